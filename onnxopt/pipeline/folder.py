"""A diffusers/optimum ONNX pipeline folder, read without running anything.

    folder = PipelineFolder.open("sd15-tiny")
    folder.kind                      # "sd" | "sdxl" | "controlnet" | "sd3" (onnxopt.pipeline.families)
    folder.component("unet").model   # Path to unet/model.onnx
    folder.tokenizer("tokenizer_2")  # transformers.CLIPTokenizer
    folder.config("vae_decoder")     # the component's config.json (empty dict when absent)

The layout (what optimum-cli and ``models/pipelines.py`` write)::

    model_index.json        _class_name: StableDiffusionPipeline | StableDiffusionXLPipeline |
                            StableDiffusionControlNetPipeline | StableDiffusion3Pipeline (+ pipeline
                            config such as force_zeros_for_empty_prompt)
    scheduler/scheduler_config.json
    tokenizer/  tokenizer_2/ (SDXL, SD3)  [tokenizer_3/] (SD3's T5: tokenizer.json alone will do)
    text_encoder/  text_encoder_2/ (SDXL, SD3)  [text_encoder_3/] (SD3's T5, optional as in diffusers)
    unet/ | transformer/ (SD3)  vae_decoder/  [vae_encoder/]  [controlnet/]
                            each a model.onnx, external data in model.onnx_data | model.onnx.data |
                            weights.pb, and optionally config.json
    [controlnet_1/ controlnet_2/ ...]  more ControlNets: diffusers' MultiControlNetModel.save_pretrained
                            writes the k-th (from 0) to controlnet_<k>/ (the first to controlnet/) and
                            model_index.json's "controlnet" entry names MultiControlNetModel
    [text_encoder*/model.static.b{b}.onnx]  written by onnxopt: the text encoder at input_ids
                            [b, 77], capturable (onnxopt.pipeline.static_text)
    [merged_step.onnx]      written by onnxopt: the ControlNet(s) and the UNet step graph merged
    [unet/step.onnx]        written by onnxopt: the UNet with guidance and the scheduler update
                            (onnxopt.pipeline.step_graph), beside it step.context_kv.onnx (the text's
                            K/V, once per prompt) and step.streams.onnx + step.streams.down.onnx (two
                            streams: onnxopt.pipeline.two_streams)
    [controlnet*/step.onnx, step.hint.onnx]  written by onnxopt: the ControlNet's step and its
                            conditioning embedding, once per image (onnxopt.pipeline.controlnet_hint)

Every file name onnxopt reads or writes in a folder is a constant of this module; the modules that
write those files take their names from here.

``folder.controlnets`` lists the ControlNet folders in order (``["controlnet", "controlnet_1"]``);
a ``controlnet_<k>/`` without all of ``controlnet/`` .. ``controlnet_<k-1>/`` is refused (diffusers
would silently drop it).

Every problem with the folder (missing, not a pipeline, a required component absent) raises
:class:`PipelineFolderError`, a one-line :class:`~onnxopt.errors.OnnxoptError` (exit code 2).
Nothing here writes to the folder.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from onnxopt.errors import MissingDependencyError, OnnxoptError
from onnxopt.pipeline.families import (FAMILIES, INDEX_ENTRIES, INDEX_LIBRARIES, MODEL_COMPONENTS,  # noqa: F401
                                       PIPELINE_CLASSES, RUNNABLE_CLASSES, TOKENIZER_OF, TOKENIZERS, Family,
                                       with_unet_config)

KINDS = tuple(FAMILIES)
MAX_IMAGE_SIDE = 1 << 16  # pixels: far above any model's, far below what overflows the latents' shape
CLIP_SEQUENCE = 77  # the prompt length CLIP's text encoders take
TOKENIZER_NO_LIMIT = 4096  # a model_max_length above it is transformers' "no limit" placeholder
EXTERNAL_DATA_NAMES = ("model.onnx_data", "model.onnx.data", "weights.pb")
MODEL_FILE = "model.onnx"
STEP_FILE = "step.onnx"  # the fused step graph (onnxopt.pipeline.step_graph.write_step_graph)
CONTEXT_FILE = "step.context_kv.onnx"  # its context-kv companion, run once per prompt
HINT_FILE = "step.hint.onnx"  # a ControlNet's conditioning embedding, run once per image
MERGED_STEP_FILE = "merged_step.onnx"  # at the root: ControlNet + UNet step graph in one (onnxopt.pipeline.merged_step)
STREAMS_FILE = "step.streams.onnx"  # unet/: the step graph past the down blocks (onnxopt.pipeline.two_streams)
STREAMS_COMPANION = "down"  # ... and its companion, unet/step.streams.down.onnx: the down blocks
HINT_COMPANION = "hint"  # controlnet/step.hint.onnx: the companion of controlnet/step.onnx
STATIC_TEXT_PREFIX = "model.static.b"  # text_encoder*/model.static.b{batch}.onnx (onnxopt.pipeline.static_text)

# What each kind needs to generate an image, from the one table of pipeline families (families.py)
REQUIRED_MODELS = {kind: fam.required for kind, fam in FAMILIES.items()}
REQUIRED_TOKENIZERS = {kind: fam.tokenizers for kind, fam in FAMILIES.items()}

class PipelineFolderError(OnnxoptError):
    """The folder is not a pipeline folder onnxopt can run (one line, exit code 2)."""


@dataclass
class Component:
    """One ONNX component: ``<folder>/<name>/model.onnx`` and what lies beside it."""

    name: str
    folder: Path
    model: Path
    external_data: list[Path]
    config: dict = field(default_factory=dict)

    @property
    def step_model(self) -> Path | None:
        """unet/step.onnx when the folder ships the fused step graph, else None."""
        path = self.folder / STEP_FILE
        return path if path.is_file() else None

    @property
    def context_model(self) -> Path | None:
        """unet/step.context_kv.onnx: the step graph's once-per-prompt part (cross-attention K/V),
        written beside step.onnx by write_step_graph; None when the step graph has none."""
        path = self.folder / CONTEXT_FILE
        return path if path.is_file() and self.step_model is not None else None

    @property
    def hint_model(self) -> Path | None:
        """controlnet/step.hint.onnx: the ControlNet's once-per-image part (its conditioning
        embedding), written with controlnet/step.onnx by onnxopt.pipeline.controlnet_hint."""
        path = self.folder / HINT_FILE
        return path if path.is_file() and self.step_model is not None else None

    @property
    def static_models(self) -> dict[int, Path]:
        """batch -> ``model.static.b{batch}.onnx``: the text encoder at input_ids [batch, 77], every
        node on the CUDA EP (:mod:`onnxopt.pipeline.static_text`); empty when the folder has none."""
        found = {}
        for path in self.folder.glob(f"{STATIC_TEXT_PREFIX}*.onnx"):
            batch = path.name[len(STATIC_TEXT_PREFIX):-len(".onnx")]
            if batch.isdigit():
                found[int(batch)] = path
        return dict(sorted(found.items()))

    @property
    def two_stream_models(self) -> tuple[Path, Path] | None:
        """(rest, down): unet/step.streams.onnx and its down-blocks companion beside step.onnx
        (:mod:`onnxopt.pipeline.two_streams`), when the folder has both."""
        rest = self.folder / STREAMS_FILE
        down = rest.with_name(f"{rest.stem}.{STREAMS_COMPANION}.onnx")
        return (rest, down) if rest.is_file() and down.is_file() else None

    def nbytes(self) -> int:
        """Size on disk of the graph and its external data."""
        return self.model.stat().st_size + sum(p.stat().st_size for p in self.external_data)


def read_json(path: Path) -> dict:
    """A JSON object from ``path``, or a one-line PipelineFolderError (unreadable, not JSON, not an object)."""
    try:
        value = json.loads(path.read_text())
    except OSError as exc:
        raise PipelineFolderError(f"{path}: cannot read: {exc.strerror or exc}")
    except ValueError as exc:
        raise PipelineFolderError(f"{path}: not valid JSON: {exc}")
    except RecursionError:  # the C decoder recurses per nesting level: [[[[... was an internal error
        raise PipelineFolderError(f"{path}: not a config file: its JSON nests deeper than Python's decoder goes") from None
    if not isinstance(value, dict):
        raise PipelineFolderError(f"{path}: expected a JSON object")
    return value


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# the latents are float32: a factor they are divided or multiplied by stays in its normal range (1e39 overflowed to inf)
FLOAT32_MIN, FLOAT32_MAX = 1.1754944e-38, 3.4028235e38


def _float32_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= FLOAT32_MAX


def _float32_positive(value) -> bool:
    return _float32_number(value) and FLOAT32_MIN <= value


# config.json fields the pipeline computes with (absent: diffusers' default applies), each with what
# diffusers accepts for it: a value of another type crashed deep inside the run (exit 3) or, for a zero
# scaling_factor, gave a NaN image.
CONFIG_FIELDS = {
    "unet": {
        "sample_size": (lambda v: _positive_int(v) or (isinstance(v, list) and len(v) == 2 and all(map(_positive_int, v))),
                        "a positive integer or [height, width]"),
        "in_channels": (_positive_int, "a positive integer"),
        # the guidance embedding's width (LCM): diffusers' get_guidance_scale_embedding(embedding_dim=...)
        "time_cond_proj_dim": (lambda v: v is None or _positive_int(v), "a positive integer or null"),
    },
    "transformer": {
        "sample_size": (_positive_int, "a positive integer"),
        "in_channels": (_positive_int, "a positive integer"),
        "patch_size": (_positive_int, "a positive integer"),
    },
    "vae_decoder": {
        "block_out_channels": (lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list"),
        "scaling_factor": (_float32_positive, "a positive number in float32's range"),
        "shift_factor": (lambda v: v is None or _float32_number(v), "a finite number or null"),
    },
    "vae_encoder": {
        "block_out_channels": (lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list"),
    },
}


def check_config(path: Path, name: str, config: dict) -> None:
    """A one-line PipelineFolderError when a field of :data:`CONFIG_FIELDS` has a value diffusers would not take."""
    for key, (ok, expected) in CONFIG_FIELDS.get(name, {}).items():
        if key in config and not ok(config[key]):
            raise PipelineFolderError(f"{path}: '{key}' must be {expected}, got {json.dumps(config[key])}")


def check_folder_files(root: Path) -> None:
    """The JSON files a run reads besides model_index.json, where present, as generate reads them:
    scheduler_config.json a JSON object of values diffusers' schedulers take
    (:func:`~onnxopt.pipeline.schedulers.check_config_values`), each tokenizer_config.json a JSON
    object, each component's config.json an object whose :data:`CONFIG_FIELDS` diffusers would take, and a tokenizer's
    model_max_length a positive integer. ``optimize`` calls it too, so that it does not copy a
    folder generate refuses."""
    scheduler = root / "scheduler" / "scheduler_config.json"
    if scheduler.is_file():
        from onnxopt.pipeline.schedulers import check_config_values  # no diffusers: the values alone

        check_config_values(read_json(scheduler))  # whichever scheduler runs, it is made from these values
    for tokenizer in TOKENIZERS:
        path = root / tokenizer / "tokenizer_config.json"
        if path.is_file():
            length = read_json(path).get("model_max_length")
            if length is not None and not _positive_int(length):
                raise PipelineFolderError(f"{path}: 'model_max_length' must be a positive integer, got {json.dumps(length)}")
    configs = {}
    for name in CONFIG_FIELDS:
        path = root / name / "config.json"
        if path.is_file():
            configs[name] = read_json(path)
            check_config(path, name, configs[name])
    for denoiser in ("unet", "transformer"):
        sample = configs.get(denoiser, {}).get("sample_size")
        if sample is not None:
            default_size(root, sample, configs.get("vae_decoder", {}), denoiser)
    if "unet" in configs and "vae_decoder" in configs:
        check_unet_latents(root, configs["unet"], configs["vae_decoder"])
    for tokenizer, encoder in (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")):
        path, encoder_config = root / tokenizer / "tokenizer_config.json", root / encoder / "config.json"
        if path.is_file() and encoder_config.is_file():  # optimize builds its static text graphs at this length
            problem = prompt_length_problem(root, encoder, read_json(path).get("model_max_length"),
                                            read_json(encoder_config).get("max_position_embeddings"))
            if problem:
                raise PipelineFolderError(problem)


# every CLIP tokenizer's own tokens (SD3's CLIP-G pads with "!" instead of the second: it has them all the same)
CLIP_SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>")


def tokenizer_json_model(folder: Path) -> str | None:
    """The model kind ``folder/tokenizer.json`` declares, as the tokenizers library loads it ("BPE" for
    CLIP's, "Unigram" for T5's, "WordPiece", "WordLevel"), or None without a tokenizer.json. The
    loaded transformers tokenizer cannot say it: CLIPTokenizer and T5TokenizerFast each build their
    own model from whatever vocabulary the folder holds, and tokenize a prompt into wrong ids."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return type(Tokenizer.from_file(str(path)).model).__name__
    except Exception as exc:  # noqa: BLE001 -- the folder's file, parsed by tokenizers: any failure is the file's
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PipelineFolderError(f"{path}: cannot load the tokenizer: {first}") from None


