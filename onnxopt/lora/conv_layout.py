"""An NhwcConv whose weight a LoRA changes becomes a channels-first Conv between Transposes.

    x_nhwc ─ NhwcConv(W (M,kH,kW,C/g), [B]) ─ y_nhwc
        ==>
    x_nhwc ─ Transpose(0,3,1,2) ─ Conv(Transpose(W, (0,3,1,2)), [B]) ─ Transpose(0,2,3,1) ─ y_nhwc

Why: ONNX Runtime's CUDA EP takes an NhwcConv only with a constant weight (it packs the weight once,
at session creation); with the weight a graph input it assigns the node to no provider and the
session fails ("Provider type for NhwcConv node ... is not set"). Conv reads its weight at run
time. The rewrite is exact: NhwcConv is Conv with X, W and Y channels-last, and every attribute
(auto_pad, dilations, group, kernel_shape, pads, strides) means what it means for Conv, so the
node's attributes are copied as they are. The weight stays an input in its stored (channels-last)
layout, where the LoRA update graph writes it (see the weight maps); ONNX Runtime cancels the
Transpose on x against the one in front of it, if any.

Conditions: the node is com.microsoft NhwcConv and its weight or bias is one of ``weights`` (the
initializers that become graph inputs). Every other NhwcConv keeps its constant weight and layout.
"""

from __future__ import annotations

import onnx
from onnx import helper

from onnxopt.domains import MS_DOMAIN


def channels_first(rank: int) -> list[int]:
    """Transpose perm: channels-last (N, spatial..., C) -> channels-first (N, C, spatial...)."""
    return [0, rank - 1, *range(1, rank - 1)]


def channels_last(rank: int) -> list[int]:
    """Transpose perm: channels-first -> channels-last."""
    return [0, *range(2, rank), 1]


def varying_nhwc_convs(graph: onnx.GraphProto, weights: set[str]) -> list[int]:
    """The positions in ``graph.node`` of the NhwcConv nodes whose weight or bias is in ``weights``."""
    return [k for k, n in enumerate(graph.node)
            if n.domain == MS_DOMAIN and n.op_type == "NhwcConv" and set(n.input[1:3]) & weights]


def nhwc_convs_as_conv(graph: onnx.GraphProto, weights: set[str], ranks: dict[str, int]) -> int:
    """Rewrites, in place, each NhwcConv of ``graph`` whose weight or bias is in ``weights`` as the
    diagram says (``ranks``: the weight's rank by initializer name). Returns how many."""
    varying = set(varying_nhwc_convs(graph, weights))
    if not varying:
        return 0
    taken = {name for n in graph.node for name in (*n.input, *n.output, n.name)}
    taken |= {v.name for v in (*graph.input, *graph.output, *graph.initializer)}

    def fresh(base: str) -> str:
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        return name

    nodes = []
    for k, node in enumerate(graph.node):
        if k not in varying:
            nodes.append(node)
            continue
        x, w, *bias = node.input
        rank = ranks[w]
        stem = node.name or node.output[0]
        x_first, w_first, y_first = (fresh(f"{stem}/{part}") for part in ("x_nchw", "w_oihw", "y_nchw"))
        conv = helper.make_node("Conv", [x_first, w_first, *bias], [y_first], name=fresh(f"{stem}/Conv"))
        conv.attribute.extend(node.attribute)
        nodes += [helper.make_node("Transpose", [x], [x_first], name=fresh(f"{stem}/x_to_nchw"), perm=channels_first(rank)),
                  helper.make_node("Transpose", [w], [w_first], name=fresh(f"{stem}/w_to_oihw"), perm=channels_first(rank)),
                  conv,
                  helper.make_node("Transpose", [y_first], [node.output[0]], name=fresh(f"{stem}/y_to_nhwc"),
                                   perm=channels_last(rank))]
    del graph.node[:]
    graph.node.extend(nodes)
    return len(varying)


__all__ = ["channels_first", "channels_last", "nhwc_convs_as_conv", "varying_nhwc_convs"]
