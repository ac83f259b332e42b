"""Shared pieces of the com.microsoft reference kernels: the OpRun base class and math helpers."""

from __future__ import annotations

import math

import numpy as np
from onnx.reference.op_run import OpRun

try:  # scipy's erf is vectorised; math.erf is exact too but per element.
    from scipy.special import erf as _erf
except ImportError:  # pragma: no cover - scipy is optional
    _erf = np.vectorize(math.erf, otypes=[np.float64])

from onnxopt.domains import MS_DOMAIN  # noqa: E402,F401


class ContribOp(OpRun):
    """Base class for the com.microsoft kernels.

    ``op_schema = None`` matters: OpRun otherwise looks its schema up by op_type among the
    standard ONNX ops, and ``Gelu`` and ``Attention`` also exist there (opset 20 / 23) with
    other attributes, which would be injected as keyword arguments into ``_run``.
    """

    op_domain = MS_DOMAIN
    op_schema = None

    def _name(self) -> str:
        return f"{MS_DOMAIN}.{self.onnx_node.op_type}"

    def _reject(self, what: str) -> NotImplementedError:
        """Error for a spec-defined feature that these reference kernels do not implement."""
        return NotImplementedError(f"{self._name()}: {what} is not supported by the reference kernel")

    def _invalid(self, what: str) -> ValueError:
        """Error for inputs or attributes that violate the op's specification."""
        return ValueError(f"{self._name()}: {what}")

    def _require(self, **attrs) -> None:
        for name, value in attrs.items():
            if value is None:
                raise self._invalid(f"required attribute {name!r} is missing")

    def _wants_output(self, index: int) -> bool:
        """True when the node binds optional output ``index`` to a name."""
        outs = self.onnx_node.output
        return index < len(outs) and outs[index] != ""

    def run(self, *args, **kwargs):
        # Kernels return every output; drop those bound to "". The evaluator stores results under
        # the node's output names, and "" is also the name that resolves omitted optional *inputs*
        # to None: an array stored there would be fed to later nodes as their omitted input.
        results = super().run(*args, **kwargs)
        return tuple(None if name == "" else value for name, value in zip(self.onnx_node.output, results))


def compute_dtype(x: np.ndarray) -> type:
    """The precision the kernels compute in: float32 for fp16/bf16/fp32, float64 for double."""
    return np.float64 if x.dtype == np.float64 else np.float32


def erf(x: np.ndarray) -> np.ndarray:
    return _erf(x).astype(x.dtype, copy=False)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """Exact GELU: x * 0.5 * (1 + erf(x / sqrt(2)))."""
    return x * 0.5 * (1.0 + erf(x * x.dtype.type(1.0 / math.sqrt(2.0))))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """Tanh GELU approximation: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))."""
    k = x.dtype.type(math.sqrt(2.0 / math.pi))
    return 0.5 * x * (1.0 + np.tanh(k * (x + x.dtype.type(0.044715) * x * x * x)))


def sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a non-positive number never overflows, so no warnings for large |x|.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype, copy=False)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)
