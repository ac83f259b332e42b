"""Executable checks for the graph properties passes ``provide`` and ``preserve`` (onnxopt.pass_infra).

A property label is a promise: ``SHAPES_INFERRED`` says every tensor ONNX shape inference can type
carries its dtype and shape, so a fusion that ``preserves`` it promises to annotate what it writes.
``ENSURES[label](model)`` returns what breaks the promise (None: it holds). The pass manager runs
the checks after every step while :func:`checking` is on: in the tests, and under ``--debug``; a
broken promise is a bug in the pass that last claimed the property (:class:`PropertyViolation`).

``constants-folded`` says no node is left whose inputs are all constants and whose result the
folder would have computed: a standard-domain, deterministic node without subgraphs, reading no
externally stored weight, with an output of at most ``FOLD_SIZE_THRESHOLD`` bytes (larger constant
results, the ConstantOfShape zeros of a static export, stay computed at run time on purpose).

Labels without a check (``attention-canonical``, ``slices-as-split``) are promises about what a
pass chose to do, which only the pass's own rules can judge.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import shape_inference

from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, NO_DEAD_NODES, SHAPES_INFERRED
from onnxopt.pattern.constants import is_constant
from onnxopt.weights import BFLOAT16, is_external, numpy_dtype

LIMIT = 5  # tensors or nodes named in a violation
# fold-constants leaves constant results larger than this computed at run time (model size).
FOLD_SIZE_THRESHOLD = 16 << 20
# Ops whose result is not a function of their inputs: never folded.
NONDETERMINISTIC_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                                  "Multinomial", "Bernoulli"})


class PropertyViolation(AssertionError):
    """A pass claimed a property that does not hold after it: a bug in that pass."""


def dead_nodes(model: Model) -> str | None:
    """no-dead-nodes: every node computes something that is read or is a graph output."""
    graph = model.graph
    outputs = {id(t) for t in graph.outputs}
    dead = [n.name or n.op for n in graph.nodes if not any(t.outputs or id(t) in outputs for t in n.outputs)]
    return f"{len(dead)} dead node(s): {', '.join(dead[:LIMIT])}" if dead else None


def unannotated_tensors(model: Model) -> str | None:
    """shapes-inferred: no tensor ONNX shape inference types lacks the dtype (or the shape) it infers."""
    skeleton = model.skeleton()
    del skeleton.graph.value_info[:]
    inferred = shape_inference.infer_shapes(skeleton, check_type=False, strict_mode=False, data_prop=True)
    tensors = model.graph.tensors()
    missing = []
    for info in list(inferred.graph.value_info) + list(inferred.graph.output):
        tensor = tensors.get(info.name)
        if not isinstance(tensor, gs.Variable) or not info.type.HasField("tensor_type"):
            continue
        typed = info.type.tensor_type
        if (typed.elem_type and tensor.dtype is None) or (typed.HasField("shape") and tensor.shape is None):
            missing.append(info.name)
    return f"{len(missing)} tensor(s) shape inference types are not annotated: {', '.join(missing[:LIMIT])}" if missing else None


def unfolded_constants(model: Model) -> str | None:
    """constants-folded: no node the folder computes is left reading constants only (module docstring)."""
    left = [n.name or n.op for n in model.graph.nodes if _foldable(n)]
    return f"{len(left)} node(s) compute from constants only: {', '.join(left[:LIMIT])}" if left else None


def _foldable(node: gs.Node) -> bool:
    if node.op == "Constant" or node.op in NONDETERMINISTIC_OPS or node.domain not in ("", "ai.onnx", None):
        return False
    if not node.inputs or any(isinstance(v, gs.Graph) for v in node.attrs.values()):
        return False
    inputs = [t for t in node.inputs if t.name]  # optional inputs left out
    if not inputs or not all(is_constant(t) for t in inputs):
        return False
    if any(isinstance(t, gs.Constant) and is_external(t) for t in inputs):
        return False
    if needs_bfloat16_kernel(node):
        return False
    return all(_within_threshold(t) for t in node.outputs)


# ONNX Runtime's CPU build, which the folder evaluates with, reads bfloat16 in these; most arithmetic
# (MatMul, Mul, Add...) has no bfloat16 kernel. Its Python API returns no bfloat16 array at all.
BFLOAT16_READING_CPU_OPS = frozenset({"Cast", "Shape", "Size"})


def needs_bfloat16_kernel(node: gs.Node) -> bool:
    """ONNX Runtime's CPU build cannot evaluate the node for the folder: it writes bfloat16, or
    reads it in an op that has no bfloat16 CPU kernel."""
    if node.op == "Cast" and int(node.attrs.get("to", 0)) == onnx.TensorProto.BFLOAT16:
        return True
    if any(_is_bfloat16(t) for t in node.outputs):
        return True
    return node.op not in BFLOAT16_READING_CPU_OPS and any(_is_bfloat16(t) for t in node.inputs)


def _is_bfloat16(tensor: gs.Tensor) -> bool:
    return bool(tensor.name) and tensor.dtype is not None and numpy_dtype(tensor.dtype) == BFLOAT16


def _within_threshold(tensor: gs.Tensor) -> bool:
    """The tensor's size is known and at most the folder's threshold."""
    shape, dtype = tensor.shape, tensor.dtype
    if shape is None or dtype is None or not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
        return False  # the folder would have had to compute it to know; a static-shape miss is what this catches
    try:
        itemsize = numpy_dtype(dtype).itemsize
    except TypeError:
        return False
    return int(np.prod(shape, dtype=np.int64)) * itemsize <= FOLD_SIZE_THRESHOLD


ENSURES: dict[str, Callable[[Model], str | None]] = {
    NO_DEAD_NODES: dead_nodes,
    SHAPES_INFERRED: unannotated_tensors,
    CONSTANTS_FOLDED: unfolded_constants,
}

_checking = False


def is_checking() -> bool:
    return _checking


@contextlib.contextmanager
def checking(on: bool = True) -> Iterator[None]:
    """Within the block, the pass manager checks every claimed property after every step."""
    global _checking
    before, _checking = _checking, on
    try:
        yield
    finally:
        _checking = before


def check(model: Model, properties, after: str) -> None:
    """Raise PropertyViolation if one of ``properties`` (claimed after the pass ``after``) does not hold."""
    for prop in sorted(properties):
        ensure = ENSURES.get(prop)
        problem = ensure(model) if ensure is not None else None
        if problem:
            raise PropertyViolation(f"after {after}: '{prop}' is claimed but does not hold: {problem}")
