"""Facts the norm fusions (LayerNorm, RMSNorm) share about the reductions they match."""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxopt.pattern.tensor_facts import normalize_axis, static_ints


def reduce_axes(node: gs.Node) -> list[int] | None:
    """The axes a Reduce* node reduces (attribute before opset 18, input after), None when they are
    not static or not given (no axes: all of them -- never a norm's statistic)."""
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    if len(node.inputs) > 1 and node.inputs[1].name:
        return static_ints(node.inputs[1])
    return None


def last_axis_refusal(node: gs.Node, rank: int | None, what: str) -> str | None:
    """Why ``node`` (a ReduceMean with keepdims=1) is not a statistic over the last axis alone."""
    axes = reduce_axes(node)
    if axes is None:
        return f"the {what} ReduceMean's axes are not static"
    if axes != [-1] and (rank is None or [normalize_axis(a, rank) for a in axes] != [rank - 1]):
        return f"the {what} is over axes {axes}, not the last axis alone"
    return None


def per_channel_refusal(name: str, tensor: gs.Tensor, d: int, rank: int | None, op: str) -> str | None:
    """Why ``tensor`` (a norm's scale or bias) is not one value per last-axis element that ``op``
    can take as (d,): shape (d,) or a constant of shape (1, .., 1, d) no longer than the input."""
    from onnxopt.pattern import is_constant
    from onnxopt.pattern.tensor_facts import shape_of

    shape = shape_of(tensor)
    per_last_element = bool(shape) and shape[-1] == d and all(s == 1 for s in shape[:-1])
    if not per_last_element or (rank is not None and len(shape) > rank):
        return f"{name} has shape {shape}; {op} takes ({d},) (one value per last-axis element)"
    if shape != [d] and not is_constant(tensor):
        return f"{name} has shape {shape} and is computed at run time; {op} takes ({d},)"
    return None
