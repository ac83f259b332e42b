"""AutoencoderKL builders: ``vae-encoder`` (image -> latent mean) and ``vae-decoder`` (latent -> image),
and ``vae16-encoder`` / ``vae16-decoder``, the 16-channel VAE of SD3 / SD3.5 and Flux.1.

The full-size config follows the public SD 1.5 / SD 2.x ``vae/config.json``
(128/256/512/512 channels, 2 resnets per block, 32 groups, mid-block attention
with a single 512-wide head).  The tiny config keeps the structure (down/up
encoder/decoder blocks with resnets, down/upsampling, mid-block attention with
its GroupNorm) with 16/32 channels and 8 groups.

The 16-channel VAE (stabilityai/stable-diffusion-3-medium-diffusers ``vae/config.json``; SD3.5 and
Flux.1 use the same architecture) has ``latent_channels=16`` and no ``quant_conv`` /
``post_quant_conv``. Its latents are normalised as ``(z - shift_factor) * scaling_factor``, which
SD3 publishes as 1.5305 / 0.0609 and Flux.1 (black-forest-labs/FLUX.1-dev ``vae/config.json``) as
0.3611 / 0.1159: :data:`VAE16_FACTORS`; the builders use SD3's (the graph does not depend on them).
Tiny: the tiny SD VAE with 16 latent channels.

The encoder is exported deterministically: ``encode(x).latent_dist.mean``
(no sampling, no scaling factor).  The decoder takes the unscaled latent.
"""
from __future__ import annotations

import torch

from .base import BuiltModel, check_choice, count_sites, default_dtype, dtype_name, set_diffusers_attention, SIZES
from .seeding import init_module, seed_everything

CONFIGS = {
    # runwayml/stable-diffusion-v1-5 vae/config.json (SD 2.x uses the same architecture)
    "full": dict(
        act_fn="silu",
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        layers_per_block=2,
        norm_num_groups=32,
        sample_size=512,
        scaling_factor=0.18215,
    ),
    "tiny": dict(
        act_fn="silu",
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=32,
        scaling_factor=0.18215,
    ),
}

# stabilityai/stable-diffusion-3-medium-diffusers vae/config.json (16 latent channels, no quant convs)
_VAE16 = dict(
    CONFIGS["full"], latent_channels=16, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
    use_quant_conv=False, use_post_quant_conv=False, force_upcast=True, mid_block_add_attention=True,
)
VAE16_CONFIGS = {
    "full": _VAE16,
    "tiny": dict(CONFIGS["tiny"], latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609,
                 use_quant_conv=False, use_post_quant_conv=False),
}
# published latent normalisation: (scaling_factor, shift_factor)
VAE16_FACTORS = {
    "sd3": (1.5305, 0.0609),   # stabilityai/stable-diffusion-3-medium-diffusers, SD3.5 medium/large
    "flux": (0.3611, 0.1159),  # black-forest-labs/FLUX.1-dev and FLUX.1-schnell
}

FAMILIES = ("vae-encoder", "vae-decoder", "vae16-encoder", "vae16-decoder")

# Dims are latent dims for both halves (the images are 2**(blocks-1) times larger).
EXAMPLE_DIMS = {
    "full": dict(batch=2, height=64, width=64),
    "tiny": dict(batch=2, height=8, width=6),
}
ALT_DIMS = {
    "full": dict(batch=1, height=32, width=48),
    "tiny": dict(batch=3, height=4, width=10),
}


class VAEEncoderWrapper(torch.nn.Module):
    """(sample,) -> (latent_mean,)"""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, sample):
        return (self.vae.encode(sample).latent_dist.mean,)


class VAELatentParametersWrapper(torch.nn.Module):
    """(sample,) -> (latent_parameters,): the latent distribution's mean and log-variance, concatenated
    on the channel axis, as optimum's ``vae_encoder`` exports them (``latent_dist.parameters``)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, sample):
        return (self.vae.encode(sample).latent_dist.parameters,)


class VAEDecoderWrapper(torch.nn.Module):
    """(latent_sample,) -> (sample,)"""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent_sample):
        return (self.vae.decode(latent_sample, return_dict=False)[0],)


def vae_config(family: str, size: str) -> dict:
    return (VAE16_CONFIGS if family.startswith("vae16") else CONFIGS)[size]


def make_vae(size: str, seed: int = 0, family: str = "vae-decoder", dtype=None):
    from diffusers import AutoencoderKL

    seed_everything(seed)
    with default_dtype(dtype):
        vae = AutoencoderKL(**vae_config(family, size))
    return init_module(vae, seed)


def build(family: str, size: str = "tiny", attention: str = "sdpa", seed: int = 0, dtype=None) -> BuiltModel:
    check_choice("family", family, FAMILIES)
    check_choice("size", size, SIZES)
    cfg = vae_config(family, size)
    vae = make_vae(size, seed, family, dtype)
    set_diffusers_attention(vae, attention)
    factor = 2 ** (len(cfg["block_out_channels"]) - 1)
    encoder = family.endswith("-encoder")
    if encoder:
        # Drop the half we do not export so that sites count what is in the graph.
        vae.decoder = None
        vae.post_quant_conv = None
        wrapper = VAEEncoderWrapper(vae).eval()
        part = torch.nn.ModuleList([m for m in (vae.encoder, vae.quant_conv) if m is not None])
    else:
        vae.encoder = None
        vae.quant_conv = None
        wrapper = VAEDecoderWrapper(vae).eval()
        part = torch.nn.ModuleList([m for m in (vae.decoder, vae.post_quant_conv) if m is not None])

    f = factor
    if encoder:
        specs = [dict(name="sample", shape=["batch", 3, f"{f}*height", f"{f}*width"], dtype=dtype_name(dtype),
                      kind="image")]
        names_out = ["latent_mean"]
        dyn = {
            "sample": {0: "batch", 2: "image_height", 3: "image_width"},
            "latent_mean": {0: "batch", 2: "height", 3: "width"},
        }
        mult = {}
    else:
        specs = [dict(name="latent_sample", shape=["batch", cfg["latent_channels"], "height", "width"],
                      dtype=dtype_name(dtype), kind="latent")]
        names_out = ["sample"]
        dyn = {
            "latent_sample": {0: "batch", 2: "height", 3: "width"},
            "sample": {0: "batch", 2: "image_height", 3: "image_width"},
        }
        mult = {}
    return BuiltModel(
        family=family,
        size=size,
        attention=attention,
        module=wrapper,
        input_specs=specs,
        output_names=names_out,
        dynamic_axes=dyn,
        example_dims=dict(EXAMPLE_DIMS[size]),
        alt_dims=dict(ALT_DIMS[size]),
        dim_multiples=mult,
        sites=count_sites(part),
        config=dict(cfg),
        seed=seed,
    )
