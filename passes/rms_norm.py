"""fuse-rms-norm: RMSNorm (T5's LayerNorm, diffusers' RMSNorm: SD3/Flux QK norms, T5 encoder) as one
SimplifiedLayerNormalization, the op ONNX Runtime registers in the ONNX domain (CPU and CUDA kernels;
com.microsoft has no op of that name).

    xf = Cast(x, to=FLOAT) | x                           the fp32 upcast diffusers and T5 write
    ms = ReduceMean(xf ** 2 | xf * xf, axes=[-1], keepdims=1)
    r  = Sqrt(ms + eps)
    n  = xf * Reciprocal(r) | xf * (1 / r) | xf / r | xf * (ms + eps) ** -0.5      ("x * rsqrt(...)")
    y  = Cast(n) | n   [* gamma]         or   y = Cast(n * gamma32)   (torch.nn.RMSNorm: the weight
                                                                   upcast too, the product cast back)
                         ==>
    y = SimplifiedLayerNormalization(x, gamma | ones(D), axis=-1, epsilon=eps, stash_type=1)

    and ONNX's own op (opset 23, the dynamo exporter's RMSNorm), counted as unfused until rewritten:

    y = RMSNormalization(x, scale, axis=a, epsilon=eps, stash_type=1)
                         ==>
    y = SimplifiedLayerNormalization(x, scale, axis=-1, epsilon=eps, stash_type=1)

    Conditions: the mean is over the last axis alone (keepdims=1), eps a one-element constant added
    *inside* the square root; the upcast Cast, when there, is to float32, and the output Cast back
    to x's type; gamma holds D = x's static last dim values, broadcast along the last axis only
    ((D,) or a constant (1, .., D)), of x's type (gamma32: float32 values that x's type holds
    exactly, the upcast weight, written back in x's type); RMSNormalization normalizes the last axis only
    (axis -1 or rank-1) and computes in float32 (stash_type 1). The kernel computes in float32
    whatever x's type, as the upcast did: in bfloat16 and float16 it reads x and gamma in x's type
    and writes y in it (CUDA: SimplifiedLayerNormalization<T=V=bfloat16|float16, U=float32>), so
    the Casts around the float32 statistics go with the rest; torch rounds twice (the normalized
    value, then its product with gamma), the kernel once.

A residual Add in front becomes SkipSimplifiedLayerNormalization in fuse-skip-layer-norm.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.layer_norm_kernel import per_channel
from onnxopt.norm_facts import last_axis_refusal, per_channel_refusal
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, OrtFusion
from onnxopt.pattern import Const, Literal, Match, Maybe, OneOf, Pattern, constant_shape, constant_value, is_constant, op
from onnxopt.pattern.tensor_facts import normalize_axis, rank_of, static_dim
from onnxopt.registry import register_pass
from onnxopt.weights import numpy_dtype

FLOAT = TensorProto.FLOAT


def rms_normalized(x, eps=Const()):
    """x / sqrt(mean(x^2) + eps), with the upcast Cast that may read x (the Cast may feed others too:
    T5's residual reads the upcast input)."""
    xf = Maybe(op.Cast, x, to=FLOAT, _name="upcast", _external_uses=True)
    square = OneOf(xf ** Literal(2.0, rtol=0, atol=0), xf * xf)
    shifted = op.ReduceMean(square, _extra_inputs=True, _name="mean_square", keepdims=1) + eps
    root = op.Sqrt(shifted)
    return OneOf(xf * op.Reciprocal(root), xf * (Literal(1.0, rtol=0, atol=0) / root), xf / root,
                 xf * shifted ** Literal(-0.5, rtol=0, atol=0))


def rms_norm_scaled(x, gamma, eps=Const()):
    return Maybe(op.Cast, rms_normalized(x, eps), _name="downcast") * gamma


def rms_norm_scaled_then_cast(x, gamma, eps=Const()):
    return op.Cast(rms_normalized(x, eps) * gamma, _name="downcast")


def rms_norm_cast_back(x, eps=Const()):
    return op.Cast(rms_normalized(x, eps), _name="downcast")


def rms_norm_plain(x, eps=Const()):
    return rms_normalized(x, eps)


def onnx_rms_norm(x, scale):
    return op.RMSNormalization(x, scale, _name="rms_norm")


# Where the output Cast is the root (the weight multiplied in float32, or no weight), the form with
# the Cast has its own rule, ahead of the one without it: that one would match first at the Mul
# before the Cast (graph order) and keep the Mul's nodes for itself.
RMS_NORM_SCALED_THEN_CAST = Pattern(rms_norm_scaled_then_cast, name="rms-norm-scaled-in-float32")
RMS_NORM_SCALED = Pattern(rms_norm_scaled, name="rms-norm")
RMS_NORM_CAST_BACK = Pattern(rms_norm_cast_back, name="rms-norm-without-weight-cast-back")
RMS_NORM_PLAIN = Pattern(rms_norm_plain, name="rms-norm-without-weight")
ONNX_RMS_NORM = Pattern(onnx_rms_norm, name="onnx-rms-normalization")


def check_decomposed(match: Match, run: FusionRun) -> Match:
    reason = _decomposed_refusal(match)
    if reason is not None:
        raise Refusal(reason)
    reason = _gamma_refusal(match)
    if reason is not None:  # the norm without its weight may still be the weightless rules' site
        raise Refusal(reason, not_a_site=True)
    return match


def check_cast_back(match: Match, run: FusionRun) -> Match:
    """The forms rooted at the output Cast: a Cast to another type than x's is no part of the norm
    (the rules without it take the norm)."""
    x, to = match["x"], int(match.node("downcast").attrs["to"])
    if x.dtype is None or to != _onnx_type(numpy_dtype(x.dtype)):
        raise Refusal("the Cast after the norm is not back to x's type", not_a_site=True)
    reason = _decomposed_refusal(match) or _gamma_refusal(match, upcast=True)
    if reason is not None:
        raise Refusal(reason)
    return match


def _mean_square(match: Match) -> gs.Node:
    return match.node("mean_square")


def _root_name(match: Match) -> str:
    return match.root.name


def check_onnx(match: Match, run: FusionRun) -> Match:
    node, x = match.node("rms_norm"), match["x"]
    rank, d = rank_of(x), static_dim(x, -1)
    axis = int(node.attrs.get("axis", -1))
    if axis != -1 and (rank is None or normalize_axis(axis, rank) != rank - 1):
        raise Refusal(f"normalizes from axis {axis}; SimplifiedLayerNormalization here normalizes the last axis only")
    if int(node.attrs.get("stash_type", 1)) != 1:
        raise Refusal(f"stash_type {node.attrs['stash_type']}: the kernel computes in float32")
    if any(t.outputs for t in node.outputs[1:] if t.name):
        raise Refusal("a second output is read")
    if d is None:
        raise Refusal("the normalized (last) dim is not static")
    reason = per_channel_refusal("scale", match["scale"], d, rank, "SimplifiedLayerNormalization")
    if reason is not None:
        raise Refusal(reason)
    run.details["onnx_rms_normalization"] += 1
    return match


def emit_decomposed(make: Emit, match: Match) -> list[gs.Tensor]:
    x = match["x"]
    d = static_dim(x, -1)
    if "gamma" in match:
        gamma = per_channel(make, match["gamma"], d)
        if numpy_dtype(gamma.dtype) != numpy_dtype(x.dtype):  # the upcast weight: exact in x's type
            gamma = make.constant(f"{gamma.name.rsplit('/', 1)[-1]}_{numpy_dtype(x.dtype)}",
                                  constant_value(gamma).astype(numpy_dtype(x.dtype)))
    else:
        gamma = make.constant("ones", np.ones(d, dtype=numpy_dtype(x.dtype)))
    eps = float(match.value("eps").reshape(-1)[0])
    return [_simplified_layer_norm(make, x, gamma, eps)]


def emit_onnx(make: Emit, match: Match) -> list[gs.Tensor]:
    x, node = match["x"], match.node("rms_norm")
    gamma = per_channel(make, match["scale"], static_dim(x, -1))
    return [_simplified_layer_norm(make, x, gamma, float(node.attrs.get("epsilon", 1e-5)))]


def _simplified_layer_norm(make: Emit, x: gs.Tensor, gamma: gs.Tensor, eps: float) -> gs.Tensor:
    return make.op.SimplifiedLayerNormalization(x, gamma, axis=-1, epsilon=eps, stash_type=1, _shape=x.shape)


@register_pass
class FuseRmsNorm(Fusion, OrtFusion):
    name = "fuse-rms-norm"
    description = ("fuse RMSNorm (Pow/ReduceMean/Add/Sqrt/Reciprocal|Div/Mul [* weight], fp32 Casts around it) and "
                   "ONNX RMSNormalization into SimplifiedLayerNormalization")
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})
    rules = (  # one site per norm (its mean of squares), named after the node it ends in
        Rule(RMS_NORM_SCALED_THEN_CAST, check_cast_back, emit_decomposed, site=_mean_square, label=_root_name),
        Rule(RMS_NORM_SCALED, check_decomposed, emit_decomposed, site=_mean_square, label=_root_name),
        # what the weighted forms left: no weight, or one that is no SimplifiedLayerNormalization gamma
        Rule(RMS_NORM_CAST_BACK, check_cast_back, emit_decomposed, site=_mean_square, label=_root_name),
        Rule(RMS_NORM_PLAIN, check_decomposed, emit_decomposed, site=_mean_square, label=_root_name),
        Rule(ONNX_RMS_NORM, check_onnx, emit_onnx),
    )

    def finish(self, run: FusionRun) -> None:
        run.result.details.update(onnx_rms_normalization=run.details["onnx_rms_normalization"])


