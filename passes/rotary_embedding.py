"""fuse-rotary-embedding: the interleaved rotary embedding (Flux's RoPE) -> com.microsoft RotaryEmbedding.

What it matches (diffusers' ``apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=-1)``, both exporters)::

    pairs   = Reshape(x, (.., H/2, 2))
    even    = pairs[..., 0]       Slice(0:1)+Squeeze | Gather(0) | Split(1, 1)[0]+Squeeze | x[..., 0::2]
    odd     = pairs[..., 1]       Slice(1:2)+Squeeze | Gather(1) | Split(1, 1)[1]+Squeeze | x[..., 1::2]
    rotated = Reshape(Concat(Unsqueeze(Neg(odd), -1), Unsqueeze(even, -1), axis=-1), x's shape)
    y       = x * cos + rotated * sin          cos, sin: Unsqueeze..(table (T, H))
            | Cast(x, FLOAT) * cos + Cast(rotated, FLOAT) * sin     (a bfloat16/float16 export: diffusers
                                                   computes ``x.float() * cos + ...`` and casts y back)

What it writes::

    half(t) = Slice(t, 0:H:2 on the last axis)                  one per table, shared by its sites
    x (B, S, N, H):  y = Reshape(RotaryEmbedding(Reshape(x, (0, 0, N*H)), [0], half(cos), half(sin),
                                                 interleaved=1, num_heads=N), (0, 0, N, H))
    x (B, N, S, H):  y = RotaryEmbedding(x, [0], half(cos), half(sin), interleaved=1)

    position_ids [0]: token s reads row s of the tables. Where the export upcasts, the kernel reads
    Cast(x, FLOAT) and computes in float32 as the export does (the Cast back after y stays): ONNX
    Runtime's bfloat16 RotaryEmbedding CUDA kernel multiplies and adds in bfloat16
    (contrib_ops/cuda/bert/rotary_embedding_impl.cu), rounding three times where the export rounds once.

    and ONNX's RotaryEmbedding (opset 23), which ort-cuda counts as unfused, as the contrib op:
    RotaryEmbedding(x, cos, sin, position_ids) -> com.microsoft RotaryEmbedding(x, position_ids, cos, sin)
    (same attributes); without position_ids its per-batch (B, S, R/2) tables become one (B*S, R/2)
    table and token (b, s) reads row b*S + s.

Conditions (a site that fits the diagram but fails one is refused, with the reason):
    * x is 4-D with a constant, even head size H; the pairs Reshape ends in 2 and the rotated
      Reshape gives x's shape back (every dim but one proven x's: the element count fixes that one),
      so the pairs are channels (2i, 2i+1) of a head.
    * The odd channel is the negated one: (x1, x2) -> (-x2, x1), the rotation by +angle.
    * cos and sin are tables (T, H) broadcast over batch and heads, T on x's sequence axis, each
      proven pair-repeated (``t[..., 2i] == t[..., 2i+1]``): a Concat on the last axis of
      pair-repeated parts, ``repeat_interleave(2)`` as the exporters write it
      (Reshape/Flatten(Expand/Tile(Unsqueeze(a, -1), (1, .., 2)))), an elementwise op of one, or a
      constant that is. The kernel reads one angle per pair: only then is it the same rotation.
    * T and the sequence length: equal where proven; where they come from different inputs
      (Flux: txt_ids/img_ids and the token counts) they broadcast in the source Mul, and neither is
      taken to be 1 (a one-row table, or one token, under a multi-row table is not a rotary embedding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto

from onnxopt.dim_sources import proven_dim
from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.pass_infra import SHAPES_INFERRED, OrtFusion
from onnxopt.pattern import Const, Match, Maybe, OneOf, Pattern, Var, constant_value, is_constant, op, reads_only_shape
from onnxopt.pattern.dims import Dim, Dims, same, text
from onnxopt.registry import register_pass

FLOAT = TensorProto.FLOAT

# ---------------------------------------------------------------- the pattern


def _rotated(pairs, even, odd):
    """stack([-odd, even], -1).flatten(-2): each pair (x1, x2) becomes (-x2, x1)"""
    stacked = op.Concat(op.Unsqueeze(op.Neg(odd), Var("neg_axes")), op.Unsqueeze(even, Var("even_axes")),
                        axis=Var("stack_axis"), _name="stack", _external_uses=reads_only_shape)
    return op.Reshape(stacked, Var("rotated_shape"), _name="rotated")


def _channel(pairs, t: str):
    """pairs[..., i] by Slice+Squeeze or Gather"""
    sliced = op.Slice(pairs, *(Const.named(f"{t}_slice_{k}") for k in ("starts", "ends", "axes")),
                      _name=f"{t}_slice", _extra_inputs=True)
    return [op.Squeeze(sliced, Const.named(f"{t}_squeeze_axes"), _name=f"{t}_squeeze"),
            op.Gather(pairs, Const.named(f"{t}_index"), axis=Var(f"{t}_gather_axis"), _name=f"{t}_gather")]


def _rotary(x, cos, sin, rotated):
    """x * cos + rotated * sin, in float32 between Casts where x is bfloat16 or float16"""
    xf = Maybe(op.Cast, x, to=FLOAT, _name="upcast", _external_uses=True)
    rotated_f = Maybe(op.Cast, rotated, to=FLOAT, _name="rotated_upcast")
    return op.Add(op.Mul(xf, cos, _name="cos_mul"), op.Mul(rotated_f, sin, _name="sin_mul"))


def rotary_sliced(x, cos, sin):
    pairs = op.Reshape(x, Var("pairs_shape"), _name="pairs")
    even, odd = (OneOf(*_channel(pairs, t)) for t in ("even", "odd"))
    return _rotary(x, cos, sin, _rotated(pairs, even, odd))


def rotary_split(x, cos, sin):
    pairs = op.Reshape(x, Var("pairs_shape"), _name="pairs")
    first, second = op.Split(pairs, Var("split_sizes", optional=True), axis=Var("split_axis"), _outputs=2, _name="split",
                             _extra_inputs=True)
    even = op.Squeeze(first, Const.named("even_squeeze_axes"), _name="even_squeeze")
    odd = op.Squeeze(second, Const.named("odd_squeeze_axes"), _name="odd_squeeze")
    return _rotary(x, cos, sin, _rotated(pairs, even, odd))


def rotary_strided(x, cos, sin):
    """the pairs as x[..., 0::2] and x[..., 1::2] (models' traceable form for TorchScript)"""
    even, odd = (op.Slice(x, *(Const.named(f"{t}_strided_{k}") for k in ("starts", "ends", "axes", "steps")),
                          _name=f"{t}_strided") for t in ("even", "odd"))
    return _rotary(x, cos, sin, _rotated(None, even, odd))


ROTARY = Pattern(rotary_sliced, rotary_split, rotary_strided, name="interleaved-rotary")


def onnx_rotary(x, cos, sin):
    """ONNX's RotaryEmbedding (opset 23), either form: position_ids given or not."""
    return op.RotaryEmbedding(x, cos, sin, _name="onnx_rotary", _extra_inputs=True)


ONNX_ROTARY = Pattern(onnx_rotary, name="onnx-rotary-embedding")


# ---------------------------------------------------------------- the check


@dataclass
class RotarySite:
    x: gs.Tensor  # what the kernel reads: x, or its float32 upcast
    cos: gs.Tensor  # the (T, H) tables
    sin: gs.Tensor
    heads: int
    head_dim: int
    sequence_axis: int  # 1: x is (B, S, N, H); 2: (B, N, S, H)


def check_rotary(m: Match, run: FusionRun) -> RotarySite:
    dims: Dims = run.memo.setdefault("dims", Dims())
    x = m["x"]
    shape = dims.shape(x)
    if shape is None or len(shape) != 4 or shape[3] is None or not shape[3].is_int or shape[3].value % 2:
        raise Refusal(f"x '{x.name}' is {text(shape)}: not 4-D with a constant, even head size")
    h = shape[3].value
    if m.has_node("pairs"):
        pairs = dims.reshaped(m.node("pairs"))
        if pairs is None or len(pairs) < 2 or not same(pairs[-1], Dim(2)):
            raise Refusal(f"the pairs Reshape gives {text(pairs)}: its last axis is not the pair (2)")
        last = len(pairs) - 1
        _check_channels(m, last)
    else:
        last = len(shape)  # the stacked pair axis, after x's
        _check_strided(m, len(shape) - 1, h)
    if not _is_axis(m.attrs["stack_axis"], last):
        raise Refusal(f"the pair is stacked on axis {m.attrs['stack_axis']}, not the last")
    for name in ("neg_axes", "even_axes"):
        if not _axes_are(m[name], last):
            raise Refusal(f"Unsqueeze '{name}' is not on the last axis")
    rotated = dims.reshaped(m.node("rotated"))
    # A Reshape keeps the element count (x's): with every dim but one proven x's, that one is x's too.
    if rotated is None or len(rotated) != 4 or sum(not same(a, b) for a, b in zip(rotated, shape)) > 1:
        raise Refusal(f"the rotated Reshape gives {text(rotated)}, not x's shape {text(shape)}")

    tables = {}
    for t in ("cos", "sin"):
        table, axis = _table(m[t], dims)
        if table is None:
            raise Refusal(f"{t} '{m[t].name}' is not a (T, {h}) table broadcast over batch and heads")
        rows, width = dims.shape(table)
        if not same(width, Dim(h)):
            raise Refusal(f"{t} table '{table.name}' has {width} channels, the heads {h}")
        if same(rows, Dim(1)) or same(shape[axis], Dim(1)):
            raise Refusal(f"{t} table '{table.name}' has {rows} rows for a sequence of {shape[axis]}: a broadcast, not a rotary")
        reason = pair_repeated(table)
        if reason is not None:
            raise Refusal(f"{t} table '{table.name}' is not proven pair-repeated ({reason}): not the interleaved form")
        tables[t] = (table, axis)
    (cos, axis), (sin, sin_axis) = tables["cos"], tables["sin"]
    if axis != sin_axis:
        raise Refusal("cos and sin run along different axes")
    heads = proven_dim(x, 2 if axis == 1 else 1, dims)  # here, or where the head split gave it
    if heads is None:
        raise Refusal(f"x '{x.name}' {text(shape)}: the head count is not a proven constant")
    if m.has_node("upcast") != m.has_node("rotated_upcast"):
        raise Refusal("x and its rotation are not both cast to float32")
    run.details["(B, S, N, H)" if axis == 1 else "(B, N, S, H)"] += 1
    if m.has_node("upcast"):  # the export rotates in float32: so does the kernel, between the same Casts
        run.details["in_float32"] += 1
        x = m.node("upcast").outputs[0]
    return RotarySite(x, cos, sin, heads, h, axis)


def _check_channels(m: Match, last: int) -> None:
    if m.has_node("split"):
        sizes = m.get("split_sizes")
        if not _is_axis(m.attrs["split_axis"], last):
            raise Refusal("the pair is split on another axis than the last")
        if sizes is not None and (not is_constant(sizes) or constant_value(sizes).tolist() != [1, 1]):
            raise Refusal("the pair Split is not (1, 1)")
    for t, index in (("even", 0), ("odd", 1)):
        if m.has_node(f"{t}_gather"):
            value = constant_value(m[f"{t}_index"])
            if value is None or value.size != 1 or int(value.reshape(-1)[0]) % 2 != index or \
                    not _is_axis(m.attrs[f"{t}_gather_axis"], last):
                raise Refusal(f"the {t} channel is not pairs[..., {index}]")
            continue
        if m.has_node(f"{t}_slice"):
            node = m.node(f"{t}_slice")
            values = [constant_value(i) if is_constant(i) else None for i in node.inputs[1:]]
            if any(v is None for v in values) or len(values) < 3:
                raise Refusal(f"the {t} Slice's arguments are not constants")
            starts, ends, axes = (v.reshape(-1).tolist() for v in values[:3])
            steps = values[3].reshape(-1).tolist() if len(values) > 3 else [1]
            if starts != [index] or ends != [index + 1] or steps != [1] or not _is_axis(axes[0], last):
                raise Refusal(f"the {t} channel is not pairs[..., {index}]")
        if not _axes_are(m[f"{t}_squeeze_axes"], last):
            raise Refusal(f"the {t} channel is squeezed on another axis than the last")


def _check_strided(m: Match, last: int, h: int) -> None:
    for t, index in (("even", 0), ("odd", 1)):
        values = [constant_value(m[f"{t}_strided_{k}"]) for k in ("starts", "ends", "axes", "steps")]
        if any(v is None or v.size != 1 for v in values):
            raise Refusal(f"the {t} Slice's arguments are not one-element constants")
        start, end, axis, step = (int(v.reshape(-1)[0]) for v in values)
        if start != index or step != 2 or end < h or not _is_axis(axis, last):
            raise Refusal(f"the {t} channel is not x[..., {index}::2]")


def _is_axis(axis, last: int) -> bool:
    return axis is not None and int(axis) in (-1, last)


def _axes_are(t: gs.Tensor, last: int) -> bool:
    value = constant_value(t) if is_constant(t) else None
    return value is not None and value.size == 1 and _is_axis(int(value.reshape(-1)[0]), last)


def _table(t: gs.Tensor, dims: Dims) -> tuple[gs.Tensor | None, int]:
    """The (T, H) table under the Unsqueezes that broadcast it against x, and the axis of x its rows
    run along (1: x is (B, S, N, H); 2: (B, N, S, H)); (None, 0) when it is not one."""
    shape = dims.shape(t)
    if shape is None or len(shape) not in (2, 3, 4):
        return None, 0
    padded = [Dim(1)] * (4 - len(shape)) + list(shape)
    ones = [same(d, Dim(1)) for d in padded[:3]]
    if ones == [True, False, True]:
        axis = 1
    elif ones == [True, True, False]:
        axis = 2
    else:
        return None, 0
    table = t
    while dims.rank(table) != 2:
        node = table.inputs[0] if len(table.inputs) == 1 else None
        if node is None or node.op not in ("Unsqueeze", "Reshape", "Expand"):
            return None, 0
        if node.op != "Unsqueeze":  # Reshape/Expand count only when the rows and channels come from a 2-D tensor
            inner = dims.shape(node.inputs[0])
            if inner is None or len(inner) != 2 or not (same(inner[0], padded[axis]) and same(inner[1], padded[3])):
                return None, 0
        table = node.inputs[0]
    return table, axis


# ---------------------------------------------------------------- ONNX's RotaryEmbedding (opset 23)


@dataclass
class OnnxRotarySite:
    node: gs.Node
    positions: gs.Tensor | None  # (B, S) ids; None: per-batch (B, S, R/2) tables


def check_onnx_rotary(m: Match, run: FusionRun) -> OnnxRotarySite:
    """The contrib op takes the same attributes and a 4-D input in the same (B, N, S, H) layout."""
    dims: Dims = run.memo.setdefault("dims", Dims())
    node = m.node("onnx_rotary")
    positions = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3].name else None
    if positions is None and not (dims.rank(m["cos"]) == 3 and dims.rank(m["sin"]) == 3):
        raise Refusal("without position_ids, cos_cache and sin_cache are not both (B, S, R/2)")
    return OnnxRotarySite(node, positions)


