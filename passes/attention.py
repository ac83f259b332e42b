"""fuse-attention: scaled-dot-product attention -> com.microsoft MultiHeadAttention / Attention (ORT CUDA).

What it matches, after canonicalize-attention (which it requires)::

    x_q ─ MatMul(Wq) [+bq] ─ Reshape(B,S,N,H) ─ Transpose(0,2,1,3) ──┐ q   (B,N,S,H)
    x_k ─ MatMul(Wk) [+bk] ─ Reshape(B,L,N,H) ─ Transpose(0,2,3,1) ── MatMul ── [Mul(scale)] [Add(mask)] [Cast]
                                                                      Softmax(-1) [Where(IsNaN)] [Cast] ──┐
    x_v ─ MatMul(Wv) [+bv] ─ Reshape(B,L,N,H) ─ Transpose(0,2,1,3) ──────────────────────────────── MatMul
                                                          Transpose(0,2,1,3) ─ Reshape(B,S,N*H) ─ out

    and the classic (bmm) processor's form: every head tensor is folded on to (B*N, S, H) by one
    more Reshape, [Cast] may sit on q and k (upcast_attention), K^T is Transpose(0,2,1), and the
    result is unfolded by Reshape(B,N,S,H) before the Transpose.

    and, as a second rule, attention over head tensors (the diffusion transformers), whatever
    computed Q, K and V (a QK RMSNorm, written out or fused; Flux's rotary; MMDiT's joint attention,
    the Concat of the text and image streams along the sequence; Flux's single-stream block)::

    q (B,N,S,H) ─────────────────────────────────── MatMul ── [Mul(scale)] [Add(mask) [Add(mask2)]] [Cast]
    k (B,N,L,H) ─ Transpose(0,1,3,2) ───────────────┘          Softmax(-1) [Where(IsNaN)] [Cast] ──┐
      or k (B,L,N,H) ─ Transpose(0,2,3,1)                                                        │
    v (B,N,L,H) ──────────────────────────────────────────────────────────────────────────── MatMul
                                                          Transpose(0,2,1,3) ─ Reshape(B,S,N*H) ─ out
                     ==>
    q, k, v ─ [Transpose(0,2,1,3)] ─ [Reshape(0,0,N*H)] ─ MultiHeadAttention(query, key, value) ─ out

    where a head tensor that is Transpose(0,2,1,3) of a head split Reshape(x (B,S,N*H)) is read as x
    itself (RotaryEmbedding's 3-D output, a projection). The conditions are those below that do not
    name projections, and: Q, K, V have one (N, H), constant; K and V one batch with Q, proven
    (equal dims, or a tensor or Shape they all take it from); two additive masks (T5: the
    relative-position bias, then the padding mask) go to attention_bias as their sum.

What it writes: every form above is first read into one canonical :class:`AttentionSite` (the
check); one small lowering per kind and layout then writes it (``layout`` for self-attention,
default "packed"; ``cross_layout`` for cross-attention, default "separate")::

    self, packed, no projection bias (UNet attn1):
        x ─ MatMul(W_qkv) ─ Reshape(0,0,N,3,H) ─ MultiHeadAttention(packed QKV) ─ out
    self, packed, projection biases (VAE mid-block, CLIP):
        x ─ Attention(weights [Wq|Wk|Wv], bias [bq|bk|bv]) ─ out
    cross, packed:
        q_proj ───────────────────────────────────────────────┐
        ctx ─ MatMul(W_kv) [+ b_kv] ─ Reshape(0,0,N,2,H) ─ MultiHeadAttention(query, packed KV) ─ out
    split (self: Q, K, V from x; cross: K, V from ctx, the query is q_proj):
        x ─ MatMul([W_q|]W_k|W_v) [+ [b_q|]b_k|b_v] ─ Split ─ MultiHeadAttention(q, k, v) ─ out
    separate (self: query x @ W_q [+ b_q]; cross: the query is q_proj):
        query ──────────────────────┐
        x ─ MatMul(W_k) [+ b_k] ──── MultiHeadAttention(query, key, value) ─ out
        x ─ MatMul(W_v) [+ b_v] ────┘

    W_qkv is laid out so its output reshapes to (B, S, N, 3, H): column n*3H + t*H + h is column
    n*H + h of W_t (t = q, k, v); W_kv likewise with 2. Packed and concatenated weights are
    derived lazily (onnxopt.weights.DerivedValues): computed when saved, never held twice.
    Why these defaults (packed self-attention, separate cross K/V that fuse-parallel-gemm then
    joins): benchmarks/results/layout-choices.md.
    Attributes: num_heads=N, scale only when it differs from 1/sqrt(H), unidirectional=1 only for
    a mask proven exactly causal; any other mask goes, unchanged, to attention_bias (unsqueezed
    to 4-D), and a self-attention with one is lowered separate whatever the layout (ONNX Runtime's
    CUDA kernel cannot unpack a wide packed QKV in bfloat16 on the path that adds the bias).

Conditions (a site that fits the diagram but fails one is refused, with the reason):
    * K and V project the same tensor; Q too for self-attention, another tensor for cross.
    * Each Reshape provably splits (B, S, N*H) into (B, S, N, H), folds (B, N, S, H) into
      (B*N, S, H), or undoes that, with one N and one H for Q, K, V and the output; N*H is the
      projections' width and every bias is one value per output channel.
    * The scale is a one-element constant: it is the scale MHA is given.
    * Cross-attention: query and key/value provably have one batch size (the export's MatMul
      would broadcast a batch of 1; MHA does not).
    * The mask is absent, exactly causal, or of a shape attention_bias takes: (.., S, L).
    * A NaN guard after Softmax only where no row can be all -inf.
    * Casts inside are float upcasts (MHA computes in fp32 anyway).
    * Values computed inside are read outside only by Shape nodes (nothing is computed twice):
      the pattern says so (``_external_uses=reads_only_shape``: a candidate that breaks it does
      not match, and ``--explain`` names the reader). The query projection of a cross-attention
      stays (MHA reads it); that of a self-attention is recomputed by the new projection, so it
      too may be read outside only for its shape (a refusal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.attention_masks import any_same, is_causal, nan_free_scores
from onnxopt.dim_sources import dim_sources, proven_dim, share_dim
from onnxopt.errors import PassOptionError
from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.pass_infra import ATTENTION_CANONICAL, SHAPES_INFERRED, OrtFusion
from onnxopt.pattern import (Const, Match, Maybe, OneOf, OpBuilder, Pattern, Var, constant_reader, constant_shape,
                             constant_value, is_constant, reads_only_shape)
from onnxopt.pattern.dims import Dim, Dims, same, text
from onnxopt.registry import register_pass
from onnxopt.weight_provenance import concatenated, place, record_sources, reshape
from onnxopt.weights import DerivedValues, numpy_dtype, read_uncached, stored_values


class _ReadForShape(OpBuilder):
    """``op.X(...)`` whose outputs may also be read outside the match, by Shape nodes only."""

    def __getattr__(self, op_type: str):
        build = super().__getattr__(op_type)
        return lambda *inputs, **kwargs: build(*inputs, **{"_external_uses": reads_only_shape, **kwargs})


op = _ReadForShape()


# ---------------------------------------------------------------- the pattern


def projection(x, t: str):
    """x @ W_t [+ b_t]. The query projection may be read outside (cross-attention keeps it;
    the check limits self-attention's to Shape readers)."""
    reads = {"_external_uses": True} if t == "q" else {}
    matmul = op.MatMul(x, Const.named(f"w{t}"), _name=f"{t}_matmul", **reads)
    return OneOf(op.Add(matmul, Const.named(f"b{t}"), _name=f"{t}_bias", **reads), matmul)


def split_heads(x, t: str, perm=(0, 2, 1, 3)):
    """(B, S, N*H) -> (B, N, S, H); K^T with perm (0, 2, 3, 1): (B, N, H, L)"""
    return op.Transpose(op.Reshape(x, Var(f"{t}_shape"), _name=f"{t}_split"), perm=list(perm))


def fold_heads(x, t: str):
    """(B, S, N*H) -> (B*N, S, H): heads folded into the batch (classic processor)"""
    return op.Reshape(split_heads(x, t), Var(f"{t}_fold_shape"), _name=f"{t}_fold")


def merge_heads(o):
    """(B, N, S, H) -> (B, S, N*H)"""
    return op.Reshape(op.Transpose(o, perm=[0, 2, 1, 3]), Var("out_shape"), _name="out_merge")


def unfold_heads(o):
    """(B*N, S, H) -> (B, N, S, H)"""
    return op.Reshape(o, Var("out_unfold_shape"), _name="out_unfold")


def upcast(x, name: str):
    return Maybe(op.Cast, x, to=Var(f"cast_{name}"))


def probabilities(scores):
    """softmax(scores * scale + mask), each step optional"""
    scaled = OneOf(op.Mul(scores, Var("scale"), _name="scale_mul"), op.Div(scores, Var("divisor"), _name="scale_div"), scores)
    masked = OneOf(op.Add(scaled, Var("mask"), _name="mask_add"), scaled)
    masked = OneOf(op.Add(op.Add(scaled, Var("mask"), _name="mask_add"), Var("second_mask"), _name="second_mask_add"), masked)
    probs = op.Softmax(upcast(masked, "scores"), axis=Var("axis"), _name="softmax")
    guarded = OneOf(op.Where(op.IsNaN(probs), 0.0, probs, _name="nan_guard"), probs)
    return upcast(upcast(guarded, "probs"), "probs_again")


def attention(x_q, x_k, x_v):
    q = split_heads(projection(x_q, "q"), "q")
    kt = split_heads(projection(x_k, "k"), "k", perm=(0, 2, 3, 1))
    v = split_heads(projection(x_v, "v"), "v")
    probs = probabilities(op.MatMul(q, kt, _name="qk"))
    return merge_heads(op.MatMul(probs, v, _name="pv"))


def attention_heads_in_batch(x_q, x_k, x_v):
    q = upcast(fold_heads(projection(x_q, "q"), "q"), "q")
    kt = op.Transpose(upcast(fold_heads(projection(x_k, "k"), "k"), "k"), perm=[0, 2, 1])
    v = fold_heads(projection(x_v, "v"), "v")
    probs = probabilities(op.MatMul(q, kt, _name="qk"))
    return merge_heads(unfold_heads(op.MatMul(probs, v, _name="pv")))


ATTENTION = Pattern(attention, attention_heads_in_batch, name="attention")


def attention_over_heads(q, k, v):
    """Q, K, V already split into heads, by whatever computed them (QK RMSNorm, rotary, the joint
    attention's Concat of two streams): K^T is Transpose(k, (0, 1, 3, 2)) of a (B, N, L, H) k, or
    Transpose(k, (0, 2, 3, 1)) of a (B, L, N, H) one (the exporters' head split merged into it)."""
    kt = op.Transpose(k, perm=Var("k_perm"), _name="k_transpose")
    probs = probabilities(op.MatMul(q, kt, _name="qk"))
    return merge_heads(op.MatMul(probs, v, _name="pv"))


ATTENTION_OVER_HEADS = Pattern(attention_over_heads, name="attention-over-heads")


# ---------------------------------------------------------------- the canonical site (the check)


@dataclass
class AttentionSite:
    """One attention, whatever form it was exported in: what every lowering needs."""

    cross: bool
    x: gs.Tensor  # what K and V (and Q, for self-attention) project: (B, L, Din)
    query: gs.Tensor | None  # cross-attention: the projected query (B, S, N*H), which stays
    weights: dict[str, gs.Tensor]  # "q", "k", "v": (Din, N*H) constants
    biases: dict[str, gs.Tensor | None]  # (N*H,) constants, or None
    heads: int
    head_dim: int
    scale: float | None  # None: MHA's default 1/sqrt(head_dim)
    causal: bool
    attention_bias: gs.Tensor | tuple | None  # a pair: two additive masks, MHA reads their sum
    mask_rank: int | tuple  # a pair with a pair of masks
    out_dtype: object
    out_shape: object
    layout: str = "packed"  # the lowering (the pass's options)

    @property
    def kind(self) -> str:
        return "cross" if self.cross else "self"

    @property
    def biased(self) -> bool:
        return any(b is not None for b in self.biases.values())

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


def check_site(graph: gs.Graph, m: Match, dims: Dims) -> "AttentionSite":
    """Prove the conditions of the module docstring for ``m``, or raise Refusal."""
    x_q, x_k, x_v = m["x_q"], m["x_k"], m["x_v"]
    if x_k is not x_v:
        raise Refusal(f"K and V project different tensors ('{x_k.name}', '{x_v.name}')")
    cross = x_q is not x_k
    batched = m.has_node("out_unfold")

    # Projections: D = N*H channels each, one bias value per channel.
    widths = {}
    for t in "qkv":
        w = m[f"w{t}"]
        shape = tuple(constant_shape(w))
        if len(shape) != 2:
            raise Refusal(f"W{t} '{w.name}' is not a matrix: {list(shape)}")
        widths[t] = shape
        b = m.get(f"b{t}")
        if b is not None and tuple(constant_shape(b)) != (shape[1],):
            raise Refusal(f"b{t} '{b.name}' has shape {list(constant_shape(b))}, not ({shape[1]},): not a projection bias")
    d = widths["q"][1]
    if widths["k"][1] != d or widths["v"][1] != d:
        raise Refusal(f"projection widths differ: Q {widths['q'][1]}, K {widths['k'][1]}, V {widths['v'][1]}")

    # Heads: every Reshape splits, folds or unfolds exactly; one (N, H) throughout.
    # The dims each Reshape proves equal: aliases of the batch and sequence lengths.
    heads, batch, seq = {}, {"q": set(), "k": set()}, {"q": set(), "k": set()}
    for t in "qkv":
        split = m.node(f"{t}_split")
        source = dims.shape(split.inputs[0])
        result = dims.reshaped(split)
        heads[t] = _heads_of_split(t, source, result, d)
        if t != "v":
            batch[t] |= {source[0], result[0]}
            seq[t] |= {source[1], result[1]}
    if len(set(heads.values())) != 1:
        found = ", ".join(f"{t.upper()} {n} heads of {h}" for t, (n, h) in heads.items())
        raise Refusal(f"head count/dim differ: {found}")
    n, h = heads["q"]
    if cross and not any(any_same(b, batch["k"]) for b in batch["q"]):
        # The export's MatMul would broadcast a batch of 1 against the other; MHA does not.
        raise Refusal(f"cannot prove query and key/value have the same batch ({text(list(batch['q']))} vs {text(list(batch['k']))})")
    b_dim, s_dims = batch["q"], seq["q"]

    if batched:
        for t in "qkv":
            _check_fold(t, dims, m.node(f"{t}_fold"), n, h)
        unfold = dims.reshaped(m.node("out_unfold"))
        if unfold is None or len(unfold) != 4 or not (same(unfold[1], Dim(n)) and same(unfold[3], Dim(h))):
            raise Refusal(f"output unfold gives {text(unfold)}, not (B, {n}, S, {h})")
        if not (any_same(unfold[0], b_dim) or any_same(unfold[2], s_dims)):
            raise Refusal(f"output unfold gives {text(unfold)}: cannot prove its batch or sequence dim")
    merged = dims.reshaped(m.node("out_merge"))
    if merged is None or len(merged) != 3 or not same(merged[2], Dim(n * h)):
        raise Refusal(f"output merge gives {text(merged)}, not (B, S, {n * h})")
    if not (any_same(merged[0], b_dim) or any_same(merged[1], s_dims)):
        raise Refusal(f"output merge gives {text(merged)}: cannot prove its batch or sequence dim")

    rank = 3 if batched else 4
    axis = m.attrs["axis"]
    if axis not in (-1, rank - 1):
        raise Refusal(f"Softmax over axis {axis}, not the key axis")
    _check_casts(m)
    scale = _scale(m, h)
    causal, bias, mask_rank = _mask(graph, m, dims, cross=cross, rank=rank, seq_q=s_dims, seq_k=seq["k"], batch=b_dim, heads=n)
    if m.has_node("nan_guard"):
        reason = nan_free_scores(m.node("softmax").inputs[0])
        if reason is not None and not causal:
            raise Refusal(f"Softmax is NaN-guarded and {reason}")
    if not cross:
        _check_query_read_only_for_shape(m)
    return AttentionSite(
        cross=cross, x=x_k, query=m.node("q_split").inputs[0] if cross else None,
        weights={t: m[f"w{t}"] for t in "qkv"}, biases={t: m.get(f"b{t}") for t in "qkv"},
        heads=n, head_dim=h, scale=scale, causal=causal, attention_bias=bias, mask_rank=mask_rank,
        out_dtype=m.output.dtype, out_shape=m.output.shape)


def _heads_of_split(t: str, source, result, d: int) -> tuple[int, int]:
    """(N, H) when Reshape(source -> result) splits (B, S, D) into (B, S, N, H)."""
    if source is None or len(source) != 3 or not same(source[2], Dim(d)):
        raise Refusal(f"{t.upper()} projection output is {text(source)}, not (B, S, {d})")
    if result is None or len(result) != 4 or not (result[2] and result[2].is_int and result[3] and result[3].is_int):
        raise Refusal(f"{t.upper()} Reshape gives {text(result)}: heads and head dim are not proven constants")
    n, h = result[2].value, result[3].value
    if n * h != d:
        raise Refusal(f"{t.upper()} Reshape splits {d} channels into {n} x {h}")
    if not (same(result[0], source[0]) or same(result[1], source[1])):
        raise Refusal(f"{t.upper()} Reshape gives {text(result)} from {text(source)}: cannot prove it keeps batch and sequence")
    return n, h


def _check_fold(t: str, dims: Dims, node: gs.Node, n: int, h: int) -> None:
    source, result = dims.shape(node.inputs[0]), dims.reshaped(node)
    if source is None or len(source) != 4 or result is None or len(result) != 3 or not same(result[2], Dim(h)):
        raise Refusal(f"{t.upper()} fold gives {text(result)} from {text(source)}, not (B*{n}, S, {h})")
    if not (same(result[0], _times(source[0], source[1])) or same(result[1], source[2])):
        raise Refusal(f"{t.upper()} fold gives {text(result)} from {text(source)}: cannot prove (B*N, S, H)")


def _check_casts(m: Match, dtype: np.dtype | None = None) -> None:
    weights = onnx.helper.np_dtype_to_tensor_dtype(dtype if dtype is not None else _dtype(m["wq"]))
    for name, to in m.attrs.items():
        if name.startswith("cast_") and int(to) not in (onnx.TensorProto.FLOAT, weights):
            raise Refusal(f"a Cast inside the attention converts to {onnx.TensorProto.DataType.Name(int(to))}")


def _scale(m: Match, head_dim: int) -> float | None:
    """The constant the scores are multiplied by; None when it is MHA's default 1/sqrt(H)."""
    if m.get("scale") is not None:
        value = _one_element(m["scale"], "scale")
    elif m.get("divisor") is not None:
        divisor = _one_element(m["divisor"], "divisor")
        if divisor == 0:
            raise Refusal(f"the scores are divided by zero ('{m['divisor'].name}')")
        value = 1.0 / divisor
    else:
        value = 1.0
    return None if math.isclose(value * math.sqrt(head_dim), 1.0, rel_tol=1e-6) else value


def _one_element(t: gs.Tensor, what: str) -> float:
    if not is_constant(t):
        raise Refusal(f"the {what} '{t.name}' is not a constant")
    value = constant_value(t)
    if value.size != 1:
        raise Refusal(f"the {what} '{t.name}' has {value.size} elements, not one")
    return float(value.reshape(-1)[0])


def _mask(graph, m: Match, dims: Dims, *, cross, rank, seq_q, seq_k, batch, heads, dtype=None):
    """(causal, attention_bias, its rank) for the mask of ``m``. Two additive masks (T5: the
    relative-position bias, then the padding mask) give a pair of each: MHA reads their sum."""
    mask, second = m.get("mask"), m.get("second_mask")
    if mask is None:
        return False, None, 0
    if second is None and not cross and is_causal(graph, mask, dims, seq_q | seq_k):
        return True, None, 0
    dtype = dtype if dtype is not None else _dtype(m["wq"])
    ranks = tuple(_bias_rank(t, dims, rank=rank, seq_q=seq_q, seq_k=seq_k, batch=batch, heads=heads, dtype=dtype)
                  for t in (mask, second) if t is not None)
    return (False, mask, ranks[0]) if second is None else (False, (mask, second), ranks)


def _bias_rank(mask: gs.Tensor, dims: Dims, *, rank, seq_q, seq_k, batch, heads, dtype) -> int:
    """The rank of an additive mask that attention_bias takes as it is (unsqueezed), or Refusal."""
    shape = dims.shape(mask)
    if shape is None or len(shape) > 4 or len(shape) < 2:
        raise Refusal(f"mask '{mask.name}' has shape {text(shape)}, not (.., S, L)")
    if not (any_same(shape[-2], seq_q) and any_same(shape[-1], seq_k)):
        raise Refusal(f"mask '{mask.name}' has shape {text(shape)}: cannot prove its last dims are (S, L)")
    leading = shape[:-2]
    if rank == 3:  # scores (B*N, S, L): only a mask shared by every batch and head maps to attention_bias
        if not all(same(d, Dim(1)) for d in leading):
            raise Refusal(f"mask '{mask.name}' {text(shape)} on batch-of-heads scores")
    else:
        allowed = [batch, {Dim(heads)}][-len(leading):] if leading else []
        for d, ok in zip(leading, allowed):
            if not (same(d, Dim(1)) or any_same(d, ok)):
                raise Refusal(f"mask '{mask.name}' has shape {text(shape)}, not (B or 1, N or 1, S, L)")
    if mask.dtype is not None and numpy_dtype(mask.dtype) != dtype:
        raise Refusal(f"mask '{mask.name}' is {numpy_dtype(mask.dtype)}, the attention {dtype}")
    return len(shape)


def _check_query_read_only_for_shape(m: Match) -> None:
    """Self-attention: the new projection recomputes Q, so the old one may be read outside only for its shape."""
    inside = {id(node) for node in m.nodes}
    for name in ("q_matmul", "q_bias"):
        if not m.has_node(name):
            continue
        for t in m.node(name).outputs:
            for consumer in t.outputs:
                if id(consumer) not in inside and not reads_only_shape(consumer):
                    raise Refusal(f"the query projection '{t.name}' is also read by {consumer.op} '{consumer.name}'")

# ---------------------------------------------------------------- attention over head tensors (DiT)

# How a head tensor is read back as MHA's (B, S, N*H): the tensor, and whether it is (B, N, S, H)
# (a Transpose(0, 2, 1, 3) first) and a (B, S, N, H) to merge (a Reshape) or already (B, S, N*H).
BNSH_TO_BSNH = (0, 2, 1, 3)


@dataclass
class HeadInput:
    tensor: gs.Tensor
    transpose: bool  # (B, N, S, H): Transpose(0, 2, 1, 3) first
    merge: bool  # (B, S, N, H): Reshape(0, 0, N*H); False: already (B, S, N*H)


@dataclass
class HeadsSite:
    """An attention whose Q, K, V are head tensors (B, N, S, H): what lower_heads needs."""

    inputs: dict[str, HeadInput]  # "q", "k", "v"
    heads: int
    head_dim: int
    scale: float | None
    causal: bool
    attention_bias: gs.Tensor | tuple | None  # a pair: two additive masks, MHA reads their sum
    mask_rank: int | tuple  # a pair with a pair of masks
    out_dtype: object
    out_shape: object
    kind: str = "over heads"


def check_heads_site(graph: gs.Graph, m: Match, dims: Dims) -> HeadsSite:
    """The conditions of attention-over-heads (module docstring), or Refusal."""
    perm = tuple(int(p) for p in (m.attrs["k_perm"] or ()))
    if perm not in ((0, 1, 3, 2), (0, 2, 3, 1)):
        raise Refusal(f"K is transposed by {list(perm)}: not K^T of (B, N, L, H) or (B, L, N, H) heads")
    q, k, v = (dims.shape(m[t]) for t in "qkv")
    heads_axis = {"q": 1, "k": 2 if perm == (0, 2, 3, 1) else 1, "v": 1}
    found = {}
    for t, shape in zip("qkv", (q, k, v)):
        # heads and head size: proven constant here, or where the head split gave them
        n_t, h_t = (proven_dim(m[t], axis, dims) if shape is not None and len(shape) == 4 else None
                    for axis in (heads_axis[t], 3))
        if n_t is None or h_t is None:
            raise Refusal(f"{t.upper()} '{m[t].name}' is {text(shape)}: not (B, N, S, H) with constant heads and head size")
        found[t] = (n_t, h_t)
    n, h = found["q"]
    if perm == (0, 2, 3, 1):
        k = [k[0], k[2], k[1], k[3]]  # as (B, N, L, H)
    for t, shape in (("K", k), ("V", v)):
        if found[t.lower()] != (n, h):
            raise Refusal(f"{t} has {found[t.lower()][0]} heads of {found[t.lower()][1]}: not {n} of {h} as Q (grouped-query attention is not fused)")
        if not (same(shape[0], q[0]) or share_dim(m["q"], 0, m[t.lower()], 0, dims)):
            raise Refusal(f"cannot prove Q {text(q)} and {t} {text(shape)} have one batch (MatMul broadcasts, MHA does not)")
    merged = dims.reshaped(m.node("out_merge"))
    # N*H proven, and the element count: one of B, S proven fixes the other
    if merged is None or len(merged) != 3 or not same(merged[2], Dim(n * h)) or not (
            same(merged[1], q[2]) or any(same(merged[0], d) for d in dim_sources(m["q"], 0, dims)[1])):
        raise Refusal(f"output merge gives {text(merged)}, not (B, S, {n * h})")
    axis = m.attrs["axis"]
    if axis not in (-1, 3):
        raise Refusal(f"Softmax over axis {axis}, not the key axis")
    dtype = numpy_dtype(m["q"].dtype) if m["q"].dtype is not None else None
    _check_casts(m, dtype or np.dtype(np.float32))
    scale = _scale(m, h)
    causal, bias, mask_rank = _mask(graph, m, dims, cross=True, rank=4, seq_q={q[2]}, seq_k={k[2]}, batch={q[0]},
                                    heads=n, dtype=dtype)
    if m.has_node("nan_guard"):
        reason = nan_free_scores(m.node("softmax").inputs[0])
        if reason is not None:
            raise Refusal(f"Softmax is NaN-guarded and {reason}")
    inputs = {"q": _head_input(m["q"], dims, n, h, bnsh=True), "k": _head_input(m["k"], dims, n, h, bnsh=perm == (0, 1, 3, 2)),
              "v": _head_input(m["v"], dims, n, h, bnsh=True)}
    return HeadsSite(inputs, n, h, scale, causal, bias, mask_rank, m.output.dtype, m.output.shape)


def _head_input(t: gs.Tensor, dims: Dims, n: int, h: int, *, bnsh: bool) -> HeadInput:
    """Where MHA reads a head tensor from: under its Transpose(0, 2, 1, 3) and head-split Reshape when it has them."""
    transpose = bnsh
    producer = t.inputs[0] if len(t.inputs) == 1 else None
    if bnsh and producer is not None and producer.op == "Transpose" and tuple(producer.attrs.get("perm", ())) == BNSH_TO_BSNH:
        t, transpose = producer.inputs[0], False
    producer = t.inputs[0] if len(t.inputs) == 1 else None
    if not transpose and producer is not None and producer.op == "Reshape":
        source, split = dims.shape(producer.inputs[0]), dims.reshaped(producer)
        # (B, S, N*H) -> (B, S, N, H): the head split; one of B, S proven, the element count gives the other
        if source is not None and len(source) == 3 and same(source[2], Dim(n * h)) and split is not None and \
                len(split) == 4 and same(split[2], Dim(n)) and same(split[3], Dim(h)) and \
                (same(split[0], source[0]) or same(split[1], source[1])):
            return HeadInput(producer.inputs[0], False, False)
    return HeadInput(t, transpose, True)


def lower_heads(make: Emit, s: HeadsSite) -> gs.Tensor:
    """q, k, v ─ [Transpose(0, 2, 1, 3)] ─ [Reshape(0, 0, N*H)] ─ MultiHeadAttention(query, key, value)"""
    q, k, v = (_hidden(make, s, t) for t in "qkv")
    return _mha(make, s, q, k, v)


def _hidden(make: Emit, s: HeadsSite, role: str) -> gs.Tensor:
    source = s.inputs[role]
    x = source.tensor
    if source.transpose:
        x = make.op.Transpose(x, perm=list(BNSH_TO_BSNH), _label=f"{role}_heads",
                              _shape=[x.shape[i] for i in BNSH_TO_BSNH] if x.shape is not None else None)
    if source.merge:
        width = s.heads * s.head_dim
        x = make.op.Reshape(x, make.constant(f"{role}_hidden.shape", np.array([0, 0, width], np.int64)),
                            _label=f"{role}_hidden", _shape=[*(x.shape[:2] if x.shape is not None else [None, None]), width])
    return x


def read_heads_site(m: Match, run: FusionRun) -> HeadsSite:
    site = check_heads_site(run.graph, m, run.memo.setdefault("dims", Dims()))
    run.details[site.kind] += 1
    run.details["causal"] += site.causal
    run.details["attention_bias"] += site.attention_bias is not None
    run.details["two additive masks"] += isinstance(site.attention_bias, tuple)
    return site


# ---------------------------------------------------------------- the lowerings (the emit)


def lower_packed_self(make: Emit, s: AttentionSite) -> gs.Tensor:
    """x ─ MatMul(W_qkv) ─ Reshape(0,0,N,3,H) ─ MultiHeadAttention(packed QKV)"""
    qkv = make.op.MatMul(s.x, make.constant("qkv.weight", _packed_weight(s, "qkv")), _label="qkv",
                         _shape=[*_leading(s.x), 3 * s.width])
    qkv = _reshape(make, qkv, [0, 0, s.heads, 3, s.head_dim], "qkv_packed")
    return _mha(make, s, qkv)


def lower_attention_op(make: Emit, s: AttentionSite) -> gs.Tensor:
    """x ─ Attention(weights [Wq|Wk|Wv], bias [bq|bk|bv])"""
    w = make.constant("Attention.weights", _concatenated_weight(s, "qkv"))
    b = make.constant("Attention.bias", _concatenated_bias(s, "qkv"))
    return make.ms.Attention(s.x, w, b, None, None, _attention_bias(make, s), _dtype=s.out_dtype, _shape=s.out_shape,
                             **_attributes(s))


def lower_packed_cross(make: Emit, s: AttentionSite) -> gs.Tensor:
    """ctx ─ MatMul(W_kv) [+ b_kv] ─ Reshape(0,0,N,2,H) ─ MultiHeadAttention(query, packed KV)"""
    kv = make.op.MatMul(s.x, make.constant("kv.weight", _packed_weight(s, "kv")), _label="kv",
                        _shape=[*_leading(s.x), 2 * s.width])
    if s.biases["k"] is not None or s.biases["v"] is not None:
        kv = make.op.Add(kv, make.constant("kv_bias.bias", _packed_bias(s, "kv")), _label="kv_bias")
    kv = _reshape(make, kv, [0, 0, s.heads, 2, s.head_dim], "kv_packed")
    return _mha(make, s, s.query, kv)


def lower_split(make: Emit, s: AttentionSite) -> gs.Tensor:
    """x ─ MatMul([W_q|]W_k|W_v) [+ bias] ─ Split ─ MultiHeadAttention(q, k, v)"""
    roles = "kv" if s.cross else "qkv"
    projected = make.op.MatMul(s.x, make.constant(f"{roles}.weight", _concatenated_weight(s, roles)), _label=roles,
                               _shape=[*_leading(s.x), len(roles) * s.width])
    if any(s.biases[t] is not None for t in roles):
        projected = make.op.Add(projected, make.constant(f"{roles}_bias.bias", _concatenated_bias(s, roles)),
                                _label=f"{roles}_bias")
    sizes = make.constant("split.sizes", np.full(len(roles), s.width, np.int64))
    heads = dict(zip(roles, make.op.Split(projected, sizes, axis=-1, _outputs=len(roles), _label="split",
                                          _shape=[*_leading(s.x), s.width])))
    return _mha(make, s, s.query if s.cross else heads["q"], heads["k"], heads["v"])


def lower_separate(make: Emit, s: AttentionSite) -> gs.Tensor:
    """x ─ MatMul(W_t) [+ b_t] per projection ─ MultiHeadAttention(query, key, value)"""
    k, v = _projected(make, s, "k"), _projected(make, s, "v")
    return _mha(make, s, s.query if s.cross else _projected(make, s, "q"), k, v)


# (kind, layout, biased) -> the lowering; biased self-attention packs into Attention, which
# takes its biases, only in the packed layout.
LOWERINGS: dict[tuple[str, str], Callable[[Emit, AttentionSite], gs.Tensor]] = {
    ("self", "packed"): lower_packed_self,
    ("self, biased", "packed"): lower_attention_op,
    ("cross", "packed"): lower_packed_cross,
    ("self", "split"): lower_split,
    ("self, biased", "split"): lower_split,
    ("cross", "split"): lower_split,
    ("self", "separate"): lower_separate,
    ("self, biased", "separate"): lower_separate,
    ("cross", "separate"): lower_separate,
}


def lowering_for(s: AttentionSite) -> Callable[[Emit, AttentionSite], gs.Tensor]:
    kind = "self, biased" if not s.cross and s.biased else s.kind
    return LOWERINGS[(kind, s.layout)]


def emit_attention(make: Emit, s: AttentionSite) -> list[gs.Tensor]:
    return [lowering_for(s)(make, s)]


def _attributes(s: AttentionSite) -> dict:
    attrs = {"num_heads": s.heads}
    if s.scale is not None:
        attrs["scale"] = float(s.scale)
    if s.causal:
        attrs["unidirectional"] = 1
    return attrs


def _mha(make: Emit, s: AttentionSite, query, key=None, value=None) -> gs.Tensor:
    return make.ms.MultiHeadAttention(query, key, value, None, None, _attention_bias(make, s),
                                      _dtype=s.out_dtype, _shape=s.out_shape, **_attributes(s))


def _attention_bias(make: Emit, s: AttentionSite) -> gs.Tensor | None:
    """The mask as (.., .., S, L): unsqueezed in front to 4-D; two masks added."""
    if isinstance(s.attention_bias, tuple):
        first, second = (_as_4d(make, mask, rank) for mask, rank in zip(s.attention_bias, s.mask_rank))
        # one sum for the layers that share both masks (T5: every layer)
        name = f"{first.name}+{second.name}__attention_bias"
        for consumer in first.outputs:
            if consumer.op == "Add" and consumer.name == name and consumer.inputs[1] is second:
                return consumer.outputs[0]
        return make.node("Add", [first, second], first.dtype, _broadcast_shape(first.shape, second.shape), name=name)
    return _as_4d(make, s.attention_bias, s.mask_rank)


def _broadcast_shape(a, b):
    """Two 4-D shape annotations broadcast (a dim of 1 takes the other's)."""
    if a is None or b is None or len(a) != len(b):
        return None
    return [y if x == 1 else x for x, y in zip(a, b)]


def _as_4d(make: Emit, mask: gs.Tensor | None, rank: int) -> gs.Tensor | None:
    if mask is None or rank == 4:
        return mask
    axes = make.constant("attention_bias.axes", np.arange(4 - rank, dtype=np.int64))
    shape = [1] * (4 - rank) + list(mask.shape) if mask.shape is not None else None
    return make.op.Unsqueeze(mask, axes, _label="attention_bias", _shape=shape)


def _projected(make: Emit, s: AttentionSite, t: str) -> gs.Tensor:
    """x @ W_t [+ b_t], with the exported weight itself (not a copy)."""
    w = s.weights[t]
    y = make.op.MatMul(s.x, w, _label=t, _shape=[*_leading(s.x), w.shape[-1]] if w.shape is not None else None)
    if s.biases[t] is not None:
        y = make.op.Add(y, make.constant(f"{t}_bias.bias", _concatenated_bias(s, t)), _label=f"{t}_bias")
    return y


def _reshape(make: Emit, x: gs.Tensor, target: list[int], label: str) -> gs.Tensor:
    leading = _leading(x)
    shape = [*leading, *target[2:]]
    return make.op.Reshape(x, make.constant(f"{label}.shape", np.array(target, np.int64)), _label=label, _shape=shape)


def _leading(x: gs.Tensor) -> list:
    return list(x.shape[:-1]) if x.shape is not None else [None, None]


# Derived weights: described here, computed when read or saved (never held twice).


def _read(t: gs.Tensor) -> np.ndarray:
    return read_uncached(t) if isinstance(t, gs.Constant) else constant_value(t)


def _weight_sources(s: AttentionSite, roles: str):
    """(weights, readers, elements): readers read the data each weight holds *now* (a later pass may
    give the orphaned constant other values before the derived weight is computed, at save time);
    ``elements`` lets the fp16 range scan read the sources instead of computing the derived weight."""
    ws = [s.weights[t] for t in roles]
    readers = [constant_reader(w) for w in ws]
    elements = [stored_values(w) for w in ws] if all(isinstance(w, gs.Constant) for w in ws) else None
    return ws, readers, elements


def _packed_weight(s: AttentionSite, roles: str) -> DerivedValues:
    """(Din, N*H) per role -> (Din, N * len(roles) * H): the product reshapes to (.., N, len, H)."""
    ws, readers, elements = _weight_sources(s, roles)
    d_in = constant_shape(ws[0])[0]

    def pack():
        return np.stack([read().reshape(d_in, s.heads, s.head_dim) for read in readers], axis=2).reshape(d_in, -1)

    packed = DerivedValues((d_in, len(roles) * s.width), _dtype(ws[0]), pack, name=f"{roles}.weight",
                           elements_of=elements)
    n = len(roles)  # part t: (Din, H, hd) at [:, :, t, :] of (Din, H, n, hd)
    return record_sources(packed, ws, [[reshape((d_in, s.heads, 1, s.head_dim)),
                                         place((d_in, s.heads, n, s.head_dim), (0, 0, t, 0)),
                                         reshape((d_in, n * s.width))] for t in range(n)])


def _concatenated_weight(s: AttentionSite, roles: str) -> DerivedValues:
    ws, readers, elements = _weight_sources(s, roles)
    d_in = constant_shape(ws[0])[0]
    joined = DerivedValues((d_in, len(roles) * s.width), _dtype(ws[0]),
                           lambda: np.concatenate([read() for read in readers], axis=1), name=f"{roles}.weight",
                           elements_of=elements)
    return record_sources(joined, ws, concatenated([constant_shape(w) for w in ws], axis=1))


def _bias_or_zeros(s: AttentionSite, t: str, dtype) -> np.ndarray:
    b = s.biases[t]
    return np.zeros(s.width, dtype) if b is None else _read(b).astype(dtype)


def _concatenated_bias(s: AttentionSite, roles: str) -> DerivedValues:
    dtype = _dtype(s.weights["q"])
    return DerivedValues((len(roles) * s.width,), dtype,
                         lambda: np.concatenate([_bias_or_zeros(s, t, dtype) for t in roles]), name=f"{roles}.bias")


def _packed_bias(s: AttentionSite, roles: str) -> DerivedValues:
    dtype = _dtype(s.weights["q"])

    def pack():
        return np.stack([_bias_or_zeros(s, t, dtype).reshape(s.heads, s.head_dim) for t in roles], axis=1).reshape(-1)

    return DerivedValues((len(roles) * s.width,), dtype, pack, name=f"{roles}.bias")


# ---------------------------------------------------------------- the pass


def read_site(m: Match, run: FusionRun) -> AttentionSite:
    """check_site with the run's shared Dims (dims proven equal across sites), in the pass's layout."""
    site = check_site(run.graph, m, run.memo.setdefault("dims", Dims()))
    site.layout = run.fusion.cross_layout if site.cross else run.fusion.layout
    if site.attention_bias is not None and site.layout == "packed":
        # ONNX Runtime's CUDA MHA runs an attention_bias on its unfused path, which unpacks packed QKV
        # with AddBiasTranspose; in bfloat16 that kernel has no form for widths over 2048 (T5-XXL: 4096
        # fails, H100, ORT 1.31). Three BSNH inputs are read as they are, in every precision.
        site.layout = "separate"
        run.details["attention_bias: separate Q, K, V"] += 1
    run.details[site.kind] += 1
    run.details["with projection bias"] += site.biased
    run.details["causal"] += site.causal
    run.details["attention_bias"] += site.attention_bias is not None
    run.details["two additive masks"] += isinstance(site.attention_bias, tuple)
    return site


@register_pass
class FuseAttention(Fusion, OrtFusion):
    name = "fuse-attention"
    description = "fuse attention (self, cross, VAE, causal CLIP) into com.microsoft MultiHeadAttention/Attention, packing Q/K/V weights and keeping biases"
    requires = frozenset({SHAPES_INFERRED, ATTENTION_CANONICAL})
    LAYOUTS = ("packed", "split", "separate")
    rules = (Rule(ATTENTION, read_site, emit_attention, label=lambda m: _site_name(m)),
             # after the projections' form: a site it matched (or refused) is not read again
             Rule(ATTENTION_OVER_HEADS, read_heads_site, lambda make, s: [lower_heads(make, s)], label=lambda m: _site_name(m)))
    defer_rewrites = True  # check every site on the unchanged graph, then rewrite

    def __init__(self, layout: str = "packed", cross_layout: str = "separate"):
        for option, value in (("layout", layout), ("cross_layout", cross_layout)):
            if value not in self.LAYOUTS:
                raise PassOptionError(f"fuse-attention: {option} must be one of {', '.join(self.LAYOUTS)}, not '{value}'")
        self.layout = layout
        self.cross_layout = cross_layout

    def finish(self, run: FusionRun) -> None:
        run.result.details = {k: v for k, v in run.details.items() if v}


# ---------------------------------------------------------------- small helpers


def _site_name(m: Match) -> str:
    """The attention module's name, from its Softmax: '/unet/.../attn1' (or the Softmax's name)."""
    name = m.node("softmax").name
    return name.rsplit("/", 1)[0] if "/" in name.strip("/") else name


def _dtype(constant: gs.Tensor) -> np.dtype:
    """A constant's dtype, without loading an initializer's data."""
    if isinstance(constant, gs.Constant):
        return numpy_dtype(constant.dtype)
    return constant_value(constant).dtype


def _times(a: Dim | None, b: Dim | None) -> Dim | None:
    return None if a is None or b is None else a * b
