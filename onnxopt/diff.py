"""``onnxopt diff``: how far an optimized model is from its fp32 source, output by output.

Both models get the same inputs (random, from the source's input types and ``--shape/--dim``, or
an ``.npz``); Polygraphy's Comparator runs them:

* reference: the source, in float32, on ONNX Runtime's CPU EP (on ``onnx.reference`` with
  onnxopt's kernels when the source itself holds fused ops ORT's CPU build cannot run);
* candidate, by ``runtime``: ``cuda`` (:class:`onnxopt.runners.ort_cuda.OrtCudaSession`: IO
  binding, the session bench times), ``trt`` (``onnxopt.runners.tensorrt``), ``cpu`` (ORT CPU EP)
  or ``reference`` (``onnx.reference`` + :mod:`onnxopt.reference`). Default: ``cuda`` where ORT's
  CUDA EP is available, else ``cpu`` where ORT's CPU build has a kernel for every op, else
  ``reference``.

Inputs are cast to each model's input types (fp16 candidates get fp16 inputs); outputs are
compared in float64. Per output:

* ``max abs``, ``median abs``, ``p99 abs``: of |candidate - reference|;
* ``max rel``: of |candidate - reference| / |reference| (Polygraphy's definition: zeros in the
  reference get a 2e-16 epsilon, so this can be huge where the reference is 0);
* ``rel L2``: ||candidate - reference||_2 / ||reference||_2;
* ``PSNR`` (dB), for image-like outputs only: 10 log10(peak^2 / MSE), peak = max - min of the
  reference (its dynamic range, so [-1, 1] images and latents are judged on their real range;
  Polygraphy's PsnrCompareFunc takes max(reference) as the peak instead). Image-like: rank 4, with
  1, 3 or 4 channels in dim 1 (NCHW) or dim 3 (NHWC) and both other non-batch dims >= 8. That is
  a VAE decoder's image and a UNet's latent, not a ControlNet's 320-channel residuals;
* verdict: Polygraphy's ``SimpleCompareFunc`` element-wise check, as ``--verify`` does: every
  value within ``atol`` (absolute) or within ``rtol`` (relative to the reference). NaN fails.

``bisect`` answers which pass broke it: the passes run one at a time from the source
(:class:`~onnxopt.manager.PassManager` with :class:`~onnxopt.verify.Verifier`, the candidates on
the chosen runtime) and the first to break the tolerance is named, with these metrics for the
model right after it.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
from polygraphy.backend.base import BaseRunner
from polygraphy.backend.onnxrt import OnnxrtRunner
from polygraphy.common import TensorMetadata
from polygraphy.comparator import Comparator, SimpleCompareFunc
from polygraphy.comparator.struct import IterationResult, RunResults
from polygraphy.exception import PolygraphyException

from onnxopt import registry
from onnxopt.errors import MissingDependencyError, OnnxoptError
from onnxopt.loading import load_model
from onnxopt.model import Model
from onnxopt.report import OptimizationReport
from onnxopt.runtime import import_onnxruntime, inference_session
from onnxopt.verify import InputSpec, ReferenceRunner, Tolerance, Verifier, _quiet, load_feeds, random_feeds, runner_for
from onnxopt.weights import numpy_dtype

RUNTIMES = ("cuda", "trt", "cpu", "reference")
RUNTIME_NAMES = {"cuda": "ORT CUDA EP", "trt": "TensorRT", "cpu": "ORT CPU EP", "reference": "onnx.reference"}
# A bisection without --runtime and without CUDA: each candidate runs where `diff` would run it, on
# ORT CPU where it has every kernel, else on the reference kernels (a fused op ORT CPU lacks).
CPU_OR_REFERENCE = "cpu-or-reference"
RUNTIME_NAMES[CPU_OR_REFERENCE] = "ORT CPU EP (onnx.reference for a candidate with ops ORT CPU lacks)"
QUANTILE = 0.99
IMAGE_CHANNELS = (1, 3, 4)
IMAGE_MIN_SIDE = 8
LARGE_MODEL_BYTES = 64 << 20  # candidates saved for a runtime go to external data above this


# ----------------------------------------------------------------------------------- metrics


@dataclass
class OutputMetrics:
    name: str
    shape: list[int]
    dtype: str  # the candidate's output type
    max_abs: float
    median_abs: float
    p99_abs: float
    max_rel: float
    rel_l2: float
    psnr_db: float | None  # image-like outputs only
    nonfinite: int  # values finite in the reference but not in the candidate
    atol: float
    rtol: float
    passed: bool


def is_image_like(shape) -> bool:
    """Rank 4 with 1/3/4 channels in the NCHW or NHWC place and spatial sides of at least 8."""
    if len(shape) != 4:
        return False
    _, c1, d2, d3 = shape
    if c1 in IMAGE_CHANNELS and min(d2, d3) >= IMAGE_MIN_SIDE:
        return True
    return d3 in IMAGE_CHANNELS and min(c1, d2) >= IMAGE_MIN_SIDE


def relative_l2(reference: np.ndarray, candidate: np.ndarray) -> float:
    ref, cand = reference.astype(np.float64), candidate.astype(np.float64)
    err, norm = float(np.linalg.norm(cand - ref)), float(np.linalg.norm(ref))
    if norm == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / norm


def psnr_db(reference: np.ndarray, candidate: np.ndarray) -> float:
    """10 log10(peak^2 / MSE), peak = the reference's dynamic range (max - min); inf when equal."""
    ref, cand = reference.astype(np.float64), candidate.astype(np.float64)
    mse = float(np.mean((cand - ref) ** 2))
    if mse == 0.0:
        return math.inf
    peak = float(ref.max() - ref.min()) or 1.0
    return 10.0 * math.log10(peak * peak / mse)


