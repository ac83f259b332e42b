"""NhwcConv: channels-last convolution, as a sum of one matrix product per kernel tap.

ONNX's reference Conv unfolds the input (im2col) in float64-sized temporaries: calibrating SDXL's
VAE decoder at a 256x256 image held 3.7 GB for 0.2 GB of weights. A 2-D conv is also
``Y = sum over taps (kh, kw) of X[strided window at (kh, kw)] @ W[:, kh, kw, :].T``, whose
temporaries are one input window and the output. Other ranks and auto_pad SAME_* go to the
reference Conv.
"""

from __future__ import annotations

import numpy as np
from onnx import helper
from onnx.reference.ops import load_op

from ._common import ContribOp, compute_dtype


class NhwcConv(ContribOp):
    """Y = Conv(X, W, B) in channels-last layout.

    Inputs: X (N, H, W, C); W (M, kH, kW, C/group), i.e. the ONNX filter with its input-channel
    axis moved last (the layout ORT's transformer fusion writes, transpose (0, 2, 3, 1)); optional
    B (M). Output: Y (N, outH, outW, M). Attributes: auto_pad, dilations, group, kernel_shape,
    pads, strides with the meaning they have for ONNX Conv.

    (The generated ContribOperators.md text for W/X was copied from Conv and still says NCHW;
    the CUDA kernel is Conv<T, NHWC=true>, which reads both X and W channels-last.)
    """

    def __init__(self, onnx_node, run_params):
        super().__init__(onnx_node, run_params)
        # An ONNX Conv node with the same attributes, so that every attribute keeps exactly the
        # standard semantics (and validation) of the reference Conv.
        conv_node = helper.make_node("Conv", ["X", "W", "B"], ["Y"])
        conv_node.attribute.extend(onnx_node.attribute)
        self._conv = load_op("", "Conv")(conv_node, run_params)

    def _run(self, X, W, B=None, **_attributes):
        # auto_pad, dilations, group, kernel_shape, pads, strides: applied by self._conv, whose node
        # carries this node's attributes.
        if X.ndim < 3 or W.ndim != X.ndim:
            raise self._invalid(f"X and W must be channels-last tensors of the same rank, got {X.shape} and {W.shape}")
        ct = compute_dtype(X)
        attrs = {a.name: helper.get_attribute_value(a) for a in self.onnx_node.attribute}
        auto_pad = attrs.get("auto_pad", b"NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        if X.ndim == 4 and auto_pad in ("NOTSET", "VALID"):
            y = _conv2d_taps(X.astype(ct, copy=False), W.astype(ct, copy=False), None if B is None else B.astype(ct),
                             strides=attrs.get("strides", [1, 1]), dilations=attrs.get("dilations", [1, 1]),
                             pads=attrs.get("pads", [0, 0, 0, 0]) if auto_pad == "NOTSET" else [0, 0, 0, 0],
                             group=int(attrs.get("group", 1)))
            return (y.astype(X.dtype, copy=False),)
        # Channels-last -> channels-first for X and W, and back for Y.
        x = np.moveaxis(X.astype(ct), -1, 1)
        w = np.moveaxis(W.astype(ct), -1, 1)
        b = None if B is None else B.astype(ct)
        (y,) = self._conv.run(x, w, b)
        return (np.moveaxis(y, 1, -1).astype(X.dtype),)


def _conv2d_taps(x, w, b, *, strides, dilations, pads, group):
    """Channels-last 2-D conv: x (N, H, W, C), w (M, kH, kW, C/group) -> (N, oH, oW, M)."""
    n, h, wd, c = x.shape
    m, kh, kw, cg = w.shape
    if c != cg * group or m % group:
        raise ValueError(f"NhwcConv: X has {c} channels, W expects {cg} per group x {group} groups for {m} outputs")
    (sh, sw), (dh, dw) = strides, dilations
    top, left, bottom, right = pads
    oh = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + left + right - dw * (kw - 1) - 1) // sw + 1
    if top or left or bottom or right:
        x = np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))
    mg = m // group
    taps = np.ascontiguousarray(w.reshape(group, mg, kh, kw, cg).transpose(2, 3, 0, 4, 1))  # (kH, kW, group, C/g, M/g)
    y = np.zeros((group, n * oh * ow, mg), x.dtype)
    for i in range(kh):
        for j in range(kw):
            # Contiguous rows, so that the products go to BLAS (a strided operand takes NumPy's slow loop).
            window = np.ascontiguousarray(
                x[:, i * dh : i * dh + sh * (oh - 1) + 1 : sh, j * dw : j * dw + sw * (ow - 1) + 1 : sw, :]
            ).reshape(n * oh * ow, group, cg)
            for g in range(group):
                y[g] += window[:, g, :] @ taps[i, j, g]
    y = y.transpose(1, 0, 2).reshape(n, oh, ow, m)
    if b is not None:
        y += b
    return y
