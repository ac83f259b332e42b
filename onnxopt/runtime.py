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

import ml_dtypes
import numpy as np

from onnxopt.errors import MissingDependencyError, OnnxoptError

# ONNX Runtime's type strings (NodeArg.type, OrtValue.data_type()) and the NumPy types they hold
# (bfloat16: ml_dtypes', which onnx itself uses; NumPy has none).
ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
             "tensor(int32)": np.int32, "tensor(double)": np.float64, "tensor(bool)": np.bool_,
             "tensor(bfloat16)": ml_dtypes.bfloat16, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
             "tensor(int16)": np.int16, "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32,
             "tensor(uint64)": np.uint64}

# Types ORT's Python API cannot take as NumPy arrays (ONNX Runtime 1.32), by dtype: (ONNX element
# type, the NumPy type of the same width whose bytes ORT does take). What 1.32 does with bfloat16:
#   InferenceSession.run(feed of ml_dtypes.bfloat16)          fails: "Numpy_type 256 can't be converted to MLDataType"
#   InferenceSession.run(feed of its uint16 bits)             fails: "expected (tensor(bfloat16))"
#   OrtValue.ortvalue_from_numpy(ml_dtypes array)             fails: "only supported from non-string numpy arrays"
#   OrtValue.ortvalue_from_shape_and_type(shape, ml_dtypes)   fails the same way
#   OrtValue.ortvalue_from_numpy_with_onnx_type(uint16 bits, BFLOAT16)   works (CPU, shares the array's memory)
#   OrtValue.ortvalue_from_shape_and_type(shape, BFLOAT16 as an int, device)   works (its docs: for
#                                                             types NumPy lacks)
#   bf16 OrtValue.update_inplace(uint16 bits)                 works (a bf16 array: fails as above)
#   bf16 OrtValue.numpy(), and run() returning a bf16 output  fail: "No corresponding Numpy type"
#   host OrtValue over uint16 bits .update_inplace(bf16 OrtValue)   works: the read-back used here
# So a bf16 value goes to ORT as an OrtValue made from its bits, the session runs on OrtValues, and
# a bf16 output comes back through a host buffer of uint16 bits, read as float32 (exact). Measured
# on the CPU EP (tests/test_pipeline_bf16_io.py); the CUDA side: benchmarks/bf16_io_gpu.py.
BITS_ONLY = {np.dtype(ml_dtypes.bfloat16): (16, np.uint16)}  # 16: onnx.TensorProto.BFLOAT16

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


# ONNX Runtime's graph optimization levels (SessionOptions.graph_optimization_level) by name; "all" is
# ORT's default.
OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")


def graph_optimization_level(ort, name: str):
    """ORT's ``GraphOptimizationLevel`` called ``name`` (one of OPTIMIZATION_LEVELS); a one-line error
    (exit code 2) for another name."""
    if name not in OPTIMIZATION_LEVELS:
        raise OnnxoptError(f"unknown graph optimization level '{name}' (choose from {', '.join(OPTIMIZATION_LEVELS)})")
    level = ort.GraphOptimizationLevel
    return {"disable": level.ORT_DISABLE_ALL, "basic": level.ORT_ENABLE_BASIC, "extended": level.ORT_ENABLE_EXTENDED,
            "all": level.ORT_ENABLE_ALL}[name]


def inference_session(model, providers, options=None):
    """``onnxruntime.InferenceSession(model, options, providers=providers)``; ``model`` a path or
    serialized bytes, ``options`` from :func:`session_options` (made when None): the one place the
    package creates sessions."""
    ort = import_onnxruntime()
    options = options if options is not None else session_options(ort)
    return ort.InferenceSession(model if isinstance(model, (bytes, str)) else str(model), options, providers=providers)


def input_dtype(spec, where: str = "") -> np.dtype:
    """The NumPy type a session input (a NodeArg: ``name``, ``type``) is fed in; a one-line error
    (exit code 2) for a type onnxopt cannot feed (a string, float8, a sequence...)."""
    dtype = ORT_TYPES.get(spec.type)
    if dtype is None:
        fed = ", ".join(sorted(t[len("tensor("):-1] for t in ORT_TYPES))
        raise OnnxoptError(f"{where + ': ' if where else ''}input {spec.name} is {spec.type}: onnxopt feeds only "
                           f"{fed} tensors")
    return np.dtype(dtype)


