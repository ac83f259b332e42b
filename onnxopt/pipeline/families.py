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

``FluxPipeline`` runs through :class:`onnxopt.pipeline.flux_runner.FluxRunner` (its prompt, packed
latents and VAE input: :mod:`onnxopt.pipeline.flux`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Denoiser:
    """How a family's denoiser graph is called: its component folder, the names of its latent
    input, timestep input and output, what the pipeline feeds as the timestep (the scheduler's
    timestep times ``timestep_scale``: diffusers' FluxPipeline feeds ``t / 1000``, the others ``t``,
    broadcast over the batch), and whether classifier-free guidance runs as batch 2 (negative and
    prompt rows; Flux-dev embeds the guidance instead)."""

    component: str
    sample: str
    timestep: str
    output: str
    timestep_scale: float = 1.0
    classifier_free_guidance: bool = True


UNET = Denoiser("unet", "sample", "timestep", "out_sample")
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

    @property
    def components(self) -> tuple[str, ...]:
        return (*self.required, *self.optional)


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

# a text encoder -> the tokenizer that feeds it
TOKENIZER_OF = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"}


def family(kind: str) -> Family:
    return FAMILIES[kind]
