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

from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, Pass, PassResult
from onnxopt.pattern import Const, Match, OneOf, Pattern, Var, constant_value, is_constant, op, replace
from onnxopt.registry import register_pass

from .group_norm import NewNames, NodeMaker


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


def _has_node(m: Match, name: str) -> bool:
    try:
        m.node(name)
    except KeyError:
        return False
    return True


@register_pass
class TrtAttentionScale(Pass):
    name = "trt-attention-scale"
    description = "move the attention scale from the scores onto Q (before the first MatMul), as TensorRT's MHA fusion requires"
    targets = frozenset({"tensorrt"})
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})
    is_fusion = True

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        names = NewNames(graph)
        masked = 0
        for match in SCALED_ATTENTION.find(graph):
            result.sites_matched += 1
            q, kt = match["q"], match["kt"]
            scale = scale_of(match)
            if q.shape is not None and scale.ndim > len(q.shape):
                result.refuse(match.root.name, "the scale has more dims than Q")
                continue
            make = NodeMaker(names, match.node("softmax").name or "attention")
            scaled_q = make.node("Mul", [q, make.constant("q_scale", scale)], q.dtype, q.shape)
            scores = make.node("MatMul", [scaled_q, kt], match.node("qk").outputs[0].dtype, match.node("qk").outputs[0].shape)
            if _has_node(match, "mask_add"):
                add = match.node("mask_add")
                mask = match["mask"]
                operands = [scores, mask] if add.inputs[0] is not mask else [mask, scores]
                scores = make.node("Add", operands, add.outputs[0].dtype, add.outputs[0].shape)
                masked += 1
            softmax = match.node("softmax")
            probs = make.node("Softmax", [scores], softmax.outputs[0].dtype, softmax.outputs[0].shape, **dict(softmax.attrs))
            replace(graph, match, make.nodes, [probs])
            result.sites_rewritten += 1
        if result.sites_rewritten:
            graph.cleanup(remove_unused_graph_inputs=False).toposort()
        result.modified = result.sites_rewritten > 0
        result.details = {"with_mask": masked}
        return result
