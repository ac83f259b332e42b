"""fuse-skip-group-norm: the Add in front of a GroupNorm becomes part of a com.microsoft SkipGroupNorm.

Runs after fuse-group-norm, on its output. Before, in an NCHW graph (s, the sum, may have other
consumers: the residual path):

    a ─┐
       Add ─ s ─ Transpose(0,2,3,1) ─ GroupNorm(channels_last=1) ─ y
    b ─┘   └─ (other consumers of s)

After:

    Transpose(0,2,3,1)(a) ─┐
                           SkipGroupNorm(γ, β, groups, activation, ε, channels_last=1) ─ y
              skip(b)    ─┘            └─ S ─ Transpose(0,3,1,2) ─ s ─ (other consumers of s)

    skip(b) = Transpose(0,2,3,1)(b)   for a full b, (N, C, H, W): a residual
            = Flatten(b, axis=1)     for b of shape (N, C, 1, 1): a broadcast time embedding, as (N, C)
    An operand that is itself Transpose(0,3,1,2)(q) of an NHWC q is read as q (no transpose pair).
    The S output and its Transpose exist only when s has consumers outside the fusion.

The same Add directly in front of a GroupNorm whose input is already NHWC (after the NHWC pass) fuses
with its operands as they are: skip (N, H, W, C) or (N, 1, 1, C).

Conditions (a matched site that fails one is refused, with the reason, and left as it was):

* Neither operand is a constant: a per-channel constant is a bias, and SkipGroupNorm needs a skip.
* Both operands are 4-D with known rank; X (the full operand) and skip have the same channel count
  as γ; known dims of two full operands agree; a broadcast skip keeps the batch dim (a literal 1
  against a batch that is not provably 1 would broadcast over the batch, which SkipGroupNorm
  does not do).

SkipGroupNorm itself checks at run time that skip is (N, H, W, C), (N, 1, 1, C) or (N, C) for X
(N, H, W, C), and fails loudly otherwise. So where symbolic dims cannot be compared (the TorchScript
exporter's shape inference leaves them unnamed), a kernel that runs computes exactly s = a + b.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.domains import MS_DOMAIN
from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.layout import TO_NCHW, TO_NHWC
from onnxopt.pass_infra import CONSTANTS_FOLDED, NO_DEAD_NODES, SHAPES_INFERRED, OrtFusion
from onnxopt.pattern import Match, OpBuilder, Pattern, Var, is_constant, op
from onnxopt.registry import register_pass

ms = OpBuilder(MS_DOMAIN)


def _channels_last(value) -> bool:
    return value in (None, 1)  # unset means the default, 1


def _group_norm(x):
    return ms.GroupNorm(x, Var("gamma"), Var("beta"), channels_last=_channels_last, _name="group_norm")


def nchw_sum_group_norm(a, b):
    s = op.Add(a, b, _external_uses=True, _name="add")
    return _group_norm(op.Transpose(s, perm=TO_NHWC)), s


def nhwc_sum_group_norm(a, b):
    s = op.Add(a, b, _external_uses=True, _name="add")
    return _group_norm(s), s


SUM_GROUP_NORM = Pattern(nchw_sum_group_norm, nhwc_sum_group_norm, name="sum_group_norm")
FROM_NHWC = Pattern(lambda q: op.Transpose(q, perm=TO_NCHW), name="from_nhwc")


# ---------------------------------------------------------------- operands


def _is_one(dim) -> bool:
    return isinstance(dim, (int, np.integer)) and dim == 1


def _known(dim) -> bool:
    return isinstance(dim, (int, np.integer))


def split_operands(add: gs.Node, channels: int, layout: str) -> tuple[gs.Tensor, gs.Tensor, bool]:
    """(X, skip source, skip is broadcast) for the Add's two operands; raises Refusal."""
    a, b = add.inputs
    spatial = (2, 3) if layout == "nchw" else (1, 2)
    channel = 1 if layout == "nchw" else 3
    for t in (a, b):
        if is_constant(t):
            raise Refusal("an Add operand is a constant (a bias, not a skip)")
        if t.shape is None or len(t.shape) != 4:
            raise Refusal(f"an Add operand is not known to be 4-D (shape {t.shape})")
        if _known(t.shape[channel]) and t.shape[channel] != channels:
            raise Refusal(f"an Add operand has {t.shape[channel]} channels, the GroupNorm {channels}")
    a_broadcast, b_broadcast = (all(_is_one(t.shape[i]) for i in spatial) for t in (a, b))  # (N, C, 1, 1)
    if a_broadcast and not b_broadcast:
        x, skip, skip_broadcast = b, a, True
    else:  # (when both are (N, C, 1, 1), X is too: either way is right)
        x, skip, skip_broadcast = a, b, b_broadcast
    if skip_broadcast:
        if _is_one(skip.shape[0]) and not _is_one(x.shape[0]):
            raise Refusal("the broadcast skip has batch 1: the Add broadcasts it over the batch, SkipGroupNorm cannot")
    else:
        for dx, ds in zip(x.shape, skip.shape):
            if _known(dx) and _known(ds) and dx != ds:
                raise Refusal(f"the Add broadcasts: operand shapes {list(x.shape)} and {list(skip.shape)}")
    if not _known(x.shape[channel]) and not _known(skip.shape[channel]):
        raise Refusal("the Add operands' channel count is unknown")
    return x, skip, skip_broadcast


