"""canonicalize-attention: bring every exporter's attention to the one form fuse-attention matches.

The TorchScript and dynamo exporters write the same scaled-dot-product attention differently
(see the field notes). Each rule below removes one difference, and only where it can prove the
rewrite exact::

    rule                   before                                           after
    onnx-attention         Attention(q, k, v [, mask])  (ONNX, opset 23+;  Softmax(MatMul(q, Transpose(k, (0,1,3,2)))
                           4-D q, k, v)                                     * scale [+ mask]) @ v
                           Attention(q, k, v, is_causal=1)                  the same, mask = Where(Trilu(ones(S, L)) == 0,
                                                                            -inf, 0): the causal mask TorchScript writes
    identity-reshape       Reshape(x, shape)  with shape provably x's       x
    sdpa-scale-from-shape  Div(1, Sqrt(Cast(Slice(Shape(q), -1:))))         1/sqrt(H)   H = q's last dim, proven
    scalar-arithmetic      Sqrt(c), Cast(c), Mul(c1, c2) ... of 1-element   the constant
                           float constants
    k-transpose-chain      Reshape(Transpose(Reshape(k, (-1, c, d)),        Transpose(k, (0, 1, 3, 2))
                           (0, 2, 1)), (a, b, d, c))   k: (a, b, c, d)
    transpose-pair         Transpose(Transpose(x, p), q)                    Transpose(x, p[q])
    qk-scale               MatMul(Mul(q, a), Mul(kT, b))                    Mul(MatMul(q, kT), a*b)   a, b scalars
    zero-score-bias        Add(s, Mul(ConstantOfShape|Expand(c, shape), 0)) s   c finite; shape broadcasts into s
                           Add(s, zeros)
    softmax-nan-guard      Where(IsNaN(p), 0, p),  p = Softmax(s [+ mask])  p   s and mask finite: no row is all -inf

The onnx-attention rule lowers ONNX's own op (the dynamo exporter writes SDPA as ``Attention`` from
opset 23) into the same form, so the exporters' older forms and the new op fuse through one matcher
(q, k, v are the head-split projections, and the transpose-pair rule then merges K's two Transposes).
It respects ``scale`` (default 1/sqrt(H), H proven constant), ``softmax_precision`` (a Cast around
the Softmax) and a boolean mask proven causal (CLIP's ``kv_idx <= q_idx``: ``Where(mask, 0, -inf)``,
no row fully masked), and lowers ``is_causal=1`` (no attn_mask) to the explicit causal mask the
TorchScript exporter writes for SDPA(is_causal=True), which fuse-attention proves causal (MHA's
``unidirectional``) as it proves TorchScript's. ONNX aligns that mask to the upper left (key j is
seen by query i when j <= i, whatever S and L; torch's SDPA does the same), so it is lowered only
where the query and key lengths are proven equal: there upper-left and lower-right (ORT's causal
kernels for a KV cache) agree. It refuses, with the reason: 3-D inputs, ``is_causal`` with an
attn_mask or with lengths not proven equal, ``softcap``, a KV cache
(past_key / past_value / nonpad_kv_seqlen), sliding windows, a read of the extra outputs, heads of Q
and K/V not proven equal (GQA), any other boolean mask, a mask whose last dim is not proven to be the key
length (Attention pads a shorter one with -inf), and a mask that may hold -inf (Attention zeroes a
fully masked row; the lowered Softmax would give NaN).

After it, attention reads: ``Softmax([Add(] [Mul(] MatMul(Transpose(Reshape(q)), Transpose(Reshape(k)))
[, scale)] [, mask)])`` with K^T one ``Transpose(perm=(0, 2, 3, 1))`` (or ``(0, 2, 1)`` in the
batch-of-heads form of the classic processor), one constant scale, and no guard.

Shapes come from :class:`onnxopt.pattern.dims.Dims`: symbolic Shape/Reshape algebra plus the
annotations of infer-shapes, which this pass requires.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.attention_masks import keeps_causal, nan_free_scores, provably_finite
from onnxopt.fusion import Emit, NameAuthority, Refusal
from onnxopt.graph_edit import bypass, detach, is_standard
from onnxopt.model import Model
from onnxopt.pass_infra import ATTENTION_CANONICAL, CONSTANTS_FOLDED, SHAPES_INFERRED, Pass, PassResult
from onnxopt.pattern import Const, Match, OneOf, Pattern, Tracer, Var, constant_value, is_constant, op, replace
from onnxopt.pattern.dims import Dim, Dims, same, same_dims, text
from onnxopt.registry import register_pass
from onnxopt.weights import numpy_dtype


FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


# ---------------------------------------------------------------- patterns


def onnx_attention(q, k, v):
    """ONNX's Attention op (opset 23+): softmax(q kᵀ · scale [+ mask]) v in one node."""
    # its other outputs (present key/value, QK scores) may be read: the rewrite refuses those sites
    return op.Attention(q, k, v, _name="attention", _extra_inputs=True, _external_uses=True)


