"""Two streams for ControlNet: the step graph's part that does not wait for the
ControlNet, cut off; proven equal on tiny ControlNet folders from both exporters."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")
ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.models

DIMS = {"images": 1, "batch": 2, "height": 8, "width": 8, "height_div2": 4, "width_div2": 4, "sequence": 7, "schedule": 5}
TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """exporter -> a tiny sd15-controlnet folder with unet/step.onnx and the two-stream split."""
    from models.pipelines import write_onnx_folder
    from onnxopt.pipeline.step_graph import write_step_graph
    from onnxopt.pipeline.two_streams import write_two_stream_graphs

    cache = {}

    def get(exporter: str):
        if exporter not in cache:
            root = tmp_path_factory.mktemp(exporter) / "sd15-controlnet"
            write_onnx_folder("sd15-controlnet", root, "tiny", exporter, 0)
            write_step_graph(root / "unet")
            residuals = [o.name for o in ort.InferenceSession(str(root / "controlnet" / "model.onnx")).get_outputs()]
            write_two_stream_graphs(root / "unet", residuals)
            cache[exporter] = root
        return cache[exporter]

    return get


def random_feeds(session, rng, dims=DIMS) -> dict:
    """Random feeds for a step graph's session at ``dims`` (a named dim not in ``dims``: 1), with
    timesteps in the schedule's range."""
    feeds = {}
    for spec in session.get_inputs():
        shape = [d if isinstance(d, int) else dims.get(d, 1) for d in spec.shape]
        dtype = TYPES[spec.type]
        feeds[spec.name] = (rng.integers(0, dims["schedule"], shape) if dtype == np.int64
                            else rng.standard_normal(shape)).astype(dtype)
    feeds["schedule_timesteps"] = (np.abs(feeds["schedule_timesteps"]) * 300).astype(feeds["schedule_timesteps"].dtype)
    return feeds


def run(session, feeds) -> dict:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {i.name: feeds[i.name] for i in session.get_inputs()})))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_down_then_rest_equals_the_step_graph(folders, exporter):
    """down (no ControlNet input) then rest (the residuals and what follows) give every output of the
    step graph, on random inputs; down holds the down blocks and the mid block (the mid residual is
    added after it), rest the up blocks."""
    unet = folders(exporter) / "unet"
    step, down, rest = (ort.InferenceSession(str(unet / name))
                        for name in ("step.onnx", "step.streams.down.onnx", "step.streams.onnx"))
    down_inputs = {i.name for i in down.get_inputs()}
    assert not any(name.startswith(("down_block_res", "mid_block_res")) for name in down_inputs)
    assert {"down_block_res_0", "mid_block_res"} <= {i.name for i in rest.get_inputs()}
    assert {o.name for o in rest.get_outputs()} == {o.name for o in step.get_outputs()}
    for seed in range(2):
        feeds = random_feeds(step, np.random.default_rng(seed))
        expected = run(step, feeds)
        got = run(rest, {**feeds, **run(down, feeds)})
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5 * float(np.abs(value).max() or 1))


def test_a_step_graph_without_residuals_is_refused(tmp_path):
    """The lookalike: a step graph that reads no ControlNet residual has nothing to overlap."""
    import onnx_graphsurgeon as gs

    from onnxopt.errors import UnsupportedModelError
    from onnxopt.model import Model
    from onnxopt.pipeline.two_streams import split_step_graph

    x = gs.Variable("latents", np.float32, [1, 4])
    y = gs.Variable("latents_out", np.float32, [1, 4])
    graph = gs.Graph(nodes=[gs.Node("Relu", inputs=[x], outputs=[y])], inputs=[x], outputs=[y], opset=17)
    with pytest.raises(UnsupportedModelError, match="reads none of the ControlNet residuals"):
        split_step_graph(Model(graph=graph), ["down_block_res_0"])


