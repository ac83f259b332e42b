"""TensorRT engines through Polygraphy's API: build (``onnxopt build``) and run (``onnxopt diff --trt``).

    build_engine("unet.trt.onnx", "unet.plan", precision="fp16", compute_capabilities=[(8, 9)],
                 profiles={"sample": ((1, 4, 64, 64), (2, 4, 64, 64), (4, 4, 128, 128))},
                 timing_cache="trt.cache")
    runner = polygraphy_runner("unet.plan")        # or an .onnx: built in memory, same options

Which TensorRT (chosen once, at import: :data:`TENSORRT_MODULE`): the full ``tensorrt`` module where
it is importable, else TensorRT for RTX (``tensorrt_rtx``, real wheels on PyPI: what
``pip install 'onnxopt[trt]'`` installs). Polygraphy drives both through one code path: its
loaders import the module its ``USE_TENSORRT_RTX`` flag names, which this module sets.
TensorRT-RTX builds ahead of time for named compute capabilities on any machine, without a GPU;
its runtime runs engines on compute capability 8.0 8.6 8.9 12.x only (not on an H100/H200, 9.0).

How an ONNX file becomes an engine:

    model.onnx ─ [onnxopt fp16 pass, when the graph is float32 and fp16/bf16 is asked] ─ strongly typed
    network (NetworkFromOnnxPath(strongly_typed=True)) ─ CreateConfig / CreateConfigRTX(profiles,
    timing cache, workspace, compute capabilities, DETAILED profiling) ─ engine bytes ─ written
    atomically to engine_path; the timing cache saved back; the layer listing read for the report.

Precision: TensorRT gets a *strongly typed* low-precision graph, not a float32
graph plus the builder's FP16/BF16 flags and per-layer precision constraints.

* The flags are on their way out: weak typing is deprecated since TensorRT 10.12, and TensorRT 11
  removes ``BuilderFlag.FP16``/``BF16`` and ``OBEY/PREFER_PRECISION_CONSTRAINTS`` (NVIDIA's 10.x to
  11.x migration guide: "strong typing (always enforced)"). A build path written on them would stop
  working on the next TensorRT.
* With the flags, which layers stay float32 is TensorRT's speed choice after fusion; keeping the
  fp16 hazards float32 (Sin/Cos of the timestep embedding, overflowing tensors found by
  ``--fp32-auto``, out-of-range constants) would need a precision constraint on every such layer,
  through layer names its fusions do not keep. Strongly typed, those decisions are Casts in the graph
  and TensorRT must honour them: the hazard analysis of the ``fp16`` pass *is* the precision
  constraint, and the graph's numerics are the ones onnxopt checks on the CPU.
* The cost: TensorRT may not move a layer to float32 on its own. What must be float32 is decided by
  the fp16 pass (run it yourself with ``--fp32-auto --calibration`` for VAEs; ``build`` runs it with
  its defaults when given a float32 graph).

``precision="fp32"`` builds the float32 graph as it is, TF32 off (a reference engine).

Without TensorRT every entry point raises :class:`MissingDependencyError` naming the package; a build
without a GPU and without compute capabilities, or a run on a GPU the engines cannot run on, raises
a one-line OnnxoptError saying what to do. The TensorRT module is imported only when needed.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from onnxopt.errors import MissingDependencyError, OnnxoptError

PRECISIONS = {"fp32": None, "fp16": "float16", "bf16": "bfloat16"}
ENGINE_SUFFIXES = (".plan", ".engine", ".trt")
INSTALL_HINT = (
    "TensorRT is not installed: pip install 'onnxopt[trt]' (TensorRT-RTX and Polygraphy from PyPI; "
    "the full tensorrt module, from https://pypi.nvidia.com, is used instead where it is importable)"
)
DEFAULT_BATCH, DEFAULT_DIM = 2, 8  # as onnxopt.verify fills symbolic dims


# ---------------------------------------------------------------- shapes and profiles


@dataclass(frozen=True)
class ShapeRange:
    """One input's shapes in an optimization profile."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    @classmethod
    def fixed(cls, shape) -> "ShapeRange":
        shape = tuple(int(d) for d in shape)
        return cls(shape, shape, shape)

    def __str__(self) -> str:
        text = lambda s: "x".join(map(str, s))  # noqa: E731
        return text(self.min) if self.min == self.opt == self.max else f"{text(self.min)}:{text(self.opt)}:{text(self.max)}"


