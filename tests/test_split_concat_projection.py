"""Claims about split-concat-projection (ort-cuda): a Linear of a feature Concat as the sum of two
Linears with the weight's row blocks, the bias added to the sum (not a BiasAdd site: ORT's BiasAdd
has no bfloat16 kernel).

* hand-built, against the source (ORT CPU): the Concat is gone, two MatMuls read a and m with
  W[:Da] and W[Da:], the outputs match; fuse-bias-add leaves the sum alone;
* lookalikes: a Concat along the sequence (refused with its reason), a Concat read elsewhere, three
  pieces (no site);
* the committed tiny Flux.1-dev exports (both exporters): each single block's proj_out is split,
  no BiasAdd is written, the graph computes what the export computes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from onnxopt import load_model, optimize
from onnxopt.pattern import constant_value
from onnxopt.verify import InputSpec, assert_same_computation
from tests.conftest import op_counts, result_of
from tests.test_ffn_fusions import Net, weights

PASS = "split-concat-projection"
DA, DM, N = 8, 12, 5


def joined_projection(*, axis: int = -1, concat_read: bool = False, pieces: int = 2):
    net = Net()
    x = net.input("x", [2, 7, 6])
    a = net.op("Relu", net.op("MatMul", x, net.const(weights(6, DA))))
    m = net.op("Sigmoid", net.op("MatMul", x, net.const(weights(6, DM if axis == -1 else DA))))
    parts = [a, m] + [net.op("Tanh", x)] * (pieces - 2)
    rows = DA + DM + 6 * (pieces - 2) if axis == -1 else DA
    joined = net.op("Concat", *parts, axis=axis)
    y = net.op("Add", net.op("MatMul", joined, net.const(weights(rows, N))), net.const(weights(N)))
    return net.model(y, *([net.op("Exp", joined)] if concat_read else []))


def test_a_linear_of_a_feature_concat_is_the_sum_of_two_linears():
    proto = joined_projection()
    model, report = optimize(proto, [PASS])
    result = result_of(report, PASS)
    assert (result.sites_matched, result.sites_rewritten) == (1, 1)
    assert op_counts(model)["Concat"] == 0 and op_counts(model)["MatMul"] == 4
    source_w = next(constant_value(n.inputs[1]) for n in load_model(proto).graph.nodes
                    if n.op == "MatMul" and n.inputs[0].inputs and n.inputs[0].inputs[0].op == "Concat")
    halves = {constant_value(n.inputs[1]).shape[0]: constant_value(n.inputs[1]) for n in model.graph.nodes
              if n.op == "MatMul" and n.inputs[0].inputs and n.inputs[0].inputs[0].op in ("Relu", "Sigmoid")}
    np.testing.assert_array_equal(halves[DA], source_w[:DA])
    np.testing.assert_array_equal(halves[DM], source_w[DA:])
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-4)


def test_the_bias_is_added_to_the_sum_which_fuse_bias_add_leaves_alone():
    proto = joined_projection()
    model, report = optimize(proto, [PASS, "fuse-bias-add"])
    assert result_of(report, "fuse-bias-add").sites_matched == 0
    (bias_add,) = [n for n in model.graph.nodes if n.op == "Add" and any(constant_value(t) is not None for t in n.inputs)]
    total = next(t for t in bias_add.inputs if constant_value(t) is None).inputs[0]
    assert total.op == "Add" and {t.inputs[0].op for t in total.inputs} == {"MatMul"}
    assert op_counts(model)["BiasAdd"] == 0
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-4)


def test_a_concat_along_the_sequence_is_refused_with_its_reason():
    model, report = optimize(joined_projection(axis=1), [PASS])
    result = result_of(report, PASS)
    assert (result.sites_matched, result.sites_rewritten) == (1, 0)
    assert result.refused[0][1] == "the Concat joins axis 1, not the features (the last axis)"
    assert op_counts(model)["Concat"] == 1


@pytest.mark.parametrize("kind", ["concat-read-elsewhere", "three-pieces"])
def test_a_lookalike_is_no_site(kind):
    proto = joined_projection(concat_read=True) if kind == "concat-read-elsewhere" else joined_projection(pieces=3)
    model, report = optimize(proto, [PASS])
    assert result_of(report, PASS).sites_matched == 0
    assert op_counts(model) == op_counts(load_model(proto))


DIT_FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "dit"


@pytest.mark.parametrize("name", ["flux-dev.tiny.dynamo.dynamic.sdpa.onnx",
                                  pytest.param("flux-dev.tiny.torchscript.dynamic.sdpa.onnx", marks=pytest.mark.slow)])
def test_each_flux_single_blocks_proj_out_is_split(name):
    entry = next(e for e in json.loads((DIT_FIXTURES / "manifest.json").read_text())["fixtures"] if e["file"] == name)
    inputs = InputSpec(shapes={i["name"]: tuple(i["example_shape"]) for i in entry["inputs"]})
    model, report = optimize(str(DIT_FIXTURES / name), ["ort-cuda"], inputs=inputs)
    singles = entry["config"]["num_single_layers"]
    assert result_of(report, PASS).sites_rewritten == singles == 2
    assert op_counts(model)["BiasAdd"] == 0
    assert_same_computation(str(DIT_FIXTURES / name), model, inputs=inputs, atol=1e-4, rtol=1e-3)
