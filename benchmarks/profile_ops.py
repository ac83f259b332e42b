"""Where a model's time goes on the ORT CUDA EP: per-op-type kernel time from ORT's profiler.

    python -m benchmarks.profile_ops MODEL.onnx [MODEL2.onnx ...] --inputs reference.npz --runs 20

Prints, per model, the op types by total time per run (ms) and node counts, so two graphs of the
same model (ONNX Runtime's optimizer vs onnxopt) can be compared op by op.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict

import numpy as np


def profile(path: str, feeds: dict, runs: int) -> dict[str, tuple[float, int]]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_profiling = True
    so.log_severity_level = 3
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "prof")
    session = ort.InferenceSession(path, so, providers=["CUDAExecutionProvider"])
    types = {i.name: (np.float16 if "float16" in i.type else np.float32 if "float" in i.type else np.int64) for i in session.get_inputs()}
    feed = {n: feeds[n].astype(t) for n, t in types.items()}
    for _ in range(5):
        session.run(None, feed)
    session.end_profiling()
    session = ort.InferenceSession(path, so, providers=["CUDAExecutionProvider"])
    for _ in range(runs):
        session.run(None, feed)
    events = json.load(open(session.end_profiling()))
    per_op: dict[str, list] = defaultdict(lambda: [0.0, set()])
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e["args"].get("op_name", "?")
            per_op[op][0] += e["dur"] / 1000.0 / runs
            per_op[op][1].add(e["name"])
    return {op: (ms, len(nodes)) for op, (ms, nodes) in per_op.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--inputs", required=True, help=".npz whose in_<name> arrays are the feeds (benchmarks.unet_gpu writes one)")
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args(argv)
    data = np.load(args.inputs)
    feeds = {k[3:]: data[k] for k in data.files if k.startswith("in_")}
    for path in args.models:
        result = profile(path, feeds, args.runs)
        total = sum(ms for ms, _ in result.values())
        print(f"\n{path}: {total:.2f} ms of kernels per run")
        for op, (ms, n) in sorted(result.items(), key=lambda kv: -kv[1][0]):
            print(f"  {op:28s} {ms:7.3f} ms  {n:4d} nodes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
