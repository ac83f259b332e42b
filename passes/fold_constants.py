"""fold-constants: evaluate every subgraph whose inputs are all constant, using graphsurgeon's folder,
swept until nothing more folds (constants-folded: onnxopt.properties checks it).

graphsurgeon (0.6.1) has one defect we work around: its shape folding ignores the ``start`` and
``end`` attributes of ``Shape`` (opset 15+), which the dynamo exporter uses everywhere; on static
dynamo graphs that yields wrong Reshape shapes. So before folding, each such node becomes

    Shape(x, start=a, end=b)   ==>   Slice(Shape(x), starts=[a], ends=[b])

which graphsurgeon folds correctly, and afterwards every pair that did not fold (dynamic dims)
is joined back into one ``Shape(start, end)``.

Weights are never loaded to fold them: a node that reads an externally stored constant of 1 MB or
more is excluded (exporters do not emit foldable work on weights in SD graphs, and loading a
3.4 GB UNet to find that out would defeat lazy loading). Small external constants (dynamo stores
even shape vectors externally) are read so they can take part.

The folder evaluates with ONNX Runtime's CPU build, which has no bfloat16 kernels for most ops: a
node that would need one stays computed at run time and is reported as refused. (Left in,
graphsurgeon's "basic" partitioning retries a failing partition unchanged and recurses without
bound.)
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.logger import G_LOGGER

from onnxopt.fusion import Emit, NameAuthority
from onnxopt.graph_edit import detach, is_standard, replace_output
from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, Pass, PassResult
from onnxopt.properties import FOLD_SIZE_THRESHOLD, needs_bfloat16_kernel
from onnxopt.registry import register_pass
from onnxopt.runtime import import_onnxruntime
from onnxopt.weights import constant_nbytes, is_external, read_uncached, store_values

INT64_MAX = np.iinfo(np.int64).max
LOAD_EXTERNAL_BELOW_BYTES = 1 << 20
# Folding must not blow up the model: constants larger than this stay computed at run time
# (e.g. ConstantOfShape zeros of a static export); the constants-folded check allows for them.
DEFAULT_SIZE_THRESHOLD = FOLD_SIZE_THRESHOLD
MAX_SWEEPS = 8  # folder sweeps per run (SD graphs settle in two or three)


@register_pass
class FoldConstants(Pass):
    name = "fold-constants"
    description = "evaluate constant subgraphs (graphsurgeon + ORT), with Shape(start,end) handled correctly"
    provides = frozenset({CONSTANTS_FOLDED})

    def __init__(self, size_threshold: int = DEFAULT_SIZE_THRESHOLD):
        self.size_threshold = size_threshold

    def run(self, model: Model) -> PassResult:
        # graphsurgeon folds on ONNX Runtime sessions; without ORT its "basic" partitioning recurses without bound
        import_onnxruntime()
        graph = model.graph
        split = split_ranged_shapes(graph)
        load_small_external_constants(model)
        before = len(graph.nodes)
        result = PassResult(modified=False)
        severity = G_LOGGER.severity
        G_LOGGER.severity = max(severity, G_LOGGER.ERROR)  # graphsurgeon logs every partition it tries
        quiet_onnxruntime()  # and the sessions it folds with warn about their own graph optimizations
        try:
            # One sweep of graphsurgeon's folder leaves nodes whose inputs its own shape folding
            # made constant (a Shape of static dims folded, the Add reading it not): sweep again
            # until a sweep folds nothing, so that constants-folded holds.
            for _ in range(MAX_SWEEPS):
                count = len(graph.nodes)
                graph.fold_constants(
                    fold_shapes=True,
                    partitioning="basic",
                    error_ok=True,
                    size_threshold=self.size_threshold,
                    should_exclude_node=excluded_from_folding,
                )
                graph.cleanup(remove_unused_graph_inputs=False)
                fold_bfloat16_on_reference(graph, self.size_threshold)
                if len(graph.nodes) == count:
                    break
        finally:
            G_LOGGER.severity = severity
        for node in graph.nodes:
            if needs_bfloat16_kernel(node) and _reads_constants_only(node):
                result.refuse(node.name or node.op, "bfloat16: neither ONNX Runtime's CPU build nor the reference evaluator folds it")
        folded = before - len(graph.nodes)
        rejoined = join_ranged_shapes(graph, split)
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
        # Net nodes removed, not counting the temporary Slices of the Shape(start, end) workaround.
        removed = folded + rejoined - len(split)
        result.modified = removed > 0
        result.sites_rewritten = removed
        result.sites_matched = removed + len(result.refused)
        return result


def quiet_onnxruntime() -> None:
    try:
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)
    except ImportError:
        pass


def split_ranged_shapes(graph: gs.Graph) -> list[gs.Node]:
    """Rewrite ``Shape(x, start, end)`` as ``Slice(Shape(x))``; returns the new Slice nodes."""
    slices = []
    names = NameAuthority(graph)
    for node in [n for n in graph.nodes if n.op == "Shape" and is_standard(n)]:
        start = int(node.attrs.get("start", 0))
        end = node.attrs.get("end")
        if start == 0 and end is None:
            continue
        ranged = node.outputs[0]
        make = Emit(graph, names, node.name or ranged.name)
        full = make.tensor("full_shape", np.int64, None)
        node.attrs.pop("start", None)
        node.attrs.pop("end", None)
        replace_output(node, ranged, full)
        consts = [make.constant(label, np.array([value], dtype=np.int64))
                  for label, value in (("starts", start), ("ends", INT64_MAX if end is None else int(end)), ("axes", 0))]
        make.op.Slice(full, *consts, _label="range", _outputs=[ranged])
        (slice_node,) = make.into(graph)
        slices.append(slice_node)
    return slices


def join_ranged_shapes(graph: gs.Graph, slices: list[gs.Node]) -> int:
    """Undo :func:`split_ranged_shapes` where the pair survived folding (dynamic dims)."""
    joined = 0
    for slice_node in slices:
        if not slice_node.inputs or not slice_node.inputs[0].inputs:
            continue  # folded away
        full = slice_node.inputs[0]
        shape_node = full.inputs[0]
        if shape_node.op != "Shape" or len(full.outputs) != 1:
            continue
        starts, ends = (slice_node.inputs[i] for i in (1, 2))
        if not (isinstance(starts, gs.Constant) and isinstance(ends, gs.Constant)):
            continue
        shape_node.attrs["start"] = int(starts.values[0])
        end = int(ends.values[0])
        if end != INT64_MAX:
            shape_node.attrs["end"] = end
        ranged = slice_node.outputs[0]
        detach(slice_node)
        replace_output(shape_node, full, ranged)
        joined += 1
    return joined


def load_small_external_constants(model: Model) -> None:
    for constant in model.constants():
        if is_external(constant) and constant_nbytes(constant) < LOAD_EXTERNAL_BELOW_BYTES:
            store_values(constant, read_uncached(constant))


def reads_large_external_weight(node: gs.Node) -> bool:
    return any(isinstance(t, gs.Constant) and is_external(t) for t in node.inputs)


def excluded_from_folding(node: gs.Node) -> bool:
    return reads_large_external_weight(node) or needs_bfloat16_kernel(node)


def fold_bfloat16_on_reference(graph: gs.Graph, size_threshold: int) -> None:
    """Evaluate the nodes graphsurgeon's folder leaves for want of a bfloat16 CPU kernel (an
    attention scale computed from a shape, cast to bfloat16) one by one on onnx.reference, in
    order, so that what they feed folds too; a node it cannot evaluate stays."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    from onnxopt.pattern import constant_value

    opset = graph.opset
    for node in graph.toposort().nodes:
        if not (needs_bfloat16_kernel(node) and _reads_constants_only(node)) or node.domain not in ("", "ai.onnx", None):
            continue
        if any(isinstance(v, gs.Graph) for v in node.attrs.values()) or reads_large_external_weight(node):
            continue
        inputs = [t for t in node.inputs if t.name]
        try:
            feeds = {t.name: constant_value(t) for t in inputs}
            proto = helper.make_model(
                helper.make_graph([gs.export_onnx(gs.Graph(nodes=[node], inputs=[], outputs=list(node.outputs), opset=opset),
                                                  do_type_check=False).graph.node[0]], "fold",
                                  [helper.make_tensor_value_info(t.name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                                   for t, v in zip(inputs, feeds.values())],
                                  [helper.make_empty_tensor_value_info(t.name) for t in node.outputs]),
                opset_imports=[helper.make_opsetid("", opset)])
            values = ReferenceEvaluator(proto).run(None, feeds)
        except Exception:  # an op the reference evaluator lacks, or a value it cannot type: leave it
            continue
        if any(np.asarray(v).nbytes > size_threshold for v in values):
            continue
        for out, value in zip(list(node.outputs), values):
            constant = gs.Constant(out.name, np.asarray(value))
            for consumer in list(out.outputs):
                for i, t in enumerate(consumer.inputs):
                    if t is out:
                        consumer.inputs[i] = constant
            graph.outputs[:] = [constant if t is out else t for t in graph.outputs]
        node.outputs.clear()
        node.inputs.clear()
    graph.cleanup(remove_unused_graph_inputs=False)


def _reads_constants_only(node: gs.Node) -> bool:
    inputs = [t for t in node.inputs if t.name]
    return bool(inputs) and all(isinstance(t, gs.Constant) for t in inputs)
