"""The guidance embedding of a guidance-distilled UNet (LCM): what diffusers feeds as ``timestep_cond``.

A UNet whose config sets ``time_cond_proj_dim`` was distilled with the guidance as an input.
diffusers' ``LatentConsistencyModelPipeline`` (and ``StableDiffusionPipeline`` for such a UNet) then
runs no classifier-free guidance (one row per image, the negative prompt unused) and feeds::

    w           = guidance_scale - 1, one per image     (the pipelines' guidance is Imagen's; LCM's is one less)
    f_k         = exp(-k * log(10000) / (d/2 - 1)),  k = 0 .. d/2 - 1,   d = time_cond_proj_dim
    timestep_cond = concat(sin(1000 w f), cos(1000 w f))   [zero-padded to d when d is odd]

(``get_guidance_scale_embedding``, after VDM's timestep embedding: google-research/vdm model_vdm.py).
It is written out here in torch, op for op as diffusers computes it, rather than called: the method
lives on diffusers' pipeline classes, whose modules import transformers' image processors (3 s and
warnings on stderr at each start). ``tests/test_pipeline_lcm.py`` checks it against diffusers' own.

The embedding is constant for a whole generation: computed once on the host, and bound once as the
step graph's input of that name (optimum's exporter and ``models/`` name it ``timestep_cond``).
"""

from __future__ import annotations

import numpy as np

from onnxopt.pipeline.plan import GenerationError


def guidance_embedding(guidance, width: int) -> np.ndarray:
    """``timestep_cond`` [rows, width] float32 for ``guidance``, one diffusers' guidance_scale per row (a
    list), as diffusers' ``get_guidance_scale_embedding(torch.tensor(guidance - 1).repeat(rows), embedding_dim=width)``
    computes it for a batch of one guidance (each row its own here: a batch of requests may mix them)."""
    import torch

    w = torch.tensor([g - 1 for g in guidance]) * 1000.0
    half = width // 2
    frequencies = torch.exp(torch.arange(half, dtype=torch.float32) * -(torch.log(torch.tensor(10000.0)) / (half - 1)))
    angles = w.to(torch.float32)[:, None] * frequencies[None, :]
    embedding = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if width % 2:
        embedding = torch.nn.functional.pad(embedding, (0, 1))
    return embedding.numpy()


def check_embedding_input(session, where, name: str | None, width) -> None:
    """The denoiser graph ``session`` (read from ``where``) takes the guidance embedding as the folder's
    config says: an input ``name`` of ``width`` (its last dim, where declared) when the UNet config sets
    ``time_cond_proj_dim`` (``name`` is the family's input, None when it sets none), and no such input
    otherwise (the pipeline would not feed it). A one-line GenerationError."""
    inputs = {i.name: i.shape for i in session.get_inputs()}
    if name is None:
        if "timestep_cond" in inputs:
            raise GenerationError(f"{where}: the graph takes timestep_cond (a guidance embedding, as LCM's UNet), but "
                                  "unet/config.json sets no time_cond_proj_dim")
        return
    if name not in inputs:
        raise GenerationError(f"{where}: unet/config.json sets time_cond_proj_dim {width}, but the graph takes no {name} "
                              f"input (export the UNet with {name}, as optimum does)")
    shape = inputs[name]
    if not shape or len(shape) != 2 or (isinstance(shape[1], int) and shape[1] != width):
        raise GenerationError(f"{where}: unet/config.json sets time_cond_proj_dim {width}, but the graph's {name} is "
                              f"{'[' + ', '.join(map(str, shape)) + ']' if shape else 'a scalar'} (expected [batch, {width}])")
