"""ControlNetModel builder (SD 1.5-like).

Inputs: ``sample`` (latent), ``timestep``, ``encoder_hidden_states`` and
``controlnet_cond`` (an RGB image at 8x the latent resolution; the tiny model
keeps the 8x factor: its conditioning embedding has 4 stages, 3 of them stride 2).
Outputs: the down-block residuals (``down_block_res_0`` ...) and ``mid_block_res``,
with ``conditioning_scale`` fixed at 1.0.

The zero convolutions (``controlnet_down_blocks``, ``controlnet_mid_block``,
``controlnet_cond_embedding.conv_out``) get seeded noise (see :mod:`models.seeding`);
left at zero every output would be exactly zero.
"""
from __future__ import annotations

import torch

from .base import BuiltModel, check_choice, count_sites, set_diffusers_attention, site_module_names, SIZES
from .seeding import init_module, seed_everything
from .unet import CONFIGS as UNET_CONFIGS, EXAMPLE_DIMS as UNET_DIMS, ALT_DIMS as UNET_ALT

_UNET_ONLY = ("up_block_types", "out_channels", "center_input_sample", "sample_size")


def _from_unet(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in _UNET_ONLY}


CONFIGS = {
    # lllyasviel/sd-controlnet-* / control_v11p_sd15_* config.json
    "full": dict(
        _from_unet(UNET_CONFIGS[("unet-sd15", "full")]),
        conditioning_embedding_out_channels=(16, 32, 96, 256),
        controlnet_conditioning_channel_order="rgb",
    ),
    "tiny": dict(
        _from_unet(UNET_CONFIGS[("unet-sd15", "tiny")]),
        conditioning_embedding_out_channels=(8, 8, 16, 16),
        controlnet_conditioning_channel_order="rgb",
    ),
}

FAMILIES = ("controlnet",)


def _res_axes(k: int) -> dict:
    sfx = "" if k == 1 else f"_div{k}"
    return {0: "batch", 2: f"height{sfx}", 3: f"width{sfx}"}


class ControlNetWrapper(torch.nn.Module):
    """(sample, timestep, encoder_hidden_states, controlnet_cond) -> (*down_block_res, mid_block_res)"""

    def __init__(self, controlnet):
        super().__init__()
        self.controlnet = controlnet

    def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond):
        down, mid = self.controlnet(
            sample, timestep, encoder_hidden_states, controlnet_cond,
            conditioning_scale=1.0, return_dict=False,
        )
        return (*down, mid)


def make_controlnet(size: str, seed: int = 0):
    from diffusers import ControlNetModel

    seed_everything(seed)
    cn = ControlNetModel(**CONFIGS[size])
    return init_module(cn, seed)


def build(family: str = "controlnet", size: str = "tiny", attention: str = "sdpa", seed: int = 0) -> BuiltModel:
    check_choice("family", family, FAMILIES)
    check_choice("size", size, SIZES)
    cfg = CONFIGS[size]
    cn = make_controlnet(size, seed)
    set_diffusers_attention(cn, attention)
    wrapper = ControlNetWrapper(cn).eval()
    cross = cfg["cross_attention_dim"]
    down_factor = 2 ** (len(cfg["block_out_channels"]) - 1)
    cond_factor = 2 ** (len(cfg["conditioning_embedding_out_channels"]) - 1)
    n_down = len(cn.controlnet_down_blocks)

    c = cond_factor
    specs = [
        dict(name="sample", shape=["batch", 4, "height", "width"], dtype="float32", kind="latent"),
        dict(name="timestep", shape=["batch"], dtype="float32", kind="timestep"),
        dict(name="encoder_hidden_states", shape=["batch", "sequence", cross], dtype="float32", kind="hidden"),
        dict(name="controlnet_cond", shape=["batch", 3, f"{c}*height", f"{c}*width"], dtype="float32",
             kind="cond_image"),
    ]

    # Shapes of the residuals, for symbolic dim names.
    res_names = [f"down_block_res_{i}" for i in range(n_down)]
    dyn = {
        "sample": {0: "batch", 2: "height", 3: "width"},
        "timestep": {0: "batch"},
        "encoder_hidden_states": {0: "batch", 1: "sequence"},
        "controlnet_cond": {0: "batch", 2: "image_height", 3: "image_width"},
    }
    # Residual i has resolution height / 2**k for the block it comes from.
    # (conv_in, then per block: its resnets and its downsampler), then the mid block.
    k = 1
    names = iter(res_names)
    dyn[next(names)] = {0: "batch", 2: "height", 3: "width"}
    for i, _ in enumerate(cfg["down_block_types"]):
        last = i == len(cfg["down_block_types"]) - 1
        for _ in range(cfg["layers_per_block"]):
            dyn[next(names)] = _res_axes(k)
        if not last:
            k *= 2
            dyn[next(names)] = _res_axes(k)
    dyn["mid_block_res"] = _res_axes(k)
    return BuiltModel(
        family=family,
        size=size,
        attention=attention,
        module=wrapper,
        input_specs=specs,
        output_names=res_names + ["mid_block_res"],
        dynamic_axes=dyn,
        example_dims=dict(UNET_DIMS[("unet-sd15", size)]),
        alt_dims=dict(UNET_ALT[size]),
        dim_multiples={"height": down_factor, "width": down_factor},
        sites=count_sites(cn),
        site_modules=site_module_names(cn),
        config=dict(cfg),
        seed=seed,
    )
