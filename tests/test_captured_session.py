"""The captured session (``onnxopt.runners.captured_session``) on the CPU EP, where ORT runs the same
IO bindings it runs on the CUDA EP and ignores graph ids. ORT's capture is stood in for by a
recording session: a graph id's first run is its capture, as under ORT's ``gpu_graph_id``.

The claims:
- a binding reads the buffers it was given where they are (a buffer shared with another binding
  sees every write), holds arrays in fresh buffers, and writes outputs into given buffers or into
  fixed buffers of the probed shapes;
- the shape probe runs under graph id -1 (never captured: its outputs are temporary), each binding
  under its own id, and only when the session captures;
- the keyed use binds once per input shape: a cached shape writes its inputs in place and replays,
  a new shape takes a fresh graph id, the least recently used shape is dropped past the cache size;
- a wrapper's ``bound_inputs`` (the LoRA weights) are bound into every binding.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

ort = pytest.importorskip("onnxruntime")

from onnxopt.runners.captured_session import CapturedSession  # noqa: E402


def scaled_sum_model() -> bytes:
    """out = (x + y) * w, with symbolic dims: x, y [n, 3], w [1]."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["s"]), helper.make_node("Mul", ["s", "w"], ["out"])], "scaled_sum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


class RecordingSession:
    """An ORT session whose runs are recorded by graph id (-1 when none or uncaptured)."""

    def __init__(self, session):
        self.session, self.runs = session, []

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run_with_iobinding(self, binding, options=None):
        try:
            self.runs.append(int(options.get_run_config_entry("gpu_graph_id")))
        except (AttributeError, RuntimeError):  # no options, or no graph id in them
            self.runs.append(None)
        return self.session.run_with_iobinding(binding, options)

    def captures(self) -> list[int]:
        """Each graph id in the order of its first run (its capture, under ORT's rules)."""
        return list(dict.fromkeys(graph for graph in self.runs if graph is not None and graph >= 0))


@pytest.fixture
def session():
    return RecordingSession(ort.InferenceSession(scaled_sum_model(), providers=["CPUExecutionProvider"]))


def feeds(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, 3)).astype(np.float32), "y": rng.standard_normal((rows, 3)).astype(np.float32),
            "w": np.array([2.0], np.float32)}


def expected(f: dict) -> np.ndarray:
    return (f["x"] + f["y"]) * f["w"]


def test_a_binding_reads_shared_buffers_where_they_are_and_writes_given_outputs(session):
    captured = CapturedSession(ort, session, device="cpu", cuda_graph=True)
    f = feeds(2)
    shared = captured.buffer(f["x"])  # e.g. another session's output, read in place
    out = captured.empty([2, 3], np.float32)
    run = captured.bind({**f, "x": shared, "unread": np.zeros(1)}, {"out": out}, graph_id=5)
    assert run.inputs["x"] is shared and set(run.inputs) == {"x", "y", "w"} and run.outputs["out"] is out
    run.run()
    np.testing.assert_allclose(out.numpy(), expected(f), rtol=1e-6)
    g = feeds(2, seed=1)
    shared.update_inplace(g["x"])  # a write into the shared buffer is what the next run reads
    run.write({"y": g["y"]})
    run.run()
    np.testing.assert_allclose(out.numpy(), expected(g), rtol=1e-6)
    assert session.runs == [5, 5]  # given outputs: no probe


def test_the_output_probe_is_never_captured_and_ids_are_set_only_when_capturing(session):
    captured = CapturedSession(ort, session, device="cpu", cuda_graph=True)
    run = captured.bind(feeds(4), graph_id=3)
    assert run.outputs["out"].shape() == [4, 3] and session.runs == [-1]
    run.run()
    run.run_uncaptured()
    assert session.runs == [-1, 3, -1] and session.captures() == [3]
    np.testing.assert_allclose(run.outputs["out"].numpy(), expected(feeds(4)), rtol=1e-6)
    plain = CapturedSession(ort, session, device="cpu", cuda_graph=False).bind(feeds(4), graph_id=7)
    plain.run()
    assert session.runs[-2:] == [-1, None]  # not capturing: the id is not passed to ORT


