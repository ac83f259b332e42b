"""Per-step time of each scheduler on the fused step graph against diffusers' step on the host.

    python -m benchmarks.scheduler_step_gpu /tmp/pipe-bench/sd15/optimized --schedulers pndm ddim --steps 50
    python -m benchmarks.scheduler_step_gpu models/pipelines/sd15-tiny --provider cpu --steps 2 --size 64   # checks the script

The folder is an optimized pipeline folder (``benchmarks/pipeline_gpu.py --kind sd15`` builds one at
full size). Two pipelines are loaded on it: the fused step graph (CUDA graphs) and the unfused UNet
with diffusers' scheduler step on the host (``fused_step=False``). Each runs every scheduler once to
warm up (the captures), then once timed; the row gives which step ran, whether it was captured, the
steps run (PNDM's PLMS runs one more than asked: its first timestep twice), the mean step and the
whole image. Last, for each scheduler, the fused image against the unfused one (max abs of the
latents and pixels: fp16 noise, not a bit-for-bit check).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

PROMPT = "a photo of a cat"


def load(folder: str, provider: str, fused: bool, scheduler: str):
    from onnxopt.pipeline import Pipeline

    options = dict(cuda_graph=True) if fused else dict(fused_step=False)
    if provider == "cpu":
        options.pop("cuda_graph", None)
    t0 = time.perf_counter()
    pipe = Pipeline.load(folder, provider, scheduler=scheduler, **options)
    return pipe, time.perf_counter() - t0


def image(pipe, scheduler: str, args):
    return pipe(PROMPT, steps=args.steps, scheduler=scheduler, seed=0, height=args.size, width=args.size, progress=False)


def row(label: str, scheduler: str, load_s: float, first, timed) -> str:
    t = timed.timings
    return (f"| {label} | {scheduler} | {load_s:.2f} s | {first.timings['total_s']:.3f} s | {t['step']} | "
            f"{t.get('cuda_graph')} | {t['steps']} | {t['step_mean_s'] * 1e3:.2f} | {t['total_s']:.3f} s |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--provider", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--schedulers", nargs="+", default=["pndm", "ddim"])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--size", type=int, default=512)
    args = ap.parse_args(argv)
    print("| step | scheduler | load | first image | step graph | CUDA graph | steps | ms per step | image |")
    print("|---|---|---|---|---|---|---|---|---|")
    images: dict = {}
    for fused, label in ((True, "fused"), (False, "unfused (host step)")):
        for scheduler in args.schedulers:  # a load per scheduler: the load makes the step it asks for
            pipe, load_s = load(args.folder, args.provider, fused, scheduler)
            first = image(pipe, scheduler, args)
            timed = image(pipe, scheduler, args)
            images[fused, scheduler] = timed
            print(row(label, scheduler, load_s, first, timed), flush=True)
            del pipe
    for scheduler in args.schedulers:
        a, b = images[True, scheduler], images[False, scheduler]
        print(f"{scheduler}: fused vs unfused, latents max abs {float(np.abs(a.latents - b.latents).max()):.3g} "
              f"(of {float(np.abs(b.latents).max()):.3g}), pixels {float(np.abs(a.pixels - b.pixels).max()):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
