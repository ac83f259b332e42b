"""Matching patterns against a gs graph.

    GELU = Pattern(erf_gelu)                  # or Pattern(erf_gelu, gelu_op): alternatives
    for match in GELU.find(graph):
        match["x"], match.root, match.nodes, match.outputs, match.attrs

How it works. Candidate roots are the graph nodes whose op type is the op of
the pattern's (first) output. From a candidate the matcher walks backward
through producers, pattern node by graph node. It is a backtracking search
written with generators: each step yields every way it can extend the current
bindings, so operand orders of commutative ops, ``OneOf`` alternatives and
``Maybe`` ops are all explored, and a binding conflict found late (the same
``x`` bound to two tensors) undoes an earlier choice instead of failing.

A complete assignment is accepted only after the safety check (no value
computed inside the match escapes it, unless its node says
``_external_uses=True``, or names the outside readers it allows with a predicate)
and the pattern's own ``check``. ``find`` skips
candidates that would overlap an earlier match.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import textwrap
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .builder import (
    Absent,
    AttrCapture,
    Const,
    Literal,
    NodeOutput,
    OneOf,
    PatternNode,
    PatternValue,
    Var,
    attr_values_equal,
    format_number,
    normalize_domain,
)
from onnxopt.graph_edit import is_absent
from onnxopt.weights import BFLOAT16

from .constants import constant_shape, constant_value, is_constant
from .tracer import CandidateTrace, Failure, Tracer

# How close a failed step came (Failure.fit): the tracer reports, among the
# failures that got furthest, the one that fit best.
FIT_RIGHT_OP, FIT_WRONG_OP, FIT_WRONG_KIND = 2, 1, 0

# A check returns None (or True) to accept a match, a reason string (or False) to refuse it.
Check = Callable[["Match"], Union[str, bool, None]]
# Text for a failure record (where, why), or a callable that builds it: called only when tracing.
LazyText = Union[str, Callable[[], str]]


class Pattern:
    """A pattern built from one or more functions (alternatives), ready to be matched.

        def erf_gelu(x):
            return 0.5 * (x * (op.Erf(x / math.sqrt(2)) + 1.0))

        def gelu_op(x):
            return op.Gelu(x)

        GELU = Pattern(erf_gelu, gelu_op)     # either form; parameters with one name share a Var
        GELU = Pattern(erf_gelu, rtol=1e-2)   # looser literal tolerance
        BIAS_GELU = Pattern(bias_gelu, check=lambda m: None if m.value("b").ndim == 1 else "bias not 1-D")

    A function's parameters become ``Var``s named after them, unless a
    parameter's default is a pattern value (``def f(x, w=Const())`` makes ``w``
    a constant bound as ``"w"``). It returns the pattern's output, or a tuple of
    outputs; all outputs after the first must be computed inside the first
    one's subgraph.
    """

    def __init__(
        self,
        *functions: Callable[..., Any] | Sequence[Callable[..., Any]],
        name: str | None = None,
        rtol: float = 1e-3,
        atol: float = 1e-6,
        check: Check | None = None,
    ):
        functions = _flatten(functions)
        if not functions:
            raise ValueError("Pattern needs at least one function")
        self.name = name or "|".join(getattr(f, "__name__", "pattern") for f in functions)
        self.rtol = rtol
        self.atol = atol
        self.check = check
        self.outputs: list[PatternValue] = _build_outputs(functions)
        self.root_ops = _root_ops(self.outputs[0])
        self.output_values = _output_values(self.outputs)  # ids of the NodeOutputs that are outputs
        self.use_counts = _use_counts(self.outputs)  # id(NodeOutput) -> inputs of pattern nodes it feeds
        self._orders: dict[tuple[int, int], list[list[tuple[int, int]]]] = {}
        self._outlines: dict[int, str] = {}  # width -> outline()

    def __str__(self) -> str:
        return ", ".join(str(v) for v in self.outputs)

    def __repr__(self) -> str:
        return f"<Pattern {self.name}: {self}>"

    def outline(self, width: int = 96) -> str:
        """The pattern one node a line, each written once (``str`` spells a shared node out at
        every use, which grows with the pattern's depth: the attention pattern ran to 136,611
        characters): ``%3 = MatMul(%2, w)``, the outputs last; lines wrapped at ``width``."""
        if width not in self._outlines:
            self._outlines[width] = "\n".join(
                textwrap.fill(line, width, subsequent_indent="      ", break_long_words=False, break_on_hyphens=False)
                for line in _outline_lines(self.outputs))
        return self._outlines[width]

    def find(self, graph: gs.Graph, *, trace: bool | Tracer = False, overlap: bool = False) -> Matches:
        """All matches in ``graph``, in graph order.

        ``trace=True`` (or a ``Tracer``) records why each candidate failed in
        ``matches.trace``. Matches do not share nodes unless ``overlap=True``:
        a candidate that would reuse a node of an earlier match is skipped (it
        may still match in another way that avoids those nodes).
        """
        tracer = Tracer() if trace is True else (trace or None)
        if tracer is not None:
            tracer.note_pattern(self.name, self.outline(), self._root_op_text())
        search = _Search(self, graph, tracer)
        claimed: set[int] | None = None if overlap else set()
        matches = Matches(trace=tracer)
        for node in graph.nodes:
            if node.op not in self.root_ops:
                continue
            matches.candidates += 1
            match = search.match_at(node, claimed)
            if match is not None:
                matches.append(match)
                if claimed is not None:
                    claimed.update(id(n) for n in match.nodes)
        return matches

    def match(self, graph: gs.Graph, node: gs.Node, *, trace: Tracer | None = None) -> Match | None:
        """The match rooted at ``node`` of ``graph``, or None (overlap with other matches is not checked)."""
        if trace is not None:
            trace.note_pattern(self.name, self.outline(), self._root_op_text())
        if node.op not in self.root_ops:
            return None
        return _Search(self, graph, trace).match_at(node, claimed=None)

    def _root_op_text(self) -> str:
        return "|".join(sorted(self.root_ops))

    def operand_orders(self, pnode: PatternNode, n_graph_inputs: int) -> list[list[tuple[int, int]]]:
        """(pattern operand, graph input) pairs for each operand order to try, cached per node."""
        key = (id(pnode), n_graph_inputs)
        orders = self._orders.get(key)
        if orders is None:
            orders = self._orders[key] = _operand_orders(pnode, n_graph_inputs)
        return orders


class Match:
    """One occurrence of a pattern in a graph: what a rewrite needs.

        match["x"]            # gs.Tensor bound to variable (or named Const / named output) x
        match.value("w")      # numpy value of a bound constant (loads it)
        match.attrs["eps"]    # attribute captured by Var("eps")
        match.nodes           # matched gs.Nodes, topologically ordered (Constant nodes excluded)
        match.root            # node producing the (first) output
        match.outputs         # gs tensors produced by the pattern's outputs; match.output if one
        match.node("gelu")    # graph node matched by the pattern node named with _name="gelu"
    """

    def __init__(self, pattern: Pattern, bindings: dict, attrs: dict, nodes: list, outputs: list, named_nodes: dict):
        self.pattern = pattern
        self.root: gs.Node = outputs[0].inputs[0]
        self.bindings: dict[str, gs.Tensor | None] = bindings
        self.attrs: dict[str, Any] = attrs
        self.nodes: list[gs.Node] = nodes
        self.outputs: list[gs.Tensor] = outputs
        self._named_nodes = named_nodes

    def __getitem__(self, name: str) -> gs.Tensor | None:
        try:
            return self.bindings[name]
        except KeyError:
            raise KeyError(f"{name!r} is not bound by pattern {self.pattern.name}; bound: {sorted(self.bindings)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.bindings

    def get(self, name: str, default=None):
        return self.bindings.get(name, default)

    def value(self, name: str) -> np.ndarray:
        """The numpy value of the constant bound to ``name`` (raises if it is not a constant)."""
        tensor = self[name]
        value = constant_value(tensor) if tensor is not None else None
        if value is None:
            raise ValueError(f"{name!r} is bound to {_name(tensor)}, which is not a constant")
        return value

    def node(self, name: str) -> gs.Node:
        """The graph node matched by the pattern node named ``name`` (``op.X(..., _name=name)``)."""
        return self._named_nodes[name]

    def has_node(self, name: str) -> bool:
        """Whether the pattern node named ``name`` is part of the match (alternatives may skip it)."""
        return name in self._named_nodes

    @property
    def output(self) -> gs.Tensor:
        if len(self.outputs) != 1:
            raise ValueError(f"pattern {self.pattern.name} has {len(self.outputs)} outputs; use .outputs")
        return self.outputs[0]

    def __repr__(self) -> str:
        names = ", ".join(f"{k}={v.name if v is not None else None}" for k, v in self.bindings.items())
        return f"<Match {self.pattern.name} at {self.root.op} '{self.root.name}': {names}>"


class Matches(list):
    """The list ``Pattern.find`` returns; ``.trace`` is its Tracer (or None), ``.candidates`` a count."""

    def __init__(self, trace: Tracer | None = None):
        super().__init__()
        self.trace = trace
        self.candidates = 0


# ---------------------------------------------------------------- building a pattern


def _flatten(functions) -> list:
    flat = []
    for f in functions:
        flat.extend(f if isinstance(f, (list, tuple)) else [f])
    return flat


def _build_outputs(functions) -> list[PatternValue]:
    """Call each function with its Vars; alternatives become a OneOf per output."""
    shared_vars: dict[str, PatternValue] = {}
    results = []
    for fn in functions:
        out = fn(*_parameters(fn, shared_vars))
        results.append(list(out) if isinstance(out, (tuple, list)) else [out])
    arity = {len(r) for r in results}
    if len(arity) != 1:
        raise ValueError(f"alternative functions return different numbers of outputs: {sorted(arity)}")
    if len(results) == 1:
        return results[0]
    return [OneOf(*alternatives) for alternatives in zip(*results)]


def _parameters(fn, shared_vars: dict[str, PatternValue]) -> list[PatternValue]:
    values = []
    for param in inspect.signature(fn).parameters.values():
        if isinstance(param.default, PatternValue):
            values.append(_named_default(param.name, param.default))
        else:
            values.append(shared_vars.setdefault(param.name, Var(param.name)))
    return values


def _named_default(name: str, value: PatternValue) -> PatternValue:
    if isinstance(value, Const) and value.name is None:
        return Const(value.check, name=name)
    return value


def _output_values(outputs: list[PatternValue]) -> set[int]:
    """Ids of the pattern values that are (alternatives of) the pattern's outputs."""
    ids: set[int] = set()

    def visit(value):
        ids.add(id(value))
        for alternative in getattr(value, "alternatives", ()):
            visit(alternative)

    for output in outputs:
        visit(output)
    return ids


