"""Where a model's GPU time goes, kernel by kernel, on the ORT CUDA EP.

    python -m benchmarks.kernels_gpu A.onnx [B.onnx ...] --inputs reference.npz [--runs 10] [--json out.json]

ORT's own profiler times operators on the host, launch overhead included, so its numbers do not
add up to the GPU time of a CUDA-graph replay. This script records the GPU kernels themselves
through CUPTI (torch.profiler sees every kernel of the process, ONNX Runtime's included), then
prints per model: GPU busy time per run, the kernels by total time, and a summary by family
(attention, convolution, GEMM, normalization, copies/transposes, elementwise). With
``ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1`` it also lists which attention kernel every
MultiHeadAttention node chose (a subprocess per model, since ORT reads that variable once).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter

import numpy as np

FAMILIES = [  # first match wins
    ("fused elementwise", r"biasSplitGelu|BiasSplitGelu|BiasAddKernel|BiasGelu"),  # before "Split" below
    ("attention", r"flash|fmha|attention|Attention|cutlass.*Kernel|mha|softmax|Softmax|sdpa"),
    ("transpose/copy", r"[Tt]ranspose|Unpack|[Cc]opy|nchwToNhwc|nhwcToNchw|Concat|Split|Slice|Gather|Pad|Expand"),
    ("convolution", r"conv|Conv|implicit|xmma_fprop|sm90_xmma|dgrad|fprop|winograd|cudnn"),
    ("gemm", r"gemm|Gemm|cutlass|sm90_|ampere_|cublas|nvjet"),
    ("normalization", r"[Nn]orm|GroupNorm|LayerNorm|InstanceNorm"),
    ("elementwise", r"Elementwise|elementwise|_kernel|Add|Mul|Sigmoid|Gelu|Cast|Unary|Binary"),
]


def family(kernel: str) -> str:
    for name, pattern in FAMILIES:
        if re.search(pattern, kernel):
            return name
    return "other"


def kernel_times(path: str, feeds: dict, runs: int, provider_options: dict | None = None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from onnxopt.runners.ort_cuda import OrtCudaSession

    session = OrtCudaSession(path, provider_options=provider_options)
    session.bind(feeds)
    for _ in range(5):
        session.run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            session.run()
        torch.cuda.synchronize()
    per_kernel: dict[str, list] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us and event.key and not event.key.startswith(("cudaLaunch", "cudaMemcpy", "cudaStream")):
            per_kernel[event.key] = [us / 1000.0 / runs, event.count / runs]
    timing = session.time(warmup=5, runs=20)
    del session
    busy = sum(ms for ms, _ in per_kernel.values())
    families: Counter = Counter()
    for name, (ms, _) in per_kernel.items():
        families[family(name)] += ms
    return {"busy_ms": busy, "latency_ms": timing.median_ms, "kernels": per_kernel, "families": dict(families)}


ATTENTION_DEBUG = r"""
import sys, numpy as np
from onnxopt.runners.ort_cuda import OrtCudaSession
ref = np.load(sys.argv[2])
feeds = {k[3:]: ref[k] for k in ref.files if k.startswith("in_")}
s = OrtCudaSession(sys.argv[1], log_severity=3)
s.bind(feeds)
s.run()
"""


def attention_kernels(path: str, inputs: str) -> dict:
    env = dict(os.environ, ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO="1")
    proc = subprocess.run([sys.executable, "-c", ATTENTION_DEBUG, path, inputs], env=env, capture_output=True, text=True)
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if "Attention" in line and ("kernel" in line.lower() or "=" in line)]
    return dict(Counter(re.sub(r"node=\S+|name=\S+", "", line) for line in lines).most_common(12))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--inputs", required=True, help=".npz with in_<name> arrays (benchmarks.unet_gpu writes one)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    ap.add_argument("--sdpa-kernel", help="ORT CUDA provider option sdpa_kernel for every model (bitmask)")
    args = ap.parse_args(argv)
    ref = np.load(args.inputs)
    feeds = {k[3:]: ref[k] for k in ref.files if k.startswith("in_")}
    options = {"sdpa_kernel": args.sdpa_kernel} if args.sdpa_kernel else None
    results = {}
    for path in args.models:
        try:
            results[path] = kernel_times(path, feeds, args.runs, options)
            results[path]["attention_kernels"] = attention_kernels(path, args.inputs)
        except Exception as exc:
            results[path] = {"error": str(exc).splitlines()[0][:300]}
    for path, r in results.items():
        print(f"\n## {path}")
        if "error" in r:
            print(f"failed: {r['error']}")
            continue
        print(f"GPU busy {r['busy_ms']:.3f} ms per run; latency {r['latency_ms']:.3f} ms (no CUDA graph)")
        print("| family | ms |\n|---|---|")
        for name, ms in sorted(r["families"].items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {ms:.3f} |")
        print("| kernel | ms/run | launches/run |\n|---|---|---|")
        for name, (ms, count) in sorted(r["kernels"].items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"| {name[:110]} | {ms:.3f} | {count:.0f} |")
        for line, n in r.get("attention_kernels", {}).items():
            print(f"  {n}x {line[:160]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
