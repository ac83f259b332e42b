"""trt-group-norm: the exporters' InstanceNorm-based GroupNorm becomes the standard GroupNormalization op.

Before, as both exporters write nn.GroupNorm (see fuse-group-norm; the restore shape is ``Shape(x)``
in dynamic exports, a constant in static ones):

    x ─ Reshape([0|N, G, -1]) ─ InstanceNormalization(scale=1, B=0, ε) ─ Reshape(Shape(x) | x's shape) ─ Mul(γ) ─ Add(β) ─ y

After, in opset 21 (the model is moved there when it is older, see below):

    x ─ GroupNormalization(γ, β, num_groups=G, epsilon=ε) ─ y                     γ, β: per channel, shape (C,)
    (γ or β not per channel:  x ─ GroupNormalization(ones(C), zeros(C)) ─ Mul(γ) ─ Add(β) ─ y)

Why this form for TensorRT: TensorRT 10's ONNX parser imports GroupNormalization as its native
normalization layer, where the Reshape-InstanceNormalization-Reshape chain goes through the
InstanceNormalization importer (native, or the InstanceNormalization_TRT plugin) with two reshapes
around it that the builder has to see through; NVIDIA's guidance for mixed precision is to target the
opset that has the normalization function op, which is more accurate than its composition. The
GroupNormalization *plugin* is deprecated since TensorRT 10.12; onnxopt never emits it.

Why opset 21: GroupNormalization-18 took per-group scale and bias, which is not GroupNorm's
per-channel affine; ONNX fixed that in opset 21 and deprecated version 18 (onnx.checker rejects a
GroupNormalization in an opset 18-20 model). TensorRT 11's parser reads opsets up to 25; check the
parser's operators.md for an older TensorRT.

Moving a model to opset 21 (only when at least one site will be rewritten). Of the ai.onnx ops whose
version changed between the model's opset and 21, this pass knows which keep their meaning:

* ReduceMean, ReduceMax, ReduceMin, ReduceProd, ReduceL1, ReduceL2, ReduceLogSum, ReduceLogSumExp,
  ReduceSumSquare (18): ``axes`` moved from an attribute to an input; such nodes are rewritten
  with the axes as a constant input.
* ``COMPATIBLE_CHANGES``: the new version only added types, or inputs/attributes (values) whose
  defaults keep the old behaviour (Cast's saturate applies to float8 only, Resize's antialias=0, ...).
* Any other changed op (DFT's axis became an input in 20, GridSample renamed its modes in 20, a
  GroupNormalization-18 already there, ...) and nodes holding subgraphs (If/Loop/Scan) stop the
  move: every site is refused with the reason, and the graph keeps the InstanceNorm form, which
  TensorRT parses too.

Conditions on a site (refused sites keep the InstanceNorm form):

* InstanceNormalization scale is all ones and B all zeros, both of shape (G,) (a per-group affine is
  not GroupNorm's per-channel one).
* The first Reshape is [0 or N, G, -1], G divides C = x.shape[1], a known number; x is 3-D or 4-D,
  float16 or float32.
* The second Reshape provably restores x's shape.
* γ and β are absorbed only when they broadcast per channel ((C,1,1) for 4-D x); other ones stay
  as they were, after a GroupNormalization with unit scale and zero bias.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, Pass, PassResult
from onnxopt.pattern import Const, Match, OneOf, Pattern, Var, op, replace
from onnxopt.registry import register_pass

from .group_norm import (
    NewNames,
    NodeMaker,
    Refused,
    _check_instance_norm_is_plain,
    _check_restores_shape,
    _groups_from_reshape,
    _per_channel,
    _rank_and_channels,
)

TARGET_OPSET = 21  # GroupNormalization-21: scale and bias per channel
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


# ---------------------------------------------------------------- patterns


def grouped_instance_norm(x):
    """The normalization part of the exporters' GroupNorm: no affine yet."""
    grouped = op.Reshape(x, Const.named("group_shape"), allowzero=Var("group_allowzero"))
    normed = op.InstanceNormalization(
        grouped, Const.named("in_scale"), Const.named("in_bias"), epsilon=Var("epsilon"), _name="norm"
    )
    whole_shape = op.Shape(x, start=0, end=None, _external_uses=True)
    return op.Reshape(normed, OneOf(whole_shape, Const.named("restore_shape")), allowzero=Var("restore_allowzero"))


def grouped_instance_norm_affine(x):
    return grouped_instance_norm(x) * Const.named("gamma") + Const.named("beta")


GROUP_NORM_AFFINE = Pattern(grouped_instance_norm_affine, name="instance-norm-group-norm+affine")
GROUP_NORM_CORE = Pattern(grouped_instance_norm, name="instance-norm-group-norm")


# ---------------------------------------------------------------- the site


def read_groups(match: Match) -> tuple[int, int, float]:
    """(channels, groups, epsilon) of a matched GroupNorm; raises Refused when it is not provably one."""
    x = match["x"]
    _, channels = _rank_and_channels(x)
    groups = _groups_from_reshape(match.value("group_shape"), bool(match.attrs["group_allowzero"]), x, channels)
    _check_instance_norm_is_plain(match.value("in_scale"), match.value("in_bias"), groups)
    if "restore_shape" in match:
        _check_restores_shape(match.value("restore_shape"), bool(match.attrs["restore_allowzero"]), x)
    epsilon = match.attrs.get("epsilon")
    return channels, groups, 1e-5 if epsilon is None else float(epsilon)


