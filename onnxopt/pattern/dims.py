"""Symbolic dimensions: what a fusion's ``check`` needs to prove a Reshape, a Shape or a mask shape.

A pattern binds the shape operand of ``Reshape(x, shape)`` to a Var; whether that Reshape really
splits the hidden axis into (heads, head_dim) depends on values computed at run time
(``Concat(Unsqueeze(Gather(Shape(x), 0)), [-1], [8], ...)``), on constants (static exports) or on
both. This module evaluates such shape computations symbolically::

    dims = Dims()                               # one per pass run: results are memoized
    dims.shape(tensor)       # [Dim('batch'), Dim('?x:1'), Dim(32)] or None (rank unknown)
    dims.vector(shape_in)    # the int64 vector a Shape/Gather/Concat/... subgraph computes
    dims.reshaped(node)      # the output dims of a Reshape node, -1 and 0 resolved
    dims.scalar(tensor)      # a 1-element int/float tensor as a Dim (e.g. a head dim)

A :class:`Dim` is ``coeff * sym1 * sym2 ...``: an integer when it has no symbols. Symbols are the
``dim_param`` names of graph inputs and shape annotations (equal names are equal sizes, by ONNX's
convention) or, for a dimension nothing names, ``?tensor:axis``. Two dims compare equal only when
they are provably equal; ``None`` means "unknown" and never compares equal. Structural rules
(Transpose, Reshape, MatMul, Gemm, Conv, Gather, Concat, Resize, broadcasting and shape-preserving
ops, Shape arithmetic) come first, so ``Div(Gather(Shape(k), 2), 1)`` is 32 even where shape
inference left ``unk__15``; annotations fill in where the rules stop.

One assumption beyond the ONNX spec: the graph runs. Two dims that broadcast against each other
and can never be 1 (``2*batch``, ``77``) are taken as equal, since otherwise the graph would fail.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from onnxopt.graph_edit import is_absent
from onnxopt.weights import numpy_dtype

from .constants import constant_shape, constant_value, is_constant

# Ops whose output has the shape of their first input.
SHAPE_PRESERVING = frozenset({
    "Cast", "Identity", "Softmax", "LogSoftmax", "LayerNormalization", "InstanceNormalization",
    "Relu", "Sigmoid", "Tanh", "Erf", "Sqrt", "Neg", "Abs", "Exp", "Log", "Gelu", "FastGelu",
    "GroupNormalization", "IsNaN", "Not", "Dropout", "Clip", "Reciprocal", "Trilu", "Sin", "Cos",
    "Softplus", "Mish", "HardSigmoid", "LeakyRelu", "Elu",
})
ELEMENTWISE_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Equal", "Less", "LessOrEqual",
                                "Greater", "GreaterOrEqual", "And", "Or", "Max", "Min"})


@dataclass(frozen=True)
class Dim:
    """``coeff`` times the product of ``symbols`` (sorted). ``Dim(32)``, ``Dim(1, ("batch",))``."""

    coeff: int
    symbols: tuple[str, ...] = ()

    @property
    def is_int(self) -> bool:
        return not self.symbols

    @property
    def value(self) -> int | None:
        return self.coeff if not self.symbols else None

    def __mul__(self, other: Dim) -> Dim:
        return Dim(self.coeff * other.coeff, tuple(sorted(self.symbols + other.symbols)))

    def divided_by(self, other: Dim) -> Dim | None:
        """Exact division, or None when it is not provably exact."""
        if other.coeff == 0 or self.coeff % other.coeff:
            return None
        mine = Counter(self.symbols)
        mine.subtract(other.symbols)
        if any(n < 0 for n in mine.values()):
            return None
        return Dim(self.coeff // other.coeff, tuple(sorted(mine.elements())))

    def __str__(self) -> str:
        parts = ([str(self.coeff)] if self.coeff != 1 or not self.symbols else []) + list(self.symbols)
        return "*".join(parts)

    __repr__ = __str__


def product(dims) -> Dim:
    out = Dim(1)
    for d in dims:
        out = out * d
    return out


def same(a: Dim | None, b: Dim | None) -> bool:
    """Provably equal (None is unknown and equals nothing)."""
    return a is not None and b is not None and a == b


def same_dims(a: list | None, b: list | None) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def text(dims: list | None) -> str:
    return "?" if dims is None else "(" + ", ".join("?" if d is None else str(d) for d in dims) + ")"


class Dims:
    """Symbolic shapes of the tensors of one graph, computed on demand and memoized.

    Create one per pass run: results are cached by tensor identity, so a Dims must not outlive
    edits to the tensors it has seen.
    """

    def __init__(self, max_depth: int = 200, *, annotated_only: bool = False,
                 leading_dim: Callable[[gs.Tensor], Dim | None] | None = None):
        """``annotated_only``: a tensor's dims are its annotations (what shape inference wrote), no
        structural rule; what :func:`onnxopt.pattern.tensor_facts.static_ints` reads.
        ``leading_dim``: the caller's own dim 0 for the tensors it returns one for (cfg-late: the
        full batch, as a symbol, of the tensors it computes at half the batch); asked once per tensor."""
        self.annotated_only = annotated_only
        self.leading_dim = leading_dim
        self._shapes: dict[int, list | None] = {}
        self._vectors: dict[int, list | None] = {}
        self._depth = 0
        self._max_depth = max_depth
        # min(d, end) of a Slice [0:end] that neither bound decides: the symbol -> its two bounds
        self._prefixes: dict[Dim, tuple[Dim, Dim]] = {}

    # ---------------------------------------------------------------- tensor shapes

    def shape(self, tensor: gs.Tensor | None) -> list[Dim | None] | None:
        """Dims of ``tensor`` (None entries are unknown), or None when the rank is unknown."""
        if tensor is None:
            return None
        key = id(tensor)
        if key not in self._shapes:
            self._shapes[key] = None  # cycles (there are none in a valid graph) read as unknown
            self._depth += 1
            try:
                shape = self._shape(tensor) if self._depth < self._max_depth else self._annotated(tensor)
                leading = self.leading_dim(tensor) if self.leading_dim is not None and shape else None
                self._shapes[key] = shape if leading is None else [leading, *shape[1:]]
            finally:
                self._depth -= 1
        return self._shapes[key]

    def dim(self, tensor: gs.Tensor, axis: int) -> Dim | None:
        shape = self.shape(tensor)
        if shape is None or not -len(shape) <= axis < len(shape):
            return None
        return shape[axis]

    def rank(self, tensor: gs.Tensor) -> int | None:
        shape = self.shape(tensor)
        return None if shape is None else len(shape)

    def _shape(self, tensor: gs.Tensor) -> list | None:
        annotated = self._annotated(tensor)
        if isinstance(tensor, gs.Constant) or is_constant(tensor):
            return [Dim(int(d)) for d in constant_shape(tensor)]
        if not tensor.inputs or self.annotated_only:  # a graph input, or annotations asked for
            return annotated
        derived = self._derived(tensor.inputs[0], tensor)
        if derived is None:
            return annotated
        if annotated is not None and len(annotated) == len(derived):
            # A rule that stopped short of an int loses to an annotated int.
            derived = [a if (d is None or not d.is_int) and a is not None and a.is_int else (d if d is not None else a)
                       for d, a in zip(derived, annotated)]
        return derived

    def _annotated(self, tensor: gs.Tensor) -> list | None:
        shape = tensor.shape
        if shape is None:
            return None
        out = []
        for axis, d in enumerate(shape):
            if isinstance(d, (int, np.integer)) and d >= 0:
                out.append(Dim(int(d)))
            elif isinstance(d, str) and d:
                out.append(Dim(1, (d,)))
            else:
                out.append(Dim(1, (f"?{tensor.name}:{axis}",)))
        return out

    def _derived(self, node: gs.Node, tensor: gs.Tensor) -> list | None:
        """The output dims of ``node`` by a structural rule (None when no rule applies)."""
        op = node.op
        if node.domain not in (None, "", "ai.onnx") or node.outputs[0] is not tensor:
            return None
        inputs = node.inputs
        if op in SHAPE_PRESERVING:
            return self.shape(inputs[0])
        if op == "Transpose":
            shape = self.shape(inputs[0])
            if shape is None:
                return None
            perm = node.attrs.get("perm") or list(reversed(range(len(shape))))
            return [shape[p] for p in perm] if len(perm) == len(shape) else None
        if op == "Reshape":
            return self.reshaped(node)
        if op == "MatMul":
            return self._matmul(inputs[0], inputs[1])
        if op in ELEMENTWISE_BINARY:
            return self._broadcast([self.shape(t) for t in inputs])
        if op == "Gather":
            return self._gather(node)
        if op == "Conv":
            return self._conv(node)
        if op == "Gemm":
            a, b = self.shape(inputs[0]), self.shape(inputs[1])
            if a is None or b is None or len(a) != 2 or len(b) != 2:
                return None
            return [a[1 if node.attrs.get("transA", 0) else 0], b[0 if node.attrs.get("transB", 0) else 1]]
        if op == "Expand":
            target = self.vector(inputs[1])
            return None if target is None else self._broadcast([self.shape(inputs[0]), target])
        if op == "Unsqueeze":
            return self._unsqueeze(node)
        if op == "ConstantOfShape":
            return self.vector(inputs[0])
        if op == "Concat":
            return self._concat(node)
        if op == "Resize":
            return self._resize(node)
        if op == "Slice":
            return self._sliced(node)
        if op == "Range":  # Range(0, n, 1) has n elements
            start, limit, delta = (self.scalar(t) for t in inputs[:3])
            if same(start, Dim(0)) and same(delta, Dim(1)):
                return [limit]
            return None
        return None

    def _concat(self, node: gs.Node) -> list | None:
        """Other axes are shared; the concatenated one is the sum (integers only)."""
        shapes = [self.shape(t) for t in node.inputs]
        if any(sh is None for sh in shapes) or len({len(sh) for sh in shapes}) != 1:
            return None
        axis = int(node.attrs.get("axis", 0)) % len(shapes[0])
        out = []
        for i in range(len(shapes[0])):
            column = [sh[i] for sh in shapes]
            if i == axis:
                ints = [d.value if d is not None else None for d in column]
                out.append(Dim(sum(ints)) if all(v is not None for v in ints) else None)
            else:
                known = [d for d in column if d is not None]
                # Concat needs the other axes equal: any operand's dim names them.
                out.append(known[0] if known else None)
        return out

    def _resize(self, node: gs.Node) -> list | None:
        """Axes with scale 1 keep their dims; ``sizes`` give theirs."""
        shape = self.shape(node.inputs[0])
        if shape is None:
            return None
        scales = node.inputs[2] if len(node.inputs) > 2 and not is_absent(node.inputs[2]) else None
        sizes = node.inputs[3] if len(node.inputs) > 3 and not is_absent(node.inputs[3]) else None
        if sizes is not None:
            return self.vector(sizes)
        value = constant_value(scales) if scales is not None else None
        if value is None or value.size != len(shape):
            return None
        return [d if s == 1 else None for d, s in zip(shape, value.reshape(-1))]

    def _sliced(self, node: gs.Node) -> list | None:
        """Axes the Slice does not touch keep their dims; a touched axis sliced ``[0:end]`` with step 1
        keeps its dim d where ``end`` is provably d or at least d (``mask[..., :key_len]`` with the mask
        key_len long), and is ``end`` where both are integers and end is smaller."""
        shape = self.shape(node.inputs[0])
        if shape is None:
            return None
        axes_t = node.inputs[3] if len(node.inputs) > 3 else None
        axes = constant_value(axes_t) if axes_t is not None and not is_absent(axes_t) else np.arange(len(shape))
        if axes is None:
            return None
        axes = [int(a) % len(shape) for a in axes.reshape(-1)]
        starts, ends = (_ints(self.vector(t)) for t in node.inputs[1:3])
        ends_dims = self.vector(node.inputs[2])
        steps_t = node.inputs[4] if len(node.inputs) > 4 and not is_absent(node.inputs[4]) else None
        steps = [1] * len(axes) if steps_t is None else _ints(self.vector(steps_t))
        out = list(shape)
        for k, axis in enumerate(axes):
            out[axis] = None
            if starts is None or steps is None or ends_dims is None or len(ends_dims) != len(axes):
                continue
            if starts[k] != 0 or steps[k] != 1:
                continue
            d, end = shape[axis], ends_dims[k]
            if same(end, d) or (end is not None and end.is_int and end.value >= _SLICE_TO_THE_END):
                out[axis] = d
            elif d is not None and end is not None and d.is_int and end.is_int and end.value >= 0:
                out[axis] = Dim(min(d.value, end.value))
            elif d is not None and end is not None and not (end.is_int and end.value < 0):
                out[axis] = self._prefix(d, end)
        return out

    def _prefix(self, d: Dim, end: Dim) -> Dim:
        """min(d, end), a size of its own that broadcasting against either bound resolves
        (CLIP's ``position_ids[:, :seq_len]``, 77 positions, added to a seq_len-long embedding)."""
        prefix = Dim(1, (f"min({d},{end})",))
        self._prefixes[prefix] = (d, end)
        return prefix

    def _drop_prefixes_of(self, found: list) -> list:
        """Broadcasting b against min(b, c) gives b in a graph that runs: min(b, c) is b, or c < b,
        which broadcasts only when it is 1. The prefix dims among ``found`` that meet a bound go."""
        return [d for d in found
                if not (d in self._prefixes and any(same(other, bound) for other in found for bound in self._prefixes[d]))]

    def _conv(self, node: gs.Node) -> list | None:
        """Batch and channels; a spatial dim too where the conv keeps its size (stride 1, "same" pads)."""
        x, w = self.shape(node.inputs[0]), self.shape(node.inputs[1])
        if x is None or w is None or len(x) != len(w) or node.attrs.get("auto_pad", "NOTSET") != "NOTSET":
            return None
        spatial = len(x) - 2
        kernel = node.attrs.get("kernel_shape") or [d.value for d in w[2:]]
        strides = node.attrs.get("strides") or [1] * spatial
        dilations = node.attrs.get("dilations") or [1] * spatial
        pads = node.attrs.get("pads") or [0] * (2 * spatial)
        out = [x[0], w[0]]
        for i in range(spatial):
            keeps = kernel[i] is not None and strides[i] == 1 and pads[i] + pads[i + spatial] == dilations[i] * (kernel[i] - 1)
            out.append(x[2 + i] if keeps else None)
        return out

    def _matmul(self, a: gs.Tensor, b: gs.Tensor) -> list | None:
        sa, sb = self.shape(a), self.shape(b)
        if sa is None or sb is None or len(sa) < 2 or len(sb) < 2:
            return None
        batch = self._broadcast([sa[:-2], sb[:-2]])
        return None if batch is None else batch + [sa[-2], sb[-1]]

    def _broadcast(self, shapes: list) -> list | None:
        if any(s is None for s in shapes):
            return None
        rank = max(len(s) for s in shapes)
        out = []
        for axis in range(rank):
            found = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]
            found = self._drop_prefixes_of([d for d in found if not same(d, Dim(1))])
            if not found:
                out.append(Dim(1))
            elif all(same(d, found[0]) for d in found[1:]) or all(_never_one(d) for d in found):
                # Dims that can never be 1 only broadcast when equal: in a graph that runs, they are.
                out.append(found[0])
            else:
                out.append(None)
        return out

    def _gather(self, node: gs.Node) -> list | None:
        data, indices = self.shape(node.inputs[0]), self.shape(node.inputs[1])
        axis = int(node.attrs.get("axis", 0))
        if data is None or indices is None:
            return None
        axis %= len(data)
        return data[:axis] + indices + data[axis + 1:]

    def _unsqueeze(self, node: gs.Node) -> list | None:
        shape = self.shape(node.inputs[0])
        axes = node.attrs.get("axes")
        if axes is None and len(node.inputs) > 1:
            value = constant_value(node.inputs[1])
            axes = None if value is None else value.reshape(-1).tolist()
        if shape is None or axes is None:
            return None
        rank = len(shape) + len(axes)
        axes = sorted(a % rank for a in axes)
        out, rest = [], iter(shape)
        for i in range(rank):
            out.append(Dim(1) if i in axes else next(rest))
        return out

    # ---------------------------------------------------------------- Reshape

    def reshaped(self, node: gs.Node) -> list | None:
        """The dims ``Reshape(x, shape)`` produces: 0 copies (allowzero=0), -1 is solved exactly."""
        x, target = node.inputs[0], self.vector(node.inputs[1])
        if target is None:
            return None
        shape = self.shape(x)
        allowzero = int(node.attrs.get("allowzero", 0))
        out: list = []
        for i, d in enumerate(target):
            if d is not None and d.value == 0 and not allowzero:
                out.append(shape[i] if shape is not None and i < len(shape) else None)
            else:
                out.append(d)
        holes = [i for i, d in enumerate(out) if d is not None and d.value == -1]
        if len(holes) == 1:
            known = [d for i, d in enumerate(out) if i != holes[0]]
            solved = None
            if shape is not None and all(d is not None for d in shape) and all(d is not None for d in known):
                solved = product(shape).divided_by(product(known))
            out[holes[0]] = solved
        return out

    # ---------------------------------------------------------------- shape vectors

    def scalar(self, tensor: gs.Tensor) -> Dim | None:
        """A one-element integer tensor as a Dim (None if unknown or not one element)."""
        vector = self.vector(tensor)
        return vector[0] if vector is not None and len(vector) == 1 else None

    def vector(self, tensor: gs.Tensor | None) -> list[Dim | None] | None:
        """The elements of a 0-D/1-D integer tensor computed from constants and shapes."""
        if tensor is None:
            return None
        key = id(tensor)
        if key not in self._vectors:
            self._vectors[key] = None
            self._depth += 1
            try:
                self._vectors[key] = self._vector(tensor) if self._depth < self._max_depth else None
            finally:
                self._depth -= 1
        return self._vectors[key]

    def _vector(self, tensor: gs.Tensor) -> list | None:
        if is_constant(tensor):
            value = constant_value(tensor)
            if value.ndim > 1 or not np.issubdtype(value.dtype, np.integer) and not _integral(value):
                return None
            return [Dim(int(v)) for v in value.reshape(-1)]
        if not tensor.inputs:
            return None
        node = tensor.inputs[0]
        if node.domain not in (None, "", "ai.onnx"):
            return None
        op, inputs = node.op, node.inputs
        if op == "Shape":
            shape = self.shape(inputs[0])
            if shape is None:
                return None
            start, end = node.attrs.get("start", 0), node.attrs.get("end")
            return list(shape[slice(start, end)])
        if op in ("Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten"):
            return self.vector(inputs[0])
        if op == "Concat":
            parts = [self.vector(t) for t in inputs]
            return None if any(p is None for p in parts) else [d for p in parts for d in p]
        if op == "Gather":
            data, index = self.vector(inputs[0]), _ints(self.vector(inputs[1]))
            if data is None or index is None or int(node.attrs.get("axis", 0)) not in (0, -1):
                return None
            try:
                return [data[i] for i in index]
            except IndexError:
                return None
        if op == "Slice":
            return self._slice(inputs)
        if op == "Size":
            shape = self.shape(inputs[0])
            return None if shape is None or any(d is None for d in shape) else [product(shape)]
        if op in ("Neg", "Abs"):
            data = self.vector(inputs[0])
            if data is None:
                return None
            return [Dim(-d.value if op == "Neg" else abs(d.value)) if d is not None and d.is_int else None for d in data]
        if op == "ConstantOfShape":
            count = self.vector(inputs[0])
            value = node.attrs.get("value")
            fill = 0 if value is None else np.asarray(value.values).reshape(-1)[0]
            if count is None or len(count) != 1 or count[0] is None or not count[0].is_int or not _integral(np.asarray(float(fill))):
                return None
            return [Dim(int(fill))] * count[0].value
        if op == "Where":  # TorchScript's expand(): where(shape == -1, 1, shape)
            cond, a, b = (self._truth(inputs[0]), self.vector(inputs[1]), self.vector(inputs[2]))
            if cond is None or a is None or b is None:
                return None
            n = max(len(cond), len(a), len(b))
            cond, a, b = (x * n if len(x) == 1 else x for x in (cond, a, b))
            if not len(cond) == len(a) == len(b) == n:
                return None
            return [None if c is None else (x if c else y) for c, x, y in zip(cond, a, b)]
        if op in ("Mul", "Div", "Add", "Sub", "Mod", "Max", "Min"):
            operands = [self.vector(t) for t in inputs]
            if any(v is None for v in operands) or (op not in ("Max", "Min") and len(operands) != 2):
                return None
            n = max(len(v) for v in operands)
            if any(len(v) not in (1, n) for v in operands):
                return None
            operands = [v * n if len(v) == 1 else v for v in operands]
            integer = all(_integer_typed(t) for t in inputs)  # Div and Mod as ONNX computes them on integers
            out = operands[0]
            for other in operands[1:]:
                out = [_arith(op, x, y, integer=integer, fmod=bool(node.attrs.get("fmod", 0))) for x, y in zip(out, other)]
            return out
        return None

    def _truth(self, tensor: gs.Tensor) -> list | None:
        """Elementwise truth of ``Equal(a, b)`` on shape vectors, where decidable (None where not)."""
        node = tensor.inputs[0] if isinstance(tensor, gs.Variable) and len(tensor.inputs) == 1 else None
        if node is None or node.op != "Equal":
            return None
        a, b = self.vector(node.inputs[0]), self.vector(node.inputs[1])
        if a is None or b is None:
            return None
        n = max(len(a), len(b))
        a, b = (x * n if len(x) == 1 else x for x in (a, b))
        return [_decide_equal(x, y) for x, y in zip(a, b)] if len(a) == len(b) else None

    def _slice(self, inputs) -> list | None:
        """A Slice of a vector (axis 0) with one start, end and step each, computed or constant;
        positive steps only (ONNX clamps negative ones unlike Python; shape code has none)."""
        data = self.vector(inputs[0])
        bounds = [_ints(self.vector(t)) if t is not None and not is_absent(t) else None for t in inputs[1:5]]
        while len(bounds) < 4:
            bounds.append(None)
        starts, ends, axes, steps = bounds
        if data is None or starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
            return None
        if axes is not None and axes not in ([0], [-1]):
            return None
        step = 1 if steps is None else steps[0]
        if step <= 0:
            return None
        return data[starts[0] : ends[0] : step]


