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

Moving a model to opset 21 (only when at least one site will be rewritten; onnxopt.opset_upgrade
says which ops keep their meaning): when the model cannot move, every site is refused with the
reason, and the graph keeps the InstanceNorm form, which TensorRT parses too.

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

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule, Site
from onnxopt.group_norm_form import (
    check_instance_norm_is_plain,
    check_restores_shape,
    grouped_instance_norm,
    grouped_instance_norm_affine,
    groups_from_reshape,
    per_channel,
    rank_and_channels,
)
from onnxopt.opset_upgrade import OPSET_21, opset_upgrade_refusal, upgrade_to_opset_21
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED
from onnxopt.pattern import Match, Pattern
from onnxopt.registry import register_pass
from onnxopt.weights import numpy_dtype

TARGET_OPSET = OPSET_21  # GroupNormalization-21: scale and bias per channel


# ---------------------------------------------------------------- patterns


GROUP_NORM_AFFINE = Pattern(grouped_instance_norm_affine, name="instance-norm-group-norm+affine")
GROUP_NORM_CORE = Pattern(grouped_instance_norm, name="instance-norm-group-norm")


# ---------------------------------------------------------------- the site


def read_groups(match: Match) -> tuple[int, int, float]:
    """(channels, groups, epsilon) of a matched GroupNorm; raises Refusal when it is not provably one."""
    x = match["x"]
    _, channels = rank_and_channels(x)
    groups = groups_from_reshape(match.value("group_shape"), bool(match.attrs["group_allowzero"]), x, channels)
    check_instance_norm_is_plain(match.value("in_scale"), match.value("in_bias"), groups)
    if "restore_shape" in match:
        check_restores_shape(match.value("restore_shape"), bool(match.attrs["restore_allowzero"]), x)
    epsilon = match.attrs.get("epsilon")
    return channels, groups, 1e-5 if epsilon is None else float(epsilon)


def float_dtype(x: gs.Tensor) -> np.dtype:
    return numpy_dtype(x.dtype) if x.dtype is not None else np.dtype(np.float32)


# ---------------------------------------------------------------- the site and what it writes


@dataclass
class TrtGroupNormSite:
    x: gs.Tensor
    channels: int
    groups: int
    epsilon: float
    affine: tuple[np.ndarray, np.ndarray] | None  # (γ, β) per channel, absorbed; None: unit scale, zero bias


def read_site(match: Match, run: FusionRun) -> TrtGroupNormSite:
    """The GroupNorm a match computes, with γ and β when the affine pattern matched and they are per channel."""
    affine_rule = match.pattern is GROUP_NORM_AFFINE
    try:
        channels, groups, epsilon = read_groups(match)
        affine = None
        if affine_rule:
            rank = len(match["x"].shape)
            affine = (per_channel("γ (the Mul after the GroupNorm)", match.value("gamma"), rank, channels),
                      per_channel("β (the Add after the Mul)", match.value("beta"), rank, channels))
    except Refusal as refusal:
        if affine_rule:  # the core rule finds it again: refused there, or rewritten with γ/β left outside
            raise Refusal(f"{refusal.reason} (left to the rule without γ/β)", not_a_site=True) from None
        raise
    if "upgrade_refusal" not in run.memo:
        run.memo["upgrade_refusal"] = opset_upgrade_refusal(run.graph, run.model.opset)
    if run.memo["upgrade_refusal"]:
        raise Refusal(run.memo["upgrade_refusal"])
    return TrtGroupNormSite(match["x"], channels, groups, epsilon, affine)


def emit_group_normalization(make: Emit, site: TrtGroupNormSite) -> list[gs.Tensor]:
    x = site.x
    dtype = float_dtype(x)
    if site.affine is not None:
        scale, bias = (v.astype(dtype) for v in site.affine)
    else:
        scale, bias = np.ones(site.channels, dtype), np.zeros(site.channels, dtype)
    return [make.op.GroupNormalization(x, make.constant("scale", scale), make.constant("bias", bias),
                                       num_groups=site.groups, epsilon=site.epsilon)]


def _norm(match: Match) -> gs.Node:
    return match.node("norm")


# ---------------------------------------------------------------- the pass


@register_pass
class TrtGroupNorm(Fusion):
    name = "trt-group-norm"
    description = "InstanceNorm-based GroupNorm -> standard GroupNormalization (the model moves to opset 21)"
    targets = frozenset({"tensorrt"})
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})  # new tensors take over annotated ones
    # With γ and β first; a site whose γ/β is not per channel is found again without them.
    rules = (Rule(GROUP_NORM_AFFINE, read_site, emit_group_normalization, site=_norm),
             Rule(GROUP_NORM_CORE, read_site, emit_group_normalization, site=_norm))
    defer_rewrites = True  # every site is checked before the model moves to opset 21, once

    def before_rewrites(self, run: FusionRun, sites: list[Site]) -> list[Site]:
        opset = run.model.opset
        if sites and opset < TARGET_OPSET:
            moved = upgrade_to_opset_21(run.graph, opset, run.names)
            run.result.details["opset"] = f"{opset} -> {TARGET_OPSET}" + (f" ({moved} Reduce nodes given axes inputs)" if moved else "")
        run.result.details["affine_absorbed"] = sum(site.facts.affine is not None for site in sites)
        return sites
