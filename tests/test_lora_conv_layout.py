"""An NhwcConv whose weight becomes a graph input (a LoRA changes it) runs as a Conv between Transposes.

The claims, on hand-built graphs: with its weight (or bias) fed as an input, the rewritten node
computes on ONNX Runtime's CPU EP what onnxopt's reference NhwcConv computes with the weight
constant, for stride, padding, dilation, group, auto_pad and bias variants; an NhwcConv whose
weight stays constant is left as it was. On a GPU, the CUDA EP runs the rewritten graph with no CPU
fallback and gives the same output. The SD 1.5 folder cases are in tests/test_lora.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import reference
from onnxopt.lora.session import weights_as_inputs

C_IN, M_OUT = 8, 12
VARIANTS = {
    "3x3 pad 1": dict(kernel=(3, 3), pads=[1, 1, 1, 1]),
    "stride 2, asymmetric pads": dict(kernel=(3, 3), strides=[2, 2], pads=[0, 1, 1, 0]),
    "dilation 2, stride (1, 2)": dict(kernel=(3, 3), dilations=[2, 2], strides=[1, 2], pads=[2, 2, 2, 2]),
    "group 4, no bias": dict(kernel=(3, 3), group=4, pads=[1, 1, 1, 1], bias=False),
    "depthwise": dict(kernel=(3, 3), group=C_IN, out=C_IN, pads=[1, 1, 1, 1]),
    "1x1 stride 2": dict(kernel=(1, 1), strides=[2, 2]),
    "5x3 SAME_UPPER stride 2": dict(kernel=(5, 3), strides=[2, 2], auto_pad="SAME_UPPER"),
    "auto_pad VALID": dict(kernel=(3, 3), auto_pad="VALID"),
}


def nhwc_conv_model(kernel, strides=None, pads=None, dilations=None, group=1, out=M_OUT, bias=True, auto_pad=None,
                    seed=0):
    """x (2, 9, 11, C) -> NhwcConv(W (out, kH, kW, C/group), [B]) -> Relu -> NhwcConv(W2 constant) -> y."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out, *kernel, C_IN // group), np.float32)
    w2 = rng.standard_normal((4, 1, 1, out), np.float32)
    attrs = dict(kernel_shape=list(kernel), group=group)
    attrs.update((k, v) for k, v in (("strides", strides), ("pads", pads), ("dilations", dilations),
                                     ("auto_pad", auto_pad)) if v is not None)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w2, "W2")]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(out).astype(np.float32), "B"))
    nodes = [helper.make_node("NhwcConv", ["x", "W", *(["B"] if bias else [])], ["h"], name="conv",
                              domain="com.microsoft", **attrs),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("NhwcConv", ["r", "W2"], ["y"], name="constant_conv", domain="com.microsoft",
                              kernel_shape=[1, 1])]
    graph = helper.make_graph(nodes, "nhwc", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 9, 11, C_IN])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=8)
    return model, rng.standard_normal((2, 9, 11, C_IN), np.float32)


def ops(model) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("varying", [("W",), ("W", "B")])
def test_an_nhwc_conv_with_its_weight_an_input_computes_what_nhwc_conv_computes(variant, varying):
    model, x = nhwc_conv_model(**VARIANTS[variant])
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in varying}
    expected = reference.run(model, {"x": x})["y"]
    rewritten = onnx.load_from_string(weights_as_inputs(model, set(weights)))
    # only the node reading an input weight changed: the second conv keeps its constant weight and layout
    assert ops(rewritten) == ["Transpose", "Transpose", "Conv", "Transpose", "Relu", "NhwcConv"]
    assert rewritten.graph.node[-1] == model.graph.node[-1]
    conv = rewritten.graph.node[2]
    assert {a.name: a for a in conv.attribute} == {a.name: a for a in model.graph.node[0].attribute}
    assert weights["W"].shape == tuple(d.dim_value for d in
                                       next(i for i in rewritten.graph.input if i.name == "W").type.tensor_type.shape.dim)
    # the second (constant) NhwcConv has no CPU kernel: run the rewritten conv alone on ORT's CPU EP
    del rewritten.graph.node[4:]
    rewritten.graph.output[0].name = "h"
    plain = onnx.load_from_string(weights_as_inputs(model, set()))
    del plain.graph.node[1:]
    plain.graph.output[0].name = "h"
    got = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, **weights})[0]
    want = reference.run(plain, {"x": x})["h"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # and the whole graph, reference kernels for the constant NhwcConv
    full = onnx.load_from_string(weights_as_inputs(model, set(weights)))
    np.testing.assert_allclose(reference.run(full, {"x": x, **weights})["y"], expected, rtol=0,
                               atol=1e-5 * np.abs(expected).max())


def test_no_nhwc_conv_changes_when_no_weight_of_it_is_an_input():
    model, _ = nhwc_conv_model((3, 3), pads=[1, 1, 1, 1])
    extra = numpy_helper.from_array(np.ones(M_OUT, np.float32), "unrelated")
    model.graph.initializer.append(extra)
    rewritten = onnx.load_from_string(weights_as_inputs(model, {"unrelated"}))
    assert list(rewritten.graph.node) == list(model.graph.node)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_cuda_ep_runs_the_rewritten_graph_with_no_cpu_fallback(variant):
    """On a GPU (``pytest -m gpu``): ONNX Runtime's CUDA EP takes the rewritten graph whole (it refuses
    an NhwcConv whose weight is an input) and computes the reference NhwcConv's output (TF32 off)."""
    from onnxopt.runners import cuda_available

    if not cuda_available():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")
    model, x = nhwc_conv_model(**VARIANTS[variant])
    weights = {"W": numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "W"))}
    expected = reference.run(model, {"x": x})["y"]
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    session = ort.InferenceSession(weights_as_inputs(model, set(weights)), options,
                                   providers=[("CUDAExecutionProvider", {"use_tf32": "0"})])
    got = session.run(None, {"x": x, **weights})[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
