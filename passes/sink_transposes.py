"""sink-transposes: move layout Transposes down through layout-agnostic ops until they cancel.

Fusions that need a different layout (NhwcConv, GroupNorm with channels_last=1) wrap their node in
a Transpose pair. Between two such nodes the graph then reads

    ... ─ Transpose(P) ─ y ─ Add(·, c) ─ Sigmoid ─ Transpose(P⁻¹) ─ ...

This pass sinks every Transpose below ops that do not care about layout, rewriting them for the
other layout, so that inverse pairs meet and vanish; Transposes are left only at the edges of
layout regions (before a Reshape, a MatMul, a graph output):

    Transpose(P)(x) ─ op            ==>  op'(x) ─ Transpose(P)     op elementwise / Concat / Resize
    Transpose(P⁻¹)(Transpose(P)(x)) ==>  x                          per consumer
    Shape(Transpose(P)(x))          ==>  Gather(Shape(x), P)        per consumer (dynamic graphs)

Rewrites for each op (P: the transpose's perm, out[i] = in[P[i]]):

* unary elementwise: unchanged;
* binary/ternary elementwise: every other operand is brought into the new layout: a constant is
  transposed offline (after right-aligning its rank), the output of a Transpose(P) is unwrapped,
  an operand that some other reader already transposes to the new layout reuses that Transpose,
  a broadcast operand much smaller than the transposed one (e.g. a (N, C, 1, 1) time embedding next
  to (N, C, H, W) activations) gets a Transpose(P⁻¹) of its own; anything else stops the sinking
  (a full-size operand would need a Transpose as costly as the one saved, and two small operands
  could trade a Transpose back and forth forever);
* Concat(axis=a) → Concat(axis=P[a]), all inputs unwrapped as above;
* Resize (constant scales or sizes, no ROI use) → scales/sizes permuted; computed sizes through a Gather;
* LayerNormalization / SimplifiedLayerNormalization over the last axis, with a (D,) scale and bias,
  where P keeps the last axis in place: unchanged. A diffusion transformer's QK RMSNorm reads
  (B, S, H, Dh) -> Transpose(0, 2, 1, 3) -> norm over Dh -> Concat over the tokens -> the inverse
  Transpose -> Reshape (B, S, H*Dh): sunk through the norm and the Concat, the pair cancels.

Safe because each rewrite is the identity ``op(T(x), T(c)) = T(op(x, c))`` for ops applied
element by element (or along an axis that is renamed accordingly).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, NameAuthority
from onnxopt.graph_edit import detach, is_absent, is_standard, redirect_consumers, replace_output, set_input
from onnxopt.layout import inverse
from onnxopt.model import Model
from onnxopt.pass_infra import Pass, PassResult
from onnxopt.pattern import constant_value, is_constant
from onnxopt.registry import register_pass

UNARY = {"Sigmoid", "Relu", "Tanh", "Erf", "Neg", "Sqrt", "Exp", "Log", "Abs", "Cast", "Softplus", "Elu",
         "LeakyRelu", "HardSigmoid", "Gelu", "Reciprocal", "Identity", "Floor", "Ceil", "Round", "Sin", "Cos"}
ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Equal", "Less", "Greater", "And", "Or"}
LAST_AXIS_NORMS = {"LayerNormalization", "SimplifiedLayerNormalization"}
SMALL_OPERAND = 1 << 16  # elements of a broadcast operand worth a Transpose of its own
MAX_ROUNDS = 1000


def is_layout_transpose(node: gs.Node) -> bool:
    return node.op == "Transpose" and is_standard(node) and "perm" in node.attrs and len(node.inputs) == 1


def _perm(node: gs.Node) -> list[int]:
    return [int(p) for p in node.attrs["perm"]]


@register_pass
class SinkTransposes(Pass):
    name = "sink-transposes"
    description = "sink layout Transposes through elementwise ops, Concat and Resize so inverse pairs cancel"

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        transposes_before = sum(1 for n in graph.nodes if is_layout_transpose(n))
        names = _Names(graph)
        for _ in range(MAX_ROUNDS):
            changed = cancel_inverse_pairs(graph) + read_shapes_before_transposes(graph, names) + sink_once(graph, names)
            if not changed:
                break
            result.modified = True
            graph.cleanup(remove_unused_graph_inputs=False)
        graph.toposort()
        transposes_after = sum(1 for n in graph.nodes if is_layout_transpose(n))
        result.sites_matched = transposes_before
        result.sites_rewritten = max(transposes_before - transposes_after, 0)
        result.details = {"transposes_before": transposes_before, "transposes_after": transposes_after}
        return result


class _Names(NameAuthority):
    """The run's names, and every constant already brought into another layout: made once and
    shared by the nodes that need it (two ops reading one constant sink the same way)."""

    def __init__(self, graph: gs.Graph):
        super().__init__(graph)
        self._relaid: dict[tuple, tuple[gs.Tensor, gs.Constant]] = {}

    def relaid(self, make: Emit, operand: gs.Tensor, how: tuple, compute) -> gs.Constant:
        """``operand`` in another layout (``how`` says which), written by ``make`` the first time."""
        key = (id(operand), how)
        known = self._relaid.get(key)
        if known is None or known[0] is not operand:
            known = self._relaid[key] = (operand, make.constant("x".join(map(str, how[-1])), compute()))
        return known[1]


def cancel_inverse_pairs(graph: gs.Graph) -> int:
    """Transpose(Q)(Transpose(P)(x)) with Q = P⁻¹: the consumer reads x. Counted per consumer."""
    cancelled = 0
    for outer in [n for n in graph.nodes if is_layout_transpose(n)]:
        t = outer.inputs[0]
        if len(t.inputs) != 1 or not is_layout_transpose(t.inputs[0]):
            continue
        inner = t.inputs[0]
        if _perm(outer) != inverse(_perm(inner)):
            continue
        x = inner.inputs[0]
        y = outer.outputs[0]
        if any(y is out for out in graph.outputs):
            continue  # the graph output keeps its name and its producer
        redirect_consumers(y, x)
        detach(outer)
        cancelled += 1
    return cancelled


def read_shapes_before_transposes(graph: gs.Graph, names: _Names) -> int:
    """A Shape of a transposed tensor reads the untransposed one and permutes the result instead.

    Dynamic exports take many Shapes; without this they would pin Transposes in place.
    """
    rewritten = 0
    for transpose in [n for n in graph.nodes if is_layout_transpose(n)]:
        t = transpose.outputs[0]
        for shape_node in [c for c in t.outputs if c.op == "Shape" and is_standard(c)]:
            perm = _perm(transpose)
            start = int(shape_node.attrs.get("start", 0))
            end = shape_node.attrs.get("end")
            indices = perm[start: None if end is None else int(end)]
            make = Emit(graph, names, shape_node.name)
            full = make.tensor("untransposed", np.int64, [len(perm)])
            shape_node.attrs.pop("start", None)
            shape_node.attrs.pop("end", None)
            set_input(shape_node, 0, transpose.inputs[0])
            result = shape_node.outputs[0]
            replace_output(shape_node, result, full)
            make.op.Gather(full, make.constant("perm", np.array(indices, np.int64)), axis=0, _label="permuted", _outputs=[result])
            make.into(graph)
            rewritten += 1
    return rewritten


def sink_once(graph: gs.Graph, names: _Names) -> int:
    """Sink each Transpose one op down. A Transpose read by several ops is cloned for each op it
    can sink through (the others keep sharing it), so a residual branch does not pin it."""
    moved = 0
    for node in list(graph.nodes):
        if not is_layout_transpose(node) or not node.outputs:
            continue
        t = node.outputs[0]
        if any(t is out for out in graph.outputs):
            continue
        consumers = list(t.outputs)
        if len(consumers) == 1:
            moved += _sink_through(graph, names, node, consumers[0])
            continue
        for consumer in consumers:
            if not _sink_through(graph, names, node, consumer, dry_run=True):
                continue
            make = Emit(graph, names, node.name)
            clone_out = make.op.Transpose(node.inputs[0], **dict(node.attrs), _label=f"for_{consumer.name}",
                                          _dtype=t.dtype, _shape=t.shape)
            make.into(graph)
            redirect_consumers(t, clone_out, only=consumer)
            moved += _sink_through(graph, names, clone_out.inputs[0], consumer)
    return moved


def _sink_through(graph: gs.Graph, names: _Names, transpose: gs.Node, consumer: gs.Node, dry_run: bool = False) -> bool:
    """Rewrite ``consumer(Transpose(P)(x), ...)`` as ``Transpose(P)(consumer'(x, ...))``.

    With ``dry_run``, only say whether it can be done; the graph is not touched.
    """
    if not is_standard(consumer) or len(consumer.outputs) != 1:
        return False
    perm = _perm(transpose)
    rank = len(perm)
    t = transpose.outputs[0]
    op = consumer.op
    new_inputs = list(consumer.inputs)
    new_attrs = dict(consumer.attrs)

    if op in UNARY:
        new_inputs[0] = transpose.inputs[0]
    elif op in ELEMENTWISE or op == "Concat":
        if op == "Concat":
            axis = int(consumer.attrs["axis"]) % rank
            new_attrs["axis"] = perm[axis]
        for i, operand in enumerate(consumer.inputs):
            if operand is t:
                new_inputs[i] = transpose.inputs[0]
                continue
            converted = _to_inner_layout(graph, names, operand, perm, broadcast=op != "Concat", beside=t, dry_run=dry_run)
            if converted is None:
                return False
            new_inputs[i] = converted
    elif op in LAST_AXIS_NORMS:
        if not _norm_commutes(consumer, t, perm):
            return False
        new_inputs[0] = transpose.inputs[0]
    elif op == "Resize":
        resize_make = Emit(graph, names, consumer.name)
        converted = _resize_inputs(resize_make, consumer, perm, dry_run)
        if converted is None:
            return False
        new_inputs = [transpose.inputs[0]] + converted
        if not dry_run:
            resize_make.into(graph)
    else:
        return False
    if dry_run:
        return True

    y = consumer.outputs[0]
    y_inner = Emit(graph, names, y.name).tensor(
        "x".join(map(str, inverse(perm))), y.dtype,
        [y.shape[i] for i in inverse(perm)] if y.shape is not None and len(y.shape) == rank else None)
    for i, operand in enumerate(new_inputs):
        set_input(consumer, i, operand)
    consumer.attrs.clear()
    consumer.attrs.update(new_attrs)
    replace_output(consumer, y, y_inner)
    make = Emit(graph, names, transpose.name)
    make.op.Transpose(y_inner, perm=perm, _label="sunk", _outputs=[y])
    make.into(graph)
    return True


def _norm_commutes(norm: gs.Node, t: gs.Tensor, perm: list[int]) -> bool:
    """``norm`` normalizes ``t`` (its input 0 only) along the last axis, which ``perm`` leaves in
    place, with a scale and bias of one value per channel: it computes the same in either layout."""
    rank = len(perm)
    if norm.inputs[0] is not t or any(operand is t for operand in norm.inputs[1:]):
        return False
    if int(norm.attrs.get("axis", -1)) % rank != rank - 1 or perm[-1] != rank - 1:
        return False
    return all(is_absent(p) or (p.shape is not None and len(p.shape) == 1) for p in norm.inputs[1:])


def _to_inner_layout(graph: gs.Graph, names: _Names, operand: gs.Tensor, perm: list[int], broadcast: bool,
                     beside: gs.Tensor, dry_run: bool = False) -> gs.Tensor | None:
    """``operand`` as seen before Transpose(P): the same values in the other layout, or None."""
    rank = len(perm)
    inv = inverse(perm)
    make = Emit(graph, names, operand.name)
    if is_constant(operand):
        value = constant_value(operand)
        if value.ndim > rank or (not broadcast and value.ndim != rank):
            return None
        if value.size == 1 and value.ndim <= 1:
            return operand  # a scalar broadcasts the same way in any layout
        aligned = value.reshape((1,) * (rank - value.ndim) + value.shape)
        return names.relaid(make, operand, ("transposed", tuple(inv)), lambda: aligned.transpose(inv))
    if len(operand.inputs) == 1 and is_layout_transpose(operand.inputs[0]) and _perm(operand.inputs[0]) == perm:
        return operand.inputs[0].inputs[0]
    for reader in operand.outputs:  # the other layout may already be computed for another reader
        if is_layout_transpose(reader) and _perm(reader) == inv:
            return reader.outputs[0]
    shape = operand.shape
    if shape is None or len(shape) != rank:
        return None
    if not broadcast or not _is_small_broadcast(shape, beside):
        return None
    if dry_run:
        return operand
    out = make.op.Transpose(operand, perm=inv, _label="to_inner_layout")
    make.into(graph)
    return out


def _is_small_broadcast(shape, beside: gs.Tensor) -> bool:
    """A small operand that broadcasts over ``beside`` (e.g. a (N, C, 1, 1) time embedding next to
    (N, C, H, W) activations): worth a Transpose of its own. Symbolic dims (a dynamic batch) are
    allowed: transposing the operand is correct whatever its size, and broadcasting along some
    axis of ``beside`` bounds it below ``beside``'s size."""
    if beside.shape is None or len(beside.shape) != len(shape):
        return False
    known = 1
    broadcasts = False
    for mine, theirs in zip(shape, beside.shape):
        if isinstance(mine, int):
            known *= mine
            broadcasts |= mine == 1 and theirs != 1
    return broadcasts and known <= SMALL_OPERAND


def _resize_inputs(make: Emit, resize: gs.Node, perm: list[int], dry_run: bool = False) -> list[gs.Tensor] | None:
    """Resize's roi/scales/sizes, permuted for the other layout; None if they cannot be. Computed sizes
    (upsample-to-skip's, read off the skip) are permuted by a Gather the Resize reads (written unless
    ``dry_run``); other computed inputs stop the sinking."""
    inv = inverse(perm)
    out: list[gs.Tensor] = []
    for index, tensor in enumerate(resize.inputs[1:], start=1):
        if is_absent(tensor):
            out.append(tensor)
            continue
        if not is_constant(tensor) and index == 3 and tensor.shape is not None and list(tensor.shape) == [len(perm)]:
            out.append(tensor if dry_run else make.op.Gather(tensor, make.constant("perm", np.array(inv, np.int64)),
                                                             axis=0, _label="sizes_permuted", _shape=[len(perm)]))
            continue
        if not is_constant(tensor):
            return None
        value = constant_value(tensor)
        if value.size == 0:
            out.append(tensor)
            continue
        if index == 1:  # roi: starts then ends, one per axis; only matters for tf_crop_and_resize
            if resize.attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize":
                return None
            out.append(tensor)
            continue
        if value.ndim != 1 or value.size != len(perm):
            return None
        out.append(make.names.relaid(make, tensor, ("permuted", tuple(inv)), lambda: value[inv]))
    if resize.attrs.get("axes") is not None:
        return None
    return out