@pytest.mark.parametrize("exporter", ["torchscript"])
def test_two_stream_loop_equals_the_one_graph_loop(folders, exporter):
    """The loop on two threads (ControlNet beside down, then rest) on CPU buffers: the latents of the
    device loop on step.onnx after every step, for a multistep solver (state), on two images."""
    from onnxopt.pipeline import PipelineFolder
    from onnxopt.pipeline.schedulers import make_scheduler, plan_steps
    from onnxopt.pipeline.sessions import DeviceStepLoop, controlnet_prepare_model, create_session, input_types
    from onnxopt.pipeline.two_streams import TwoStreamStepLoop

    root = folders(exporter)
    factor = PipelineFolder.open(root).vae_scale_factor
    make = lambda path: create_session(path, "cpu", name=str(path), threads=1)  # noqa: E731
    controlnet = make(root / "controlnet" / "model.onnx")
    timestep = next(i for i in controlnet.get_inputs() if i.name == "timestep")
    prepare = lambda: create_session(controlnet_prepare_model(  # noqa: E731
        input_types(controlnet)["sample"], input_types(controlnet)["timestep"], tuple(timestep.shape or ())),
        "cpu", name="prepare")
    step = make(root / "unet" / "step.onnx")
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
    static = {i.name: rng.standard_normal([d if isinstance(d, int) else DIMS[d] for d in i.shape]).astype(np.float32)
              for i in step.get_inputs() if i.name.endswith((".k", ".v"))}
    cn_inputs = {"encoder_hidden_states": rng.standard_normal((2, 7, 32)).astype(np.float32),
                 "controlnet_cond": rng.standard_normal((2, 3, 8 * factor, 8 * factor)).astype(np.float32),
                 "conditioning_scale": np.asarray([1.0], np.float32)}
    cn_inputs = {k: v for k, v in cn_inputs.items() if k in input_types(controlnet)}
    cn_inputs["encoder_hidden_states"] = rng.standard_normal(
        [d if isinstance(d, int) else DIMS[d] for d in controlnet.get_inputs()[2].shape]).astype(np.float32)
    plan = plan_steps(make_scheduler("dpm++2m", PipelineFolder.open(root).scheduler_config()), 4)
    one = DeviceStepLoop(ort, step, controlnet, prepare(), device="cpu")
    two = TwoStreamStepLoop(ort, make(root / "unet" / "step.streams.down.onnx"), make(root / "unet" / "step.streams.onnx"),
                            controlnet, prepare(), device="cpu")
    for loop in (one, two):
        loop.bind(latents, static, 1000, cn_inputs)
    for image in range(2):
        start = latents * (1 + image)
        for loop in (one, two):
            loop.start(plan, start, static, 7.5, cn_inputs)
        for _ in range(len(plan)):
            one.step()
            two.step()
            np.testing.assert_allclose(two.latents(), one.latents(), rtol=0, atol=1e-5 * float(np.abs(one.latents()).max()))
    assert not np.allclose(two.latents(), latents)


def test_generate_with_two_streams_gives_the_same_image(folders):
    """Pipeline.load(two_streams=True) on the bound-buffer loop (CPU buffers): the separate graphs'
    image, for two prompts/seeds on the same buffers; four session runs per step."""
    from PIL import Image

    from onnxopt.pipeline import Pipeline

    root = folders("torchscript")
    edges = (np.random.default_rng(7).random((64, 64)) > 0.8).astype(np.uint8) * 255
    request = dict(negative_prompt="blurry", steps=3, guidance=7.5, scheduler="dpm++2m", height=64, width=64,
                   controlnet_image=Image.fromarray(np.stack([edges] * 3, axis=-1)), progress=False)
    two = Pipeline.load(root, "cpu", io_binding=True, threads=1, two_streams=True)
    one = Pipeline.load(root, "cpu", io_binding=True, threads=1)
    assert "down" in two.sessions and "down" not in one.sessions
    for prompt, seed in (("a house", 0), ("a tree", 3)):
        a, b = two(prompt, seed=seed, **request), one(prompt, seed=seed, **request)
        assert a.timings["session_runs_per_step"] == 4 and "two streams" in a.timings["step"]
        np.testing.assert_allclose(a.latents, b.latents, rtol=0, atol=1e-5 * float(np.abs(b.latents).max()))
        np.testing.assert_allclose(a.pixels, b.pixels, rtol=0, atol=1e-5)


def _cuda() -> bool:
    return "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs onnxruntime-gpu and a CUDA device")
def test_two_streams_on_the_cuda_ep_with_capture(folders, tmp_path):
    """The ort-cuda folder on the CUDA EP with CUDA graphs: two streams (down, ControlNet and its input
    graph, rest: each captured) give the merged step's image within fp32 GPU rounding, twice."""
    from PIL import Image

    from onnxopt.pipeline import Pipeline, optimize_folder

    out = tmp_path / "ort-cuda"
    optimize_folder(folders("torchscript"), out, target="ort-cuda")
    edges = (np.random.default_rng(7).random((64, 64)) > 0.8).astype(np.uint8) * 255
    request = dict(negative_prompt="blurry", steps=4, guidance=7.5, scheduler="ddim", height=64, width=64,
                   controlnet_image=Image.fromarray(np.stack([edges] * 3, axis=-1)), progress=False)
    two = Pipeline.load(out, "cuda", two_streams=True)
    merged = Pipeline.load(out, "cuda", two_streams=False)
    assert two.cuda_graph and "down" in two.sessions
    for prompt, seed in (("a house", 0), ("a tree", 3)):
        a, b = two(prompt, seed=seed, **request), merged(prompt, seed=seed, **request)
        scale = float(np.abs(b.latents).max())
        np.testing.assert_allclose(a.latents, b.latents, rtol=0, atol=2e-3 * scale)