def reshape_of_scores_product(p, v, shape):
    """TorchScript's SDPA reshapes its output (B, N, S, H) to the query's shape: a no-op."""
    return op.Reshape(op.MatMul(p, v, _external_uses=True), shape)


def sdpa_default_scale(q, starts=Const(), ends=Const()):
    """torch's SDPA decomposition: 1 / sqrt(q.shape[-1]), computed at run time."""
    head_dim = op.Cast(op.Slice(op.Shape(q), starts, ends, _name="slice", _extra_inputs=True), to=Var("to"))
    return op.Div(1.0, op.Sqrt(head_dim))


def k_transpose_via_reshapes(k, flat, unflat):
    """dynamo's K^T: fold (B, N) into one batch axis, transpose the last two, unfold."""
    folded = op.Reshape(k, flat, _name="fold")
    return op.Reshape(op.Transpose(folded, perm=[0, 2, 1]), unflat, _name="unfold")


def transpose_pair(x):
    return op.Transpose(op.Transpose(x, perm=Var("inner"), _external_uses=True), perm=Var("outer"))


def scaled_qk(q, kt):
    return op.MatMul(OneOf(op.Mul(q, Var("q_scale")), q), OneOf(op.Mul(kt, Var("k_scale")), kt))


def plus_zeros(scores):
    """baddbmm(empty, q, kT, beta=0): scores + 0 * empty. dynamo shares one empty (and its
    product with 0) between attentions of one size, so those may be read outside the match."""
    zeros = OneOf(
        op.ConstantOfShape(Var("shape"), _name="fill", _external_uses=True),
        op.Expand(Const.named("value"), Var("shape"), _external_uses=True),
        Const.named("value"),
    )
    return op.Add(scores, OneOf(op.Mul(zeros, 0.0, _name="times_zero", _external_uses=True), zeros), _name="add")


def nan_guarded_softmax(scores):
    probs = op.Softmax(scores, axis=Var("axis"), _name="softmax")
    return op.Where(op.IsNaN(probs), 0.0, probs)


def _scalar_check(*names):
    def check(match: Match):
        if is_constant(match["q"]) or is_constant(match["kt"]):
            return "an operand is a constant (a projection, not attention scores)"
        bound = [match.get(n) for n in names]
        if all(t is None for t in bound):
            return "no scale on either operand"
        for t in bound:
            if t is not None and (not is_constant(t) or constant_value(t).size != 1 or constant_value(t).ndim > 1):
                return f"'{t.name}' is not a one-element constant"
        return None

    return check


def _adds_zero(m: Match) -> str | None:
    value = _fill_value(m)
    if value is None:
        return "fill value is not a constant"
    if m.has_node("times_zero"):
        return None if np.all(np.isfinite(value)) else "0 * a non-finite fill is NaN, not 0"
    return None if not np.any(value) else "added tensor is not zero"