def compare_outputs(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray],
                    tolerance: Tolerance) -> list[OutputMetrics]:
    """Metrics for every reference output (see the module docstring), verdicts by Polygraphy."""
    results = RunResults()
    results.append(("candidate", [IterationResult(dict(candidate), runner_name="candidate")]))
    results.append(("reference", [IterationResult(dict(reference), runner_name="reference")]))
    return _metrics_from(results, tolerance)


def _metrics_from(results: RunResults, tolerance: Tolerance) -> list[OutputMetrics]:
    """``results``: the candidate's run first, the reference's second (relative errors are
    relative to the second)."""
    (_, cand_iters), (_, ref_iters) = list(results.items())
    candidate, reference = cand_iters[0], ref_iters[0]
    for outputs in (candidate, reference):  # onnx.reference returns transposed views; Polygraphy wants contiguous arrays
        for name in list(outputs.keys()):
            outputs[name] = np.ascontiguousarray(outputs[name])
    missing = [name for name in reference if name not in candidate]
    if missing:
        raise OnnxoptError(f"the candidate has no output named {', '.join(map(repr, missing))}; "
                           f"its outputs: {', '.join(candidate)}")
    compare = SimpleCompareFunc(atol=tolerance.atol, rtol=tolerance.rtol, check_error_stat="elemwise", check_shapes=True)
    # 0 / 0 of equal integer outputs and the mean of an empty (dim 0) output: NumPy's RuntimeWarnings
    # reached stderr; the metrics below say what they mean
    with _quiet(), np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        accuracy = Comparator.compare_accuracy(results, compare_func=compare)
    verdicts = next(iter(accuracy[0].values()))[0]  # the one pair, the one iteration: {output: result}
    metrics = []
    for name, ref in reference.items():
        cand = np.asarray(candidate[name])
        ref = np.asarray(ref)
        verdict = verdicts.get(name)
        if verdict is None or cand.shape != ref.shape:  # Polygraphy refused to compare: shapes differ
            raise OnnxoptError(f"output '{name}': the candidate's shape {list(cand.shape)} is not the source's {list(ref.shape)}")
        absdiff = np.abs(cand.astype(np.float64) - ref.astype(np.float64))
        metrics.append(OutputMetrics(
            name=name, shape=list(ref.shape), dtype=str(cand.dtype),
            max_abs=float(verdict.max_absdiff), median_abs=float(verdict.median_absdiff),
            p99_abs=float(np.quantile(absdiff, QUANTILE)) if absdiff.size else 0.0,
            max_rel=_max_rel(verdict, absdiff, ref),
            rel_l2=relative_l2(ref, cand),
            psnr_db=psnr_db(ref, cand) if is_image_like(ref.shape) else None,
            nonfinite=int(np.count_nonzero(np.isfinite(ref) & ~np.isfinite(cand))),
            atol=tolerance.atol, rtol=tolerance.rtol, passed=bool(verdict),
        ))
    return metrics


