"""Schedulers for the fused step graph: diffusers' own classes, their update read as coefficients.

The step graph (:mod:`onnxopt.pipeline.step_graph`) computes, per denoising step,

    model_in    = c_in * x                                   (scale_model_input)
    x_next      = c_x * x + c_eps * eps + c_state * state    (step(...).prev_sample)
    state_next  = d_x * x + d_eps * eps                      (the solver's stored data prediction)

where ``eps`` is the guided model output (epsilon or v, whatever the config predicts) and
``state`` the previous step's stored data prediction (DPM-Solver++ 2M; zero elsewhere). For DDIM
(eta=0), Euler (s_churn=0) and DPM-Solver++ 2M, diffusers' ``scale_model_input`` and ``step`` are
linear and elementwise in (x, eps, state). So the coefficients are not re-derived here: they are
*read* by running diffusers' own methods on basis vectors, on a deep copy of the scheduler:

    step(model_output=[0, 1, 0], t, sample=[1, 0, 0]) with model_outputs[-1] = [0, 0, 1]
        prev_sample          = [c_x, c_eps, c_state]
        new model_outputs[-1] = [d_x, d_eps, 0]

The copy is then advanced (step index, lower-order counters) exactly as a real run advances it, so
first steps (no history: c_state = 0), ``lower_order_final`` steps, ``timestep_spacing`` and
``steps_offset`` come out of diffusers as they are. Each step is then checked: a random
(x, eps, state) must give diffusers' result within fp32 rounding. A configuration that is not
affine (DDIM ``clip_sample`` or ``thresholding``, ``eta > 0``, Euler ``s_churn > 0``, an SDE or
other multistep variant) is refused with a one-line error rather than planned wrongly.

Flow matching (``FlowMatchEulerDiscreteScheduler``, SD3's and Flux's) is Euler on a velocity:
``x_next = x + (sigma_next - sigma) * v``, read the same way (c_in 1: it has no ``scale_model_input``;
c_state 0). Its schedule depends on what the pipeline passes to ``set_timesteps`` (dynamic
shifting's ``mu``, Flux's ``sigmas``): :func:`flow_match_timestep_kwargs`.

Euler ancestral and LCM add noise at each step (LCM: at each step but the last). Their update is
affine in (x, eps, noise): the probe passes a seeded generator, sees whether the step drew from it,
and reads the noise's coefficient from a basis channel whose x, eps and state are all zero. The
run draws that noise with the image's generator in diffusers' order and feeds it as ``state``
(:attr:`StepPlan.noise`), so the image is diffusers' own. LCM's last step draws none and returns
``prev_sample = denoised``: the latents after the run are the ``denoised`` that diffusers'
LatentConsistencyModelPipeline decodes.

PNDM (SD 1.5's own scheduler: PLMS with ``skip_prk_steps``) keeps more than one earlier value: the
last three model outputs (``ets``) and, between its first two steps, the first sample
(``cur_sample``). Its step is linear in all of them, so :func:`plan_plms` reads it the same way, as
a matrix per step over the inputs (x, eps, slots) and the outputs (x_next, slots_next), on basis
vectors put where diffusers keeps them (:data:`PLMS_SLOTS`); the step graph then carries the slots
in a ``state`` of one more axis (:func:`onnxopt.pipeline.step_graph.with_history`). PNDM's
Runge-Kutta steps (``skip_prk_steps`` False) and UniPC are run by diffusers' own ``step`` in the
host loop (the plan says so).

What a run uses is what diffusers' pipeline for the folder uses (:func:`pipeline_scheduler_config`):
the folder's scheduler class built from its config, the pipeline class's own corrections applied
(``StableDiffusionPipeline.__init__`` resets ``steps_offset`` to 1 and ``clip_sample`` to False),
then the requested class made ``from_config`` of that, as ``pipe.scheduler =
DDIMScheduler.from_config(pipe.scheduler.config)`` does. Without a requested class, the folder's own
(:func:`folder_scheduler`). :func:`check_schedule` runs the schedule once on a tiny sample before any
work, so a config diffusers cannot run (``steps`` equal to ``num_train_timesteps`` with "leading"
spacing and ``steps_offset`` 1, a ``trained_betas`` list of the wrong length, an unknown
``timestep_spacing``...) is a one-line error, not a crash mid-run.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import numpy as np

from onnxopt.errors import MissingDependencyError, OnnxoptError

# the UNet families' that plan_steps reads as coefficients (euler-a and lcm: with the noise they draw as an input)
FUSED_SCHEDULERS = ("ddim", "euler", "dpm++2m", "euler-a", "dpm++2m-karras", "lcm")
# read by plan_plms as a matrix over a history of earlier values (PNDM's PLMS steps; its PRK steps run on the host)
HISTORY_SCHEDULERS = ("pndm",)
# diffusers' own step in the host loop: UniPC's corrector reads the previous sample and outputs beside the update
HOST_SCHEDULERS = ("unipc",)
SCHEDULERS = (*FUSED_SCHEDULERS, *HISTORY_SCHEDULERS, *HOST_SCHEDULERS)  # every name a UNet family takes
FLOW_MATCH = "flow-match"  # FlowMatchEulerDiscreteScheduler: the transformer families' (SD3, Flux)
FLOW_MATCH_SCHEDULERS = (FLOW_MATCH,)  # what a flow-matching denoiser takes (it predicts a velocity, not noise)
ALL_SCHEDULERS = (*SCHEDULERS, *FLOW_MATCH_SCHEDULERS)  # every name a run takes
FUSABLE_SCHEDULERS = (*FUSED_SCHEDULERS, *HISTORY_SCHEDULERS, *FLOW_MATCH_SCHEDULERS)  # every one the step graph runs
# the folder's scheduler class -> the name that makes it as it is
FOLDER_CLASSES = {"DDIMScheduler": "ddim", "EulerDiscreteScheduler": "euler", "DPMSolverMultistepScheduler": "dpm++2m",
                  "PNDMScheduler": "pndm", "EulerAncestralDiscreteScheduler": "euler-a",
                  "UniPCMultistepScheduler": "unipc", "LCMScheduler": "lcm", "FlowMatchEulerDiscreteScheduler": FLOW_MATCH}
_DPM_2M = {"algorithm_type": "dpmsolver++", "solver_order": 2}
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")  # diffusers' set_timesteps takes these
# diffusers pipeline classes whose __init__ corrects an outdated scheduler config (steps_offset, clip_sample):
# StableDiffusionPipeline and OnnxStableDiffusionPipeline; SDXL's and the ControlNet pipeline's do not
RESETTING_KINDS = ("sd",)
COEFFICIENTS = ("c_in", "c_x", "c_eps", "c_state", "d_x", "d_eps")

# Relative tolerance of the affine check, against the magnitude of the terms summed: fp32 rounding
# of a few operations is ~1e-7; clipping, thresholding or noise are off by orders of magnitude more.
AFFINE_RTOL = 2e-5


class SchedulerError(OnnxoptError):
    """A scheduler name or configuration the fused step graph cannot run."""


@dataclass
class StepPlan:
    """Everything the step loop needs from the scheduler, for ``len(timesteps)`` steps.

    ``coefficients[k]`` are step k's (c_in, c_x, c_eps, c_state, d_x, d_eps), float32.
    ``timesteps[k]`` is the value diffusers feeds the denoiser at step k (int for DDIM and DPM-Solver,
    float for Euler and flow matching). Initial latents are scaled by ``init_noise_sigma`` (1 for
    flow matching, whose pipelines do not scale them).

    ``noise[k]``: step k draws noise (Euler ancestral, LCM): ``randn_tensor(latents.shape,
    generator)`` after the previous step's draw, as diffusers' ``step(..., generator=...)`` draws
    it; the step loop writes it into the step's ``state`` input and ``c_state`` is its coefficient
    (these schedulers keep no earlier prediction: ``d_x = d_eps = 0``).
    """

    timesteps: list
    coefficients: np.ndarray
    init_noise_sigma: float
    noise: tuple = ()
    history: int = 0  # PLMS: the state's slots (coefficients[k] is then c_in and a matrix, :func:`plan_plms`)

    def draws_noise(self, k: int) -> bool:
        return bool(self.noise) and self.noise[k]

    def __len__(self) -> int:
        return len(self.timesteps)

    def first(self, steps: int) -> "StepPlan":
        """The plan's first ``steps`` steps (a run stopped early: each step's coefficients depend on
        the steps before it only, so a prefix is that run's plan)."""
        return replace(self, timesteps=self.timesteps[:steps], coefficients=self.coefficients[:steps],
                       noise=self.noise[:steps])


