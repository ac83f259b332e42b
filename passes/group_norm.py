"""fuse-group-norm: GroupNorm subgraphs become com.microsoft GroupNorm (NHWC), a following SiLU folded in.

Before, as both exporters write nn.GroupNorm (the restore shape is ``Shape(x)`` in dynamic exports,
a constant in static or folded ones), and the standard op:

    x ─ Reshape([0|N, G, -1]) ─ InstanceNormalization(scale=1, B=0, ε) ─ Reshape(Shape(x) | x's shape) ─ [Mul(γ)] ─ [Add(β)] ─ y
                                  (no Mul: γ = 1; no Add: β = 0, as cleanup leaves ``* 1`` and ``+ 0``)
    x ─ GroupNormalization(γ, β, num_groups=G, ε) ─ y          (opset 21+: γ, β per channel; 18-20: per group,
                                                                  each repeated over its group's C/G channels)

    and, optionally, a SiLU on y:  Mul(y, Sigmoid(y)) (either operand order)  or  Swish(y, alpha=1)

After, in an NCHW graph (x of rank 4):

    x ─ Transpose(0,2,3,1) ─ com.microsoft.GroupNorm(γ', β', groups=G, epsilon=ε, activation=0|1, channels_last=1) ─ Transpose(0,3,1,2) ─ y

    γ', β': float32 constants of shape (C,). ORT's CUDA kernel takes NHWC only; the NHWC pass cancels
    the transposes between neighbouring NHWC regions, so this exact form (those two perms) is emitted.

x of rank 3, (N, C, L) (the VAE attention block normalizes ``view(N, C, H*W)`` of a 4-D tensor):

    x = Reshape(x4, s), x4 (N, C, H, W)   ==>  Transpose(x4) ─ GroupNorm ─ Transpose ─ Reshape(·, s) ─ y
    any other 3-D x                       ==>  Unsqueeze(x, [3]) ─ Transpose ─ GroupNorm ─ Transpose ─ Squeeze([3]) ─ y

Conditions (a site that fits the pattern but fails one is refused, with the reason, and left as it was):

* InstanceNormalization scale is all ones and B all zeros, both of shape (G,). (A per-group scale is
  not a GroupNorm γ, which is per channel.)
* The first Reshape is [0 or N, G, -1]; G divides C = x.shape[1], a known number.
* The second Reshape restores x's shape: Shape(x) (whole shape: start 0, no end), or a constant
  provably equal to it.
* γ and β broadcast per channel: after right-aligning them with x, every axis but axis 1 is 1,
  and axis 1 is C or 1 (so (C,1,1) for 4-D x, (C,1) for 3-D x; a (C,) γ would broadcast along W).
* GroupNormalization's scale and bias have shape (C,) from opset 21, (G,) before (per group).
* x is 3-D or 4-D float16/float32, and C/G is even and at most 512 (ORT's CUDA kernel rejects
  anything else at run time with NOT_IMPLEMENTED).
* The SiLU is folded (activation=1) only when its input y has no other consumer and is no graph
  output; otherwise the GroupNorm gets activation=0 and the SiLU stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.group_norm_form import (
    check_divides,
    check_instance_norm_is_plain,
    check_restores_shape,
    affine_or_not,
    grouped_instance_norm,
    grouped_instance_norm_affine,
    grouped_instance_norm_scaled,
    grouped_instance_norm_shifted,
    groups_from_reshape,
    per_channel,
    rank_and_channels,
)
from onnxopt.layout import TO_NCHW, TO_NHWC
from onnxopt.pass_infra import CONSTANTS_FOLDED, NO_DEAD_NODES, SHAPES_INFERRED, OrtFusion
from onnxopt.pattern import Const, Match, OneOf, Pattern, Var, op
from onnxopt.registry import register_pass

MAX_CHANNELS_PER_GROUP = 512  # ORT's CUDA kernel: channels_per_group even and <= kMaxSize (512)


# ---------------------------------------------------------------- patterns


def instance_norm_group_norm(x):
    """nn.GroupNorm as the TorchScript and dynamo exporters write it (see onnxopt.group_norm_form)."""
    return grouped_instance_norm_affine(x)


def group_normalization_op(x):
    """The standard ONNX op (opset 18+)."""
    return op.GroupNormalization(
        x, Const.named("gamma"), Const.named("beta"), num_groups=Var("groups"), epsilon=Var("epsilon"), _name="norm"
    )


def silu(y):
    return OneOf(y * op.Sigmoid(y), op.Swish(y, alpha=1.0))


GROUP_NORM = Pattern(instance_norm_group_norm, group_normalization_op, name="group_norm")
# Without the Add (β = 0), the Mul (γ = 1) or both: rules of their own, after the whole form, so that
# a GroupNorm with both is never taken without its Add (a match is found from its root, in graph order).
GROUP_NORM_ZERO_BETA = Pattern(grouped_instance_norm_scaled, name="group_norm (β = 0)")
GROUP_NORM_UNIT_GAMMA = Pattern(grouped_instance_norm_shifted, name="group_norm (γ = 1)")
GROUP_NORM_PLAIN = Pattern(grouped_instance_norm, name="group_norm (γ = 1, β = 0)")
GROUP_NORM_SILU = Pattern(
    lambda x: silu(affine_or_not(x)),
    lambda x: silu(group_normalization_op(x)),
    name="group_norm+silu",
)
# The VAE attention's GroupNorm input: a 4-D tensor viewed as (N, C, H*W).
FLATTENED_SPATIAL = Pattern(lambda x4, shape: op.Reshape(x4, shape, allowzero=Var("allowzero")), name="flattened_spatial")


def _activation(match: Match) -> int:
    return 1 if match.pattern is GROUP_NORM_SILU else 0


# ---------------------------------------------------------------- the site, read and checked


@dataclass
class GroupNormSite:
    x: gs.Tensor
    channels: int
    groups: int
    epsilon: float
    gamma: np.ndarray  # float32 (C,)
    beta: np.ndarray  # float32 (C,)
    form: str  # "instance_norm" or "group_normalization"
    activation: int  # 1: the SiLU after it is folded in


def read_site(match: Match, run: FusionRun) -> GroupNormSite:
    """The GroupNorm a match computes; raises Refusal when it is not provably one ORT can run."""
    x, opset = match["x"], run.model.opset
    rank, channels = rank_and_channels(x)
    epsilon = match.attrs.get("epsilon")
    epsilon = 1e-5 if epsilon is None else float(epsilon)
    if "in_scale" in match:
        form = "instance_norm"
        groups = groups_from_reshape(match.value("group_shape"), bool(match.attrs["group_allowzero"]), x, channels)
        check_instance_norm_is_plain(match.value("in_scale"), match.value("in_bias"), groups)
        if "restore_shape" in match:
            check_restores_shape(match.value("restore_shape"), bool(match.attrs["restore_allowzero"]), x)
        gamma = (per_channel("γ (the Mul after the InstanceNormalization)", match.value("gamma"), rank, channels)
                 if match.get("gamma") is not None else np.ones(channels, np.float32))
        beta = (per_channel("β (the Add after the Mul)", match.value("beta"), rank, channels)
                if match.get("beta") is not None else np.zeros(channels, np.float32))
    else:
        form = "group_normalization"
        groups = int(match.attrs["groups"])
        check_divides(groups, channels)
        scale, bias = match.value("gamma"), match.value("beta")
        # GroupNormalization-18 scales and shifts each group by one value: GroupNorm's per-channel γ, β
        # repeat it over the group's channels. From opset 21 scale and bias are per channel.
        per_group = opset < 21
        expected = (groups,) if per_group else (channels,)
        for what, value in (("scale", scale), ("bias", bias)):
            if value.shape != expected:
                kind = "per group (opset < 21)" if per_group else "per channel"
                raise Refusal(f"GroupNormalization {what} has shape {value.shape}, expected {expected}: {kind}")
        repeats = channels // groups if per_group else 1
        gamma, beta = (np.repeat(value.astype(np.float32), repeats) for value in (scale, bias))
    _check_kernel_supports(channels, groups)
    activation = _activation(match)
    run.details["with_silu"] += activation
    run.details["form:" + (form if rank == 4 else f"{form}, 3-D input")] += 1
    return GroupNormSite(x, channels, groups, epsilon, gamma, beta, form, activation)


def _check_kernel_supports(channels: int, groups: int) -> None:
    per_group = channels // groups
    if per_group % 2 or per_group > MAX_CHANNELS_PER_GROUP:
        raise Refusal(
            f"{per_group} channels per group: ORT's CUDA GroupNorm kernel needs an even number, at most {MAX_CHANNELS_PER_GROUP}"
        )


def emit_group_norm(make: Emit, site: GroupNormSite) -> list[gs.Tensor]:
    """What it writes: Transpose ─ GroupNorm ─ Transpose (around a 4-D view of a 3-D x); returns [y]."""
    x4, back_to_x = as_4d(make, site.x)
    gamma, beta = make.constant("gamma", site.gamma), make.constant("beta", site.beta)
    x_nhwc = make.op.Transpose(x4, perm=TO_NHWC)
    y_nhwc = make.ms.GroupNorm(x_nhwc, gamma, beta, groups=site.groups, activation=site.activation,
                               epsilon=site.epsilon, channels_last=1)
    return [back_to_x(make.op.Transpose(y_nhwc, perm=TO_NCHW))]


def as_4d(make: Emit, x: gs.Tensor):
    """x as a 4-D NCHW tensor, and how to bring a result of that shape back to x's shape."""
    if len(x.shape) == 4:
        return x, lambda y: y
    view = FLATTENED_SPATIAL.match(make.graph, x.inputs[0]) if len(x.inputs) == 1 else None
    if view is not None and _is_flattened_view(view["x4"], x):
        attrs = dict(x.inputs[0].attrs)  # the same Reshape back: same shape operand, same allowzero
        return view["x4"], lambda y: make.op.Reshape(y, view["shape"], _shape=x.shape, **attrs)
    axes = make.constant("axes", np.array([3], np.int64))
    x4 = make.op.Unsqueeze(x, axes, _shape=[*x.shape, 1])
    return x4, lambda y: make.op.Squeeze(y, axes, _shape=x.shape)