def _max_rel(verdict, absdiff: np.ndarray, ref: np.ndarray) -> float:
    """Polygraphy's max relative difference, except where it is 0 / 0: equal integer outputs with
    zeros gave NaN (in the table and, as an invalid JSON token, in --json). Equal values: 0."""
    value = float(verdict.max_reldiff)
    if math.isnan(value) and not np.isnan(absdiff).any():
        with np.errstate(all="ignore"):
            rel = np.where(absdiff == 0, 0.0, absdiff / np.abs(ref.astype(np.float64)))
        value = float(rel.max()) if rel.size else 0.0
    return value


# ----------------------------------------------------------------------------------- runners


class OrtCudaRunner(BaseRunner):
    """Polygraphy runner around :class:`~onnxopt.runners.ort_cuda.OrtCudaSession` (IO binding,
    the session configuration ``onnxopt bench`` times)."""

    def __init__(self, path: str, *, prefer_nhwc: bool = False, name: str | None = None):
        super().__init__(name=name, prefix="onnxopt-ort-cuda")
        self.path, self.prefer_nhwc = str(path), prefer_nhwc

    def activate_impl(self):
        from onnxopt.runners.ort_cuda import OrtCudaSession

        self._session = OrtCudaSession(self.path, cuda_graph=False, prefer_nhwc=self.prefer_nhwc)

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        types = self._session.input_types()
        for i in self._session.session.get_inputs():  # symbolic dims: their names (None: "?")
            meta.add(i.name, dtype=types[i.name], shape=[d if isinstance(d, (int, str)) else "?" for d in i.shape])
        return meta

    def infer_impl(self, feed_dict):
        start = time.perf_counter()
        self._session.bind(feed_dict)
        self._session.run()
        outputs = self._session.outputs()
        self.inference_time = time.perf_counter() - start
        return outputs

    def deactivate_impl(self):
        del self._session


def tensorrt_runner(path: str, precision: str, shapes: dict[str, tuple[int, ...]] | None = None):
    """``onnxopt.runners.tensorrt.polygraphy_runner``, imported only when asked for; one engine
    profile fixed at ``shapes`` (the shapes diff feeds)."""
    try:
        from onnxopt.runners.tensorrt import polygraphy_runner
    except ImportError as exc:
        raise MissingDependencyError(
            "the TensorRT runtime is not available: pip install tensorrt ('onnxopt[trt]') on a machine "
            f"with an NVIDIA GPU ({type(exc).__name__}: {exc})"
        ) from exc
    return polygraphy_runner(str(path), precision=precision, profiles=shapes or None, timing_cache=None)


def trt_precision(model: Model) -> str:
    """The TensorRT precision a model's own types ask for: bf16 or fp16 where it has such tensors, else fp32."""
    types = {str(numpy_dtype(t.dtype)) if not isinstance(t.dtype, str) else t.dtype
             for t in model.graph.tensors().values() if t.dtype is not None}
    return "bf16" if "bfloat16" in types else "fp16" if "float16" in types else "fp32"


def default_runtime(model: Model) -> str:
    """``cuda`` where ORT's CUDA EP is available, else ``cpu`` where ORT CPU has every kernel, else ``reference``."""
    from onnxopt import reference
    from onnxopt.runners.ort_cuda import cuda_available

    if cuda_available():
        return "cuda"
    return "reference" if reference.unsupported_on_ort_cpu(model.skeleton()) else "cpu"


def check_runtime(runtime: str, model: Model) -> None:
    """Fail with one line, before anything runs, where ``runtime`` cannot run ``model``."""
    from onnxopt import reference

    if runtime not in RUNTIMES:
        raise OnnxoptError(f"unknown runtime '{runtime}': choose one of {', '.join(RUNTIMES)}")
    if runtime == "cuda":
        from onnxopt.runners.ort_cuda import _require_cuda

        _require_cuda()
    elif runtime == "cpu":
        import_onnxruntime()
        missing = reference.unsupported_on_ort_cpu(model.skeleton())
        if missing:
            raise OnnxoptError(f"ONNX Runtime's CPU build has no kernel for {', '.join(sorted(missing))}: "
                               "use --runtime reference (NumPy kernels) or --runtime cuda on a GPU")