def schedulers_for(flow_matching: bool) -> tuple[str, ...]:
    """The scheduler names a family takes: a flow-matching denoiser (SD3, Flux) predicts a velocity and
    runs flow matching only; a UNet predicts noise (or v) and runs the others."""
    return FLOW_MATCH_SCHEDULERS if flow_matching else SCHEDULERS


def make_scheduler(name: str, config: dict):
    """diffusers' scheduler ``name`` (one of :data:`SCHEDULERS`) configured from ``config``
    (a ``scheduler_config.json``, any scheduler class: its common keys carry over, as with
    diffusers' ``from_config``)."""
    classes = _diffusers_classes()
    made = {"ddim": (classes.DDIMScheduler, {}), "euler": (classes.EulerDiscreteScheduler, {}),
            "dpm++2m": (classes.DPMSolverMultistepScheduler, _DPM_2M),
            "dpm++2m-karras": (classes.DPMSolverMultistepScheduler, dict(_DPM_2M, use_karras_sigmas=True)),
            "euler-a": (classes.EulerAncestralDiscreteScheduler, {}), "lcm": (classes.LCMScheduler, {}),
            "pndm": (classes.PNDMScheduler, {}), "unipc": (classes.UniPCMultistepScheduler, {}),
            FLOW_MATCH: (classes.FlowMatchEulerDiscreteScheduler, {})}
    if name not in made:
        raise SchedulerError(f"unknown scheduler '{name}'; choose one of {', '.join(ALL_SCHEDULERS)}")
    cls, options = made[name]
    check_config_values(config)
    try:
        return cls.from_config(config, **options)
    except (TypeError, ValueError, NotImplementedError) as exc:  # a value of the wrong type or range in the config
        raise SchedulerError(f"scheduler_config.json: {cls.__name__} cannot be made from it: {_first_line(exc)}") from None


