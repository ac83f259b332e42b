"""Flow matching in the fused step: FlowMatchEulerDiscreteScheduler's schedule, as diffusers' SD3 and Flux
pipelines set it up, read as step-graph coefficients; and the table of pipeline families."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from onnxopt.pipeline.families import FAMILIES, INDEX_ENTRIES, PIPELINE_CLASSES, RUNNABLE_CLASSES  # noqa: E402
from onnxopt.pipeline.schedulers import (FLOW_MATCH, SchedulerError, check_schedule,  # noqa: E402
                                         flow_match_timestep_kwargs, folder_scheduler, make_scheduler, plan_steps)

SD35_MEDIUM = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
# black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json
FLUX_DEV = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
            "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
            "max_image_seq_len": 4096}
SD3_DYNAMIC = dict(SD35_MEDIUM, use_dynamic_shifting=True, base_shift=0.5, base_image_seq_len=256,
                   max_image_seq_len=4096)


def diffusers_timesteps(kind: str, config: dict, steps: int, latent_hw: tuple[int, int]):
    """The scheduler after diffusers' own pipeline code set it up (its calculate_shift and
    retrieve_timesteps), for ``steps`` on latents of ``latent_hw``."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(config)
    h, w = latent_hw
    if kind == "flux":
        sigmas = np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift((h // 2) * (w // 2), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        retrieve_timesteps(scheduler, steps, "cpu", sigmas=sigmas, mu=mu)
    else:
        kwargs = {}
        if config.get("use_dynamic_shifting"):
            kwargs["mu"] = calculate_shift((h // 2) * (w // 2), config.get("base_image_seq_len", 256),
                                           config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                                           config.get("max_shift", 1.16))
        retrieve_timesteps(scheduler, steps, "cpu", **kwargs)
    return scheduler


@pytest.mark.parametrize("kind,config,steps,latent_hw", [
    ("sd3", SD35_MEDIUM, 28, (128, 128)), ("sd3", SD35_MEDIUM, 3, (8, 6)), ("sd3", SD3_DYNAMIC, 5, (64, 96)),
    ("flux", FLUX_DEV, 28, (128, 128)), ("flux", FLUX_DEV, 4, (32, 48))])
def test_the_flow_match_step_plan_is_diffusers_pipeline_loop(kind, config, steps, latent_hw):
    """Every step's x_next = c_x x + c_eps v equals diffusers' step on random latents and velocities,
    and the timesteps are the ones the pipeline feeds (Flux: t / 1000), within fp32 rounding."""
    reference = diffusers_timesteps(kind, config, steps, latent_hw)
    kwargs = flow_match_timestep_kwargs(kind, config, steps, *latent_hw)
    scale = 1 / 1000 if kind == "flux" else 1.0
    plan = plan_steps(make_scheduler(FLOW_MATCH, config), steps, timestep_kwargs=kwargs, timestep_scale=scale)
    assert plan.init_noise_sigma == 1.0
    np.testing.assert_allclose(plan.timesteps, reference.timesteps.numpy() * scale, rtol=1e-6)
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((1, 16, 4, 4)).astype(np.float32))
    ours = x.numpy().copy()
    for k, t in enumerate(reference.timesteps):
        v = torch.from_numpy(rng.standard_normal((1, 16, 4, 4)).astype(np.float32))
        c_in, c_x, c_eps, c_state, _, _ = plan.coefficients[k]
        assert (c_in, c_state) == (1.0, 0.0)
        ours = c_x * ours + c_eps * v.numpy()
        x = reference.step(v, t, x, return_dict=False)[0]
        np.testing.assert_allclose(ours, x.numpy(), rtol=1e-5, atol=1e-5)
    check_schedule(make_scheduler(FLOW_MATCH, config), steps, kwargs)


def test_dynamic_shifting_moves_the_schedule_with_the_image_size():
    """Flux's mu grows with the token count: a larger image spends more steps at high noise."""
    small = plan_steps(make_scheduler(FLOW_MATCH, FLUX_DEV), 4, timestep_kwargs=flow_match_timestep_kwargs(
        "flux", FLUX_DEV, 4, 32, 32))
    large = plan_steps(make_scheduler(FLOW_MATCH, FLUX_DEV), 4, timestep_kwargs=flow_match_timestep_kwargs(
        "flux", FLUX_DEV, 4, 128, 128))
    assert small.timesteps[0] == large.timesteps[0] == 1000.0
    assert all(a < b for a, b in zip(small.timesteps[1:], large.timesteps[1:]))


def test_the_folder_scheduler_of_a_flow_matching_folder_is_flow_match():
    assert folder_scheduler(SD35_MEDIUM) == FLOW_MATCH


def test_stochastic_flow_matching_is_refused():
    with pytest.raises(SchedulerError, match="stochastic_sampling"):
        plan_steps(make_scheduler(FLOW_MATCH, dict(SD35_MEDIUM, stochastic_sampling=True)), 4)


def test_every_family_is_one_row_of_the_table():
    assert set(PIPELINE_CLASSES.values()) == set(FAMILIES)
    assert "StableDiffusion3Pipeline" in RUNNABLE_CLASSES and "FluxPipeline" in RUNNABLE_CLASSES
    for family in FAMILIES.values():
        assert family.denoiser.component in family.required
        for name in family.components:
            assert f"{name}/model.onnx" in INDEX_ENTRIES.values()
        for name in (*family.tokenizers, *family.optional_tokenizers):
            assert INDEX_ENTRIES[name] == f"{name}/"
