"""fuse-fast-gelu: the tanh GELU (diffusers' ``gelu-approximate`` FeedForward in SD3/Flux, T5's
``gelu_new``) with the Linear's bias Add in front as one com.microsoft FastGelu.

    h = X + bias | X                 bias: a constant, one value per last-axis element
    y = Gelu(h, approximate="tanh")                                          (ONNX opset 20+)
      | 0.5 * h * (1 + Tanh(sqrt(2/pi) * (h + 0.044715 * h^3)))               (the explicit chain;
        h^3 as Pow(h, 3) or h * h * h, the 0.5 on h, on the sum or on the product)
                         ==>
    y = FastGelu(X, bias)            (com.microsoft; bias left out when there is none)

Conditions: the constants are sqrt(2/pi) and 0.044715 (to fp32 precision: a GELU with another
constant is another function); h is a float tensor. The bias Add is folded when the GELU alone
reads it and its constant holds D = X's static last dim values ((D,) or (1, .., D)); otherwise
the GELU is fused without it (details["bias_left_outside"]). The kernels (CPU; CUDA float32,
float16, bfloat16) compute in float32.

T5's gated GELU, ``gelu_new(x W_i0) * (x W_i1)``, becomes ``FastGelu(x W_i0) * (x W_i1)``: ONNX
Runtime has no op for a tanh-GELU gate (BiasSplitGelu gates with the erf GELU, at SD's widths
only), so the gating Mul stays elementwise.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.layer_norm_kernel import per_channel
from onnxopt.pass_infra import OrtFusion
from onnxopt.pattern import Const, Literal, Match, OneOf, Pattern, op
from onnxopt.pattern.tensor_facts import rank_of, shape_of, static_dim
from onnxopt.registry import register_pass
from onnxopt.weights import numpy_dtype

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBIC = 0.044715


def _exactly(value: float) -> Literal:
    return Literal(value, rtol=1e-6, atol=0)  # fp32 rounding of the constant, nothing more


def tanh_gelu(h):
    """0.5 * h * (1 + tanh(sqrt(2/pi) * (h + 0.044715 * h^3))), or the ONNX Gelu op saying so."""
    cube = OneOf(h * (h * h), (h * h) * h, h ** _exactly(3.0))
    one_plus_tanh = op.Tanh((h + cube * _exactly(CUBIC)) * _exactly(SQRT_2_OVER_PI)) + _exactly(1.0)
    half = _exactly(0.5)
    return OneOf(
        op.Gelu(h, approximate="tanh"),
        (h * one_plus_tanh) * half,   # TorchScript's aten::gelu(approximate="tanh")
        (h * half) * one_plus_tanh,   # T5's NewGELUActivation
        h * (one_plus_tanh * half),
    )


def biased_tanh_gelu(x, bias=Const()):
    return tanh_gelu(op.Add(x, bias, _name="bias_add"))


def plain_tanh_gelu(h):
    return tanh_gelu(h)


BIASED_TANH_GELU = Pattern(biased_tanh_gelu, name="bias-tanh-gelu")
TANH_GELU = Pattern(plain_tanh_gelu, name="tanh-gelu")


def check_biased(match: Match, run: FusionRun) -> Match:
    x, bias = match["x"], match["bias"]
    _check_float(x)
    d = static_dim(x, -1)
    shape = shape_of(bias)
    if d is None:
        run.details["bias_left_outside"] += 1
        raise Refusal("the last dim of the biased input is not static", not_a_site=True)
    if not shape or shape[-1] != d or any(s != 1 for s in shape[:-1]) or len(shape) > (rank_of(x) or 0):
        run.details["bias_left_outside"] += 1  # the GELU alone is the tanh-gelu rule's site
        raise Refusal(f"the Add's constant has shape {shape}; FastGelu's bias is one value per last-axis element ({d},)",
                      not_a_site=True)
    run.details["bias_folded"] += 1
    return match


def check_plain(match: Match, run: FusionRun) -> Match:
    _check_float(match["h"])
    return match


def emit_biased(make: Emit, match: Match) -> list[gs.Tensor]:
    x = match["x"]
    return [make.ms.FastGelu(x, per_channel(make, match["bias"], static_dim(x, -1)), _shape=x.shape)]


def emit_plain(make: Emit, match: Match) -> list[gs.Tensor]:
    return [make.ms.FastGelu(match["h"], _shape=match["h"].shape)]


@register_pass
class FuseFastGelu(Fusion, OrtFusion):
    name = "fuse-fast-gelu"
    description = "fuse the tanh GELU (explicit chain or Gelu(approximate='tanh')) and its bias Add into com.microsoft FastGelu"
    rules = (
        Rule(BIASED_TANH_GELU, check_biased, emit_biased),
        Rule(TANH_GELU, check_plain, emit_plain),  # no bias Add in front, or one the GELU cannot take
    )

    def finish(self, run: FusionRun) -> None:
        run.result.details.update(bias_folded=run.details["bias_folded"], bias_left_outside=run.details["bias_left_outside"])


def _check_float(x: gs.Tensor) -> None:
    if x.dtype is not None and numpy_dtype(x.dtype).kind != "f" and str(numpy_dtype(x.dtype)) != "bfloat16":
        raise Refusal(f"the GELU's input has type {numpy_dtype(x.dtype)}; FastGelu takes float types")


__all__ = ["BIASED_TANH_GELU", "TANH_GELU", "FuseFastGelu"]