# far above any published scheduler's (diffusers' 1000; improved DDPM's 4000), far below a table that fills the memory
MAX_TRAIN_TIMESTEPS = 100_000


def check_config_values(config: dict) -> None:
    """The scheduler config values diffusers takes without complaint and then fails on mid-run (or
    silently misreads): a one-line SchedulerError instead."""
    train = config.get("num_train_timesteps", 1000)
    if not isinstance(train, int) or isinstance(train, bool) or train < 1:
        raise SchedulerError(f"scheduler_config.json: num_train_timesteps must be a positive integer, got {train!r}")
    if train > MAX_TRAIN_TIMESTEPS:  # diffusers makes tables of that many entries, and so does the step graph
        raise SchedulerError(f"scheduler_config.json: num_train_timesteps must be at most {MAX_TRAIN_TIMESTEPS}, got "
                             f"{train} (the schedule's tables hold one entry per train timestep)")
    betas = config.get("trained_betas")
    if betas is not None:
        if not isinstance(betas, list) or len(betas) != train:
            size = len(betas) if isinstance(betas, list) else type(betas).__name__
            raise SchedulerError(f"scheduler_config.json: trained_betas must be a list of num_train_timesteps ({train}) "
                                 f"numbers, got {size}")
        if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < 1 for b in betas):
            raise SchedulerError("scheduler_config.json: every trained_betas value must be a number in (0, 1)")
    spacing = config.get("timestep_spacing", "leading")
    if spacing not in TIMESTEP_SPACINGS:
        raise SchedulerError(f"scheduler_config.json: unknown timestep_spacing {spacing!r} "
                             f"(diffusers takes {', '.join(TIMESTEP_SPACINGS)})")
    offset = config.get("steps_offset", 0)
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < train:
        raise SchedulerError(f"scheduler_config.json: steps_offset must be an integer in 0..{train - 1}, got {offset!r}")
    for key in ("beta_start", "beta_end"):  # betas are probabilities: a negative one made scaled_linear's sqrt complex
        value = config.get(key)
        if value is not None and not (_real(value) and 0 <= value < 1):
            raise SchedulerError(f"scheduler_config.json: {key} must be a number in [0, 1), got {value!r}")
    # flow matching's sigma shift: sigma' = shift * sigma / (1 + (shift - 1) * sigma), a warping of (0, 1] for shift > 0
    if "shift" in config and not (_real(config["shift"]) and 0 < config["shift"] <= FLOAT32_MAX):
        raise SchedulerError(f"scheduler_config.json: shift must be a positive number, got {config['shift']!r}")
    for key in ("base_shift", "max_shift"):  # dynamic shifting's line (calculate_shift)
        if key in config and not (_real(config[key]) and abs(config[key]) <= FLOAT32_MAX):
            raise SchedulerError(f"scheduler_config.json: {key} must be a finite number, got {config[key]!r}")
    lengths = [config[key] for key in ("base_image_seq_len", "max_image_seq_len") if key in config]
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lengths) or (
            len(lengths) == 2 and lengths[0] == lengths[1]):
        raise SchedulerError("scheduler_config.json: base_image_seq_len and max_image_seq_len must be two different "
                             f"positive integers (the two points of dynamic shifting's line), got {lengths}")


