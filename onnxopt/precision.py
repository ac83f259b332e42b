"""Facts that precision decisions rest on: low-precision formats, op signatures, value ranges.

Used by the ``fp16`` pass (``passes/fp16.py``) and its hazard rules (``onnxopt/fp16_hazards.py``);
nothing here edits a graph.

* :class:`LowPrecision` — float16 or bfloat16: its ONNX type, range, and how a float32 array is
  converted (attention masks clamped to a finite fill value, which is how they are kept
  finite).
* :func:`signature` — which type parameter every input and output of a node is bound to, and which
  element types the parameter allows, from the operator schema: ``onnx.defs`` for the standard
  domain, ONNX Runtime's own schema registry for ``com.microsoft`` (with a vendored copy of the
  contrib ops onnxopt emits, for when ONNX Runtime is not installed). A pass decides per input
  from these constraints, not from a list of op names.
* :func:`element_types` — every tensor's element type: the annotated one, else propagated through
  the signatures (ONNX shape inference does not know the contrib ops).
* :func:`data_dependent` — which tensors depend on the *values* of the graph inputs (as opposed to
  constants and shapes only).
* :func:`calibrate` — runs the float32 model on CPU (ONNX Runtime, or onnxopt's reference
  evaluator where ORT's CPU EP lacks a contrib kernel) with every intermediate tensor exposed, and
  records each tensor's largest magnitude.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto

from onnxopt.domains import MS_DOMAIN
from onnxopt.model import Model
from onnxopt.weights import constant_data_type, element_sources, iter_values_bytes, onnx_dtype_to_numpy

FLOAT = TensorProto.FLOAT


# ---------------------------------------------------------------- low-precision formats


@dataclass(frozen=True)
class LowPrecision:
    name: str  # "float16" | "bfloat16"
    np_dtype: np.dtype
    onnx_type: int
    max: float  # largest finite magnitude
    tiny: float  # smallest positive subnormal

    @property
    def type_str(self) -> str:
        return f"tensor({self.name})"

    @property
    def mask_fill(self) -> float:
        """The value an additive attention mask's -inf / -3.4e38 becomes: -max/2 (-32752 in float16).

        Any value that makes ``exp`` underflow gives the same softmax on rows with an unmasked
        entry; half the range leaves headroom so that the mask plus a score, or plus a second mask,
        stays finite, and a fully masked row gives finite weights instead of NaN.
        """
        return -self.max / 2

    def convert(self, array: np.ndarray, mask: bool = False) -> np.ndarray:
        """``array`` rounded to this format; ``mask``: values below :attr:`mask_fill` (±inf too) become it."""
        array = np.asarray(array)
        if mask:
            array = np.asarray(np.clip(array, self.mask_fill, self.max))  # np.clip of a 0-d array is a scalar
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(array.astype(self.np_dtype))


def _low(name: str, dtype) -> LowPrecision:
    info = ml_dtypes.finfo(dtype)
    return LowPrecision(name, np.dtype(dtype), onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
                        float(info.max), float(info.smallest_subnormal))


LOW_PRECISIONS = {
    "float16": _low("float16", np.float16),
    "bfloat16": _low("bfloat16", ml_dtypes.bfloat16),
}


def low_precision(name: str) -> LowPrecision:
    try:
        return LOW_PRECISIONS[name]
    except KeyError:
        raise ValueError(f"low_precision must be one of {sorted(LOW_PRECISIONS)}, not {name!r}") from None


# ---------------------------------------------------------------- element types


def type_str(elem_type: int) -> str:
    """ONNX's type string for an element type: FLOAT -> 'tensor(float)'."""
    return "tensor(" + _TYPE_NAMES[elem_type] + ")"


