"""Why a pattern did not match: one record per candidate root node.

A fusion that does not fire on a new exporter's graph is debugged here::

    matches = GELU.find(graph, trace=True)
    print(matches.trace.report())

    pattern erf_gelu:
        %1 = Div(x, 1.41421)
        %2 = Erf(%1)
        %3 = Add(%2, 1)
        %4 = Mul(x, %3)
        %5 = Mul(0.5, %4)
        output: %5
      4 candidates (root op Mul): 1 matched, 3 failed
      ok   Mul 'gelu_ok'
      FAIL Mul 'half_bad': constant 'c22' is 0.6, expected 0.5 (rtol 0.001)
         at Mul.in0, graph node 'half_bad', after 5 of the pattern's nodes matched
      FAIL Mul 'mul9': op type is Add, expected Mul
         at Mul.in1 > Mul, graph node 'add7', after 1 of the pattern's nodes matched
      ... 1 more failed candidates (report(limit=...) shows them)

The matcher backtracks (operand orders of commutative ops, alternatives), so a
candidate usually fails several times; the report shows the failure that got
furthest (most pattern nodes matched; on a tie, the one on a node of the right
op type), which is nearly always the informative one. ``CandidateTrace.failures``
keeps all of them. Near misses are listed first.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Failure:
    """One failed attempt: where in the pattern, on which graph node, and why."""

    where: str  # path in the pattern from its output, e.g. "Mul.in1 > Mul.in1 > Add"
    graph_node: str | None  # name of the graph node being matched (or whose input failed)
    reason: str  # e.g. "op type is Mul, expected Add"
    progress: int  # pattern nodes matched when it failed
    fit: int = 2  # how close it came: 2 right op or kind of value, 1 wrong op type, 0 wrong kind of value

    def __str__(self) -> str:
        node = f", graph node '{self.graph_node}'" if self.graph_node is not None else ""
        return f"{self.reason}\n     at {self.where}{node}, after {self.progress} of the pattern's nodes matched"


@dataclass
class CandidateTrace:
    """The outcome of matching one pattern at one candidate root node."""

    pattern: str  # the pattern's name
    node: str  # the candidate node's name
    op_type: str
    matched: bool = False
    failures: list[Failure] = field(default_factory=list)
    refusal: str | None = None  # matched, then refused by the pass's check (onnxopt.fusion.Refusal)
    site: str | None = None  # the refused site's name, where the pass names it other than the root

    @property
    def best_failure(self) -> Failure | None:
        """The failure that got furthest; on a tie, the best fit (see Failure.fit), then the first."""
        best = None
        for failure in self.failures:
            if best is None or _closeness(failure) > _closeness(best):
                best = failure
        return best

    @property
    def reason(self) -> str | None:
        """One line saying why this candidate failed (None if it matched)."""
        best = self.best_failure
        return None if self.matched or best is None else best.reason


class Tracer:
    """Collects a ``CandidateTrace`` per candidate; one tracer may serve several patterns.

        tracer = Tracer()
        GELU.find(graph, trace=tracer)
        GEGLU.find(graph, trace=tracer)
        tracer.report(); tracer.failed; tracer.counts()
    """

    def __init__(self) -> None:
        self.candidates: list[CandidateTrace] = []
        self._pattern_text: dict[str, str] = {}
        self._pattern_roots: dict[str, str] = {}

    # -- recording (called by the matcher)

    def begin(self, pattern_name: str, pattern_text: str, root_ops: str, node_name: str, op_type: str) -> CandidateTrace:
        self.note_pattern(pattern_name, pattern_text, root_ops)
        trace = CandidateTrace(pattern_name, node_name, op_type)
        self.candidates.append(trace)
        return trace

    def note_pattern(self, pattern_name: str, pattern_text: str, root_ops: str) -> None:
        """Register a pattern even if the graph has no candidate for it."""
        self._pattern_text.setdefault(pattern_name, pattern_text)
        self._pattern_roots.setdefault(pattern_name, root_ops)

    def refuse(self, pattern_name: str, node, reason: str, site: str | None = None) -> None:
        """Record that the pass refused the match of ``pattern_name`` rooted at ``node`` (the site
        ``site``): ``reason``."""
        trace = next((t for t in reversed(self.candidates)
                      if t.pattern == pattern_name and t.node == node.name and t.matched), None)
        if trace is None:
            trace = self.begin(pattern_name, self._pattern_text.get(pattern_name, pattern_name),
                               self._pattern_roots.get(pattern_name, "?"), node.name, node.op)
            trace.matched = True
        trace.refusal, trace.site = reason, site if site != node.name else None

    # -- reading

    @property
    def matched(self) -> list[CandidateTrace]:
        return [c for c in self.candidates if c.matched]

    @property
    def failed(self) -> list[CandidateTrace]:
        return [c for c in self.candidates if not c.matched]

    def counts(self, pattern: str | None = None) -> dict[str, int]:
        """``{"candidates": n, "matched": m, "failed": f}`` (for one pattern, or all)."""
        chosen = [c for c in self.candidates if pattern is None or c.pattern == pattern]
        matched = sum(c.matched for c in chosen)
        return {"candidates": len(chosen), "matched": matched, "failed": len(chosen) - matched}

    def near_misses(self, min_progress: int = 1) -> list[CandidateTrace]:
        """Failed candidates whose best attempt matched at least ``min_progress`` pattern nodes."""
        return [c for c in self.failed if c.best_failure and c.best_failure.progress >= min_progress]

    def report(self, limit: int = 20, show_matched: bool = True) -> str:
        """A readable summary: per pattern, the counts, then the failures that got furthest."""
        lines: list[str] = []
        for pattern in self._pattern_text:
            lines += self._pattern_report(pattern, limit, show_matched)
        return "\n".join(lines)

    def _pattern_report(self, pattern: str, limit: int, show_matched: bool) -> list[str]:
        counts = self.counts(pattern)
        lines = [f"pattern {pattern}:"]
        lines += ["    " + line for line in self._pattern_text[pattern].splitlines()]
        lines.append(f"  {counts['candidates']} candidates (root op {self._pattern_roots[pattern]}): "
                     f"{counts['matched']} matched, {counts['failed']} failed")
        mine = [c for c in self.candidates if c.pattern == pattern]
        if show_matched:
            lines += [f"  ok   {c.op_type} '{c.node}'" for c in mine if c.matched and c.refusal is None]
        lines += [f"  REFUSED {c.op_type} '{c.node}'" + (f" (site '{c.site}')" if c.site else "") + f": {c.refusal}"
                  for c in mine if c.matched and c.refusal is not None]
        failed = sorted((c for c in mine if not c.matched), key=_furthest_first)
        for c in failed[:limit]:
            best = c.best_failure
            text = str(best) if best else "no attempt recorded"
            lines.append(f"  FAIL {c.op_type} '{c.node}': {text}")
        if len(failed) > limit:
            lines.append(f"  ... {len(failed) - limit} more failed candidates (report(limit=...) shows them)")
        return lines

    def __str__(self) -> str:
        return self.report()


def _closeness(failure: Failure) -> tuple[int, int]:
    return failure.progress, failure.fit


def _furthest_first(trace: CandidateTrace) -> int:
    best = trace.best_failure
    return -(best.progress if best else 0)