FLOAT32_MAX = float(np.finfo(np.float32).max)  # the schedule's sigmas and timesteps are float32 tensors


def _real(value) -> bool:
    """A finite int or float of JSON (not a bool, a string or NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def folder_scheduler(config: dict, class_name: str | None = None) -> str:
    """The name that makes the folder's own scheduler as it is configured (``class_name``, model_index.json's
    entry, else the config's ``_class_name``), or a one-line SchedulerError listing the names a run takes."""
    cls = class_name or config.get("_class_name")
    name = FOLDER_CLASSES.get(cls)
    if name == "dpm++2m" and (config.get("algorithm_type", "dpmsolver++"), config.get("solver_order", 2)) != ("dpmsolver++", 2):
        name = None  # "dpm++2m" forces DPM-Solver++ of order 2: not this config's solver
    if name == "dpm++2m" and config.get("use_karras_sigmas"):
        name = "dpm++2m-karras"
    if name is None:
        where = _describe(dict(config, _class_name=cls))
        if class_name and class_name != config.get("_class_name") and where == "scheduler_config.json":
            where = "model_index.json"  # the class diffusers makes is the index's, not the config's _class_name
        raise SchedulerError(f"the folder's scheduler {cls} ({where}) is not one "
                             f"onnxopt runs as configured: "
                             f"choose one with --scheduler ({', '.join(SCHEDULERS)})")
    return name


def _describe(config: dict) -> str:
    keys = ("algorithm_type", "solver_order") if config.get("_class_name") == "DPMSolverMultistepScheduler" else ()
    return ", ".join(f"{k}={config.get(k)!r}" for k in keys) or "scheduler_config.json"


def pipeline_scheduler_config(config: dict, kind: str, class_name: str | None = None) -> dict:
    """The scheduler config diffusers' pipeline of ``kind`` holds after loading the folder: the
    folder's class (``class_name``, model_index.json's entry, else the config's ``_class_name``)
    made from ``config`` (its defaults filled in), with the corrections that
    ``StableDiffusionPipeline.__init__`` makes to an outdated config (``steps_offset`` != 1 -> 1,
    ``clip_sample`` True -> False; SDXL's and the ControlNet pipeline's keep the config as it is)."""
    classes = _diffusers_classes()
    check_config_values(config)
    cls = getattr(classes, str(class_name or config.get("_class_name")), None)
    if isinstance(cls, type) and issubclass(cls, classes.SchedulerMixin):
        try:
            config = dict(cls.from_config(config).config)
        except (TypeError, ValueError, NotImplementedError) as exc:
            raise SchedulerError(f"scheduler_config.json: {cls.__name__} cannot be made from it: {_first_line(exc)}") from None
    else:
        config = dict(config)
    if kind in RESETTING_KINDS:
        if "steps_offset" in config and config["steps_offset"] != 1:
            config["steps_offset"] = 1
        if config.get("clip_sample", False) is True:
            config["clip_sample"] = False
    return config


def check_schedule(scheduler, steps: int, timestep_kwargs: dict | None = None) -> None:
    """Run ``steps`` steps of (a copy of) ``scheduler`` on a 1x4x1x1 sample of ones, as the pipeline
    drives it; a one-line SchedulerError when diffusers fails on it or a timestep falls outside the
    trained ones (e.g. ``steps`` = ``num_train_timesteps`` with "leading" spacing and ``steps_offset`` 1:
    timestep 1000 of 0..999; flow matching: 0..num_train_timesteps) or a value is not finite.
    ``timestep_kwargs``: what the pipeline passes to ``set_timesteps`` (flow matching's ``mu``, ``sigmas``)."""
    torch = _torch()
    running = copy.deepcopy(scheduler)
    name = type(scheduler).__name__
    train = running.config.num_train_timesteps
    try:
        _set_timesteps(running, steps, timestep_kwargs)
        timesteps = running.timesteps
        top = train + 1 if _is_flow_match(running) else train  # a flow's t = sigma * train reaches train itself
        if len(timesteps) and not (0 <= float(timesteps.min()) and float(timesteps.max()) < top):
            raise SchedulerError(f"{name} with this scheduler_config.json cannot run {steps} steps: timestep "
                                 f"{float(timesteps.max()):g} lies outside the trained 0..{train - 1}")
        x = torch.ones(1, 4, 1, 1)
        extra = step_extra_kwargs(running, torch.Generator().manual_seed(0))  # not the global RNG's draws
        for t in timesteps:
            model_output = _scale_model_input(running, x, t)
            x = running.step(model_output, t, x, return_dict=False, **extra)[0]
            if not torch.isfinite(x).all():
                raise SchedulerError(f"{name} with this scheduler_config.json cannot run {steps} steps: its sample "
                                     f"is not finite at timestep {float(t):g}")
    except SchedulerError:
        raise
    except Exception as exc:  # noqa: BLE001 -- diffusers' own failure on this config: the config's fault
        raise SchedulerError(f"{name} with this scheduler_config.json cannot run {steps} steps: "
                             f"{type(exc).__name__}: {_first_line(exc)}") from None