def _use_counts(outputs: list[PatternValue]) -> dict[int, int]:
    """For each NodeOutput (by id), how many pattern node inputs it feeds, across all alternatives."""
    counts: dict[int, int] = {}
    seen: set[int] = set()

    def count_use(value):
        for alternative in getattr(value, "alternatives", (value,)):
            counts[id(alternative)] = counts.get(id(alternative), 0) + 1

    def visit(value):
        if isinstance(value, OneOf):
            for alternative in value.alternatives:
                visit(alternative)
        elif isinstance(value, NodeOutput) and id(value.node) not in seen:
            seen.add(id(value.node))
            for operand in value.node.inputs:
                count_use(operand)
                visit(operand)

    for output in outputs:
        visit(output)
    return counts


def _root_ops(value: PatternValue) -> set[str]:
    """Op types a candidate root may have; the output must be computed by an op."""
    if isinstance(value, NodeOutput):
        return {value.node.op_type}
    if isinstance(value, OneOf):
        return set().union(*(_root_ops(a) for a in value.alternatives))
    raise ValueError(f"a pattern's output must be computed by an op, not {value}")


# ---------------------------------------------------------------- the search


class _State:
    """Bindings made so far. Immutable: binding returns a new state, so backtracking is free."""

    __slots__ = ("values", "attrs", "nodes")

    def __init__(self, values=None, attrs=None, nodes=None):
        self.values: dict[str, gs.Tensor | None] = values or {}
        self.attrs: dict[str, Any] = attrs or {}
        self.nodes: dict[int, tuple[PatternNode, gs.Node, _Operand]] = nodes or {}

    def bind_value(self, name: str, tensor) -> _State:
        return _State({**self.values, name: tensor}, self.attrs, self.nodes)

    def bind_attr(self, name: str, value) -> _State:
        return _State(self.values, {**self.attrs, name: value}, self.nodes)

    def bind_node(self, pnode: PatternNode, gnode: gs.Node, operand: _Operand) -> _State:
        return _State(self.values, self.attrs, {**self.nodes, id(pnode): (pnode, gnode, operand)})


