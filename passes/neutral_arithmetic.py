"""remove-neutral-arithmetic: drop arithmetic with its identity element.

    x * 1,  1 * x,  x / 1,  x + 0,  0 + x,  x - 0      ==>   x

diffusers writes ``(input + residual) / output_scale_factor`` with a factor of 1.0; the TorchScript
exporter keeps that ``Div``, which hides the residual ``Add`` from fusions such as SkipGroupNorm.

Safe when the constant is exactly the identity (0 or 1 in every element) and broadcasting it
changes neither x's shape nor its type: the constant is a scalar, or has no more dims than x and
every one of them 1, and x's dtype equals the constant's. (``x + 0`` also maps -0.0 to +0.0; no
later op in these graphs can tell the difference.)
"""

from __future__ import annotations

import numpy as np

from onnxopt.graph_edit import detach, is_standard, redirect_consumers
from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, Pass, PassResult
from onnxopt.pattern import constant_shape, constant_value, is_constant
from onnxopt.registry import register_pass
from onnxopt.weights import numpy_dtype

# op -> (identity element, positions of x the identity may stand on the other side of)
IDENTITIES = {"Mul": (1.0, (0, 1)), "Add": (0.0, (0, 1)), "Div": (1.0, (0,)), "Sub": (0.0, (0,))}


@register_pass
class RemoveNeutralArithmetic(Pass):
    name = "remove-neutral-arithmetic"
    description = "drop x*1, x/1, x+0, x-0 (diffusers' output_scale_factor=1 divisions)"
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        outputs = {id(t) for t in graph.outputs}
        for node in [n for n in graph.nodes if n.op in IDENTITIES and is_standard(n) and len(n.inputs) == 2]:
            identity, x_positions = IDENTITIES[node.op]
            for x_index in x_positions:
                x, c = node.inputs[x_index], node.inputs[1 - x_index]
                if _is_identity_constant(c, identity) and _keeps_shape_and_type(x, c):
                    break
            else:
                continue
            y = node.outputs[0]
            result.sites_matched += 1
            if id(y) in outputs:
                result.refuse(node.name, "writes a graph output")
                continue
            redirect_consumers(y, x)
            detach(node)
            result.sites_rewritten += 1
        if result.sites_rewritten:
            result.modified = True
            graph.cleanup(remove_unused_graph_inputs=False)
        return result


def _is_identity_constant(tensor, identity: float) -> bool:
    if not is_constant(tensor):
        return False
    shape = constant_shape(tensor)
    if shape is None or int(np.prod(shape)) > 64:
        return False  # a large constant is a weight, not a neutral element
    value = constant_value(tensor)
    return value.size > 0 and bool(np.all(value == identity))


def _keeps_shape_and_type(x, c) -> bool:
    c_shape = constant_shape(c)
    if x.shape is None or len(c_shape) > len(x.shape) or any(d != 1 for d in c_shape):
        return False
    return x.dtype is not None and numpy_dtype(x.dtype) == constant_value(c).dtype
