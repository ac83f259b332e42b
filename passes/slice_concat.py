"""remove-slice-concat: a Concat of the consecutive Slices of one tensor, covering it, is that tensor.

    a = Slice(x, [0], e, [axis] [, [1]])              x[:, :e]    (e: a constant or a computed index)
    b = Slice(x, e', [END], [axis] [, [1]])           x[:, e:]    (e' the same value as e)
    y = Concat(a, b, axis=axis)
                         ==>
    y = x

diffusers' FluxSingleTransformerBlock takes the text and image streams apart and concatenates them
in every block: ``encoder_hidden_states, hidden_states = hidden_states[:, :text], hidden_states[:, text:]``
at a block's end, ``torch.cat([encoder_hidden_states, hidden_states], dim=1)`` at the next one's
start. Both copies (the Slices and the Concat) go; a Slice read elsewhere too stays for that reader
(TorchScript reads the text length off the text Slice's shape).

Why it is x: ONNX Slice maps a start or end s to s + dim when negative, then clamps it to
[0, dim]; the first Slice starts at 0, each next one starts where the one before ends (the same
value, so mapped and clamped alike), and the last one's end is at least INT32's maximum (the
exporters write INT64's), clamped to dim. The pieces are consecutive and cover the axis, in order.

Conditions: every Concat input is a Slice of one tensor x (rank 2 or more) along the Concat's axis (one constant
axis; steps absent or 1); the first start the constant 0; each end and the next start the same
value: one tensor, equal constants, or the same op with the same attributes on inputs of the same
value (the exporters compute text-length indices twice: Unsqueeze(Gather(Shape(..))) per Slice);
the last end a constant >= 2**31 - 1; x and y of one dtype. A Concat that meets them is a site
(refused only where it writes a graph output); any other Concat of Slices (the time embedding's
``cat([emb[:, half:], emb[:, :half]])``, a swap) is none.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.graph_edit import is_standard, redirect_consumers
from onnxopt.model import Model
from onnxopt.pass_infra import SHAPES_INFERRED, Pass, PassResult
from onnxopt.pattern import constant_value, is_constant
from onnxopt.pattern.tensor_facts import normalize_axis, rank_of
from onnxopt.registry import register_pass

TO_THE_END = 2**31 - 1
SAME_VALUE_DEPTH = 6  # how deep two index computations are compared (Unsqueeze(Gather(Shape(..))) is 3)


@register_pass
class RemoveSliceConcat(Pass):
    name = "remove-slice-concat"
    description = "Concat(x[:, :e], x[:, e:]) -> x (Flux's single blocks split and re-join the streams in every block)"
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED})

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        outputs = {id(t) for t in graph.outputs}
        for concat in [n for n in graph.nodes if n.op == "Concat" and is_standard(n) and len(n.inputs) >= 2]:
            if not all(t.inputs and t.inputs[0].op == "Slice" and is_standard(t.inputs[0]) for t in concat.inputs):
                continue
            source = _covered_source(concat)
            if isinstance(source, str):  # not a round trip (a swap of halves, shape plumbing, ...): no site
                continue
            result.sites_matched += 1
            y = concat.outputs[0]
            if id(y) in outputs:
                result.refuse(concat.name, "writes a graph output")
                continue
            redirect_consumers(y, source)
            result.sites_rewritten += 1
        if result.sites_rewritten:
            result.modified = True
            graph.cleanup(remove_unused_graph_inputs=False)
        return result


def _covered_source(concat: gs.Node) -> gs.Tensor | str:
    """x, when ``concat`` joins consecutive Slices of x that cover its axis; else why not."""
    slices = [t.inputs[0] for t in concat.inputs]
    x = slices[0].inputs[0]
    rank = rank_of(x)
    if any(s.inputs[0] is not x for s in slices) or rank is None or rank < 2:  # shape plumbing is fold-constants'
        return "the Slices are not of one tensor of rank 2 or more"
    axis = normalize_axis(int(concat.attrs.get("axis", 0)), rank)
    if axis is None:
        return "the Concat's axis is not known against x's rank"
    for s in slices:
        inputs = list(s.inputs) + [None] * (5 - len(s.inputs))
        axes, steps = inputs[3], inputs[4]
        axes_value = constant_value(axes) if axes is not None and axes.name and is_constant(axes) else None
        if axes_value is None or axes_value.size != 1 or normalize_axis(int(axes_value.reshape(-1)[0]), rank) != axis:
            return f"Slice '{s.name}' does not cut the Concat's axis {axis} alone"
        if steps is not None and steps.name and not _is_constant_value(steps, lambda v: v.size == 1 and v.reshape(-1)[0] == 1):
            return f"Slice '{s.name}' has a step other than 1"
    if not _is_constant_value(slices[0].inputs[1], lambda v: v.size == 1 and v.reshape(-1)[0] == 0):
        return "the first Slice does not start at 0"
    for before, after in zip(slices, slices[1:]):
        if not _same_value(before.inputs[2], after.inputs[1], SAME_VALUE_DEPTH):
            return f"Slice '{after.name}' does not start where '{before.name}' ends"
    if not _is_constant_value(slices[-1].inputs[2], lambda v: v.size == 1 and v.reshape(-1)[0] >= TO_THE_END):
        return "the last Slice does not run to the end of the axis"
    if x.dtype is not None and concat.outputs[0].dtype is not None and x.dtype != concat.outputs[0].dtype:
        return "x and the Concat differ in dtype"
    return x


def _is_constant_value(tensor: gs.Tensor | None, test) -> bool:
    if tensor is None or not is_constant(tensor):
        return False
    value = constant_value(tensor)
    return value is not None and bool(test(np.asarray(value)))


def _same_value(a: gs.Tensor, b: gs.Tensor, depth: int) -> bool:
    """Whether a and b hold the same value: one tensor, equal constants, or one deterministic op with
    equal attributes on inputs of the same value (index arithmetic computed twice)."""
    if a is b:
        return True
    if is_constant(a) and is_constant(b):
        va, vb = constant_value(a), constant_value(b)
        return va is not None and vb is not None and va.shape == vb.shape and va.dtype == vb.dtype and bool(np.all(va == vb))
    if depth == 0 or len(a.inputs) != 1 or len(b.inputs) != 1:
        return False
    pa, pb = a.inputs[0], b.inputs[0]
    if (pa.op, pa.domain) != (pb.op, pb.domain) or pa.op not in DETERMINISTIC or pa.attrs != pb.attrs:
        return False
    if len(pa.inputs) != len(pb.inputs) or pa.outputs.index(a) != pb.outputs.index(b):
        return False
    return all(_same_value(ia, ib, depth - 1) for ia, ib in zip(pa.inputs, pb.inputs))


# ops whose output is a function of their inputs and attributes alone (no randomness, no state)
DETERMINISTIC = frozenset({"Shape", "Gather", "Unsqueeze", "Squeeze", "Slice", "Cast", "Concat", "Reshape", "Add", "Sub",
                           "Mul", "Div", "Neg", "Size", "Identity"})

__all__ = ["RemoveSliceConcat"]