def prompt_length_problem(root: Path, encoder: str, length, positions) -> str | None:
    """Why a tokenizer that pads every prompt to ``length`` tokens (its model_max_length) cannot feed a
    text encoder of ``positions`` positions (its config's max_position_embeddings), or None. A length
    over :data:`TOKENIZER_NO_LIMIT` is transformers' "no limit": the pipeline pads to 77 then."""
    if not _positive_int(length) or length > TOKENIZER_NO_LIMIT or not _positive_int(positions) or length <= positions:
        return None
    return (f"{root}: the tokenizer pads prompts to {length} tokens (model_max_length), {encoder} takes at most "
            f"{positions} (max_position_embeddings)")


def check_unet_latents(root: Path, unet: dict, vae: dict) -> None:
    """The UNet predicts the latents the VAE decodes (out_channels = latent_channels L) and reads them
    (in_channels L), or them with a mask and the masked image's (2L + 1: an inpainting UNet, as
    diffusers' StableDiffusionInpaintPipeline checks). Another count is a config of another model:
    a VAE config of 16 latent channels beside SD 1.5's UNet was refused as "an inpainting UNet"."""
    latent = vae.get("latent_channels", 4)
    reads, predicts = unet.get("in_channels", 4), unet.get("out_channels", 4)
    if not all(_positive_int(v) for v in (latent, reads, predicts)):
        return  # a value of the wrong type: check_config's to refuse, by name
    vae_path, unet_path = root / "vae_decoder" / "config.json", root / "unet" / "config.json"
    if predicts != latent:
        raise PipelineFolderError(f"{unet_path}: out_channels {predicts}, but {vae_path} decodes latents of "
                                  f"{latent} channels: the two configs belong to different models")
    if reads not in (latent, 2 * latent + 1):
        raise PipelineFolderError(f"{unet_path}: in_channels {reads} is neither the latents' {latent} "
                                  f"({vae_path}) nor an inpainting UNet's {2 * latent + 1}")