def parse_shape(text: str) -> tuple[int, ...]:
    dims = text.replace(",", "x").split("x")
    if not text or not all(d.strip().isdigit() for d in dims):
        raise ValueError(f"'{text}' is not a shape like 2x4x64x64")
    return tuple(int(d) for d in dims)


def parse_profile(text: str) -> tuple[str, ShapeRange]:
    """``sample=1x4x64x64:2x4x64x64:4x4x128x128`` (min:opt:max) or ``sample=2x4x64x64`` (fixed)."""
    name, sep, shapes = text.rpartition("=")
    if not sep or not name:
        raise ValueError(f"expected INPUT=MIN:OPT:MAX (shapes like 1x4x64x64), got '{text}'")
    parts = shapes.split(":")
    if len(parts) not in (1, 3):
        raise ValueError(f"'{text}': give one shape or three (min:opt:max), not {len(parts)}")
    try:
        parsed = [parse_shape(p) for p in parts]
    except ValueError as exc:
        raise ValueError(f"'{text}': {exc}") from None
    return name, ShapeRange(*parsed) if len(parsed) == 3 else ShapeRange.fixed(parsed[0])


def _as_range(name: str, value) -> ShapeRange:
    if isinstance(value, ShapeRange):
        return value
    if isinstance(value, str):
        return parse_profile(f"{name}={value}")[1]
    value = tuple(value)
    if len(value) == 3 and all(isinstance(v, (tuple, list)) for v in value):
        return ShapeRange(*(tuple(int(d) for d in v) for v in value))
    return ShapeRange.fixed(value)


def resolve_profiles(inputs: Sequence[tuple[str, Sequence]], profiles=None, dims: Mapping[str, int] | None = None):
    """Complete optimization profiles for a model whose inputs are ``(name, shape)`` pairs.

    ``profiles``: None, one mapping ``{input: range}`` or a list of them (one engine profile each);
    a range is a ShapeRange, ``(min, opt, max)`` shapes, one shape (fixed) or ``"1x4x64x64:..."``.
    An input a profile leaves out gets a fixed shape: its static dims, and for symbolic ones the
    value in ``dims`` (by dim name) or onnxopt's defaults (batch 2, others 8).

    Returns ``(list of {input: ShapeRange} in input order, sorted names of inputs given defaults)``.
    Raises OnnxoptError for unknown inputs, wrong ranks, ranges that contradict a static dim, or
    min > opt > max.
    """
    dims = dict(dims or {})
    given_list = [{}] if profiles is None else [profiles] if isinstance(profiles, Mapping) else list(profiles)
    known = {name: list(shape) for name, shape in inputs}
    resolved, defaulted = [], set()
    for given in given_list or [{}]:
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise OnnxoptError(f"profile names {', '.join(repr(u) for u in unknown)}: the model's inputs are {', '.join(known)}")
        profile = {}
        for name, shape in known.items():
            if name in given:
                profile[name] = _checked_range(name, shape, _as_range(name, given[name]))
            else:
                profile[name] = ShapeRange.fixed(_default_shape(shape, dims))
                if any(not _is_static(d) for d in shape):
                    defaulted.add(name)
        resolved.append(profile)
    return resolved, sorted(defaulted)


def _is_static(dim) -> bool:
    return isinstance(dim, (int, np.integer)) and dim >= 0


def _default_shape(shape, dims: Mapping[str, int]) -> tuple[int, ...]:
    out = []
    for d in shape:
        if _is_static(d):
            out.append(int(d))
        elif str(d or "") in dims:
            out.append(int(dims[str(d)]))
        else:
            out.append(DEFAULT_BATCH if "batch" in str(d or "").lower() else DEFAULT_DIM)
    return tuple(out)


