"""``onnxopt bench``: latency of several models on the same inputs, as ratios to the first.

Every model gets the same random inputs (cast to its input types), is bound to device buffers,
warmed up, then timed ``runs`` times; medians are reported with min/max, with and without CUDA
graphs, next to the first model's as a ratio. The table is markdown; ``--json`` keeps everything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from onnxopt.loading import load_model
from onnxopt.runners.ort_cuda import OrtCudaSession, Timing, gpu_memory_used_mb
from onnxopt.verify import InputSpec, random_feeds


@dataclass
class BenchRow:
    label: str
    path: str
    cuda_graph: bool
    timing: Timing | None
    gpu_memory_mb: float | None = None
    error: str | None = None


@dataclass
class BenchReport:
    rows: list[BenchRow] = field(default_factory=list)

    def markdown(self) -> str:
        lines = ["| model | CUDA graph | median ms | min | max | vs first | GPU MB |", "|---|---|---|---|---|---|---|"]
        baseline = {}
        for row in self.rows:
            if row.timing is None:
                lines.append(f"| {row.label} | {'on' if row.cuda_graph else 'off'} | failed: {row.error} | | | | |")
                continue
            base = baseline.setdefault(row.cuda_graph, row.timing.median_ms)
            mem = f"{row.gpu_memory_mb:.0f}" if row.gpu_memory_mb is not None else "-"
            lines.append(
                f"| {row.label} | {'on' if row.cuda_graph else 'off'} | {row.timing.median_ms:.2f} | {row.timing.min_ms:.2f} | "
                f"{row.timing.max_ms:.2f} | {row.timing.median_ms / base:.2f}x | {mem} |"
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps([asdict(r) for r in self.rows], indent=2)


def bench(paths: list[str], labels: list[str] | None = None, *, inputs: InputSpec | None = None, cuda_graph=(False, True),
          warmup: int = 10, runs: int = 40, prefer_nhwc: bool = False, seed: int = 0) -> BenchReport:
    labels = labels or [Path(p).name for p in paths]
    feeds = random_feeds(load_model(paths[0]), inputs, seed=seed)[0]
    report = BenchReport()
    for graph_mode in cuda_graph:
        for label, path in zip(labels, paths):
            before = gpu_memory_used_mb()
            try:
                session = OrtCudaSession(path, cuda_graph=graph_mode, prefer_nhwc=prefer_nhwc)
                session.bind(feeds)
                timing = session.time(warmup=warmup, runs=runs)
                after = gpu_memory_used_mb()
                memory = after - before if before is not None and after is not None else None
                report.rows.append(BenchRow(label, str(path), graph_mode, timing, memory))
                del session
            except Exception as exc:  # one model failing must not lose the others' numbers
                report.rows.append(BenchRow(label, str(path), graph_mode, None, error=str(exc).splitlines()[0][:200]))
    return report
