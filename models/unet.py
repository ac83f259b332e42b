"""UNet2DConditionModel builders: SD 1.5, SD 2.1, SDXL and LCM (guidance-distilled SD 1.5), full size and tiny.

Full-size configs are written by hand after the public ``unet/config.json`` of
runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-2-1,
stabilityai/stable-diffusion-xl-base-1.0; the LCM one is SD 1.5's with the
``time_cond_proj_dim`` of SimianLuo/LCM_Dreamshaper_v7 (256: the guidance embedding, an input
``timestep_cond`` [batch, dim] as optimum exports it).  The tiny configs keep each variant's
structure (block types, linear vs conv projection, constant-heads vs
constant-head-dim, text_time conditioning, several transformer layers per
block, GEGLU feed-forward) with very small channels.

Note the diffusers quirk: ``attention_head_dim`` in these configs is really
the number of heads (SD 1.5: 8 heads everywhere, head dim 40/80/160; SD 2.1
and SDXL: 5/10/20 heads, head dim 64).
"""
from __future__ import annotations

import torch

from .base import BuiltModel, check_choice, count_sites, set_diffusers_attention, site_module_names, SIZES
from .seeding import init_module, seed_everything

_SD_COMMON = dict(
    act_fn="silu",
    center_input_sample=False,
    downsample_padding=1,
    flip_sin_to_cos=True,
    freq_shift=0,
    in_channels=4,
    out_channels=4,
    mid_block_scale_factor=1,
    norm_eps=1e-5,
)

CONFIGS = {
    # runwayml/stable-diffusion-v1-5 unet/config.json
    ("unet-sd15", "full"): dict(
        _SD_COMMON,
        attention_head_dim=8,
        block_out_channels=(320, 640, 1280, 1280),
        cross_attention_dim=768,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        layers_per_block=2,
        norm_num_groups=32,
        sample_size=64,
    ),
    # stabilityai/stable-diffusion-2-1 unet/config.json
    ("unet-sd21", "full"): dict(
        _SD_COMMON,
        attention_head_dim=(5, 10, 20, 20),
        block_out_channels=(320, 640, 1280, 1280),
        cross_attention_dim=1024,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        dual_cross_attention=False,
        layers_per_block=2,
        norm_num_groups=32,
        sample_size=96,
        upcast_attention=True,
        use_linear_projection=True,
    ),
    # stabilityai/stable-diffusion-xl-base-1.0 unet/config.json
    ("unet-sdxl", "full"): dict(
        _SD_COMMON,
        addition_embed_type="text_time",
        addition_embed_type_num_heads=64,
        addition_time_embed_dim=256,
        attention_head_dim=(5, 10, 20),
        block_out_channels=(320, 640, 1280),
        cross_attention_dim=2048,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        layers_per_block=2,
        mid_block_type="UNetMidBlock2DCrossAttn",
        norm_num_groups=32,
        projection_class_embeddings_input_dim=2816,  # 1280 pooled text_embeds + 6 * 256 time_ids
        sample_size=128,
        transformer_layers_per_block=(1, 2, 10),
        use_linear_projection=True,
    ),
    # Tiny SD 1.5: conv proj_in/out, constant heads (2) with varying head dim (4, 8), GroupNorm
    # with 2 and 4 channels per group, cross_attention_dim unlike any channel count.
    # (8, 16) channels keep the ONNX file near 0.5 MB (fixtures); (16, 32) would be 1.1 MB.
    ("unet-sd15", "tiny"): dict(
        _SD_COMMON,
        attention_head_dim=2,
        block_out_channels=(8, 16),
        cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=16,
    ),
    # Tiny SD 2.1: linear proj_in/out, constant head dim 8 (2 and 4 heads), upcast attention.
    ("unet-sd21", "tiny"): dict(
        _SD_COMMON,
        attention_head_dim=(2, 4),
        block_out_channels=(16, 32),
        cross_attention_dim=24,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=16,
        upcast_attention=True,
        use_linear_projection=True,
    ),
    # Tiny SDXL: text_time conditioning, 3 blocks (DownBlock2D first), 1/2/3 transformer
    # layers per block, head dim 8, linear projection.
    ("unet-sdxl", "tiny"): dict(
        _SD_COMMON,
        addition_embed_type="text_time",
        addition_embed_type_num_heads=64,
        addition_time_embed_dim=8,
        attention_head_dim=(1, 2, 2),
        block_out_channels=(8, 16, 16),
        cross_attention_dim=64,  # tiny clip-text hidden (32) + tiny openclip-text hidden (32), as 2048 = 768 + 1280
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        layers_per_block=1,
        mid_block_type="UNetMidBlock2DCrossAttn",
        norm_num_groups=4,
        projection_class_embeddings_input_dim=24 + 6 * 8,  # pooled text_embeds (24, tiny openclip) + 6 * 8 time_ids
        sample_size=16,
        transformer_layers_per_block=(1, 2, 3),
        use_linear_projection=True,
    ),
}

# LCM: SD 1.5's UNet with the guidance embedding's width of SimianLuo/LCM_Dreamshaper_v7 (tiny: a width
# unlike any channel count)
CONFIGS[("unet-lcm", "full")] = dict(CONFIGS[("unet-sd15", "full")], time_cond_proj_dim=256)
CONFIGS[("unet-lcm", "tiny")] = dict(CONFIGS[("unet-sd15", "tiny")], time_cond_proj_dim=10)