_TYPE_NAMES = {
    TensorProto.FLOAT: "float", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16",
    TensorProto.DOUBLE: "double", TensorProto.INT8: "int8", TensorProto.INT16: "int16",
    TensorProto.INT32: "int32", TensorProto.INT64: "int64", TensorProto.UINT8: "uint8",
    TensorProto.UINT16: "uint16", TensorProto.UINT32: "uint32", TensorProto.UINT64: "uint64",
    TensorProto.BOOL: "bool", TensorProto.STRING: "string",
}


def elem_type_of(tensor: gs.Tensor) -> int | None:
    """The tensor's annotated ONNX element type, or None when unknown."""
    if isinstance(tensor, gs.Constant):
        return constant_data_type(tensor)
    dtype = tensor.dtype
    if dtype is None:
        return None
    if isinstance(dtype, (int, np.integer)):
        return int(dtype)
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except (KeyError, TypeError, ValueError):
        return None


# ---------------------------------------------------------------- signatures


@dataclass(frozen=True)
class Signature:
    """Which type each input and output of an op is bound to.

    ``inputs[i]`` / ``outputs[j]`` is a type parameter name ("T") or a fixed type string
    ("tensor(float)"); the last formal parameter repeats when it is variadic. ``allowed`` maps each
    type parameter to the type strings it admits.
    """

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    variadic_input: bool
    variadic_output: bool
    allowed: dict[str, frozenset[str]]
    heterogeneous: bool = False  # a variadic parameter whose elements may differ (Loop, If, ...)
    attributes: frozenset[str] = frozenset()

    def input_param(self, index: int) -> str | None:
        return _param(self.inputs, index, self.variadic_input)

    def output_param(self, index: int) -> str | None:
        return _param(self.outputs, index, self.variadic_output)

    def allows(self, param: str, type_string: str) -> bool:
        if param.startswith("tensor("):
            return param == type_string
        return type_string in self.allowed.get(param, ())

    def is_fixed(self, param: str) -> bool:
        return param.startswith("tensor(") or param not in self.allowed


def _param(params: tuple[str, ...], index: int, variadic: bool) -> str | None:
    if index < len(params):
        return params[index]
    if variadic and params:
        return params[-1]
    return None


def _is_variadic(option) -> bool:
    return str(option).endswith("Variadic")


@functools.lru_cache(maxsize=4096)
def _onnx_signature(op: str, domain: str, version: int) -> Signature | None:
    try:
        schema = onnx.defs.get_schema(op, max_inclusive_version=version, domain=domain)
    except onnx.defs.SchemaError:
        return None
    heterogeneous = any(_is_variadic(p.option) and not p.is_homogeneous for p in (*schema.inputs, *schema.outputs))
    return Signature(
        op=op,
        inputs=tuple(p.type_str for p in schema.inputs),
        outputs=tuple(p.type_str for p in schema.outputs),
        variadic_input=bool(schema.inputs) and _is_variadic(schema.inputs[-1].option),
        variadic_output=bool(schema.outputs) and _is_variadic(schema.outputs[-1].option),
        allowed={c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints},
        heterogeneous=heterogeneous,
        attributes=frozenset(schema.attributes),
    )


