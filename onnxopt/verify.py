"""Prove that two models compute the same thing on random inputs (Polygraphy's Comparator).

The source runs once on ONNX Runtime's CPU EP; each candidate runs on the same inputs, on ORT CPU
when ORT has kernels for all its ops, otherwise on ``onnx.reference`` with onnxopt's NumPy kernels
for the com.microsoft fused ops (:mod:`onnxopt.reference`). Outputs are compared element-wise:
a value passes when its absolute error is within ``atol`` or its relative error within ``rtol``.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from polygraphy.backend.base import BaseRunner
from polygraphy.backend.onnxrt import OnnxrtRunner
from polygraphy.common import TensorMetadata
from polygraphy.comparator import Comparator, DataLoader, SimpleCompareFunc
from polygraphy.comparator.struct import RunResults
from polygraphy.logger import G_LOGGER

from onnxopt.errors import OnnxoptError
from onnxopt.model import Model
from onnxopt.report import Verification
from onnxopt.runtime import import_onnxruntime, inference_session
from onnxopt.saving import AUTO_EXTERNAL_BYTES, save_model
from onnxopt.weights import BFLOAT16, numpy_dtype

# Concrete values for symbolic dims, by name. Exporters name dims freely ("batch", "s30",
# "height"), so a dim we cannot place gets DEFAULT_DIM; users override with --shape/dims=.
DEFAULT_DIM = 8
BATCH_DIM = 2
FLOAT_RANGE = (-1.0, 1.0)
INT_RANGE = (0, 10)  # token ids, timesteps: small non-negative values valid for any vocabulary
MAX_FEED_BYTES = 1 << 30  # random inputs, all together: far above a full-size UNet's, far below a crash


@dataclass
class Tolerance:
    atol: float = 1e-4
    rtol: float = 1e-3


# bfloat16 keeps 8 bits of mantissa to float16's 11: its rounding is 8 times coarser than float16's
# (which the fp16 pass allows 2e-2), allowed 4 times. A source computed in bfloat16 is compared no
# tighter: any reordering of its arithmetic moves results by bfloat16 roundings.
BFLOAT16_TOLERANCE = Tolerance(atol=8e-2, rtol=8e-2)


@dataclass
class InputSpec:
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per input name
    dims: dict[str, int] = field(default_factory=dict)  # per symbolic dim name


def input_metadata(model: Model, spec: InputSpec | None = None) -> TensorMetadata:
    """Concrete shapes and dtypes for every graph input.

    Refuses (:class:`OnnxoptError`, exit 2): a ``--shape`` for an input the model does not have,
    of another rank, or that contradicts a static dim; an input type random values cannot be made
    for (string, float8...); inputs larger than MAX_FEED_BYTES in all (a rank-16 input with every
    dim symbolic is 2 PiB at the default dims), naming the dims to set."""
    spec = spec or InputSpec()
    names = [t.name for t in model.graph.inputs]
    for name in spec.shapes:
        if name not in names:
            raise OnnxoptError(f"--shape {name}=...: the model has no input '{name}' (its inputs: {', '.join(names) or 'none'})")
    meta, nbytes, defaulted = TensorMetadata(), 0, {}
    for tensor in model.graph.inputs:
        dtype = _feed_dtype(tensor)
        declared = list(tensor.shape) if tensor.shape is not None else None
        if tensor.name in spec.shapes:
            shape = tuple(spec.shapes[tensor.name])
            _check_shape_arg(tensor.name, shape, declared)
        else:
            shape = tuple(_concrete_dim(d, spec.dims) for d in (declared or ()))
            defaulted.update({str(d): v for d, v in zip(declared or (), shape) if not _is_static(d) and str(d) not in spec.dims})
        # Polygraphy's loader makes no bfloat16: it draws float32, rounded by random_feeds.
        meta.add(tensor.name, dtype=np.dtype(np.float32) if dtype == BFLOAT16 else dtype, shape=shape)
        nbytes += int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
    if nbytes > MAX_FEED_BYTES:
        dims = ", ".join(f"{d or '?'}={v}" for d, v in defaulted.items())
        hint = f" (dims set by default: {dims})" if dims else ""
        raise OnnxoptError(f"the random inputs would take {_human_bytes(nbytes)}, over the {_human_bytes(MAX_FEED_BYTES)} "
                           f"limit{hint}: give smaller values with --dim NAME=N or --shape INPUT=D1,D2,...")
    return meta


def check_dim_names(model: Model, names) -> None:
    """Refuse (exit 2) a ``--dim NAME=N`` whose NAME no graph input has: it would be ignored, and the
    inputs made at the default dims instead of the ones the user meant."""
    known = {str(d) for t in model.graph.inputs for d in (t.shape or ()) if not _is_static(d)}
    for name in names:
        if name not in known:
            listed = ", ".join(sorted(known)) or "none: every input shape is static"
            raise OnnxoptError(f"--dim {name}=...: no input of the model has a dim named '{name}' (its symbolic dims: {listed})")


def _is_static(dim) -> bool:
    return isinstance(dim, (int, np.integer)) and dim >= 0



def _feed_dtype(tensor) -> np.dtype:
    try:
        dtype = numpy_dtype(tensor.dtype) if tensor.dtype is not None else None
    except (TypeError, KeyError, ValueError):
        dtype = None
    if dtype == BFLOAT16:
        return dtype
    if dtype is None or dtype.kind not in "biuf":
        if isinstance(tensor.dtype, int):
            kind = onnx.TensorProto.DataType.Name(tensor.dtype).lower()
        else:
            kind = "string" if dtype is not None and dtype.kind in "OSU" else str(getattr(dtype, "name", tensor.dtype))
        raise OnnxoptError(f"cannot make random values for input '{tensor.name}' of type {kind}: "
                           "inputs must be bool, integer, bfloat16 or float16/32/64")
    return dtype


def _check_shape_arg(name: str, shape: tuple[int, ...], declared: list | None) -> None:
    if any(d < 0 for d in shape):
        raise OnnxoptError(f"--shape {name}={','.join(map(str, shape))}: dims must be 0 or more")
    if declared is None:
        return
    if len(shape) != len(declared):
        raise OnnxoptError(f"--shape {name}={','.join(map(str, shape))}: input '{name}' has rank {len(declared)} "
                           f"({'x'.join(str(d) for d in declared) or 'a scalar'}), not {len(shape)}")
    for axis, (given, dim) in enumerate(zip(shape, declared)):
        if _is_static(dim) and given != dim:
            raise OnnxoptError(f"--shape {name}={','.join(map(str, shape))}: dim {axis} of input '{name}' is fixed at {dim}")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _concrete_dim(dim, named: dict[str, int]) -> int:
    if isinstance(dim, (int, np.integer)) and dim >= 0:
        return int(dim)
    name = str(dim or "")
    if name in named:
        return named[name]
    if re.search(r"batch", name, re.IGNORECASE):
        return BATCH_DIM
    return DEFAULT_DIM


def random_feeds(model: Model, spec: InputSpec | None = None, seed: int = 0, iterations: int = 1) -> list[dict[str, np.ndarray]]:
    meta = input_metadata(model, spec)
    ranges = {t.name: (INT_RANGE if np.issubdtype(numpy_dtype(t.dtype), np.integer) else FLOAT_RANGE) for t in model.graph.inputs}
    with _quiet():
        loader = DataLoader(seed=seed, iterations=iterations, input_metadata=meta, val_range=ranges)
        feeds = [dict(feed) for feed in loader]
    rounded = [t.name for t in model.graph.inputs if _feed_dtype(t) == BFLOAT16]
    for feed in feeds:
        feed.update({name: feed[name].astype(BFLOAT16) for name in rounded})
    return feeds


def load_feeds(path: str | Path, model: Model) -> list[dict[str, np.ndarray]]:
    """Inputs from an .npz keyed by input name (cast to the model's input types); one-line
    :class:`OnnxoptError` for a missing file, a named pipe or device, a file that is not an .npz, a
    missing input."""
    import zipfile

    from onnxopt.input_files import refuse_special_file

    refuse_special_file(path, "an .npz of inputs")  # np.load of a named pipe waited for a writer forever
    try:
        data = np.load(path, allow_pickle=False)
    except OSError as exc:
        raise OnnxoptError(f"{path}: cannot read inputs: {exc.strerror or exc}")
    except (ValueError, EOFError, zipfile.BadZipFile):  # numpy takes what is not .npy/.npz for a pickle
        data = None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise OnnxoptError(f"{path}: not an .npz of arrays keyed by input name (np.savez(path, name=array, ...))")
    with data:
        names = [t.name for t in model.graph.inputs]
        missing = [n for n in names if n not in data.files]
        if missing:
            raise OnnxoptError(f"{path}: no array for input(s) {', '.join(missing)} (it holds: {', '.join(data.files) or 'nothing'})")
        feeds = {}
        for t in model.graph.inputs:
            try:
                feeds[t.name] = np.asarray(data[t.name]).astype(_feed_dtype(t))
            except (ValueError, TypeError, zipfile.BadZipFile) as exc:
                raise OnnxoptError(f"{path}: array '{t.name}' cannot be read as {t.dtype}: {exc}")
    return [feeds]


def _io_dtypes(model: Model) -> set[np.dtype]:
    return {numpy_dtype(t.dtype) for t in list(model.graph.inputs) + list(model.graph.outputs) if t.dtype is not None}


def computes_in_bfloat16(model: Model) -> bool:
    """The model takes or returns bfloat16 (an export made in bfloat16)."""
    return BFLOAT16 in _io_dtypes(model)


def computes_in_low_precision_io(model: Model) -> bool:
    """The model takes or returns float16/bfloat16 (an export made in low precision)."""
    return bool(_io_dtypes(model) & {BFLOAT16, np.dtype(np.float16)})


class ReferenceRunner(BaseRunner):
    """Runs a model with onnx.reference plus onnxopt's kernels for com.microsoft ops."""

    def __init__(self, model: onnx.ModelProto, name: str | None = None):
        super().__init__(name=name, prefix="onnxopt-reference")
        self._proto = model

    def activate_impl(self):
        from onnxopt import reference

        self._evaluator = reference.evaluator(self._proto)

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for vi in self._proto.graph.input:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in vi.type.tensor_type.shape.dim]
            meta.add(vi.name, dtype=dtype, shape=dims)
        return meta

    def infer_impl(self, feed_dict):
        names = [o.name for o in self._proto.graph.output]
        start = time.perf_counter()
        with np.errstate(all="ignore"):  # a half-precision overflow is a result to compare, not a warning
            outputs = self._evaluator.run(names, feed_dict)
        self.inference_time = time.perf_counter() - start  # Polygraphy's Comparator sums these
        # Polygraphy compares no bfloat16: widen it to float32, which holds every bfloat16 exactly.
        return {name: value.astype(np.float32) if value.dtype == BFLOAT16 else value for name, value in zip(names, outputs)}

    def deactivate_impl(self):
        del self._evaluator