ONNX_ATTENTION = Pattern(onnx_attention, name="onnx-attention")
IDENTITY_RESHAPE = Pattern(reshape_of_scores_product, name="identity-reshape")
SDPA_SCALE = Pattern(sdpa_default_scale, name="sdpa-scale-from-shape")
K_TRANSPOSE_CHAIN = Pattern(k_transpose_via_reshapes, name="k-transpose-chain")
TRANSPOSE_PAIR = Pattern(transpose_pair, name="transpose-pair")
QK_SCALE = Pattern(scaled_qk, name="qk-scale", check=_scalar_check("q_scale", "k_scale"))
ZERO_SCORE_BIAS = Pattern(plus_zeros, name="zero-score-bias", check=_adds_zero)
SOFTMAX_NAN_GUARD = Pattern(nan_guarded_softmax, name="softmax-nan-guard")


# ---------------------------------------------------------------- rewrites
# Each takes (graph, match, dims) and rewrites, or raises Refusal with the reason it refused
# (not_a_site: the match is an ordinary node the rule does not apply to; not reported).
# A rewrite that bypasses a node (its output replaced by an existing tensor) reads that tensor
# from the live node, not from the match: an earlier bypass in the same sweep may have moved it.

# Attention inputs after (q, k, v, attn_mask) and its attributes that the lowering cannot express.
_KV_CACHE_INPUTS = ("past_key", "past_value", "nonpad_kv_seqlen")


def rewrite_onnx_attention(graph: gs.Graph, m: Match, dims: Dims, names: NameAuthority) -> None:
    node = m.node("attention")
    q, k, v = m["q"], m["k"], m["v"]
    reason = _unsupported_attention_form(graph, node, dims)
    if reason is not None:
        raise Refusal(reason)
    q_shape, k_shape, v_shape = dims.shape(q), dims.shape(k), dims.shape(v)
    if not (same(q_shape[1], k_shape[1]) and same(k_shape[1], v_shape[1])):
        raise Refusal(f"heads of Q {text(q_shape)}, K {text(k_shape)}, V {text(v_shape)} are not proven equal (grouped-query attention is not lowered)")
    dtype = _float_dtype(q)
    if dtype is None:
        raise Refusal(f"the type of '{q.name}' is not a known float type")
    scale = node.attrs.get("scale")
    if scale is None:
        head_dim = q_shape[3]
        if head_dim is None or not head_dim.is_int or head_dim.value <= 0:
            raise Refusal(f"the head size of '{q.name}' {text(q_shape)} is not a proven constant (the default scale is 1/sqrt of it)")
        scale = 1.0 / np.sqrt(head_dim.value)
    mask = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3].name else None
    causal = bool(node.attrs.get("is_causal", 0))
    if causal:
        _check_causal_lowering(q_shape, k_shape, mask)
    if mask is not None:
        mask_shape = dims.shape(mask)
        boolean = mask.dtype is not None and numpy_dtype(mask.dtype) == np.bool_
        if boolean and not keeps_causal(graph, mask, dims, {q_shape[2], k_shape[2]}):
            raise Refusal(f"attn_mask '{mask.name}' is boolean and not proven causal (a fully masked row is 0 in Attention, NaN in Softmax)")
        if mask_shape is None or not mask_shape or not same(mask_shape[-1], k_shape[2]):
            raise Refusal(f"attn_mask {text(mask_shape)}: its last dim is not proven to be the key length {text([k_shape[2]])} (Attention pads a shorter mask with -inf)")
        if not boolean and not provably_finite(mask):
            raise Refusal(f"attn_mask '{mask.name}' may hold -inf (Attention zeroes a fully masked row; the lowered Softmax would give NaN)")

    # What it writes: softmax(q @ kᵀ * scale [+ mask]) @ v, the Softmax in softmax_precision.
    make = Emit(graph, names, node.name or m.output.name)
    if causal:
        mask, boolean = _causal_mask(make, q, k, dtype), False
    kt = make.op.Transpose(k, perm=[0, 1, 3, 2], _dtype=dtype)
    scores_shape = None if q.shape is None or k.shape is None else [*q.shape[:3], k.shape[2]]
    scores = make.op.MatMul(q, kt, _dtype=dtype, _shape=scores_shape)
    scores = make.op.Mul(scores, make.constant("scale", np.array([scale], dtype)), _dtype=dtype, _shape=scores_shape)
    if mask is not None:
        if boolean:  # True: attend. Every row keeps key 0 (proven causal), so -inf never fills a row.
            mask = _additive_mask(mask, dtype, make)
        scores = make.op.Add(scores, mask, _dtype=dtype, _shape=scores_shape)
    precision = node.attrs.get("softmax_precision")
    upcast = precision is not None and onnx.helper.tensor_dtype_to_np_dtype(int(precision)) != dtype
    if upcast:
        scores = make.op.Cast(scores, to=int(precision), _dtype=onnx.helper.tensor_dtype_to_np_dtype(int(precision)), _shape=scores_shape)
    probs = make.op.Softmax(scores, axis=-1, _dtype=scores.dtype, _shape=scores_shape)
    if upcast:
        probs = make.op.Cast(probs, to=onnx.helper.np_dtype_to_tensor_dtype(dtype), _dtype=dtype, _shape=scores_shape)
    make.op.MatMul(probs, v, _dtype=m.output.dtype, _shape=m.output.shape)
    replace(graph, m, make.nodes)


