"""What the pipeline reads from a text encoder graph: the named outputs it needs, and the
penultimate hidden state (SDXL's and SD3's conditioning) by optimum's output names."""

from __future__ import annotations

import numpy as np

from onnxopt.errors import OnnxoptError
from onnxopt.pipeline.sessions import input_types


def penultimate_name(session) -> str:
    """The encoder's hidden_states[-2] output: ``hidden_states.{L-1}`` of 0..L (optimum's names)."""
    names = [o.name for o in session.get_outputs()]
    layers = sorted(int(n.split(".")[1]) for n in names if n.startswith("hidden_states.") and n.split(".")[1].isdigit())
    if layers:
        return f"hidden_states.{layers[-1] - 1}"
    if "penultimate_hidden_state" in names:
        return "penultimate_hidden_state"
    raise OnnxoptError("the text encoder has no hidden_states.{i} outputs (SDXL and SD3 read the penultimate one: "
                       "export it with output_hidden_states)")


def run_outputs(session, input_ids: np.ndarray, names: list[str]) -> list[np.ndarray]:
    """A text encoder's ``names`` outputs only: SDXL's encoders have 14 and 34 outputs (every
    hidden state) of which the pipeline reads one or two, and each output fetched is a copy from
    the device (CapturedSession copies only the ones asked for)."""
    dtype = input_types(session)["input_ids"]
    return session.run(names, {"input_ids": np.ascontiguousarray(input_ids.astype(dtype, copy=False))})
