"""How a fusion is written: rules (pattern, check, emit) and the one loop that applies them.

A fusion module declares what it matches and what it writes; :class:`Fusion` does the rest::

    def check(match, run) -> Site          # the facts the rewrite needs; ``raise Refusal("why")`` otherwise
    def emit(make, site) -> [tensors]      # the replacement, written the way the pattern reads:
        y = make.ms.BiasAdd(site.p, site.bias, site.skip)       #   make.op.X / make.ms.X (com.microsoft)
        return [y]                                              #   one tensor per match output

    @register_pass
    class FuseBiasAdd(Fusion):
        name = "fuse-bias-add"; description = "..."
        rules = (Rule(LINEAR_RESIDUAL, check, emit),)

The loop (:meth:`Fusion.run`), for each rule in order:

* find the pattern's matches (on a ``Tracer`` when one is given: ``--explain``),
* count each site once, also when an earlier rule already saw its site node (``Rule.site``),
* call ``check``: a :class:`Refusal` is recorded in the result (report) and in the tracer; a
  refusal that says ``not_a_site`` is not counted (the match is an ordinary node another pass owns),
* ``emit`` the replacement through :class:`Emit` (nodes named after the site node by the pass's
  one :class:`NameAuthority`, domains set, dtype and shape annotated) and splice it in with
  :func:`onnxopt.pattern.replace`,
* clean up after a rule that rewrote (dead matched nodes still count as consumers until then), and
  toposort once at the end; ``modified`` is "rewrote a site".

With a ``tracer`` (``--explain``: the pass manager passes one in) every candidate is recorded:
where its pattern failed, or which condition refused it. When a fusion the user named matches no site, the pass manager asks
:meth:`Fusion.trace` for the near misses (the candidates that got furthest) and reports them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import numpy as np
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from onnxopt.domains import MS_DOMAIN
from onnxopt.layout import permuted
from onnxopt.model import Model
from onnxopt.pass_infra import Pass, PassResult
from onnxopt.pattern import Match, Pattern, Tracer, replace


class Refusal(Exception):
    """A site fits a pattern but must not be rewritten; the message says why.

    ``not_a_site``: the match is not one of this pass's sites at all (an Add pair that feeds a
    LayerNorm is fuse-skip-layer-norm's): it is neither counted nor reported, only traced.
    """

    def __init__(self, reason: str, *, not_a_site: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.not_a_site = not_a_site


# ---------------------------------------------------------------- names and the emit builder


class NameAuthority:
    """Fresh node and tensor names, unique in the graph (collected once per pass run)."""

    def __init__(self, graph: gs.Graph):
        self.taken = set(graph.tensors().keys()) | {n.name for n in graph.nodes}

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name


# Ops whose output has the shape of their first input (the default annotation the builder writes).
SAME_SHAPE_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Sigmoid", "Cast", "Identity", "Relu", "Gelu", "Erf",
    "GroupNorm", "SkipGroupNorm", "BiasAdd", "LayerNormalization", "SkipLayerNormalization",
    "GroupNormalization", "InstanceNormalization", "Softmax",
})


class _OpWriter:
    """``make.op.Transpose(x, perm=[...])``: one node of the writer's domain per call.

    Options (the rest are attributes): ``_dtype`` / ``_shape`` annotate the outputs where they are
    not the first input's; ``_outputs`` is a count of new tensors or the existing tensors the node
    computes; ``_label`` names the node ``{prefix}/{label}`` instead of ``{prefix}/{Op}``; ``_name``
    is a fixed node name. An input ``None`` is an optional input left out (trailing ones dropped).
    """

    def __init__(self, make: "Emit", domain: str | None):
        self._make, self._domain = make, domain

    def __getattr__(self, op_type: str):
        if op_type.startswith("_"):
            raise AttributeError(op_type)

        def write(*inputs, _dtype=None, _shape=None, _outputs: int | Sequence[gs.Tensor] = 1,
                  _label: str | None = None, _name: str | None = None, **attrs):
            inputs = list(inputs)
            while inputs and inputs[-1] is None:
                inputs.pop()
            inputs = [self._make.absent() if t is None else t for t in inputs]
            first = inputs[0] if inputs else None
            dtype = _dtype if _dtype is not None else getattr(first, "dtype", None)
            shape = _shape
            if shape is None and first is not None:
                if op_type == "Transpose" and "perm" in attrs:
                    shape = permuted(first.shape, attrs["perm"])
                elif op_type in SAME_SHAPE_OPS:
                    shape = first.shape
            return self._make.node(op_type, inputs, dtype, shape, outputs=_outputs, domain=self._domain,
                                   name=_name, label=_label, **attrs)

        return write


class Emit:
    """Writes the replacement of one site into ``nodes``.

    Nodes and tensors are named ``{prefix}/{Op}`` and ``{prefix}/{Op}_out``, ``prefix`` being the
    site node's name, made unique by the pass's :class:`NameAuthority`; new tensors carry dtype
    and shape (``SHAPES_INFERRED`` holds after a fusion)::

        x_nhwc = make.op.Transpose(x, perm=TO_NHWC)                     # shape permuted
        y = make.ms.GroupNorm(x_nhwc, gamma, beta, groups=32, ...)      # domain com.microsoft
        s = make.op.Flatten(skip, axis=1, _shape=[n, c])                # shape where it is not the input's

    A pass that is not a :class:`Fusion` (it rewires by hand) writes the same way, with one
    ``NameAuthority(graph)`` per run, and adds what it wrote with :meth:`into`.
    """

    def __init__(self, graph: gs.Graph, names: NameAuthority, prefix: str):
        self.graph, self.names, self.prefix, self.nodes = graph, names, prefix, []
        self.op = _OpWriter(self, None)
        self.ms = _OpWriter(self, MS_DOMAIN)

    def tensor(self, suffix: str, dtype, shape) -> gs.Variable:
        return gs.Variable(self.names(f"{self.prefix}/{suffix}"), dtype=dtype, shape=None if shape is None else list(shape))

    def variable(self, name: str, dtype, shape, *, exact: bool = False) -> gs.Variable:
        """A new tensor named after ``name`` itself, not the prefix (made unique): for a pass whose
        names follow the tensor they stand for (fp16's ``x__fp16``). ``exact``: ``name`` as given,
        for a tensor that takes over a name its old holder gives up (a graph output)."""
        if exact:
            self.names.taken.add(name)
        return gs.Variable(name if exact else self.names(name), dtype=dtype, shape=None if shape is None else list(shape))

    def constant(self, suffix: str, value) -> gs.Constant:
        """A new weight: an array, or lazy values (onnxopt.weights.DerivedValues: computed when read or saved)."""
        values = value
        if not isinstance(value, LazyValues):
            values = np.asarray(value)  # a 0-d value stays 0-d (np.ascontiguousarray would make it (1,))
            values = np.ascontiguousarray(values) if values.ndim else values
        return gs.Constant(self.names(f"{self.prefix}/{suffix}"), values)

    def node(self, op_type: str, inputs, dtype, shape, *, outputs: int | Sequence[gs.Tensor] = 1,
             domain: str | None = None, name: str | None = None, label: str | None = None, **attrs):
        """One node; ``outputs`` is a count of new annotated tensors, or the tensors themselves.
        ``name``: a fixed node name, for a node later rewrites look up by it (it must be free);
        ``label``: the node is named ``{prefix}/{label}`` (default: the op type)."""
        label = label or op_type
        if name is not None:
            self.names.taken.add(name)
        node_name = name if name is not None else self.names(f"{self.prefix}/{label}")
        if isinstance(outputs, int):
            outs = [self.tensor(f"{label}_out{'' if k == 0 else k}", dtype, shape) for k in range(outputs)]
        else:
            outs = list(outputs)
        self.nodes.append(gs.Node(op_type, node_name, attrs, list(inputs), outs, domain=domain))
        return outs[0] if len(outs) == 1 else outs

    def into(self, graph: gs.Graph) -> list[gs.Node]:
        """Append the nodes written so far to ``graph`` (passes that rewire by hand, not through
        :func:`onnxopt.pattern.replace`); returns them."""
        graph.nodes.extend(self.nodes)
        written, self.nodes = self.nodes, []
        return written

    def absent(self) -> gs.Variable:
        """An optional input or output left out (the empty name)."""
        return gs.Variable.empty()

    def transpose(self, x: gs.Tensor, perm: list[int]) -> gs.Variable:
        return self.op.Transpose(x, perm=list(perm))


# ---------------------------------------------------------------- rules and the loop


@dataclass
class FusionRun:
    """What one run of a fusion shares between its rules: the model, names, counters, tracer."""

    model: Model
    fusion: "Fusion"  # the pass (its options)
    names: NameAuthority
    result: PassResult
    tracer: Tracer | None = None
    details: Counter = field(default_factory=Counter)  # counts the pass reports in finish()
    memo: dict = field(default_factory=dict)  # facts computed once per run (by the first check that needs them)

    @property
    def graph(self) -> gs.Graph:
        return self.model.graph


def _root(match: Match) -> gs.Node:
    return match.root


@dataclass(frozen=True)
class Rule:
    """One way a fusion rewrites: where (``pattern``), whether (``check``), what (``emit``).

    ``check(match, run)`` returns the site (whatever ``emit`` needs) or raises :class:`Refusal`.
    ``emit(make, site)`` writes the replacement and returns the tensors that take the place of
    ``match.outputs``, in order. ``site(match)`` is the node that counts a site once across rules
    and names it (the report's refusals, the replacement's names), unless ``label(match)`` gives a
    name of its own (the torch module an attention came from).
    """

    pattern: Pattern
    check: Callable[[Match, FusionRun], Any]
    emit: Callable[[Emit, Any], Sequence[gs.Tensor]]
    site: Callable[[Match], gs.Node] = _root
    label: Callable[[Match], str] | None = None

    def name_of(self, match: Match, node: gs.Node) -> str:
        return self.label(match) if self.label is not None else node.name


@dataclass
class Site:
    """A checked site waiting to be written (``Fusion.defer_rewrites``)."""

    rule: Rule
    match: Match
    facts: Any
    node: gs.Node
    name: str  # the site's name in the report and the prefix of the names it writes


class Fusion(Pass):
    """A pass made of :class:`Rule` s; :meth:`run` is the loop of the module docstring.

    Subclasses declare ``rules`` (or override :meth:`rules_for` when they depend on options) and
    may override :meth:`before_rewrites` (``defer_rewrites = True``: every rule's sites are found
    and checked before any is written, e.g. to move the model's opset once) and :meth:`finish`.
    """

    is_fusion = True
    traces = True
    rules: ClassVar[tuple[Rule, ...]] = ()
    defer_rewrites: ClassVar[bool] = False
    def rules_for(self, model: Model) -> Sequence[Rule]:
        return self.rules

    def before_rewrites(self, run: FusionRun, sites: list[Site]) -> list[Site]:
        """Called once with every checked site when ``defer_rewrites``; returns the ones to write."""
        return sites

    def finish(self, run: FusionRun) -> None:
        """Called at the end of the run (put pass-specific facts into ``run.result.details``)."""

    def run(self, model: Model, *, tracer: Tracer | None = None) -> PassResult:
        """The loop of the module docstring; with ``tracer``, every candidate of every rule is
        recorded on it (``PassResult.trace``)."""
        graph = model.graph
        result = PassResult(modified=False)
        run = FusionRun(model, self, NameAuthority(graph), result, tracer)
        seen: set[int] = set()
        deferred: list[Site] = []
        rules = list(self.rules_for(model))
        for rule in rules:
            rewritten_before = result.sites_rewritten
            for match in rule.pattern.find(graph, trace=run.tracer or False):
                node = rule.site(match)
                if id(node) in seen:
                    continue
                try:
                    facts = rule.check(match, run)
                except Refusal as refusal:
                    if run.tracer is not None:
                        run.tracer.refuse(rule.pattern.name, match.root, refusal.reason, rule.name_of(match, node))
                    if not refusal.not_a_site:
                        seen.add(id(node))
                        result.sites_matched += 1
                        result.refuse(rule.name_of(match, node), refusal.reason)
                    continue
                seen.add(id(node))
                result.sites_matched += 1
                site = Site(rule, match, facts, node, rule.name_of(match, node))
                if self.defer_rewrites:
                    deferred.append(site)
                else:
                    self._write(run, site)
            if not self.defer_rewrites and result.sites_rewritten > rewritten_before:
                graph.cleanup(remove_unused_graph_inputs=False)  # dead matched nodes must not count as consumers
        if self.defer_rewrites:
            for site in self.before_rewrites(run, deferred):
                self._write(run, site)
            if result.sites_rewritten:
                graph.cleanup(remove_unused_graph_inputs=False)
        if result.sites_rewritten:
            graph.toposort()
        result.modified = result.sites_rewritten > 0
        self.finish(run)
        result.trace = run.tracer
        return result

    def trace(self, model: Model) -> Tracer:
        """Why each candidate of each rule's pattern fails to match ``model`` (the graph is not changed).
        The pass manager asks for it when a fusion the user named matched no site."""
        return near_misses(model.graph, [rule.pattern for rule in self.rules_for(model)])

    def _write(self, run: FusionRun, site: Site) -> None:
        make = Emit(run.graph, run.names, site.name or self.name)
        outputs = site.rule.emit(make, site.facts)
        replace(run.graph, site.match, make.nodes, list(outputs))
        run.result.sites_rewritten += 1


def near_misses(graph: gs.Graph, patterns: Sequence[Pattern]) -> Tracer:
    """The trace of ``patterns`` on ``graph``: why each candidate failed."""
    tracer = Tracer()
    for pattern in patterns:
        pattern.find(graph, trace=tracer)
    return tracer


def near_miss_lines(tracer: Tracer, limit: int = 5) -> list[str]:
    """One line per candidate that got furthest (at least one pattern node matched), furthest first."""
    misses = sorted(tracer.near_misses(min_progress=1), key=lambda c: -c.best_failure.progress)
    return [f"{c.pattern}: {c.op_type} '{c.node}': {c.best_failure.reason} "
            f"(at {c.best_failure.where}, graph node '{c.best_failure.graph_node}')" for c in misses[:limit]]
