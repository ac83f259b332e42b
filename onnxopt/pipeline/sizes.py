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
    only for other sizes, a branch the trace did not take), so another size fails in their Concat.
    1 (any size) where unet/model.onnx carries the upsample-to-skip rewrite (``onnxopt optimize``
    writes it: the metadata :data:`~onnxopt.passes.upsample_to_skip.UPSAMPLE_TO_SKIP_METADATA`,
    which the step graphs built from that UNet copy)."""
    channels = folder.config("unet").get("block_out_channels") or ()
    multiple = 2 ** max(len(channels) - 1, 0)
    if multiple > 1 and folder.has("unet") and takes_any_latent_size(folder.component("unet").model):
        return 1
    return multiple


def takes_any_latent_size(unet_model) -> bool:
    """Whether a UNet graph file carries the upsample-to-skip rewrite (its metadata; the graph is not parsed)."""
    from onnxopt.loading import read_metadata_props
    from onnxopt.passes.upsample_to_skip import UPSAMPLE_TO_SKIP_METADATA

    return UPSAMPLE_TO_SKIP_METADATA in read_metadata_props(unet_model)


def check_latent_sides(folder: PipelineFolder, height: int, width: int, what: str, fix: str = "resize or crop it") -> None:
    """A one-line GenerationError for a size whose latents the exported UNet cannot take
    (:func:`unet_latent_multiple`), where diffusers' torch UNet takes any; ``fix`` ends the message."""
    factor, multiple = folder.vae_scale_factor, unet_latent_multiple(folder)
    if (height // factor) % multiple or (width // factor) % multiple:
        raise GenerationError(f"{what} is {width}x{height} pixels: the exported UNet takes latents whose sides are "
                              f"multiples of {multiple}, pixels of {multiple * factor} (diffusers' torch UNet "
                              f"takes any size; so does one optimized by onnxopt from a TorchScript export); {fix}")


def check_text_to_image_sides(folder: PipelineFolder, height: int, width: int) -> None:
    """Text to image's size against the UNet's latent multiple (:func:`check_latent_sides`)."""
    if folder.family.denoiser.component == "unet":
        check_latent_sides(folder, height, width, "the image", f"give a height and width that are multiples of "
                           f"{unet_latent_multiple(folder) * folder.vae_scale_factor}")
