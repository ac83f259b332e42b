"""Pins of the optimized graphs: what each preset writes for every fixture and tiny export.

A *fingerprint* says what an optimized graph is without depending on the names passes give:

* ``ops``: the op multiset (``domain::op`` -> count; the standard domain is ``""``),
* ``connectivity``: a hash of the graph as a DAG of ops, attributes and edges, where a tensor is
  known by what computes it (its producer's op, attributes and inputs, recursively), a graph
  input by its name and a weight by its dtype and shape only,
* ``weights``: a hash of the multiset of weight values (initializers and Constant nodes),
* ``graph``: the connectivity hash with every weight known by its value as well, so a weight
  that moved to another consumer changes it even when the multiset does not change.

``tests/pinned_graphs.json`` holds the fingerprints of every case (committed fixture or tiny
family x export variant, under ``ort-cuda``, ``ort-cuda,fp16`` and ``tensorrt``), made by::

    PYTHONPATH=$PWD python3 -m tests.graph_pins            # every case (exports 80 tiny models: ~15 min)
    PYTHONPATH=$PWD python3 -m tests.graph_pins --only fixture:   # the cases whose key starts so

``tests/test_pinned_graphs.py`` recomputes them and compares.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from importlib import metadata
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[1]
PINS = Path(__file__).resolve().parent / "pinned_graphs.json"
PRESETS = ("ort-cuda", "ort-cuda,fp16", "tensorrt")
# Exports differ between versions of these (and the pins with them): the pins say which they were made with.
VERSIONED = ("torch", "onnx", "onnxscript", "diffusers", "transformers", "numpy", "onnx-graphsurgeon", "onnxruntime")


def _sha(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\x00")
    return h.hexdigest()


def _tensor_digest(tensor: onnx.TensorProto) -> str:
    array = numpy_helper.to_array(tensor)
    return _sha(array.dtype.str, array.shape, np.ascontiguousarray(array).tobytes())


def _tensor_kind(tensor: onnx.TensorProto) -> str:
    return f"{tensor.data_type}{list(tensor.dims)}"


def _attribute(attr: onnx.AttributeProto, with_values: bool) -> str:
    if attr.type == onnx.AttributeProto.TENSOR:
        return f"{attr.name}=tensor:" + (_tensor_digest(attr.t) if with_values else _tensor_kind(attr.t))
    if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        return f"{attr.name}=graphs:" + ",".join(_graph_hash(g, with_values) for g in graphs)
    value = onnx.helper.get_attribute_value(attr)
    return f"{attr.name}={value!r}"


def _graph_hash(graph: onnx.GraphProto, with_values: bool, outer: dict[str, str] | None = None) -> str:
    """A Merkle hash of ``graph``: each tensor hashed from what computes it, names left out."""
    known: dict[str, str] = dict(outer or {})
    for value in graph.input:
        if value.name not in known:
            known[value.name] = _sha("input", value.name)
    for init in graph.initializer:
        known[init.name] = _sha("weight", _tensor_digest(init) if with_values else _tensor_kind(init))
    producer = {out: node for node in graph.node for out in node.output if out}
    node_hashes: dict[int, str] = {}

    def tensor(name: str) -> str:
        if name == "":
            return "absent"
        if name in known:
            return known[name]
        node = producer.get(name)
        if node is None:  # read from an enclosing graph that did not name it: a free variable
            known[name] = _sha("free", name)
            return known[name]
        # Iterative post-order: graphs are deep enough to exceed Python's recursion limit.
        stack = [node]
        while stack:
            top = stack[-1]
            if id(top) in node_hashes:
                stack.pop()
                continue
            pending = [producer[i] for i in top.input
                       if i and i not in known and i in producer and id(producer[i]) not in node_hashes]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            inputs = [known.get(i) or ("absent" if not i else _sha("free", i)) for i in top.input]
            attrs = sorted(_attribute(a, with_values) for a in top.attribute)
            h = _sha("node", top.domain or "", top.op_type, attrs, inputs)
            node_hashes[id(top)] = h
            for index, out in enumerate(top.output):
                if out:
                    known[out] = _sha(h, index)
        return known[name]

    outputs = [(value.name, tensor(value.name)) for value in graph.output]
    for node in graph.node:  # nodes no output reads (there should be none) count too
        for out in node.output:
            if out:
                tensor(out)
    return _sha("graph", outputs, sorted(node_hashes.values()))


def fingerprint(proto: onnx.ModelProto) -> dict:
    """The fingerprint of an optimized model (see the module docstring)."""
    graph = proto.graph
    ops = Counter(f"{n.domain or ''}::{n.op_type}" for n in graph.node)
    weights = [_tensor_digest(t) for t in graph.initializer]
    weights += [_tensor_digest(a.t) for n in graph.node for a in n.attribute if a.type == onnx.AttributeProto.TENSOR]
    opsets = {o.domain or "ai.onnx": o.version for o in proto.opset_import}
    return {
        "nodes": len(graph.node),
        "ops": dict(sorted(ops.items())),
        "opsets": dict(sorted(opsets.items())),
        "connectivity": _graph_hash(graph, with_values=False),
        "weights": _sha("weights", sorted(weights)),
        "graph": _graph_hash(graph, with_values=True),
    }


# ------------------------------------------------------------------------------------ cases


def fixture_cases() -> list[str]:
    return [f"fixture:{p.name}" for p in sorted((ROOT / "models" / "fixtures").glob("*.onnx"))]


def export_cases() -> list[str]:
    from models import EXPORT_VARIANTS, FAMILIES, OPSET_VARIANTS

    cases = []
    for family in FAMILIES:
        for variant in list(EXPORT_VARIANTS) + list(OPSET_VARIANTS):
            cases.append("export:" + ".".join([family, *variant[:3]] + ([f"opset{variant[3]}"] if len(variant) > 3 else [])))
    return cases


def all_keys() -> list[str]:
    return [f"{case}|{preset}" for case in fixture_cases() + export_cases() for preset in PRESETS]


def export_args(case: str) -> tuple[str, str, str, str, int | None]:
    """(family, exporter, shapes, attention, opset) of an ``export:`` case."""
    family, exporter, shapes, attention, *rest = case.removeprefix("export:").split(".")
    return family, exporter, shapes, attention, int(rest[0].removeprefix("opset")) if rest else None


def optimized_fingerprint(path: Path, preset: str, check_properties: bool = False) -> dict:
    """Optimize ``path`` with ``preset`` (comma-separated passes/presets) and fingerprint the result;
    a run that raises is pinned as its error. ``check_properties``: every property a pass claims
    is checked after it (onnxopt.properties); a broken claim raises."""
    from onnxopt import optimize
    from onnxopt.properties import PropertyViolation, checking

    try:
        with checking(check_properties):
            model, _ = optimize(path, preset.split(","))
    except PropertyViolation:
        raise
    except Exception as exc:  # pinned too: a rewrite must not start or stop failing
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    return fingerprint(model.to_onnx())


def versions() -> dict[str, str]:
    out = {}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def load_pins() -> dict:
    return json.loads(PINS.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="regenerate tests/pinned_graphs.json")
    parser.add_argument("--only", default="", help="regenerate only the cases whose key starts with this")
    args = parser.parse_args(argv)
    import tempfile

    old = load_pins() if PINS.exists() else {"pins": {}}
    pins = dict(old.get("pins", {}))
    keys = [k for k in all_keys() if k.startswith(args.only)]
    with tempfile.TemporaryDirectory() as tmp:
        exported: dict[str, Path] = {}
        for key in keys:
            case, preset = key.split("|")
            if case.startswith("fixture:"):
                path = ROOT / "models" / "fixtures" / case.removeprefix("fixture:")
            else:
                if case not in exported:
                    from models import build
                    from models.export import export

                    family, exporter, shapes, attention, opset = export_args(case)
                    path = Path(tmp) / case.replace(":", "-") / f"{family}.onnx"
                    export(build(family, size="tiny", attention=attention), path, exporter=exporter, shapes=shapes, opset=opset)
                    exported[case] = path
                path = exported[case]
            pins[key] = optimized_fingerprint(path, preset)
            print(key, pins[key].get("nodes", pins[key].get("error")), flush=True)
    pins = {k: pins[k] for k in all_keys() if k in pins}
    PINS.write_text(json.dumps({"versions": versions(), "regenerate": "PYTHONPATH=$PWD python3 -m tests.graph_pins",
                                "pins": pins}, indent=1, sort_keys=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
