"""com.microsoft GemmFloat8: a GEMM of float8 (or 16/32-bit float) matrices with per-tensor scales."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ._common import ContribOp

# Output types the CUDA kernel writes (TR); float8 outputs are not implemented here.
_OUTPUT_TYPES = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: None}


class GemmFloat8(ContribOp):
    """Y = alpha * op(A) @ op(B) * scaleA * scaleB + beta * C, computed in float32, stored as ``dtype``.

    Inputs: A (M, K) or (K, M) with transA, B (K, N) or (N, K) with transB -- 2-D, row-major, float8
    (e4m3fn/e5m2) or float16/bfloat16/float32; optional C (M, N) of type ``dtype``; optional scaleA,
    scaleB, scaleY: one float32 each (per tensor: ORT's CUDA kernel hands cuBLASLt one scale pointer
    per matrix, so per-channel scales are not expressible). Attributes: transA, transB (0), alpha (1),
    beta (0), dtype (FLOAT), activation ("NONE"). ORT's CUDA kernel (cuBLASLt) accumulates in
    float32; with float8 inputs in "fast accumulation" mode, whose rounding this kernel does not model
    (it stays well inside the error of the float8 inputs themselves).

    Supported: dtype float32 or float16, activation "NONE", scaleY absent or 1 (cuBLASLt applies a D
    scale only to float8 outputs).
    """

    def _run(self, A, B, C=None, scaleA=None, scaleB=None, scaleY=None,
             transA=0, transB=0, alpha=1.0, beta=0.0, dtype=TensorProto.FLOAT, activation="NONE"):
        if A.ndim != 2 or B.ndim != 2:
            raise self._invalid(f"A and B must be 2-D, got {A.shape} and {B.shape}")
        out_type = _OUTPUT_TYPES.get(dtype)
        if out_type is None:
            raise self._reject(f"dtype {helper.tensor_dtype_to_string(dtype)}")
        if activation not in ("NONE", b"NONE"):
            raise self._reject(f"activation {activation!r}")
        if scaleY is not None and float(np.asarray(scaleY, np.float32).reshape(-1)[0]) != 1.0:
            raise self._reject("scaleY other than 1 (a non-float8 output)")
        a = _widen(A).T if transA else _widen(A)
        b = _widen(B).T if transB else _widen(B)
        if a.shape[1] != b.shape[0]:
            raise self._invalid(f"op(A) {a.shape} and op(B) {b.shape} do not multiply")
        scale = np.float32(alpha)
        for s in (scaleA, scaleB):
            if s is not None:
                values = np.asarray(s, np.float32).reshape(-1)
                if values.size != 1:
                    raise self._invalid(f"scales are per tensor (one value), got shape {np.shape(s)}")
                scale = scale * values[0]
        y = (a @ b) * scale
        if C is not None and beta != 0:
            if C.shape != y.shape:
                raise self._invalid(f"C must be (M, N) = {y.shape}, got {C.shape}")
            y = y + np.float32(beta) * C.astype(np.float32)
        return (y.astype(out_type),)


def _widen(x: np.ndarray) -> np.ndarray:
    """float32 values of a float8 / float16 / float32 matrix (float8 as ml_dtypes arrays)."""
    return x.astype(np.float32)
