"""fuse-group-norm: GroupNorm subgraphs become com.microsoft GroupNorm (NHWC), a following SiLU folded in.

Before, as both exporters write nn.GroupNorm (the restore shape is ``Shape(x)`` in dynamic exports,
a constant in static or folded ones), and the standard op:

    x ─ Reshape([0|N, G, -1]) ─ InstanceNormalization(scale=1, B=0, ε) ─ Reshape(Shape(x) | x's shape) ─ Mul(γ) ─ Add(β) ─ y
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

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, NO_DEAD_NODES, SHAPES_INFERRED, OrtFusion, PassResult
from onnxopt.pattern import Const, Match, OneOf, Pattern, Var, op, replace
from onnxopt.registry import register_pass

MS_DOMAIN = "com.microsoft"
TO_NHWC = [0, 2, 3, 1]
TO_NCHW = [0, 3, 1, 2]
GROUP_NORM_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))
MAX_CHANNELS_PER_GROUP = 512  # ORT's CUDA kernel: channels_per_group even and <= kMaxSize (512)


# ---------------------------------------------------------------- patterns


def instance_norm_group_norm(x):
    """nn.GroupNorm as the TorchScript and dynamo exporters write it."""
    grouped = op.Reshape(x, Const.named("group_shape"), allowzero=Var("group_allowzero"))
    normed = op.InstanceNormalization(
        grouped, Const.named("in_scale"), Const.named("in_bias"), epsilon=Var("epsilon"), _name="norm"
    )
    whole_shape = op.Shape(x, start=0, end=None, _external_uses=True)  # a shared Shape(x) may stay for others
    restored = op.Reshape(normed, OneOf(whole_shape, Const.named("restore_shape")), allowzero=Var("restore_allowzero"))
    return restored * Const.named("gamma") + Const.named("beta")


def group_normalization_op(x):
    """The standard ONNX op (opset 18+)."""
    return op.GroupNormalization(
        x, Const.named("gamma"), Const.named("beta"), num_groups=Var("groups"), epsilon=Var("epsilon"), _name="norm"
    )


def silu(y):
    return OneOf(y * op.Sigmoid(y), op.Swish(y, alpha=1.0))


GROUP_NORM = Pattern(instance_norm_group_norm, group_normalization_op, name="group_norm")
GROUP_NORM_SILU = Pattern(
    lambda x: silu(instance_norm_group_norm(x)),
    lambda x: silu(group_normalization_op(x)),
    name="group_norm+silu",
)
# The VAE attention's GroupNorm input: a 4-D tensor viewed as (N, C, H*W).
FLATTENED_SPATIAL = Pattern(lambda x4, shape: op.Reshape(x4, shape, allowzero=Var("allowzero")), name="flattened_spatial")


# ---------------------------------------------------------------- the site, read and checked


class Refused(Exception):
    """A site fits the pattern but must not be rewritten; the message says why."""


@dataclass
class GroupNormSite:
    x: gs.Tensor
    channels: int
    groups: int
    epsilon: float
    gamma: np.ndarray  # float32 (C,)
    beta: np.ndarray  # float32 (C,)
    form: str  # "instance_norm" or "group_normalization"


def read_site(match: Match, opset: int) -> GroupNormSite:
    """The GroupNorm a match computes; raises Refused when it is not provably one ORT can run."""
    x = match["x"]
    rank, channels = _rank_and_channels(x)
    epsilon = match.attrs.get("epsilon")
    epsilon = 1e-5 if epsilon is None else float(epsilon)
    if "in_scale" in match:
        form = "instance_norm"
        groups = _groups_from_reshape(match.value("group_shape"), bool(match.attrs["group_allowzero"]), x, channels)
        _check_instance_norm_is_plain(match.value("in_scale"), match.value("in_bias"), groups)
        if "restore_shape" in match:
            _check_restores_shape(match.value("restore_shape"), bool(match.attrs["restore_allowzero"]), x)
        gamma = _per_channel("γ (the Mul after the InstanceNormalization)", match.value("gamma"), rank, channels)
        beta = _per_channel("β (the Add after the Mul)", match.value("beta"), rank, channels)
    else:
        form = "group_normalization"
        groups = int(match.attrs["groups"])
        _check_divides(groups, channels)
        scale, bias = match.value("gamma"), match.value("beta")
        # GroupNormalization-18 scales and shifts each group by one value: GroupNorm's per-channel γ, β
        # repeat it over the group's channels. From opset 21 scale and bias are per channel.
        per_group = opset < 21
        expected = (groups,) if per_group else (channels,)
        for what, value in (("scale", scale), ("bias", bias)):
            if value.shape != expected:
                kind = "per group (opset < 21)" if per_group else "per channel"
                raise Refused(f"GroupNormalization {what} has shape {value.shape}, expected {expected}: {kind}")
        repeats = channels // groups if per_group else 1
        gamma, beta = (np.repeat(value.astype(np.float32), repeats) for value in (scale, bias))
    _check_kernel_supports(channels, groups)
    return GroupNormSite(x, channels, groups, epsilon, gamma, beta, form)


def _rank_and_channels(x: gs.Tensor) -> tuple[int, int]:
    if x.shape is None:
        raise Refused("the input's rank is unknown (shape inference gave it no shape)")
    rank = len(x.shape)
    if rank not in (3, 4):
        raise Refused(f"input is {rank}-D; GroupNorm takes 4-D (and 3-D via a reshape) only")
    channels = x.shape[1]
    if not isinstance(channels, (int, np.integer)) or channels <= 0:
        raise Refused(f"the input's channel count is not a known number ({channels!r})")
    if x.dtype is not None and np.dtype(x.dtype) not in GROUP_NORM_DTYPES:
        raise Refused(f"input is {np.dtype(x.dtype)}; GroupNorm takes float16 or float32")
    return rank, int(channels)


def _groups_from_reshape(group_shape: np.ndarray, allowzero: bool, x: gs.Tensor, channels: int) -> int:
    shape = [int(v) for v in np.asarray(group_shape).reshape(-1)]
    if len(shape) != 3:
        raise Refused(f"the first Reshape's shape {shape} is not [N, G, -1]")
    batch, groups, rest = shape
    if not ((batch == 0 and not allowzero) or batch == x.shape[0]):
        raise Refused(f"the first Reshape's shape {shape} does not keep the batch dim ({x.shape[0]!r})")
    if groups <= 0:
        raise Refused(f"the first Reshape's shape {shape} is not [N, G, -1]")
    _check_divides(groups, channels)
    if rest != -1:
        spatial = x.shape[2:]
        if not all(isinstance(d, (int, np.integer)) for d in spatial) or rest != channels // groups * math.prod(spatial):
            raise Refused(f"the first Reshape's shape {shape} is not [N, G, -1]")
    return groups


def _check_divides(groups: int, channels: int) -> None:
    if groups <= 0 or channels % groups:
        raise Refused(f"group count {groups} does not divide the channel count {channels}")


def _check_instance_norm_is_plain(scale: np.ndarray, bias: np.ndarray, groups: int) -> None:
    if scale.shape != (groups,) or bias.shape != (groups,):
        raise Refused(f"InstanceNormalization scale/B have shapes {scale.shape}/{bias.shape}, expected ({groups},)")
    if not np.all(scale == 1):
        raise Refused("InstanceNormalization scale is not all ones (a per-group scale, not GroupNorm's per-channel γ)")
    if not np.all(bias == 0):
        raise Refused("InstanceNormalization B is not all zeros (a per-group shift, not GroupNorm's per-channel β)")


def _check_restores_shape(restore: np.ndarray, allowzero: bool, x: gs.Tensor) -> None:
    """The second Reshape (of the (N, G, L) tensor) must give x's shape back, provably."""
    restore = [int(v) for v in np.asarray(restore).reshape(-1)]
    target = list(x.shape)
    fits = len(restore) == len(target) and restore.count(-1) <= 1
    for i, (r, d) in enumerate(zip(restore, target)):
        if not fits:
            break
        if r == -1:
            continue  # the one inferred dim: right when every other dim is
        if r == 0:
            fits = i == 0 and not allowzero  # copies the (N, G, L) tensor's dim: only dim 0 (N) is x's
        else:
            fits = isinstance(d, (int, np.integer)) and r == d
    if not fits:
        raise Refused(f"the second Reshape's shape {restore} does not provably restore the input's shape {target}")


