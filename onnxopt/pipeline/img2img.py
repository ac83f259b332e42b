"""Generation from an init image: diffusers' img2img and inpainting latents, for the same denoising loop.

    pipe("a cat", image="init.png", strength=0.6)                    # StableDiffusion(XL)Img2ImgPipeline
    pipe("a cat", image="init.png", mask="mask.png")                 # StableDiffusion(XL)InpaintPipeline
    pipe("a cat", num_images=4)                                      # num_images_per_prompt=4: one batch

What differs from text to image is only where the loop starts and what it starts from; the step graph
and the step loop are the text-to-image ones (a shorter schedule table: :func:`first_step`). The SDXL
pipelines' ``denoising_end`` stops it early (:func:`steps_before_end`), from text or an image::

    scheduler.set_timesteps(steps); t_start = steps - min(int(steps * strength), steps)
    timesteps = scheduler.timesteps[t_start * order:]; scheduler.set_begin_index(t_start * order)
    img2img:  image ─ VaeImageProcessor (its size, rounded down to the VAE factor; [-1, 1]) ─ vae_encoder
              ─ latent_parameters (mean, logvar) ─ DiagonalGaussianDistribution.sample(generator)
              ─ * scaling_factor (SDXL: (x - latents_mean) * scaling_factor / latents_std) ─ repeat N
              ─ add_noise(x, randn_tensor(generator), timesteps[0])
    inpaint:  image, mask ─ processors at --height/--width (default: the UNet's sample size, as diffusers)
              latents = randn_tensor(generator) * init_noise_sigma  (strength 1; else add_noise to the
              image's latents, encoded first); masked image = image * (mask < 0.5) ─ vae_encoder, sampled;
              mask ─ interpolate to the latent size; both repeated N, then twice (guidance rows)
              ─ the UNet reads concat([scale_model_input(latents), mask, masked latents], channels)
              Both inpainting pipelines (SD's and SDXL's) scale the encoded latents by scaling_factor
              alone (``_encode_vae_image``: no latents_mean/std, unlike SDXL img2img) and need a UNet of
              9 input channels here: with a 4-channel UNet diffusers blends the noised image latents back
              after every step (``init_latents_proper``), which the step graph does not do: refused.

Every random draw takes the request's one ``torch.Generator`` in diffusers' order (encoder samples,
noise), so the same seed gives diffusers' image. The VAE encoder is optimum's ``vae_encoder`` with its
``latent_parameters`` output (the distribution's parameters): a folder whose encoder gives the mean
alone (``latent_sample``) cannot sample as diffusers does and is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnxopt.pipeline.folder import MAX_IMAGE_SIDE
from onnxopt.pipeline.plan import GenerationError, inpainting_unet as inpainting
from onnxopt.pipeline.sizes import check_latent_sides, check_multiple, default_size

# diffusers' defaults for ``strength`` (by folder kind; with a mask): StableDiffusionImg2ImgPipeline 0.8,
# StableDiffusionXLImg2ImgPipeline 0.3, StableDiffusionInpaintPipeline 1.0, StableDiffusionXLInpaintPipeline 0.9999
# (under 1: its latents start from the noised image's, not from pure noise)
DEFAULT_STRENGTH = {("sd", False): 0.8, ("sdxl", False): 0.3, ("sd", True): 1.0, ("sdxl", True): 0.9999}
INPAINT_PIPELINES = {"sd": "StableDiffusionInpaintPipeline", "sdxl": "StableDiffusionXLInpaintPipeline"}
MAX_IMAGES = 64  # --num-images: one batch on the device; more is a typo, not a request
ENCODER_OUTPUT = "latent_parameters"


def latent_channels(folder) -> int:
    return folder.config("vae_decoder").get("latent_channels", 4)


@dataclass(frozen=True)
class InitRequest:
    """A request's init image (and mask): checked, preprocessed as diffusers does, its size and strength."""

    image: object  # torch [1, 3, H, W] in [-1, 1]
    mask: object | None  # torch [1, 1, H, W], binarized: diffusers' mask_condition
    strength: float
    height: int
    width: int


