"""What goes to external data on save, and that the result loads in ONNX Runtime.

* Tensors that shape inference reads as data stay inline whatever their size: ORT infers shapes
  at load, before it reads external data (the full SDXL UNet's int64[140] Split sizes, 1120 bytes,
  over the 1024-byte threshold, made an output ORT refused).
* Initializers of If/Loop branches are written to the output (inline or into its data file), not
  left pointing at the source's data file.
* A Constant node whose tensor is in external data is read and written inline.
"""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnx.reference
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import load_model, optimize, save_model
from onnxopt.saving import EXTERNAL_MIN_BYTES, must_stay_inline
from tests.graphs import make_model

CPU = ["CPUExecutionProvider"]


def session(path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=CPU)


def external_names(path) -> set[str]:
    proto = onnx.load(str(path), load_external_data=False)
    return {t.name for t in onnx.external_data_helper._get_all_tensors(proto) if onnx.external_data_helper.uses_external_data(t)}


def sdxl_like_split(members: int = 140) -> onnx.ModelProto:
    """The split fuse-parallel-gemm writes for SDXL's 70 cross-attentions (K and V each): an
    int64[140] sizes initializer (1120 bytes), beside a weight that does go external."""
    sizes = np.arange(1, members + 1, dtype=np.int64) % 3 + 1
    weight = np.random.default_rng(0).standard_normal((8, int(sizes.sum())), dtype=np.float32)
    outputs = [f"y{i}" for i in range(members)]
    return make_model(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Split", ["h", "split_sizes"], outputs, axis=-1)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(sizes, "split_sizes")],
    )


def test_sdxl_sized_split_sizes_stay_inline_and_ort_loads_and_runs_the_model(tmp_path):
    source = sdxl_like_split()
    assert source.graph.initializer[1].dims == [140] and 140 * 8 > EXTERNAL_MIN_BYTES
    out = tmp_path / "split.onnx"
    save_model(load_model(source), out, external_data=True)
    assert external_names(out) == {"W"}  # the weight goes external, the sizes stay inline
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    expected = onnx.reference.ReferenceEvaluator(source).run(None, {"x": x})
    got = session(out).run(None, {"x": x})
    assert len(got) == 140
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_inline_rule_keeps_shape_inputs_and_small_integers_and_lets_weights_go():
    big_shape = np.array([1] * 200 + [-1], dtype=np.int64)  # 1608 bytes, read as a Reshape shape
    axes = np.arange(300, dtype=np.int64) * 0  # only used by a Mul: a small integer tensor
    gather = np.zeros(20000, dtype=np.int64)  # 160 kB of integer data, not a shape: may go external
    source = make_model(
        [helper.make_node("Reshape", ["x", "shape"], ["r"]),
         helper.make_node("Mul", ["axes", "axes"], ["m"]),
         helper.make_node("Gather", ["x", "idx"], ["g"]),
         helper.make_node("Resize", ["x", "", "scales"], ["z"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("r", "g", "z")]
        + [helper.make_tensor_value_info("m", TensorProto.INT64, None)],
        [numpy_helper.from_array(big_shape, "shape"), numpy_helper.from_array(axes, "axes"),
         numpy_helper.from_array(gather, "idx"), numpy_helper.from_array(np.ones(400, np.float32), "scales")],
    )
    assert must_stay_inline(load_model(source)) == {"shape", "axes", "scales"}


def if_model(weight: np.ndarray) -> onnx.ModelProto:
    """y = If(c, then: x @ W, else: x @ -W), each branch with its own (large) initializer."""
    def branch(name, w):
        out = helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, None)
        return helper.make_graph([helper.make_node("MatMul", ["x", f"W_{name}"], [f"y_{name}"])], name, [], [out],
                                 [numpy_helper.from_array(w, f"W_{name}")])

    node = helper.make_node("If", ["c"], ["y"], then_branch=branch("then", weight), else_branch=branch("else", -weight))
    return make_model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64]),
                               helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])


@pytest.mark.parametrize("external_out", [False, True])
def test_branch_initializers_in_external_data_are_written_with_the_output(tmp_path, external_out):
    weight = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    src = tmp_path / "src" / "m.onnx"
    src.parent.mkdir()
    onnx.save(if_model(weight), src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    model, _ = optimize(src, ["cleanup"])
    out = tmp_path / "out" / "m.onnx"
    out.parent.mkdir()
    save_model(model, out, external_data=external_out)
    shutil.rmtree(src.parent)  # the output must not lean on the source's files
    onnx.checker.check_model(str(out), full_check=True)
    assert external_names(out) == ({"W_then", "W_else"} if external_out else set())
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    run = session(out)
    for c, w in ((True, weight), (False, -weight)):
        np.testing.assert_allclose(run.run(None, {"x": x, "c": np.array(c)})[0], x @ w, rtol=1e-5, atol=1e-5)


def test_constant_node_with_external_data_is_read_and_written_inline(tmp_path):
    value = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32)
    tensor = numpy_helper.from_array(value, "c_value")
    source = make_model([helper.make_node("Constant", [], ["c"], value=tensor), helper.make_node("Add", ["x", "c"], ["y"])],
                        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 32])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 32])])
    src = tmp_path / "src" / "m.onnx"
    src.parent.mkdir()
    onnx.external_data_helper.convert_model_to_external_data(source, location="m.onnx.data", size_threshold=0,
                                                             convert_attribute=True)
    onnx.save(source, src)
    assert onnx.external_data_helper.uses_external_data(onnx.load(str(src), load_external_data=False).graph.node[0].attribute[0].t)
    out = tmp_path / "out.onnx"
    save_model(load_model(src), out, external_data=True)
    shutil.rmtree(src.parent)
    x = np.ones((32, 32), np.float32)
    np.testing.assert_allclose(session(out).run(None, {"x": x})[0], x + value, rtol=1e-6)
