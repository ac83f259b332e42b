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

What it writes (``layout="packed"``, the default)::

    self-attention, no projection bias (UNet attn1):
        x ─ MatMul(W_qkv) ─ Reshape(0,0,N,3,H) ─ MultiHeadAttention(packed QKV) ─ out
    self-attention with projection biases (VAE mid-block, CLIP):
        x ─ Attention(weights [Wq|Wk|Wv], bias [bq|bk|bv]) ─ out
    cross-attention (UNet attn2; ``cross_layout="packed"``):
        q_proj ───────────────────────────────────────────────┐
        ctx ─ MatMul(W_kv) [+ b_kv] ─ Reshape(0,0,N,2,H) ─ MultiHeadAttention(query, packed KV) ─ out
    cross-attention, ``cross_layout="separate"`` (the default):
        q_proj ──────────────────────────┐
        ctx ─ MatMul(W_k) [+ b_k] ─────── MultiHeadAttention(query, key, value) ─ out
        ctx ─ MatMul(W_v) [+ b_v] ───────┘

    W_qkv is laid out so its output reshapes to (B, S, N, 3, H): column n*3H + t*H + h is column
    n*H + h of W_t (t = q, k, v); W_kv likewise with 2. ``layout="split"`` keeps the one GEMM but
    splits its output and hands MHA (B, S, N*H) q, k, v, which ORT's cuDNN kernel reads in place
    (packed inputs are first unpacked by AddBiasUnpack). On an H100 that won in isolation (158 vs
    174 us per 4096-token attention, benchmarks/micro_gpu.py) but lost in the full SD1.5 UNet
    (6.55 vs 6.49 ms with CUDA graph: ORT's Split kernel took 0.21 ms where the unpacking took
    0.16 ms), so packed stays the default. ``layout="separate"`` writes one MatMul per projection.
    ``cross_layout`` is the same choice for cross-attention alone; its default is "separate": the
    K and V projections of the shared text context then all join one MatMul in fuse-parallel-gemm,
    whose Split hands MHA K and V that it reads in place (6.41 against 6.48 ms for packed KV,
    full SD1.5 UNet on an H100 with CUDA graph).
    Attributes: num_heads=N, scale only when it differs from 1/sqrt(H), unidirectional=1 only for
    a mask proven exactly causal; any other mask goes, unchanged, to attention_bias (unsqueezed
    to 4-D).

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
    * Casts inside are float upcasts (MHA computes in fp32 anyway); values computed inside are
      read outside only by Shape nodes (nothing is computed twice).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.attention_masks import any_same, is_causal, nan_free_scores
from onnxopt.domains import MS_DOMAIN
from onnxopt.errors import PassOptionError
from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.fusion import Site as FusionSite
from onnxopt.layout import LAYOUT_OPS
from onnxopt.pass_infra import ATTENTION_CANONICAL, SHAPES_INFERRED, OrtFusion
from onnxopt.pattern import (Const, Match, Maybe, OneOf, OpBuilder, Pattern, Var, constant_reader, constant_shape,
                             constant_value, is_constant)
from onnxopt.pattern.dims import Dim, Dims, same, text
from onnxopt.registry import register_pass
from onnxopt.weights import DerivedValues, stored_values



class _OpenOps(OpBuilder):
    """``op.X(...)`` whose outputs may also be read outside a match: the pass checks those reads
    itself (``outside_reads``) so that a refused site gets a reason."""

    def __getattr__(self, op_type: str):
        build = super().__getattr__(op_type)
        return lambda *inputs, **kwargs: build(*inputs, **{"_external_uses": True, **kwargs})


op = _OpenOps()


# ---------------------------------------------------------------- the pattern


def projection(x, t: str):
    """x @ W_t [+ b_t]"""
    matmul = op.MatMul(x, Const.named(f"w{t}"), _name=f"{t}_matmul")
    return OneOf(op.Add(matmul, Const.named(f"b{t}"), _name=f"{t}_bias"), matmul)


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


