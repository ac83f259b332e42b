"""onnxopt.pipeline.generate: the ONNX pipeline gives the diffusers torch pipeline's image.

The claim (issue 13, "Done when"): for the tiny SD 1.5, SDXL and SD 1.5 + ControlNet folders,
exported from the torch pipeline ``models.pipelines.build_torch_pipeline(kind, "tiny", seed)``,
fp32 on the ORT CPU EP, for each of DDIM, Euler and DPM-Solver++ 2M, ``Pipeline`` gives the final
latents and the image of diffusers' own ``__call__`` with the same scheduler object, prompt,
negative prompt, seed, steps, guidance and size.

Tolerances. Both sides run the same fp32 graphs; they differ only by kernel rounding (ORT's vs
torch's GEMM/conv accumulation order, ~1e-7 relative per op), amplified by guidance 7.5 and the
solver over the steps. Measured: final latents agree to ~1e-6 of their scale (max |latent| ~20,
max abs difference ~2e-5), so latents are checked at ``atol = 1e-5 * scale`` (10x margin) and the
images in [0, 1] at 1e-4. The PNG's uint8 values may then differ by at most one level (a value
within 1e-4 of a rounding boundary); more than 0.5 % of the pixels doing so would mean a real
difference.

Kept small for CI: 4 steps, 32x48 images (latents 16x24: not square, so H/W mix-ups show).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="generating needs torch (pip install -e '.[models]')")
pytest.importorskip("diffusers", reason="generating needs diffusers")
pytest.importorskip("transformers", reason="generating needs transformers")
pytest.importorskip("onnxruntime", reason="generating needs onnxruntime")

from onnxopt.pipeline import Pipeline, PipelineFolder  # noqa: E402
from onnxopt.pipeline.schedulers import SCHEDULERS, make_scheduler  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMITTED_SD15 = ROOT / "models" / "pipelines" / "sd15-tiny"
KINDS = {"sd15": "sd", "sdxl": "sdxl", "sd15-controlnet": "controlnet"}
SEED = 0
STEPS = 4
GUIDANCE = 7.5
HEIGHT, WIDTH = 32, 48
PROMPT, NEGATIVE = "a photo of a red cat", "blurry"
LATENT_RTOL = 1e-5  # of max |latent|
PIXEL_ATOL = 1e-4


def control_image():
    from PIL import Image

    rng = np.random.default_rng(7)
    edges = (rng.random((HEIGHT, WIDTH)) > 0.8).astype(np.uint8) * 255
    return Image.fromarray(np.stack([edges] * 3, axis=-1))


class Built:
    """A tiny kind: its torch pipeline (the reference) and its ONNX folder, made once per module."""

    def __init__(self, kind: str, root: Path):
        from models.pipelines import build_torch_pipeline, write_onnx_folder

        self.kind = kind
        self.torch_pipe = build_torch_pipeline(kind, "tiny", SEED)
        self.torch_pipe.set_progress_bar_config(disable=True)
        self.folder = root / kind
        write_onnx_folder(kind, self.folder, "tiny", "torchscript", SEED, pipe=self.torch_pipe)
        self.pipelines: dict[bool, Pipeline] = {}

    def onnx(self, fused: bool = True) -> Pipeline:
        if fused not in self.pipelines:
            self.pipelines[fused] = Pipeline.load(self.folder, "cpu", fused_step=fused)
        return self.pipelines[fused]

    def request(self, **overrides) -> dict:
        request = dict(prompt=PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=GUIDANCE, seed=SEED,
                       height=HEIGHT, width=WIDTH)
        if self.kind == "sd15-controlnet":
            request["controlnet_image"] = control_image()
        request.update(overrides)
        return request

    def reference(self, scheduler: str, **overrides):
        """diffusers' __call__: (final latents, image [H, W, 3] in [0, 1])."""
        import torch

        r = self.request(**overrides)
        pipe = self.torch_pipe
        pipe.scheduler = make_scheduler(scheduler, PipelineFolder.open(self.folder).scheduler_config())
        final = {}

        def keep_latents(_pipe, i, _t, kwargs):
            final["latents"] = kwargs["latents"].clone()
            return kwargs

        extra = {"image": r["controlnet_image"]} if "controlnet_image" in r else {}
        with torch.no_grad():
            image = pipe(r["prompt"], negative_prompt=r["negative_prompt"], num_inference_steps=r["steps"],
                         guidance_scale=r["guidance"], height=r["height"], width=r["width"],
                         generator=torch.Generator("cpu").manual_seed(r["seed"]), output_type="np",
                         callback_on_step_end=keep_latents, **extra).images[0]
        return final["latents"].numpy(), image


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelines")
    cache: dict[str, Built] = {}

    def get(kind: str) -> Built:
        if kind not in cache:
            cache[kind] = Built(kind, root)
        return cache[kind]

    return get


def assert_same_image(latents, pixels, ref_latents, ref_pixels):
    scale = float(np.abs(ref_latents).max())
    assert latents.shape == ref_latents.shape
    np.testing.assert_allclose(latents, ref_latents, rtol=0, atol=LATENT_RTOL * scale)
    assert pixels.shape == ref_pixels.shape
    np.testing.assert_allclose(pixels, ref_pixels, rtol=0, atol=PIXEL_ATOL)
    levels = np.abs((pixels * 255).round() - (ref_pixels * 255).round())
    assert levels.max() <= 1 and (levels > 0).mean() <= 0.005


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_onnx_pipeline_gives_the_diffusers_image(built, kind, scheduler):
    b = built(kind)
    result = b.onnx()(scheduler=scheduler, progress=False, **b.request())
    ref_latents, ref_pixels = b.reference(scheduler)
    assert PipelineFolder.open(b.folder).kind == KINDS[kind]
    assert result.image.size == (WIDTH, HEIGHT)
    assert_same_image(result.latents, result.pixels, ref_latents, ref_pixels)
    assert np.asarray(result.image).tolist() == (result.pixels * 255).round().astype(np.uint8).tolist()
