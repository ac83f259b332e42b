"""Median call time after a warm-up: CUDA events on the GPU, the host clock on the CPU (dry runs)."""

from __future__ import annotations

import time

import numpy as np


def timed(fn, warmup: int, runs: int, device: str = "cuda") -> dict:
    """Median of ``runs`` calls after ``warmup``: CUDA events on the GPU, the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": float(np.median(times)), "min_ms": float(np.min(times)), "max_ms": float(np.max(times)),
            "runs": runs, "clock": "cuda-events" if device == "cuda" else "host"}
