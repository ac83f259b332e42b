"""Reading constant tensors of a gs graph without loading large weights.

A value is *constant* when it is a ``gs.Constant`` (an initializer) or the
output of an ONNX ``Constant`` node. Both forms appear in exported graphs:
the TorchScript exporter writes many ``Constant`` nodes, the dynamo exporter
writes initializers.

    >>> is_constant(tensor)
    True
    >>> constant_shape(tensor)        # no data is loaded
    (1,)
    >>> constant_value(tensor)        # reads the data (not kept: see onnxopt.weights.read_uncached)
    array([0.5], dtype=float32)
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.weights import read_uncached, stored_values

# Attributes of an ONNX ``Constant`` node, other than ``value``, and their numpy dtype.
_CONSTANT_NODE_SCALAR_ATTRS = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def constant_node(tensor: gs.Tensor) -> gs.Node | None:
    """The ONNX ``Constant`` node that produces ``tensor``, if there is one."""
    if isinstance(tensor, gs.Variable) and len(tensor.inputs) == 1:
        producer = tensor.inputs[0]
        if producer.op == "Constant" and not producer.inputs:
            return producer
    return None


def is_constant(tensor: gs.Tensor | None) -> bool:
    """True for an initializer or the output of an ONNX ``Constant`` node."""
    if tensor is None:
        return False
    return isinstance(tensor, gs.Constant) or _constant_node_payload(tensor) is not None


def constant_shape(tensor: gs.Tensor) -> tuple[int, ...] | None:
    """The shape of a constant tensor, read without loading its data (None if not constant)."""
    payload = _constant_node_payload(tensor) if not isinstance(tensor, gs.Constant) else tensor
    if payload is None:
        return None
    if isinstance(payload, gs.Constant):
        return tuple(payload.shape)
    return np.shape(payload[1])


def is_zero_constant(tensor: gs.Tensor | None) -> bool:
    """True for a constant whose every value is zero (loads it)."""
    value = constant_value(tensor) if is_constant(tensor) else None
    return value is not None and not np.any(value)


def constant_value(tensor: gs.Tensor) -> np.ndarray | None:
    """The numpy value of a constant tensor, read each time and not kept on the tensor (a pass
    that looks at every weight of a 10 GB UNet must not end up holding them); None if the
    tensor is not constant."""
    if isinstance(tensor, gs.Constant):
        return read_uncached(tensor)
    payload = _constant_node_payload(tensor)
    if payload is None:
        return None
    if isinstance(payload, gs.Constant):
        return read_uncached(payload)
    attr_name, raw = payload
    return np.asarray(raw, dtype=_CONSTANT_NODE_SCALAR_ATTRS[attr_name])


def constant_reader(tensor: gs.Tensor) -> Callable[[], np.ndarray] | None:
    """A function that reads the constant's value when called (each time, uncached), from the data
    the tensor holds *now*: a rewrite that derives a weight lazily (packing Q/K/V) reads its
    sources at save time, after later passes may have given the tensor other values. None if
    the tensor is not constant."""
    if isinstance(tensor, gs.Constant):
        source = stored_values(tensor)
        return lambda: read_uncached(source)
    if not is_constant(tensor):
        return None
    value = constant_value(tensor)  # a Constant node's attribute: small, kept as it is now
    return lambda: value


def _constant_node_payload(tensor: gs.Tensor):
    """The ``value`` gs.Constant of a ``Constant`` node, or ``(attr_name, python_value)``."""
    node = constant_node(tensor)
    if node is None:
        return None
    value = node.attrs.get("value")
    if isinstance(value, gs.Constant):
        return value
    for attr_name in _CONSTANT_NODE_SCALAR_ATTRS:
        if attr_name in node.attrs:
            return attr_name, node.attrs[attr_name]
    return None  # sparse_value / string values: not numeric constants we can compare