def _decomposed_refusal(match: Match) -> str | None:
    x = match["x"]
    rank, d = rank_of(x), static_dim(x, -1)
    reason = last_axis_refusal(match.node("mean_square"), rank, "mean of squares")
    if reason is not None:
        return reason
    if int(np.prod(constant_shape(match["eps"]))) != 1:
        return "epsilon is not a single value"
    if d is None:
        return "the normalized (last) dim is not static"
    dtype = None if x.dtype is None else numpy_dtype(x.dtype)
    if dtype is not None and dtype.kind != "f" and str(dtype) != "bfloat16":
        return f"x has type {dtype}, not a float type"
    if match.has_node("downcast"):
        to = int(match.node("downcast").attrs["to"])
        if dtype is not None and to != _onnx_type(dtype):
            return f"the normalized value is cast to type {to}, not back to x's {dtype}"
    elif match.has_node("upcast") and dtype is not None and _onnx_type(dtype) != FLOAT:
        return f"the result stays float32 where x is {dtype}; the kernel returns x's type"
    return None


def _gamma_refusal(match: Match, upcast: bool = False) -> str | None:
    """Why gamma is not SimplifiedLayerNormalization's scale: one value per channel, of x's type;
    with ``upcast``, float32 values that x's type holds exactly do (the weight upcast for a
    product in float32, written back in x's type)."""
    if "gamma" not in match:
        return None
    x, gamma = match["x"], match["gamma"]
    reason = per_channel_refusal("gamma", gamma, static_dim(x, -1), rank_of(x), "SimplifiedLayerNormalization")
    if reason is not None or gamma.dtype is None or x.dtype is None:
        return reason
    gamma_type, dtype = numpy_dtype(gamma.dtype), numpy_dtype(x.dtype)
    if gamma_type == dtype:
        return None
    if not (upcast and gamma_type == np.float32 and is_constant(gamma)):
        return f"gamma has type {gamma_type}, x {dtype}: the kernel takes one type"
    values = constant_value(gamma)
    if not np.array_equal(values.astype(dtype).astype(np.float32), values):
        return f"gamma holds float32 values that {dtype} does not; the kernel takes gamma in x's type"
    return None


def _onnx_type(dtype: np.dtype) -> int:
    from onnx.helper import np_dtype_to_tensor_dtype

    return np_dtype_to_tensor_dtype(dtype)


__all__ = ["ONNX_RMS_NORM", "RMS_NORM_CAST_BACK", "RMS_NORM_PLAIN", "RMS_NORM_SCALED", "RMS_NORM_SCALED_THEN_CAST", "FuseRmsNorm"]
