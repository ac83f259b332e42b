"""The pipeline families onnxopt runs: one entry per family, keyed by model_index.json's ``_class_name``.

A family says which components its folder holds, which of them a generation needs, which
tokenizers it reads, and how its denoiser is called. A new family is a new entry here (and the
steps of its prompt encoding in the runner), never a branch in the folder reader.

The layouts (the same folder names in both; what differs is who wrote ``model_index.json``)::

    component            optimum-onnx's export      diffusers' index entry (save_pretrained)
    text encoders        text_encoder/ _2/ _3/      text_encoder, text_encoder_2, text_encoder_3
    denoiser             unet/ | transformer/       unet | transformer
    VAE                  vae_decoder/ vae_encoder/  vae (one entry for both halves)
    ControlNet           controlnet/                controlnet
    tokenizers           tokenizer/ _2/ _3/         tokenizer, tokenizer_2, tokenizer_3
    scheduler            scheduler/                 scheduler

Each component folder holds ``model.onnx`` (and its external data, and optionally the
component's ``config.json``); :data:`INDEX_ENTRIES` maps each index entry to the file it needs.

A UNet whose config sets ``time_cond_proj_dim`` (a guidance-distilled one: LCM) embeds the guidance:
diffusers' pipelines then run no classifier-free guidance and feed ``timestep_cond``, the guidance
embedding (:mod:`onnxopt.pipeline.guidance_embedding`). ``LatentConsistencyModelPipeline`` folders
are such UNets; a ``StableDiffusionPipeline`` folder holding one runs the same way, as diffusers'
StableDiffusionPipeline does (:func:`with_unet_config`).

``FluxPipeline`` runs through :class:`onnxopt.pipeline.flux_runner.FluxRunner` (its prompt, packed
latents and VAE input: :mod:`onnxopt.pipeline.flux`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Denoiser:
    """How a family's denoiser graph is called: its component folder, the names of its latent
    input, timestep input and output, what the pipeline feeds as the timestep (the scheduler's
    timestep times ``timestep_scale``: diffusers' FluxPipeline feeds ``t / 1000``, the others ``t``,
    broadcast over the batch), whether classifier-free guidance runs as batch 2 (negative and
    prompt rows; Flux-dev embeds the guidance instead), and ``guidance_embedding``: the input that
    takes the guidance embedding of a guidance-distilled UNet (LCM's ``timestep_cond``), None: none."""

    component: str
    sample: str
    timestep: str
    output: str
    timestep_scale: float = 1.0
    classifier_free_guidance: bool = True
    guidance_embedding: str | None = None


UNET = Denoiser("unet", "sample", "timestep", "out_sample")
# a guidance-distilled UNet (time_cond_proj_dim): one row per image, the guidance embedded (optimum's input name)
GUIDANCE_EMBEDDING_UNET = Denoiser("unet", "sample", "timestep", "out_sample", classifier_free_guidance=False,
                                   guidance_embedding="timestep_cond")
# optimum-onnx's SD3 / Flux transformer exports (models/dit.py writes the same names)
SD3_TRANSFORMER = Denoiser("transformer", "hidden_states", "timestep", "out_hidden_states")
FLUX_TRANSFORMER = Denoiser("transformer", "hidden_states", "timestep", "out_hidden_states", timestep_scale=1 / 1000,
                            classifier_free_guidance=False)


@dataclass(frozen=True)
class Family:
    """One pipeline family. ``required``: the component folders a generation needs (each with
    model.onnx); ``optional``: those it uses when present; ``tokenizers``: the tokenizer folders
    it needs; ``optional_tokenizers``: needed with their optional encoder; ``flow_matching``: its
    scheduler is a flow-matching one (FlowMatchEulerDiscreteScheduler), not a noise-prediction one;
    ``t5_tokenizer``: the tokenizer folder that holds T5's tokenizer (SD3's third, Flux's second);
    ``runs``: False for a family listed so that its layout is known, refused for now; ``runner``:
    the family's own runner class as ``module:Class`` (a subclass of the runner's ``Pipeline``, named
    here rather than imported so that the runner needs no import of its subclasses), None: ``Pipeline``."""

    kind: str
    classes: tuple[str, ...]
    required: tuple[str, ...]
    optional: tuple[str, ...]
    tokenizers: tuple[str, ...]
    denoiser: Denoiser
    optional_tokenizers: tuple[str, ...] = ()
    flow_matching: bool = False
    t5_tokenizer: str = "tokenizer_3"
    runs: bool = True
    runner: str | None = None
    # generate's defaults without --steps/--guidance: diffusers' pipeline's (SDXL's guidance_scale is 5.0 in diffusers
    # 0.42; onnxopt keeps 7.5 for the UNet families, as it always had)
    default_steps: int = 50
    default_guidance: float = 7.5
    schedulers: tuple[str, ...] | None = None
    img2img: bool = True

    @property
    def components(self) -> tuple[str, ...]:
        return (*self.required, *self.optional)

    @property
    def t5_encoder(self) -> str:
        """The component folder of T5 (its tokenizer's twin): ``text_encoder_3`` for SD3, ``text_encoder_2`` for
        Flux. T5 takes the request's token count, so it gets no static graph of a fixed length."""
        return "text_encoder" + self.t5_tokenizer[len("tokenizer"):]


FAMILIES = {
    # the Img2Img/Inpaint classes: the same components, run with --image (onnxopt.pipeline.img2img)
    # or --image and --mask (an inpainting UNet)
    "sd": Family("sd", ("StableDiffusionPipeline", "OnnxStableDiffusionPipeline",  # diffusers' own ONNX export too
                        "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline"),
                 ("text_encoder", "unet", "vae_decoder"), ("vae_encoder",), ("tokenizer",), UNET),
    "sdxl": Family("sdxl", ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline",
                            "StableDiffusionXLInpaintPipeline"), ("text_encoder", "text_encoder_2", "unet", "vae_decoder"),
                   ("vae_encoder",), ("tokenizer", "tokenizer_2"), UNET),
    "controlnet": Family("controlnet", ("StableDiffusionControlNetPipeline",),
                         ("text_encoder", "unet", "vae_decoder", "controlnet"), ("vae_encoder",), ("tokenizer",), UNET),
    # LatentConsistencyModelPipeline: its own defaults (4 steps, guidance 8.5); LCMScheduler only (it decodes the
    # step's `denoised`, which LCMScheduler alone returns); LatentConsistencyModelImg2ImgPipeline's strength
    # schedule (LCMScheduler.set_timesteps(strength=...)) is not run
    "lcm": Family("lcm", ("LatentConsistencyModelPipeline",), ("text_encoder", "unet", "vae_decoder"), ("vae_encoder",),
                  ("tokenizer",), GUIDANCE_EMBEDDING_UNET, default_steps=4, default_guidance=8.5, schedulers=("lcm",),
                  img2img=False),
    # diffusers' StableDiffusion3Pipeline runs without T5 (text_encoder_3=None: zeros in its place)
    "sd3": Family("sd3", ("StableDiffusion3Pipeline",), ("text_encoder", "text_encoder_2", "transformer", "vae_decoder"),
                  ("text_encoder_3", "vae_encoder"), ("tokenizer", "tokenizer_2"), SD3_TRANSFORMER,
                  optional_tokenizers=("tokenizer_3",), flow_matching=True, default_steps=28, default_guidance=7.0),
    "flux": Family("flux", ("FluxPipeline",), ("text_encoder", "text_encoder_2", "transformer", "vae_decoder"),
                   ("vae_encoder",), ("tokenizer", "tokenizer_2"), FLUX_TRANSFORMER, flow_matching=True,
                   t5_tokenizer="tokenizer_2", runner="onnxopt.pipeline.flux_runner:FluxRunner", default_steps=28,
                   default_guidance=3.5),
}

