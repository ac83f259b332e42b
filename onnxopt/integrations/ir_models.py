"""onnx-ir models in and out of onnxopt without copying a weight.

In: the graph structure goes through a ModelProto in which every initializer is an empty stub
(name, type, shape), so no tensor is serialised; each weight of the onnxopt :class:`Model` then
reads the onnx-ir tensor it came from (:class:`IrTensorValues`), which for the dynamo exporter's
``TorchTensor`` is a NumPy view of the torch parameter's own storage.

Out: the onnxopt model's skeleton (every initializer a stub) is read by ``onnx_ir.from_proto``,
then each initializer gets a tensor that refers to where the bytes already are:

    unchanged weight from an onnx-ir model -> that same onnx-ir tensor object (buffer checked)
    weight in an external data file          -> ir.ExternalTensor (memory-mapped on read)
    weight a pass rewrote (DerivedValues)    -> ir.LazyTensor (computed when serialised)
    inline TensorProto / NumPy array         -> ir.TensorProtoTensor / ir.Tensor over it

So ``optimize(ir_model, ..., returns="same")`` gives back an ``onnx_ir.Model`` whose untouched
weights are the caller's own buffers (``tests/test_integrations_torch.py`` checks the pointers).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import onnx
from onnx_graphsurgeon.ir.tensor import Constant, LazyValues

from onnxopt.errors import OnnxoptError
from onnxopt.integrations import require
from onnxopt.model import Model, _materialised
from onnxopt.weights import DerivedValues, ExternalValues, constant_data_type, constant_dims, store_values, stored_values

IR_INSTALL = "onnx-ir (it comes with onnxscript: pip install 'onnxopt[models]')"


def is_ir_model(obj) -> bool:
    """Whether ``obj`` is an ``onnx_ir.Model``, without importing onnx_ir when it is not."""
    return type(obj).__module__.split(".")[0] == "onnx_ir" and type(obj).__name__ == "Model"


class IrTensorValues(DerivedValues):
    """A constant's values read from an onnx-ir tensor when needed; ``ir_tensor`` is kept so the
    same object can be handed back by :func:`to_ir_model`."""

    def __init__(self, ir_tensor, name: str):
        self.ir_tensor = ir_tensor
        self.shape_declared = tuple(int(d) for d in ir_tensor.shape)
        super().__init__(self.shape_declared, ir_tensor.dtype.numpy(), ir_tensor.numpy, name=name)

    def load(self) -> np.ndarray:
        # The onnx-ir tensor's own array (a view of its buffer), reshaped to the declared shape.
        return np.asarray(self.ir_tensor.numpy()).reshape(self.shape_declared)


@contextlib.contextmanager
def _initializers_stubbed(ir_model) -> Iterator[None]:
    """Temporarily give every initializer an external-data stand-in, so serialising the model
    writes name, type and shape but no bytes; the caller's tensors are put back afterwards."""
    ir = require("onnx_ir", IR_INSTALL)
    swapped = []
    try:
        for graph in (ir_model.graph, *ir_model.graph.subgraphs()):
            for value in graph.initializers.values():
                tensor = value.const_value
                if tensor is None or tensor.dtype == ir.DataType.STRING:  # no raw bytes: serialised as is
                    continue
                stub = ir.ExternalTensor("__onnxopt_ir_stub__", 0, tensor.nbytes, tensor.dtype,
                                         shape=tensor.shape, name=value.name)
                swapped.append((value, tensor))
                value.const_value = stub
        yield
    finally:
        for value, tensor in swapped:
            value.const_value = tensor


def from_ir_model(ir_model) -> Model:
    """An onnxopt Model over ``ir_model``'s graph and weights (the weights are not copied, and
    ``ir_model`` is left as it was)."""
    from onnxopt.loading import load_model

    ir = require("onnx_ir", IR_INSTALL)
    with _initializers_stubbed(ir_model):
        proto = ir.to_proto(ir_model)
    tensors = {}
    for graph in (ir_model.graph, *ir_model.graph.subgraphs()):
        tensors.update({name: v.const_value for name, v in graph.initializers.items()
                        if v.const_value is not None and v.const_value.dtype != ir.DataType.STRING})
    for initializer in onnx.external_data_helper._get_all_tensors(proto):
        if initializer.name in tensors and initializer.data_location == onnx.TensorProto.EXTERNAL:
            del initializer.external_data[:]  # an empty tensor of the right name, type and shape
            initializer.data_location = onnx.TensorProto.DEFAULT
    model = load_model(proto)
    for constant in model.constants() + model.subgraph_constants():
        if constant.name in tensors:
            store_values(constant, IrTensorValues(tensors[constant.name], constant.name))
    model._ir_tensors = tensors  # read back by to_ir_model (see _source_tensor)
    return model


def _source_tensor(constant: Constant, sources: dict):
    """The onnx-ir tensor ``constant`` came from, when graphsurgeon has since replaced its
    IrTensorValues with the array they gave (``Constant.values`` keeps what it loads) and the
    array is still that tensor's buffer, unchanged in shape and type; else None."""
    tensor = sources.get(constant.name)
    values = stored_values(constant)
    if tensor is None or not isinstance(values, np.ndarray):
        return None
    original = tensor.numpy()
    same = values.shape == tuple(int(d) for d in tensor.shape) and values.dtype == original.dtype \
        and values.__array_interface__["data"][0] == original.__array_interface__["data"][0]
    return tensor if same else None


def _ir_tensor_for(constant: Constant, sources: dict):
    ir = require("onnx_ir", IR_INSTALL)
    values = stored_values(constant)
    if isinstance(values, IrTensorValues):
        return values.ir_tensor
    if (source := _source_tensor(constant, sources)) is not None:
        return source
    dtype = ir.DataType(constant_data_type(constant))
    shape = ir.Shape(constant_dims(constant))
    if isinstance(values, ExternalValues):
        where = values.location
        return ir.ExternalTensor(where.path.name, where.offset, where.length, dtype, shape=shape,
                                 name=constant.name, base_dir=where.path.parent)
    if isinstance(values, DerivedValues):
        return ir.LazyTensor(lambda: ir.Tensor(values.load()), dtype, shape, name=constant.name)
    if isinstance(values, LazyValues):
        return ir.TensorProtoTensor(values.tensor)
    return ir.Tensor(np.asarray(values), name=constant.name)


def to_ir_model(model: Model):
    """``model`` as an ``onnx_ir.Model`` whose initializers refer to the bytes where they are.

    A model split in two (``context-kv``) is refused: one onnx-ir model cannot hold both graphs;
    take them with :func:`onnxopt.context_and_denoiser` and convert each."""
    ir = require("onnx_ir", IR_INSTALL)
    if model.companions:
        raise OnnxoptError(f"the result has companion models ({', '.join(model.companions)}) that one onnx-ir model "
                           "cannot hold: use returns='model' and onnxopt.context_and_denoiser")
    main = model
    with _materialised(main.subgraph_constants()):  # few and small: written inline
        proto = main.skeleton(threshold=0)
    ir_model = ir.from_proto(proto)
    constants = {c.name: c for c in main.constants()}
    for name, value in ir_model.graph.initializers.items():
        if name in constants:
            value.const_value = _ir_tensor_for(constants[name], getattr(model, "_ir_tensors", {}))
    return ir_model
