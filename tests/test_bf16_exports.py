"""bfloat16 exports through ort-cuda: Flux, SD3.5 and T5 are trained and served in bfloat16, and
their full-size exports are made directly in it.

onnx-graphsurgeon holds bfloat16 as the ONNX element type (an int: NumPy has no bfloat16), and ONNX
Runtime's CPU build, which fold-constants evaluates with, has no bfloat16 kernel for most ops.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxopt import optimize
from tests.conftest import result_of, run_passes

BF16 = np.dtype(ml_dtypes.bfloat16)


def bf16_constant_subgraph() -> onnx.ModelProto:
    """y = x + (w @ w): the MatMul reads bfloat16 constants only, which ORT's CPU build cannot run."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 4)).astype(BF16)
    w_init = helper.make_tensor("w", TensorProto.BFLOAT16, [4, 4], w.view(np.uint16).tobytes(), raw=True)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["w", "w"], ["ww"]), helper.make_node("Add", ["x", "ww"], ["y"])],
        "bf16_fold",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [4, 4])],
        [w_init],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_fold_constants_folds_a_bf16_matmul_of_constants_on_the_reference_evaluator():
    """ORT's CPU build has no bfloat16 MatMul: graphsurgeon's folder recursed without bound on it."""
    proto = bf16_constant_subgraph()
    model, report = run_passes(proto, ["fold-constants"])
    result = result_of(report, "fold-constants")
    assert result.refused == [] and result.sites_rewritten == 1
    assert [n.op for n in model.graph.nodes] == ["Add"]
    out = model.to_onnx()
    onnx.checker.check_model(out, full_check=True)
    x = np.random.default_rng(1).standard_normal((4, 4)).astype(BF16)
    (before,) = ReferenceEvaluator(proto).run(None, {"x": x})
    (after,) = ReferenceEvaluator(out).run(None, {"x": x})
    np.testing.assert_array_equal(np.asarray(before, np.float32), np.asarray(after, np.float32))


@pytest.mark.models
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_ort_cuda_takes_the_bf16_export_of_the_tiny_sd35_medium_and_verifies_in_bf16(export_tiny, exporter):
    """Before: dynamo exports crashed reading bfloat16 as a NumPy dtype, TorchScript exports
    recursed without bound in fold-constants, and --verify made no bfloat16 inputs."""
    exported = export_tiny("sd35-medium", exporter=exporter, dtype="bfloat16")
    proto = onnx.load(str(exported.path), load_external_data=False)
    assert proto.graph.input[0].type.tensor_type.elem_type == TensorProto.BFLOAT16
    _, report = optimize(exported.path, ["ort-cuda"], verify=True)
    assert report.final_verification is not None and report.final_verification.ok, report.final_verification
    assert result_of(report, "fuse-rms-norm").sites_rewritten + result_of(report, "fuse-parallel-gemm").sites_rewritten > 0
    assert result_of(report, "fuse-attention").sites_rewritten > 0
    # ORT's CPU build has no bfloat16 MatMul, and onnx.checker knows no SimplifiedLayerNormalization
    # (ORT's op in the ONNX domain): the verification above ran the result on the reference evaluator.


def test_verify_draws_bf16_inputs_and_compares_bf16_outputs(tmp_path):
    """--verify used to refuse a bfloat16 input (no random values for it)."""
    from onnxopt.cli import main

    add = helper.make_graph([helper.make_node("Add", ["x", "x"], ["out"])], "bf16_add",
                            [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 3])],
                            [helper.make_tensor_value_info("out", TensorProto.BFLOAT16, [2, 3])])
    onnx.save(helper.make_model(add, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "in.onnx")
    assert main(["optimize", "-q", "-i", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "out.onnx"), "--verify"]) == 0


@pytest.mark.models
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_the_bf16_tiny_sd35_medium_has_no_time_embedding_arithmetic_to_widen(export_tiny, exporter):
    """SD3's Timesteps casts the timestep to float32 before any arithmetic (Unsqueeze, then
    Cast(to=FLOAT)): the fp16 pass finds no Sin/Cos argument the source rounds, and runs no
    widen-periodic-arguments. (What rounds there is the bfloat16 timestep input itself: 999 is 1000.)"""
    exported = export_tiny("sd35-medium", exporter=exporter, dtype="bfloat16")
    _, report = optimize(exported.path, ["fp16"], options={"fp16": {"low_precision": "bfloat16"}})
    assert "periodic_arguments_in_low_precision" not in result_of(report, "fp16").details
    assert "widen-periodic-arguments" not in {p.name for p in report.passes}