def _checked_range(name: str, shape, r: ShapeRange) -> ShapeRange:
    for label, s in (("min", r.min), ("opt", r.opt), ("max", r.max)):
        if len(s) != len(shape):
            raise OnnxoptError(f"profile for '{name}': {label} shape {'x'.join(map(str, s))} has rank {len(s)}, the input has rank {len(shape)}")
    for axis, d in enumerate(shape):
        if _is_static(d) and not r.min[axis] == r.opt[axis] == r.max[axis] == d:
            raise OnnxoptError(f"profile for '{name}': axis {axis} is {d} in the model, the profile gives {r}")
        if not 1 <= r.min[axis] <= r.opt[axis] <= r.max[axis]:
            raise OnnxoptError(f"profile for '{name}': axis {axis} needs 1 <= min <= opt <= max, got {r}")
    return r


# ---------------------------------------------------------------- which TensorRT: chosen once, at import


def _choose_tensorrt_module() -> str | None:
    """``tensorrt`` where the full TensorRT is importable, else ``tensorrt_rtx`` (TensorRT for RTX,
    whose PyPI wheels are real: ``pip install 'onnxopt[trt]'``), else None.

    Polygraphy's TensorRT loaders import the module its ``config.USE_TENSORRT_RTX`` names, when
    they are first imported (``polygraphy.mod.trt_importer.lazy_import_trt``), so the choice is
    Polygraphy's flag, set here before onnxopt imports them: ``POLYGRAPHY_USE_TENSORRT_RTX=1`` asks
    for TensorRT-RTX whatever else is installed, and loaders someone imported before onnxopt keep
    the module they were bound to.
    """
    from importlib.util import find_spec

    from polygraphy import config

    def importable(name: str) -> bool:
        try:
            return find_spec(name) is not None
        except (ImportError, ValueError):  # a module set to None in sys.modules, a broken package
            return False

    bound = "polygraphy.backend.trt" in sys.modules  # the loaders already chose
    if config.USE_TENSORRT_RTX or (not bound and not importable("tensorrt") and importable("tensorrt_rtx")):
        config.USE_TENSORRT_RTX = True
        return "tensorrt_rtx" if importable("tensorrt_rtx") else None
    return "tensorrt" if importable("tensorrt") else None


TENSORRT_MODULE = _choose_tensorrt_module()


def is_rtx() -> bool:
    return TENSORRT_MODULE == "tensorrt_rtx"


def import_tensorrt():
    """The chosen TensorRT module (``tensorrt`` or ``tensorrt_rtx``); MissingDependencyError without one."""
    if TENSORRT_MODULE is None:
        raise MissingDependencyError(INSTALL_HINT)
    try:
        return importlib.import_module(TENSORRT_MODULE)
    except ImportError as exc:  # installed but broken (a missing shared library)
        raise MissingDependencyError(f"{INSTALL_HINT} ({TENSORRT_MODULE} does not import: {_first_line(exc)})") from exc


def tensorrt_available() -> bool:
    try:
        import_tensorrt()
    except MissingDependencyError:
        return False
    return True


def tensorrt_name(trt) -> str:
    return f"{'TensorRT-RTX' if is_rtx() else 'TensorRT'} {trt.__version__}"


# ---------------------------------------------------------------- which GPU: compute capabilities

# The GPUs TensorRT-RTX's runtime runs engines on, as it says on any other: "Supported compute
# capabilities: 8.0 8.6 8.9 12.0 12.1 >12.0" (TensorRT-RTX 1.7 on an H100, compute capability 9.0).
RTX_RUNTIME_CAPABILITIES = ((8, 0), (8, 6), (8, 9), (12, 0), (12, 1))
RTX_RUNTIME_TEXT = "8.0 8.6 8.9 12.x"
ORT_CUDA_PATH = "onnxopt optimize -i FOLDER -o OUT --target ort-cuda, then onnxopt generate OUT --provider cuda"