def latent_channels(root: Path, name: str, config: dict, shape) -> int:
    """The latent channels of the denoiser ``name``: its config.json's in_channels (diffusers makes the
    latents from the config; Flux's is the packed width, four times the latents'), which its graph's
    latent input, of ``shape``, must take, or a one-line PipelineFolderError. A 4-D input [batch, C,
    height, width] takes C channels, a 3-D one [batch, sequence, C] (Flux's packed latents) C; a dim
    the graph leaves symbolic says nothing. A config of another model was ORT's shape error mid-run."""
    packed = len(shape) == 3
    channels = config.get("in_channels", 64 if packed else 4)
    declared = shape[-1] if packed else shape[1] if len(shape) == 4 else None
    if isinstance(declared, int) and declared != channels:
        raise PipelineFolderError(f"{root / name / 'config.json'}: in_channels {channels}, but {name}'s graph takes "
                                  f"latents of {declared} channels")
    return channels


def default_size(root: Path, sample, vae_config: dict, denoiser: str = "unet") -> tuple[int, int]:
    """(height, width) in pixels for a UNet ``sample_size`` (n or [h, w]) and the VAE's config; a
    size beyond :data:`MAX_IMAGE_SIDE` is refused (it overflowed the latents' shape: exit 3)."""
    channels = vae_config.get("block_out_channels")
    factor = 2 ** (len(channels) - 1) if channels else 8
    h, w = (sample, sample) if isinstance(sample, int) else sample
    size = h * factor, w * factor
    if max(size) > MAX_IMAGE_SIDE:
        raise PipelineFolderError(f"{root / denoiser / 'config.json'}: 'sample_size' {json.dumps(sample)} makes a default "
                                  f"image of {size[0]}x{size[1]} pixels (at most {MAX_IMAGE_SIDE} a side)")
    return size