# model_index.json's _class_name -> the family's kind
PIPELINE_CLASSES = {name: family.kind for family in FAMILIES.values() for name in family.classes}
RUNNABLE_CLASSES = tuple(name for name, kind in PIPELINE_CLASSES.items() if FAMILIES[kind].runs)

# every component folder holding a model.onnx that some family reads, in the order a folder lists them
MODEL_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "unet", "transformer", "vae_decoder",
                    "vae_encoder", "controlnet")
TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3")

# model_index.json's entries and what each needs in the folder (diffusers' "vae" is optimum's vae_decoder/)
INDEX_ENTRIES = {
    "text_encoder": "text_encoder/model.onnx", "text_encoder_2": "text_encoder_2/model.onnx",
    "text_encoder_3": "text_encoder_3/model.onnx", "unet": "unet/model.onnx", "transformer": "transformer/model.onnx",
    "vae": "vae_decoder/model.onnx", "vae_decoder": "vae_decoder/model.onnx", "vae_encoder": "vae_encoder/model.onnx",
    "controlnet": "controlnet/model.onnx", "tokenizer": "tokenizer/", "tokenizer_2": "tokenizer_2/",
    "tokenizer_3": "tokenizer_3/", "scheduler": "scheduler/scheduler_config.json",
}

# the libraries diffusers loads each entry's class from (its LOADABLE_CLASSES): models and schedulers from diffusers,
# tokenizers from transformers, text encoders from transformers or, in diffusers' own ONNX pipelines (whose every
# model is diffusers' OnnxRuntimeModel), from diffusers
INDEX_LIBRARIES = {key: ("transformers",) if key.startswith("tokenizer") else
                   ("transformers", "diffusers") if key.startswith("text_encoder") else ("diffusers",)
                   for key in INDEX_ENTRIES}

# a text encoder -> the tokenizer that feeds it
TOKENIZER_OF = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"}


def family(kind: str) -> Family:
    return FAMILIES[kind]


# the families whose pipeline class feeds a guidance-distilled UNet its embedding (StableDiffusionPipeline
# and LatentConsistencyModelPipeline); the others refuse such a UNet (onnxopt.pipeline.runner.check_model_configs)
GUIDANCE_EMBEDDING_KINDS = ("sd", "lcm")


def with_unet_config(family: Family, unet_config: dict) -> Family:
    """``family`` as its folder's UNet makes it run: a UNet whose config sets ``time_cond_proj_dim``,
    in a family of :data:`GUIDANCE_EMBEDDING_KINDS`, takes the guidance as an embedding and runs no
    classifier-free guidance (diffusers' ``do_classifier_free_guidance`` is ``guidance_scale > 1 and
    time_cond_proj_dim is None``)."""
    if family.kind in GUIDANCE_EMBEDDING_KINDS and unet_config.get("time_cond_proj_dim") is not None:
        return replace(family, denoiser=GUIDANCE_EMBEDDING_UNET)
    return family
