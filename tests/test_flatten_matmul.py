"""Claims about flatten-matmul (opt-in): a MatMul of a rank >= 3 input by a constant 2-D weight as
Reshape to (M, K), one 2-D MatMul, Reshape back.

* Static and dynamic leading dims, rank 3 and 4: the rewrite computes the same outputs; the shape
  back is a constant (with -1 for one unknown dim) where that is exact, else Concat(Shape(x), [N]).
* Lookalikes are left alone: a MatMul already 2-D (not a site), a weight that is not a constant, a
  batched (3-D) weight, each refused with its reason.
* What reads the product keeps reading the same tensor: a bias Add and a FastGelu after it.
* On the tiny SD3.5-Medium and Flux.1-dev fixtures after ``ort-cuda,fp16`` (both exporters): every
  MatMul by a constant 2-D weight of a rank >= 3 input is rewritten, no other op changes, and the
  outputs match (fp16, onnxopt's reference kernels for the com.microsoft ops on CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import optimize
from onnxopt.domains import MS_DOMAIN
from onnxopt.pattern import is_constant
from onnxopt.verify import InputSpec, assert_same_computation
from tests.conftest import op_counts, result_of

RNG = np.random.default_rng(7)
K, N = 16, 12


def linear_model(x_dims, w_shape=(K, N), weight_is_input=False, after=None, opset=17):
    """y = x @ W (+ whatever ``after`` appends to it: "bias" an Add, "fast_gelu" a com.microsoft FastGelu)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = RNG.standard_normal(w_shape).astype(np.float32)
    inputs, inits = [x], [numpy_helper.from_array(w, "W")]
    if weight_is_input:
        inputs, inits = [x, helper.make_tensor_value_info("W", TensorProto.FLOAT, list(w_shape))], []
    nodes = [helper.make_node("MatMul", ["x", "W"], ["p" if after else "y"], name="proj")]
    if after:
        inits.append(numpy_helper.from_array(RNG.standard_normal(w_shape[-1]).astype(np.float32), "bias"))
        nodes.append(helper.make_node("Add", ["p", "bias"], ["y"], name="bias_add") if after == "bias" else
                     helper.make_node("FastGelu", ["p", "bias"], ["y"], name="gelu", domain=MS_DOMAIN))
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)]
    graph = helper.make_graph(nodes, "linear", inputs, [y], inits)
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def concrete(dims) -> InputSpec:
    return InputSpec(shapes={"x": tuple(d if isinstance(d, int) else 3 for d in dims)})


def flatten(model, inputs):
    out, report = optimize(model, ["flatten-matmul"], inputs=inputs)
    return out, result_of(report, "flatten-matmul")


@pytest.mark.parametrize("x_dims,runtime_shape", [
    ([2, 5, K], False), (["batch", 5, K], False), (["batch", "seq", K], True),
    ([2, 3, 5, K], False), (["b", 3, "s", K], True)],
    ids=["static-rank3", "dynamic-batch", "dynamic-batch-and-seq", "static-rank4", "dynamic-rank4"])