def _unsupported_attention_form(graph: gs.Graph, node: gs.Node, dims: Dims) -> str | None:
    """Why this Attention node is not plain 4-D scaled-dot-product attention, or None."""
    ranks = [dims.rank(t) for t in node.inputs[:3]]
    if ranks != [4, 4, 4]:
        return f"Q, K, V of rank {ranks}: only 4-D (B, N, S, H) inputs are lowered"
    for name, t in zip(_KV_CACHE_INPUTS, node.inputs[4:]):
        if t.name:
            return f"input {name} is given (a KV cache: not lowered)"
    for i, out in enumerate(node.outputs[1:], start=1):
        if out.name and (out.outputs or any(o is out for o in graph.outputs)):
            return f"output {i} ('{out.name}': present key/value or QK scores) is read"
    if node.attrs.get("softcap", 0.0):
        return f"softcap={node.attrs['softcap']} (not lowered)"
    for window in ("left_window_size", "right_window_size"):
        if node.attrs.get(window, -1) != -1:
            return f"{window}={node.attrs[window]} (a sliding window: not lowered)"
    return None


# ---- is_causal=1: the explicit causal mask (its own rule of the lowering: the non-causal path above
# is untouched by it)


def _check_causal_lowering(q_shape, k_shape, mask: gs.Tensor | None) -> None:
    """is_causal is lowered only alone, and only where query and key lengths are proven equal."""
    if mask is not None:
        raise Refusal(f"is_causal=1 with attn_mask '{mask.name}' (both at once are not lowered)")
    if not same(q_shape[2], k_shape[2]):
        raise Refusal(f"is_causal=1 with query length {text([q_shape[2]])} and key length {text([k_shape[2]])} not "
                      "proven equal (ONNX aligns the causal mask to the upper left; not lowered)")


def _causal_mask(make: Emit, q: gs.Tensor, k: gs.Tensor, dtype: np.dtype) -> gs.Tensor:
    """Where(Trilu(Expand(1, (S, L)), upper=0) == 0, -inf, 0): key j hidden from query i where j > i.

    The form TorchScript writes for SDPA(is_causal=True) (onnxopt.attention_masks.CAUSAL_MASK), so
    fuse-attention proves it causal; S and L are read from q and k at run time. Every row keeps
    key 0, so no row is all -inf and the Softmax never gives NaN (Attention neither)."""
    lengths = [make.op.Shape(t, start=2, end=3, _dtype=np.int64, _shape=[1]) for t in (q, k)]
    shape = make.op.Concat(*lengths, axis=0, _dtype=np.int64, _shape=[2])
    seq = [q.shape[2] if q.shape is not None else None, k.shape[2] if k.shape is not None else None]
    ones = make.op.Expand(make.constant("causal_one", np.array(1.0, dtype)), shape, _dtype=dtype, _shape=seq)
    lower = make.op.Trilu(ones, upper=0, _dtype=dtype, _shape=seq)
    hidden = make.op.Equal(lower, make.constant("causal_zero", np.array(0.0, dtype)), _dtype=np.bool_, _shape=seq)
    return make.op.Where(hidden, make.constant("causal_hidden", np.array(-np.inf, dtype)),
                         make.constant("causal_kept", np.array(0.0, dtype)), _dtype=dtype, _shape=seq)