def parse_compute_capability(text: str) -> tuple[int, int]:
    """``8.9`` -> (8, 9); ``12.0`` -> (12, 0)."""
    major, dot, minor = text.strip().partition(".")
    if not dot or not major.isdigit() or not minor.isdigit():
        raise ValueError(f"'{text}' is not a compute capability like 8.9 or 12.0")
    return int(major), int(minor)


def capability_text(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def rtx_runs_on(capability: tuple[int, int]) -> bool:
    return capability in RTX_RUNTIME_CAPABILITIES or capability[0] > 12


def buildable_capabilities(trt) -> list[tuple[int, int]]:
    """The compute capabilities this TensorRT-RTX builds for (its ``ComputeCapability.SM<major><minor>``)."""
    found = []
    for name in dir(trt.ComputeCapability):
        if name.startswith("SM") and name[2:].isdigit():
            digits = name[2:]
            found.append((int(digits[:-1]), int(digits[-1])))
    return sorted(found)


def _cuda_driver():
    import ctypes

    try:
        return ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
    except OSError:
        return None


def gpu_compute_capability(device: int = 0) -> tuple[int, int] | None:
    """(major, minor) of GPU ``device`` through the NVIDIA driver (libcuda); None without a driver or a GPU."""
    import ctypes

    cuda = _cuda_driver()
    if cuda is None:
        return None
    count, handle, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value <= device:
        return None
    if cuda.cuDeviceGet(ctypes.byref(handle), device) != 0:
        return None
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76 (cuda.h)
    if cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, handle) or cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, handle):
        return None
    return major.value, minor.value


def require_gpu() -> tuple[int, int]:
    """The GPU's compute capability; one line when no NVIDIA GPU is usable."""
    if _cuda_driver() is None:
        raise MissingDependencyError("no NVIDIA driver found (libcuda): TensorRT runs engines on an NVIDIA GPU")
    capability = gpu_compute_capability()
    if capability is None:
        raise MissingDependencyError("no CUDA GPU is visible (the NVIDIA driver reports none): TensorRT needs an NVIDIA GPU")
    return capability


def build_targets(trt, capabilities) -> tuple[list[tuple[int, int]], str]:
    """The compute capabilities to build for, and how they were chosen.

    TensorRT-RTX builds ahead of time for the capabilities named (no GPU needed), or without any
    for the GPU it runs on. The full TensorRT builds only for the GPU it runs on: a capability named
    must be that GPU's.
    """
    capabilities = [tuple(c) for c in capabilities or ()]
    if is_rtx():
        known = buildable_capabilities(trt)
        unknown = [c for c in capabilities if c not in known]
        if unknown:
            raise OnnxoptError(f"compute capability {capability_text(unknown[0])}: {tensorrt_name(trt)} builds for "
                               f"{' '.join(map(capability_text, known))}")
        if capabilities:
            return list(dict.fromkeys(capabilities)), "named"
        gpu = gpu_compute_capability()
        if gpu is None:
            raise OnnxoptError("no NVIDIA GPU here to build for: pass --compute-capability (e.g. 8.9 for an RTX 40xx/L4/L40S; "
                               f"{tensorrt_name(trt)} builds for {' '.join(map(capability_text, known))})")
        if gpu not in known:
            raise OnnxoptError(f"this GPU has compute capability {capability_text(gpu)}, which {tensorrt_name(trt)} does not "
                               f"build for ({' '.join(map(capability_text, known))}): pass --compute-capability to build for another GPU")
        return [gpu], "this GPU"
    gpu = require_gpu()
    other = [c for c in capabilities if c != gpu]
    if other:
        raise OnnxoptError(f"compute capability {capability_text(other[0])}: {tensorrt_name(trt)} builds only for the GPU it "
                           f"runs on ({capability_text(gpu)}); TensorRT-RTX (pip install tensorrt-rtx) builds for others")
    return [gpu], "this GPU"


# ---------------------------------------------------------------- the graph TensorRT gets


def graph_precision(model) -> str:
    """``fp16``/``bf16`` when the graph already computes in that type (its float initializers or
    inputs are of it), else ``fp32``."""
    kinds = {_float_kind(t.dtype) for t in list(model.graph.inputs) + model.constants()}
    for precision, low in (("bf16", "bfloat16"), ("fp16", "float16")):
        if low in kinds:
            return precision
    return "fp32"


