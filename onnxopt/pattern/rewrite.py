"""Replacing a match with new nodes, the onnx-graphsurgeon way.

The new nodes take over the match's output tensors: each output Variable is
detached from the matched node that computed it and becomes an output of a
new node. Consumers, graph outputs, names, dtypes and shapes stay as they
were; the matched nodes are left dead for ``graph.cleanup()``::

    for m in GELU.find(graph):
        y = gs.Variable(f"{m.output.name}_gelu")
        replace(graph, m, [gs.Node("Gelu", inputs=[m["x"]], outputs=[y])])
    graph.cleanup().toposort()

New nodes are appended to ``graph.nodes``: call ``graph.toposort()`` before
exporting. Call ``graph.cleanup()`` before the next ``find``: until then the
dead nodes still count as consumers, and the escape check refuses matches
whose intermediates they read.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_graphsurgeon as gs

from onnxopt.graph_edit import bypass, replace_output, take_over

from .matcher import Match


def replace(
    graph: gs.Graph,
    match: Match,
    new_nodes: Sequence[gs.Node],
    new_outputs: Sequence[gs.Tensor] | None = None,
) -> None:
    """Make ``new_nodes`` compute the match's outputs in place of the matched nodes.

    ``new_outputs[k]`` is the tensor (produced by one of ``new_nodes``) that
    replaces ``match.outputs[k]``; it defaults to the outputs of the last new
    node. A new node may also list ``match.outputs[k]`` itself as its output.
    Either way, ``match.outputs[k]`` ends up produced by the new node, and the
    placeholder's consumers among the new nodes are moved onto it.

    A new output that no new node produces (an existing tensor: the rewrite
    removes the computation, e.g. a no-op Cast) takes over the old output's
    consumers instead; if the old output is a graph output, an ``Identity``
    keeps its name.
    """
    new_nodes = list(new_nodes)
    if new_outputs is None:
        if not new_nodes:
            raise ValueError("replace: no new nodes and no new outputs given")
        new_outputs = list(new_nodes[-1].outputs)
    if len(new_outputs) != len(match.outputs):
        raise ValueError(f"replace: {len(new_outputs)} new outputs for {len(match.outputs)} match outputs")
    matched = {id(n) for n in match.nodes}
    created = {id(n) for n in new_nodes}
    for old in match.outputs:
        _detach_from_matched_producers(old, matched)
    for old, new in zip(match.outputs, new_outputs):
        if new is old:
            continue
        if any(id(p) in created for p in new.inputs):
            take_over(old, new)
        else:
            new_nodes += bypass(graph, old, new)
    graph.nodes.extend(new_nodes)


def _detach_from_matched_producers(tensor: gs.Variable, matched: set[int]) -> None:
    """Swap ``tensor`` out of the outputs of matched nodes for a fresh dead Variable.

    Replacing the slot (rather than clearing the node's outputs) keeps the
    positions of the node's other outputs, which may still be in use.
    """
    for producer in list(tensor.inputs):
        if id(producer) in matched:
            replace_output(producer, tensor, gs.Variable(f"{tensor.name}__replaced"))