class _Operand:
    """One pattern operand to match against one graph tensor, and where it sits: input ``index``
    of pattern node ``consumer`` (matched to ``graph_node``), reached through ``parent``."""

    __slots__ = ("value", "tensor", "consumer", "index", "graph_node", "parent")

    def __init__(self, value, tensor, consumer: PatternNode | None = None, index: int = 0, graph_node=None, parent=None):
        self.value: PatternValue = value
        self.tensor = tensor
        self.consumer = consumer
        self.index = index
        self.graph_node: gs.Node | None = graph_node
        self.parent: _Operand | None = parent

    def alternative(self, value: PatternValue) -> _Operand:
        return _Operand(value, self.tensor, self.consumer, self.index, self.graph_node, self.parent)

    def path(self) -> str:
        """Where this operand sits in the pattern, from the output: ``Mul.in1 > Add.in0``."""
        steps, operand = [], self
        while operand is not None and operand.consumer is not None:
            steps.append(f"{operand.consumer.qualified_op}.in{operand.index}")
            operand = operand.parent
        return " > ".join(reversed(steps))


# Operands that lead to subgraphs are matched first, larger subgraphs before
# smaller ones: they fail on the op type at once when the operand order is
# wrong, and when the order is right the failure that follows (say, a
# constant 0.6 for 0.5) comes after the most progress, which is the failure
# the tracer reports.
_OPERAND_PRIORITY = {NodeOutput: 0, OneOf: 0, Var: 1, Const: 2, Literal: 2, Absent: 2}


