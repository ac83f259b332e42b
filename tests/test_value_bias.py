"""Claims about fold-value-bias (ort-cuda): a self-attention's V bias moves past MultiHeadAttention
(softmax rows sum to 1) into the output projection's bias.

* hand-built, on ORT CPU against the source (it has an unpacked MultiHeadAttention kernel): the
  output-projection form (SD3.5's attn2) and the Concat form (Flux's single block,
  ``proj_out(cat([attn, mlp], dim=-1))``): the V bias Add is gone, MultiHeadAttention reads the V
  projection's product, the output bias is b_o + b_v @ W_o[:D], and the outputs match;
* lookalikes: a key padding mask (a row of P may be all zero), attention read elsewhere, a Concat
  along the sequence, o second in the Concat, a per-token constant added to V;
* the committed tiny SD3.5-Medium (one attn2) and Flux.1-dev (two single blocks) exports, both
  exporters: every self-attention's V bias folds, no joint attention's, and the graph computes
  what the export computes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxopt import load_model, optimize
from onnxopt.pattern import constant_value
from onnxopt.verify import InputSpec, assert_same_computation
from tests.conftest import op_counts, result_of
from tests.test_ffn_fusions import Net, weights

PASS = "fold-value-bias"
D, HEADS, D_IN, N, D_MLP = 8, 2, 6, 5, 12


def attention_net(form: str = "projection", *, v_bias_shape=(D,), mask: bool = False, attention_read: bool = False,
                  concat_axis: int = -1, attention_second: bool = False):
    net = Net()
    x = net.input("x", [2, 7, D_IN])
    q, k = (net.op("MatMul", x, net.const(weights(D_IN, D))) for _ in range(2))
    v = net.op("Add", net.op("MatMul", x, net.const(weights(D_IN, D))), net.const(weights(*v_bias_shape)))
    inputs = [q, k, v]
    if mask:
        inputs += ["", net.input("mask", [2, 7], TensorProto.INT32)]
    o = net.op("MultiHeadAttention", *inputs, domain="com.microsoft", num_heads=HEADS)
    if form == "projection":
        projected, rows = o, D
    else:
        m = net.op("Relu", net.op("MatMul", x, net.const(weights(D_IN, D_MLP))))
        if concat_axis != -1:
            m = net.op("MatMul", x, net.const(weights(D_IN, D)))
        projected = net.op("Concat", *((m, o) if attention_second else (o, m)), axis=concat_axis)
        rows = D if concat_axis != -1 else D + D_MLP
    y = net.op("Add", net.op("MatMul", projected, net.const(weights(rows, N))), net.const(weights(N)))
    outputs = [y] + ([net.op("Sigmoid", o)] if attention_read else [])
    proto = net.model(*outputs)
    proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return proto


def fuse(proto):
    model, report = optimize(proto, [PASS])
    return model, result_of(report, PASS)


def value_bias_adds(model) -> int:
    """Add nodes that MultiHeadAttention reads as its value."""
    return sum(1 for n in model.graph.nodes if n.op == "MultiHeadAttention" and n.inputs[2].inputs
               and n.inputs[2].inputs[0].op == "Add")


@pytest.mark.parametrize("form", ["projection", "concat"])
def test_a_self_attentions_value_bias_folds_into_the_output_projections_bias(form):
    proto = attention_net(form)
    model, result = fuse(proto)
    assert (result.sites_matched, result.sites_rewritten) == (1, 1) and result.details["joined"] == (form == "concat")
    assert value_bias_adds(model) == 0 and op_counts(model)["Add"] == 1
    (mha,) = [n for n in model.graph.nodes if n.op == "MultiHeadAttention"]
    assert mha.inputs[2].inputs[0].op == "MatMul"
    source = load_model(proto)
    b_v = next(constant_value(t) for n in source.graph.nodes if n.op == "Add" and n.outputs[0] is not None
               for t in n.inputs if t.inputs == [] and constant_value(t) is not None and constant_value(t).shape == (D,))
    (out_bias,) = [n for n in model.graph.nodes if n.op == "Add"]
    (out_proj,) = [n for n in model.graph.nodes if n.op == "MatMul" and n.outputs[0] is out_bias.inputs[0]]
    w_o = constant_value(out_proj.inputs[1])
    folded = constant_value(out_bias.inputs[1])
    original = next(constant_value(t) for n in source.graph.nodes if n.op == "Add" for t in n.inputs
                    if constant_value(t) is not None and constant_value(t).shape == (N,))
    np.testing.assert_allclose(folded, original + b_v @ w_o[:D], rtol=1e-6, atol=1e-6)
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-4)


LOOKALIKES = {
    "mask": dict(mask=True),
    "attention-read-elsewhere": dict(attention_read=True),
    "attention-second-in-concat": dict(form="concat", attention_second=True),
}


@pytest.mark.parametrize("kind", list(LOOKALIKES))
def test_a_lookalike_is_no_site(kind):
    proto = attention_net(**LOOKALIKES[kind])
    model, result = fuse(proto)
    assert result.sites_matched == 0 and value_bias_adds(model) == 1
    assert op_counts(model) == op_counts(load_model(proto))


@pytest.mark.parametrize("kind, reason", [
    ("concat-along-sequence", "the Concat does not join the last axis: the bias would not stay per column"),
    ("per-token-value-constant", "the constant added to V has shape [7, 8]; a bias is (8,)"),
])
def test_a_lookalike_is_refused_with_its_reason(kind, reason):
    proto = (attention_net("concat", concat_axis=1) if kind == "concat-along-sequence"
             else attention_net(v_bias_shape=(7, D)))
    model, result = fuse(proto)
    assert (result.sites_matched, result.sites_rewritten) == (1, 0)
    assert result.refused[0][1] == reason
    assert value_bias_adds(model) == 1


DIT_FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "dit"
FIXTURES = {  # file: self-attentions (SD3.5: attn2 of each dual-attention layer; Flux: one per single block)
    "sd35-medium.tiny.dynamo.dynamic.sdpa.onnx": 1, "sd35-medium.tiny.torchscript.dynamic.sdpa.onnx": 1,
    "flux-dev.tiny.dynamo.dynamic.sdpa.onnx": 2, "flux-dev.tiny.torchscript.dynamic.sdpa.onnx": 2,
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if "dynamo" in n else [pytest.mark.slow]) for n in FIXTURES])
def test_every_self_attentions_value_bias_of_sd35_and_flux_folds(name):
    entry = next(e for e in json.loads((DIT_FIXTURES / "manifest.json").read_text())["fixtures"] if e["file"] == name)
    inputs = InputSpec(shapes={i["name"]: tuple(i["example_shape"]) for i in entry["inputs"]})
    model, report = optimize(str(DIT_FIXTURES / name), ["ort-cuda"], inputs=inputs)
    result = result_of(report, PASS)
    assert result.sites_rewritten == FIXTURES[name] == entry["sites"]["attention"] - entry["sites"]["attention_joint"]
    assert value_bias_adds(model) == 0  # joint attention reads a Concat (two streams, two biases)
    assert_same_computation(str(DIT_FIXTURES / name), model, inputs=inputs, atol=1e-4, rtol=1e-3)
