"""Declarative subgraph patterns for fusion passes.

A pattern is a function that builds the subgraph it matches::

    import math
    import onnx_graphsurgeon as gs
    from onnxopt.pattern import Pattern, op, OneOf, replace

    def erf_gelu(x):
        return 0.5 * (x * (op.Erf(x / math.sqrt(2)) + 1.0))

    def gelu_op(x):
        return op.Gelu(x, approximate="none")

    GELU = Pattern(erf_gelu, gelu_op)             # both exporters' forms

    matches = GELU.find(graph, trace=True)
    for m in matches:
        y = gs.Variable(m.output.name + "_fused")
        replace(graph, m, [gs.Node("Gelu", inputs=[m["x"]], outputs=[y])])
    graph.cleanup().toposort()
    print(matches.trace.report())                # why the other candidates did not match

Vocabulary (see ``builder``): function parameters and ``Var("x")`` match any
tensor; Python numbers match constants close to them (``Literal``);
``Const()`` / ``Const.named("w")`` any constant; ``OneOf(a, b)`` either form;
``Maybe(op.Cast, x)`` an op that may be absent; ``None`` an absent optional
input. Attributes: a value (exact), a callable (predicate), ``Var("eps")``
(captured into ``match.attrs``). Add, Mul, Max, Min, Sum, Equal, And, Or and Xor
match in every operand order.

A match is refused when a value computed inside it is used outside it (or is
a graph output), unless its node says ``_external_uses=True`` (or names the
outside readers it allows: ``_external_uses=reads_only_shape``); matches found
by one ``find`` do not share nodes.

Pieces: ``builder`` (op builder and pattern values), ``matcher`` (Pattern,
Match, the search), ``tracer`` (failure records), ``rewrite`` (replace),
``constants`` (reading constant tensors lazily).
"""

from .builder import COMMUTATIVE_OPS, Const, Literal, Maybe, OneOf, OpBuilder, PatternValue, Var, op, reads_only_shape
from .constants import constant_reader, constant_shape, constant_value, is_constant, is_zero_constant
from .matcher import Match, Matches, Pattern
from .rewrite import replace
from .tracer import CandidateTrace, Failure, Tracer

__all__ = [
    "COMMUTATIVE_OPS",
    "CandidateTrace",
    "Const",
    "Failure",
    "Literal",
    "Match",
    "Matches",
    "Maybe",
    "OneOf",
    "OpBuilder",
    "Pattern",
    "PatternValue",
    "Tracer",
    "Var",
    "constant_shape",
    "constant_reader",
    "constant_value",
    "is_constant",
    "is_zero_constant",
    "op",
    "reads_only_shape",
    "replace",
]
