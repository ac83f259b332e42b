"""Optimize a whole diffusers/optimum ONNX pipeline folder: each component with the preset that fits it.

    FOLDER/                                   OUT/  (appears whole, or not at all)
      model_index.json, scheduler/, tokenizer*/  ─ copied byte for byte ─►  same
      <component>/config.json, other files        ─ copied byte for byte ─►  same
      text_encoder[_2]/model.onnx   ─ ort-cuda | tensorrt [+ fp16]                  ─►  model.onnx [+ data]
                                                                            + model.static.b{b}.onnx
      unet/, controlnet[_k]/model.onnx ─ ort-cuda | tensorrt [+ fp16]               ─►  model.onnx [+ data]
      vae_decoder/, vae_encoder/    ─ ort-cuda | tensorrt [+ fp16, guarded: below]  ─►  model.onnx [+ data]

Presets per component (``target``):
  unet, controlnet[_k] ``ort-cuda`` or ``tensorrt``; ``fp16`` adds the fp16 pass (for TensorRT a strongly
                      typed fp16 graph, as passes/fp16.py recommends).
  text encoders       the target's preset; ``fp16`` adds the fp16 pass.
  VAE                 the target's preset; with ``fp16`` the fp16 pass runs with ``fp32_auto``, calibrated on a
                      latent (decoder) or image (encoder) at the folder's size (unet/config.json
                      ``sample_size``, at most 32x32: see vae_calibration_feed; batch 1; a decoder
                      latent is N(0, 1) / ``scaling_factor``, what the pipeline feeds it). The VAE fp16
                      rule: the fp16 graph is then run on that input next to the fp32 graph; if its output has a NaN/inf, or its relative L2 to fp32 exceeds
                      :data:`VAE_FP16_MAX_REL_L2` (a black or washed-out image is ~1), the VAE is written in
                      fp32 and the report says why.
  anything else       other subfolders holding a ``model.onnx`` are copied unchanged (noted).

Weights keep the source's layout: inline when the source was inline, else one external file with
the source's data name (``model.onnx_data``, ``model.onnx.data``, ``weights.pb``; a source with one
file per tensor gets ``model.onnx_data``); above ~1.8 GB they always go external.

Safety: the output is built in a temporary sibling folder (``.OUT.tmp-XXXX``) and renamed into place
at the end; any error removes it. OUT must not exist, or be an empty folder; it may not be inside
FOLDER nor FOLDER inside it. The input folder is only read (files outside it are never read: a
symbolic link leaving it is refused, and so is external data located outside a component's folder).
Before anything is written the folder is checked as ``generate`` loads it (:meth:`PipelineFolder.open`:
every component its pipeline class needs, the index, the configs; each tokenizer's family where
transformers is installed; the denoiser's in_channels against its graph): a folder generate would
refuse is refused (exit 2), whichever components are asked for.

The text encoders: beside each optimized model.onnx, ``model.static.b{b}.onnx`` for every batch
the pipeline feeds it (input_ids [b, 77]: shape arithmetic folded, ArgMax on the GPU, every node
on the CUDA EP, so ORT can capture it as a CUDA graph; weights referred to in model.onnx's data
file): :mod:`onnxopt.pipeline.static_text`.

The step graph: after the UNet is written, :func:`onnxopt.pipeline.step_graph.write_step_graph` writes
``unet/step.onnx`` beside it (guidance and the scheduler update appended; the UNet's weights referred
to, not copied); a diffusion transformer's is ``transformer/step.onnx`` (SD3: guidance and the
update; Flux, which embeds its guidance: the update alone); with ``cfg_late`` (``--cfg-late``, off
by default until measured on a GPU) what both guidance halves share is computed once in it
(:mod:`onnxopt.passes.cfg_late`). With a ControlNet, ``merged_step.onnx`` at the root holds the ControlNet and that step graph in one graph
(:mod:`onnxopt.pipeline.merged_step`; weights referred to as well). More than one ControlNet
(``controlnet/``, ``controlnet_1/``...: diffusers' MultiControlNetModel layout): each gets the
ControlNet preset and its hint split; the step graph reads one residual set per ControlNet and sums
them (:mod:`onnxopt.pipeline.multi_controlnet`); the two-stream split and the merged step take them all.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnxopt import progress as progress_line
from onnxopt.errors import ModelSaveError, OnnxoptError, VerificationError
from onnxopt.loading import check_external_data
from onnxopt.loading import read_json_object as _read_json  # a config.json, or {} (the defaults apply)
from onnxopt.library_logs import quiet_libraries
from onnxopt.outputs import Inputs, Outputs, staged, temp_folder_beside
from onnxopt.pipeline.controlnet_hint import write_hint_graph
from onnxopt.pipeline.folder import PipelineFolder, controlnet_folders, kind_of, latent_channels
from onnxopt.pipeline.merged_step import write_merged_step
from onnxopt.pipeline.step_graph import write_step_graph
from onnxopt.report import OptimizationReport
from onnxopt.weight_provenance import MAP_SUFFIX
from onnxopt.weights import numpy_dtype

TARGETS = ("ort-cuda", "tensorrt")
CALIBRATION_MAX_LATENT = 32  # latent side of the VAE fp16 calibration (256x256 pixels for SD)
MODEL_FILE = "model.onnx"
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
CLIP_TEXT_ENCODERS = ("text_encoder", "text_encoder_2")  # static graphs at [b, 77] (T5's length is the request's)
DENOISERS = ("unet", "transformer", "controlnet")
VAES = ("vae_decoder", "vae_encoder")
COMPONENTS = TEXT_ENCODERS + DENOISERS + VAES
DEFAULT_DATA_NAME = "model.onnx_data"   # optimum's name
VAE_FP16_MAX_REL_L2 = 1e-2              # fp16 VAE vs fp32 on the calibration input; above: keep fp32
DEFAULT_LATENT_SIZE = 64                # when unet/config.json has no sample_size
# what the optimization writes besides the source's files (a report may not take one of these names)
GENERATED_NAMES = {MODEL_FILE, DEFAULT_DATA_NAME, "model.onnx.data", "weights.pb", "step.onnx", "step.context_kv.onnx",
                   "step.hint.onnx", "step.streams.onnx", "step.streams.down.onnx", "merged_step.onnx"}


@dataclass
class ComponentReport:
    name: str
    passes: list[str]
    precision: str                      # "float32" | "float16" | "bfloat16"
    report: OptimizationReport | None   # None: copied unchanged
    weights_bytes: int = 0
    seconds: float = 0.0
    data_name: str | None = None        # external data file written beside model.onnx, if any
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"component": self.name, "passes": self.passes, "precision": self.precision,
                "weights_mb": round(self.weights_bytes / 1e6, 3), "seconds": round(self.seconds, 3),
                "data_name": self.data_name, "notes": self.notes,
                "report": self.report.as_dict() if self.report else None}


@dataclass
class FolderReport:
    source: str
    destination: str
    target: str
    fp16: bool
    components: list[ComponentReport] = field(default_factory=list)
    copied_files: int = 0
    seconds: float = 0.0

    @property
    def nodes_before(self) -> int:
        return sum(c.report.nodes_before for c in self.components if c.report)

    @property
    def nodes_after(self) -> int:
        return sum(c.report.nodes_after for c in self.components if c.report)

    @property
    def weights_bytes(self) -> int:
        return sum(c.weights_bytes for c in self.components)

    def component(self, name: str) -> ComponentReport:
        return next(c for c in self.components if c.name == name)

    def as_dict(self) -> dict:
        return {"source": self.source, "destination": self.destination, "target": self.target, "fp16": self.fp16,
                "components": [c.as_dict() for c in self.components],
                "total": {"components": len(self.components), "nodes_before": self.nodes_before,
                          "nodes_after": self.nodes_after, "seconds": round(self.seconds, 3),
                          "weights_mb": round(self.weights_bytes / 1e6, 3), "copied_files": self.copied_files}}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, default=str)

    def verdict(self, atol: float, rtol: float) -> str:
        """What ``verify`` compared, and how it came out (a failure raised before: nothing was written)."""
        checked = [c for c in self.components if c.report and c.report.final_verification]
        if not checked:
            return "verify: no component was compared (none was optimized)"
        errors = ", ".join(f"{c.name} {c.report.final_verification.max_abs_error:.1e}" for c in checked)
        return (f"verify: each of {len(checked)} component{'s' if len(checked) > 1 else ''} equals its source within atol={atol:g}, rtol={rtol:g} "
                f"after every pass, on random inputs (max abs err: {errors}); the graphs written from them "
                "(step.onnx, static text encoders, merged step) are not compared")

    def table(self) -> str:
        header = ["component", "passes", "precision", "nodes", "weights MB", "s"]
        rows = []
        for c in self.components:
            nodes = f"{c.report.nodes_before} -> {c.report.nodes_after}" if c.report else "copied"
            rows.append([c.name, ",".join(c.passes) or "-", c.precision, nodes, f"{c.weights_bytes / 1e6:.1f}",
                         f"{c.seconds:.1f}"])
        total = ["total", f"{len(self.components)} components", "", f"{self.nodes_before} -> {self.nodes_after}",
                 f"{self.weights_bytes / 1e6:.1f}", f"{self.seconds:.1f}"]
        widths = [max(len(h), *(len(r[i]) for r in rows + [total])) for i, h in enumerate(header)]

        def fmt(r):
            return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

        rule = "  ".join("-" * w for w in widths)
        lines = [fmt(header), rule, *map(fmt, rows), rule, fmt(total)]
        lines += [f"  {c.name}: {n}" for c in self.components for n in c.notes]
        lines.append(f"  {self.copied_files} other files copied unchanged")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------- the folder

@dataclass
class PipelineComponent:
    name: str
    model_path: Path
    data_files: list[str]               # external data file names (relative to the component folder)


def read_components(folder: Path) -> list[PipelineComponent]:
    """The ONNX components of a pipeline folder (subfolders holding ``model.onnx``), in folder order."""
    import onnx
    from onnx import external_data_helper

    if not folder.is_dir():
        raise OnnxoptError(f"{folder}: not a folder")
    if not (folder / "model_index.json").is_file():
        raise OnnxoptError(f"{folder}: no model_index.json: not a diffusers/optimum pipeline folder")
    # the checks generate makes when it loads the folder (every path before any file is opened, the index, the
    # configs, every component the pipeline class needs and every one the index names): a folder they refuse
    # would be written, and generate would refuse it after optimize said it worked
    pipeline = PipelineFolder.open(folder)
    if importlib.util.find_spec("transformers") is not None:  # optimizing needs no transformers (the cpu extra)
        pipeline.tokenizers()  # each loaded and checked as generate loads it: another model's tokenizer is refused
    out = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        path = sub / MODEL_FILE
        if not path.exists():
            continue
        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception:               # not ONNX: load_model reports it with the reason, later
            out.append(PipelineComponent(sub.name, path, []))
            continue
        if sub.name == pipeline.denoiser:  # its config says what latents the run makes: the graph must take them
            check_latent_input(pipeline, proto)
        # every component's external data where its graph says, inside its folder: before the first is optimized
        check_external_data(proto, sub, str(path))
        names = []
        for t in external_data_helper._get_all_tensors(proto):
            for kv in t.external_data:
                if kv.key == "location" and kv.value not in names:
                    names.append(kv.value)
        out.append(PipelineComponent(sub.name, path, names))
    if not any(is_component(c.name) for c in out):
        raise OnnxoptError(f"{folder}: no component folder ({', '.join(COMPONENTS)}) holds a {MODEL_FILE}")
    return out


def check_latent_input(pipeline: PipelineFolder, proto) -> None:
    """The denoiser graph takes the latents its config.json makes, as generate checks on its session
    (:func:`~onnxopt.pipeline.folder.latent_channels`), or a one-line PipelineFolderError."""
    name = pipeline.denoiser
    latent = next((i for i in proto.graph.input if i.name == pipeline.family.denoiser.sample), None)
    if latent is None:
        return  # not a denoiser graph at all: the step graph names it (optimize) as the load does (generate)
    shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in latent.type.tensor_type.shape.dim]
    latent_channels(pipeline.root, name, pipeline.config(name), shape)


def plan_outputs(src: Path, dst: Path, report_json=None) -> tuple[Path, Path | None, Outputs]:
    """Check, before any work, the folder to write and the report beside it (:mod:`onnxopt.outputs`):
    (the folder to build, the report's path inside it or None, the outputs)."""
    outputs = Outputs(Inputs().folder(src))
    folder = outputs.folder(dst)
    if report_json is None:
        return folder, None, outputs
    report = Path(report_json)
    real, into = Path(os.path.realpath(report)), Path(os.path.realpath(folder))
    if into not in real.parents:
        outputs.file(report, "--report-json")  # also refuses the output folder itself
        return folder, None, outputs
    inside = real.relative_to(into)  # written into the folder before it appears: both or neither
    if (src / inside).exists() or inside.name in GENERATED_NAMES or inside.name.startswith("model.static.") \
            or inside.name.endswith(MAP_SUFFIX):
        raise ModelSaveError(f"{report}: --report-json would replace {inside}, a file of the output folder")
    if not (src / inside).parent.is_dir():
        raise ModelSaveError(f"{report}: folder {inside.parent} is not in the output folder")
    return folder, inside, outputs


# ----------------------------------------------------------------------------------- presets

def is_component(name: str) -> bool:
    """A component folder onnxopt optimizes: COMPONENTS, and controlnet_1, controlnet_2..."""
    return name in COMPONENTS or is_controlnet(name)


def is_controlnet(name: str) -> bool:
    suffix = name[len("controlnet_"):]
    return name == "controlnet" or (name.startswith("controlnet_") and suffix.isdigit() and not suffix.startswith("0"))


def component_passes(name: str, target: str, fp16: bool) -> list[str]:
    """Passes and presets for one component (see the module docstring)."""
    if target not in TARGETS:
        raise OnnxoptError(f"unknown target '{target}'; choose one of {', '.join(TARGETS)}")
    # One target for the whole folder: a ``tensorrt`` folder is standard ONNX throughout, so it also
    # runs on any ONNX Runtime EP (the CPU one included), which an ort-cuda VAE's NhwcConv does not.
    return [target, "fp16"] if fp16 else [target]


def vae_calibration_feed(model, name: str, folder: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """One input for the VAE: latent N(0,1)/scaling_factor (decoder), or an image uniform in [-1, 1]
    (encoder); batch 1, latent side = unet sample_size, at most :data:`CALIBRATION_MAX_LATENT`.

    Why a smaller side is enough: the VAE's values are made by convolutions (local: a pixel's value
    does not depend on the image size), GroupNorms (normalized) and one mid-block attention whose
    softmax is normalized too, so their range does not grow with the image. Why it matters: on a
    machine without the CUDA EP the calibration and the check run the fused graph on the CPU (the
    reference kernels where ORT's CPU build lacks one), minutes for SD 1.5's VAE at 64x64.
    """
    unet_cfg = _read_json(folder / "unet" / "config.json") or _read_json(folder / "transformer" / "config.json")
    vae_cfg = _read_json(folder / name / "config.json")
    sample = unet_cfg.get("sample_size") or DEFAULT_LATENT_SIZE  # checked by check_folder_files: n or [h, w]
    side = min(min(sample) if isinstance(sample, list) else int(sample), CALIBRATION_MAX_LATENT)
    factor = 2 ** (len(vae_cfg.get("block_out_channels", (0, 0, 0, 0))) - 1)
    scaling = float(vae_cfg.get("scaling_factor", 0.18215))
    rng = np.random.default_rng(seed)
    (inp,) = model.graph.inputs
    channels = inp.shape[1] if isinstance(inp.shape[1], int) else (4 if name == "vae_decoder" else 3)
    if name == "vae_decoder":
        x = rng.standard_normal((1, channels, side, side)).astype(np.float32) / scaling
    else:
        x = rng.uniform(-1, 1, (1, channels, side * factor, side * factor)).astype(np.float32)
    return {inp.name: x}


def _run_once(model, feed: dict) -> dict[str, np.ndarray]:
    """Run ``model`` where the check is fastest and truest: ONNX Runtime's CUDA EP when this ORT has
    it (real fp16 arithmetic, every contrib op, TF32 off), else ORT CPU, or onnxopt's reference
    kernels when ORT's CPU build lacks one (``ONNXOPT_CALIBRATION_DEVICE=cpu`` keeps it off the GPU)."""
    from onnxopt.precision import checks_on_cuda
    from onnxopt.verify import _quiet, runner_for

    feed = {k: v.astype(_input_dtype(model, k)) for k, v in feed.items()}
    with tempfile.TemporaryDirectory(prefix="onnxopt-vae-check-") as work, _quiet():
        if checks_on_cuda():
            out = _run_on_cuda(model, feed, Path(work))
        else:
            runner = runner_for(model, "check", Path(work))
            with runner:
                out = runner.infer(feed)
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def _run_on_cuda(model, feed: dict, work: Path) -> dict[str, np.ndarray]:
    from onnxopt.precision import CUDA_CHECK_PROVIDERS
    from onnxopt.runtime import import_onnxruntime, inference_session, run_session
    from onnxopt.saving import save_model

    path = save_model(model, work / "check.onnx", external_data=True).path
    session = inference_session(path, CUDA_CHECK_PROVIDERS)  # quiet: cuDNN's discarded plans logged 18 [E:...] lines
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, run_session(import_onnxruntime(), session, names, feed)))  # bf16 I/O too