def controlnet_name(k: int) -> str:
    """The folder of the k-th ControlNet (from 0): controlnet, controlnet_1, controlnet_2..."""
    return "controlnet" if k == 0 else f"controlnet_{k}"


def controlnet_folders(root: Path) -> list[str]:
    """The ControlNet folders holding a model.onnx, in order; a gap in the numbering is an error."""
    numbers = set()
    for sub in root.iterdir() if root.is_dir() else ():
        name = sub.name
        if name == "controlnet" or (name.startswith("controlnet_") and name[len("controlnet_"):].isdigit()
                                    and not name[len("controlnet_"):].startswith("0")):
            if (sub / MODEL_FILE).is_file():
                numbers.add(0 if name == "controlnet" else int(name[len("controlnet_"):]))
    for k in sorted(numbers):
        if k and k - 1 not in numbers:
            raise PipelineFolderError(f"{root}: {controlnet_name(k)}/ without {controlnet_name(k - 1)}/{MODEL_FILE} "
                                      "(diffusers numbers the ControlNets controlnet/, controlnet_1/, controlnet_2/...)")
    return [controlnet_name(k) for k in sorted(numbers)]


# a transformer's config.json _class_name (diffusers' save_config writes it) -> the family whose denoiser it is
TRANSFORMER_CLASSES = {"SD3Transformer2DModel": "sd3", "FluxTransformer2DModel": "flux"}


