"""eliminate-dead-nodes: drop nodes whose outputs reach no graph output, then sort topologically."""

from __future__ import annotations

from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, NO_DEAD_NODES, SHAPES_INFERRED, Pass, PassResult
from onnxopt.registry import register_pass


@register_pass
class EliminateDeadNodes(Pass):
    name = "eliminate-dead-nodes"
    description = "remove nodes and tensors that no graph output depends on; sort nodes topologically"
    provides = frozenset({NO_DEAD_NODES})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})

    def run(self, model: Model) -> PassResult:
        before = len(model.graph.nodes)
        # Graph inputs stay: removing one would change the model's signature.
        model.graph.cleanup(remove_unused_graph_inputs=False).toposort()
        removed = before - len(model.graph.nodes)
        return PassResult(modified=removed > 0, sites_matched=removed, sites_rewritten=removed)
