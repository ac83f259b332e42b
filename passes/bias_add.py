"""fuse-bias-add: a Linear's bias Add and the residual Add after it as one com.microsoft BiasAdd.

    p = x @ W                      MatMul (stays)
    y = Add(Add(p, bias), skip)    bias: a 1-D constant (C); p, skip: (B, S, C)
                         ==>
    y = BiasAdd(p, bias, skip)     (com.microsoft)

Where it fires in SD UNets: the feed-forward output of the *last* BasicTransformerBlock of every
Transformer2DModel, ``ff(norm3(h)) + h``. Every other Linear + residual Add there feeds a
LayerNorm (norm2, norm3, the next block's norm1) and becomes SkipLayerNormalization with a bias
instead; this pass leaves those to fuse-skip-layer-norm (details["left_for_skip_layer_norm"]),
whichever runs first. (The Transformer2DModel's ``proj_out(h) + residual`` is not a site: the
residual Add happens in NCHW after a Reshape/Transpose, or after a 1x1 Conv.)

Conditions, from ORT's CUDA kernel (bias_add.cc), which checks them at run time:
p is 3-D; bias is (C,); skip has exactly p's shape (no broadcasting: a static 1 against another
dim is refused; dims that shape inference left symbolic are taken as equal -- a mismatch there
makes the kernel fail, it cannot compute something else); fp32 or fp16. Any C: ORT 1.31.1's
kernel, run on an H100, took 16, 320, 640, 768 and 1280 channels (releases before it rejected
everything but 320, 640 and 1280).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.pass_infra import OrtFusion
from onnxopt.pattern import Const, Match, Pattern, constant_shape, op
from onnxopt.pattern.tensor_facts import dims_agree, dims_conflict, rank_of, shape_of, static_dim
from onnxopt.registry import register_pass
from onnxopt.weights import numpy_dtype

KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
LAYER_NORMS = ("LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


def linear_residual(x, w, skip, bias=Const()):
    product = op.MatMul(x, w, _outputs=["product"])
    return op.Add(op.Add(product, bias, _name="bias_add"), skip, _name="sum")


LINEAR_RESIDUAL = Pattern(linear_residual, name="linear-residual")


def check(match: Match, run: FusionRun) -> Match:
    """The conditions of the module docstring; the match itself is the site."""
    product, skip = match["product"], match["skip"]
    if any(c.op in LAYER_NORMS for c in match.output.outputs):
        run.details["left_for_skip_layer_norm"] += 1
        raise Refusal("the sum feeds a LayerNorm: a SkipLayerNormalization site (fuse-skip-layer-norm)", not_a_site=True)
    bias_shape = constant_shape(match["bias"])
    if len(bias_shape) != 1:
        raise Refusal(f"bias has shape {list(bias_shape)}; BiasAdd takes a 1-D bias")
    c = int(bias_shape[0])
    if rank_of(product) != 3 or rank_of(skip) != 3:
        raise Refusal(f"operands of shapes {shape_of(product)} and {shape_of(skip)}; BiasAdd takes (B, S, C)")
    if static_dim(product, -1) != c or static_dim(skip, -1) != c:
        raise Refusal(f"last dims {shape_of(product)[-1]!r} and {shape_of(skip)[-1]!r} are not both the bias size {c}")
    if any(dims_conflict(a, b) for a, b in zip(shape_of(product), shape_of(skip))):
        raise Refusal(f"{shape_of(product)} + {shape_of(skip)} broadcasts; BiasAdd needs skip of the input's shape")
    dtype = product.dtype
    if dtype is not None and numpy_dtype(dtype) not in KERNEL_DTYPES:
        raise Refusal(f"dtype {numpy_dtype(dtype)}; the CUDA kernel takes float32 and float16")
    run.details["dims_assumed_equal"] += not all(dims_agree(a, b) for a, b in zip(shape_of(product), shape_of(skip)))
    return match


def emit(make: Emit, match: Match) -> list[gs.Tensor]:
    return [make.ms.BiasAdd(match["product"], match["bias"], match["skip"])]


@register_pass
class FuseBiasAdd(Fusion, OrtFusion):
    name = "fuse-bias-add"
    description = "fuse a Linear's bias Add and the residual Add after it into com.microsoft BiasAdd"
    rules = (Rule(LINEAR_RESIDUAL, check, emit),)

    def finish(self, run: FusionRun) -> None:
        run.result.details.update(left_for_skip_layer_norm=run.details["left_for_skip_layer_norm"],
                                  dims_assumed_equal=run.details["dims_assumed_equal"])


__all__ = ["LINEAR_RESIDUAL", "FuseBiasAdd"]
