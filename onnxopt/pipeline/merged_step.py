"""The whole denoising step in one graph: ControlNet and UNet step graph merged.

A ControlNet step used to be three session runs, each bound and captured on its own::

    prepare (tiny):       latents, step_index, schedule_* ─ sample = concat([latents * c_in] * 2), timestep
    controlnet/step.onnx: sample, timestep, encoder_hidden_states, controlnet_hint, conditioning_scale
                          ─ down_block_res_{i}, mid_block_res
    unet/step.onnx:       latents, state, step_index, schedule_*, guidance_scale, conditioning,
                          down_block_res_{i}, mid_block_res ─ latents_out, state_out, step_index_out, guided_output

:func:`build_merged_step` writes them as one graph, so the runner binds one IOBinding per parity
and ORT captures one CUDA graph per step::

    latents, step_index, schedule_timesteps, schedule_coefficients
        ─ controlnet/prepare/... (the prepare graph's nodes, :func:`emit_controlnet_inputs`) ─ sample, timestep ─┐
    encoder_hidden_states, controlnet_hint (or controlnet_cond), conditioning_scale ────────────────────────────┤
        ControlNet nodes, every tensor and node renamed controlnet/<name> ─ residuals ─┐                        │
    the UNet step graph, unchanged, reading the residuals where it read its inputs ────┴─ latents_out, state_out,
                                                                                          step_index_out, guided_output

The interface is the UNet step graph's (the pipeline contract) less the residual inputs, plus
the ControlNet's own inputs other than ``sample`` and ``timestep`` (an input both graphs read,
``encoder_hidden_states``, is one input: same name, same type, else the merge is refused). The
once-per-prompt and once-per-image companions (``unet/step.context_kv.onnx``,
``controlnet/step.hint.onnx``) stay where they are: their outputs feed the merged graph's inputs of
the same names, as they fed the separate graphs. The ControlNet's intermediate shape annotations
are dropped (ORT infers them at load): two exports may use one symbolic dim name for different
dims, and ORT plans buffers on declared shapes.

Weights are never written twice: :func:`write_merged_step` saves the merged graph at the pipeline
folder's root (``merged_step.onnx``: an ONNX external-data location must lie inside the model's
folder, and the root holds both components), its initializers referring to the components' own
data files (``unet/model.onnx_data``, ``controlnet/model.onnx_data``). A component stored inline
has no data file to refer to: its weights are then written into the merged file too, as
``unet/step.onnx`` already copies an inline UNet's.

More than one ControlNet (``controlnet_1/``...; :mod:`onnxopt.pipeline.multi_controlnet`): the
step graph then reads one residual set per ControlNet and sums them, and each ControlNet is merged
in turn (``build_merged_step(..., index=k)``), its nodes and inner tensors prefixed
``controlnet_<k>/``, its own inputs and residuals named ``controlnet_<k>.<name>`` (the step graph's
names for them); ``encoder_hidden_states`` stays one input. Each merged ControlNet gets its own
copy of the few prepare nodes (a Mul and a Concat on the latents: not worth sharing).

Why graphsurgeon and not ``onnx.compose.merge_models``: that works on loaded ModelProtos (weights
and all, under protobuf's 2 GB) and keeps each model's external-data locations relative to its own
folder; here the graphs stay onnxopt Models whose weights are never read, and saving rewrites the
locations relative to the root.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.errors import UnsupportedModelError
from onnxopt.fusion import Emit, NameAuthority
from onnxopt.graph_edit import redirect_consumers
from onnxopt.model import Model
from onnxopt.pipeline.folder import MERGED_STEP_FILE
from onnxopt.weights import numpy_dtype

CONTROLNET_PREFIX = "controlnet/"
CONTROLNET_STEP_INPUTS = ("sample", "timestep")  # what the prepare nodes compute inside the merged graph
PREPARE_INPUTS = ("latents", "step_index", "schedule_timesteps", "schedule_coefficients")
METADATA_KEY = "onnxopt.merged_step"


def emit_controlnet_inputs(make: Emit, latents: gs.Tensor, step_index: gs.Tensor, timesteps: gs.Tensor,
                           coefficients: gs.Tensor, *, sample_dtype, timestep_dtype,
                           timestep_shape: tuple) -> tuple[gs.Variable, gs.Variable]:
    """The ControlNet's per-step ``sample`` and ``timestep``, computed where the latents live (as
    the step graph computes its UNet's)::

        step_index ─ Gather(schedule_coefficients) ─ Slice(column 0) ─ c_in ─┐
        latents (float32) ──────────────────────────────────────────────── Mul ─ [Cast] ─ Concat([scaled] * 2) ─ sample
        step_index ─ Gather(schedule_timesteps) ─ [Cast] ─ [Reshape to [] | Identity | Expand to [2b]] ─ timestep

    ``timestep_shape`` is the ControlNet's timestep: () a scalar, (1,) one value, else one per row.
    """
    int64 = np.dtype(np.int64)
    row = make.op.Gather(coefficients, step_index, axis=0, _shape=[1, 6])
    first = make.constant("column0", np.array([0], np.int64))
    one = make.constant("column1", np.array([1], np.int64))
    c_in = make.op.Slice(row, first, one, one, _shape=[1, 1])
    scaled = make.op.Mul(latents, c_in)
    if np.dtype(sample_dtype) != numpy_dtype(latents.dtype):
        scaled = make.op.Cast(scaled, to=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(sample_dtype)),
                              _dtype=np.dtype(sample_dtype))
    sample = make.op.Concat(scaled, scaled, axis=0, _shape=None)
    t = make.op.Gather(timesteps, step_index, axis=0, _shape=[1])
    if np.dtype(timestep_dtype) != numpy_dtype(timesteps.dtype):
        t = make.op.Cast(t, to=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(timestep_dtype)),
                         _dtype=np.dtype(timestep_dtype))
    if len(timestep_shape) == 0:
        timestep = make.op.Reshape(t, make.constant("scalar_shape", np.zeros([0], np.int64)), _shape=[])
    elif tuple(timestep_shape) == (1,):
        timestep = make.op.Identity(t)
    else:
        batch = make.op.Shape(sample, start=0, end=1, _dtype=int64, _shape=[1])
        timestep = make.op.Expand(t, batch, _shape=None)
    return sample, timestep


def build_merged_step(unet_step: Model, controlnet: Model, *, index: int = 0) -> Model:
    """One graph computing what ``controlnet`` (its step graph, or its whole model) followed by the
    UNet step graph ``unet_step`` compute (see the module docstring). Both models are consumed:
    the result is built from their graphs (weights shared, never copied). ``index``: the
    ControlNet's place k among several (its names, see the module docstring). Raises
    :class:`UnsupportedModelError` when they do not fit together."""
    from onnxopt.pipeline.folder import controlnet_name
    from onnxopt.pipeline.multi_controlnet import interface_name

    step, cn = unet_step.graph, controlnet.graph
    prefix = f"{controlnet_name(index)}/"
    for tensor in [*cn.inputs, *cn.outputs]:  # its interface under the names the step graph reads
        tensor.name = interface_name(tensor.name, index)
    step_inputs = {t.name: t for t in step.inputs}
    cn_inputs = {t.name: t for t in cn.inputs}
    missing = [name for name in PREPARE_INPUTS if name not in step_inputs]
    if missing:
        raise UnsupportedModelError(f"not a UNet step graph: no input {', '.join(missing)}")
    missing = [name for name in CONTROLNET_STEP_INPUTS if name not in cn_inputs]
    if missing:
        raise UnsupportedModelError(f"not a ControlNet graph: no input {', '.join(missing)}")
    if unet_step.opset != controlnet.opset:
        raise UnsupportedModelError(f"the UNet step graph (opset {unet_step.opset}) and the ControlNet (opset "
                                    f"{controlnet.opset}) come from different exports; merging needs one opset")
    residuals = [t for t in cn.outputs]
    for out in residuals:
        inp = step_inputs.get(out.name)
        if inp is None:
            raise UnsupportedModelError(f"the UNet step graph has no input '{out.name}' for the ControlNet's output")
        _same_type(out, inp, "ControlNet output")
    for name, inp in cn_inputs.items():
        if name in step_inputs and name not in CONTROLNET_STEP_INPUTS:
            _same_type(inp, step_inputs[name], "input")

    _rename_controlnet(cn, prefix)
    make = Emit(step, NameAuthority(step), f"{prefix}prepare")
    sample_in, timestep_in = cn_inputs["sample"], cn_inputs["timestep"]
    sample, timestep = emit_controlnet_inputs(
        make, step_inputs["latents"], step_inputs["step_index"], step_inputs["schedule_timesteps"],
        step_inputs["schedule_coefficients"], sample_dtype=sample_in.dtype, timestep_dtype=timestep_in.dtype,
        timestep_shape=tuple(timestep_in.shape or ()))
    redirect_consumers(sample_in, sample)
    redirect_consumers(timestep_in, timestep)
    shared = []
    for name, inp in cn_inputs.items():
        if name in CONTROLNET_STEP_INPUTS:
            continue
        if name in step_inputs:  # one input read by both graphs
            redirect_consumers(inp, step_inputs[name])
        else:
            shared.append(inp)
    for out in residuals:
        redirect_consumers(step_inputs[out.name], out)
    residual_names = {out.name for out in residuals}

    step.nodes.extend(make.nodes + cn.nodes)
    step.inputs = [t for t in step.inputs if t.name not in residual_names] + shared
    step.import_domains = _merged_domains(step, cn)
    for out in residuals:  # now an inner tensor: a name of the ControlNet's part, no declared shape
        out.name, out.shape = f"{prefix}{out.name}", None
    step.toposort()
    _check_unique_names(step)
    scopes = dict(unet_step.node_scopes)
    scopes.update({f"{prefix}{k}": v for k, v in controlnet.node_scopes.items()})
    metadata = dict(unet_step.metadata_props, **{METADATA_KEY: "controlnet + unet step graph"})
    return Model(graph=step, source=unet_step.source, metadata_props=metadata, model_version=unet_step.model_version,
                 doc_string=unet_step.doc_string, domain=unet_step.domain, node_scopes=scopes,
                 input_defaults={**controlnet.input_defaults, **unet_step.input_defaults})


def write_merged_step(root: str | os.PathLike, *, controlnet_file: str = "step.onnx",
                      file_name: str = MERGED_STEP_FILE, controlnets=("controlnet",)) -> Path | None:
    """Merge ``root/<controlnet>/<controlnet_file>`` (``model.onnx`` when it is absent) of each of
    ``controlnets`` (in order) with ``root/unet/step.onnx`` into ``root/<file_name>``, written
    atomically, weights referring to the components' data files. Returns the path, or None when the
    folder has no ControlNet or no UNet step graph."""
    from onnxopt.loading import load_model
    from onnxopt.saving import save_model

    root = Path(root)
    unet_step = root / "unet" / "step.onnx"
    paths = []
    for name in controlnets:
        controlnet = root / name / controlnet_file
        paths.append(controlnet if controlnet.is_file() else root / name / "model.onnx")
    if not unet_step.is_file() or not paths or not all(p.is_file() for p in paths):
        return None
    merged = load_model(unet_step)
    for k, controlnet in enumerate(paths):
        merged = build_merged_step(merged, load_model(controlnet), index=k)
    merged.metadata_props[METADATA_KEY] = " + ".join(p.relative_to(root).as_posix() for p in [*paths, unet_step])
    return save_model(merged, root / file_name, reference_external=True).path


def merged_parts(model_path: str | os.PathLike) -> tuple[str, ...]:
    """The component graphs a merged step file was built from (``("controlnet/step.onnx",
    "unet/step.onnx")``), read from its metadata without loading its weights; () when it has none."""
    proto = onnx.load(str(model_path), load_external_data=False)
    value = next((p.value for p in proto.metadata_props if p.key == METADATA_KEY), "")
    return tuple(part.strip() for part in value.split("+") if part.strip().endswith(".onnx"))


def _same_type(a: gs.Tensor, b: gs.Tensor, what: str) -> None:
    if a.dtype is not None and b.dtype is not None and numpy_dtype(a.dtype) != numpy_dtype(b.dtype):
        raise UnsupportedModelError(f"{what} '{a.name}' is {numpy_dtype(a.dtype)} in the ControlNet and "
                                    f"{numpy_dtype(b.dtype)} in the UNet step graph")


def _rename_controlnet(cn: gs.Graph, prefix: str) -> None:
    """Give every ControlNet node and inner tensor the ``prefix`` (``controlnet/``: two exports name
    their tensors alike: ``conv_in.weight``, ``/conv_in/Conv_output_0``) and drop the inner
    tensors' shape annotations (see the module docstring)."""
    boundary = {id(t) for t in cn.inputs} | {id(t) for t in cn.outputs}
    for tensor in cn.tensors().values():
        if id(tensor) in boundary or not tensor.name:
            continue
        tensor.name = f"{prefix}{tensor.name}"
        if isinstance(tensor, gs.Variable):
            tensor.shape = None
    for node in cn.nodes:
        node.name = f"{prefix}{node.name}" if node.name else ""


def _check_unique_names(graph: gs.Graph) -> None:
    seen: dict[str, int] = {}
    for node in graph.nodes:
        for t in [*node.inputs, *node.outputs]:
            if t.name and seen.setdefault(t.name, id(t)) != id(t):
                raise UnsupportedModelError(f"merging the ControlNet into the step graph gives two tensors named "
                                            f"'{t.name}'")


def _merged_domains(step: gs.Graph, cn: gs.Graph) -> list:
    domains = {d.domain: d for d in (cn.import_domains or [])}
    domains.update({d.domain: d for d in (step.import_domains or [])})
    return list(domains.values()) if domains else step.import_domains
