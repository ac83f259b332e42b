"""What a TensorRT engine is made of: its layers, as TensorRT's engine inspector lists them, and what
that says about fusion.

    layers = parse_layer_information(text)             # the inspector's one-line-per-layer format
    summary = fusion_summary(layers, op_types)          # op_types: ONNX node name -> op type

Where the text comes from: with ``ProfilingVerbosity.DETAILED`` the builder logs the engine
inspector's listing at the end of a build (a verbose message that starts with ``Layers:``), so it
is there on a machine without a GPU; an engine that can be deserialized here gives the same
listing through ``ICudaEngine.create_engine_inspector()``. One layer per line::

    Name: <layer>, LayerType: <type>, Inputs: [...], Outputs: [...], TacticName: <kernel>, ..., Metadata: [ONNX Layer: <node>][ONNX Layer: <node>]

The metadata names the ONNX nodes each layer computes: a layer with two or more is a fusion. Myelin
(TensorRT's graph compiler, which takes whole transformer and UNet blocks) names its layers
``..._myl<k>_<i>`` and its generated kernels ``__myl_<Op><Op>..._0x<hash>``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

_LAYER = re.compile(r"^Name: (?P<name>.*?), LayerType: (?P<type>[^,]*),")
_TACTIC = re.compile(r"TacticName: (?P<tactic>[^,]*),")
_ONNX_NODE = re.compile(r"\[ONNX Layer: ([^\]]*)\]")
_KERNEL_HASH = re.compile(r"_0x[0-9a-fA-F]+$")

ATTENTION_OPS = ("Attention", "MultiHeadAttention")  # the ONNX op (opset 23) and ORT's, should one reach TensorRT
NORM_OPS = ("GroupNormalization", "LayerNormalization", "InstanceNormalization")
ATTENTION_KERNEL_WORDS = ("mha", "attention", "attn", "flash")  # fused-attention kernel names (fmha, ...)


@dataclass(frozen=True)
class EngineLayer:
    name: str
    type: str
    kernel: str              # the tactic's name without its hash ("" where TensorRT gives none)
    onnx_nodes: tuple[str, ...]

    @property
    def myelin(self) -> bool:
        return "_myl" in self.name

    @property
    def fused(self) -> bool:
        return len(self.onnx_nodes) > 1


def parse_layer_information(text: str) -> list[EngineLayer]:
    """The layers of the inspector's one-line format (lines that are not a layer are skipped)."""
    layers = []
    for line in text.splitlines():
        match = _LAYER.match(line.strip())
        if not match:
            continue
        tactic = _TACTIC.search(line)
        kernel = _KERNEL_HASH.sub("", tactic.group("tactic").strip()) if tactic else ""
        layers.append(EngineLayer(match.group("name"), match.group("type").strip(), kernel,
                                  tuple(n.strip() for n in _ONNX_NODE.findall(line))))
    return layers


def fusion_summary(layers: list[EngineLayer], op_types: Mapping[str, str], source: str) -> dict:
    """What the layers say about fusion, as plain data (the report's ``engine_layers``).

    ``op_types`` maps the ONNX node names of the parsed graph to their op types, so that each layer
    can be read as the ONNX ops it computes: attention is fused where a Softmax shares its layer
    with a MatMul (or runs in a fused-attention kernel), a normalization is fused where its layer
    computes other nodes too.
    """
    ops_of = [Counter(op_types.get(n, "?") for n in layer.onnx_nodes) for layer in layers]
    softmax_layers = [(layer, ops) for layer, ops in zip(layers, ops_of) if ops["Softmax"]]
    attention_kernels = Counter(layer.kernel for layer in layers
                                if any(w in layer.kernel.lower() for w in ATTENTION_KERNEL_WORDS))
    norms = {}
    for op in NORM_OPS:  # a node may span several layers (Myelin splits one into its reductions)
        holding = [(layer, ops) for layer, ops in zip(layers, ops_of) if ops[op]]
        if holding:
            nodes = {n for layer, _ in holding for n in layer.onnx_nodes if op_types.get(n) == op}
            norms[op] = {"nodes": len(nodes), "layers": len(holding),
                         "layers_with_other_nodes": sum(1 for _, ops in holding if sum(ops.values()) > ops[op]),
                         "kernels": dict(Counter(layer.kernel or layer.type for layer, _ in holding).most_common(4))}
    return {
        "source": source,
        "layers": len(layers),
        "layer_types": dict(Counter(layer.type for layer in layers).most_common()),
        "myelin_layers": sum(layer.myelin for layer in layers),
        "fused_layers": sum(layer.fused for layer in layers),
        "onnx_nodes_in_fused_layers": sum(len(layer.onnx_nodes) for layer in layers if layer.fused),
        "attention": {
            "softmax_nodes": len({n for layer, _ in softmax_layers for n in layer.onnx_nodes if op_types.get(n) == "Softmax"}),
            "softmax_with_matmul": sum(1 for _, ops in softmax_layers if ops["MatMul"]),  # layers
            "attention_op_nodes": len({n for layer in layers for n in layer.onnx_nodes if op_types.get(n) in ATTENTION_OPS}),
            "fused_attention_kernels": dict(attention_kernels),
        },
        "normalization": norms,
        "top_kernels": dict(Counter(layer.kernel for layer in layers if layer.kernel).most_common(8)),
    }


def summary_lines(summary: dict) -> list[str]:
    """The report's lines for :func:`fusion_summary`'s data."""
    if not summary.get("layers"):
        return [f"  layers: not available ({summary.get('source', 'no layer information')})"]
    types = ", ".join(f"{t} {n}" for t, n in summary["layer_types"].items())
    attention = summary["attention"]
    lines = [
        f"  layers: {summary['layers']} ({types}); from the {summary['source']}",
        f"  fusion: {summary['fused_layers']} layers compute 2+ ONNX nodes ({summary['onnx_nodes_in_fused_layers']} nodes);"
        f" {summary['myelin_layers']} Myelin layers",
        f"  attention: {attention['softmax_nodes']} Softmax, {attention['softmax_with_matmul']} layers with a Softmax and a MatMul;"
        f" {attention['attention_op_nodes']} Attention ops; fused-attention kernels: "
        + (", ".join(f"{k} {n}" for k, n in attention["fused_attention_kernels"].items()) or "none"),
    ]
    for op, facts in summary["normalization"].items():
        kernels = ", ".join(f"{k} {n}" for k, n in facts["kernels"].items())
        lines.append(f"  {op}: {facts['nodes']} nodes in {facts['layers']} layers, {facts['layers_with_other_nodes']} of them"
                     f" with other nodes ({kernels})")
    return lines
