"""Normalisation ops of ONNX Runtime: GroupNorm, SkipGroupNorm, SkipLayerNormalization,
SkipSimplifiedLayerNormalization (com.microsoft) and SimplifiedLayerNormalization (ONNX domain)."""

from __future__ import annotations

import numpy as np

from ._common import ContribOp, compute_dtype, sigmoid

def _group_norm_nhwc(x, gamma, beta, groups: int, epsilon: float, silu: bool) -> np.ndarray:
    """GroupNorm of a channels-last tensor x (N, ..., C), statistics in x's (float) precision."""
    n, c = x.shape[0], x.shape[-1]
    grouped = x.reshape(n, -1, groups, c // groups)
    mean = grouped.mean(axis=(1, 3), keepdims=True)
    var = grouped.var(axis=(1, 3), keepdims=True)
    y = ((grouped - mean) / np.sqrt(var + x.dtype.type(epsilon))).reshape(x.shape)
    y = y * gamma.astype(x.dtype) + beta.astype(x.dtype)
    return y * sigmoid(y) if silu else y


class _GroupNormBase(ContribOp):
    def _validate(self, X, gamma, beta, groups, activation, epsilon, channels_last) -> None:
        """Checks what GroupNorm and SkipGroupNorm share: attributes, X rank, gamma/beta shapes."""
        self._require(groups=groups, activation=activation)
        if activation not in (0, 1):
            raise self._invalid(f"activation must be 0 (none) or 1 (SiLU), got {activation}")
        if epsilon < 0:
            raise self._invalid(f"epsilon must be >= 0, got {epsilon}")
        if X.ndim != 4:
            raise self._invalid(f"X must be 4-D, got shape {X.shape}")
        c = X.shape[-1] if channels_last else X.shape[1]
        if groups <= 0 or c % groups:
            raise self._invalid(f"groups={groups} must divide the channel count {c}")
        if gamma.shape != (c,) or beta.shape != (c,):
            raise self._invalid(f"gamma and beta must have shape ({c},), got {gamma.shape} and {beta.shape}")


class GroupNorm(_GroupNormBase):
    """Y = act(gamma * (X - mean) / sqrt(var + epsilon) + beta), statistics per (sample, group).

    Inputs: X (N, H, W, C) when channels_last=1 (the default!) else (N, C, H, W); gamma (C) and
    beta (C), fp32 or fp16. Attributes: groups (required, divides C), activation (required:
    0 none, 1 SiLU, i.e. y * sigmoid(y)), epsilon (default 1e-5), channels_last (default 1).
    Computed in float32 even for fp16 X, as the CUDA kernel does; Y has X's type.
    """

    def _run(self, X, gamma, beta, groups=None, activation=None, epsilon=1e-5, channels_last=1):
        self._validate(X, gamma, beta, groups, activation, epsilon, channels_last)
        x = X.astype(compute_dtype(X))
        if not channels_last:
            x = np.moveaxis(x, 1, -1)
        y = _group_norm_nhwc(x, gamma, beta, groups, epsilon, activation == 1)
        if not channels_last:
            y = np.moveaxis(y, -1, 1)
        return (y.astype(X.dtype),)


class SkipGroupNorm(_GroupNormBase):
    """S = X + skip (+ bias); Y = act(gamma * (S - mean) / sqrt(var + epsilon) + beta).

    Inputs: X (N, H, W, C); gamma (C); beta (C); skip (N, H, W, C), (N, 1, 1, C) or (N, C);
    optional bias (C). Outputs: Y (N, H, W, C); optional S, the sum, same shape as X.
    Attributes: as GroupNorm, but only channels_last=1 is supported: the skip shapes the spec
    lists are NHWC ones, and ORT's kernel rejects NCHW too.
    The sum is formed in X's type (fp16 stays fp16: the CUDA kernel stores the sum and takes
    its statistics from the stored values); the normalisation runs in float32.
    """

    def _run(self, X, gamma, beta, skip, bias=None, groups=None, activation=None, epsilon=1e-5, channels_last=1):
        if not channels_last:
            raise self._reject("channels_last=0 (NCHW)")
        self._validate(X, gamma, beta, groups, activation, epsilon, channels_last)
        n, c = X.shape[0], X.shape[-1]
        if skip.shape == (n, c):
            skip = skip.reshape(n, 1, 1, c)
        if skip.shape not in (X.shape, (n, 1, 1, c)):
            raise self._invalid(f"skip must be (N, H, W, C), (N, 1, 1, C) or (N, C); got {skip.shape} for X {X.shape}")
        if bias is not None and bias.shape != (c,):
            raise self._invalid(f"bias must have shape ({c},), got {bias.shape}")

        s = (X + skip if bias is None else X + skip + bias).astype(X.dtype)
        y = _group_norm_nhwc(s.astype(compute_dtype(X)), gamma, beta, groups, epsilon, activation == 1)
        return (y.astype(X.dtype), s)


def _skip_sum(op: ContribOp, input, skip, bias=None, **per_channel) -> np.ndarray:
    """input + skip (+ bias) in the compute precision, after checking the shapes the skip norms take."""
    d = input.shape[-1]
    if skip.shape not in (input.shape, (1, *input.shape[1:]), input.shape[1:]):
        raise op._invalid(f"skip must be (B, S, D), (1, S, D) or (S, D) for input {input.shape}, got {skip.shape}")
    for name, t in (*per_channel.items(), ("bias", bias)):
        if t is not None and t.shape != (d,):
            raise op._invalid(f"{name} must have shape ({d},), got {t.shape}")
    ct = compute_dtype(input)
    s = input.astype(ct) + skip.astype(ct)
    return s + bias.astype(ct) if bias is not None else s


class SkipLayerNormalization(ContribOp):
    """S = input + skip (+ bias); output = (S - mean) / sqrt(var + epsilon) * gamma (+ beta), over the last axis.

    Inputs: input (B, S, D); skip (B, S, D), (1, S, D) or (S, D); gamma (D); optional beta (D);
    optional bias (D). Attribute: epsilon (default 1e-12).
    Outputs: output; optional mean and inv_std_var (float32, shape (B, S, 1)); optional
    input_skip_bias_sum (S in the input type). Computed in float32 for fp16 inputs.
    """

    def _run(self, input, skip, gamma, beta=None, bias=None, epsilon=1e-12):
        s = _skip_sum(self, input, skip, gamma=gamma, beta=beta, bias=bias)
        ct = s.dtype.type
        mean = s.mean(axis=-1, keepdims=True)
        inv_std = 1.0 / np.sqrt(s.var(axis=-1, keepdims=True) + ct(epsilon))
        y = (s - mean) * inv_std * gamma.astype(ct)
        if beta is not None:
            y = y + beta.astype(ct)
        return (
            y.astype(input.dtype),
            mean.astype(np.float32),
            inv_std.astype(np.float32),
            s.astype(input.dtype),
        )


def _rms_normalized(s: np.ndarray, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """s / sqrt(mean(s^2) + epsilon) over the last axis, and the inverse RMS (s already in float32)."""
    inv_rms = 1.0 / np.sqrt((s * s).mean(axis=-1, keepdims=True) + s.dtype.type(epsilon))
    return s * inv_rms, inv_rms


class SimplifiedLayerNormalization(ContribOp):
    """Y = X / sqrt(mean(X^2) + epsilon) * scale over the axes from ``axis`` (RMSNorm).

    ONNX Runtime registers it in the ONNX domain (not com.microsoft). Inputs: X; scale of the
    normalized shape. Attributes: axis (default -1; only the last axis is supported here), epsilon
    (default 1e-5), stash_type (default 1: float32 statistics). Outputs: Y in scale's type;
    optional inv_std_var (float32). Computed in float32 for fp16/bf16 X, as the kernels do.
    """

    op_domain = ""

    def _name(self) -> str:
        return self.onnx_node.op_type

    def _run(self, X, scale, axis=-1, epsilon=1e-5, stash_type=1):
        if axis not in (-1, X.ndim - 1):
            raise self._reject(f"axis={axis} (only the last axis)")
        if stash_type != 1:
            raise self._reject(f"stash_type={stash_type}")
        d = X.shape[-1]
        if scale.size != d:
            raise self._invalid(f"scale must hold {d} values, got shape {scale.shape}")
        ct = compute_dtype(X)
        y, inv_rms = _rms_normalized(X.astype(ct), epsilon)
        y = y * scale.reshape(d).astype(ct)
        return (y.astype(scale.dtype), inv_rms.astype(np.float32))


class SkipSimplifiedLayerNormalization(ContribOp):
    """S = input + skip (+ bias); output = S / sqrt(mean(S^2) + epsilon) * gamma, over the last axis.

    Inputs: input (B, S, D) or (S, D); skip (B, S, D), (1, S, D) or (S, D); gamma (D); optional
    bias (D). Attribute: epsilon (default 1e-12). Outputs: output; optional mean, inv_std_var (float32) and input_skip_bias_sum (S in the input type). The sum
    is formed in float32 and rounded to the input type for output 3, as the CUDA kernel does.
    """

    def _run(self, input, skip, gamma, bias=None, epsilon=1e-12):
        s = _skip_sum(self, input, skip, gamma=gamma, bias=bias)
        ct = s.dtype.type
        y, inv_rms = _rms_normalized(s, epsilon)
        y = y * gamma.astype(ct)
        mean = s.mean(axis=-1, keepdims=True)  # the spec's output 1; nothing reads it after fuse-skip-layer-norm
        return (y.astype(input.dtype), mean.astype(np.float32), inv_rms.astype(np.float32), s.astype(input.dtype))
