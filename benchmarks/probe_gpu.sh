#!/usr/bin/env bash
# A quick look at candidate preset changes on the full SD1.5 UNet (TorchScript dynamic export only,
# no ONNX Runtime optimizer run): onnxopt's preset and variants of it (each --extra), timed with and
# without CUDA graph, then a per-kernel profile of the preset's model. One 10-minute device call.
#   bash benchmarks/probe_gpu.sh OUT [--extra LABEL:SPEC ...]
set -uo pipefail
out=$1; shift
work=/tmp/unet-probe
export PYTHONPATH=/tmp/site:$PWD
mkdir -p "$out"
python3 -m benchmarks.unet_gpu --work $work --variants ts-dynamic --skip raw,ort --budget 420 --out "$out/probe" "$@" 2>&1 \
  | grep -v "^\[.*\] \.\.\.$" | tail -12
python3 -m benchmarks.kernels_gpu $work/ts-dynamic/onnxopt_fp16.onnx --inputs $work/reference.npz --top 45 \
  --json "$out/kernels.json" 2>&1 | grep -v "^\[\|No registered plugin" | tail -70 > "$out/kernels.md"
head -60 "$out/kernels.md"
