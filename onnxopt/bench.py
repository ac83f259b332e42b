"""``onnxopt bench``: latency of several models on the same inputs, as ratios to the first.

Every model gets the same random inputs (cast to its input types), is bound to device buffers,
warmed up, then timed ``runs`` times; medians are reported with min/max, with and without CUDA
graphs, next to the first model's as a ratio. Timing: CUDA events recorded on the stream ORT runs
on when torch with CUDA is importable, else the host clock around synchronous runs (the ``clock``
field says which; :meth:`onnxopt.runners.ort_cuda.OrtCudaSession.time`).

GPU memory (``GPU MB``): device memory this process holds after the timed runs minus what it held
before the session was created, read from NVML for this process (or, where NVML cannot see this
process or pynvml is missing, device-wide from NVML or ``torch.cuda.mem_get_info``; the report's
``memory_probe`` says which). ONNX Runtime's CUDA arena never shrinks while a session lives, so
this is the session's high-water mark: weights, the activation arena (grown in power-of-two steps
by ORT's default extension strategy), cuDNN/cuBLAS workspaces and, with CUDA graphs, the captured
graph's memory. The CUDA context is created before the first measurement, so the first model is
not charged for it.

Ablation (:func:`build_ablation`, ``onnxopt bench --ablation ort-cuda,fp16 SOURCE``): like ONNX
Runtime's per-fusion table for SD 1.5, the source converted to fp16 alone, then the preset's
passes added one fusion at a time, each model built from the source and written to a work folder
(one model in memory at a time; folders are reused when source and passes are unchanged).
"""

from __future__ import annotations

import gc
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from onnxopt import registry
from onnxopt.errors import OnnxoptError
from onnxopt.loading import load_model
from onnxopt.runners.ort_cuda import OrtCudaSession, Timing
from onnxopt.verify import InputSpec, random_feeds

LARGE_MODEL_BYTES = 64 << 20  # ablation models with more weights than this keep them in <model>.onnx.data
MANIFEST = "ablation.json"


# ----------------------------------------------------------------------------------- memory