def _float_kind(dtype) -> str | None:
    if dtype is None:
        return None
    if dtype == onnx.TensorProto.BFLOAT16 or str(dtype) == "bfloat16":  # graphsurgeon keeps bfloat16 as the enum
        return "bfloat16"
    try:
        return np.dtype(dtype).name
    except TypeError:
        return None


def check_parseable(model, where: str) -> None:
    """TensorRT's ONNX parser reads standard ONNX ops (and its plugins): refuse ORT's fused ops early."""
    custom = sorted({f"{n.domain}.{n.op}" for n in model.graph.nodes if n.domain not in ("", "ai.onnx", None)})
    if custom:
        shown = ", ".join(custom[:4]) + (", ..." if len(custom) > 4 else "")
        raise OnnxoptError(
            f"{where}: has non-standard ops TensorRT's ONNX parser cannot read ({shown}); "
            "optimize the source with --passes tensorrt (not ort-cuda)"
        )


def load_checked(onnx_path, precision: str):
    """Load ``onnx_path`` (weights stay on disk) and check that TensorRT can be given it at ``precision``."""
    from onnxopt.loading import load_model

    if precision not in PRECISIONS:
        raise OnnxoptError(f"precision '{precision}': choose one of {', '.join(PRECISIONS)}")
    model = load_model(onnx_path)
    check_parseable(model, str(onnx_path))
    have = graph_precision(model)
    if have not in ("fp32", precision):
        raise OnnxoptError(f"{onnx_path}: the graph is already {have}; build it with --precision {have}, or give the float32 graph")
    return model


def model_inputs(model) -> list[tuple[str, list]]:
    return [(t.name, list(t.shape or ())) for t in model.graph.inputs]


def typed_graph(model, onnx_path, precision: str, workdir: Path) -> tuple[Path, bool]:
    """The ONNX file TensorRT parses, and whether onnxopt's fp16 pass made it: a float32 graph asked
    for in fp16/bf16 is converted (into ``workdir``), anything else is used as it is."""
    if precision == "fp32" or graph_precision(model) == precision:
        return Path(onnx_path), False
    from onnxopt.api import optimize
    from onnxopt.saving import save_model

    converted, _ = optimize(model, ["fp16"], options={"fp16": {"low_precision": PRECISIONS[precision]}})
    path = workdir / f"{Path(onnx_path).stem}.{precision}.onnx"
    save_model(converted, path, external_data=True)
    return path, True


# ---------------------------------------------------------------- Polygraphy loaders


def _network(trt, path: Path):
    """The parsed network (builder, network, parser), through Polygraphy's loader."""
    from polygraphy.backend.trt import NetworkFromOnnxPath

    flags = [trt.OnnxParserFlag.NATIVE_INSTANCENORM] if hasattr(trt, "OnnxParserFlag") and hasattr(trt.OnnxParserFlag, "NATIVE_INSTANCENORM") else None
    return NetworkFromOnnxPath(str(path), flags=flags, strongly_typed=True)


def _config(trt, profiles: list[dict[str, ShapeRange]], timing_cache, workspace_mb, capabilities=None):
    from polygraphy.backend.trt import CreateConfig, Profile

    trt_profiles = []
    for profile in profiles:
        p = Profile()
        for name, r in profile.items():
            p.add(name, min=r.min, opt=r.opt, max=r.max)
        trt_profiles.append(p)
    pools = {trt.MemoryPoolType.WORKSPACE: int(workspace_mb) << 20} if workspace_mb else None
    cache = str(timing_cache) if timing_cache and Path(timing_cache).is_file() else None
    # No fp16/bf16 flags: the network is strongly typed (see the module docstring). TF32 off, so an
    # fp32 engine is a float32 reference (TensorRT only: Polygraphy's TensorRT-RTX config takes no
    # precision flag, and TensorRT-RTX leaves TF32 on). DETAILED: the layer listing the report reads.
    common = dict(profiles=trt_profiles, load_timing_cache=cache, memory_pool_limits=pools,
                  profiling_verbosity=trt.ProfilingVerbosity.DETAILED)
    if is_rtx():
        from polygraphy.backend.tensorrt_rtx import CreateConfigRTX

        return CreateConfigRTX(compute_capabilities=capabilities or None, use_gpu=None if capabilities else True, **common)
    return CreateConfig(tf32=False, **common)