class _Search:
    """Matching state for one ``find`` on one graph."""

    def __init__(self, pattern: Pattern, graph: gs.Graph | None, tracer: Tracer | None):
        self.pattern = pattern
        self.tracer = tracer
        self.graph_outputs = {id(t) for t in graph.outputs} if graph is not None else set()
        self.claimed: set[int] | None = None
        self.trace: CandidateTrace | None = None
        self.dependent_failures = 0  # a counter: see _operands

    # -- entry point

    def match_at(self, root: gs.Node, claimed: set[int] | None) -> Match | None:
        self.claimed = claimed
        if self.tracer is not None:
            self.trace = self.tracer.begin(
                self.pattern.name, self.pattern.outline(), self.pattern._root_op_text(), root.name, root.op
            )
        match = next(self._solutions(root), None)
        if self.trace is not None:
            self.trace.matched = match is not None
        return match

    def _solutions(self, root: gs.Node) -> Iterator[Match]:
        if _is_claimed(root, self.claimed):
            self._fail("output", root, "already belongs to an earlier match", 0)
            return
        for tensor in _distinct(root.outputs):
            root_operand = _Operand(self.pattern.outputs[0], tensor)
            for state in self._value(root_operand, _State()):
                match = self._accept(state)
                if match is not None:
                    yield match

    # -- values

    def _value(self, operand: _Operand, state: _State) -> Iterator[_State]:
        value = operand.value
        if isinstance(value, NodeOutput):
            return self._node_output(operand, state)
        if isinstance(value, Var):
            return self._var(operand, state)
        if isinstance(value, Literal):
            return self._literal(operand, state)
        if isinstance(value, Const):
            return self._const(operand, state)
        if isinstance(value, OneOf):
            return self._one_of(operand, state)
        if isinstance(value, Absent):
            return self._absent(operand, state)
        raise TypeError(f"unknown pattern value {value!r}")

    def _var(self, operand: _Operand, state: _State) -> Iterator[_State]:
        var, tensor = operand.value, operand.tensor
        if is_absent(tensor) and not var.optional:
            return self._fail_operand(operand, state, f"input is missing; Var {var.name} needs a tensor", fit=FIT_WRONG_KIND)
        tensor = None if is_absent(tensor) else tensor
        if var.name in state.values:
            bound = state.values[var.name]
            if bound is not tensor:
                return self._fail_operand(
                    operand, state, f"{var.name} bound to two different tensors: {_name(bound)} vs {_name(tensor)}", dependent=True
                )
            return iter((state,))
        if var.check is not None and tensor is not None and not var.check(tensor):
            return self._fail_operand(operand, state, f"tensor {_name(tensor)} fails the check of Var {var.name}")
        return iter((state.bind_value(var.name, tensor),))

    def _const(self, operand: _Operand, state: _State) -> Iterator[_State]:
        const, tensor = operand.value, operand.tensor
        if not is_constant(tensor):
            return self._fail_operand(
                operand, state, lambda: f"{_describe(tensor)} is not a constant; pattern wants {const}", fit=FIT_WRONG_KIND
            )
        if const.name is not None and const.name in state.values and state.values[const.name] is not tensor:
            return self._fail_operand(
                operand, state, f"{const.name} bound to two different tensors: {_name(state.values[const.name])} vs {_name(tensor)}",
                dependent=True,
            )
        if const.check is not None and not const.check(constant_value(tensor)):
            return self._fail_operand(operand, state, f"constant {_name(tensor)} fails the check of {const}")
        return iter((state.bind_value(const.name, tensor) if const.name else state,))

    def _literal(self, operand: _Operand, state: _State) -> Iterator[_State]:
        literal, tensor = operand.value, operand.tensor
        if not is_constant(tensor):
            return self._fail_operand(
                operand, state, lambda: f"{_describe(tensor)} is not a constant; pattern wants {literal}", fit=FIT_WRONG_KIND
            )
        reason = self._literal_refusal(literal, tensor)
        if reason is not None:
            return self._fail_operand(operand, state, reason)
        return iter((state,))

    def _literal_refusal(self, literal: Literal, tensor) -> str | None:
        """Why the constant ``tensor`` is not close to ``literal`` (None if it is)."""
        shape = constant_shape(tensor)
        if literal.is_scalar:
            if int(np.prod(shape)) != 1 or len(shape) > literal.max_rank:
                return f"constant {_name(tensor)} has shape {list(shape)}; pattern wants the scalar {literal}"
        elif tuple(shape) != literal.value.shape:
            return f"constant {_name(tensor)} has shape {list(shape)}; pattern wants {list(literal.value.shape)}"
        actual = constant_value(tensor)
        if actual.dtype == BFLOAT16:
            if _rounds_to(actual, literal.value):
                return None
            actual = actual.astype(np.float32)
        if not np.issubdtype(actual.dtype, np.number) and actual.dtype != bool:
            return f"constant {_name(tensor)} has dtype {actual.dtype}; pattern wants {literal}"
        rtol = self.pattern.rtol if literal.rtol is None else literal.rtol
        atol = self.pattern.atol if literal.atol is None else literal.atol
        if not _all_close(actual, literal.value, rtol, atol) and not (actual.dtype == np.float16 and _rounds_to(actual, literal.value)):
            return f"constant {_name(tensor)} is {format_number(actual)}, expected {literal} (rtol {rtol:g})"
        return None

    def _absent(self, operand: _Operand, state: _State) -> Iterator[_State]:
        if not is_absent(operand.tensor):
            return self._fail_operand(operand, state, f"input is {_name(operand.tensor)}; pattern wants it absent", fit=FIT_WRONG_KIND)
        return iter((state,))

    def _one_of(self, operand: _Operand, state: _State) -> Iterator[_State]:
        for alternative in operand.value.alternatives:
            yield from self._value(operand.alternative(alternative), state)

    def _node_output(self, operand: _Operand, state: _State) -> Iterator[_State]:
        out, tensor = operand.value, operand.tensor
        pnode = out.node
        if is_absent(tensor):
            return self._fail_operand(
                operand, state, f"input is missing; pattern wants the output of {pnode.qualified_op}", fit=FIT_WRONG_KIND
            )
        if not isinstance(tensor, gs.Variable) or not tensor.inputs:
            return self._fail_operand(
                operand, state, lambda: f"{_describe(tensor)}; pattern wants the output of {pnode.qualified_op}", fit=FIT_WRONG_KIND
            )
        reason = self._early_escape(operand)
        if reason is not None:
            return self._fail_node(operand, tensor.inputs[0], state, reason)
        return self._node(operand, tensor.inputs[0], state)

    def _early_escape(self, operand: _Operand) -> str | None:
        """The escape check, done as soon as it can be decided, so a doomed branch is cut early.

        An intermediate that is a graph output escapes. One that a single pattern
        input uses escapes if any graph node other than the consumer at hand uses it.
        (Everything else is checked on the complete match.)
        """
        out, tensor = operand.value, operand.tensor
        if out.node.external_uses is True or id(out) in self.pattern.output_values:
            return None
        if self.pattern.use_counts.get(id(out), 0) == 1:
            return self._escape_reason(tensor, {id(operand.graph_node)}, out.node.external_uses)
        if id(tensor) in self.graph_outputs:
            return f"intermediate {_name(tensor)} is a graph output"
        return None

    # -- nodes

    def _node(self, operand: _Operand, gnode: gs.Node, state: _State) -> Iterator[_State]:
        """Match the producer ``gnode`` of the operand's tensor against the operand's pattern node."""
        pnode = operand.value.node
        already = state.nodes.get(id(pnode))
        if already is not None:
            if already[1] is not gnode:
                return self._fail_node(operand, gnode, state, f"this pattern node is already matched to '{already[1].name}'", dependent=True)
            return iter((state,))
        if gnode.op != pnode.op_type:  # the usual failure: checked first, cheaply
            return self._fail_node(operand, gnode, state, lambda: f"op type is {gnode.op}, expected {pnode.op_type}", fit=FIT_WRONG_OP)
        n_inputs = len(_present_inputs(gnode))
        reason = self._node_refusal(pnode, gnode, operand.value.index, operand.tensor, n_inputs)
        if reason is not None:
            return self._fail_node(operand, gnode, state, reason)
        state = self._bind_attrs(operand, gnode, state)
        if state is not None:
            state = self._bind_named_outputs(operand, gnode, state)
        if state is None:
            return iter(())
        return self._operand_choices(operand, gnode, n_inputs, state.bind_node(pnode, gnode, operand))

    def _bind_named_outputs(self, operand: _Operand, gnode: gs.Node, state: _State) -> _State | None:
        """Bind the outputs named with ``_outputs=[...]`` to the graph node's output tensors."""
        for out in operand.value.node.outputs:
            if out.name is None:
                continue
            tensor = gnode.outputs[out.index]
            bound = state.values.get(out.name, tensor)
            if bound is not tensor:
                self._fail_node(operand, gnode, state, f"{out.name} bound to two different tensors: {_name(bound)} vs {_name(tensor)}", dependent=True)
                return None
            state = state.bind_value(out.name, tensor)
        return state

    def _node_refusal(self, pnode: PatternNode, gnode: gs.Node, out_index: int, tensor, n_inputs: int) -> str | None:
        if normalize_domain(gnode.domain) != pnode.domain:
            return f"domain is {normalize_domain(gnode.domain)!r}, expected {pnode.domain!r}"
        if _is_claimed(gnode, self.claimed):
            return "already belongs to an earlier match"
        actual_index = _index_of(gnode.outputs, tensor)
        if actual_index != out_index:
            return f"{_name(tensor)} is output {actual_index} of the node; pattern wants output {out_index}"
        if len(gnode.outputs) < len(pnode.outputs):
            return f"has {len(gnode.outputs)} outputs; pattern wants {len(pnode.outputs)}"
        if n_inputs > len(pnode.inputs) and not pnode.extra_inputs:
            return f"has {n_inputs} inputs; pattern wants {len(pnode.inputs)}"
        return None

    def _bind_attrs(self, operand: _Operand, gnode: gs.Node, state: _State) -> _State | None:
        pnode = operand.value.node
        for name, attr_pattern in pnode.attrs.items():
            is_set = name in gnode.attrs
            value = gnode.attrs[name] if is_set else schema_default(gnode.op, gnode.domain, name)
            reason = attr_pattern.refusal(value, is_set)
            if reason is not None:
                self._fail_node(operand, gnode, state, f"attribute {name}={_show(value)} {reason}")
                return None
            if isinstance(attr_pattern, AttrCapture):
                state = self._capture_attr(operand, gnode, state, attr_pattern.var.name, name, value)
                if state is None:
                    return None
        return state

    def _capture_attr(self, operand: _Operand, gnode: gs.Node, state: _State, var_name: str, attr_name: str, value) -> _State | None:
        if var_name in state.attrs and not attr_values_equal(state.attrs[var_name], value):
            self._fail_node(
                operand, gnode, state,
                f"attribute {attr_name}={_show(value)}, but {var_name} already captured {_show(state.attrs[var_name])}",
                dependent=True,
            )
            return None
        return state.bind_attr(var_name, value)

    def _operand_choices(self, parent: _Operand, gnode: gs.Node, n_inputs: int, state: _State) -> Iterator[_State]:
        """Every operand order (one unless the op is commutative), matched in priority order."""
        pnode = parent.value.node
        inputs = gnode.inputs
        for order in self.pattern.operand_orders(pnode, n_inputs):
            operands = [
                _Operand(pnode.inputs[p], inputs[g] if g < len(inputs) else None, pnode, p, gnode, parent)
                for p, g in order
            ]
            yield from self._operands(operands, state)

    def _operands(self, operands: list[_Operand], state: _State) -> Iterator[_State]:
        """Match operands left to right, backtracking over each one's ways to match.

        When the rest fails without any binding conflict, its failure does not
        depend on how ``first`` matched, so ``first``'s other ways are not tried:
        this keeps a refused candidate from enumerating every operand order of
        every commutative op before it.
        """
        if not operands:
            yield state
            return
        first, rest = operands[0], operands[1:]
        for extended in self._value(first, state):
            conflicts_before = self.dependent_failures
            produced = False
            for complete in self._operands(rest, extended):
                produced = True
                yield complete
            if not produced and self.dependent_failures == conflicts_before:
                return

    # -- accepting a complete assignment

    def _accept(self, state: _State) -> Match | None:
        outputs = [self._resolve_output(v, state) for v in self.pattern.outputs]
        if any(t is None for t in outputs):
            missing = [k for k, t in enumerate(outputs) if t is None]
            self._fail("output", None, f"outputs {missing} are not computed by the matched nodes", len(state.nodes), dependent=True)
            return None
        reason = self._escape_refusal(state, outputs)
        if reason is not None:
            return None
        match = _make_match(self.pattern, state, outputs)
        if self.pattern.check is not None:
            verdict = self.pattern.check(match)
            if verdict is not None and verdict is not True:
                text = verdict if isinstance(verdict, str) else "refused by the pattern's check"
                self._fail("check", match.root, text, len(state.nodes), dependent=True)
                return None
        return match

    def _resolve_output(self, value: PatternValue, state: _State):
        if isinstance(value, NodeOutput):
            bound = state.nodes.get(id(value.node))
            return bound[1].outputs[value.index] if bound is not None else None
        if isinstance(value, OneOf):
            resolved = (self._resolve_output(a, state) for a in value.alternatives)
            return next((t for t in resolved if t is not None), None)
        return state.values.get(value.name) if isinstance(value, (Var, Const)) else None

    def _escape_refusal(self, state: _State, outputs: list) -> str | None:
        """Refuse if a value computed inside the match (other than an output) is used outside it."""
        matched = {id(g) for _, g, _ in state.nodes.values()}
        output_ids = {id(t) for t in outputs}
        for pnode, gnode, operand in state.nodes.values():
            if pnode.external_uses is True:
                continue
            for tensor in gnode.outputs:
                if id(tensor) in output_ids:
                    continue
                reason = self._escape_reason(tensor, matched, pnode.external_uses)
                if reason is not None:
                    self._fail_node(operand, gnode, state, reason, dependent=True)
                    return reason
        return None

    def _escape_reason(self, tensor, matched: set[int], allowed=False) -> str | None:
        """Why ``tensor`` escapes the match; ``allowed(consumer)`` (a node's ``_external_uses``
        predicate) names the outside readers that do not count (e.g. "reads only its shape")."""
        if id(tensor) in self.graph_outputs:
            return f"intermediate {_name(tensor)} is a graph output"
        outside = [c for c in tensor.outputs if id(c) not in matched and not (callable(allowed) and allowed(c))]
        if outside:
            names = ", ".join(f"'{c.name}'" for c in outside[:4])
            return f"intermediate {_name(tensor)} has {len(outside)} consumer(s) outside the match: {names}"
        return None

    # -- tracing

    def _fail(
        self, where: LazyText, gnode: gs.Node | None, reason: LazyText, progress: int, dependent: bool = False, fit: int = FIT_RIGHT_OP
    ) -> Iterator[_State]:
        """Record a failure (when tracing); ``where`` and ``reason`` may be callables, called only then.

        ``dependent`` marks failures that depend on earlier bindings (conflicts); see ``_operands``.
        """
        if dependent:
            self.dependent_failures += 1
        if self.trace is not None:
            where, text = (where() if callable(where) else where), (reason() if callable(reason) else reason)
            self.trace.failures.append(Failure(where, gnode.name if gnode is not None else None, text, progress, fit))
        return iter(())

    def _fail_node(
        self, operand: _Operand, gnode: gs.Node, state: _State, reason: LazyText, dependent: bool = False, fit: int = FIT_RIGHT_OP
    ) -> Iterator[_State]:
        """A failure on the graph node matched against the operand's pattern node."""

        def where() -> str:
            path, op_type = operand.path(), operand.value.node.qualified_op
            return f"{path} > {op_type}" if path else op_type

        return self._fail(where, gnode, reason, len(state.nodes), dependent, fit)

    def _fail_operand(
        self, operand: _Operand, state: _State, reason: LazyText, dependent: bool = False, fit: int = FIT_RIGHT_OP
    ) -> Iterator[_State]:
        """A failure on an operand: the graph tensor at that input does not fit the pattern value."""
        return self._fail(lambda: operand.path() or "output", operand.graph_node, reason, len(state.nodes), dependent, fit)


