"""NhwcConv: channels-last convolution, evaluated with the reference implementation of ONNX Conv."""

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
        # Channels-last -> channels-first for X and W, and back for Y.
        x = np.moveaxis(X.astype(ct), -1, 1)
        w = np.moveaxis(W.astype(ct), -1, 1)
        b = None if B is None else B.astype(ct)
        (y,) = self._conv.run(x, w, b)
        return (np.moveaxis(y, 1, -1).astype(X.dtype),)
