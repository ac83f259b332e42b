"""Diffusion-transformer builders: the SD3 / SD3.5 MMDiT and the Flux.1 transformer, full size and tiny.

Families (diffusers class, published ``transformer/config.json`` it follows):

``sd3-medium``     ``SD3Transformer2DModel``, stabilityai/stable-diffusion-3-medium-diffusers: 24 joint
                   blocks, 24 heads x 64, no QK norm, no dual attention, pos_embed_max_size 192.
``sd35-medium``    stabilityai/stable-diffusion-3.5-medium: as SD3 Medium plus MMDiT-X dual attention
                   (a second, image-only attention ``attn2``) in blocks 0-12 and QK RMSNorm
                   (``qk_norm="rms_norm"``), pos_embed_max_size 384.
``sd35-large``     stabilityai/stable-diffusion-3.5-large: 38 blocks, 38 heads x 64 (2432 wide),
                   QK RMSNorm, no dual attention, pos_embed_max_size 192.
``flux-dev``       ``FluxTransformer2DModel``, black-forest-labs/FLUX.1-dev: 19 double-stream + 38
                   single-stream blocks, 24 heads x 128 (3072 wide), rotary axes (16, 56, 56),
                   guidance embedding.
``flux-schnell``   black-forest-labs/FLUX.1-schnell: the same without the guidance embedding.

The full configs were checked against the published ``transformer/config.json`` values as
public code quotes them (diffusers' own defaults give Flux; the SD3 family's differ from the
defaults in every size).  Every tiny config keeps its family's structure -- joint attention
with its context projections, the last block's ``context_pre_only`` (AdaLayerNormContinuous on
the text stream, no text output), dual attention in the first block only (so both kinds of
block appear), QK RMSNorm, the cropped positional embedding (``pos_embed_max_size`` larger than
the example latents), Flux's three rotary axes (unequal, so an axis mix-up shows) and guidance
embedding -- at a few blocks and widths of 16-24.

Inputs (names as optimum's ONNX export of these models):

* SD3: ``hidden_states`` latent ``[batch, 16, height, width]``, ``encoder_hidden_states``
  ``[batch, sequence, joint_attention_dim]`` (CLIP-L + CLIP-G + T5 tokens), ``pooled_projections``
  ``[batch, pooled_projection_dim]``, ``timestep`` float ``[batch]`` (0..1000);
  output ``out_hidden_states`` ``[batch, 16, height, width]``.
* Flux: ``hidden_states`` the packed latent ``[batch, height*width/4, 64]`` (2x2 patches of the
  16-channel latent), ``encoder_hidden_states`` ``[batch, sequence, 4096]`` (T5), ``pooled_projections``
  ``[batch, 768]`` (CLIP-L), ``timestep`` float ``[batch]`` in (0, 1] (the model multiplies by 1000),
  ``img_ids`` ``[height*width/4, 3]``, ``txt_ids`` ``[sequence, 3]``, and for dev ``guidance``
  ``[batch]``; output ``out_hidden_states`` like ``hidden_states``.
  ``height`` / ``width`` are the latent size, as for every family (multiples of 2).

TorchScript export: the TorchScript exporter has no symbolic for ``aten::rms_norm`` at opset 17,
which Flux's ``torch.nn.RMSNorm`` QK norms call.  For that exporter only, each ``torch.nn.RMSNorm``
is swapped for :class:`WrittenOutRMSNorm` (``x * rsqrt(mean(x^2) + eps) * weight``, as optimum's
exporter writes it) and swapped back afterwards; the dynamo exports keep ``torch.nn.RMSNorm``
(an ``RMSNormalization`` op at opset 23, a written-out chain before).  SD3's QK norm is
diffusers' ``RMSNorm``, already written out in torch.
"""
from __future__ import annotations

import contextlib

import torch

from .base import BuiltModel, check_choice, count_sites, default_dtype, dtype_name, SIZES
from .metaweights import SeededWeights
from .seeding import init_module, seed_everything

# stabilityai/stable-diffusion-3-medium-diffusers transformer/config.json
_SD3_MEDIUM = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=192,
)
_FLUX_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# Tiny MMDiT: heads x head dim 2 x 8 (16 wide; caption_projection_dim must equal it), text width 24
# and pooled width 20 unlike the model width, positional table 16x16 patches (latents up to 32).
_SD3_TINY = dict(
    sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
    num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=16, pooled_projection_dim=20,
    pos_embed_max_size=16,
)
# Tiny Flux: 2 double + 2 single blocks, 2 heads x 12 (rotary axes 2 + 4 + 6 = 12), T5 width 24
# (the tiny T5 encoder's d_model would be 32: keep them apart so a swap shows), pooled 20.
_FLUX_TINY = dict(
    patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=12,
    num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=20, guidance_embeds=True,
    axes_dims_rope=(2, 4, 6),
)

