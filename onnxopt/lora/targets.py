"""Where each LoRA module lands: the parameter it changes, and that parameter's place in each graph.

    loras = LoraSet([read_lora("a.safetensors", 0.8)], {"unet": [unet/step.onnx, ...], ...})
    loras.targets("unet", proto, map_file)   # {initializer: Target} of one graph file
    target.value(scales)                     # base + sum_l scale_l * delta_l, in the weight's dtype

A module matches the parameter whose module path ends with the module's name, at a dot (peft's
``down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q`` in ``unet.down_blocks...``) or at
an underscore for kohya's names (``lora_unet_down_blocks_0_..._to_q``). The text encoder's
``text_model.`` level is ignored on both sides: transformers 5's ``CLIPTextModel`` has none, so a
graph exported from it lacks it while LoRA files in the wild carry it (diffusers reads both). Each
module must match exactly one parameter of its component, in the graphs the pipeline runs; else
the LoRA is refused, saying how many of its modules matched.

The parameter's place in a graph comes from the weight map the optimizer wrote beside it
(``<stem>.weights.json``: packed Q/K/V slices, merged GEMMs, transposes, casts), or for a graph
written by an exporter, from the exporter's names (:mod:`onnxopt.weight_provenance`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnxopt.lora.files import LoraError, LoraFile, LoraModule
from onnxopt.weight_provenance import carried_shape, carry, file_sources, parameter_module


def graph_sources(proto, map_file: Path | None) -> dict[str, list]:
    """{initializer: [(parameter, ops)]} of a graph file (its weight map, or its exporter's names)."""
    from onnxopt.loading import node_scopes

    return file_sources(proto, map_file, node_scopes(proto.graph))


def _plain(name: str) -> str:
    return re.sub(r"(^|\.)text_model\.", r"\1", name)


def module_matches(parameter_module: str, module: LoraModule) -> bool:
    """``module`` (as its file names it) is the torch module ``parameter_module`` (as the export names it)."""
    path, name = _plain(parameter_module), module.module
    if module.kohya:
        path, name, sep = path.replace(".", "_"), re.sub(r"^text_model_", "", name), "_"
    else:
        name, sep = _plain(name), "."
    return path == name or path.endswith(sep + name)


@dataclass
class Target:
    """One initializer some LoRA changes: its base value and each LoRA's delta in its layout."""

    name: str
    base: np.ndarray
    deltas: list  # per LoRA: float32 array of the base's shape, or None (that LoRA leaves it alone)

    def leaves_its_range(self, scales: list[float]) -> bool:
        """Whether ``base + sum_l scale_l * delta_l`` may leave the finite range of the weight's dtype
        (bounded by ``max|base| + sum_l |scale_l| * max|delta_l|``), or a delta is not finite itself
        (then even scale 0 gives NaN: 0 * inf): the update graph would write inf or NaN weights."""
        limit = float(np.finfo(self.base.dtype).max) if np.issubdtype(self.base.dtype, np.floating) else np.inf
        bound = float(np.abs(self.base.astype(np.float32)).max(initial=0))
        for scale, delta in zip(scales, self.deltas):
            if delta is not None:
                largest = float(np.abs(delta).max(initial=0))
                if not np.isfinite(largest) or largest > limit:
                    return True
                bound += abs(scale) * largest
        return not bound <= limit

    def value(self, scales: list[float]) -> np.ndarray:
        total = self.base.astype(np.float32)
        for scale, delta in zip(scales, self.deltas):
            if delta is not None and scale != 0:
                total = total + np.float32(scale) * delta
        return total.astype(self.base.dtype)


@dataclass
class LoraSet:
    """The LoRAs of one pipeline, their scales, and the parameter each of their modules changes."""

    loras: list[LoraFile]
    graphs: dict  # component -> [(proto, map file)] of every graph of it the pipeline may run
    scales: list[float] = field(init=False)
    changes: dict = field(init=False)  # (component, parameter) -> [(LoRA index, LoraModule)]

    def __post_init__(self):
        self.scales = [lora.scale for lora in self.loras]
        self._known = {component: {p for proto, map_file in graphs for parts in graph_sources(proto, map_file).values()
                                   for p, _ in parts} for component, graphs in self.graphs.items()}
        self.changes = {}
        for k, lora in enumerate(self.loras):
            for module in lora.modules:
                self.changes.setdefault((module.component, self._parameter(lora, module)), []).append((k, module))
        for component, graphs in self.graphs.items():  # every delta fits where it lands, before any session
            for proto, map_file in graphs:
                dims = {t.name: tuple(t.dims) for t in proto.graph.initializer}
                for name, parts in graph_sources(proto, map_file).items():
                    for parameter, ops in parts:
                        for k, module in self.changes.get((component, parameter), []):
                            _check_fits(module, ops, dims.get(name), self.loras[k].path)

    def _parameters(self, component: str) -> set[str]:
        return self._known.get(component, set())

    def _parameter(self, lora: LoraFile, module: LoraModule) -> str:
        candidates = {p for p in self._parameters(module.component) if module_matches(parameter_module(p), module)}
        if len(candidates) == 1:
            return candidates.pop()
        matched = sum(1 for m in lora.modules if len({p for p in self._parameters(m.component)
                                                       if module_matches(parameter_module(p), m)}) == 1)
        why = (f"no {module.component} weight of the pipeline is {module.module!r}" if not candidates else
               f"{module.module!r} could be any of {len(candidates)} weights ({', '.join(sorted(candidates)[:2])}...)")
        raise LoraError(f"{lora.path}: {matched} of {len(lora.modules)} LoRA modules match a weight of this pipeline; "
                        f"{why}")

    def targets(self, component: str, proto, map_file: Path | None, base_dir: Path) -> dict[str, Target]:
        """{initializer name: Target} of one graph file of ``component`` (``proto`` loaded without its external data)."""
        from onnx import numpy_helper

        initializers = {t.name: t for t in proto.graph.initializer}
        found = {}
        for name, parts in graph_sources(proto, map_file).items():
            touched = [(p, ops) for p, ops in parts if (component, p) in self.changes]
            if not touched or name not in initializers:
                continue
            dims = tuple(initializers[name].dims)
            deltas: list = [None] * len(self.loras)
            for parameter, ops in touched:
                for k, module in self.changes[(component, parameter)]:
                    part = _carried(module, ops, dims, self.loras[k].path)
                    deltas[k] = part if deltas[k] is None else deltas[k] + part
            found[name] = Target(name, numpy_helper.to_array(initializers[name], base_dir=str(base_dir)), deltas)
        return found


def _check_fits(module: LoraModule, ops: list, dims: tuple | None, path: Path) -> None:
    shape = (module.up.shape[0], *module.down.shape[1:])
    if dims is None or carried_shape(shape, ops) != tuple(dims):
        raise LoraError(f"{path}: {module.component}.{module.module}: its delta {list(shape)} does not fit the "
                        f"weight it changes ({list(dims or ())} in the graph)")


def _carried(module: LoraModule, ops: list, dims: tuple, path: Path) -> np.ndarray:
    _check_fits(module, ops, dims, path)
    return carry(module.delta(), ops).astype(np.float32)


__all__ = ["LoraSet", "Target", "module_matches"]
