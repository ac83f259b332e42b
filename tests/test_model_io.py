"""Graph I/O: external data in both exporters' layouts, lazy weights, atomic and 2 GB-aware saving."""

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxopt import load_model, save_model
from onnxopt.errors import ModelLoadError, ModelSaveError, UnsupportedModelError
from onnxopt.saving import AUTO_EXTERNAL_BYTES
from onnxopt.weights import ExternalValues
from tests.graphs import linear_model


def _run(path, x):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.fixture
def x():
    return np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)


@pytest.mark.parametrize("layout", ["inline", "one-file-per-tensor", "single-data-file"])
@pytest.mark.parametrize("external_out", [False, True])
def test_round_trip_computes_the_same(tmp_path, x, layout, external_out):
    proto, w, b = linear_model()
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    if layout == "inline":
        onnx.save(proto, src)
    else:  # TorchScript writes a file per tensor; dynamo one model.onnx.data
        onnx.save(proto, src, save_as_external_data=True, all_tensors_to_one_file=layout == "single-data-file",
                  location="model.onnx.data", size_threshold=0)
    model = load_model(src)
    out = tmp_path / "out.onnx"
    info = save_model(model, out, external_data=external_out)
    assert info.external == external_out
    assert (tmp_path / "out.onnx.data").exists() == external_out
    onnx.checker.check_model(str(out))
    np.testing.assert_allclose(_run(out, x), x @ w + b, rtol=1e-6, atol=1e-6)


def test_external_weights_are_not_loaded(tmp_path):
    proto, w_expected, _ = linear_model()
    src = tmp_path / "model.onnx"
    onnx.save(proto, src, save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0)
    model = load_model(src)
    w = model.graph.tensors()["W"]
    assert isinstance(w._values, ExternalValues)  # still on disk
    np.testing.assert_array_equal(w.values, w_expected)


def test_auto_external_data_over_threshold(tmp_path, monkeypatch):
    proto, _, _ = linear_model()
    monkeypatch.setattr("onnxopt.saving.AUTO_EXTERNAL_BYTES", 1000)  # stand-in for 2 GB
    info = save_model(load_model(proto), tmp_path / "m.onnx")
    assert info.external and info.data_path.exists()
    assert AUTO_EXTERNAL_BYTES < 2**31


def test_save_never_touches_source_and_refuses_to_overwrite_it(tmp_path):
    proto, _, _ = linear_model()
    src = tmp_path / "m.onnx"
    onnx.save(proto, src)
    before = src.read_bytes()
    with pytest.raises(ModelSaveError, match="never modifies its input"):
        save_model(load_model(src), src)
    assert src.read_bytes() == before


def test_failed_save_leaves_no_partial_file(tmp_path, monkeypatch):
    proto, _, _ = linear_model()
    model = load_model(proto)
    out = tmp_path / "out.onnx"
    out.write_bytes(b"previous")

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("onnxopt.saving._copy", broken)
    with pytest.raises(ModelSaveError, match="No space left"):
        save_model(model, out, external_data=True)
    assert out.read_bytes() == b"previous"  # the old output is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx"]  # no temporaries left behind


def test_in_memory_sources_are_not_modified():
    proto, _, _ = linear_model()
    snapshot = proto.SerializeToString()
    model = load_model(proto)
    model.graph.nodes.clear()
    assert proto.SerializeToString() == snapshot
    graph_model = load_model(load_model(proto).graph)
    assert len(graph_model.graph.nodes) == 3


@pytest.mark.parametrize(
    "content, message",
    [
        (b"this is not a model at all\n" * 10, "not an ONNX model"),
        (b"", "not an ONNX model"),
    ],
)
def test_not_onnx(tmp_path, content, message):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    with pytest.raises(ModelLoadError, match=message):
        load_model(bad)


def test_truncated_file(tmp_path):
    proto, _, _ = linear_model()
    data = proto.SerializeToString()
    bad = tmp_path / "cut.onnx"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError):
        load_model(bad)