def _input_dtype(model, name):
    return next(numpy_dtype(t.dtype) for t in model.graph.inputs if t.name == name)


def fp16_vae_error(fp32_model, fp16_model, feed) -> tuple[float, bool]:
    """(relative L2 of the fp16 output to fp32, finite) on ``feed``."""
    ref, got = _run_once(fp32_model, feed), _run_once(fp16_model, feed)
    worst, finite = 0.0, True
    for k, r in ref.items():
        g = got[k]
        finite = finite and bool(np.isfinite(g).all())
        denom = float(np.linalg.norm(r)) or 1.0
        worst = max(worst, float(np.linalg.norm(np.nan_to_num(g - r, nan=np.inf, posinf=np.inf)) / denom))
    return worst, finite


# ----------------------------------------------------------------------------------- optimize

def _data_name(component: PipelineComponent) -> str | None:
    if not component.data_files:
        return None
    name = component.data_files[0]
    # one file beside model.onnx keeps its name; a file in a subfolder ("sub/w.bin") or several files: optimum's name
    return name if len(component.data_files) == 1 and Path(name).name == name else DEFAULT_DATA_NAME


def _optimize_component(component: PipelineComponent, out_dir: Path, src: Path, target: str, fp16: bool,
                        verify: bool, tolerance, fp16_options: dict, vae_max_rel_l2: float) -> ComponentReport:
    from onnxopt.api import optimize
    from onnxopt.loading import load_model
    from onnxopt.saving import save_model

    start = time.perf_counter()
    name = component.name
    passes = component_passes(name, target, fp16)
    notes = []
    options = {"fp16": dict(fp16_options)} if fp16 else {}
    # Optimize from the path (weights stay lazy, as for one model); only the VAE's fp16 check keeps the source.
    source, feed = component.model_path, None
    if fp16 and name in VAES:
        source = load_model(component.model_path)
        feed = vae_calibration_feed(source, name, src)
        options["fp16"].update(fp32_auto=True, calibration=feed)
    model, report = optimize(source, passes, verify=verify, tolerance=tolerance, options=options)
    if report.first_broken_pass:
        raise VerificationError(f"{name}: verification failed at pass '{report.first_broken_pass}'; nothing written")
    precision = fp16_options.get("low_precision", "float16") if fp16 else "float32"  # what the fp16 pass wrote
    if feed is not None:
        error, finite = fp16_vae_error(source, model, feed)
        if not finite or error > vae_max_rel_l2:
            why = "non-finite output" if not finite else f"relative L2 {error:.2e} > {vae_max_rel_l2:.0e}"
            notes.append(f"kept float32: fp16 with fp32_auto gave {why} on a calibration input at the folder's size")
            passes = passes[:-1]
            model, report = optimize(source, passes, verify=verify, tolerance=tolerance)
            precision = "float32"
        else:
            notes.append(f"fp16 with fp32_auto: relative L2 {error:.2e} to fp32 on a calibration input at the "
                         f"folder's size")
    notes += _refusal_notes(report)
    data_name = _data_name(component)
    info = save_model(model, out_dir / MODEL_FILE, external_data=True if data_name else None,
                      data_location=data_name, weight_map=True)
    written = info.data_path.name if info.data_path else None
    return ComponentReport(name, passes, precision, report, info.weights_nbytes, time.perf_counter() - start,
                           written, notes)


