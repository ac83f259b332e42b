"""Claims about remove-slice-concat (cleanup): a Concat of consecutive Slices of one tensor that cover
its axis is that tensor.

* hand-built, on ORT CPU against the source: the text/image split and re-join of Flux's single
  blocks, the split index computed at run time twice (TorchScript's Unsqueeze(Gather(Shape(..))) per
  Slice) or once (dynamo), or a constant; three pieces; the Slices read elsewhere too stay for
  those readers;
* lookalikes left alone, each with its reason: a swap of halves (the time embedding's
  flip_sin_to_cos), a gap, an end short of the axis, a step of 2, a cut along another axis, pieces
  of two tensors; a Concat that is a graph output is refused;
* the committed tiny Flux.1-dev exports (both exporters): the one boundary between its two single
  blocks goes, and the graph computes what the export computes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from onnxopt import load_model, optimize
from onnxopt.verify import InputSpec, assert_same_computation
from onnxopt.passes.slice_concat import _covered_source
from tests.conftest import op_counts, result_of
from tests.test_ffn_fusions import Net

END = 2**63 - 1


def split_rejoin(kind: str = "computed-twice", *, graph_output: bool = False):
    """x (B, S, 8): y = Relu(Concat(x[:, :e], x[:, e:])) with e the text length, as Flux's single block."""
    net = Net()
    x = net.input("x", ["batch", "seq", 8])
    text = net.input("text", ["batch", "text_len", 8])
    starts_0, to_end, axis, step = net.ints(0), net.ints(END), net.ints(1), net.ints(1)
    steps = [step]
    if kind in ("computed-twice", "computed-once"):
        length = net.op("Gather", net.op("Shape", text), net.const(np.array(1, np.int64), np.int64), axis=0)
        e1 = net.op("Unsqueeze", length, net.ints(0))
        e2 = net.op("Unsqueeze", length, net.ints(0)) if kind == "computed-twice" else e1
        pieces = [(starts_0, e1), (e2, to_end)]
    elif kind == "constant":
        pieces = [(starts_0, net.ints(3)), (net.ints(3), to_end)]
    elif kind == "three":
        pieces = [(starts_0, net.ints(2)), (net.ints(2), net.ints(5)), (net.ints(5), to_end)]
    elif kind == "swap":
        pieces = [(net.ints(3), to_end), (starts_0, net.ints(3))]
    elif kind == "gap":
        pieces = [(starts_0, net.ints(3)), (net.ints(4), to_end)]
    elif kind == "short":
        pieces = [(starts_0, net.ints(3)), (net.ints(3), net.ints(6))]
    elif kind == "step-2":
        pieces, steps = [(starts_0, net.ints(3)), (net.ints(3), to_end)], [net.ints(2)]
    elif kind == "other-axis":
        pieces, axis = [(starts_0, net.ints(3)), (net.ints(3), to_end)], net.ints(2)
    elif kind == "two-tensors":
        pieces = [(starts_0, net.ints(3)), (net.ints(3), to_end)]
    else:
        raise ValueError(kind)
    sources = [x, text] if kind == "two-tensors" else [x, x]
    sources += [x] * (len(pieces) - len(sources))
    slices = [net.op("Slice", src, s, e, axis, *steps) for src, (s, e) in zip(sources, pieces)]
    joined = net.op("Concat", *slices, axis=1)
    return net.model(joined if graph_output else net.op("Relu", joined))


@pytest.mark.parametrize("kind", ["computed-twice", "computed-once", "constant", "three"])
def test_consecutive_slices_covering_the_axis_rejoined_are_the_tensor(kind):
    proto = split_rejoin(kind)
    model, report = optimize(proto, ["remove-slice-concat"])
    result = result_of(report, "remove-slice-concat")
    assert (result.sites_matched, result.sites_rewritten) == (1, 1)
    assert op_counts(model)["Concat"] == 0 and op_counts(model)["Slice"] == 0
    (relu,) = [n for n in model.graph.nodes if n.op == "Relu"]
    assert relu.inputs[0].name == "x"
    inputs = InputSpec(shapes={"x": (2, 7, 8), "text": (2, 3, 8)})
    assert_same_computation(proto, model, inputs=inputs, atol=0, rtol=0)


def test_a_slice_read_elsewhere_stays_for_that_reader():
    net = Net()
    x = net.input("x", [2, 7, 8])
    head = net.op("Slice", x, net.ints(0), net.ints(3), net.ints(1))
    tail = net.op("Slice", x, net.ints(3), net.ints(END), net.ints(1))
    proto = net.model(net.op("Relu", net.op("Concat", head, tail, axis=1)), net.op("Sigmoid", head))
    model, _ = optimize(proto, ["remove-slice-concat"])
    assert op_counts(model)["Concat"] == 0 and op_counts(model)["Slice"] == 1
    assert_same_computation(proto, model, atol=0, rtol=0)


LOOKALIKES = {
    "swap": "the first Slice does not start at 0",
    "gap": "Slice '{1}' does not start where '{0}' ends",
    "short": "the last Slice does not run to the end of the axis",
    "step-2": "Slice '{0}' has a step other than 1",
    "other-axis": "Slice '{0}' does not cut the Concat's axis 1 alone",
    "two-tensors": "the Slices are not of one tensor of rank 2 or more",
}


@pytest.mark.parametrize("kind", list(LOOKALIKES))
def test_a_lookalike_is_left_alone_with_its_reason(kind):
    proto = split_rejoin(kind)
    source = op_counts(load_model(proto))
    model, report = optimize(proto, ["remove-slice-concat"])
    assert result_of(report, "remove-slice-concat").sites_matched == 0
    assert op_counts(model) == source
    (concat,) = [n for n in load_model(proto).graph.nodes if n.op == "Concat"]
    names = [t.inputs[0].name for t in concat.inputs]
    assert _covered_source(concat) == LOOKALIKES[kind].format(*names)


def test_a_round_trip_that_is_a_graph_output_is_refused():
    model, report = optimize(split_rejoin("constant", graph_output=True), ["remove-slice-concat"])
    result = result_of(report, "remove-slice-concat")
    assert (result.sites_matched, result.sites_rewritten) == (1, 0)
    assert result.refused[0][1] == "writes a graph output" and op_counts(model)["Concat"] == 1


DIT_FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "dit"


@pytest.mark.parametrize("name", ["flux-dev.tiny.dynamo.dynamic.sdpa.onnx",
                                  pytest.param("flux-dev.tiny.torchscript.dynamic.sdpa.onnx", marks=pytest.mark.slow)])
def test_the_stream_split_and_rejoin_between_flux_single_blocks_goes(name):
    """The tiny Flux has 2 single blocks: one boundary where the first block's split meets the
    second block's Concat. The first block's Concat joins the double blocks' two outputs: it stays."""
    entry = next(e for e in json.loads((DIT_FIXTURES / "manifest.json").read_text())["fixtures"] if e["file"] == name)
    inputs = InputSpec(shapes={i["name"]: tuple(i["example_shape"]) for i in entry["inputs"]})
    model, report = optimize(str(DIT_FIXTURES / name), ["cleanup"], inputs=inputs)
    rewritten = sum(p.result.sites_rewritten for p in report.passes if p.name.startswith("remove-slice-concat"))
    assert rewritten == entry["config"]["num_single_layers"] - 1 == 1
    assert_same_computation(str(DIT_FIXTURES / name), model, inputs=inputs, atol=1e-5, rtol=1e-4)