@contextlib.contextmanager
def _build_log(trt):
    """TensorRT's log during a build, forwarded to Polygraphy's logger as always, keeping what the
    report reads: the engine inspector's layer listing the builder logs with DETAILED profiling (a
    verbose message starting ``Layers:``) and the errors (the one-line message of a failed build).
    Polygraphy's loaders create their builders with ``polygraphy.backend.trt.util.get_trt_logger()``,
    which returns the module's ``TRT_LOGGER``: ours for the duration."""
    from polygraphy.backend.trt import util as trt_util

    forward = trt_util.get_trt_logger()

    class BuildLog(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.layers, self.errors = None, []

        def log(self, severity, msg):
            if msg.startswith("Layers:"):
                self.layers = msg
            elif severity in (trt.Logger.ERROR, trt.Logger.INTERNAL_ERROR):
                self.errors.append(msg.strip())
            forward.log(severity, msg)

    log = BuildLog()
    trt_util.TRT_LOGGER = log
    try:
        yield log
    finally:
        trt_util.TRT_LOGGER = forward


def _io_types(trt, network) -> list[dict]:
    """Each network input and output: name, kind, numpy-style type and shape (-1: dynamic)."""

    def type_name(dtype) -> str:
        try:
            return np.dtype(trt.nptype(dtype)).name
        except (TypeError, KeyError):  # bfloat16, fp8: no numpy type
            return str(dtype).rpartition(".")[2].lower()

    def entry(tensor, kind):
        return {"name": tensor.name, "io": kind, "dtype": type_name(tensor.dtype), "shape": list(tensor.shape)}

    return ([entry(network.get_input(i), "input") for i in range(network.num_inputs)]
            + [entry(network.get_output(i), "output") for i in range(network.num_outputs)])


def _inspected_layers(trt, engine: bytes) -> str | None:
    """The engine inspector's listing where the engine deserializes here (a GPU it runs on), else None."""
    try:
        runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
        deserialized = runtime.deserialize_cuda_engine(engine)
        if deserialized is None:
            return None
        return deserialized.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.ONELINE)
    except Exception:  # no GPU, a GPU the engine is not for: the report says the listing is missing
        return None


