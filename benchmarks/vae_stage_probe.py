"""Why the VAE decode stage swings between identical pipelines (GPU probe; the H100 pipeline tables of benchmarks/results/h100-2026-11-25-session7/).

In benchmarks/results/h100-2026-11-25-session7, the SD 1.5 ablation rows "+ text side once per
prompt" and "default, launch timing" took 24-26 ms for the VAE decode, the other rows of the same
run 11.6-11.9 ms, although the first of them loads exactly what the default row loads (the
two_streams/merged_step switches do nothing without a ControlNet) and every row runs the same
captured VAE graph on bound buffers; SDXL swung 45-62 ms. Each row is a fresh ``Pipeline.load`` in
one process, after the torch pipelines of earlier steps. This probe repeats that and splits the
stage so the swinging part shows::

    python -m benchmarks.vae_stage_probe --folder /tmp/pipe-bench/sd15/optimized --loads 6

    per load: free GPU memory before the load (cuDNN's exhaustive algorithm search, run at the
              VAE's first run, skips algorithms whose workspace does not fit in it), whether the
              VAE graph was captured, then over --runs decodes of one latent:
                copy_in    latents host -> the bound input buffer (BoundRun.write: update_inplace)
                graph      BoundRun.run (a captured replay; returns when the device is done)
                copy_out   the image buffer -> host (.numpy())
                post       diffusers' postprocessing on the host (torch CPU)
              and the pipeline's own vae_decode_s / vae_run_s / vae_postprocess_s over --images images.
    --gc      gc.collect() and torch.cuda.empty_cache() before each load (does the swing follow
              memory left by earlier pipelines?)
    --search  also a bare VAE session per cuDNN algorithm search mode (EXHAUSTIVE, HEURISTIC,
              DEFAULT), graph time only: is the slow mode one algorithm choice?

Reading it: if ``graph`` carries the swing and follows free memory or the search mode, the cause is
the cuDNN algorithm chosen per session (fix: pin the search, or search before other sessions take
memory); if ``post`` or the copies carry it, the host side (CPU threads) is the cause. Writes
``<out>/vae_probe.json`` when --out is given. Needs CUDA (``--provider cpu --steps 2 --size 64`` on
a tiny folder checks the script itself); never imported by the tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import numpy as np

PROMPT = "a photograph of an astronaut riding a horse on the moon, highly detailed"
NEGATIVE = "blurry, low quality"


def free_gpu_bytes() -> int | None:
    try:
        import torch

        return int(torch.cuda.mem_get_info()[0])
    except Exception:  # torch without CUDA: not reported
        return None


def split_stage(pipe, latents: np.ndarray, runs: int) -> dict:
    """Medians (ms) of the VAE stage's parts on the pipeline's own bound VAE session."""
    from onnxopt.pipeline import images
    from onnxopt.pipeline.sessions import input_types

    session = pipe.sessions["vae_decoder"]
    feed = pipe._unscale(latents).astype(input_types(session)["latent_sample"])
    session.run(None, {"latent_sample": feed})  # bound (and captured) already by the pipeline's images
    key = tuple(sorted((n, v.shape, v.dtype.str) for n, v in {"latent_sample": feed}.items()))
    bound = session.cache[key]
    parts = {"copy_in": [], "graph": [], "copy_out": [], "post": []}
    for _ in range(runs):
        t0 = time.perf_counter()
        bound.write({"latent_sample": feed})
        t1 = time.perf_counter()
        bound.run()
        t2 = time.perf_counter()
        decoded = bound.outputs["sample"].numpy()
        t3 = time.perf_counter()
        images.postprocess(decoded.astype(np.float32), pipe.folder.vae_scale_factor)
        t4 = time.perf_counter()
        for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[name].append(seconds)
    return {name: round(statistics.median(values) * 1e3, 3) for name, values in parts.items()}


def bare_vae_graph_ms(model: Path, latents: np.ndarray, search: str, runs: int) -> float:
    """A plain CUDA EP session of the VAE decoder with ``cudnn_conv_algo_search=search``, IO-bound,
    no capture: the median graph time (ms)."""
    import onnxruntime as ort

    from onnxopt.runners.captured_session import CapturedSession

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(model), options, providers=[
        ("CUDAExecutionProvider", {"cudnn_conv_algo_search": search})])
    spec = session.get_inputs()[0]
    dtype = np.float16 if "float16" in spec.type else np.float32
    bound = CapturedSession(ort, session).bind({spec.name: latents.astype(dtype)})  # its output probe: the algorithm search
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        bound.run()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, required=True, help="an optimized pipeline folder (ort-cuda)")
    ap.add_argument("--loads", type=int, default=6, help="fresh Pipeline.load calls in this process")
    ap.add_argument("--images", type=int, default=3, help="images per load (the first includes the capture)")
    ap.add_argument("--runs", type=int, default=20, help="decodes per load for the split")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--size", type=int, default=512, help="image side in pixels (SDXL: 1024)")
    ap.add_argument("--gc", action="store_true", help="gc.collect() + torch.cuda.empty_cache() before each load")
    ap.add_argument("--search", action="store_true", help="also bare VAE sessions per cuDNN search mode")
    ap.add_argument("--provider", default="cuda", help="cpu: a dry run of this script (bound buffers on the CPU EP)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    from onnxopt.pipeline import Pipeline

    rows = []
    latents = None
    for k in range(args.loads):
        if args.gc:
            gc.collect()
            try:
                import torch

                torch.cuda.empty_cache()
            except Exception:
                pass
        free = free_gpu_bytes()
        pipe = Pipeline.load(args.folder, args.provider, cuda_graph=True, io_binding=True)
        stages = []
        for _ in range(args.images):
            result = pipe(PROMPT, negative_prompt=NEGATIVE, steps=args.steps, guidance=7.5, scheduler="ddim",
                          seed=0, height=args.size, width=args.size, progress=False)
            keys = ("vae_decode_s", "vae_run_s", "vae_postprocess_s", "text_encoder_s")
            stages.append({key: round(result.timings[key] * 1e3, 3) for key in keys if key in result.timings})
        latents = result.latents
        vae = pipe.sessions["vae_decoder"]
        row = {"load": k, "free_gpu_gb_before": None if free is None else round(free / 2 ** 30, 2),
               "vae_captured": bool(getattr(vae, "cuda_graph", False)), "pipeline_stages_ms": stages[1:],
               "split_ms": split_stage(pipe, latents, args.runs), "text_encoders": result.timings.get("text_encoders")}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del pipe, vae, result
    report = {"folder": str(args.folder), "gc": args.gc, "loads": rows}
    if args.search and latents is not None and args.provider == "cuda":
        from onnxopt.pipeline import PipelineFolder

        folder = PipelineFolder.open(args.folder)
        model = folder.component("vae_decoder").model
        scaled = latents / np.float32(folder.config("vae_decoder").get("scaling_factor", 0.18215))
        report["bare_graph_ms"] = {search: [bare_vae_graph_ms(model, scaled, search, args.runs) for _ in range(3)]
                                   for search in ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")}
        print(json.dumps({"bare_graph_ms": report["bare_graph_ms"]}), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vae_probe.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