CONFIGS = {
    ("sd3-medium", "full"): dict(_SD3_MEDIUM),
    # stabilityai/stable-diffusion-3.5-medium transformer/config.json
    ("sd35-medium", "full"): dict(_SD3_MEDIUM, pos_embed_max_size=384, dual_attention_layers=tuple(range(13)),
                                  qk_norm="rms_norm"),
    # stabilityai/stable-diffusion-3.5-large transformer/config.json
    ("sd35-large", "full"): dict(_SD3_MEDIUM, num_layers=38, num_attention_heads=38, caption_projection_dim=2432,
                                 qk_norm="rms_norm"),
    # black-forest-labs/FLUX.1-dev transformer/config.json
    ("flux-dev", "full"): dict(_FLUX_DEV),
    # black-forest-labs/FLUX.1-schnell transformer/config.json
    ("flux-schnell", "full"): dict(_FLUX_DEV, guidance_embeds=False),
    # block 0 joint, block 1 joint with context_pre_only
    ("sd3-medium", "tiny"): dict(_SD3_TINY),
    # block 0 dual attention (joint + image-only attn2), block 1 plain, block 2 context_pre_only
    ("sd35-medium", "tiny"): dict(_SD3_TINY, num_layers=3, dual_attention_layers=(0,), qk_norm="rms_norm"),
    # 3 heads x 8 (24 wide)
    ("sd35-large", "tiny"): dict(_SD3_TINY, num_attention_heads=3, caption_projection_dim=24, qk_norm="rms_norm"),
    ("flux-dev", "tiny"): dict(_FLUX_TINY),
    ("flux-schnell", "tiny"): dict(_FLUX_TINY, guidance_embeds=False),
}

SD3_FAMILIES = ("sd3-medium", "sd35-medium", "sd35-large")
FLUX_FAMILIES = ("flux-dev", "flux-schnell")
FAMILIES = SD3_FAMILIES + FLUX_FAMILIES

# Latent dims (multiples of 2, not square so that H/W mix-ups show). Full: 1024x1024 images
# (128x128 latents) with the published text lengths: SD3 77 CLIP + 256 T5 tokens = 333, Flux-dev 512 T5.
EXAMPLE_DIMS = {
    "full-sd3": dict(batch=2, height=128, width=128, sequence=333),
    "full-flux": dict(batch=1, height=128, width=128, sequence=512),
    "tiny": dict(batch=2, height=16, width=12, sequence=20),
}
ALT_DIMS = {
    "full": dict(batch=1, height=64, width=96, sequence=77),
    "tiny": dict(batch=3, height=8, width=20, sequence=13),
}


class WrittenOutRMSNorm(torch.nn.Module):
    """``torch.nn.RMSNorm`` in elementary ops, for exporters without ``aten::rms_norm``:
    ``x * rsqrt(mean(x^2, -1) + eps) * weight`` (the statistics in float32, as torch computes them)."""

    def __init__(self, norm: torch.nn.RMSNorm):
        super().__init__()
        if len(norm.normalized_shape) != 1:
            raise ValueError("only RMSNorm over the last dim is written out")
        self.eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
        self.weight = norm.weight

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.to(x.dtype)


@contextlib.contextmanager
def rms_norm_written_out(module: torch.nn.Module):
    """Swap every ``torch.nn.RMSNorm`` under ``module`` for :class:`WrittenOutRMSNorm`, and back."""
    swapped = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.RMSNorm):
                setattr(parent, name, WrittenOutRMSNorm(child))
                swapped.append((parent, name, child))
    try:
        yield len(swapped)
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)


def rotary_traceable(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
    """diffusers' ``apply_rotary_emb`` for Flux (real cos/sin, interleaved pairs) with the pairs
    taken by strided slices: the TorchScript exporter folds the shape of diffusers'
    ``x.reshape(*x.shape[:-1], -1, 2)`` into a constant, so its dynamic export fails at any other
    batch or sequence length."""
    if not use_real or use_real_unbind_dim != -1:
        raise NotImplementedError("only Flux's interleaved real rotary embedding is traced this way")
    cos, sin = freqs_cis
    if sequence_dim == 2:
        cos, sin = cos[None, None, :, :], sin[None, None, :, :]
    else:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x_real, x_imag = x[..., 0::2], x[..., 1::2]
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


@contextlib.contextmanager
def flux_torchscript_patches(module: torch.nn.Module):
    """What the TorchScript exporter needs to export diffusers' Flux: RMSNorm written out and the
    rotary embedding's reshape traced dim by dim (see :func:`rotary_traceable`)."""
    from diffusers.models.transformers import transformer_flux

    original = transformer_flux.apply_rotary_emb
    transformer_flux.apply_rotary_emb = rotary_traceable
    try:
        with rms_norm_written_out(module):
            yield
    finally:
        transformer_flux.apply_rotary_emb = original


class SD3Wrapper(torch.nn.Module):
    """(hidden_states, encoder_hidden_states, pooled_projections, timestep) -> (out_hidden_states,)"""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep):
        return (self.transformer(hidden_states, encoder_hidden_states, pooled_projections, timestep,
                                 return_dict=False)[0],)


class FluxWrapper(torch.nn.Module):
    """(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids[, guidance])
    -> (out_hidden_states,)"""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                guidance=None):
        return (self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                 pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids,
                                 txt_ids=txt_ids, guidance=guidance, return_dict=False)[0],)


