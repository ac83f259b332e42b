"""The one place the service touches onnxopt.pipeline: load a folder, turn a batch of image
requests into images and PNGs.

Batching contract. A compatible group (:meth:`ImageRequest.compatible_key`: one size, steps,
scheduler and step guidance, :func:`onnxopt.pipeline.batch.run_key`) is one call of
:func:`onnxopt.pipeline.batch.generate_batch`: one denoising loop with the UNet at 2B rows (B without guidance), each
image's noise drawn from its own seed, and each image equal to the one ``onnxopt generate`` makes
alone with its settings (``tests/test_pipeline_batch.py``; the PNG is written as generate writes it).
Re-point this module when the pipeline's entry points change.
"""

from __future__ import annotations

import io

from onnxopt.serve.api import Defaults, ImageRequest


def load_pipeline(folder: str, provider: str):
    """The folder's optimized pipeline on ``provider`` (cuda: the replica's one GPU, device 0 of
    what Ray hands it through CUDA_VISIBLE_DEVICES)."""
    from onnxopt.pipeline import Pipeline

    return Pipeline.load(folder, provider=provider)


def schedulers() -> tuple[str, ...]:
    from onnxopt.pipeline.schedulers import SCHEDULERS

    return SCHEDULERS


def check_servable(folder) -> None:
    """Refuse (one-line GenerationError) a folder whose images the batched run cannot make: every
    request would fail at once (flow matching: SD3 and Flux run their own loop; a ControlNet needs a
    conditioning image; an inpainting UNet an image and a mask), so the service is refused before Ray starts."""
    from onnxopt.pipeline.families import FAMILIES
    from onnxopt.pipeline.plan import GenerationError, inpainting_unet

    if inpainting_unet(folder):
        raise GenerationError(f"{folder.root}: its UNet is an inpainting one (it takes an image and a mask): onnxopt "
                              "serve makes text-to-image only; onnxopt generate --image --mask runs this folder")
    if not _batched(folder.family):
        served = ", ".join(kind for kind, family in FAMILIES.items() if family.runs and _batched(family))
        raise GenerationError(f"{folder.root} is a {folder.kind} pipeline ({folder.index.get('_class_name')}): "
                              f"onnxopt serve runs {served} folders; onnxopt generate runs this one")


def _batched(family) -> bool:
    """Whether :func:`onnxopt.pipeline.batch.generate_batch` makes this family's images (UNet, no ControlNet)."""
    return not family.flow_matching and family.kind != "controlnet"


def folder_defaults(folder: str) -> tuple[Defaults, int]:
    """``onnxopt generate``'s defaults for this folder (its family's steps and guidance: LCM's 4 and
    8.5, not SD's 50 and 7.5), and the size factor (the VAE's)."""
    from onnxopt.pipeline import PipelineFolder

    opened = PipelineFolder.open(folder)
    family = opened.family
    return Defaults(steps=family.default_steps, guidance=family.default_guidance), opened.vae_scale_factor


def check_against_folder(pipe, request: ImageRequest) -> None:
    """The pipeline's own request checks (steps over the folder's train steps...), as GenerationError."""
    from onnxopt.pipeline.runner import check_request

    check_request(pipe.folder, steps=request.steps, height=request.height, width=request.width,
                  **_scheduler(request))


def make_images(pipe, group: list[ImageRequest]) -> list:
    """The image of each request of one compatible group, in order, from one batched run (PIL images:
    the PNGs are encoded by each request's own task, off the replica's one batch at a time)."""
    from onnxopt.pipeline.batch import BatchImage, generate_batch

    first = group[0]
    images = [BatchImage(r.prompt, seed=r.seed, negative_prompt=r.negative_prompt, guidance=r.guidance) for r in group]
    results = generate_batch(pipe, images, steps=first.steps, height=first.height, width=first.width, **_scheduler(first))
    return [result.image for result in results]


def png_bytes(image) -> bytes:
    """``image`` as the PNG file ``onnxopt generate`` writes (PIL's defaults). At 512x512 this is
    about 50 ms of CPU (zlib), which is why it runs beside the next batch, not in it."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def bad_request_errors() -> tuple[type[Exception], ...]:
    """The pipeline's exceptions that mean the request, not the service, is at fault (-> 400)."""
    from onnxopt.pipeline.runner import GenerationError

    return (GenerationError,)


def _scheduler(request: ImageRequest) -> dict:
    """The scheduler argument: left out when the request left it out, so the pipeline's own default applies."""
    return {"scheduler": request.scheduler} if request.scheduler is not None else {}
