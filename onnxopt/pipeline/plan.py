"""What a generation runs, decided once from the folder and the options, before any session exists.

    plan = plan_generation(PipelineFolder.open("sd15-opt"), "cuda")
    print(plan.text())          # onnxopt generate FOLDER --plan
    plan.as_dict()              # in generate --json, under "plan"
    Pipeline.from_plan(plan)    # the runner creates what the plan lists, in its order

The plan names the components, the step graph and where it comes from, the step loop (bound
buffers, host feeds, two streams, or diffusers' unfused loop), the ControlNet graphs, whether CUDA
graphs are asked for, and one :class:`SessionEntry` per session: which file it runs, when it runs
and what it binds. A new model family or pipeline feature is a new entry here (or a new source of
the step graph), not a branch in the runner: :meth:`onnxopt.pipeline.runner.Pipeline.from_plan`
turns each entry into a session by its ``binds`` alone.

Which rewrite is used, and why one is passed over, follows the folder (files written by
``onnxopt optimize``) and the switches of :meth:`onnxopt.pipeline.runner.Pipeline.load`.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from onnxopt.errors import OnnxoptError
from onnxopt.pipeline.folder import MERGED_STEP_FILE, PipelineFolder, folder_scheduler_class
from onnxopt.pipeline.schedulers import PLMS_SLOTS

INMEMORY_STEP_GRAPH_MAX_BYTES = 1_800_000_000  # serialized bytes with the weights inline stay under protobuf's 2 GB

# How a session is run (SessionEntry.binds): the runner's one switch.
BOUND = "bound buffers"  # once per prompt or image, on buffers bound per input shape (CapturedSession), captured when asked
STEP_LOOP = "step loop"  # every step, bound by the step loop (captured when asked and ORT can)
HOST = "host feeds"  # numpy in, numpy out
BUILT = "built graph"  # a small graph onnxopt builds (the reuse step, the ControlNet's input prep)

NO_CFG_STEP = "step_no_cfg"  # the session key of the step without classifier-free guidance (one row per image)
HISTORY_STEP = "+history"  # after a step session's key: that step with PLMS's history (PNDM's PLMS steps)
PLMS_HISTORY = len(PLMS_SLOTS)  # its slots
# every step session key: with guidance or without, each with PLMS's history or without
STEP_SESSIONS = ("step", NO_CFG_STEP, "step" + HISTORY_STEP, NO_CFG_STEP + HISTORY_STEP)


class GenerationError(OnnxoptError):
    """A bad generation request (size, steps, ControlNet image...): one line, exit code 2."""



def classifier_free_guidance(guidance: float, denoiser=None) -> bool:
    """diffusers' ``do_classifier_free_guidance``: guidance > 1, and never for a ``denoiser``
    (:class:`~onnxopt.pipeline.families.Denoiser`) that embeds the guidance (Flux; a UNet with
    ``time_cond_proj_dim``, LCM's: ``guidance_scale > 1 and time_cond_proj_dim is None``)."""
    return guidance > 1 and (denoiser is None or denoiser.classifier_free_guidance)

def hint_key(k: int) -> str:
    """The session key of ControlNet k's once-per-image hint graph: hint, hint_1, hint_2..."""
    return "hint" if k == 0 else f"hint_{k}"


@dataclass(frozen=True)
class SessionEntry:
    """One session: ``key`` (the runner's name for it), the ``component`` whose folder it reads, the
    ``graph`` it runs (relative to the folder, or what builds it), when it ``runs``, what it
    ``binds`` and whether capture is asked (``capture``); ``lazy``: made on first use."""

    key: str
    component: str
    graph: str
    runs: str
    binds: str
    capture: bool = False
    lazy: bool = False
    model: Path | None = field(default=None, compare=False, repr=False)  # the file (None: built or lazy)


@dataclass
class GenerationPlan:
    folder: Path
    kind: str
    provider: str
    components: list[str]
    step: str  # the step graph and where it comes from ("unfused" when diffusers' loop runs)
    step_loop: str  # "bound buffers" | "host feeds" | "two streams" | "unfused"
    capture: bool  # CUDA graphs asked for (the step session says whether ORT could)
    controlnets: list[str]  # the graph each ControlNet's step runs, in order
    merged_step: bool
    scheduler: str  # the folder's own, which a request without --scheduler gets
    sessions: list[SessionEntry]
    io_binding: bool = False  # once-per-prompt/image graphs and the fused step on bound buffers
    static_text: bool = True  # text encoders: their static graph for the prompt batch, when the folder has one
    build_step_graph: bool = False  # the step graph is built in memory from unet/model.onnx
    # diffusers' do_classifier_free_guidance (guidance > 1) of the request the plan is for; None: each call's
    classifier_free_guidance: bool | None = None
    # guidance <= 1: how the denoiser runs the prompt's row: 1 row per image, or 2 (the prompt's row twice:
    # graphs that take two rows per image, where the guidance then cancels exactly)
    no_cfg_rows: int = 1
    no_cfg: str = ""  # what runs then, for people
    embedded_guidance: bool = False  # the denoiser takes the guidance itself (Flux, LCM): never classifier-free guidance
    negative_prompt: bool | None = None  # PlanOptions.negative_prompt
    step_model: Path | None = field(default=None, repr=False)
    context_model: Path | None = field(default=None, repr=False)
    down_model: Path | None = field(default=None, repr=False)
    controlnet_models: list[Path] = field(default_factory=list, repr=False)

    def entry(self, key: str) -> SessionEntry | None:
        return next((e for e in self.sessions if e.key == key), None)

    def as_dict(self) -> dict:
        """The plan as JSON-ready data (the files as paths relative to the folder)."""
        return {"folder": str(self.folder), "kind": self.kind, "provider": self.provider,
                "components": list(self.components), "step": self.step, "step_loop": self.step_loop,
                "capture": self.capture, "controlnets": list(self.controlnets), "merged_step": self.merged_step,
                "scheduler": self.scheduler, "classifier_free_guidance": self.classifier_free_guidance,
                "without_guidance": {"rows_per_image": self.no_cfg_rows, "runs": self.no_cfg},
                "sessions": [{k: v for k, v in asdict(e).items() if k != "model"} for e in self.sessions]}

    def guidance_text(self) -> str:
        """Whether classifier-free guidance runs, and what runs without it."""
        if self.embedded_guidance:
            return ("CFG never: the denoiser embeds the guidance, one row per image, no negative prompt"
                    + (f" ({self.no_cfg})" if self.no_cfg else ""))
        on = "CFG on (guidance > 1): [negative; prompt] rows, two per image"
        off = f"CFG off (guidance <= 1): the prompt alone, the negative prompt ignored; {self.no_cfg}"
        if self.classifier_free_guidance is None:
            return f"per request: {on}; {off}"
        return on if self.classifier_free_guidance else off

    def text(self) -> str:
        """The plan for people: one line a fact, one line a session."""
        lines = [f"{self.folder} ({self.kind}) on {self.provider}",
                 f"  components: {', '.join(self.components)}",
                 f"  step graph: {self.step}",
                 f"  step loop:  {self.step_loop}" + (", CUDA graphs asked" if self.capture else ""),
                 f"  scheduler:  {self.scheduler}",
                 f"  guidance:   {self.guidance_text()}"]
        if self.controlnets:
            lines.append(f"  ControlNets: {', '.join(self.controlnets)}" + (" (inside the merged step graph)"
                                                                           if self.merged_step else ""))
        lines.append("  sessions:")
        for e in self.sessions:
            extra = ", captured" if e.capture else ""
            extra += ", made on first use" if e.lazy else ""
            lines.append(f"    {e.key:<20} {e.graph}: {e.runs}, {e.binds}{extra}")
        return "\n".join(lines)


@dataclass(frozen=True)
class PlanOptions:
    """The switches of :meth:`Pipeline.load` that choose what runs (its docstring says the others).

    The pipeline rewrites an optimized folder holds, each used when present and switched on
    (switching one off measures what it buys; a rewrite that is off never needs a file):

    * ``context_kv``: ``unet/step.context_kv.onnx`` once per prompt (cross-attention K/V, and
      SDXL's added conditioning) and ``unet/step.onnx`` reading them; off: the step graph of
      the whole UNet, built in memory from ``unet/model.onnx`` (a UNet under 1.8 GB).
    * ``controlnet_hint``: ``controlnet/step.hint.onnx`` once per image and
      ``controlnet/step.onnx`` reading the hint (the same in each ``controlnet_<k>/``); off:
      ``controlnet/model.onnx`` at every step.
    * ``merged_step``: ``merged_step.onnx``, ControlNet and UNet step graph in one graph (one
      run per step), used when it was built from the very graphs the other switches select.
    * ``two_streams`` (default: on for cuda/tensorrt, where it measured faster than
      ``merged_step``: benchmarks/results/h100-2026-11-25-session7/; bound-buffer loop only):
      ``unet/step.streams.down.onnx`` beside the ControlNet on a second thread and stream, then
      ``unet/step.streams.onnx`` (:mod:`onnxopt.pipeline.two_streams`); ``merged_step`` when off.
    """

    fused_step: bool = True
    cuda_graph: bool = True
    io_binding: bool | None = None
    context_kv: bool = True
    controlnet_hint: bool = True
    merged_step: bool = True
    step_file: str | None = None
    two_streams: bool | None = None
    static_text: bool = True
    scheduler: str | None = None  # the request's: one the fused step cannot run (unipc, PNDM's PRK steps) plans diffusers' loop
    guidance: float | None = None  # the request's, when known: the step of its guidance is made at load, the other on use
    # whether the requests give a negative prompt, when known: SDXL encodes the prompt alone without one
    # (force_zeros_for_empty_prompt), so the load makes the text graphs of that prompt batch ahead
    negative_prompt: bool | None = None


def plan_generation(folder: PipelineFolder, provider: str, options: PlanOptions = PlanOptions()) -> GenerationPlan:
    """The plan for ``folder`` on ``provider`` (cpu | cuda | tensorrt) with ``options``."""
    from onnxopt.pipeline.schedulers import FUSABLE_SCHEDULERS, HOST_SCHEDULERS

    if options.scheduler is not None and options.scheduler not in FUSABLE_SCHEDULERS:
        options = replace(options, fused_step=False)
    if provider == "tensorrt":  # each component's engine, host loop (onnxopt.runners.engine_session)
        options = replace(options, fused_step=False, io_binding=False, static_text=False)
    capture = options.cuda_graph and provider != "cpu"
    io_binding = provider != "cpu" if options.io_binding is None else options.io_binding
    two_streams = provider != "cpu" if options.two_streams is None else options.two_streams
    once = BOUND if io_binding else HOST
    plan = GenerationPlan(folder.root, folder.kind, provider, _components(folder), "unfused", "unfused", capture, [],
                          False, options.scheduler or folder_scheduler_name(folder), [], io_binding, options.static_text)
    if folder.has("vae_decoder"):
        plan.sessions.append(_entry(folder, "vae_decoder", "vae_decoder", folder.component("vae_decoder").model,
                                    "once per image", once, capture and io_binding))
    if folder.has("vae_encoder"):  # an init image's latents (onnxopt.pipeline.img2img), once per image
        plan.sessions.append(SessionEntry("vae_encoder", "vae_encoder", "vae_encoder/model.onnx",
                                          "once per init image (--image)", once, capture and io_binding, lazy=True))
    for encoder in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if folder.has(encoder):
            static = " or model.static.b{b}.onnx" if options.static_text and folder.component(encoder).static_models else ""
            plan.sessions.append(SessionEntry(encoder, encoder, f"{encoder}/model.onnx{static}", "once per prompt", once,
                                              capture and io_binding, lazy=True))
    hints = _controlnet_graphs(folder, plan, options, once, capture and io_binding)
    if options.scheduler in HOST_SCHEDULERS:
        plan.step = (f"unfused: {options.scheduler}'s corrector reads the previous sample and model outputs "
                     "beside the update: diffusers' own step on the host")
    if options.fused_step:
        _plan_step(folder, plan, options, io_binding, two_streams, hints)
    _plan_per_step_sessions(folder, plan, io_binding)
    _plan_without_guidance(folder, plan, options)
    _plan_history(folder, plan)
    plan.negative_prompt = options.negative_prompt
    return plan


def _plan_history(folder: PipelineFolder, plan: GenerationPlan) -> None:
    """PNDM's PLMS steps (``skip_prk_steps``) run on the step graph with its history
    (:func:`~onnxopt.pipeline.step_graph.with_history`, built in memory from the plan's step graph).
    With PNDM the plan's scheduler, the step its requests run is the history one: it takes the plain
    step's place (made at load where that was) and the plain step is made on first use, by a request
    with another scheduler, as :func:`_plan_without_guidance` makes the step of the other guidance:
    a load holds one UNet session. Not for a folder with ControlNets: their graphs read six
    coefficients a step, and diffusers' loop runs PNDM there."""
    if plan.scheduler != "pndm" or folder.controlnets or not folder.scheduler_config().get("skip_prk_steps", False):
        return
    for key in ("step", NO_CFG_STEP):
        entry = plan.entry(key)
        if entry is not None:
            index = plan.sessions.index(entry)
            plan.sessions[index] = replace(entry, lazy=True)
            plan.sessions.insert(index + 1, replace(
                entry, key=key + HISTORY_STEP, runs=f"{entry.runs} (PNDM)", graph=f"{entry.graph}, with PNDM's history"))


def _plan_without_guidance(folder, plan, options) -> None:
    """What a request with guidance <= 1 runs (diffusers' do_classifier_free_guidance False: the
    prompt's row alone): the step graph without its guidance rows (built in memory from the plan's
    step graph, :func:`onnxopt.pipeline.step_graph.without_guidance`) or the unfused UNet, at one row
    per image; the prompt's row twice where the graphs take two rows per image (the ControlNets'
    and the merged or two-stream step graphs, TensorRT's engines built at batch 2, a step file
    named by the request); the guided step is then exact: eps_c + g * (eps_c - eps_c) = eps_c.
    With the request's guidance known (``options.guidance``), the step it needs is made at load and
    the other one on first use."""
    denoiser = folder.family.denoiser
    if not denoiser.classifier_free_guidance:  # Flux, LCM: no guidance rows at all
        plan.embedded_guidance, plan.classifier_free_guidance = True, False
        if denoiser.guidance_embedding:
            plan.no_cfg = f"the guidance as {denoiser.guidance_embedding}, computed once per image"
            if plan.provider == "tensorrt":  # the UNet's engine is built at batch 2 (runners.folder_engines)
                plan.no_cfg_rows = 2
                plan.no_cfg += "; the prompt's row twice (its TensorRT engines are built for two rows per image)"
        return
    if options.guidance is not None:
        plan.classifier_free_guidance = classifier_free_guidance(options.guidance)
    step = plan.entry("step")
    why_twice = ("its ControlNet graphs take two rows per image" if folder.controlnets else
                 "its TensorRT engines are built for two rows per image" if plan.provider == "tensorrt" else
                 f"the step file {options.step_file} is run as written" if step is not None and options.step_file
                 else None)
    if why_twice:
        plan.no_cfg_rows = 2
        plan.no_cfg = f"the prompt's row twice ({why_twice}; the guidance cancels exactly)"
        return
    if step is None:
        plan.no_cfg = f"{folder.denoiser} on the prompt's row alone (one row per image)"
        return
    source = step.graph if step.model is not None else f"{folder.denoiser}/model.onnx"
    graph = f"the step graph of {source} without its guidance rows, built in memory"
    plan.no_cfg = f"{graph} (one row per image)"
    plan.sessions.insert(plan.sessions.index(step) + 1, SessionEntry(
        NO_CFG_STEP, step.component, graph, "every step with guidance <= 1", STEP_LOOP, step.capture,
        lazy=plan.classifier_free_guidance is not False, model=step.model))
    if plan.classifier_free_guidance is False:  # made when a request with guidance > 1 needs it
        plan.sessions[plan.sessions.index(step)] = replace(step, runs="every step with guidance > 1", lazy=True)


def inpainting_unet(folder: PipelineFolder) -> bool:
    """Whether the UNet reads more channels than the latents (an inpainting UNet: latents, mask and
    masked-image latents, StableDiffusion(XL)InpaintPipeline's). A transformer family's denoiser is none."""
    if folder.denoiser != "unet":
        return False
    return folder.config("unet").get("in_channels", 4) != folder.config("vae_decoder").get("latent_channels", 4)


def folder_scheduler_name(folder: PipelineFolder) -> str:
    """The folder's own scheduler (what a request without one gets), or why onnxopt runs none: the
    class model_index.json names, as the run reads it (the plan read the config's _class_name and
    printed a scheduler the run did not use)."""
    from onnxopt.pipeline.schedulers import SchedulerError, folder_scheduler

    try:
        return folder_scheduler(folder.scheduler_config(), folder_scheduler_class(folder))
    except SchedulerError as exc:
        return f"none onnxopt runs ({exc})"


def _components(folder: PipelineFolder) -> list[str]:
    names = ("text_encoder", "text_encoder_2", "text_encoder_3", folder.denoiser, *folder.controlnets, "vae_decoder")
    return [name for name in names if folder.has(name)]


def _entry(folder, key, component, model: Path, runs, binds, capture=False) -> SessionEntry:
    return SessionEntry(key, component, _relative(folder, model), runs, binds, capture, model=model)


def _controlnet_graphs(folder, plan, options, once, capture) -> bool:
    """Each ControlNet's step graph (its hint graph once per image when the folder has one)."""
    hints = False
    for k, name in enumerate(folder.controlnets):
        component = folder.component(name)
        hint = component.hint_model if options.fused_step and options.controlnet_hint else None
        plan.controlnet_models.append(component.model)
        if hint is not None:  # the conditioning embedding once per image (onnxopt.pipeline.controlnet_hint)
            plan.sessions.append(_entry(folder, hint_key(k), name, hint, "once per image", once, capture))
            plan.controlnet_models[-1] = component.step_model
            hints = True
    plan.controlnets = [_relative(folder, m) for m in plan.controlnet_models]
    return hints


def _plan_step(folder, plan, options, io_binding, two_streams, hints) -> None:
    """The fused step: its graph, the K/V companion, two streams or the merged graph."""
    step_model, step_source, build = step_graph_source(folder, options.context_kv, options.step_file)
    context = folder.component("unet").context_model if step_source == "unet/step.onnx" else None
    if options.step_file is not None:
        context = Path(step_model).with_suffix(".context_kv.onnx")
        context = context if context.is_file() else None
    controlnet = plan.controlnet_models[0] if plan.controlnet_models else None
    streams = None
    if two_streams and controlnet is not None and io_binding and step_source == "unet/step.onnx":
        streams = folder.component("unet").two_stream_models
    merged = None
    if controlnet is not None and options.merged_step and streams is None:
        merged = merged_step_graph(folder, plan.controlnet_models, step_source)
    if context is not None:  # cross-attention K/V once per prompt (step.context_kv.onnx)
        plan.context_model = context
        plan.sessions.append(_entry(folder, "context", "unet", context, "once per prompt", BOUND if io_binding else HOST,
                                    plan.capture and io_binding))
    if merged is not None:  # ControlNet + UNet step graph: one run per step
        step_model, step_source = merged, f"{MERGED_STEP_FILE} ({' + '.join([step_source, *plan.controlnets])})"
    if streams is not None:  # down beside the ControlNet, then the rest
        plan.down_model = streams[1]
        plan.sessions.append(_entry(folder, "down", "unet", streams[1], "every step, beside the ControlNets",
                                    STEP_LOOP, plan.capture))
        step_model, step_source = streams[0], f"{streams[0].name} + {streams[1].name} (two streams)"
    if context is not None:
        step_source += f" + {context.name}"
    plan.step, plan.merged_step = step_source, merged is not None and (step_model is not None or build)
    if step_model is None and not build:
        return
    plan.step_model, plan.build_step_graph = step_model, build
    graph = f"{folder.denoiser}/model.onnx, built in memory" if build else _relative(folder, step_model)
    plan.sessions.append(SessionEntry("step", folder.denoiser, graph, "every step", STEP_LOOP, plan.capture,
                                      model=step_model))
    plan.step_loop = "two streams" if streams is not None else ("bound buffers" if io_binding else "host feeds")


def _plan_per_step_sessions(folder, plan, io_binding) -> None:
    """The ControlNets (unless merged), the reuse graph or the UNet, the ControlNet's input graph."""
    fused, two = plan.entry("step") is not None, plan.entry("down") is not None
    if not plan.merged_step:  # captured too when they run on a stream of their own
        for name, model in zip(folder.controlnets, plan.controlnet_models):
            plan.sessions.append(_entry(folder, name, name, model, "every step", STEP_LOOP if two else HOST,
                                        plan.capture and two))
    if fused:
        plan.sessions.append(SessionEntry("reuse", "", "reuse step (onnxopt.pipeline.step_reuse)", "a reused step", BUILT))
    else:
        plan.sessions.append(_entry(folder, folder.denoiser, folder.denoiser, folder.component(folder.denoiser).model,
                                    "every step", HOST))
    if io_binding and fused and plan.entry("controlnet") is not None:  # one input graph serves every ControlNet
        plan.sessions.append(SessionEntry("controlnet_prepare", "", "ControlNet input (onnxopt.pipeline.merged_step)",
                                          "every step", BUILT, plan.capture and two))


def step_graph_source(folder: PipelineFolder, context_kv: bool = True, step_file: str | None = None):
    """(model path, where it came from, build in memory?): ``unet/<step_file>``, ``unet/step.onnx``,
    or the step graph built from ``unet/model.onnx``; (None, why not, False) -> the unfused loop.
    ``context_kv=False`` passes over a step.onnx that reads the K/V of step.context_kv.onnx."""
    from onnxopt.pipeline.multi_controlnet import controlnet_count

    unet = folder.component(folder.denoiser)
    where = folder.denoiser
    controlnets = max(1, len(folder.controlnets))
    if step_file is not None:
        path = unet.folder / step_file
        if Path(step_file).name != step_file or path.suffix != ".onnx" or not path.is_file():
            raise GenerationError(f"{path}: no step graph of that name in {unet.folder}")
        if controlnet_count(path) != controlnets:  # the residuals of the others would be dropped
            raise GenerationError(f"{path} reads the residuals of {controlnet_count(path)} ControlNet(s), the folder "
                                  f"has {controlnets}: write it with write_step_graph(..., controlnets={controlnets})")
        return path, f"{where}/{step_file}", False
    if unet.step_model is not None and (context_kv or unet.context_model is None):
        if controlnet_count(unet.step_model) == controlnets:
            return unet.step_model, f"{where}/step.onnx", False
        print(f"onnxopt: {unet.step_model} reads the residuals of {controlnet_count(unet.step_model)} ControlNet(s), the "
              f"folder has {controlnets}: building the step graph from unet/model.onnx", file=sys.stderr)
    try:
        import onnxopt.pipeline.step_graph  # noqa: F401
    except ImportError:
        return None, "unfused (onnxopt.pipeline.step_graph is not available)", False
    if not unet.external_data and unet.nbytes() >= INMEMORY_STEP_GRAPH_MAX_BYTES:
        print(f"onnxopt: {unet.folder} has no step.onnx and its UNet is over 1.8 GB inline: running the unfused step "
              "(write the fused one once with onnxopt.pipeline.step_graph.write_step_graph)", file=sys.stderr)
        return None, f"unfused ({where} over 1.8 GB without {where}/step.onnx)", False
    return None, f"built in memory from {where}/model.onnx", True


def build_step_graph_in_memory(folder: PipelineFolder, step_model: Path | None = None,
                               classifier_free_guidance: bool = True, history: int = 0) -> bytes:
    """The step graph of ``unet/model.onnx`` (or ``step_model``, a step graph in the UNet's folder;
    without ``classifier_free_guidance``: :func:`~onnxopt.pipeline.step_graph.without_guidance` of
    it; ``history`` > 0: :func:`~onnxopt.pipeline.step_graph.with_history` of it), serialized with its weights referring to the UNet's own data files (ORT reads them from the
    UNet's folder: create_session's external_data_folder), so a UNet of any size fits in memory
    once; inline weights are written inline, as they were."""
    import io

    from onnxopt.loading import load_model
    from onnxopt.pipeline.multi_controlnet import sum_controlnet_residuals
    from onnxopt.pipeline.step_graph import build_step_graph, with_history, without_guidance
    from onnxopt.saving import _write

    unet = folder.component(folder.denoiser)
    serialized = io.BytesIO()
    if step_model is not None:
        step = load_model(step_model)
    else:
        step = build_step_graph(load_model(unet.model), denoiser=folder.family.denoiser)
        step = sum_controlnet_residuals(step, max(1, len(folder.controlnets)))
    if not classifier_free_guidance:
        step = without_guidance(step)
    if history:
        step = with_history(step, history)
    _write(step, serialized, None, "", unet.folder.resolve())
    return serialized.getvalue()


def merged_step_graph(folder: PipelineFolder, controlnet_models: list[Path], step_source: str) -> Path | None:
    """merged_step.onnx when the folder has it and it was built from the UNet step graph and the
    ControlNet graphs this plan selected (``step_source``, ``controlnet_models``); else None."""
    from onnxopt.pipeline.merged_step import merged_parts

    merged = folder.merged_step_model
    if merged is None or step_source != "unet/step.onnx":
        return None
    expected = {step_source, *(_relative(folder, m) for m in controlnet_models)}
    return merged if set(merged_parts(merged)) == expected else None


def _relative(folder: PipelineFolder, path: Path) -> str:
    return Path(path).relative_to(folder.root).as_posix()