def test_missing_and_truncated_external_data(tmp_path):
    proto, _, _ = linear_model()
    src = tmp_path / "m.onnx"
    onnx.save(proto, src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    data = tmp_path / "m.onnx.data"
    content = data.read_bytes()
    data.write_bytes(content[:100])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(src)
    data.unlink()
    with pytest.raises(ModelLoadError, match="missing external data: m.onnx.data"):
        load_model(src)


def test_unsupported_opset(tmp_path):
    proto, _, _ = linear_model()
    proto.opset_import[0].version = 9
    with pytest.raises(UnsupportedModelError, match="opset 9 is not supported"):
        load_model(proto)


def test_missing_file_and_unwritable_output(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(tmp_path / "nope.onnx")
    proto, _, _ = linear_model()
    with pytest.raises(ModelSaveError, match="does not exist"):
        save_model(load_model(proto), tmp_path / "no" / "such" / "dir" / "m.onnx")


def test_skeleton_carries_no_weight_bytes():
    proto, _, _ = linear_model(256, 256)
    model = load_model(proto)
    skeleton = model.skeleton()
    assert skeleton.ByteSize() < 4096 < model.weights_nbytes()
    # and the graph's own constants are untouched afterwards
    assert model.graph.tensors()["W"].values.shape == (256, 256)


def test_optimize_and_save_stream_weights_instead_of_holding_them(tmp_path):
    """Peak Python memory stays far below the weights: nothing loads them, saving streams them."""
    import tracemalloc

    from onnx import TensorProto, helper, numpy_helper

    from onnxopt import optimize

    n = 3000  # 4 weights of 36 MB
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(4):
        inits.append(numpy_helper.from_array(rng.standard_normal((n, n), dtype=np.float32), f"W{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"h{i}"]))
        prev = f"h{i}"
    nodes.append(helper.make_node("Identity", [prev], ["out"]))
    proto = helper.make_model(
        helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", n])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", n])], inits),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    src = tmp_path / "big.onnx"
    onnx.save(proto, src, save_as_external_data=True, location="big.onnx.data")
    del proto, inits
    weights = 4 * n * n * 4

    tracemalloc.start()
    model, _ = optimize(src, ["cleanup"])
    save_model(model, tmp_path / "out.onnx", external_data=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert all(isinstance(c._values, ExternalValues) for c in model.constants())
    assert peak < 0.6 * weights, f"peak {peak / 1e6:.0f} MB for {weights / 1e6:.0f} MB of weights"
    assert (tmp_path / "out.onnx.data").stat().st_size >= weights


def test_dims_shape_inference_cannot_resolve_never_share_a_name_across_runs():
    """ONNX names unresolved dims unk__0, unk__1, ... afresh in each run (reserving only the names
    on graph inputs and outputs), and an intermediate tensor keeps an earlier run's annotation:
    without run-unique names, a tensor typed in the second run (z) got the name a kept tensor (y)
    had from the first, declaring two different dims equal (ORT plans buffer reuse on that and
    failed on the TorchScript SDXL UNet)."""
    import onnx_graphsurgeon as gs
    from onnx import TensorProto, helper

    from onnxopt.shapes import infer_shapes
    from tests.graphs import make_model

    def count_nonzero(x: str, tag: str) -> list:
        """x -> NonZero -> (1, n) -> Cast -> ReduceSum -> scalar: n lives on an intermediate only."""
        return [helper.make_node("NonZero", [x], [tag], name=f"nz_{tag}"),
                helper.make_node("Cast", [tag], [f"{tag}_f"], to=TensorProto.FLOAT),
                helper.make_node("ReduceSum", [f"{tag}_f"], [f"{tag}_sum"], keepdims=0)]

    source = make_model(count_nonzero("x", "y"), [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5])],
                        [helper.make_tensor_value_info("y_sum", TensorProto.FLOAT, [])])
    model = load_model(source)
    infer_shapes(model)
    graph = model.graph
    y = graph.tensors()["y"]
    assert y.shape[0] == 1 and isinstance(y.shape[1], str)  # (1, count of non-zeros): unresolved
    # A rewrite adds the same computation on another input in front: the next run numbers its dim first.
    second = gs.import_onnx(make_model(count_nonzero("x2", "z"), [helper.make_tensor_value_info("x2", TensorProto.FLOAT, [7])],
                                       [helper.make_tensor_value_info("z_sum", TensorProto.FLOAT, [])]))
    graph.inputs.insert(0, second.inputs[0])
    graph.outputs.insert(0, second.outputs[0])
    graph.nodes[:0] = second.nodes
    infer_shapes(model)
    z = graph.tensors()["z"]
    assert isinstance(z.shape[1], str) and z.shape[1] != y.shape[1]


def test_a_derived_scalar_keeps_rank_zero():
    """DerivedValues of a 0-d weight loads as 0-d (np.ascontiguousarray would give shape (1,))."""
    from onnxopt.weights import DerivedValues

    values = DerivedValues((), np.float32, lambda: np.float32(3.0), name="s")
    assert values.load().shape == () and values.load() == 3.0
    with pytest.raises(ValueError, match="declared"):
        DerivedValues((1,), np.float32, lambda: np.zeros(2, np.float32), name="v").load()


