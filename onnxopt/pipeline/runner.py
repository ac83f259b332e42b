"""Text to image from an ONNX pipeline folder: diffusers' generation loop on ONNX Runtime.

    pipe = Pipeline.load("sd15-tiny", provider="cpu")
    result = pipe("a photo of a cat", steps=20, scheduler="ddim", seed=0)
    result.image.save("cat.png"); result.timings["step_mean_s"]

What one call does (following diffusers' ``StableDiffusionPipeline.__call__``,
``StableDiffusionXLPipeline.__call__`` and ``StableDiffusionControlNetPipeline.__call__``)::

    prompt, negative ─ CLIPTokenizer(s), padded to model_max_length ─ text encoder(s), once ─┐
         SD: last_hidden_state          SDXL: concat(penultimate hidden states of both encoders),
                                              pooled = text_encoder_2.text_embeds, time ids
                                              [h, w, 0, 0, h, w]; no negative prompt -> zeros
    conditioning [negative; prompt] (batch 2: classifier-free guidance as one call) ───────────┤
    latents = randn_tensor([1, C, H/f, W/f], torch.Generator("cpu").manual_seed(seed))        │
              * init_noise_sigma                                                              │
    for each timestep:                                                                       ─┤
        [ControlNet: residuals = controlnet(concat([latents * c_in] * 2), t, cond, image, scale)]
        fused:    latents, state = step_graph(latents, t, cond, [residuals], g, coefficients, state)
        unfused:  eps2 = unet(scheduler.scale_model_input(concat([latents] * 2), t), t, cond, ...)
                  latents = scheduler.step(eps_u + g * (eps_c - eps_u), t, latents)
    image = VaeImageProcessor.postprocess(vae_decoder(latents / scaling_factor))

The scheduler is diffusers' own class (``onnxopt.pipeline.schedulers.make_scheduler``), built
from the folder's scheduler_config.json; the fused step graph takes its per-step coefficients
from ``plan_steps``, which reads them from that scheduler. Same folder, prompt, seed, scheduler,
steps, guidance and size as the torch pipeline built from the same weights: the same image
(``tests/test_pipeline_generate.py`` checks it for every kind and scheduler).

Where the step graph comes from (``fused_step=True``, the default): ``unet/step.onnx`` when the
folder has it (with ``unet/step.context_kv.onnx`` beside it, run once per prompt: every
cross-attention's K/V of the prompt and SDXL's added conditioning, which the step graph then
reads instead of the text); else built in memory from ``unet/model.onnx`` by
``onnxopt.pipeline.step_graph.build_step_graph`` (serialized with its weights referring to the
UNet's data files; an inline UNet under 1.8 GB with them inline); else the unfused loop, which is
also what ``fused_step=False`` runs (the reference for the fused path, and an ablation).

With a ControlNet, ``merged_step.onnx`` at the folder's root (when present) is the ControlNet and
the step graph in one graph: one session run, one captured CUDA graph per step
(:mod:`onnxopt.pipeline.merged_step`). With several (``controlnet/``, ``controlnet_1/``...: diffusers'
MultiControlNetModel), each has its own image, scale and hint graph, and the step graph sums their
residuals (:mod:`onnxopt.pipeline.multi_controlnet`; diffusers' own loop, ``fused_step=False``,
sums them on the host as MultiControlNetModel does). ``Pipeline.load``'s switches turn each pipeline rewrite off
for the ablation.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from onnxopt.errors import MissingDependencyError, OnnxoptError
from onnxopt.pipeline import images
from onnxopt.pipeline.families import TOKENIZER_OF
from onnxopt.pipeline.folder import CLIP_SEQUENCE, PipelineFolder, folder_scheduler_class, latent_channels
from onnxopt.pipeline.session_prefetch import LOAD_WORKERS, Ahead, SessionPrefetch
from onnxopt.pipeline.sizes import _check_size, _written_before_0_9, check_text_to_image_sides, default_size  # noqa: F401 (importers read them here too)
from onnxopt.pipeline.plan import (
    BOUND,
    HOST,
    HISTORY_STEP,
    NO_CFG_STEP,
    PLMS_HISTORY,
    STEP_SESSIONS,
    STEP_LOOP,
    GenerationError,
    GenerationPlan,
    PlanOptions,
    SessionEntry,
    build_step_graph_in_memory,
    classifier_free_guidance,
    hint_key,
    plan_generation,
)
from onnxopt.pipeline.text_outputs import penultimate_name as _penultimate_name
from onnxopt.pipeline.text_outputs import run_outputs as _run_outputs
from onnxopt.pipeline.two_streams import TwoStreamStepLoop
from onnxopt.runners.capture_cache import DEFAULT_SIZE, CaptureCache
from onnxopt.runners.captured_session import CapturedSession
from onnxopt.pipeline.sessions import (
    DeviceStepLoop,
    HostStepLoop,
    as_list,
    controlnet_prepare_model,
    create_session,
    input_types,
    require_provider,
    run_host,
    run_on_device,
    timestep_feed,
)


@dataclass
class Result:
    latents: np.ndarray  # final latents [N, C, H/f, W/f], before the VAE (not divided by the scaling factor)
    pixels: np.ndarray  # [H, W, 3] float32 in [0, 1]: diffusers' output_type="np", the first image
    timings: dict = field(default_factory=dict)
    all_pixels: np.ndarray | None = None  # [N, H, W, 3]: every image of the batch, in diffusers' order

    @functools.cached_property
    def image(self):
        """The PIL image, made on first use (1.6 ms at 512x512 that a caller of ``pixels`` never needs)."""
        return images.to_pil(self.pixels)

    @property
    def images(self) -> list:
        """Every image of the batch (``num_images``) as PIL images, in diffusers' batch order."""
        return [images.to_pil(p) for p in (self.pixels[None] if self.all_pixels is None else self.all_pixels)]