def _refusal_notes(report) -> list[str]:
    """A site a fusion of the preset refused, by reason: the folder summary says what stayed unfused
    (as the one-model table does), not only --report-json."""
    from onnxopt import registry

    notes = []
    for p in report.passes:
        if not getattr(registry.get_pass(p.name), "is_fusion", False):
            continue
        for reason, count in p.result.refusal_counts().most_common():
            notes.append(f"{p.label}: refused {count} site(s): {reason}")
    return notes


def _copy_unchanged(src: Path, tmp: Path, skip: set[Path]) -> int:
    """Copy every file of ``src`` not in ``skip`` into ``tmp`` (same relative paths), byte for byte."""
    n = 0
    for root, dirs, files in os.walk(src):
        dirs.sort()
        rel = Path(root).relative_to(src)
        (tmp / rel).mkdir(parents=True, exist_ok=True)
        for f in sorted(files):
            p = Path(root) / f
            if p in skip:
                continue
            shutil.copyfile(p, tmp / rel / f)
            n += 1
    return n


def optimize_folder(src, dst, target: str = "ort-cuda", fp16: bool = False, verify: bool = False, *,
                    tolerance=None, fp16_options: dict | None = None,
                    vae_max_rel_l2: float = VAE_FP16_MAX_REL_L2, step_graph: bool = True,
                    context_kv: bool = True, cfg_late: bool = False, merged_step: bool = True,
                    static_text: bool = True, report_json=None, progress: bool = False,
                    engines_for: list | None = None, components=None) -> FolderReport:
    """Optimize every ONNX component of the pipeline folder ``src`` into the new folder ``dst``.

    ``target``: "ort-cuda" or "tensorrt", the preset of every component. ``fp16``: add the fp16
    pass (VAE guarded, see the module docstring). ``verify``: compare after every pass (raises
    VerificationError, exit 1, and writes nothing when a pass breaks the tolerance).
    ``fp16_options``: extra options of the fp16 pass for every component. ``step_graph``: write
    ``unet/step.onnx``; ``context_kv``: with its cross-attention K/V cut into
    ``unet/step.context_kv.onnx``, run once per prompt (:func:`write_step_graph`); ``cfg_late``:
    with what both guidance halves share computed once (:mod:`onnxopt.passes.cfg_late`);
    ``merged_step``: with a ControlNet, also ``merged_step.onnx`` at the root, the ControlNet and the
    step graph in one graph (:func:`onnxopt.pipeline.merged_step.write_merged_step`).
    ``static_text``: beside each text encoder, ``model.static.b{b}.onnx`` for each batch the
    pipeline feeds it, every node on the CUDA EP so it can be captured
    (:mod:`onnxopt.pipeline.static_text`).
    ``report_json``: also write the report as JSON there, with the folder: both or neither (inside
    ``dst`` it is written into the folder before the folder appears). ``progress``: a status line
    (component, pass) on stderr when it is a terminal.
    Every path of ``src`` is checked before any file of it is read (:func:`check_folder_paths`), and
    every output before any work (:func:`plan_outputs`): OnnxoptError (exit 2) for a bad folder or
    destination, and ``dst`` then does not exist. Library log lines stay quiet
    (:mod:`onnxopt.library_logs`).
    ``engines_for`` (target tensorrt): also a TensorRT engine per component, for these compute
    capabilities (``[]``: this GPU's; :mod:`onnxopt.runners.folder_engines`).
    ``components``: the names of the components to optimize (None: every one); the others are
    copied unchanged, and the folder is checked whole either way (a folder generate refuses is
    refused, whichever components are asked for).
    """
    src, dst = Path(src), Path(dst)
    start = time.perf_counter()
    if target not in TARGETS:
        raise OnnxoptError(f"unknown target '{target}'; choose one of {', '.join(TARGETS)}")
    if engines_for is not None and target != "tensorrt":
        raise OnnxoptError("--build-engines builds TensorRT engines: it goes with --target tensorrt")
    found = read_components(src)
    if components is not None:
        known = [c.name for c in found if is_component(c.name)]
        unknown = sorted(set(components) - set(known))
        if unknown:
            raise OnnxoptError(f"{src}: no component {', '.join(unknown)} to optimize (it has {', '.join(known)})")
        found = [c for c in found if c.name in components]  # the others are copied as they are
    components = found
    controlnets = controlnet_folders(src)  # refuses controlnet_<k>/ without controlnet_<k-1>/
    dst, report_inside, _ = plan_outputs(src, dst, report_json)
    report = FolderReport(str(src), str(dst), target, fp16)
    tmp = temp_folder_beside(dst)
    try:
        with quiet_libraries(), staged() as stage, progress_line.status(progress) as line:
            _build(src, tmp, report, components, controlnets, target, fp16, verify, tolerance, fp16_options or {},
                   vae_max_rel_l2, step_graph, context_kv, cfg_late, merged_step, static_text, line)
            if engines_for is not None:  # engines inside the folder before it appears
                line.show("TensorRT engines")
                _build_engines(tmp, components, engines_for, report)
            report.seconds = time.perf_counter() - start
            if report_inside is not None:
                if (tmp / report_inside).exists():
                    raise ModelSaveError(f"{report_json}: --report-json would replace {report_inside}, a file of the "
                                         "output folder")
                (tmp / report_inside).write_text(report.to_json())
            elif report_json is not None:
                stage.text(report_json, report.to_json())  # renamed once the folder is in place
            if dst.exists():
                dst.rmdir()                 # empty (checked); rename cannot replace a folder on every OS
            os.replace(tmp, dst)
    except BaseException as exc:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        elif dst.exists() and report_json is not None and report_inside is None:  # the report could not be renamed
            shutil.rmtree(dst, ignore_errors=True)
        if isinstance(exc, OnnxoptError) and exc.args and str(tmp) in str(exc.args[0]):
            # the message named a file of the temporary folder, just removed: name the source's file instead
            exc.args = (str(exc.args[0]).replace(str(tmp), str(src)), *exc.args[1:])
        raise
    return report