def _make_match(pattern: Pattern, state: _State, outputs: list) -> Match:
    nodes = _topological([g for _, g, _ in state.nodes.values()])
    named = {p.name: g for p, g, _ in state.nodes.values() if p.name is not None}
    return Match(pattern, dict(state.values), dict(state.attrs), nodes, outputs, named)


# ---------------------------------------------------------------- small helpers


def _is_claimed(node: gs.Node, claimed: set[int] | None) -> bool:
    return claimed is not None and id(node) in claimed


def _operand_orders(pnode: PatternNode, n_graph_inputs: int) -> list[list[tuple[int, int]]]:
    """Pairs (pattern operand, graph input) per order; all distinct permutations for commutative ops.

    Within an order, operands that lead to subgraphs come first (see _OPERAND_PRIORITY).
    """
    n = len(pnode.inputs)
    if not pnode.commutative or n < 2 or n_graph_inputs != n:
        perms = [tuple(range(n))]
    else:
        perms, seen = [], set()
        for perm in itertools.permutations(range(n)):
            key = tuple(id(pnode.inputs[p]) for p in perm)  # x * x needs one order, not two
            if key not in seen:
                seen.add(key)
                perms.append(perm)
    priority = [(_OPERAND_PRIORITY[type(v)], -_pattern_size(v)) for v in pnode.inputs]
    return [sorted(((p, g) for g, p in enumerate(perm)), key=lambda pair: priority[pair[0]]) for perm in perms]


