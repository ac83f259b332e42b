"""Where a tensor's dim comes from: proofs that two tensors share a batch, or that a dim is a constant,
through the ops between them that keep the dim (the diffusion transformers' QK RMSNorm, rotary and
joint-attention Concat sit between the head split, whose dims Reshape proves, and the attention).

:func:`dim_sources` walks back from ``t``'s ``axis`` through ops whose output has that dim of an input:
unary elementwise ops and normalizations over the last axis, Transposes (the axis moves with the perm),
Linears (MatMul by a constant matrix: every axis but the last),
ReduceMean over other axes, Concat on another axis (it never broadcasts: every input has the dim),
binary elementwise ops against a constant, a lower rank, or a tensor computed from the operand
followed (an RMSNorm's statistics). A Reshape contributes the dim it provably gives, and is followed
when it keeps the dim. Used by fuse-attention and fuse-rotary-embedding.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxopt.pattern import constant_value, is_constant
from onnxopt.pattern.dims import Dim, Dims, same

_UNARY = frozenset({"Cast", "Identity", "Neg", "Sqrt", "Reciprocal", "Softmax", "SimplifiedLayerNormalization",
                    "RMSNormalization", "LayerNormalization", "com.microsoft.RotaryEmbedding"})
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Pow"})


def dim_sources(t: gs.Tensor, axis: int, dims: Dims, depth: int = 0) -> tuple[set[int], list]:
    """(ids of the tensors ``t`` provably takes dim ``axis`` from, ``t`` included; the dims they give)."""
    shape = dims.shape(t)
    ids, found = {id(t)}, [shape[axis]] if shape and axis < len(shape) else []
    node = t.inputs[0] if len(t.inputs) == 1 else None
    if node is None or depth > 32 or shape is None:
        return ids, found
    kind = f"{node.domain}.{node.op}" if node.domain else node.op
    follow: list[tuple[gs.Tensor, int]] = []
    if node.op == "Reshape":
        before, after = dims.shape(node.inputs[0]), dims.reshaped(node)
        found += [after[axis]] if after and axis < len(after) else []
        if before and after and axis < min(len(before), len(after)) and same(before[axis], after[axis]):
            follow = [(node.inputs[0], axis)]
    elif kind in _UNARY:
        follow = [(node.inputs[0], axis)]
    elif node.op == "Transpose" and node.attrs.get("perm") is not None:
        follow = [(node.inputs[0], int(node.attrs["perm"][axis]))]
    elif node.op == "ReduceMean" and axis not in _reduced_axes(node, len(shape)):
        follow = [(node.inputs[0], axis)]
    elif node.op == "MatMul" and is_constant(node.inputs[1]) and dims.rank(node.inputs[1]) == 2 and axis < len(shape) - 1:
        follow = [(node.inputs[0], axis)]  # a Linear keeps every axis but the last
    elif node.op == "Concat" and int(node.attrs.get("axis", 0)) % len(shape) != axis:
        follow = [(x, axis) for x in node.inputs]
    elif node.op in _ELEMENTWISE:
        x, y = node.inputs[:2]
        for main, other in ((x, y), (y, x)):
            if is_constant(other) or (dims.rank(other) or 0) < (dims.rank(main) or 0) or \
                    id(main) in dim_sources(other, axis, dims, depth + 1)[0]:
                follow = [(main, axis)]
                break
    for source, source_axis in follow:
        more_ids, more_dims = dim_sources(source, source_axis, dims, depth + 1)
        ids |= more_ids
        found += more_dims
    return ids, found


def share_dim(a: gs.Tensor, axis_a: int, b: gs.Tensor, axis_b: int, dims: Dims) -> bool:
    """Dim ``axis_a`` of ``a`` and ``axis_b`` of ``b`` are provably one: a tensor both take it from,
    or one Dim both reach (head-split Reshapes reading one Shape)."""
    ids_a, dims_a = dim_sources(a, axis_a, dims)
    ids_b, dims_b = dim_sources(b, axis_b, dims)
    return bool(ids_a & ids_b) or any(same(x, y) for x in dims_a for y in dims_b)


def proven_dim(t: gs.Tensor, axis: int, dims: Dims) -> int | None:
    """The constant dim ``axis`` of ``t`` provably has, or None."""
    for d in dim_sources(t, axis, dims)[1]:
        if d is not None and d.is_int and d.value >= 0:
            return d.value
    return None


def _reduced_axes(node: gs.Node, rank: int) -> set[int]:
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and is_constant(node.inputs[1]):
        axes = constant_value(node.inputs[1]).reshape(-1).tolist()
    return set(range(rank)) if axes is None else {int(a) % rank for a in axes}


__all__ = ["Dim", "dim_sources", "proven_dim", "share_dim"]
