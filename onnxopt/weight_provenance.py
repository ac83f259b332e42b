"""Where each source weight went: the map from a torch parameter to the initializers that hold it.

A LoRA changes a torch module's weight (``W' = W + s * B @ A``), but the optimizer moves weights:
fuse-attention packs Q/K/V side by side or head-interleaved, parallel-gemm and context-kv
concatenate GEMMs, nhwc-conv transposes conv weights (a 1x1 one into a matrix), fuse-bias-split-gelu
swaps a weight's halves, fp16 casts. Each of those is linear in its sources, so a delta follows
the weight through the same rearrangement. The optimizer keeps that rearrangement here:

    loading   each initializer of an exported file starts as its parameter (:func:`record_origins`):
              the exporter's name (``unet.conv_in.weight``), else the module of the node that reads
              it (TorchScript: ``/unet/down_blocks.0/.../to_q/MatMul``; dynamo: the node's
              ``pkg.torch.onnx.name_scopes``), a MatMul's weight being the parameter transposed;
              a file with ``<stem>.weights.json`` beside it (written by ``onnxopt optimize`` on a
              folder) starts from that map instead
    passes    one call where they derive a weight from others (:func:`record`): the sources and
              the ops that carry a source's delta into the result
    saving    ``save_model(..., weight_map=True)`` writes ``<stem>.weights.json`` beside the model

A map entry, per initializer of the saved file::

    "qkv.weight": {"dtype": "float16", "shape": [320, 960],
                   "from": [{"source": "unet.down_blocks.0....attn1.to_q.weight",
                             "ops": [["transpose", [1, 0]], ["reshape", [320, 8, 1, 40]],
                                     ["place", [320, 8, 3, 40], [0, 0, 0, 0]], ["reshape", [320, 960]]]}, ...]}

The ops, applied in order to a delta of the source's shape (:func:`carry`): ``transpose`` (perm),
``reshape`` (shape), ``slice`` (starts, ends) and ``place`` (into zeros of a shape, at starts).
The result's delta is the sum over its sources. A weight computed by anything not recorded (a
value no rule traces) has no entry: a LoRA on it is refused, never applied to the wrong place.
"""

from __future__ import annotations

import json
import re
import weakref
from pathlib import Path

import numpy as np

MAP_SUFFIX = ".weights.json"
MAP_FORMAT = "onnxopt weight map 1"
WEIGHT_READERS = {"MatMul": 1, "Gemm": 1, "Conv": 0}  # op -> ... (the weight is input 1 of each)


def transpose(perm) -> list:
    return ["transpose", [int(p) for p in perm]]


def reshape(shape) -> list:
    return ["reshape", [int(d) for d in shape]]


def take(starts, ends) -> list:
    return ["slice", [int(s) for s in starts], [int(e) for e in ends]]


def place(shape, starts) -> list:
    return ["place", [int(d) for d in shape], [int(s) for s in starts]]


def concatenated(shapes: list, axis: int) -> list[list]:
    """The ops of each part of ``np.concatenate(parts, axis)``, parts of ``shapes``."""
    total = list(shapes[0])
    total[axis] = sum(s[axis] for s in shapes)
    ops, offset = [], 0
    for shape in shapes:
        starts = [0] * len(total)
        starts[axis] = offset
        ops.append([place(total, starts)])
        offset += shape[axis]
    return ops


# --- the record: values object -> its sources, kept as long as the values live ------------------

_RECORD: dict[int, tuple] = {}  # id(values) -> (weakref to values, [(source values or parameter name, ops)])


def record(values, parts):
    """``values`` (an array or lazy values) is the sum over ``parts`` of ``(source, ops)``: ``source``
    a values object (a constant's stored values) or a parameter name. Returns ``values``."""
    try:
        # the callback holds the dict itself: at interpreter exit the module's globals are None before
        # the last values die, and a callback reading _RECORD then printed 'Exception ignored' tracebacks
        ref = weakref.ref(values, lambda _, key=id(values), table=_RECORD: table.pop(key, None))
    except TypeError:  # a Python scalar: no weight
        return values
    _RECORD[id(values)] = (ref, [(source, [list(op) for op in ops]) for source, ops in parts])
    return values


def record_sources(values, constants, ops_per_source):
    """:func:`record` for a result derived from graph tensors ``constants`` (graphsurgeon), each
    carried by its ops; left untraced when one is not an initializer (a Constant node's value)."""
    from onnx_graphsurgeon import Constant

    if not all(isinstance(c, Constant) for c in constants):
        return values
    return record(values, [(c._values, ops) for c, ops in zip(constants, ops_per_source)])


def _parts(values) -> list | None:
    entry = _RECORD.get(id(values))
    return entry[1] if entry is not None and entry[0]() is values else None


def sources(values) -> list[tuple[str, list]]:
    """``values`` as (parameter name, ops) pairs, through every recorded derivation; [] if untraced."""
    parts = _parts(values)
    if parts is None:
        return []
    out = []
    for source, ops in parts:
        if isinstance(source, str):
            out.append((source, ops))
            continue
        inner = sources(source)
        if not inner:  # one untraced part makes the whole untraced: a delta would be incomplete
            return []
        out += [(name, first + ops) for name, first in inner]
    return out


# --- loading: what each initializer of a file is ------------------------------------------------

def module_of(node_name: str, scope: str | None) -> str | None:
    """The torch module a node belongs to: the dynamo exporter's innermost name scope
    (:func:`onnxopt.loading.node_scopes`), else the TorchScript exporter's node name
    ``/a/b.0/c/MatMul`` -> ``a.b.0.c``."""
    if scope:
        return scope
    parts = [p for p in (node_name or "").split("/") if p]
    return ".".join(parts[:-1]) if node_name.startswith("/") and len(parts) >= 2 else None