# ---------------------------------------------------------------- what a site needs


@dataclass
class Site:
    """What the check proved about one match: enough to write the fused node."""

    name: str
    cross: bool
    heads: int
    head_dim: int
    scale: float | None  # None: MHA's default 1/sqrt(head_dim)
    causal: bool
    attention_bias: gs.Tensor | None
    mask_rank: int = 4
    match: Match | None = None  # set before the rewrite (fuse-attention checks every site first)
    layout: str = "packed"  # the layout it is written in (the pass's options)

    @property
    def kind(self) -> str:
        return "cross" if self.cross else "self"


def check_site(graph: gs.Graph, m: Match, dims: Dims) -> Site:
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
    _check_outside_reads(graph, m, cross)
    return Site(_site_name(m), cross, n, h, scale, causal, bias, mask_rank)


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


def _check_casts(m: Match) -> None:
    weights = onnx.helper.np_dtype_to_tensor_dtype(_dtype(m["wq"]))
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


def _mask(graph, m: Match, dims: Dims, *, cross, rank, seq_q, seq_k, batch, heads):
    """(causal, attention_bias tensor, its rank) for the mask of ``m``."""
    mask = m.get("mask")
    if mask is None:
        return False, None, 0
    if not cross and is_causal(graph, mask, dims, seq_q | seq_k):
        return True, None, 0
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
    dtype = _dtype(m["wq"])
    if mask.dtype is not None and np.dtype(mask.dtype) != dtype:
        raise Refusal(f"mask '{mask.name}' is {np.dtype(mask.dtype)}, the attention {dtype}")
    return False, mask, len(shape)


def _check_outside_reads(graph: gs.Graph, m: Match, cross: bool) -> None:
    """Values computed inside the match may be read outside it only for their shape."""
    inside = {id(node) for node in m.nodes}
    outputs = {id(t) for t in graph.outputs}
    reused = {id(m.node("q_split").inputs[0])} if cross else set()  # the query MHA reads
    for node in m.nodes:
        if node is m.root:
            continue
        for t in node.outputs:
            if id(t) in reused:
                continue
            if id(t) in outputs:
                raise Refusal(f"'{t.name}' (inside the attention) is a graph output")
            for consumer in t.outputs:
                if id(consumer) not in inside and not _reads_shape_only(consumer):
                    raise Refusal(f"'{t.name}' (inside the attention) is also read by {consumer.op} '{consumer.name}'")




def _reads_shape_only(node: gs.Node, depth: int = 0) -> bool:
    """``node`` is a Shape, or moves data only towards Shape nodes (TorchScript's mask sizes)."""
    if node.op == "Shape":
        return True
    if node.op not in LAYOUT_OPS or depth > 4:
        return False
    return all(_reads_shape_only(c, depth + 1) for out in node.outputs for c in out.outputs)


# ---------------------------------------------------------------- the rewrite


