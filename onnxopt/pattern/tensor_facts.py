"""What a fusion's check can know about a matched tensor beyond its producer op.

Exporters compute slice bounds, split sizes and reshape targets at run time from ``Shape``
(TorchScript: ``Shape -> Gather -> Add -> Div -> Mul``); after shape inference most of those
values are fixed by the static dims they read. ``static_value`` evaluates such shape arithmetic
without running the model: every element carries a "known" flag, a ``Shape`` of a tensor with
symbolic dims yields unknown elements for those dims only, and the value counts as static when
every element of the result is known. So ``Gather(Shape(h), -1)`` is static when ``h``'s last dim
is, whatever its batch dim is::

    static_value(slice_node.inputs[2])    # array([64]) or None
    static_dims(tensor)                    # [None, None, 128]: ints, None where symbolic/unknown
    dims_agree("batch", "batch")           # True: proven equal
    dims_conflict(1, "batch")              # True: static evidence of broadcasting

Only small integer/float shape arithmetic is evaluated (constants of at most 64 elements, the ops
listed in ``_EVALUATORS``); anything else is "not static". Weights are never loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.graph_edit import is_absent

from .constants import constant_shape, constant_value, is_constant

MAX_ELEMENTS = 64  # shape arithmetic is tiny; anything larger is not what static_value is for
_MAX_DEPTH = 48

# A partially known value: the numbers, and a same-shaped bool array saying which are known.
Partial = tuple[np.ndarray, np.ndarray]


def static_value(tensor: gs.Tensor | None) -> np.ndarray | None:
    """The value of ``tensor`` if constants and static dims determine it, else None."""
    partial = _evaluate(tensor, {}, 0)
    if partial is None or not partial[1].all():
        return None
    return partial[0]


def static_ints(tensor: gs.Tensor | None) -> list[int] | None:
    """``static_value`` as a flat list of Python ints (None if not static or not integral)."""
    value = static_value(tensor)
    if value is None or not (np.issubdtype(value.dtype, np.integer) or np.all(np.mod(value, 1) == 0)):
        return None
    return [int(v) for v in value.reshape(-1)]


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


# ---------------------------------------------------------------- the evaluator


def _evaluate(tensor, memo: dict[int, Partial | None], depth: int) -> Partial | None:
    if tensor is None or depth > _MAX_DEPTH:
        return None
    key = id(tensor)
    if key in memo:
        return memo[key]
    memo[key] = None  # a cycle (there should be none) reads as "not static"
    memo[key] = result = _evaluate_uncached(tensor, memo, depth)
    return result


def _evaluate_uncached(tensor, memo, depth) -> Partial | None:
    if is_constant(tensor):
        shape = constant_shape(tensor)
        if shape is None or int(np.prod(shape)) > MAX_ELEMENTS:
            return None
        value = constant_value(tensor)
        if value is None or not (np.issubdtype(value.dtype, np.number) or value.dtype == bool):
            return None
        return value, np.ones(value.shape, dtype=bool)
    if not isinstance(tensor, gs.Variable) or len(tensor.inputs) != 1:
        return None  # a graph input (values unknown) or an odd graph
    node = tensor.inputs[0]
    if node.domain not in ("", "ai.onnx", None) or node.outputs[0] is not tensor:
        return None
    evaluator = _EVALUATORS.get(node.op)
    if evaluator is None:
        return None

    def operand(i: int) -> Partial | None:
        if i >= len(node.inputs) or is_absent(node.inputs[i]):
            return None
        return _evaluate(node.inputs[i], memo, depth + 1)

    try:
        with np.errstate(all="ignore"):
            result = evaluator(node, operand)
    except (ValueError, IndexError, TypeError, KeyError, OverflowError):
        return None
    if result is None or result[0].size > MAX_ELEMENTS:
        return None
    return result



def _known_ints(partial: Partial | None) -> list[int] | None:
    if partial is None or not partial[1].all():
        return None
    return [int(v) for v in partial[0].reshape(-1)]


def _shape(node, operand):
    dims = shape_of(node.inputs[0])
    if dims is None:
        return None
    rank = len(dims)
    start = _clamp(int(node.attrs.get("start", 0)), rank)
    end = _clamp(int(node.attrs.get("end", rank)), rank)
    dims = dims[start:end]
    values = np.array([_static(d) or 0 for d in dims], dtype=np.int64)
    known = np.array([_static(d) is not None for d in dims], dtype=bool)
    return values, known


def _clamp(index: int, rank: int) -> int:
    if index < 0:
        index += rank
    return min(max(index, 0), rank)


def _size(node, operand):
    dims = static_dims(node.inputs[0])
    if dims is None or any(d is None for d in dims):
        return None
    return np.array(int(np.prod(dims)), dtype=np.int64), np.array(True)


def _gather(node, operand):
    data, indices = operand(0), _known_ints(operand(1))
    if data is None or indices is None:
        return None
    idx = np.array(indices, dtype=np.int64).reshape(operand(1)[0].shape)
    axis = int(node.attrs.get("axis", 0))
    return np.take(data[0], idx, axis=axis), np.take(data[1], idx, axis=axis)


def _slice(node, operand):
    data = operand(0)
    starts, ends = _known_ints(operand(1)), _known_ints(operand(2))
    if data is None or starts is None or ends is None:
        return None
    axes = _known_ints(operand(3)) if len(node.inputs) > 3 and not is_absent(node.inputs[3]) else list(range(len(starts)))
    steps = _known_ints(operand(4)) if len(node.inputs) > 4 and not is_absent(node.inputs[4]) else [1] * len(starts)
    if axes is None or steps is None or any(s <= 0 for s in steps):
        return None  # negative steps clamp differently from Python slices; shape code does not use them
    index = [slice(None)] * data[0].ndim
    for start, end, axis, step in zip(starts, ends, axes, steps):
        index[axis] = slice(start, end, step)
    return data[0][tuple(index)], data[1][tuple(index)]


def _concat(node, operand):
    parts = [operand(i) for i in range(len(node.inputs))]
    if any(p is None for p in parts):
        return None
    axis = int(node.attrs["axis"])
    return np.concatenate([p[0] for p in parts], axis=axis), np.concatenate([p[1] for p in parts], axis=axis)


def _axes(node, operand) -> list[int] | None:
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    if len(node.inputs) > 1 and not is_absent(node.inputs[1]):
        return _known_ints(operand(1))
    return []


def _unsqueeze(node, operand):
    data, axes = operand(0), _axes(node, operand)
    if data is None or not axes:
        return None
    rank = data[0].ndim + len(axes)
    axes = sorted(a + rank if a < 0 else a for a in axes)
    return np.expand_dims(data[0], axes), np.expand_dims(data[1], axes)


def _squeeze(node, operand):
    data, axes = operand(0), _axes(node, operand)
    if data is None or axes is None:
        return None
    axes = tuple(a + data[0].ndim if a < 0 else a for a in axes) or None
    return np.squeeze(data[0], axis=axes), np.squeeze(data[1], axis=axes)


def _reshape(node, operand):
    data, target = operand(0), _known_ints(operand(1))
    if data is None or target is None:
        return None
    if not node.attrs.get("allowzero", 0):
        target = [data[0].shape[i] if t == 0 else t for i, t in enumerate(target)]
    return data[0].reshape(target), data[1].reshape(target)


def _identity(node, operand):
    return operand(0)


def _cast(node, operand):
    data = operand(0)
    if data is None:
        return None
    dtype = onnx.helper.tensor_dtype_to_np_dtype(int(node.attrs["to"]))
    if not (np.issubdtype(dtype, np.number) or dtype == bool):
        return None
    return data[0].astype(dtype), data[1]


def _int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ONNX integer Div truncates toward zero (numpy's // floors)."""
    quotient = np.abs(a) // np.abs(b)
    return quotient * np.sign(a) * np.sign(b)