def _pattern_size(value: PatternValue) -> int:
    """Number of distinct pattern nodes a value depends on (alternatives: the largest)."""
    seen: set[int] = set()

    def visit(v) -> int:
        if isinstance(v, OneOf):
            return max(visit(a) for a in v.alternatives)
        if not isinstance(v, NodeOutput) or id(v.node) in seen:
            return 0
        seen.add(id(v.node))
        return 1 + sum(visit(i) for i in v.node.inputs)

    return visit(value)


def _rounds_to(actual: np.ndarray, expected: np.ndarray) -> bool:
    """A float16/bfloat16 constant is the literal as written in its type: the exporter rounded
    sqrt(2/pi) to 0.796875 in a bfloat16 model, further than any tolerance meant for float32."""
    return bool(np.array_equal(actual.astype(np.float32), np.broadcast_to(expected, actual.shape).astype(actual.dtype).astype(np.float32)))


def _all_close(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float) -> bool:
    """|actual - expected| <= atol + rtol * |expected|, element by element (tolerance relative to the pattern)."""
    if expected.ndim == 0:  # the common case, without numpy's per-call overhead
        e = float(expected)
        return abs(float(actual.reshape(-1)[0]) - e) <= atol + rtol * abs(e)
    expected = expected.astype(np.float64)
    return bool(np.all(np.abs(actual.astype(np.float64) - expected) <= atol + rtol * np.abs(expected)))


