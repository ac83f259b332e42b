"""LoRA weights as bound inputs: swapping a LoRA's scale re-creates no session and re-captures no graph.

    loras = LoraWeights(lora_set, "cuda")
    session = loras.session("unet", path_or_bytes, make)    # make(model, **extra) -> InferenceSession
    loras.set_scales([0.5, 1.0])                            # every session sees the new weights

Each graph file's initializers that some LoRA changes become graph inputs (the model is rewritten in
memory, its other weights still read from its external data files). Their values live in buffers
this module owns, one per weight and session: on the CUDA EP device memory (an OrtValue), on the
CPU an array. ``set_scales`` computes ``W + sum_l scale_l * delta_l`` for each and writes it into the
same buffer: a small graph of its own (:func:`update_graph`) on the same device, its inputs the
base weights and each LoRA's delta (uploaded once), its outputs bound to those buffers, so a swap
moves ``len(scales)`` floats to the device and runs one memory-bound graph.

Why inputs and not initializers: ONNX Runtime offers no way to change an initializer once a session
exists. ``SessionOptions.add_initializer`` / ``add_external_initializers`` take a value only at
session creation, and the CUDA EP copies initializers to the device then (so a later change of the
host buffer is not seen; the CPU EP may also prepack MatMul weights). A captured CUDA graph replays
the device addresses it was captured with, and a bound input keeps its address whatever is copied
into it: the same mechanism the step loop's latents use (:mod:`onnxopt.pipeline.sessions`). So a
scale or LoRA change rewrites the buffers in place; the captured graphs replay with the new weights.

The wrapper names its weights in ``bound_inputs``, which every binding of
:class:`~onnxopt.runners.captured_session.CapturedSession` binds, adds them to the feeds of a plain
``run``, and hides them from ``get_inputs``: the runner's sessions, bound-buffer sessions and step
loops use it as the session it wraps.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx

from onnxopt.lora.conv_layout import nhwc_convs_as_conv
from onnxopt.lora.files import LoraError
from onnxopt.lora.targets import LoraSet, Target
from onnxopt.runners.captured_session import CapturedSession, write
from onnxopt.weight_provenance import map_path


def weights_as_inputs(proto: onnx.ModelProto, names: set[str]) -> bytes:
    """``proto`` serialized with the initializers ``names`` turned into graph inputs of their type and
    shape, and each NhwcConv that reads one of them as a Conv between Transposes
    (:mod:`onnxopt.lora.conv_layout`: the CUDA EP needs an NhwcConv's weight constant)."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    nhwc_convs_as_conv(model.graph, names, {t.name: len(t.dims) for t in model.graph.initializer})
    kept, moved = [], []
    for tensor in model.graph.initializer:
        (moved if tensor.name in names else kept).append(tensor)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    for tensor in moved:
        model.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return model.SerializeToString()


def update_graph(targets: dict[str, Target], loras: int) -> bytes:
    """The graph that writes every changed weight where the session reads it::

        W'_t = Cast(Cast(base_t, float32) + sum_l scales[l] * Cast(delta_lt, float32), dtype of W_t)

    inputs ``lora_scales`` [loras] and, per weight t, ``base_t`` and ``delta_l_t`` (each LoRA that
    changes it), outputs ``t``: all bound to buffers that stay put, so a new scale is one copy of
    ``loras`` floats and one run, on the device where the weights live."""
    import onnx_graphsurgeon as gs

    from onnxopt.fusion import Emit, NameAuthority
    from onnxopt.pipeline.sessions import serialized_graph

    graph = gs.Graph(name="lora_update", opset=17)
    make = Emit(graph, NameAuthority(graph), "lora")
    scales = make.variable("lora_scales", np.float32, [loras], exact=True)
    inputs, outputs = [scales], []
    for k, (name, target) in enumerate(targets.items()):
        dtype, shape = target.base.dtype, list(target.base.shape)
        to_weight = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        base = make.variable(f"base_{k}", dtype, shape, exact=True)
        inputs.append(base)
        total = make.op.Cast(base, to=onnx.TensorProto.FLOAT, _dtype=np.float32)
        for lora, delta in enumerate(target.deltas):
            if delta is None:
                continue
            part = make.variable(f"delta_{lora}_{k}", dtype, shape, exact=True)
            inputs.append(part)
            scale = make.op.Gather(scales, make.constant(f"index{lora}", np.array([lora], np.int64)), axis=0, _shape=[1])
            total = make.op.Add(total, make.op.Mul(make.op.Cast(part, to=onnx.TensorProto.FLOAT, _dtype=np.float32), scale))
        outputs.append(make.variable(name, dtype, shape, exact=True))
        make.op.Cast(total, to=to_weight, _outputs=[outputs[-1]])
    make.into(graph)
    graph.inputs, graph.outputs = inputs, outputs
    return serialized_graph(graph)


class WeightInputs:
    """``session`` with the LoRA-touched weights fed from buffers of its own (see the module
    docstring), rewritten in place by a small update graph on the same device."""

    def __init__(self, ort, session, targets: dict[str, Target], scales: list[float], device: str, device_id: int,
                 make_update):
        self.session, self.targets = session, targets
        update = CapturedSession(ort, make_update(update_graph(targets, len(scales))), device=device, device_id=device_id)
        self.buffers = {name: update.empty(t.base.shape, t.base.dtype) for name, t in targets.items()}
        self.scales = update.buffer(np.asarray(scales, np.float32))
        inputs = {"lora_scales": self.scales}  # the base weights and deltas: uploaded once, held by the binding
        for k, target in enumerate(targets.values()):
            inputs[f"base_{k}"] = target.base
            inputs.update((f"delta_{lora}_{k}", delta.astype(target.base.dtype))
                          for lora, delta in enumerate(target.deltas) if delta is not None)
        self.update = update.bind(inputs, self.buffers)
        self.set_scales(scales)

    @property
    def bound_inputs(self) -> dict:
        """The weights every binding of this session reads (bound by
        :class:`~onnxopt.runners.captured_session.CapturedSession`)."""
        return self.buffers

    def __getattr__(self, name):  # run_with_iobinding, get_outputs, ... of the session
        return getattr(self.session, name)

    def get_inputs(self):
        return [i for i in self.session.get_inputs() if i.name not in self.targets]

    def run(self, output_names, feeds, run_options=None):
        """A plain run (host feeds): the weights as host arrays (copied from their buffers)."""
        weights = {name: value.numpy() for name, value in self.buffers.items()}
        return self.session.run(output_names, {**feeds, **weights}, run_options)

    def set_scales(self, scales: list[float]) -> None:
        write(self.scales, np.asarray(scales, np.float32))
        self.update.run()


def check_scales(targets: dict[str, Target], scales: list[float], paths: list) -> None:
    """A one-line :class:`LoraError` for a scale that is not a finite number, or scales under which a
    weight of ``targets`` may leave its dtype's range (float16's 65504: a LoRA made for float32
    weights, or a huge scale), before the update graph writes inf or NaN into it."""
    for scale, path in zip(scales, paths):
        if not math.isfinite(scale):
            raise LoraError(f"{path}: the LoRA scale must be a finite number, not {scale}")
    for name, target in targets.items():
        if target.leaves_its_range(scales):
            raise LoraError(f"{name}: the LoRAs ({', '.join(f'{Path(p).name} at {s:g}' for p, s in zip(paths, scales))}) "
                            f"may take this weight beyond {target.base.dtype}'s finite range")


class LoraWeights:
    """The LoRAs of a pipeline on its sessions: made by :meth:`session`, changed by :meth:`set_scales`."""

    def __init__(self, loras: LoraSet, provider: str, device_id: int = 0):
        self.loras, self.provider, self.device_id = loras, provider, device_id
        self.sessions: list[WeightInputs] = []

    @property
    def scales(self) -> list[float]:
        return list(self.loras.scales)

    def session(self, component: str, model, make, map_model: Path | None = None):
        """``make(model)``, with the weights the LoRAs change in ``model`` (a path, or serialized
        bytes whose weight map is ``map_model``'s) as inputs fed by this object."""
        if isinstance(model, bytes):
            proto, map_file, base_dir = onnx.load_from_string(model), map_model, Path(map_model).parent
        else:
            proto, map_file, base_dir = onnx.load(str(model), load_external_data=False), Path(model), Path(model).parent
        map_file = map_file if map_file is not None and map_path(map_file).is_file() else None
        targets = self.loras.targets(component, proto, map_file, base_dir)
        if not targets:
            return make(model)
        check_scales(targets, self.loras.scales, [lora.path for lora in self.loras.loras])
        from onnxopt.runtime import import_onnxruntime

        session = make(weights_as_inputs(proto, set(targets)), external_data_folder=base_dir)
        wrapped = WeightInputs(import_onnxruntime(), session, targets, self.loras.scales,
                               "cpu" if self.provider == "cpu" else "cuda", self.device_id,
                               lambda graph: make(graph, cuda_graph=False))
        self.sessions.append(wrapped)
        return wrapped

    def set_scales(self, scales: list[float]) -> None:
        """Each LoRA's scale (0 switches it off), written into every session's weight buffers."""
        if len(scales) != len(self.loras.loras):
            raise LoraError(f"{len(scales)} scales for {len(self.loras.loras)} LoRAs")
        scales = [float(s) for s in scales]
        for session in self.sessions:  # every weight checked before any buffer is written
            check_scales(session.targets, scales, [lora.path for lora in self.loras.loras])
        self.loras.scales = scales
        for session in self.sessions:
            session.set_scales(self.loras.scales)