def _build(src: Path, tmp: Path, report: FolderReport, components, controlnets, target, fp16, verify, tolerance,
           fp16_options, vae_max_rel_l2, step_graph, context_kv, cfg_late, merged_step, static_text, line) -> None:
    """Write the optimized folder into ``tmp`` (see :func:`optimize_folder`)."""
    from onnxopt.pipeline.families import FAMILIES

    optimized = [c for c in components if is_component(c.name)]
    skip = {c.model_path for c in optimized}
    skip |= {c.model_path.parent / f for c in optimized for f in c.data_files}
    report.copied_files = _copy_unchanged(src, tmp, skip)
    t5_encoder = FAMILIES[kind_of(_read_json(src / "model_index.json"), src)].t5_encoder  # Flux's: text_encoder_2
    for number, c in enumerate(components, 1):
        line.show(f"[{number}/{len(components)}] {c.name}")
        if not is_component(c.name):
            report.components.append(ComponentReport(c.name, [], "unchanged", None, notes=[
                "not a known pipeline component: copied unchanged"]))
            continue
        report.components.append(_optimize_component(
            c, tmp / c.name, src, target, fp16, verify, tolerance, fp16_options, vae_max_rel_l2))
        if c.name in CLIP_TEXT_ENCODERS and c.name != t5_encoder and static_text:
            line.detail("static text encoder graphs")
            report.components[-1].notes.append(_write_static_text(src, tmp, c.name))
        if c.name == "transformer" and step_graph:
            line.detail("step graph")
            write_step_graph(tmp / "transformer", context_kv=False, denoiser=_denoiser(src))
            report.components[-1].notes.append("step graph written (onnxopt.pipeline.step_graph)")
        if c.name == "unet" and step_graph:
            line.detail("step graph")
            denoiser = _denoiser(src)
            if not denoiser.classifier_free_guidance and cfg_late:  # nothing both guidance rows share: there are none
                report.components[-1].notes.append("cfg-late skipped: the UNet embeds the guidance (one row per image)")
            step = write_step_graph(tmp / "unet", context_kv=context_kv,
                                    cfg_late=cfg_late and denoiser.classifier_free_guidance,
                                    controlnets=max(1, len(controlnets)), denoiser=denoiser)
            context = step.with_name("step.context_kv.onnx").is_file()
            report.components[-1].notes.append(
                "step graph written (onnxopt.pipeline.step_graph)"
                + (", cross-attention K/V once per prompt in step.context_kv.onnx" if context else "")
                + (f", cfg-late: {_cfg_late_note(step)}" if cfg_late and denoiser.classifier_free_guidance else "")
                + (f", the residuals of {len(controlnets)} ControlNets summed" if len(controlnets) > 1 else ""))
        if is_controlnet(c.name) and step_graph and write_hint_graph(tmp / c.name) is not None:
            report.components[-1].notes.append("hint once per image: step.hint.onnx + step.onnx "
                                               "(onnxopt.pipeline.controlnet_hint)")
    if not {"unet", *controlnets} <= {c.name for c in components}:
        return  # the graphs below read the optimized UNet and every ControlNet, and one of them was not asked for
    if step_graph and merged_step and controlnets:
        line.show("merged step graph")
        report.component("controlnet").notes.append(_merge_step(tmp, controlnets))
    if step_graph and controlnets:
        line.show("two-stream step graphs")
        report.component("unet").notes.append(_split_for_two_streams(tmp, controlnets))