def device_memory_mb(device_id: int = 0) -> tuple[float | None, str]:
    """(MB of device memory in use, how it was read); (None, "unavailable") without NVML or torch."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(device_id)
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                        return proc.usedGpuMemory / 2**20, "nvml-process"
                return pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20, "nvml-device"
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # NVML present but unusable (driver mismatch, container): try torch
            pass
    try:
        import torch
    except ImportError:
        return None, "unavailable"
    if not torch.cuda.is_available():
        return None, "unavailable"
    free, total = torch.cuda.mem_get_info(device_id)
    return (total - free) / 2**20, "cuda-mem-get-info-device"


def _create_cuda_context(device_id: int = 0) -> None:
    """Make the CUDA context exist before the first memory reading (it is ~0.5 GB that no model owns)."""
    try:
        import torch

        if torch.cuda.is_available():
            torch.zeros(1, device=f"cuda:{device_id}")
            return
    except ImportError:
        pass
    from onnxopt.runtime import import_onnxruntime

    ort = import_onnxruntime()
    ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.float32), "cuda", device_id)


# ----------------------------------------------------------------------------------- report


@dataclass
class BenchRow:
    label: str
    path: str
    cuda_graph: bool
    timing: Timing | None
    gpu_memory_mb: float | None = None
    error: str | None = None
    note: str = ""  # what an ablation step added ("fuse-attention 32/32")


@dataclass
class BenchReport:
    rows: list[BenchRow] = field(default_factory=list)
    inputs: dict[str, list[int]] = field(default_factory=dict)
    memory_probe: str = "unavailable"

    def ratio(self, row: BenchRow) -> float | None:
        """Median over the median of the first model that ran in the same CUDA graph mode (a raw
        export with CPU-placed shape ops cannot be captured: the next row is the baseline then)."""
        first = next((r for r in self.rows if r.cuda_graph == row.cuda_graph and r.timing is not None), None)
        if first is None or first.timing is None or row.timing is None:
            return None
        return row.timing.median_ms / first.timing.median_ms

    def markdown(self) -> str:
        notes = any(r.note for r in self.rows)
        header = ["model", "CUDA graph", "median ms", "min", "max", "vs first", "GPU MB"] + (["added"] if notes else [])
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in self.rows:
            graph = "on" if row.cuda_graph else "off"
            extra = [row.note] if notes else []
            if row.timing is None:
                cells = [row.label, graph, f"failed: {row.error}", "", "", "", ""] + extra
            else:
                ratio = self.ratio(row)
                mem = f"{row.gpu_memory_mb:.0f}" if row.gpu_memory_mb is not None else "-"
                cells = [row.label, graph, f"{row.timing.median_ms:.2f}", f"{row.timing.min_ms:.2f}", f"{row.timing.max_ms:.2f}",
                         f"{ratio:.2f}x" if ratio is not None else "-", mem] + extra
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        shapes = ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in self.inputs.items())
        clock = next((r.timing.clock for r in self.rows if r.timing is not None), "-")
        lines.append("")
        lines.append(f"inputs: {shapes or '-'}; timing: {clock}; GPU MB: {self.memory_probe}; ratios against the first model that ran, same CUDA graph mode")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        rows = []
        for row in self.rows:
            entry = asdict(row)
            entry["ratio_to_first"] = self.ratio(row)
            rows.append(entry)
        return {"inputs": self.inputs, "memory_probe": self.memory_probe, "rows": rows}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)


# ----------------------------------------------------------------------------------- timing


def bench(paths: list[str], labels: list[str] | None = None, *, inputs: InputSpec | None = None, cuda_graph=(False, True),
          warmup: int = 10, runs: int = 40, prefer_nhwc: bool = False, seed: int = 0,
          feeds: dict[str, np.ndarray] | None = None, notes: list[str] | None = None) -> BenchReport:
    """Time every model in ``paths`` on the same inputs (``feeds``, or random ones for the first model)."""
    paths = [str(p) for p in paths]
    labels = labels or [Path(p).name for p in paths]
    if len(labels) != len(paths):
        raise OnnxoptError(f"{len(labels)} labels for {len(paths)} models")
    notes = notes or [""] * len(paths)
    feeds = feeds if feeds is not None else random_feeds(load_model(paths[0]), inputs, seed=seed)[0]
    report = BenchReport(inputs={k: list(v.shape) for k, v in feeds.items()})
    _create_cuda_context()
    for graph_mode in cuda_graph:
        for label, path, note in zip(labels, paths, notes):
            gc.collect()
            before, report.memory_probe = device_memory_mb()
            session = None
            try:
                session = OrtCudaSession(path, cuda_graph=graph_mode, prefer_nhwc=prefer_nhwc)
                session.bind(feeds)
                timing = session.time(warmup=warmup, runs=runs)
                after, _ = device_memory_mb()
                memory = after - before if before is not None and after is not None else None
                report.rows.append(BenchRow(label, path, graph_mode, timing, memory, note=note))
            except Exception as exc:  # one model failing must not lose the others' numbers
                text = str(exc).strip()
                report.rows.append(BenchRow(label, path, graph_mode, None, error=(text.splitlines() or [type(exc).__name__])[0][:200], note=note))
            finally:
                del session
    return report


# ----------------------------------------------------------------------------------- ablation


@dataclass
class AblationStep:
    label: str  # "source fp16", "+ cleanup", "+ fuse-attention"
    passes: list[str]  # what is applied to the source to build it (pass names, presets expanded)
    added: list[str]  # passes this step adds to the previous one
    path: str = ""
    rewritten: str = ""  # "fuse-attention 32/32": sites rewritten/matched by the added fusions
    reused: bool = False


def ablation_plan(names: list[str]) -> list[AblationStep]:
    """The models of an ablation over ``names`` (passes and presets, e.g. ``["ort-cuda", "fp16"]``).

    Passes that change numerics (those declaring a verify tolerance: ``fp16``) are taken out and
    applied last in every step. The rest is split at its fusions: step 0 is the source with only
    those numerics passes; step 1 adds what comes before the first fusion (``cleanup``); each
    further step adds one fusion with the non-fusion passes that follow it; the passes after the
    last fusion (dead nodes, shapes) close every step. The last step is the whole list.
    """
    expanded = registry.expand(list(names))
    tail = [n for n in expanded if registry.get_pass(n).verify_tolerance is not None]
    body = [n for n in expanded if registry.get_pass(n).verify_tolerance is None]
    fusions = [i for i, n in enumerate(body) if registry.get_pass(n).is_fusion]
    if not fusions:
        stages, epilogue = ([body] if body else []), []
    else:
        prologue, epilogue = body[:fusions[0]], body[fusions[-1] + 1:]
        stages = [prologue] if prologue else []
        for k, start in enumerate(fusions):
            end = fusions[k + 1] if k + 1 < len(fusions) else fusions[-1] + 1
            stages.append(body[start:end])
    steps = [AblationStep("source" + ("".join(f" {n}" for n in tail)), list(tail), list(tail))]
    applied: list[str] = []
    for stage in stages:
        applied = applied + stage
        steps.append(AblationStep(f"+ {_stage_label(stage)}", applied + epilogue + tail, stage))
    if len(steps) > 2:  # the last step is the whole list: say so
        steps[-1].label += f" (= {','.join(names)})"
    return steps


def _stage_label(stage: list[str]) -> str:
    for preset in registry.PRESETS.values():
        if tuple(stage) == preset.passes:
            return preset.name
    return ",".join(dict.fromkeys(stage))


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", label.replace("+", "")).strip("-").lower() or "source"


def _source_identity(source: Path) -> dict:
    stat = source.stat()
    return {"path": str(source.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def build_ablation(source: str | Path, names: list[str], work: str | Path, *, options: dict[str, dict] | None = None,
                   log=print) -> list[AblationStep]:
    """Build (or reuse from ``work``) every model of :func:`ablation_plan`; returns the steps with paths.

    Each model is built from the source by :func:`onnxopt.optimize` and saved before the next is
    started, so one model is in memory at a time (weights stay in the source's files until saved).
    A step whose file exists and whose manifest entry names the same source file (size, mtime)
    and passes is reused. A step without passes is the source file itself.
    """
    from onnxopt.api import optimize
    from onnxopt.saving import save_model

    source, work = Path(source), Path(work)
    if not source.is_file():
        raise OnnxoptError(f"{source}: no such file")
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OnnxoptError(f"{work}: cannot create the work folder: {exc.strerror or exc}")
    manifest_path = work / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    identity = _source_identity(source)
    if manifest.get("source") != identity:
        manifest = {"source": identity, "steps": {}}
    steps = ablation_plan(names)
    for index, step in enumerate(steps):
        if not step.passes:
            step.path = str(source)
            continue
        path = work / f"{index:02d}-{_slug(step.label)}.onnx"
        known = manifest["steps"].get(path.name)
        if path.is_file() and known and known.get("passes") == step.passes:
            step.path, step.rewritten, step.reused = str(path), known.get("rewritten", ""), True
            log(f"[ablation] {step.label}: reusing {path}")
            continue
        log(f"[ablation] {step.label}: building {path.name} ({len(step.passes)} passes)")
        model, report = optimize(str(source), step.passes, options=options)
        added = set(step.added)
        step.rewritten = ", ".join(
            f"{p.name} {p.result.sites_rewritten}/{p.result.sites_matched}" for p in report.passes
            if p.name in added and registry.get_pass(p.name).is_fusion and p.auto is None
        )
        save_model(model, path, external_data=True if model.weights_nbytes() > LARGE_MODEL_BYTES else None)
        del model, report
        gc.collect()
        step.path = str(path)
        manifest["steps"][path.name] = {"label": step.label, "passes": step.passes, "rewritten": step.rewritten}
        manifest_path.write_text(json.dumps(manifest, indent=2))
    return steps


def bench_ablation(source: str | Path, names: list[str], work: str | Path, *, extra: list[str] = (),
                   extra_labels: list[str] | None = None, inputs: InputSpec | None = None, seed: int = 0,
                   options: dict[str, dict] | None = None, log=print, **bench_args) -> tuple[list[AblationStep], BenchReport]:
    """Build the ablation models, then time them and the ``extra`` models on the same inputs (random ones for the source)."""
    extra = [str(p) for p in extra]
    extra_labels = list(extra_labels) if extra_labels else [Path(p).name for p in extra]
    if len(extra_labels) != len(extra):
        raise OnnxoptError(f"{len(extra_labels)} labels for {len(extra)} extra models")
    steps = build_ablation(source, names, work, options=options, log=log)
    feeds = random_feeds(load_model(source), inputs, seed=seed)[0]
    report = bench([s.path for s in steps] + extra, [s.label for s in steps] + extra_labels, feeds=feeds,
                   notes=[s.rewritten for s in steps] + [""] * len(extra), **bench_args)
    return steps, report
