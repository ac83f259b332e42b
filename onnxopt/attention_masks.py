"""Attention masks and scores, proven: causal masks as the exporters build them, and scores Softmax
cannot turn into NaN. Shared by canonicalize-attention and fuse-attention.

* :func:`is_causal` / :func:`keeps_causal`: an additive mask (or a boolean keep-mask) hides key j from
  query i exactly when j > i, S == L among the given sequence lengths: a constant mask, TorchScript's
  ``Where(Trilu(...) == 0, -inf, 0)``, transformers' ``kv_idx <= q_idx`` ranges, or transformers 4's
  ``_make_causal_mask``: ``Where(j < i + 1, 0, min)``, unsqueezed, expanded over the batch and sliced
  to the key length (optimum's CLIP export).
* :func:`nan_free_scores`: no row of Softmax(scores) can be all -inf.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.pattern import Const, Match, OneOf, Pattern, constant_value, is_constant, is_zero_constant
from onnxopt.pattern import op as std_op
from onnxopt.pattern.dims import Dim, Dims, same

# An additive mask entry at or below this hides its key exactly: exp(s + m - max) is 0 in fp32.
HIDDEN = -1e30


def causal_mask_from_trilu(shape, one=Const(), hidden=Const()):
    """TorchScript's SDPA(is_causal=True): where(tril(ones(S, L)) == 0, -inf, 0)"""
    lower = std_op.Trilu(std_op.Expand(one, shape), upper=0, _name="trilu", _extra_inputs=True)
    return std_op.Where(std_op.Equal(lower, 0.0), hidden, 0.0)


def causal_keep_from_ranges(key_index, query_index, shape):
    """transformers' boolean causal mask (True: attend): kv_idx <= q_idx, broadcast to (B, 1, S, L)"""
    keep = OneOf(std_op.LessOrEqual(key_index, query_index), std_op.GreaterOrEqual(query_index, key_index))
    return OneOf(std_op.Expand(keep, shape), keep)


def causal_mask_from_ranges(key_index, query_index, shape, hidden=Const()):
    """transformers' causal mask: where(kv_idx <= q_idx, 0, min), broadcast to (B, 1, S, L)"""
    return std_op.Where(causal_keep_from_ranges(key_index, query_index, shape), 0.0, hidden)


def causal_mask_from_next_row(key_index, next_query_index, fill):
    """transformers 4's _make_causal_mask: full((S, S), min).masked_fill(j < (i + 1).view(S, 1), 0)"""
    keep = std_op.Less(key_index, next_query_index)
    return std_op.Where(OneOf(std_op.Cast(keep, to=onnx.TensorProto.BOOL), keep), 0.0, fill)


CAUSAL_MASK = Pattern(causal_mask_from_trilu, name="causal-mask-trilu")
CAUSAL_MASK_NEXT_ROW = Pattern(causal_mask_from_next_row, name="causal-mask-next-row")
CAUSAL_MASK_RANGES = Pattern(causal_mask_from_ranges, name="causal-mask-ranges")
CAUSAL_KEEP_RANGES = Pattern(
    lambda key_index, query_index, shape: std_op.Expand(std_op.LessOrEqual(key_index, query_index), shape),
    lambda key_index, query_index, shape: std_op.Expand(std_op.GreaterOrEqual(query_index, key_index), shape),
    lambda key_index, query_index: std_op.LessOrEqual(key_index, query_index),
    lambda key_index, query_index: std_op.GreaterOrEqual(query_index, key_index),
    name="causal-keep-ranges",
)



def is_causal(graph, mask: gs.Tensor, dims: Dims, seq: set) -> bool:
    """The mask hides key j from query i exactly when j > i (and S == L): MHA's unidirectional."""
    value = _constant_mask_value(mask)
    if value is not None:
        if value.ndim < 2 or value.shape[-1] != value.shape[-2] or not any_same(Dim(value.shape[-1]), seq):
            return False
        upper = np.triu(np.ones(value.shape[-2:], dtype=bool), k=1)
        return bool(np.all(value[..., ~upper] == 0) and np.all(value[..., upper] <= HIDDEN))
    producer = mask.inputs[0] if len(mask.inputs) == 1 else None
    if producer is None:
        return False
    found = CAUSAL_MASK.match(graph, producer)
    if found is not None:
        return _trilu_mask_is_causal(found, dims, seq)
    found = CAUSAL_MASK_RANGES.match(graph, producer)
    if found is not None:
        return _range_mask_is_causal(found, dims, seq)
    core = _through_layout(mask, dims)
    found = CAUSAL_MASK_NEXT_ROW.match(graph, core.inputs[0]) if core is not None and core.inputs else None
    return found is not None and _next_row_mask_is_causal(found, dims, seq)


