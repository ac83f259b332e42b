"""fuse-layer-norm, fuse-skip-layer-norm and fuse-bias-layer-norm: LayerNorm as one op, then as
ONNX Runtime's SkipLayerNormalization, with its residual Add or with the bias Add in front of it.

fuse-layer-norm (older exports; opset >= 17 has the op and both exporters use it):

    m = ReduceMean(x, axes=[-1])
    d = x - m
    v = ReduceMean(d ** 2 | d * d, axes=[-1])
    n = d / Sqrt(v + eps)  |  d * Reciprocal(Sqrt(v + eps))
    y = n * gamma + beta
                         ==>   y = LayerNormalization(x, gamma, beta, axis=-1, epsilon=eps)

    Conditions: both means over the last axis only, keepdims=1; eps a one-element constant;
    gamma and beta hold D = x's (static) last dim values, broadcast along the last axis only; the
    model's opset is >= 17.

fuse-skip-layer-norm (ort-cuda):

    s = Add(a, b)                                    s = Add(Add(x, bias), r)
    y = LayerNormalization(s, gamma, beta)     or    y = LayerNormalization(s, gamma, beta)
                         ==>
    y, _, _, s = SkipLayerNormalization(input, skip, gamma, beta[, bias], epsilon=eps)   (com.microsoft)

    Output 3 (input + skip + bias) takes over s, so the residual stream that reads s is unchanged;
    it is left off when only the LayerNorm read s. The bias form folds the Linear's bias Add into
    the kernel (diffusers' ``attn_output / rescale_output_factor`` of 1 between them is gone after
    cleanup's remove-neutral-arithmetic).

    Conditions: the LayerNorm normalizes the last axis (axis -1), computes in float32
    (stash_type 1), and its mean/inv-std outputs are unused; gamma, beta and bias are 1-D of D, the
    static last dim; the operands fit the kernel's shapes: input 2-D or 3-D, skip of input's shape,
    (1, S, D) or (S, D). Of the Add's operands, the one that can be the input (it has the full
    shape) is chosen. A skip that would broadcast anywhere else (a 1-D bias, (B, 1, D) against
    (B, S, D), ...) is refused. Dims that shape inference left symbolic are taken as equal unless
    a static 1 shows broadcasting (details["dims_assumed_equal"] counts those sites); a run-time
    mismatch of S or D makes ORT's kernel fail rather than compute something else. The batch dim
    is the exception: ORT computes an input of batch 1 against a skip of batch 2 without a word,
    at the input's shape ((1, S, D) where the Add gave (2, S, D)). So where the two batch dims are
    not proven equal (the same static value or the same symbol), the broadcast is kept:

        input' = Expand(input, Shape(skip))      the Add's own broadcast shape, (B, S, D)
        y, _, _, s = SkipLayerNormalization(input', skip, ...)

    (details["batch_broadcast_kept"] counts those sites; the Expand is a copy of the input where the
    batches turn out equal, as they do on TorchScript dynamic exports whose batch symbols shape
    inference loses).

fuse-bias-layer-norm (ort-cuda; after fuse-skip-layer-norm and nhwc-conv): the LayerNorms left
without a residual Add, onto ORT's faster SkipLayerNormalization kernel (measurements:
benchmarks/results/layout-choices.md). In a UNet these are the first norm1 of every
Transformer2DModel, reading proj_in: a 1x1 conv (after nhwc-conv a channels-last MatMul + bias Add,
then a Reshape (B, H, W, C) -> (B, H*W, C)) or, with use_linear_projection, a Linear (MatMul + bias
Add on (B, S, C)). The kernel wants skip's last two dims equal to input's and broadcasts a 2-D
skip, so the tensor is viewed as (-1, 1, D) rows and the skip is a constant zero row:

    t4 = Add(u, bias)             [t = Reshape(t4, target)   or   t = t4]
    y  = LayerNormalization(t, gamma, beta, axis=-1, epsilon=eps)
                         ==>
    v = Reshape(u, [-1, 1, D])
    y', _, _, t' = SkipLayerNormalization(v, zeros(1, D), gamma, beta, bias, epsilon=eps)  (com.microsoft)
    y  = Reshape(y', shape of t)
    t  = Reshape(t', shape of t)      t4 = Reshape(t', shape of u)      (only those read elsewhere)

and a LayerNorm with no bias Add in front: y = Reshape(SkipLayerNormalization(Reshape(t, [-1, 1, D]),
zeros(1, D), gamma, beta), shape of t). The shapes back are constants when static, else Shape(u),
Shape(t) or, through the Reshape, Shape(Reshape(u, target)) (a view: ORT's Reshape copies nothing
and Shape runs on the host). Output 3 (u + bias) is written only when t or t4 has another reader
(SD 1.5: the block's residual, which a later SkipLayerNormalization reads).

Why it is the same computation: row-major Reshapes that keep the last dim D keep every group of D
consecutive elements together, so the per-last-element bias and the last-axis normalization are
the same on (-1, 1, D) rows; a zero skip adds nothing.

    Conditions: as fuse-skip-layer-norm's (last axis, stash_type 1, mean / inv-std unused, float32
    or float16), and gamma (and beta) constant 1-D of D, the LayerNorm input's static last dim; the
    bias a constant of shape (D,) or (1, .., 1, D) no longer in rank than u, and u's static last dim
    D (then the Add gives u's shape, and a Reshape between keeps the last dim). Refused: a bias that
    broadcasts along another axis ((D, 1)), and a LayerNorm reading an Add of two computed tensors,
    directly or through a Reshape (a residual sum, fuse-skip-layer-norm's site; a (B, 1, D) tensor
    added is one of those).

    details: bias_folded (sites with a bias Add), through_reshape (with a Reshape between Add and
    LayerNorm), dynamic_shape (reshaped back through Shape rather than a constant shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.domains import MS_DOMAIN
from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, OrtFusion
from onnxopt.pattern import Const, Literal, Match, OneOf, Pattern, Var, constant_shape, constant_value, is_constant, op
from onnxopt.pattern.tensor_facts import (
    dims_agree,
    dims_conflict,
    normalize_axis,
    rank_of,
    shape_of,
    static_dim,
    static_dims,
    static_ints,
)
from onnxopt.registry import register_pass

SKIP_LAYER_NORM_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))  # bfloat16 too, but numpy has none
LAYER_NORM_DEFAULT_EPSILON = 1e-5  # ONNX LayerNormalization's default


# ---------------------------------------------------------------- fuse-layer-norm


def decomposed_layer_norm(x, gamma, beta, eps=Const()):
    d = x - op.ReduceMean(x, _extra_inputs=True, _name="mean", keepdims=1)
    variance = op.ReduceMean(OneOf(d ** Literal(2.0, rtol=0, atol=0), d * d), _extra_inputs=True, _name="variance", keepdims=1)
    std = op.Sqrt(variance + eps)
    return OneOf(d / std, d * op.Reciprocal(std)) * gamma + beta


DECOMPOSED_LAYER_NORM = Pattern(decomposed_layer_norm, name="decomposed-layer-norm")


def check_layer_norm(match: Match, run: FusionRun) -> Match:
    reason = _layer_norm_refusal(match, run.graph.opset)
    if reason is not None:
        raise Refusal(reason)
    return match


def emit_layer_norm(make: Emit, match: Match) -> list[gs.Tensor]:
    d = static_dim(match["x"], -1)
    gamma, beta = _per_channel(make, match["gamma"], d), _per_channel(make, match["beta"], d)
    eps = float(match.value("eps").reshape(-1)[0])
    return [make.op.LayerNormalization(match["x"], gamma, beta, axis=-1, epsilon=eps)]


@register_pass
class FuseLayerNorm(Fusion):
    name = "fuse-layer-norm"
    description = "fuse decomposed LayerNorm (ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add) into LayerNormalization"
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})
    rules = (Rule(DECOMPOSED_LAYER_NORM, check_layer_norm, emit_layer_norm),)


def _layer_norm_refusal(match, opset: int) -> str | None:
    x = match["x"]
    rank = rank_of(x)
    for name in ("mean", "variance"):
        axes = _reduce_axes(match.node(name))
        if axes is None:
            return f"the {name} ReduceMean's axes are not static"
        if axes != [-1] and (rank is None or [normalize_axis(a, rank) for a in axes] != [rank - 1]):
            return f"the {name} is over axes {axes}, not the last axis alone"
    if int(np.prod(constant_shape(match["eps"]))) != 1:
        return "epsilon is not a single value"
    d = static_dim(x, -1)
    if d is None:
        return "the normalized (last) dim is not static"
    for name in ("gamma", "beta"):
        shape = shape_of(match[name])
        per_last_element = bool(shape) and shape[-1] == d and all(s == 1 for s in shape[:-1])
        if not per_last_element or (rank is not None and len(shape) > rank):
            return f"{name} has shape {shape}; LayerNormalization takes ({d},) (one value per last-axis element)"
        if shape != [d] and not is_constant(match[name]):
            return f"{name} has shape {shape} and is computed at run time; LayerNormalization takes ({d},)"
    if opset < 17:
        return f"opset {opset} has no LayerNormalization (it came in opset 17)"
    return None


def _reduce_axes(node: gs.Node) -> list[int] | None:
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    if len(node.inputs) > 1 and node.inputs[1].name:
        return static_ints(node.inputs[1])
    return None  # no axes: all of them (noop_with_empty_axes aside) -- not a LayerNorm


def _per_channel(make: Emit, tensor: gs.Tensor, d: int) -> gs.Tensor:
    """``tensor`` as shape (d,): constants of shape (1, .., d) get a reshaped copy."""
    if list(shape_of(tensor)) == [d]:
        return tensor
    return make.constant(f"{tensor.name.rsplit('/', 1)[-1]}_flat", constant_value(tensor).reshape(d))


# ---------------------------------------------------------------- fuse-skip-layer-norm


def skip_layer_norm(a, b, gamma, beta=Var("beta", optional=True)):
    s = op.Add(a, b, _name="sum")
    return op.LayerNormalization(s, gamma, beta, _name="ln"), s


def bias_skip_layer_norm(x, residual, gamma, beta=Var("beta", optional=True), bias=Const()):
    s = op.Add(op.Add(x, bias, _name="bias_add"), residual, _name="sum")
    return op.LayerNormalization(s, gamma, beta, _name="ln"), s


SKIP_LAYER_NORM = Pattern(bias_skip_layer_norm, skip_layer_norm, name="skip-layer-norm")


@dataclass
class SkipLayerNormSite:
    match: Match
    input: gs.Tensor
    skip: gs.Tensor
    broadcast_batch: bool  # the Add broadcast the input's batch: it is expanded first


def check_skip_layer_norm(match: Match, run: FusionRun) -> SkipLayerNormSite:
    verdict = _skip_layer_norm_plan(match, {id(t) for t in run.graph.outputs})
    if isinstance(verdict, str):
        raise Refusal(verdict)
    input_, skip, proven = verdict
    broadcast = not _batch_proven(input_, skip)
    run.details["dims_assumed_equal"] += not proven
    run.details["bias_folded"] += "bias" in match
    run.details["batch_broadcast_kept"] += broadcast
    return SkipLayerNormSite(match, input_, skip, broadcast)


def emit_skip_layer_norm(make: Emit, site: SkipLayerNormSite) -> list[gs.Tensor]:
    """SkipLayerNormalization(input, skip, γ, β, bias) -> y and, when s has other readers, the sum s.
    When only the LayerNorm read s, s is left without producer or consumer (cleanup drops it)."""
    match, input_, skip = site.match, site.input, site.skip
    ln, s = match.node("ln"), match.outputs[1]
    if site.broadcast_batch:  # Expand(input, Shape(skip)): input at the shape the Add broadcast to
        input_ = make.op.Expand(input_, make.op.Shape(skip, _dtype=np.int64, _shape=[3]), _shape=s.shape)
    sum_is_read = any(c is not ln for c in s.outputs) or any(t is s for t in make.graph.outputs)
    y = make.tensor("y", None, None)
    new_sum = make.tensor("sum", None, None) if sum_is_read else None
    write_skip_layer_norm(make, ln, input_, skip, match["gamma"], match.get("beta"), match.get("bias"), y, new_sum)
    return [y, new_sum if new_sum is not None else s]


@register_pass
class FuseSkipLayerNorm(Fusion, OrtFusion):
    name = "fuse-skip-layer-norm"
    description = "fuse Add (+ bias) + LayerNormalization into com.microsoft SkipLayerNormalization (sum as output 3)"
    rules = (Rule(SKIP_LAYER_NORM, check_skip_layer_norm, emit_skip_layer_norm),)

    def finish(self, run: FusionRun) -> None:
        run.result.details.update(dims_assumed_equal=run.details["dims_assumed_equal"],
                                  bias_folded=run.details["bias_folded"],
                                  batch_broadcast_kept=run.details["batch_broadcast_kept"])


def _skip_layer_norm_plan(match, graph_outputs: set[int]):
    """(input, skip, dims proven equal) for the kernel, or why the site is refused."""
    s = match.outputs[1]
    d = layer_norm_kernel_refusal(match.node("ln"), s, match["gamma"], match.get("beta"), graph_outputs)
    if isinstance(d, str):
        return d
    bias = match.get("bias")
    if bias is not None and shape_of(bias) != [d]:
        return f"bias has shape {shape_of(bias)}; SkipLayerNormalization takes ({d},)"
    if "bias" in match:
        first, second = match["x"], match["residual"]
    else:
        first, second = match["a"], match["b"]
    reasons = []
    for input_, skip in ((first, second), (second, first)):
        reason = skip_shape_refusal(input_, skip, d)
        if reason is None:
            return input_, skip, _dims_proven(input_, skip)
        reasons.append(reason)
    return reasons[0] if reasons[0] == reasons[1] else f"{reasons[0]}; swapped: {reasons[1]}"


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
    if dtype is not None and np.dtype(dtype) not in SKIP_LAYER_NORM_DTYPES:
        return f"dtype {np.dtype(dtype)}; the kernels take float32 and float16"
    return d


def skip_shape_refusal(input_: gs.Tensor, skip: gs.Tensor, d: int) -> str | None:
    """Why SkipLayerNormalization(input, skip) would not compute input + skip (None if it would).

    The kernel takes input (B, S, D) or (S, D) and skip of input's shape, (1, S, D) or (S, D);
    the output has input's shape.
    """
    ri, rs = rank_of(input_), rank_of(skip)
    if ri is None or rs is None:
        return "an operand's rank is unknown"
    if ri not in (2, 3):
        return f"the input would have rank {ri}; SkipLayerNormalization takes 2-D or 3-D"
    if rs not in (2, 3) or rs > ri:
        return f"the skip would have shape {shape_of(skip)}; SkipLayerNormalization takes (B, S, D), (1, S, D) or (S, D)"
    si, ss = shape_of(input_), shape_of(skip)
    if static_dim(input_, -1) != d or static_dim(skip, -1) != d:
        return f"last dims {si[-1]!r} and {ss[-1]!r} are not both {d}"
    if dims_conflict(si[-2], ss[-2]):
        return f"{si} + {ss} broadcasts along axis -2"
    if ri == 3 and rs == 3 and dims_conflict(si[0], ss[0]) and static_dim(skip, 0) != 1:
        return f"{si} + {ss} broadcasts the input along the batch axis"
    return None


def _dims_proven(input_: gs.Tensor, skip: gs.Tensor) -> bool:
    si, ss = shape_of(input_), shape_of(skip)
    aligned = list(zip(si[len(si) - len(ss):], ss))
    if len(ss) == 3 and static_dim(skip, 0) == 1:
        aligned = aligned[1:]
    return all(dims_agree(a, b) for a, b in aligned)


def _batch_proven(input_: gs.Tensor, skip: gs.Tensor) -> bool:
    """The kernel's output has the Add's batch: skip has no batch, a batch of 1, input's batch is the
    same symbol or value, or one operand is computed from the other row by row (a residual block,
    ``h + F(h)``: shape inference loses the batch symbol in TorchScript exports, the data flow keeps it)."""
    if rank_of(input_) != 3 or rank_of(skip) != 3 or static_dim(skip, 0) == 1:
        return True
    return (dims_agree(shape_of(input_)[0], shape_of(skip)[0])
            or _computed_row_by_row(input_, skip) or _computed_row_by_row(skip, input_))


# Ops whose output's leading dim is that of the inputs followed below (the batch-carrying ones):
# op -> indices of those inputs. Every other input must be a constant of rank <= 2 (weights, biases,
# scales), so that nothing broadcasts a batch in. MultiHeadAttention's output has the query's batch.
_ROW_WISE_INPUTS = {
    "MatMul": (0,), "Gemm": (0,), "Add": (0, 1), "Sub": (0, 1), "Mul": (0, 1), "Div": (0, 1),
    "Cast": (0,), "Identity": (0,), "Sigmoid": (0,), "Tanh": (0,), "Relu": (0,), "Erf": (0,), "Softmax": (0,),
    "Gelu": (0,), "FastGelu": (0,), "BiasGelu": (0,), "QuickGelu": (0,), "BiasSplitGelu": (0,), "BiasAdd": (0, 2),
    "LayerNormalization": (0,), "SkipLayerNormalization": (0, 1), "MultiHeadAttention": (0,), "Split": (0,),
}
_ROW_WISE_DEPTH = 24  # producers followed back from one operand (a transformer block's branch is ~10)


def _keeps_leading_dim(reshape: gs.Node) -> bool:
    """A Reshape whose constant shape copies dim 0 (a 0 there, allowzero off): the packed-QKV views."""
    shape = reshape.inputs[1] if len(reshape.inputs) > 1 else None
    if not isinstance(shape, gs.Constant) or reshape.attrs.get("allowzero", 0):
        return False
    values = constant_value(shape)
    return values is not None and values.ndim == 1 and values.size >= 1 and int(values[0]) == 0


def _splits_inside_rows(split: gs.Node) -> bool:
    axis, rank = split.attrs.get("axis", 0), rank_of(split.inputs[0])
    return axis > 0 or (rank is not None and -rank < axis < 0)


def _computed_row_by_row(tensor: gs.Tensor, source: gs.Tensor, depth: int = _ROW_WISE_DEPTH) -> bool:
    """``tensor`` is computed from ``source`` alone (constants aside) through ops that keep the leading
    dim: then the two have the same batch, whatever shape inference named them. Two outputs of one
    SkipLayerNormalization (the normalized sum and the sum itself) count as one source."""
    if tensor is source:
        return True
    if depth == 0 or len(tensor.inputs) != 1:
        return False
    node = tensor.inputs[0]
    if source.inputs and source.inputs[0] is node:
        return node.op == "SkipLayerNormalization"
    followed = _ROW_WISE_INPUTS.get(node.op)
    if node.op == "Reshape" and _keeps_leading_dim(node):
        followed = (0,)
    if node.op == "Split" and not _splits_inside_rows(node):
        return False  # a split along the batch, or along an axis not known (GEGLU's chunk splits channels)
    if followed is None:
        return False
    rows = [t for i, t in enumerate(node.inputs) if i in followed and t is not None and not isinstance(t, gs.Constant)]
    rest = [t for i, t in enumerate(node.inputs) if t is not None and (i not in followed or isinstance(t, gs.Constant))]
    if node.op == "MultiHeadAttention":
        rest = []  # key, value, biases: the output has the query's batch (or the kernel fails)
    if node.op == "Reshape":
        rest = []  # its shape, checked by _keeps_leading_dim
    if not rows or any(not isinstance(t, gs.Constant) or len(t.shape) > 2 for t in rest):
        return False
    return all(_computed_row_by_row(t, source, depth - 1) for t in rows)


def write_skip_layer_norm(make: Emit, ln: gs.Node, input_, skip, gamma, beta, bias, y: gs.Variable,
                          input_skip_bias_sum: gs.Variable | None = None) -> None:
    """SkipLayerNormalization(input, skip, gamma, beta, bias) with ``ln``'s epsilon, computing y
    (output 0) and, when given, the sum input + skip + bias (output 3)."""
    inputs = [input_, skip, gamma, beta if beta is not None else make.absent()]
    if bias is not None:
        inputs.append(bias)
    outputs = [y]
    if input_skip_bias_sum is not None:
        outputs += [make.absent(), make.absent(), input_skip_bias_sum]
    epsilon = float(ln.attrs.get("epsilon", LAYER_NORM_DEFAULT_EPSILON))
    make.node("SkipLayerNormalization", inputs, None, None, outputs=outputs, domain=MS_DOMAIN, epsilon=epsilon)


# ---------------------------------------------------------------- fuse-bias-layer-norm


def reshaped_bias_layer_norm(u, gamma, beta=Var("beta", optional=True), bias=Const()):
    biased = op.Add(u, bias, _name="bias_add")
    viewed = op.Reshape(biased, Var("target"), _name="view")
    return op.LayerNormalization(viewed, gamma, beta, _name="ln", _external_uses=True), viewed, biased


def bias_layer_norm(u, gamma, beta=Var("beta", optional=True), bias=Const()):
    biased = op.Add(u, bias, _name="bias_add")
    return op.LayerNormalization(biased, gamma, beta, _name="ln", _external_uses=True), biased


def layer_norm(x, gamma, beta=Var("beta", optional=True)):
    return op.LayerNormalization(x, gamma, beta, _name="ln", _external_uses=True)


# Tried in this order on every LayerNormalization: the first that matches is the site's form.
# (_external_uses on the LayerNorm: its mean / inv-std outputs are checked with a reason, below.)
BIAS_LAYER_NORM_FORMS = (
    Pattern(reshaped_bias_layer_norm, name="bias-reshape-layer-norm"),
    Pattern(bias_layer_norm, name="bias-layer-norm"),
    Pattern(layer_norm, name="layer-norm"),
)


@dataclass
class _RowsPlan:
    """What the rewrite needs: D, the dtype, the bias as (D,) (None: no bias Add), and the
    normalized tensor's static shape (None: some dim is not static)."""

    d: int
    dtype: np.dtype
    bias: gs.Tensor | None  # the constant added in front, (D,) or (1, .., 1, D)
    shape: list[int] | None