def _additive_mask(mask: gs.Tensor, dtype: np.dtype, make: Emit) -> gs.Tensor:
    """Where(mask, 0, -inf), one per boolean mask: the layers that share the mask share it, as
    fuse-attention's causal-mask proof needs (a value read outside its match is not matched)."""
    name = f"{mask.name}__additive"
    for consumer in mask.outputs:
        if consumer.op == "Where" and consumer.name == name:
            return consumer.outputs[0]
    values = [make.constant(f"additive_{v}", np.array(v, dtype)) for v in (0.0, -np.inf)]
    return make.node("Where", [mask, *values], dtype, mask.shape, name=name)


def _float_dtype(t: gs.Tensor) -> np.dtype | None:
    if t.dtype is None:
        return None
    dtype = numpy_dtype(t.dtype)
    return dtype if onnx.helper.np_dtype_to_tensor_dtype(dtype) in FLOAT_TYPES else None


def rewrite_identity_reshape(graph: gs.Graph, m: Match, dims: Dims, names: NameAuthority) -> None:
    x = m.root.inputs[0]  # the product
    before, after = dims.shape(x), dims.reshaped(m.root)
    if not same_dims(before, after) or any(d is None for d in before):
        raise Refusal("the Reshape does not provably keep the shape: an ordinary Reshape", not_a_site=True)
    replace(graph, m, [], [x])
    return


def rewrite_sdpa_scale(graph: gs.Graph, m: Match, dims: Dims, names: NameAuthority) -> None:
    # Whatever the Slice takes (starts, ends, axes, steps), Dims evaluates exactly that.
    head_dim = dims.scalar(m.node("slice").outputs[0])
    if head_dim is None or not head_dim.is_int or head_dim.value <= 0:
        raise Refusal(f"the sliced dim of '{m['q'].name}' is not a proven constant ({head_dim})")
    if int(m.attrs["to"]) not in FLOAT_TYPES:
        raise Refusal(f"Cast to {m.attrs['to']} is not a float cast")
    dtype = onnx.helper.tensor_dtype_to_np_dtype(int(m.attrs["to"]))
    scale = dtype.type(1) / np.sqrt(dtype.type(head_dim.value))
    replace(graph, m, [], [Emit(graph, names, m.root.name).constant("scale", np.array([scale], dtype=dtype))])


def rewrite_k_transpose_chain(graph: gs.Graph, m: Match, dims: Dims, names: NameAuthority) -> None:
    k = dims.shape(m["k"])
    if k is None or len(k) != 4 or any(d is None for d in k):
        raise Refusal(f"shape of '{m['k'].name}' is not known ({text(k)})")
    a, b, c, d = k
    folded, unfolded = dims.reshaped(m.node("fold")), dims.reshaped(m.node("unfold"))
    if not same_dims(folded, [a * b, c, d]):
        raise Refusal(f"first Reshape gives {text(folded)}, not {text([a * b, c, d])}")
    if not same_dims(unfolded, [a, b, d, c]):
        raise Refusal(f"second Reshape gives {text(unfolded)}, not {text([a, b, d, c])}")
    make = Emit(graph, names, m.root.name)
    make.op.Transpose(m["k"], perm=[0, 1, 3, 2])
    replace(graph, m, make.nodes)


