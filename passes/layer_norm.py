"""fuse-layer-norm and fuse-skip-layer-norm: LayerNorm as one op, then with its residual Add.

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
    mismatch there makes ORT's kernel fail rather than compute something else, except an input
    whose batch is 1 against a larger batch of skip.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, OrtFusion, Pass, PassResult
from onnxopt.pattern import Const, Literal, OneOf, Pattern, Var, constant_shape, constant_value, is_constant, op, replace
from onnxopt.pattern.tensor_facts import (
    dims_agree,
    dims_conflict,
    normalize_axis,
    rank_of,
    shape_of,
    static_dim,
    static_ints,
)
from onnxopt.registry import register_pass

MS_DOMAIN = "com.microsoft"
SKIP_LAYER_NORM_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))  # bfloat16 too, but numpy has none
LAYER_NORM_DEFAULT_EPSILON = 1e-5  # ONNX LayerNormalization's default


# ---------------------------------------------------------------- fuse-layer-norm


def decomposed_layer_norm(x, gamma, beta, eps=Const()):
    d = x - op.ReduceMean(x, _extra_inputs=True, _name="mean", keepdims=1)
    variance = op.ReduceMean(OneOf(d ** Literal(2.0, rtol=0, atol=0), d * d), _extra_inputs=True, _name="variance", keepdims=1)
    std = op.Sqrt(variance + eps)
    return OneOf(d / std, d * op.Reciprocal(std)) * gamma + beta


DECOMPOSED_LAYER_NORM = Pattern(decomposed_layer_norm, name="decomposed-layer-norm")


@register_pass
class FuseLayerNorm(Pass):
    name = "fuse-layer-norm"
    description = "fuse decomposed LayerNorm (ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add) into LayerNormalization"
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})
    is_fusion = True

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        for match in DECOMPOSED_LAYER_NORM.find(graph):
            result.sites_matched += 1
            reason = _layer_norm_refusal(match, graph.opset)
            if reason is not None:
                result.refuse(match.root.name, reason)
                continue
            d = static_dim(match["x"], -1)
            y = gs.Variable(f"{match.output.name}__ln")
            inputs = [match["x"], _per_channel(match["gamma"], d), _per_channel(match["beta"], d)]
            eps = float(match.value("eps").reshape(-1)[0])
            replace(graph, match, [gs.Node("LayerNormalization", f"{match.root.name}__layer_norm", attrs={"axis": -1, "epsilon": eps},
                                           inputs=inputs, outputs=[y])])
            result.sites_rewritten += 1
        result.modified = result.sites_rewritten > 0
        if result.modified:
            graph.cleanup(remove_unused_graph_inputs=False).toposort()
        return result


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


def _per_channel(tensor: gs.Tensor, d: int) -> gs.Tensor:
    """``tensor`` as shape (d,): constants of shape (1, .., d) get a reshaped copy."""
    if list(shape_of(tensor)) == [d]:
        return tensor
    return gs.Constant(f"{tensor.name}__flat", np.ascontiguousarray(constant_value(tensor).reshape(d)))


# ---------------------------------------------------------------- fuse-skip-layer-norm


def skip_layer_norm(a, b, gamma, beta=Var("beta", optional=True)):
    s = op.Add(a, b, _name="sum")
    return op.LayerNormalization(s, gamma, beta, _name="ln"), s


def bias_skip_layer_norm(x, residual, gamma, beta=Var("beta", optional=True), bias=Const()):
    s = op.Add(op.Add(x, bias, _name="bias_add"), residual, _name="sum")
    return op.LayerNormalization(s, gamma, beta, _name="ln"), s


SKIP_LAYER_NORM = Pattern(bias_skip_layer_norm, skip_layer_norm, name="skip-layer-norm")


@register_pass
class FuseSkipLayerNorm(OrtFusion):
    name = "fuse-skip-layer-norm"
    description = "fuse Add (+ bias) + LayerNormalization into com.microsoft SkipLayerNormalization (sum as output 3)"

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        assumed = biased = 0
        graph_outputs = {id(t) for t in graph.outputs}
        for match in SKIP_LAYER_NORM.find(graph):
            result.sites_matched += 1
            verdict = _skip_layer_norm_plan(match, graph_outputs)
            if isinstance(verdict, str):
                result.refuse(match.root.name, verdict)
                continue
            input_, skip, proven = verdict
            assumed += not proven
            biased += "bias" in match
            _rewrite_skip_layer_norm(graph, match, input_, skip, graph_outputs)
            result.sites_rewritten += 1
        result.details.update(dims_assumed_equal=assumed, bias_folded=biased)
        result.modified = result.sites_rewritten > 0
        if result.modified:
            graph.cleanup(remove_unused_graph_inputs=False).toposort()
        return result


def _skip_layer_norm_plan(match, graph_outputs: set[int]):
    """(input, skip, dims proven equal) for the kernel, or why the site is refused."""
    ln = match.node("ln")
    s = match.outputs[1]
    if any(t.outputs or id(t) in graph_outputs for t in ln.outputs[1:] if t.name):
        return "the LayerNorm's mean / inv-std outputs are used"
    rank = rank_of(s)
    axis = int(ln.attrs.get("axis", -1))
    if axis != -1 and (rank is None or normalize_axis(axis, rank) != rank - 1):
        return f"normalizes from axis {axis}; SkipLayerNormalization normalizes the last axis only"
    if int(ln.attrs.get("stash_type", 1)) != 1:
        return f"stash_type {ln.attrs['stash_type']}; SkipLayerNormalization computes in float32"
    d = static_dim(match["gamma"], 0) if rank_of(match["gamma"]) == 1 else None
    if d is None:
        return f"gamma has shape {shape_of(match['gamma'])}; SkipLayerNormalization takes a 1-D gamma of static size"
    for name in ("beta", "bias"):
        t = match.get(name)
        if t is not None and shape_of(t) != [d]:
            return f"{name} has shape {shape_of(t)}; SkipLayerNormalization takes ({d},)"
    if static_dim(s, -1) not in (None, d):
        return f"gamma of {d} broadcasts over a last dim of {static_dim(s, -1)}"
    dtype = s.dtype
    if dtype is not None and np.dtype(dtype) not in SKIP_LAYER_NORM_DTYPES:
        return f"dtype {np.dtype(dtype)}; the kernels take float32 and float16"
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


def _rewrite_skip_layer_norm(graph: gs.Graph, match, input_, skip, graph_outputs: set[int]) -> None:
    ln, s = match.node("ln"), match.outputs[1]
    beta, bias = match.get("beta"), match.get("bias")
    inputs = [input_, skip, match["gamma"], beta if beta is not None else gs.Variable.empty()]
    if bias is not None:
        inputs.append(bias)
    y = gs.Variable(f"{match.outputs[0].name}__skip_ln")
    outputs = [y]
    sum_is_read = any(c is not ln for c in s.outputs) or id(s) in graph_outputs
    new_sum = None
    if sum_is_read:
        new_sum = gs.Variable(f"{s.name}__skip_ln_sum")
        outputs += [gs.Variable.empty(), gs.Variable.empty(), new_sum]
    epsilon = float(ln.attrs.get("epsilon", LAYER_NORM_DEFAULT_EPSILON))
    node = gs.Node("SkipLayerNormalization", f"{ln.name}__skip", domain=MS_DOMAIN, attrs={"epsilon": epsilon},
                   inputs=inputs, outputs=outputs)
    # When only the LayerNorm read s, s is left without producer or consumer (cleanup drops it).
    replace(graph, match, [node], [y, new_sum if new_sum is not None else s])


__all__ = [
    "DECOMPOSED_LAYER_NORM",
    "SKIP_LAYER_NORM",
    "FuseLayerNorm",
    "FuseSkipLayerNorm",
    "skip_shape_refusal",
]