def step_extra_kwargs(scheduler, generator=None, eta: float = 0.0) -> dict:
    """diffusers' ``prepare_extra_step_kwargs``: ``eta`` and ``generator`` for a ``step`` that takes them."""
    import inspect

    accepted = inspect.signature(scheduler.step).parameters
    extra = {"eta": eta} if "eta" in accepted else {}
    if "generator" in accepted:
        extra["generator"] = generator
    return extra


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def plan_steps(scheduler, num_inference_steps: int, *, step_kwargs: dict | None = None,
               timestep_kwargs: dict | None = None, timestep_scale: float = 1.0, first_step: int = 0) -> StepPlan:
    """Timesteps and per-step coefficients of ``scheduler`` for ``num_inference_steps`` steps.

    ``first_step``: the run starts at that timestep index, as img2img's does (diffusers'
    ``get_timesteps``, with its ``set_begin_index``); the steps from there on are probed as a run of
    their own, so a multistep solver starts at first order there (slicing the full schedule's plan
    would carry the history of steps never run).
    ``scheduler`` is not modified (a deep copy is probed). ``step_kwargs`` go to every ``step``
    call as the pipeline would pass them (DDIM ``eta``, Euler ``s_churn``...); values that make
    the update non-affine are refused. Raises :class:`SchedulerError` for a configuration whose
    update is not affine in (x, eps, state).
    """
    torch = _torch()
    if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
        raise SchedulerError(f"number of inference steps must be a positive integer, got {num_inference_steps!r}")
    _refuse_non_affine(scheduler, step_kwargs or {})
    running = copy.deepcopy(scheduler)
    _set_timesteps(running, num_inference_steps, timestep_kwargs)
    if first_step and hasattr(running, "set_begin_index"):
        running.set_begin_index(first_step)
    timesteps = running.timesteps[first_step:]
    rng = np.random.default_rng(0)
    rows, noise = [], []
    for k in range(len(timesteps)):
        t = timesteps[k]
        before = copy.deepcopy(running)
        row, draws = _probe(running, t, step_kwargs or {}, torch)
        _check_affine(before, t, row, draws, step_kwargs or {}, rng, torch, k)
        rows.append(row)
        noise.append(draws)
    return StepPlan(
        timesteps=[t.item() * timestep_scale if timestep_scale != 1.0 else t.item() for t in timesteps],
        coefficients=np.asarray(rows, dtype=np.float32).reshape(len(rows), len(COEFFICIENTS)),
        init_noise_sigma=float(getattr(running, "init_noise_sigma", 1.0)),
        noise=tuple(noise),
    )


# Where PNDM's PLMS step keeps what a later step reads: the last three model outputs (a step appends
# one to ``ets`` after keeping the last three) and the first step's sample, read at the second step.
PLMS_SLOTS = ("ets[-1]", "ets[-2]", "ets[-3]", "cur_sample")


