"""Moving a graph to opset 21, for the passes whose output needs it (trt-group-norm's
GroupNormalization-21, fp8-linear's float8 QuantizeLinear).

Of the ai.onnx ops whose version changed between the model's opset and 21, this module knows which
keep their meaning:

* ReduceMean, ReduceMax, ReduceMin, ReduceProd, ReduceL1, ReduceL2, ReduceLogSum, ReduceLogSumExp,
  ReduceSumSquare (18): ``axes`` moved from an attribute to an input; such nodes are rewritten
  with the axes as a constant input.
* ``COMPATIBLE_CHANGES``: the new version only added types, or inputs/attributes (values) whose
  defaults keep the old behaviour (Cast's saturate applies to float8 only, Resize's antialias=0, ...).
* Any other changed op (DFT's axis became an input in 20, GridSample renamed its modes in 20, a
  GroupNormalization-18 already there, ...) and nodes holding subgraphs (If/Loop/Scan) stop the
  move: :func:`opset_upgrade_refusal` says why, and the caller refuses its sites.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, NameAuthority
from onnxopt.graph_edit import set_input

OPSET_21 = 21
MIN_IR_VERSION = 10  # what opset 21 needs
# Ops whose meaning changed in opset 18: ``axes`` moved from an attribute to an input.
AXES_BECAME_INPUT_IN_18 = frozenset({
    "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
})
# Ops with a new version in opsets 18-21 that means the same for every graph valid before it: new
# types, or new inputs/attributes (or attribute values) whose defaults keep the old behaviour.
COMPATIBLE_CHANGES = frozenset({
    "Cast", "CastLike", "Constant", "ConstantOfShape", "Identity", "Reshape", "Shape", "Size", "Squeeze",
    "Unsqueeze", "Transpose", "Flatten", "Equal", "IsInf", "IsNaN", "AveragePool", "LpPool", "Pad",
    "Resize", "Split", "ScatterElements", "ScatterND", "QuantizeLinear", "DequantizeLinear", "QLinearMatMul",
    "OptionalGetElement", "OptionalHasElement", "ReduceMax", "ReduceMin",
})

def _version(op_type: str, opset: int) -> int | None:
    try:
        return onnx.defs.get_schema(op_type, max_inclusive_version=opset, domain="").since_version
    except onnx.defs.SchemaError:
        return None


def opset_upgrade_refusal(graph: gs.Graph, opset: int) -> str | None:
    """Why the model cannot be moved to opset 21 by this pass, or None when it can (or is there)."""
    if opset >= OPSET_21:
        return None
    if any(isinstance(v, gs.Graph) for node in graph.nodes for v in node.attrs.values()):
        return f"opset {opset} model with subgraphs (If/Loop/Scan): not moved to opset {OPSET_21}"
    changed = sorted({
        n.op for n in graph.nodes
        if n.domain in ("", "ai.onnx", None) and _version(n.op, opset) != _version(n.op, OPSET_21)
        and n.op not in COMPATIBLE_CHANGES | AXES_BECAME_INPUT_IN_18
    })
    if changed:
        return (f"{', '.join(changed)} got new versions between opset {opset} and {OPSET_21} not known to keep their"
                f" meaning: the model stays at opset {opset}")
    return None


def upgrade_to_opset_21(graph: gs.Graph, opset: int, names: NameAuthority) -> int:
    """Move a graph to opset 21; returns how many Reduce nodes got their axes as an input."""
    moved = 0
    if opset < 18:
        for node in graph.nodes:
            if node.op in AXES_BECAME_INPUT_IN_18 and node.domain in ("", "ai.onnx", None) and "axes" in node.attrs:
                axes = np.asarray(node.attrs.pop("axes"), dtype=np.int64).reshape(-1)
                set_input(node, len(node.inputs), Emit(graph, names, node.name or node.op).constant("axes", axes))
                moved += 1
    graph.opset = OPSET_21
    if graph.import_domains is not None:
        graph.import_domains = [
            onnx.helper.make_opsetid("", OPSET_21) if (d.domain or "ai.onnx") == "ai.onnx" else d
            for d in graph.import_domains
        ]
    if graph.ir_version is not None and graph.ir_version < MIN_IR_VERSION:
        graph.ir_version = MIN_IR_VERSION
    return moved
