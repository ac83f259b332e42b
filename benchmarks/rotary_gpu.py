"""Flux's rotary embedding on the ORT CUDA EP: com.microsoft RotaryEmbedding against the exported elementwise form.

    python -m benchmarks.rotary_gpu [--work DIR] [--tokens 4096] [--text 512] [--json out.json]

Builds one Flux.1-dev-shaped double-stream attention (diffusers ``FluxAttention``: width 3072, 24
heads of 128, QK RMSNorm, the rotary tables computed in the graph from ``txt_ids``/``img_ids`` by
``FluxPosEmbed(axes_dim=(16, 56, 56))``, 512 text + 4096 image tokens, batch 1), exports it with
the dynamo exporter (static shapes) and writes two fp16 models:

* ``elementwise``: ``cleanup,fuse-attention,fp16``: MultiHeadAttention, the rotary left as exported
  (Reshape/Slice/Neg/Concat/Mul/Add on Q and K);
* ``rotary``: ``cleanup,fuse-rotary-embedding,fuse-attention,fp16``: the rotary as two
  RotaryEmbedding(interleaved=1) nodes in front of the same MultiHeadAttention.

Both are timed by ``onnxopt bench`` (IO binding, CUDA graph off and on); tests/test_dit_attention.py
proves the two rewrites on the tiny modules. The attention op's own rotary (GroupQueryAttention's
``do_rotary``) indexes its tables by the token's position in the sequence, one axis; Flux's tables
come from 3-axis ids, so it has no form for them and is not a candidate.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def export_flux_attention(path: Path, tokens: int, text: int) -> None:
    import torch
    from diffusers.models.transformers.transformer_flux import FluxAttention, FluxPosEmbed

    torch.manual_seed(0)
    width, heads, head_dim = 3072, 24, 128
    attn = FluxAttention(query_dim=width, heads=heads, dim_head=head_dim, added_kv_proj_dim=width, bias=True, eps=1e-6,
                         context_pre_only=False).eval()
    pos_embed = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])

    class Double(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.pos_embed = attn, pos_embed

        def forward(self, hidden_states, encoder_hidden_states, txt_ids, img_ids):
            return self.attn(hidden_states, encoder_hidden_states,
                             image_rotary_emb=self.pos_embed(torch.cat([txt_ids, img_ids], dim=0)))

    side = int(tokens ** 0.5)
    img_ids = torch.zeros(side, tokens // side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(tokens // side)[None, :]
    args = (torch.randn(1, tokens, width), torch.randn(1, text, width), torch.zeros(text, 3), img_ids.reshape(-1, 3))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(Double(), args, str(path), dynamo=True,
                      input_names=["hidden_states", "encoder_hidden_states", "txt_ids", "img_ids"],
                      output_names=["image", "text"])


def onnxopt(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "onnxopt", *args], check=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("rotary-bench"))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--text", type=int, default=512)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    source = args.work / "flux-attention.onnx"
    if not source.exists():
        export_flux_attention(source, args.tokens, args.text)
    variants = {"elementwise": "cleanup,fuse-attention,fp16",
                "rotary": "cleanup,fuse-rotary-embedding,fuse-attention,fp16"}
    for label, passes in variants.items():
        out = args.work / f"{label}.onnx"
        if not out.exists():
            onnxopt("optimize", "-i", str(source), "-o", str(out), "--passes", passes, "--strict")
    bench = ["bench", *(str(args.work / f"{label}.onnx") for label in variants), "--labels", ",".join(variants),
             "--cuda-graph", "both", "--markdown", str(args.work / "rotary.md")]
    if args.json:
        bench += ["--json", str(args.json)]
    onnxopt(*bench)
    return 0


if __name__ == "__main__":
    sys.exit(main())
