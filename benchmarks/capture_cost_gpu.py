"""The cost of a new image size: one optimized folder, sizes in turn, CUDA graphs captured per shape.

    python -m benchmarks.pipeline_gpu --kind sd15 --work /tmp/pipe-bench --skip torch-fp32,torch-eager,torch-compile,onnxopt
    python -m benchmarks.capture_cost_gpu --kind sd15 --work /tmp/pipe-bench --out benchmarks/results/capture-sd15
    python -m benchmarks.capture_cost_gpu --kind sdxl --work /tmp/pipe-bench --out benchmarks/results/capture-sdxl
    python -m benchmarks.capture_cost_gpu --kind sd15 --dry-run --work /tmp/pipe-dry   # CPU, tiny: the sequence once

The first command writes ``<work>/<kind>/optimized`` (benchmarks.pipeline_gpu's folder and optimize
steps). Then ``Pipeline.load(optimized, "cuda", cuda_graph=True, capture_cache=2)`` generates, each
with the kind's scheduler and step count, sizes A, A, B, A, C, A, B (SD 1.5: 512x512, 512x768,
768x512; SDXL: 1024x1024, 832x1216, 1216x832): the first A pays the session's first capture, the
second A replays, B captures its shape, A replays (cached), C captures and evicts B (the least
recently used of a cache of 2), A replays, B comes back and captures again. Per image: total_s, steps_s, step_mean_s, first_step_s and
``timings["capture"]`` (new_shape, capture_s: its two capturing steps over two later ones, and the
cache's counts). The target: a new size costs at most one capture above a repeated one
(total_s of a new-shape image minus that of a cached one, against capture_s).

This module needs CUDA (except --dry-run) and is never imported by the tests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SIZES = {"sd15": {"A": (512, 512), "B": (512, 768), "C": (768, 512)},
         "sdxl": {"A": (1024, 1024), "B": (832, 1216), "C": (1216, 832)}}
SEQUENCE = ("A", "A", "B", "A", "C", "A", "B")
DRY = {"A": (32, 32), "B": (32, 48), "C": (48, 32)}
PROMPT = "a photograph of an astronaut riding a horse on the moon, highly detailed"


def main(argv=None) -> int:
    from benchmarks.pipeline_gpu import SETTINGS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=list(SIZES), default="sd15")
    ap.add_argument("--work", type=Path, default=Path("/tmp/pipe-bench"))
    ap.add_argument("--out", type=Path, help="write results.json here")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny weights (written when absent)")
    args = ap.parse_args(argv)

    from onnxopt.pipeline import Pipeline

    settings, sizes = SETTINGS[args.kind], DRY if args.dry_run else SIZES[args.kind]
    folder = args.work / args.kind / ("folder" if args.dry_run else "optimized")
    if args.dry_run and not folder.is_dir():
        from models.pipelines import write_onnx_folder

        write_onnx_folder(args.kind, folder, "tiny")
    provider = "cpu" if args.dry_run else "cuda"
    pipe = Pipeline.load(folder, provider, cuda_graph=True, io_binding=True, capture_cache=2)
    steps = 3 if args.dry_run else settings["steps"]
    rows = []
    for name in SEQUENCE:
        height, width = sizes[name]
        result = pipe(PROMPT, steps=steps, scheduler=settings["scheduler"], height=height, width=width, seed=0,
                      progress=False)
        t = result.timings
        row = {"size": name, "height": height, "width": width, **{k: t.get(k) for k in (
            "total_s", "steps_s", "step_mean_s", "first_step_s", "vae_decode_s", "capture")}}
        rows.append(row)
        capture = row["capture"] or {}
        print(f"{name} {height}x{width}: total {row['total_s']:.3f} s, steps {row['steps_s']:.3f} s, "
              f"new shape {capture.get('new_shape')}, capture {capture.get('capture_s')}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"kind": args.kind, "steps": steps, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