def _present_inputs(node: gs.Node) -> list:
    """The node's inputs without trailing missing optional ones."""
    inputs = list(node.inputs)
    while inputs and is_absent(inputs[-1]):
        inputs.pop()
    return inputs


def _distinct(tensors) -> list:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _index_of(items, item) -> int | None:
    return next((i for i, x in enumerate(items) if x is item), None)


def _topological(nodes: list[gs.Node]) -> list[gs.Node]:
    """The matched nodes, producers before consumers (the set is small; graph order is not trusted)."""
    members = {id(n): n for n in nodes}
    ordered, done = [], set()

    def visit(node):
        if id(node) in done:
            return
        done.add(id(node))
        for tensor in node.inputs:
            for producer in getattr(tensor, "inputs", ()):
                if id(producer) in members:
                    visit(producer)
        ordered.append(node)

    for node in members.values():
        visit(node)
    return ordered


@functools.lru_cache(maxsize=None)
def schema_default(op_type: str, domain: str | None, attr_name: str):
    """The ONNX schema default of an attribute (None if unknown or required)."""
    try:
        schema = onnx.defs.get_schema(op_type, domain=normalize_domain(domain))
    except Exception:  # contrib ops (com.microsoft) have no schema in the onnx package
        return None
    attr = schema.attributes.get(attr_name)
    if attr is None or not attr.default_value.type:
        return None
    value = onnx.helper.get_attribute_value(attr.default_value)
    return value.decode() if isinstance(value, bytes) else value


