"""trt-attention-scale: the attention scale moves from the scores onto Q, where TensorRT wants it.

canonicalize-attention leaves every exporter's attention with one constant scale on the scores.
TensorRT's attention fusion (Myelin's MHA from MatMul-Softmax-MatMul, as for its IAttention layer)
requires the scale on Q (or on K, or √scale on both) *before* the first batched MatMul, "for numeric
stability and performance" (TensorRT docs, Fused Attention): a scale on the fp16 scores comes after
they may already have overflowed. So, for the TensorRT target::

    Softmax( [Add(]  Mul(MatMul(q, kT), s)  [, mask)] )        s: a one-element float constant
                                                               (or Div(MatMul(q, kT), c), s = 1/c)
        ==>
    Softmax( [Add(]  MatMul(Mul(q, s), kT)  [, mask)] )

Equal up to rounding: (s·q)·kT and s·(q·kT) are the same product, rounded in a different order.

Conditions: q and kT are not constants (a projection times a constant weight is not attention); the
scale is a single float value; the MatMul's product feeds only the scaling, and the scaled scores only
the Softmax (or the mask Add before it).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED
from onnxopt.pattern import Const, Match, OneOf, Pattern, Var, constant_value, is_constant, op
from onnxopt.registry import register_pass


def scaled_scores(q, kt):
    scores = op.MatMul(q, kt, _name="qk")
    return OneOf(op.Mul(scores, Const.named("scale"), _name="scale"), op.Div(scores, Const.named("divisor"), _name="scale"))


def softmax_of_scaled_scores(q, kt):
    scaled = scaled_scores(q, kt)
    return op.Softmax(OneOf(op.Add(scaled, Var("mask"), _name="mask_add"), scaled), axis=Var("axis"), _name="softmax")


def _check(m: Match) -> str | None:
    if is_constant(m["q"]) or is_constant(m["kt"]):
        return "an operand of the MatMul is a constant (a projection, not attention scores)"
    value = constant_value(m["scale"] if "scale" in m else m["divisor"])
    if value.size != 1 or not np.issubdtype(value.dtype, np.floating):
        return "the scale is not a single float value"
    if "divisor" in m and not np.all(value):
        return "division by zero"
    return None


SCALED_ATTENTION = Pattern(softmax_of_scaled_scores, name="scaled-attention-scores", check=_check)


def scale_of(m: Match) -> np.ndarray:
    if "scale" in m:
        return constant_value(m["scale"]).reshape(())
    return (1 / constant_value(m["divisor"])).reshape(()).astype(constant_value(m["divisor"]).dtype)


def read_site(match: Match, run: FusionRun) -> Match:
    q = match["q"]
    if q.shape is not None and scale_of(match).ndim > len(q.shape):
        raise Refusal("the scale has more dims than Q")
    run.details["with_mask"] += match.has_node("mask_add")
    return match


def emit_scaled_q(make: Emit, match: Match) -> list[gs.Tensor]:
    """softmax(q * scale @ kt [+ mask]), each node annotated as the one it replaces."""
    q, kt, qk, softmax = match["q"], match["kt"], match.node("qk"), match.node("softmax")
    scaled_q = make.op.Mul(q, make.constant("q_scale", scale_of(match).reshape(1)))  # a (1,) constant
    scores = make.op.MatMul(scaled_q, kt, _dtype=qk.outputs[0].dtype, _shape=qk.outputs[0].shape)
    if match.has_node("mask_add"):
        add, mask = match.node("mask_add"), match["mask"]
        operands = [scores, mask] if add.inputs[0] is not mask else [mask, scores]
        scores = make.op.Add(*operands, _dtype=add.outputs[0].dtype, _shape=add.outputs[0].shape)
    return [make.op.Softmax(scores, _dtype=softmax.outputs[0].dtype, _shape=softmax.outputs[0].shape, **dict(softmax.attrs))]


@register_pass
class TrtAttentionScale(Fusion):
    name = "trt-attention-scale"
    description = "move the attention scale from the scores onto Q (before the first MatMul), as TensorRT's MHA fusion requires"
    targets = frozenset({"tensorrt"})
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})
    rules = (Rule(SCALED_ATTENTION, read_site, emit_scaled_q),)

    def finish(self, run: FusionRun) -> None:
        run.result.details = {"with_mask": run.details["with_mask"]}
