"""Text to image end to end on one GPU: onnxopt vs diffusers eager vs diffusers + torch.compile (issue 13, item 4).

    python -m benchmarks.pipeline_gpu --kind sd15 --work /tmp/pipe-bench --budget 540 --out benchmarks/results/pipeline-sd15
    python -m benchmarks.pipeline_gpu --kind sdxl --work /tmp/pipe-bench --budget 540 --out benchmarks/results/pipeline-sdxl
    python -m benchmarks.pipeline_gpu --kind sd15 --dry-run --work /tmp/pipe-dry   # CPU, tiny, fp32: every step once

Same random weights (``models.pipelines.build_torch_pipeline(kind, "full", seed)``) and seed on
every side; SD 1.5 at 512x512, DDIM, 50 steps; SDXL at 1024x1024, Euler (its own scheduler; its
config leaves DDIM's clip_sample on), 30 steps; guidance 7.5; one image.

Steps (each resumable: its result is recorded in <work>/<kind>/results.json and skipped when
present; the script stops between steps after --budget seconds, so a run spans several
10-minute calls of the device machine -- rerun the same command until it prints the table):

  folder          export the fp32 ONNX folder (TorchScript, dynamic axes) from those weights
  optimize        ``optimize_folder(--target ort-cuda, --fp16)`` (+ unet/step.onnx)
  torch-fp32      diffusers fp32 on the GPU: the quality reference (final latents and image saved)
  torch-eager     diffusers fp16 eager: median of 5 end to end after one warm-up, per stage, quality
  torch-compile   diffusers fp16, UNet under torch.compile(mode="reduce-overhead", fullgraph=True),
                  channels_last, torch._inductor.config.conv_1x1_as_mm = True; cold start = the
                  first image including compilation; then as above
  onnxopt         Pipeline.load(optimized folder, "cuda", cuda_graph=True); cold start = load +
                  session creation + first image (with the graph capture); then as above

Per stage: text encoder (per prompt, both CFG rows), mean denoising step, VAE decode; for torch
from one extra run with synchronizing hooks (the timed runs have none), for onnxopt from its own
timings. Quality: PSNR of the uint8 image and max abs of the final latents against torch fp32,
for onnxopt and for torch fp16 (the target: onnxopt deviates at most 1.5x torch fp16's deviation).

This module needs CUDA (except --dry-run) and is never imported by the tests.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.unet_gpu import Steps

SETTINGS = {
    "sd15": dict(height=512, width=512, steps=50, scheduler="ddim"),
    "sdxl": dict(height=1024, width=1024, steps=30, scheduler="euler"),
}
DRY = dict(height=32, width=32, steps=3)
PROMPT = "a photograph of an astronaut riding a horse on the moon, highly detailed"
NEGATIVE = "blurry, low quality"
GUIDANCE = 7.5
SEED = 0


class Bench:
    def __init__(self, args):
        import torch

        self.args, self.kind = args, args.kind
        self.dry = args.dry_run
        self.size = "tiny" if self.dry else "full"
        self.device = "cpu" if self.dry else "cuda"
        self.dtype = torch.float32 if self.dry else torch.float16
        self.settings = dict(SETTINGS[self.kind], **(DRY if self.dry else {}))
        self.runs = 1 if self.dry else args.runs
        self.work = args.work / self.kind
        self.work.mkdir(parents=True, exist_ok=True)
        self.src, self.opt = self.work / "folder", self.work / "optimized"

    # --- steps ------------------------------------------------------------------------------

    def build_folder(self) -> dict:
        from models.pipelines import folder_bytes, write_onnx_folder

        t0 = time.perf_counter()
        data = None if self.dry else "model.onnx_data"
        write_onnx_folder(self.kind, self.src, self.size, "torchscript", SEED, data_name=data)
        return {"path": str(self.src), "seconds": time.perf_counter() - t0, "bytes": folder_bytes(self.src)}

    def optimize(self) -> dict:
        if self.dry:  # the ort-cuda preset writes CUDA-only ops: the dry run uses the source folder
            return {"path": str(self.src), "skipped": "dry run (ort-cuda graphs need the CUDA EP)"}
        from onnxopt.pipeline import optimize_folder

        report = optimize_folder(self.src, self.opt, target="ort-cuda", fp16=True)
        return {"path": str(self.opt), "seconds": report.seconds, "table": report.table()}

    def torch_pipe(self, dtype, compiled: bool):
        import torch

        from models.pipelines import build_torch_pipeline
        from onnxopt.pipeline.schedulers import make_scheduler

        pipe = build_torch_pipeline(self.kind, self.size, SEED)
        # The config the folder's scheduler_config.json is written from: the torch steps need no ONNX folder,
        # so they can run in a call of their own (--skip folder,optimize,onnxopt).
        pipe.scheduler = make_scheduler(self.settings["scheduler"], dict(pipe.scheduler.config))
        pipe = pipe.to(self.device, dtype)
        pipe.set_progress_bar_config(disable=True)
        if compiled:
            torch._inductor.config.conv_1x1_as_mm = True
            pipe.unet.to(memory_format=torch.channels_last)
            pipe.unet = torch.compile(pipe.unet, mode="reduce-overhead", fullgraph=True)
        return pipe

    def torch_call(self, pipe, output_type="np"):
        import torch

        final = {}

        def keep(_pipe, i, t, kwargs):
            final["latents"] = kwargs["latents"]
            return kwargs

        s = self.settings
        # The initial noise is drawn in float32, as the fp32 pipeline and onnxopt draw it, then cast: an fp16
        # pipeline left to draw its own would sample float16 noise, another image altogether.
        factor = pipe.vae_scale_factor
        noise = torch.randn((1, pipe.unet.config.in_channels, s["height"] // factor, s["width"] // factor),
                            generator=torch.Generator("cpu").manual_seed(SEED), dtype=torch.float32)
        with torch.no_grad():
            image = pipe(PROMPT, negative_prompt=NEGATIVE, num_inference_steps=s["steps"], guidance_scale=GUIDANCE,
                         height=s["height"], width=s["width"], latents=noise.to(self.device, pipe.unet.dtype),
                         output_type=output_type, callback_on_step_end=keep).images[0]
        self.sync()
        return final["latents"].float().cpu().numpy(), np.asarray(image, np.float32)

    def sync(self):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def torch_stages(self, pipe) -> dict:
        """One run with synchronizing timers around the text encoder(s), the UNet and the VAE decode."""
        times = {"text_encoder": 0.0, "unet": [], "vae_decode": 0.0}

        def wrap(module, attr, key):
            original = getattr(module, attr)

            def timed(*a, **k):
                self.sync()
                t0 = time.perf_counter()
                out = original(*a, **k)
                self.sync()
                dt = time.perf_counter() - t0
                if key == "unet":
                    times["unet"].append(dt)
                else:
                    times[key] += dt
                return out

            setattr(module, attr, timed)
            return original

        undo = [(pipe.text_encoder, "forward", wrap(pipe.text_encoder, "forward", "text_encoder"))]
        if getattr(pipe, "text_encoder_2", None) is not None:
            undo.append((pipe.text_encoder_2, "forward", wrap(pipe.text_encoder_2, "forward", "text_encoder")))
        undo.append((pipe.vae, "decode", wrap(pipe.vae, "decode", "vae_decode")))
        unet_holder = pipe
        original_unet = pipe.unet
        unet_calls = []

        class TimedUNet:  # pipe.unet may be a compiled module: time calls around it
            def __getattr__(self, name):
                return getattr(original_unet, name)

            def __call__(self_inner, *a, **k):
                self.sync()
                t0 = time.perf_counter()
                out = original_unet(*a, **k)
                self.sync()
                unet_calls.append(time.perf_counter() - t0)
                return out

        # object.__setattr__: DiffusionPipeline.__setattr__ would register the stand-in as a component
        object.__setattr__(unet_holder, "unet", TimedUNet())
        try:
            self.torch_call(pipe)
        finally:
            object.__setattr__(unet_holder, "unet", original_unet)
            for module, attr, original in undo:
                setattr(module, attr, original)
        return {"text_encoder_s": times["text_encoder"], "step_mean_s": statistics.mean(unet_calls[1:] or unet_calls),
                "vae_decode_s": times["vae_decode"]}

    def torch_fp32(self) -> dict:
        import torch

        pipe = self.torch_pipe(torch.float32, compiled=False)
        latents, image = self.torch_call(pipe)
        np.save(self.work / "fp32_latents.npy", latents)
        np.save(self.work / "fp32_image.npy", image)
        del pipe
        return {"latents_absmax": float(np.abs(latents).max())}

    def torch_timed(self, compiled: bool) -> dict:
        if compiled and self.dry:
            return {"skipped": "dry run (torch.compile reduce-overhead needs CUDA graphs)"}
        t0 = time.perf_counter()
        pipe = self.torch_pipe(self.dtype, compiled)
        latents, image = self.torch_call(pipe)  # warm-up; with compile: the compilation
        cold = time.perf_counter() - t0
        totals = []
        for _ in range(self.runs):
            t1 = time.perf_counter()
            latents, image = self.torch_call(pipe)
            totals.append(time.perf_counter() - t1)
        out = {"end_to_end_s": statistics.median(totals), "runs_s": totals, "cold_start_s": cold,
               "stages": self.torch_stages(pipe), **self.quality(latents, image)}
        del pipe
        return out

    def onnxopt(self) -> dict:
        from onnxopt.pipeline import Pipeline

        folder = self.src if self.dry else self.opt
        provider = "cpu" if self.dry else "cuda"
        s = self.settings
        request = dict(negative_prompt=NEGATIVE, steps=s["steps"], guidance=GUIDANCE, scheduler=s["scheduler"],
                       seed=SEED, height=s["height"], width=s["width"], progress=False)
        t0 = time.perf_counter()
        pipe = Pipeline.load(folder, provider, cuda_graph=True)
        first = pipe(PROMPT, **request)
        cold = time.perf_counter() - t0
        results = []
        for _ in range(self.runs):
            t1 = time.perf_counter()
            results.append((pipe(PROMPT, **request), time.perf_counter() - t1))
        last = results[-1][0]
        totals = [t for _, t in results]
        stages = {k: statistics.median(r.timings[k] for r, _ in results)
                  for k in ("text_encoder_s", "step_mean_s", "vae_decode_s")}
        return {"end_to_end_s": statistics.median(totals), "runs_s": totals, "cold_start_s": cold,
                "session_creation_s": pipe.creation_s, "first_image_s": first.timings["total_s"],
                "first_step_s": first.timings["first_step_s"], "step": last.timings["step"],
                "cuda_graph": last.timings["cuda_graph"], "stages": stages,
                **self.quality(last.latents, last.pixels)}

    def quality(self, latents: np.ndarray, image: np.ndarray) -> dict:
        ref_latents = np.load(self.work / "fp32_latents.npy")
        ref_image = np.load(self.work / "fp32_image.npy")
        a = (np.clip(image, 0, 1) * 255).round()
        b = (np.clip(ref_image, 0, 1) * 255).round()
        mse = float(np.mean((a - b) ** 2))
        psnr = float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)
        return {"psnr_db": psnr, "latents_max_abs": float(np.abs(latents - ref_latents).max()),
                "image_max_abs": float(np.abs(image - ref_image).max())}


def table(kind: str, results: dict, dry: bool = False) -> str:
    s = dict(SETTINGS[kind], **(DRY if dry else {}))
    precision = "DRY RUN: tiny weights, fp32, CPU" if dry else "fp16"
    lines = [f"### {kind}: {s['height']}x{s['width']}, {s['scheduler']} {s['steps']} steps, guidance {GUIDANCE}, {precision}",
             "", "| pipeline | end to end | cold start | text encoder | mean step | VAE decode | PSNR vs fp32 | latents max abs vs fp32 |",
             "|---|---|---|---|---|---|---|---|"]
    rows = (("diffusers eager", "torch-eager"), ("diffusers + torch.compile", "torch-compile"), ("onnxopt ort-cuda fp16", "onnxopt"))
    for label, key in rows:
        r = results.get(key)
        if not r or "skipped" in r:
            lines.append(f"| {label} | {(r or {}).get('skipped', 'not run')} | | | | | | |")
            continue
        st = r["stages"]
        lines.append(f"| {label} | {r['end_to_end_s']:.3f} s | {r['cold_start_s']:.1f} s | {st['text_encoder_s'] * 1e3:.1f} ms | "
                     f"{st['step_mean_s'] * 1e3:.2f} ms | {st['vae_decode_s'] * 1e3:.1f} ms | {r['psnr_db']:.1f} dB | "
                     f"{r['latents_max_abs']:.3g} |")
    eager, compiled, ours = (results.get(k) or {} for k in ("torch-eager", "torch-compile", "onnxopt"))
    if "end_to_end_s" in compiled and "end_to_end_s" in ours:
        lines += ["", f"onnxopt / torch.compile end to end: {ours['end_to_end_s'] / compiled['end_to_end_s']:.2f}x"]
    if "latents_max_abs" in eager and "latents_max_abs" in ours:
        ratio = ours["latents_max_abs"] / max(eager["latents_max_abs"], 1e-12)
        lines += [f"onnxopt / torch fp16 deviation from fp32 (final latents max abs): {ratio:.2f}x"]
    if "step" in ours:
        lines += [f"onnxopt step: {ours['step']}, CUDA graph {ours['cuda_graph']}, first step {ours['first_step_s'] * 1e3:.0f} ms, "
                  f"sessions {ours['session_creation_s']:.1f} s"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=list(SETTINGS), default="sd15")
    ap.add_argument("--work", type=Path, default=Path("/tmp/pipe-bench"))
    ap.add_argument("--budget", type=float, default=540, help="seconds; stop between steps after this")
    ap.add_argument("--runs", type=int, default=5, help="timed images after the warm-up (median reported)")
    ap.add_argument("--out", type=Path, help="copy results.json and table.md here (e.g. benchmarks/results/pipeline-sd15)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny weights, fp32, one run of each step (no compile)")
    ap.add_argument("--skip", default="", help="comma-separated steps not to run (e.g. torch-compile)")
    args = ap.parse_args(argv)
    bench = Bench(args)
    steps = Steps(bench.work, args.budget)
    plan = [("folder", bench.build_folder), ("optimize", bench.optimize), ("torch-fp32", bench.torch_fp32),
            ("torch-eager", lambda: bench.torch_timed(False)), ("torch-compile", lambda: bench.torch_timed(True)),
            ("onnxopt", bench.onnxopt)]
    skip = set(filter(None, args.skip.split(",")))
    try:
        for key, fn in plan:
            if key not in skip:
                steps.run(key, fn)
    except TimeoutError as exc:
        print(f"budget spent before step '{exc}': rerun the same command to continue", flush=True)
    text = table(args.kind, steps.results, args.dry_run)
    print(text)
    steps.save(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