def _bias_layer_norm_plan(match, graph_outputs: set[int]) -> _RowsPlan | str:
    ln = match.node("ln")
    normalized = ln.inputs[0]
    gamma, beta = match["gamma"], match.get("beta")
    d = layer_norm_kernel_refusal(ln, normalized, gamma, beta, graph_outputs)
    if isinstance(d, str):
        return d
    for name, t in (("gamma", gamma), ("beta", beta)):
        if t is not None and not is_constant(t):
            return f"{name} is computed at run time; this rewrite takes constant gamma and beta"
    dtype = np.dtype(constant_value(gamma).dtype)
    if dtype not in SKIP_LAYER_NORM_DTYPES:
        return f"dtype {dtype}; the kernels take float32 and float16"
    if static_dim(normalized, -1) != d:
        return f"the normalized last dim {_last_dim(normalized)} is not static {d}; the rows view needs it"
    bias = None
    if "bias" in match:
        reason = _bias_refusal(match, d)
        if reason is not None:
            return reason
        bias = match["bias"]
    else:
        reason = _residual_sum_refusal(normalized)
        if reason is not None:
            return reason
    return _RowsPlan(d, dtype, bias, _static_shape(normalized))


def _bias_refusal(match, d: int) -> str | None:
    """Why Add(u, bias) is not u plus one value per last-axis element, shaped as u, with a Reshape
    after it (if any) keeping the last dim (None if it is)."""
    u, bias, biased = match["u"], match["bias"], match.node("bias_add").outputs[0]
    if "target" in match and static_dim(biased, -1) != d:
        return f"the Reshape between the Add and the LayerNorm does not keep the last dim: {_last_dim(biased)} -> {d}"
    shape = shape_of(bias)
    if not shape or shape[-1] != d or any(s != 1 for s in shape[:-1]):
        return f"the constant added in front has shape {shape}; a bias is ({d},) or (1, .., 1, {d})"
    rank = rank_of(u)
    if rank is None or rank < len(shape) or static_dim(u, -1) != d:
        return f"{shape_of(u)} + {shape} broadcasts the Add's other operand; a bias Add keeps its shape"
    return None