FAMILIES = ("unet-sd15", "unet-sd21", "unet-sdxl", "unet-lcm")

# Example dims: all dynamic dims >= 2 (the dynamo exporter specialises 0/1 sizes);
# tiny latents are not square so that H/W mix-ups show.
EXAMPLE_DIMS = {
    ("unet-sd15", "full"): dict(batch=2, height=64, width=64, sequence=77),
    ("unet-sd21", "full"): dict(batch=2, height=96, width=96, sequence=77),
    ("unet-sdxl", "full"): dict(batch=2, height=128, width=128, sequence=77),
    ("unet-lcm", "full"): dict(batch=2, height=64, width=64, sequence=77),
    ("unet-sd15", "tiny"): dict(batch=2, height=16, width=12, sequence=77),
    ("unet-sd21", "tiny"): dict(batch=2, height=16, width=12, sequence=77),
    ("unet-sdxl", "tiny"): dict(batch=2, height=16, width=12, sequence=77),
    ("unet-lcm", "tiny"): dict(batch=2, height=16, width=12, sequence=77),
}
ALT_DIMS = {
    "full": dict(batch=1, height=32, width=48, sequence=77),
    "tiny": dict(batch=3, height=8, width=20, sequence=40),
}


class UNetWrapper(torch.nn.Module):
    """(sample, timestep, encoder_hidden_states[, timestep_cond]) -> (out_sample,)"""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states, timestep_cond=None):
        return (self.unet(sample, timestep, encoder_hidden_states, timestep_cond=timestep_cond, return_dict=False)[0],)


class UNetXLWrapper(torch.nn.Module):
    """(sample, timestep, encoder_hidden_states, text_embeds, time_ids) -> (out_sample,)"""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states, text_embeds, time_ids):
        added = {"text_embeds": text_embeds, "time_ids": time_ids}
        return (self.unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=added, return_dict=False)[0],)


def make_unet(family: str, size: str, seed: int = 0, **overrides):
    """The seeded UNet of ``family``/``size``; ``overrides``: config values changed (e.g. in_channels=9,
    an inpainting UNet)."""
    from diffusers import UNet2DConditionModel

    seed_everything(seed)
    unet = UNet2DConditionModel(**dict(CONFIGS[(family, size)], **overrides))
    return init_module(unet, seed)


def overall_down_factor(config: dict) -> int:
    return 2 ** (len(config["block_out_channels"]) - 1)


def build(family: str, size: str = "tiny", attention: str = "sdpa", seed: int = 0) -> BuiltModel:
    check_choice("family", family, FAMILIES)
    check_choice("size", size, SIZES)
    cfg = CONFIGS[(family, size)]
    unet = make_unet(family, size, seed)
    set_diffusers_attention(unet, attention)
    xl = cfg.get("addition_embed_type") == "text_time"
    wrapper = (UNetXLWrapper if xl else UNetWrapper)(unet).eval()
    cross = cfg["cross_attention_dim"]
    n_time = cfg.get("projection_class_embeddings_input_dim", 0)
    text_dim = n_time - 6 * cfg.get("addition_time_embed_dim", 0)

    specs = [
        dict(name="sample", shape=["batch", 4, "height", "width"], dtype="float32", kind="latent"),
        dict(name="timestep", shape=["batch"], dtype="float32", kind="timestep"),
        dict(name="encoder_hidden_states", shape=["batch", "sequence", cross], dtype="float32", kind="hidden"),
    ]
    guidance_embedding = cfg.get("time_cond_proj_dim")
    if guidance_embedding:  # LCM: optimum's name and place for it
        specs.append(dict(name="timestep_cond", shape=["batch", guidance_embedding], dtype="float32", kind="hidden"))
    if xl:
        specs += [
            dict(name="text_embeds", shape=["batch", text_dim], dtype="float32", kind="hidden"),
            dict(name="time_ids", shape=["batch", 6], dtype="float32", kind="time_ids"),
        ]
    output_names = ["out_sample"]
    dyn = {
        "sample": {0: "batch", 2: "height", 3: "width"},
        "timestep": {0: "batch"},
        "encoder_hidden_states": {0: "batch", 1: "sequence"},
        "out_sample": {0: "batch", 2: "height", 3: "width"},
    }
    if guidance_embedding:
        dyn["timestep_cond"] = {0: "batch"}
    if xl:
        dyn["text_embeds"] = {0: "batch"}
        dyn["time_ids"] = {0: "batch"}
    m = overall_down_factor(cfg)
    return BuiltModel(
        family=family,
        size=size,
        attention=attention,
        module=wrapper,
        input_specs=specs,
        output_names=output_names,
        dynamic_axes=dyn,
        example_dims=dict(EXAMPLE_DIMS[(family, size)]),
        alt_dims=dict(ALT_DIMS[size]),
        dim_multiples={"height": m, "width": m},
        sites=count_sites(unet),
        site_modules=site_module_names(unet),
        config=dict(cfg),
        seed=seed,
    )
