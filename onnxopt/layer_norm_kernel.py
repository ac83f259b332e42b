"""What ONNX Runtime's SkipLayerNormalization kernel takes, and how a fusion writes it.

Shared by fuse-skip-layer-norm (a residual Add + LayerNorm) and fuse-bias-layer-norm (a LayerNorm
viewed as (-1, 1, D) rows with a zero skip):

    y, _, _, s = SkipLayerNormalization(input, skip, gamma, beta[, bias], epsilon=eps)   (com.microsoft)

    y = LayerNorm(input + skip + bias) over the last axis D, computed in float32; s = input + skip + bias.

The kernel takes float32, float16 or bfloat16 (ONNX Runtime 1.31's CUDA EP registers all three for
SkipLayerNormalization and SkipSimplifiedLayerNormalization: contrib_ops/cuda/bert/skip_layer_norm.cc;
its CPU EP float32 and float16), gamma and beta 1-D of D, input 2-D or 3-D; see
:func:`layer_norm_kernel_refusal` for when it computes what a ``LayerNormalization`` node computes.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.domains import MS_DOMAIN
from onnxopt.fusion import Emit
from onnxopt.pattern import constant_value
from onnxopt.pattern.tensor_facts import normalize_axis, rank_of, shape_of, static_dim
from onnxopt.weights import BFLOAT16, numpy_dtype

SKIP_LAYER_NORM_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)
LAYER_NORM_DEFAULT_EPSILON = 1e-5  # ONNX LayerNormalization's default


def layer_norm_kernel_refusal(ln: gs.Node, normalized: gs.Tensor, gamma: gs.Tensor, beta: gs.Tensor | None,
                              graph_outputs: set[int]) -> int | str:
    """D, the normalized size, when SkipLayerNormalization can compute what ``ln`` computes on
    ``normalized``; else why not."""
    if any(t.outputs or id(t) in graph_outputs for t in ln.outputs[1:] if t.name):
        return "the LayerNorm's mean / inv-std outputs are used"
    rank = rank_of(normalized)
    axis = int(ln.attrs.get("axis", -1))
    if axis != -1 and (rank is None or normalize_axis(axis, rank) != rank - 1):
        return f"normalizes from axis {axis}; SkipLayerNormalization normalizes the last axis only"
    if int(ln.attrs.get("stash_type", 1)) != 1:
        return f"stash_type {ln.attrs['stash_type']}; SkipLayerNormalization computes in float32"
    d = static_dim(gamma, 0) if rank_of(gamma) == 1 else None
    if d is None:
        return f"gamma has shape {shape_of(gamma)}; SkipLayerNormalization takes a 1-D gamma of static size"
    if beta is not None and shape_of(beta) != [d]:
        return f"beta has shape {shape_of(beta)}; SkipLayerNormalization takes ({d},)"
    if static_dim(normalized, -1) not in (None, d):
        return f"gamma of {d} broadcasts over a last dim of {static_dim(normalized, -1)}"
    dtype = normalized.dtype
    if dtype is not None and numpy_dtype(dtype) not in SKIP_LAYER_NORM_DTYPES:
        return f"dtype {numpy_dtype(dtype)}; the kernels take float32, float16 and bfloat16"
    return d


def write_skip_layer_norm(make: Emit, ln: gs.Node, input_, skip, gamma, beta, bias, y: gs.Variable,
                          input_skip_bias_sum: gs.Variable | None = None) -> None:
    """SkipLayerNormalization(input, skip, gamma, beta, bias) with ``ln``'s epsilon, computing y
    (output 0) and, when given, the sum input + skip + bias (output 3). ``ln`` a
    SimplifiedLayerNormalization (RMSNorm, no beta): SkipSimplifiedLayerNormalization(input, skip,
    gamma, bias), the same kernel without the mean."""
    simplified = ln.op == "SimplifiedLayerNormalization"
    inputs = [input_, skip, gamma] if simplified else [input_, skip, gamma, beta if beta is not None else make.absent()]
    if bias is not None:
        inputs.append(bias)
    outputs = [y]
    if input_skip_bias_sum is not None:
        outputs += [make.absent(), make.absent(), input_skip_bias_sum]
    epsilon = float(ln.attrs.get("epsilon", LAYER_NORM_DEFAULT_EPSILON))
    op = "SkipSimplifiedLayerNormalization" if simplified else "SkipLayerNormalization"
    make.node(op, inputs, None, None, outputs=outputs, domain=MS_DOMAIN, epsilon=epsilon)


def per_channel(make: Emit, tensor: gs.Tensor, d: int) -> gs.Tensor:
    """``tensor`` as shape (d,): constants of shape (1, .., d) get a reshaped copy."""
    if list(shape_of(tensor)) == [d]:
        return tensor
    return make.constant(f"{tensor.name.rsplit('/', 1)[-1]}_flat", constant_value(tensor).reshape(d))