def fused_nodes(m: Match, site: Site, layout: str = "packed") -> list[gs.Node]:
    """The nodes that compute ``m.output`` in place of the match.

    ``layout="packed"`` writes one projection MatMul for QKV (self) or KV (cross) and hands MHA
    the packed tensor; ``"split"`` splits that MatMul's output and hands MHA (B, S, N*H) query,
    key and value; ``"separate"`` keeps one MatMul per projection.
    """
    n, h = site.heads, site.head_dim
    name = site.name
    x = m["x_k"]
    weights = {t: constant_reader(m[f"w{t}"]) for t in "qkv"}
    biases = {t: constant_value(m[f"b{t}"]) if m.get(f"b{t}") is not None else None for t in "qkv"}
    dtype = _dtype(m["wq"])

    def packed(roles: str, combine) -> DerivedValues:  # read when needed (fp16 scan, save), never all held
        d_in, sources = constant_shape(m[f"w{roles[0]}"])[0], [m[f"w{t}"] for t in roles]
        elements = [stored_values(w) for w in sources] if all(isinstance(w, gs.Constant) for w in sources) else None
        return DerivedValues((d_in, len(roles) * n * h), dtype, lambda: combine([weights[t]() for t in roles]), f"{name}/{roles}",
                             elements_of=elements)
    nodes: list[gs.Node] = []
    bias_input = _attention_bias(m, site, nodes)
    attrs = {"num_heads": n}
    if site.scale is not None:
        attrs["scale"] = float(site.scale)
    if site.causal:
        attrs["unidirectional"] = 1
    out = gs.Variable(f"{name}/attention_out", dtype=m.output.dtype, shape=m.output.shape)

    if layout == "split" and (site.cross or all(b is None for b in biases.values())):
        roles = "kv" if site.cross else "qkv"
        projected = _matmul(nodes, f"{name}/{roles}", x, packed(roles, lambda ws: np.concatenate(ws, axis=1)),
                            [*_leading(x), len(roles) * n * h])
        if any(biases[t] is not None for t in roles):
            bias = np.concatenate([_or_zeros(biases[t], n * h, dtype) for t in roles])
            projected = _add(nodes, f"{name}/{roles}_bias", projected, bias)
        heads = _split(nodes, name, projected, roles, n * h)
        q = m.node("q_split").inputs[0] if site.cross else heads["q"]
        nodes.append(_node("MultiHeadAttention", f"{name}/MultiHeadAttention", [q, heads["k"], heads["v"], None, None, bias_input], out, attrs))
    elif layout == "separate" and (site.cross or all(b is None for b in biases.values())):
        q = m.node("q_split").inputs[0] if site.cross else _matmul_by(nodes, f"{name}/q", x, m["wq"])
        k = _matmul_by(nodes, f"{name}/k", x, m["wk"])
        v = _matmul_by(nodes, f"{name}/v", x, m["wv"])
        if biases["k"] is not None:
            k = _add(nodes, f"{name}/k_bias", k, biases["k"].astype(dtype))
        if biases["v"] is not None:
            v = _add(nodes, f"{name}/v_bias", v, biases["v"].astype(dtype))
        nodes.append(_node("MultiHeadAttention", f"{name}/MultiHeadAttention", [q, k, v, None, None, bias_input], out, attrs))
    elif site.cross:
        kv = _matmul(nodes, f"{name}/kv", x, packed("kv", lambda ws: _pack(ws, n, h)), [*_leading(x), 2 * n * h])
        if biases["k"] is not None or biases["v"] is not None:
            b = _pack_bias([biases["k"], biases["v"]], n, h, dtype)
            kv = _add(nodes, f"{name}/kv_bias", kv, b)
        kv = _reshape(nodes, f"{name}/kv_packed", kv, [0, 0, n, 2, h], [*_leading(x), n, 2, h])
        query = m.node("q_split").inputs[0]
        nodes.append(_node("MultiHeadAttention", f"{name}/MultiHeadAttention", [query, kv, None, None, None, bias_input], out, attrs))
    elif all(b is None for b in biases.values()):
        qkv = _matmul(nodes, f"{name}/qkv", x, packed("qkv", lambda ws: _pack(ws, n, h)), [*_leading(x), 3 * n * h])
        qkv = _reshape(nodes, f"{name}/qkv_packed", qkv, [0, 0, n, 3, h], [*_leading(x), n, 3, h])
        nodes.append(_node("MultiHeadAttention", f"{name}/MultiHeadAttention", [qkv, None, None, None, None, bias_input], out, attrs))
    else:
        w = gs.Constant(f"{name}/Attention.weights", packed("qkv", lambda ws: np.concatenate(ws, axis=1)))
        b = gs.Constant(f"{name}/Attention.bias", np.concatenate([_or_zeros(biases[t], n * h, dtype) for t in "qkv"]))
        nodes.append(_node("Attention", f"{name}/Attention", [x, w, b, None, None, bias_input], out, attrs))
    return nodes