def runner_for_path(runtime: str, path: str | Path, model: Model, *, name: str, prefer_nhwc: bool = False,
                    precision: str | None = None, shapes: dict[str, tuple[int, ...]] | None = None) -> BaseRunner:
    """A Polygraphy runner for the model file ``path`` (``model``: the same model, loaded lazily)."""
    check_runtime(runtime, model)
    if runtime == "cuda":
        return OrtCudaRunner(str(path), prefer_nhwc=prefer_nhwc, name=name)
    if runtime == "trt":
        return tensorrt_runner(str(path), precision or trt_precision(model), shapes)
    if runtime == "cpu":
        return OnnxrtRunner(partial(inference_session, str(path), ["CPUExecutionProvider"]), name=name)
    return ReferenceRunner(model.to_onnx(), name=name)


def model_runner(runtime: str, *, prefer_nhwc: bool = False, precision: str | None = None,
                 shapes: dict[str, tuple[int, ...]] | None = None):
    """``make(model, name, workdir) -> runner`` for in-memory models (the Verifier's candidates):
    saved to ``workdir`` for the runtimes that need a file. Each call first deletes the files the
    previous call wrote (its run is over), so a bisection of a 3.4 GB UNet keeps one candidate on disk."""
    from onnxopt.saving import save_model

    written: list[Path] = []

    def make(model: Model, name: str, workdir: Path) -> BaseRunner:
        while written:
            written.pop().unlink(missing_ok=True)
        path = Path(workdir) / f"{name}.onnx"
        written.extend([path, path.with_name(path.name + ".data")])
        run_on = default_runtime(model) if runtime == CPU_OR_REFERENCE else runtime
        if run_on in ("cpu", "reference"):
            check_runtime(run_on, model)
            # ORT CPU, in memory below 1.8 GB, else saved as ``path``; --runtime cpu keeps float16 models there too
            return runner_for(model, name, workdir, low_precision_on_reference=run_on == "reference")
        save_model(model, path, external_data=True if model.weights_nbytes() > LARGE_MODEL_BYTES else None)
        return runner_for_path(runtime, path, model, name=name, prefer_nhwc=prefer_nhwc, precision=precision, shapes=shapes)

    return make


def source_runner(path: str | Path, model: Model) -> BaseRunner:
    """The reference side: the source on ORT CPU (or onnx.reference where it holds fused ops)."""
    from onnxopt import reference

    import_onnxruntime()
    if reference.unsupported_on_ort_cpu(model.skeleton()):
        return ReferenceRunner(model.to_onnx(), name="reference")
    return OnnxrtRunner(partial(inference_session, str(path), ["CPUExecutionProvider"]), name="reference")


# ----------------------------------------------------------------------------------- inputs


# ----------------------------------------------------------------------------------- report


@dataclass
class BisectResult:
    passes: list[str]
    first_broken_pass: str | None
    report: OptimizationReport
    metrics: list[OutputMetrics] = field(default_factory=list)  # of the model right after the broken pass
    runtime: str = ""  # where the candidates ran (RUNTIME_NAMES); the diff's runtime when empty

    def as_dict(self) -> dict:
        return {"passes": self.passes, "first_broken_pass": self.first_broken_pass, "runtime": self.runtime or None,
                "metrics": [asdict(m) for m in self.metrics], "report": self.report.as_dict()}


