"""The Python API: optimize a model with named passes and presets, as the CLI does."""

from __future__ import annotations

from typing import Iterable

from onnxopt import registry
from onnxopt.errors import OnnxoptError
from onnxopt.loading import load_model
from onnxopt.manager import PassManager
from onnxopt.model import Model
from onnxopt.pass_infra import Pass
from onnxopt.report import OptimizationReport
from onnxopt.verify import InputSpec, Tolerance, Verifier


def optimize(
    source,
    passes: Iterable[str | Pass] = ("cleanup",),
    *,
    verify: bool = False,
    tolerance: Tolerance | None = None,
    inputs: InputSpec | None = None,
    strict: bool = False,
    options: dict[str, dict] | None = None,
    returns: str = "model",
    explain: Iterable[str] = (),
) -> tuple[Model | object, OptimizationReport]:
    """Load ``source`` (path, ModelProto, graph, Model, ``onnx_ir.Model`` or
    ``torch.onnx.ONNXProgram``), run ``passes`` and return the result.

    ``returns="same"`` gives the result as the kind ``source`` was (a path gives a Model: save it
    with :func:`onnxopt.save_model`). onnx-ir models and ONNX programs go in and out without a
    copy of their weights: unchanged initializers are the source's own tensors
    (:mod:`onnxopt.integrations.ir_models`).

    Names may be passes or presets (``cleanup``). The source is never modified: a Model or graph
    given in memory is copied first. ``options`` maps a pass name to its constructor arguments
    (``{"fp16": {"fp32_ops": ["Resize"]}}``), wherever that pass comes from. With ``verify``, the result of every pass is compared with the
    source on random inputs and the report names the first pass that broke ``tolerance``.
    ``explain``: pass names (auto-inserted ones too) whose every candidate site is traced, for
    ``report.explain()``.
    """
    if returns not in ("model", "same"):
        raise OnnxoptError(f"returns must be 'model' or 'same', not {returns!r}")
    model = _load_any(source)
    steps: list[str | Pass] = []
    requested: set[str] = set()  # named by the caller, not brought in by a preset
    for p in passes:
        if isinstance(p, str) and p not in registry.PRESETS:
            requested.add(p)
        elif not isinstance(p, str):
            requested.add(p.name)
        steps.extend(registry.expand([p]) if isinstance(p, str) else [p])
    options = options or {}
    steps = [registry.get_pass(s)(**options.get(s, {})) if isinstance(s, str) else s for s in steps]
    verifier = Verifier(model, tolerance=tolerance, inputs=inputs) if verify else None
    try:
        report = PassManager(steps, verifier=verifier, strict=strict, requested=requested,
                             explain=explain).run(model)
        if verifier is not None:
            report.notes.extend(verifier.notes)
    finally:
        if verifier is not None:
            verifier.close()
    return (_same_kind(model, source) if returns == "same" else model), report


def _load_any(source) -> Model:
    from onnxopt.integrations import ir_models, torch_export

    if torch_export.is_onnx_program(source):
        return torch_export.from_onnx_program(source)
    if ir_models.is_ir_model(source):
        return ir_models.from_ir_model(source)
    return load_model(source)


def _same_kind(model: Model, source):
    """``model`` as the kind of object ``source`` is."""
    import onnx
    import onnx_graphsurgeon as gs

    from onnxopt.integrations import ir_models, torch_export

    if torch_export.is_onnx_program(source):
        return torch_export.to_onnx_program(model, source)
    if ir_models.is_ir_model(source):
        return ir_models.to_ir_model(model)
    if isinstance(source, onnx.ModelProto):
        return model.alone().to_onnx()
    if isinstance(source, gs.Graph):
        return model.graph
    return model


def context_and_denoiser(model: Model, companion: str = "context_kv") -> tuple[Model, Model]:
    """The two models a ``context-kv`` run makes: (context graph, denoiser). Run the context graph
    once per prompt; feed its outputs, by name, to the denoiser at every step. (``save_model``
    writes both: ``out.onnx`` and ``out.context_kv.onnx``.)"""
    if companion not in model.companions:
        raise OnnxoptError(f"the model has no '{companion}' companion: run the context-kv pass (--passes ort-cuda,context-kv)")
    return model.companions[companion], model.alone()
