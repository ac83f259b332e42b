"""trt-group-norm: the exporters' InstanceNorm-based GroupNorm becomes the standard GroupNormalization op.

Before, as both exporters write nn.GroupNorm (see fuse-group-norm; the restore shape is ``Shape(x)``
in dynamic exports, a constant in static ones):

    x ─ Reshape([0|N, G, -1]) ─ InstanceNormalization(scale=1, B=0, ε) ─ Reshape(Shape(x) | x's shape) ─ Mul(γ) ─ Add(β) ─ y

After, by the model's opset:

    opset >= 21:  x ─ GroupNormalization(γ, β, num_groups=G, epsilon=ε) ─ y                   γ, β per channel (C,)
                  (without a per-channel Mul/Add after it:  GroupNormalization(ones(C), zeros(C)))
    opset 18-20:  x ─ GroupNormalization(ones(G), zeros(G), num_groups=G, epsilon=ε) ─ Mul(γ) ─ Add(β) ─ y
                  (GroupNormalization-18 takes per-group scale/bias, so the per-channel affine stays as it was)
    opset 17:     the model moves to opset 18 first (below), then as opset 18.

Why this form for TensorRT: TensorRT 10's ONNX parser imports GroupNormalization as its native
normalization layer; the Reshape-InstanceNormalization-Reshape chain goes through the
InstanceNormalization importer (native or the InstanceNormalization_TRT plugin) with two reshapes
around it that the builder has to see through, and NVIDIA's guidance for mixed precision is to target
the opset that has the normalization function op (opset 18 for GroupNormalization) because the op is
more accurate than its composition. The GroupNormalization *plugin* is deprecated since TensorRT 10.12,
so onnxopt never emits it. The opset-18 form keeps scale/bias trivially ones/zeros, which means the
same thing under both readings of GroupNormalization-18's scale (per group, as its schema says, or per
channel, as opset 21 fixed it).

Moving an opset-17 model to 18 (done only when at least one site will be rewritten): between 17 and 18
only the Reduce ops (all but ReduceSum) changed meaning, their ``axes`` moving from an attribute to
an input; those nodes are rewritten with the axes as a constant input. Every other op that got a new
version in 18 (Split, Pad, Resize, ScatterElements/ND, LpPool, Optional*) only gained inputs or
attribute values whose defaults keep the old behaviour. A model whose nodes hold subgraphs (If, Loop,
Scan) is not moved: its sites are refused.

Conditions (refused sites keep the InstanceNorm form, which TensorRT also parses):

* InstanceNormalization scale is all ones and B all zeros, both of shape (G,) (a per-group affine is
  not GroupNorm's per-channel one).
* The first Reshape is [0 or N, G, -1], G divides C = x.shape[1], a known number; x is 3-D or 4-D.
* The second Reshape provably restores x's shape.
* opset >= 21 absorbs γ and β only when they broadcast per channel ((C,1,1) for 4-D x); other ones stay
  as a Mul and an Add after a GroupNormalization with ones/zeros.
* The model's opset is at least 17 (earlier opsets are refused, not upgraded).
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

GROUP_NORMALIZATION_OPSET = 18
PER_CHANNEL_OPSET = 21  # GroupNormalization-21: scale and bias of shape (C,)
# Ops whose meaning changed from opset 17 to 18: ``axes`` moved from an attribute to an input.
AXES_BECAME_INPUT_IN_18 = frozenset({
    "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
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


# ---------------------------------------------------------------- opset 17 -> 18


def opset_upgrade_refusal(graph: gs.Graph, opset: int) -> str | None:
    if opset >= GROUP_NORMALIZATION_OPSET:
        return None
    if opset != GROUP_NORMALIZATION_OPSET - 1:
        return f"opset {opset}: GroupNormalization needs opset {GROUP_NORMALIZATION_OPSET}, and only opset 17 models are moved up"
    if any(isinstance(v, gs.Graph) for node in graph.nodes for v in node.attrs.values()):
        return "opset 17 model with subgraphs (If/Loop/Scan): not moved to opset 18"
    return None


def upgrade_to_opset_18(graph: gs.Graph, names: NewNames) -> int:
    """Move an opset-17 graph to 18; returns how many Reduce nodes got their axes as an input."""
    moved = 0
    for node in graph.nodes:
        if node.op in AXES_BECAME_INPUT_IN_18 and node.domain in ("", "ai.onnx", None) and "axes" in node.attrs:
            axes = np.asarray(node.attrs.pop("axes"), dtype=np.int64).reshape(-1)
            node.inputs.append(gs.Constant(names(f"{node.name or node.op}/axes"), axes))
            moved += 1
    graph.opset = GROUP_NORMALIZATION_OPSET
    if graph.import_domains is not None:
        graph.import_domains = [
            onnx.helper.make_opsetid("", GROUP_NORMALIZATION_OPSET) if (d.domain or "ai.onnx") == "ai.onnx" else d
            for d in graph.import_domains
        ]
    return moved


# ---------------------------------------------------------------- the pass


@register_pass
class TrtGroupNorm(Pass):
    name = "trt-group-norm"
    description = "InstanceNorm-based GroupNorm -> standard GroupNormalization (opset 17 models move to 18)"
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
        target_opset = max(opset, GROUP_NORMALIZATION_OPSET)
        absorb_affine = target_opset >= PER_CHANNEL_OPSET
        seen: set[int] = set()
        rewrites: list = []  # (match, channels, groups, epsilon, affine): built after the opset decision
        patterns = (GROUP_NORM_AFFINE, GROUP_NORM_CORE) if absorb_affine else (GROUP_NORM_CORE,)
        for pattern in patterns:
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
                    if upgrade_refusal:
                        raise Refused(upgrade_refusal)
                except Refused as refusal:
                    if pattern is GROUP_NORM_AFFINE:
                        continue  # the core pattern finds it again: refused there, or rewritten with γ/β left outside
                    seen.add(id(norm))
                    result.sites_matched += 1
                    result.refuse(norm.name, str(refusal))
                    continue
                seen.add(id(norm))
                result.sites_matched += 1
                rewrites.append((match, channels, groups, epsilon, affine))
        upgraded_reduces = None
        if rewrites and opset < GROUP_NORMALIZATION_OPSET:
            upgraded_reduces = upgrade_to_opset_18(graph, names)
        forms: Counter = Counter()
        for match, channels, groups, epsilon, affine in rewrites:
            x = match["x"]
            dtype = float_dtype(x)
            make = NodeMaker(names, match.node("norm").name or "group_norm")
            if affine is not None:
                scale, bias = (v.astype(dtype) for v in affine)
                forms["per-channel γ, β in the op"] += 1
            elif absorb_affine:
                scale, bias = np.ones(channels, dtype), np.zeros(channels, dtype)
                forms["opset 21, affine kept outside"] += 1
            else:
                scale, bias = np.ones(groups, dtype), np.zeros(groups, dtype)
                forms["opset 18-20, affine kept outside"] += 1
            y = make.node(
                "GroupNormalization", [x, make.constant("scale", scale), make.constant("bias", bias)],
                x.dtype, x.shape, num_groups=groups, epsilon=epsilon,
            )
            replace(graph, match, make.nodes, [y])
            result.sites_rewritten += 1
        if rewrites:
            graph.cleanup(remove_unused_graph_inputs=False).toposort()
        result.modified = bool(rewrites)
        result.details = {"forms": dict(forms)}
        if upgraded_reduces is not None:
            result.details["opset"] = f"{opset} -> {GROUP_NORMALIZATION_OPSET} ({upgraded_reduces} Reduce nodes given axes inputs)"
        return result
