"""Refuse, with one line, a model whose graph is not a valid ONNX graph or is outside what onnxopt handles.

graphsurgeon imports almost anything and exports it again, so an invalid input would otherwise
come out as an invalid output with exit 0 (or crash somewhere deep in a pass). Checked on the
ModelProto, before import, in O(nodes):

* names are UTF-8 (protobuf hands back ``bytes`` for a proto2 string that is not);
* graph inputs and outputs are tensors (sequence, optional, map and sparse types are not handled);
* every tensor has one producer: a graph input, an initializer (which may share its name with a
  graph input: the input's default) or one node output; graph output names are unique;
* every node input and graph output has a producer, in this graph or an enclosing one;
* the nodes have no cycle (they need not be listed in order: graphsurgeon sorts them).

Subgraphs (If/Loop/Scan bodies) are checked the same way, with the enclosing graphs' tensors in scope.
"""

from __future__ import annotations

from collections import deque

import onnx
from google.protobuf.descriptor import FieldDescriptor

from onnxopt.errors import ModelLoadError, UnsupportedModelError


def check_model_structure(proto: onnx.ModelProto, where: str) -> None:
    """Raise :class:`ModelLoadError` (invalid model) or :class:`UnsupportedModelError` for ``proto``."""
    _check_utf8(proto, where)
    for label, infos in (("input", proto.graph.input), ("output", proto.graph.output)):
        for info in infos:
            kind = info.type.WhichOneof("value")
            if kind != "tensor_type":
                raise UnsupportedModelError(
                    f"{where}: graph {label} '{info.name}' is not a tensor ({(kind or 'no').replace('_type', '')} type); "
                    "onnxopt handles models whose inputs and outputs are tensors")
    _check_graph(proto.graph, where, outer=frozenset())


def _check_utf8(message, where: str) -> None:
    for field, value in message.ListFields():
        if field.type == FieldDescriptor.TYPE_STRING:
            for text in (value if field.is_repeated else (value,)):
                if isinstance(text, bytes):
                    raise ModelLoadError(f"invalid model {where}: {field.containing_type.name}.{field.name} {text!r} is not UTF-8")
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in (value if field.is_repeated else (value,)):
                _check_utf8(item, where)  # (payloads are bytes or numbers: never walked element by element)


def _check_graph(graph: onnx.GraphProto, where: str, outer: frozenset[str]) -> None:
    def invalid(why: str) -> ModelLoadError:
        scope = f" (subgraph '{graph.name}')" if outer else ""
        return ModelLoadError(f"invalid model {where}{scope}: {why}")

    producer: dict[str, str] = {}
    for info in graph.input:
        if info.name in producer:
            raise invalid(f"graph input '{info.name}' is listed twice")
        producer[info.name] = "graph input"
    initializers: set[str] = set()
    for init in graph.initializer:
        if init.name in initializers:
            raise invalid(f"initializer '{init.name}' is listed twice")
        initializers.add(init.name)
        producer.setdefault(init.name, "initializer")  # beside a graph input of that name: its default
    for node in graph.node:
        for name in filter(None, node.output):
            if name in producer:
                raise invalid(f"tensor '{name}' has two producers: {producer[name]} and {_label(node)}")
            producer[name] = _label(node)
    in_scope = outer | producer.keys()
    for node in graph.node:
        for name in filter(None, node.input):
            if name not in in_scope:
                raise invalid(f"{_label(node)} reads '{name}', which no node, initializer or graph input produces")
        for sub in _subgraphs(node):
            _check_graph(sub, where, frozenset(in_scope))
    seen_outputs: set[str] = set()
    for info in graph.output:
        if info.name in seen_outputs:
            raise invalid(f"graph output '{info.name}' is listed twice")
        seen_outputs.add(info.name)
        if info.name not in in_scope:
            raise invalid(f"graph output '{info.name}' is produced by nothing")
    _check_acyclic(graph, invalid)


def _check_acyclic(graph: onnx.GraphProto, invalid) -> None:
    """Kahn's algorithm over the node-to-node edges (subgraph reads of this graph's tensors included)."""
    made_by = {name: i for i, node in enumerate(graph.node) for name in node.output if name}
    consumers: list[set[int]] = [set() for _ in graph.node]
    waiting = [0] * len(graph.node)
    for i, node in enumerate(graph.node):
        for name in set(filter(None, node.input)) | _outer_reads(node):
            j = made_by.get(name)
            if j is not None and i not in consumers[j]:
                consumers[j].add(i)
                waiting[i] += 1
    ready = deque(i for i, n in enumerate(waiting) if n == 0)
    done = 0
    while ready:
        j = ready.popleft()
        done += 1
        for i in consumers[j]:
            waiting[i] -= 1
            if waiting[i] == 0:
                ready.append(i)
    if done < len(graph.node):
        stuck = next(graph.node[i] for i, n in enumerate(waiting) if n > 0)
        raise invalid(f"the graph has a cycle (through {_label(stuck)})")


def _subgraphs(node: onnx.NodeProto):
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _outer_reads(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read but do not define (their implicit inputs)."""
    reads: set[str] = set()
    for sub in _subgraphs(node):
        defined = {i.name for i in sub.input} | {i.name for i in sub.initializer}
        defined |= {name for n in sub.node for name in n.output}
        used = {name for n in sub.node for name in n.input if name} | {o.name for o in sub.output}
        for n in sub.node:
            used |= _outer_reads(n)
        reads |= used - defined
    return reads


def _label(node: onnx.NodeProto) -> str:
    return f"node '{node.name}' ({node.op_type})" if node.name else f"a {node.op_type} node"