@dataclass
class BuildInfo:
    engine_path: Path
    onnx_path: Path  # the source; TensorRT parsed a temporary fp16/bf16 copy of it when ``converted``
    precision: str
    converted: bool
    profiles: list[dict[str, ShapeRange]]
    defaulted_inputs: list[str]  # inputs with symbolic dims no profile named (fixed at default values)
    timing_cache: Path | None
    build_seconds: float
    engine_bytes: int
    tensorrt_version: str  # "TensorRT-RTX 1.7.1.116" or "TensorRT 10.x"
    compute_capabilities: list[tuple[int, int]] = field(default_factory=list)
    targeted: str = ""  # "named" (--compute-capability) or "this GPU"
    io: list[dict] = field(default_factory=list)
    layers: dict = field(default_factory=dict)  # engine_layers.fusion_summary
    strongly_typed: bool = True
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "engine": str(self.engine_path), "onnx": str(self.onnx_path), "tensorrt": self.tensorrt_version,
            "compute_capabilities": [capability_text(c) for c in self.compute_capabilities], "targeted": self.targeted,
            "precision": self.precision, "strongly_typed": self.strongly_typed, "converted_by_fp16_pass": self.converted,
            "build_seconds": round(self.build_seconds, 3), "engine_bytes": self.engine_bytes,
            "profiles": [{n: {"min": list(r.min), "opt": list(r.opt), "max": list(r.max)} for n, r in p.items()}
                         for p in self.profiles],
            "defaulted_inputs": self.defaulted_inputs, "timing_cache": str(self.timing_cache) if self.timing_cache else None,
            "io": self.io, "engine_layers": self.layers, "notes": self.notes,
        }

    def summary(self) -> str:
        from onnxopt.runners.engine_layers import summary_lines

        shapes = "; ".join(", ".join(f"{n}={r}" for n, r in p.items()) for p in self.profiles)
        targets = " ".join(map(capability_text, self.compute_capabilities))
        lines = [
            f"wrote {self.engine_path}: {self.engine_bytes / 1e6:.1f} MB, {self.precision} strongly typed"
            f"{' (converted by the fp16 pass)' if self.converted else ''}, {self.tensorrt_version},"
            f" compute capability {targets} ({self.targeted}), built in {self.build_seconds:.1f} s",
            f"  profile: {shapes}",
        ]
        width = max((len(t["name"]) for t in self.io), default=0)
        lines += [f"  {t['io']:<6} {t['name']:<{width}}  {t['dtype']} {'x'.join(map(str, t['shape'])) or 'scalar'}" for t in self.io]
        lines += summary_lines(self.layers)
        if self.defaulted_inputs:
            lines.append(f"  fixed at default shapes (no --profile given): {', '.join(self.defaulted_inputs)}")
        if self.timing_cache:
            lines.append(f"  timing cache: {self.timing_cache}")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OnnxoptError(f"{path}: cannot write: {exc.strerror or exc}") from exc


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _op_types(path: Path) -> dict[str, str]:
    """ONNX node name -> op type of the graph TensorRT parsed (no weights read)."""
    proto = onnx.load(str(path), load_external_data=False)
    return {n.name: n.op_type for n in proto.graph.node}


def build_engine(onnx_path, engine_path, *, precision: str = "fp16", profiles=None, timing_cache=None,
                 workspace: int | None = None, dims: Mapping[str, int] | None = None,
                 compute_capabilities=None) -> BuildInfo:
    """Build a TensorRT engine from ``onnx_path`` and save it to ``engine_path`` (atomically).

    ``precision``: ``fp16``, ``bf16`` or ``fp32`` (see the module docstring). ``profiles``: see
    :func:`resolve_profiles`. ``timing_cache``: a file read when it exists and written (atomically)
    after the build; components of one pipeline share one. ``workspace``: the builder's workspace
    limit in MiB (default: TensorRT's). ``compute_capabilities``: ``[(8, 9), ...]``, the GPUs to
    build for (TensorRT-RTX, no GPU needed); none: the GPU this runs on (:func:`build_targets`).
    Bad inputs raise OnnxoptError before TensorRT is looked for; nothing is left behind on failure.
    """
    from onnxopt.runners.engine_layers import fusion_summary, parse_layer_information
    from onnxopt.saving import check_destination

    engine_path, onnx_path = Path(engine_path), Path(onnx_path)
    check_destination(engine_path, onnx_path)
    if timing_cache is not None:
        check_destination(timing_cache, onnx_path)
    model = load_checked(onnx_path, precision)  # a bad file, precision or profile fails before TensorRT is looked for
    resolved, defaulted = resolve_profiles(model_inputs(model), profiles, dims)
    trt = import_tensorrt()
    targets, targeted = build_targets(trt, compute_capabilities)
    from polygraphy.backend.trt import engine_bytes_from_network

    notes = []
    if timing_cache is not None and is_rtx():  # "Timing cache operations are no-ops in TensorRT-RTX" (since 1.2)
        notes.append(f"timing cache {timing_cache} not used: TensorRT-RTX has none (its timing cache calls are no-ops)")
        timing_cache = None
    with tempfile.TemporaryDirectory(prefix="onnxopt-trt-") as tmp:
        parsed, converted = typed_graph(model, onnx_path, precision, Path(tmp))
        cache_out = Path(tmp) / "timing.cache" if timing_cache else None
        start = time.perf_counter()
        with _build_log(trt) as log:
            try:
                network = _network(trt, parsed)()
                io = _io_types(trt, network[1])
                engine = engine_bytes_from_network(
                    network, config=_config(trt, resolved, timing_cache, workspace, targets if is_rtx() else None),
                    save_timing_cache=str(cache_out) if cache_out else None,
                )
            except Exception as exc:  # Polygraphy raises PolygraphyException after TensorRT's log
                why = log.errors[0] if log.errors else _first_line(exc)
                raise OnnxoptError(f"{onnx_path}: {tensorrt_name(trt)} could not build an engine: {why}") from exc
        seconds = time.perf_counter() - start
        data = bytes(engine)
        listing, source = log.layers, "builder's log (engine inspector format)"
        if listing is None:
            listing, source = _inspected_layers(trt, data), "engine inspector"
        layers = fusion_summary(parse_layer_information(listing), _op_types(parsed), source) if listing else {
            "source": "no layer listing: the builder logged none and the engine does not load here", "layers": 0}
        _write_atomically(engine_path, data)
        if cache_out is not None and cache_out.is_file():
            _write_atomically(Path(timing_cache), cache_out.read_bytes())
    return BuildInfo(engine_path, onnx_path, precision, converted, resolved, defaulted,
                     Path(timing_cache) if timing_cache else None, seconds, len(data), tensorrt_name(trt),
                     targets, targeted, io, layers, notes=notes)