def check_num_images(num_images) -> int:
    if not isinstance(num_images, int) or isinstance(num_images, bool) or not 1 <= num_images <= MAX_IMAGES:
        raise GenerationError(f"the number of images must be an integer in 1..{MAX_IMAGES}, got {num_images}")
    return num_images


def check_init_request(folder, image=None, mask=None, strength=None, height=None, width=None) -> None:
    """A one-line GenerationError for an init image, mask or strength this folder cannot take, before any work."""
    from onnxopt.pipeline import images

    inpaint = inpainting(folder)
    if image is None:
        if mask is not None:
            raise GenerationError("--mask needs the image it masks (--image)")
        if strength is not None:
            raise GenerationError("--strength needs an init image (--image)")
        if inpaint:
            raise GenerationError(f"{folder.root}: its UNet takes {folder.config('unet').get('in_channels')} input "
                                  "channels (an inpainting UNet): give --image and --mask")
        return
    if folder.kind == "controlnet":
        raise GenerationError(f"{folder.root} is a ControlNet pipeline: --image (img2img, inpainting) is not supported there")
    if not folder.family.img2img:
        raise GenerationError(f"{folder.root} is a {folder.kind} pipeline: --image (img2img) is not supported there "
                              "(text to image only)")
    if not folder.has("vae_encoder"):
        raise GenerationError(f"{folder.root} has no vae_encoder/: an init image (--image) needs the VAE encoder")
    if mask is None and inpaint:
        raise GenerationError(f"{folder.root}: an inpainting UNet ({folder.config('unet').get('in_channels')} input "
                              "channels) needs --mask beside --image")
    if mask is not None and folder.kind not in INPAINT_PIPELINES:
        raise GenerationError(f"{folder.root}: inpainting runs on SD and SDXL folders "
                              f"({', '.join(INPAINT_PIPELINES.values())}), not {folder.kind}")
    if mask is not None and not inpaint:
        raise GenerationError(f"{folder.root}: --mask needs an inpainting UNet (in_channels "
                              f"{latent_channels(folder) * 2 + 1}); this one takes "
                              f"{folder.config('unet').get('in_channels', 4)} (diffusers' "
                              f"{INPAINT_PIPELINES[folder.kind]} then blends the image back after every step, "
                              "which onnxopt does not run)")
    if not inpaint and (height is not None or width is not None):
        raise GenerationError("img2img takes the init image's size (as diffusers' img2img pipelines): resize the image "
                              "rather than giving --height/--width")
    if strength is not None and not (isinstance(strength, (int, float)) and not isinstance(strength, bool)
                                     and math.isfinite(strength) and 0 < strength <= 1):
        raise GenerationError(f"strength must be a number in (0, 1], got {strength}")
    for path, what in ((image, "--image"), (mask, "--mask")):
        if isinstance(path, (str, Path)):
            if Path(path).is_dir():
                raise GenerationError(f"{path}: is a folder, not an image ({what})")
            images.check_image(path)  # not an image, or a decompression bomb: one line


def strength_of(folder, strength) -> float:
    """The request's strength, or diffusers' default for the folder's pipeline."""
    if strength is not None:
        return float(strength)
    return DEFAULT_STRENGTH[folder.kind, inpainting(folder)]


def first_step(steps: int, strength: float, order: int = 1) -> int:
    """diffusers' ``get_timesteps``: the index of the first timestep run; ``int(steps * strength)`` steps run."""
    run = min(int(steps * strength), steps)
    return max(steps - run, 0) * order


def check_denoising_end(folder, denoising_end) -> None:
    """``denoising_end`` is diffusers' SDXL pipelines' (text to image, img2img, inpainting); where diffusers
    ignores a value outside (0, 1) without a word, a one-line GenerationError here."""
    if denoising_end is None:
        return
    if folder.kind != "sdxl":
        raise GenerationError(f"{folder.root}: --denoising-end is the SDXL pipelines' (diffusers' {folder.kind} "
                              "pipeline has none)")
    if not (isinstance(denoising_end, (int, float)) and not isinstance(denoising_end, bool)
            and math.isfinite(denoising_end) and 0 < denoising_end < 1):
        raise GenerationError(f"denoising_end must be a number in (0, 1), got {denoising_end}")