# The com.microsoft ops onnxopt's fusions emit, as ONNX Runtime 1.31.1 registers them
# (onnxruntime.capi.onnxruntime_pybind11_state.get_all_operator_schema(); tests/test_fp16.py checks
# this copy against the installed ORT). Used when ORT's registry is unavailable.
_F16_F32 = frozenset({"tensor(float16)", "tensor(float)"})
_F16_F32_BF16 = _F16_F32 | {"tensor(bfloat16)"}
_F16_F32_F64_BF16 = _F16_F32_BF16 | {"tensor(double)"}
CONTRIB_SIGNATURES: dict[str, Signature] = {
    s.op: s
    for s in [
        Signature("GroupNorm", ("T", "M", "M"), ("T",), False, False, {"T": _F16_F32, "M": _F16_F32}),
        Signature("SkipGroupNorm", ("T", "M", "M", "T", "T"), ("T", "T"), False, False, {"T": _F16_F32, "M": _F16_F32}),
        Signature("SkipLayerNormalization", ("T", "T", "T", "T", "T"), ("T", "U", "U", "T"), False, False,
                  {"T": _F16_F32_BF16, "U": frozenset({"tensor(float)"})}),
        Signature("SkipSimplifiedLayerNormalization", ("T", "T", "T", "T"), ("T", "U", "U", "T"), False, False,
                  {"T": _F16_F32_BF16, "U": frozenset({"tensor(float)"})}),
        Signature("MultiHeadAttention", ("T", "T", "T", "T", "M", "T", "T", "T", "M", "M"), ("T", "T", "T", "QK"),
                  False, False, {"T": _F16_F32_BF16, "QK": _F16_F32_BF16, "M": frozenset({"tensor(int32)"})}),
        Signature("Attention", ("T", "T", "T", "M", "T", "T", "M"), ("T", "T"), False, False,
                  {"T": _F16_F32_BF16, "M": frozenset({"tensor(int32)"})}),
        Signature("BiasSplitGelu", ("T", "T"), ("T",), False, False, {"T": _F16_F32}),
        Signature("BiasAdd", ("T", "T", "T"), ("T",), False, False, {"T": _F16_F32}),
        Signature("NhwcConv", ("T", "T", "T"), ("T",), False, False, {"T": _F16_F32 | {"tensor(double)"}}),
        Signature("Gelu", ("T",), ("T",), False, False, {"T": _F16_F32_F64_BF16}),
        Signature("BiasGelu", ("T", "T"), ("T",), False, False, {"T": _F16_F32_F64_BF16}),
        Signature("FastGelu", ("T", "T"), ("T",), False, False, {"T": _F16_F32_F64_BF16}),
        Signature("QuickGelu", ("T",), ("T",), False, False, {"T": _F16_F32_F64_BF16}),
    ]
}


# Ops ONNX Runtime registers in the ONNX domain that ONNX itself does not define (onnx.defs has no
# schema for them): SimplifiedLayerNormalization, which fuse-rms-norm writes (RMSNorm).
ORT_ONNX_DOMAIN_SIGNATURES: dict[str, Signature] = {
    "SimplifiedLayerNormalization": Signature(
        "SimplifiedLayerNormalization", ("T", "V"), ("V", "U"), False, False,
        {"T": _F16_F32_F64_BF16, "V": _F16_F32_F64_BF16, "U": frozenset({"tensor(float)", "tensor(double)"})}),
}


def ort_contrib_signatures() -> dict[str, Signature]:
    """Every com.microsoft op in the installed ONNX Runtime's schema registry ({} without ORT)."""
    return ort_signatures(MS_DOMAIN)


@functools.lru_cache(maxsize=4)
def ort_signatures(domain: str) -> dict[str, Signature]:
    """Every op of ``domain`` ("" for the ONNX domain) in the installed ONNX Runtime's schema
    registry ({} without ORT)."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_c
    except ImportError:
        return {}
    latest: dict[str, object] = {}
    for schema in ort_c.get_all_operator_schema():
        if schema.domain == domain and (schema.name not in latest or schema.since_version > latest[schema.name].since_version):
            latest[schema.name] = schema
    out = {}
    for name, schema in latest.items():
        out[name] = Signature(
            op=name,
            inputs=tuple(p.typeStr for p in schema.inputs),
            outputs=tuple(p.typeStr for p in schema.outputs),
            variadic_input=bool(schema.inputs) and _is_variadic(schema.inputs[-1].option),
            variadic_output=bool(schema.outputs) and _is_variadic(schema.outputs[-1].option),
            allowed={c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints},
            attributes=frozenset(schema.attributes),
        )
    return out


def domain_versions(graph: gs.Graph) -> dict[str, int]:
    versions = {"": int(graph.opset)}
    for opset in getattr(graph, "import_domains", None) or []:
        versions[opset.domain if opset.domain != "ai.onnx" else ""] = int(opset.version)
    return versions


def signature(node: gs.Node, versions: dict[str, int]) -> Signature | None:
    """The node's signature, or None when no schema is known for its op."""
    domain = node.domain or ""
    if domain == "ai.onnx":
        domain = ""
    if domain == MS_DOMAIN:
        return ort_contrib_signatures().get(node.op) or CONTRIB_SIGNATURES.get(node.op)
    if domain == "":
        return (_onnx_signature(node.op, "", versions.get("", onnx.defs.onnx_opset_version()))
                or ORT_ONNX_DOMAIN_SIGNATURES.get(node.op))
    return _onnx_signature(node.op, domain, versions.get(domain, 1))