class StartupStatus:
    """What start-up is doing, on one line of stderr (``say(text)`` replaces it; ``done()`` clears
    it), when ``enabled`` (None: when stderr is a terminal); nothing otherwise."""

    line_shown = False  # the one status line of stderr, whichever instance wrote it

    def __init__(self, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def __call__(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r\x1b[Konnxopt: {text}...")
            sys.stderr.flush()
            StartupStatus.line_shown = True

    @staticmethod
    def done() -> None:
        if StartupStatus.line_shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            StartupStatus.line_shown = False


def clears_status(function):
    """``function``, clearing a status line it leaves when it raises (an error then starts its own line)."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except BaseException:
            StartupStatus.done()
            raise
    return run


def _torch(import_now: bool = True):
    """torch, imported (``import_now=False``: only checked to be importable; None)."""
    missing = MissingDependencyError("generating images needs torch and diffusers: pip install 'onnxopt[pipeline]'")
    if not import_now:
        if importlib.util.find_spec("torch") is None:
            raise missing
        return None
    try:
        import torch
    except ImportError as exc:
        raise missing from exc
    return torch


def _import_scheduler(folder: PipelineFolder) -> None:
    """The folder's own scheduler class imported now, at load, rather than by the first image's
    schedule check: diffusers imports each scheduler on first use, and the module of
    FlowMatchEulerDiscreteScheduler (SD3's, Flux's) imports scipy.stats, seconds on a small CPU
    (benchmarks/cold_start.py). A class it cannot import is the first image's error, as before."""
    with contextlib.suppress(Exception):
        import diffusers

        getattr(diffusers, str(folder_scheduler_class(folder) or folder.scheduler_config().get("_class_name")), None)


class Pipeline:
    """An ONNX pipeline folder loaded into ORT sessions; call it to generate an image."""

    def __init__(self, folder: PipelineFolder, provider: str, sessions: dict, *, step_source: str, cuda_graph: bool,
                 io_binding: bool, device_id: int = 0, threads: int | None = None, creation_s: float = 0.0,
                 tokenizers: dict | None = None):
        self.folder, self.provider, self.sessions = folder, provider, sessions
        self.step_source, self.cuda_graph, self.io_binding = step_source, cuda_graph, io_binding
        self.device_id, self.threads = device_id, threads
        self.creation_s = creation_s  # Pipeline.load: opening the folder and creating every session
        self.plan: GenerationPlan | None = None  # what from_plan made the sessions from
        self.controlnet_model: Path | None = None  # the ControlNet graph the step runs (set by load)
        self.merged_step = False  # the step session is merged_step.onnx (ControlNet inside)
        self.launch_timing = False  # time each step's launch apart from its wait (DeviceStepLoop)
        self.calls = 0
        self.status = StartupStatus(False)  # what loading a session on first use says (load sets it)
        self._plans: dict = {}  # (scheduler, steps) -> StepPlan
        self._schedulers: dict = {}  # name -> diffusers' scheduler (Pipeline._scheduler)
        # DeviceStepLoop.key -> a loop whose buffers (and captured graphs) stay put, per shape, LRU-bounded
        self._device_loops = CaptureCache(DEFAULT_SIZE)
        self._new_shape = False  # the last step loop was made for this image (its first steps capture)
        self.tokenizers = tokenizers if tokenizers is not None else _load_tokenizers(folder)
        self._warned_truncation: set = set()  # prompts already warned about
        self.static_text = False  # use text_encoder*/model.static.b{b}.onnx (set by load)
        self._release_ahead = lambda component: 0  # the load's: drops what it made ahead for component, untaken
        self.text_sources: dict[str, str] = {}  # encoder -> the graph its last prompt ran on, and why
        self.lora = None  # onnxopt.lora.LoraWeights, when loaded with LoRAs (from_plan)
        self.graph_optimization = "all"  # ORT's graph optimization level for the sessions (set by load)
        self._open_unet = lambda: create_session(  # noqa: E731 (from_plan gives its session maker's)
            folder.component(folder.denoiser).model, provider, name=str(folder.root / folder.denoiser), device_id=device_id,
            threads=threads)
        self._open_once = lambda name, model=None: create_session(  # noqa: E731 (load gives CapturedSessions)
            model or folder.component(name).model, provider, name=str(folder.root / name), device_id=device_id,
            threads=threads)

    @property
    def fused_step(self) -> bool:
        return any(key in self.sessions for key in STEP_SESSIONS)

    @classmethod
    @clears_status
    def load(cls, folder, provider: str = "cpu", *, fused_step: bool = True, cuda_graph: bool = True, device_id: int = 0,
             threads: int | None = None, io_binding: bool | None = None, context_kv: bool = True,
             controlnet_hint: bool = True, merged_step: bool = True, launch_timing: bool = False,
             step_file: str | None = None, two_streams: bool | None = None, static_text: bool = True,
             status: bool | None = None, capture_cache: int = DEFAULT_SIZE, loras: list | None = None,
             guidance: float | None = None, load_workers: int = LOAD_WORKERS,
             graph_optimization: str = "all", scheduler: str | None = None,
             negative_prompt: bool | None = None) -> "Pipeline":
        """Open ``folder`` and create its sessions on ``provider`` (cpu | cuda | tensorrt).

        ``cuda_graph`` (cuda/tensorrt): capture the step graph as CUDA graphs. ``fused_step=False``
        runs the UNet and diffusers' ``scheduler.step`` separately (the reference loop).
        ``io_binding``: the fused step, and the graphs run once per prompt or image (text encoders,
        K/V, hint, VAE decoder: :class:`CapturedSession`), on buffers bound once and captured with
        ``cuda_graph`` (default: on for cuda/tensorrt; on the CPU EP it runs the same bindings on
        CPU buffers). ``step_file``: another step graph in ``unet/`` than ``step.onnx`` (with its
        ``<stem>.context_kv.onnx`` when present), e.g. the ``step.cfg_late.onnx`` that
        ``write_step_graph(unet_dir, file_name=..., cfg_late=True)`` writes: for ablations.

        The pipeline rewrites an optimized folder holds (``context_kv``, ``controlnet_hint``,
        ``merged_step``, ``two_streams``), each used when present and switched on:
        :class:`~onnxopt.pipeline.plan.PlanOptions` says what each selects.

        * ``static_text``: ``text_encoder*/model.static.b{b}.onnx`` for a prompt batch b (input_ids
          [b, 77], every node on the CUDA EP, so captured: :mod:`onnxopt.pipeline.static_text`);
          off, or for a batch without one: ``model.onnx`` (``timings["text_encoders"]`` says which
          ran, and why). Text encoder sessions are created on first use, one per graph used (an
          SDXL folder holds graphs for batch 1 and 2; a run uses one: weights are not loaded twice).

        ``launch_timing`` (bound-buffer loop): each step's run returns once the step is queued and
        the loop then waits for the device; ``timings["step_launch_mean_s"]`` is the host's part of
        a step (the step's CPU-side overhead is at most that plus the wait's return), beside
        ``step_mean_s``, the whole step.

        ``capture_cache``: how many input shapes (image sizes, prompt batches) keep their bound
        buffers and captured CUDA graphs, per session; the least recently used is dropped past it
        (:mod:`onnxopt.runners.capture_cache`). ``timings["capture"]`` says what an image cost.

        ``status``: say what start-up is doing (importing, loading each component, building the step
        graph) on one line of stderr, cleared when done; None: only when stderr is a terminal.

        ``loras``: LoRA files, ``"FILE[:SCALE]"`` or (path, scale), applied to the UNet and the text
        encoders as bound inputs (:mod:`onnxopt.lora`); :meth:`set_lora_scales` changes them later.

        ``guidance``: the guidance the calls will ask, when known: the step graph it needs (with
        classifier-free guidance above 1, without it at 1 or below) is made now, the other on first
        use (None: the guided one now). ``scheduler``: the one the calls will ask, when known (None:
        the folder's own): with PNDM (an SD 1.5 folder's), the step graph with its history is made
        now and the plain one on first use, by a call with another scheduler; with another, the
        plain one now (a scheduler the fused step cannot run: diffusers' loop, as ``fused_step=False``).

        ``negative_prompt``: whether the calls will give a negative prompt, when known (an SDXL
        folder encodes the prompt alone without one: its text graphs for one row are made ahead).

        ``load_workers``: how many sessions are created at once: the load's and those the first
        image asks for (its text encoders, for the prompt batch ``guidance`` and ``negative_prompt``
        imply; one made for another batch than the first image's is released then), while the
        tokenizers load (:mod:`onnxopt.pipeline.session_prefetch`); 0 or 1: one after another.
        ``graph_optimization``: ORT's graph optimization level for every session ("disable",
        "basic", "extended", "all": ORT's default; benchmarks/cold_start.py measures what each
        costs at creation and per run).
        """
        start = time.perf_counter()
        say = StartupStatus(status)
        folder = folder if isinstance(folder, PipelineFolder) else PipelineFolder.open(folder)
        require_provider(provider)
        _torch(import_now=False)  # imported beside the sessions made ahead (from_plan); missing: this error, now
        options = PlanOptions(fused_step=fused_step, cuda_graph=cuda_graph, io_binding=io_binding, context_kv=context_kv,
                              controlnet_hint=controlnet_hint, merged_step=merged_step, step_file=step_file,
                              two_streams=two_streams, static_text=static_text, guidance=guidance,
                              scheduler=scheduler, negative_prompt=negative_prompt)
        plan = plan_generation(folder, provider, options)
        from onnxopt.lora import pipeline_loras

        return cls.from_plan(folder, plan, device_id=device_id, threads=threads, launch_timing=launch_timing, start=start,
                             say=say, capture_cache=capture_cache,
                             loras=pipeline_loras(folder, plan, loras or [], provider, device_id),
                             load_workers=load_workers, graph_optimization=graph_optimization)

    @classmethod
    def from_plan(cls, folder: PipelineFolder, plan: GenerationPlan, *, device_id: int = 0, threads: int | None = None,
                  launch_timing: bool = False, start: float | None = None, say: StartupStatus | None = None,
                  capture_cache: int = DEFAULT_SIZE, loras=None, load_workers: int = LOAD_WORKERS,
                  graph_optimization: str = "all") -> "Pipeline":
        """Create the sessions ``plan`` lists, in its order, each as its ``binds`` says (text
        encoders on first use); the step session's capture outcome decides the rest's. ``say``:
        the start-up status line (:class:`StartupStatus`). ``loras``: :class:`onnxopt.lora.LoraWeights`.
        ``load_workers``, ``graph_optimization``: as :meth:`load`."""
        start = time.perf_counter() if start is None else start
        say = say or StartupStatus(False)
        sessions = _SessionMaker(folder, plan, device_id, threads, say, capture_cache, loras,
                                 workers=load_workers, optimization=graph_optimization)
        try:
            sessions.prefetch.start(sessions.ahead())
            # the load's Python work, beside the sessions made ahead (ORT makes them without the GIL)
            say("importing torch and diffusers")
            _torch()
            _import_scheduler(folder)
            tokenizers = _deferred(_load_tokenizers, folder)  # its error raised in turn, after the sessions' ones
            for entry in plan.sessions:
                if not entry.lazy:
                    sessions.make(entry)
            made = sessions.sessions
            if "vae_decoder" in made:
                check_interface(made["vae_decoder"], folder.component("vae_decoder").model, "VAE decoder",
                                ["latent_sample"], ["sample"])
            if folder.family.runner and cls is Pipeline:  # the family's own runner (Flux: its prompt, packed latents)
                module, name = folder.family.runner.split(":")
                cls = getattr(importlib.import_module(module), name)
            fused = any(key in made for key in STEP_SESSIONS)
            pipe = cls(folder, plan.provider, made, step_source=plan.step, cuda_graph=sessions.capture and fused,
                       io_binding=plan.io_binding, device_id=device_id,
                       threads=threads, creation_s=time.perf_counter() - start, tokenizers=tokenizers())
        except BaseException:
            sessions.prefetch.cancel()
            raise
        pipe.plan, pipe.graph_optimization = plan, graph_optimization
        pipe.controlnet_model = plan.controlnet_models[0] if plan.controlnet_models else None
        pipe.merged_step = plan.merged_step and "step" in made
        pipe.controlnet_models = plan.controlnet_models
        pipe.launch_timing = launch_timing
        pipe.static_text, pipe._open_once = plan.static_text, sessions.text_encoder
        pipe._release_ahead = sessions.prefetch.release
        pipe.status, pipe.lora, pipe._open_unet = say, loras, lambda: sessions.open(pipe.folder.denoiser)
        pipe._make_session = sessions.make  # a step graph the plan made lazy, on first use
        pipe._device_loops = CaptureCache(capture_cache)
        say.done()
        return pipe

    def set_lora_scales(self, scales: list[float]) -> None:
        """Each loaded LoRA's scale (0: off), in the order they were given: written into the weight
        buffers the sessions read, so no session is re-created and no CUDA graph re-captured."""
        if self.lora is None:
            raise GenerationError("this pipeline was loaded without LoRAs (Pipeline.load(..., loras=[...]))")
        self.lora.set_scales(scales)

    def _controlnet_session(self, k: int = 0):
        """ControlNet k's own session: at load, unless the merged step graph holds the ControlNets;
        then made on first use (the unfused loop, for a scheduler the step graph cannot run)."""
        name = self.folder.controlnets[k]
        if name not in self.sessions:
            self.sessions[name] = create_session(self.controlnet_models[k], self.provider, name=str(self.folder.root / name),
                                                 device_id=self.device_id, threads=self.threads,
                                                 optimization=self.graph_optimization)
        return self.sessions[name]

    def _controlnet_sessions(self) -> list:
        return [self._controlnet_session(k) for k in range(len(self.folder.controlnets))]

    def session_runs_per_step(self) -> int:
        """How many sessions one computed denoising step runs (1 with the merged step graph; the
        fused step, the ControlNet and its input graph otherwise; the unfused loop: UNet [+ ControlNet])."""
        n = len(self.controlnet_models)
        if not self.fused_step:
            return 1 + n
        if self.merged_step or not n:
            return 1
        if "down" in self.sessions:  # input graph + ControlNets beside down, then rest
            return 3 + n
        return 2 + n if self.io_binding else 1 + n

    # --- the text side, once per prompt ---------------------------------------------------------

    def _token_ids(self, name: str, texts: list[str], max_length: int | None = None) -> np.ndarray:
        """diffusers' ``encode_prompt``: padded to model_max_length and cut there, and, as diffusers
        warns, a warning on stderr naming the part of the prompt that was cut (once per prompt)."""
        tokenizer = self.tokenizers[name]
        max_length = max_length or tokenizer.model_max_length
        ids = tokenizer(texts, padding="max_length", max_length=max_length, truncation=True,
                        return_tensors="np").input_ids
        prompt = texts[-1]  # as diffusers: the prompt is checked, the negative prompt is cut silently
        if prompt not in self._warned_truncation:
            # transformers' own "longer than the specified maximum" line is not the user's: ours says it
            getattr(tokenizer, "deprecation_warnings", {})["sequence-length-is-longer-than-the-specified-maximum"] = True
            whole = tokenizer(prompt, padding="longest").input_ids
            if len(whole) > max_length:
                self._warned_truncation.add(prompt)
                removed = tokenizer.decode(whole[max_length - 1: -1])
                print(f"onnxopt: warning: the following part of your input was truncated because CLIP can only handle "
                      f"sequences up to {max_length} tokens: {removed!r}", file=sys.stderr)
        return ids

    def text_session(self, encoder: str, batch: int):
        """The session that encodes ``batch`` prompts with ``encoder``: its static graph for that
        batch when the folder has one (captured on cuda/tensorrt), else model.onnx; made on
        first use and kept (one the load made ahead for another batch is then released:
        :mod:`~onnxopt.pipeline.session_prefetch`). Records which in ``text_sources``."""
        component = self.folder.component(encoder)
        static = component.static_models if self.static_text else {}
        key = f"{encoder}/b{batch}" if batch in static else encoder
        if key not in self.sessions:
            session = self._open_once(encoder, static.get(batch))
            check_interface(session, static.get(batch) or component.model, "text encoder", ["input_ids"],
                            ["last_hidden_state"] if self.folder.kind in ("sd", "lcm", "controlnet") else [])
            if encoder != "text_encoder_3":  # T5 takes the request's length (max_sequence_length)
                tokenizer = self.tokenizers[TOKENIZER_OF[encoder]]
                check_prompt_length(self.folder, encoder, tokenizer.model_max_length, session)
            self.sessions[key] = session
            self._release_ahead(encoder)  # a graph made ahead for another prompt batch: not held beside this one
        if batch in static:
            self.text_sources[encoder] = static[batch].name
        elif not self.static_text:
            self.text_sources[encoder] = "model.onnx: static graphs off (static_text=False)"
        else:
            present = ", ".join(p.name for p in component.static_models.values())
            self.text_sources[encoder] = (f"model.onnx: no static graph for batch {batch}"
                                          + (f" (it has {present})" if present else ""))
        return self.sessions[key]

    def encode_prompt(self, prompt: str, negative_prompt: str | None, max_sequence_length: int = 256,
                      classifier_free_guidance: bool = True) -> dict[str, np.ndarray]:
        """The step's conditioning inputs, negative first (batch 2): encoder_hidden_states
        [+ text_embeds, time_ids are added by the caller for SDXL; SD3: pooled_projections, T5's
        tokens ``max_sequence_length``: :mod:`onnxopt.pipeline.sd3_text`]. Without
        ``classifier_free_guidance``: the prompt's row alone (batch 1), as diffusers' encode_prompt."""
        if self.folder.kind == "sd3":
            from onnxopt.pipeline.sd3_text import encode_sd3_prompt

            return encode_sd3_prompt(self, prompt, negative_prompt, max_sequence_length, classifier_free_guidance)
        if self.folder.kind != "sdxl":
            ids = self._token_ids("tokenizer", [negative_prompt or "", prompt][not classifier_free_guidance:])
            (hidden,) = _run_outputs(self.text_session("text_encoder", len(ids)), ids, ["last_hidden_state"])
            return {"encoder_hidden_states": hidden.astype(np.float32)}
        zeros = classifier_free_guidance and negative_prompt is None and self.folder.force_zeros_for_empty_prompt
        texts = [prompt] if zeros or not classifier_free_guidance else [negative_prompt or "", prompt]
        parts, pooled = [], None
        for encoder, tokenizer in zip(self.folder.text_encoders, _tokenizers_of(self.folder)):  # refiner: the 2nd alone
            session = self.text_session(encoder, len(texts))
            pooled_name = ["text_embeds"] if encoder == "text_encoder_2" else []
            out = _run_outputs(session, self._token_ids(tokenizer, texts), [_penultimate_name(session), *pooled_name])
            parts.append(out[0])
            if pooled_name:
                pooled = out[1]
        hidden = np.concatenate(parts, axis=-1).astype(np.float32)
        pooled = pooled.astype(np.float32)
        if zeros:  # diffusers: force_zeros_for_empty_prompt -> the negative conditioning is zeros
            hidden = np.concatenate([np.zeros_like(hidden), hidden])
            pooled = np.concatenate([np.zeros_like(pooled), pooled])
        return {"encoder_hidden_states": hidden, "text_embeds": pooled}

    # --- one image -----------------------------------------------------------------------------

    def uses_guidance(self) -> bool:
        """Whether ``guidance`` can change the image (a Flux schnell folder's transformer takes none)."""
        return True

    @clears_status
    def __call__(self, prompt: str, negative_prompt: str | None = None, steps: int | None = None,
                 guidance: float | None = None,
                 scheduler: str | None = None, seed: int = 0, height: int | None = None, width: int | None = None,
                 controlnet_image=None, controlnet_scale=1.0, progress: bool = True, reuse=None, image=None,
                 mask=None, strength: float | None = None, num_images: int = 1, max_sequence_length: int = 256,
                 denoising_end: float | None = None) -> Result:
        """One image (``num_images``: diffusers' num_images_per_prompt, one batch from one generator).
        ``scheduler``: one of :data:`~onnxopt.pipeline.schedulers.SCHEDULERS`, made from
        the folder's config; None: the folder's own scheduler, as diffusers' pipeline uses it.
        ``steps``, ``guidance``: None: the family's pipeline's defaults (50 and 7.5; LCM's 4 and 8.5).
        ``guidance`` <= 1 turns classifier-free guidance off, as diffusers does (the negative prompt
        is then unused); a UNet that embeds the guidance (LCM's ``time_cond_proj_dim``) never runs it
        and takes the guidance as its embedding (:mod:`onnxopt.pipeline.guidance_embedding`).
        ``controlnet_image``: the conditioning image (a path, PIL image or array), or a
        list of one per ControlNet (folders with ``controlnet_1/``...); ``controlnet_scale``: one
        scale for every ControlNet, or a list of one per ControlNet (diffusers' semantics).
        ``image`` (a path or PIL image) with ``strength``: img2img; with ``mask`` too, on a folder
        whose UNet is an inpainting one: inpainting (:mod:`onnxopt.pipeline.img2img`).
        ``max_sequence_length``: SD3's T5 prompt length in tokens (diffusers' default 256).
        ``denoising_end``: SDXL's, the fraction of the schedule after which the loop stops."""
        from onnxopt.pipeline.img2img import LatentSource, check_steps_run, prepare

        torch = _torch()
        folder = self.folder
        steps = folder.family.default_steps if steps is None else steps
        guidance = folder.family.default_guidance if guidance is None else guidance
        scheduler = check_request(folder, steps=steps, scheduler=scheduler, height=height, width=width,
                                  controlnet_image=controlnet_image, controlnet_scale=controlnet_scale, image=image,
                                  mask=mask, strength=strength, num_images=num_images, denoising_end=denoising_end)
        check_numbers(guidance=guidance, seed=seed, controlnet_scale=controlnet_scale)
        check_prompts(prompt, negative_prompt)
        check_sequence_length(folder, max_sequence_length)
        reused = reuse_steps(reuse, steps)
        factor = folder.vae_scale_factor
        init = prepare(folder, image, mask, strength, height, width) if image is not None else None
        if init is not None:  # its size checked by prepare, as the img2img and inpainting pipelines size it
            check_steps_run(steps, init.strength)
            height, width = init.height, init.width
        controls = []
        for control in as_list(controlnet_image):
            controls.append(images.preprocess_control_image(control, height, width, factor))
            # as diffusers: the (first) preprocessed image sets the size; later ones are resized to it
            height, width = controls[0].shape[-2:]
        if init is None:
            default_h, default_w = default_size(folder)
            height, width = height or default_h, width or default_w
            _check_size(height, width, factor)
            check_text_to_image_sides(folder, height, width)

        timings: dict = {"provider": self.provider, "step": self.step_source, "cuda_graph": self.cuda_graph,
                         "session_runs_per_step": self.session_runs_per_step()}
        start = time.perf_counter()
        cond = self._conditioning(prompt, negative_prompt, height, width, timings, num_images, max_sequence_length,
                                  classifier_free_guidance(guidance, folder.family.denoiser), guidance)
        sched = self._scheduler(scheduler)
        self._latent_size = (height // factor, width // factor)  # flow matching's dynamic shifting reads it
        generator = torch.Generator("cpu").manual_seed(seed)
        source = LatentSource(folder, self._encode_image)
        if init is None:
            first = extra = None
            initial = source.text_to_image(sched, steps, generator, num_images, self._latent_channels(), height, width,
                                           self._timestep_kwargs(sched, steps))
        else:
            t0 = time.perf_counter()
            initial, first, extra = source.from_image(init, sched, steps, generator, num_images)
            timings["vae_encode_s"] = time.perf_counter() - t0
        controlnet = self._controlnet_inputs(cond, controls, controlnet_scale, timings, num_images) if controls else None
        latents = self._denoise(scheduler, sched, steps, initial, cond, controlnet, guidance, reused, progress, timings,
                                first, extra, generator, denoising_end)
        every = self._decode(latents, guidance, timings)
        timings["total_s"] = time.perf_counter() - start
        # what no stage holds: the scheduler's set-up, the initial noise, the writes into bound buffers
        timings["rest_s"] = timings["total_s"] - sum(timings.get(k, 0.0) for k in (
            "text_encoder_s", "controlnet_hint_s", "vae_encode_s", "steps_s", "vae_decode_s"))
        timings["session_creation_s"] = self.creation_s
        if self.calls == 0:  # loading + session creation + the first image (with its graph capture)
            timings["cold_start_s"] = self.creation_s + timings["total_s"]
        self.calls += 1
        return Result(latents=latents, pixels=every[0], timings=timings, all_pixels=every)

    def _conditioning(self, prompt, negative_prompt, height: int, width: int, timings: dict, images: int = 1,
                      max_sequence_length: int = 256, cfg: bool = True, guidance: float = 1.0) -> dict:
        """The step's conditioning: the text encoders' outputs (SDXL: with its time ids), each row
        repeated ``images`` times ([negative] * N + [prompt] * N, diffusers' num_images_per_prompt;
        without classifier-free guidance, ``cfg`` False: [prompt] * N), the guidance embedding where
        the UNet takes one, and the cross-attention K/V when the step graph reads them instead of the text."""
        t0 = time.perf_counter()
        cond = self._prompt_conditioning(prompt, negative_prompt, height, width, max_sequence_length, cfg)
        if images > 1:
            cond = {name: np.repeat(value, images, axis=0) for name, value in cond.items()}
        cond = self._step_conditioning(self._with_guidance_embedding(cond, guidance), cfg)
        timings["text_encoder_s"] = time.perf_counter() - t0
        timings["text_encoders"] = dict(self.text_sources)
        return cond

    def _prompt_conditioning(self, prompt, negative_prompt, height: int, width: int,
                             max_sequence_length: int = 256, cfg: bool = True) -> dict[str, np.ndarray]:
        """One prompt's conditioning on the host, two rows [negative, prompt] (``cfg`` False: the
        prompt's row alone): the text encoders' outputs (SDXL: with its time ids). A batch
        concatenates these (onnxopt.pipeline.batch)."""
        cond = self.encode_prompt(prompt, negative_prompt, max_sequence_length, cfg)
        if self.folder.kind == "sdxl":
            cond["time_ids"] = sdxl_time_ids(self.folder, height, width)[0 if cfg else 1:]
        return cond

    def _step_conditioning(self, cond: dict, cfg: bool = True) -> dict:
        """``cond`` as the step graph reads it: without classifier-free guidance (``cfg`` False),
        the prompt's rows twice where the denoiser takes two rows per image
        (:meth:`_rows_without_guidance`); with the cross-attention K/V when the step graph reads them
        instead of the text (one run for all of cond's rows)."""
        if not cfg and self._rows_without_guidance() == 2:
            cond = {name: np.concatenate([value, value]) for name, value in cond.items()}
        if "context" in self.sessions:  # the step graph reads the cross-attention K/V, not the text
            # on bound buffers the K/V stay on the device, where the step loop binds them (SDXL's
            # 140 K/V tensors, 50 MB, cost ~20 ms a prompt through the host)
            cond.update(run_on_device(self.sessions["context"], cond))
        return cond

    def _with_guidance_embedding(self, cond: dict, guidance) -> dict:
        """``cond`` with the guidance embedding of ``guidance`` (one value, or one per image: a batch), one
        row per image, where the UNet takes one (LCM's
        ``timestep_cond``: :mod:`onnxopt.pipeline.guidance_embedding`), after checking that the graph
        that runs takes it as the UNet's config says (and takes none where the config sets none)."""
        from onnxopt.pipeline.guidance_embedding import check_embedding_input, guidance_embedding

        if self.folder.denoiser != "unet":
            return cond
        name, width = self.folder.family.denoiser.guidance_embedding, self.folder.config("unet").get("time_cond_proj_dim")
        check_embedding_input(*self._denoiser_graph(), name, width)
        if name is None:
            return cond
        rows = len(cond["encoder_hidden_states"])  # one per image: the UNet runs no guidance rows
        return dict(cond, **{name: guidance_embedding(guidance if isinstance(guidance, list) else [guidance] * rows, width)})

    def _denoiser_graph(self):
        """(session, its file) of the denoiser graph that runs: the step graph when one is made, else
        the denoiser's own (made now)."""
        made = [key for key in STEP_SESSIONS if key in self.sessions]
        model = self.folder.component(self.folder.denoiser).model
        if not made:
            return self._unet_session(), model
        entry = self.plan.entry(made[0]) if self.plan is not None else None
        return self.sessions[made[0]], entry.model if entry is not None and entry.model is not None else model

    def _rows_without_guidance(self) -> int:
        """The denoiser's rows per image without classifier-free guidance (the plan's
        ``no_cfg_rows``). The step graph without guidance is made here when first needed; where
        :func:`~onnxopt.pipeline.step_graph.without_guidance` refuses the step graph (a static batch),
        the guided one runs on the prompt's row twice instead, and the plan says so."""
        plan = self.plan
        # the one the folder's scheduler runs (PNDM: with its history) tells as well as the other
        key = next(k for k in (NO_CFG_STEP + HISTORY_STEP, NO_CFG_STEP) if plan.entry(k) is not None or k == NO_CFG_STEP)
        made = any(k in self.sessions for k in (NO_CFG_STEP, NO_CFG_STEP + HISTORY_STEP))
        if plan.no_cfg_rows == 1 and plan.entry(NO_CFG_STEP) is not None and not made:
            from onnxopt.errors import UnsupportedModelError

            try:
                self.step_session(key)
            except UnsupportedModelError as exc:
                print(f"onnxopt: {exc}: the prompt's row runs twice instead", file=sys.stderr)
                plan.no_cfg_rows, plan.no_cfg = 2, f"the prompt's row twice ({exc})"
        return plan.no_cfg_rows

    def step_session(self, key: str = "step"):
        """The step session ``key`` ("step", or :data:`~onnxopt.pipeline.plan.NO_CFG_STEP`; either with
        :data:`HISTORY_STEP` after it: its update with PLMS's history), made on first use: read a step
        session through it, not ``sessions``, which holds only those made (the plan's scheduler's at load)."""
        if key not in self.sessions:
            base = key.removesuffix(HISTORY_STEP)
            self.status("preparing the step graph" + (" without guidance" if base == NO_CFG_STEP else "")
                        + (" with PNDM's history" if base != key else ""))
            self._make_session(self.plan.entry(key) or replace(self.plan.entry(base), key=key))
            self.status.done()
        return self.sessions[key]

    def _latent_channels(self) -> int:
        """The latents' channels: the denoiser config's in_channels (diffusers reads it there; Flux's is
        the packed width, four times the latents'), which the graph that runs must take where it
        declares them (:func:`~onnxopt.pipeline.folder.latent_channels`)."""
        name = self.folder.denoiser
        made = [self.sessions[key] for key in STEP_SESSIONS if key in self.sessions]
        session, latent = (made[0], "latents") if made else (self._unet_session(), self.folder.family.denoiser.sample)
        shape = next((i.shape for i in session.get_inputs() if i.name == latent), None) or ()
        return latent_channels(self.folder.root, name, self.folder.config(name), shape)

    def _controlnet_inputs(self, cond: dict, controls: list, controlnet_scale, timings: dict, images: int = 1) -> list[dict]:
        """Per ControlNet: its per-image inputs by its own input names (the hint, where its step
        graph reads the hint rather than the image)."""
        from onnxopt.pipeline.multi_controlnet import interface_name

        scales = as_list(controlnet_scale) * (len(controls) if len(as_list(controlnet_scale)) == 1 else 1)
        controlnet = []
        t0 = time.perf_counter()
        for k, (control, scale) in enumerate(zip(controls, scales)):
            feeds = {"encoder_hidden_states": cond["encoder_hidden_states"],
                     "controlnet_cond": np.concatenate([np.repeat(control, images, axis=0)] * 2),
                     "conditioning_scale": np.asarray([scale], np.float32)}
            if hint_key(k) in self.sessions:  # the step graph reads the hint, not the image
                feeds.update(run_host(self.sessions[hint_key(k)], feeds))
            if self.merged_step:
                reads = input_types(self.step_session())
                feeds = {n: v for n, v in feeds.items() if interface_name(n, k) in reads}
            else:
                reads = input_types(self._controlnet_session(k))
                feeds = {n: v for n, v in feeds.items() if n in reads}
            controlnet.append(feeds)
        if any(hint_key(k) in self.sessions for k in range(len(controls))):
            timings["controlnet_hint_s"] = time.perf_counter() - t0
        return controlnet

    def _denoise(self, name: str, sched, steps: int, initial, cond, controlnet, guidance: float, reused, progress: bool,
                 timings: dict, start: int | None = None, extra=None, generator=None, end: float | None = None) -> np.ndarray:
        """The denoising loop from the ``initial`` latents: the fused step when the pipeline has one and
        the scheduler is affine, else diffusers' loop. ``start``: the index of the first timestep
        (img2img; None: text to image); ``extra``: the inpainting UNet's mask and masked-image channels.
        ``generator``: the image's, which a scheduler that adds noise at each step (Euler ancestral,
        LCM) draws from after the initial latents, as diffusers' does. ``end``: SDXL's denoising_end
        (:func:`~onnxopt.pipeline.img2img.steps_before_end`: the loop stops early)."""
        from onnxopt.pipeline.img2img import steps_before_end
        from onnxopt.pipeline.schedulers import SchedulerError, _set_timesteps

        # diffusers' do_classifier_free_guidance is guidance > 1: at 1 or below, the prompt's row alone (cond
        # holds it alone, or twice where the denoiser takes two rows per image: there eps_u == eps_c exactly)
        cfg = classifier_free_guidance(guidance, self.folder.family.denoiser)
        rows = 2 if cfg else self._rows_without_guidance()
        timings["classifier_free_guidance"] = cfg
        if not cfg:
            timings["without_guidance"] = self.plan.no_cfg
        if extra is not None and rows == 1:  # the inpainting channels: one row per image, not both guidance rows
            extra = extra[len(extra) // 2:]
        plan = None
        if self.fused_step:
            try:
                plan = self._plan(name, sched, steps, start or 0)
                self._check_history(plan, controlnet, reused)
            except SchedulerError as exc:  # e.g. DDIM with clip_sample: not affine, diffusers' own step then
                timings["step"] = f"unfused: {exc}"
        train_steps = sched.config.num_train_timesteps
        if plan is not None:
            plan = plan.first(steps_before_end(plan.timesteps, end, train_steps))
        else:
            self._unet_session()
            # PNDM runs steps + 1 (its second timestep twice): the bar counts them
            _set_timesteps(sched, steps, self._timestep_kwargs(sched, steps))
        run = len(plan) if plan is not None else steps_before_end(sched.timesteps[start or 0:], end, train_steps)
        self.status.done()
        bar = _progress(run, progress)
        if plan is not None:
            if extra is not None:  # the step graph of an inpainting UNet reads them beside the latents
                from onnxopt.pipeline.step_graph import INPAINT_INPUT

                cond = dict(cond, **{INPAINT_INPUT: extra})
            # a denoiser that embeds the guidance has one step graph, of one row per image
            step = "step" if rows == 2 or not self.folder.family.denoiser.classifier_free_guidance else NO_CFG_STEP
            step += HISTORY_STEP if plan.history else ""
            latents = self._fused_loop(plan, initial, cond, controlnet, guidance if cfg else 1.0, reused, bar, timings,
                                       generator, step)
        else:
            step_times: list = []
            latents = self._unfused_loop(sched, steps, initial, cond, controlnet, guidance if cfg else None, step_times,
                                         bar, self.folder.kind, reused, start, extra, generator, rows, run)
            timings["first_step_s"] = step_times[0]
            computed = [t for k, t in enumerate(step_times) if k and k not in reused]
            timings["step_mean_s"] = float(np.mean(computed)) if computed else step_times[0]
            timings["steps_s"] = float(np.sum(step_times))
            timings["steps"] = len(step_times)
        timings["unet_steps"] = timings["steps"] - len(reused)
        bar.close()
        return latents

    def _fused_loop(self, plan, initial, cond, controlnet, step_guidance: float, reused, bar, timings: dict,
                    generator=None, step: str = "step") -> np.ndarray:
        """The step graph's loop from the ``initial`` latents on the step plan's coefficient table
        (from the run's first timestep: img2img's starts mid-way); the first step (with its graph
        capture) timed apart. A step that draws noise gets it in its ``state`` input. ``step``: the
        step session's key (:meth:`step_session`)."""
        latents = initial.numpy()
        static, step_controlnet = cond, controlnet
        if self.merged_step and controlnet is not None:  # the ControlNets' inputs are the step graph's
            from onnxopt.pipeline.multi_controlnet import interface_feeds

            static, step_controlnet = dict(cond), None
            for k, feeds in enumerate(controlnet):
                static.update(interface_feeds(feeds, k))
        loop = self._step_loop(latents, static, step_controlnet, len(plan), step)
        loop.start(plan, latents, static, step_guidance, step_controlnet)
        step_noise = functools.partial(_step_noise, plan, latents.shape, generator)
        step_noise(0, loop)
        t1 = time.perf_counter()
        loop.step()  # the first step alone: it includes the graph capture
        timings["first_step_s"] = time.perf_counter() - t1
        bar.update()
        computed, reused_times = [], []
        for k in range(1, len(plan)):
            step_noise(k, loop)
            t1 = time.perf_counter()
            loop.step(reuse=k in reused)
            (reused_times if k in reused else computed).append(time.perf_counter() - t1)
            bar.update()
        if self.io_binding:  # the bound-buffer loop: per shape, captured with CUDA graphs
            timings["capture"] = self._capture_timings(timings["first_step_s"], computed, 1 in reused)
        timings["step_mean_s"] = float(np.mean(computed)) if computed else timings["first_step_s"]
        timings["steps_s"] = timings["first_step_s"] + float(np.sum(computed)) + float(np.sum(reused_times))
        if reused_times:
            timings["reused_step_mean_s"] = float(np.mean(reused_times))
        launches = getattr(loop, "launches", [])[1:]  # computed steps after the first (capture)
        if launches:
            timings["step_launch_mean_s"] = float(np.mean(launches))
        timings["steps"] = len(plan)
        return loop.latents().astype(np.float32)

    def _capture_timings(self, first: float, computed: list, second_reused: bool) -> dict:
        """What the step loop's cache did for this image: ``new_shape`` (its buffers were made and, with
        CUDA graphs, its two graphs captured on its first two steps), ``capture_s`` (those two steps
        over two later ones: the capture's cost; None without a third computed step) and the cache's
        counts (:meth:`~onnxopt.runners.capture_cache.CaptureCache.stats`)."""
        capture_s = None
        if self._new_shape and not second_reused and len(computed) >= 2:
            capture_s = first + computed[0] - 2 * float(np.median(computed[1:]))
        return {"new_shape": self._new_shape, "cuda_graph": self.cuda_graph, "capture_s": capture_s,
                **self._device_loops.stats()}

    def _decode(self, latents: np.ndarray, guidance: float, timings: dict) -> np.ndarray:
        """The VAE stage, split so a slow one shows which part is slow: the decoder's run (latents in,
        the graph, the image out to the host) and diffusers' postprocessing on the host (torch CPU)."""
        t0 = time.perf_counter()
        decoded = run_host(self.sessions["vae_decoder"], {"latent_sample": self._unscale(latents)})["sample"]
        t1 = time.perf_counter()
        if not np.isfinite(decoded).all():  # a NaN image would be written as a silently black PNG
            raise GenerationError(f"the image is not finite (NaN or inf out of the VAE decoder, guidance {guidance:g}): "
                                  "nothing written")
        pixels = images.postprocess(decoded, self.folder.vae_scale_factor)
        timings["vae_decode_s"] = time.perf_counter() - t0
        timings["vae_run_s"], timings["vae_postprocess_s"] = t1 - t0, timings["vae_decode_s"] - (t1 - t0)
        return pixels

    def _scheduler(self, name: str):
        """diffusers' scheduler ``name`` configured from the folder, made once per pipeline (``from_config``
        costs a few ms a call) and reused as diffusers' pipelines reuse theirs: ``set_timesteps`` resets it."""
        from onnxopt.pipeline.schedulers import make_scheduler, pipeline_scheduler_config

        if name not in self._schedulers:
            config = pipeline_scheduler_config(self.folder.scheduler_config(), self.folder.kind,
                                               folder_scheduler_class(self.folder))
            self._schedulers[name] = make_scheduler(name, config)
        return self._schedulers[name]

    def _plan(self, name: str, scheduler, steps: int, first: int = 0):
        """The step plan of (scheduler, steps, first timestep), probed once per pipeline: it depends on
        nothing else (the folder's scheduler config is fixed), and probing diffusers costs ~0.5 ms a step."""
        from onnxopt.pipeline.schedulers import plan_plms, plan_steps

        kwargs = self._timestep_kwargs(scheduler, steps)
        key = (name, steps, first, json.dumps(kwargs, sort_keys=True, default=list))
        if key not in self._plans:
            if type(scheduler).__name__ == "PNDMScheduler":
                self._plans[key] = plan_plms(scheduler, steps, first_step=first)
            else:
                self._plans[key] = plan_steps(scheduler, steps, timestep_kwargs=kwargs, first_step=first,
                                              timestep_scale=self.folder.family.denoiser.timestep_scale)
        return self._plans[key]

    def _check_history(self, plan, controlnet, reused) -> None:
        """A plan with a history (PLMS) runs on the single step graph's loop only: a SchedulerError
        (diffusers' loop then) with the ControlNets' graphs, whose input graph reads six coefficients,
        or with step reuse, whose update graph carries one state."""
        from onnxopt.pipeline.schedulers import SchedulerError

        if not plan.history:
            return
        if controlnet or self.merged_step or "down" in self.sessions:
            raise SchedulerError("PNDM's history is not carried through the ControlNet step graphs")
        if reused:
            raise SchedulerError("PNDM's history is not carried through a reused step")

    def _timestep_kwargs(self, scheduler, steps: int) -> dict:
        """What diffusers' pipeline passes to ``set_timesteps`` (flow matching: dynamic shifting's
        ``mu`` for this image's latent size, Flux's sigmas); nothing for the UNet families."""
        from onnxopt.pipeline.schedulers import flow_match_timestep_kwargs

        if not self.folder.family.flow_matching:
            return {}
        patch = self.folder.config(self.folder.denoiser).get("patch_size", 2)
        return flow_match_timestep_kwargs(self.folder.kind, dict(scheduler.config), steps, *self._latent_size, patch)

    def _encode_image(self, pixels: np.ndarray) -> np.ndarray:
        """The VAE encoder's latent_parameters for ``pixels`` [1, 3, H, W] in [-1, 1] (its session made on first use)."""
        from onnxopt.pipeline.img2img import ENCODER_OUTPUT

        if "vae_encoder" not in self.sessions:
            self.status("loading vae_encoder")
            session = self._open_once("vae_encoder")
            check_interface(session, self.folder.component("vae_encoder").model, "VAE encoder with latent_parameters "
                            "(the distribution img2img samples, as optimum exports it)", ["sample"], [ENCODER_OUTPUT])
            self.sessions["vae_encoder"] = session
        session = self.sessions["vae_encoder"]
        return run_host(session, {"sample": pixels})[ENCODER_OUTPUT].astype(np.float32)

    def _unscale(self, latents: np.ndarray) -> np.ndarray:
        """The VAE decoder's input. latents_mean/latents_std are read by StableDiffusionXLPipeline
        only: the SD and ControlNet pipelines divide by scaling_factor whatever the VAE config holds."""
        config = self.folder.config("vae_decoder")
        scaling = config.get("scaling_factor", 0.18215)
        mean, std = config.get("latents_mean"), config.get("latents_std")
        if self.folder.family.flow_matching:  # SD3 and Flux: latents / scaling_factor + shift_factor
            shift = config.get("shift_factor")
            return latents / np.float32(scaling) + np.float32(shift or 0.0)
        if self.folder.kind == "sdxl" and mean is not None and std is not None:
            mean = np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
            std = np.asarray(std, np.float32).reshape(1, -1, 1, 1)
            return latents * std / np.float32(scaling) + mean
        return latents / np.float32(scaling)

    def _step_loop(self, latents, cond, controlnet, steps: int, key: str = "step"):
        step = self.step_session(key)
        controlnet_session = None if self.merged_step or not self.controlnet_models else self._controlnet_sessions()
        down = self.sessions.get("down")
        reuse = None if key.endswith(HISTORY_STEP) else self.sessions["reuse"]  # its update carries one state
        if not self.io_binding:
            return HostStepLoop(step, controlnet_session, reuse)
        # diffusers' schedulers take at most num_train_timesteps steps: one table size serves every run
        capacity = max(steps, self.folder.scheduler_config().get("num_train_timesteps", 1000))
        key = (*DeviceStepLoop.key(latents, cond, controlnet, capacity), key)  # and which step graph runs
        loop = self._device_loops.lookup(key)
        self._new_shape = loop is None
        if loop is None:  # graph ids never given before: an evicted shape's ids still replay its capture
            where = dict(cuda_graph=self.cuda_graph, graph_ids=self._device_loops.graph_ids(2), device_id=self.device_id,
                         device="cpu" if self.provider == "cpu" else "cuda")
            if down is not None:
                loop = TwoStreamStepLoop(require_provider(self.provider), down, step, controlnet_session,
                                         self.sessions["controlnet_prepare"], self.sessions["reuse"], **where)
            else:
                loop = DeviceStepLoop(require_provider(self.provider), step, controlnet_session,
                                      self.sessions.get("controlnet_prepare"), reuse,
                                      launch_timing=self.launch_timing, **where)
            loop.bind(latents, cond, capacity, controlnet)
            self._device_loops.insert(key, loop)
        return loop

    def _unet_session(self):
        """The UNet's own session: made at load for the unfused loop; on first use when a fused
        pipeline meets a scheduler the step graph cannot run."""
        name = self.folder.denoiser
        if name not in self.sessions:
            self.status(f"loading {name} (the scheduler's own step, unfused)")
            self.sessions[name] = self._open_unet()
        return self.sessions[name]

    def _unfused_loop(self, sched, steps, initial, cond, controlnet, guidance, step_times, bar, kind, reused=frozenset(),
                      start: int | None = None, extra=None, generator=None, rows: int = 2, run: int | None = None):
        """diffusers' loop from the ``initial`` latents and the timestep at ``start`` (None: text to
        image): UNet session on ``rows`` rows per image, guidance in numpy (``guidance`` None: no
        guidance, the prompt's own output: the last row's), diffusers' scale_model_input and step (at a
        ``reused`` step: diffusers' step on the last computed guided output, no UNet); ``extra``: the
        inpainting channels the UNet reads after the latents. ``generator``: the image's, for a step
        that draws noise. ``run``: how many of the timesteps from ``start`` run (None: all; SDXL's
        denoising_end stops earlier).
        """
        from onnxopt.pipeline.schedulers import _scale_model_input, _set_timesteps, step_extra_kwargs

        torch = _torch()
        step_kwargs = step_extra_kwargs(sched, generator)  # diffusers' prepare_extra_step_kwargs (eta 0)
        _set_timesteps(sched, steps, self._timestep_kwargs(sched, steps))
        if (start is not None or kind == "sdxl") and hasattr(sched, "set_begin_index"):
            sched.set_begin_index(start or 0)
        latents = initial
        unet = self._unet_session()
        denoiser = self.folder.family.denoiser
        eps = None
        for k, t in enumerate(sched.timesteps[start or 0:][:run]):
            t1 = time.perf_counter()
            if k in reused:
                latents = sched.step(torch.from_numpy(eps), t, latents, return_dict=False, **step_kwargs)[0]
                step_times.append(time.perf_counter() - t1)
                bar.update()
                continue
            model_in = _scale_model_input(sched, torch.cat([latents] * rows), t).numpy()
            sample = model_in if extra is None else np.concatenate([model_in, extra], axis=1)
            feeds = dict(cond, **{denoiser.sample: sample, denoiser.timestep: timestep_feed(
                unet, t.item() * denoiser.timestep_scale, model_in.shape[0], denoiser.timestep)})
            residuals = {}  # diffusers' MultiControlNetModel: the residuals summed in ControlNet order
            for k, inputs in enumerate(controlnet or ()):
                cn = self._controlnet_session(k)
                out = run_host(cn, dict(inputs, sample=model_in, timestep=timestep_feed(cn, t.item(), model_in.shape[0])))
                residuals = {n: residuals[n] + v for n, v in out.items()} if residuals else out
            feeds.update(residuals)
            eps2 = run_host(unet, feeds)[denoiser.output].astype(np.float32)
            eps_u, eps_c = eps2[: len(eps2) - len(latents)], eps2[len(eps2) - len(latents):]
            eps = eps_c if guidance is None else eps_u + np.float32(guidance) * (eps_c - eps_u)
            latents = sched.step(torch.from_numpy(eps), t, latents, return_dict=False, **step_kwargs)[0]
            step_times.append(time.perf_counter() - t1)
            bar.update()
        return latents.numpy()


def _step_noise(plan, shape, generator, k: int, loop) -> None:
    """Step k's noise into the loop's ``state`` input when the plan's step k draws it (the order and
    shape of diffusers' ``randn_tensor(model_output.shape, generator=...)`` in the scheduler's step)."""
    if plan.draws_noise(k):
        if generator is None:
            raise OnnxoptError("a scheduler that draws noise at each step needs the image's generator")
        from diffusers.utils.torch_utils import randn_tensor

        torch = _torch()
        loop.write_state(randn_tensor(shape, generator=generator, dtype=torch.float32).numpy())


@clears_status
def check_request(folder: PipelineFolder, *, steps: int = 50, scheduler: str | None = None, height=None, width=None,
                  controlnet_image=None, controlnet_scale=1.0, status: bool | None = False, image=None, mask=None,
                  strength=None, num_images: int = 1, denoising_end=None) -> str:
    """Refuse a bad request before any session exists (one-line :class:`GenerationError`); returns
    the scheduler's name (``scheduler``, or the folder's own when None). ``status``: as
    :meth:`Pipeline.load`'s (the scheduler's check imports torch and diffusers: seconds)."""
    say = StartupStatus(status)
    say("importing torch and diffusers")
    from onnxopt.pipeline.img2img import (check_denoising_end, check_init_request, check_num_images, check_steps_run,
                                          inpainting_size_multiple, strength_of)
    from onnxopt.pipeline.sizes import check_multiple, check_text_to_image_sides
    from onnxopt.pipeline.schedulers import ALL_SCHEDULERS, schedulers_for

    if scheduler is not None and scheduler not in ALL_SCHEDULERS:
        raise GenerationError(f"unknown scheduler '{scheduler}' (choose from {', '.join(ALL_SCHEDULERS)})")
    takes = schedulers_for(folder.family.flow_matching)
    if scheduler is not None and scheduler not in takes:
        raise GenerationError(f"{folder.root} is a {folder.kind} pipeline: its denoiser runs {', '.join(takes)}, "
                              f"not {scheduler}")
    if scheduler is None:
        _check_own_scheduler_runs(folder, takes)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise GenerationError(f"steps must be at least 1, got {steps}")
    control_images, names = as_list(controlnet_image), folder.controlnets
    if folder.kind == "controlnet" and not control_images:
        raise GenerationError(f"{folder.root} is a ControlNet pipeline: give a conditioning image (--controlnet-image)")
    if folder.kind != "controlnet" and control_images:
        raise GenerationError(f"{folder.root} has no controlnet/: a conditioning image cannot be used")
    if control_images and len(control_images) != len(names):
        raise GenerationError(f"{folder.root} has {len(names)} ControlNet{'s' if len(names) > 1 else ''} "
                              f"({', '.join(names)}): give one conditioning image each (--controlnet-image "
                              f"{len(names)} times), got {len(control_images)}")
    scales = as_list(controlnet_scale)
    if control_images and len(scales) not in (1, len(names)):
        raise GenerationError(f"{folder.root} has {len(names)} ControlNets: give one conditioning scale for all or one "
                              f"each (--controlnet-scale), got {len(scales)}")
    if control_images and any(folder.config(name).get("global_pool_conditions") for name in names):
        raise GenerationError("ControlNets with global_pool_conditions (guess mode) are not supported")
    for control in control_images:
        if isinstance(control, (str, Path)) and Path(control).is_dir():
            raise GenerationError(f"{control}: is a folder, not an image")
        if isinstance(control, (str, Path)) and not Path(control).is_file():
            raise GenerationError(f"{control}: no such image")
    if image is not None and mask is not None:  # the inpainting pipelines' own rule, checked with the request
        check_multiple(height, width, inpainting_size_multiple(folder), allow_none=True)
    elif folder.kind != "flux":  # FluxPipeline takes any size and rounds it down (onnxopt.pipeline.flux.latent_size)
        _check_size(height, width, folder.vae_scale_factor, allow_none=True)
    if image is None and (height or width) and folder.kind != "flux":  # a ControlNet image's own size: at the call
        check_text_to_image_sides(folder, height or default_size(folder)[0], width or default_size(folder)[1])
    if folder.family.flow_matching and (image is not None or mask is not None or num_images != 1):
        raise GenerationError(f"{folder.root} is a {folder.kind} pipeline: an init image, a mask and several images "
                              "are run for the UNet families only")
    check_num_images(num_images)
    check_init_request(folder, image, mask, strength, height, width)
    check_denoising_end(folder, denoising_end)
    if image is not None:
        check_steps_run(steps, strength_of(folder, strength))
    scheduler = _checked_schedule(json.dumps(folder.scheduler_config(), sort_keys=True, default=str), folder.kind,
                                  folder_scheduler_class(folder), scheduler, steps, _latent_size(folder, height, width))
    if folder.family.schedulers is not None and scheduler not in folder.family.schedulers:  # the request's or the folder's own
        raise GenerationError(f"{folder.root} is a {folder.kind} pipeline ({folder.index.get('_class_name')}): it runs "
                              f"{', '.join(folder.family.schedulers)} only, not {scheduler}")
    check_model_configs(folder)
    say.done()
    return scheduler


def _check_own_scheduler_runs(folder: PipelineFolder, takes: tuple[str, ...]) -> None:
    """The folder's own scheduler is one its denoiser runs: a DDIM config in an SD3 or Flux folder (or
    flow matching in an SD one) was accepted here, then refused by the load (SD3) or by the schedule's
    dry run with diffusers' TypeError (Flux), or served as it is. A class onnxopt runs none of is the
    dry run's to refuse."""
    from onnxopt.pipeline.schedulers import SchedulerError, folder_scheduler

    cls = folder_scheduler_class(folder)
    try:
        own = folder_scheduler(folder.scheduler_config(), cls)
    except SchedulerError:
        return
    if own not in takes:
        raise GenerationError(f"{folder.root / 'scheduler'}: the folder's scheduler {cls} ({own}) is not one a "
                              f"{folder.kind} pipeline's denoiser runs: give --scheduler ({', '.join(takes)})")


def _latent_size(folder: PipelineFolder, height, width) -> tuple[int, int, int] | None:
    """The latents' (height, width) of a request (the default size where none is asked) and the
    transformer's patch size, for flow matching's resolution-dependent schedule; None for the UNet
    families (their schedule does not depend on it)."""
    if not folder.family.flow_matching:
        return None
    default_h, default_w = default_size(folder)
    factor = folder.vae_scale_factor
    return (height or default_h) // factor, (width or default_w) // factor, folder.config(folder.denoiser).get("patch_size", 2)


@functools.lru_cache(maxsize=32)
def _checked_schedule(config_json: str, kind: str, own: str | None, scheduler: str | None, steps: int,
                      latent_size: tuple[int, int, int] | None = None) -> str:
    """The scheduler's name for a request (``scheduler``, or the folder's own), once the whole
    schedule has been dry-run (:func:`~onnxopt.pipeline.schedulers.check_schedule`). Remembered:
    every image of a pipeline asks the same question, and the dry run of 50 DDIM steps cost about
    10 ms an image on the H100 host, 3 % of SD 1.5's whole generation. A refusal is not remembered."""
    from onnxopt.pipeline.schedulers import SchedulerError, check_schedule, folder_scheduler, make_scheduler
    from onnxopt.pipeline.schedulers import pipeline_scheduler_config

    try:
        config = pipeline_scheduler_config(json.loads(config_json), kind, own)
        scheduler = scheduler or folder_scheduler(json.loads(config_json), own)
        train_steps = config.get("num_train_timesteps", 1000)
        if steps > train_steps:  # diffusers' set_timesteps refuses it, deep in the run
            raise GenerationError(f"steps must be at most {train_steps} (num_train_timesteps of the folder's "
                                  f"scheduler_config.json), got {steps}")
        made = make_scheduler(scheduler, config)
        kwargs = {}
        if latent_size is not None:  # flow matching: the schedule as the pipeline sets it for this size
            from onnxopt.pipeline.schedulers import flow_match_timestep_kwargs

            kwargs = flow_match_timestep_kwargs(kind, dict(made.config), steps, *latent_size)
        check_schedule(made, steps, kwargs)
    except SchedulerError as exc:
        raise GenerationError(str(exc)) from None
    return scheduler


def fusable(scheduler: str) -> bool:
    """Whether the fused step graph can run ``scheduler`` (else a load need not prepare it)."""
    from onnxopt.pipeline.schedulers import FUSABLE_SCHEDULERS

    return scheduler in FUSABLE_SCHEDULERS


def check_model_configs(folder: PipelineFolder) -> None:
    """Component config values diffusers' pipeline reads that onnxopt would misread or crash on:
    a one-line GenerationError. (The audit of every field: docs/pipeline-configs.md.)"""
    unet = folder.config("unet")
    check_guidance_embedding_config(folder)
    if folder.kind == "sd" and "_diffusers_version" in unet:
        _written_before_0_9(unet)  # unparsable: diffusers' StableDiffusionPipeline fails on it
    if folder.kind != "sdxl" and folder.config("text_encoder").get("use_attention_mask"):
        raise GenerationError(f"{folder.root / 'text_encoder' / 'config.json'}: use_attention_mask is set: diffusers "
                              "then feeds the tokenizer's attention mask to the text encoder, which onnxopt does not")
    if folder.kind == "sdxl":
        check_time_ids(folder)
    vae = folder.config("vae_decoder")
    if folder.kind == "sdxl" and vae.get("latents_mean") is not None and vae.get("latents_std") is not None:
        for key in ("latents_mean", "latents_std"):  # StableDiffusionXLPipeline: .view(1, 4, 1, 1)
            value = vae[key]
            if not (isinstance(value, list) and len(value) == 4
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
                raise GenerationError(f"{folder.root / 'vae_decoder' / 'config.json'}: {key} must be 4 finite numbers "
                                      f"(one per latent channel), got {value!r}")
    for tokenizer, encoder in (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")):
        path = folder.root / tokenizer / "tokenizer_config.json"
        if tokenizer in _tokenizers_of(folder) and path.is_file():
            from onnxopt.pipeline.folder import read_json

            check_prompt_length(folder, encoder, read_json(path).get("model_max_length"))


def check_guidance_embedding_config(folder: PipelineFolder) -> None:
    """A guidance-distilled UNet (``time_cond_proj_dim``, LCM's) runs where diffusers' pipeline of the
    folder feeds its embedding (:data:`~onnxopt.pipeline.families.GUIDANCE_EMBEDDING_KINDS`), on a
    text-to-image UNet; LatentConsistencyModelPipeline needs one (diffusers' fails without). The
    value's type is checked with the folder (``CONFIG_FIELDS``); its match with the graph's input
    where the graph runs (:func:`~onnxopt.pipeline.guidance_embedding.check_embedding_input`)."""
    from onnxopt.pipeline.families import GUIDANCE_EMBEDDING_KINDS
    from onnxopt.pipeline.plan import inpainting_unet

    config = folder.root / "unet" / "config.json"
    width = folder.config("unet").get("time_cond_proj_dim")
    if width is None:
        if folder.family.denoiser.guidance_embedding:
            raise GenerationError(f"{config}: {folder.index.get('_class_name')} needs a UNet with time_cond_proj_dim "
                                  "(the guidance embedding's width), and this config sets none")
        return
    if folder.kind not in GUIDANCE_EMBEDDING_KINDS:
        raise GenerationError(f"{config}: a UNet with time_cond_proj_dim (a guidance embedding, as LCM's) runs in SD 1.5 "
                              f"and LatentConsistencyModelPipeline folders, not in a {folder.kind} one")
    if inpainting_unet(folder):
        raise GenerationError(f"{config}: an inpainting UNet with time_cond_proj_dim (a guidance embedding) is not "
                              "supported")


def check_prompt_length(folder: PipelineFolder, encoder: str, length, session=None) -> None:
    """The tokenizer pads every prompt to ``length`` (its model_max_length) tokens: the text encoder must
    take that many positions (its config's max_position_embeddings; its graph's input_ids, when
    ``session`` is given). A GenerationError rather than ONNX Runtime's index error mid-run."""
    from onnxopt.pipeline.folder import TOKENIZER_NO_LIMIT, prompt_length_problem

    if not isinstance(length, int) or length > TOKENIZER_NO_LIMIT:  # absent, or transformers' "no limit": 77 then
        return
    problem = prompt_length_problem(folder.root, encoder, length, folder.config(encoder).get("max_position_embeddings"))
    if problem:
        raise GenerationError(problem)
    if session is not None:
        dims = next((i.shape for i in session.get_inputs() if i.name == "input_ids"), None)
        if dims and len(dims) == 2 and isinstance(dims[1], int) and dims[1] != length:
            raise GenerationError(f"{folder.root}: the tokenizer pads prompts to {length} tokens (model_max_length), "
                                  f"{encoder}'s graph takes input_ids of {dims[1]}")


# torch.Generator.manual_seed's range: what --seed means is torch's seed (see the module docstring)
SEED_RANGE = (-(2**63), 2**64 - 1)


def check_numbers(*, guidance: float, seed: int, controlnet_scale=1.0) -> None:
    """Finite guidance and ControlNet scales and a seed torch's generator takes, or a one-line
    GenerationError (a NaN scale gives a NaN image, not an error, further down)."""
    if not _finite_float32(guidance):  # the step graphs take it as float32: 1e39 became inf there
        raise GenerationError(f"guidance must be a finite number (in float32's range), got {guidance}")
    if not all(_finite_float32(scale) for scale in as_list(controlnet_scale)):
        raise GenerationError(f"ControlNet conditioning scales must be finite numbers, got {controlnet_scale}")
    if not isinstance(seed, int) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise GenerationError(f"seed must be an integer in {SEED_RANGE[0]}..{SEED_RANGE[1]}, got {seed}")


def _finite_float32(value) -> bool:
    return math.isfinite(value) and abs(value) <= float(np.finfo(np.float32).max)


# StableDiffusionXLImg2ImgPipeline.__call__'s defaults: the refiner's aesthetic score conditioning
AESTHETIC_SCORE, NEGATIVE_AESTHETIC_SCORE = 6.0, 2.5


def sdxl_time_ids(folder: PipelineFolder, height: int, width: int) -> np.ndarray:
    """SDXL's micro-conditioning, the negative row first (diffusers' ``_get_add_time_ids``): original
    size, crop (0, 0), then the target size, or with ``requires_aesthetics_score`` (the refiner) the
    aesthetic score (6.0; the negative row 2.5)."""
    if folder.requires_aesthetics_score:
        return np.asarray([[height, width, 0, 0, NEGATIVE_AESTHETIC_SCORE], [height, width, 0, 0, AESTHETIC_SCORE]],
                          np.float32)
    return np.asarray([[height, width, 0, 0, height, width]] * 2, np.float32)


def check_time_ids(folder: PipelineFolder) -> None:
    """The UNet's added-conditioning width must take the time ids the folder's pipeline makes (5 with
    aesthetic scores, else 6): diffusers refuses the mismatch mid-call; here a one-line GenerationError."""
    unet, pooled = folder.config("unet"), folder.config("text_encoder_2").get("projection_dim")
    total, each = unet.get("projection_class_embeddings_input_dim"), unet.get("addition_time_embed_dim")
    if not all(isinstance(v, int) and v > 0 for v in (total, each, pooled)) or (total - pooled) % each:
        return  # not enough config to tell: the graph's own shapes decide
    takes, makes = (total - pooled) // each, 5 if folder.requires_aesthetics_score else 6
    if takes != makes:
        score = "sets" if folder.requires_aesthetics_score else "does not set"
        raise GenerationError(f"{folder.root}: the UNet takes {takes} time ids but model_index.json {score} "
                              f"requires_aesthetics_score, which makes {makes} (a refiner's UNet takes 5: original "
                              "size, crop, aesthetic score)")


def check_interface(session, where, what: str, inputs: list[str], outputs: list[str]) -> None:
    """The inputs and outputs the pipeline feeds and reads, or a one-line GenerationError naming the
    graph (another component's model.onnx in its place was a KeyError or ORT's ValueError: exit 3)."""
    have_in, have_out = [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()]
    missing = [f"input {n}" for n in inputs if n not in have_in] + [f"output {n}" for n in outputs if n not in have_out]
    if missing:
        raise GenerationError(f"{where}: not a {what} graph: no {', '.join(missing)} (it has inputs "
                              f"{', '.join(have_in) or 'none'}; outputs {', '.join(have_out[:4])}{'...' if len(have_out) > 4 else ''})")


def check_prompts(prompt, negative_prompt) -> None:
    """Prompts are text the tokenizer takes: a str of valid Unicode (a command-line argument that is
    not UTF-8 arrives as lone surrogates, which the tokenizer refused with a TypeError)."""
    for name, text in (("prompt", prompt), ("negative prompt", negative_prompt)):
        if text is None and name == "negative prompt":
            continue
        if not isinstance(text, str):
            raise GenerationError(f"the {name} must be text, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise GenerationError(f"the {name} is not valid UTF-8 text: {text.encode('utf-8', 'replace').decode()!r}") from None


def reuse_steps(reuse, steps: int) -> frozenset:
    """The steps a --reuse schedule names, or a one-line GenerationError."""
    from onnxopt.pipeline.step_reuse import ReuseScheduleError, parse_reuse

    try:
        return parse_reuse(reuse, steps)
    except ReuseScheduleError as exc:
        raise GenerationError(str(exc)) from None


def _load_tokenizers(folder: PipelineFolder) -> dict:
    return folder.tokenizers()


def _deferred(function, *args):
    """``function(*args)`` run now; a callable that returns its result, or raises its error, later
    (where the work used to be done: the first error a user sees stays the same)."""
    try:
        result = function(*args)
    except Exception as exc:  # noqa: BLE001 -- raised unchanged by the callable
        error = exc  # Python unbinds ``exc`` when the except block ends: a closure over it raised NameError

        def fail():
            raise error
        return fail
    return lambda: result


def _tokenizers_of(folder: PipelineFolder) -> tuple[str, ...]:
    """The tokenizer of each text encoder the folder's pipeline runs (the SDXL refiner: tokenizer_2
    alone; SD3's third only with its T5 encoder)."""
    return tuple(TOKENIZER_OF[encoder] for encoder in folder.text_encoders)


MAX_SEQUENCE_LENGTH = 512  # diffusers' StableDiffusion3Pipeline and FluxPipeline refuse a longer T5 prompt


def default_sequence_length(folder: PipelineFolder) -> int:
    """diffusers' max_sequence_length default: FluxPipeline's 512, StableDiffusion3Pipeline's 256."""
    return 512 if folder.kind == "flux" else 256


# the families whose prompt encoding has a T5 slot (SD3 without T5 still puts max_sequence_length zero rows in it)
SEQUENCE_LENGTH_KINDS = ("sd3", "flux")


def check_sequence_length(folder: PipelineFolder, max_sequence_length, asked: bool = False) -> None:
    """SD3's and Flux's T5 prompt length: a positive integer up to :data:`MAX_SEQUENCE_LENGTH`, as diffusers
    takes it (FluxPipeline refuses more than 512 too); checked for every folder (a 0 or a negative value
    passed silently where it was not read). ``asked``: the user named the length (``--max-sequence-length``),
    refused for a family without T5 (its CLIP encoders take 77 tokens), as ``--denoising-end`` is outside SDXL."""
    if asked and folder.kind not in SEQUENCE_LENGTH_KINDS:
        raise GenerationError(f"{folder.root}: --max-sequence-length is the T5 prompt length of SD3 and Flux "
                              f"(diffusers' {folder.kind} pipeline has none: its text encoders take {CLIP_SEQUENCE} tokens)")
    if (not isinstance(max_sequence_length, int) or isinstance(max_sequence_length, bool)
            or not 1 <= max_sequence_length <= MAX_SEQUENCE_LENGTH):
        raise GenerationError(f"max sequence length must be an integer in 1..{MAX_SEQUENCE_LENGTH}, "
                              f"got {max_sequence_length!r}")


class _SessionMaker:
    """The sessions of a plan's entries (:meth:`Pipeline.from_plan`), by what each binds."""

    def __init__(self, folder: PipelineFolder, plan: GenerationPlan, device_id: int, threads: int | None,
                 say: StartupStatus, capture_cache: int = DEFAULT_SIZE, loras=None, *, workers: int = LOAD_WORKERS,
                 optimization: str = "all"):
        self.folder, self.plan, self.device_id, self.threads, self.say = folder, plan, device_id, threads, say
        self.optimization = optimization
        self.loras = loras  # onnxopt.lora.LoraWeights: the weights LoRAs change become bound inputs
        self.capture_cache = CaptureCache(capture_cache).size  # checked before any session exists
        self.io_binding, self.requested = plan.io_binding, plan.capture
        self.capture = plan.capture  # the step session's outcome, once it is made
        self.sessions: dict = {}
        # sessions made ahead: ORT's own (a LoRA rewrites the graphs it touches; TensorRT loads engines)
        ahead = loras is None and plan.provider != "tensorrt"
        self.prefetch = SessionPrefetch(self._create, workers if ahead else 0)

    def _create(self, ahead: Ahead):
        """A session made ahead; one ORT refuses to capture is made again without capture, here, for
        the request :meth:`captured` makes next (its refusal raised where the captured one is taken)."""
        try:
            return self._session(ahead.component, ahead.model, cuda_graph=ahead.cuda_graph)
        except OnnxoptError:
            if ahead.cuda_graph:
                plain = Ahead(ahead.component, ahead.model)
                self.prefetch.made_here(plain, lambda: self._session(plain.component, plain.model))
            raise

    def _session(self, component: str, graph, **kw):
        return create_session(graph, self.plan.provider, name=f"{self.folder.root / component}", device_id=self.device_id,
                              threads=self.threads, optimization=self.optimization, **kw)

    def ahead(self) -> list[Ahead]:
        """The sessions the load and the first image ask for by file, asked as :meth:`make` and
        :meth:`text_encoder` ask (capture as the plan requests it), for :class:`SessionPrefetch`.
        The text encoders' graphs are those of the prompt batch of one image: two rows with
        classifier-free guidance (unless the plan knows it off or the denoiser embeds the guidance,
        or knows an SDXL folder's calls give no negative prompt: :meth:`Pipeline.encode_prompt`)."""
        plan, folder = self.plan, self.folder
        bound = lambda component, model: Ahead(component, model, plan.io_binding and plan.capture)  # noqa: E731
        requests = []
        for entry in plan.sessions:
            if entry.lazy or entry.model is None:
                continue
            if entry.binds == BOUND:
                requests.append(bound(entry.component, entry.model))
            elif entry.binds == HOST:
                requests.append(Ahead(entry.component, entry.model))
            elif entry.key.removesuffix(HISTORY_STEP) in ("step", NO_CFG_STEP):  # one built in memory is no file
                if entry.key == "step" and not plan.build_step_graph:
                    requests.append(Ahead(folder.denoiser, entry.model, plan.capture))
            elif entry.binds == STEP_LOOP:
                requests.append(Ahead(entry.component, entry.model, plan.capture))
        prompt_alone = plan.negative_prompt is False and folder.force_zeros_for_empty_prompt
        rows = 1 if plan.classifier_free_guidance is False or plan.embedded_guidance or prompt_alone else 2
        for encoder in folder.text_encoders:
            component = folder.component(encoder)
            static = component.static_models if plan.static_text else {}
            requests.append(bound(encoder, static.get(rows) or component.model))
        return requests

    def open(self, component: str, model=None, map_model=None, **kw):
        self.say(f"loading {component}" + (f" ({Path(model).name})" if isinstance(model, (str, Path)) else ""))
        model = model or self.folder.component(component).model

        def make(graph, **extra):
            return self._session(component, graph, **{**kw, **extra})

        if self.loras is None:
            if isinstance(model, (str, Path)) and set(kw) <= {"cuda_graph"}:  # a file, as Ahead asks for it
                request = Ahead(component, Path(model), bool(kw.get("cuda_graph", False)))
                return self.prefetch.take(request, lambda: make(model))
            return make(model)
        return self.loras.session(component, model, make, map_model=map_model or self.folder.component(component).model)

    def captured(self, component: str, model, say: bool = False, capture: bool | None = None, **kw):
        """(session, whether it captures): CUDA graphs when asked (``capture``, default: as the
        step captures) and ORT can, else a plain session (``say``: tell the user; the step's
        capture is what the speed depends on)."""
        capture = self.capture if capture is None else capture
        try:
            return self.open(component, model, cuda_graph=capture, **kw), capture
        except OnnxoptError as exc:  # ORT refuses capture when a node is not on the GPU EP
            if not capture:
                raise
            if say:
                print(f"onnxopt: step graph without CUDA graph capture: {exc}", file=sys.stderr)
            return self.open(component, model, **kw), False

    def once(self, component: str, model=None, capture: bool | None = None):
        """A graph run once per prompt or image: on bound buffers, captured when ORT can."""
        if not self.io_binding:
            return self.open(component, model)
        session, capturing = self.captured(component, model, capture=capture)
        provider = self.plan.provider
        return CapturedSession(require_provider(provider), session, device="cpu" if provider == "cpu" else "cuda",
                               device_id=self.device_id, cuda_graph=capturing, capture_cache=self.capture_cache)

    def text_encoder(self, name: str, model=None):
        """A text encoder, made on first use, asking for capture as the plan does."""
        return self.once(name, model, self.requested)

    def make(self, entry: SessionEntry) -> None:
        if entry.binds == BOUND:
            session = self.once(entry.component, entry.model)
        elif entry.binds == HOST:
            session = self.open(entry.component, entry.model)
        elif entry.key.removesuffix(HISTORY_STEP) in ("step", NO_CFG_STEP):
            if self.plan.build_step_graph:
                self.say("preparing the step graph")
            model, key = entry.model, entry.key.removesuffix(HISTORY_STEP)
            history = PLMS_HISTORY if key != entry.key else 0
            if self.plan.build_step_graph or key == NO_CFG_STEP or history:  # from unet/model.onnx, or changed
                model = build_step_graph_in_memory(self.folder, entry.model, key != NO_CFG_STEP, history)
            denoiser = self.folder.denoiser
            beside = {"external_data_folder": self.folder.component(denoiser).folder,
                      "map_model": entry.model} if isinstance(model, bytes) else {}
            session, self.capture = self.captured(denoiser, model, say=True, **beside)
        elif entry.binds == STEP_LOOP:
            session, _ = self.captured(entry.component, entry.model)
        elif entry.key == "reuse":
            from onnxopt.pipeline.step_reuse import reuse_step_model

            session = create_session(reuse_step_model(), self.plan.provider, name="reuse step", device_id=self.device_id,
                                     optimization=self.optimization)
        else:  # controlnet_prepare: one input graph serves every ControlNet
            cn = self.sessions["controlnet"]
            timestep = next(i for i in cn.get_inputs() if i.name == "timestep")
            session = create_session(
                controlnet_prepare_model(input_types(cn)["sample"], input_types(cn)["timestep"],
                                         tuple(timestep.shape or ())), self.plan.provider, name="controlnet input",
                device_id=self.device_id, cuda_graph=self.capture and "down" in self.sessions, optimization=self.optimization)
        self.sessions[entry.key] = session


class _SimpleBar:
    def __init__(self, total: int):
        self.total, self.done = total, 0

    def update(self):
        self.done += 1
        sys.stderr.write(f"\rsteps {self.done}/{self.total}")
        sys.stderr.flush()

    def close(self):
        sys.stderr.write("\n")


class _NoBar:
    def update(self):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _SimpleBar(total)
    return tqdm(total=total, desc="denoising", unit="step", file=sys.stderr, leave=False)


def generate(folder, prompt: str, *, output=None, provider: str = "cpu", fused_step: bool = True, cuda_graph: bool = True,
             loras: list | None = None, **options) -> Result:
    """Load ``folder`` (with ``loras``, as :meth:`Pipeline.load`), generate one image (``options`` as
    :meth:`Pipeline.__call__`), write it to ``output`` (atomically, in the format its suffix names) when given."""
    if output is not None:
        images.check_writable(output)
        images.image_format(output)
    folder = folder if isinstance(folder, PipelineFolder) else PipelineFolder.open(folder)
    steps = folder.family.default_steps if options.get("steps") is None else options["steps"]
    options["scheduler"] = check_request(folder, steps=steps, scheduler=options.get("scheduler"))
    pipe = Pipeline.load(folder, provider, fused_step=fused_step and fusable(options["scheduler"]), cuda_graph=cuda_graph,
                         status=None if options.get("progress", True) else False, loras=loras,
                         scheduler=options["scheduler"])
    result = pipe(prompt, **options)
    if output is not None:
        images.write_image(result.image, output)
    return result
