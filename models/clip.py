"""CLIP text encoder builders (transformers).

``clip-text``:     CLIPTextModel as SD 1.x uses it (openai/clip-vit-large-patch14 text
                   tower: hidden 768, 12 layers, 12 heads, quick_gelu, causal mask).
                   Outputs ``last_hidden_state`` and ``pooler_output``.
``openclip-text``: CLIPTextModelWithProjection as SDXL's ``text_encoder_2`` (OpenCLIP
                   ViT-bigG/14: hidden 1280, 32 layers, 20 heads, gelu, projection
                   1280).  Outputs ``text_embeds`` (projected pooled output),
                   ``last_hidden_state`` and ``penultimate_hidden_state``
                   (``hidden_states[-2]``, what SDXL feeds the UNet).

``attention``: ``sdpa`` -> ``attn_implementation="sdpa"``; ``classic`` -> ``"eager"``.
Both configs use ``eos_token_id=2`` as the public SD configs do, so the pooled
token is picked with ``argmax(input_ids)`` (the EOT token has the highest id).
"""
from __future__ import annotations

import torch

from .base import BuiltModel, check_choice, count_sites, SIZES
from .seeding import init_module, seed_everything

CONFIGS = {
    # stable-diffusion-v1-5 text_encoder/config.json
    ("clip-text", "full"): dict(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
        layer_norm_eps=1e-5, projection_dim=768, bos_token_id=0, eos_token_id=2, pad_token_id=1,
    ),
    # stable-diffusion-xl-base-1.0 text_encoder_2/config.json
    ("openclip-text", "full"): dict(
        vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
        num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu",
        layer_norm_eps=1e-5, projection_dim=1280, bos_token_id=0, eos_token_id=2, pad_token_id=1,
    ),
    ("clip-text", "tiny"): dict(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, hidden_act="quick_gelu",
        layer_norm_eps=1e-5, projection_dim=32, bos_token_id=0, eos_token_id=2, pad_token_id=1,
    ),
    ("openclip-text", "tiny"): dict(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, hidden_act="gelu",
        layer_norm_eps=1e-5, projection_dim=24, bos_token_id=0, eos_token_id=2, pad_token_id=1,
    ),
}

FAMILIES = ("clip-text", "openclip-text")

EXAMPLE_DIMS = {"full": dict(batch=2, sequence=77), "tiny": dict(batch=2, sequence=77)}
ALT_DIMS = {"full": dict(batch=1, sequence=20), "tiny": dict(batch=3, sequence=16)}


class CLIPTextWrapper(torch.nn.Module):
    """(input_ids,) -> (last_hidden_state, pooler_output)"""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, return_dict=True)
        return out.last_hidden_state, out.pooler_output


class OpenCLIPTextWrapper(torch.nn.Module):
    """(input_ids,) -> (text_embeds, last_hidden_state, penultimate_hidden_state)"""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, output_hidden_states=True, return_dict=True)
        return out.text_embeds, out.last_hidden_state, out.hidden_states[-2]


def make_clip(family: str, size: str, attention: str = "sdpa", seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    impl = {"sdpa": "sdpa", "classic": "eager"}[attention]
    cfg = CLIPTextConfig(**CONFIGS[(family, size)])
    cfg._attn_implementation = impl
    cls = CLIPTextModel if family == "clip-text" else CLIPTextModelWithProjection
    seed_everything(seed)
    model = cls(cfg)
    model.set_attn_implementation(impl)
    return init_module(model, seed)


def build(family: str, size: str = "tiny", attention: str = "sdpa", seed: int = 0) -> BuiltModel:
    check_choice("family", family, FAMILIES)
    check_choice("size", size, SIZES)
    check_choice("attention", attention, ("sdpa", "classic"))
    cfg = CONFIGS[(family, size)]
    model = make_clip(family, size, attention, seed)
    vocab = cfg["vocab_size"]

    if family == "clip-text":
        wrapper = CLIPTextWrapper(model).eval()
        outs = ["last_hidden_state", "pooler_output"]
        dyn = {"input_ids": {0: "batch", 1: "sequence"},
               "last_hidden_state": {0: "batch", 1: "sequence"},
               "pooler_output": {0: "batch"}}
    else:
        wrapper = OpenCLIPTextWrapper(model).eval()
        outs = ["text_embeds", "last_hidden_state", "penultimate_hidden_state"]
        dyn = {"input_ids": {0: "batch", 1: "sequence"},
               "text_embeds": {0: "batch"},
               "last_hidden_state": {0: "batch", 1: "sequence"},
               "penultimate_hidden_state": {0: "batch", 1: "sequence"}}
    return BuiltModel(
        family=family,
        size=size,
        attention=attention,
        module=wrapper,
        input_specs=[dict(name="input_ids", shape=["batch", "sequence"], dtype="int64", kind="input_ids")],
        output_names=outs,
        dynamic_axes=dyn,
        example_dims=dict(EXAMPLE_DIMS[size]),
        alt_dims=dict(ALT_DIMS[size]),
        dim_multiples={},
        sites=count_sites(model),
        config=dict(cfg),
        seed=seed,
        feed_options={"vocab": vocab, "pad_id": cfg["pad_token_id"] if family == "clip-text" else 0},
    )
