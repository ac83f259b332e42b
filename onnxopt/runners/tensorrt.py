"""TensorRT engines through Polygraphy's API: build (``onnxopt build``) and run (``onnxopt diff --trt``).

    build_engine("unet.trt.onnx", "unet.plan", precision="fp16",
                 profiles={"sample": ((1, 4, 64, 64), (2, 4, 64, 64), (4, 4, 128, 128))},
                 timing_cache="trt.cache")
    runner = polygraphy_runner("unet.plan")        # or an .onnx: built in memory, same options

How an ONNX file becomes an engine:

    model.onnx ─ [onnxopt fp16 pass, when the graph is float32 and fp16/bf16 is asked] ─ strongly typed
    network (NetworkFromOnnxPath(strongly_typed=True)) ─ CreateConfig(profiles, timing cache,
    workspace) ─ engine bytes ─ written atomically to engine_path; the timing cache saved back.

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

Without the ``tensorrt`` module every entry point raises :class:`MissingDependencyError` naming the
package; without an NVIDIA GPU, the same error saying so. tensorrt is imported only when needed.
"""

from __future__ import annotations

import contextlib
import os
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
    "TensorRT is not installed: pip install 'onnxopt[trt]' (the tensorrt package; NVIDIA also serves it "
    "from --extra-index-url https://pypi.nvidia.com) on a machine with an NVIDIA GPU"
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


# ---------------------------------------------------------------- what TensorRT needs installed


def import_tensorrt():
    try:
        import tensorrt
    except ImportError as exc:
        raise MissingDependencyError(INSTALL_HINT) from exc
    return tensorrt


def tensorrt_available() -> bool:
    try:
        import_tensorrt()
    except MissingDependencyError:
        return False
    return True


def require_gpu() -> None:
    """Fail with one line when no NVIDIA GPU is usable (checked through the driver, libcuda)."""
    import ctypes

    try:
        cuda = ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
    except OSError as exc:
        raise MissingDependencyError("no NVIDIA driver found (libcuda): TensorRT builds and runs engines on an NVIDIA GPU") from exc
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        raise MissingDependencyError("no CUDA GPU is visible (the NVIDIA driver reports none): TensorRT needs an NVIDIA GPU")


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
    from polygraphy.backend.trt import NetworkFromOnnxPath

    flags = [trt.OnnxParserFlag.NATIVE_INSTANCENORM] if hasattr(trt, "OnnxParserFlag") and hasattr(trt.OnnxParserFlag, "NATIVE_INSTANCENORM") else None
    return NetworkFromOnnxPath(str(path), flags=flags, strongly_typed=True)


def _config(trt, profiles: list[dict[str, ShapeRange]], timing_cache, workspace_mb):
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
    # fp32 engine is a float32 reference.
    return CreateConfig(tf32=False, profiles=trt_profiles, load_timing_cache=cache, memory_pool_limits=pools)


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
    tensorrt_version: str
    strongly_typed: bool = True
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        shapes = "; ".join(", ".join(f"{n}={r}" for n, r in p.items()) for p in self.profiles)
        lines = [
            f"wrote {self.engine_path}: {self.engine_bytes / 1e6:.1f} MB, {self.precision} strongly typed"
            f"{' (converted by the fp16 pass)' if self.converted else ''}, TensorRT {self.tensorrt_version},"
            f" {self.build_seconds:.1f} s",
            f"  profile: {shapes}",
        ]
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
        raise OnnxoptError(f"{path}: cannot write the engine: {exc.strerror or exc}") from exc


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def build_engine(onnx_path, engine_path, *, precision: str = "fp16", profiles=None, timing_cache=None,
                 workspace: int | None = None, dims: Mapping[str, int] | None = None) -> BuildInfo:
    """Build a TensorRT engine from ``onnx_path`` and save it to ``engine_path`` (atomically).

    ``precision``: ``fp16``, ``bf16`` or ``fp32`` (see the module docstring). ``profiles``: see
    :func:`resolve_profiles`. ``timing_cache``: a file read when it exists and written after the
    build. ``workspace``: the builder's workspace limit in MiB (default: TensorRT's).
    """
    from onnxopt.saving import check_destination

    engine_path, onnx_path = Path(engine_path), Path(onnx_path)
    check_destination(engine_path, onnx_path)
    model = load_checked(onnx_path, precision)  # a bad file, precision or profile fails before TensorRT is looked for
    resolved, defaulted = resolve_profiles(model_inputs(model), profiles, dims)
    trt = import_tensorrt()
    require_gpu()
    from polygraphy.backend.trt import engine_bytes_from_network

    with tempfile.TemporaryDirectory(prefix="onnxopt-trt-") as tmp:
        parsed, converted = typed_graph(model, onnx_path, precision, Path(tmp))
        start = time.perf_counter()
        try:
            engine = engine_bytes_from_network(
                _network(trt, parsed), config=_config(trt, resolved, timing_cache, workspace),
                save_timing_cache=str(timing_cache) if timing_cache else None,
            )
        except Exception as exc:  # Polygraphy raises PolygraphyException after TensorRT's log
            raise OnnxoptError(f"{onnx_path}: TensorRT could not build an engine: {_first_line(exc)}") from exc
        seconds = time.perf_counter() - start
        data = bytes(engine)
        _write_atomically(engine_path, data)
    return BuildInfo(engine_path, onnx_path, precision, converted, resolved, defaulted,
                     Path(timing_cache) if timing_cache else None, seconds, len(data), str(trt.__version__))


def is_engine_path(path) -> bool:
    return Path(path).suffix.lower() in ENGINE_SUFFIXES


def polygraphy_runner(model_or_engine_path, *, precision: str = "fp16", profiles=None, timing_cache=None):
    """A Polygraphy ``TrtRunner`` (not yet activated) for an engine file or an ONNX model.

    An engine (``.plan``, ``.engine``, ``.trt``) is deserialized as it is (``precision`` and
    ``profiles`` are fixed in it). An ONNX file is prepared and built in memory when the runner is
    activated, exactly as :func:`build_engine` would build it; its profile's ``opt`` shapes should be
    the shapes you feed it. Use it with Polygraphy's ``Comparator`` or ``with runner: runner.infer(feeds)``.
    """
    path = Path(model_or_engine_path)
    if is_engine_path(path):
        if not path.is_file():
            raise OnnxoptError(f"{path}: no such engine file")
        import_tensorrt()
        require_gpu()
        from polygraphy.backend.common import BytesFromPath
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        return TrtRunner(EngineFromBytes(BytesFromPath(str(path))), name=f"trt:{path.name}")
    model = load_checked(path, precision)
    resolved, _ = resolve_profiles(model_inputs(model), profiles)
    trt = import_tensorrt()
    require_gpu()
    workdir = tempfile.TemporaryDirectory(prefix="onnxopt-trt-")
    parsed, _ = typed_graph(model, path, precision, Path(workdir.name))
    from polygraphy.backend.trt import EngineFromNetwork, TrtRunner

    engine = EngineFromNetwork(_network(trt, parsed), config=_config(trt, resolved, timing_cache, None),
                               save_timing_cache=str(timing_cache) if timing_cache else None)
    runner = TrtRunner(engine, name=f"trt-{precision}:{path.name}")
    runner.onnxopt_workdir = workdir  # the converted ONNX must outlive the runner's lazy build
    return runner
