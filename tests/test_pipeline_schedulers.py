"""Scheduler coefficients for the fused step graph reproduce diffusers' own schedulers step by step.

Claim: for DDIM, Euler and DPM-Solver++ 2M, configured from the scheduler configs of SD 1.5 (its
PNDM config re-created as the requested class), SD 2.1 (v-prediction) and SDXL (Euler, "leading"
spacing, steps_offset 1), the plan's ``c_x*x + c_eps*eps + c_state*state`` equals a fresh diffusers
scheduler's ``step(eps, t, x).prev_sample`` at every step of a whole schedule on random tensors
(within fp32 rounding), with the state carried only through ``d_x*x + d_eps*eps``; and
``c_in*x`` equals ``scale_model_input(x, t)``. Configurations that are not affine are refused.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from onnxopt.pipeline import schedulers  # noqa: E402
from onnxopt.pipeline.schedulers import FUSED_SCHEDULERS, SchedulerError, make_scheduler, plan_steps  # noqa: E402

# The scheduler_config.json files of the public checkpoints (values as published).
SD15 = {
    "_class_name": "PNDMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
    "num_train_timesteps": 1000, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
    "trained_betas": None, "clip_sample": False,
}
SD21 = {
    "_class_name": "DDIMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
    "clip_sample": False, "num_train_timesteps": 1000, "prediction_type": "v_prediction", "set_alpha_to_one": False,
    "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None,
}
SDXL = {
    "_class_name": "EulerDiscreteScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
    "beta_start": 0.00085, "clip_sample": False, "interpolation_type": "linear", "num_train_timesteps": 1000,
    "prediction_type": "epsilon", "sample_max_value": 1.0, "set_alpha_to_one": False, "skip_prk_steps": True,
    "steps_offset": 1, "timestep_spacing": "leading", "trained_betas": None, "use_karras_sigmas": False,
}
CONFIGS = {"sd15": SD15, "sd21-v": SD21, "sdxl": SDXL, "sdxl-v": dict(SDXL, prediction_type="v_prediction")}


def run_both(name: str, config: dict, steps: int, seed: int = 0, begin_index: bool = False) -> list[float]:
    """Drive a fresh diffusers scheduler and the plan on the same random inputs; per-step relative errors.
    ``begin_index``: the reference is driven as StableDiffusionXLPipeline drives it (set_begin_index(0))."""
    plan = plan_steps(make_scheduler(name, config), steps)
    reference = make_scheduler(name, config)
    reference.set_timesteps(steps)
    if begin_index and hasattr(reference, "set_begin_index"):
        reference.set_begin_index(0)
    assert plan.timesteps == [t.item() for t in reference.timesteps]
    assert plan.init_noise_sigma == pytest.approx(float(reference.init_noise_sigma))
    assert plan.coefficients.shape == (len(plan.timesteps), 6) and plan.coefficients.dtype == np.float32

    generator = torch.Generator().manual_seed(seed)
    # a stochastic step's noise: the reference draws it from its generator, the plan's run from a twin
    step_generator, twin = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 4, 8, 8, generator=generator) * reference.init_noise_sigma
    state = torch.zeros_like(x)
    errors = []
    for k, ((c_in, c_x, c_eps, c_state, d_x, d_eps), t) in enumerate(zip(plan.coefficients.tolist(), reference.timesteps)):
        scaled = reference.scale_model_input(x, t)
        torch.testing.assert_close(c_in * x, scaled, rtol=1e-6, atol=1e-6)
        eps = torch.randn(x.shape, generator=generator)
        expected = reference.step(eps, t, x, **schedulers.step_extra_kwargs(reference, step_generator)).prev_sample
        if plan.draws_noise(k):
            state = torch.randn(x.shape, generator=twin)
        ours = c_x * x + c_eps * eps + c_state * state
        magnitude = (abs(c_x) * x.abs() + abs(c_eps) * eps.abs() + abs(c_state) * state.abs()).max()
        errors.append(((ours - expected).abs().max() / magnitude).item())
        state = d_x * x + d_eps * eps
        x = expected
    return errors


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", FUSED_SCHEDULERS)
@pytest.mark.parametrize("steps", [10, 50])
def test_coefficients_reproduce_diffusers_step(name, config, steps):
    errors = run_both(name, CONFIGS[config], steps)
    assert max(errors) < 1e-6, errors  # fp32 rounding of a sum of three terms


@pytest.mark.parametrize("name", FUSED_SCHEDULERS)
def test_driven_as_the_sdxl_pipeline_drives_it(name):
    """StableDiffusionXLPipeline calls set_begin_index(0) before its loop; SD 1.5's lets the scheduler
    find its index from the first timestep. The plan fits both."""
    assert max(run_both(name, SDXL, 30, begin_index=True)) < 1e-6


def test_multistep_state_matters():
    """DPM-Solver++ 2M: the state term is used after the first step and not on the first or the final
    (lower_order_final) step; Euler and DDIM carry no state."""
    plan = plan_steps(make_scheduler("dpm++2m", SD15), 10)
    c_state = plan.coefficients[:, 3]
    assert c_state[0] == 0 and c_state[-1] == 0 and np.all(c_state[1:-1] != 0)
    assert np.all(plan.coefficients[:, 4] != 0)  # every step stores its data prediction
    for name in ("ddim", "euler"):
        coefficients = plan_steps(make_scheduler(name, SD15), 10).coefficients
        assert not coefficients[:, 3:].any()


def test_dropping_the_state_breaks_the_match():
    """The comparison above can fail: without the carried state, DPM-Solver++ 2M no longer matches."""
    plan = plan_steps(make_scheduler("dpm++2m", SD15), 10)
    reference = make_scheduler("dpm++2m", SD15)
    reference.set_timesteps(10)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 8, 8, generator=generator)
    worst = 0.0
    for (_, c_x, c_eps, _, _, _), t in zip(plan.coefficients.tolist(), reference.timesteps):
        eps = torch.randn(x.shape, generator=generator)
        expected = reference.step(eps, t, x).prev_sample
        worst = max(worst, (c_x * x + c_eps * eps - expected).abs().max().item())
        x = expected
    assert worst > 1e-2


def test_plan_leaves_the_scheduler_alone():
    scheduler = make_scheduler("euler", SDXL)
    plan_steps(scheduler, 5)
    assert scheduler.num_inference_steps is None and scheduler.step_index is None


def test_make_scheduler_classes_and_solver_options():
    assert type(make_scheduler("ddim", SD15)).__name__ == "DDIMScheduler"
    assert type(make_scheduler("euler", SD15)).__name__ == "EulerDiscreteScheduler"
    dpm = make_scheduler("dpm++2m", dict(SD15, algorithm_type="sde-dpmsolver++", solver_order=3))
    assert type(dpm).__name__ == "DPMSolverMultistepScheduler"
    assert dpm.config.algorithm_type == "dpmsolver++" and dpm.config.solver_order == 2
    assert make_scheduler("ddim", SD21).config.prediction_type == "v_prediction"
    pndm = make_scheduler("pndm", SD15)
    assert type(pndm).__name__ == "PNDMScheduler" and pndm.config.skip_prk_steps is True
    with pytest.raises(SchedulerError, match="unknown scheduler 'lms'"):
        make_scheduler("lms", SD15)


@pytest.mark.parametrize("name, config, step_kwargs, reason", [
    ("ddim", dict(SD15, clip_sample=True), {}, "clip_sample=True"),
    ("ddim", dict(SD15, thresholding=True), {}, "thresholding=True"),
    ("dpm++2m", dict(SD15, thresholding=True), {}, "thresholding=True"),
    ("ddim", SD15, {"eta": 0.5}, "eta=0.5"),
    ("euler", SD15, {"s_churn": 1.0}, "s_churn=1.0"),
])
def test_non_affine_configurations_are_refused(name, config, step_kwargs, reason):
    with pytest.raises(SchedulerError, match=reason):
        plan_steps(make_scheduler(name, config), 10, step_kwargs=step_kwargs)


# (DDIM's eta and Euler's s_churn draw noise: the numeric check reads such a step as affine in its
# noise, as it reads Euler ancestral's; only the named refusal keeps them out of the step graph)
@pytest.mark.parametrize("name, config, step_kwargs", [
    ("ddim", dict(SD15, clip_sample=True), {}),
    ("dpm++2m", dict(SD15, thresholding=True), {}),
])
def test_numeric_check_catches_what_the_config_check_would_miss(monkeypatch, name, config, step_kwargs):
    """With the named refusals switched off, the random-input check still refuses the plan."""
    monkeypatch.setattr(schedulers, "_refuse_non_affine", lambda scheduler, kwargs: None)
    with pytest.raises(SchedulerError, match="not affine"):
        plan_steps(make_scheduler(name, config), 10, step_kwargs=step_kwargs)


def test_other_scheduler_classes_and_bad_step_counts_are_refused():
    from diffusers import PNDMScheduler

    with pytest.raises(SchedulerError, match="PNDMScheduler is not supported"):
        plan_steps(PNDMScheduler.from_config(SD15), 10)
    with pytest.raises(SchedulerError, match="positive integer"):
        plan_steps(make_scheduler("ddim", SD15), 0)


# --- what a run takes from the folder's scheduler config, and what it refuses before the work ---

def test_the_folders_own_scheduler_is_the_default():
    """Without --scheduler a run uses the folder's class as configured: SD 1.5's PNDM, SD 2.1's DDIM,
    SDXL's Euler; a DPM-Solver config of another algorithm or order (which "dpm++2m" would silently
    turn into DPM-Solver++ 2M) and a class onnxopt does not run are refused with the list."""
    assert [schedulers.folder_scheduler(c) for c in (SD15, SD21, SDXL)] == ["pndm", "ddim", "euler"]
    dpm = {"_class_name": "DPMSolverMultistepScheduler", "num_train_timesteps": 1000}
    assert schedulers.folder_scheduler(dpm) == "dpm++2m"
    for config in (dict(dpm, solver_order=3), dict(dpm, algorithm_type="sde-dpmsolver++"),
                   dict(SD15, _class_name="LMSDiscreteScheduler"), {"num_train_timesteps": 1000}):
        with pytest.raises(SchedulerError, match="choose one with --scheduler .*ddim, euler, dpm\\+\\+2m, .*pndm"):
            schedulers.folder_scheduler(config)


@pytest.mark.parametrize("name", ["ddim", "pndm", "dpm++2m"])
def test_steps_that_diffusers_cannot_run_are_refused(name):
    """num_train_timesteps steps with "leading" spacing and steps_offset 1 (SD 1.5's config) ask for
    timestep 1000 of 0..999: diffusers' own loop fails with an IndexError on it. check_schedule says
    so in one line; with "trailing" spacing the same count runs, in diffusers and here."""
    leading = dict(SD15, timestep_spacing="leading")
    with pytest.raises(IndexError):  # diffusers itself, driven as its pipeline drives it
        reference = make_scheduler(name, leading)
        reference.set_timesteps(1000)
        x = torch.ones(1, 4, 1, 1)
        for t in reference.timesteps:
            x = reference.step(reference.scale_model_input(x, t), t, x).prev_sample
    with pytest.raises(SchedulerError, match="cannot run 1000 steps"):
        schedulers.check_schedule(make_scheduler(name, leading), 1000)
    schedulers.check_schedule(make_scheduler(name, dict(SD15, timestep_spacing="trailing")), 1000)
    schedulers.check_schedule(make_scheduler(name, leading), 500)


@pytest.mark.parametrize("change, message", [
    ({"trained_betas": [0.01] * 10}, "trained_betas must be a list of num_train_timesteps \\(1000\\) numbers, got 10"),
    ({"trained_betas": [0.01] * 999 + [1.5]}, "every trained_betas value must be a number in \\(0, 1\\)"),
    ({"trained_betas": "0.01"}, "trained_betas must be a list"),
    ({"timestep_spacing": "Leading"}, "unknown timestep_spacing 'Leading'"),
    ({"timestep_spacing": None}, "unknown timestep_spacing None"),
    ({"num_train_timesteps": 0}, "num_train_timesteps must be a positive integer"),
    ({"num_train_timesteps": 1000.0}, "num_train_timesteps must be a positive integer"),
    ({"steps_offset": -1}, "steps_offset must be an integer in 0..999"),
    ({"prediction_type": "x0"}, "cannot run 4 steps: ValueError"),
    ({"beta_schedule": "cosine"}, "cannot be made from it"),
])
@pytest.mark.parametrize("name", ["ddim", "euler", "pndm"])
def test_scheduler_configs_diffusers_fails_on_are_one_line_errors(name, change, message):
    """Each of these made diffusers fail mid-run (IndexError, ValueError: exit 3) or compute NaN:
    refused by make_scheduler, or by check_schedule's dry run, before any session exists."""
    with pytest.raises(SchedulerError, match=message) as caught:
        schedulers.check_schedule(make_scheduler(name, dict(SD15, **change)), 4)
    assert "\n" not in str(caught.value)


def run_plms(plan, x, model, slots=None):
    """The plan's PLMS run as the step graph computes it: [x, *slots] <- M_k @ [x, eps, *slots]."""
    slots = np.zeros((plan.history, *x.shape), np.float32) if slots is None else slots
    for row, t in zip(plan.coefficients, plan.timesteps):
        eps = model(row[0] * x, t)
        matrix = row[1:].reshape(1 + plan.history, 2 + plan.history)
        out = np.tensordot(matrix, np.stack([x, eps, *slots]), axes=1).astype(np.float32)
        x, slots = out[0], out[1:]
    return x


def plms_model(x, t):
    """A stand-in denoiser, nonlinear in x and t, so that a wrong coefficient shows in the result."""
    return np.tanh(0.8 * x + np.float32(t) / 700).astype(np.float32)


def diffusers_plms(config: dict, steps: int, x, first_step: int = 0):
    reference = make_scheduler("pndm", config)
    reference.set_timesteps(steps)
    sample = torch.from_numpy(x)
    for t in reference.timesteps[first_step:]:
        eps = torch.from_numpy(plms_model(reference.scale_model_input(sample, t).numpy(), t.item()))
        sample = reference.step(eps, t, sample).prev_sample
    return sample.numpy(), [t.item() for t in reference.timesteps[first_step:]]


@pytest.mark.parametrize("config", ["sd15", "sd15-v", "alpha-one-offset-0"])
@pytest.mark.parametrize("steps, first_step", [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (20, 0), (10, 5), (10, 9)])
def test_plms_plan_reproduces_diffusers_pndm(config, steps, first_step):
    """PNDM (skip_prk_steps): the plan's matrices and four history slots give diffusers' whole PLMS run
    (its duplicated second timestep, cur_sample at the second step, the Adams-Bashforth warm-up orders;
    img2img's start mid-schedule with an empty history) within fp32 rounding."""
    configs = {"sd15": SD15, "sd15-v": dict(SD15, prediction_type="v_prediction"),
               "alpha-one-offset-0": dict(SD15, set_alpha_to_one=True, steps_offset=0)}
    plan = schedulers.plan_plms(make_scheduler("pndm", configs[config]), steps, first_step=first_step)
    x = np.random.default_rng(steps).standard_normal((2, 4, 8, 8)).astype(np.float32)
    expected, timesteps = diffusers_plms(configs[config], steps, x, first_step)
    assert plan.timesteps == timesteps and len(plan) == (steps + 1 if steps > 1 else 1) - first_step  # second one twice
    assert plan.coefficients.shape == (len(plan), 31) and plan.history == 4
    np.testing.assert_allclose(run_plms(plan, x, plms_model), expected, rtol=0, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("broken", ["history", "cur_sample", "order-4 weight"])
def test_plms_plan_with_a_broken_coefficient_misses_diffusers(broken):
    """The comparison above can fail: without the history slots, without cur_sample, or with one
    Adams-Bashforth weight off by 1%, the 20-step run is not diffusers'."""
    plan = schedulers.plan_plms(make_scheduler("pndm", SD15), 20)
    matrices = plan.coefficients[:, 1:].reshape(len(plan), 5, 6)
    if broken == "history":
        matrices[:, 0, 2:5] = 0
    elif broken == "cur_sample":
        matrices[:, 0, 5] = 0
    else:
        matrices[6:, 0, 3] *= 1.01
    x = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    expected, _ = diffusers_plms(SD15, 20, x)
    assert np.abs(run_plms(plan, x, plms_model) - expected).max() > 1e-3 * np.abs(expected).max()


def test_plms_with_runge_kutta_steps_is_refused():
    with pytest.raises(SchedulerError, match="skip_prk_steps=False"):
        schedulers.plan_plms(make_scheduler("pndm", dict(SD15, skip_prk_steps=False)), 10)
