"""Import ONNX Runtime with a clear message when it is missing.

``onnxruntime`` and ``onnxruntime-gpu`` install the same module, so the package cannot depend on
either: the user picks one through the ``cpu`` or ``gpu`` extra.
"""

from __future__ import annotations

from onnxopt.errors import MissingDependencyError


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise MissingDependencyError(
            "ONNX Runtime is not installed: pip install 'onnxopt[cpu]' (onnxruntime) "
            "or 'onnxopt[gpu]' (onnxruntime-gpu)"
        ) from exc
    return onnxruntime