def kind_of(index: dict, root: Path) -> str:
    """The family's kind (sd / sdxl / controlnet / sd3 / flux), from model_index.json's class name
    (:data:`~onnxopt.pipeline.families.PIPELINE_CLASSES`; a class onnxopt does not run is refused by
    name); an index without one (hand-written folders) by its folders: a UNet folder by whether it holds
    controlnet/ or text_encoder_2/, a transformer/ by its config.json's class name (SD3's and Flux's
    folders hold the same component names: one whose config does not say is refused, where it ran as
    SD3 whatever it was)."""
    name = index.get("_class_name")
    if name is not None:
        if not isinstance(name, str):  # a list or an object raised TypeError (unhashable) below: exit 3
            raise PipelineFolderError(f"{root / 'model_index.json'}: '_class_name' must be a pipeline class name, "
                                      f"got {json.dumps(name)}")
        if name not in PIPELINE_CLASSES or not FAMILIES[PIPELINE_CLASSES[name]].runs:
            raise PipelineFolderError(f"{root}: model_index.json names {json.dumps(name)}, a pipeline onnxopt does not "
                                      f"run (it runs {', '.join(RUNNABLE_CLASSES)})")
        return PIPELINE_CLASSES[name]
    if "transformer" in index or (root / "transformer").is_dir():
        config_path = root / "transformer" / "config.json"
        transformer = read_json(config_path).get("_class_name") if config_path.is_file() else None
        if isinstance(transformer, str) and transformer in TRANSFORMER_CLASSES:
            return TRANSFORMER_CLASSES[transformer]
        raise PipelineFolderError(f"{root / 'model_index.json'}: no '_class_name', and transformer/ (its config.json "
                                  "names no SD3Transformer2DModel or FluxTransformer2DModel) may be "
                                  "StableDiffusion3Pipeline's or FluxPipeline's: name the pipeline class")
    if "controlnet" in index or (root / "controlnet").is_dir():
        return "controlnet"
    if "text_encoder_2" in index or (root / "text_encoder_2").is_dir():
        return "sdxl"
    return "sd"


def check_index_entries(root: Path, index: dict) -> None:
    """Each component entry of model_index.json is what diffusers' save_pretrained writes, [library,
    class] or [null, null], with a library diffusers loads that component from
    (:data:`~onnxopt.pipeline.families.INDEX_LIBRARIES`): another shape or library is a folder
    diffusers cannot load (a text encoder from diffusers' UNet module, a tokenizer from diffusers),
    which onnxopt ran without a word. Each component it names (an entry other than [null, null]) is
    in the folder: one it names and lacks made a folder generate refuses, after optimize said it worked."""
    for key, needed in INDEX_ENTRIES.items():
        entry = index.get(key)
        if entry is None or entry == [None, None]:
            continue
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(part, str) and part for part in entry)):
            raise PipelineFolderError(f"{root / 'model_index.json'}: '{key}' must be [library, class] or [null, null], "
                                      f"as diffusers writes it, got {json.dumps(entry)}")
        if entry[0] not in INDEX_LIBRARIES[key]:
            raise PipelineFolderError(f"{root / 'model_index.json'}: '{key}' names {json.dumps(entry)}, but diffusers "
                                      f"loads {key} from {' or '.join(INDEX_LIBRARIES[key])}")
        path = root / needed
        if not (path.is_dir() if needed.endswith("/") else path.is_file()):
            raise PipelineFolderError(f"{root}: model_index.json names '{key}', but there is no {needed}")


