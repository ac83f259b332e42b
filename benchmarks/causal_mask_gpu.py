"""Causal text-encoder attention on the CUDA EP: MultiHeadAttention's ``unidirectional=1`` against
the same causal mask given as an additive ``attention_bias``.

fuse-attention writes ``unidirectional=1`` (com.microsoft Attention with packed QKV weights for self-attention) for every mask it proves causal (CLIP's, from either
exporter, and ONNX ``Attention(is_causal=1)`` lowered by canonicalize-attention). This measures
whether ORT's CUDA kernels run that faster than the explicit mask, on the full-size CLIP-L (SD 1.5,
SDXL's first encoder) and OpenCLIP bigG (SDXL's second), batch 2 x 77 tokens, fp16, CUDA graph off
and on. Seeded random weights from ``models/``.

    python -m benchmarks.causal_mask_gpu --work /tmp/causal --json causal.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx

from onnxopt.domains import MS_DOMAIN


def with_attention_bias(src: Path, dst: Path, sequence: int) -> int:
    """``src`` with each causal Attention/MultiHeadAttention given the causal mask as attention_bias instead of
    unidirectional=1; returns how many it changed."""
    model = onnx.load(str(src))
    half = any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer)
    dtype = np.float16 if half else np.float32  # the attention's own type
    mask = np.triu(np.full((sequence, sequence), np.finfo(dtype).min, dtype), k=1)[None, None]
    model.graph.initializer.append(onnx.numpy_helper.from_array(mask, "causal_attention_bias"))
    changed = 0
    for node in model.graph.node:
        if node.domain != MS_DOMAIN or node.op_type not in ("Attention", "MultiHeadAttention"):
            continue
        if not any(a.name == "unidirectional" and a.i == 1 for a in node.attribute):
            continue
        kept = [a for a in node.attribute if a.name != "unidirectional"]
        del node.attribute[:]
        node.attribute.extend(kept)
        # attention_bias is input 5 of both (Attention: input weights bias mask_index past; MultiHeadAttention:
        # query key value bias key_padding_mask)
        inputs = list(node.input) + [""] * (5 - len(node.input))
        del node.input[:]
        node.input.extend(inputs[:5] + ["causal_attention_bias"])
        changed += 1
    onnx.save(model, str(dst))
    return changed


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(args[:4])}...: exit {done.returncode}\n{done.stderr[-2000:]}")
    return done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--families", default="clip-text,openclip-text")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    for family in args.families.split(","):
        work = args.work / family
        work.mkdir(parents=True, exist_ok=True)
        source, uni, bias = work / "source.onnx", work / "unidirectional.onnx", work / "attention_bias.onnx"
        if not source.exists():
            run("-m", "models", "build", family, "--size", "full", "--exporter", "torchscript", "--no-check", "-o", str(source))
        if not uni.exists():
            run("-m", "onnxopt", "optimize", "-i", str(source), "-o", str(uni), "--passes", "ort-cuda,fp16", "-q")
        changed = with_attention_bias(uni, bias, 77)
        table = run("-m", "onnxopt", "bench", str(uni), str(bias), "--labels", "unidirectional,attention_bias",
                    "--shape", "input_ids=2,77", "--cuda-graph", "both", "--runs", "50",
                    "--json", str(work / "bench.json"))
        print(f"## {family}: {changed} attentions\n{table}", flush=True)
        results[family] = {"attentions": changed, "bench": json.loads((work / "bench.json").read_text())}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