def element_types(graph: gs.Graph, versions: dict[str, int] | None = None) -> dict[str, int]:
    """{tensor name: ONNX element type} for every tensor whose type is annotated or can be derived.

    Unannotated outputs take the type of an input bound to the same type parameter (com.microsoft
    ops, which ONNX shape inference skips), Cast's ``to``, or Constant's value.
    """
    versions = versions or domain_versions(graph)
    types: dict[str, int] = {}
    for tensor in graph.tensors().values():
        t = elem_type_of(tensor)
        if t:
            types[tensor.name] = t
    for node in graph.nodes:  # graphsurgeon keeps nodes in file order: topological for valid models
        missing = [o for o in node.outputs if o.name not in types]
        if not missing:
            continue
        if node.op == "Cast" and node.outputs:
            types[node.outputs[0].name] = int(node.attrs["to"])
            continue
        if node.op == "Constant" and node.outputs:
            value = node.attrs.get("value")
            if isinstance(value, gs.Constant):
                types[node.outputs[0].name] = constant_data_type(value)
            elif "value_float" in node.attrs or "value_floats" in node.attrs:
                types[node.outputs[0].name] = FLOAT
            continue
        sig = signature(node, versions)
        if sig is None:
            continue
        for j, out in enumerate(node.outputs):
            if out.name in types:
                continue
            param = sig.output_param(j)
            if param is None:
                continue
            if param.startswith("tensor("):
                types[out.name] = _TYPE_FROM_STR.get(param, 0)
                continue
            for i, inp in enumerate(node.inputs):
                if sig.input_param(i) == param and inp.name in types:
                    types[out.name] = types[inp.name]
                    break
    return {k: v for k, v in types.items() if v}


_TYPE_FROM_STR = {f"tensor({v})": k for k, v in _TYPE_NAMES.items()}


# ---------------------------------------------------------------- data dependence

# Ops whose output depends only on the *shape* of their input, not its values.
SHAPE_ONLY_OPS = frozenset({"Shape", "Size"})


def data_dependent(graph: gs.Graph) -> set[str]:
    """Names of the tensors whose values depend on the values of the graph inputs.

    Everything else is computed from constants and shapes only (shape arithmetic, attention masks
    built from ``Shape``, scales computed from a head dimension): its type can be chosen freely.
    """
    dependent = {t.name for t in graph.inputs}
    for node in graph.nodes:
        if node.op in SHAPE_ONLY_OPS:
            continue
        if any(t.name in dependent for t in node.inputs if not isinstance(t, gs.Constant)):
            dependent.update(o.name for o in node.outputs)
    return dependent


# ---------------------------------------------------------------- constants


@dataclass(frozen=True)
class ValueStats:
    """Range facts of a constant, relative to one low-precision format."""

    absmax: float  # largest finite magnitude (0 for an empty or all-zero tensor)
    has_inf: bool  # holds +inf or -inf
    has_nan: bool
    pos_overflow: bool  # holds a value above +max (+inf included)
    neg_overflow: bool  # holds a value below -max (-inf included)
    vanishes: bool  # a small constant (an epsilon) whose every non-zero value rounds to zero

    def overflows(self, low: LowPrecision) -> bool:
        """Holds a value the format cannot represent as a finite number."""
        return self.absmax > low.max or self.has_inf


