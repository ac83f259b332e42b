"""TensorRT engines for an optimized pipeline folder (``onnxopt optimize ... --target tensorrt --build-engines``).

    OUT/<component>/model.onnx  ─ build_engine (the code path of ``onnxopt build``) ─►  OUT/<component>/model.plan
                                                                                    + model.plan.json (its report)

Every component (text encoders, UNet, ControlNets, VAE decoder and encoder) gets one engine, built
in the folder before it is renamed into place (the folder appears whole, engines included, or not
at all), for the compute capabilities asked (TensorRT-RTX: any, no GPU needed) or the GPU this runs
on. One timing cache serves every component (``OUT/.trt-timing.cache`` while building; TensorRT-RTX
has none, see :func:`onnxopt.runners.tensorrt.build_engine`).

Shapes: one fixed profile per component, at the folder's default generation size (unet/config.json
``sample_size``, 77 tokens, batch 2 for what classifier-free guidance doubles, 1 for the VAE):
symbolic dims are filled by where they stand (:func:`component_shapes`). Another size is another
engine: ``onnxopt build -i OUT/unet/model.onnx -o ... --profile sample=...``.
"""

from __future__ import annotations

import json
from pathlib import Path

from onnxopt.errors import OnnxoptError

ENGINE_FILE = "model.plan"
REPORT_FILE = "model.plan.json"
TIMING_CACHE = ".trt-timing.cache"
TOKENS = 77
DEFAULT_LATENT = 64


def component_shapes(component: str, inputs: list[tuple[str, list]], latent: int, factor: int) -> dict[str, tuple[int, ...]]:
    """Concrete shapes of a component's inputs at the folder's default size: a symbolic batch dim
    (first) is 1 for a VAE, else 2 (guidance's two halves); the spatial dims of a rank-4 input are
    the latent side, times the VAE factor for a 3-channel image; the second dim of a rank-2 or -3
    input (tokens) is 77. Static dims stay."""
    batch = 1 if component.startswith("vae") else 2
    shapes = {}
    for name, shape in inputs:
        out = []
        for axis, dim in enumerate(shape):
            if isinstance(dim, int) and dim > 0:
                out.append(dim)
            elif axis == 0:
                out.append(batch)
            elif len(shape) == 4 and axis >= 2:
                out.append(latent * factor if shape[1] == 3 else latent)
            else:
                out.append(TOKENS)
        shapes[name] = tuple(out)
    return shapes


def build_folder_engines(folder: Path, components: list[str], compute_capabilities=None) -> dict[str, str]:
    """Build ``<component>/model.plan`` for each of ``components`` of the (not yet renamed) output
    ``folder``; returns a report note per component. Raises OnnxoptError (one line) when one fails."""
    from onnxopt.loading import load_model, read_json_object
    from onnxopt.runners.tensorrt import build_engine, graph_precision, model_inputs

    sample = read_json_object(folder / "unet" / "config.json").get("sample_size") or DEFAULT_LATENT
    latent = int(min(sample) if isinstance(sample, list) else sample)
    vae = read_json_object(folder / "vae_decoder" / "config.json") or read_json_object(folder / "vae_encoder" / "config.json")
    factor = 2 ** (len(vae.get("block_out_channels", (0, 0, 0, 0))) - 1)
    cache = folder / TIMING_CACHE
    notes = {}
    try:
        for name in components:
            model_path = folder / name / "model.onnx"
            model = load_model(model_path)  # weights stay on disk
            shapes = component_shapes(name, model_inputs(model), latent, factor)
            try:  # the engine computes in the graph's own precision: the folder's --fp16 decided it
                info = build_engine(model_path, folder / name / ENGINE_FILE, precision=graph_precision(model),
                                    profiles=shapes, timing_cache=cache, compute_capabilities=compute_capabilities)
            except OnnxoptError as exc:
                raise OnnxoptError(f"{name}: no engine: {exc}") from exc
            (folder / name / REPORT_FILE).write_text(json.dumps(info.as_dict(), indent=2) + "\n")
            notes[name] = (f"engine {ENGINE_FILE}: {info.engine_bytes / 1e6:.1f} MB, {info.build_seconds:.1f} s, "
                           f"{info.tensorrt_version}, compute capability "
                           f"{' '.join(f'{a}.{b}' for a, b in info.compute_capabilities)}, "
                           f"{', '.join(f'{n}={s}' for n, s in shapes.items())}")
    finally:
        cache.unlink(missing_ok=True)  # one cache for the components of this run, not a file of the folder
    return notes