def check_folder_paths(root: Path) -> None:
    """Every entry of the folder, before any file of it is opened: a symbolic link whose target
    lies outside the folder or is missing, and anything that is neither a regular file nor a folder
    (a named pipe blocked the first read forever; a device), is refused. A hard link is a regular
    file of the folder (its other names may lie anywhere: the bytes are the folder's)."""
    real_root = Path(os.path.realpath(root))
    for dirpath, dirs, files in os.walk(root):  # symbolic links to folders are listed, not followed
        for name in dirs + files:
            path = Path(dirpath) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                target = Path(os.path.realpath(path))
                if target != real_root and real_root not in target.parents:
                    raise PipelineFolderError(f"{path}: a symbolic link out of the input folder; onnxopt reads only inside it")
                try:
                    mode = os.stat(path).st_mode
                except OSError:
                    raise PipelineFolderError(f"{path}: a symbolic link to nothing ({os.readlink(path)})") from None
            if not stat.S_ISDIR(mode) and not stat.S_ISREG(mode):
                raise PipelineFolderError(f"{path}: not a regular file (a named pipe, socket or device); "
                                          "a pipeline folder holds files")


def check_component_folders(root: Path) -> None:
    """Each name a pipeline's component or tokenizer folder takes is a folder where it exists: a file
    there was said to be missing (required) or passed unread (optional, such as vae_encoder)."""
    for name in (*MODEL_COMPONENTS, *TOKENIZERS, "scheduler"):
        path = root / name
        if path.exists() and not path.is_dir():
            raise PipelineFolderError(f"{path}: a file where the folder {name}/ of a pipeline belongs")


