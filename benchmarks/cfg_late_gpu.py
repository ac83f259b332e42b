"""cfg-late measured: what moves to batch b, and what it saves per denoising step.

    # CPU, any UNet (tiny here; the full-size folders on the GPU host): nodes and FLOPs that move
    python -m benchmarks.cfg_late_gpu count --unet /tmp/pipe-bench/sd15/folder/unet/model.onnx --height 64 --width 64
    # GPU: the optimized folder's step graph with and without cfg-late, same run, interleaved
    python -m benchmarks.cfg_late_gpu time --folder /tmp/pipe-bench/sd15/optimized --kind sd15 --out benchmarks/results/cfg-late-sd15
    python -m benchmarks.cfg_late_gpu time --folder /tmp/pipe-bench/sdxl/optimized --kind sdxl --out benchmarks/results/cfg-late-sdxl
    python -m benchmarks.cfg_late_gpu time --folder /tmp/tiny-trt --dry-run    # CPU rehearsal, tiny folder

``count`` builds the step graph of ``--unet`` with and without the pass and reports nodes, the
nodes moved (by op), and the FLOPs of Conv/ConvTranspose/MatMul/Gemm at the given latent size,
batch b = 1 image (UNet batch 2), from the shapes ONNX Runtime's CPU profiler records in one run
(so give it a standard-op graph: a raw export or a ``tensorrt`` folder's UNet, not ``ort-cuda``).

``time`` writes ``unet/step.cfg_late.onnx`` (with its ``step.cfg_late.context_kv.onnx``) beside the
folder's ``unet/step.onnx`` (built by ``benchmarks.pipeline_gpu``'s optimize step: ``ort-cuda``,
fp16), then loads the pipeline twice on the CUDA EP with CUDA graphs (``Pipeline.load(...,
step_file=...)``), and times one image per variant in turn (``--runs`` each, after a warm-up):
median end to end and mean step, and the final latents' max difference between the variants
(fp16 kernels at another batch may round differently). The settings are pipeline_gpu's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

VARIANT_FILE = "step.cfg_late.onnx"
MAC_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")


def flops(model, feeds: dict) -> float:
    """2 x multiply-adds of Conv/ConvTranspose/MatMul/Gemm in one run of ``model`` on ``feeds``, from
    the shapes ONNX Runtime's profiler records (graph optimizations off: the nodes as written)."""
    import tempfile

    import onnxruntime as ort

    from onnxopt.saving import save_model

    total = 0.0
    with tempfile.TemporaryDirectory(prefix="cfg-late-flops-") as work:
        path = save_model(model, Path(work) / "step.onnx", external_data=True).path
        options = ort.SessionOptions()
        options.enable_profiling, options.profile_file_prefix = True, str(Path(work) / "profile")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 3
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    for event in events:
        info = event.get("args", {})
        if event.get("cat") != "Node" or info.get("op_name") not in MAC_OPS or "input_type_shape" not in info:
            continue
        ins = [next(iter(d.values())) for d in info["input_type_shape"]]
        out = next(iter(info["output_type_shape"][0].values()))
        op = info["op_name"]
        if op == "Conv":
            per_output = np.prod(ins[1][1:])
        elif op == "ConvTranspose":
            per_output = np.prod(ins[1][2:]) * ins[1][0] / out[1]
        elif op == "Gemm":
            per_output = ins[1][0] if not int(info.get("transB", 0)) else ins[1][1]
        else:
            per_output = ins[0][-1]
        total += 2.0 * float(np.prod(out)) * float(per_output)
    return total


def step_feeds(unet, height: int, width: int, sequence: int) -> dict:
    """Random step-graph inputs for one image (the UNet at batch 2), at the given latent size."""
    rng = np.random.default_rng(0)
    inputs = {t.name: t for t in unet.graph.inputs}
    timestep_dtype = np.dtype(inputs["timestep"].dtype)
    feeds = {"latents": rng.standard_normal((1, 4, height, width)).astype(np.float32),
             "state": rng.standard_normal((1, 4, height, width)).astype(np.float32),
             "step_index": np.array([3], np.int64), "schedule_timesteps": np.arange(999, 0, -20).astype(timestep_dtype),
             "schedule_coefficients": rng.uniform(-1, 1, (50, 6)).astype(np.float32),
             "guidance_scale": np.array([7.5], np.float32)}
    for name, t in inputs.items():
        if name in ("sample", "timestep"):
            continue
        if name.startswith(("down_block_res", "mid_block_res")):
            raise SystemExit("count a plain UNet: a ControlNet UNet's residual sizes depend on its down factors")
        dims = [2] + [sequence if (i == 1 and name == "encoder_hidden_states") else d for i, d in enumerate(t.shape[1:], 1)]
        feeds[name] = rng.standard_normal([d if isinstance(d, int) else 1 for d in dims]).astype(np.dtype(t.dtype))
    return feeds