def steps_before_end(timesteps, denoising_end: float | None, train_steps: int) -> int:
    """How many of the run's ``timesteps`` run before ``denoising_end`` (diffusers' SDXL pipelines:
    those at or above ``round(train_steps - denoising_end * train_steps)``; the latents are left that
    noisy, for a refiner); all of them without one. None left is a one-line GenerationError."""
    if denoising_end is None:
        return len(timesteps)
    cutoff = int(round(train_steps - denoising_end * train_steps))
    run = sum(1 for t in timesteps if float(t) >= cutoff)
    if run < 1:
        raise GenerationError(f"denoising_end {denoising_end:g} stops before the first of the {len(timesteps)} "
                              f"steps (timestep {float(timesteps[0]):g} is under {cutoff}): give a larger one")
    return run


def check_steps_run(steps: int, strength: float) -> None:
    if min(int(steps * strength), steps) < 1:
        raise GenerationError(f"strength {strength:g} runs int({steps} x {strength:g}) = 0 of the {steps} steps: "
                              "give a larger --strength or more --steps")


def prepare(folder, image, mask, strength, height, width) -> InitRequest:
    """Load and preprocess the init image (and mask) as diffusers' pipeline does; the output size."""
    from onnxopt.pipeline import images

    factor = folder.vae_scale_factor
    image = images.load_image(image) if isinstance(image, (str, Path)) else image
    processor = images.vae_processor(factor)
    if mask is None:  # img2img: the image's own size, rounded down to the VAE factor, any size above 0
        height, width = processor.get_default_height_width(image)
        check_init_image_size(image, height, width, factor)
        check_latent_sides(folder, height, width, f"the init image, {image.width}x{image.height} rounded down to the "
                                                  f"VAE factor {factor},")
    else:  # StableDiffusion(XL)InpaintPipeline: the UNet's sample size unless asked
        default_h, default_w = default_size(folder)
        height, width = height or default_h, width or default_w
        check_multiple(height, width, inpainting_size_multiple(folder))
        check_latent_sides(folder, height, width, "the inpainted image")
    torch_image = processor.preprocess(image, height=height, width=width).float()
    torch_mask = None
    if mask is not None:
        mask = images.load_image(mask) if isinstance(mask, (str, Path)) else mask
        masks = images.vae_processor(factor, do_normalize=False, do_binarize=True, do_convert_grayscale=True)
        torch_mask = masks.preprocess(mask, height=height, width=width)
    return InitRequest(torch_image, torch_mask, strength_of(folder, strength), height, width)


def check_init_image_size(image, height: int, width: int, factor: int) -> None:
    """img2img's size: the image's, rounded down to the VAE factor (the img2img pipelines resize it to
    that with their processor's lanczos). A one-line GenerationError where it rounds down to nothing
    or is beyond what the latents' shape can hold."""
    if min(height, width) < factor:
        raise GenerationError(f"the init image is {image.width}x{image.height} pixels: under the VAE factor {factor} "
                              "on a side, it rounds down to no pixels; give a larger image")
    if max(height, width) > MAX_IMAGE_SIDE:
        raise GenerationError(f"the init image is {image.width}x{image.height} pixels: at most {MAX_IMAGE_SIDE} a side")


def inpainting_size_multiple(folder) -> int:
    """What --height/--width must be a multiple of with a mask, as the inpainting pipelines' check_inputs
    say: StableDiffusionInpaintPipeline the VAE factor, StableDiffusionXLInpaintPipeline 8 (as text to image)."""
    return folder.vae_scale_factor if folder.kind == "sd" else max(8, folder.vae_scale_factor)