@dataclass
class DiffReport:
    source: str
    candidate: str | None
    runtime: str
    tolerance: Tolerance
    inputs: dict[str, list[int]] = field(default_factory=dict)
    outputs: list[OutputMetrics] = field(default_factory=list)
    bisect: BisectResult | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        if self.bisect is not None and self.bisect.first_broken_pass:
            return False
        return all(m.passed for m in self.outputs)

    def as_dict(self) -> dict:
        return {
            "source": self.source, "candidate": self.candidate, "runtime": self.runtime,
            "reference_runtime": "ORT CPU EP, float32", "atol": self.tolerance.atol, "rtol": self.tolerance.rtol,
            "inputs": self.inputs, "ok": self.ok, "outputs": [asdict(m) for m in self.outputs],
            "bisect": self.bisect.as_dict() if self.bisect else None, "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(_finite(self.as_dict()), indent=2, default=str, allow_nan=False)

    def table(self) -> str:
        lines = []
        if self.candidate is not None:
            lines.append(f"{self.candidate} on {RUNTIME_NAMES[self.runtime]} vs {self.source} (fp32, ORT CPU EP); "
                         f"atol={self.tolerance.atol:g} rtol={self.tolerance.rtol:g}")
            lines.append(metrics_table(self.outputs))
            lines.append("within tolerance" if all(m.passed for m in self.outputs) else
                         "OUTSIDE tolerance: " + ", ".join(f"'{m.name}'" for m in self.outputs if not m.passed))
        if self.bisect is not None:
            b = self.bisect
            lines.append(f"bisect: {', '.join(b.passes)} from {self.source}, candidates on {RUNTIME_NAMES[b.runtime or self.runtime]}")
            lines.append(b.report.table())
            if b.first_broken_pass:
                lines.append(f"first pass to break the tolerance: {b.first_broken_pass}")
                if b.metrics:
                    lines.append(metrics_table(b.metrics))
            else:
                lines.append("every pass stays within tolerance")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _finite(value):
    """Strict JSON: inf and NaN (a PSNR of identical outputs, a NaN output) as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.3g}"


def metrics_table(metrics: list[OutputMetrics]) -> str:
    header = ["output", "shape", "dtype", "max abs", "median abs", "p99 abs", "max rel", "rel L2", "PSNR dB", "verdict"]
    rows = [[m.name, "x".join(map(str, m.shape)), m.dtype, _fmt(m.max_abs), _fmt(m.median_abs), _fmt(m.p99_abs),
             _fmt(m.max_rel), _fmt(m.rel_l2), "-" if m.psnr_db is None else (f"{m.psnr_db:.1f}" if math.isfinite(m.psnr_db) else "inf"),
             ("ok" if m.passed else "FAIL") + (f" ({m.nonfinite} non-finite)" if m.nonfinite else "")] for m in metrics]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = lambda row: "  ".join(c.ljust(w) if i < 3 or i == 9 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()  # noqa: E731
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


# ----------------------------------------------------------------------------------- commands


def diff(source: str | Path, candidate: str | Path | None = None, *, runtime: str | None = None,
         tolerance: Tolerance | None = None, inputs: InputSpec | None = None, feeds_path: str | Path | None = None,
         bisect: list[str] | None = None, prefer_nhwc: bool = False, precision: str | None = None, seed: int = 0,
         always_bisect: bool = False) -> DiffReport:
    """Compare ``candidate`` with ``source`` and/or bisect ``bisect`` (pass and preset names) from it.

    With both, the bisection runs only when the candidate is outside tolerance (or ``always_bisect``).
    """
    if candidate is None and not bisect:
        raise OnnxoptError("nothing to compare: give an optimized model, or --bisect with --passes")
    tolerance = tolerance or Tolerance()
    source_model = load_model(source)
    if bisect:
        registry.expand(list(bisect))  # unknown pass names fail before any work
    candidate_model = load_model(candidate) if candidate is not None else None
    chosen_by_user = runtime is not None
    runtime = runtime or default_runtime(candidate_model or source_model)
    # an option of another runtime would be silently ignored: the user would read a result it did not shape
    for option, given, applies in (("--prefer-nhwc", prefer_nhwc, "cuda"), ("--precision", precision, "trt")):
        if given and runtime != applies:
            raise OnnxoptError(f"{option} applies to --runtime {applies}; this diff runs on {runtime}")
    if candidate_model is not None:
        check_runtime(runtime, candidate_model)
        _check_same_inputs(source_model, candidate_model)
    feeds = load_feeds(feeds_path, source_model) if feeds_path else random_feeds(source_model, inputs, seed=seed)
    if feeds_path:
        for model in filter(None, (source_model, candidate_model)):
            check_feed_shapes(feeds[0], model, feeds_path)
    report = DiffReport(str(source), str(candidate) if candidate is not None else None, runtime, tolerance,
                        inputs={k: list(v.shape) for k, v in feeds[0].items()})
    if candidate_model is not None:
        cand_runner = runner_for_path(runtime, candidate, candidate_model, name="candidate", prefer_nhwc=prefer_nhwc,
                                      precision=precision, shapes=_shapes(feeds))
        results = _run([cand_runner, source_runner(source, source_model)], feeds, runtime)
        report.outputs = _metrics_from(results, tolerance)
        if bisect and all(m.passed for m in report.outputs) and not always_bisect:
            report.notes.append("the optimized model is within tolerance: no bisection needed")
            return report
    if bisect:
        # without --runtime, as diff picks one: per candidate (a fused op may leave ORT CPU behind mid-bisection)
        bisect_runtime = runtime if chosen_by_user or runtime == "cuda" else CPU_OR_REFERENCE
        report.bisect = bisect_passes(source_model, bisect, runtime=bisect_runtime, tolerance=tolerance, feeds=feeds,
                                      prefer_nhwc=prefer_nhwc, precision=precision, source_path=source)
    return report


def check_feed_shapes(feed: dict[str, np.ndarray], model: Model, where) -> None:
    """Each array has the rank of the model's input and its fixed dims: Polygraphy silently reshapes
    an array of the same size (a [24] array ran as [2, 3, 4]), so a wrong array compared as a right one."""
    for t in model.graph.inputs:
        if t.name not in feed or t.shape is None:
            continue
        got = feed[t.name].shape
        fixed_ok = all(not isinstance(d, int) or d < 0 or d == g for d, g in zip(t.shape, got))
        if len(got) != len(t.shape) or not fixed_ok:
            expected = "x".join(str(d) if isinstance(d, int) and d >= 0 else str(d or "?") for d in t.shape)
            raise OnnxoptError(f"{where}: array '{t.name}' has shape {list(got)}; the model's input is "
                               f"[{expected}] (rank {len(t.shape)})")


def _check_same_inputs(source: Model, candidate: Model) -> None:
    """Both models are fed the same inputs by name: a candidate input the source lacks got some other
    value (two models with different input names were reported equal)."""
    names = [t.name for t in source.graph.inputs]
    extra = [t.name for t in candidate.graph.inputs if t.name not in names]
    if extra:
        raise OnnxoptError(f"the candidate has input(s) the source does not have: {', '.join(map(repr, extra))} "
                           f"(the source's inputs: {', '.join(names) or 'none'})")


def bisect_passes(source: Model, passes: list[str], *, runtime: str, tolerance: Tolerance, feeds,
                  prefer_nhwc: bool = False, precision: str | None = None, source_path: str | Path | None = None) -> BisectResult:
    """Run ``passes`` one at a time from ``source`` (the Verifier after each) and name the first that breaks ``tolerance``."""
    from onnxopt.manager import PassManager

    steps = [registry.get_pass(name)() for name in registry.expand(list(passes))]
    make = model_runner(runtime, prefer_nhwc=prefer_nhwc, precision=precision, shapes=_shapes(feeds))
    model = source.copy()
    verifier = Verifier(source, tolerance=tolerance, feeds=feeds, candidate_runner=make)
    try:
        report = PassManager(steps, verifier=verifier).run(model)
    finally:
        verifier.close()
    result = BisectResult(list(passes), report.first_broken_pass, report, runtime=runtime)
    if report.first_broken_pass:
        # The manager stops at the broken pass: ``model`` is the model right after it. Its full
        # metrics, at the tolerance the manager applied at that point (fp16 loosens it).
        applied = _applied_tolerance(report, tolerance)
        with tempfile.TemporaryDirectory(prefix="onnxopt-bisect-") as tmp:
            runner = make(model, "broken", Path(tmp))
            src = source_runner(source_path, source) if source_path else runner_for(source, "reference", Path(tmp))
            result.metrics = _metrics_from(_run([runner, src], feeds, runtime), applied)
    return result


def _shapes(feeds) -> dict[str, tuple[int, ...]]:
    return {name: tuple(value.shape) for name, value in feeds[0].items()}


def _applied_tolerance(report: OptimizationReport, tolerance: Tolerance) -> Tolerance:
    atol, rtol = tolerance.atol, tolerance.rtol
    for step in report.passes:
        loosened = registry.get_pass(step.name).verify_tolerance
        if loosened is not None:
            atol, rtol = max(atol, loosened[0]), max(rtol, loosened[1])
    return Tolerance(atol, rtol)


def _run(runners: list[BaseRunner], feeds, runtime: str) -> RunResults:
    try:
        with _quiet():
            return Comparator.run(runners, data_loader=feeds)
    except OnnxoptError:
        raise
    except (PolygraphyException, Exception) as exc:  # ORT/TensorRT errors: long, multi-line
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        hint = " (try --runtime reference)" if runtime == "cpu" else ""
        raise OnnxoptError(f"running on {RUNTIME_NAMES.get(runtime, runtime)} failed: {first[:300]}{hint}") from exc

