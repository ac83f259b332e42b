"""Several images from one denoising loop: the UNet (or the step graph) runs on the concatenated batch.

    from onnxopt.pipeline.batch import BatchImage, generate_batch
    results = generate_batch(pipe, [BatchImage("a cat", seed=1), BatchImage("a dog", seed=2, negative_prompt="blurry")],
                             steps=20, scheduler="ddim", height=512, width=512)   # [Result, Result]

What the B images of one run share and what each keeps as its own::

    image i: prompt_i, negative_i ─ text encoder(s), once per distinct pair, as alone ─ rows [neg_i; prompt_i]
    conditioning  [neg_1 ... neg_B; prompt_1 ... prompt_B]        2B rows, the uncond half first:
                  the step graph's and diffusers' loop's layout  ─ K/V companion once, on all 2B rows
                  (guidance <= 1: [prompt_1 ... prompt_B], B rows, the negative prompts unused)
    latents       concat(randn_tensor([1, C, h, w], Generator("cpu").manual_seed(seed_i)) for each i) * sigma
    denoise       one loop at batch B: the step graph (UNet at 2B, guidance, update; at B without guidance), or diffusers' loop
    decode        each image alone through the VAE decoder (its batch-1 graph, bound and captured as alone)

A run shares the size, the steps, the scheduler and the guidance its step applies. The step graph
takes one ``guidance_scale``, so images with guidance > 1 share a run with images of the same
guidance only; images at guidance <= 1 (no classifier-free guidance: the prompt's row alone counts)
all share one. :func:`generate_batch` splits its images into such runs of at most ``max_batch``
images, keeping their order; :func:`run_key` is what a caller that groups requests itself (the
service, :mod:`onnxopt.serve.batching`) groups by.

Each image equals the image :meth:`Pipeline.__call__ <onnxopt.pipeline.runner.Pipeline.__call__>`
makes alone with its prompt, negative prompt, seed and guidance: the rows of a batch do not mix
(convolutions, attention and normalizations are per sample; the guidance and the scheduler's update
are elementwise), and ONNX Runtime's CPU kernels compute each row as they do at batch 1
(``tests/test_pipeline_batch.py`` checks it bit for bit, fp32 on the CPU EP; the GPU check, where
cuDNN/cuBLAS may pick other algorithms per batch size, is in its ``gpu`` test).

On bound buffers (cuda, or ``io_binding`` on the CPU) the step loop is keyed by the shapes it binds,
the latents' included (:meth:`~onnxopt.pipeline.sessions.DeviceStepLoop.key`), so each batch size
gets its own buffers and captured CUDA graphs, as the K/V companion and the text encoders get theirs
per input shape (:class:`~onnxopt.runners.captured_session.CapturedSession`). The VAE decoder runs at
batch 1: its batch-B activations at 512x512 would cost gigabytes of device memory for little speed
(the decoder is compute-bound at that size).

ControlNet folders, image-to-image and step reuse are single-image features: not batched here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from onnxopt.pipeline.plan import GenerationError, classifier_free_guidance
from onnxopt.pipeline.runner import (
    Pipeline,
    Result,
    _check_size,
    _torch,
    check_numbers,
    check_prompts,
    check_request,
    check_text_to_image_sides,
    clears_status,
    default_size,
)


@dataclass(frozen=True)
class BatchImage:
    """One image of a batch: what is its own (the rest is the batch's)."""
    prompt: str
    seed: int = 0
    negative_prompt: str | None = None
    guidance: float = 7.5


def run_key(guidance: float) -> float | None:
    """Images whose keys are equal can share one denoising run (given one size, steps and
    scheduler): the guidance the step applies, None when classifier-free guidance is off."""
    return float(guidance) if classifier_free_guidance(guidance) else None


def runs(images: list[BatchImage], max_batch: int | None = None) -> list[list[int]]:
    """The denoising runs of ``images``: lists of their indices, one :func:`run_key` each, at most
    ``max_batch`` long (None: no limit), in order of each run's first image."""
    by_key: dict = {}
    order: list[list[int]] = []
    for i, image in enumerate(images):
        group = by_key.get(run_key(image.guidance))
        if group is None or (max_batch is not None and len(group) >= max_batch):
            group = by_key[run_key(image.guidance)] = []
            order.append(group)
        group.append(i)
    return order


@clears_status
def generate_batch(pipe: Pipeline, images: list[BatchImage], *, steps: int = 50, scheduler: str | None = None,
                   height: int | None = None, width: int | None = None, max_batch: int | None = None,
                   progress: bool = False) -> list[Result]:
    """One Result per image of ``images``, in order, each equal to ``pipe(image.prompt,
    negative_prompt=..., seed=..., guidance=..., steps=steps, scheduler=scheduler, height=height,
    width=width)``; the images run in batches (:func:`runs`). Every image is checked before any work."""
    torch = _torch()
    folder = pipe.folder
    if not images:
        return []
    if folder.kind == "controlnet":
        raise GenerationError(f"{folder.root} is a ControlNet pipeline: its images are made one at a time")
    if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
        raise GenerationError(f"max_batch must be a positive integer, got {max_batch!r}")
    scheduler = check_request(folder, steps=steps, scheduler=scheduler, height=height, width=width)
    for image in images:
        check_numbers(guidance=image.guidance, seed=image.seed)
        check_prompts(image.prompt, image.negative_prompt)
    default_h, default_w = default_size(folder)
    height, width = height or default_h, width or default_w
    factor = folder.vae_scale_factor
    _check_size(height, width, factor)
    check_text_to_image_sides(folder, height, width)
    channels = folder.config("unet").get("in_channels", 4)
    sched = pipe._scheduler(scheduler)

    prompts: dict[tuple, dict] = {}  # (prompt, negative, cfg) -> its conditioning rows: each encoded once
    results: list[Result | None] = [None] * len(images)
    for run in runs(images, max_batch):
        start = time.perf_counter()
        timings: dict = {"provider": pipe.provider, "step": pipe.step_source, "cuda_graph": pipe.cuda_graph,
                         "session_runs_per_step": pipe.session_runs_per_step(), "batch_images": len(run)}
        t0 = time.perf_counter()
        # one run_key: one answer for the whole run
        cfg = classifier_free_guidance(images[run[0]].guidance, folder.family.denoiser)
        rows = []
        for i in run:
            pair = (images[i].prompt, images[i].negative_prompt if cfg else None)
            if (*pair, cfg) not in prompts:
                prompts[(*pair, cfg)] = pipe._prompt_conditioning(*pair, height, width, cfg=cfg)
            rows.append(prompts[(*pair, cfg)])
        # a UNet that embeds the guidance (LCM): each image's own, whatever the run's key
        cond = pipe._step_conditioning(pipe._with_guidance_embedding(batch_conditioning(rows),
                                                                     [images[i].guidance for i in run]), cfg)
        timings["text_encoder_s"] = time.perf_counter() - t0
        timings["text_encoders"] = dict(pipe.text_sources)
        # each image's own generator: its initial noise, then (Euler ancestral, LCM) its row of each step's noise
        generators = [torch.Generator("cpu").manual_seed(images[i].seed) for i in run]
        noise = torch.cat([_noise(torch, g, (1, channels, height // factor, width // factor)) for g in generators])
        sched.set_timesteps(steps)  # the denoising loop takes the initial latents scaled, as diffusers' prepare_latents
        noise = noise * getattr(sched, "init_noise_sigma", 1.0)  # flow matching has none
        guidance = images[run[0]].guidance
        latents = pipe._denoise(scheduler, sched, steps, noise, cond, None, guidance, frozenset(), progress, timings,
                                generator=generators)
        decode_s = 0.0
        for k, i in enumerate(run):
            own = dict(timings)
            pixels = pipe._decode(latents[k:k + 1], images[i].guidance, own)[0]  # [1, H, W, 3]: the image
            decode_s += own["vae_decode_s"]
            results[i] = Result(latents=latents[k:k + 1], pixels=pixels, timings=own)
        total = time.perf_counter() - start
        for i in run:  # the run's stages are every image's; its decode is the image's own
            own = results[i].timings
            own["total_s"], own["vae_decode_all_s"] = total, decode_s
            own["session_creation_s"] = pipe.creation_s
            if pipe.calls == 0:
                own["cold_start_s"] = pipe.creation_s + total
        pipe.calls += 1
    return results


def batch_conditioning(rows: list[dict]) -> dict[str, np.ndarray]:
    """Each image's two rows [negative; prompt] -> one batch [negatives...; prompts...] per input
    (one row each, the prompt's, without guidance -> [prompts...])."""
    return {name: np.concatenate([r[name][:1] for r in rows] + [r[name][1:] for r in rows]) for name in rows[0]}


def _noise(torch, generator, shape: tuple):
    """The image's initial noise, drawn from its generator exactly as Pipeline.__call__ draws it alone."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=torch.float32)
