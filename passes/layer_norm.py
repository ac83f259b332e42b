"""fuse-layer-norm: a decomposed LayerNorm as one LayerNormalization op (older exports; opset >= 17
has the op and both exporters use it):

    m = ReduceMean(x, axes=[-1])
    d = x - m
    v = ReduceMean(d ** 2 | d * d, axes=[-1])
    n = d / Sqrt(v + eps)  |  d * Reciprocal(Sqrt(v + eps))
    y = n * gamma + beta
                         ==>   y = LayerNormalization(x, gamma, beta, axis=-1, epsilon=eps)

    Without the affine (nn.LayerNorm(elementwise_affine=False): SD3's and Flux's AdaLN norms),
    y = n  ==>  LayerNormalization(x, ones(D), axis=-1, epsilon=eps) (the Mul/Add a weighted rule
    refused stay after it).

    Conditions: both means over the last axis only, keepdims=1; eps a one-element constant;
    gamma and beta hold D = x's (static) last dim values, broadcast along the last axis only; the
    model's opset is >= 17.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.layer_norm_kernel import per_channel
from onnxopt.norm_facts import last_axis_refusal, per_channel_refusal
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED
from onnxopt.pattern import Const, Literal, Match, OneOf, Pattern, constant_shape, op
from onnxopt.pattern.tensor_facts import rank_of, static_dim
from onnxopt.registry import register_pass
from onnxopt.weights import numpy_dtype


def normalized(x, eps=Const()):
    d = x - op.ReduceMean(x, _extra_inputs=True, _name="mean", keepdims=1)
    variance = op.ReduceMean(OneOf(d ** Literal(2.0, rtol=0, atol=0), d * d), _extra_inputs=True, _name="variance", keepdims=1)
    std = op.Sqrt(variance + eps)
    return OneOf(d / std, d * op.Reciprocal(std))


def decomposed_layer_norm(x, gamma, beta, eps=Const()):
    return normalized(x, eps) * gamma + beta


def decomposed_layer_norm_without_affine(x, eps=Const()):
    return normalized(x, eps)


DECOMPOSED_LAYER_NORM = Pattern(decomposed_layer_norm, name="decomposed-layer-norm")
# nn.LayerNorm(elementwise_affine=False), SD3's and Flux's AdaLN norm, written out: what the affine
# rule leaves (its Mul/Add then stay outside: a modulation, or not per channel)
DECOMPOSED_LAYER_NORM_WITHOUT_AFFINE = Pattern(decomposed_layer_norm_without_affine, name="decomposed-layer-norm-without-affine")


def check_layer_norm(match: Match, run: FusionRun) -> Match:
    reason = _layer_norm_refusal(match, run.graph.opset)
    if reason is not None:
        raise Refusal(reason)
    return match


def emit_layer_norm(make: Emit, match: Match) -> list[gs.Tensor]:
    d = static_dim(match["x"], -1)
    if "gamma" in match:
        gamma, beta = per_channel(make, match["gamma"], d), per_channel(make, match["beta"], d)
    else:  # no affine: scale 1, no bias
        gamma, beta = make.constant("ones", np.ones(d, dtype=numpy_dtype(match["x"].dtype))), None
    eps = float(match.value("eps").reshape(-1)[0])
    return [make.op.LayerNormalization(match["x"], gamma, beta, axis=-1, epsilon=eps)]


@register_pass
class FuseLayerNorm(Fusion):
    name = "fuse-layer-norm"
    description = "fuse decomposed LayerNorm (ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add) into LayerNormalization"
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})
    rules = (Rule(DECOMPOSED_LAYER_NORM, check_layer_norm, emit_layer_norm),
             Rule(DECOMPOSED_LAYER_NORM_WITHOUT_AFFINE, check_layer_norm, emit_layer_norm))


def _layer_norm_refusal(match, opset: int) -> str | None:
    x = match["x"]
    rank = rank_of(x)
    for name in ("mean", "variance"):
        reason = last_axis_refusal(match.node(name), rank, name)
        if reason is not None:
            return reason
    if int(np.prod(constant_shape(match["eps"]))) != 1:
        return "epsilon is not a single value"
    d = static_dim(x, -1)
    if d is None:
        return "the normalized (last) dim is not static"
    for name in ("gamma", "beta") if "gamma" in match else ():
        reason = per_channel_refusal(name, match[name], d, rank, "LayerNormalization")
        if reason is not None:
            return reason
    if opset < 17:
        return f"opset {opset} has no LayerNormalization (it came in opset 17)"
    return None


__all__ = ["DECOMPOSED_LAYER_NORM", "DECOMPOSED_LAYER_NORM_WITHOUT_AFFINE", "FuseLayerNorm"]
