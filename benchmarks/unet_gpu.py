"""SD1.5-architecture UNet on the ORT CUDA EP: raw fp16 vs ONNX Runtime's optimizer vs onnxopt.

    python -m benchmarks.unet_gpu --work /tmp/unet-bench --budget 540 [--variants ts-dynamic,ts-static,dynamo-dynamic]
    python -m benchmarks.unet_gpu --family unet-sdxl --variants ts-static --skip ort --fp8 --work /tmp/sdxl-fp8

For each export variant (same seeded random weights), it builds:
  raw        the export converted to fp16 by onnxopt's fp16 pass, no fusion;
  ort        ONNX Runtime's transformers optimizer as its SD pipeline runs it (opt_level 0, packed
             QKV/KV and BiasAdd on, then its convert_float_to_float16); run in a subprocess with
             ``--ort-pythonpath`` first on sys.path (numpy 1.26: it crashes under numpy >= 2.4);
  onnxopt    ``ort-cuda`` preset, then fp16;
  fp8        (``--fp8``, opt-in) onnxopt, then fp8-linear: the Linears as float8 GemmFloat8, activation
             scales calibrated on the family's inputs of another seed than the timed ones (min_macs=0:
             dynamic exports have no static token count to judge by);
and times each with IO binding, CUDA graph off and on (batch 2, 64x64 latent, 77 tokens), and
compares its output with torch's fp32 output on the GPU (max abs error, relative L2).

The torch peers, from the same weights and inputs (``--torch``, on by default with CUDA; rows
"torch eager" and "torch.compile"): the fp16 module in channels_last, eager (plain, and replayed as
one captured torch.cuda.CUDAGraph) and under ``torch.compile(mode="reduce-overhead", fullgraph=True)``
with ``torch._inductor.config.conv_1x1_as_mm = True`` (as the pipeline benchmark compiles the UNet).
The ratio column is against the best peer of the run: the fastest of ONNX Runtime's optimizer's
model (any export, CUDA graph or not) and the torch rows.

Steps are resumable: each writes its result under --work and is skipped when it exists, and the
script stops between steps once --budget seconds have passed, so a run can be split over several
calls of a time-limited machine. Results accumulate in <work>/results.json; the markdown table is
printed at the end of every call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.cuda_timing import timed as median_time

VARIANTS = {"ts-dynamic": ("torchscript", "dynamic"), "ts-static": ("torchscript", "static"), "dynamo-dynamic": ("dynamo", "dynamic")}
DIMS = dict(batch=2, height=64, width=64, sequence=77)
# The latent size each family is run at (its native image size / 8), batch 2 for guidance.
FAMILY_DIMS = {"unet-sd15": DIMS, "unet-sd21": dict(DIMS, height=96, width=96),
               "unet-sdxl": dict(DIMS, height=128, width=128)}
ORT_OPTIMIZE = r"""
import sys, onnx
from onnxruntime.transformers.optimizer import optimize_model
from onnxruntime.transformers.fusion_options import FusionOptions
options = FusionOptions("unet")
options.enable_packed_kv = True
options.enable_packed_qkv = True
options.enable_bias_add = True
m = optimize_model(sys.argv[1], model_type="unet", num_heads=0, hidden_size=0, opt_level=0, optimization_options=options, use_gpu=True)
m.convert_float_to_float16(keep_io_types=False, op_block_list=[])
m.save_model_to_file(sys.argv[2], use_external_data_format=True)
from collections import Counter
print(dict(Counter(n.op_type for n in m.model.graph.node if n.domain == "com.microsoft")))
"""


class Steps:
    def __init__(self, work: Path, budget: float):
        self.work, self.deadline = work, time.time() + budget
        self.results_path = work / "results.json"
        self.results = json.loads(self.results_path.read_text()) if self.results_path.exists() else {}
        self.ran = 0  # steps this process ran

    def out_of_time(self) -> bool:
        return time.time() > self.deadline

    def record(self, key: str, value) -> None:
        """Record ``key`` on top of what the file holds now: two processes may run different steps of one
        --work at once (Flux's T5 export beside its transformer's), and neither may drop the other's
        record. Written to a temporary file and renamed, so a reader never sees half a file."""
        if self.results_path.exists():
            self.results = {**json.loads(self.results_path.read_text()), **self.results}
        self.results[key] = value
        partial = self.results_path.with_name(f".{self.results_path.name}.{os.getpid()}")
        partial.write_text(json.dumps(self.results, indent=2, default=str))
        os.replace(partial, self.results_path)

    def save(self, out: Path | None, text: str) -> None:
        """Copy results.json and the printed table to ``out`` (nothing without one)."""
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(self.results, indent=2, default=str))
        (out / "table.md").write_text(text + "\n")

    def run(self, key: str, fn, alone: bool = False):
        """``fn``'s result, recorded under ``key`` (or the recorded one). ``alone``: a step that needs a
        call of its own (minutes of a 10-minute call): it runs only as this process's first step."""
        if key in self.results:
            return self.results[key]
        if self.out_of_time() or alone and self.ran:
            raise TimeoutError(key)
        t0 = time.time()
        print(f"[{key}] ...", flush=True)
        self.ran += 1
        value = fn()
        self.record(key, value)
        print(f"[{key}] done in {time.time() - t0:.0f} s: {str(value)[:300]}", flush=True)
        return value