def plan_plms(scheduler, num_inference_steps: int, *, first_step: int = 0) -> StepPlan:
    """PNDMScheduler's PLMS steps (``skip_prk_steps`` True) for ``num_inference_steps`` steps, read as
    a matrix per step. With ``slots`` = the values of :data:`PLMS_SLOTS` (zero where diffusers has none
    yet), step k is::

        model_in                = c_in * x
        [x_next, *slots_next]   = M_k @ [x, eps, *slots]        (M_k: 5 x 6, elementwise over the latents)

    and ``coefficients[k]`` = [c_in, *M_k.flatten()] (``history`` = 4 slots). M_k is read from diffusers'
    own ``step`` on basis vectors, put into ``ets`` and ``cur_sample`` where the running copy holds a
    value, so the duplicated first timestep, ``cur_sample`` at the second step, the growing Adams-Bashforth
    orders, ``_get_prev_sample`` (``set_alpha_to_one``, ``steps_offset``, epsilon or v prediction) come
    out of diffusers as they are; each step is then checked on random inputs. ``first_step``: img2img
    starts at that index of ``timesteps`` with an empty history, as diffusers' pipeline does (PNDM has
    no ``set_begin_index``). ``scheduler`` is not modified. Raises :class:`SchedulerError` for PRK steps
    or another class."""
    torch = _torch()
    classes = _diffusers_classes()
    if not isinstance(scheduler, classes.PNDMScheduler):
        raise SchedulerError(f"{type(scheduler).__name__} is not PNDMScheduler")
    if not scheduler.config.get("skip_prk_steps", False):
        raise SchedulerError("PNDMScheduler with skip_prk_steps=False runs Runge-Kutta steps: diffusers' own step "
                             "on the host")
    if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
        raise SchedulerError(f"number of inference steps must be a positive integer, got {num_inference_steps!r}")
    running = copy.deepcopy(scheduler)
    running.set_timesteps(num_inference_steps)
    timesteps = running.timesteps[first_step:]
    inputs = 2 + len(PLMS_SLOTS)
    basis = lambda i: torch.eye(inputs, dtype=torch.float64)[i].reshape(1, inputs, 1, 1)  # noqa: E731
    rng = np.random.default_rng(0)
    rows = []
    for k, t in enumerate(timesteps):
        before = copy.deepcopy(running)
        c_in = _scale_model_input(running, torch.ones(1, 1, 1, 1), t).item()
        _put_plms_slots(running, [basis(2 + i) for i in range(len(PLMS_SLOTS))])
        prev = running.step(basis(1), t, basis(0)).prev_sample
        matrix = np.stack([_flat(v, inputs) for v in (prev, *_plms_slots(running))])
        _check_plms(before, t, matrix, rng, torch, k)
        rows.append([c_in, *matrix.flatten()])
    return StepPlan(timesteps=[t.item() for t in timesteps], coefficients=np.asarray(rows, np.float32).reshape(
                    len(rows), 1 + (1 + len(PLMS_SLOTS)) * inputs),
                    init_noise_sigma=float(running.init_noise_sigma), history=len(PLMS_SLOTS))


def _plms_slots(scheduler) -> list:
    """The values of :data:`PLMS_SLOTS` (None where diffusers holds none)."""
    ets = scheduler.ets
    return [ets[-i] if len(ets) >= i else None for i in (1, 2, 3)] + [scheduler.cur_sample]


def _put_plms_slots(scheduler, values: list) -> None:
    """``values`` where :data:`PLMS_SLOTS` hold one (an empty slot stays empty: diffusers' branch reads
    how many it holds)."""
    for i in (1, 2, 3):
        if len(scheduler.ets) >= i:
            scheduler.ets[-i] = values[i - 1]
    if scheduler.cur_sample is not None:
        scheduler.cur_sample = values[3]


def _flat(value, size: int) -> np.ndarray:
    return np.zeros(size) if value is None else value.double().flatten().numpy()


def _check_plms(scheduler, t, matrix: np.ndarray, rng, torch, k: int) -> None:
    """Run ``scheduler`` (a copy from before step k) on random inputs; refuse if ``matrix`` misses it."""
    shape = (2, 4, 4, 4)
    values = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 10) for _ in range(matrix.shape[1])]
    _put_plms_slots(scheduler, values[2:])
    prev = scheduler.step(values[1], t, values[0]).prev_sample
    stacked = np.stack([v.double().numpy() for v in values])
    for what, actual, row in zip(("step", *PLMS_SLOTS), (prev, *_plms_slots(scheduler)), matrix):
        actual = np.zeros(shape) if actual is None else actual.double().numpy()
        expected = np.tensordot(row, stacked, axes=1)
        scale = np.tensordot(np.abs(row), np.abs(stacked), axes=1) + 1e-30
        error = float((np.abs(actual - expected) / scale).max())
        if not error <= AFFINE_RTOL:
            raise SchedulerError(f"PNDMScheduler: {what} at step {k} (timestep {t.item():g}) is not linear in the "
                                 f"sample, model output and history (relative error {error:.1e})")


def _is_flow_match(scheduler) -> bool:
    return type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"


def _set_timesteps(scheduler, steps: int, timestep_kwargs: dict | None) -> None:
    """``set_timesteps`` as diffusers' ``retrieve_timesteps`` calls it: with ``sigmas`` the step
    count is theirs (diffusers passes none then)."""
    kwargs = dict(timestep_kwargs or {})
    if kwargs.get("sigmas") is not None:
        scheduler.set_timesteps(**kwargs)
    else:
        kwargs.pop("sigmas", None)
        scheduler.set_timesteps(steps, **kwargs)


