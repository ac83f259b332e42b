"""Step reuse against fewer steps at the same compute: the quality curve.

    python -m benchmarks.step_reuse_curve --folder /tmp/pipe-bench/sd15/optimized --provider cuda \
        --steps 50 --scheduler ddim --out benchmarks/results/step-reuse-sd15
    python -m benchmarks.step_reuse_curve --folder models/pipelines/sd15-tiny --steps 8   # CPU smoke run
    python -m benchmarks.step_reuse_curve --plot benchmarks/results/step-reuse-sd15/results.json  # curve.png

One pipeline, one prompt and seed. The reference is the full schedule (``--steps`` UNet calls).
For each reuse schedule (default: every second step from step k to the end, for several k) the
image computes ``c`` UNet steps; next to it, the plain schedule of ``c`` steps (the same compute,
diffusers' "fewer steps"). Both are compared with the full schedule: image PSNR (uint8) and the
final latents' max abs and relative L2 error. Time per image is recorded too (end to end).

With ``--out``: results.json, table.md, and images.png (every row's image side by side, labelled);
curve.png (PSNR and latent error against UNet steps, reuse vs fewer steps) is drawn from
results.json by ``--plot``, on any machine with matplotlib (``pip install 'onnxopt[bench]'``).
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
    rows = [{"schedule": "full", "kind": "full", "unet_steps": args.steps, "total_s": full.timings["total_s"],
             **compare(full.latents, full.pixels, full.latents, full.pixels)}]
    pictures = [("full", full.image)]
    for spec in args.schedules or default_schedules(args.steps):
        reused = pipe(PROMPT, steps=args.steps, reuse=spec, **base)
        computed = reused.timings["unet_steps"]
        fewer = pipe(PROMPT, steps=computed, **base)
        rows.append({"schedule": f"reuse {spec}", "kind": "reuse", "unet_steps": computed,
                     "total_s": reused.timings["total_s"],
                     **compare(reused.latents, reused.pixels, full.latents, full.pixels)})
        rows.append({"schedule": f"{computed} steps", "kind": "fewer", "unet_steps": computed,
                     "total_s": fewer.timings["total_s"],
                     **compare(fewer.latents, fewer.pixels, full.latents, full.pixels)})
        pictures += [(f"reuse {spec}", reused.image), (f"{computed} steps", fewer.image)]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        side_by_side(pictures).save(args.out / "images.png")
    return {"folder": str(args.folder), "provider": args.provider, "scheduler": args.scheduler, "steps": args.steps,
            "seed": args.seed, "rows": rows}


def side_by_side(pictures: list, size: int = 256):
    """The images in one row each pair (reuse, fewer steps) under the full one, labelled."""
    from PIL import Image, ImageDraw

    full, rest = pictures[0], pictures[1:]
    rows = 1 + (len(rest) + 1) // 2
    sheet = Image.new("RGB", (2 * size, rows * (size + 16)), "white")
    draw = ImageDraw.Draw(sheet)
    cells = [(0, full)] + [(2 + i, p) for i, p in enumerate(rest)]  # the full image alone on the first row
    for index, (label, image) in cells:
        x, y = (index % 2) * size, (index // 2) * (size + 16)
        sheet.paste(image.convert("RGB").resize((size, size)), (x, y + 16))
        draw.text((x + 4, y + 2), label, fill="black")
    return sheet


def plot(results_path: Path) -> Path:
    """curve.png beside results.json: PSNR and latents rel L2 vs UNet steps, reuse vs fewer steps."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'onnxopt[bench]'") from None
    result = json.loads(results_path.read_text())
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for kind, style in (("reuse", "o-"), ("fewer", "s--")):
        rows = sorted((r for r in result["rows"] if r.get("kind") == kind), key=lambda r: r["unet_steps"])
        steps = [r["unet_steps"] for r in rows]
        label = "step reuse" if kind == "reuse" else "fewer steps (same compute)"
        axes[0].plot(steps, [r["psnr_db"] for r in rows], style, label=label)
        axes[1].plot(steps, [r["latents_rel_l2"] for r in rows], style, label=label)
    axes[0].set(xlabel="UNet steps computed", ylabel="image PSNR vs full schedule (dB)")
    axes[1].set(xlabel="UNet steps computed", ylabel="final latents rel. L2 vs full", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['scheduler']} {result['steps']} steps, seed {result['seed']}, {result['provider']}")
    fig.tight_layout()
    out = results_path.with_name("curve.png")
    fig.savefig(out, dpi=100)
    return out


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
    ap.add_argument("--folder", type=Path)
    ap.add_argument("--plot", type=Path, metavar="RESULTS_JSON", help="draw curve.png from a results.json, then exit")
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
    if args.plot:
        print(plot(args.plot))
        return 0
    if args.folder is None:
        ap.error("--folder is required (or --plot)")
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
