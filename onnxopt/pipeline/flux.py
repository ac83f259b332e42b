"""Flux.1's own side of a generation, as diffusers' ``FluxPipeline`` computes it (diffusers 0.42):

* the prompt: CLIP-L's ``pooler_output`` (77 tokens) as ``pooled_projections``, and T5's
  ``last_hidden_state`` over ``max_sequence_length`` tokens (512 by default) as
  ``encoder_hidden_states``; one prompt, no negative (the distilled guidance needs no CFG);
* the latents: drawn by torch's generator at ``[1, 16, h, w]`` (h, w the latent size, rounded down
  to even), packed into 2x2 patches ``[1, h*w/4, 64]`` (``_pack_latents``); ``img_ids`` [h*w/4, 3]
  hold (0, row, column) of each patch and ``txt_ids`` [S, 3] are zeros, fed in the type each
  graph input declares (diffusers' exports take float32; optimum's take int64);
* dev's guidance embedding: ``guidance`` [1] = the guidance scale, no CFG; schnell has none (its
  transformer has no ``guidance`` input, and the scale is unused, as in diffusers);
* the VAE's input: unpacked, then ``latents / scaling_factor + shift_factor``, both read from the
  folder's VAE config (a config without them is refused: Flux's differ from SD3's and neither is a
  safe default).

Nothing here runs a session; the runner feeds what these return.
"""

from __future__ import annotations

import sys
import numpy as np

from onnxopt.errors import MissingDependencyError
from onnxopt.pipeline.plan import GenerationError

T5_SEQUENCE = 512  # FluxPipeline's max_sequence_length default
PATCH = 2  # latents are packed into 2x2 patches
IDS_AXES = 3  # (text/image index, row, column)


def t5_token_ids(tokenizer, prompt: str, max_sequence_length: int = T5_SEQUENCE) -> np.ndarray:
    """[1, max_sequence_length] ids, padded and cut as diffusers' ``_get_t5_prompt_embeds`` does
    (a warning on stderr names the part cut off)."""
    ids = tokenizer([prompt], padding="max_length", max_length=max_sequence_length, truncation=True,
                    return_tensors="np").input_ids
    whole = tokenizer([prompt], padding="longest", return_tensors="np").input_ids
    if whole.shape[-1] > ids.shape[-1]:
        removed = tokenizer.decode(whole[0, max_sequence_length - 1: -1])
        print("onnxopt: warning: the following part of your input was truncated because max_sequence_length is "
              f"set to {max_sequence_length} tokens: {removed!r}", file=sys.stderr)
    return ids


def latent_size(height: int, width: int, vae_scale_factor: int) -> tuple[int, int]:
    """The latent (h, w) of a height x width image: rounded down to a multiple of 2 patches, as
    FluxPipeline.prepare_latents rounds (the image is then 2*f*(height // (2*f)) high)."""
    step = vae_scale_factor * PATCH
    return PATCH * (int(height) // step), PATCH * (int(width) // step)


def check_image_size(height: int, width: int, vae_scale_factor: int) -> None:
    h, w = latent_size(height, width, vae_scale_factor)
    if h < PATCH or w < PATCH:
        raise GenerationError(f"--height and --width must be at least {vae_scale_factor * PATCH} pixels for Flux "
                              f"(one 2x2 patch of latents), got {height}x{width}")
    if (height, width) != (h * vae_scale_factor, w * vae_scale_factor):
        print(f"onnxopt: warning: {height}x{width} is not a multiple of {vae_scale_factor * PATCH}: the image is "
              f"{h * vae_scale_factor}x{w * vae_scale_factor}, as diffusers' FluxPipeline makes it", file=sys.stderr)


def pack_latents(latents: np.ndarray) -> np.ndarray:
    """[B, C, h, w] -> [B, h/2 * w/2, 4C] (diffusers' ``FluxPipeline._pack_latents``)."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(x.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH))


def unpack_latents(packed: np.ndarray, height: int, width: int) -> np.ndarray:
    """[B, h/2 * w/2, 4C] -> [B, C, h, w] for the latent size (h, w) (``_unpack_latents``)."""
    b, _, channels = packed.shape
    x = packed.reshape(b, height // PATCH, width // PATCH, channels // 4, PATCH, PATCH).transpose(0, 3, 1, 4, 2, 5)
    return np.ascontiguousarray(x.reshape(b, channels // 4, height, width))


def image_ids(height: int, width: int) -> np.ndarray:
    """[h/2 * w/2, 3]: (0, row, column) of each patch (``_prepare_latent_image_ids``), float32."""
    rows, cols = np.meshgrid(np.arange(height // PATCH), np.arange(width // PATCH), indexing="ij")
    ids = np.stack([np.zeros_like(rows), rows, cols], axis=-1).reshape(-1, IDS_AXES)
    return ids.astype(np.float32)


def text_ids(sequence: int) -> np.ndarray:
    """[S, 3] zeros: every text token sits at position (0, 0, 0)."""
    return np.zeros((sequence, IDS_AXES), np.float32)


def initial_latents(seed: int, channels: int, height: int, width: int) -> np.ndarray:
    """The packed starting latents FluxPipeline draws for ``seed``: randn_tensor([1, C, h, w]) with
    ``torch.Generator("cpu").manual_seed(seed)``, packed."""
    try:
        import torch
        from diffusers.utils.torch_utils import randn_tensor
    except ImportError as exc:
        raise MissingDependencyError("generating images needs torch and diffusers: pip install 'onnxopt[pipeline]'") \
            from exc
    generator = torch.Generator("cpu").manual_seed(seed)
    noise = randn_tensor((1, channels, height, width), generator=generator, device=torch.device("cpu"),
                         dtype=torch.float32)
    return pack_latents(noise.numpy())


def takes_guidance(transformer_inputs, transformer_config: dict, where) -> bool:
    """Whether the transformer takes the guidance embedding (dev) or not (schnell): its graph's
    ``guidance`` input, which its config's ``guidance_embeds`` must agree with (a graph without the
    input would silently drop the guidance the config promises)."""
    graph = "guidance" in set(transformer_inputs)
    config = transformer_config.get("guidance_embeds")
    if config is not None and bool(config) != graph:
        has = "has a guidance input" if graph else "has no guidance input"
        raise GenerationError(f"{where}: the transformer graph {has} but its config.json says guidance_embeds="
                              f"{bool(config)}: re-export the transformer from the same model")
    return graph


def guidance_feed(guidance: float) -> np.ndarray:
    """dev's ``guidance`` input: [1] = the scale (diffusers: torch.full([1], guidance_scale))."""
    return np.full([1], guidance, np.float32)


def vae_factors(vae_config: dict, where) -> tuple[float, float]:
    """(scaling_factor, shift_factor) from the folder's VAE config; refused when either is absent."""
    missing = [k for k in ("scaling_factor", "shift_factor") if not isinstance(vae_config.get(k), (int, float))]
    if missing:
        raise GenerationError(f"{where}: the VAE config has no {' or '.join(missing)} (Flux's latents are "
                              "unscaled with both; no default is safe)")
    return float(vae_config["scaling_factor"]), float(vae_config["shift_factor"])


def vae_input(packed: np.ndarray, height: int, width: int, scaling: float, shift: float) -> np.ndarray:
    """The decoder's ``latent_sample``: unpacked, / scaling_factor + shift_factor."""
    return unpack_latents(packed, height, width) / np.float32(scaling) + np.float32(shift)