LOW_PRECISION_TYPES = frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})


def computes_in_low_precision(proto: onnx.ModelProto) -> bool:
    """Whether ``proto`` holds float16/bfloat16 values: inputs, outputs, annotated tensors,
    initializers, Constant values or Casts to those types."""
    graph = proto.graph
    infos = list(graph.input) + list(graph.output) + list(graph.value_info)
    if any(vi.type.tensor_type.elem_type in LOW_PRECISION_TYPES for vi in infos):
        return True
    if any(t.data_type in LOW_PRECISION_TYPES for t in graph.initializer):
        return True
    for node in graph.node:
        for attr in node.attribute:
            if attr.name == "to" and node.op_type == "Cast" and attr.i in LOW_PRECISION_TYPES:
                return True
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in LOW_PRECISION_TYPES:
                return True
    return False


def runner_for(model: Model, name: str, workdir: Path, *, low_precision_on_reference: bool = True) -> BaseRunner:
    """ORT CPU where it has every kernel and the model computes in float32, else the reference evaluator.

    A model with float16/bfloat16 values runs on the reference evaluator, whose NumPy kernels
    compute in the tensors' own type: ORT's CPU EP runs many half-precision ops in float32 (it
    inserts Casts around ops without a float16 kernel), so an overflow to inf that the GPU would
    produce stays finite there and verification could not see it. Past 1.8 GB of weights the
    model runs on ORT CPU from a file (the NumPy kernels would take hours): its half-precision
    arithmetic is then not reproduced, and the :class:`Verifier` says so in its ``notes``.
    ``low_precision_on_reference=False`` keeps them on ORT CPU (``onnxopt diff --runtime cpu``)."""
    from onnxopt import reference

    import_onnxruntime()
    if model.weights_nbytes() > AUTO_EXTERNAL_BYTES:
        path = workdir / f"{name}.onnx"
        save_model(model, path, external_data=True)
        return OnnxrtRunner(partial(inference_session, str(path), ["CPUExecutionProvider"]), name=name)
    proto = model.to_onnx()
    if reference.unsupported_on_ort_cpu(proto) or (low_precision_on_reference and computes_in_low_precision(proto)):
        return ReferenceRunner(proto, name=name)
    return OnnxrtRunner(partial(inference_session, proto.SerializeToString(), ["CPUExecutionProvider"]), name=name)


