"""What a fusion's check can know about a matched tensor beyond its producer op: its annotated
dims, and the integers that shape arithmetic computes from them.

Exporters compute slice bounds, split sizes and reshape targets at run time from ``Shape``
(TorchScript: ``Shape -> Gather -> Add -> Div -> Mul``); after shape inference most of those
values are fixed by the static dims they read. The one evaluator of that arithmetic is
:class:`onnxopt.pattern.dims.Dims`; here it reads the annotations only (``Dims(annotated_only=True)``):
a ``Shape`` of a tensor with symbolic dims yields symbols for those dims only, and the value counts
as static when every element of the result is an integer. So ``Gather(Shape(h), -1)`` is static
when ``h``'s last dim is, whatever its batch dim is::

    static_ints(slice_node.inputs[2])     # [64] or None
    static_dims(tensor)                    # [None, None, 128]: ints, None where symbolic/unknown
    dims_agree("batch", "batch")           # True: proven equal
    dims_conflict(1, "batch")              # True: static evidence of broadcasting

Weights are never loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_graphsurgeon as gs

from .constants import constant_shape, is_constant
from .dims import Dims


def static_ints(tensor: gs.Tensor | None) -> list[int] | None:
    """The integers ``tensor`` holds if constants and static dims determine them (flattened), else None."""
    if tensor is None:
        return None
    values = Dims(annotated_only=True).vector(tensor)
    if values is None or any(d is None or not d.is_int for d in values):
        return None
    return [d.value for d in values]


def static_value(tensor: gs.Tensor | None) -> np.ndarray | None:
    """``static_ints`` as an int64 vector (None if not static)."""
    ints = static_ints(tensor)
    return None if ints is None else np.array(ints, dtype=np.int64)


# ---------------------------------------------------------------- dims


def shape_of(tensor: gs.Tensor | None) -> list | None:
    """The tensor's shape as inferred (ints and symbol strings; None entries unknown), or None."""
    if tensor is None:
        return None
    if is_constant(tensor) and not isinstance(tensor, gs.Constant):
        shape = constant_shape(tensor)
        return list(shape) if shape is not None else None
    shape = tensor.shape
    return None if shape is None else list(shape)


def rank_of(tensor: gs.Tensor | None) -> int | None:
    shape = shape_of(tensor)
    return None if shape is None else len(shape)


def static_dims(tensor: gs.Tensor | None) -> list[int | None] | None:
    """The shape with every non-static dim as None (None if the rank is unknown)."""
    shape = shape_of(tensor)
    return None if shape is None else [_static(d) for d in shape]


def static_dim(tensor: gs.Tensor | None, axis: int) -> int | None:
    dims = static_dims(tensor)
    if dims is None or not -len(dims) <= axis < len(dims):
        return None
    return dims[axis]


def normalize_axis(axis: int, rank: int | None) -> int | None:
    """``axis`` in [0, rank), or None when it is negative and the rank is unknown or out of range."""
    if axis < 0:
        if rank is None:
            return None
        axis += rank
    if rank is not None and not 0 <= axis < rank:
        return None
    return axis


def dims_agree(a, b) -> bool:
    """Proven equal: the same static int, or the same symbol (shape inference names one dim once)."""
    sa, sb = _static(a), _static(b)
    if sa is not None or sb is not None:
        return sa is not None and sa == sb
    return isinstance(a, str) and bool(a) and a == b


def dims_conflict(a, b) -> bool:
    """Static evidence that two aligned dims differ or broadcast: different ints, or a static 1
    against a dim that is not a static 1. Two unknown or symbolic dims never conflict."""
    sa, sb = _static(a), _static(b)
    if sa is not None and sb is not None:
        return sa != sb
    return sa == 1 or sb == 1


def _static(dim) -> int | None:
    if isinstance(dim, (int, np.integer)) and not isinstance(dim, bool) and dim >= 0:
        return int(dim)
    return None


__all__: Sequence[str] = (
    "dims_agree",
    "dims_conflict",
    "normalize_axis",
    "rank_of",
    "shape_of",
    "static_dim",
    "static_dims",
    "static_ints",
    "static_value",
)
