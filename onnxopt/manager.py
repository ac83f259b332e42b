"""Run passes in order, establish their requirements, time and report them, and verify on request."""

from __future__ import annotations

import time
from typing import Callable, Iterable

from onnxopt import properties as property_checks
from onnxopt import registry
from onnxopt.companions import narrow_interface_casts
from onnxopt.errors import PassNotApplicableError, PassOrderError
from onnxopt.model import Model
from onnxopt.pass_infra import Pass, Sequence
from onnxopt.pattern import Tracer
from onnxopt.progress import show_pass
from onnxopt.report import OptimizationReport, PassReport, Verification, process_memory

# A verifier compares the current model with the source and says how far apart they are, at a
# tolerance (atol, rtol) no tighter than the one given (None: its own).
Verifier = Callable[..., Verification]


class PassManager:
    """Runs a list of passes over a model.

    * Requirements: before a pass, every property it ``requires`` that is not currently true is
      established by running the registered pass that ``provides`` it (shown in the report as
      "auto-inserted").
    * Invalidation: a pass that modified the graph keeps only the properties it ``provides`` or
      ``preserves``.
    * Verification: with a verifier, the model is compared with the source after every pass that
      modified it; the first pass that breaks the tolerance is named and the run stops there. A
      pass that ``rebases_verification`` (it computes more exactly than the source) is compared,
      and so is everything after it, with the source rewritten by that pass.
    * ``strict``: a fusion pass that matched nothing raises :class:`PassNotApplicableError`.
      Only passes the user named count (``requested``, default: all); a preset's fusions that do
      not apply to this model (no GroupNorm in a text encoder) are normal.
    * Composition: the passes a pass names as its ``followers`` (nhwc-conv: sink-transposes; fp16:
      remove-redundant-casts) run right after it, each as its own step: in the report as
      "sink-transposes (for nhwc-conv)", timed and verified like any other.
    * Fixpoints: a :class:`~onnxopt.pass_infra.Sequence` (the ``cleanup`` preset) runs its passes
      one step each, repeated until a whole round of them modified nothing; the repeats appear in
      the report as "infer-shapes (cleanup round 2)".
    * Order: a pass listed before one of its ``runs_after`` passes is refused up front
      (:class:`PassOrderError`, one line saying why and where to put it).
    * Explaining: each run of a pass named in ``explain`` (auto-inserted ones and followers too)
      gets a fresh :class:`~onnxopt.pattern.Tracer` when the pass ``traces``; the trace is its
      result's ``trace``, which :meth:`~onnxopt.report.OptimizationReport.explain` prints.
    * Companions: once a pass has split the model (``context-kv``), every later pass runs on the
      main model and on each companion (unless it sets ``applies_to_companions = False``); the
      companion runs appear in the report as their own rows. Afterwards, a Cast pair that a pass
      left across a companion interface (fp16 with float32 I/O kept: Cast(f16->f32) as the
      companion's output, Cast(f32->f16) on the main model's input) is removed, so the tensors
      handed over stay in the low precision.
    """

    def __init__(self, passes: Iterable[Pass | str], *, verifier: Verifier | None = None, strict: bool = False,
                 requested: set[str] | None = None, explain: Iterable[str] = ()):
        self.passes = [registry.get_pass(p)() if isinstance(p, str) else p for p in passes]
        check_order(self.passes)
        self.verifier = verifier
        self.strict = strict
        self.requested = requested
        self.explain = frozenset(explain)

    def run(self, model: Model) -> OptimizationReport:
        report = OptimizationReport(model=str(model.source or model.graph.name or "model"))
        report.nodes_before = len(model.graph.nodes)
        report.memory_before = process_memory()
        properties: set[str] = set()
        self._tolerance: tuple[float, float] | None = None  # loosened by passes that change numerics
        start = time.perf_counter()
        for p in self.passes:
            if not self._establish(p, model, report, properties, chain=()):
                break
            if not self._step(p, model, report, properties):
                break
        report.nodes_after = len(model.graph.nodes)
        report.seconds = time.perf_counter() - start
        if self.verifier is not None and not report.first_broken_pass:
            # The final model is always proven, also when no single pass changed it.
            report.final_verification = self.verifier(model, tolerance=self._tolerance)
            if not report.final_verification.ok:
                report.first_broken_pass = "(final model)"
        return report

    def _establish(self, p: Pass, model: Model, report: OptimizationReport, properties: set[str], chain: tuple) -> bool:
        """Run the providers of ``p``'s missing requirements, their own requirements first."""
        for prop in sorted(p.requires - properties):
            if prop in properties:  # established by a provider run for an earlier property
                continue
            provider_cls = registry.provider_of(prop)
            if provider_cls is None:
                raise RuntimeError(f"pass {p.name} requires '{prop}' but no pass provides it")
            if provider_cls.name in chain:
                raise RuntimeError(f"requirement cycle: {' -> '.join(chain + (provider_cls.name,))}")
            provider = provider_cls()
            if not self._establish(provider, model, report, properties, chain + (p.name,)):
                return False
            if not self._step(provider, model, report, properties, auto=p.name):
                return False
        return True

    def _sequence(self, p: Sequence, model: Model, report: OptimizationReport, properties: set[str],
                  auto: str | None = None) -> bool:
        """Each step of ``p`` as a step of its own, repeated to a fixpoint when ``p.fixpoint``."""
        schedule, modified = p.schedule(), None
        try:
            while True:
                round_, name = schedule.send(modified)
                step = registry.get_pass(name)()
                if not self._establish(step, model, report, properties, chain=(p.name,)):
                    return False
                if not self._step(step, model, report, properties, auto=auto,
                                  round_=f"{p.name} round {round_}" if round_ > 1 else None):
                    return False
                modified = self._modified
        except StopIteration:
            return True

    def _step(self, p: Pass, model: Model, report: OptimizationReport, properties: set[str], auto: str | None = None,
              round_: str | None = None) -> bool:
        if isinstance(p, Sequence):
            return self._sequence(p, model, report, properties, auto)
        nodes_before = len(model.graph.nodes)
        companions = list(model.companions.items()) if p.applies_to_companions else []  # not those p makes
        show_pass(p.name)  # a terminal's status line (onnxopt.progress); nothing otherwise
        t0, cpu0 = time.perf_counter(), time.process_time()
        result = p(model, tracer=self._tracer(p))
        seconds = time.perf_counter() - t0
        step = PassReport(p.name, result, nodes_before, len(model.graph.nodes), seconds, auto=auto, memory=process_memory(),
                          cpu_seconds=time.process_time() - cpu0, round=round_)
        report.passes.append(step)
        modified = result.modified
        for name, companion in companions:
            nodes, t0, cpu0 = len(companion.graph.nodes), time.perf_counter(), time.process_time()
            part = p(companion, tracer=self._tracer(p))
            report.passes.append(PassReport(p.name, part, nodes, len(companion.graph.nodes), time.perf_counter() - t0,
                                            auto=auto, companion=name, memory=process_memory(),
                                            cpu_seconds=time.process_time() - cpu0, round=round_))
            modified = modified or part.modified
        self._modified = modified
        if companions and modified:
            narrow_interface_casts(model)
        if modified:
            properties.intersection_update(p.provides | p.preserves)
        properties.update(p.provides)
        if property_checks.is_checking():  # tests and --debug: the claims are checked, not trusted
            property_checks.check(model, properties, after=step.label)
        if p.is_fusion and result.sites_matched == 0 and (self.requested is None or p.name in self.requested):
            message = f"{p.name}: {result.nothing_to_do or 'nothing to fuse (no site matches its pattern)'}"
            message += _near_misses(p, model, result)
            if self.strict:
                raise PassNotApplicableError(message)
            report.notes.append(message)
        if p.verify_tolerance is not None:
            current = self._tolerance or (0.0, 0.0)
            self._tolerance = (max(current[0], p.verify_tolerance[0]), max(current[1], p.verify_tolerance[1]))
        if self.verifier is not None and modified:
            if p.rebases_verification:
                self._rebase_verification(p)
            step.verification = self.verifier(model, tolerance=self._tolerance)
            if not step.verification.ok:
                report.first_broken_pass = p.name
                return False
        for name in p.followers(result):  # the passes that complete p, each a step of its own
            if not self._step(registry.get_pass(name)(), model, report, properties, auto=p.name):
                return False
        return True


    def _rebase_verification(self, p: Pass) -> None:
        """From ``p`` on, the verifier's reference is the source rewritten by ``p`` alone (a
        verifier without ``rebase``, or with no source kept for it, compares as before)."""
        rebase = getattr(self.verifier, "rebase", None)
        if rebase is not None:
            rebase(lambda source: PassManager([type(p)()]).run(source), p.name)

    def _tracer(self, p: Pass) -> Tracer | None:
        return Tracer() if p.name in self.explain and p.traces else None