def make_transformer(family: str, size: str, seed: int = 0, dtype=None, overrides: dict | None = None,
                     meta: bool = False):
    """The seeded diffusers model; ``dtype`` (e.g. ``torch.bfloat16``) builds it in that precision
    directly (the full Flux-dev is 48 GB in float32); ``overrides`` change config entries (fewer
    layers at full width, to try the full-size export path on a smaller machine).

    ``meta``: built on the meta device, returned with its recorded initialisation
    (``(model, calls)``, see :mod:`models.metaweights`): the same weights, made one at a time later."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    cls = FluxTransformer2DModel if family in FLUX_FAMILIES else SD3Transformer2DModel
    if meta:
        from .metaweights import build_on_meta

        return build_on_meta(lambda: cls(**dict(CONFIGS[(family, size)], **(overrides or {}))), dtype, seed)
    seed_everything(seed)
    with default_dtype(dtype):
        model = cls(**dict(CONFIGS[(family, size)], **(overrides or {})))
    return init_module(model, seed)


def build(family: str, size: str = "tiny", attention: str = "sdpa", seed: int = 0, dtype=None,
          overrides: dict | None = None, meta: bool = False) -> BuiltModel:
    """``meta``: the module is on the meta device and ``weights`` (a :class:`models.metaweights.SeededWeights`,
    keyed by the wrapper's parameter names) makes its seeded parameters one at a time."""
    check_choice("family", family, FAMILIES)
    check_choice("size", size, SIZES)
    if attention != "sdpa":
        raise ValueError(f"{family}: attention must be 'sdpa' (diffusers has no classic joint-attention processor)")
    cfg = dict(CONFIGS[(family, size)], **(overrides or {}))
    model = make_transformer(family, size, seed, dtype, overrides, meta)
    if meta:
        model, calls = model
    flux = family in FLUX_FAMILIES
    dt = dtype_name(dtype)
    if flux:
        wrapper = FluxWrapper(model).eval()
        seq = "height*width/4"
        specs = [
            dict(name="hidden_states", shape=["batch", seq, cfg["in_channels"]], dtype=dt, kind="latent"),
            dict(name="encoder_hidden_states", shape=["batch", "sequence", cfg["joint_attention_dim"]], dtype=dt,
                 kind="hidden"),
            dict(name="pooled_projections", shape=["batch", cfg["pooled_projection_dim"]], dtype=dt, kind="hidden"),
            dict(name="timestep", shape=["batch"], dtype=dt, kind="sigma"),
            dict(name="img_ids", shape=[seq, 3], dtype=dt, kind="img_ids"),
            dict(name="txt_ids", shape=["sequence", 3], dtype=dt, kind="txt_ids"),
        ]
        dyn = {
            "hidden_states": {0: "batch", 1: "image_sequence"},
            "encoder_hidden_states": {0: "batch", 1: "sequence"},
            "pooled_projections": {0: "batch"},
            "timestep": {0: "batch"},
            "img_ids": {0: "image_sequence"},
            "txt_ids": {0: "sequence"},
            "out_hidden_states": {0: "batch", 1: "image_sequence"},
        }
        if cfg["guidance_embeds"]:
            specs.append(dict(name="guidance", shape=["batch"], dtype=dt, kind="guidance"))
            dyn["guidance"] = {0: "batch"}
        patches = {"torchscript": lambda: flux_torchscript_patches(model)}
    else:
        wrapper = SD3Wrapper(model).eval()
        specs = [
            dict(name="hidden_states", shape=["batch", cfg["in_channels"], "height", "width"], dtype=dt, kind="latent"),
            dict(name="encoder_hidden_states", shape=["batch", "sequence", cfg["joint_attention_dim"]], dtype=dt,
                 kind="hidden"),
            dict(name="pooled_projections", shape=["batch", cfg["pooled_projection_dim"]], dtype=dt, kind="hidden"),
            dict(name="timestep", shape=["batch"], dtype=dt, kind="timestep"),
        ]
        dyn = {
            "hidden_states": {0: "batch", 2: "height", 3: "width"},
            "encoder_hidden_states": {0: "batch", 1: "sequence"},
            "pooled_projections": {0: "batch"},
            "timestep": {0: "batch"},
            "out_hidden_states": {0: "batch", 2: "height", 3: "width"},
        }
        patches = {}
    example = EXAMPLE_DIMS["tiny" if size == "tiny" else f"full-{'flux' if flux else 'sd3'}"]
    return BuiltModel(
        family=family,
        size=size,
        attention=attention,
        module=wrapper,
        input_specs=specs,
        output_names=["out_hidden_states"],
        dynamic_axes=dyn,
        example_dims=dict(example),
        alt_dims=dict(ALT_DIMS[size]),
        dim_multiples={"height": 2, "width": 2},
        sites=count_sites(model),
        config=dict(cfg),
        seed=seed,
        export_patches=patches,
        weights=SeededWeights(wrapper, calls, seed) if meta else None,
    )
