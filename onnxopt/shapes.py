"""2 GB-safe shape inference.

``onnx.shape_inference.infer_shapes`` serialises the whole ModelProto, which fails past 2 GB, and
``infer_shapes_path`` writes a copy of the model to disk. We run it on the model's skeleton
instead: large initializers reduced to name, type and dims (all that inference reads from them),
small ones (shape constants, scales) kept with their values so data propagation still works.
"""

from __future__ import annotations

import itertools
import re

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


GENERATED_DIM = re.compile(r"unk__\d+")
_RUNS = itertools.count(1)


def infer_shapes(model: Model) -> int:
    """Annotate the graph's tensors with inferred dtypes and shapes; returns how many tensors gained information.

    ONNX names the dims it cannot resolve ``unk__0``, ``unk__1``, ... afresh in every run, and a
    tensor keeps an earlier run's annotation unless the new one is more specific: the same name
    could then stand for two different dims (SDXL: ``unk__284`` for 12 tokens on one tensor and 48
    on another), and ONNX Runtime, which plans buffer reuse on declared shapes, fails at run time.
    So each run's generated names get the run's number: ``unk__7_284``."""
    skeleton = model.skeleton()
    del skeleton.graph.value_info[:]  # infer from scratch: stale annotations from earlier rewrites must not win
    inferred = shape_inference.infer_shapes(skeleton, check_type=False, strict_mode=False, data_prop=True)
    run = next(_RUNS)
    tensors = model.graph.tensors()
    gained = 0
    for info in list(inferred.graph.value_info) + list(inferred.graph.output):
        tensor = tensors.get(info.name)
        if not isinstance(tensor, gs.Variable) or not info.type.HasField("tensor_type"):
            continue
        elem_type = info.type.tensor_type.elem_type
        dims = _run_unique(_dims(info.type), run)
        changed = False
        if elem_type and tensor.dtype is None:
            tensor.dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
            changed = True
        if dims is not None and (tensor.shape is None or _more_specific(dims, tensor.shape)):
            tensor.shape = dims
            changed = True
        gained += changed
    return gained


def _run_unique(dims: list | None, run: int) -> list | None:
    """``unk__N`` -> ``unk__<run>_N``; every other dim as it is."""
    if dims is None:
        return None
    return [f"unk__{run}_{d[5:]}" if isinstance(d, str) and GENERATED_DIM.fullmatch(d) else d for d in dims]


def _more_specific(new: list, old) -> bool:
    if len(new) != len(old):
        return True
    return sum(isinstance(d, int) for d in new) > sum(isinstance(d, int) for d in old)
