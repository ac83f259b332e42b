"""remove-identity: bypass Identity nodes.

    producer -> t -> Identity -> u -> consumers      ==>      producer -> u -> consumers

The surviving tensor is the Identity's output ``u`` when ``u`` is a graph output (its name is part
of the model's interface), else the input ``t``. An Identity between two interface tensors
(graph input to graph output, constant to graph output) is kept: removing it would rename one.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxopt.graph_edit import detach, is_standard, redirect_consumers
from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, Pass, PassResult
from onnxopt.registry import register_pass


@register_pass
class RemoveIdentity(Pass):
    name = "remove-identity"
    description = "bypass Identity nodes (keeping graph input/output names)"
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        graph_outputs = {id(t) for t in graph.outputs}
        graph_inputs = {id(t) for t in graph.inputs}
        for node in [n for n in graph.nodes if n.op == "Identity" and is_standard(n)]:
            result.sites_matched += 1
            src, dst = node.inputs[0], node.outputs[0]
            if id(dst) not in graph_outputs:
                redirect_consumers(dst, src)
            elif id(src) in graph_inputs or id(src) in graph_outputs or isinstance(src, gs.Constant) or not src.inputs:
                result.refuse(node.name, "joins two interface tensors (graph input/constant to graph output)")
                continue
            else:
                # Keep the output's name: its producer now writes `dst` directly.
                producer = src.inputs[0]
                redirect_consumers(src, dst, skip=node)
                producer.outputs[producer.outputs.index(src)] = dst
            detach(node)
            result.sites_rewritten += 1
        result.modified = result.sites_rewritten > 0
        if result.modified:
            graph.cleanup(remove_unused_graph_inputs=False)
        return result
