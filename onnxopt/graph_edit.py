"""Small graph edits shared by passes (graphsurgeon idioms with the safety checks spelled out)."""

from __future__ import annotations

import onnx_graphsurgeon as gs


def redirect_consumers(old: gs.Tensor, new: gs.Tensor, skip: gs.Node | None = None) -> int:
    """Make every consumer of ``old`` (except ``skip``) read ``new`` instead; returns how many inputs moved."""
    moved = 0
    for consumer in list(old.outputs):
        if consumer is skip:
            continue
        for i, tensor in enumerate(consumer.inputs):
            if tensor is old:
                consumer.inputs[i] = new
                moved += 1
    return moved


def detach(node: gs.Node) -> None:
    """Disconnect a node so the next ``graph.cleanup()`` drops it."""
    node.inputs.clear()
    node.outputs.clear()


def is_standard(node: gs.Node) -> bool:
    return node.domain in ("", "ai.onnx", None)
