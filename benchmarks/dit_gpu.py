"""One diffusion-transformer call on one GPU: torch eager / torch.compile against ONNX Runtime's CUDA EP
(the raw export, ONNX Runtime's own transformers optimizer, onnxopt's ort-cuda in fp16 and bf16, and in
fp16 with the opt-in flatten-matmul pass: every Linear as one 2-D GEMM).

    python -m benchmarks.dit_gpu --family sd35-medium --work /tmp/dit-bench --budget 540 --out OUT
    python -m benchmarks.dit_gpu --family flux-dev --work /tmp/dit-bench --budget 540 --out OUT
    python -m benchmarks.dit_gpu --family sd35-medium --dry-run --exporter torchscript --work /tmp/dit-dry  # CPU

Models (``models.dit``, seeded random weights from the published configs), at 1024x1024 (latent 128x128):

  sd35-medium  SD3Transformer2DModel shaped as SD3.5 Medium (2.24 B), batch 2 (CFG), 333 text tokens;
               built and exported in float32 (9 GB): every low-precision row rounds the same fp32 weights.
  flux-dev     FluxTransformer2DModel shaped as FLUX.1-dev (11.9 B), batch 1, 512 T5 tokens, guidance;
               built and exported in bfloat16 (24 GB; fp32 is 48 GB and its export plus one optimized
               copy overflow the 64 GB disk): the fp32 reference is those bf16 weights upcast.

Steps, each resumable (recorded in <work>/<family>/results.json, skipped when present; the script
stops between steps once --budget seconds have passed: rerun the same command until it prints the
table). Estimates for one H100 host (16 cores, 128 GB), SD3.5-Medium / Flux-dev:

  export          ``models.bigexport.export_folder`` (``python -m models export``): build in the source
                  dtype, export (dynamo by default), weights streamed to one data file.
                  ~3 min, 20 GB RSS / ~8-10 min, 50 GB RSS (may need its own call: see the report)
  reference       torch fp32 on the GPU from the source weights (bf16 ones upcast), inputs saved.
                  ~1 min, 9 GB GPU / ~3 min (build 1-2 min), 48 GB GPU
  build:raw       the export as the exporter wrote it, in low precision: fp32 source -> onnxopt's fp16
                  pass alone (``cleanup,fp16``, no fusion); bf16 source: the export itself.
                  ~2 min / nothing
  build:ort       ``onnxruntime.transformers.optimizer.optimize_model(model_type="mmdit")`` (ORT's model
                  type for SD3.x and Flux; opt_level 0, as its SD pipeline runs it), then its
                  ``convert_float_to_float16(keep_io_types=False)`` for an fp32 source; a subprocess with
                  --ort-pythonpath first (numpy 1.26). ~4 min, 30 GB RSS / ~6 min, 60 GB RSS
  build:onnxopt-fp16, build:onnxopt-bf16
                  ``onnxopt optimize --passes ort-cuda,fp16 --low-precision float16|bfloat16 --external-data``.
  build:onnxopt-fp16-flat
                  the same in fp16 with ``--passes ort-cuda,fp16,flatten-matmul`` (each MatMul of a 3-D input
                  by a constant weight as Reshape, 2-D MatMul, Reshape), timed next to onnxopt-fp16.
                  ~3 min, < 10 GB RSS each / ~8 min each (run with --budget that leaves it a call of its own)
  row:<label>     one ORT session (IO binding, CUDA graph; without when capture fails, said in the row),
                  warm-up, median of --runs with CUDA events, accuracy against the reference, GPU kernels
                  by family (torch.profiler/CUPTI, grouped as benchmarks.kernels_gpu does); then the
                  model's files are removed (--keep-models keeps them: Flux's copies are 24 GB each).
                  ~1 min, 5 GB GPU / ~2-3 min (session creation), 26 GB GPU
  torch:eager-bf16, torch:eager-fp16, torch:compile-bf16
                  the module cast to that dtype; compile = torch.compile(mode="reduce-overhead",
                  fullgraph=True) with its compile time; median of --runs with CUDA events; kernels by family.
                  ~1 min each (compile ~1.5 min) / ~2-3 min each (compile ~3 min), 26 GB GPU

export, build:ort and the onnxopt builds run as detached processes (:func:`detached`): a call whose budget
ends while one runs stops there, and the next call waits for the same process where the machine kept it
(or starts it over). --results-from OUT/results.json carries the rows of an earlier machine to a fresh one.
Every row frees its GPU and host memory before the next. --skip drops rows (raw, ort, onnxopt-fp16,
onnxopt-fp16-flat, onnxopt-bf16, eager-bf16, eager-fp16, compile-bf16). --dry-run: the tiny configs, float32, CPU, ORT's
CPU provider with host timing, no torch.compile and no ORT fp16 conversion: every step once, to test
the script (a few minutes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.cuda_timing import timed
from benchmarks.kernels_gpu import family as kernel_family
from benchmarks.pipeline_gpu import free_device_memory
from benchmarks.unet_gpu import Steps, ort_cuda_chain

SOURCE_DTYPE = {"sd35-medium": "float32", "flux-dev": "bfloat16"}
ORT_ROWS = ("raw", "ort", "onnxopt-fp16", "onnxopt-fp16-flat", "onnxopt-bf16")
TORCH_ROWS = {"eager-bf16": ("bfloat16", False), "eager-fp16": ("float16", False), "compile-bf16": ("bfloat16", True)}
# ONNX element types (TensorProto) of the inputs/outputs the sessions bind, by ORT's type string.
ONNX_TYPES = {"tensor(float)": 1, "tensor(float16)": 10, "tensor(bfloat16)": 16, "tensor(double)": 11,
              "tensor(int64)": 7, "tensor(int32)": 6}
# ONNX Runtime's transformers optimizer as its SD3/Flux pipeline runs it (models/stable_diffusion/
# optimize_pipeline.py: the transformer is model type "mmdit", opt_level 0, then fp16 with keep_io_types=False).
ORT_OPTIMIZE_MMDIT = r"""
import sys
from collections import Counter
from onnxruntime.transformers.optimizer import optimize_model
from onnxruntime.transformers.fusion_options import FusionOptions
m = optimize_model(sys.argv[1], model_type="mmdit", num_heads=0, hidden_size=0, opt_level=0,
                   optimization_options=FusionOptions("mmdit"), use_gpu=True)