@dataclass
class PipelineFolder:
    root: Path
    index: dict
    kind: str
    components: dict[str, Component]
    _scheduler_config: dict | None = field(default=None, repr=False, compare=False)

    @classmethod
    def open(cls, path) -> "PipelineFolder":
        root = Path(path)
        if not root.exists():
            raise PipelineFolderError(f"{root}: no such folder")
        if not root.is_dir():
            raise PipelineFolderError(f"{root}: not a folder (expected a pipeline folder with model_index.json)")
        index_path = root / "model_index.json"
        if not index_path.is_file():
            raise PipelineFolderError(f"{root}: not a pipeline folder (no model_index.json)")
        check_folder_paths(root)  # before any file of it is read
        check_component_folders(root)
        index = read_json(index_path)
        kind = kind_of(index, root)
        controlnet_folders(root)  # controlnet_<k>/ without controlnet_<k-1>/: said before what the index names
        check_folder_files(root)
        components = {}
        for name in (*MODEL_COMPONENTS, *controlnet_folders(root)[1:]):
            model = root / name / MODEL_FILE
            if model.is_file():
                data = [root / name / n for n in EXTERNAL_DATA_NAMES if (root / name / n).is_file()]
                config_path = root / name / "config.json"
                config = read_json(config_path) if config_path.is_file() else {}
                components[name] = Component(name, root / name, model, data, config)
        folder = cls(root, index, kind, components)
        folder._check_complete()
        check_index_entries(root, index)  # beyond what the kind needs: every component the index names
        return folder

    def _check_complete(self) -> None:
        refiner_lacks = ("text_encoder", "tokenizer") if self.refiner else ()
        for name in REQUIRED_MODELS[self.kind]:
            if name not in self.components and name not in refiner_lacks:
                raise PipelineFolderError(f"{self.root}: missing component {name}/{MODEL_FILE} ({self.kind} pipeline)")
        optional = [tokenizer for encoder, tokenizer in TOKENIZER_OF.items()
                    if tokenizer in self.family.optional_tokenizers and encoder in self.components]
        for name in (*REQUIRED_TOKENIZERS[self.kind], *optional):
            if name in refiner_lacks:
                continue
            if not (self.root / name).is_dir():
                raise PipelineFolderError(f"{self.root}: missing {name}/ ({self.kind} pipeline)")
        if not (self.root / "scheduler" / "scheduler_config.json").is_file():
            raise PipelineFolderError(f"{self.root}: missing scheduler/scheduler_config.json")

    @property
    def family(self) -> Family:
        """The folder's pipeline family (:mod:`onnxopt.pipeline.families`), as its UNet makes it run (a
        guidance-distilled UNet embeds the guidance: :func:`~onnxopt.pipeline.families.with_unet_config`)."""
        return with_unet_config(FAMILIES[self.kind], self.config("unet"))

    @property
    def denoiser(self) -> str:
        """The denoiser's component: unet or transformer."""
        return self.family.denoiser.component

    @property
    def controlnets(self) -> list[str]:
        """The ControlNet components in order: [] | ["controlnet"] | ["controlnet", "controlnet_1", ...]."""
        names, k = [], 0
        while controlnet_name(k) in self.components:
            names.append(controlnet_name(k))
            k += 1
        return names

    @property
    def merged_step_model(self) -> Path | None:
        """merged_step.onnx: the ControlNet and the UNet step graph as one graph (one run, one
        captured CUDA graph per step), written at the root by onnxopt.pipeline.merged_step; None
        when absent or when the UNet has no step graph."""
        path = self.root / MERGED_STEP_FILE
        unet = self.components.get("unet")
        return path if path.is_file() and unet is not None and unet.step_model is not None else None

    def has(self, name: str) -> bool:
        return name in self.components

    def component(self, name: str) -> Component:
        if name not in self.components:
            raise PipelineFolderError(f"{self.root}: no component {name}/{MODEL_FILE}")
        return self.components[name]

    def config(self, name: str) -> dict:
        """The component's config.json (unet, vae_decoder, text_encoder_2...), {} when absent."""
        return self.components[name].config if name in self.components else {}

    def scheduler_config(self) -> dict:
        """scheduler/scheduler_config.json, read once (as the components' configs are; every image reads it)."""
        if self._scheduler_config is None:
            self._scheduler_config = read_json(self.root / "scheduler" / "scheduler_config.json")
        return dict(self._scheduler_config)

    def tokenizer(self, name: str = "tokenizer"):
        """transformers' CLIPTokenizer from ``<folder>/<name>/`` (the real tokenizer code); the family's
        T5 tokenizer (SD3's ``tokenizer_3``, Flux's ``tokenizer_2``) is T5's (:meth:`t5_tokenizer`)."""
        try:
            from transformers import CLIPTokenizer
        except ImportError as exc:
            raise MissingDependencyError("generating images needs transformers: pip install 'onnxopt[pipeline]'") from exc
        folder = self.root / name
        if name == self.family.t5_tokenizer:
            return self.t5_tokenizer(folder)
        if not (folder / "tokenizer.json").is_file() and not all((folder / f).is_file() for f in ("vocab.json", "merges.txt")):
            # transformers loads a folder without them as a two-token tokenizer: every word its unknown token
            raise PipelineFolderError(f"{folder}: no tokenizer vocabulary (tokenizer.json, or vocab.json and merges.txt)")
        declared = tokenizer_json_model(folder)  # before transformers builds a CLIP BPE tokenizer out of any vocabulary
        if declared not in (None, "BPE"):
            raise PipelineFolderError(f"{folder}: tokenizer.json holds a {declared} tokenizer, not CLIP's BPE "
                                      f"tokenizer, which {name}/ of a {self.kind} pipeline holds (another model's "
                                      "tokenizer?)")
        try:
            tokenizer = CLIPTokenizer.from_pretrained(str(folder))
        except Exception as exc:  # noqa: BLE001 -- the folder's files, parsed by transformers: any failure is the file's
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PipelineFolderError(f"{folder}: cannot load the tokenizer: {first}")
        # the vocabulary's own tokens: transformers adds a missing special token past its end (an id the text
        # encoder has no embedding for); a BPE vocabulary of another model (GPT-2's) lacks CLIP's
        backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers 4's: Python, its .encoder
        vocabulary = backend.get_vocab(with_added_tokens=False) if backend is not None else tokenizer.encoder
        lacks = [token for token in CLIP_SPECIAL_TOKENS if token not in vocabulary]
        if lacks:
            raise PipelineFolderError(f"{folder}: the tokenizer's vocabulary has no {' or '.join(lacks)}: not "
                                      f"CLIP's tokenizer, which {name}/ of a {self.kind} pipeline holds (another "
                                      "model's tokenizer?)")
        if tokenizer.model_max_length > TOKENIZER_NO_LIMIT:
            # no model_max_length in tokenizer_config.json: transformers' "no limit" placeholder (1e30), which
            # the padding cannot use; CLIP's text encoders take 77 positions (optimize's static graphs too)
            tokenizer.model_max_length = CLIP_SEQUENCE
        return tokenizer

    def tokenizers(self) -> dict:
        """name -> tokenizer, for each text encoder the folder's pipeline runs (:attr:`text_encoders`):
        every tokenizer a generation reads, loaded and checked (:meth:`tokenizer`)."""
        return {TOKENIZER_OF[encoder]: self.tokenizer(TOKENIZER_OF[encoder]) for encoder in self.text_encoders}

    def t5_tokenizer(self, folder: Path):
        """transformers' T5TokenizerFast from ``folder``: its tokenizer_config.json when present, else
        ``tokenizer.json`` alone (T5's special tokens are in it), as the folder ships it."""
        from transformers import T5TokenizerFast

        if not (folder / "tokenizer.json").is_file() and not (folder / "spiece.model").is_file():
            raise PipelineFolderError(f"{folder}: no tokenizer vocabulary (tokenizer.json or spiece.model)")
        declared = tokenizer_json_model(folder)  # T5TokenizerFast makes a Unigram of a BPE one: wrong ids
        if declared not in (None, "Unigram"):
            raise PipelineFolderError(f"{folder}: tokenizer.json holds a {declared} tokenizer, not T5's Unigram "
                                      f"(SentencePiece) tokenizer, which {folder.name}/ of a {self.kind} pipeline "
                                      "holds (CLIP's tokenizer in T5's place?)")
        try:
            if (folder / "tokenizer_config.json").is_file():
                return T5TokenizerFast.from_pretrained(str(folder))
            return T5TokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 -- the folder's files, parsed by transformers: any failure is the file's
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PipelineFolderError(f"{folder}: cannot load the tokenizer: {first}")

    @property
    def vae_scale_factor(self) -> int:
        """2 ** (number of VAE blocks - 1), as diffusers computes it; 8 without a VAE config."""
        channels = self.config("vae_decoder").get("block_out_channels")
        return 2 ** (len(channels) - 1) if channels else 8

    @property
    def default_size(self) -> tuple[int, int]:
        """(height, width) in pixels when none is asked: the UNet's sample_size times the VAE factor."""
        sample = self.config(self.denoiser).get("sample_size", 64 if self.kind in ("sd", "lcm", "controlnet") else 128)
        return default_size(self.root, sample, self.config("vae_decoder"), self.denoiser)

    @property
    def refiner(self) -> bool:
        """An SDXL refiner (stabilityai/stable-diffusion-xl-refiner-1.0's layout): model_index.json names
        no text_encoder ([null, null]) and the folder has none; text_encoder_2 alone encodes the prompt."""
        entry = self.index.get("text_encoder")
        named = isinstance(entry, list) and len(entry) == 2 and entry[0] is not None
        return self.kind == "sdxl" and not named and "text_encoder" not in self.components

    @property
    def text_encoders(self) -> tuple[str, ...]:
        """The text encoders diffusers' pipeline runs, in its order (SDXL's two, the refiner's one;
        SD3's third, T5, where the folder has it)."""
        if self.kind == "sdxl" and self.refiner:
            return ("text_encoder_2",)
        return tuple(e for e in ("text_encoder", "text_encoder_2", "text_encoder_3")
                     if e in self.family.required or (e in self.family.optional and self.has(e)))

    @property
    def requires_aesthetics_score(self) -> bool:
        """StableDiffusionXLImg2ImgPipeline's and StableDiffusionXLInpaintPipeline's switch (model_index.json):
        the time ids end with an aesthetic score (6.0, the negative row's 2.5) instead of the target size."""
        return self.kind == "sdxl" and self.index.get("requires_aesthetics_score", False) is True

    @property
    def force_zeros_for_empty_prompt(self) -> bool:
        """SDXL: the negative conditioning is zeros (not the encoded "") when no negative prompt is given."""
        return bool(self.index.get("force_zeros_for_empty_prompt", True)) if self.kind == "sdxl" else False


def folder_scheduler_class(folder: "PipelineFolder") -> str | None:
    """The scheduler class diffusers loads for the folder: model_index.json's ["diffusers", class]
    entry (from_pretrained makes that class, whatever the config's _class_name says), else the
    config's _class_name."""
    entry = getattr(folder, "index", {}).get("scheduler")
    if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str):
        return entry[1]
    return folder.scheduler_config().get("_class_name")