def _name(tensor) -> str:
    return "<missing>" if tensor is None else f"'{tensor.name}'"


def _describe(tensor) -> str:
    """What a tensor is, in a few words, for failure reasons."""
    if is_absent(tensor):
        return "the input is missing"
    if isinstance(tensor, gs.Constant):
        return f"{_name(tensor)} is an initializer"
    if is_constant(tensor):
        return f"{_name(tensor)} is a Constant node's output"
    if not tensor.inputs:
        return f"{_name(tensor)} is a graph input"
    producer = tensor.inputs[0]
    return f"{_name(tensor)} is the output of {producer.op} '{producer.name}'"


def _show(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, gs.Constant):
        return f"<tensor {list(value.shape)}>"
    return repr(value)


def _outline_lines(outputs) -> list[str]:
    """``%k = Op(args)`` for each pattern node, inputs before their readers, then ``output: %k``."""
    names: dict[int, str] = {}
    lines: list[str] = []

    def ref(value) -> str:
        if isinstance(value, NodeOutput):
            name = node_name(value.node)
            return f"{name}[{value.index}]" if len(value.node.outputs) > 1 else name
        if isinstance(value, OneOf):
            return "OneOf(" + " | ".join(ref(a) for a in value.alternatives) + ")"
        return str(value)

    def node_name(node) -> str:
        if id(node) not in names:
            args = [ref(v) for v in node.inputs] + [f"{k}={p}" for k, p in node.attrs.items()]
            names[id(node)] = f"%{len(names) + 1}"
            lines.append(f"{names[id(node)]} = {node.qualified_op}({', '.join(args)})")
        return names[id(node)]

    results = [ref(v) for v in outputs]
    lines.append(("outputs: " if len(results) > 1 else "output: ") + ", ".join(results))
    return lines
