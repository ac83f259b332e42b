"""fuse-adaln-modulation: the AdaLN(-Zero/Continuous) modulation of SD3's and Flux's blocks folded into the
LayerNorm, where ONNX Runtime's norms can take it: one scale and shift per channel, i.e. batch 1
(Flux.1-dev runs without classifier-free guidance).

    n = LayerNormalization(x, 1, 0 | none)           diffusers' norm, elementwise_affine=False
    m = n * Unsqueeze(1 + scale | scale, 1) [+ 1] + Unsqueeze(shift, 1)
                         scale, shift: (B, D), from linear(silu(temb)).chunk(...)
                         ==>   (B == 1)
    m = LayerNormalization(x, Reshape(1 + scale, [D]), Reshape(shift, [D]), epsilon=eps)

    A norm that others read too stays for them. A residual Add in front then makes it SkipLayerNormalization (fuse-skip-layer-norm), whose gamma
    and beta are those run-time (D,) tensors.

Conditions: the LayerNorm normalizes the last axis, its scale is all ones and its bias absent or all
zeros (a norm with its own affine is left as it is); scale and shift are (B, D) with D x's static last
dim, unsqueezed at axis 1; B is statically 1.

What stays elementwise, and why (each such site is refused with it, so the report lists them):
ONNX Runtime's LayerNormalization / SkipLayerNormalization take one gamma and beta per channel, and
no ORT op computes a per-sample ``n * (1 + scale) + shift``. With a batch above 1 (SD3 and SD3.5
with classifier-free guidance: B = 2) the modulation stays one Mul and one Add over (B, S, D) --
the ``1 + scale`` is on (B, D), negligible -- and the gated residual ``x + gate * y`` keeps its Mul
over (B, S, D) in every case (the Add goes into the next SkipLayerNormalization).
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

PER_SAMPLE = ("per-sample modulation stays elementwise (a Mul and an Add over (B, S, D)): ONNX Runtime's "
              "LayerNormalization/SkipLayerNormalization take one scale and shift per channel")


def check(match: Match, run: FusionRun) -> Match:
    ln, x = match.node("ln"), match["x"]
    rank, d = rank_of(x), static_dim(x, -1)
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
    batch = static_dim(match["scale"], 0)
    if batch != 1 or static_dim(match["shift"], 0) != 1:
        run.details["stays_elementwise"] += 1
        dim = shape_of(match["scale"])[0]
        batch = f"batch {dim}" if isinstance(dim, int) else f"batch dim {dim!r} not statically 1"
        raise Refusal(f"{PER_SAMPLE} ({batch})")
    return match


def emit(make: Emit, match: Match) -> list[gs.Tensor]:
    ln, x, scale, shift = match.node("ln"), match["x"], match["scale"], match["shift"]
    d = static_dim(x, -1)
    channels = make.constant("channels", np.array([d], np.int64))
    one = make.constant("one", np.ones((), dtype=numpy_dtype(scale.dtype)))
    gamma = make.op.Reshape(make.op.Add(scale, one, _shape=scale.shape), channels, _shape=[d], _label="gamma")
    beta = make.op.Reshape(shift, channels, _shape=[d], _label="beta")
    attrs = {k: ln.attrs[k] for k in ("epsilon", "stash_type") if k in ln.attrs}
    return [make.op.LayerNormalization(x, gamma, beta, axis=-1, _shape=x.shape, **attrs)]


@register_pass
class FuseAdaLnModulation(Fusion, OrtFusion):
    name = "fuse-adaln-modulation"
    description = ("fold AdaLN's norm(x) * (1 + scale) + shift into the LayerNorm's gamma/beta at batch 1; "
                   "report the per-sample modulations that stay elementwise")
    rules = (Rule(ADALN_MODULATION, check, emit),)

    def finish(self, run: FusionRun) -> None:
        run.result.details.update(stays_elementwise=run.details["stays_elementwise"])


def _all(tensor: gs.Tensor, value: float) -> bool:
    if not is_constant(tensor):
        return False
    values = constant_value(tensor)
    return values is not None and bool(np.all(values == value))


__all__ = ["ADALN_MODULATION", "FuseAdaLnModulation"]
