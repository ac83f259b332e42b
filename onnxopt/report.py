"""What each pass did, as a table for people and JSON for tools.

A pass's ``details["listing"]`` (lines of text, e.g. context-kv's cross-attention layers and the
input each now reads) is printed under the table; the rest of ``details`` goes to JSON only.
A pass run on a companion model (see :mod:`onnxopt.model`) is its own row, ``fp16 [context_kv]``.

Memory: each row carries the process's resident set size after the pass and its peak so far
(:func:`process_memory`); the peak only grows, so the pass where it jumps is the one that needed
the memory. Loading and saving are timed by their callers (``load_seconds``, ``save_seconds``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from onnxopt.pass_infra import PassResult


@dataclass(frozen=True)
class MemoryUse:
    rss_bytes: int   # resident now (0 where the system does not say)
    peak_bytes: int  # the process's peak resident set size so far


def process_memory() -> MemoryUse:
    """This process's resident set size now and at its peak (Linux ``/proc/self/status``
    VmRSS/VmHWM; elsewhere the peak from ``getrusage`` and no current value)."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM")))
        return MemoryUse(int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return MemoryUse(0, peak if sys.platform == "darwin" else peak * 1024)  # macOS says bytes, Linux KiB


@dataclass
class Verification:
    ok: bool
    max_abs_error: float
    max_rel_error: float
    worst_output: str
    message: str = ""


@dataclass
class PassReport:
    name: str
    result: PassResult
    nodes_before: int
    nodes_after: int
    seconds: float
    auto: str | None = None  # why the manager inserted it (a requirement of another pass)
    verification: Verification | None = None
    companion: str | None = None  # the companion model it ran on (None: the main model)
    memory: MemoryUse | None = None  # after the pass
    cpu_seconds: float | None = None  # this process's CPU time (user + system) in the pass: on a
    # shared machine the wall time also counts the others' work, the CPU time does not
    round: str | None = None  # "cleanup round 2": a repeated step of a fixpoint sequence

    @property
    def label(self) -> str:
        name = self.name if not self.companion else f"{self.name} [{self.companion}]"
        name = name if not self.round else f"{name} ({self.round})"
        return name if not self.auto else f"{name} (for {self.auto})"

    def as_dict(self) -> dict[str, Any]:
        r = self.result
        return {
            "pass": self.name,
            "auto_inserted_for": self.auto,
            "companion": self.companion,
            "round": self.round,
            "modified": r.modified,
            "sites_matched": r.sites_matched,
            "sites_rewritten": r.sites_rewritten,
            "sites_refused": dict(r.refusal_counts()),
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "seconds": round(self.seconds, 4),
            "cpu_seconds": _round(self.cpu_seconds),
            "rss_mb": _mb(self.memory.rss_bytes) if self.memory else None,
            "peak_rss_mb": _mb(self.memory.peak_bytes) if self.memory else None,
            "details": r.details,
            "verification": asdict(self.verification) if self.verification else None,
        }


@dataclass
class OptimizationReport:
    model: str
    passes: list[PassReport] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    seconds: float = 0.0
    first_broken_pass: str | None = None
    final_verification: Verification | None = None
    notes: list[str] = field(default_factory=list)
    load_seconds: float | None = None   # set by whoever loaded the model (the CLI)
    save_seconds: float | None = None   # set by whoever saved it
    memory_before: MemoryUse | None = None  # when the first pass started (the model loaded)
    memory_after_save: MemoryUse | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "seconds": round(self.seconds, 4),
            "load_seconds": _round(self.load_seconds),
            "save_seconds": _round(self.save_seconds),
            "peak_rss_mb_before_passes": _mb(self.memory_before.peak_bytes) if self.memory_before else None,
            "peak_rss_mb_after_save": _mb(self.memory_after_save.peak_bytes) if self.memory_after_save else None,
            "first_broken_pass": self.first_broken_pass,
            "final_verification": asdict(self.final_verification) if self.final_verification else None,
            "passes": [p.as_dict() for p in self.passes],
            "notes": self.notes,
        }

    def explain(self, names=None) -> str:
        """Per run of each pass in ``names`` (default: every pass that traced its patterns, see
        ``onnxopt optimize --explain``): for a pass that traces, each candidate site, where its
        pattern failed or which condition refused it; for any other, what it did (nodes, its
        details, the sites it refused). A named pass that did not run says so. No line is wider
        than ``EXPLAIN_WIDTH``."""
        lines: list[str] = []
        for p in self.passes:
            r = p.result
            if (names is not None and p.name not in names) or (names is None and r.trace is None):
                continue
            lines.append(f"{p.label}: {r.sites_matched} site(s) matched, {r.sites_rewritten} rewritten, {len(r.refused)} refused")
            if r.trace is not None:
                lines += ["  " + line for line in r.trace.report(limit=50).splitlines()]
            else:
                lines += ["  " + line for line in _what_it_did(p)]
        ran = {p.name for p in self.passes}
        lines += [f"{name}: did not run (nothing required it)" for name in sorted(set(names or ()) - ran)]
        return "\n".join(wrapped for line in lines for wrapped in _wrap(line, EXPLAIN_WIDTH))

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, default=str)

    def table(self) -> str:
        verified = any(p.verification for p in self.passes)
        header = ["pass", "matched", "rewritten", "refused", "nodes", "ms", "cpu ms", "peak MB"] + (["verify (max abs err)"] if verified else [])
        rows = []
        for p in self.passes:
            r = p.result
            row = [
                p.label,
                str(r.sites_matched),
                str(r.sites_rewritten),
                str(len(r.refused)),
                f"{p.nodes_before} -> {p.nodes_after}",
                f"{p.seconds * 1000:.0f}",
                f"{p.cpu_seconds * 1000:.0f}" if p.cpu_seconds is not None else "-",
                f"{_mb(p.memory.peak_bytes):.0f}" if p.memory else "-",
            ]
            if verified:
                v = p.verification
                row.append("-" if v is None else f"{'ok' if v.ok else 'FAIL'} {v.max_abs_error:.2e}")
            rows.append(row)
        rows.append(["total", "", "", "", f"{self.nodes_before} -> {self.nodes_after}", f"{self.seconds * 1000:.0f}",
                     f"{sum(p.cpu_seconds or 0 for p in self.passes) * 1000:.0f}",
                     f"{max((_mb(p.memory.peak_bytes) for p in self.passes if p.memory), default=0):.0f}"] + ([""] if verified else []))
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        numeric = {1, 2, 3, 5, 6, 7}

        def fmt(row):
            return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

        lines = [fmt(header), "  ".join("-" * w for w in widths)]
        lines += [fmt(r) for r in rows[:-1]] + ["  ".join("-" * w for w in widths), fmt(rows[-1])]
        for p in self.passes:
            for reason, count in p.result.refusal_counts().most_common():
                lines.append(f"  {p.label}: refused {count} site(s): {reason}")
            lines += [f"  {p.label}: {line}" for line in p.result.details.get("listing", ())]
        lines += [f"  note: {n}" for n in self.notes]
        if self.final_verification is not None:
            v = self.final_verification
            verdict = "equal to the source" if v.ok else "DIFFERS from the source"
            lines.append(f"  verify: final model {verdict} (max abs err {v.max_abs_error:.2e}, max rel err {v.max_rel_error:.2e})")
        if self.first_broken_pass:
            lines.append(f"  VERIFICATION FAILED: first pass to break the tolerance: {self.first_broken_pass}")
        return "\n".join(lines)


