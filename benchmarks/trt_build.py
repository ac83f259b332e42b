"""Full-size UNet TensorRT-RTX engines, built for an RTX/Ada GPU on any machine, beside ORT CUDA's session creation.

    python -m benchmarks.trt_build --work /tmp/trt-build --family unet-sd15,unet-sdxl --compute-capability 8.9 --budget 540

For each family (seeded random weights from ``models/``, the TorchScript export with dynamic axes):

  export     the full-size UNet to ONNX (``models.export``);
  tensorrt   onnxopt ``--passes tensorrt,fp16`` (the graph TensorRT gets: standard ops, strongly typed fp16);
  engine     ``onnxopt build`` of that graph for ``--compute-capability`` (the code path of the CLI,
             ``onnxopt.runners.tensorrt.build_engine``), in a process of its own: build seconds,
             engine MB, the process's peak RSS, layers and what the engine inspector says of fusion;
             fixed at the family's generation size (batch 2, 64x64 latent for SD 1.5, 128x128 for
             SDXL, 77 tokens);
  ort-cuda   (when onnxruntime-gpu has the CUDA EP here) onnxopt ``ort-cuda,fp16`` of the same export,
             and the seconds to create its CUDA EP session: what an ORT CUDA user waits instead of a build.

TensorRT-RTX runs engines on compute capability 8.0 8.6 8.9 12.x only: on an H100 or H200 (9.0)
the engines are built, not run. Steps are resumable (each result is kept in <work>/results.json and
skipped when present) and the script stops between steps once ``--budget`` seconds have passed, so
a run can span several calls of a time-limited machine; the table is printed at the end of each.

TensorRT-RTX on a machine that cannot download (Python 3.12): stage the wheels here,

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        -d .gpu/trt tensorrt-rtx-cu13-bindings==1.7.1.116 tensorrt-rtx-cu13-libs==1.7.1.116 polygraphy==0.53.6
    pip wheel --no-deps -w .gpu/trt tensorrt-rtx==1.7.1.116 tensorrt-rtx-cu13==1.7.1.116   # sdists: pure-Python shims
    split -b 55000000 -d -a 1 .gpu/trt/tensorrt_rtx_cu13_libs-*.whl .gpu/trt-libs.part && rm .gpu/trt/tensorrt_rtx_cu13_libs-*.whl

carry the parts one call each (64 MiB a call), then join and install them there:

    cat .gpu/trt-libs.part* > /tmp/tensorrt_rtx_cu13_libs-1.7.1.116-py3-none-manylinux_2_28_x86_64.whl
    pip install --no-index --no-deps --target /tmp/site /tmp/tensorrt_rtx_cu13_libs-*.whl .gpu/trt/*.whl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

FAMILY_DIMS = {"unet-sd15": dict(batch=2, height=64, width=64, sequence=77),
               "unet-sdxl": dict(batch=2, height=128, width=128, sequence=77)}


class Steps:
    """Results by key in <work>/results.json; a step whose key is there is not run again."""

    def __init__(self, work: Path, budget: float):
        self.work, self.budget, self.start = work, budget, time.monotonic()
        self.path = work / "results.json"
        self.results = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def run(self, key: str, fn) -> dict | None:
        if key in self.results:
            return self.results[key]
        if time.monotonic() - self.start > self.budget:
            print(f"budget spent: stopping before {key}; run again to go on", flush=True)
            return None
        print(f"{key} ...", flush=True)
        self.results[key] = fn()
        self.path.write_text(json.dumps(self.results, indent=2))
        return self.results[key]


def export_unet(work: Path, family: str, size: str) -> dict:
    from models import build
    from models.export import export

    path = work / family / "raw.onnx"
    result = export(build(family, size=size), path, exporter="torchscript", shapes="dynamic")
    return {"path": str(path), "seconds": result.seconds, "bytes": result.total_bytes}


def optimized(src: str, dst: Path, passes: list[str]) -> dict:
    import onnxopt

    start = time.perf_counter()
    model, _ = onnxopt.optimize(src, passes)
    onnxopt.save_model(model, dst, external_data=True)
    return {"path": str(dst), "seconds": time.perf_counter() - start}


def engine_in_a_process(onnx_path: str, engine: Path, family: str, capabilities: list[str]) -> dict:
    """``build_engine`` in a child process, so that its peak RSS is the build's own."""
    args = [sys.executable, "-m", "benchmarks.trt_build", "--one-build", onnx_path, str(engine), family, *capabilities]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"engine build failed ({done.returncode}): {' | '.join(tail)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_build(onnx_path: str, engine: str, family: str, capabilities: list[str]) -> None:
    from onnxopt.report import process_memory
    from onnxopt.runners.tensorrt import build_engine, parse_compute_capability

    info = build_engine(onnx_path, engine, precision="fp16", dims=FAMILY_DIMS[family],
                        compute_capabilities=[parse_compute_capability(c) for c in capabilities])
    print(info.summary(), file=sys.stderr)
    print(json.dumps({**info.as_dict(), "peak_rss_bytes": process_memory().peak_bytes}))


