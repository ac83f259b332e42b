"""Step reuse against fewer steps at the same compute (issue 14, item 4): the quality curve.

    python -m benchmarks.step_reuse_curve --folder /tmp/pipe-bench/sd15/optimized --provider cuda \
        --steps 50 --scheduler ddim --out benchmarks/results/step-reuse-sd15
    python -m benchmarks.step_reuse_curve --folder models/pipelines/sd15-tiny --steps 8   # CPU smoke run

One pipeline, one prompt and seed. The reference is the full schedule (``--steps`` UNet calls).
For each reuse schedule (default: every second step from step k to the end, for several k) the
image computes ``c`` UNet steps; next to it, the plain schedule of ``c`` steps (the same compute,
diffusers' "fewer steps"). Both are compared with the full schedule: image PSNR (uint8) and the
final latents' max abs and relative L2 error. Time per image is recorded too (end to end).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

PROMPT = "a photograph of an astronaut riding a horse on the moon, highly detailed"
NEGATIVE = "blurry, low quality"


def default_schedules(steps: int) -> list[str]:
    """Every second step reused from k to the end, k from late to early (more reuse, less compute)."""
    starts = sorted({max(1, round(steps * f)) for f in (0.8, 0.6, 0.4, 0.2)}, reverse=True)
    return [f"{k}-{steps - 1}:2" for k in starts if k < steps]


def compare(latents, pixels, ref_latents, ref_pixels) -> dict:
    a = (np.clip(pixels, 0, 1) * 255).round()
    b = (np.clip(ref_pixels, 0, 1) * 255).round()
    mse = float(np.mean((a - b) ** 2))
    diff = latents.astype(np.float64) - ref_latents
    return {"psnr_db": float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse)),
            "latents_max_abs": float(np.abs(diff).max()),
            "latents_rel_l2": float(np.linalg.norm(diff) / (np.linalg.norm(ref_latents) or 1.0))}


def run(args) -> dict:
    from onnxopt.pipeline import Pipeline

    pipe = Pipeline.load(args.folder, args.provider)
    base = dict(negative_prompt=NEGATIVE, guidance=args.guidance, scheduler=args.scheduler, seed=args.seed,
                height=args.height, width=args.width, progress=False)
    pipe(PROMPT, steps=args.steps, **base)  # warm-up (graph capture)
    full = pipe(PROMPT, steps=args.steps, **base)
    rows = [{"schedule": "full", "unet_steps": args.steps, "total_s": full.timings["total_s"],
             **compare(full.latents, full.pixels, full.latents, full.pixels)}]
    for spec in args.schedules or default_schedules(args.steps):
        reused = pipe(PROMPT, steps=args.steps, reuse=spec, **base)
        computed = reused.timings["unet_steps"]
        fewer = pipe(PROMPT, steps=computed, **base)
        rows.append({"schedule": f"reuse {spec}", "unet_steps": computed, "total_s": reused.timings["total_s"],
                     **compare(reused.latents, reused.pixels, full.latents, full.pixels)})
        rows.append({"schedule": f"{computed} steps", "unet_steps": computed, "total_s": fewer.timings["total_s"],
                     **compare(fewer.latents, fewer.pixels, full.latents, full.pixels)})
    return {"folder": str(args.folder), "provider": args.provider, "scheduler": args.scheduler, "steps": args.steps,
            "seed": args.seed, "rows": rows}


def table(result: dict) -> str:
    lines = [f"### step reuse vs fewer steps: {result['scheduler']}, {result['steps']} steps, seed {result['seed']}, "
             f"{result['provider']} ({result['folder']})", "",
             "| schedule | UNet steps | end to end | PSNR vs full | latents max abs | latents rel L2 |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['schedule']} | {r['unet_steps']} | {r['total_s']:.3f} s | {r['psnr_db']:.1f} dB | "
                     f"{r['latents_max_abs']:.3g} | {r['latents_rel_l2']:.3g} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, required=True)
    ap.add_argument("--provider", default="cpu", choices=["cpu", "cuda", "tensorrt"])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--scheduler", default="ddim")
    ap.add_argument("--guidance", type=float, default=7.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--schedules", nargs="*", help="reuse schedules (default: every second step from k, several k)")
    ap.add_argument("--out", type=Path, help="write results.json and table.md here")
    args = ap.parse_args(argv)
    result = run(args)
    text = table(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=2))
        (args.out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