def _scale_model_input(scheduler, x, t):
    """diffusers' ``scale_model_input`` (flow matching has none: the pipelines feed the latents as they are)."""
    scale = getattr(scheduler, "scale_model_input", None)
    return x if scale is None else scale(x, t)


def calculate_shift(kind: str, config: dict, image_seq_len: int) -> float:
    """Dynamic shifting's ``mu`` for an image of ``image_seq_len`` transformer tokens, as diffusers'
    pipeline of ``kind`` computes it (``calculate_shift`` of diffusers' SD3 and Flux pipelines, a line
    through (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift)); the pipelines' own
    defaults where the config has no value: SD3's max_shift 1.16, Flux's 1.15. Written out, not
    imported: importing diffusers' pipeline modules pulls in transformers' image processors (seconds,
    and warnings on stderr) for a line equation."""
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.16 if kind == "sd3" else 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + (base_shift - m * base_len)


def flow_match_timestep_kwargs(kind: str, config: dict, steps: int, latent_height: int, latent_width: int,
                               patch_size: int = 2) -> dict:
    """What diffusers' pipeline of ``kind`` passes to FlowMatchEulerDiscreteScheduler.set_timesteps
    for ``steps`` steps on latents of ``latent_height`` x ``latent_width``:

    * ``sd3`` (StableDiffusion3Pipeline): ``mu`` only when the config has ``use_dynamic_shifting``,
      for (latent_height // patch_size) * (latent_width // patch_size) tokens; no sigmas (the
      scheduler's own linspace, then its ``shift``).
    * ``flux`` (FluxPipeline): ``sigmas`` = linspace(1, 1/steps, steps) (none when the config has
      ``use_flow_sigmas``) and ``mu`` always, for (latent_height // 2) * (latent_width // 2)
      packed tokens."""
    if kind == "flux":
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        return {"sigmas": sigmas, "mu": calculate_shift(kind, config, (latent_height // 2) * (latent_width // 2))}
    if config.get("use_dynamic_shifting"):
        return {"mu": calculate_shift(kind, config, (latent_height // patch_size) * (latent_width // patch_size))}
    return {}


PROBE_SEED = 0  # the probe's own generator: the noise a step draws is regenerated from it


def _probe(scheduler, t, step_kwargs: dict, torch) -> tuple[list[float], bool]:
    """One step of ``scheduler`` on basis vectors (advances it): the step's coefficients, and whether
    it drew noise. Channels: x, eps, state, and a fourth with all three zero, where a step that
    draws noise outputs ``c_noise * noise`` alone (the noise regenerated from the probe's seed)."""
    def basis(i: int):  # latent-shaped (some scheduler code reads batch and channel dims)
        return torch.eye(4)[i].reshape(1, 4, 1, 1)

    c_in = _scale_model_input(scheduler, torch.ones(1, 1, 1, 1), t).item()
    has_state = _set_state(scheduler, basis(2))
    generator = torch.Generator().manual_seed(PROBE_SEED)
    prev = scheduler.step(basis(1), t, basis(0), **{**step_extra_kwargs(scheduler, generator), **step_kwargs}).prev_sample
    out = prev.double().flatten()
    draws = not torch.equal(generator.get_state(), torch.Generator().manual_seed(PROBE_SEED).get_state())
    c_noise = 0.0
    if draws:
        if has_state:
            raise SchedulerError(f"{type(scheduler).__name__} draws noise and keeps an earlier prediction: the step "
                                 "graph's one state input cannot carry both")
        noise = _probe_noise(torch, prev.shape).double().flatten()
        c_noise = (out[3] / noise[3]).item()
        out = out - c_noise * noise
    c_x, c_eps, c_state = out[:3].tolist()
    d_x = d_eps = 0.0
    stored = _state(scheduler)
    if stored is not None:
        d_x, d_eps = stored.double().flatten()[:2].tolist()
    if not has_state:
        c_state = c_noise
    return [c_in, c_x, c_eps, c_state, d_x, d_eps], draws


def _probe_noise(torch, shape):
    """What diffusers' ``randn_tensor(shape, generator)`` draws first from a CPU generator of the probe's seed."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(tuple(shape), generator=torch.Generator().manual_seed(PROBE_SEED), dtype=torch.float32)


def _check_affine(scheduler, t, row: list[float], draws: bool, step_kwargs: dict, rng, torch, k: int) -> None:
    """Run ``scheduler`` (a copy from before step k) on random inputs; refuse if the coefficients miss it.
    ``draws``: the step's noise (regenerated from the probe's seed) is its ``state`` term."""
    c_in, c_x, c_eps, c_state, d_x, d_eps = row
    shape = (2, 4, 4, 4)
    # Large values on purpose: clipping and thresholding act beyond |x0| = 1.
    x, eps, state = (torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 10) for _ in range(3))
    has_state = _set_state(scheduler, state)
    if not has_state:
        state = _probe_noise(torch, shape) if draws else torch.zeros(shape)
    scaled = _scale_model_input(scheduler, x, t)
    extra = step_extra_kwargs(scheduler, torch.Generator().manual_seed(PROBE_SEED))
    prev = scheduler.step(eps, t, x, **{**extra, **step_kwargs}).prev_sample
    checks = [("scale_model_input", scaled, [(c_in, x)]),
              ("step", prev, [(c_x, x), (c_eps, eps), (c_state, state)])]
    stored = _state(scheduler)
    if stored is not None:
        checks.append(("stored data prediction", stored, [(d_x, x), (d_eps, eps)]))
    for what, actual, terms in checks:
        expected = sum(c * v.double() for c, v in terms)
        scale = sum(abs(c) * v.double().abs() for c, v in terms) + 1e-30
        error = ((actual.double() - expected).abs() / scale).max().item()
        if not error <= AFFINE_RTOL:
            raise SchedulerError(
                f"{type(scheduler).__name__}: {what} at step {k} (timestep {t.item():g}) is not affine in the sample, "
                f"model output and state (relative error {error:.1e}); the fused step graph cannot run this "
                "configuration (noise, clipping or thresholding?)"
            )


def _set_state(scheduler, value) -> bool:
    """Put ``value`` where a multistep solver keeps its previous data prediction; False if it has none yet."""
    outputs = getattr(scheduler, "model_outputs", None)
    if not outputs or outputs[-1] is None:
        return False
    outputs[-1] = value
    return True


def _state(scheduler):
    outputs = getattr(scheduler, "model_outputs", None)
    return outputs[-1] if outputs else None


def _refuse_non_affine(scheduler, step_kwargs: dict) -> None:
    """One-line reasons for the configurations known not to be affine (the numeric check catches the rest)."""
    classes = _diffusers_classes()
    name = type(scheduler).__name__
    config = scheduler.config
    supported = (classes.DDIMScheduler, classes.EulerDiscreteScheduler, classes.DPMSolverMultistepScheduler,
                 classes.EulerAncestralDiscreteScheduler, classes.LCMScheduler, classes.FlowMatchEulerDiscreteScheduler)
    if not isinstance(scheduler, supported):
        raise SchedulerError(f"{name} is not supported by the fused step graph (it runs: {', '.join(FUSABLE_SCHEDULERS)})")
    reasons = []
    if config.get("thresholding"):
        reasons.append("thresholding=True")
    if isinstance(scheduler, (classes.DDIMScheduler, classes.LCMScheduler)):
        if config.get("clip_sample"):
            reasons.append("clip_sample=True")
        if step_kwargs.get("eta", 0.0):
            reasons.append(f"eta={step_kwargs['eta']} (adds noise)")
    if isinstance(scheduler, classes.FlowMatchEulerDiscreteScheduler) and config.get("stochastic_sampling"):
        reasons.append("stochastic_sampling=True (adds noise)")
    if isinstance(scheduler, classes.EulerDiscreteScheduler) and step_kwargs.get("s_churn", 0.0):
        reasons.append(f"s_churn={step_kwargs['s_churn']} (adds noise)")
    if isinstance(scheduler, classes.DPMSolverMultistepScheduler):
        if config.get("algorithm_type") != "dpmsolver++":
            reasons.append(f"algorithm_type={config.get('algorithm_type')!r} (only 'dpmsolver++')")
        if config.get("solver_order") not in (1, 2):
            reasons.append(f"solver_order={config.get('solver_order')} "
                           "(the step graph carries one previous prediction)")
    if reasons:
        raise SchedulerError(f"{name} with {', '.join(reasons)} is not affine; the fused step graph cannot run it")


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise MissingDependencyError("schedulers need torch and diffusers (pip install 'onnxopt[pipeline]')") from exc
    return torch


def _diffusers_classes():
    try:
        import diffusers
    except ImportError as exc:
        raise MissingDependencyError("schedulers need diffusers (pip install 'onnxopt[pipeline]')") from exc
    return diffusers