def _is_flattened_view(x4: gs.Tensor, x: gs.Tensor) -> bool:
    """x = Reshape(x4) with x4 4-D of the same batch and channels: x is x4 with H, W merged,
    and a GroupNorm of x4 is the GroupNorm of x, reshaped back."""
    if x4.shape is None or len(x4.shape) != 4:
        return False
    same_batch = x4.shape[0] == x.shape[0] and x.shape[0] not in (None, "")
    return same_batch and x4.shape[1] == x.shape[1]


def _norm(match: Match) -> gs.Node:
    return match.node("norm")


# ---------------------------------------------------------------- the pass


@register_pass
class FuseGroupNorm(Fusion, OrtFusion):
    name = "fuse-group-norm"
    description = "GroupNorm subgraphs (InstanceNorm form, GroupNormalization) + SiLU -> com.microsoft GroupNorm (NHWC)"
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED, NO_DEAD_NODES})  # new tensors are annotated
    # GroupNorm+SiLU first: a SiLU whose input has another consumer does not match it (the matcher's
    # escape check), and its GroupNorm is fused by the second rule, with activation 0. A site is
    # its InstanceNormalization / GroupNormalization node: a refused GroupNorm+SiLU is not seen twice.
    rules = (Rule(GROUP_NORM_SILU, read_site, emit_group_norm, site=_norm),
             Rule(GROUP_NORM, read_site, emit_group_norm, site=_norm),
             Rule(GROUP_NORM_ZERO_BETA, read_site, emit_group_norm, site=_norm),
             Rule(GROUP_NORM_UNIT_GAMMA, read_site, emit_group_norm, site=_norm),
             Rule(GROUP_NORM_PLAIN, read_site, emit_group_norm, site=_norm))

    def finish(self, run: FusionRun) -> None:
        forms = {key.removeprefix("form:"): n for key, n in run.details.items() if key.startswith("form:")}
        run.result.details = {"with_silu": run.details["with_silu"], "forms": forms}