def _pack(matrices: list[np.ndarray], n: int, h: int) -> np.ndarray:
    """(Din, N*H) each -> (Din, N * len * H), so the product reshapes to (.., N, len, H)."""
    d_in = matrices[0].shape[0]
    return np.stack([w.reshape(d_in, n, h) for w in matrices], axis=2).reshape(d_in, -1)


def _pack_bias(biases: list, n: int, h: int, dtype) -> np.ndarray:
    return np.stack([_or_zeros(b, n * h, dtype).reshape(n, h) for b in biases], axis=1).reshape(-1)


def _or_zeros(b, size: int, dtype) -> np.ndarray:
    return np.zeros(size, dtype) if b is None else b.astype(dtype)


def _attention_bias(m: Match, site: Site, nodes: list) -> gs.Tensor | None:
    """The mask as (.., .., S, L): unsqueezed in front to 4-D."""
    mask = site.attention_bias
    if mask is None or site.mask_rank == 4:
        return mask
    axes = gs.Constant(f"{site.name}/attention_bias.axes", np.arange(4 - site.mask_rank, dtype=np.int64))
    shape = [1] * (4 - site.mask_rank) + list(mask.shape) if mask.shape is not None else None
    out = gs.Variable(f"{site.name}/attention_bias", dtype=mask.dtype, shape=shape)
    nodes.append(gs.Node("Unsqueeze", f"{site.name}/attention_bias", inputs=[mask, axes], outputs=[out]))
    return out


def _leading(x: gs.Tensor) -> list:
    return list(x.shape[:-1]) if x.shape is not None else [None, None]


def _matmul(nodes, name, x, w: np.ndarray, shape) -> gs.Variable:
    out = gs.Variable(name, dtype=w.dtype, shape=shape)
    nodes.append(gs.Node("MatMul", name, inputs=[x, gs.Constant(f"{name}.weight", w)], outputs=[out]))
    return out


def _matmul_by(nodes, name, x, w: gs.Tensor) -> gs.Variable:
    """x @ w with the exported weight tensor itself (not a copy)."""
    out = gs.Variable(name, dtype=x.dtype, shape=[*_leading(x), w.shape[-1]] if w.shape is not None else None)
    nodes.append(gs.Node("MatMul", name, inputs=[x, w], outputs=[out]))
    return out


def _add(nodes, name, x, b: np.ndarray) -> gs.Variable:
    out = gs.Variable(name, dtype=x.dtype, shape=x.shape)
    nodes.append(gs.Node("Add", name, inputs=[x, gs.Constant(f"{name}.bias", b)], outputs=[out]))
    return out


def _split(nodes, name, x, roles: str, width: int) -> dict[str, gs.Variable]:
    """x (.., len(roles) * width) -> one (.., width) tensor per role, named <name>/<role>."""
    outs = {t: gs.Variable(f"{name}/{t}", dtype=x.dtype, shape=[*_leading(x), width]) for t in roles}
    sizes = gs.Constant(f"{name}/split.sizes", np.full(len(roles), width, np.int64))
    nodes.append(gs.Node("Split", f"{name}/split", attrs={"axis": -1}, inputs=[x, sizes], outputs=list(outs.values())))
    return outs


def _reshape(nodes, name, x, target: list[int], shape) -> gs.Variable:
    out = gs.Variable(name, dtype=x.dtype, shape=shape)
    nodes.append(gs.Node("Reshape", name, inputs=[x, gs.Constant(f"{name}.shape", np.array(target, np.int64))], outputs=[out]))
    return out


def _node(op_type: str, name: str, inputs: list, out: gs.Variable, attrs: dict) -> gs.Node:
    while inputs and inputs[-1] is None:
        inputs = inputs[:-1]
    inputs = [gs.Variable.empty() if t is None else t for t in inputs]
    return gs.Node(op_type, name, attrs=attrs, inputs=inputs, outputs=[out], domain=MS_DOMAIN)


