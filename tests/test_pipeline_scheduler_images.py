"""Each scheduler a run takes gives diffusers' pipeline image with that scheduler.

The claim: on the tiny SD 1.5 folder (and SDXL for two of them), fp32 on the ORT CPU EP, the
ONNX pipeline with ``euler-a``, ``dpm++2m-karras``, ``lcm`` (fused: the step graph, their noise
drawn from the image's generator in diffusers' order and fed as the step's ``state``), ``pndm``
(fused: the step graph with its history of earlier outputs) and ``unipc`` (diffusers' own step in
the host loop) gives the final latents and image of diffusers'
``__call__`` with ``<Class>.from_config(pipe.scheduler.config)`` from the same weights and seed.

Tolerances are test_pipeline_generate's (latents within 1e-4 of their scale, pixels within 1e-4):
both sides run the same fp32 graphs and differ by kernel rounding only. Noise drawn from another
generator, or in another order, moves the latents by O(1) (the last test shows it).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch", reason="generating needs torch (pip install -e '.[models]')")
pytest.importorskip("diffusers", reason="generating needs diffusers")
pytest.importorskip("onnxruntime", reason="generating needs onnxruntime")

from onnxopt.pipeline import Pipeline  # noqa: E402
from onnxopt.pipeline.plan import GenerationError  # noqa: E402
from onnxopt.pipeline.schedulers import FUSED_SCHEDULERS, HOST_SCHEDULERS, SchedulerError  # noqa: E402
from tests.test_pipeline_generate import LATENT_RTOL, THREADS, Built, assert_same_image  # noqa: E402
from tests.test_pipeline_generate import built  # noqa: E402,F401  (fixture: the tiny folders, once per module)

NEW = ("euler-a", "dpm++2m-karras", "lcm", "unipc")
STEPS = 3


def check(b: Built, scheduler: str, pipe: Pipeline | None = None, **overrides):
    overrides = {"steps": STEPS, **overrides}
    result = (pipe or b.onnx())(scheduler=scheduler, progress=False, **b.request(**overrides))
    ref_latents, ref_pixels = b.reference(scheduler, **overrides)
    assert_same_image(result.latents, result.pixels, ref_latents, ref_pixels)
    return result


@pytest.mark.parametrize("kind, scheduler", [*(("sd15", s) for s in NEW), ("sdxl", "euler-a"), ("sdxl", "lcm"),
                                             ("sdxl", "unipc")])
def test_scheduler_gives_the_diffusers_image(built, kind, scheduler):
    result = check(built(kind), scheduler)
    if scheduler in FUSED_SCHEDULERS:
        assert result.timings["step"] == "built in memory from unet/model.onnx"
    else:
        assert scheduler in HOST_SCHEDULERS and result.timings["step"].startswith("unfused:")


def test_euler_ancestral_on_the_bound_buffer_loop(built):
    """The device loop (the CUDA EP's, on CPU buffers) writes each step's noise into its bound state
    buffer; a second image reuses the buffers (a captured graph would replay them)."""
    b = built("sd15")
    pipe = Pipeline.load(b.folder, "cpu", io_binding=True, threads=THREADS)
    check(b, "euler-a", pipe)
    check(b, "euler-a", pipe, seed=5)


@pytest.mark.parametrize("guidance", [1.0, 7.5])
def test_lcm_with_and_without_guidance(built, guidance):
    """LCM on a UNet without a guidance embedding: diffusers runs classifier-free guidance when
    guidance > 1, and the prompt alone at 1 (the negative prompt unused)."""
    b = built("sd15")
    result = check(b, "lcm", guidance=guidance)
    assert result.timings["classifier_free_guidance"] is (guidance > 1)


@pytest.mark.parametrize("scheduler", ["euler-a", "lcm", "dpm++2m-karras", "unipc", "pndm"])
def test_one_step(built, scheduler):
    check(built("sd15"), scheduler, steps=1)


def test_unipc_of_order_three(built, tmp_path):
    """solver_order 3 (the predictor and corrector read two earlier outputs; 6 steps, as diffusers lowers
    the order over the last ones): diffusers' own step."""
    from models.pipelines import copy_folder

    b = built("sd15")
    folder = tmp_path / "unipc3"
    copy_folder(b.folder, folder)
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(dict(config, solver_order=3)))
    pipe = Pipeline.load(folder, "cpu", threads=THREADS)
    result = pipe(scheduler="unipc", progress=False, **b.request(steps=6))
    ref_latents, ref_pixels = b.reference("unipc", folder=folder, steps=6)
    assert_same_image(result.latents, result.pixels, ref_latents, ref_pixels)
    order_two = b.onnx()(scheduler="unipc", progress=False, **b.request(steps=6))
    # order 3 changes one predictor step of six: 0.7 % of the latents' scale, 70 times the tolerance
    assert np.abs(order_two.latents - result.latents).max() > 10 * LATENT_RTOL * np.abs(ref_latents).max()


