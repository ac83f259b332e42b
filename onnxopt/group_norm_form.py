"""The exporters' GroupNorm, read: what makes Reshape-InstanceNormalization-Reshape-Mul-Add a GroupNorm.

Both exporters write nn.GroupNorm as (the restore shape is ``Shape(x)`` in dynamic exports, a
constant in static or folded ones)::

    x ─ Reshape([0|N, G, -1]) ─ InstanceNormalization(scale=1, B=0, ε) ─ Reshape(Shape(x) | x's shape) ─ Mul(γ) ─ Add(β) ─ y

:func:`grouped_instance_norm` is that pattern without the affine Mul/Add; the checks below raise
:class:`onnxopt.fusion.Refusal` with the reason when a match is not provably a GroupNorm. Shared by
fuse-group-norm (com.microsoft GroupNorm) and trt-group-norm (GroupNormalization-21).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.fusion import Refusal
from onnxopt.pattern import Const, OneOf, Var, op
from onnxopt.weights import numpy_dtype

GROUP_NORM_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))


def grouped_instance_norm(x):
    """The normalization part of the exporters' GroupNorm (no affine yet); the InstanceNormalization is ``norm``."""
    grouped = op.Reshape(x, Const.named("group_shape"), allowzero=Var("group_allowzero"))
    normed = op.InstanceNormalization(
        grouped, Const.named("in_scale"), Const.named("in_bias"), epsilon=Var("epsilon"), _name="norm"
    )
    whole_shape = op.Shape(x, start=0, end=None, _external_uses=True)  # a shared Shape(x) may stay for others
    return op.Reshape(normed, OneOf(whole_shape, Const.named("restore_shape")), allowzero=Var("restore_allowzero"))


def grouped_instance_norm_affine(x):
    """The whole exporters' GroupNorm: γ and β as ``gamma`` and ``beta``."""
    return grouped_instance_norm(x) * Const.named("gamma") + Const.named("beta")


# A β of exactly 0 or a γ of exactly 1 leaves no Add or no Mul: the exporter may not write it, and
# cleanup (remove-neutral-arithmetic, canonicalize-attention's zero-bias rule) removes ``+ 0`` and
# ``* 1``. What is left is still a GroupNorm, with β = 0 or γ = 1.


def grouped_instance_norm_scaled(x):
    """The exporters' GroupNorm with β = 0: no Add after the Mul."""
    return grouped_instance_norm(x) * Const.named("gamma")


def grouped_instance_norm_shifted(x):
    """The exporters' GroupNorm with γ = 1: no Mul before the Add."""
    return grouped_instance_norm(x) + Const.named("beta")


def affine_or_not(x):
    """Any of the four: with γ and β, without the Add, without the Mul, without either (for a
    pattern whose root follows the GroupNorm, such as a SiLU, where no partial match is possible)."""
    return OneOf(grouped_instance_norm_affine(x), grouped_instance_norm_scaled(x),
                 grouped_instance_norm_shifted(x), grouped_instance_norm(x))


def rank_and_channels(x: gs.Tensor) -> tuple[int, int]:
    if x.shape is None:
        raise Refusal("the input's rank is unknown (shape inference gave it no shape)")
    rank = len(x.shape)
    if rank not in (3, 4):
        raise Refusal(f"input is {rank}-D; GroupNorm takes 4-D (and 3-D via a reshape) only")
    channels = x.shape[1]
    if not isinstance(channels, (int, np.integer)) or channels <= 0:
        raise Refusal(f"the input's channel count is not a known number ({channels!r})")
    if x.dtype is not None and numpy_dtype(x.dtype) not in GROUP_NORM_DTYPES:
        raise Refusal(f"input is {numpy_dtype(x.dtype)}; GroupNorm takes float16 or float32")
    return rank, int(channels)


def groups_from_reshape(group_shape: np.ndarray, allowzero: bool, x: gs.Tensor, channels: int) -> int:
    shape = [int(v) for v in np.asarray(group_shape).reshape(-1)]
    if len(shape) != 3:
        raise Refusal(f"the first Reshape's shape {shape} is not [N, G, -1]")
    batch, groups, rest = shape
    if not ((batch == 0 and not allowzero) or batch == x.shape[0]):
        raise Refusal(f"the first Reshape's shape {shape} does not keep the batch dim ({x.shape[0]!r})")
    if groups <= 0:
        raise Refusal(f"the first Reshape's shape {shape} is not [N, G, -1]")
    check_divides(groups, channels)
    if rest != -1:
        spatial = x.shape[2:]
        if not all(isinstance(d, (int, np.integer)) for d in spatial) or rest != channels // groups * math.prod(spatial):
            raise Refusal(f"the first Reshape's shape {shape} is not [N, G, -1]")
    return groups


def check_divides(groups: int, channels: int) -> None:
    if groups <= 0 or channels % groups:
        raise Refusal(f"group count {groups} does not divide the channel count {channels}")


def check_instance_norm_is_plain(scale: np.ndarray, bias: np.ndarray, groups: int) -> None:
    if scale.shape != (groups,) or bias.shape != (groups,):
        raise Refusal(f"InstanceNormalization scale/B have shapes {scale.shape}/{bias.shape}, expected ({groups},)")
    if not np.all(scale == 1):
        raise Refusal("InstanceNormalization scale is not all ones (a per-group scale, not GroupNorm's per-channel γ)")
    if not np.all(bias == 0):
        raise Refusal("InstanceNormalization B is not all zeros (a per-group shift, not GroupNorm's per-channel β)")


def check_restores_shape(restore: np.ndarray, allowzero: bool, x: gs.Tensor) -> None:
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
        raise Refusal(f"the second Reshape's shape {restore} does not provably restore the input's shape {target}")


def per_channel(what: str, value: np.ndarray, rank: int, channels: int) -> np.ndarray:
    """``value`` as a float32 (C,) vector, if it broadcasts against x as one number per channel."""
    shape = value.shape
    aligned = (1,) * (rank - len(shape)) + tuple(shape)
    if len(shape) > rank or any(d != 1 for i, d in enumerate(aligned) if i != 1) or aligned[1] not in (1, channels):
        want = ", ".join([str(channels)] + ["1"] * (rank - 2))
        raise Refusal(f"{what} has shape {tuple(shape)}, not per channel for a {rank}-D input (want ({want}))")
    return np.broadcast_to(value.reshape(-1).astype(np.float32), (channels,)).copy()