class ChainedRunner(BaseRunner):
    """A model with companions, run as a pipeline runs it: each companion on the inputs, then the
    main model on the inputs plus what the companions computed (outputs feed inputs by name)."""

    def __init__(self, stages: list[BaseRunner], name: str | None = None):
        super().__init__(name=name, prefix="onnxopt-chain")
        self.stages = stages  # companions first, the main model last

    def activate_impl(self):
        for stage in self.stages:
            stage.activate()

    def get_input_metadata_impl(self):
        meta, produced = TensorMetadata(), set()
        for stage in self.stages:
            for name, entry in stage.get_input_metadata(use_numpy_dtypes=False).items():
                if name not in produced and name not in meta:
                    meta.add(name, dtype=entry.dtype, shape=entry.shape)
            produced |= getattr(stage, "output_names", set())
        return meta

    def infer_impl(self, feed_dict):
        values, seconds = dict(feed_dict), 0.0
        for stage in self.stages:
            wanted = stage.get_input_metadata(use_numpy_dtypes=False)
            outputs = stage.infer({name: values[name] for name in wanted}, check_inputs=False)
            seconds += stage.last_inference_time() or 0.0
            values.update({name: np.array(value) for name, value in outputs.items()})
        self.inference_time = seconds
        return outputs

    def deactivate_impl(self):
        for stage in reversed(self.stages):
            stage.deactivate()