def emit_onnx_rotary(make: Emit, s: OnnxRotarySite) -> list[gs.Tensor]:
    x, cos, sin = s.node.inputs[:3]
    positions = s.positions
    if positions is None:
        # (B, S, R/2) tables, one per batch: as one (B*S, R/2) table that token (b, s) reads at row b*S + s
        i64 = np.int64
        half = make.op.Shape(cos, start=2, end=3, _label="half", _dtype=i64, _shape=[1])
        flat = make.op.Concat(make.constant("rows", np.array([-1], i64)), half, axis=0, _label="flat", _dtype=i64, _shape=[2])
        cos, sin = (make.op.Reshape(t, flat, _label=f"{role}_rows", _shape=None) for role, t in (("cos", cos), ("sin", sin)))
        rows = make.op.Shape(cos, start=0, end=1, _label="row_count", _dtype=i64, _shape=[1])
        count = make.op.Squeeze(rows, make.constant("squeeze.axes", np.zeros(1, i64)), _label="count", _dtype=i64, _shape=[])
        indices = make.op.Range(make.constant("zero", np.array(0, i64)), count, make.constant("one", np.array(1, i64)),
                                _label="rows_range", _dtype=i64, _shape=None)
        batch_seq = make.op.Shape(s.node.inputs[1], start=0, end=2, _label="batch_seq", _dtype=i64, _shape=[2])
        positions = make.op.Reshape(indices, batch_seq, _label="position_ids", _dtype=i64, _shape=None)
    attrs = {k: int(v) for k, v in s.node.attrs.items() if k in ("interleaved", "num_heads", "rotary_embedding_dim") and v}
    return [make.ms.RotaryEmbedding(x, positions, cos, sin, _label="rotary", _dtype=x.dtype, _shape=x.shape, **attrs)]


