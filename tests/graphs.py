"""Small hand-built models for edge cases (real exporter graphs come from models/fixtures)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def make_model(nodes, inputs, outputs, initializers=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def linear_model(n_in=64, n_out=64, seed=0) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """out = Identity(x @ W + b), with a symbolic batch dim."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_in, n_out)).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32)
    model = make_model(
        [
            helper.make_node("MatMul", ["x", "W"], ["y"], name="matmul"),
            helper.make_node("Add", ["y", "b"], ["z"], name="add"),
            helper.make_node("Identity", ["z"], ["out"], name="identity"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_in])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", n_out])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
    )
    return model, w, b
