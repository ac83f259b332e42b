"""ControlNet hint once per image (seeds 001, 003): the conditioning embedding split off the ControlNet.

The ControlNet's conditioning embedding (the hint block: a stack of convolutions over the control
image) reads ``controlnet_cond`` alone, which does not change during the denoising loop. The cut is
``context-kv``'s rule applied to that input: everything computed from ``controlnet_cond`` and
constants only moves to a graph run once per image::

    before (controlnet/model.onnx, every step):
        controlnet_cond ─ Conv ─ SiLU ─ ... ─ Conv ──────────────┐ hint
        sample ─ conv_in ────────────────────────────────────── Add ─ down blocks ─ ... ─ residuals

    after:
        controlnet/step.hint.onnx (once per image):
            controlnet_cond ─ Conv ─ SiLU ─ ... ─ Conv ─ controlnet_hint
        controlnet/step.onnx (every step):
            controlnet_hint (input) ───────────────────────────┐
            sample ─ conv_in ────────────────────────────────── Add ─ down blocks ─ ... ─ residuals

Both files refer to the ControlNet's own data file (no weight written twice). The interface
tensors are renamed ``controlnet_hint`` (``controlnet_hint.<i>`` when there are several). When the
rule finds nothing to cut (no ``controlnet_cond`` input, or nothing reads it alone), nothing is
written and the pipeline runs ``model.onnx`` as before. The runner runs the hint graph once per
image and feeds its outputs, by name, to the step graph at every step
(``tests/test_pipeline_generate.py`` proves the image unchanged).
"""

from __future__ import annotations

import os
from pathlib import Path

from onnxopt.pipeline.folder import HINT_COMPANION, STEP_FILE

HINT_INPUT = "controlnet_cond"
COMPANION = HINT_COMPANION  # the folder's names (onnxopt.pipeline.folder)


def write_hint_graph(controlnet_dir: str | os.PathLike) -> Path | None:
    """Split ``controlnet_dir/model.onnx`` into ``step.onnx`` (every step) and ``step.hint.onnx``
    (once per image), written atomically beside it; returns the step graph's path, or None when
    there is nothing to split."""
    from onnxopt.api import optimize
    from onnxopt.saving import save_model

    controlnet_dir = Path(controlnet_dir)
    model, _ = optimize(controlnet_dir / "model.onnx", ["context-kv"],
                        options={"context-kv": {"context_input": HINT_INPUT, "companion": COMPANION}})
    hint = model.companions.get(COMPANION)
    if hint is None:
        return None
    interface = [t.name for t in hint.graph.outputs]
    names = {old: "controlnet_hint" if len(interface) == 1 else f"controlnet_hint.{i}" for i, old in enumerate(interface)}
    for graph in (model.graph, hint.graph):  # the same name on both sides of the cut
        for tensor in graph.tensors().values():
            if tensor.name in names:
                tensor.name = names[tensor.name]
    return save_model(model, controlnet_dir / STEP_FILE, reference_external=True).path