def _residual_sum_refusal(normalized: gs.Tensor) -> str | None:
    """A LayerNorm of an Add of two computed tensors (maybe through a Reshape) is fuse-skip-layer-norm's site."""
    producer = normalized.inputs[0] if len(normalized.inputs) == 1 else None
    if producer is not None and producer.op == "Reshape" and len(producer.inputs[0].inputs) == 1:
        producer = producer.inputs[0].inputs[0]
    if producer is not None and producer.op == "Add" and producer.domain in ("", "ai.onnx", None):
        shapes = " + ".join(str(shape_of(t)) for t in producer.inputs)
        return f"reads the sum {shapes} of two computed tensors: a residual Add, left to fuse-skip-layer-norm"
    return None


def _last_dim(t: gs.Tensor):
    shape = shape_of(t)
    return shape[-1] if shape else None


@dataclass
class RowsSite:
    match: Match
    plan: _RowsPlan


def check_rows(match: Match, run: FusionRun) -> RowsSite:
    plan = _bias_layer_norm_plan(match, {id(t) for t in run.graph.outputs})
    if isinstance(plan, str):
        raise Refusal(plan)
    run.details["bias_folded"] += "bias" in match
    run.details["through_reshape"] += "target" in match
    run.details["dynamic_shape"] += plan.shape is None
    return RowsSite(match, plan)