def test_large_external_weights_are_mapped_read_only_and_never_cached(tmp_path):
    """A weight of 1 MB or more is a read-only view of the mapped file (no copy into fresh memory);
    reading it through constant_value leaves it on disk."""
    from onnxopt.pattern import constant_value
    from onnxopt.weights import MAP_FROM_BYTES, read_uncached

    proto, w_expected, _ = linear_model(n_in=512, n_out=1024)  # 2 MB
    assert w_expected.nbytes >= MAP_FROM_BYTES
    src = tmp_path / "model.onnx"
    onnx.save(proto, src, save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    w = load_model(src).graph.tensors()["W"]
    array = read_uncached(w)
    np.testing.assert_array_equal(array, w_expected)
    assert not array.flags.owndata and not array.flags.writeable
    np.testing.assert_array_equal(constant_value(w), w_expected)
    assert isinstance(w._values, ExternalValues)


def test_range_scan_of_a_rearranged_tensor_reads_its_sources_not_the_result():
    """fp16's range scan of packed/transposed weights (DerivedValues with elements_of) gives what
    scanning the computed tensor gives, without computing it."""
    import onnx_graphsurgeon as gs

    from onnxopt.precision import low_precision, value_stats
    from onnxopt.weights import DerivedValues

    a = np.array([[1.0, -7e4], [3.0, 4.0]], np.float32)
    b = np.array([[2e-3, 0.0], [5.0, -6.0]], np.float32)
    packed = np.concatenate([a, b], axis=1)

    def not_computed():
        raise AssertionError("the scan computed the derived tensor")

    derived = gs.Constant("packed", DerivedValues(packed.shape, np.float32, not_computed, name="packed", elements_of=[a, b]))
    computed = gs.Constant("computed", DerivedValues(packed.shape, np.float32, lambda: packed, name="computed"))
    low = low_precision("float16")
    assert value_stats(derived, low) == value_stats(computed, low) == value_stats(packed, low)
    assert value_stats(derived, low).neg_overflow


def test_save_computes_the_next_derived_tensor_on_a_worker_while_writing(tmp_path, monkeypatch):
    """The saver overlaps computing derived weights (fp16 conversion, packing) with writing:
    they are computed off the main thread, and the file is byte for byte the one written without."""
    import threading

    import onnx_graphsurgeon as gs

    from onnxopt import weights
    from onnxopt.weights import DerivedValues

    proto, _, _ = linear_model(n_in=256, n_out=256)
    threads = []

    def derive(model, scale):
        for constant in model.constants():
            source = constant._values

            def compute(source=source, scale=scale):
                threads.append(threading.current_thread())
                return weights.read_uncached(source) * scale

            constant._values = DerivedValues(constant.shape, constant.dtype, compute, name=constant.name)
        return model

    def save(ahead: int, name: str) -> bytes:
        monkeypatch.setattr(weights, "COMPUTE_AHEAD", ahead)
        model = derive(load_model(proto), 2.0)
        save_model(model, tmp_path / f"{name}.onnx", external_data=True)
        return (tmp_path / f"{name}.onnx").read_bytes() + (tmp_path / f"{name}.onnx.data").read_bytes()

    assert isinstance(load_model(proto).graph.tensors()["W"], gs.Constant)
    plain = save(0, "plain")
    assert threads and all(t is threading.main_thread() for t in threads)
    threads.clear()
    ahead = save(1, "ahead")
    assert threads and all(t is not threading.main_thread() for t in threads)
    assert ahead.replace(b"ahead", b"plain") == plain


def test_range_scan_on_threads_gives_each_constant_its_own_stats_in_order(monkeypatch):
    """fp16's range scan runs on two threads; results come back in the sources' order, each
    the stats a scan on the main thread gives."""
    from onnxopt import precision

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(n).astype(np.float32) * scale for n, scale in
              [(10, 1.0), (70000, 1e5), (3, 1e-9), (5000, 2.0)] * 5]
    low = precision.low_precision("float16")
    expected = [precision.value_stats(a, low) for a in arrays]
    monkeypatch.setattr(precision, "SCAN_THREADS", 2)
    got = list(precision.values_stats(enumerate(arrays), low))
    assert [i for i, _ in got] == list(range(len(arrays)))
    assert [s for _, s in got] == expected
    assert any(s.pos_overflow for s in expected) and any(s.vanishes for s in expected)