def as_type(value, dtype) -> np.ndarray:
    """``value`` as a contiguous array of ``dtype``. bfloat16 is rounded to nearest even from float32,
    as torch's ``.to(torch.bfloat16)`` rounds (a float64 goes to float32 first, as torch's float32
    timesteps do); a value already bfloat16, or exactly representable, is unchanged. A 0-d value
    stays 0-d (``np.ascontiguousarray`` would make it 1-d: a scalar input fed as [1])."""
    array = np.asarray(value)
    dtype = np.dtype(dtype)
    if dtype in BITS_ONLY and array.dtype == np.float64:
        array = array.astype(np.float32)
    return np.asarray(array.astype(dtype, copy=False), order="C")


def ortvalue(ort, value, dtype=None, device: str = "cpu", device_id: int = 0):
    """An OrtValue holding ``value`` (cast to ``dtype``). On the CPU it shares the cast array's memory
    (``ortvalue_from_numpy``), elsewhere it is a copy; bfloat16 goes through its bits (see BITS_ONLY)."""
    array = as_type(value, dtype if dtype is not None else np.asarray(value).dtype)
    if array.dtype not in BITS_ONLY:
        return ort.OrtValue.ortvalue_from_numpy(array, device, device_id)
    element, bits = BITS_ONLY[array.dtype]
    if device == "cpu":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(bits), element)
    result = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), element, device, device_id)
    result.update_inplace(array.view(bits))
    return result


def empty_ortvalue(ort, shape, dtype, device: str = "cpu", device_id: int = 0):
    """A fresh OrtValue of ``shape`` and ``dtype`` on ``device`` (contents undefined)."""
    dtype = np.dtype(dtype)
    element = BITS_ONLY[dtype][0] if dtype in BITS_ONLY else dtype.type
    return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), element, device, device_id)


def update_ortvalue(target, value, dtype=None) -> None:
    """``value`` (cast to ``dtype``, else to the target's own type) into ``target`` in place: the
    address a captured graph reads stays."""
    array = as_type(value, dtype if dtype is not None else ORT_TYPES.get(target.data_type(), np.asarray(value).dtype))
    target.update_inplace(array.view(BITS_ONLY[array.dtype][1]) if array.dtype in BITS_ONLY else array)


def host_array(ort, value) -> np.ndarray:
    """An OrtValue's contents on the host, as NumPy: a bfloat16 value as float32 (exact), since the
    host computes with it (latents, images, embeddings another graph reads in its own type)."""
    dtype = ORT_TYPES.get(value.data_type())
    if dtype is None or np.dtype(dtype) not in BITS_ONLY:
        return value.numpy()
    element, bits = BITS_ONLY[np.dtype(dtype)]
    host = np.empty(value.shape(), bits)
    ort.OrtValue.ortvalue_from_numpy_with_onnx_type(host, element).update_inplace(value)  # a copy from any device
    return host.view(dtype).astype(np.float32)


def needs_ortvalues(session) -> bool:
    """Whether ``InferenceSession.run`` cannot take this session's feeds or give its outputs as
    NumPy (a bfloat16 input or output: see BITS_ONLY)."""
    types = [ORT_TYPES.get(spec.type) for spec in [*session.get_inputs(), *session.get_outputs()]]
    return any(t is not None and np.dtype(t) in BITS_ONLY for t in types)


def run_session(ort, session, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """``session.run(names, feeds)``, feeds already of the session's input types, for any session:
    one with bfloat16 inputs or outputs runs on OrtValues (bf16 outputs come back float32)."""
    if not (isinstance(session, ort.InferenceSession) and needs_ortvalues(session)):
        return session.run(names, feeds)  # NumPy types, or a wrapper that feeds ORT itself (CapturedSession)
    values = {name: ortvalue(ort, array) for name, array in feeds.items()}
    return [host_array(ort, out) for out in session.run_with_ort_values(names, values)]