VANISH_CHECK_MAX_ELEMENTS = 16  # epsilons and scalar constants; a weight may hold tiny values harmlessly


def value_stats(values, low: LowPrecision, chunk_elems: int = 1 << 20) -> ValueStats:
    """Range facts of a constant (``gs.Constant`` or array), read a chunk at a time.

    A gs.Constant is streamed from where it lives (external data, raw bytes or a derived tensor)
    without caching its values on the constant, so scanning a 3.4 GB model's weights holds one
    chunk at a time. Reductions only: no temporaries the size of the chunk on the common path.
    """
    if isinstance(values, gs.Constant):
        dtype = onnx_dtype_to_numpy(constant_data_type(values))
        size = int(np.prod(values.shape, dtype=np.int64))
        # a tensor that rearranges others (packed Q/K/V, a transposed conv weight) is not computed:
        # its elements are its sources'
        chunks = (chunk for source in element_sources(values) for chunk in _typed_chunks(iter_values_bytes(source), dtype))
    else:
        array = np.asarray(values).reshape(-1)
        size = array.size
        chunks = iter([array])
    absmax, has_inf, has_nan, pos_overflow, neg_overflow = 0.0, False, False, False, False
    small = size <= VANISH_CHECK_MAX_ELEMENTS
    any_nonzero, all_vanish = False, True
    for chunk in chunks:
        for part in (chunk[i : i + chunk_elems] for i in range(0, len(chunk), chunk_elems)):
            if part.size == 0 or part.dtype.kind != "f":
                continue
            hi, lo = float(part.max()), float(part.min())
            if not (math.isfinite(hi) and math.isfinite(lo)):
                has_nan = has_nan or bool(np.isnan(part).any())
                has_inf = has_inf or bool(np.isinf(part).any())
                pos_overflow = pos_overflow or bool(np.isposinf(part).any())
                neg_overflow = neg_overflow or bool(np.isneginf(part).any())
                finite = part[np.isfinite(part)]
                hi, lo = (float(finite.max()), float(finite.min())) if finite.size else (0.0, 0.0)
            absmax = max(absmax, abs(hi), abs(lo))
            pos_overflow = pos_overflow or hi > low.max
            neg_overflow = neg_overflow or lo < -low.max
            if small:
                nonzero = np.abs(part[(part != 0) & np.isfinite(part)].astype(np.float64))
                if nonzero.size:
                    any_nonzero = True
                    all_vanish = all_vanish and bool((nonzero < low.tiny / 2).all())
    return ValueStats(absmax=absmax, has_inf=has_inf, has_nan=has_nan, pos_overflow=pos_overflow,
                      neg_overflow=neg_overflow, vanishes=small and any_nonzero and all_vanish)


# Threads that scan constants at once in :func:`values_stats`: NumPy's reductions and the page
# faults of mapped weights release the GIL, so the range scan of a 10 GB UNet uses both cores of a
# 2-core machine (and gets twice the share of a crowded one).
SCAN_THREADS = 2


def values_stats(sources: Iterable, low: LowPrecision) -> Iterator:
    """``(item, value_stats(values))`` for each ``(item, values)`` of ``sources``, in order; the
    scans run on :data:`SCAN_THREADS` threads, a bounded number of them ahead of the reader."""
    if SCAN_THREADS < 2:
        for item, values in sources:
            yield item, value_stats(values, low)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=SCAN_THREADS, thread_name_prefix="onnxopt-scan") as pool:
        pending: deque = deque()
        for item, values in sources:
            pending.append((item, pool.submit(value_stats, values, low)))
            if len(pending) > 4 * SCAN_THREADS:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()