def rewrite_transpose_pair(graph: gs.Graph, m: Match, dims: Dims, names: NameAuthority) -> None:
    inner, outer = m.attrs["inner"], m.attrs["outer"]
    if inner is None or outer is None or len(inner) != len(outer):
        raise Refusal("a Transpose without an explicit perm")
    perm = [int(inner[i]) for i in outer]
    x = m.root.inputs[0].inputs[0].inputs[0]
    if perm == sorted(perm):
        replace(graph, m, [], [x])
        return
    make = Emit(graph, names, m.root.name)
    make.op.Transpose(x, perm=perm)
    replace(graph, m, make.nodes)


def rewrite_qk_scale(graph: gs.Graph, m: Match, dims: Dims, names: NameAuthority) -> None:
    scales = [constant_value(m[n]) for n in ("q_scale", "k_scale") if m.get(n) is not None]
    dtype = scales[0].dtype
    value = dtype.type(1)
    for s in scales:
        value = value * dtype.type(s.reshape(-1)[0])
    make = Emit(graph, names, m.root.name)
    scores = make.op.MatMul(m["q"], m["kt"], _dtype=m.output.dtype, _shape=m.output.shape)
    make.op.Mul(scores, make.constant("scale", np.array([value], dtype)))
    replace(graph, m, make.nodes)


def rewrite_zero_score_bias(graph: gs.Graph, m: Match, dims: Dims, names: NameAuthority) -> None:
    add, matched = m.node("add"), {id(n) for n in m.nodes}
    # The zeros are computed inside the match (or constant); the scores come from outside it.
    zeros_index = 0 if is_constant(add.inputs[0]) or id(_producer(add.inputs[0])) in matched else 1
    zeros, scores = add.inputs[zeros_index], add.inputs[1 - zeros_index]
    z, s = dims.shape(zeros), dims.shape(scores)
    if z is None or s is None or len(z) > len(s):
        raise Refusal(f"cannot prove the zeros {text(z)} broadcast into the scores {text(s)}")
    for zd, sd in zip(reversed(z), reversed(s)):
        if not (same(zd, Dim(1)) or same(zd, sd)):
            raise Refusal(f"zeros {text(z)} may broadcast the scores {text(s)} to a larger shape")
    replace(graph, m, [], [scores])
    return


def rewrite_softmax_nan_guard(graph: gs.Graph, m: Match, dims: Dims, names: NameAuthority) -> None:
    reason = nan_free_scores(m["scores"])
    if reason is not None:
        raise Refusal(reason)
    replace(graph, m, [], [m.node("softmax").outputs[0]])
    return


# ---------------------------------------------------------------- scalar arithmetic

_SCALAR_OPS: dict[str, Callable] = {
    "Sqrt": np.sqrt,
    "Neg": np.negative,
    "Reciprocal": np.reciprocal,
    "Mul": np.multiply,
    "Div": np.divide,
    "Add": np.add,
    "Sub": np.subtract,
}


def fold_scalar_constants(graph: gs.Graph) -> int:
    """Evaluate float ops (and float Casts) whose inputs are all one-element constants.

    ``graph.nodes`` must be topologically sorted, so that a chain folds in one sweep.
    """
    folded, names = 0, NameAuthority(graph)
    for node in list(graph.nodes):
        if not is_standard(node) or len(node.outputs) != 1 or not node.inputs:
            continue
        if node.op not in _SCALAR_OPS and node.op != "Cast":
            continue
        values = [constant_value(t) if is_constant(t) else None for t in node.inputs]
        if any(v is None or v.size != 1 or not np.issubdtype(v.dtype, np.floating) for v in values):
            continue
        if node.op == "Cast":
            to = int(node.attrs["to"])
            if to not in FLOAT_TYPES:
                continue
            result = values[0].astype(onnx.helper.tensor_dtype_to_np_dtype(to))
        else:
            if len({v.dtype for v in values}) != 1:
                continue
            with np.errstate(all="ignore"):
                result = np.asarray(_SCALAR_OPS[node.op](*values)).astype(values[0].dtype)
        rank = max(v.ndim for v in values)
        out = node.outputs[0]
        _bypass_output(graph, out, Emit(graph, names, node.name or out.name).constant("folded", result.reshape((1,) * rank)))
        detach(node)
        folded += 1
    return folded


