#!/usr/bin/env bash
# One pipeline kind end to end on two GPUs of one machine (benchmarks/pipeline_gpu.py --side): the torch
# rows (fp32 reference, eager, torch.compile) on GPU $2, the ONNX side (folder, optimize, onnxopt) on GPU
# $3 at once, Flux's T5 export beside its transformer's; then the merge, which scores the ONNX rows
# against the torch side's fp32 reference. Each side is rerun until it stops printing "budget spent"
# (a full-size Flux step runs alone in its process). Logs and results: $RESULTS (default /tmp/out):
# KIND-{torch,t5,onnx,merge}.log, KIND-all/{results.json,table.md}; ALL-DONE ends KIND-merge.log.
#
#   setsid nohup bash benchmarks/pipeline_two_gpus.sh flux-dev 0 1 > /tmp/dev.log 2>&1 < /dev/null &
#   setsid nohup bash benchmarks/pipeline_two_gpus.sh flux-schnell 2 3 > /tmp/schnell.log 2>&1 < /dev/null &
#
# (both at once on a 4-GPU machine: benchmarks/results/h100x4-2026-11-27-flux-pipelines/). PYTHONPATH
# puts /tmp/ort first: onnxruntime-gpu may be installed there (renamed into place) while the exports
# run, which need none.
set -u
KIND=${1:?kind, e.g. flux-dev}; TG=${2:-0}; OG=${3:-1}
R=${RESULTS:-/tmp/out}
export PYTHONPATH=/tmp/ort:/tmp/site:$PWD
mkdir -p "$R"
W="--kind $KIND --budget 5000"
ON="--side onnx --work /tmp/po --scratch /dev/shm/po"
loop() {
  local log=$R/last.$BASHPID  # $BASHPID here, not in the redirect: there bash expands it in the child
  for _ in $(seq 1 14); do
    python -m benchmarks.pipeline_gpu $W "$@" > "$log" 2>&1
    cat "$log"
    grep -q "budget spent" "$log" || break
  done
}
( export CUDA_VISIBLE_DEVICES=$TG; loop --side torch --work /tmp/pt --out "$R/$KIND-torch"; echo TORCH-DONE ) \
    > "$R/$KIND-torch.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=$OG
  parts=""
  case $KIND in flux-*)  # T5's export (10 min) beside the transformer's; each records its step only
    python -m benchmarks.pipeline_gpu $W $ON --out "$R/$KIND-onnx" --skip "folder: transformer" > "$R/$KIND-t5.log" 2>&1 &
    parts=$!
    python -m benchmarks.pipeline_gpu $W $ON --out "$R/$KIND-onnx" --skip "folder: text_encoder_2"
    wait $parts; cat "$R/$KIND-t5.log";;
  esac
  loop $ON --out "$R/$KIND-onnx"; echo ONNX-DONE
) > "$R/$KIND-onnx.log" 2>&1 &
wait
CUDA_VISIBLE_DEVICES=$OG python -m benchmarks.pipeline_gpu $W $ON --resume-from "$R/$KIND-torch" \
    --out "$R/$KIND-all" > "$R/$KIND-merge.log" 2>&1
echo ALL-DONE >> "$R/$KIND-merge.log"
