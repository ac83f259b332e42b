"""Element-wise com.microsoft ops: GELU variants and bias/residual adds."""

from __future__ import annotations

import numpy as np

from ._common import ContribOp, compute_dtype, gelu_erf, gelu_tanh, sigmoid


class BiasSplitGelu(ContribOp):
    """Y = left * Gelu(right), where [left | right] = X + bias split in halves along the last axis.

    Inputs: X (N, S, D), bias (D). Output: Y (N, S, D/2). The *right* half is gated, with the
    exact (erf) GELU, as in the CUDA kernel. No attributes.
    """

    def _run(self, X, bias):
        d = X.shape[-1]
        if d % 2 or bias.shape != (d,):
            raise self._invalid(f"expects X (..., D) with even D and bias (D,), got {X.shape} and {bias.shape}")
        # The CUDA kernel adds the bias in the tensor type and only then widens to float.
        x = (X + bias).astype(compute_dtype(X))
        left, right = x[..., : d // 2], x[..., d // 2 :]
        return ((left * gelu_erf(right)).astype(X.dtype),)


class BiasAdd(ContribOp):
    """Y = X + bias + skip.

    Inputs: X (N, S, C), bias (C), skip (N, S, C). Output: Y (N, S, C). No attributes.
    Computed in the tensor type, as the CUDA kernel does.
    """

    def _run(self, X, bias, skip):
        if X.ndim != 3 or bias.shape != (X.shape[-1],) or skip.shape != X.shape:
            raise self._invalid(
                f"expects X (N, S, C), bias (C,), skip (N, S, C), got {X.shape}, {bias.shape}, {skip.shape}"
            )
        return ((X + bias + skip).astype(X.dtype),)


class FastGelu(ContribOp):
    """Y = 0.5 * x * (1 + tanh(0.7978845608 * (x + 0.044715 * x^3))), x = X (+ bias).

    Inputs: X, optional bias (broadcast over the trailing axis). No attributes.
    """

    def _run(self, X, bias=None):
        x = X.astype(compute_dtype(X))
        if bias is not None:
            x = x + bias.astype(x.dtype)
        return (gelu_tanh(x).astype(X.dtype),)


class BiasGelu(ContribOp):
    """C = Gelu(A + B) with the exact (erf) GELU.

    Inputs: A, B (1-D bias over A's last axis). No attributes.
    """

    def _run(self, A, B):
        x = A.astype(compute_dtype(A)) + B.astype(compute_dtype(A))
        return (gelu_erf(x).astype(A.dtype),)


class Gelu(ContribOp):
    """Y = X * 0.5 * (1 + erf(X / sqrt(2))) -- com.microsoft Gelu, always the erf form. No attributes."""

    def _run(self, X):
        return (gelu_erf(X.astype(compute_dtype(X))).astype(X.dtype),)


class QuickGelu(ContribOp):
    """Y = X * sigmoid(alpha * X).

    Input: X. Attribute: alpha (float, default 1.702).
    """

    def _run(self, X, alpha=1.702):
        x = X.astype(compute_dtype(X))
        return ((x * sigmoid(x.dtype.type(alpha) * x)).astype(X.dtype),)