# ---------------------------------------------------------------- the pass


def read_site(m: Match, run: FusionRun) -> Site:
    """check_site with the run's shared Dims (dims proven equal across sites)."""
    return check_site(run.graph, m, run.memo.setdefault("dims", Dims()))


def emit_attention(make: Emit, site: Site) -> list[gs.Tensor]:
    nodes = fused_nodes(site.match, site, site.layout)
    make.nodes.extend(nodes)
    return list(nodes[-1].outputs)


@register_pass
class FuseAttention(Fusion, OrtFusion):
    name = "fuse-attention"
    description = "fuse attention (self, cross, VAE, causal CLIP) into com.microsoft MultiHeadAttention/Attention, packing Q/K/V weights and keeping biases"
    requires = frozenset({SHAPES_INFERRED, ATTENTION_CANONICAL})
    LAYOUTS = ("packed", "split", "separate")
    rules = (Rule(ATTENTION, read_site, emit_attention, label=lambda m: _site_name(m)),)
    defer_rewrites = True  # check every site on the unchanged graph, then rewrite

    def __init__(self, layout: str = "packed", cross_layout: str = "separate"):
        for option, value in (("layout", layout), ("cross_layout", cross_layout)):
            if value not in self.LAYOUTS:
                raise PassOptionError(f"fuse-attention: {option} must be one of {', '.join(self.LAYOUTS)}, not '{value}'")
        self.layout = layout
        self.cross_layout = cross_layout

    def before_rewrites(self, run: FusionRun, sites: list[FusionSite]) -> list[FusionSite]:
        names = {n.name for n in run.graph.nodes} | set(run.graph.tensors())
        kinds: Counter = Counter()
        for fusion_site in sites:
            site, m = fusion_site.facts, fusion_site.match
            site.name = _unused(site.name, names)  # prefixes the new nodes' and tensors' names
            site.match, site.layout = m, self.cross_layout if site.cross else self.layout
            kinds[site.kind] += 1
            kinds["with projection bias"] += any(m.get(f"b{t}") is not None for t in "qkv")
            kinds["causal"] += site.causal
            kinds["attention_bias"] += site.attention_bias is not None
        run.result.details = {k: v for k, v in kinds.items() if v}
        return sites


# ---------------------------------------------------------------- small helpers


def _site_name(m: Match) -> str:
    """The attention module's name, from its Softmax: '/unet/.../attn1' (or the Softmax's name)."""
    name = m.node("softmax").name
    return name.rsplit("/", 1)[0] if "/" in name.strip("/") else name


# Names fused_nodes gives new nodes and tensors, after the site's prefix.
CREATED_NAMES = (
    "MultiHeadAttention", "Attention", "Attention.weights", "Attention.bias", "attention_out", "attention_bias",
    "attention_bias.axes", "qkv", "qkv.weight", "qkv_packed", "qkv_packed.shape", "kv", "kv.weight", "kv_bias",
    "kv_bias.bias", "kv_packed", "kv_packed.shape", "q", "k", "v", "k_bias", "k_bias.bias", "v_bias", "v_bias.bias",
    "qkv_bias", "qkv_bias.bias", "split", "split.sizes",
)


def _unused(base: str, names: set) -> str:
    """``base``, or ``base_2``, ``base_3`` ...: a prefix under which no name fused_nodes makes exists."""
    candidate, k = base, 1
    while any(f"{candidate}/{suffix}" in names for suffix in CREATED_NAMES):
        k += 1
        candidate = f"{base}_{k}"
    names.update(f"{candidate}/{suffix}" for suffix in CREATED_NAMES)
    return candidate


def _dtype(constant: gs.Tensor) -> np.dtype:
    """A constant's dtype, without loading an initializer's data."""
    if isinstance(constant, gs.Constant):
        return np.dtype(constant.dtype)
    return constant_value(constant).dtype


def _times(a: Dim | None, b: Dim | None) -> Dim | None:
    return None if a is None or b is None else a * b


