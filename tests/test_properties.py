"""Claims: the property labels passes provide and preserve are checked, not trusted
(onnxopt.properties): a pass whose claim does not hold is named.
Also the composition the manager sees: nhwc-conv and fp16 hand over to the passes that complete
them as steps of their own, and cleanup repeats its passes, each a step, until none changes the model."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest

from onnxopt import load_model, optimize
from onnxopt.manager import PassManager
from onnxopt.model import Model
from onnxopt import registry
from onnxopt.pass_infra import CONSTANTS_FOLDED, NO_DEAD_NODES, SHAPES_INFERRED, Pass, PassResult
from onnxopt.registry import fixpoint_sequence
from onnxopt.properties import PropertyViolation, checking
from tests.conftest import FIXTURES


# Every preset on every fixture and pinned export runs with the checks on in
# tests/test_pinned_graphs.py. (The TorchScript CLIP fixture's first LayerNorm reads a residual Add
# that broadcasts the batch: fuse-skip-layer-norm's Expand there once left a tensor unannotated.)


class ClaimsNoDeadNodes(Pass):
    """Planted bug: leaves the node it disconnects in the graph and claims there is no dead node."""

    name = "test-claims-no-dead-nodes"
    description = "leaves a dead node, claims none"
    provides = frozenset({NO_DEAD_NODES})

    def run(self, model):
        node = model.graph.nodes[0]
        node.outputs[0] = gs.Variable("nobody_reads_this")
        return PassResult(modified=True)


class ClaimsShapes(Pass):
    """Planted bug: writes an unannotated Identity and claims shapes-inferred."""

    name = "test-claims-shapes"
    description = "writes an unannotated tensor, claims shapes-inferred"
    provides = frozenset({SHAPES_INFERRED})

    def run(self, model):
        graph = model.graph
        y = graph.outputs[0]
        fresh = gs.Variable("unannotated")
        graph.nodes.append(gs.Node("Identity", inputs=[y.inputs[0].outputs[0]], outputs=[fresh]))
        graph.nodes.append(gs.Node("Identity", inputs=[fresh], outputs=[gs.Variable("y2", dtype=np.float32, shape=[2])]))
        graph.outputs.append(graph.nodes[-1].outputs[0])
        return PassResult(modified=True)


class ClaimsConstantsFolded(Pass):
    """Planted bug: writes an Add of two constants and claims constants-folded."""

    name = "test-claims-constants-folded"
    description = "writes Add(constant, constant), claims constants-folded"
    provides = frozenset({CONSTANTS_FOLDED})

    def run(self, model):
        graph = model.graph
        one = gs.Constant("one", np.ones(2, np.float32))
        folded = gs.Variable("one_plus_one", dtype=np.float32, shape=[2])
        graph.nodes.append(gs.Node("Add", "constant_add", inputs=[one, one], outputs=[folded]))
        graph.outputs.append(folded)
        return PassResult(modified=True)


class ModifiesForever(Pass):
    """Planted bug: says it modified the model on every run."""

    name = "test-modifies-forever"
    description = "reports modified every time"

    def run(self, model):
        return PassResult(modified=True)


def _model() -> Model:
    x = gs.Variable("x", dtype=np.float32, shape=[2])
    y = gs.Variable("y", dtype=np.float32, shape=[2])
    z = gs.Variable("z", dtype=np.float32, shape=[2])
    graph = gs.Graph(nodes=[gs.Node("Relu", inputs=[x], outputs=[y]), gs.Node("Neg", inputs=[y], outputs=[z])],
                     inputs=[x], outputs=[z], opset=17)
    return Model(graph)


@pytest.mark.parametrize("bad, label", [(ClaimsNoDeadNodes, NO_DEAD_NODES), (ClaimsShapes, SHAPES_INFERRED),
                                        (ClaimsConstantsFolded, CONSTANTS_FOLDED)])
def test_a_pass_whose_claim_does_not_hold_is_named_when_checking(bad, label):
    with checking(), pytest.raises(PropertyViolation, match=f"after {bad.name}: '{label}'"):
        PassManager([bad()]).run(_model())
    PassManager([bad()]).run(_model())  # not checking: trusted, as before


def test_nhwc_conv_and_fp16_hand_over_to_the_passes_that_complete_them_as_their_own_steps():
    _, report = optimize(FIXTURES / "vae-decoder.tiny.torchscript.dynamic.sdpa.onnx", ["cleanup", "nhwc-conv", "fp16"])
    labels = [p.label for p in report.passes]
    i, j = labels.index("nhwc-conv"), labels.index("fp16")
    assert labels[i + 1] == "sink-transposes (for nhwc-conv)" and labels[j + 1] == "remove-redundant-casts (for fp16)"
    sink = report.passes[i + 1].result
    assert sink.details["transposes_after"] < sink.details["transposes_before"]


def test_cleanup_repeats_its_passes_until_a_whole_round_changes_nothing():
    steps = registry.PRESETS["cleanup"].passes
    assert registry.PRESETS["cleanup"].fixpoint and steps.count("infer-shapes") == 1
    with checking():  # constants-folded and shapes-inferred hold after every step
        _, report = optimize(FIXTURES / "vae-decoder.tiny.torchscript.dynamic.sdpa.onnx", ["cleanup"])
    own = [p for p in report.passes if not p.auto]  # each step of the sequence, in order
    assert [p.name for p in own[:len(steps)]] == list(steps)
    assert all(p.name == steps[i % len(steps)] for i, p in enumerate(own))
    assert not any(p.result.modified for p in own[-len(steps):])  # the fixpoint: a round that changed nothing
    second = [p for p in own if p.round == "cleanup round 2"]
    assert any(p.name == "fold-constants" and p.result.modified for p in second)  # what the shapes of round 1 made foldable
    assert "fold-constants (cleanup round 2)" in report.table()


def test_infer_shapes_reports_modified_only_when_an_annotation_changed():
    model = load_model(FIXTURES / "vae-decoder.tiny.torchscript.dynamic.sdpa.onnx")
    infer = registry.get_pass("infer-shapes")()
    assert infer(model).modified
    assert not infer(model).modified


def test_a_fixpoint_that_never_settles_is_an_error_naming_the_pass(monkeypatch):
    registry.available_passes()
    monkeypatch.setitem(registry._PASSES, ModifiesForever.name, ModifiesForever)
    sequence = fixpoint_sequence("test-sequence", "never settles", ("remove-identity", ModifiesForever.name))
    with pytest.raises(RuntimeError, match="test-sequence reached no fixpoint in 8 rounds: test-modifies-forever still modify"):
        PassManager([sequence()]).run(_model())