def _binary(fn):
    def evaluate(node, operand):
        a, b = operand(0), operand(1)
        if a is None or b is None:
            return None
        known = np.logical_and(*np.broadcast_arrays(a[1], b[1]))
        rhs = np.where(b[1], b[0], np.ones_like(b[0]))  # unknown elements must not divide by zero
        return fn(node, a[0], rhs).astype(np.result_type(a[0], b[0])), known

    return evaluate


def _div(node, a, b):
    if np.issubdtype(a.dtype, np.integer) and np.issubdtype(b.dtype, np.integer):
        return _int_div(a, b)
    return a / b


def _mod(node, a, b):
    return np.fmod(a, b) if node.attrs.get("fmod", 0) else np.mod(a, b)


def _unary(fn):
    def evaluate(node, operand):
        a = operand(0)
        return None if a is None else (np.asarray(fn(a[0])).astype(a[0].dtype), a[1])

    return evaluate


_EVALUATORS = {
    "Shape": _shape,
    "Size": _size,
    "Gather": _gather,
    "Slice": _slice,
    "Concat": _concat,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Reshape": _reshape,
    "Identity": _identity,
    "Cast": _cast,
    "Add": _binary(lambda n, a, b: a + b),
    "Sub": _binary(lambda n, a, b: a - b),
    "Mul": _binary(lambda n, a, b: a * b),
    "Div": _binary(_div),
    "Mod": _binary(_mod),
    "Max": _binary(lambda n, a, b: np.maximum(a, b)),
    "Min": _binary(lambda n, a, b: np.minimum(a, b)),
    "Neg": _unary(np.negative),
    "Abs": _unary(np.abs),
    "Floor": _unary(np.floor),
    "Ceil": _unary(np.ceil),
    "Sqrt": _unary(np.sqrt),
}

__all__: Sequence[str] = (
    "MAX_ELEMENTS",
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
