#!/usr/bin/env bash
# Every GPU measurement the open issues ask for, as resumable steps that each fit one 10-minute
# call of the device machine (onnxruntime-gpu installed in /tmp/site, ORT's optimizer's numpy 1.26
# in /tmp/np1; see DEVELOPERS notes in README). Usage: bash benchmarks/gpu_all.sh STEP [OUT]
#   fusion      raw fp16 / ORT optimizer / onnxopt on TS-dynamic, TS-static, dynamo exports,
#               and one more onnxopt variant ($FUSION_EXTRA, unet_gpu's --extra; default: the
#               packed-KV cross-attention)
#   ablation-ts onnxopt bench --ablation on the TS-dynamic export (+ ORT optimizer), and diff
#   ablation-dy the same on the dynamo export
#   context-kv  per-step latency with and without context-KV extraction
#   sdxl        the full SDXL UNet (TorchScript dynamic export, 10 GB fp32) through
#               ort-cuda,fp16, written with external data: loads, runs, latency with and without
#               CUDA graph, accuracy against torch fp32 at 128x128 latents
# Rerun a step until it prints its table: every step skips what it already did.
set -uo pipefail
step=$1
out=${2:-${OUT:-/tmp/gpu-out}}
work=/tmp/unet-bench
export PYTHONPATH=/tmp/site:$PWD
mkdir -p "$out"
D="--dim batch=2 --dim height=64 --dim width=64 --dim sequence=77"

ablation() {  # $1: export variant
  local v=$1 w=$work/$1
  python3 -m onnxopt bench --ablation ort-cuda,fp16 "$w/raw.onnx" --work "$w/ablation" --build-only >"$out/$v-ablation-build.log" 2>&1
  tail -3 "$out/$v-ablation-build.log"
  local extra=() labels=()
  if [ -f "$w/ort_fp16.onnx" ]; then extra=("$w/ort_fp16.onnx"); labels=(--labels "ORT optimizer"); fi
  python3 -m onnxopt bench --ablation ort-cuda,fp16 "$w/raw.onnx" "${extra[@]}" "${labels[@]}" --work "$w/ablation" $D \
    --cuda-graph both --runs 40 --json "$out/$v-ablation.json" --markdown "$out/$v-ablation.md" 2>&1 | grep -v "^\[" | tail -30
  local last
  last=$(ls "$w"/ablation/*ort-cuda-fp16.onnx | head -1)
  for m in "$w/ablation/00-source-fp16.onnx" "$last" "${extra[@]}"; do
    python3 -m onnxopt diff "$w/raw.onnx" "$m" --runtime cuda $D --atol 2e-2 --rtol 2e-2 \
      --json "$out/$v-diff-$(basename "$m" .onnx).json" 2>&1 | tail -8
  done
  rm -rf "$w/ablation"  # 11 fp16 UNets: the disk holds one export's ablation at a time
}

case $step in
  fusion)
    python3 -m benchmarks.unet_gpu --work $work --variants ts-dynamic,ts-static,dynamo-dynamic --budget 520 \
      --extra "${FUSION_EXTRA:-packed-kv:fuse-attention.cross_layout=packed}" --out "$out/fusion" 2>&1 \
      | grep -v "^\[.*\] \.\.\.$" | tail -40 ;;
  ablation-ts) ablation ts-dynamic ;;
  ablation-dy) ablation dynamo-dynamic ;;
  context-kv)
    python3 -m benchmarks.context_kv_gpu --work /tmp/ckv-bench --budget 520 --source $work/ts-dynamic/raw.onnx \
      --out "$out/context-kv" 2>&1 | tail -30 ;;
  sdxl)
    python3 -m benchmarks.unet_gpu --family unet-sdxl --work /tmp/sdxl-bench --variants ts-dynamic --skip raw,ort \
      --budget 520 --out "$out/sdxl" 2>&1 | grep -v "^\[.*\] \.\.\.$" | tail -20 ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