def emit_rows(make: Emit, site: RowsSite) -> list[gs.Tensor]:
    """Reshape to (-1, 1, D) rows, SkipLayerNormalization with a zero (1, D) skip, reshape back.

    Output 3 (u + bias) is written only when the Add's (or the Reshape's) output has readers
    besides the LayerNorm; it is reshaped back into that tensor.
    """
    match, plan = site.match, site.plan
    ln = match.node("ln")
    normalized = ln.inputs[0]
    source = match["u"] if plan.bias is not None else normalized  # what the kernel reads, before the bias
    n_rows = int(np.prod(plan.shape)) // plan.d if plan.shape is not None else None
    rows_shape = [n_rows, 1, plan.d]
    rows = make.op.Reshape(source, make.constant("rows_shape", np.array([-1, 1, plan.d], np.int64)),
                           _dtype=plan.dtype, _shape=rows_shape)

    def back(rows_tensor: gs.Tensor, shape: gs.Tensor, old: gs.Tensor) -> gs.Tensor:
        """rows_tensor reshaped to ``shape``: the tensor that takes over ``old``."""
        return make.op.Reshape(rows_tensor, shape, _dtype=plan.dtype, _shape=shape_of(old))

    def shape_tensor(of: gs.Tensor, static: list[int] | None, label: str, view: gs.Node | None = None) -> gs.Tensor:
        if static is not None:
            return make.constant(f"{label}_shape", np.array(static, np.int64))
        if view is not None:  # the shape the Reshape between Add and LayerNorm gives u (free: a view)
            of = make.op.Reshape(of, view.inputs[1], _dtype=plan.dtype, _shape=shape_of(view.outputs[0]), **dict(view.attrs))
        return make.op.Shape(of, _dtype=np.int64, _shape=[rank_of(of)])

    # Outputs after the first: the Reshape's output, the Add's output (those of the match's form).
    sums = match.outputs[1:]
    matched = {id(n) for n in match.nodes}
    graph_outputs = {id(t) for t in make.graph.outputs}
    read = [any(id(c) not in matched for c in t.outputs) or id(t) in graph_outputs for t in sums]
    y_rows = make.tensor("y_rows", plan.dtype, rows_shape)
    sum_rows = make.tensor("sum_rows", plan.dtype, rows_shape) if any(read) else None
    bias = _per_channel(make, plan.bias, plan.d) if plan.bias is not None else None
    zero_skip = make.constant("zero_skip", np.zeros((1, plan.d), plan.dtype))
    write_skip_layer_norm(make, ln, rows, zero_skip, match["gamma"], match.get("beta"), bias, y_rows, sum_rows)
    view = match.node("view") if "target" in match else None
    normalized_shape = shape_tensor(source, plan.shape, "normalized", view)
    new_outputs = [back(y_rows, normalized_shape, match.outputs[0])]
    for t, is_read in zip(sums, read):
        if not is_read:
            new_outputs.append(t)  # left without producer or readers: cleanup drops it
        elif t is normalized:
            new_outputs.append(back(sum_rows, normalized_shape, t))
        else:  # the Add's output, before the Reshape: u's shape
            new_outputs.append(back(sum_rows, shape_tensor(source, _static_shape(t), "biased"), t))
    return new_outputs


