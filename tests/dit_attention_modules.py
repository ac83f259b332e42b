"""Tiny attention modules of the diffusion transformers, built from diffusers/transformers with seeded
weights, and their exports: the unit graphs tests/test_dit_attention.py proves the fusions on.

* ``sd3-joint``: diffusers ``Attention`` with ``JointAttnProcessor2_0`` (SD3/SD3.5's MMDiT block:
  image and text streams projected apart, attended over their concatenation, split back);
  ``qk_norm="rms_norm"`` as SD3.5, or None as SD3 Medium.
* ``flux-double``: ``FluxAttention`` with ``FluxAttnProcessor`` (Flux's double-stream block) and
  the rotary tables ``FluxPosEmbed`` computes from ``txt_ids``/``img_ids`` inside the graph.
* ``flux-single``: ``FluxSingleTransformerBlock`` (Q/K/V and the MLP read one normed input).
* ``t5``: a two-layer ``T5EncoderModel`` (unscaled attention, relative-position bias shared by the
  layers, and the padding mask added to it).

TorchScript (opset 17) cannot export ``aten::rms_norm``: for that exporter every ``torch.nn.RMSNorm``
is swapped for the same math written out, as optimum's exporter does (models.dit.rms_norm_written_out).
``dtype="bfloat16"`` exports the module and its float inputs in bfloat16, as Flux and T5 are served.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEADS, HEAD_DIM, WIDTH = 4, 16, 64
IMAGE_TOKENS, TEXT_TOKENS = 12, 5
FLUX_AXES = (4, 6, 6)  # FluxPosEmbed's axes_dim: sum is the head dim


@dataclass
class AttentionModule:
    name: str
    module: object
    inputs: dict  # name -> torch tensor
    dynamic: dict  # input name -> {axis: dim name}
    outputs: list[str]
    attentions: int  # attention sites in the module


def _seeded(module, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.eval()


def _flux_ids():
    import torch

    txt_ids = torch.zeros(TEXT_TOKENS, 3)
    rows, cols = 3, IMAGE_TOKENS // 3
    img_ids = torch.zeros(rows, cols, 3)
    img_ids[..., 1] = torch.arange(rows)[:, None]
    img_ids[..., 2] = torch.arange(cols)[None, :]
    return txt_ids, img_ids.reshape(-1, 3)


def sd3_joint(qk_norm: str | None = "rms_norm") -> AttentionModule:
    import torch
    from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0

    torch.manual_seed(0)
    attn = Attention(query_dim=WIDTH, cross_attention_dim=None, added_kv_proj_dim=WIDTH, dim_head=HEAD_DIM, heads=HEADS,
                     out_dim=WIDTH, context_pre_only=False, bias=True, processor=JointAttnProcessor2_0(),
                     qk_norm=qk_norm, eps=1e-6)
    _seeded(attn)

    class Joint(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, hidden_states, encoder_hidden_states):
            return self.attn(hidden_states, encoder_hidden_states)

    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(2, IMAGE_TOKENS, WIDTH, generator=g),
              "encoder_hidden_states": torch.randn(2, TEXT_TOKENS, WIDTH, generator=g)}
    dynamic = {"hidden_states": {0: "batch", 1: "image_tokens"}, "encoder_hidden_states": {0: "batch", 1: "text_tokens"}}
    return AttentionModule(f"sd3-joint{'-qknorm' if qk_norm else ''}", Joint(), inputs, dynamic, ["image", "text"], 1)


def flux_double() -> AttentionModule:
    import torch
    from diffusers.models.transformers.transformer_flux import FluxAttention, FluxPosEmbed

    torch.manual_seed(0)
    attn = _seeded(FluxAttention(query_dim=WIDTH, heads=HEADS, dim_head=HEAD_DIM, added_kv_proj_dim=WIDTH, bias=True,
                                 eps=1e-6, context_pre_only=False))
    pos_embed = FluxPosEmbed(theta=10000, axes_dim=list(FLUX_AXES))

    class Double(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.pos_embed = attn, pos_embed

        def forward(self, hidden_states, encoder_hidden_states, txt_ids, img_ids):
            rotary = self.pos_embed(torch.cat([txt_ids, img_ids], dim=0))
            return self.attn(hidden_states, encoder_hidden_states, image_rotary_emb=rotary)

    g = torch.Generator().manual_seed(1)
    txt_ids, img_ids = _flux_ids()
    inputs = {"hidden_states": torch.randn(2, IMAGE_TOKENS, WIDTH, generator=g),
              "encoder_hidden_states": torch.randn(2, TEXT_TOKENS, WIDTH, generator=g),
              "txt_ids": txt_ids, "img_ids": img_ids}
    dynamic = {"hidden_states": {0: "batch", 1: "image_tokens"}, "encoder_hidden_states": {0: "batch", 1: "text_tokens"},
               "txt_ids": {0: "text_tokens"}, "img_ids": {0: "image_tokens"}}
    return AttentionModule("flux-double", Double(), inputs, dynamic, ["image", "text"], 1)


def flux_single() -> AttentionModule:
    import torch
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed, FluxSingleTransformerBlock

    torch.manual_seed(0)
    block = _seeded(FluxSingleTransformerBlock(dim=WIDTH, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM))
    pos_embed = FluxPosEmbed(theta=10000, axes_dim=list(FLUX_AXES))

    class Single(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.pos_embed = block, pos_embed

        def forward(self, hidden_states, encoder_hidden_states, temb, txt_ids, img_ids):
            rotary = self.pos_embed(torch.cat([txt_ids, img_ids], dim=0))
            return self.block(hidden_states, encoder_hidden_states, temb, image_rotary_emb=rotary)

    g = torch.Generator().manual_seed(1)
    txt_ids, img_ids = _flux_ids()
    inputs = {"hidden_states": torch.randn(2, IMAGE_TOKENS, WIDTH, generator=g),
              "encoder_hidden_states": torch.randn(2, TEXT_TOKENS, WIDTH, generator=g),
              "temb": torch.randn(2, WIDTH, generator=g), "txt_ids": txt_ids, "img_ids": img_ids}
    dynamic = {"hidden_states": {0: "batch", 1: "image_tokens"}, "encoder_hidden_states": {0: "batch", 1: "text_tokens"},
               "temb": {0: "batch"}, "txt_ids": {0: "text_tokens"}, "img_ids": {0: "image_tokens"}}
    return AttentionModule("flux-single", Single(), inputs, dynamic, ["text", "image"], 1)


def t5_encoder() -> AttentionModule:
    import torch
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=64, d_model=WIDTH, d_kv=HEAD_DIM, num_heads=HEADS, num_layers=2, d_ff=96,
                      feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                      relative_attention_max_distance=16, dropout_rate=0.0)
    torch.manual_seed(0)
    config._attn_implementation = "eager"  # transformers picks SDPA otherwise, which the dynamo exporter cannot decompose here
    model = T5EncoderModel(config).eval()

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[1, 6:] = 0
    dynamic = {"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"}}
    return AttentionModule("t5", Encoder(), {"input_ids": ids, "attention_mask": mask}, dynamic, ["last_hidden_state"], 2)


BUILDERS = {"sd3-joint": sd3_joint, "sd3-joint-plain": lambda: sd3_joint(None), "flux-double": flux_double,
            "flux-single": flux_single, "t5": t5_encoder}


def export_module(name: str, path: Path, exporter: str, shapes: str = "dynamic", opset: int | None = None,
                  dtype: str | None = None) -> AttentionModule:
    """Export module ``name`` to ``path``: TorchScript at opset 17 (RMSNorm written out) or dynamo;
    ``dtype`` (``"bfloat16"``) casts the module and its float inputs first."""
    import contextlib
    import io
    import warnings

    import torch

    from models.dit import rms_norm_written_out

    built = BUILDERS[name]()
    if dtype is not None:
        built.module.to(getattr(torch, dtype))
        built.inputs = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in built.inputs.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(built.inputs)
    args = tuple(built.inputs.values())
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            with rms_norm_written_out(built.module):
                torch.onnx.export(built.module, args, str(path), dynamo=False, opset_version=17, input_names=names,
                                  output_names=built.outputs,
                                  dynamic_axes=built.dynamic if shapes == "dynamic" else None)
        else:
            kwargs = {"opset_version": opset} if opset else {}
            dims = None
            if shapes == "dynamic":
                dims = {k: {a: torch.export.Dim.AUTO for a in axes} for k, axes in built.dynamic.items()}
            torch.onnx.export(built.module, args, str(path), dynamo=True, input_names=names, output_names=built.outputs,
                              dynamic_shapes=dims, **kwargs)
    return built


def feeds(built: AttentionModule) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in built.inputs.items()}
