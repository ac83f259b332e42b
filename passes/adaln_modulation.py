"""fuse-adaln-modulation: the AdaLN(-Zero/Continuous) modulation of SD3's and Flux's blocks folded into the
LayerNorm, as its scale and bias, at any batch.

    n = LayerNormalization(x, 1, 0 | none)           diffusers' norm, elementwise_affine=False
    m = n * Unsqueeze(1 + scale | scale, 1) [+ 1] + Unsqueeze(shift, 1)
                         scale, shift: (B, D), from linear(silu(temb)).chunk(...)
                         ==>   (B == 1: one scale and shift per channel)
    m = LayerNormalization(x, Reshape(1 + scale, [D]), Reshape(shift, [D]), epsilon=eps)
                         ==>   (B > 1 or not static: one per sample and channel; x is (B, S, D))
    m = LayerNormalization(x, Unsqueeze(scale, 1) + 1, Unsqueeze(shift, 1), axis=2, epsilon=eps)

    At batch 1 a residual Add in front then makes it SkipLayerNormalization (fuse-skip-layer-norm), whose
    gamma and beta are those run-time (D,) tensors. At other batches the scale and bias are (B, 1, D):
    ONNX Runtime's LayerNormalization takes scale and bias of shape (B, 1, D) against an x of
    (B, S, D) when axis is 2 (its LayerNormHelper's broadcast case, CPU and CUDA kernels alike), and
    ONNX's own definition broadcasts them the same way. SkipLayerNormalization takes only (D,), so
    the residual Add in front stays its own kernel there: an Add and a LayerNorm (three reads, two
    writes of (B, S, D)) in place of SkipLayerNorm, Mul and Add (four and four, one more launch).

Conditions: the LayerNorm normalizes the last axis (D: x's static last dim, or the size of its constant
1-D scale where shape inference left x's last dim symbolic), its scale is all ones and its bias absent or all
zeros (a norm with its own affine is left as it is); scale and shift are (B, D) with D x's static last
dim, unsqueezed at axis 1; at a batch other than a static 1, x is rank 3. A norm that others read too
stays for them.

What stays elementwise: the gated residual ``x + gate * y`` keeps its Mul over (B, S, D) (the Add
goes into the next norm); a per-sample modulation of an x of another rank (reported).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.pass_infra import OrtFusion
from onnxopt.pattern import Literal, Match, OneOf, Pattern, Var, constant_value, is_constant, op
from onnxopt.pattern.tensor_facts import normalize_axis, rank_of, shape_of, static_dim, static_ints
from onnxopt.registry import register_pass
from onnxopt.weights import numpy_dtype

ONE = Literal(1.0, rtol=0, atol=0)


def modulated_layer_norm(x, scale, shift, gamma, beta=Var("beta", optional=True)):
    # the norm may have other readers: exporters share one LayerNorm of a tensor between its modulations
    normalized = op.LayerNormalization(x, gamma, beta, _name="ln", _external_uses=True)
    one_plus_scale = OneOf(op.Unsqueeze(scale + ONE, _extra_inputs=True, _name="scale_view"),    # (1 + scale)[:, None]
                           op.Unsqueeze(scale, _extra_inputs=True, _name="scale_view") + ONE)    # 1 + scale[:, None]
    return normalized * one_plus_scale + op.Unsqueeze(shift, _extra_inputs=True, _name="shift_view")


ADALN_MODULATION = Pattern(modulated_layer_norm, name="adaln-modulation")

PER_SAMPLE = ("per-sample modulation stays elementwise (a Mul and an Add): ONNX Runtime's LayerNormalization "
              "takes a per-sample scale and shift only as (B, 1, D) against an x of (B, S, D)")


def _width(match: Match) -> int | None:
    """D: x's static last dim, or, where shape inference lost it (TorchScript's Flux single block
    normalizes a Concat of Slices), the size of the LayerNorm's constant 1-D gamma, which ONNX
    requires to be x's normalized shape."""
    d = static_dim(match["x"], -1)
    gamma = match["gamma"]
    if d is None and is_constant(gamma) and rank_of(gamma) == 1:
        d = static_dim(gamma, 0)
    return d


