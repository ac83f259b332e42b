"""Pattern values and the op builder: the vocabulary patterns are written in.

A pattern is a small Python function that builds the subgraph it matches.
Its parameters are variables (they match any tensor), ``op.X(...)`` calls
create pattern nodes, Python numbers in an operand position match constants
close to that number, and ``+ - * / **`` build the obvious ONNX ops::

    from onnxopt.pattern import op, Const, Var, OneOf, Maybe

    def erf_gelu(x):
        return 0.5 * (x * (op.Erf(x / math.sqrt(2)) + 1.0))

    def gelu(x):
        return OneOf(op.Gelu(x, approximate="none"), erf_gelu(x))

    def group_norm(x, gamma, beta, shape_in, shape_out):
        normed = op.InstanceNormalization(
            op.Reshape(x, shape_in), Const.named("scale"), Const.named("bias"),
            epsilon=Var("eps"))
        return op.Add(op.Mul(op.Reshape(normed, shape_out), gamma), beta)

Node options are keyword arguments that start with ``_``:

- ``_domain="com.microsoft"``: the node's domain (default: the builder's, ``""``).
- ``_outputs=2`` or ``_outputs=["a", "b"]``: number of outputs (names bind the
  output tensors, ``match["a"]``); a multi-output call returns a tuple.
- ``_name="gelu"``: name the node; ``match.node("gelu")`` returns the graph node.
- ``_attrs={...}``: attributes, merged with the other keyword arguments.
- ``_extra_inputs=True``: the graph node may have more inputs than the pattern.
- ``_external_uses=True``: this node's outputs may also feed nodes outside the
  match (by default a match is refused when an intermediate value escapes).
  ``_external_uses=predicate``: only outside readers ``predicate(node)`` accepts
  (``onnxopt.pattern.reads_only_shape``: values read outside only for their shape).

Attribute patterns (keyword arguments): a plain value matches exactly (floats
to fp32 precision), a callable is a predicate, ``Var("eps")`` captures the
value into ``match.attrs["eps"]``, ``None`` requires the attribute to be unset.
An attribute missing on the node reads as its ONNX schema default.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.layout import LAYOUT_OPS

# Ops whose operands may be permuted: the matcher tries every operand order.
COMMUTATIVE_OPS = frozenset({"Add", "Mul", "Max", "Min", "Sum", "Equal", "And", "Or", "Xor"})


class PatternValue:
    """A value in a pattern. Arithmetic operators build ONNX ops (``x * 0.5`` is ``Mul``)."""

    name: str | None = None

    def __add__(self, other):
        return op.Add(self, other)

    def __radd__(self, other):
        return op.Add(other, self)

    def __sub__(self, other):
        return op.Sub(self, other)

    def __rsub__(self, other):
        return op.Sub(other, self)

    def __mul__(self, other):
        return op.Mul(self, other)

    def __rmul__(self, other):
        return op.Mul(other, self)

    def __truediv__(self, other):
        return op.Div(self, other)

    def __rtruediv__(self, other):
        return op.Div(other, self)

    def __pow__(self, other):
        return op.Pow(self, other)

    def __matmul__(self, other):
        return op.MatMul(self, other)

    def __neg__(self):
        return op.Neg(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self}>"


class Var(PatternValue):
    """A pattern variable: matches any tensor (or, as an attribute, captures its value).

    Every use of the same name must bind the same tensor: in ``x * op.Erf(x)``
    both operands must be one tensor.

        Var("x")                              # any tensor
        Var("bias", check=lambda t: len(t.shape or []) == 1)   # check(gs.Tensor) -> bool
        Var("b", optional=True)               # also matches a missing optional input (binds None)
        op.LayerNormalization(x, s, b, epsilon=Var("eps"))     # captures match.attrs["eps"]
    """

    def __init__(self, name: str, check: Callable[[Any], bool] | None = None, *, optional: bool = False):
        self.name = name
        self.check = check
        self.optional = optional

    def __str__(self) -> str:
        return self.name


class Const(PatternValue):
    """Matches any constant tensor: an initializer or the output of an ONNX ``Constant`` node.

    The bound tensor is not loaded; ``match.value(name)`` loads it. A check, if
    given, receives the numpy value.

        Const()                               # any constant, not bound
        Const.named("w")                      # match["w"], match.value("w")
        Const(lambda v: v.ndim == 1, name="bias")
    """

    def __init__(self, check: Callable[[np.ndarray], bool] | None = None, *, name: str | None = None):
        self.check = check
        self.name = name

    @classmethod
    def named(cls, name: str, check: Callable[[np.ndarray], bool] | None = None) -> Const:
        """A constant bound to ``name`` in the match."""
        return cls(check, name=name)

    def __str__(self) -> str:
        return f"Const({self.name})" if self.name else "Const()"


class Literal(PatternValue):
    """A constant close to a given number (or array). Python numbers in patterns become Literals.

    A scalar literal matches a constant of one element (rank at most ``max_rank``,
    so that broadcasting it cannot change the result's shape) whose value is
    within ``atol + rtol * |value|``; tolerances default to the Pattern's.
    An array literal matches a constant of the same shape, element by element.

        x * 0.5                               # Literal(0.5)
        x * Literal(0.5, rtol=0)              # exact
        op.Transpose(x, perm=[0, 2, 1, 3])    # attribute: exact, not a Literal
        op.Reshape(x, [0, 0, -1])             # array literal
    """

    def __init__(self, value, *, rtol: float | None = None, atol: float | None = None, max_rank: int = 1):
        self.value = np.asarray(value)
        if not np.issubdtype(self.value.dtype, np.number) and self.value.dtype != bool:
            raise TypeError(f"Literal needs a number or a numeric array, got {value!r}")
        self.rtol = rtol
        self.atol = atol
        self.max_rank = max_rank

    @property
    def is_scalar(self) -> bool:
        return self.value.ndim == 0

    def __str__(self) -> str:
        return format_number(self.value)


class Absent(PatternValue):
    """An optional input that must be missing (written as ``None`` in an op call)."""

    def __str__(self) -> str:
        return "None"


ABSENT = Absent()


class OneOf(PatternValue):
    """Alternatives: matches the first alternative that fits (with backtracking).

        OneOf(op.Gelu(x), erf_gelu(x))        # the two exporters' GELU
    """

    def __init__(self, *alternatives):
        if not alternatives:
            raise ValueError("OneOf needs at least one alternative")
        self.alternatives = [to_pattern_value(a) for a in alternatives]

    def __str__(self) -> str:
        return "OneOf(" + " | ".join(str(a) for a in self.alternatives) + ")"


def Maybe(op_call: Callable[..., PatternValue], x, *other_inputs, **kwargs) -> OneOf:
    """An op that may or may not sit on the path: ``Maybe(op.Cast, x)`` is ``OneOf(op.Cast(x), x)``.

    The variant with the op is tried first, so a present Cast is part of the match.
    """
    return OneOf(op_call(x, *other_inputs, **kwargs), x)


class NodeOutput(PatternValue):
    """Output ``index`` of a pattern node."""

    def __init__(self, node: PatternNode, index: int, name: str | None = None):
        self.node = node
        self.index = index
        self.name = name

    def __str__(self) -> str:
        text = str(self.node)
        return f"{text}[{self.index}]" if len(self.node.outputs) > 1 else text


class PatternNode:
    """One op in a pattern. Built by ``op.X(...)``; matched against one graph node."""

    def __init__(
        self,
        op_type: str,
        domain: str,
        inputs: Sequence[PatternValue],
        attrs: dict[str, AttrPattern],
        output_names: Sequence[str | None],
        *,
        name: str | None = None,
        extra_inputs: bool = False,
        external_uses: bool = False,
    ):
        self.op_type = op_type
        self.domain = normalize_domain(domain)
        self.inputs = list(inputs)
        self.attrs = attrs
        self.outputs = [NodeOutput(self, i, n) for i, n in enumerate(output_names)]
        self.name = name
        self.extra_inputs = extra_inputs
        self.external_uses = external_uses

    @property
    def commutative(self) -> bool:
        return self.domain == "" and self.op_type in COMMUTATIVE_OPS

    @property
    def qualified_op(self) -> str:
        return f"{self.domain}.{self.op_type}" if self.domain else self.op_type

    def __str__(self) -> str:
        args = [str(v) for v in self.inputs]
        args += [f"{k}={p}" for k, p in self.attrs.items()]
        return f"{self.qualified_op}({', '.join(args)})"

    def __repr__(self) -> str:
        return f"<PatternNode {self}>"


# ---------------------------------------------------------------- attributes


class AttrPattern:
    """Matches one attribute. ``refusal(value, is_set)`` returns None, or why it does not match.

    ``value`` is the node's attribute, or its schema default (None if unknown) when not set.
    """

    def refusal(self, value, is_set: bool) -> str | None:
        raise NotImplementedError


class AttrEquals(AttrPattern):
    """The attribute equals a value (floats compared to fp32 precision)."""

    def __init__(self, expected):
        self.expected = expected

    def refusal(self, value, is_set: bool) -> str | None:
        return None if attr_values_equal(value, self.expected) else f"!= {self.expected!r}"

    def __str__(self) -> str:
        return repr(self.expected)


class AttrPredicate(AttrPattern):
    """The attribute satisfies a predicate."""

    def __init__(self, predicate: Callable[[Any], bool]):
        self.predicate = predicate

    def refusal(self, value, is_set: bool) -> str | None:
        return None if self.predicate(value) else f"fails predicate {_callable_name(self.predicate)}"

    def __str__(self) -> str:
        return _callable_name(self.predicate)


class AttrUnset(AttrPattern):
    """The attribute must not be set on the node."""

    def refusal(self, value, is_set: bool) -> str | None:
        return "is set; pattern wants it unset" if is_set else None

    def __str__(self) -> str:
        return "unset"


class AttrCapture(AttrPattern):
    """Captures the attribute into ``match.attrs[var.name]`` (the matcher binds it)."""

    def __init__(self, var: Var):
        self.var = var

    def refusal(self, value, is_set: bool) -> str | None:
        if self.var.check is not None and not self.var.check(value):
            return f"fails check of Var {self.var.name!r}"
        return None

    def __str__(self) -> str:
        return self.var.name


def to_attr_pattern(value) -> AttrPattern:
    """Promote what a pattern writes as an attribute to an AttrPattern."""
    if isinstance(value, AttrPattern):
        return value
    if isinstance(value, Var):
        return AttrCapture(value)
    if value is None:
        return AttrUnset()
    if callable(value):
        return AttrPredicate(value)
    return AttrEquals(value)


def attr_values_equal(actual, expected) -> bool:
    """Equality for attribute values: sequences element by element, floats to fp32 precision."""
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return False
        return all(attr_values_equal(a, e) for a, e in zip(actual, expected))
    if isinstance(actual, str) or isinstance(expected, str):
        return actual == expected
    if hasattr(actual, "values"):  # a tensor attribute (gs.Constant)
        return np.array_equal(np.asarray(actual.values), np.asarray(expected))
    if isinstance(actual, float) or isinstance(expected, float):
        return isinstance(actual, (int, float)) and math.isclose(actual, expected, rel_tol=1e-6, abs_tol=1e-30)
    return actual == expected


# ---------------------------------------------------------------- op builder


class OpBuilder:
    """``op.X(*inputs, **attrs)`` creates a pattern node of op type X and returns its output(s).

        op.Erf(x)
        op.Gelu(x, _domain="com.microsoft")
        a, b = op.Split(x, _outputs=2)
        ms = OpBuilder("com.microsoft"); ms.BiasGelu(x, bias)
    """

    def __init__(self, domain: str = ""):
        self._domain = domain

    def __getattr__(self, op_type: str) -> Callable[..., Any]:
        if op_type.startswith("__"):
            raise AttributeError(op_type)

        def build(*inputs, **kwargs):
            return _build_node(op_type, self._domain, inputs, kwargs)

        build.__name__ = op_type
        return build


op = OpBuilder()


def _build_node(op_type: str, default_domain: str, inputs, kwargs):
    domain = kwargs.pop("_domain", default_domain)
    outputs = kwargs.pop("_outputs", 1)
    name = kwargs.pop("_name", None)
    extra_inputs = kwargs.pop("_extra_inputs", False)
    external_uses = kwargs.pop("_external_uses", False)
    attrs = dict(kwargs.pop("_attrs", None) or {})
    unknown = [k for k in kwargs if k.startswith("_")]
    if unknown:
        raise TypeError(f"op.{op_type}: unknown option(s) {unknown}")
    attrs.update(kwargs)
    output_names = [None] * outputs if isinstance(outputs, int) else list(outputs)
    node = PatternNode(
        op_type,
        domain,
        [to_pattern_value(x) for x in inputs],
        {k: to_attr_pattern(v) for k, v in attrs.items()},
        output_names,
        name=name,
        extra_inputs=extra_inputs,
        external_uses=external_uses,
    )
    return node.outputs[0] if len(node.outputs) == 1 else tuple(node.outputs)


def to_pattern_value(x) -> PatternValue:
    """Promote what a pattern writes as an operand: numbers and numeric lists become Literals,
    ``None`` an absent optional input."""
    if isinstance(x, PatternValue):
        return x
    if x is None:
        return ABSENT
    if isinstance(x, (bool, int, float, np.number, np.ndarray, list, tuple)):
        return Literal(x)
    raise TypeError(f"cannot use {x!r} ({type(x).__name__}) as a pattern operand")


# ---------------------------------------------------------------- small shared helpers


def normalize_domain(domain: str | None) -> str:
    """``None``, ``""`` and ``"ai.onnx"`` all name the default ONNX domain."""
    return "" if domain in (None, "", "ai.onnx") else domain


def format_number(value) -> str:
    """Short text for a number or small array, for pattern text and failure reasons."""
    array = np.asarray(value)
    if array.size == 1:
        item = array.reshape(()).item()
        return f"{item:.6g}" if isinstance(item, float) else str(item)
    if array.size <= 8:
        return "[" + ", ".join(format_number(v) for v in array.reshape(-1)) + "]"
    return f"<array shape={list(array.shape)} dtype={array.dtype}>"


def _callable_name(fn) -> str:
    name = getattr(fn, "__name__", None) or repr(fn)
    return "<lambda>" if name == "<lambda>" else name


def reads_only_shape(node: gs.Node, depth: int = 0) -> bool:
    """An ``_external_uses`` predicate: ``node`` is a Shape, or only moves data on towards Shape
    nodes (TorchScript reads sizes for masks that way); such a reader needs no value computed."""
    if node.op == "Shape":
        return True
    if node.op not in LAYOUT_OPS or depth > 4:
        return False
    return all(reads_only_shape(c, depth + 1) for out in node.outputs for c in out.outputs)