# ---------------------------------------------------------------- the site


@dataclass
class SkipGroupNormSite:
    group_norm: gs.Node
    layout: str  # "nchw": the GroupNorm reads Transpose(s); "nhwc": it reads s
    x: gs.Tensor  # the full operand
    skip: gs.Tensor
    skip_broadcast: bool  # skip is (N, C, 1, 1) / (N, 1, 1, C)
    channels: int
    sum: gs.Tensor  # s, the Add's output
    keeps_sum: bool  # s has consumers outside the fusion: SkipGroupNorm's S output computes it


def read_site(match: Match, run: FusionRun) -> SkipGroupNormSite:
    gn, add = match.node("group_norm"), match.node("add")
    s = match.outputs[1]
    layout = "nhwc" if gn.inputs[0] is s else "nchw"
    gamma = match["gamma"]
    channels = gamma.shape[0] if gamma.shape is not None and len(gamma.shape) == 1 else None
    if not isinstance(channels, (int, np.integer)):
        raise Refusal("GroupNorm gamma is not a vector of known length")
    x, skip, skip_broadcast = split_operands(add, int(channels), layout)
    matched = {id(n) for n in match.nodes}
    keeps_sum = any(t is s for t in run.graph.outputs) or any(id(c) not in matched for c in s.outputs)
    run.details["broadcast skip" if skip_broadcast else "full skip"] += 1
    run.details["with S output" if keeps_sum else "without S output"] += 1
    return SkipGroupNormSite(gn, layout, x, skip, skip_broadcast, int(channels), s, keeps_sum)


def emit_skip_group_norm(make: Emit, site: SkipGroupNormSite) -> list[gs.Tensor]:
    """What it writes (see the diagram): [y, s] (s: the sum, for its other consumers)."""
    gn, x, skip = site.group_norm, site.x, site.skip
    if site.layout == "nchw":
        x_in = _to_nhwc(make, x)
        if site.skip_broadcast:  # (N, C, 1, 1) -> (N, C)
            skip_in = make.op.Flatten(skip, axis=1, _shape=[skip.shape[0], site.channels])
        else:
            skip_in = _to_nhwc(make, skip)
    else:
        x_in, skip_in = x, skip
    y_nhwc = make.tensor("Y", gn.outputs[0].dtype, gn.outputs[0].shape)
    outputs = [y_nhwc] + ([make.tensor("S", x_in.dtype, x_in.shape)] if site.keeps_sum else [])
    make.node("SkipGroupNorm", [x_in, gn.inputs[1], gn.inputs[2], skip_in], None, None, outputs=outputs,
              domain=MS_DOMAIN, **dict(gn.attrs))
    new_s = site.sum
    if site.keeps_sum:
        new_s = make.op.Transpose(outputs[1], perm=TO_NCHW) if site.layout == "nchw" else outputs[1]
    return [y_nhwc, new_s]


def _to_nhwc(make: Emit, t: gs.Tensor) -> gs.Tensor:
    """``t`` (NCHW) in NHWC: the source of a Transpose(0,3,1,2) as it is, else a new Transpose(0,2,3,1)."""
    from_nhwc = FROM_NHWC.match(make.graph, t.inputs[0]) if len(t.inputs) == 1 else None
    return from_nhwc["q"] if from_nhwc is not None else make.op.Transpose(t, perm=TO_NHWC)


# ---------------------------------------------------------------- the pass


@register_pass
class FuseSkipGroupNorm(Fusion, OrtFusion):
    name = "fuse-skip-group-norm"
    description = "Add (residual or time embedding) + com.microsoft GroupNorm -> SkipGroupNorm (after fuse-group-norm)"
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED, NO_DEAD_NODES})  # new tensors are annotated
    rules = (Rule(SUM_GROUP_NORM, read_site, emit_skip_group_norm, site=lambda m: m.node("group_norm")),)

    def finish(self, run: FusionRun) -> None:
        run.result.details = dict(run.details)