def _per_channel(what: str, value: np.ndarray, rank: int, channels: int) -> np.ndarray:
    """``value`` as a float32 (C,) vector, if it broadcasts against x as one number per channel."""
    shape = value.shape
    aligned = (1,) * (rank - len(shape)) + tuple(shape)
    if len(shape) > rank or any(d != 1 for i, d in enumerate(aligned) if i != 1) or aligned[1] not in (1, channels):
        want = ", ".join([str(channels)] + ["1"] * (rank - 2))
        raise Refused(f"{what} has shape {tuple(shape)}, not per channel for a {rank}-D input (want ({want}))")
    return np.broadcast_to(value.reshape(-1).astype(np.float32), (channels,)).copy()


def _check_kernel_supports(channels: int, groups: int) -> None:
    per_group = channels // groups
    if per_group % 2 or per_group > MAX_CHANNELS_PER_GROUP:
        raise Refused(
            f"{per_group} channels per group: ORT's CUDA GroupNorm kernel needs an even number, at most {MAX_CHANNELS_PER_GROUP}"
        )


# ---------------------------------------------------------------- building the replacement


class NewNames:
    """Fresh node and tensor names, unique in the graph (collected once per pass)."""

    def __init__(self, graph: gs.Graph):
        self.taken = set(graph.tensors().keys()) | {n.name for n in graph.nodes}

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name


