"""bfloat16 exports through ort-cuda: Flux, SD3.5 and T5 are trained and served in bfloat16, and
their full-size exports are made directly in it.

onnx-graphsurgeon holds bfloat16 as the ONNX element type (an int: NumPy has no bfloat16), and ONNX
Runtime's CPU build, which fold-constants evaluates with, has no bfloat16 kernel for most ops.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from tests.conftest import result_of, run_passes

BF16 = np.dtype(ml_dtypes.bfloat16)
BF16_REASON = "bfloat16: ONNX Runtime's CPU build, which folds, has no kernel for it"


def bf16_constant_subgraph() -> onnx.ModelProto:
    """y = x + (w @ w): the MatMul reads bfloat16 constants only, which ORT's CPU build cannot run."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 4)).astype(BF16)
    w_init = helper.make_tensor("w", TensorProto.BFLOAT16, [4, 4], w.view(np.uint16).tobytes(), raw=True)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["w", "w"], ["ww"]), helper.make_node("Add", ["x", "ww"], ["y"])],
        "bf16_fold",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [4, 4])],
        [w_init],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_fold_constants_leaves_a_bf16_matmul_of_constants_to_run_time_and_says_why():
    proto = bf16_constant_subgraph()
    model, report = run_passes(proto, ["fold-constants"])
    result = result_of(report, "fold-constants")
    assert [reason for _, reason in result.refused] == [BF16_REASON]
    assert [n.op for n in model.graph.nodes] == ["MatMul", "Add"]
    out = model.to_onnx()
    onnx.checker.check_model(out, full_check=True)
    x = np.random.default_rng(1).standard_normal((4, 4)).astype(BF16)
    (before,) = ReferenceEvaluator(proto).run(None, {"x": x})
    (after,) = ReferenceEvaluator(out).run(None, {"x": x})
    np.testing.assert_array_equal(np.asarray(before, np.float32), np.asarray(after, np.float32))


@pytest.mark.models
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_ort_cuda_takes_the_bf16_export_of_the_tiny_sd35_medium(export_tiny, exporter):
    """Before: dynamo exports crashed reading bfloat16 as a NumPy dtype (attention's dtype check),
    TorchScript exports recursed without bound in fold-constants."""
    exported = export_tiny("sd35-medium", exporter=exporter, dtype="bfloat16")
    model, report = run_passes(exported.path, ["ort-cuda"])
    assert result_of(report, "fuse-attention").sites_rewritten > 0
    proto = onnx.load(str(exported.path))
    assert proto.graph.input and any(
        i.data_type == TensorProto.BFLOAT16 for i in proto.graph.initializer)
    out = model.to_onnx()
    onnx.checker.check_model(out, full_check=True)
