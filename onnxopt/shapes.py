"""2 GB-safe shape inference.

``onnx.shape_inference.infer_shapes`` serialises the whole ModelProto, which fails past 2 GB, and
``infer_shapes_path`` writes a copy of the model to disk. We run it on the model's skeleton
instead: large initializers reduced to name, type and dims (all that inference reads from them),
small ones (shape constants, scales) kept with their values so data propagation still works.
"""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs
from onnx import shape_inference

from onnxopt.model import Model


def _dims(type_proto: onnx.TypeProto) -> list | None:
    tensor_type = type_proto.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    dims = []
    for d in tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def infer_shapes(model: Model) -> int:
    """Annotate the graph's tensors with inferred dtypes and shapes; returns how many tensors gained information."""
    skeleton = model.skeleton()
    del skeleton.graph.value_info[:]  # infer from scratch: stale annotations from earlier rewrites must not win
    inferred = shape_inference.infer_shapes(skeleton, check_type=False, strict_mode=False, data_prop=True)
    tensors = model.graph.tensors()
    gained = 0
    for info in list(inferred.graph.value_info) + list(inferred.graph.output):
        tensor = tensors.get(info.name)
        if not isinstance(tensor, gs.Variable) or not info.type.HasField("tensor_type"):
            continue
        elem_type = info.type.tensor_type.elem_type
        dims = _dims(info.type)
        changed = False
        if elem_type and tensor.dtype is None:
            tensor.dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
            changed = True
        if dims is not None and (tensor.shape is None or _more_specific(dims, tensor.shape)):
            tensor.shape = dims
            changed = True
        gained += changed
    return gained


def _more_specific(new: list, old) -> bool:
    if len(new) != len(old):
        return True
    return sum(isinstance(d, int) for d in new) > sum(isinstance(d, int) for d in old)
