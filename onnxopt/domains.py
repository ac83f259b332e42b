"""The operator domains onnxopt reads and writes."""

from __future__ import annotations

import onnx_graphsurgeon as gs

MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops (GroupNorm, MultiHeadAttention, BiasAdd, ...)
STANDARD_DOMAINS = ("", "ai.onnx", None)  # how a graph may spell the default domain


def is_standard(node: gs.Node) -> bool:
    """The node is a default-domain (ai.onnx) op."""
    return node.domain in STANDARD_DOMAINS
