"""fold-value-bias (ort-cuda; after fuse-attention): the V projection's bias of a self-attention moved
past the attention and through the output projection into its bias: one elementwise pass over V fewer.

    v = Add(p, b_v)                         p = x @ W_v (stays), b_v (D,)
    o = MultiHeadAttention(q, k, v)         (com.microsoft; no bias, mask, attention bias or past)
    y = Add(MatMul(o, W_o), b_o)            SD3.5's attn2: ``to_out.0``
      | Add(MatMul(Concat(o, m, axis=-1), W_o), b_o)      Flux's single block: ``proj_out(cat([attn, mlp]))``
                         ==>
    o = MultiHeadAttention(q, k, p)
    y = Add(MatMul(o, W_o), b_o + b_v @ W_o[r:r + D])     r: the row of W_o where o's columns start

Why: each attention output row is a convex combination of V's rows (softmax rows sum to 1), so
``P (V + 1 b_v) = P V + 1 b_v``: the bias comes out of the attention unchanged, and
``(O + 1 b_v) W_o = O W_o + 1 (b_v W_o)``; in the Concat form only W_o's rows that read o's columns
see it. The new bias is computed in float64 from the constants, when the model is saved (a lazy
weight: Flux.1-dev's 38 proj_out matrices are not read while the passes run).

Why not MultiHeadAttention's own ``bias`` input (Q, K, V biases, 3 x D): with one present, ORT's CUDA
MHA adds it to Q, K and V into a workspace before flash / memory-efficient attention
(``LaunchAddBias``, contrib_ops/cuda/bert/attention_prepare_qkv.cu), three passes where the Add was one.

Conditions: the MHA reads q, k, v only (no bias, key padding mask, attention bias or past: with a
mask a row of P may be all zero) and v is the Add of a constant bias of shape (D,) or (1, .., D),
D = v's static last dim; o is read by the output MatMul alone (or by the Concat, o's columns at a
static offset along the last axis); W_o a constant 2-D matrix and b_o a constant (N,) or (1, .., N).
Joint attention (SD3/Flux double blocks) is no site: its V is the Concat of two streams with two biases.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.domains import MS_DOMAIN
from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.pass_infra import OrtFusion
from onnxopt.pattern import Const, Match, Pattern, Var, constant_shape, op
from onnxopt.pattern.tensor_facts import normalize_axis, rank_of, static_dim
from onnxopt.registry import register_pass
from onnxopt.weights import DerivedValues, read_uncached, stored_values


def _attention_of_biased_value(p, q, k, b_v):
    return op.MultiHeadAttention(q, k, op.Add(p, b_v, _name="v_bias"), _domain=MS_DOMAIN, _name="mha")


def attention_output_projection(p, q, k, b_v=Const(), w_o=Const(), b_o=Const()):
    o = _attention_of_biased_value(p, q, k, b_v)
    return op.Add(op.MatMul(o, w_o, _name="out_proj"), b_o, _name="out_bias")


def attention_joined_output_projection(p, q, k, m, b_v=Const(), w_o=Const(), b_o=Const()):
    o = _attention_of_biased_value(p, q, k, b_v)
    joined = op.Concat(o, m, _name="join", axis=Var("axis"))
    return op.Add(op.MatMul(joined, w_o, _name="out_proj"), b_o, _name="out_bias")


VALUE_BIAS_FORMS = (
    Pattern(attention_output_projection, name="value-bias-output-projection"),
    Pattern(attention_joined_output_projection, name="value-bias-joined-output-projection"),
)


@dataclass
class ValueBiasSite:
    match: Match
    d: int  # V's width: W_o's rows 0 .. d read o's columns


def check(match: Match, run: FusionRun) -> ValueBiasSite:
    v = match.node("v_bias").outputs[0]
    d = static_dim(v, -1)
    b_v, w_o, b_o = (list(constant_shape(match[name])) for name in ("b_v", "w_o", "b_o"))
    if d is None:
        raise Refusal("V's last dim is not static")
    if b_v[-1:] != [d] or any(s != 1 for s in b_v[:-1]) or len(b_v) > (rank_of(v) or 0):
        raise Refusal(f"the constant added to V has shape {b_v}; a bias is ({d},)")
    if len(w_o) != 2:
        raise Refusal(f"the output projection's weight has shape {w_o}; a Linear's is 2-D")
    if b_o[-1:] != [w_o[1]] or any(s != 1 for s in b_o[:-1]):
        raise Refusal(f"the output projection's bias has shape {b_o}, not ({w_o[1]},)")
    if "m" in match:  # o's columns come first in the Concat (the pattern's order): W_o's first d rows read them
        axis, rank = int(match.attrs["axis"]), rank_of(match.node("join").outputs[0]) or rank_of(match["m"])
        if axis != -1 and (rank is None or normalize_axis(axis, rank) != rank - 1):
            raise Refusal("the Concat does not join the last axis: the bias would not stay per column")
    if d > w_o[0]:
        raise Refusal(f"the output projection reads {w_o[0]} columns, fewer than V's {d}")
    run.details["joined"] += "m" in match
    return ValueBiasSite(match, d)


def folded_bias(site: ValueBiasSite) -> DerivedValues:
    """b_o + b_v @ W_o[:d] in float64, in b_o's dtype and shape: computed when saved (or read), from
    the values the three constants hold now (a later fp16 conversion of W_o does not reach it)."""
    b_v, w_o, b_o = (stored_values(site.match[name]) for name in ("b_v", "w_o", "b_o"))
    shape, dtype, d = tuple(constant_shape(site.match["b_o"])), site.match["b_o"].dtype, site.d

    def compute() -> np.ndarray:
        bias = read_uncached(b_o)
        folded = bias.astype(np.float64).reshape(-1) + read_uncached(b_v).astype(np.float64).reshape(d) @ read_uncached(w_o)[:d].astype(np.float64)
        return folded.reshape(shape).astype(bias.dtype)

    return DerivedValues(shape, dtype, compute, name=f"{site.match['b_o'].name}__with_value_bias")


def emit(make: Emit, site: ValueBiasSite) -> list[gs.Tensor]:
    match = site.match
    mha, out_proj, out_bias = match.node("mha"), match.node("out_proj"), match.node("out_bias")
    o = make.ms.MultiHeadAttention(match["q"], match["k"], match["p"], _shape=mha.outputs[0].shape, _dtype=mha.outputs[0].dtype,
                                   _label="attention", **dict(mha.attrs))
    projected_input = o
    if "m" in match:
        join = match.node("join")
        projected_input = make.op.Concat(o, match["m"], axis=join.attrs["axis"], _shape=join.outputs[0].shape,
                                         _dtype=join.outputs[0].dtype)
    product = make.op.MatMul(projected_input, match["w_o"], _shape=out_proj.outputs[0].shape, _dtype=out_proj.outputs[0].dtype)
    bias = make.constant("out_bias_with_value_bias", folded_bias(site))
    return [make.op.Add(product, bias, _shape=out_bias.outputs[0].shape, _dtype=out_bias.outputs[0].dtype)]


@register_pass
class FoldValueBias(Fusion, OrtFusion):
    name = "fold-value-bias"
    description = ("a self-attention's V bias moved past MultiHeadAttention (softmax rows sum to 1) into the output "
                   "projection's bias: one pass over V fewer")
    runs_after = {"fuse-attention": "the attention is MultiHeadAttention after it"}
    rules = tuple(Rule(form, check, emit, site=lambda m: m.node("mha")) for form in VALUE_BIAS_FORMS)

    def finish(self, run: FusionRun) -> None:
        run.result.details.update(joined=run.details["joined"])


__all__ = ["FoldValueBias", "VALUE_BIAS_FORMS"]