def _typed_chunks(byte_chunks: Iterable, dtype: np.dtype):
    leftover = b""
    for chunk in byte_chunks:
        data = leftover + bytes(chunk) if leftover else chunk
        usable = len(data) - len(data) % dtype.itemsize
        leftover = bytes(data[usable:])
        yield np.frombuffer(data, dtype=dtype, count=usable // dtype.itemsize)


# ---------------------------------------------------------------- calibration


@dataclass
class TensorRange:
    absmax: float = 0.0  # largest finite magnitude seen
    nonfinite: bool = False  # saw ±inf or NaN

    def update(self, array: np.ndarray) -> None:
        if array.size == 0 or array.dtype.kind != "f":
            return
        a = array.astype(np.float32, copy=False)
        finite = np.isfinite(a)
        if not finite.all():
            self.nonfinite = True
            a = a[finite]
        if a.size:
            self.absmax = max(self.absmax, float(np.abs(a).max()))


@dataclass
class Calibration:
    ranges: dict[str, TensorRange] = field(default_factory=dict)
    runs: int = 0
    runner: str = ""


def calibration_feeds(model: Model, calibration=None, *, inputs=None, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Feeds to calibrate on: random (``None``), a .npz file of inputs, or a list of feed dicts."""
    from onnxopt.verify import load_feeds, random_feeds

    if calibration is None:
        return random_feeds(model, inputs, seed=seed)
    if isinstance(calibration, (str, Path)):
        return load_feeds(calibration, model)
    if isinstance(calibration, dict):
        return [calibration]
    return list(calibration)


def calibrate(model: Model, feeds: list[dict[str, np.ndarray]], *, outputs_per_run: int | None = None,
              only: set[str] | None = None) -> Calibration:
    """Run ``model`` (float32) on ``feeds`` and record every float tensor's largest magnitude
    (``only``: of these tensors alone; an ORT run then returns only them).

    Runs with every intermediate tensor added as a graph output on ONNX Runtime's CUDA EP when this
    ONNX Runtime has it (every contrib op has a kernel there, and it is where an ``ort-cuda`` model
    runs: a VAE calibrates in seconds instead of minutes of NumPy convolutions), else on its CPU EP,
    or on onnxopt's reference evaluator (streaming: each value observed, then dropped) when the CPU EP lacks a kernel for
    one of the model's contrib ops. ``ONNXOPT_CALIBRATION_DEVICE=cpu`` keeps it off the GPU.
    ``outputs_per_run`` bounds how many intermediates one ORT run returns (memory on big models);
    the model then runs once per group. The ranges only need magnitudes: TF32 is turned off anyway.
    """
    from onnxopt import reference
    from onnxopt.saving import AUTO_EXTERNAL_BYTES

    types = element_types(model.graph)
    names = [
        t.name for t in model.graph.tensors().values()
        if isinstance(t, gs.Variable) and t.inputs and types.get(t.name) in _FLOAT_TYPES
        and (only is None or t.name in only)
    ]
    result = Calibration()
    for feed in feeds:
        for name, value in feed.items():
            result.ranges.setdefault(name, TensorRange()).update(np.asarray(value))
    on_cuda = checks_on_cuda()
    small = model.weights_nbytes() <= AUTO_EXTERNAL_BYTES
    proto = model.to_onnx() if small and not on_cuda else None
    if proto is not None and reference.unsupported_on_ort_cpu(proto):
        result.runner = "onnxopt-reference"
        evaluator = reference.evaluator(proto)
        wanted = set(names)

        def observe(name, value):
            if name in wanted and isinstance(value, np.ndarray):
                result.ranges.setdefault(name, TensorRange()).update(value)

        for feed in feeds:
            evaluator.run_observed(feed, observe)  # each value seen once, then dropped
            result.runs += 1
        return result
    result.runner = "onnxruntime-cuda" if on_cuda else "onnxruntime-cpu"
    group = outputs_per_run or max(len(names), 1)
    with tempfile.TemporaryDirectory(prefix="onnxopt-calibrate-") as tmp:
        for start in range(0, len(names), group):
            chunk = names[start : start + group]
            session = _probe_session(model, chunk, types, Path(tmp), cuda=on_cuda)
            out_names = [o.name for o in session.get_outputs()]
            for feed in feeds:
                for name, value in zip(out_names, session.run(out_names, feed)):
                    result.ranges.setdefault(name, TensorRange()).update(np.asarray(value))
                result.runs += 1
            del session
    return result


# Where calibrations and fp16 checks run when the CUDA EP is there: fp32 references without TF32.
CUDA_CHECK_PROVIDERS = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]


def checks_on_cuda() -> bool:
    """Calibrations and fp16 checks run on ORT's CUDA EP: this ORT has it and
    ``ONNXOPT_CALIBRATION_DEVICE`` is not ``cpu``."""
    from onnxopt.runners.ort_cuda import cuda_available

    return os.environ.get("ONNXOPT_CALIBRATION_DEVICE", "auto") != "cpu" and cuda_available()


_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}


def _probe_session(model: Model, names: list[str], types: dict[str, int], workdir: Path, *, cuda: bool = False):
    """An ORT session of ``model`` with ``names`` added as graph outputs (CPU EP, or CUDA EP without TF32)."""
    from onnxopt.runtime import import_onnxruntime, inference_session, session_options
    from onnxopt.saving import AUTO_EXTERNAL_BYTES, save_model

    ort = import_onnxruntime()
    probed = model.copy()
    tensors = probed.graph.tensors()
    present = {t.name for t in probed.graph.outputs}
    for name in names:
        if name in present:
            continue
        tensor = tensors[name]
        tensor.dtype = onnx.helper.tensor_dtype_to_np_dtype(types[name])
        probed.graph.outputs.append(tensor)
    options = session_options(ort)
    # Graph optimizations could fuse away the tensors we ask for; basic ones keep names.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    providers = CUDA_CHECK_PROVIDERS if cuda else ["CPUExecutionProvider"]
    if probed.weights_nbytes() > AUTO_EXTERNAL_BYTES:
        path = workdir / "probe.onnx"
        save_model(probed, path, external_data=True)
        return inference_session(path, providers, options)
    return inference_session(probed.to_onnx().SerializeToString(), providers, options)


# ---------------------------------------------------------------- accuracy


def tensor_errors(reference_model: Model, candidate: Model, feeds: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Relative L2 error of every tensor both models hold under one name, candidate against reference.

    Both run on onnxopt's reference evaluator, where float16 arithmetic is real (NumPy computes
    float16 ops in float16); ORT's CPU EP would run many float16 ops in float32 behind inserted
    casts. Feeds are cast to the candidate's input types.
    """
    from onnxopt import reference

    ref = reference.evaluator(reference_model.to_onnx())
    cand_proto = candidate.to_onnx()
    cand = reference.evaluator(cand_proto)
    input_types = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in cand_proto.graph.input}
    errors: dict[str, float] = {}
    for feed in feeds:
        expected = ref.run(None, feed, intermediate=True)
        got = cand.run(None, {k: np.asarray(v).astype(input_types.get(k, np.asarray(v).dtype)) for k, v in feed.items()},
                       intermediate=True)
        for name, a in expected.items():
            b = got.get(name)
            if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.dtype.kind != "f" or a.shape != b.shape:
                continue
            errors[name] = max(errors.get(name, 0.0), relative_l2(a, b))
    return errors


def relative_l2(reference_values: np.ndarray, values: np.ndarray) -> float:
    """||values - reference|| / ||reference|| in float64 (inf when values hold NaN/inf)."""
    ref = np.asarray(reference_values, dtype=np.float64)
    got = np.asarray(values, dtype=np.float64)
    if not np.isfinite(got).all():
        return math.inf
    denom = float(np.linalg.norm(ref))
    return float(np.linalg.norm(got - ref)) / (denom if denom > 0 else 1.0)