def test_a_linear_on_a_batched_input_becomes_one_2d_gemm_and_computes_the_same(x_dims, runtime_shape):
    source = linear_model(x_dims)
    model, result = flatten(source, concrete(x_dims))
    assert (result.sites_matched, result.sites_rewritten, result.refused) == (1, 1, [])
    ops = op_counts(model)
    assert (ops["Reshape"], ops["MatMul"]) == (2, 1), ops
    assert (ops["Shape"], ops["Concat"]) == ((1, 1) if runtime_shape else (0, 0)), ops
    matmul = next(n for n in model.graph.nodes if n.op == "MatMul")
    assert len(matmul.inputs[0].shape) == 2 and matmul.inputs[0].shape[-1] == K
    assert_same_computation(source, model, inputs=concrete(x_dims), atol=1e-5, rtol=1e-5)
    for other in ([1, 7, 2, K][-len(x_dims):],):  # another size of the dynamic dims
        if any(not isinstance(d, int) for d in x_dims):
            spec = InputSpec(shapes={"x": tuple(d if isinstance(d, int) else o for d, o in zip(x_dims, other))})
            assert_same_computation(source, model, inputs=spec, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("after", ["bias", "fast_gelu"])
def test_what_reads_the_product_keeps_reading_the_same_tensor(after):
    source = linear_model(["batch", 6, K], after=after)
    model, result = flatten(source, concrete(["batch", 6, K]))
    assert result.sites_rewritten == 1
    reader = next(n for n in model.graph.nodes if n.op in ("Add", "FastGelu"))
    assert reader.inputs[0].inputs[0].op == "Reshape"  # the 3-D tensor, restored
    assert_same_computation(source, model, inputs=concrete(["batch", 6, K]), atol=1e-5, rtol=1e-5)


def test_a_matmul_already_2d_is_not_a_site():
    model, result = flatten(linear_model([7, K]), None)
    assert (result.sites_matched, result.sites_rewritten, result.refused) == (0, 0, [])
    assert op_counts(model) == {"MatMul": 1}


@pytest.mark.parametrize("kwargs,reason", [
    ({"weight_is_input": True}, "not a constant"),
    ({"w_shape": (2, K, N)}, "not (K, N)"),
], ids=["weight-not-constant", "batched-weight"])
def test_lookalikes_are_refused_with_the_reason(kwargs, reason):
    source = linear_model([2, 5, K], **kwargs)
    model, result = flatten(source, None)
    assert result.sites_rewritten == 0 and len(result.refused) == 1 and reason in result.refused[0][1], result.refused
    assert op_counts(model) == {"MatMul": 1}


def test_two_unknown_leading_dims_need_opset_15():
    model, result = flatten(linear_model(["b", "s", K], opset=13), None)
    assert result.sites_rewritten == 0 and "opset" in result.refused[0][1], result.refused


# ================================================================ the committed DiT fixtures (models/fixtures/dit)

DIT_FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "dit"


def _dit_fixtures() -> list:
    manifest = DIT_FIXTURES / "manifest.json"
    if not manifest.exists():
        return []
    entries = [e for e in json.loads(manifest.read_text())["fixtures"] if e["file"].startswith(("sd35", "flux"))]
    return [pytest.param(e, id=e["file"], marks=[pytest.mark.slow] if "torchscript" in e["file"] else []) for e in entries]


def _linears(model) -> int:
    """MatMuls by a constant 2-D weight of an input of rank >= 3."""
    return sum(1 for n in model.graph.nodes if n.op == "MatMul" and is_constant(n.inputs[1])
               and len(n.inputs[1].shape) == 2 and n.inputs[0].shape is not None and len(n.inputs[0].shape) >= 3)


@pytest.mark.parametrize("entry", _dit_fixtures())
def test_every_linear_of_the_fused_fp16_dit_fixtures_becomes_a_2d_gemm(entry):
    """SD3.5-Medium and Flux.1-dev (tiny) after ort-cuda,fp16: every Linear left as a MatMul is rewritten,
    the fused ops around them are unchanged, and the outputs match."""
    inputs = InputSpec(shapes={i["name"]: tuple(i["example_shape"]) for i in entry["inputs"]})
    fused, _ = optimize(str(DIT_FIXTURES / entry["file"]), ["ort-cuda", "fp16"], inputs=inputs)
    linears, before = _linears(fused), op_counts(fused)
    assert linears > 0
    flat, report = optimize(fused, ["flatten-matmul"], inputs=inputs)
    result = result_of(report, "flatten-matmul")
    assert result.sites_rewritten == linears and _linears(flat) == 0, result.refused
    after = op_counts(flat)
    assert after["Reshape"] - before["Reshape"] == 2 * linears and after["MatMul"] == before["MatMul"]
    assert {op: n for op, n in after.items() if op not in ("Reshape", "Shape", "Concat")} == \
           {op: n for op, n in before.items() if op not in ("Reshape", "Shape", "Concat")}
    assert_same_computation(fused, flat, inputs=inputs, atol=1e-3, rtol=1e-3)


def test_an_unknown_last_dim_of_x_is_the_weights_k():
    """TorchScript exports lose some inner dims to shape inference; MatMul itself requires x's last dim = K."""
    source = linear_model(["batch", 5, "k"])
    model, result = flatten(source, None)
    assert result.sites_rewritten == 1, result.refused
    assert_same_computation(source, model, inputs=InputSpec(shapes={"x": (2, 5, K)}), atol=1e-5, rtol=1e-5)


def test_a_static_last_dim_other_than_k_is_refused():
    model, result = flatten(linear_model([2, 5, K + 1]), None)
    assert result.sites_rewritten == 0 and "not the weight's K" in result.refused[0][1], result.refused


# ================================================================ on a GPU (-m gpu)


def _gpu_only(test):
    from onnxopt.runners import cuda_available

    skip = pytest.mark.skipif(not cuda_available(), reason="needs onnxruntime-gpu and a CUDA device")
    return pytest.mark.gpu(skip(test))


@pytest.mark.parametrize("entry", [e for e in _dit_fixtures() if "dynamo" in e.id])
@_gpu_only
def test_gpu_the_flattened_dit_fixtures_run_under_a_cuda_graph_and_match_the_fused_graph(entry, tmp_path):
    """The Shape/Concat of the dynamic shape back do not stop the capture; the 2-D GEMMs give the
    3-D MatMuls' outputs up to fp16 accumulation order."""
    from onnxopt.runners.ort_cuda import OrtCudaSession
    from onnxopt.saving import save_model
    from onnxopt.verify import random_feeds

    entry = entry.values[0]
    inputs = InputSpec(shapes={i["name"]: tuple(i["example_shape"]) for i in entry["inputs"]})
    fused, _ = optimize(str(DIT_FIXTURES / entry["file"]), ["ort-cuda", "fp16"], inputs=inputs)
    flat, _ = optimize(fused, ["flatten-matmul"], inputs=inputs)
    feeds = random_feeds(fused, inputs)[0]
    outputs = []
    for name, model in (("fused", fused), ("flat", flat)):
        save_model(model, tmp_path / f"{name}.onnx")
        session = OrtCudaSession(str(tmp_path / f"{name}.onnx"), cuda_graph=True)
        session.bind(feeds)
        session.run()  # the capture
        session.run()
        outputs.append(next(iter(session.outputs().values())).astype(np.float32))
    np.testing.assert_allclose(outputs[1], outputs[0], atol=1e-2, rtol=1e-2)