def is_engine_path(path) -> bool:
    return Path(path).suffix.lower() in ENGINE_SUFFIXES


def polygraphy_runner(model_or_engine_path, *, precision: str = "fp16", profiles=None, timing_cache=None):
    """A Polygraphy ``TrtRunner`` (not yet activated) for an engine file or an ONNX model.

    An engine (``.plan``, ``.engine``, ``.trt``) is deserialized as it is (``precision`` and
    ``profiles`` are fixed in it). An ONNX file is prepared and built in memory for this GPU when the
    runner is activated, as :func:`build_engine` would build it; its profile's ``opt`` shapes should be
    the shapes you feed it. Use it with Polygraphy's ``Comparator`` or ``with runner: runner.infer(feeds)``.
    """
    path = Path(model_or_engine_path)
    if is_engine_path(path):
        if not path.is_file():
            raise OnnxoptError(f"{path}: no such engine file")
        import_tensorrt()
        require_runnable_gpu()
        from polygraphy.backend.common import BytesFromPath
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        return TrtRunner(EngineFromBytes(BytesFromPath(str(path))), name=f"trt:{path.name}")
    model = load_checked(path, precision)
    resolved, _ = resolve_profiles(model_inputs(model), profiles)
    trt = import_tensorrt()
    require_runnable_gpu()
    targets, _ = build_targets(trt, None)
    workdir = tempfile.TemporaryDirectory(prefix="onnxopt-trt-")
    parsed, _ = typed_graph(model, path, precision, Path(workdir.name))
    from polygraphy.backend.trt import EngineFromNetwork, TrtRunner

    engine = EngineFromNetwork(_network(trt, parsed), config=_config(trt, resolved, timing_cache, None, targets if is_rtx() else None),
                               save_timing_cache=str(timing_cache) if timing_cache else None)
    runner = TrtRunner(engine, name=f"trt-{precision}:{path.name}")
    runner.onnxopt_workdir = workdir  # the converted ONNX must outlive the runner's lazy build
    return runner


def require_runnable_gpu() -> tuple[int, int]:
    """The GPU's compute capability, where the chosen TensorRT runs engines on it; else one line
    (exit 2): TensorRT-RTX runs on 8.0 8.6 8.9 12.x, not on a 9.0 (H100/H200) or 10.0 (B200)."""
    capability = require_gpu()
    if is_rtx() and not rtx_runs_on(capability):
        raise OnnxoptError(
            f"TensorRT-RTX cannot run engines on this GPU (compute capability {capability_text(capability)}); it runs them "
            f"on compute capability {RTX_RUNTIME_TEXT} (RTX 30xx-50xx, A10/A40, L4/L40S, RTX PRO). Here use ONNX Runtime's "
            f"CUDA EP: {ORT_CUDA_PATH}")
    return capability
