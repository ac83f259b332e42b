"""The step graph with and without classifier-free guidance hold their weights once between them.

A pipeline that serves guidance > 1 and guidance <= 1 runs two step sessions, the second built in
memory without the guidance rows (onnxopt.pipeline.step_graph.without_guidance). On the CPU EP,
loaded for calls of either guidance, both use one host copy of the step graph's weights
(onnxopt.pipeline.sessions.SharedWeights, ONNX Runtime's shared initializers): the second session
adds almost nothing to the process.
"""

from __future__ import annotations

import gc
import os
import shutil

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxopt.pipeline.plan import NO_CFG_STEP
from onnxopt.pipeline.runner import Pipeline
from tests.test_adversarial_round9 import COMMITTED_SD15

WIDTH = 393_216  # the weight: 32 x WIDTH float32, 48 MiB, far above the sessions' own allocations
WEIGHT_BYTES = 32 * WIDTH * 4


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def big_weight_unet(path) -> None:
    """A UNet interface (sample, timestep, encoder_hidden_states -> out_sample) around one MatMul by a
    48 MiB constant, which ORT's CPU EP prepacks per session unless the weight is shared."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((32, WIDTH), np.float32) * 1e-3, "w")
    nodes = [
        helper.make_node("MatMul", ["encoder_hidden_states", "w"], ["projected"]),
        helper.make_node("ReduceMean", ["projected"], ["mean"], axes=[1, 2], keepdims=0),
        helper.make_node("Add", ["mean", "timestep"], ["shift"]),
        helper.make_node("Reshape", ["shift", "column"], ["shift4"]),
        helper.make_node("Mul", ["shift4", "small"], ["scaled"]),
        helper.make_node("Add", ["sample", "scaled"], ["out_sample"]),
    ]
    graph = helper.make_graph(nodes, "unet", [
        helper.make_tensor_value_info("sample", T.FLOAT, ["batch", 4, "height", "width"]),
        helper.make_tensor_value_info("timestep", T.FLOAT, ["batch"]),
        helper.make_tensor_value_info("encoder_hidden_states", T.FLOAT, ["batch", "sequence", 32])],
        [helper.make_tensor_value_info("out_sample", T.FLOAT, ["batch", 4, "height", "width"])],
        [weight, numpy_helper.from_array(np.array([-1, 1, 1, 1], np.int64), "column"),
         numpy_helper.from_array(np.array(1e-4, np.float32), "small")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx_data", size_threshold=1024)


def test_the_step_without_guidance_adds_no_copy_of_the_weights(tmp_path):
    folder = tmp_path / "sd15"
    shutil.copytree(COMMITTED_SD15, folder)
    (folder / "unet" / "model.onnx_data").unlink()
    big_weight_unet(folder / "unet" / "model.onnx")
    request = dict(prompt="a cat", steps=2, seed=0, height=32, width=32, progress=False)
    pipe = Pipeline.load(folder, "cpu", status=False)  # each call its guidance, as serve loads it
    guided = pipe(guidance=7.5, **request)
    assert NO_CFG_STEP not in pipe.sessions  # made on first use
    gc.collect()
    before = resident_bytes()
    pipe._step_session(NO_CFG_STEP)
    plain = pipe(guidance=1.0, **request)
    gc.collect()
    added = resident_bytes() - before
    assert added < WEIGHT_BYTES / 4, f"the second step session added {added / 2**20:.1f} MiB ({WEIGHT_BYTES >> 20} MiB of weights)"
    assert np.isfinite(plain.latents).all() and not np.array_equal(plain.latents, guided.latents)


def test_a_pipeline_loaded_for_one_guidance_keeps_its_step_weights_prepacked(monkeypatch):
    """``generate`` knows its guidance: the other step session is made only if a call asks for it,
    so the step session made at load keeps ORT's prepacked (faster) weights of its own."""
    from onnxopt.pipeline import runner

    made = []
    real = runner.create_session
    monkeypatch.setattr(runner, "create_session",
                        lambda *args, **kwargs: made.append(kwargs.get("shared_initializers")) or real(*args, **kwargs))
    for guidance, shared in ((7.5, False), (None, True)):
        made.clear()
        Pipeline.load(COMMITTED_SD15, "cpu", status=False, guidance=guidance)
        assert any(made) == shared, (guidance, made)