# An end this large slices to the end of any axis (torch writes INT64_MAX; some exporters INT32_MAX).
_SLICE_TO_THE_END = 2**31 - 1


def _decide_equal(a: Dim | None, b: Dim | None) -> bool | None:
    if a is None or b is None:
        return None
    if a == b:
        return True
    if a.is_int and b.is_int:
        return False
    # A dim is never negative: a symbolic one differs from any negative integer.
    if (a.is_int and a.value < 0) or (b.is_int and b.value < 0):
        return False
    return None


def _never_one(d: Dim | None) -> bool:
    """``d`` can never be 1: an integer other than 1, or a multiple of 2 or more."""
    return d is not None and (d.value != 1 if d.is_int else d.coeff >= 2)


def _arith(op: str, a: Dim | None, b: Dim | None, *, integer: bool = False, fmod: bool = False) -> Dim | None:
    """``a op b``; ``integer``: both operands are integer tensors, so Div truncates toward zero and
    Mod is ONNX's (the divisor's sign, or the dividend's with ``fmod``). Otherwise a Div is exact
    or unknown (shape code divides floats that hold integers, too)."""
    if a is None or b is None:
        return None
    if op == "Mul":
        return a * b
    if op == "Div":
        exact = a.divided_by(b)
        if exact is None and integer and a.is_int and b.is_int and b.value != 0:
            quotient = abs(a.value) // abs(b.value)
            return Dim(-quotient if (a.value < 0) != (b.value < 0) else quotient)
        return exact
    if op in ("Max", "Min") and a == b:
        return a
    if op == "Sub" and a == b:  # seq - seq: transformers' past length, 0 without a cache
        return Dim(0)
    if op in ("Add", "Sub") and b == Dim(0):
        return a
    if op == "Add" and a == Dim(0):
        return b
    if not (a.is_int and b.is_int):
        return None
    x, y = a.value, b.value
    if op == "Add":
        return Dim(x + y)
    if op == "Sub":
        return Dim(x - y)
    if op == "Max":
        return Dim(max(x, y))
    if op == "Min":
        return Dim(min(x, y))
    if op == "Mod" and integer and y != 0:
        return Dim(int(math.fmod(x, y)) if fmod else x % y)
    return None