# ---------------------------------------------------------------- pair-repeated tables

_ELEMENTWISE = frozenset({"Cast", "Cos", "Sin", "Neg", "Identity"})


def pair_repeated(t: gs.Tensor, depth: int = 0) -> str | None:
    """None when ``t[..., 2i] == t[..., 2i+1]`` is proven from how ``t`` is computed; else why not."""
    if depth > 16:
        return "too deep"
    if is_constant(t):
        value = constant_value(t)
        if value is None or value.ndim == 0 or value.shape[-1] % 2:
            return f"constant '{t.name}' has no pairs"
        return None if np.array_equal(value[..., 0::2], value[..., 1::2]) else f"constant '{t.name}' differs within a pair"
    node = t.inputs[0] if len(t.inputs) == 1 else None
    if node is None:
        return f"'{t.name}' is a graph input"
    if node.op in _ELEMENTWISE:
        return pair_repeated(node.inputs[0], depth + 1)
    if node.op == "Concat":
        rank = len(t.shape) if t.shape is not None else None
        axis = int(node.attrs.get("axis", 0))
        if rank is None or axis not in (-1, rank - 1):
            return f"Concat '{node.name}' joins another axis than the last"
        for part in node.inputs:
            reason = pair_repeated(part, depth + 1)
            if reason is not None:
                return reason
        return None
    if node.op in ("Reshape", "Flatten"):
        return _repeat_interleave(node)
    return f"'{t.name}' is computed by {node.op} '{node.name}'"