def exporter_sources(graph, scopes: dict | None = None) -> dict[str, list]:
    """{initializer name: [(parameter name, ops)]} for the weights of MatMul, Gemm and Conv nodes
    of an exported ``graph`` (an onnx GraphProto), from the names the exporter left."""
    scopes = scopes or {}
    weights = {t.name: list(t.dims) for t in graph.initializer}
    found: dict[str, list] = {}
    for node in graph.node:
        if node.op_type not in WEIGHT_READERS or len(node.input) < 2 or node.input[1] not in weights:
            continue
        name, dims = node.input[1], weights[node.input[1]]
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        as_stored = node.op_type == "Conv" or (node.op_type == "Gemm" and trans_b)
        if len(dims) != (4 if node.op_type == "Conv" else 2):
            continue
        if name.endswith(".weight") and as_stored:
            entry = [(name, [])]
        else:
            module = module_of(node.name, scopes.get(node.name))
            if module is None:
                continue
            entry = [(f"{module}.weight", [] if as_stored else [transpose([1, 0])])]
        if found.setdefault(name, entry) != entry:  # read by two modules: no single source
            found[name] = []
    return {k: v for k, v in found.items() if v}


def map_path(model_path: str | Path) -> Path:
    path = Path(model_path)
    return path.with_name(path.stem + MAP_SUFFIX)


def read_map(model_path: str | Path) -> dict | None:
    """The weight map beside ``model_path``, or None; a malformed one is an error (ValueError)."""
    path = map_path(model_path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except RecursionError:  # nested deeper than the decoder goes: malformed, as any other bad map
        raise ValueError(f"{path}: not an onnxopt weight map (its JSON nests too deep)") from None
    if not isinstance(data, dict) or data.get("format") != MAP_FORMAT or not isinstance(data.get("tensors"), dict):
        raise ValueError(f"{path}: not an onnxopt weight map")
    return data["tensors"]


def file_sources(proto, model_path: str | Path | None, scopes: dict) -> dict[str, list]:
    """{initializer name: [(parameter name, ops)]} of a file: its map when it has one, else what
    the exporter's names say (:func:`exporter_sources`; ``scopes``: :func:`onnxopt.loading.node_scopes`)."""
    written = read_map(model_path) if model_path is not None else None
    if written is None:
        return exporter_sources(proto.graph, scopes)
    return {name: [(p["source"], p["ops"]) for p in entry["from"]] for name, entry in written.items()}


def record_origins(model, proto, model_path: str | Path | None) -> None:
    """Mark each weight of a freshly loaded ``model`` with the parameters it holds."""
    scopes = getattr(model, "node_scopes", None) or {}
    try:
        known = file_sources(proto, model_path, scopes)
    except (ValueError, KeyError, TypeError):  # a damaged map: the weights are untraced, no LoRA lands
        return
    for constant in model.constants():
        if constant.name in known:
            record(constant._values, known[constant.name])


# --- saving: the map of a model -----------------------------------------------------------------

def weight_map(model) -> dict:
    """The map of ``model``'s traced weights, as written beside it."""
    tensors = {}
    for constant in model.constants():
        found = sources(constant._values)
        if found:
            tensors[constant.name] = {"dtype": _dtype_name(constant),
                                      "shape": [int(d) for d in constant.shape],
                                      "from": [{"source": name, "ops": ops} for name, ops in found]}
    return {"format": MAP_FORMAT, "tensors": tensors}


def _dtype_name(constant) -> str:
    """The weight's element type as NumPy names it ("" where NumPy has none: bfloat16 under graphsurgeon)."""
    try:
        return str(np.dtype(constant.dtype))
    except TypeError:
        return ""


# --- applying: a source's delta carried into a weight's layout ----------------------------------

def carry(delta: np.ndarray, ops: list) -> np.ndarray:
    """``delta`` (the source parameter's shape) through ``ops``: its contribution to the weight."""
    for op in ops:
        kind = op[0]
        if kind == "transpose":
            delta = delta.transpose(op[1])
        elif kind == "reshape":
            delta = delta.reshape(op[1])
        elif kind == "slice":
            delta = delta[tuple(slice(s, e) for s, e in zip(op[1], op[2]))]
        elif kind == "place":
            full = np.zeros(op[1], delta.dtype)
            full[tuple(slice(s, s + n) for s, n in zip(op[2], delta.shape))] = delta
            delta = full
        else:
            raise ValueError(f"unknown weight map op {kind!r}")
    return delta


def carried_shape(shape, ops: list) -> tuple | None:
    """The shape :func:`carry` gives a delta of ``shape``, or None where the ops do not apply to it."""
    shape = tuple(int(d) for d in shape)
    for op in ops:
        kind = op[0]
        if kind == "transpose" and sorted(op[1]) == list(range(len(shape))):
            shape = tuple(shape[p] for p in op[1])
        elif kind == "reshape" and int(np.prod(op[1])) == int(np.prod(shape)) and min(op[1], default=0) >= 0:
            shape = tuple(op[1])
        elif kind == "slice" and len(op[1]) == len(shape) and all(0 <= s <= e <= d for s, e, d in zip(op[1], op[2], shape)):
            shape = tuple(e - s for s, e in zip(op[1], op[2]))
        elif kind == "place" and len(op[1]) == len(shape) and all(s + n <= d for s, n, d in zip(op[2], shape, op[1])):
            shape = tuple(op[1])
        else:
            return None
    return shape


def parameter_module(name: str) -> str:
    """``a.b.to_q.weight`` -> ``a.b.to_q``."""
    return re.sub(r"\.weight$", "", name)
