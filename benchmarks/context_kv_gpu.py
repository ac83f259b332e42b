"""Per-step latency with and without context-kv: SD 1.5 UNet, ORT CUDA EP, fp16, batch 2, 64x64, 77 tokens.

    python -m benchmarks.context_kv_gpu --work /tmp/ckv-bench --budget 540 --out benchmarks/results/ckv

Builds from one export (same seeded random weights, models/):
  full       ``ort-cuda,fp16``: the UNet as a pipeline runs it today, K/V recomputed at every step;
  split      ``ort-cuda,context-kv,fp16``: the denoiser (``split_fp16.onnx``) and its context graph
             (``split_fp16.context_kv.onnx``, encoder_hidden_states -> the K and V of every
             cross-attention, in fp16: one MatMul and a Split, fuse-parallel-gemm's merge);
then, in the same run, times the full UNet and the denoiser per step (IO binding, CUDA graph off
and on; onnxopt.runners.ort_cuda.OrtCudaSession), the context graph once per prompt (session
creation, first run, steady run; no CUDA graph: it runs once), and checks both UNet outputs against
torch fp32 (the denoiser fed the context graph's outputs). Prints a markdown table, the time saved
per step and over a --steps loop (net of the context graph), and writes results.json.

Steps are resumable and stop between steps once --budget seconds are spent (see
benchmarks.unet_gpu.Steps): rerun the same command to continue. ``--size tiny`` rehearses every
step on the tiny UNet; ``--build-only`` stops before the GPU (the CPU-side part, tested in
tests/test_context_kv.py); ``--source`` takes an existing export instead of exporting.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.unet_gpu import DIMS, VARIANTS, Steps, export_variant, onnxopt_fp16, torch_reference

PASSES = {"full": ["ort-cuda", "fp16"], "split": ["ort-cuda", "context-kv", "fp16"]}
CONTEXT_INPUT = "encoder_hidden_states"


def build(source: Path, work: Path, label: str) -> dict:
    """``onnxopt_fp16`` as unet_gpu runs it; save_model writes the context graph beside the denoiser."""
    from onnxopt.companions import companion_path

    out = onnxopt_fp16(source, work / f"{label}_fp16.onnx", PASSES[label])
    context = companion_path(out["path"], "context_kv")
    if context.exists() and label == "split":
        out["context_path"] = str(context)
    return out


def reference(work: Path) -> tuple[dict, np.ndarray]:
    ref = np.load(work / "reference.npz")
    return {k[3:]: ref[k] for k in ref.files if k.startswith("in_")}, ref["output"]


def accuracy(output: np.ndarray, expected: np.ndarray) -> dict:
    output = output.astype(np.float32)
    return {"max_abs": float(np.abs(output - expected).max()),
            "rel_l2": float(np.linalg.norm(output - expected) / np.linalg.norm(expected)),
            "finite": bool(np.isfinite(output).all())}


def time_session(path: str, feeds: dict, cuda_graph: bool, runs: int, expected: np.ndarray | None) -> dict:
    from onnxopt.runners.ort_cuda import OrtCudaSession

    session = OrtCudaSession(path, cuda_graph=cuda_graph)
    session.bind(feeds)
    session.run()
    timing = session.time(warmup=10, runs=runs)
    result = {"median_ms": timing.median_ms, "min_ms": timing.min_ms, "max_ms": timing.max_ms, "clock": timing.clock}
    if expected is not None:
        result.update(accuracy(next(iter(session.outputs().values())), expected))
    return result


def context_outputs(work: Path, context_path: str) -> dict[str, np.ndarray]:
    """Run the context graph once on the reference prompt and keep its K/V (for the denoiser's feeds)."""
    from onnxopt.runners.ort_cuda import OrtCudaSession

    feeds, _ = reference(work)
    session = OrtCudaSession(context_path)
    session.bind({CONTEXT_INPUT: feeds[CONTEXT_INPUT]})
    session.run()
    kv = session.outputs()
    np.savez(work / "context_kv.npz", **kv)
    return kv


def time_context(work: Path, context_path: str, runs: int) -> dict:
    """What the context graph costs once per prompt: session creation, first run, steady run."""
    from onnxopt.runners.ort_cuda import OrtCudaSession

    feeds, _ = reference(work)
    t0 = time.perf_counter()
    session = OrtCudaSession(context_path)
    load_s = time.perf_counter() - t0
    session.bind({CONTEXT_INPUT: feeds[CONTEXT_INPUT]})
    t0 = time.perf_counter()
    session.run()
    first_ms = (time.perf_counter() - t0) * 1000
    timing = session.time(warmup=3, runs=runs)
    nbytes = sum(v.nbytes for v in session.outputs().values())
    return {"session_s": load_s, "first_run_ms": first_ms, "median_ms": timing.median_ms, "min_ms": timing.min_ms,
            "clock": timing.clock, "kv_bytes": int(nbytes)}


def _guarded(fn):
    def run():
        try:
            return fn()
        except Exception as exc:  # keep the other rows: an error is a result too
            return {"error": str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__}
    return run


def _ms(entry) -> float:
    return entry["median_ms"] if entry and "median_ms" in entry else float("nan")


def table(results: dict, variant: str, steps: int) -> str:
    lines = ["| model | per | ms | ms, CUDA graph | max abs vs torch fp32 | rel L2 |", "|---|---|---|---|---|---|"]
    rows = {"full": "UNet, ort-cuda+fp16 (K/V recomputed)", "split": "denoiser, ort-cuda+context-kv+fp16"}
    for label, title in rows.items():
        off, on = results.get(f"time:{variant}:{label}:0"), results.get(f"time:{variant}:{label}:1")
        error = next((e.get("error") for e in (results.get(f"build:{variant}:{label}"), off, on) if e and "error" in e), None)
        if error or not (off or on):
            lines.append(f"| {title} | step | failed: {str(error or 'not run')[:90]} | | | |")
            continue
        acc = off if off and "max_abs" in off else (on or {})
        lines.append(f"| {title} | step | {_ms(off):.2f} | {_ms(on):.2f} | {acc.get('max_abs', float('nan')):.3g} | "
                     f"{acc.get('rel_l2', float('nan')):.3g} |")
    context = results.get(f"time:{variant}:context") or {}
    if "median_ms" in context:
        lines.append(f"| context graph (encoder_hidden_states -> K/V) | prompt | {context['median_ms']:.2f} "
                     f"(first run {context['first_run_ms']:.1f}, session {context['session_s']:.1f} s) | - | | |")
    else:
        lines.append(f"| context graph | prompt | failed: {str(context.get('error', 'not run'))[:90]} | | | |")
    lines.append("")
    for graph, name in ((0, "without CUDA graph"), (1, "with CUDA graph")):
        full, split = _ms(results.get(f"time:{variant}:full:{graph}")), _ms(results.get(f"time:{variant}:split:{graph}"))
        once = context.get("median_ms", float("nan"))
        if full == full and split == split:
            saved = full - split
            lines.append(f"* {name}: {saved:.2f} ms saved per step ({saved / full:.1%}); over a {steps}-step loop "
                         f"{steps * saved:.1f} ms saved, {steps * saved - once:.1f} ms net of the context graph ({once:.2f} ms)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ckv-bench"))
    ap.add_argument("--budget", type=float, default=540, help="seconds; stops between steps, rerun to continue")
    ap.add_argument("--variant", default="ts-dynamic", choices=list(VARIANTS))
    ap.add_argument("--size", default="full", choices=["full", "tiny"], help="tiny: a quick rehearsal of every step")
    ap.add_argument("--source", type=Path, help="an existing export of the UNet (skips exporting)")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--steps", type=int, default=50, help="denoising steps for the per-loop saving")
    ap.add_argument("--build-only", action="store_true", help="build both models and stop (no GPU needed)")
    ap.add_argument("--out", type=Path, help="copy results.json and the table here")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    steps = Steps(args.work, args.budget)
    v = args.variant
    done = True
    try:
        if args.source:
            raw = args.source
        else:
            raw = Path(steps.run(f"export:{v}", lambda: export_variant(args.work, v, args.size))["path"])
        built = {label: steps.run(f"build:{v}:{label}", _guarded(lambda label=label: build(raw, args.work, label))) for label in PASSES}
        if not args.build_only:
            steps.run("reference", lambda: torch_reference(args.work, args.size))
            feeds, expected = reference(args.work)
            split = built["split"]
            if "context_path" in split:
                kv_path = args.work / "context_kv.npz"
                if not kv_path.exists():
                    context_outputs(args.work, split["context_path"])
                kv = dict(np.load(kv_path))
                denoiser_feeds = {**{k: a for k, a in feeds.items() if k != CONTEXT_INPUT}, **kv}
            for graph in (0, 1):
                if "path" in built["full"]:
                    steps.run(f"time:{v}:full:{graph}", _guarded(lambda g=graph: time_session(
                        built["full"]["path"], feeds, bool(g), args.runs, expected)))
                if "context_path" in split:
                    steps.run(f"time:{v}:split:{graph}", _guarded(lambda g=graph: time_session(
                        split["path"], denoiser_feeds, bool(g), args.runs, expected)))
            if "context_path" in split:
                steps.run(f"time:{v}:context", _guarded(lambda: time_context(args.work, split["context_path"], args.runs)))
    except TimeoutError as stop:
        print(f"budget spent before step {stop}; rerun to continue", flush=True)
        done = False
    dims = DIMS if args.size == "full" else "example dims of the tiny model"
    text = f"SD 1.5 UNet ({args.size}, {v}), {dims}, fp16, ORT CUDA EP\n\n" + table(steps.results, v, args.steps)
    print(text)
    steps.save(args.out, text)
    return 0 if done else 3


if __name__ == "__main__":
    sys.exit(main())