def check(match: Match, run: FusionRun) -> Match:
    ln, x = match.node("ln"), match["x"]
    rank, d = rank_of(x), _width(match)
    axis = int(ln.attrs.get("axis", -1))
    if rank is None or d is None or normalize_axis(axis, rank) != rank - 1:
        raise Refusal("the LayerNorm does not normalize a static last axis", not_a_site=True)
    if any(t.outputs for t in ln.outputs[1:] if t.name):
        raise Refusal("the LayerNorm's mean / inv-std outputs are used", not_a_site=True)
    beta = match.get("beta")
    if not _all(match["gamma"], 1.0) or (beta is not None and beta.name and not _all(beta, 0.0)):
        raise Refusal("the LayerNorm has an affine of its own", not_a_site=True)
    for name in ("scale_view", "shift_view"):
        view = match.node(name)
        axes = static_ints(view.inputs[1]) if len(view.inputs) > 1 else [int(a) for a in view.attrs.get("axes", [])]
        if axes != [1]:
            raise Refusal(f"{name.split('_')[0]} is unsqueezed at axes {axes}, not 1", not_a_site=True)
    for name in ("scale", "shift"):
        shape = shape_of(match[name])
        if shape is None or len(shape) != 2 or shape[1] != d:
            raise Refusal(f"{name} has shape {shape}, not (B, {d})", not_a_site=True)
    if _per_sample(match) and rank != 3:
        run.details["stays_elementwise"] += 1
        raise Refusal(f"{PER_SAMPLE} (x has rank {rank})")
    return match


def _per_sample(match: Match) -> bool:
    """Whether scale and shift differ per sample: a batch other than a static 1."""
    return not (static_dim(match["scale"], 0) == 1 and static_dim(match["shift"], 0) == 1)


def emit(make: Emit, match: Match) -> list[gs.Tensor]:
    ln, x, scale, shift = match.node("ln"), match["x"], match["scale"], match["shift"]
    d = _width(match)
    one = make.constant("one", np.ones((), dtype=numpy_dtype(scale.dtype)))
    attrs = {k: ln.attrs[k] for k in ("epsilon", "stash_type") if k in ln.attrs}
    if _per_sample(match):  # (B, 1, D) against x (B, S, D), axis 2
        rows = make.constant("axis_1", np.array([1], np.int64))
        batch_shape = [shape_of(scale)[0], 1, d]
        scale_rows = make.op.Unsqueeze(scale, rows, _shape=batch_shape)
        gamma = make.op.Add(scale_rows, one, _shape=batch_shape, _label="gamma")
        beta = make.op.Unsqueeze(shift, rows, _shape=batch_shape, _label="beta")
        return [make.op.LayerNormalization(x, gamma, beta, axis=2, _shape=x.shape, **attrs)]
    channels = make.constant("channels", np.array([d], np.int64))
    gamma = make.op.Reshape(make.op.Add(scale, one, _shape=scale.shape), channels, _shape=[d], _label="gamma")
    beta = make.op.Reshape(shift, channels, _shape=[d], _label="beta")
    return [make.op.LayerNormalization(x, gamma, beta, axis=-1, _shape=x.shape, **attrs)]


@register_pass
class FuseAdaLnModulation(Fusion, OrtFusion):
    name = "fuse-adaln-modulation"
    description = ("fold AdaLN's norm(x) * (1 + scale) + shift into the LayerNorm's scale/bias: (D,) at "
                   "batch 1, (B, 1, D) with axis 2 at other batches")
    rules = (Rule(ADALN_MODULATION, check, emit),)

    def finish(self, run: FusionRun) -> None:
        run.result.details.update(stays_elementwise=run.details["stays_elementwise"])


def _all(tensor: gs.Tensor, value: float) -> bool:
    if not is_constant(tensor):
        return False
    values = constant_value(tensor)
    return values is not None and bool(np.all(values == value))


__all__ = ["ADALN_MODULATION", "FuseAdaLnModulation"]