@pytest.mark.parametrize("edit, expected", [
    ({"an_unknown_key": 3, "another": [1, 2]}, None),  # diffusers ignores keys it does not know: so do we
    ({"use_karras_sigmas": True, "use_exponential_sigmas": True}, "cannot be made from it"),
    ({"timestep_spacing": "sideways"}, "unknown timestep_spacing"),
])
def test_scheduler_config_with_unknown_or_contradicting_keys(built, tmp_path, edit, expected):
    from models.pipelines import copy_folder

    b = built("sd15")
    folder = tmp_path / "edited"
    copy_folder(b.folder, folder)
    path = folder / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **edit)))
    if expected is None:
        pipe = Pipeline.load(folder, "cpu", threads=THREADS)
        result = pipe(scheduler="euler-a", progress=False, **b.request(steps=2))
        ref_latents, ref_pixels = b.reference("euler-a", folder=folder, steps=2)
        assert_same_image(result.latents, result.pixels, ref_latents, ref_pixels)
        return
    # a value no scheduler takes (timestep_spacing) is refused when the folder is opened; a combination
    # only some schedulers refuse (karras and exponential sigmas) when that scheduler is made
    with pytest.raises((GenerationError, SchedulerError)) as caught:
        Pipeline.load(folder, "cpu", threads=THREADS)(scheduler="dpm++2m-karras", progress=False, **b.request(steps=2))
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_the_noise_is_the_images_generator(built, monkeypatch):
    """The comparison sees the per-step noise: the same initial latents (seed) with each step's noise
    drawn from another generator is far off diffusers' image."""
    import torch

    from onnxopt.pipeline import runner

    b = built("sd15")
    ref_latents, _ = b.reference("euler-a", steps=STEPS)
    real = runner._step_noise
    monkeypatch.setattr(runner, "_step_noise", lambda plan, shape, generator, k, loop: real(
        plan, shape, torch.Generator().manual_seed(99), k, loop))
    other = b.onnx()(scheduler="euler-a", progress=False, **b.request(steps=STEPS))
    assert np.abs(other.latents - ref_latents).max() > 100 * LATENT_RTOL * np.abs(ref_latents).max()


# stabilityai/stable-diffusion-2-1's scheduler/scheduler_config.json (the 768 v-prediction model)
SD21_V = {"_class_name": "DDIMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
          "clip_sample": False, "num_train_timesteps": 1000, "prediction_type": "v_prediction", "set_alpha_to_one": False,
          "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None}


@pytest.mark.parametrize("scheduler", [None, "euler-a", "dpm++2m-karras", "unipc"])
def test_sd2_v_prediction_folder_at_its_default_size(built, tmp_path_factory, scheduler):
    """An SD 2.x folder (OpenCLIP-style text encoder, whose last hidden state StableDiffusionPipeline
    reads: SD 2's penultimate layer is the config's last) with the 768 model's v-prediction DDIM
    config, no size asked: the UNet's sample_size times the VAE factor, and diffusers' image."""
    from models.pipelines import copy_folder

    b = built("sd21")
    folder = tmp_path_factory.getbasetemp() / "sd21-v"
    if not folder.is_dir():
        copy_folder(b.folder, folder)
        (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(SD21_V))
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps(dict(index, scheduler=["diffusers", "DDIMScheduler"])))
    pipe = Pipeline.load(folder, "cpu", threads=THREADS)
    result = pipe(scheduler=scheduler, progress=False, **b.request(steps=STEPS, height=None, width=None))
    ref_latents, ref_pixels = b.reference(scheduler, folder=folder, steps=STEPS, height=None, width=None)
    factor = 2 ** (len(b.torch_pipe.vae.config.block_out_channels) - 1)
    assert result.pixels.shape[:2] == (b.torch_pipe.unet.config.sample_size * factor,) * 2
    assert_same_image(result.latents, result.pixels, ref_latents, ref_pixels)
    epsilon = b.onnx()(scheduler=scheduler or "ddim", progress=False, **b.request(steps=STEPS, height=None, width=None))
    assert np.abs(epsilon.latents - result.latents).max() > 100 * LATENT_RTOL * np.abs(ref_latents).max()


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 20])
def test_pndm_on_the_step_graph_with_its_history(built, steps):
    """PNDM (the SD 1.5 folder's own scheduler, PLMS steps): the step graph with its history slots
    gives diffusers' image at the step counts of its warm-up (the second timestep twice, cur_sample,
    orders 1 to 4) and past it."""
    result = check(built("sd15"), "pndm", steps=steps)
    assert result.timings["step"] == "built in memory from unet/model.onnx"


@pytest.mark.parametrize("case", ["no guidance", "bound buffers"])
def test_pndm_on_the_step_graph_without_guidance_and_on_bound_buffers(built, case):
    """Guidance 1: the step graph of one row per image, with the history; the bound-buffer loop (the CUDA
    EP's, on CPU buffers): the history in its ping-pong state buffers, emptied again for a second image."""
    b = built("sd15")
    if case == "bound buffers":
        pipe = Pipeline.load(b.folder, "cpu", io_binding=True, threads=THREADS)
        check(b, "pndm", pipe, steps=5)
        result = check(b, "pndm", pipe, steps=5, seed=5)
    else:
        result = check(b, "pndm", steps=5, guidance=1.0)
        assert result.timings["classifier_free_guidance"] is False
    assert result.timings["step"] == "built in memory from unet/model.onnx"