def _denoiser(src: Path):
    """The folder family's denoiser interface (:mod:`onnxopt.pipeline.families`), as its UNet makes it
    (a guidance-distilled UNet's step graph runs one row per image: no classifier-free guidance)."""
    from onnxopt.pipeline.families import FAMILIES, with_unet_config

    family = FAMILIES[kind_of(_read_json(src / "model_index.json"), src)]
    unet_config = src / "unet" / "config.json"
    return with_unet_config(family, _read_json(unet_config) if unet_config.is_file() else {}).denoiser


def _build_engines(tmp: Path, components, engines_for: list, report: FolderReport) -> None:
    """A TensorRT engine beside each optimized component's graph (:mod:`onnxopt.runners.folder_engines`)."""
    from onnxopt.runners.folder_engines import build_folder_engines

    names = [c.name for c in components if is_component(c.name)]
    for name, note in build_folder_engines(tmp, names, engines_for).items():
        report.component(name).notes.append(note)


def _write_static_text(src: Path, tmp: Path, name: str) -> str:
    """Write the text encoder's static graphs (one per batch the runner feeds); the report's note."""
    from onnxopt.errors import UnsupportedModelError
    from onnxopt.pipeline.folder import kind_of
    from onnxopt.pipeline.static_text import DEFAULT_SEQUENCE, text_batches, write_static_text_encoders

    tokenizer = _read_json(src / ("tokenizer_2" if name == "text_encoder_2" else "tokenizer") / "tokenizer_config.json")
    sequence = int(tokenizer.get("model_max_length") or DEFAULT_SEQUENCE)
    if sequence > 4096:  # transformers' "no limit" placeholder: the pipeline then pads to 77 as CLIP does
        sequence = DEFAULT_SEQUENCE
    batches = text_batches(kind_of(_read_json(src / "model_index.json"), src))
    try:
        written = write_static_text_encoders(tmp / name, batches, sequence)
    except UnsupportedModelError as exc:
        return f"no static graph (CUDA graph capture): {exc}"
    off = max(len(nodes) for _, nodes in written)
    where = "every node on the CUDA EP" if not off else f"{off} nodes not verified for the CUDA EP"
    return (f"static graphs for CUDA graph capture: {', '.join(p.name for p, _ in written)} "
            f"(input_ids [{'|'.join(map(str, batches))}, {sequence}], {where})")


