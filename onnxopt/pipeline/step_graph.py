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

Without classifier-free guidance (a denoiser whose family embeds its guidance, Flux:
``Denoiser.classifier_free_guidance`` False) the denoiser runs one row per image: its input is
``latents * c_in`` (any rank: Flux's packed [B, tokens, 64]), its output is ``guided_output`` as
it is, and ``guidance_scale`` is read by nothing (kept so that one interface serves every loop).

An inpainting UNet (StableDiffusionInpaintPipeline's: more input channels than it outputs) reads
the latents and, after them on the channel axis, the mask and the masked image's latents: the step
graph then takes those as ``inpaint_channels`` [2b, C_in - C, h, w] float32 (both guidance rows, fixed
for a whole image) and the UNet's sample is ``Concat([Concat([latents * c_in] * 2), inpaint_channels],
axis 1)``, diffusers' ``torch.cat([scale_model_input(latents), mask, masked_image_latents], dim=1)``.

The interface (the pipeline contract): inputs ``latents``, ``state`` (float32), ``step_index`` [1]
int64, ``schedule_timesteps`` [T] (the UNet's timestep dtype; float32 for bfloat16), ``schedule_coefficients`` [T, 6]
float32, ``guidance_scale`` [1] and the UNet's conditioning inputs by their own names and dtypes;
outputs ``latents_out``, ``state_out``, ``step_index_out`` (= step_index + 1) and ``guided_output``
(eps, float32: what a reused step reads, :mod:`onnxopt.pipeline.step_reuse`). Row k of the
schedule is step k's timestep and (c_in, c_x, c_eps, c_state, d_x, d_eps), from
:func:`onnxopt.pipeline.schedulers.plan_steps`; rows past the run's step count are never read.

Why the schedule is a table and the step a counter: every input of a run is bound once, and step k
feeds step k+1 on the device (latents, state, step index), so a denoising loop is N replays of one
captured CUDA graph with nothing written from the host in between. The host neither waits for a
step nor copies anything between steps. The schedule is an input, not baked in, so one graph (one
engine, one capture) serves every scheduler and step count (a scheduler baked into the graph would
force a TensorRT engine rebuild and a new capture for each).

The latents, the state, the coefficients and the update stay float32 whatever the UNet's precision
(an fp16- or bf16-io UNet gets Casts around it), so fifty steps do not accumulate fp16 or bf16
rounding: the latents are rounded to the denoiser's type where it reads them, once per step.

The UNet inside is not rewritten: its nodes are copied as they are, and its weights are the very
same graphsurgeon Constants (``is``), so a large UNet is never held twice. (Each shared Constant's
consumer list then names the step graph's nodes too.) Every new node and tensor is named
``step/...``; the UNet's ``sample`` and ``timestep`` tensors become ``step/unet_sample`` and
``step/unet_timestep`` inside the graph.

:func:`write_step_graph` writes ``step.onnx`` beside a UNet folder's ``model.onnx``, its
initializers pointing into the UNet's own external data file (no weight is written twice).

Guidance off (diffusers' ``do_classifier_free_guidance``: guidance <= 1): :func:`without_guidance`
turns a written step graph into the step of one row per image, the prompt's, whose output is the
guided output as it is (``Concat([x, x])`` becomes ``Identity(x)``; the Split, Sub, Mul and Add of the
guidance go). The runner builds it in memory from ``step.onnx``, its weights referring to the
UNet's data files, when a request turns guidance off.

A history (PNDM's PLMS steps: the last three model outputs and the first sample): :func:`with_history`
turns a written step graph into one whose ``state`` holds those slots on a leading axis and whose
update is a matrix per step (:func:`onnxopt.pipeline.schedulers.plan_plms`); built in memory, as the
step without guidance is.

``cfg_late`` (:mod:`onnxopt.passes.cfg_late`): the part of the UNet that reads
only the latents and the timestep runs once at batch b, and ``Concat([h, h], axis 0)`` broadcasts
it where the text side comes in (the first cross-attention's query; SDXL: the time embedding,
which meets the pooled text there). The graph's interface is the same; its metadata
``onnxopt.cfg_late`` says how many nodes moved.
"""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.errors import UnsupportedModelError
from onnxopt.fusion import Emit, NameAuthority
from onnxopt.model import Model
from onnxopt.pipeline.families import UNET, Denoiser
from onnxopt.shapes import infer_shapes
from onnxopt.weights import numpy_dtype

PREFIX = "step/"
STEP_INPUTS = ("latents", "state", "step_index", "schedule_timesteps", "schedule_coefficients", "guidance_scale")
STEP_OUTPUTS = ("latents_out", "state_out", "step_index_out", "guided_output")
UNET_INPUTS = ("sample", "timestep", "encoder_hidden_states")
IMAGE_BATCH = "images"  # the latents' batch dim: half the UNet's (uncond and cond rows)
INPAINT_INPUT = "inpaint_channels"  # an inpainting UNet's mask and masked-image latents (module docstring)
F32 = np.dtype(np.float32)


def build_step_graph(unet: Model, *, cfg_late: bool = False, denoiser: Denoiser = UNET) -> Model:
    """The step graph of ``unet`` (see the module docstring). ``unet`` is left as it was; the
    result shares its weights. ``cfg_late``: compute what both guidance halves share once
    (:mod:`onnxopt.passes.cfg_late`). ``denoiser``: the names of the graph's latent and timestep
    inputs and its output (:mod:`onnxopt.pipeline.families`: a UNet's ``sample``/``out_sample``,
    a diffusion transformer's ``hidden_states``/``out_hidden_states``); every other input is
    passed through. Raises :class:`UnsupportedModelError` for a graph without those inputs and
    ``encoder_hidden_states``."""
    graph = copy_sharing_constants(unet.graph)
    sample, timestep, out_sample = _unet_interface(unet, graph, denoiser)
    where = str(unet.source) if unet.source else "UNet"
    guided = denoiser.classifier_free_guidance
    latent_shape = _latent_shape(sample.shape, where, guided)
    extra = _inpaint_channels(sample, out_sample) if guided else 0
    if extra:
        latent_shape[1] = out_sample.shape[1]
    make = Emit(graph, NameAuthority(graph), PREFIX.rstrip("/"))
    step = {name: make.variable(name, dtype, shape, exact=True) for name, dtype, shape in (
        ("latents", F32, latent_shape), ("state", F32, latent_shape), ("step_index", np.int64, [1]),
        ("schedule_timesteps", _schedule_dtype(timestep), ["schedule"]),
        ("schedule_coefficients", F32, ["schedule", 6]),
        ("guidance_scale", F32, [1]))}
    if extra:
        batch2 = sample.shape[0] if sample.shape else None
        step[INPAINT_INPUT] = make.variable(INPAINT_INPUT, F32, [batch2, extra, *latent_shape[2:]], exact=True)
    sample.name, timestep.name = f"{PREFIX}unet_sample", f"{PREFIX}unet_timestep"
    coefficients, step_index_out = _feed_the_unet(make, step, sample, timestep, latent_shape, where, guided)
    if guided:
        outputs = _guide_and_update(make, step, coefficients, out_sample, latent_shape, unet.opset, where)
    else:
        outputs = _update(make, step, coefficients, out_sample, latent_shape, where)
    make.into(graph)

    passed_through = [t for t in graph.inputs if t is not sample and t is not timestep]
    graph.inputs = [*step.values(), *passed_through]
    graph.outputs = [outputs[0], outputs[1], step_index_out, outputs[2]]
    graph.toposort()
    model = Model(graph=graph, source=unet.source, metadata_props=dict(unet.metadata_props),
                  model_version=unet.model_version, doc_string=unet.doc_string, domain=unet.domain,
                  companions=dict(unet.companions), node_scopes=dict(unet.node_scopes))
    infer_shapes(model)
    if cfg_late:
        from onnxopt.passes.cfg_late import CFG_LATE_METADATA, compute_halves_once

        result = compute_halves_once(model, shared_inputs=STEP_INPUTS)
        details = result.details
        model.metadata_props[CFG_LATE_METADATA] = (
            f"{details.get('nodes_moved', 0)} nodes at batch b, {len(details.get('broadcasts', ()))} broadcasts")
    return model


def without_guidance(step: Model) -> Model:
    """``step`` (a guided step graph :func:`build_step_graph` wrote) without classifier-free guidance::

        before:  latents * c_in ─ Concat([x, x], axis 0) ─ ... ─ UNet ─ [Cast] ─ Split ─ eps_u, eps_c
                 eps_u + guidance_scale * (eps_c - eps_u) ─ guided_output
        after:   latents * c_in ─ Identity(x) ─ ... ─ UNet ─ [Cast] ─ guided_output

    Conditions: one ``Concat([x, x], axis 0)`` of the scaled latents and the guidance nodes as this
    module names them; the latents' batch is symbolic (the UNet then runs one row per image:
    a static batch fixes its shapes at two rows); no cfg-late broadcast (it doubles the rows
    inside the UNet). The conditioning inputs then take one row per image, the prompt's; the
    interface is otherwise the same (``guidance_scale`` read by nothing, as without guidance at
    build time). ``step`` is changed in place and returned; raises :class:`UnsupportedModelError`
    naming the condition that failed."""
    from onnxopt.passes.cfg_late import CFG_LATE_METADATA

    graph, where = step.graph, str(step.source) if step.source else "step graph"
    nodes = {node.name: node for node in graph.nodes}
    doubled = [node for node in graph.nodes if node.name.startswith(PREFIX) and node.op == "Concat"
               and node.attrs.get("axis") == 0 and len(node.inputs) == 2 and node.inputs[0] is node.inputs[1]]
    split, combine = nodes.get(f"{PREFIX}model_output"), nodes.get(f"{PREFIX}guided_output")
    latents = next((t for t in graph.inputs if t.name == "latents"), None)
    refusal = None
    if len(doubled) != 1 or split is None or split.op != "Split" or combine is None or combine.op != "Add":
        refusal = "not a guided step graph of onnxopt.pipeline.step_graph"
    elif CFG_LATE_METADATA in step.metadata_props:
        refusal = "a cfg-late step graph doubles the rows inside the UNet"
    elif latents is None or not latents.shape or isinstance(latents.shape[0], int):
        refusal = "the latents' batch is static: the UNet's shapes are fixed at two rows per image"
    if refusal:
        raise UnsupportedModelError(f"{where}: no step without guidance: {refusal}")
    concat, eps = doubled[0], split.inputs[0]
    concat.op, concat.attrs = "Identity", {}
    del concat.inputs[1]
    combine.op, combine.attrs = "Identity", {}
    combine.inputs.clear()
    combine.inputs.append(eps)
    for tensor in (*concat.outputs, *split.inputs):  # their declared batch was two rows per image
        if tensor not in graph.outputs and tensor.shape:
            tensor.shape = [None, *tensor.shape[1:]]
    graph.cleanup().toposort()
    return step


UPDATE_NODES = ("c_x_latents", "c_eps_output", "c_state_state", "latents_partial", "latents_out", "d_x_latents",
                "d_eps_output", "state_out")  # :func:`_scheduler_update`'s nodes, by label


def with_history(step: Model, slots: int) -> Model:
    """``step`` (a step graph :func:`build_step_graph` wrote, guided or :func:`without_guidance`) with a
    scheduler update that carries ``slots`` earlier values (PNDM's PLMS:
    :func:`onnxopt.pipeline.schedulers.plan_plms`)::

        before:  state [b,4,h,w];    coefficients [T, 6]
                 latents_out = c_x * latents + c_eps * eps + c_state * state
                 state_out   = d_x * latents + d_eps * eps
        after:   state [S,b,4,h,w];  coefficients [T, 1 + (1+S)(2+S)] = [c_in, M.flatten()]
                 stack = Concat([latents[None], eps[None], state])                  [2+S, b,4,h,w]
                 out   = ReduceSum(M[:, :, None...] * stack[None], axis 1)          [1+S, b,4,h,w]
                 latents_out = out[0];  state_out = out[1:]

    Conditions: the update nodes and the coefficient Split as this module names them. The rest of the
    graph (the UNet, the guidance, ``c_in``) is untouched; the interface names are the same, the
    state and coefficients wider. ``step`` is changed in place and returned; raises
    :class:`UnsupportedModelError` when it is not such a graph."""
    graph, where = step.graph, str(step.source) if step.source else "step graph"
    nodes = {node.name: node for node in graph.nodes}
    inputs = {t.name: t for t in graph.inputs}
    split = nodes.get(f"{PREFIX}coefficient")
    update = [nodes.get(f"{PREFIX}{label}") for label in UPDATE_NODES]
    if split is None or split.op != "Split" or len(split.outputs) != 6 or any(n is None for n in update) or "state" not in inputs:
        raise UnsupportedModelError(f"{where}: no update with history: not a step graph of onnxopt.pipeline.step_graph")
    latents, state, eps = inputs["latents"], inputs["state"], nodes[f"{PREFIX}guided_output"].outputs[0]
    latents_out, state_out = (next(t for t in graph.outputs if t.name == name) for name in ("latents_out", "state_out"))
    for node in update:  # their outputs are rewritten below
        node.inputs.clear()
        node.outputs.clear()
    graph.nodes = [node for node in graph.nodes if not any(node is old for old in update)]
    rank, rows, columns = len(latents.shape), 1 + slots, 2 + slots
    state.shape = [slots, *latents.shape]
    coefficients = inputs["schedule_coefficients"]
    coefficients.shape = [coefficients.shape[0], 1 + rows * columns]
    split.inputs[0].shape = [1, 1 + rows * columns]
    make = Emit(graph, NameAuthority(graph), PREFIX.rstrip("/"))
    ints = lambda name, values: make.constant(name, np.array(values, np.int64))  # noqa: E731
    flat = make.variable(f"{PREFIX}update_matrix_flat", F32, [1, rows * columns])
    split.inputs[1] = ints("coefficient_widths", [1, rows * columns])
    while len(split.outputs) > 1:
        split.outputs.pop()
    split.outputs.append(flat)
    matrix = make.node("Reshape", [flat, ints("update_matrix_shape", [rows, columns] + [1] * rank)], F32,
                       [rows, columns] + [1] * rank, label="update_matrix")
    axis0 = ints("axis_zero", [0])
    one = lambda t, label: make.node("Unsqueeze", [t, axis0], F32, [1, *latents.shape], label=label)  # noqa: E731
    stack = make.node("Concat", [one(latents, "latents_row"), one(eps, "output_row"), state], F32,
                      [columns, *latents.shape], label="update_inputs", axis=0)
    terms = make.node("Mul", [matrix, make.node("Unsqueeze", [stack, axis0], F32, [1, columns, *latents.shape],
                                                label="update_inputs_row")], F32, [rows, columns, *latents.shape],
                      label="update_terms")
    out = make.node("ReduceSum", [terms, ints("axis_one", [1])], F32, [rows, *latents.shape], label="update",
                    keepdims=0)
    make.node("Gather", [out, make.constant("first_row", np.array(0, np.int64))], None, None, outputs=[latents_out],
              label="latents_out", axis=0)
    make.node("Slice", [out, ints("history_start", [1]), ints("history_end", [rows]), axis0], None, None,
              outputs=[state_out], label="state_out")
    state_out.shape = list(state.shape)
    make.into(graph)
    graph.cleanup().toposort()
    return step


def _unet_interface(unet: Model, graph: gs.Graph, denoiser: Denoiser = UNET) -> tuple[gs.Tensor, gs.Tensor, gs.Tensor]:
    """(sample, timestep, out_sample) of the denoiser graph, or a one-line UnsupportedModelError."""
    inputs = {t.name: t for t in graph.inputs}
    where = str(unet.source) if unet.source else denoiser.component
    # a context-kv denoiser takes the K/V its companion computes from encoder_hidden_states instead
    missing = [name for name in (denoiser.sample, denoiser.timestep, "encoder_hidden_states") if name not in inputs
               and not (name == "encoder_hidden_states" and "context_kv" in unet.companions)]
    if missing:
        what = "a UNet" if denoiser.component == "unet" else f"a {denoiser.component}"
        raise UnsupportedModelError(f"{where}: not {what} graph: no input {', '.join(missing)} "
                                    f"(it has {', '.join(inputs) or 'none'})")
    clashes = [name for name in inputs if name in STEP_INPUTS]
    if clashes or not graph.outputs:
        raise UnsupportedModelError(f"{where}: cannot build a step graph: "
                                    + (f"input {clashes[0]} clashes with a step input" if clashes else "no output"))
    out_sample = next((t for t in graph.outputs if t.name == denoiser.output), graph.outputs[0])
    return inputs[denoiser.sample], inputs[denoiser.timestep], out_sample


def _feed_the_unet(make: Emit, step: dict, sample, timestep, latent_shape, where: str, guided: bool = True):
    """The UNet's inputs from the step's: this step's timestep and coefficient row read from the
    schedule at ``step_index``, ``sample`` = Concat([latents * c_in] * 2) (without guidance:
    latents * c_in; cast to the UNet's type), the timestep shaped as the UNet takes it. Returns
    (the six coefficients, step_index_out)."""
    ints = lambda name, values: make.constant(name, np.array(values, np.int64))  # noqa: E731
    schedule_dtype = _schedule_dtype(timestep)
    step_timestep = make.node("Gather", [step["schedule_timesteps"], step["step_index"]], schedule_dtype, [1],
                              label="timestep", axis=0)
    row = make.node("Gather", [step["schedule_coefficients"], step["step_index"]], F32, [1, 6], label="coefficients",
                    axis=0)
    coefficients = make.node("Split", [row, ints("coefficient_sizes", np.ones(6, np.int64))], F32, [1, 1], outputs=6,
                             label="coefficient", axis=1)
    step_index_out = make.variable("step_index_out", np.int64, [1], exact=True)
    make.node("Add", [step["step_index"], ints("one_step", [1])], np.int64, [1], outputs=[step_index_out],
              label="step_index_out")
    scaled = make.node("Mul", [step["latents"], coefficients[0]], F32, latent_shape, label="scaled_latents")
    sample_dtype = _float_dtype(sample, where)
    if not guided:  # one row per image
        if sample_dtype == F32:
            make.node("Identity", [scaled], None, None, outputs=[sample], label="model_input")
        else:
            make.node("Cast", [scaled], None, None, outputs=[sample], label="model_input", to=_onnx_type(sample_dtype))
    else:
        _feed_both_rows(make, step, scaled, sample, sample_dtype, latent_shape)
    shaped = timestep  # a bfloat16 timestep: shaped in float32, then one Cast (ORT's CPU EP has no bf16 Expand)
    if schedule_dtype != numpy_dtype(timestep.dtype):
        shaped = make.variable(f"{PREFIX}timestep_shaped", schedule_dtype, timestep.shape)
        make.node("Cast", [shaped], None, None, outputs=[timestep], label="timestep_cast",
                  to=_onnx_type(timestep.dtype))
    if timestep.shape is not None and len(timestep.shape) == 0:
        make.node("Reshape", [step_timestep, ints("scalar_shape", np.zeros(0, np.int64))], None, None,
                  outputs=[shaped], label="timestep_scalar")
    elif timestep.shape == [1]:  # exported for one timestep broadcast over the batch: keep it so
        make.node("Identity", [step_timestep], None, None, outputs=[shaped], label="timestep_batch")
    else:
        shape = make.node("Shape", [sample], np.int64, [len(latent_shape)], label="model_input_shape")
        batch2 = make.node("Slice", [shape, ints("zero", [0]), ints("one", [1])], np.int64, [1],
                           label="model_input_batch")
        make.node("Expand", [step_timestep, batch2], None, None, outputs=[shaped], label="timestep_batch")
    return coefficients, step_index_out


def _schedule_dtype(timestep: gs.Tensor) -> np.dtype:
    """``schedule_timesteps``' type: the denoiser's timestep type, but float32 for a bfloat16 one
    (cast to bf16 in the graph, rounding to nearest even as the host would)."""
    dtype = numpy_dtype(timestep.dtype)
    return F32 if dtype == np.dtype(ml_dtypes.bfloat16) else dtype


def _feed_both_rows(make: Emit, step: dict, scaled, sample, sample_dtype, latent_shape) -> None:
    """sample = Concat([latents * c_in] * 2) (an inpainting UNet's extra channels after them), cast
    to the UNet's type."""
    doubled_shape = [sample.shape[0] if sample.shape else None, *latent_shape[1:]]
    inputs, axis, full_shape = [scaled, scaled], 0, doubled_shape
    if INPAINT_INPUT in step:  # the mask and masked-image latents after the latents (diffusers' cat on dim 1)
        doubled = make.node("Concat", [scaled, scaled], F32, doubled_shape, label="model_input_latents", axis=0)
        inputs, axis, full_shape = [doubled, step[INPAINT_INPUT]], 1, [doubled_shape[0], *sample.shape[1:]]
    if sample_dtype == F32:
        make.node("Concat", inputs, F32, None, outputs=[sample], label="model_input", axis=axis)
    else:
        full = make.node("Concat", inputs, F32, full_shape, label="model_input_f32", axis=axis)
        make.node("Cast", [full], None, None, outputs=[sample], label="model_input", to=_onnx_type(sample_dtype))


def _guide_and_update(make: Emit, step: dict, coefficients, out_sample, latent_shape, opset: int, where: str):
    """Guidance (eps_u + g * (eps_c - eps_u)) and the scheduler update of the module docstring.
    Returns the outputs (latents_out, state_out, guided_output)."""
    eps2 = out_sample
    if _float_dtype(out_sample, where) != F32:
        doubled_shape = [out_sample.shape[0] if out_sample.shape else None, *latent_shape[1:]]
        eps2 = make.node("Cast", [out_sample], F32, doubled_shape, label="model_output_f32", to=onnx.TensorProto.FLOAT)
    split = {"axis": 0, **({"num_outputs": 2} if opset >= 18 else {})}
    eps_u, eps_c = make.node("Split", [eps2], F32, latent_shape, outputs=2, label="model_output", **split)
    mul = lambda a, b, label: make.node("Mul", [a, b], F32, latent_shape, label=label)  # noqa: E731
    guided = mul(make.node("Sub", [eps_c, eps_u], F32, latent_shape, label="guidance_difference"),
                 step["guidance_scale"], "guidance_scaled")
    latents_out, state_out, eps = (make.variable(name, F32, latent_shape, exact=True)
                                   for name in ("latents_out", "state_out", "guided_output"))
    make.node("Add", [eps_u, guided], F32, None, outputs=[eps], label="guided_output")
    return _scheduler_update(make, step, coefficients, eps, latents_out, state_out, latent_shape)


def _update(make: Emit, step: dict, coefficients, out_sample, latent_shape, where: str):
    """The scheduler update on the denoiser's own output (no guidance: one row per image, e.g.
    Flux's embedded guidance). Returns the outputs (latents_out, state_out, guided_output)."""
    latents_out, state_out, eps = (make.variable(name, F32, latent_shape, exact=True)
                                   for name in ("latents_out", "state_out", "guided_output"))
    if _float_dtype(out_sample, where) != F32:
        make.node("Cast", [out_sample], None, None, outputs=[eps], label="guided_output", to=onnx.TensorProto.FLOAT)
    else:
        make.node("Identity", [out_sample], None, None, outputs=[eps], label="guided_output")
    return _scheduler_update(make, step, coefficients, eps, latents_out, state_out, latent_shape)


def _scheduler_update(make: Emit, step: dict, coefficients, eps, latents_out, state_out, latent_shape):
    """latents_out = c_x * latents + c_eps * eps + c_state * state; state_out = d_x * latents + d_eps * eps."""
    _, c_x, c_eps, c_state, d_x, d_eps = coefficients
    latents, state = step["latents"], step["state"]
    mul = lambda a, b, label: make.node("Mul", [a, b], F32, latent_shape, label=label)  # noqa: E731
    partial = make.node("Add", [mul(c_x, latents, "c_x_latents"), mul(c_eps, eps, "c_eps_output")], F32, latent_shape,
                        label="latents_partial")
    make.node("Add", [partial, mul(c_state, state, "c_state_state")], F32, None, outputs=[latents_out],
              label="latents_out")
    make.node("Add", [mul(d_x, latents, "d_x_latents"), mul(d_eps, eps, "d_eps_output")], F32, None,
              outputs=[state_out], label="state_out")
    return latents_out, state_out, eps


def write_step_graph(unet_dir: str | os.PathLike, *, file_name: str = "step.onnx", context_kv: bool = True,
                     cfg_late: bool = False, controlnets: int = 1, denoiser: Denoiser = UNET) -> Path:
    """Build the step graph of ``unet_dir/model.onnx`` and write it to ``unet_dir/file_name``
    (atomically). Weights stored in external data files of ``unet_dir`` are referenced where they
    are, not copied; an inline UNet gives an inline step graph (own data file past ~1.8 GB).

    ``context_kv`` (the text side once per prompt): the ``context-kv`` pass first cuts
    every cross-attention's K/V projection of ``encoder_hidden_states`` out of the UNet; the step
    graph is built around the rest and the cut part is written beside it as
    ``<stem>.context_kv.onnx`` (its inputs: the prompt's conditioning; its outputs: inputs of the
    step graph, by name), which the runner runs once per prompt. When the pass refuses the UNet,
    the whole UNet goes into the step graph. ``controlnets`` > 1: the graph reads one residual set
    per ControlNet and sums them (:mod:`onnxopt.pipeline.multi_controlnet`). ``denoiser``: the
    graph's interface (a diffusion transformer's: :data:`~onnxopt.pipeline.families.SD3_TRANSFORMER`).
    Returns the path written."""
    from onnxopt.loading import load_model
    from onnxopt.saving import save_model

    unet_dir = Path(unet_dir)
    unet = None
    if context_kv:
        from onnxopt.api import optimize

        cut, _ = optimize(unet_dir / "model.onnx", ["context-kv"])
        unet = cut if "context_kv" in cut.companions else None
    step = build_step_graph(unet or load_model(unet_dir / "model.onnx"), cfg_late=cfg_late, denoiser=denoiser)
    if controlnets > 1:
        from onnxopt.pipeline.multi_controlnet import sum_controlnet_residuals

        step = sum_controlnet_residuals(step, controlnets)
    return save_model(step, unet_dir / file_name, reference_external=True, weight_map=True).path


def copy_sharing_constants(graph: gs.Graph) -> gs.Graph:
    """A structural copy of ``graph`` whose nodes read the original Constants (weights not duplicated)."""
    originals = {name: t for name, t in graph.tensors().items() if isinstance(t, gs.Constant)}
    copied = graph.copy()
    for node in copied.nodes:
        for i, tensor in enumerate(node.inputs):
            if isinstance(tensor, gs.Constant) and tensor.name in originals:
                node.inputs[i] = originals[tensor.name]
    return copied


def _inpaint_channels(sample: gs.Tensor, out_sample: gs.Tensor) -> int:
    """How many channels the UNet reads beyond the latents it predicts (an inpainting UNet's mask and
    masked-image latents); 0 for a text-to-image UNet or where the shapes do not say."""
    if not (sample.shape and out_sample.shape and len(sample.shape) == len(out_sample.shape) == 4):
        return 0
    channels_in, channels_out = sample.shape[1], out_sample.shape[1]
    if isinstance(channels_in, int) and isinstance(channels_out, int) and channels_in > channels_out:
        return channels_in - channels_out
    return 0


def _latent_shape(shape, where: str, guided: bool = True) -> list:
    """The latents' shape: the denoiser input's, its batch halved under guidance (uncond and cond rows)."""
    if not guided:  # one row per image: any rank (Flux: packed [B, tokens, 64])
        if shape is None:
            raise UnsupportedModelError(f"{where}: the denoiser's latent input has no declared shape")
        return [s if isinstance(s, int) else f"latents_{k}" for k, s in enumerate(shape)]
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
    if dtype not in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        raise UnsupportedModelError(f"{where}: UNet tensor {tensor.name} is {dtype}, expected float32, float16 or "
                                    "bfloat16")
    return dtype


def _onnx_type(dtype: np.dtype) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(numpy_dtype(dtype))