def _ints(vector: list | None) -> list[int] | None:
    """A vector's elements as ints (None if one is not a known integer)."""
    if vector is None or any(d is None or not d.is_int for d in vector):
        return None
    return [d.value for d in vector]


# Ops whose output has the element type of their first input (shape arithmetic).
_TYPE_OF_FIRST_INPUT = frozenset({"Neg", "Abs", "Add", "Sub", "Mul", "Div", "Mod", "Max", "Min", "Gather", "Concat",
                                  "Slice", "Squeeze", "Unsqueeze", "Reshape", "Identity", "Flatten"})


def _integer_typed(tensor: gs.Tensor, depth: int = 32) -> bool:
    """Whether ``tensor`` is known to hold integers: its constant or annotated dtype, else what
    computes it (Shape and Size give int64, a Cast its ``to``, arithmetic its first input's type)."""
    if is_constant(tensor):
        return np.issubdtype(constant_value(tensor).dtype, np.integer)
    dtype = getattr(tensor, "dtype", None)
    if dtype is not None:
        try:
            return np.issubdtype(numpy_dtype(dtype), np.integer)
        except TypeError:
            return False
    if depth == 0 or len(tensor.inputs) != 1:
        return False
    node = tensor.inputs[0]
    if node.domain not in (None, "", "ai.onnx"):
        return False
    if node.op in ("Shape", "Size"):
        return True
    if node.op == "Cast":
        return np.issubdtype(helper.tensor_dtype_to_np_dtype(int(node.attrs["to"])), np.integer)
    return node.op in _TYPE_OF_FIRST_INPUT and bool(node.inputs) and _integer_typed(node.inputs[0], depth - 1)


def _integral(value: np.ndarray) -> bool:
    return np.issubdtype(value.dtype, np.floating) and bool(np.all(np.mod(value, 1) == 0))