def _cfg_late_note(step_path: Path) -> str:
    import onnx

    from onnxopt.passes.cfg_late import CFG_LATE_METADATA

    props = {p.key: p.value for p in onnx.load(str(step_path), load_external_data=False).metadata_props}
    return props.get(CFG_LATE_METADATA, "nothing moved")


def _split_for_two_streams(folder: Path, controlnets: list[str]) -> str:
    """Write unet/step.streams[.down].onnx (the two-stream step); the report's note."""
    import onnx

    from onnxopt.errors import UnsupportedModelError
    from onnxopt.pipeline.multi_controlnet import interface_name
    from onnxopt.pipeline.two_streams import write_two_stream_graphs

    step = folder / "unet" / "step.onnx"
    if not step.is_file():
        return "two streams: no unet/step.onnx"
    residuals = []
    for k, name in enumerate(controlnets):
        controlnet = folder / name / ("step.onnx" if (folder / name / "step.onnx").is_file() else "model.onnx")
        outputs = onnx.load(str(controlnet), load_external_data=False).graph.output
        residuals += [interface_name(o.name, k) for o in outputs]
    try:
        write_two_stream_graphs(folder / "unet", residuals)
    except UnsupportedModelError as exc:
        return f"two streams: not split: {exc}"
    return "two streams (default on cuda/tensorrt): step.streams.down.onnx beside the ControlNet(s), then step.streams.onnx"


