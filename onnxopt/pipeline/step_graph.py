"""The fused denoising step: classifier-free guidance and the scheduler update appended to the UNet.

    step_index [1] ─┬─ Gather(schedule_timesteps [T]) ─ timestep [1] ─ Expand([2b]) ────────┐
                    ├─ Gather(schedule_coefficients [T,6]) ─ Split ─ c_in, c_x, ... d_eps   │
                    └─ Add(1) ─ step_index_out                                               │
    latents [b,4,h,w] f32 ─ Mul(c_in) ─ Concat(axis 0, twice) ─ [Cast f16] ─────────────────┤
    encoder_hidden_states [2b,S,D], text_embeds, time_ids,                                   ├─ UNet ─ out_sample
    down_block_res_{i}, mid_block_res (passed through as they are) ─────────────────────────┘        │
                                                                 [Cast f32] ─ Split(axis 0) ─ eps_u, eps_c
    eps         = eps_u + guidance_scale * (eps_c - eps_u)
    latents_out = c_x * latents + c_eps * eps + c_state * state
    state_out   = d_x * latents + d_eps * eps

The interface (the pipeline contract): inputs ``latents``, ``state`` (float32), ``step_index`` [1]
int64, ``schedule_timesteps`` [T] (the UNet's timestep dtype), ``schedule_coefficients`` [T, 6]
float32, ``guidance_scale`` [1] and the UNet's conditioning inputs by their own names and dtypes;
outputs ``latents_out``, ``state_out``, ``step_index_out`` (= step_index + 1) and ``guided_output``
(eps, float32: what a reused step reads, :mod:`onnxopt.pipeline.step_reuse`). Row k of the
schedule is step k's timestep and (c_in, c_x, c_eps, c_state, d_x, d_eps), from
:func:`onnxopt.pipeline.schedulers.plan_steps`; rows past the run's step count are never read.

Why the schedule is a table and the step a counter: every input of a run is bound once, and step k
feeds step k+1 on the device (latents, state, step index), so a denoising loop is N replays of one
captured CUDA graph with nothing written from the host in between. The host neither waits for a
step nor copies anything between steps. The schedule is an input, not baked in, so one graph (one
engine, one capture) serves every scheduler and step count (seed 001: a baked-in scheduler forces
an engine rebuild).

The latents, the state, the coefficients and the update stay float32 whatever the UNet's precision
(an fp16-io UNet gets Casts around it), so fifty steps do not accumulate fp16 rounding.

The UNet inside is not rewritten: its nodes are copied as they are, and its weights are the very
same graphsurgeon Constants (``is``), so a large UNet is never held twice. (Each shared Constant's
consumer list then names the step graph's nodes too.) Every new node and tensor is named
``step/...``; the UNet's ``sample`` and ``timestep`` tensors become ``step/unet_sample`` and
``step/unet_timestep`` inside the graph.

:func:`write_step_graph` writes ``step.onnx`` beside a UNet folder's ``model.onnx``, its
initializers pointing into the UNet's own external data file (no weight is written twice).

``cfg_late`` (issue 14 item 3, :mod:`onnxopt.pipeline.cfg_late`): the part of the UNet that reads
only the latents and the timestep runs once at batch b, and ``Concat([h, h], axis 0)`` broadcasts
it where the text side comes in (the first cross-attention's query; SDXL: the time embedding,
which meets the pooled text there). The graph's interface is the same; its metadata
``onnxopt.cfg_late`` says how many nodes moved.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.errors import UnsupportedModelError
from onnxopt.model import Model
from onnxopt.shapes import infer_shapes
from onnxopt.weights import numpy_dtype

PREFIX = "step/"
STEP_INPUTS = ("latents", "state", "step_index", "schedule_timesteps", "schedule_coefficients", "guidance_scale")
STEP_OUTPUTS = ("latents_out", "state_out", "step_index_out", "guided_output")
UNET_INPUTS = ("sample", "timestep", "encoder_hidden_states")
IMAGE_BATCH = "images"  # the latents' batch dim: half the UNet's (uncond and cond rows)
F32 = np.dtype(np.float32)


class _Builder:
    """Appends ``step/``-named nodes to a graph (graphsurgeon's Node/Variable, one name per tensor)."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph

    def op(self, op: str, name: str, inputs: list, *, dtype=F32, shape=None, attrs=None, outputs: int = 1):
        names = [f"{PREFIX}{name}"] if outputs == 1 else [f"{PREFIX}{name}_{i}" for i in range(outputs)]
        out = [gs.Variable(n, dtype=dtype, shape=shape) for n in names]
        self.graph.nodes.append(gs.Node(op, f"{PREFIX}{name}", attrs=attrs or {}, inputs=inputs, outputs=out))
        return out[0] if outputs == 1 else out

    def into(self, op: str, name: str, inputs: list, output: gs.Variable, attrs=None) -> None:
        """A node writing a given tensor (one the UNet's nodes read, or a graph output)."""
        self.graph.nodes.append(gs.Node(op, f"{PREFIX}{name}", attrs=attrs or {}, inputs=inputs, outputs=[output]))

    def constant(self, name: str, values) -> gs.Constant:
        return gs.Constant(f"{PREFIX}{name}", np.asarray(values))


def build_step_graph(unet: Model, *, cfg_late: bool = False) -> Model:
    """The step graph of ``unet`` (see the module docstring). ``unet`` is left as it was; the
    result shares its weights. ``cfg_late``: compute what both guidance halves share once
    (:mod:`onnxopt.pipeline.cfg_late`). Raises :class:`UnsupportedModelError` for a graph without
    the UNet inputs ``sample``, ``timestep`` and ``encoder_hidden_states``."""
    graph = copy_sharing_constants(unet.graph)
    inputs = {t.name: t for t in graph.inputs}
    where = str(unet.source) if unet.source else "UNet"
    # a context-kv denoiser takes the K/V its companion computes from encoder_hidden_states instead
    missing = [name for name in UNET_INPUTS if name not in inputs
               and not (name == "encoder_hidden_states" and "context_kv" in unet.companions)]
    if missing:
        raise UnsupportedModelError(f"{where}: not a UNet graph: no input {', '.join(missing)} "
                                    f"(it has {', '.join(inputs) or 'none'})")
    clashes = [name for name in inputs if name in STEP_INPUTS]
    if clashes or not graph.outputs:
        raise UnsupportedModelError(f"{where}: cannot build a step graph: "
                                    + (f"input {clashes[0]} clashes with a step input" if clashes else "no output"))
    sample, timestep = inputs["sample"], inputs["timestep"]
    out_sample = next((t for t in graph.outputs if t.name == "out_sample"), graph.outputs[0])
    latent_shape = _latent_shape(sample.shape, where)
    sample_dtype, out_dtype = _float_dtype(sample, where), _float_dtype(out_sample, where)
    b = _Builder(graph)

    latents = gs.Variable("latents", dtype=F32, shape=latent_shape)
    state = gs.Variable("state", dtype=F32, shape=latent_shape)
    step_index = gs.Variable("step_index", dtype=np.int64, shape=[1])
    timesteps = gs.Variable("schedule_timesteps", dtype=timestep.dtype, shape=["schedule"])
    coefficients = gs.Variable("schedule_coefficients", dtype=F32, shape=["schedule", 6])
    guidance = gs.Variable("guidance_scale", dtype=F32, shape=[1])
    sample.name, timestep.name = f"{PREFIX}unet_sample", f"{PREFIX}unet_timestep"

    step_timestep = b.op("Gather", "timestep", [timesteps, step_index], dtype=timestep.dtype, shape=[1],
                         attrs={"axis": 0})
    row = b.op("Gather", "coefficients", [coefficients, step_index], shape=[1, 6], attrs={"axis": 0})
    c_in, c_x, c_eps, c_state, d_x, d_eps = b.op(
        "Split", "coefficient", [row, b.constant("coefficient_sizes", np.ones(6, np.int64))],
        shape=[1, 1], attrs={"axis": 1}, outputs=6)
    step_index_out = gs.Variable("step_index_out", dtype=np.int64, shape=[1])
    b.into("Add", "step_index_out", [step_index, b.constant("one_step", np.array([1], np.int64))], step_index_out)
    scaled = b.op("Mul", "scaled_latents", [latents, c_in], shape=latent_shape)
    doubled_shape = [sample.shape[0] if sample.shape else None, *latent_shape[1:]]
    if sample_dtype == F32:
        b.into("Concat", "model_input", [scaled, scaled], sample, attrs={"axis": 0})
    else:
        doubled = b.op("Concat", "model_input_f32", [scaled, scaled], shape=doubled_shape, attrs={"axis": 0})
        b.into("Cast", "model_input", [doubled], sample, attrs={"to": _onnx_type(sample_dtype)})

    if timestep.shape is not None and len(timestep.shape) == 0:
        scalar_shape = b.constant("scalar_shape", np.zeros(0, np.int64))
        b.into("Reshape", "timestep_scalar", [step_timestep, scalar_shape], timestep)
    elif timestep.shape == [1]:  # exported for one timestep broadcast over the batch: keep it so
        b.into("Identity", "timestep_batch", [step_timestep], timestep)
    else:
        batch2 = b.op("Shape", "model_input_shape", [sample], dtype=np.int64, shape=[4])
        batch2 = b.op("Slice", "model_input_batch", [batch2, b.constant("zero", np.array([0], np.int64)),
                                                      b.constant("one", np.array([1], np.int64))],
                      dtype=np.int64, shape=[1])
        b.into("Expand", "timestep_batch", [step_timestep, batch2], timestep)

    eps2 = out_sample
    if out_dtype != F32:
        eps2 = b.op("Cast", "model_output_f32", [out_sample], shape=doubled_shape, attrs={"to": onnx.TensorProto.FLOAT})
    split_attrs = {"axis": 0, **({"num_outputs": 2} if unet.opset >= 18 else {})}
    eps_u, eps_c = b.op("Split", "model_output", [eps2], shape=latent_shape, attrs=split_attrs, outputs=2)
    difference = b.op("Sub", "guidance_difference", [eps_c, eps_u], shape=latent_shape)
    guided = b.op("Mul", "guidance_scaled", [difference, guidance], shape=latent_shape)
    eps = gs.Variable("guided_output", dtype=F32, shape=latent_shape)
    b.into("Add", "guided_output", [eps_u, guided], eps)

    x_term = b.op("Mul", "c_x_latents", [c_x, latents], shape=latent_shape)
    eps_term = b.op("Mul", "c_eps_output", [c_eps, eps], shape=latent_shape)
    state_term = b.op("Mul", "c_state_state", [c_state, state], shape=latent_shape)
    partial = b.op("Add", "latents_partial", [x_term, eps_term], shape=latent_shape)
    latents_out = gs.Variable("latents_out", dtype=F32, shape=latent_shape)
    b.into("Add", "latents_out", [partial, state_term], latents_out)
    dx_term = b.op("Mul", "d_x_latents", [d_x, latents], shape=latent_shape)
    deps_term = b.op("Mul", "d_eps_output", [d_eps, eps], shape=latent_shape)
    state_out = gs.Variable("state_out", dtype=F32, shape=latent_shape)
    b.into("Add", "state_out", [dx_term, deps_term], state_out)

    passed_through = [t for t in graph.inputs if t is not sample and t is not timestep]
    graph.inputs = [latents, state, step_index, timesteps, coefficients, guidance, *passed_through]
    graph.outputs = [latents_out, state_out, step_index_out, eps]
    graph.toposort()
    model = Model(graph=graph, source=unet.source, metadata_props=dict(unet.metadata_props),
                  model_version=unet.model_version, doc_string=unet.doc_string, domain=unet.domain,
                  companions=dict(unet.companions), node_scopes=dict(unet.node_scopes))
    infer_shapes(model)
    if cfg_late:
        from onnxopt.pipeline.cfg_late import CFG_LATE_METADATA, compute_halves_once

        result = compute_halves_once(model, shared_inputs=STEP_INPUTS)
        details = result.details
        model.metadata_props[CFG_LATE_METADATA] = (
            f"{details.get('nodes_moved', 0)} nodes at batch b, {len(details.get('broadcasts', ()))} broadcasts")
    return model


def write_step_graph(unet_dir: str | os.PathLike, *, file_name: str = "step.onnx", context_kv: bool = True,
                     cfg_late: bool = False, controlnets: int = 1) -> Path:
    """Build the step graph of ``unet_dir/model.onnx`` and write it to ``unet_dir/file_name``
    (atomically). Weights stored in external data files of ``unet_dir`` are referenced where they
    are, not copied; an inline UNet gives an inline step graph (own data file past ~1.8 GB).

    ``context_kv`` (the text side once per prompt, issue 14): the ``context-kv`` pass first cuts
    every cross-attention's K/V projection of ``encoder_hidden_states`` out of the UNet; the step
    graph is built around the rest and the cut part is written beside it as
    ``<stem>.context_kv.onnx`` (its inputs: the prompt's conditioning; its outputs: inputs of the
    step graph, by name), which the runner runs once per prompt. When the pass refuses the UNet,
    the whole UNet goes into the step graph. ``controlnets`` > 1: the graph reads one residual set
    per ControlNet and sums them (:mod:`onnxopt.pipeline.multi_controlnet`). Returns the path written."""
    from onnxopt.loading import load_model
    from onnxopt.saving import save_model

    unet_dir = Path(unet_dir)
    unet = None
    if context_kv:
        from onnxopt.api import optimize

        cut, _ = optimize(unet_dir / "model.onnx", ["context-kv"])
        unet = cut if "context_kv" in cut.companions else None
    step = build_step_graph(unet or load_model(unet_dir / "model.onnx"), cfg_late=cfg_late)
    if controlnets > 1:
        from onnxopt.pipeline.multi_controlnet import sum_controlnet_residuals

        step = sum_controlnet_residuals(step, controlnets)
    return save_model(step, unet_dir / file_name, reference_external=True).path


def copy_sharing_constants(graph: gs.Graph) -> gs.Graph:
    """A structural copy of ``graph`` whose nodes read the original Constants (weights not duplicated)."""
    originals = {name: t for name, t in graph.tensors().items() if isinstance(t, gs.Constant)}
    copied = graph.copy()
    for node in copied.nodes:
        for i, tensor in enumerate(node.inputs):
            if isinstance(tensor, gs.Constant) and tensor.name in originals:
                node.inputs[i] = originals[tensor.name]
    return copied


def _latent_shape(shape, where: str) -> list:
    if shape is None:
        return [IMAGE_BATCH, 4, "height", "width"]
    if len(shape) != 4:
        raise UnsupportedModelError(f"{where}: UNet input sample has rank {len(shape)}, expected 4 (NCHW)")
    batch = shape[0]
    if isinstance(batch, int):
        if batch % 2:
            raise UnsupportedModelError(f"{where}: UNet input sample has a static batch of {batch}; classifier-free "
                                        "guidance needs an even batch (uncond and cond rows)")
        batch //= 2
    else:
        batch = IMAGE_BATCH
    return [batch, *shape[1:]]


def _float_dtype(tensor: gs.Tensor, where: str) -> np.dtype:
    dtype = numpy_dtype(tensor.dtype) if tensor.dtype is not None else None
    if dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise UnsupportedModelError(f"{where}: UNet tensor {tensor.name} is {dtype}, expected float32 or float16")
    return dtype


def _onnx_type(dtype: np.dtype) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(numpy_dtype(dtype))
