"""remove-redundant-casts: drop Casts that cannot change a value.

    x:T -> Cast(to=T) -> y                       ==>   x                (a no-op cast)
    x:S -> Cast(to=A) -> Cast(to=B) -> y         ==>   x -> Cast(to=B)  when S -> A is lossless
                                                 ==>   x                when, in addition, B == S
    x -> Cast(to=A) -> y1,  x -> Cast(to=A) -> y2  ==>  x -> Cast(to=A) -> y1, read for y2 too

Safe because a lossless first cast (e.g. float16 -> float32, int32 -> int64) maps every value of
S exactly into A, so casting on to B gives what casting straight to B gives. A lossy first cast
(float32 -> float16 -> float32 rounds) is a computation and stays. Two Casts of one tensor to one
type compute the same values: the TorchScript exporter writes one per use of ``x.float()`` or of a
type promotion (a bfloat16 RMSNorm upcasts x for its statistics and again for the product), and
a pattern that reads x's upcast twice sees one tensor only after they are merged.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.graph_edit import detach, is_standard, redirect_consumers
from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, Pass, PassResult
from onnxopt.registry import register_pass
from onnxopt.weights import numpy_dtype

_T = onnx.TensorProto
# Exactly representable widenings (numpy's "safe" casting is not enough: it calls int64 -> float64 safe).
_LOSSLESS = {
    _T.BOOL: {_T.INT8, _T.UINT8, _T.INT16, _T.UINT16, _T.INT32, _T.UINT32, _T.INT64, _T.UINT64, _T.FLOAT16, _T.BFLOAT16, _T.FLOAT, _T.DOUBLE},
    _T.INT8: {_T.INT16, _T.INT32, _T.INT64, _T.FLOAT16, _T.BFLOAT16, _T.FLOAT, _T.DOUBLE},
    _T.UINT8: {_T.INT16, _T.UINT16, _T.INT32, _T.UINT32, _T.INT64, _T.UINT64, _T.FLOAT16, _T.FLOAT, _T.DOUBLE},
    _T.INT16: {_T.INT32, _T.INT64, _T.FLOAT, _T.DOUBLE},
    _T.UINT16: {_T.INT32, _T.UINT32, _T.INT64, _T.UINT64, _T.FLOAT, _T.DOUBLE},
    _T.INT32: {_T.INT64, _T.DOUBLE},
    _T.UINT32: {_T.INT64, _T.UINT64, _T.DOUBLE},
    _T.FLOAT16: {_T.FLOAT, _T.DOUBLE},
    _T.BFLOAT16: {_T.FLOAT, _T.DOUBLE},
    _T.FLOAT: {_T.DOUBLE},
}


def onnx_type_of(tensor: gs.Tensor) -> int | None:
    dtype = tensor.dtype
    if dtype is None:
        return None
    if isinstance(dtype, int):
        return dtype
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(numpy_dtype(dtype))
    except (KeyError, TypeError, ValueError):
        return None


def is_lossless(src: int, dst: int) -> bool:
    return src == dst or dst in _LOSSLESS.get(src, ())


@register_pass
class RemoveRedundantCasts(Pass):
    name = "remove-redundant-casts"
    description = "remove no-op Casts and lossless Cast chains"
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        graph_outputs = {id(t) for t in graph.outputs}
        for cast in [n for n in graph.nodes if n.op == "Cast" and is_standard(n)]:
            x, y = cast.inputs[0], cast.outputs[0]
            to = int(cast.attrs["to"])
            inner = x.inputs[0] if len(x.inputs) == 1 and x.inputs[0].op == "Cast" else None
            source = inner.inputs[0] if inner is not None else x
            source_type = onnx_type_of(source)
            if source_type is None:
                continue
            if inner is not None and not is_lossless(source_type, int(inner.attrs["to"])):
                continue  # a rounding cast in the chain: a real computation
            if inner is None and source_type != to:
                continue
            result.sites_matched += 1
            if source_type == to:
                if id(y) in graph_outputs:
                    if inner is None:
                        result.refuse(cast.name, "no-op Cast writes a graph output")
                        continue
                    cast.inputs[0] = source  # keep the output's name: one cast of the chain remains
                else:
                    redirect_consumers(y, source)
                    detach(cast)
            else:
                cast.inputs[0] = source  # skip the lossless inner cast
            result.sites_rewritten += 1
        merged = _merge_duplicate_casts(graph, graph_outputs)
        result.sites_matched += merged
        result.sites_rewritten += merged
        result.modified = result.sites_rewritten > 0
        if result.modified:
            graph.cleanup(remove_unused_graph_inputs=False)
        if merged:
            graph.toposort()  # a kept Cast may come after readers of the one it replaced
        return result


def _merge_duplicate_casts(graph: gs.Graph, graph_outputs: set[int]) -> int:
    """Every Cast of a tensor to a type after the first is dropped, its readers reading the
    first's output (a Cast writing a graph output is kept); returns how many were dropped."""
    first: dict[tuple[int, int], gs.Node] = {}
    merged = 0
    for cast in [n for n in graph.nodes if n.op == "Cast" and is_standard(n) and n.inputs]:
        key = (id(cast.inputs[0]), int(cast.attrs["to"]))
        kept = first.setdefault(key, cast)
        if kept is cast or id(cast.outputs[0]) in graph_outputs:
            continue
        redirect_consumers(cast.outputs[0], kept.outputs[0])
        detach(cast)
        merged += 1
    return merged
