"""``torch.onnx.ONNXProgram`` (what ``torch.onnx.export(..., dynamo=True)`` returns) in and out.

The program's model is an onnx-ir model whose initializers wrap the torch module's parameters;
:mod:`onnxopt.integrations.ir_models` carries them through without a copy. The program given
back keeps the source's ``exported_program``, so ``save()`` and friends work as on any program.
"""

from __future__ import annotations

from onnxopt.integrations import require
from onnxopt.integrations.ir_models import from_ir_model, to_ir_model
from onnxopt.model import Model


def is_onnx_program(obj) -> bool:
    """Whether ``obj`` is a ``torch.onnx.ONNXProgram``, without importing torch when it is not."""
    return type(obj).__name__ == "ONNXProgram" and type(obj).__module__.startswith("torch.onnx")


def from_onnx_program(program) -> Model:
    return from_ir_model(program.model)


def to_onnx_program(model: Model, like):
    """A new ``ONNXProgram`` holding ``model``, with ``like``'s exported program."""
    torch = require("torch", "torch (pip install 'onnxopt[models]')")
    return torch.onnx.ONNXProgram(to_ir_model(model), getattr(like, "exported_program", None))