def ort_session_seconds(path: str) -> dict:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    start = time.perf_counter()
    ort.InferenceSession(path, options, providers=["CUDAExecutionProvider"])
    return {"session_seconds": time.perf_counter() - start}


def table(results: dict, families: list[str]) -> str:
    lines = ["| family | ONNX export | tensorrt,fp16 | engine build | engine MB | build peak RSS | layers (Myelin, fused) | ORT CUDA session |",
             "|---|---|---|---|---|---|---|---|"]
    for family in families:
        get = lambda step: results.get(f"{family}/{step}") or {}  # noqa: E731
        engine, ort_cuda = get("engine"), get("ort-cuda-session")
        layers = engine.get("engine_layers") or {}
        lines.append("| " + " | ".join([
            family,
            f"{get('export').get('seconds', float('nan')):.0f} s",
            f"{get('tensorrt').get('seconds', float('nan')):.0f} s",
            f"{engine['build_seconds']:.0f} s ({' '.join(engine['compute_capabilities'])})" if engine else "-",
            f"{engine['engine_bytes'] / 1e6:.0f}" if engine else "-",
            f"{engine['peak_rss_bytes'] / 1e9:.2f} GB" if engine else "-",
            f"{layers.get('layers', '-')} ({layers.get('myelin_layers', '-')}, {layers.get('fused_layers', '-')})",
            f"{ort_cuda['session_seconds']:.1f} s" if ort_cuda else "-",
        ]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one-build"]:
        one_build(argv[1], argv[2], argv[3], argv[4:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--family", default="unet-sd15,unet-sdxl")
    parser.add_argument("--compute-capability", default="8.9", help="comma-separated, e.g. 8.9 or 8.6,8.9")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds after which no new step starts")
    parser.add_argument("--size", choices=["full", "tiny"], default="full", help="tiny: a smoke test of the script")
    args = parser.parse_args(argv)
    families = [f for f in args.family.split(",") if f]
    unknown = set(families) - set(FAMILY_DIMS)
    if unknown:
        raise SystemExit(f"unknown family {', '.join(sorted(unknown))}: choose from {', '.join(FAMILY_DIMS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    steps = Steps(args.work, args.budget)
    try:
        import onnxruntime as ort

        cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    except ImportError:
        cuda = False
    for family in families:
        folder = args.work / family
        raw = steps.run(f"{family}/export", lambda: export_unet(args.work, family, args.size))
        trt = raw and steps.run(f"{family}/tensorrt", lambda: optimized(raw["path"], folder / "unet.trt.onnx", ["tensorrt", "fp16"]))
        trt and steps.run(f"{family}/engine", lambda: engine_in_a_process(
            trt["path"], folder / "unet.plan", family, args.compute_capability.split(",")))
        if raw and cuda:
            ort_model = steps.run(f"{family}/ort-cuda", lambda: optimized(raw["path"], folder / "unet.ort.onnx", ["ort-cuda", "fp16"]))
            ort_model and steps.run(f"{family}/ort-cuda-session", lambda: ort_session_seconds(ort_model["path"]))
    print(table(steps.results, families))
    print(f"(results: {steps.path}; engines for {args.compute_capability} cannot run on this GPU unless it is one of 8.0 8.6 8.9 12.x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
