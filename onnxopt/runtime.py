"""ONNX Runtime for the whole package: its import, and every InferenceSession the package makes.

``onnxruntime`` and ``onnxruntime-gpu`` install the same module, so the package cannot depend on
either: the user picks one through the ``cpu`` or ``gpu`` extra.

ORT's own log lines (``[E:onnxruntime:...] cudnn_fe_call.cc ... No execution plans support the
graph.``, printed while cuDNN's frontend tries and discards a plan; allocation failures; warnings
about nodes placed on the CPU) are not for onnxopt's users: what fails reaches them as onnxopt's
one-line error, through the exception ORT raises as well. So every session the package creates
(:func:`inference_session`, or :func:`session_options` where a library makes the session) logs
nothing below fatal, and ORT's default logger (which some EP code logs to, whatever the session's
level) is set to the same. The switch, for debugging ORT itself::

    onnxopt.runtime.set_ort_logging(True)     # the command line's --debug does this
    with onnxopt.runtime.ort_logging(True): ...

``ONNXOPT_ORT_LOG=1`` in the environment turns it on too.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from onnxopt.errors import MissingDependencyError

# ONNX Runtime's type strings (NodeArg.type, OrtValue.data_type()) and the NumPy types they hold.
ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
             "tensor(int32)": np.int32, "tensor(double)": np.float64, "tensor(bool)": np.bool_}

ORT_QUIET = 4  # ORT's severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal
ORT_VERBOSE = 2  # warnings and errors: what ORT prints by default
_verbose = os.environ.get("ONNXOPT_ORT_LOG", "") not in ("", "0")


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise MissingDependencyError(
            "ONNX Runtime is not installed: pip install 'onnxopt[cpu]' (onnxruntime) "
            "or 'onnxopt[gpu]' (onnxruntime-gpu)"
        ) from exc
    return onnxruntime


def set_ort_logging(verbose: bool) -> None:
    """Show ONNX Runtime's own log (warnings and errors) for sessions made from now on, or not (the default)."""
    global _verbose
    _verbose = bool(verbose)


@contextlib.contextmanager
def ort_logging(verbose: bool):
    """:func:`set_ort_logging` for the sessions made inside the block."""
    global _verbose
    previous = _verbose
    set_ort_logging(verbose)
    try:
        yield
    finally:
        _verbose = previous


def ort_log_severity() -> int:
    """The severity level sessions the package makes log from."""
    return ORT_VERBOSE if _verbose else ORT_QUIET


def session_options(ort=None):
    """A SessionOptions at :func:`ort_log_severity` (ORT's default logger set to it too)."""
    ort = ort or import_onnxruntime()
    severity = ort_log_severity()
    ort.set_default_logger_severity(severity)
    options = ort.SessionOptions()
    options.log_severity_level = severity
    return options


def inference_session(model, providers, options=None):
    """``onnxruntime.InferenceSession(model, options, providers=providers)``; ``model`` a path or
    serialized bytes, ``options`` from :func:`session_options` (made when None): the one place the
    package creates sessions."""
    ort = import_onnxruntime()
    options = options if options is not None else session_options(ort)
    return ort.InferenceSession(model if isinstance(model, (bytes, str)) else str(model), options, providers=providers)