# ---------------------------------------------------------------- the pass


@dataclass(frozen=True)
class Rule:
    pattern: Pattern
    rewrite: Callable[[gs.Graph, Match, Dims, NameAuthority], None]  # rewrites the match or raises Refusal
    overlap: bool = False  # matches may share nodes (the rewrite leaves the shared ones in place)
    # A graph-wide step run before the rule's find: (name in the report's details, step -> sites rewritten).
    before: tuple[str, Callable[[gs.Graph], int]] | None = None


def fold_scalar_arithmetic(graph: gs.Graph) -> int:
    """The scale the rules before qk-scale materialized, as one constant (fold_scalar_constants, cleaned up)."""
    graph.toposort()
    folded = fold_scalar_constants(graph)
    if folded:
        graph.cleanup(remove_unused_graph_inputs=False)
    return folded


RULES = (
    Rule(ONNX_ATTENTION, rewrite_onnx_attention),  # first: its K^T Transpose meets the exporter's in transpose-pair
    Rule(IDENTITY_RESHAPE, rewrite_identity_reshape),
    Rule(SDPA_SCALE, rewrite_sdpa_scale),
    Rule(K_TRANSPOSE_CHAIN, rewrite_k_transpose_chain),
    Rule(TRANSPOSE_PAIR, rewrite_transpose_pair),
    Rule(QK_SCALE, rewrite_qk_scale, before=("scalar-arithmetic", fold_scalar_arithmetic)),
    Rule(ZERO_SCORE_BIAS, rewrite_zero_score_bias, overlap=True),
    Rule(SOFTMAX_NAN_GUARD, rewrite_softmax_nan_guard),
)


@register_pass
class CanonicalizeAttention(Pass):
    name = "canonicalize-attention"
    description = "bring both exporters' attention to one form: constant scale on the scores, K^T as one Transpose, no zero bias or NaN guard"
    requires = frozenset({SHAPES_INFERRED})
    provides = frozenset({ATTENTION_CANONICAL})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})
    traces = True

    def run(self, model: Model, *, tracer: Tracer | None = None) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False, trace=tracer)
        counts: Counter = Counter()
        names = NameAuthority(graph)
        for rule in RULES:
            if rule.before is not None:
                name, step = rule.before
                rewritten = step(graph)
                counts[name] += rewritten
                result.sites_matched += rewritten
                result.sites_rewritten += rewritten
            dims = Dims()
            for match in rule.pattern.find(graph, overlap=rule.overlap, trace=tracer or False):
                try:
                    rule.rewrite(graph, match, dims, names)
                except Refusal as refusal:
                    if tracer is not None:
                        tracer.refuse(rule.pattern.name, match.root, refusal.reason)
                    if not refusal.not_a_site:
                        result.sites_matched += 1
                        result.refuse(f"{rule.pattern.name} at '{match.root.name}'", refusal.reason)
                    continue
                result.sites_matched += 1
                result.sites_rewritten += 1
                counts[rule.pattern.name] += 1
            if counts[rule.pattern.name]:  # dead nodes still count as consumers for the next find
                graph.cleanup(remove_unused_graph_inputs=False)
        result.modified = result.sites_rewritten > 0
        result.details = {k: v for k, v in counts.items() if v}
        graph.toposort()
        return result


# ---------------------------------------------------------------- small graph helpers


def _producer(t: gs.Tensor) -> gs.Node | None:
    return t.inputs[0] if isinstance(t, gs.Variable) and len(t.inputs) == 1 else None


def _fill_value(m: Match) -> np.ndarray | None:
    if m.has_node("fill"):
        value = m.node("fill").attrs.get("value")
        return np.zeros(1, np.float32) if value is None else np.asarray(value.values)
    return constant_value(m["value"])


def _bypass_output(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> None:
    """Point ``old``'s consumers at ``new``; a graph output keeps its name through an Identity."""
    graph.nodes.extend(bypass(graph, old, new))
