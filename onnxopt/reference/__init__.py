"""NumPy reference kernels for the ONNX Runtime com.microsoft contrib ops our passes emit.

ONNX Runtime's CPU build lacks kernels for several of them (GroupNorm, NhwcConv, packed-QKV
MultiHeadAttention, ...), so fused graphs are checked on CPU with onnx's ReferenceEvaluator
plus these kernels::

    from onnxopt import reference
    outputs = reference.run(model, {"sample": x})          # {output name: array}
    reference.unsupported_on_ort_cpu(model)                 # {"com.microsoft.GroupNorm", ...}

``CONTRIB_OPS`` also works as ``ReferenceEvaluator(model, new_ops=CONTRIB_OPS)``; ``evaluator()``
additionally fixes the stock evaluator's handling of unbound optional outputs (see _Evaluator).

Semantics follow ONNX Runtime's docs/ContribOperators.md and, where the text is silent, its
CUDA/CPU kernels. Spec features a kernel does not implement raise NotImplementedError naming
the attribute, input or shape; inputs the spec does not allow raise ValueError. Each class
docstring gives the formula and lists what is supported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import NodeProto
from onnx.reference import ReferenceEvaluator

from ._common import MS_DOMAIN
from .activations import BiasAdd, BiasGelu, BiasSplitGelu, FastGelu, Gelu, QuickGelu
from .attention import Attention, MultiHeadAttention, RotaryEmbedding
from .conv import NhwcConv
from .gemm_float8 import GemmFloat8
from .norms import (
    GroupNorm,
    SimplifiedLayerNormalization,
    SkipGroupNorm,
    SkipLayerNormalization,
    SkipSimplifiedLayerNormalization,
)

__all__ = ["CONTRIB_OPS", "evaluator", "run", "unsupported_on_ort_cpu"]

CONTRIB_OPS: list[type] = [
    GroupNorm,
    SkipGroupNorm,
    SkipLayerNormalization,
    SkipSimplifiedLayerNormalization,
    SimplifiedLayerNormalization,
    BiasSplitGelu,
    BiasAdd,
    FastGelu,
    BiasGelu,
    QuickGelu,
    Gelu,
    NhwcConv,
    MultiHeadAttention,
    Attention,
    RotaryEmbedding,
    GemmFloat8,
]


class _Evaluator(ReferenceEvaluator):
    """ReferenceEvaluator that leaves unbound optional outputs unstored.

    The stock evaluator stores every value a node returns under the node's output names, ""
    included, and "" is also how it resolves omitted optional inputs (to None). So e.g.
    LayerNormalization(outputs=["y", "", "inv_std"]) followed by Clip(x, "", max) clips at the
    mean. Here every node's results bound to "" are dropped (subgraphs and functions use this
    class too).
    """

    def _init(self) -> None:
        super()._init()
        for node in self.rt_nodes_:
            names = list(getattr(node, "onnx_node", NodeProto()).output)
            if "" in names:
                node.run = _drop_unbound(node.run, names)

    def run_observed(self, feeds: dict[str, np.ndarray], observe) -> dict[str, np.ndarray]:
        """Run the graph, calling ``observe(name, value)`` on every value a node computes, and
        return the graph outputs. Unlike ``run(..., intermediate=True)``, which holds every
        intermediate until the end (4.5 GB for SDXL's VAE decoder at a 32x32 latent), a value is
        dropped after its last reader, so memory stays at what the live values need.

        Graphs with nodes that read the outer scope (If/Loop/Scan) run through ``run`` instead,
        whose results are then observed: what a subgraph reads is not visible here."""
        if any(node.need_context() for node in self.rt_nodes_):
            results = self.run(None, feeds, intermediate=True)
            for name, value in results.items():
                if name not in feeds and name not in self.rt_inits_ and name:
                    observe(name, value)
            return {name: results[name] for name in self.output_names_}
        last_read = {name: i for i, node in enumerate(self.rt_nodes_) for name in node.input}
        keep = set(self.output_names_)
        results = {"": None, **self.rt_inits_, **feeds}
        for i, node in enumerate(self.rt_nodes_):
            outputs = node.run(*[results[name] for name in node.input])
            for name, value in zip(node.output, outputs):
                if name:
                    observe(name, value)
                    results[name] = value
            for name in {*node.input, *node.output}:
                if name not in keep and name not in self.rt_inits_ and last_read.get(name, -1) <= i:
                    results.pop(name, None)
        return {name: results[name] for name in self.output_names_}


def _drop_unbound(run, names: list[str]):
    def wrapped(*args, **kwargs):
        return tuple(None if name == "" else value for name, value in zip(names, run(*args, **kwargs)))

    return wrapped


def evaluator(model: onnx.ModelProto | str | os.PathLike) -> ReferenceEvaluator:
    """A ReferenceEvaluator for ``model`` (a ModelProto or a path) that knows the contrib ops."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    return _Evaluator(model, new_ops=CONTRIB_OPS)


def run(
    model: onnx.ModelProto | str | os.PathLike,
    feeds: dict[str, np.ndarray],
    output_names: list[str] | None = None,
) -> dict[str, np.ndarray]:
    """Evaluates ``model`` on ``feeds``; returns {output name: value} (all graph outputs by default)."""
    ev = evaluator(model)
    names = list(output_names) if output_names is not None else list(ev.output_names)
    return dict(zip(names, ev.run(names, feeds), strict=True))


# Contrib ops ORT's CPU EP can't run. GroupNorm, SkipGroupNorm, BiasSplitGelu, BiasAdd and
# NhwcConv (and GemmFloat8: cuBLASLt) have CUDA/ROCm kernels only; for MultiHeadAttention and Attention only some forms fail.
# Ops outside CONTRIB_OPS are left to ORT: reporting them would route a model to the reference
# evaluator, which cannot run them either.
_NO_CPU_KERNEL = {"GroupNorm", "SkipGroupNorm", "BiasSplitGelu", "BiasAdd", "NhwcConv", "GemmFloat8"}


def _has_input(node: onnx.NodeProto, i: int) -> bool:
    return i < len(node.input) and node.input[i] != ""


def _cpu_cannot_run(node: onnx.NodeProto, ranks: dict[str, int]) -> bool:
    if node.op_type in _NO_CPU_KERNEL:
        return True
    if node.op_type == "MultiHeadAttention":
        # The CPU kernel rejects packed QKV (query (B, S, N, 3, H), key and value absent) and
        # packed KV (key (B, L, N, 2, H), value absent) at run time.
        packed = not (_has_input(node, 1) and _has_input(node, 2))
        return packed or ranks.get(node.input[0]) == 5 or ranks.get(node.input[1]) == 5
    if node.op_type == "Attention":
        # ORT 1.31's CPU Attention kernel crashes the process (segfault) when the optional bias is absent.
        return not _has_input(node, 2)
    return False


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


def _known_ranks(graph: onnx.GraphProto) -> dict[str, int]:
    ranks = {init.name: len(init.dims) for init in graph.initializer}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        tt = vi.type.tensor_type
        if tt.HasField("shape"):
            ranks[vi.name] = len(tt.shape.dim)
    return ranks


def unsupported_on_ort_cpu(model: onnx.ModelProto) -> set[str]:
    """Names like "com.microsoft.GroupNorm" of the contrib ops in ``model`` that ORT's CPU EP can't run.

    Reports GroupNorm, SkipGroupNorm, BiasSplitGelu, BiasAdd, NhwcConv and GemmFloat8 always,
    MultiHeadAttention with packed QKV or packed KV (a key or value input absent, or a 5-D
    query/key where value_info gives ranks) and Attention without bias. Conservative: a node is
    reported whenever one of its forms might fail. Subgraphs (If/Loop/Scan bodies) are searched too.
    """
    found: set[str] = set()
    for graph in _graphs(model.graph):
        ranks = _known_ranks(graph)
        for node in graph.node:
            if node.domain != MS_DOMAIN:
                continue
            if _cpu_cannot_run(node, ranks):
                found.add(f"{MS_DOMAIN}.{node.op_type}")
    return found
