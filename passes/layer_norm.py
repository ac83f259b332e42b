"""fuse-layer-norm: a decomposed LayerNorm as one LayerNormalization op (older exports; opset >= 17
has the op and both exporters use it):

    m = ReduceMean(x, axes=[-1])
    d = x - m
    v = ReduceMean(d ** 2 | d * d, axes=[-1])
    n = d / Sqrt(v + eps)  |  d * Reciprocal(Sqrt(v + eps))
    y = n * gamma + beta
                         ==>   y = LayerNormalization(x, gamma, beta, axis=-1, epsilon=eps)

    Conditions: both means over the last axis only, keepdims=1; eps a one-element constant;
    gamma and beta hold D = x's (static) last dim values, broadcast along the last axis only; the
    model's opset is >= 17.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.layer_norm_kernel import per_channel
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED
from onnxopt.pattern import Const, Literal, Match, OneOf, Pattern, constant_shape, is_constant, op
from onnxopt.pattern.tensor_facts import normalize_axis, rank_of, shape_of, static_dim, static_ints
from onnxopt.registry import register_pass


def decomposed_layer_norm(x, gamma, beta, eps=Const()):
    d = x - op.ReduceMean(x, _extra_inputs=True, _name="mean", keepdims=1)
    variance = op.ReduceMean(OneOf(d ** Literal(2.0, rtol=0, atol=0), d * d), _extra_inputs=True, _name="variance", keepdims=1)
    std = op.Sqrt(variance + eps)
    return OneOf(d / std, d * op.Reciprocal(std)) * gamma + beta


DECOMPOSED_LAYER_NORM = Pattern(decomposed_layer_norm, name="decomposed-layer-norm")


def check_layer_norm(match: Match, run: FusionRun) -> Match:
    reason = _layer_norm_refusal(match, run.graph.opset)
    if reason is not None:
        raise Refusal(reason)
    return match


def emit_layer_norm(make: Emit, match: Match) -> list[gs.Tensor]:
    d = static_dim(match["x"], -1)
    gamma, beta = per_channel(make, match["gamma"], d), per_channel(make, match["beta"], d)
    eps = float(match.value("eps").reshape(-1)[0])
    return [make.op.LayerNormalization(match["x"], gamma, beta, axis=-1, epsilon=eps)]


@register_pass
class FuseLayerNorm(Fusion):
    name = "fuse-layer-norm"
    description = "fuse decomposed LayerNorm (ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add) into LayerNormalization"
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})
    rules = (Rule(DECOMPOSED_LAYER_NORM, check_layer_norm, emit_layer_norm),)


def _layer_norm_refusal(match, opset: int) -> str | None:
    x = match["x"]
    rank = rank_of(x)
    for name in ("mean", "variance"):
        axes = _reduce_axes(match.node(name))
        if axes is None:
            return f"the {name} ReduceMean's axes are not static"
        if axes != [-1] and (rank is None or [normalize_axis(a, rank) for a in axes] != [rank - 1]):
            return f"the {name} is over axes {axes}, not the last axis alone"
    if int(np.prod(constant_shape(match["eps"]))) != 1:
        return "epsilon is not a single value"
    d = static_dim(x, -1)
    if d is None:
        return "the normalized (last) dim is not static"
    for name in ("gamma", "beta"):
        shape = shape_of(match[name])
        per_last_element = bool(shape) and shape[-1] == d and all(s == 1 for s in shape[:-1])
        if not per_last_element or (rank is not None and len(shape) > rank):
            return f"{name} has shape {shape}; LayerNormalization takes ({d},) (one value per last-axis element)"
        if shape != [d] and not is_constant(match[name]):
            return f"{name} has shape {shape} and is computed at run time; LayerNormalization takes ({d},)"
    if opset < 17:
        return f"opset {opset} has no LayerNormalization (it came in opset 17)"
    return None


def _reduce_axes(node: gs.Node) -> list[int] | None:
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    if len(node.inputs) > 1 and node.inputs[1].name:
        return static_ints(node.inputs[1])
    return None  # no axes: all of them (noop_with_empty_axes aside) -- not a LayerNorm


__all__ = ["DECOMPOSED_LAYER_NORM", "FuseLayerNorm"]
