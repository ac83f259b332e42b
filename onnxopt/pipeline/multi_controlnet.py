"""More than one ControlNet: diffusers' MultiControlNetModel on the step graphs.

diffusers' ``MultiControlNetModel`` runs each ControlNet on its own image and conditioning scale,
at the same ``sample``, ``timestep`` and text, and sums their residuals before the UNet reads them
(``down_0 + down_1 + ...`` in ControlNet order; the same for the mid residual). Here the sum is
inside the step graph: :func:`sum_controlnet_residuals` gives the UNet step graph one residual set
per ControlNet and adds them where the UNet read its single set::

    before (unet/step.onnx, one ControlNet):
        down_block_res_{i} ─────────────────────────────────────────── the UNet's skip Adds ...
    after (N ControlNets):
        down_block_res_{i} ───────────── Add ─ Add ─ ... ──────────── the UNet's skip Adds ...
        controlnet_1.down_block_res_{i} ─┘     │
        controlnet_2.down_block_res_{i} ───────┘          (and the same for mid_block_res)

Why in the step graph: one captured step stays captured graphs only, with no host-side add and
no extra session run per step; the two-stream split (:mod:`onnxopt.pipeline.two_streams`) puts the
Adds in ``rest``, after the join, since they read the residuals; the merged step
(:mod:`onnxopt.pipeline.merged_step`) merges every ControlNet into that graph. Summing inside each
ControlNet's graph instead (ControlNet k reading k-1's residuals) would chain the ControlNets and
rewrite every ControlNet; summing on the host would copy the residuals off the device each step.

Names: ControlNet k (from 0) lives in ``controlnet/`` (k = 0) or ``controlnet_<k>/`` (the layout
``MultiControlNetModel.save_pretrained`` writes). Its graphs keep their own tensor names; where its
tensors meet a shared graph (the step graph's residual inputs, the merged step's ControlNet
inputs), ControlNet k > 0's are prefixed ``controlnet_<k>.`` (:func:`interface_name`); ControlNet 0's
keep their names, so a one-ControlNet folder's graphs are unchanged. The inputs every ControlNet
reads with the same value (``sample``, ``timestep``, ``encoder_hidden_states``) keep their names:
one buffer serves them all.
"""

from __future__ import annotations

import re

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.errors import UnsupportedModelError
from onnxopt.fusion import Emit, NameAuthority
from onnxopt.graph_edit import redirect_consumers
from onnxopt.model import Model
from onnxopt.pipeline.folder import controlnet_name

SHARED_INPUTS = ("sample", "timestep", "encoder_hidden_states")  # the same value for every ControlNet
RESIDUAL_INPUT = re.compile(r"^(down_block_res_\d+|mid_block_res)$")  # the pipeline contract's residual names
METADATA_KEY = "onnxopt.controlnets"


def interface_name(name: str, k: int) -> str:
    """ControlNet k's tensor ``name`` as a shared graph reads it: itself for k = 0 and the shared
    inputs, else ``controlnet_<k>.name``."""
    return name if k == 0 or name in SHARED_INPUTS else f"{controlnet_name(k)}.{name}"


def interface_feeds(feeds: dict, k: int) -> dict:
    return {interface_name(name, k): value for name, value in feeds.items()}


def residual_inputs(graph: gs.Graph) -> list[str]:
    """The step graph's ControlNet residual inputs of one set (the contract's names), in graph order."""
    return [t.name for t in graph.inputs if RESIDUAL_INPUT.match(t.name)]


def sum_controlnet_residuals(step: Model, count: int) -> Model:
    """``step`` (a UNet step graph reading one residual set) reading ``count`` sets, summed in
    ControlNet order (see the module docstring); ``count`` 1 returns it as it is. Edits ``step``.
    Raises UnsupportedModelError when the graph reads no residual."""
    if count < 2:
        return step
    graph = step.graph
    names = residual_inputs(graph)
    if not names:
        raise UnsupportedModelError("the step graph reads no ControlNet residual (down_block_res_{i}, mid_block_res)")
    make = Emit(graph, NameAuthority(graph), "controlnets")
    inputs = {t.name: t for t in graph.inputs}
    added = []
    for name in names:
        first = inputs[name]
        total = first
        for k in range(1, count):
            other = make.variable(interface_name(name, k), first.dtype, first.shape, exact=True)
            added.append(other)
            total = make.op.Add(total, other, _shape=first.shape)
            if k == 1:
                first_add = total.inputs[0]
        redirect_consumers(first, total, skip=first_add)
    make.into(graph)
    at = max(i for i, t in enumerate(graph.inputs) if t.name in names) + 1
    graph.inputs = [*graph.inputs[:at], *added, *graph.inputs[at:]]
    graph.toposort()
    step.metadata_props[METADATA_KEY] = str(count)
    return step


def controlnet_count(model_path) -> int:
    """How many ControlNets' residual sets a step graph file reads (its metadata; 1 without)."""
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    return int(next((p.value for p in proto.metadata_props if p.key == METADATA_KEY), "1"))


def same_dtype(values, what: str):
    """The one dtype of ``values`` (ControlNet inputs every ControlNet reads from one buffer), or an error."""
    dtypes = {np.dtype(v) for v in values}
    if len(dtypes) > 1:
        raise UnsupportedModelError(f"the ControlNets take {what} as different types ({', '.join(map(str, dtypes))})")
    return dtypes.pop()
