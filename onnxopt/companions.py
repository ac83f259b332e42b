"""What ties a model to its companions (see :mod:`onnxopt.model`): file names and the interface.

A companion runs first; each of its outputs feeds the main model's input of the same name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.graph_edit import detach, redirect_consumers
from onnxopt.model import Model
from onnxopt.weights import numpy_dtype


def companion_path(path: str | Path, name: str) -> Path:
    """Where companion ``name`` of a model saved at ``path`` goes: ``unet.opt.onnx`` ->
    ``unet.opt.context_kv.onnx`` (same folder, so the pair is obviously one model)."""
    path = Path(path)
    stem = path.name[: -len(".onnx")] if path.name.endswith(".onnx") else path.name
    return path.with_name(f"{stem}.{name}.onnx")


def interface(model: Model) -> list[tuple[str, gs.Variable, gs.Variable]]:
    """(companion name, its output, the main model's input it feeds) for every handed-over tensor."""
    inputs = {t.name: t for t in model.graph.inputs}
    return [(name, out, inputs[out.name]) for name, c in model.companions.items() for out in c.graph.outputs if out.name in inputs]


def narrow_interface_casts(model: Model) -> int:
    """Drop Cast pairs across companion interfaces; return how many tensors changed type.

    A pass that converts both parts but keeps their I/O types (fp16 with ``keep_io_types``) leaves
    ``x:f16 ─ Cast(f32) ─ out`` in the companion and ``in:f32 ─ Cast(f16) ─ ...`` in the main model:
    the handed-over tensor would travel in float32 for nothing. Then the companion outputs ``x``
    and the main model reads it in float16 directly. Nothing changes unless every reader of the
    input is such a Cast and the companion's Cast is the output's only producer from that type.
    """
    changed = 0
    for name, out, inp in interface(model):
        companion = model.companions[name].graph
        producer = out.inputs[0] if len(out.inputs) == 1 else None
        if producer is None or producer.op != "Cast" or not producer.inputs:
            continue
        source = producer.inputs[0]
        readers = list(inp.outputs)
        if source.dtype is None or not readers or inp in model.graph.outputs or source in companion.inputs:
            continue
        low = onnx.helper.np_dtype_to_tensor_dtype(numpy_dtype(source.dtype))
        if any(r.op != "Cast" or int(r.attrs.get("to", -1)) != low for r in readers):
            continue
        if any(t in model.graph.outputs for r in readers for t in r.outputs) or source in companion.outputs:
            continue
        # Companion: output the low-precision tensor itself, under the interface name.
        index = companion.outputs.index(out)
        interface_name = out.name
        out.name = f"{interface_name}.before_narrowing"
        source.name = interface_name
        companion.outputs[index] = source
        # Main model: read it in the low type; the Casts go.
        inp.dtype = source.dtype
        for reader in readers:
            cast_out = reader.outputs[0]
            redirect_consumers(cast_out, inp)
            detach(reader)
        changed += 1
    if changed:
        model.graph.cleanup(remove_unused_graph_inputs=False).toposort()
        for companion in model.companions.values():
            companion.graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return changed
