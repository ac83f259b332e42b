"""flatten-matmul: a Linear on a 3-D (or higher) input as one 2-D GEMM. Opt-in.

    y = MatMul(x, W)                 x (..., M_i, K) of rank >= 3; W a constant 2-D (K, N)
                         ==>
    x2 = Reshape(x, [-1, K])                         (M, K), M the product of x's leading dims
    y2 = MatMul(x2, W)                               (M, N): one GEMM
    y  = Reshape(y2, [x's leading dims..., N])       a constant shape where exact, else
                                                     Concat(Shape(x, end=-1), [N])

Why: exporters write every Linear of a transformer as a MatMul of a (B, S, K) activation by a 2-D
weight, and ONNX Runtime's MatMul may run such a product as a strided batched GEMM over B rather
than one GEMM over B*S rows. The 2-D form computes the same numbers (each output row is the same
dot products); whether it is faster is measured in benchmarks/ (benchmarks/dit_gpu.py's
``onnxopt-fp16-flat`` row), which is why no preset includes this pass.

What reads y is left as it was: the bias Add, or the FastGelu / SkipLayerNormalization /
MultiHeadAttention / BiasAdd the ``ort-cuda`` fusions wrote around the MatMul keep reading the same
(..., N) tensor, restored by the second Reshape. com.microsoft ops that run their own GEMM
(Attention with a packed weight, GemmFloat8) and Gemm nodes are not MatMuls: untouched.

The Reshapes are free: both read contiguous tensors, which ONNX Runtime reshapes as views
(onnxopt.row_view says how the shape back is written).

Conditions (each refusal says which): W a constant of rank 2, so K (its first dim) is known; x of
known rank >= 3 (rank 2 is already one GEMM and is not a site); x's last dim K, or unknown (shape
inference loses some in TorchScript exports; MatMul itself requires it to be K); where the shape
back needs x's run-time shape (two or more unknown leading dims), the model at opset 15 or later.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.pass_infra import OrtFusion
from onnxopt.pattern import Match, constant_shape, is_constant
from onnxopt.pattern.tensor_facts import rank_of, shape_of, static_dim
from onnxopt.registry import register_pass
from onnxopt.row_view import LINEAR, SHAPE_SLICE_OPSET, LinearRows, from_rows, leading_dims, needs_runtime_shape, to_rows


def check(match: Match, run: FusionRun) -> LinearRows:
    x, w = match["x"], match["w"]
    rank = rank_of(x)
    if rank is not None and rank <= 2:
        raise Refusal(f"x has rank {rank}: already one GEMM", not_a_site=True)
    if not is_constant(w):
        raise Refusal("the weight is not a constant (a product of two activations, e.g. attention scores)")
    w_shape = constant_shape(w)
    if len(w_shape) != 2:
        raise Refusal(f"the weight has shape {list(w_shape)}, not (K, N): a batched product")
    if rank is None:
        raise Refusal("x's rank is unknown (run shape inference first)")
    k, n = (int(d) for d in w_shape)
    if static_dim(x, -1) not in (None, k):  # unknown is fine: a valid MatMul has x's last dim = K
        raise Refusal(f"x's last dim is {shape_of(x)[-1]!r}, not the weight's K={k}")
    leading = leading_dims(x)
    if needs_runtime_shape(leading, n) and run.model.opset < SHAPE_SLICE_OPSET:
        raise Refusal(f"x's leading dims {leading} need Shape(x, end=-1), which opset {run.model.opset} lacks "
                      f"(opset {SHAPE_SLICE_OPSET}+)")
    return LinearRows(x, w, k, n, leading, match.output)


def emit(make: Emit, site: LinearRows) -> list[gs.Tensor]:
    rows = to_rows(make, site.x, site.k, site.leading)
    y2 = make.op.MatMul(rows, site.w, _shape=[rows.shape[0], site.n], _label="gemm")
    return [from_rows(make, y2, site.x, site.leading, site.n, shape=site.output.shape)]


@register_pass
class FlattenMatmul(Fusion, OrtFusion):
    name = "flatten-matmul"
    description = ("opt-in: a MatMul of a rank >= 3 input by a constant 2-D weight as one 2-D GEMM "
                   "between two free Reshapes")
    rules = (Rule(LINEAR, check, emit),)


__all__ = ["FlattenMatmul", "LINEAR"]
