"""LoRA on an optimized pipeline folder, without re-optimizing: ``onnxopt generate FOLDER --lora FILE[:SCALE]``.

    loras = pipeline_loras(folder, plan, ["style.safetensors:0.8", "detail.safetensors"], provider)
    pipe = Pipeline.from_plan(folder, plan, loras=loras)     # the touched weights are bound inputs
    pipe.set_lora_scales([0.5, 1.0])                         # no session re-created, no graph re-captured

:mod:`onnxopt.lora.files` reads the files (diffusers/peft and kohya formats), :mod:`onnxopt.lora.targets`
finds the parameter each module changes and its place in each graph (the optimizer's weight maps),
:mod:`onnxopt.lora.session` feeds the changed weights to the sessions as bound inputs.
The weight is ``W + scale * (alpha / rank) * B @ A`` summed over the LoRAs, in the UNet and the text
encoders: what diffusers' ``load_lora_weights`` + ``set_adapters(names, adapter_weights=scales)`` runs.
"""

from __future__ import annotations

from pathlib import Path

from onnxopt.lora.files import LoraError, LoraFile, parse_lora_argument, read_lora
from onnxopt.lora.session import LoraWeights
from onnxopt.lora.targets import LoraSet

TEXT_ENCODERS = ("text_encoder", "text_encoder_2")


def pipeline_graphs(folder, plan) -> dict[str, list]:
    """component -> [(proto without external data, its file)] of every graph of the UNet and the
    text encoders the plan may run (a LoRA module must land in one of them)."""
    import onnx

    files: dict[str, list[Path]] = {}
    if folder.has("unet"):
        files["unet"] = [folder.component("unet").model]
        files["unet"] += [e.model for e in plan.sessions if e.component == "unet" and e.model is not None]
    for encoder in TEXT_ENCODERS:
        if folder.has(encoder):
            component = folder.component(encoder)
            files[encoder] = [component.model, *component.static_models.values()]
    return {component: [(onnx.load(str(p), load_external_data=False), Path(p)) for p in dict.fromkeys(paths)]
            for component, paths in files.items()}


def pipeline_loras(folder, plan, specs: list, provider: str, device_id: int = 0) -> LoraWeights | None:
    """The LoRAs ``specs`` (``FILE[:SCALE]`` strings, or (path, scale) pairs) on ``folder``'s graphs;
    None without any. Refused with one line (:class:`LoraError`) before any session exists."""
    if not specs:
        return None
    if provider == "tensorrt":
        raise LoraError("--lora runs on --provider cpu or cuda: a TensorRT engine holds its weights as built")
    parsed = [parse_lora_argument(s) if isinstance(s, str) else (Path(s[0]), float(s[1])) for s in specs]
    loras = [read_lora(path, scale, folder.config("unet")) for path, scale in parsed]
    return LoraWeights(LoraSet(loras, pipeline_graphs(folder, plan)), provider, device_id)


__all__ = ["LoraError", "LoraFile", "LoraSet", "LoraWeights", "parse_lora_argument", "pipeline_loras", "read_lora"]