# Ops that, where they keep the last two dims (proven), keep the (S, L) matrix of a mask as it is:
# Expand and Unsqueeze add leading axes, a Cast between floats keeps -3.4e38 hidden (fp16: -inf),
# and a Slice [0:end] (start 0, step 1) whose every axis keeps its length is the whole tensor.
_LAYOUT_OPS = ("Expand", "Unsqueeze", "Cast", "Identity", "Slice")


def _through_layout(t: gs.Tensor, dims: Dims, depth: int = 8) -> gs.Tensor | None:
    """The tensor under ``t``'s layout ops, whose last two axes hold the same (S, L) matrix."""
    while depth and _producer(t) is not None and _producer(t).op in _LAYOUT_OPS:
        node, depth = _producer(t), depth - 1
        source = node.inputs[0]
        before, after = dims.shape(source), dims.shape(t)
        if before is None or after is None or len(before) < 2 or not all(same(a, b) for a, b in zip(before[-2:], after[-2:])):
            return None
        if node.op == "Cast" and int(node.attrs["to"]) not in _FLOAT_TYPES:
            return None
        if node.op == "Slice" and not _whole_slice(node, dims, before, after):
            return None
        t = source
    return t


def _whole_slice(node: gs.Node, dims: Dims, before: list, after: list) -> bool:
    """A Slice from 0 with step 1 whose every axis keeps its length (a reversing one may too)."""
    starts = dims.vector(node.inputs[1])
    steps = dims.vector(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4].name else None
    return (starts is not None and all(same(d, Dim(0)) for d in starts)
            and (steps is None or all(same(d, Dim(1)) for d in steps))
            and len(before) == len(after) and all(same(a, b) for a, b in zip(before, after)))


_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)


def _next_row_mask_is_causal(m: Match, dims: Dims, seq: set) -> bool:
    """Where(j < i + 1, 0, fill): j along the last axis, i along the one before, fill all hidden and
    no larger than the (S, L) matrix the comparison gives."""
    fill = m["fill"]
    value = _hidden_fill(fill)
    if value is None or np.any(value > HIDDEN):
        return False
    key, query = _arange_axis(m["key_index"], dims, shifted=True), _arange_axis(m["next_query_index"], dims, shifted=True)
    if key is None or query is None:
        return False
    (key_axis, key_len, key_shift), (query_axis, query_len, query_shift) = key, query
    if (key_shift, query_shift) != (0, 1):  # j < i + 1: j <= i
        return False
    if not (key_axis == -1 and query_axis == -2 and any_same(key_len, seq) and any_same(query_len, seq)):
        return False
    fill_shape, out_shape = dims.shape(fill), dims.shape(m.output)
    return (fill_shape is not None and out_shape is not None and len(fill_shape) <= 2 and len(out_shape) == 2
            and all(any_same(d, seq) for d in out_shape))


def _hidden_fill(t: gs.Tensor) -> np.ndarray | None:
    """The values of a constant fill, or of ConstantOfShape's value."""
    if is_constant(t):
        return constant_value(t)
    node = _producer(t)
    if node is not None and node.op == "ConstantOfShape" and node.attrs.get("value") is not None:
        return np.asarray(node.attrs["value"].values)
    return None


def _constant_mask_value(t: gs.Tensor, depth: int = 0) -> np.ndarray | None:
    """The mask's value when constants alone determine it (a folded mask, or a Where of constants)."""
    if is_constant(t):
        return constant_value(t)
    node = t.inputs[0] if len(t.inputs) == 1 else None
    if node is None or depth > 4 or node.op != "Where":
        return None
    parts = [_constant_mask_value(x, depth + 1) for x in node.inputs]
    if any(p is None for p in parts) or parts[0].dtype != bool:
        return None
    return np.where(*parts)


def _trilu_mask_is_causal(m: Match, dims: Dims, seq: set) -> bool:
    trilu = m.node("trilu")
    if len(trilu.inputs) > 1 and trilu.inputs[1].name and not is_zero_constant(trilu.inputs[1]):
        return False  # a diagonal offset
    one, hidden = constant_value(m["one"]), constant_value(m["hidden"])
    if one.size != 1 or one.reshape(-1)[0] == 0 or np.any(hidden > HIDDEN):
        return False
    shape = dims.vector(m["shape"])
    return shape is not None and len(shape) == 2 and all(any_same(d, seq) for d in shape)


def keeps_causal(graph: gs.Graph, keep: gs.Tensor, dims: Dims, seq: set) -> bool:
    """The boolean mask ``keep`` (True: attend) is True exactly where key j <= query i, its lengths
    among ``seq``: ONNX Attention's causal attn_mask as the dynamo exporter writes CLIP's."""
    producer = keep.inputs[0] if len(keep.inputs) == 1 else None
    found = CAUSAL_KEEP_RANGES.match(graph, producer) if producer is not None else None
    return found is not None and _ranges_are_causal(found, dims, seq)