def export_variant(work: Path, variant: str, size: str, family: str = "unet-sd15") -> dict:
    from models import build
    from models.export import export

    exporter, shapes = VARIANTS[variant]
    built = build(family, size=size)
    path = work / variant / "raw.onnx"
    result = export(built, path, exporter=exporter, shapes=shapes)
    return {"path": str(path), "seconds": result.seconds, "files": len(result.files), "bytes": result.total_bytes}


def torch_reference(work: Path, size: str, family: str = "unet-sd15") -> dict:
    import torch

    from models import build

    built = build(family, size=size)
    feeds = built.make_feeds(FAMILY_DIMS[family] if size == "full" else None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    module = built.module.to(device).float().eval()
    with torch.no_grad():
        out = module(*[torch.from_numpy(feeds[n]).to(device) for n in built.input_names])
    out = out[0] if isinstance(out, (tuple, list)) else out
    np.savez(work / "reference.npz", output=out.float().cpu().numpy(), **{f"in_{k}": v for k, v in feeds.items()})
    return {"output_shape": list(out.shape)}


def torch_timed(work: Path, size: str, family: str, compiled: bool, runs: int) -> dict:
    """The torch fp16 module on the reference inputs: eager (plain and CUDA graph), or compiled."""
    import torch

    from models import build

    built = build(family, size=size)
    ref = np.load(work / "reference.npz")
    inputs = [torch.from_numpy(ref[f"in_{n}"]).cuda() for n in built.input_names]
    inputs = [t.half() if t.is_floating_point() else t for t in inputs]
    inputs = [t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in inputs]
    module = built.module.cuda().half().eval().to(memory_format=torch.channels_last)

    def first(out):
        return out[0] if isinstance(out, (tuple, list)) else out

    def timed(fn) -> dict:
        return median_time(fn, 10, runs)

    def accuracy(output) -> dict:
        output, expected = output.float().cpu().numpy(), ref["output"]
        return {"max_abs": float(np.abs(output - expected).max()),
                "rel_l2": float(np.linalg.norm(output - expected) / np.linalg.norm(expected)),
                "finite": bool(np.isfinite(output).all())}

    with torch.no_grad():
        if compiled:
            import torch._inductor.config as inductor

            inductor.conv_1x1_as_mm = True
            t0 = time.perf_counter()
            fn = torch.compile(module, mode="reduce-overhead", fullgraph=True)
            for _ in range(3):
                output = first(fn(*inputs)).clone()  # reduce-overhead reuses its output buffers
            torch.cuda.synchronize()
            result = {"compile_s": time.perf_counter() - t0, **accuracy(output)}
            return {"1": dict(timed(lambda: fn(*inputs)), **result)}
        output = first(module(*inputs)).clone()
        plain = dict(timed(lambda: module(*inputs)), **accuracy(output))
        stream = torch.cuda.Stream()  # warm up off the default stream before capture, as torch's docs do
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                module(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = first(module(*inputs))
        graph.replay()
        torch.cuda.synchronize()
        replayed = dict(timed(graph.replay), **accuracy(captured))
        return {"0": plain, "1": replayed}


TORCH_LABELS = {"torch-eager": False, "torch-compile": True}


def ort_cuda_chain(leave_out=()) -> list[str]:
    """The ort-cuda preset, or its passes less ``leave_out``."""
    from onnxopt.registry import PRESETS

    if not leave_out:
        return ["ort-cuda"]
    unknown = set(leave_out) - set(PRESETS["ort-cuda"].passes)
    if unknown:
        raise SystemExit(f"not in the ort-cuda preset: {', '.join(sorted(unknown))}")
    return [p for p in PRESETS["ort-cuda"].passes if p not in leave_out]


def onnxopt_fp16(src: Path, dst: Path, passes: list[str], options: dict | None = None) -> dict:
    import onnxopt

    model, report = onnxopt.optimize(str(src), passes, options=options)
    onnxopt.save_model(model, dst, external_data=True)
    fused = {p.name: f"{p.result.sites_rewritten}/{p.result.sites_matched}" for p in report.passes if p.name.startswith(("fuse", "nhwc"))}
    return {"path": str(dst), "fused": fused, "seconds": report.seconds}


def onnxopt_fp8(src: Path, dst: Path, passes: list[str], size: str, family: str, built: dict | None = None) -> dict:
    """onnxopt's ort-cuda + fp16 (``built``: that model, already written), then fp8-linear calibrated on
    one input of seed 1 (the timed one is seed 0)."""
    from models import build

    import onnxopt

    if built and "path" in built:  # the onnxopt row's model: no second ort-cuda,fp16 run (169 s on SDXL)
        src, passes = Path(built["path"]), []
    calibration = build(family, size=size, seed=1).make_feeds(FAMILY_DIMS[family] if size == "full" else None)
    model, report = onnxopt.optimize(str(src), [*passes, "fp8-linear"],
                                     options={"fp8-linear": {"calibration": [calibration], "min_macs": 0}})
    onnxopt.save_model(model, dst, external_data=True)
    fused = {p.name: f"{p.result.sites_rewritten}/{p.result.sites_matched}" for p in report.passes
             if p.name.startswith(("fuse", "nhwc", "fp8"))}
    return {"path": str(dst), "fused": fused, "seconds": report.seconds}


def ort_optimizer(src: Path, dst: Path, ort_pythonpath: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ort_pythonpath}:{os.environ.get('PYTHONPATH', '')}")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", ORT_OPTIMIZE, str(src), str(dst)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
        return {"error": (errors or [f"exit {proc.returncode}"])[-1].strip()}
    return {"path": str(dst), "fused": proc.stdout.strip().splitlines()[-1], "seconds": time.time() - t0}


def measure(work: Path, path: str, cuda_graph: bool, runs: int) -> dict:
    from onnxopt.runners.ort_cuda import OrtCudaSession, gpu_memory_used_mb

    ref = np.load(work / "reference.npz")
    feeds = {k[3:]: ref[k] for k in ref.files if k.startswith("in_")}
    before = gpu_memory_used_mb()
    session = OrtCudaSession(path, cuda_graph=cuda_graph)
    session.bind(feeds)
    session.run()
    output = next(iter(session.outputs().values())).astype(np.float32)
    expected = ref["output"]
    timing = session.time(warmup=10, runs=runs)
    after = gpu_memory_used_mb()
    return {
        "median_ms": timing.median_ms, "min_ms": timing.min_ms, "max_ms": timing.max_ms, "clock": timing.clock,
        "max_abs": float(np.abs(output - expected).max()),
        "rel_l2": float(np.linalg.norm(output - expected) / np.linalg.norm(expected)),
        "finite": bool(np.isfinite(output).all()),
        "gpu_mb": (after - before) if before is not None and after is not None else None,
    }


def _ms(entry) -> float:
    return entry["median_ms"] if entry and "median_ms" in entry else float("nan")


def _cell(entry) -> str:
    """A time, or why there is none (a CUDA graph that could not be captured says so)."""
    if entry and "median_ms" in entry:
        return f"{entry['median_ms']:.2f}"
    return f"failed: {str(entry['error'])[:60]}" if entry and "error" in entry else ""


def _ratio(t: float, best: float) -> str:
    return f"{t / best:.2f}x" if best == best else "(no peer run)"


def parse_extra(text: str) -> tuple[str, dict]:
    """'sep:fuse-attention.layout=separate,nhwc-conv.pointwise=matmul' -> ('sep', {pass: {option: value}});
    an item '-PASS' leaves PASS out of the ort-cuda chain (options["-"] lists those)."""
    label, _, spec = text.partition(":")
    options: dict = {}
    for item in filter(None, spec.split(",")):
        if item.startswith("-"):
            options.setdefault("-", []).append(item[1:])
            continue
        key, _, value = item.partition("=")
        pass_name, _, option = key.rpartition(".")
        options.setdefault(pass_name, {})[option] = {"true": True, "false": False}.get(value, value)
    return label, options


def table(results: dict, variants: list[str], labels=("raw", "ort", "onnxopt")) -> str:
    """One row per (export, model), then the torch rows. The ratio is against the best peer: the
    fastest time (CUDA graph or not) that ONNX Runtime's optimizer's model reached on any export of
    this run, or torch eager / torch.compile."""
    lines = ["| export | model | fused | ms | ms, CUDA graph | best vs best peer | max abs | rel L2 |", "|---|---|---|---|---|---|---|---|"]
    peers = [_ms(results.get(f"time:{v}:ort:{g}")) for v in variants for g in (0, 1)]
    peers += [_ms((results.get(f"torch:{label}") or {}).get(g)) for label in TORCH_LABELS for g in ("0", "1")]
    ort_best = min((t for t in peers if t == t), default=float("nan"))
    for variant in variants:
        for label in labels:
            built = results.get(f"build:{variant}:{label}", {})
            off, on = results.get(f"time:{variant}:{label}:0"), results.get(f"time:{variant}:{label}:1")
            times = [t for t in (_ms(off), _ms(on)) if t == t]
            if not times:
                error = built.get("error") or (off or {}).get("error") or (on or {}).get("error") or "not run"
                lines.append(f"| {variant} | {label} | failed: {str(error)[:90]} | | | | | |")
                continue
            acc = off if off and "max_abs" in off else on
            lines.append(
                f"| {variant} | {label} | {built.get('fused', '')} | {_cell(off)} | {_cell(on)} | "
                f"{_ratio(min(times), ort_best)} | {acc['max_abs']:.3g} | {acc['rel_l2']:.3g} |"
            )
    for label in TORCH_LABELS:
        entry = results.get(f"torch:{label}")
        if not entry:
            continue
        if "error" in entry:
            lines.append(f"| torch | {label} | failed: {str(entry['error'])[:90]} | | | | | |")
            continue
        off, on = entry.get("0"), entry.get("1")
        times = [t for t in (_ms(off), _ms(on)) if t == t]
        acc = on or off
        lines.append(f"| torch | {label} | {'compile %.0f s' % acc['compile_s'] if 'compile_s' in acc else ''} | "
                     f"{_cell(off)} | {_cell(on)} | {_ratio(min(times), ort_best)} | {acc['max_abs']:.3g} | {acc['rel_l2']:.3g} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/unet-bench"))
    ap.add_argument("--budget", type=float, default=540)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--ort-pythonpath", default="/tmp/np1")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--fp16-pass", default="fp16")
    ap.add_argument("--out", type=Path, help="copy results.json and the table here")
    ap.add_argument("--family", default="unet-sd15", choices=sorted(FAMILY_DIMS), help="which UNet (SDXL runs at 128x128)")
    ap.add_argument("--size", default="full", choices=["full", "tiny"], help="tiny: a quick rehearsal of every step")
    ap.add_argument("--extra", action="append", default=[], metavar="LABEL:PASS.OPTION=VALUE,...",
                    help="another onnxopt build with pass options, e.g. sep:fuse-attention.layout=separate")
    ap.add_argument("--skip", default="", help="comma-separated labels not to build or time (e.g. raw, torch-compile)")
    ap.add_argument("--fp8", action="store_true", help="also onnxopt + fp8-linear (opt-in float8 Linears), label fp8")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    steps = Steps(args.work, args.budget)
    variants = args.variants.split(",")
    extras = dict(parse_extra(e) for e in args.extra)
    skip = set(filter(None, args.skip.split(",")))
    labels = [label for label in ("raw", "ort", "onnxopt", *(["fp8"] if args.fp8 else []), *extras) if label not in skip]
    try:
        steps.run("reference", lambda: torch_reference(args.work, args.size, args.family))
        for variant in variants:
            raw = Path(steps.run(f"export:{variant}", lambda: export_variant(args.work, variant, args.size, args.family))["path"])
            d = raw.parent
            if "raw" in labels:
                steps.run(f"build:{variant}:raw", lambda: onnxopt_fp16(raw, d / "raw_fp16.onnx", ["cleanup", args.fp16_pass]))
            if "ort" in labels:
                steps.run(f"build:{variant}:ort", lambda: ort_optimizer(raw, d / "ort_fp16.onnx", args.ort_pythonpath))
            if "onnxopt" in labels:
                steps.run(f"build:{variant}:onnxopt", lambda: onnxopt_fp16(raw, d / "onnxopt_fp16.onnx", ["ort-cuda", args.fp16_pass]))
            if "fp8" in labels:
                steps.run(f"build:{variant}:fp8",
                          lambda: onnxopt_fp8(raw, d / "fp8.onnx", ["ort-cuda", args.fp16_pass], args.size, args.family,
                                              steps.results.get(f"build:{variant}:onnxopt")))
            for label, options in extras.items():
                steps.run(f"build:{variant}:{label}",
                          lambda: onnxopt_fp16(raw, d / f"{label}_fp16.onnx", [*ort_cuda_chain(options.get("-", ())), args.fp16_pass],
                                               {k: v for k, v in options.items() if k != "-"}))
        for variant in variants:
            for label in labels:
                built = steps.results.get(f"build:{variant}:{label}", {})
                if "path" not in built:
                    continue
                for graph in (0, 1):
                    def timed(path=built["path"], graph=graph):
                        try:
                            return measure(args.work, path, bool(graph), args.runs)
                        except Exception as exc:  # keep the other rows
                            return {"error": str(exc).splitlines()[0][:200]}
                    steps.run(f"time:{variant}:{label}:{graph}", timed)
        for label, compiled in TORCH_LABELS.items():
            if label in skip or args.size == "tiny":
                continue

            def torch_row(compiled=compiled):
                try:
                    return torch_timed(args.work, args.size, args.family, compiled, args.runs)
                except Exception as exc:  # keep the other rows
                    return {"error": str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}
            steps.run(f"torch:{label}", torch_row)
        done = True
    except TimeoutError as stop:
        print(f"budget spent before step {stop}; rerun to continue", flush=True)
        done = False
    text = table(steps.results, variants, labels)
    print(text)
    steps.save(args.out, text)
    return 0 if done else 3


if __name__ == "__main__":
    sys.exit(main())