if sys.argv[3] == "fp16":
    m.convert_float_to_float16(keep_io_types=False)
m.save_model_to_file(sys.argv[2], use_external_data_format=True)
print(dict(Counter(n.op_type for n in m.model.graph.node if n.domain == "com.microsoft" or n.op_type in
                   ("LayerNormalization", "SimplifiedLayerNormalization"))))
"""


class Bench:
    def __init__(self, args):
        self.args, self.family, self.dry = args, args.family, args.dry_run
        self.size = "tiny" if self.dry else "full"
        self.device = "cpu" if self.dry else "cuda"
        self.source_dtype = "float32" if self.dry else (args.source_dtype or SOURCE_DTYPE[self.family])
        self.runs, self.warmup = (2, 1) if self.dry else (args.runs, args.warmup)
        self.work = args.work / self.family
        self.work.mkdir(parents=True, exist_ok=True)
        self.export_dir = self.work / "export"
        self.source = self.export_dir / "model.onnx"

    # --- models -----------------------------------------------------------------------------

    def build_torch(self):
        """The seeded module in the source dtype (the weights every row rounds), eval, on the CPU."""
        import torch

        from models import build

        dtype = None if self.source_dtype == "float32" else getattr(torch, self.source_dtype)
        return build(self.family, self.size, seed=self.args.seed, **({"dtype": dtype} if dtype else {}))

    def export(self) -> dict:
        """``python -m models export`` (models/bigexport.py) in a detached process (see :func:`detached`)."""
        if not (self.export_dir / "export.json").is_file():
            shutil.rmtree(self.export_dir, ignore_errors=True)  # never a half-written folder: bigexport renames into place
            for partial in self.work.glob(".export.partial-*"):
                shutil.rmtree(partial, ignore_errors=True)
        argv = [sys.executable, "-m", "models", "export", self.family, "--size", self.size, "--exporter", self.args.exporter,
                "--dtype", self.source_dtype, "--seed", str(self.args.seed), "-o", str(self.export_dir)]
        rc = detached(self.work, "export", argv, self.deadline)
        if rc != 0:
            raise RuntimeError(f"models export exited {rc}: {last_line(self.work / 'export.log')}")
        summary = json.loads((self.export_dir / "export.json").read_text())
        return {"path": str(self.source), "seconds": summary["seconds"], "num_nodes": summary["num_nodes"],
                "peak_rss_gb": summary["peak_rss_gb"], "bytes": sum(summary["files"].values())}

    def reference(self) -> dict:
        import torch

        built = self.build_torch()
        feeds = built.make_feeds()
        module = built.module.to(self.device, torch.float32)
        with torch.no_grad():
            out = module(*self.inputs(built.input_names, feeds, torch.float32))[0]
        np.savez(self.work / "reference.npz", output=out.float().cpu().numpy(), **{f"in_{k}": v for k, v in feeds.items()})
        del module, built, out
        release()
        return {"output_shape": list(self.reference_output().shape), "dims": self.dims()}

    def dims(self) -> dict:
        from models.dit import EXAMPLE_DIMS

        return dict(EXAMPLE_DIMS["tiny" if self.dry else ("full-flux" if self.family.startswith("flux") else "full-sd3")])

    def reference_output(self) -> np.ndarray:
        return np.load(self.work / "reference.npz")["output"]

    def feeds(self) -> dict:
        ref = np.load(self.work / "reference.npz")
        return {k[3:]: ref[k] for k in ref.files if k.startswith("in_")}

    def inputs(self, names, feeds, dtype):
        import torch

        return [torch.from_numpy(feeds[n]).to(self.device, dtype if feeds[n].dtype.kind == "f" else None) for n in names]

    # --- ONNX models ------------------------------------------------------------------------

    def build_raw(self) -> dict:
        if self.dry or self.source_dtype != "float32":
            return {"path": str(self.source), "note": f"the export as written ({self.source_dtype})"}
        return self.onnxopt_cli("raw", ["cleanup", "fp16"], "float16")

    def build_ort(self) -> dict:
        convert = "none" if self.dry or self.source_dtype != "float32" else "fp16"
        dst = self.work / "ort" / "model.onnx"
        dst.parent.mkdir(parents=True, exist_ok=True)
        env = {"PYTHONPATH": f"{self.args.ort_pythonpath}:{os.environ.get('PYTHONPATH', '')}"}
        t0 = time.time()
        rc = detached(self.work, "ort", [sys.executable, "-c", ORT_OPTIMIZE_MMDIT, str(self.source), str(dst), convert],
                      self.deadline, env)
        if rc != 0:
            raise RuntimeError(f"ONNX Runtime's optimizer exited {rc}: {last_line(self.work / 'ort.log', 'rror')}")
        return {"path": str(dst), "fused": last_line(self.work / "ort.log"), "seconds": time.time() - t0}

    def build_onnxopt(self, low: str, flat: bool = False) -> dict:
        """ort-cuda then ``low``; ``flat``: then flatten-matmul (the onnxopt-fp16-flat row)."""
        # dry run: fp32 (ORT's CPU provider lacks float16/bfloat16 kernels for most of these ops) and no
        # NhwcConv (a CUDA-only op): every other pass of the preset runs on ORT's CPU provider
        passes = ort_cuda_chain(leave_out=("nhwc-conv",)) if self.dry else ["ort-cuda", "fp16"]
        label = f"onnxopt-{'bf16' if low == 'bfloat16' else 'fp16'}" + ("-flat" if flat else "")
        return self.onnxopt_cli(label, passes + ["flatten-matmul"] * flat, None if self.dry else low)

    def onnxopt_cli(self, label: str, passes: list[str], low: str | None) -> dict:
        """``onnxopt optimize`` (the CLI) in a detached process; the fused sites from its JSON report."""
        dst = self.work / label / "model.onnx"
        report = dst.with_suffix(".report.json")
        dst.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "onnxopt", "optimize", "-i", str(self.source), "-o", str(dst),
                "--passes", ",".join(passes), "--external-data", "--report-json", str(report), "-q"]
        if low:
            argv += ["--low-precision", low]
        rc = detached(self.work, label, argv, self.deadline)
        if rc != 0:
            raise RuntimeError(f"onnxopt exited {rc}: {last_line(self.work / f'{label}.log')}")
        r = json.loads(report.read_text())
        fused = {p["pass"]: f"{p['sites_rewritten']}/{p['sites_matched']}" for p in r["passes"]
                 if p["pass"].startswith(("fuse", "nhwc", "flatten")) and not p.get("companion")}
        return {"path": str(dst), "fused": fused, "seconds": r["seconds"],
                "peak_rss_gb": (r.get("peak_rss_mb_after_save") or 0) / 1e3}

    def ort_row(self, label: str, path: str) -> dict:
        """Time, accuracy and kernels of one ORT model; CUDA graph, or without it when the capture fails."""
        feeds = self.feeds()

        def opened(cuda_graph: bool) -> BoundSession:
            session = BoundSession(path, self.device, cuda_graph=cuda_graph)
            session.bind(feeds, {session.session.get_outputs()[0].name: list(self.reference_output().shape)})
            session.run()  # with a CUDA graph: the capture
            return session

        first_error = None
        try:
            session = opened(cuda_graph=not self.dry)
        except Exception as exc:  # noqa: BLE001 - no CUDA graph for this model: say why, keep the row
            if self.dry:
                raise
            first_error, session = str(exc).splitlines()[0][:160], None
        if session is None:  # out of the except block: the failed session's frames are gone
            release()
            session = opened(cuda_graph=False)
        try:
            result = {"cuda_graph": not self.dry and first_error is None,
                      **accuracy(session.output(), self.reference_output()),
                      **timed(session.run, self.warmup, self.runs, self.device)}
            if first_error:
                result["note"] = f"no CUDA graph: {first_error}"
            if not self.dry:
                result["kernels"] = kernels_by_family(session.run, max(3, self.runs // 4))
        finally:
            del session
            release()
        if not self.args.keep_models and Path(path).parent != self.export_dir:
            shutil.rmtree(Path(path).parent, ignore_errors=True)  # Flux's copies are 24 GB each
        return result

    def torch_row(self, dtype_name: str, compiled: bool) -> dict:
        import torch

        if compiled and self.dry:
            return {"skipped": "dry run (reduce-overhead captures CUDA graphs)"}
        dtype = getattr(torch, dtype_name)
        built = self.build_torch()
        feeds = self.feeds()
        module = built.module.to(self.device, dtype)
        inputs = self.inputs(built.input_names, feeds, dtype)
        result = {}
        with torch.no_grad():
            fn = module
            if compiled:
                t0 = time.perf_counter()
                fn = torch.compile(module, mode="reduce-overhead", fullgraph=True)
                for _ in range(3):
                    output = fn(*inputs)[0].clone()  # reduce-overhead reuses its output buffers
                torch.cuda.synchronize()
                result["compile_s"] = time.perf_counter() - t0
            else:
                output = fn(*inputs)[0]
            result.update(accuracy(output.float().cpu().numpy(), self.reference_output()))
            result.update(timed(lambda: fn(*inputs), self.warmup, self.runs, self.device))
            if not self.dry:
                result["kernels"] = kernels_by_family(lambda: fn(*inputs), max(3, self.runs // 4))
        del fn, module, built, inputs, output
        if compiled:
            torch._dynamo.reset()
        release()
        return result


class BoundSession:
    """An ORT session run through IO binding on torch-owned buffers, so bfloat16 inputs and outputs
    (which numpy lacks, and onnxopt.runners.ort_cuda binds as float32) are bound as they are."""

    def __init__(self, path: str, device: str, cuda_graph: bool):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        if device == "cuda":
            import torch

            options = {"enable_cuda_graph": "1" if cuda_graph else "0",
                       "user_compute_stream": str(torch.cuda.current_stream().cuda_stream)}
            providers = [("CUDAExecutionProvider", options)]
        else:
            providers = ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(path), so, providers=providers)
        if device == "cuda" and self.session.get_providers()[0] != "CUDAExecutionProvider":
            raise RuntimeError("ONNX Runtime fell back from the CUDA EP")
        self.device, self.binding, self.buffers = device, None, {}

    def bind(self, feeds: dict, output_shapes: dict | None = None) -> None:
        """Bind ``feeds`` (cast to the model's input types) and output buffers of ``output_shapes``
        (required with a CUDA graph: its session captures on its first run, which must already see the
        final buffers; without one, one run with ORT-allocated outputs tells their shapes)."""
        import torch

        by_onnx = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16, 11: torch.float64, 7: torch.int64, 6: torch.int32}
        binding = self.session.io_binding()
        for i in self.session.get_inputs():
            kind = ONNX_TYPES[i.type]
            t = torch.from_numpy(np.ascontiguousarray(feeds[i.name])).to(self.device, by_onnx[kind]).contiguous()
            self.buffers[i.name] = t
            binding.bind_input(i.name, self.device, 0, kind, list(t.shape), t.data_ptr())
        shapes = output_shapes
        if shapes is None:
            probe = self.session.io_binding()
            for i in self.session.get_inputs():
                t = self.buffers[i.name]
                probe.bind_input(i.name, self.device, 0, ONNX_TYPES[i.type], list(t.shape), t.data_ptr())
            for o in self.session.get_outputs():
                probe.bind_output(o.name, self.device, 0)
            self.session.run_with_iobinding(probe)
            shapes = {o.name: v.shape() for o, v in zip(self.session.get_outputs(), probe.get_outputs())}
        for o in self.session.get_outputs():
            kind = ONNX_TYPES[o.type]
            t = torch.empty(shapes[o.name], dtype=by_onnx[kind], device=self.device)
            self.buffers["out:" + o.name] = t
            binding.bind_output(o.name, self.device, 0, kind, list(t.shape), t.data_ptr())
        self.binding = binding

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)

    def output(self) -> np.ndarray:
        name = self.session.get_outputs()[0].name
        return self.buffers["out:" + name].float().cpu().numpy()


def detached(work: Path, name: str, argv: list[str], deadline: float, env: dict | None = None) -> int:
    """Run ``argv`` in a process of its own session, logging to <work>/<name>.log, and wait for it until
    ``deadline``; its exit status, or TimeoutError while it still runs. A later call finds it running
    (where the machine keeps a call's processes) and waits again, or finds it gone without a status
    and starts it over: the heavy CPU steps are not tied to one call's time limit where they may outlive it."""
    import subprocess

    rc_file, pid_file, log = work / f"{name}.rc", work / f"{name}.pid", work / f"{name}.log"
    if not rc_file.exists() and not alive(pid_file):
        command = f"{shlex.join(argv)} > {shlex.quote(str(log))} 2>&1; echo $? > {shlex.quote(str(rc_file))}.tmp; " \
                  f"mv {shlex.quote(str(rc_file))}.tmp {shlex.quote(str(rc_file))}"
        proc = subprocess.Popen(["bash", "-c", command], start_new_session=True, env={**os.environ, **(env or {})})
        pid_file.write_text(str(proc.pid))
    while not rc_file.exists():
        if time.time() > deadline:
            raise TimeoutError(f"{name} (still running, log {log})")
        if not alive(pid_file):
            time.sleep(1)  # the status file is written just before the process ends
            if not rc_file.exists():
                raise RuntimeError(f"{name}: the process ended without a status ({last_line(log)})")
        time.sleep(2)
    rc = int(rc_file.read_text().strip() or 1)
    if rc != 0:  # a failed run is retried on the next call, not recorded as done
        rc_file.unlink()
    return rc


def alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except (OSError, ValueError):
        return False
    try:  # a zombie child of this process counts as ended
        return os.waitpid(int(pid_file.read_text()), os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def last_line(path: Path, containing: str = "") -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip() and containing in line] \
        if path.exists() else []
    return lines[-1][:200] if lines else "no output"


def release() -> None:
    gc.collect()
    free_device_memory()


def accuracy(output: np.ndarray, expected: np.ndarray) -> dict:
    output = np.asarray(output, np.float32)
    return {"max_abs": float(np.abs(output - expected).max()),
            "rel_l2": float(np.linalg.norm(output - expected) / max(np.linalg.norm(expected), 1e-30)),
            "finite": bool(np.isfinite(output).all())}


def kernels_by_family(fn, runs: int) -> dict:
    """GPU kernel time per call by family (benchmarks.kernels_gpu's grouping), from torch.profiler's CUPTI
    trace, which sees ONNX Runtime's kernels as well as torch's; ``busy_ms`` is their sum."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    families: Counter = Counter()
    top: Counter = Counter()
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us and event.key and not event.key.startswith(("cudaLaunch", "cudaMemcpy", "cudaStream", "cudaGraph")):
            families[kernel_family(event.key)] += us / 1e3 / runs
            top[event.key[:100]] += us / 1e3 / runs
    return {"busy_ms": sum(families.values()), "families": dict(families), "top": dict(top.most_common(8))}


ROW_TITLES = {"raw": "raw ONNX (as exported, no fusion)", "ort": "ONNX Runtime transformers optimizer (mmdit)",
              "onnxopt-fp16": "onnxopt ort-cuda fp16",
              "onnxopt-fp16-flat": "onnxopt ort-cuda fp16 + flatten-matmul", "onnxopt-bf16": "onnxopt ort-cuda bf16",
              "eager-bf16": "torch eager bf16", "eager-fp16": "torch eager fp16",
              "compile-bf16": "torch.compile(reduce-overhead, fullgraph) bf16"}
FAMILY_COLUMNS = ("gemm", "attention", "normalization", "elementwise", "fused elementwise", "transpose/copy", "convolution", "other")


def table(family: str, results: dict, dry: bool) -> str:
    ref = results.get("reference", {})
    head = f"### {family}: one call at {ref.get('dims', '?')}" + (" (DRY RUN: tiny, fp32, CPU)" if dry else "")
    lines = [head, "", "| row | ms | vs torch.compile | CUDA graph | rel L2 vs fp32 | max abs | fused / note |",
             "|---|---|---|---|---|---|---|"]
    compiled = (results.get("torch:compile-bf16") or {}).get("median_ms")
    rows = [(label, f"row:{label}", f"build:{label}") for label in ORT_ROWS] + [(label, f"torch:{label}", None) for label in TORCH_ROWS]
    for label, key, build_key in rows:
        r, built = results.get(key), results.get(build_key, {}) if build_key else {}
        if r is None and not built:
            continue
        r = r or {}
        problem = built.get("error") or r.get("error") or r.get("skipped")
        if "median_ms" not in r:
            lines.append(f"| {ROW_TITLES[label]} | {str(problem or 'not run')[:100]} | | | | | |")
            continue
        ratio = f"{r['median_ms'] / compiled:.2f}x" if compiled else ""
        graph = {True: "on", False: "off"}.get(r.get("cuda_graph"), "")
        note = r.get("note") or built.get("note") or fused_summary(built.get("fused")) or (f"compile {r['compile_s']:.0f} s" if "compile_s" in r else "")
        lines.append(f"| {ROW_TITLES[label]} | {r['median_ms']:.2f} | {ratio} | {graph} | {r['rel_l2']:.3g} | {r['max_abs']:.3g} | {str(note)[:160]} |")
    profiled = [(label, results[key]["kernels"]) for label, key, _ in rows if "kernels" in (results.get(key) or {})]
    if profiled:
        lines += ["", "GPU kernel time per call by family (ms; torch.profiler/CUPTI):", "",
                  "| row | busy | " + " | ".join(FAMILY_COLUMNS) + " |", "|---|---|" + "---|" * len(FAMILY_COLUMNS)]
        for label, k in profiled:
            fam = k["families"]
            lines.append(f"| {ROW_TITLES[label]} | {k['busy_ms']:.2f} | " + " | ".join(f"{fam.get(f, 0):.2f}" for f in FAMILY_COLUMNS) + " |")
    return "\n".join(lines)


def fused_summary(fused) -> str:
    """onnxopt's {pass: "rewritten/matched"} less the passes that found nothing; ORT's op counts as given."""
    if isinstance(fused, dict):
        return ", ".join(f"{name.removeprefix('fuse-')} {sites}" for name, sites in fused.items() if not str(sites).startswith("0/0"))
    return str(fused or "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=sorted(SOURCE_DTYPE), required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dit-bench"))
    ap.add_argument("--budget", type=float, default=540, help="seconds; stop between steps after this")
    ap.add_argument("--out", type=Path, help="copy results.json and table.md here")
    ap.add_argument("--exporter", choices=["dynamo", "torchscript"], default="dynamo")
    ap.add_argument("--source-dtype", choices=["float32", "bfloat16"],
                    help="dtype the model is built and exported in (default: float32 for sd35-medium, bfloat16 for "
                         "flux-dev; Flux in float32 needs a 128 GB disk and about 100 GB of RAM for ORT's optimizer)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=20, help="timed calls (median reported)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ort-pythonpath", default="/tmp/np1", help="put first on sys.path for ORT's optimizer (numpy 1.26)")
    ap.add_argument("--skip", default="", help=f"comma-separated rows not to build or time: {', '.join([*ORT_ROWS, *TORCH_ROWS])}")
    ap.add_argument("--results-from", type=Path, help="results.json of an earlier machine (its --out): its rows are kept, "
                    "the steps whose files are gone run again")
    ap.add_argument("--keep-models", action="store_true", help="keep each row's ONNX files after timing it")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny configs, fp32, every step once (no torch.compile)")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - {*ORT_ROWS, *TORCH_ROWS}
    if unknown:
        ap.error(f"--skip: unknown rows {', '.join(sorted(unknown))}")
    bench = Bench(args)
    steps = Steps(bench.work, args.budget)
    bench.deadline = steps.deadline
    if args.results_from:  # an earlier machine's results: its rows stand, its files are gone
        earlier = json.loads(args.results_from.read_text())
        steps.results = {**earlier, **steps.results}
    forget_missing_files(steps, bench)
    builds = {"raw": bench.build_raw, "ort": bench.build_ort,
              "onnxopt-fp16": lambda: bench.build_onnxopt("float16"),
              "onnxopt-fp16-flat": lambda: bench.build_onnxopt("float16", flat=True), "onnxopt-bf16": lambda: bench.build_onnxopt("bfloat16")}
    done = True
    try:
        steps.run("export", bench.export)
        steps.run("reference", bench.reference)
        for label in ORT_ROWS:  # build, then time and delete, one model at a time (disk: Flux's are 24 GB)
            if label in skip:
                continue
            built = steps.run(f"build:{label}", lambda label=label: guarded(builds[label]))
            if "path" in built:
                steps.run(f"row:{label}", lambda label=label, path=built["path"]: guarded(lambda: bench.ort_row(label, path)))
        for label, (dtype, compiled) in TORCH_ROWS.items():
            if label not in skip:
                steps.run(f"torch:{label}", lambda d=dtype, c=compiled: guarded(lambda: bench.torch_row(d, c)))
    except TimeoutError as stop:
        print(f"budget spent before step '{stop}': rerun the same command to continue", flush=True)
        done = False
    text = table(args.family, steps.results, args.dry_run)
    print(text)
    steps.save(args.out, text)
    return 0 if done else 3


def forget_missing_files(steps, bench) -> None:
    """Steps whose files are gone (a fresh machine) run again where something still needs them: the
    export and the reference for any row not done, a build for its row not done."""
    results = steps.results
    pending = [k for k in ORT_ROWS if f"row:{k}" not in results] + \
              [k for k in TORCH_ROWS if f"torch:{k}" not in results]
    if not pending:
        return
    if not bench.source.is_file():
        results.pop("export", None)
    if not (bench.work / "reference.npz").is_file():
        results.pop("reference", None)
    for label in ORT_ROWS:
        built = results.get(f"build:{label}", {})
        if f"row:{label}" not in results and "path" in built and not Path(built["path"]).is_file():
            results.pop(f"build:{label}")
    steps.results_path.write_text(json.dumps(results, indent=2, default=str))


def guarded(fn) -> dict:
    """``fn()``, or its error as the row's result: one row failing keeps the others."""
    try:
        return fn()
    except TimeoutError:  # the budget, not a failure: the step runs again on the next call
        raise
    except Exception as exc:  # noqa: BLE001
        release()
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}


if __name__ == "__main__":
    sys.exit(main())