def chained(model: Model, name: str, workdir: Path, make_runner=None) -> BaseRunner:
    """``make_runner`` (default :func:`runner_for`) for ``model``; a :class:`ChainedRunner` of its
    companions and itself when it has companions."""
    make_runner = make_runner or runner_for
    if not model.companions:
        return make_runner(model, name, workdir)
    stages = []
    for part_name, part in [*model.companions.items(), (None, model.alone())]:
        stage = make_runner(part, f"{name}.{part_name}" if part_name else f"{name}.main", workdir)
        stage.output_names = {t.name for t in part.graph.outputs}
        stages.append(stage)
    return ChainedRunner(stages, name=name)


class Verifier:
    """Compares models with ``source``; call it with a model to get a :class:`Verification`.

    A model with companions (a split by ``context-kv``) is run as the chain companion -> main.

    Non-finite values: where the source's output is NaN or ±inf, a candidate with the same value at
    the same place computes the same thing there, so those places compare equal; any other value
    there fails. That the source itself is non-finite on these inputs is said in ``notes`` (with
    the number of such values), which ``optimize`` adds to its report.

    A source that cannot run (an op of an unknown domain, a type ORT and the reference evaluator
    lack) is a limit of verification, not of the model: :class:`OnnxoptError` (exit 2), saying
    so. A candidate that cannot run where the source did fails verification, naming the error."""

    def __init__(self, source: Model, *, tolerance: Tolerance | None = None, inputs: InputSpec | None = None,
                 feeds: list[dict[str, np.ndarray]] | None = None, seed: int = 0,
                 candidate_runner: Callable[[Model, str, Path], BaseRunner] | None = None):
        """``candidate_runner(model, name, workdir)`` runs the candidates elsewhere (``onnxopt diff
        --bisect --runtime cuda``); the source always runs as :func:`runner_for` runs it."""
        self.tolerance = tolerance or Tolerance()
        self.notes: list[str] = []
        if computes_in_bfloat16(source) and (self.tolerance.atol < BFLOAT16_TOLERANCE.atol or self.tolerance.rtol < BFLOAT16_TOLERANCE.rtol):
            self.tolerance = Tolerance(max(self.tolerance.atol, BFLOAT16_TOLERANCE.atol), max(self.tolerance.rtol, BFLOAT16_TOLERANCE.rtol))
            self.notes.append(f"the source computes in bfloat16: compared at atol {self.tolerance.atol:g}, rtol {self.tolerance.rtol:g} "
                              "(any reordering of its arithmetic moves results by bfloat16 roundings)")
        self._candidate_runner = candidate_runner or runner_for
        # The source as loaded, for rebase (the caller's model is optimized in place): kept only
        # where a rebasing pass can change something, a source computing in low precision.
        self._low_source = source.copy() if computes_in_low_precision_io(source) else None
        self._rebased: list[str] = []
        self.feeds = feeds if feeds is not None else random_feeds(source, inputs, seed=seed)
        self._tmp = tempfile.TemporaryDirectory(prefix="onnxopt-verify-")
        try:
            self._source_results = self._run(source, "source")
        except Exception as exc:
            self.close()
            if isinstance(exc, OnnxoptError):
                raise
            raise OnnxoptError(f"cannot verify: the source model does not run on ORT CPU or the reference evaluator "
                               f"({_first_line(exc)}); optimize without --verify") from exc
        self._note_nonfinite_source()
        self._count = 0

    def _run(self, model: Model, name: str, make_runner=runner_for) -> RunResults:
        runner = chained(model, name, Path(self._tmp.name), make_runner)
        self._note_unfaithful_precision(model)
        with _quiet():
            return Comparator.run([runner], data_loader=self.feeds)

    def rebase(self, transform: Callable[[Model], object], name: str) -> bool:
        """Compare from now on with the source rewritten by ``transform`` (the pass ``name``, which
        computes more exactly than the source); False, comparing as before, for a float32 source."""
        if self._low_source is None or name in self._rebased:
            return False
        reference = self._low_source.copy()
        transform(reference)
        self._source_results = self._run(reference, "source")
        self._note_nonfinite_source()
        self._rebased.append(name)
        self.notes.append(f"from {name} on, compared with the source rewritten by {name} (it computes in float32 what "
                          "the source rounded)")
        return True

    def __call__(self, model: Model, tolerance: tuple[float, float] | None = None) -> Verification:
        """Compare ``model`` with the source, at this verifier's tolerance or ``tolerance`` where looser."""
        self._count += 1
        atol, rtol = self.tolerance.atol, self.tolerance.rtol
        if tolerance is not None:
            atol, rtol = max(atol, tolerance[0]), max(rtol, tolerance[1])
        try:
            candidate = self._run(model, f"candidate{self._count}", self._candidate_runner)
        except OnnxoptError:
            raise
        except Exception as exc:  # the source ran: a rewrite made a model the runtime refuses
            message = f"the model does not run: {_first_line(exc)}"
            return Verification(ok=False, max_abs_error=float("inf"), max_rel_error=float("inf"), worst_output="", message=message)
        results = RunResults()
        for runner_name, iterations in self._source_results.items():
            results.append((runner_name, iterations))
        for runner_name, iterations in candidate.items():
            results.append((runner_name, [self._same_nonfinite_as_zero(i, it) for i, it in enumerate(iterations)]))
        compare = SimpleCompareFunc(atol=atol, rtol=rtol)
        try:
            with _quiet(), np.errstate(all="ignore"):  # statistics of inf/NaN outputs: the verdict says it
                accuracy = Comparator.compare_accuracy(results, compare_func=compare)
        except Exception as exc:  # outputs Polygraphy cannot compare (strings...)
            raise OnnxoptError(f"cannot verify: the outputs cannot be compared ({_first_line(exc)}); optimize without --verify") from exc
        return _summarise(accuracy)

    def _same_nonfinite_as_zero(self, index: int, iteration):
        """The candidate's outputs where the source's are non-finite: 0 where the candidate has the
        same value (the source has 0 there too, see :meth:`_note_nonfinite_source`), NaN elsewhere
        (which fails whatever the tolerance)."""
        from polygraphy.comparator.struct import IterationResult

        outputs = {}
        for name, value in iteration.items():
            value = np.asarray(value)
            ref = self._source_nonfinite.get(index, {}).get(name)
            if ref is not None and value.shape == ref.shape and value.dtype.kind == "f":
                same = (value == ref) | (np.isnan(value) & np.isnan(ref))
                value = np.where(np.isfinite(ref), value, np.where(same, 0, np.nan)).astype(value.dtype)
            outputs[name] = value
        return IterationResult(outputs, runner_name=iteration.runner_name)

    def _note_nonfinite_source(self) -> None:
        """Keep the source's outputs that hold NaN or inf aside and compare 0 in their place."""
        self._source_nonfinite: dict[int, dict[str, np.ndarray]] = {}
        counts: dict[str, int] = {}
        for index, it in enumerate(next(iter(self._source_results.values()))):
            for name in list(it.keys()):
                value = np.asarray(it[name])
                if value.dtype.kind == "f" and not np.isfinite(value).all():
                    counts[name] = counts.get(name, 0) + int(np.count_nonzero(~np.isfinite(value)))
                    self._source_nonfinite.setdefault(index, {})[name] = value
                    it[name] = np.where(np.isfinite(value), value, 0).astype(value.dtype)
        if counts:
            listing = ", ".join(f"'{n}' ({c} value{'s' if c > 1 else ''})" for n, c in counts.items())
            self.notes.append(f"the source itself computes NaN or inf on these inputs: {listing}; the same non-finite "
                              "value at the same place counts as equal, and verification proves nothing more there")

    def _note_unfaithful_precision(self, model: Model) -> None:
        if model.weights_nbytes() <= AUTO_EXTERNAL_BYTES or any("float16 arithmetic" in n for n in self.notes):
            return
        if computes_in_low_precision(model.skeleton()):
            self.notes.append("a model with float16/bfloat16 values this large runs on ORT CPU, which computes many "
                              "float16 ops in float32: float16 arithmetic (overflow to inf) is not reproduced; "
                              "check with onnxopt diff --runtime cuda on a GPU")

    def close(self):
        self._tmp.cleanup()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def _summarise(accuracy) -> Verification:
    worst_abs, worst_rel, worst_name, reshaped = 0.0, 0.0, "", ""
    ok = all(bool(per_func) for per_func in accuracy)
    for iterations in (it for per_func in accuracy for it in per_func.values()):
        for per_output in iterations:
            for name, result in per_output.items():
                if not hasattr(result, "max_absdiff"):  # Polygraphy's bare False: the shapes differ
                    worst_abs, worst_rel, worst_name, reshaped = float("inf"), float("inf"), name, name
                    continue
                abs_err = float(result.max_absdiff) if result.max_absdiff is not None else float("inf")
                if abs_err >= worst_abs:
                    worst_abs, worst_name = abs_err, name
                worst_rel = max(worst_rel, float(result.max_reldiff or 0.0))
    if reshaped:
        message = f"output '{reshaped}' has another shape than the source's"
    else:
        message = "" if ok else f"output '{worst_name}' differs by up to {worst_abs:.3g} (abs)"
    return Verification(ok=ok, max_abs_error=worst_abs, max_rel_error=worst_rel, worst_output=worst_name, message=message)


def assert_same_computation(a, b, *, atol: float = 1e-4, rtol: float = 1e-3, inputs: InputSpec | None = None, seed: int = 0) -> Verification:
    """Test helper: ``a`` and ``b`` (paths, ModelProtos, graphs or Models) agree on random inputs."""
    from onnxopt.loading import load_model

    source, candidate = load_model(a), load_model(b)
    verifier = Verifier(source, tolerance=Tolerance(atol, rtol), inputs=inputs, seed=seed)
    try:
        outcome = verifier(candidate)
    finally:
        verifier.close()
    if not outcome.ok:
        raise AssertionError(f"models differ: {outcome.message} (max rel {outcome.max_rel_error:.3g}; atol={atol}, rtol={rtol})")
    return outcome


@contextlib.contextmanager
def _quiet():
    """Polygraphy logs every run at INFO; verification reports through its own result instead."""
    with G_LOGGER.verbosity(max(G_LOGGER.module_severity.get(), G_LOGGER.ERROR)):  # never louder than the caller asked
        yield