class NodeMaker:
    """Builds annotated nodes into ``nodes``: ``y = make.node("Squeeze", [x, axes], x.dtype, shape)``."""

    def __init__(self, names: NewNames, prefix: str):
        self.names, self.prefix, self.nodes = names, prefix, []

    def tensor(self, suffix: str, dtype, shape) -> gs.Variable:
        return gs.Variable(self.names(f"{self.prefix}/{suffix}"), dtype=dtype, shape=None if shape is None else list(shape))

    def constant(self, suffix: str, value: np.ndarray) -> gs.Constant:
        return gs.Constant(self.names(f"{self.prefix}/{suffix}"), np.ascontiguousarray(value))

    def node(self, op_type: str, inputs, dtype, shape, *, outputs: int = 1, domain: str | None = None, **attrs):
        outs = [self.tensor(f"{op_type}_out{'' if k == 0 else k}", dtype, shape) for k in range(outputs)]
        self.nodes.append(gs.Node(op_type, self.names(f"{self.prefix}/{op_type}"), attrs, list(inputs), outs, domain=domain))
        return outs[0] if outputs == 1 else outs

    def transpose(self, x: gs.Tensor, perm: list[int]) -> gs.Variable:
        return self.node("Transpose", [x], x.dtype, permuted(x.shape, perm), perm=list(perm))


def permuted(shape, perm):
    return None if shape is None else [shape[p] for p in perm]


def emit_group_norm(graph: gs.Graph, site: GroupNormSite, activation: int, make: NodeMaker) -> gs.Variable:
    """Nodes computing the site's GroupNorm in NCHW terms (Transpose ─ GroupNorm ─ Transpose); returns y."""
    x4, back_to_x = as_4d(graph, site.x, make)
    gamma = make.constant("gamma", site.gamma)
    beta = make.constant("beta", site.beta)
    x_nhwc = make.transpose(x4, TO_NHWC)
    y_nhwc = make.node(
        "GroupNorm", [x_nhwc, gamma, beta], x4.dtype, x_nhwc.shape, domain=MS_DOMAIN,
        groups=site.groups, activation=activation, epsilon=site.epsilon, channels_last=1,
    )
    return back_to_x(make.transpose(y_nhwc, TO_NCHW))


def as_4d(graph: gs.Graph, x: gs.Tensor, make: NodeMaker):
    """x as a 4-D NCHW tensor, and how to bring a result of that shape back to x's shape."""
    if len(x.shape) == 4:
        return x, lambda y: y
    view = FLATTENED_SPATIAL.match(graph, x.inputs[0]) if len(x.inputs) == 1 else None
    if view is not None and _is_flattened_view(view["x4"], x):
        attrs = dict(x.inputs[0].attrs)  # the same Reshape back: same shape operand, same allowzero
        return view["x4"], lambda y: make.node("Reshape", [y, view["shape"]], x.dtype, x.shape, **attrs)
    axes = make.constant("axes", np.array([3], np.int64))
    x4 = make.node("Unsqueeze", [x, axes], x.dtype, [*x.shape, 1])
    return x4, lambda y: make.node("Squeeze", [y, axes], x.dtype, x.shape)


def _is_flattened_view(x4: gs.Tensor, x: gs.Tensor) -> bool:
    """x = Reshape(x4) with x4 4-D of the same batch and channels: x is x4 with H, W merged,
    and a GroupNorm of x4 is the GroupNorm of x, reshaped back."""
    if x4.shape is None or len(x4.shape) != 4:
        return False
    same_batch = x4.shape[0] == x.shape[0] and x.shape[0] not in (None, "")
    return same_batch and x4.shape[1] == x.shape[1]


# ---------------------------------------------------------------- the pass


@register_pass
class FuseGroupNorm(OrtFusion):
    name = "fuse-group-norm"
    description = "GroupNorm subgraphs (InstanceNorm form, GroupNormalization) + SiLU -> com.microsoft GroupNorm (NHWC)"
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED, NO_DEAD_NODES})  # new tensors are annotated

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        names = NewNames(graph)
        seen: set[int] = set()  # norm nodes already counted: a refused GroupNorm+SiLU comes back as GroupNorm
        forms: Counter = Counter()
        with_silu = 0
        # GroupNorm+SiLU first: a SiLU whose input has another consumer does not match it (the
        # matcher's escape check), and its GroupNorm is fused by the second round, with activation 0.
        for pattern, activation in ((GROUP_NORM_SILU, 1), (GROUP_NORM, 0)):
            for match in pattern.find(graph):
                norm = match.node("norm")
                if id(norm) in seen:
                    continue
                seen.add(id(norm))
                result.sites_matched += 1
                try:
                    site = read_site(match, model.opset)
                except Refused as refusal:
                    result.refuse(norm.name, str(refusal))
                    continue
                make = NodeMaker(names, norm.name or "group_norm")
                y = emit_group_norm(graph, site, activation, make)
                replace(graph, match, make.nodes, [y])
                result.sites_rewritten += 1
                with_silu += activation
                forms[site.form if len(site.x.shape) == 4 else f"{site.form}, 3-D input"] += 1
            if result.sites_rewritten:
                graph.cleanup(remove_unused_graph_inputs=False)  # dead matched nodes must not count as consumers
        if result.sites_rewritten:
            graph.toposort()
        result.modified = result.sites_rewritten > 0
        result.details = {"with_silu": with_silu, "forms": dict(forms)}
        return result
