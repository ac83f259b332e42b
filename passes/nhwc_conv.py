"""nhwc-conv: 2-D convolutions run channels-last as com.microsoft NhwcConv, weights transposed offline.

    x(N,C,H,W) ─ Conv(W(M,C/g,kH,kW), B) ─ y
        ==>
    x ─ Transpose(0,2,3,1) ─ NhwcConv(W'(M,kH,kW,C/g), B) ─ Transpose(0,3,1,2) ─ y

then ``sink-transposes`` moves the Transposes down through elementwise ops, Concat and Resize so
that they cancel between neighbouring NHWC nodes (convolutions and GroupNorms, which
fuse-group-norm emits in the same wrapped form): Transposes remain only at the edges of NHWC
regions, where ONNX Runtime's own NHWC pass leaves two per Conv.

A 1x1 convolution (stride 1, no padding, one group) is written as what it is on channels-last
data, a MatMul over the channel axis (cuBLAS instead of cuDNN; on an H100 the SD1.5 UNet's 46
pointwise convs took 0.28 ms less as MatMuls, benchmarks/results/h100-2026-11-22-kernels-ts-dynamic.md;
``pointwise="conv"`` keeps them NhwcConv)::

    x ─ Transpose(0,2,3,1) ─ MatMul(W[:, :, 0, 0]ᵀ) ─ [Add(B)] ─ Transpose(0,3,1,2) ─ y

Conditions: the Conv is 2-D (4-D input), its weight is a constant (a computed weight cannot be
transposed offline: refused), and its bias, if any, is a constant or absent.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.errors import PassOptionError
from onnxopt.graph_edit import is_standard
from onnxopt.model import Model
from onnxopt.pass_infra import Pass, PassResult
from onnxopt.pattern import Const, Pattern, Var, op, replace
from onnxopt.registry import register_pass
from onnxopt.weights import DerivedValues, read_uncached

from .sink_transposes import SinkTransposes

TO_NHWC = [0, 2, 3, 1]
TO_NCHW = [0, 3, 1, 2]


def conv(x, w, b):
    return op.Conv(x, w, b, _name="conv")


def conv_no_bias(x, w):
    return op.Conv(x, w, _name="conv")


CONV = Pattern(conv, conv_no_bias, name="conv2d")


def transposed_weight(w: gs.Constant) -> DerivedValues:
    """The (M, C/g, kH, kW) weight as (M, kH, kW, C/g), transposed only when read or saved."""
    m, c, kh, kw = w.shape
    return DerivedValues((m, kh, kw, c), w.dtype, lambda: read_uncached(w).transpose(TO_NHWC), name=w.name)


@register_pass
class NhwcConvPass(Pass):
    name = "nhwc-conv"
    description = "Conv -> com.microsoft NhwcConv with offline-transposed weights; Transposes only at NHWC region edges"
    targets = frozenset({"ort-cuda"})
    is_fusion = True

    POINTWISE = ("conv", "matmul")

    def __init__(self, sink: bool = True, pointwise: str = "matmul"):
        if pointwise not in self.POINTWISE:
            raise PassOptionError(f"nhwc-conv: pointwise must be one of {', '.join(self.POINTWISE)}, not '{pointwise}'")
        self.sink = sink
        self.pointwise = pointwise

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        for match in CONV.find(graph):
            node = match.node("conv")
            result.sites_matched += 1
            reason = _refusal(match)
            if reason:
                result.refuse(node.name, reason)
                continue
            if self.pointwise == "matmul" and _is_pointwise(node, match["w"]):
                _rewrite_as_matmul(graph, match)
                result.details["as MatMul"] = result.details.get("as MatMul", 0) + 1
            else:
                _rewrite(graph, match)
            result.sites_rewritten += 1
        if result.sites_rewritten:
            result.modified = True
            graph.cleanup(remove_unused_graph_inputs=False)
            if self.sink:
                sink = SinkTransposes().run(model)
                result.details.update(sink.details)
        return result


def _refusal(match) -> str | None:
    x, w, b = match["x"], match["w"], match.get("b")
    if not isinstance(w, gs.Constant):
        return "weight is not a constant: it cannot be transposed offline"
    if len(w.shape) != 4:
        return f"not a 2-D convolution (weight rank {len(w.shape)})"
    if b is not None and not isinstance(b, gs.Constant):
        return "bias is not a constant"
    if x.shape is not None and len(x.shape) != 4:
        return f"input rank {len(x.shape)} != 4"
    return None


def _rewrite(graph: gs.Graph, match) -> None:
    node = match.node("conv")
    x, w, b = match["x"], match["w"], match.get("b")
    y = match.output
    name = node.name or y.name
    w_nhwc = gs.Constant(f"{w.name}__nhwc", transposed_weight(w))
    x_nhwc = gs.Variable(f"{name}__x_nhwc", dtype=x.dtype, shape=_permute(x.shape, TO_NHWC))
    y_nhwc = gs.Variable(f"{name}__y_nhwc", dtype=y.dtype, shape=_permute(y.shape, TO_NHWC))
    inputs = [x_nhwc, w_nhwc] + ([b] if b is not None else [])
    replace(
        graph,
        match,
        [
            gs.Node("Transpose", name=f"{name}__to_nhwc", attrs={"perm": TO_NHWC}, inputs=[x], outputs=[x_nhwc]),
            gs.Node("NhwcConv", name=f"{name}__nhwc", domain="com.microsoft", attrs=dict(node.attrs), inputs=inputs, outputs=[y_nhwc]),
            gs.Node("Transpose", name=f"{name}__to_nchw", attrs={"perm": TO_NCHW}, inputs=[y_nhwc], outputs=[gs.Variable(f"{name}__y")]),
        ],
    )


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


def _rewrite_as_matmul(graph: gs.Graph, match) -> None:
    node = match.node("conv")
    x, w, b = match["x"], match["w"], match.get("b")
    y = match.output
    name = node.name or y.name
    m, c = w.shape[:2]
    w_matrix = gs.Constant(
        f"{w.name}__cm", DerivedValues((c, m), w.dtype, lambda: read_uncached(w)[:, :, 0, 0].T.copy(), name=w.name)
    )
    x_nhwc = gs.Variable(f"{name}__x_nhwc", dtype=x.dtype, shape=_permute(x.shape, TO_NHWC))
    y_nhwc = gs.Variable(f"{name}__y_nhwc", dtype=y.dtype, shape=_permute(y.shape, TO_NHWC))
    nodes = [gs.Node("Transpose", name=f"{name}__to_nhwc", attrs={"perm": TO_NHWC}, inputs=[x], outputs=[x_nhwc])]
    if b is None:
        nodes.append(gs.Node("MatMul", name=f"{name}__matmul", inputs=[x_nhwc, w_matrix], outputs=[y_nhwc]))
    else:
        product = gs.Variable(f"{name}__matmul_out", dtype=y.dtype, shape=y_nhwc.shape)
        nodes.append(gs.Node("MatMul", name=f"{name}__matmul", inputs=[x_nhwc, w_matrix], outputs=[product]))
        nodes.append(gs.Node("Add", name=f"{name}__bias", inputs=[product, b], outputs=[y_nhwc]))
    nodes.append(gs.Node("Transpose", name=f"{name}__to_nchw", attrs={"perm": TO_NCHW}, inputs=[y_nhwc], outputs=[gs.Variable(f"{name}__y")]))
    replace(graph, match, nodes)


def _permute(shape, perm):
    if shape is None or len(shape) != len(perm):
        return None
    return [shape[p] for p in perm]