def count(args) -> dict:
    from onnxopt import load_model
    from onnxopt.passes.cfg_late import compute_halves_once
    from onnxopt.pipeline.step_graph import STEP_INPUTS, build_step_graph

    unet = load_model(args.unet)
    step, late = build_step_graph(unet), build_step_graph(unet)
    details = compute_halves_once(late, STEP_INPUTS).details
    feeds = step_feeds(unet, args.height, args.width, args.sequence)
    before, after = flops(step, feeds), flops(late, feeds)
    result = {"unet": str(args.unet), "latent": [args.height, args.width], "nodes_before": len(step.graph.nodes),
              "nodes_after": len(late.graph.nodes), "nodes_moved": details["nodes_moved"],
              "ops_moved": details["ops_moved"], "broadcasts": len(details["broadcasts"]),
              "gflop_before": before / 1e9, "gflop_after": after / 1e9,
              "gflop_saved_pct": 100 * (before - after) / before if before else 0.0}
    print(json.dumps(result, indent=2))
    return result


def time_variants(args) -> dict:
    from benchmarks.pipeline_gpu import DRY, GUIDANCE, NEGATIVE, PROMPT, SEED, SETTINGS
    from onnxopt.pipeline import Pipeline
    from onnxopt.pipeline.step_graph import write_step_graph

    unet_dir = args.folder / "unet"
    if not (unet_dir / VARIANT_FILE).is_file():
        t0 = time.perf_counter()
        write_step_graph(unet_dir, file_name=VARIANT_FILE, cfg_late=True,
                         context_kv=(unet_dir / "step.context_kv.onnx").is_file())
        print(f"wrote {unet_dir / VARIANT_FILE} in {time.perf_counter() - t0:.1f} s", flush=True)
    s = dict(SETTINGS[args.kind], **(DRY if args.dry_run else {}))
    provider = "cpu" if args.dry_run else "cuda"
    request = dict(negative_prompt=NEGATIVE, steps=s["steps"], guidance=GUIDANCE, scheduler=s["scheduler"], seed=SEED,
                   height=s["height"], width=s["width"], progress=False)
    variants = {"step.onnx": None, VARIANT_FILE: VARIANT_FILE}
    pipes = {name: Pipeline.load(args.folder, provider, cuda_graph=True, step_file=file) for name, file in variants.items()}
    runs = {name: [] for name in variants}
    last = {}
    for name, pipe in pipes.items():
        pipe(PROMPT, **request)  # warm-up: capture
    for _ in range(args.runs):
        for name, pipe in pipes.items():
            result = pipe(PROMPT, **request)
            runs[name].append((result.timings["total_s"], result.timings["step_mean_s"]))
            last[name] = result.latents
    base = last["step.onnx"]
    out = {name: {"end_to_end_s": statistics.median(t for t, _ in r), "step_mean_ms": 1e3 * statistics.median(m for _, m in r),
                  "step": pipes[name].step_source, "cuda_graph": pipes[name].cuda_graph,
                  "latents_max_diff_vs_step_onnx": float(np.abs(last[name] - base).max())}
           for name, r in runs.items()}
    lines = ["| step graph | CUDA graph | mean step ms | end to end s | max abs latent diff |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {v['cuda_graph']} | {v['step_mean_ms']:.3f} | {v['end_to_end_s']:.3f} | "
              f"{v['latents_max_diff_vs_step_onnx']:.2e} |" for name, v in out.items()]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(out, indent=2))
        (args.out / "table.md").write_text(text + "\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("count", help="CPU: nodes and FLOPs moved to batch b")
    c.add_argument("--unet", type=Path, required=True)
    c.add_argument("--height", type=int, default=64)
    c.add_argument("--width", type=int, default=64)
    c.add_argument("--sequence", type=int, default=77)
    t = sub.add_parser("time", help="GPU: step time with and without cfg-late")
    t.add_argument("--folder", type=Path, required=True, help="an ort-cuda (fp16) optimized pipeline folder")
    t.add_argument("--kind", choices=["sd15", "sdxl"], default="sd15")
    t.add_argument("--runs", type=int, default=5)
    t.add_argument("--out", type=Path)
    t.add_argument("--dry-run", action="store_true", help="CPU rehearsal on a tiny (tensorrt-target) folder")
    args = ap.parse_args(argv)
    (count if args.mode == "count" else time_variants)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