def _mb(nbytes: int) -> float:
    return round(nbytes / 1e6, 1)


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


EXPLAIN_WIDTH = 100  # columns: a terminal's width, so that the explanation reads without scrolling sideways
EXPLAIN_LIMIT = 50  # refusals and list items shown per pass


def _what_it_did(p: PassReport) -> list[str]:
    """A pass that does not trace patterns: whether it changed the graph, why it found nothing to
    do, its details (lists cut at EXPLAIN_LIMIT items) and the sites it refused, with the reason."""
    r = p.result
    lines = [f"{'modified the graph' if r.modified else 'left the graph as it was'}: "
             f"{p.nodes_before} -> {p.nodes_after} nodes"]
    if r.nothing_to_do:
        lines.append(f"nothing to do: {r.nothing_to_do}")
    for key, value in r.details.items():
        if key != "listing":
            lines.append(f"{key}: {_brief(value)}")
    lines += list(r.details.get("listing", ()))[:EXPLAIN_LIMIT]
    lines += [f"REFUSED '{site}': {reason}" for site, reason in r.refused[:EXPLAIN_LIMIT]]
    if len(r.refused) > EXPLAIN_LIMIT:
        lines.append(f"... {len(r.refused) - EXPLAIN_LIMIT} more refused sites (the JSON report lists them)")
    return lines


def _brief(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_brief(v)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        shown = ", ".join(_brief(v) for v in value[:EXPLAIN_LIMIT // 5])
        more = f", ... ({len(value)} in all)" if len(value) > EXPLAIN_LIMIT // 5 else ""
        return f"[{shown}{more}]"
    return str(value)


def _wrap(line: str, width: int) -> list[str]:
    """``line`` cut at spaces to ``width`` columns, continuation lines indented under its text."""
    if len(line) <= width:
        return [line]
    import textwrap

    indent = " " * (len(line) - len(line.lstrip()) + 4)
    return textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=True, break_on_hyphens=False) or [line]
