"""The image size contract of a generation: the default size a folder gives (as diffusers' pipelines
compute it) and the sizes a request may ask for. Read by the runner, img2img and batches alike."""

from __future__ import annotations

from onnxopt.pipeline.folder import PipelineFolder
from onnxopt.pipeline.plan import GenerationError


def default_size(folder: PipelineFolder) -> tuple[int, int]:
    """(height, width) when none is asked: the UNet's sample_size times the VAE factor, after
    StableDiffusionPipeline.__init__'s correction of old configs (a UNet config written by diffusers
    before 0.9 with an integer sample_size under 64 means 64: the SD 1.x checkpoints of that time)."""
    unet = folder.config("unet")
    sample = unet.get("sample_size")
    if folder.kind == "sd" and isinstance(sample, int) and sample < 64 and _written_before_0_9(unet):
        return 64 * folder.vae_scale_factor, 64 * folder.vae_scale_factor
    return folder.default_size


def _written_before_0_9(config: dict) -> bool:
    """Whether the config's ``_diffusers_version`` is before 0.9.0.dev0 (diffusers' own comparison)."""
    from packaging import version

    written = config.get("_diffusers_version")
    if written is None:
        return False
    try:
        return version.parse(version.parse(str(written)).base_version) < version.parse("0.9.0.dev0")
    except version.InvalidVersion:
        raise GenerationError(f"unet/config.json: _diffusers_version {written!r} is not a version") from None


def _check_size(height, width, factor: int, allow_none: bool = False) -> None:
    """Text to image's sizes: multiples of 8 (the pipelines' check_inputs), and of the VAE factor."""
    check_multiple(height, width, max(8, factor), allow_none)


def check_multiple(height, width, multiple: int, allow_none: bool = False) -> None:
    for name, value in (("height", height), ("width", width)):
        if value is None and allow_none:
            continue
        if not isinstance(value, int) or value < multiple or value % multiple:
            raise GenerationError(f"{name} must be a positive multiple of {multiple}, got {value}")


def unet_latent_multiple(folder: PipelineFolder) -> int:
    """What an exported UNet's latent sides must be a multiple of: 2 ** its downsamplings. Traced at
    such a size, its up blocks upsample by a fixed 2 (diffusers' UNet passes the skip's size to them
    only for other sizes, a branch the trace did not take), so another size fails in their Concat."""
    channels = folder.config("unet").get("block_out_channels") or ()
    return 2 ** max(len(channels) - 1, 0)