@register_pass
class FuseBiasLayerNorm(Fusion, OrtFusion):
    name = "fuse-bias-layer-norm"
    description = ("LayerNormalization with no residual Add (+ the bias Add in front) -> com.microsoft "
                   "SkipLayerNormalization over (-1, 1, D) rows with a zero skip (ORT's faster CUDA kernel)")
    runs_after = {
        "fuse-skip-layer-norm": "a LayerNorm of a residual sum is SkipLayerNormalization's with the sum as its skip; "
                                "this pass leaves Adds of two computed tensors alone",
        "nhwc-conv": "a 1x1 proj_in conv becomes the MatMul + bias Add whose bias this pass folds",
    }

    # Tried in this order on every LayerNormalization: the first form that matches is the site's.
    rules = tuple(Rule(form, check_rows, emit_rows, site=lambda m: m.node("ln")) for form in BIAS_LAYER_NORM_FORMS)

    def finish(self, run: FusionRun) -> None:
        run.result.details.update({key: run.details[key] for key in ("bias_folded", "through_reshape", "dynamic_shape")})


def _static_shape(t: gs.Tensor) -> list[int] | None:
    dims = static_dims(t)
    return dims if dims is not None and None not in dims else None


__all__ = [
    "DECOMPOSED_LAYER_NORM",
    "SKIP_LAYER_NORM",
    "BIAS_LAYER_NORM_FORMS",
    "FuseBiasLayerNorm",
    "FuseLayerNorm",
    "FuseSkipLayerNorm",
    "layer_norm_kernel_refusal",
    "write_skip_layer_norm",
    "skip_shape_refusal",
]
