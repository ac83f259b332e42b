"""Claims about low precision for the diffusion-transformer fusions (bfloat16 beside float16):

* ``--low-precision bfloat16`` with ``ort-cuda`` keeps SimplifiedLayerNormalization and FastGelu in
  bfloat16 (ONNX Runtime's CUDA EP has bfloat16 kernels for both, and for
  SkipSimplifiedLayerNormalization), and ``--verify`` proves the result in bfloat16 arithmetic;
* the typing of SimplifiedLayerNormalization (ONNX domain, ORT's op) is ORT's own schema;
* in float16, a gated feed-forward's output projection (T5's ``wo``) and the residual stream after
  it stay float32 by pattern; in bfloat16 they do not (bfloat16 has float32's range). Where the
  pattern does not apply, ``--fp32-auto`` calibration keeps an overflowing tensor's nodes float32,
  and without either float16 verification fails on the overflow.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import optimize
from onnxopt.cli import main
from onnxopt.passes.fp16 import Fp16Pass
from onnxopt.precision import ORT_ONNX_DOMAIN_SIGNATURES, ort_signatures
from tests.conftest import result_of

FLOAT = TensorProto.FLOAT
D, FF = 8, 16


def test_the_onnx_domain_signatures_match_the_onnxruntime_registry():
    registry = ort_signatures("")
    if not registry:
        pytest.skip("onnxruntime is not installed")
    for name, sig in ORT_ONNX_DOMAIN_SIGNATURES.items():
        theirs = registry[name]
        assert (sig.inputs, sig.outputs, sig.allowed) == (theirs.inputs, theirs.outputs, theirs.allowed), name


def _t5_block(scale: float = 0.3, seed: int = 0):
    """x -> RMSNorm -> gelu_new(h W0) * (h W1) -> W_o -> + x -> RMSNorm -> y, as transformers' T5 writes it."""
    rng = np.random.default_rng(seed)
    k = float(np.sqrt(2 / np.pi))
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["v"]), helper.make_node("Sqrt", ["v"], ["r"]),
        helper.make_node("Div", ["one", "r"], ["inv"]), helper.make_node("Mul", ["x", "inv"], ["n0"]),
        helper.make_node("Mul", ["ln_w", "n0"], ["h"]),
        helper.make_node("MatMul", ["h", "w0"], ["a"]), helper.make_node("MatMul", ["h", "w1"], ["b"]),
        # gelu_new(a) = (a * 0.5) * (1 + tanh((a + a^3 * 0.044715) * k))
        helper.make_node("Mul", ["a", "half"], ["a_half"]), helper.make_node("Pow", ["a", "three"], ["a3"]),
        helper.make_node("Mul", ["a3", "c"], ["ca3"]), helper.make_node("Add", ["a", "ca3"], ["inner"]),
        helper.make_node("Mul", ["inner", "k"], ["scaled"]), helper.make_node("Tanh", ["scaled"], ["t"]),
        helper.make_node("Add", ["t", "one"], ["t1"]), helper.make_node("Mul", ["a_half", "t1"], ["g"]),
        helper.make_node("Mul", ["g", "b"], ["gated"]), helper.make_node("MatMul", ["gated", "wo"], ["f"]),
        helper.make_node("Add", ["x", "f"], ["s"]),
        helper.make_node("Pow", ["s", "two"], ["sq2"]), helper.make_node("ReduceMean", ["sq2"], ["ms2"], axes=[-1], keepdims=1),
        helper.make_node("Add", ["ms2", "eps"], ["v2"]), helper.make_node("Sqrt", ["v2"], ["r2"]),
        helper.make_node("Div", ["one", "r2"], ["inv2"]), helper.make_node("Mul", ["s", "inv2"], ["n2"]),
        helper.make_node("Mul", ["ln_w", "n2"], ["y"]),
    ]
    inits = {"two": 2.0, "three": 3.0, "eps": 1e-6, "one": 1.0, "half": 0.5, "c": 0.044715, "k": k,
             "ln_w": 1 + 0.1 * rng.standard_normal(D), "w0": rng.standard_normal((D, FF)) * scale,
             "w1": rng.standard_normal((D, FF)) * scale, "wo": rng.standard_normal((FF, D)) * scale}
    graph = helper.make_graph(nodes, "t5", [helper.make_tensor_value_info("x", FLOAT, [2, 4, D])],
                              [helper.make_tensor_value_info("y", FLOAT, None), helper.make_tensor_value_info("s", FLOAT, None)],
                              [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_the_t5_block_fused_for_ort_cuda_runs_in_low_precision_and_verifies(tmp_path, low):
    source = tmp_path / "t5.onnx"
    source.write_bytes(_t5_block().SerializeToString())
    out = tmp_path / "t5.opt.onnx"
    code = main(["optimize", "-i", str(source), "-o", str(out), "--passes", "ort-cuda,fp16", "--low-precision", low, "--verify"])
    assert code == 0
    import onnx

    proto = onnx.load(out)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*proto.graph.value_info, *proto.graph.output]}
    low_type = TensorProto.BFLOAT16 if low == "bfloat16" else TensorProto.FLOAT16
    ops = {n.op_type: n for n in proto.graph.node}
    assert {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "FastGelu"} <= set(ops)
    assert types[ops["FastGelu"].output[0]] == low_type
    assert types[ops["SimplifiedLayerNormalization"].output[0]] == low_type
    # float16 keeps the output projection and the residual norm float32; bfloat16 keeps nothing
    skip_type = types[ops["SkipSimplifiedLayerNormalization"].output[0]]
    assert skip_type == (TensorProto.FLOAT if low == "float16" else low_type)


