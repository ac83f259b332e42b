"""split-concat-projection (ort-cuda): a Linear of a Concat along the features as the sum of two
Linears, so that the Concat (a copy of both inputs) is never written.

    c = Concat(a, m, axis=-1)              a (.., Da), m (.., Dm)
    y = Add(MatMul(c, W), b)               W (Da + Dm, N), b (N,)
                         ==>
    y = Add(Add(MatMul(m, W[Da:]), MatMul(a, W[:Da])), b)

Flux's single block: ``proj_out(cat([attn_output, mlp_hidden], dim=2))`` with Da = D and Dm = 4D:
the Concat read and wrote 5 (B, S, D) tensors each; the second product and the sum of the two
read and write 4. The sum comes before the bias so that fuse-bias-add does not take it: its
BiasAdd (input + bias + skip, one kernel fewer) has no bfloat16 CUDA kernel (docs/bf16-kernels.md),
and Flux is served in bfloat16.

Why it is the same: ``[a, m] W = a W[:Da] + m W[Da:]`` (row blocks of W against column blocks of c).
The two halves of W are lazy weights (computed when saved, from W's stored values): a big model's W
is not read while the passes run, and W itself leaves the graph.

Conditions: the Concat joins two tensors along the last axis (-1, or rank - 1 with the rank known),
with last dims Da and Dm adding up to W's rows (one of them may be symbolic: it is W's rows less
the other, or the source's MatMul fails); the Concat read by the MatMul alone, the
product by the Add alone; W a constant 2-D matrix, b a constant (N,) or (1, .., N).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.pass_infra import OrtFusion
from onnxopt.pattern import Const, Match, Pattern, Var, constant_shape, op
from onnxopt.pattern.tensor_facts import normalize_axis, rank_of, static_dim
from onnxopt.registry import register_pass
from onnxopt.weights import DerivedValues, read_uncached, stored_values


def concat_projection(a, m, w=Const(), b=Const()):
    joined = op.Concat(a, m, _name="join", axis=Var("axis"))
    return op.Add(op.MatMul(joined, w, _name="proj"), b, _name="bias_add")


CONCAT_PROJECTION = Pattern(concat_projection, name="concat-projection")


@dataclass
class SplitSite:
    match: Match
    rows_a: int  # Da: W's rows that read a


def check(match: Match, run: FusionRun) -> SplitSite:
    a, m = match["a"], match["m"]
    axis = int(match.attrs["axis"])
    rank = rank_of(match.node("join").outputs[0]) or rank_of(a) or rank_of(m)
    if axis != -1 and (rank is None or normalize_axis(axis, rank) != rank - 1):
        raise Refusal(f"the Concat joins axis {axis}, not the features (the last axis)")
    w, b = list(constant_shape(match["w"])), list(constant_shape(match["b"]))
    if len(w) != 2:
        raise Refusal(f"the projection's weight has shape {w}; a Linear's is 2-D")
    if b[-1:] != [w[1]] or any(s != 1 for s in b[:-1]):
        raise Refusal(f"the projection's bias has shape {b}, not ({w[1]},)")
    da, dm = static_dim(a, -1), static_dim(m, -1)
    # one width unknown to shape inference (TorchScript's MultiHeadAttention output) is W's rows less the
    # other: any other width makes the source's MatMul fail, and the split's too
    da, dm = (w[0] - dm if da is None and dm is not None else da), (w[0] - da if dm is None and da is not None else dm)
    if da is None or dm is None or da + dm != w[0] or min(da, dm) <= 0:
        raise Refusal(f"the joined widths {da} + {dm} are not static or not the weight's {w[0]} rows")
    return SplitSite(match, da)


def rows_of(weight: gs.Constant, start: int, stop: int) -> DerivedValues:
    """weight[start:stop], computed when saved (or read) from the values it holds now."""
    source, (_, n) = stored_values(weight), constant_shape(weight)
    return DerivedValues((stop - start, n), weight.dtype, lambda: read_uncached(source)[start:stop].copy(),
                         name=f"{weight.name}__rows_{start}_{stop}")


def emit(make: Emit, site: SplitSite) -> list[gs.Tensor]:
    match = site.match
    w, rows = match["w"], constant_shape(match["w"])[0]
    y = match.node("bias_add").outputs[0]
    w_a = make.constant("w_first", rows_of(w, 0, site.rows_a))
    w_m = make.constant("w_second", rows_of(w, site.rows_a, rows))
    product_a = make.op.MatMul(match["a"], w_a, _shape=y.shape, _dtype=y.dtype, _label="first")
    product_m = make.op.MatMul(match["m"], w_m, _shape=y.shape, _dtype=y.dtype, _label="second")
    total = make.op.Add(product_m, product_a, _shape=y.shape, _dtype=y.dtype, _label="sum")
    return [make.op.Add(total, match["b"], _shape=y.shape, _dtype=y.dtype, _label="bias")]


@register_pass
class SplitConcatProjection(Fusion, OrtFusion):
    name = "split-concat-projection"
    description = ("Linear(Concat(a, m)) -> Linear(a) + Linear(m) with the weight's row blocks: the Concat is never "
                   "written (Flux's single-block proj_out)")
    rules = (Rule(CONCAT_PROJECTION, check, emit),)


__all__ = ["CONCAT_PROJECTION", "SplitConcatProjection"]
