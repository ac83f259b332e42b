"""nhwc-conv: 2-D convolutions run channels-last as com.microsoft NhwcConv, weights transposed offline.

    x(N,C,H,W) ─ Conv(W(M,C/g,kH,kW), B) ─ y
        ==>
    x ─ Transpose(0,2,3,1) ─ NhwcConv(W'(M,kH,kW,C/g), B) ─ Transpose(0,3,1,2) ─ y

then ``sink-transposes`` (the pass manager runs it right after, as a step of its own) moves the
Transposes down through elementwise ops, Concat and Resize so that they cancel between neighbouring NHWC nodes (convolutions and GroupNorms, which
fuse-group-norm emits in the same wrapped form): Transposes remain only at the edges of NHWC
regions, where ONNX Runtime's own NHWC pass leaves two per Conv.

A 1x1 convolution (stride 1, no padding, one group) is written as what it is on channels-last
data, a MatMul over the channel axis (cuBLAS instead of cuDNN: faster, see
benchmarks/results/layout-choices.md; ``pointwise="conv"`` keeps them NhwcConv)::

    x ─ Transpose(0,2,3,1) ─ MatMul(W[:, :, 0, 0]ᵀ) ─ [Add(B)] ─ Transpose(0,3,1,2) ─ y

Conditions: the Conv is 2-D (4-D input), its weight is a constant (a computed weight cannot be
transposed offline: refused), and its bias, if any, is a constant or absent.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxopt.errors import PassOptionError
from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.layout import TO_NCHW, TO_NHWC
from onnxopt.pattern import Match, Pattern, op
from onnxopt.registry import register_pass
from onnxopt.weight_provenance import record, reshape, transpose
from onnxopt.weights import DerivedValues, read_uncached, stored_values


def conv(x, w, b):
    return op.Conv(x, w, b, _name="conv")


def conv_no_bias(x, w):
    return op.Conv(x, w, _name="conv")


CONV = Pattern(conv, conv_no_bias, name="conv2d")


def transposed_weight(w: gs.Constant) -> DerivedValues:
    """The (M, C/g, kH, kW) weight as (M, kH, kW, C/g), transposed only when read or saved."""
    m, c, kh, kw = w.shape
    return record(DerivedValues((m, kh, kw, c), w.dtype, lambda: read_uncached(w).transpose(TO_NHWC), name=w.name,
                                elements_of=[stored_values(w)]), [(stored_values(w), [transpose(TO_NHWC)])])


# ---------------------------------------------------------------- the site and what it writes


def check(match: Match, run: FusionRun) -> Match:
    x, w, b = match["x"], match["w"], match.get("b")
    if not isinstance(w, gs.Constant):
        raise Refusal("weight is not a constant: it cannot be transposed offline")
    if len(w.shape) != 4:
        raise Refusal(f"not a 2-D convolution (weight rank {len(w.shape)})")
    if b is not None and not isinstance(b, gs.Constant):
        raise Refusal("bias is not a constant")
    if x.shape is not None and len(x.shape) != 4:
        raise Refusal(f"input rank {len(x.shape)} != 4")
    return match


def emit(make: Emit, match: Match, pointwise_as_matmul: bool) -> list[gs.Tensor]:
    """Transpose ─ NhwcConv(W') ─ Transpose, or Transpose ─ MatMul(W[:, :, 0, 0]ᵀ) ─ [Add(B)] ─ Transpose."""
    node = match.node("conv")
    x, w, b = match["x"], match["w"], match.get("b")
    y = match.output
    y_shape = _permute(y.shape, TO_NHWC)
    x_nhwc = make.op.Transpose(x, perm=TO_NHWC, _shape=_permute(x.shape, TO_NHWC))
    if pointwise_as_matmul and _is_pointwise(node, w):
        m, c = w.shape[:2]
        matrix = DerivedValues((c, m), w.dtype, lambda: read_uncached(w)[:, :, 0, 0].T.copy(), name=w.name,
                               elements_of=[stored_values(w)])
        w_matrix = make.constant("W_matrix", record(matrix, [(stored_values(w), [reshape((m, c)), transpose((1, 0))])]))
        y_nhwc = make.op.MatMul(x_nhwc, w_matrix, _dtype=y.dtype, _shape=y_shape)
        if b is not None:
            y_nhwc = make.op.Add(y_nhwc, b, _dtype=y.dtype, _shape=y_shape)
    else:
        w_nhwc = make.constant("W_nhwc", transposed_weight(w))
        y_nhwc = make.ms.NhwcConv(x_nhwc, w_nhwc, *([b] if b is not None else []), _dtype=y.dtype, _shape=y_shape,
                                  **dict(node.attrs))
    return [make.op.Transpose(y_nhwc, perm=TO_NCHW, _shape=y.shape)]


def _count_as_matmul(match: Match, run: FusionRun) -> Match:
    check(match, run)
    if run.fusion.pointwise == "matmul" and _is_pointwise(match.node("conv"), match["w"]):
        run.details["as MatMul"] += 1
    return match


@register_pass
class NhwcConvPass(Fusion):
    name = "nhwc-conv"
    description = "Conv -> com.microsoft NhwcConv with offline-transposed weights; Transposes only at NHWC region edges"
    targets = frozenset({"ort-cuda"})

    POINTWISE = ("conv", "matmul")

    def __init__(self, sink: bool = True, pointwise: str = "matmul"):
        if pointwise not in self.POINTWISE:
            raise PassOptionError(f"nhwc-conv: pointwise must be one of {', '.join(self.POINTWISE)}, not '{pointwise}'")
        self.sink = sink
        self.pointwise = pointwise

    def rules_for(self, model) -> tuple[Rule, ...]:
        as_matmul = self.pointwise == "matmul"
        return (Rule(CONV, _count_as_matmul, lambda make, match: emit(make, match, as_matmul), site=lambda m: m.node("conv")),)

    def finish(self, run: FusionRun) -> None:
        if run.details["as MatMul"]:
            run.result.details["as MatMul"] = run.details["as MatMul"]

    possible_followers = frozenset({"sink-transposes"})

    def followers(self, result) -> list[str]:
        """sink-transposes, after a run that wrapped convolutions in Transposes (unless ``sink=False``)."""
        return ["sink-transposes"] if result.sites_rewritten and self.sink else []


def _is_pointwise(node: gs.Node, w: gs.Constant) -> bool:
    a = node.attrs
    return (
        tuple(w.shape[2:]) == (1, 1)
        and a.get("group", 1) == 1
        and all(s == 1 for s in a.get("strides", [1, 1]))
        and all(d == 1 for d in a.get("dilations", [1, 1]))
        and not any(a.get("pads", [0, 0, 0, 0]))
        and a.get("auto_pad", "NOTSET") in ("NOTSET", "VALID", b"NOTSET", b"VALID")
    )


def _permute(shape, perm):
    if shape is None or len(shape) != len(perm):
        return None
    return [shape[p] for p in perm]