class LatentSource:
    """The denoising loop's start for one request: the initial latents, the first timestep's index and,
    for inpainting, the UNet's extra channels. ``encode(image) -> latent_parameters`` runs the VAE encoder."""

    def __init__(self, folder, encode):
        self.folder, self.encode = folder, encode

    def text_to_image(self, sched, steps: int, generator, batch: int, channels: int, height: int, width: int,
                      timestep_kwargs: dict | None = None):
        """diffusers' prepare_latents: randn_tensor(generator) * init_noise_sigma (after set_timesteps,
        with what the pipeline passes it: flow matching's ``mu`` or sigmas)."""
        from diffusers.utils.torch_utils import randn_tensor

        import torch

        from onnxopt.pipeline.schedulers import _set_timesteps

        factor = self.folder.vae_scale_factor
        noise = randn_tensor((batch, channels, height // factor, width // factor), generator=generator,
                             device=torch.device("cpu"), dtype=torch.float32)
        _set_timesteps(sched, steps, timestep_kwargs)
        return noise * getattr(sched, "init_noise_sigma", 1.0)  # flow matching has none (SD3: unscaled)

    def from_image(self, init: InitRequest, sched, steps: int, generator, batch: int):
        """(initial latents [N, C, h, w], index of the first timestep, inpainting channels [2N, 1 + C, h, w] or None)."""
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        start, timesteps = self._schedule(sched, steps, init.strength)
        noise_timestep = timesteps[:1].repeat(batch)
        if init.mask is None:  # StableDiffusion(XL)Img2ImgPipeline.prepare_latents
            latents = self._normalized(self._sample(init.image, generator))
            latents = torch.cat([latents] * batch, dim=0)
            noise = randn_tensor(latents.shape, generator=generator, device=torch.device("cpu"), dtype=torch.float32)
            return sched.add_noise(latents, noise, noise_timestep), start, None
        # StableDiffusion(XL)InpaintPipeline: prepare_latents, then prepare_mask_latents
        factor, channels = self.folder.vae_scale_factor, latent_channels(self.folder)
        shape = (batch, channels, init.height // factor, init.width // factor)
        full = init.strength == 1.0
        image_latents = None
        if not full:
            image_latents = self._scaled(self._sample(init.image, generator)).repeat(batch, 1, 1, 1)
        noise = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=torch.float32)
        latents = noise * getattr(sched, "init_noise_sigma", 1.0) if full else sched.add_noise(image_latents, noise, noise_timestep)
        masked = self._scaled(self._sample(init.image * (init.mask < 0.5), generator)).repeat(batch, 1, 1, 1)
        mask = torch.nn.functional.interpolate(init.mask, size=shape[2:]).repeat(batch, 1, 1, 1)
        extra = torch.cat([torch.cat([mask] * 2), torch.cat([masked] * 2)], dim=1)  # both guidance rows
        return latents, start, extra.numpy().astype(np.float32)

    @staticmethod
    def _schedule(sched, steps: int, strength: float):
        """diffusers' retrieve_timesteps + get_timesteps on the pipeline's scheduler."""
        sched.set_timesteps(steps)
        start = first_step(steps, strength, sched.order)
        if hasattr(sched, "set_begin_index"):
            sched.set_begin_index(start)
        return start, sched.timesteps[start:]

    def _sample(self, image, generator):
        """``vae.encode(image).latent_dist.sample(generator)``, with diffusers' own distribution class."""
        import torch
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        parameters = torch.from_numpy(np.asarray(self.encode(image.numpy()), np.float32))
        return DiagonalGaussianDistribution(parameters).sample(generator)

    def _vae_config(self) -> dict:
        return self.folder.config("vae_encoder") or self.folder.config("vae_decoder")

    def _scaled(self, latents):
        """scaling_factor * latents: the inpainting pipelines' ``_encode_vae_image`` (SDXL's too: it
        reads no latents_mean/std), and img2img's where the VAE has no latents_mean/std."""
        return self._vae_config().get("scaling_factor", 0.18215) * latents

    def _normalized(self, latents):
        """img2img's encoded latents: SDXL with latents_mean/std: StableDiffusionXLImg2ImgPipeline's
        normalization, (x - mean) * scaling_factor / std; else :meth:`_scaled`."""
        import torch

        config = self._vae_config()
        mean, std = config.get("latents_mean"), config.get("latents_std")
        if self.folder.kind == "sdxl" and mean is not None and std is not None:
            mean, std = torch.tensor(mean).view(1, 4, 1, 1), torch.tensor(std).view(1, 4, 1, 1)
            return (latents - mean) * config.get("scaling_factor", 0.18215) / std
        return self._scaled(latents)