def test_one_binding_per_shape_replayed_and_the_least_recent_dropped(session):
    captured = CapturedSession(ort, session, device="cpu", cuda_graph=True, capture_cache=2)
    results = {}
    for rows, seed in ((1, 0), (2, 1), (1, 2), (3, 3), (2, 4)):
        f = feeds(rows, seed)
        (got,) = captured.run(["out"], f)
        np.testing.assert_allclose(got, expected(f), rtol=1e-6)
        results[rows] = captured.run_bound(f)["out"]
    # shapes 1, 2, 1 (cached: replayed), 3 (evicts 2), 2 again (evicts 1; new id: 2's old id would
    # replay into its freed buffers)
    assert session.captures() == [0, 1, 2, 3]
    assert captured.stats() == {"size": 2, "cached": 2, "captures": 4, "evictions": 2}
    assert list(captured.cache) == [(("w", (1,), "<f4"), ("x", (3, 3), "<f4"), ("y", (3, 3), "<f4")),
                                    (("w", (1,), "<f4"), ("x", (2, 3), "<f4"), ("y", (2, 3), "<f4"))]
    assert captured.run_bound(feeds(3))["out"] is results[3]  # the same output buffer for every run of a shape


class WithWeights:
    """A session wrapper that feeds ``w`` itself from a buffer it owns (as the LoRA wrapper does)."""

    def __init__(self, session, w):
        self.session, self.bound_inputs = session, {"w": w}

    def __getattr__(self, name):
        return getattr(self.session, name)

    def get_inputs(self):
        return [i for i in self.session.get_inputs() if i.name != "w"]


def test_a_wrappers_bound_inputs_are_bound_into_every_binding(session):
    w = ort.OrtValue.ortvalue_from_numpy(np.array([3.0], np.float32))
    captured = CapturedSession(ort, WithWeights(session, w), device="cpu")
    f = feeds(2)
    (got,) = captured.run(["out"], {"x": f["x"], "y": f["y"]})
    np.testing.assert_allclose(got, (f["x"] + f["y"]) * 3.0, rtol=1e-6)
    w.update_inplace(np.array([-1.0], np.float32))
    (got,) = captured.run(["out"], {"x": f["x"], "y": f["y"]})
    np.testing.assert_allclose(got, -(f["x"] + f["y"]), rtol=1e-6)



def cuda_or_skip():
    from onnxopt.runners.ort_cuda import cuda_available

    if not cuda_available():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")


@pytest.mark.gpu
def test_on_the_cuda_ep_a_captured_graph_replays_each_new_value_and_shape():
    """With CUDA graphs, values written into the bound inputs reach the replayed graph, and each
    shape has its own capture (an uncaptured output probe first)."""
    cuda_or_skip()
    from onnxopt.pipeline.sessions import provider_list

    session = ort.InferenceSession(scaled_sum_model(), providers=provider_list("cuda", cuda_graph=True))
    captured = CapturedSession(ort, session, device="cuda", cuda_graph=True)
    for rows, seed in ((2, 0), (2, 1), (2, 2), (5, 3), (2, 4), (5, 5)):
        f = feeds(rows, seed)
        (got,) = captured.run(["out"], f)
        np.testing.assert_allclose(got, expected(f), rtol=1e-6)
    assert captured.stats() == {"size": 4, "cached": 2, "captures": 2, "evictions": 0}


@pytest.mark.gpu
def test_bench_session_with_cuda_graph_gives_the_cpu_output():
    """``onnxopt bench``'s session (its buffers probed uncaptured, then captured on its own graph
    id) gives ORT CPU's output on the tiny UNet, and a second bind (new values) replays its own."""
    cuda_or_skip()
    from onnxopt.runners.ort_cuda import OrtCudaSession
    from tests.conftest import FIXTURES

    unet = FIXTURES / "unet-sd15.tiny.torchscript.static.sdpa.onnx"
    cpu = ort.InferenceSession(str(unet), providers=["CPUExecutionProvider"])
    session = OrtCudaSession(str(unet), cuda_graph=True)
    rng = np.random.default_rng(0)
    for _ in range(2):
        feed = {i.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape]).astype(np.float32)
                for i in cpu.get_inputs()}
        session.bind(feed)
        for _ in range(3):  # a regular run, the capture, a replay
            session.run()
        (got,) = session.outputs().values()
        (want,) = cpu.run(None, feed)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * float(np.abs(want).max()))
