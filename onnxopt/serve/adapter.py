"""The one place the service touches onnxopt.pipeline: load a folder, turn a batch of image
requests into PNGs. Re-point this module when the pipeline's entry points change.

Batching contract. ``Pipeline.__call__`` makes one image from one prompt, so a compatible group
(:meth:`ImageRequest.compatible_key`) is run here one image after another on the replica's one
pipeline: every image equals the image ``onnxopt generate`` makes alone, because each is that very
call. The batched step needs from the runner: ``Pipeline.__call__`` (or a sibling) taking lists of
prompts, negative prompts and seeds of one size/steps/scheduler/guidance, drawing each image's
noise from its own ``torch.Generator('cpu').manual_seed(seed)`` as now, concatenating the
conditionings as [negatives..., prompts...] and the latents as [N, C, h, w], running the step graph
(or the UNet) at batch 2N, splitting guidance per image, and decoding per image (or at batch N);
and a step graph / bound-buffer loop keyed by that batch. Then :func:`make_images` calls it once
per group and nothing else here changes.
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


def folder_defaults(folder: str) -> tuple[Defaults, int]:
    """``onnxopt generate``'s defaults for this folder, and the size factor (the VAE's)."""
    from onnxopt.pipeline import PipelineFolder

    opened = PipelineFolder.open(folder)
    return Defaults(), opened.vae_scale_factor


def check_against_folder(pipe, request: ImageRequest) -> None:
    """The pipeline's own request checks (steps over the folder's train steps...), as GenerationError."""
    from onnxopt.pipeline.runner import check_request

    check_request(pipe.folder, steps=request.steps, height=request.height, width=request.width,
                  **_scheduler(request))


def make_images(pipe, group: list[ImageRequest]) -> list[bytes]:
    """PNG bytes of each request of one compatible group, in order (see the batching contract)."""
    pngs = []
    for r in group:
        result = pipe(r.prompt, negative_prompt=r.negative_prompt, steps=r.steps, guidance=r.guidance,
                      seed=r.seed, height=r.height, width=r.width, progress=False, **_scheduler(r))
        out = io.BytesIO()
        result.image.save(out, format="PNG")  # as onnxopt generate writes its file
        pngs.append(out.getvalue())
    return pngs


def bad_request_errors() -> tuple[type[Exception], ...]:
    """The pipeline's exceptions that mean the request, not the service, is at fault (-> 400)."""
    from onnxopt.pipeline.runner import GenerationError

    return (GenerationError,)


def _scheduler(request: ImageRequest) -> dict:
    """The scheduler argument: left out when the request left it out, so the pipeline's own default applies."""
    return {"scheduler": request.scheduler} if request.scheduler is not None else {}