def _repeat_interleave(node: gs.Node) -> str | None:
    """Reshape/Flatten(Expand/Tile(Unsqueeze(a, -1), (1, .., 1, 2))) merging the last two axes: a.repeat_interleave(2, -1)"""
    dims = Dims()
    source = node.inputs[0]
    src = dims.shape(source)
    if src is None or len(src) < 2 or not same(src[-1], Dim(2)):
        return f"'{node.name}' does not read a (.., n, 2) tensor"
    if node.op == "Flatten":
        if int(node.attrs.get("axis", 1)) != len(src) - 2 or len(src) != 3:
            return f"Flatten '{node.name}' does not merge the last two axes"
    else:
        out = dims.reshaped(node)
        if out is None or len(out) != len(src) - 1 or not all(same(a, b) for a, b in zip(out[:-1], src[:-2])):
            return f"Reshape '{node.name}' gives {text(out)} from {text(src)}: not the last two axes merged"
    repeat = source.inputs[0] if len(source.inputs) == 1 else None
    if repeat is None or repeat.op not in ("Expand", "Tile"):
        return f"'{source.name}' is not an Expand or Tile"
    counts = constant_value(repeat.inputs[1]) if is_constant(repeat.inputs[1]) else None
    if counts is None or counts.reshape(-1)[-1] != 2 or (repeat.op == "Tile" and np.any(counts.reshape(-1)[:-1] != 1)):
        return f"{repeat.op} '{repeat.name}' does not repeat the last axis twice"
    inner = dims.shape(repeat.inputs[0])
    if inner is None or len(inner) != len(src) or not same(inner[-1], Dim(1)):
        return f"{repeat.op} '{repeat.name}' does not repeat a (.., n, 1) tensor"
    if repeat.op == "Expand" and len(counts.reshape(-1)) > len(inner):
        return f"Expand '{repeat.name}' adds axes"
    return None


