"""img2img and inpainting for benchmarks/pipeline_gpu.py: the fixed init image and mask, and diffusers'
random draws in float32.

The init image is a seeded synthetic picture (smooth colour fields with a disc and a bar, so the VAE
sees edges and gradients, not white noise); the mask is a white ellipse (repaint) on black. Both are
the same PIL images on every side.

diffusers' img2img and inpainting pipelines draw the VAE encoder's sample and the noise with
``randn_tensor(..., dtype=the pipeline's dtype)``. torch's CPU normal kernel gives a float16 draw the
float32 numbers, rounded, only on its vectorised path (here: sizes that are multiples of 16, as latents
are); elsewhere float16 is another stream, and the float16 image would be another image, not a less
precise one. :func:`float32_draws` makes diffusers draw in float32 and cast for every shape, as its
float32 pipeline (the reference) and onnxopt draw; the text-to-image kinds get the same by passing
float32 noise as ``latents``.
"""
from __future__ import annotations

import contextlib

import numpy as np

# modules of diffusers that draw with randn_tensor on the img2img / inpainting paths
DRAWING_MODULES = ("diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img",
                   "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint",
                   "diffusers.models.autoencoders.vae")  # DiagonalGaussianDistribution.sample


def init_image(height: int, width: int, seed: int):
    """A seeded synthetic RGB picture of ``height`` x ``width``."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    coarse = Image.fromarray((rng.random((6, 6, 3)) * 255).astype(np.uint8))
    image = coarse.resize((width, height), Image.Resampling.BICUBIC)  # smooth colour fields
    draw = ImageDraw.Draw(image)
    colours = [tuple(int(c) for c in rng.integers(0, 256, 3)) for _ in range(2)]
    draw.ellipse([width * 0.15, height * 0.2, width * 0.55, height * 0.6], fill=colours[0])
    draw.rectangle([width * 0.6, height * 0.1, width * 0.75, height * 0.9], fill=colours[1])
    return image


def inpaint_mask(height: int, width: int):
    """White (repaint) ellipse in the middle, black elsewhere."""
    from PIL import Image, ImageDraw

    mask = Image.new("RGB", (width, height), (0, 0, 0))
    ImageDraw.Draw(mask).ellipse([width * 0.25, height * 0.25, width * 0.75, height * 0.75], fill=(255, 255, 255))
    return mask


@contextlib.contextmanager
def float32_draws():
    """diffusers' randn_tensor draws float32 and casts to the dtype asked for, in DRAWING_MODULES."""
    import importlib

    import torch
    from diffusers.utils.torch_utils import randn_tensor

    def draw_float32(shape, generator=None, device=None, dtype=None, layout=None):
        out = randn_tensor(shape, generator=generator, device=device, dtype=torch.float32, layout=layout)
        return out if dtype is None else out.to(dtype)

    patched = []
    for name in DRAWING_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "randn_tensor"):
            patched.append((module, module.randn_tensor))
            module.randn_tensor = draw_float32
    try:
        yield
    finally:
        for module, original in patched:
            module.randn_tensor = original
