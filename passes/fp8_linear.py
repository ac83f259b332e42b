"""fp8-linear: fp16 Linear layers as float8 GEMMs on Hopper (com.microsoft GemmFloat8). Opt-in: it costs accuracy.

    y = x @ W                          MatMul; x (..., K) float16, W (K, N) a float16 constant
                         ==>
    x2 = Reshape(x, [-1, K])                          (x already 2-D: no Reshape)
    xq = QuantizeLinear(x2, s_x, 0)                   float8e4m3fn, saturating; s_x = amax(x) / 448
    y2 = GemmFloat8(xq, Wq, scaleA=s_x, scaleB=s_w, transB=1, dtype=FLOAT16)     (com.microsoft)
    y  = Reshape(y2, [..., N])                        x's leading dims

    Wq (N, K) = float8e4m3fn(Wᵀ / s_w), s_w = amax(W) / 448, quantized offline (computed when saved)

What reads y is left as it was: the bias Add, or the BiasAdd / SkipLayerNorm / BiasSplitGelu /
MultiHeadAttention the ``ort-cuda`` fusions wrote around the MatMul (a packed QKV weight is one
site). GemmFloat8's C input is not a bias: cuBLASLt reads it as a full (M, N) matrix. Gemm nodes
are left alone: in these graphs they are the time embedding's Linears, M = the batch, far too small.
ORT 1.32's MatMulBlockQuantizedFp8Weight is no alternative for speed: its CUDA kernel dequantizes the
weight to fp16 and runs an fp16 GEMM.

Scales are per tensor. ORT's CUDA kernel hands cuBLASLt one scale pointer per matrix
(``CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER``), and cuBLASLt's Hopper FP8 path scales whole tensors
(its per-row "outer vector" scale modes are newer than the kernel and not set by it), so
per-channel weight scales cannot be expressed; W's amax decides its one scale.

Layout: cuBLASLt's FP8 GEMM takes only the "TN" form. ORT's kernel computes a float8 product in
column-major order as Yᵀ = op(B)ᵀ op(A)ᵀ, so the TN form is ``transA=0, transB=1`` with B in
torch's (N, K) Linear layout: A (M, K) row-major and B (N, K) row-major, Y (M, N) row-major.

Activation scales come from one calibration run of the model as it is when the pass runs (fused and
fp16: the scales are those of the tensors the GEMMs will read), with onnxopt.precision.calibrate:
on ORT's CUDA EP when there is one, else ORT's CPU EP or onnxopt's reference kernels (tiny models).
Only the sites' inputs are read out, ``outputs_per_run`` of them per run, so memory stays bounded on
SDXL (each group of outputs is one more run; a model over 2 GB is written once per group for ORT).
A fused full-size UNet calibrates on the CUDA EP only (ORT's CPU EP has no GroupNorm or BiasSplitGelu
kernel, and NumPy is too slow for it): run the pass on the GPU host. Inputs: ``calibration`` (an .npz of graph inputs or a list of feed dicts; default random
inputs of ``calibration_inputs``' shapes) -- a pipeline should give real ones (latents, prompts).

Conditions (each refusal says which): x float16; W a constant 2-D float16 (K, N); K and N known and
multiples of 16 (cuBLASLt's FP8 alignment); M, the product of x's leading dims, static, and
M*K*N >= ``min_macs`` (below it the Quantize launch and FP8 setup cost more than the GEMM saves;
``min_macs=0`` takes every size, M unknown included); calibration saw finite values, not all zero;
the model at opset 19 or later (QuantizeLinear to float8), or movable to opset 21
(onnxopt's opset move, as trt-group-norm does it; QuantizeLinear-21 keeps fp16 x and scale).

The error FP8 implies: e4m3 keeps 3 mantissa bits, so each element of x and W is rounded by up to
2^-4 relative (about 2.5% RMS for Gaussian values); a GEMM's output then has a relative L2 error of
about 3-4% against the fp16 product (tests/test_fp8_linear.py states the bounds it checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule, Site
from onnxopt.opset_upgrade import opset_upgrade_refusal, upgrade_to_opset_21
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, OrtFusion
from onnxopt.pattern import Match, constant_shape, constant_value, is_constant
from onnxopt.pattern.tensor_facts import shape_of, static_dims
from onnxopt.registry import register_pass
from onnxopt.row_view import LINEAR, LinearRows, from_rows, rows_of, to_rows
from onnxopt.weights import DerivedValues, numpy_dtype

try:  # float8 arrays: ml_dtypes (onnx >= 1.18 depends on it)
    from ml_dtypes import float8_e4m3fn as FLOAT8E4M3FN
except ImportError:  # pragma: no cover
    FLOAT8E4M3FN = None

FP8_MAX = 448.0  # largest finite float8e4m3fn
FP8_ALIGNMENT = 16  # cuBLASLt FP8: K and N multiples of 16
MIN_OPSET = 19  # QuantizeLinear with float8 outputs
DEFAULT_MIN_MACS = 1 << 27  # 134M multiply-adds, e.g. 4096 tokens x 320 x 102
FLOAT16 = np.dtype(np.float16)


@dataclass
class Fp8Site(LinearRows):
    x_scale: float = 0.0


def check(match: Match, run: FusionRun) -> Fp8Site:
    x, w = match["x"], match["w"]
    if x.dtype is None or numpy_dtype(x.dtype) != FLOAT16:
        raise Refusal(f"x is {numpy_dtype(x.dtype) if x.dtype is not None else 'of unknown type'}, not float16 "
                      "(run fp8-linear after fp16)")
    if not is_constant(w):
        raise Refusal("the weight is not a constant (FP8 weights are quantized offline)")
    w_shape = constant_shape(w)
    if len(w_shape) != 2:
        raise Refusal(f"the weight has shape {list(w_shape)}, not (K, N)")
    if w.dtype is None or numpy_dtype(w.dtype) != FLOAT16:
        raise Refusal(f"the weight is {w.dtype}, not float16")
    k, n = (int(d) for d in w_shape)
    dims = static_dims(x)
    if dims is None or len(dims) < 2:
        raise Refusal(f"x has {'an unknown rank' if dims is None else f'rank {len(dims)}'}; GemmFloat8 takes (M, K) rows")
    if dims[-1] != k:
        raise Refusal(f"x's last dim is {shape_of(x)[-1]!r}, not the weight's K={k}")
    bad = [f"{name}={v}" for name, v in (("K", k), ("N", n)) if v % FP8_ALIGNMENT]
    if bad:
        raise Refusal(f"{' and '.join(bad)} {'is not a multiple' if len(bad) == 1 else 'are not multiples'} of "
                      f"{FP8_ALIGNMENT} (cuBLASLt FP8 alignment)")
    min_macs = run.fusion.min_macs
    if min_macs:
        if any(d is None for d in dims[:-1]):
            raise Refusal(f"M (x's dims {shape_of(x)[:-1]}) is not static: whether FP8 pays cannot be judged "
                          "(min_macs=0 takes every size)")
        macs = int(np.prod(dims[:-1], dtype=np.int64)) * k * n
        if macs < min_macs:
            raise Refusal(f"M*K*N = {macs} is below min_macs={min_macs}: too small for FP8 to pay")
    if FLOAT8E4M3FN is None:
        raise Refusal("ml_dtypes is not installed (float8 weights)")
    return Fp8Site(x, w, k, n, list(shape_of(x)[:-1]), match.output)


def emit(make: Emit, site: Fp8Site) -> list[gs.Tensor]:
    x, k, n = site.x, site.k, site.n
    rows = rows_of(site.leading)
    x2 = x if len(site.leading) == 1 else to_rows(make, x, k, site.leading)
    x_scale = np.float16(site.x_scale)
    xq = make.op.QuantizeLinear(x2, make.constant("x_scale", np.array(x_scale, np.float16)),
                                make.constant("zero_fp8", np.zeros((), FLOAT8E4M3FN)), _dtype=FLOAT8E4M3FN, _label="quantize_x")
    w_scale, wq = _quantized_weight(site.w, n, k)
    y2 = make.ms.GemmFloat8(
        xq, make.constant("weight_fp8", wq), None,
        make.constant("scale_x", np.array([x_scale], np.float32)),  # the fp16 value QuantizeLinear divided by
        make.constant("scale_w", np.array([w_scale], np.float32)),
        transA=0, transB=1, _dtype=FLOAT16, _shape=[rows, n], _label="gemm_fp8")
    make.nodes[-1].attrs["dtype"] = onnx.TensorProto.FLOAT16  # the builder's own ``dtype`` parameter shadows the attribute
    if len(site.leading) == 1:
        return [y2]
    return [from_rows(make, y2, x, site.leading, n, shape=site.output.shape, dtype=FLOAT16)]


def _quantized_weight(w: gs.Tensor, n: int, k: int) -> tuple[float, DerivedValues]:
    """(s_w, Wq): s_w = amax(W) / 448 read now (one pass over W, not kept); Wq = float8(Wᵀ / s_w), (N, K),
    computed when the model is saved or read."""
    amax = float(np.abs(constant_value(w).astype(np.float32)).max())
    scale = float(np.float32(amax / FP8_MAX)) if amax > 0 else 1.0

    def quantized() -> np.ndarray:
        values = constant_value(w).astype(np.float32).T / np.float32(scale)
        return np.clip(values, -FP8_MAX, FP8_MAX).astype(FLOAT8E4M3FN)  # out of range would be NaN in e4m3fn

    return scale, DerivedValues((n, k), FLOAT8E4M3FN, quantized, name=f"{w.name}__fp8")


@register_pass
class Fp8Linear(Fusion, OrtFusion):
    name = "fp8-linear"
    description = ("opt-in: fp16 Linears (MatMul by a constant) as float8 GEMMs, com.microsoft GemmFloat8 "
                   "(Hopper; calibrated activation scales; costs accuracy)")
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})
    rules = (Rule(LINEAR, check, emit),)
    defer_rewrites = True  # one calibration run and one opset move for every site
    # --verify from here on: float8 rounds each operand by up to 2^-4 relative (tiny SD 1.5 UNet:
    # max abs 0.03 against fp16 on outputs up to 1.3)
    verify_tolerance = (1e-1, 1e-1)

    def __init__(self, calibration=None, calibration_inputs=None, min_macs: int = DEFAULT_MIN_MACS,
                 outputs_per_run: int = 256):
        """calibration: None (random inputs; ``calibration_inputs`` an onnxopt.verify.InputSpec for
        their shapes), an .npz path of graph inputs, or a list of feed dicts. min_macs: the smallest
        M*K*N rewritten (0: all, M unknown included). outputs_per_run: site inputs read per
        calibration run (memory)."""
        self.calibration = calibration
        self.calibration_inputs = calibration_inputs
        self.min_macs = int(min_macs)
        self.outputs_per_run = int(outputs_per_run)

    def before_rewrites(self, run: FusionRun, sites: list[Site]) -> list[Site]:
        if not sites:
            return sites
        refusal = _opset_refusal(run)
        if refusal is None:
            ranges = self._calibrate(run, sites)
            kept = []
            for site in sites:
                seen = ranges.get(site.facts.x.name)
                if seen is None or seen.nonfinite or not seen.absmax > 0:
                    why = ("calibration did not read x" if seen is None else
                           "calibration saw inf/NaN in x" if seen.nonfinite else "calibration saw only zeros in x")
                    _refuse(run, site, why)
                    continue
                site.facts.x_scale = seen.absmax / FP8_MAX
                kept.append(site)
            if kept:
                _move_opset(run)
            return kept
        for site in sites:
            _refuse(run, site, refusal)
        return []

    def _calibrate(self, run: FusionRun, sites: list[Site]) -> dict:
        from onnxopt.precision import calibrate, calibration_feeds

        feeds = calibration_feeds(run.model, self.calibration, inputs=self.calibration_inputs)
        names = {site.facts.x.name for site in sites}
        calibration = calibrate(run.model, feeds, outputs_per_run=self.outputs_per_run, only=names)
        run.result.details["calibration"] = {"runner": calibration.runner, "runs": calibration.runs,
                                             "feeds": len(feeds), "tensors": len(names)}
        return calibration.ranges

    def finish(self, run: FusionRun) -> None:
        if run.result.sites_rewritten:
            run.result.details["opset"] = run.model.graph.opset


def _refuse(run: FusionRun, site: Site, reason: str) -> None:
    run.result.refuse(site.name, reason)
    if run.tracer is not None:
        run.tracer.refuse(site.rule.pattern.name, site.match.root, reason, site.name)


def _opset_refusal(run: FusionRun) -> str | None:
    if run.model.opset >= MIN_OPSET:
        return None
    return opset_upgrade_refusal(run.graph, run.model.opset)


def _move_opset(run: FusionRun) -> None:
    """Opset 19+ for QuantizeLinear to float8 (the model moves to 21 when older); IR 9+ for float8 types."""
    graph = run.graph
    if run.model.opset < MIN_OPSET:
        upgrade_to_opset_21(graph, run.model.opset, run.names)
        run.result.details["opset_moved_to"] = graph.opset
    if graph.ir_version is not None and graph.ir_version < 9:
        graph.ir_version = 9


__all__ = ["DEFAULT_MIN_MACS", "FP8_MAX", "Fp8Linear", "LINEAR"]
