"""fuse-skip-layer-norm (ort-cuda): a residual Add (+ the bias Add in front) and the LayerNorm reading
it as ONNX Runtime's SkipLayerNormalization (the kernel: onnxopt.layer_norm_kernel).

    s = Add(a, b)                                    s = Add(Add(x, bias), r)
    y = LayerNormalization(s, gamma, beta)     or    y = LayerNormalization(s, gamma, beta)
                         ==>
    y, _, _, s = SkipLayerNormalization(input, skip, gamma, beta[, bias], epsilon=eps)   (com.microsoft)

    The same with y = SimplifiedLayerNormalization(s, gamma) (RMSNorm, written by fuse-rms-norm): the
    kernel is SkipSimplifiedLayerNormalization(input, skip, gamma[, bias]), no beta.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.layer_norm_kernel import layer_norm_kernel_refusal, write_skip_layer_norm
from onnxopt.pass_infra import OrtFusion
from onnxopt.pattern import Const, Match, Pattern, Var, constant_value, op
from onnxopt.pattern.tensor_facts import dims_agree, dims_conflict, rank_of, shape_of, static_dim
from onnxopt.registry import register_pass


def skip_layer_norm(a, b, gamma, beta=Var("beta", optional=True)):
    s = op.Add(a, b, _name="sum")
    return op.LayerNormalization(s, gamma, beta, _name="ln"), s


def bias_skip_layer_norm(x, residual, gamma, beta=Var("beta", optional=True), bias=Const()):
    s = op.Add(op.Add(x, bias, _name="bias_add"), residual, _name="sum")
    return op.LayerNormalization(s, gamma, beta, _name="ln"), s


def skip_rms_norm(a, b, gamma):
    s = op.Add(a, b, _name="sum")
    return op.SimplifiedLayerNormalization(s, gamma, _name="ln"), s


def bias_skip_rms_norm(x, residual, gamma, bias=Const()):
    s = op.Add(op.Add(x, bias, _name="bias_add"), residual, _name="sum")
    return op.SimplifiedLayerNormalization(s, gamma, _name="ln"), s


SKIP_LAYER_NORM = Pattern(bias_skip_layer_norm, skip_layer_norm, name="skip-layer-norm")
SKIP_RMS_NORM = Pattern(bias_skip_rms_norm, skip_rms_norm, name="skip-rms-norm")  # fuse-rms-norm's output


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
    description = ("fuse Add (+ bias) + LayerNormalization / SimplifiedLayerNormalization (RMSNorm) into com.microsoft "
                   "SkipLayerNormalization / SkipSimplifiedLayerNormalization (sum as output 3)")
    rules = (Rule(SKIP_LAYER_NORM, check_skip_layer_norm, emit_skip_layer_norm),
             Rule(SKIP_RMS_NORM, check_skip_layer_norm, emit_skip_layer_norm))

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


__all__ = ["SKIP_LAYER_NORM", "SKIP_RMS_NORM", "FuseSkipLayerNorm", "skip_shape_refusal"]