# ---------------------------------------------------------------- the emit


def emit_rotary(make: Emit, s: RotarySite) -> list[gs.Tensor]:
    cos, sin = (_half_table(make, t, s.head_dim) for t in (s.cos, s.sin))
    positions = make.constant("position_ids", np.zeros(1, np.int64))
    x = s.x
    if s.sequence_axis == 2:  # (B, N, S, H): the kernel's 4-D layout
        return [make.ms.RotaryEmbedding(x, positions, cos, sin, interleaved=1, _label="rotary", _dtype=x.dtype, _shape=x.shape)]
    leading = list(x.shape[:2]) if x.shape is not None else [None, None]
    x3 = make.op.Reshape(x, make.constant("hidden.shape", np.array([0, 0, s.heads * s.head_dim], np.int64)),
                         _label="hidden", _shape=[*leading, s.heads * s.head_dim])
    y = make.ms.RotaryEmbedding(x3, positions, cos, sin, interleaved=1, num_heads=s.heads, _label="rotary",
                                _dtype=x.dtype, _shape=x3.shape)
    return [make.op.Reshape(y, make.constant("heads.shape", np.array([0, 0, s.heads, s.head_dim], np.int64)),
                            _label="heads", _shape=x.shape)]


def _half_table(make: Emit, table: gs.Tensor, head_dim: int) -> gs.Tensor:
    """table[:, 0::2]: one angle per pair. One Slice per table, shared by every site that reads it."""
    name = f"{table.name}__pair_angles"
    for consumer in table.outputs:
        if consumer.op == "Slice" and consumer.name == name:
            return consumer.outputs[0]
    args = [make.constant(f"pair_angles.{k}", np.array([v], np.int64))
            for k, v in (("starts", 0), ("ends", head_dim), ("axes", -1), ("steps", 2))]
    rows = table.shape[0] if table.shape is not None else None
    return make.node("Slice", [table, *args], table.dtype, [rows, head_dim // 2], name=name)


@register_pass
class FuseRotaryEmbedding(Fusion, OrtFusion):
    name = "fuse-rotary-embedding"
    description = "fuse the interleaved rotary embedding (Flux's RoPE on Q and K) into com.microsoft RotaryEmbedding"
    requires = frozenset({SHAPES_INFERRED})
    rules = (Rule(ROTARY, check_rotary, emit_rotary), Rule(ONNX_ROTARY, check_onnx_rotary, emit_onnx_rotary))

    def finish(self, run: FusionRun) -> None:
        run.result.details = {k: v for k, v in run.details.items() if v}