def test_bf16_flag_is_the_fp16_pass_at_bfloat16(tmp_path):
    """``optimize --bf16`` (the flag the DiT folders are documented with) writes what ``--fp16
    --low-precision bfloat16`` writes, byte for byte."""
    source = tmp_path / "t5.onnx"
    source.write_bytes(_t5_block().SerializeToString())
    outs = {}
    for name, flags in (("flag", ["--bf16"]), ("spelled", ["--fp16", "--low-precision", "bfloat16"])):
        outs[name] = tmp_path / f"{name}.onnx"
        assert main(["optimize", "-q", "-i", str(source), "-o", str(outs[name]), "--target", "ort-cuda", *flags]) == 0
    assert outs["flag"].read_bytes() == outs["spelled"].read_bytes()
    import onnx

    types = {i.data_type for i in onnx.load(outs["flag"]).graph.initializer}
    assert TensorProto.BFLOAT16 in types and TensorProto.FLOAT16 not in types


def test_the_gated_ffn_rule_keeps_the_output_projection_and_the_residual_in_float32_only_in_float16():
    """On the unfused graph: the wo MatMul and the residual Add (the rule follows sums and fused norms,
    not a decomposed norm's Pow)."""
    for low, expected in (("float16", 2), ("bfloat16", 0)):
        _, report = optimize(_t5_block(), ["cleanup", Fp16Pass(low_precision=low)])
        kinds = result_of(report, "fp16").details["fp32_by_kind"]
        assert kinds.get("gated-ffn", 0) == expected, (low, kinds)


def test_fp32_auto_calibration_keeps_an_overflowing_feed_forward_in_float32():
    """Large weights make the gated product overflow float16: without any float32 node the float16
    model computes inf and verification fails; --fp32-auto finds the tensors on calibration inputs."""
    big = _t5_block(scale=40.0)
    plain = Fp16Pass(low_precision="float16", fp32_periodic=False)
    _, report = optimize(big, ["cleanup", plain], verify=True)
    assert report.first_broken_pass == "fp16"
    _, report = optimize(big, ["cleanup", Fp16Pass(low_precision="float16", fp32_auto=True)], verify=True)
    assert report.first_broken_pass is None and report.final_verification.ok, report.table()
    assert result_of(report, "fp16").details["fp32_by_kind"].get("calibration", 0) > 0


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_a_fused_op_without_a_bfloat16_kernel_stays_float32_and_is_reported(low):
    """com.microsoft BiasAdd (SD's residual bias) has float32 and float16 CUDA kernels only (ONNX
    Runtime 1.31: contrib_ops/cuda/diffusion/bias_add.cc): in bfloat16 it computes in float32, and
    the report says why; in float16 it converts."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("BiasAdd", ["x", "bias", "skip"], ["y"], domain="com.microsoft")], "bias_add",
        [helper.make_tensor_value_info("x", FLOAT, [2, 4, D]), helper.make_tensor_value_info("skip", FLOAT, [2, 4, D])],
        [helper.make_tensor_value_info("y", FLOAT, [2, 4, D])],
        [numpy_helper.from_array(rng.standard_normal(D).astype(np.float32), "bias")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model, report = optimize(proto, [Fp16Pass(low_precision=low)])
    [bias_add] = [n for n in model.graph.nodes if n.op == "BiasAdd"]
    kept = result_of(report, "fp16").details["fp32_nodes"]
    if low == "bfloat16":
        assert np.dtype(bias_add.inputs[0].dtype) == np.float32
        assert "no bfloat16 kernel for com.microsoft BiasAdd" in next(iter(kept.values())), kept
    else:
        assert np.dtype(bias_add.inputs[0].dtype) == np.float16 and not kept