def float_dtype(x: gs.Tensor) -> np.dtype:
    return np.dtype(x.dtype) if x.dtype is not None else np.dtype(np.float32)


# ---------------------------------------------------------------- moving the model to opset 21


def _version(op_type: str, opset: int) -> int | None:
    try:
        return onnx.defs.get_schema(op_type, max_inclusive_version=opset, domain="").since_version
    except onnx.defs.SchemaError:
        return None


def opset_upgrade_refusal(graph: gs.Graph, opset: int) -> str | None:
    """Why the model cannot be moved to opset 21 by this pass, or None when it can (or is there)."""
    if opset >= TARGET_OPSET:
        return None
    if any(isinstance(v, gs.Graph) for node in graph.nodes for v in node.attrs.values()):
        return f"opset {opset} model with subgraphs (If/Loop/Scan): not moved to opset {TARGET_OPSET}"
    changed = sorted({
        n.op for n in graph.nodes
        if n.domain in ("", "ai.onnx", None) and _version(n.op, opset) != _version(n.op, TARGET_OPSET)
        and n.op not in COMPATIBLE_CHANGES | AXES_BECAME_INPUT_IN_18
    })
    if changed:
        return (f"{', '.join(changed)} got new versions between opset {opset} and {TARGET_OPSET} not known to keep their"
                f" meaning: the model stays at opset {opset}")
    return None


def upgrade_to_target_opset(graph: gs.Graph, opset: int, names: NewNames) -> int:
    """Move a graph to opset 21; returns how many Reduce nodes got their axes as an input."""
    moved = 0
    if opset < 18:
        for node in graph.nodes:
            if node.op in AXES_BECAME_INPUT_IN_18 and node.domain in ("", "ai.onnx", None) and "axes" in node.attrs:
                axes = np.asarray(node.attrs.pop("axes"), dtype=np.int64).reshape(-1)
                node.inputs.append(gs.Constant(names(f"{node.name or node.op}/axes"), axes))
                moved += 1
    graph.opset = TARGET_OPSET
    if graph.import_domains is not None:
        graph.import_domains = [
            onnx.helper.make_opsetid("", TARGET_OPSET) if (d.domain or "ai.onnx") == "ai.onnx" else d
            for d in graph.import_domains
        ]
    if graph.ir_version is not None and graph.ir_version < MIN_IR_VERSION:
        graph.ir_version = MIN_IR_VERSION
    return moved


# ---------------------------------------------------------------- the pass


@register_pass
class TrtGroupNorm(Pass):
    name = "trt-group-norm"
    description = "InstanceNorm-based GroupNorm -> standard GroupNormalization (the model moves to opset 21)"
    targets = frozenset({"tensorrt"})
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})  # new tensors take over annotated ones
    is_fusion = True

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        opset = model.opset
        names = NewNames(graph)
        upgrade_refusal = opset_upgrade_refusal(graph, opset)
        seen: set[int] = set()
        rewrites: list = []  # (match, channels, groups, epsilon, affine), rewritten once the opset is settled
        # With γ and β first; a site whose γ/β is not per channel is found again without them.
        for pattern in (GROUP_NORM_AFFINE, GROUP_NORM_CORE):
            for match in pattern.find(graph):
                norm = match.node("norm")
                if id(norm) in seen:
                    continue
                try:
                    channels, groups, epsilon = read_groups(match)
                    affine = None
                    if pattern is GROUP_NORM_AFFINE:
                        rank = len(match["x"].shape)
                        affine = (_per_channel("γ (the Mul after the GroupNorm)", match.value("gamma"), rank, channels),
                                  _per_channel("β (the Add after the Mul)", match.value("beta"), rank, channels))
                except Refused as refusal:
                    if pattern is GROUP_NORM_AFFINE:
                        continue  # the core pattern finds it again: refused there, or rewritten with γ/β left outside
                    seen.add(id(norm))
                    result.sites_matched += 1
                    result.refuse(norm.name, str(refusal))
                    continue
                seen.add(id(norm))
                result.sites_matched += 1
                if upgrade_refusal:
                    result.refuse(norm.name, upgrade_refusal)
                    continue
                rewrites.append((match, channels, groups, epsilon, affine))
        if rewrites and opset < TARGET_OPSET:
            moved = upgrade_to_target_opset(graph, opset, names)
            result.details["opset"] = f"{opset} -> {TARGET_OPSET}" + (f" ({moved} Reduce nodes given axes inputs)" if moved else "")
        absorbed = 0
        for match, channels, groups, epsilon, affine in rewrites:
            x = match["x"]
            dtype = float_dtype(x)
            if affine is not None:
                scale, bias = (v.astype(dtype) for v in affine)
                absorbed += 1
            else:
                scale, bias = np.ones(channels, dtype), np.zeros(channels, dtype)
            make = NodeMaker(names, match.node("norm").name or "group_norm")
            y = make.node(
                "GroupNormalization", [x, make.constant("scale", scale), make.constant("bias", bias)],
                x.dtype, x.shape, num_groups=groups, epsilon=epsilon,
            )
            replace(graph, match, make.nodes, [y])
            result.sites_rewritten += 1
        if rewrites:
            graph.cleanup(remove_unused_graph_inputs=False).toposort()
        result.modified = bool(rewrites)
        result.details["affine_absorbed"] = absorbed
        return result