def _range_mask_is_causal(m: Match, dims: Dims, seq: set) -> bool:
    if np.any(constant_value(m["hidden"]) > HIDDEN):
        return False
    return _ranges_are_causal(m, dims, seq)


def _ranges_are_causal(m: Match, dims: Dims, seq: set) -> bool:
    key, query = _arange_axis(m["key_index"], dims), _arange_axis(m["query_index"], dims)
    if key is None or query is None:
        return False
    (key_axis, key_len), (query_axis, query_len) = key, query
    return key_axis == -1 and query_axis == -2 and any_same(key_len, seq) and any_same(query_len, seq)


def _arange_axis(t: gs.Tensor, dims: Dims, *, shifted: bool = False) -> tuple | None:
    """(axis from the end, n) when ``t`` is arange(n) laid along one axis, every other dim 1;
    ``shifted``: (axis, n, c) for arange(n) + c, c an integer constant."""
    source, shift = t, 0
    while source.inputs and (source.inputs[0].op in ("Unsqueeze", "Reshape", "Cast") or shifted and source.inputs[0].op == "Add"):
        node = source.inputs[0]
        if node.op == "Add":
            a, b = node.inputs
            x, c = (a, b) if is_constant(b) else (b, a)
            value = constant_value(c) if is_constant(c) else None
            if value is None or value.size != 1 or not np.issubdtype(value.dtype, np.integer):
                return None
            shift += int(value.reshape(-1)[0])
            source = x
            continue
        source = node.inputs[0]
    if not source.inputs or source.inputs[0].op != "Range":
        return None
    start, delta = (dims.scalar(source.inputs[0].inputs[i]) for i in (0, 2))
    if shifted and not (same(start, Dim(0)) and same(delta, Dim(1))):  # arange(n): 0, 1, ..., n - 1
        return None
    length = dims.shape(source)
    shape = dims.shape(t)
    if length is None or shape is None or len(length) != 1:
        return None
    long_axes = [i for i, d in enumerate(shape) if not same(d, Dim(1))]
    if len(long_axes) != 1 or not same(shape[long_axes[0]], length[0]):
        return None
    return (long_axes[0] - len(shape), length[0]) + ((shift,) if shifted else ())


def any_same(d: Dim | None, candidates: set) -> bool:
    return any(same(d, c) for c in candidates)




def nan_free_scores(scores: gs.Tensor) -> str | None:
    """None when no row of Softmax(scores) can be all -inf (so Softmax never yields NaN), else why not.

    Scores are a MatMul (optionally scaled by a finite constant), optionally plus a mask whose
    every value is finite.
    """
    node = _producer(scores)
    if node is not None and node.op == "Add":
        a, b = node.inputs
        core, mask = (a, b) if _is_scores(a) else (b, a)
        if not _is_scores(core):
            return f"'{scores.name}' is not attention scores plus a mask"
        if not provably_finite(mask):
            return f"mask '{mask.name}' may hold -inf: a fully masked row would make Softmax NaN"
        return None
    return None if _is_scores(scores) else f"'{scores.name}' is not attention scores"


def provably_finite(t: gs.Tensor) -> bool:
    """Every value of ``t`` is finite: finite constants, selected, broadcast or reshaped."""
    if is_constant(t):
        value = constant_value(t)
        return np.issubdtype(value.dtype, np.floating) and bool(np.all(np.isfinite(value)))
    node = _producer(t)
    if node is None:
        return False
    if node.op == "Where":
        return provably_finite(node.inputs[1]) and provably_finite(node.inputs[2])
    if node.op in ("Expand", "Reshape", "Unsqueeze", "Squeeze", "Identity", "Transpose"):
        return provably_finite(node.inputs[0])
    if node.op == "Cast":
        return int(node.attrs["to"]) in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE) and provably_finite(node.inputs[0])
    return False


def _is_scores(t: gs.Tensor) -> bool:
    node = _producer(t)
    if node is None:
        return False
    if node.op in ("Mul", "Div"):
        a, b = node.inputs
        factor = b if node.op == "Div" or is_constant(b) else a
        other = a if factor is b else b
        return provably_finite(factor) and _is_scores(other)
    if node.op == "Cast":
        return _is_scores(node.inputs[0])
    return node.op == "MatMul"


def _producer(t: gs.Tensor) -> gs.Node | None:
    return t.inputs[0] if isinstance(t, gs.Variable) and len(t.inputs) == 1 else None