def passes_in_run(passes: Iterable[str]) -> set[str]:
    """Every pass name a run of ``passes`` (names, presets expanded) may include: the passes, the
    steps of sequences, the providers of their requirements (auto-inserted) and their possible
    followers."""
    names: set[str] = set()
    pending = [registry.get_pass(name) for name in passes]
    while pending:
        cls = pending.pop()
        if cls.name in names:
            continue
        names.add(cls.name)
        more = [registry.provider_of(prop) for prop in cls.requires] + [registry.get_pass(n) for n in cls.possible_followers]
        if issubclass(cls, Sequence):
            more += [registry.get_pass(n) for n in cls.steps]
        pending += [c for c in more if c is not None]
    return names


def check_order(passes: list[Pass]) -> None:
    """Refuse a pass listed before a pass it must follow (``Pass.runs_after``)."""
    def names(p: Pass) -> tuple[str, ...]:
        return p.steps if isinstance(p, Sequence) else (p.name,)

    for i, p in enumerate(passes):
        later = {name for q in passes[i + 1:] for name in names(q)}
        for earlier, why in p.runs_after.items():
            if earlier in later:
                presets = [preset.name for preset in registry.PRESETS.values() if earlier in preset.passes]
                where = f"after '{earlier}'" + (f" or after a preset that includes it ({', '.join(presets)})" if presets else "")
                example = f" e.g. --passes {presets[0]},{p.name}" if presets else ""
                raise PassOrderError(f"pass '{p.name}' must run after '{earlier}': {why}. List it {where};{example}".rstrip(";"))


def _near_misses(p: Pass, model: Model, result) -> str:
    """For a fusion that matched nothing: the candidates that came closest, and where they failed
    (the graph is as the fusion found it: it rewrote nothing)."""
    trace = getattr(p, "trace", None)
    if not callable(trace):
        return ""
    from onnxopt.fusion import near_miss_lines

    if result.trace is None:
        result.trace = trace(model)
    lines = near_miss_lines(result.trace, limit=3)
    return "".join(f"\n    near miss: {line}" for line in lines)
