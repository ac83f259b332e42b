"""fuse-bias-layer-norm (ort-cuda; after fuse-skip-layer-norm and nhwc-conv): the LayerNorms left
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

    Conditions: as fuse-skip-layer-norm's (last axis, stash_type 1, mean / inv-std unused, float32,
    float16 or bfloat16), and gamma (and beta) constant 1-D of D, the LayerNorm input's static last dim; the
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

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.layer_norm_kernel import SKIP_LAYER_NORM_DTYPES, layer_norm_kernel_refusal, per_channel, write_skip_layer_norm
from onnxopt.pass_infra import OrtFusion
from onnxopt.pattern import Const, Match, Pattern, Var, constant_value, is_constant, op
from onnxopt.pattern.tensor_facts import rank_of, shape_of, static_dim, static_dims
from onnxopt.registry import register_pass


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
        return f"dtype {dtype}; the kernels take float32, float16 and bfloat16"
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
    bias = per_channel(make, plan.bias, plan.d) if plan.bias is not None else None
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


__all__ = ["BIAS_LAYER_NORM_FORMS", "FuseBiasLayerNorm"]
