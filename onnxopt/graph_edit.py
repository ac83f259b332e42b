"""Graph rewiring: the one place that moves edges between tensors (graphsurgeon idioms, safety spelled out).

Passes and the core never assign ``node.inputs[i]`` / ``node.outputs[i]`` themselves; they call these.
graphsurgeon keeps every tensor's producer and consumer lists in step with such assignments.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxopt.domains import is_standard  # noqa: F401  (re-exported: plugins import it from here)


def redirect_consumers(old: gs.Tensor, new: gs.Tensor, skip: gs.Node | None = None,
                       only: gs.Node | None = None) -> int:
    """Make every consumer of ``old`` (except ``skip``; just ``only`` when given) read ``new`` instead;
    returns how many inputs moved."""
    moved = 0
    for consumer in list(old.outputs):
        if consumer is skip or (only is not None and consumer is not only):
            continue
        for i, tensor in enumerate(consumer.inputs):
            if tensor is old:
                consumer.inputs[i] = new
                moved += 1
    return moved


def replace_inputs(node: gs.Node, replacement: dict[int, gs.Tensor]) -> None:
    """Replace ``node``'s inputs that are keys of ``replacement`` (by tensor id) by their values."""
    for i, t in enumerate(node.inputs):
        if id(t) in replacement:
            node.inputs[i] = replacement[id(t)]


def is_absent(tensor) -> bool:
    """An optional input left out: not given (None), or graphsurgeon's empty-named Variable that
    no node computes. The one meaning of "absent" in the core and the passes."""
    return tensor is None or (isinstance(tensor, gs.Variable) and not tensor.name and not tensor.inputs)


def set_input(node: gs.Node, index: int, tensor: gs.Tensor) -> None:
    """``node`` reads ``tensor`` as input ``index``; optional inputs before it that are not given
    are left out (the empty name)."""
    while len(node.inputs) <= index:
        node.inputs.append(gs.Variable.empty())
    node.inputs[index] = tensor


def replace_output(producer: gs.Node, old: gs.Tensor, new: gs.Tensor) -> None:
    """``producer`` computes ``new`` in the slot where it computed ``old`` (the other slots keep their place)."""
    for index, out in enumerate(producer.outputs):
        if out is old:
            producer.outputs[index] = new


def take_over(old: gs.Variable, new: gs.Variable) -> None:
    """Let ``old`` stand where ``new`` is: as the output of new's producer and in new's consumers."""
    for producer in list(new.inputs):
        replace_output(producer, new, old)
    redirect_consumers(new, old)


def bypass(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> list[gs.Node]:
    """Point ``old``'s consumers at the existing tensor ``new``. A graph output keeps its name: the
    returned Identity (not yet in the graph) computes ``old`` from ``new``; ``old``'s producer, if
    any, gets a dead tensor in its place."""
    redirect_consumers(old, new)
    if not any(out is old for out in graph.outputs):
        return []
    for producer in list(old.inputs):
        replace_output(producer, old, gs.Variable(f"{old.name}__bypassed"))
    return [gs.Node("Identity", name=f"{old.name}__identity", inputs=[new], outputs=[old])]


def copy_tensor(tensor: gs.Tensor, name: str | None = None, shape=...) -> gs.Variable:
    """A new tensor of ``tensor``'s dtype, named ``name`` (default: the same name, for another
    graph) with ``shape`` (default: the same shape): a graph input standing for ``tensor``."""
    return gs.Variable(tensor.name if name is None else name, dtype=tensor.dtype,
                       shape=tensor.shape if shape is ... else shape)


def clone_node(node: gs.Node) -> gs.Node:
    """A copy of ``node`` for another graph: the same op, name, attributes and inputs, and new
    output tensors of the same names (``node`` keeps its own)."""
    return gs.Node(node.op, node.name, attrs=dict(node.attrs), domain=node.domain, inputs=list(node.inputs),
                   outputs=[copy_tensor(t) for t in node.outputs])


def detach(node: gs.Node) -> None:
    """Disconnect a node so the next ``graph.cleanup()`` drops it."""
    node.inputs.clear()
    node.outputs.clear()