def _merge_step(folder: Path, controlnets: list[str]) -> str:
    """Write merged_step.onnx; the report's note (a merge that does not fit leaves the graphs separate)."""
    from onnxopt.errors import UnsupportedModelError

    try:
        path = write_merged_step(folder, controlnets=controlnets)
    except UnsupportedModelError as exc:
        return f"ControlNet and step graph kept separate: {exc}"
    if path is None:
        return "ControlNet and step graph kept separate: no unet/step.onnx"
    return (f"one graph per step: merged_step.onnx ({' + '.join(controlnets)} + unet/step.onnx, "
            "onnxopt.pipeline.merged_step)")


# ----------------------------------------------------------------------------------- CLI

def cli_optimize_folder(args) -> int:
    """``onnxopt optimize -i FOLDER -o OUT --target ...``: called by onnxopt.cli for a folder input."""
    from onnxopt.verify import Tolerance

    if args.passes is not None:
        raise OnnxoptError("a pipeline folder takes --target (each component gets its preset), not --passes")
    if getattr(args, "calibration", None):
        raise OnnxoptError("--calibration is for one model; a folder's VAE is calibrated at the folder's size")
    if args.shape or args.dim or args.external_data is not None or args.strict:
        raise OnnxoptError("--shape/--dim/--external-data/--strict are for one model file, not a pipeline folder")
    from onnxopt.cli_args import fp16_options

    fp16_flags = fp16_options(args)
    if fp16_flags and not args.fp16:
        raise OnnxoptError("fp16 options need --fp16")
    report = optimize_folder(args.input, args.output, target=args.target or "ort-cuda", fp16=args.fp16,
                             verify=args.verify, tolerance=Tolerance(args.atol, args.rtol), fp16_options=fp16_flags,
                             context_kv=args.context_kv, cfg_late=getattr(args, "cfg_late", False),
                             report_json=args.report_json, progress=not args.quiet,
                             engines_for=_engines_for(args))
    if not args.quiet:
        print(report.table())
    if args.verify:
        print(report.verdict(args.atol, args.rtol))
    if not args.quiet:
        print(f"wrote {args.output}: {report.weights_bytes / 1e6:.1f} MB of weights, {report.seconds:.1f} s in all")
    return 0


def _engines_for(args) -> list | None:
    """``--build-engines [--compute-capability X.Y ...]``: the capabilities to build for ([]: this GPU), or None."""
    capabilities = [c for group in getattr(args, "compute_capability", None) or [] for c in group]
    if capabilities and not getattr(args, "build_engines", False):
        raise OnnxoptError("--compute-capability goes with --build-engines")
    return capabilities if getattr(args, "build_engines", False) else None
