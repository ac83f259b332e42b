"""One denoising step = one graph, and the pipeline rewrites' ablation switches.

Claims, on tiny SD 1.5 + ControlNet folders optimized for TensorRT (standard ONNX: every graph
runs on the ORT CPU EP), fp32:

* ``merged_step.onnx`` computes what the three graphs it replaces compute, chained as the device
  loop runs them (the ControlNet's input graph, ``controlnet/step.onnx``, ``unet/step.onnx``), on
  random inputs: all four outputs equal to 1e-5 of their scale (measured: bit-identical on the
  TorchScript folder; 1.2e-6 of the scale on the dynamo one, where ORT's graph optimizer fuses a
  few nodes differently in the one graph). The ControlNet is really inside: another conditioning
  scale moves the output.
* A whole generate run with it gives the separate graphs' latents (same seed), on the numpy loop
  and on the bound-buffer loop the CUDA EP runs (here on CPU buffers), and it is one session run
  per step instead of three.
* Its weights are the components' own: with external data, every initializer of 1 kB or more
  points into ``unet/model.onnx_data`` or ``controlnet/model.onnx_data``, nothing else is written
  at the root, and onnx.checker and ORT accept those locations.
* Each ablation switch of ``Pipeline.load`` (context_kv, controlnet_hint, merged_step) selects the
  graphs it says, and every combination gives the same image.
* SDXL's added conditioning runs once per prompt: the step graph reads add_embedding's output, not
  text_embeds and time_ids, and the image is the source folder's.

The folders come from both exporters, each with its own external data layout (TorchScript
``model.onnx_data``, dynamo ``model.onnx.data``); the dynamo folders take about a minute each to
export, so those cases are marked slow (CI runs them). They need ``models/pipelines.py``'s UNet
wrapper with named arguments (main, commit dc35426); with the older ``*rest`` wrapper the dynamo
exporter cannot export the ControlNet and SDXL UNets and the cases skip, saying so. The dynamo
forms of the context cut (SDXL's added conditioning included) are also proven on the UNet
families' exports in tests/test_context_kv.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytest.importorskip("torch", reason="building pipeline folders needs torch (pip install -e '.[models]')")
pytest.importorskip("diffusers", reason="building pipeline folders needs diffusers")
pytest.importorskip("onnxruntime", reason="running pipelines needs onnxruntime")

from onnxopt.errors import UnsupportedModelError  # noqa: E402
from onnxopt.pipeline import Pipeline, optimize_folder  # noqa: E402
from onnxopt.pipeline.merged_step import build_merged_step, merged_parts  # noqa: E402
from onnxopt.pipeline.sessions import controlnet_prepare_model, create_session, input_types, run_host  # noqa: E402

SEED, STEPS, HEIGHT, WIDTH = 0, 3, 32, 48
THREADS = 1
DATA_NAMES = {"torchscript": "model.onnx_data", "dynamo": "model.onnx.data"}  # each exporter's own layout
EXPORTERS = ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)]  # a dynamo folder takes ~1 min
PROMPT, NEGATIVE = "a photo of a red cat", "blurry"


def control_image():
    from PIL import Image

    rng = np.random.default_rng(7)
    edges = (rng.random((HEIGHT, WIDTH)) > 0.8).astype(np.uint8) * 255
    return Image.fromarray(np.stack([edges] * 3, axis=-1))


def request(kind: str, **overrides) -> dict:
    r = dict(prompt=PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=7.5, seed=SEED, height=HEIGHT, width=WIDTH,
             scheduler="dpm++2m", progress=False)
    if kind == "sd15-controlnet":
        r["controlnet_image"] = control_image()
    r.update(overrides)
    return r


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    """optimized(kind, exporter) -> (source folder, folder optimized for tensorrt), made once."""
    from models.pipelines import write_onnx_folder

    root = tmp_path_factory.mktemp("merged-step")
    cache: dict = {}

    def get(kind: str, exporter: str = "torchscript"):
        if (kind, exporter) not in cache:
            src, out = root / f"{kind}-{exporter}", root / f"{kind}-{exporter}-trt"
            try:
                write_onnx_folder(kind, src, "tiny", exporter, SEED, data_name=DATA_NAMES[exporter])
                optimize_folder(src, out, target="tensorrt")
                cache[kind, exporter] = (src, out)
            except RuntimeError as exc:  # models/pipelines.py before its UNet wrapper took named arguments
                if exporter != "dynamo" or "dynamic_axes" not in str(exc):
                    raise
                cache[kind, exporter] = f"the dynamo exporter cannot export this {kind} UNet wrapper: " \
                                        f"{str(exc).splitlines()[0]}"
        if isinstance(cache[kind, exporter], str):
            pytest.skip(cache[kind, exporter])
        return cache[kind, exporter]

    return get


def step_feeds(folder, rng, capacity: int = 5) -> dict[str, np.ndarray]:
    """One input set for a step (merged, or the separate graphs alike): the prompt's cached K/V
    and the hint of a random control image, as the runner computes them; random latents, state,
    schedule table and coefficients; step 2."""
    pipe = Pipeline.load(folder, "cpu", merged_step=False, threads=THREADS)
    cond = pipe.encode_prompt(PROMPT, NEGATIVE)
    cond.update(run_host(pipe.sessions["context"], cond))
    image = rng.uniform(0, 1, (2, 3, HEIGHT, WIDTH)).astype(np.float32)
    cond.update(run_host(pipe.sessions["hint"], {"controlnet_cond": image}))
    factor = pipe.folder.vae_scale_factor
    shape = (1, 4, HEIGHT // factor, WIDTH // factor)
    timestep_type = input_types(pipe.sessions["step"])["schedule_timesteps"]
    return {**cond, "latents": rng.standard_normal(shape).astype(np.float32),
            "state": rng.standard_normal(shape).astype(np.float32), "step_index": np.array([2], np.int64),
            "schedule_timesteps": np.array([999, 800, 601, 400, 1][:capacity]).astype(timestep_type),
            "schedule_coefficients": rng.uniform(0.2, 1.5, (capacity, 6)).astype(np.float32),
            "guidance_scale": np.array([7.5], np.float32), "conditioning_scale": np.array([0.8], np.float32)}


def run_chained(folder, feeds) -> dict[str, np.ndarray]:
    """The device loop's three runs: the ControlNet's input graph, controlnet/step.onnx, unet/step.onnx."""
    step = create_session(folder / "unet" / "step.onnx", "cpu", name="step", threads=THREADS)
    controlnet = create_session(folder / "controlnet" / "step.onnx", "cpu", name="controlnet", threads=THREADS)
    cn_types = input_types(controlnet)
    timestep = next(i for i in controlnet.get_inputs() if i.name == "timestep")
    prepare = create_session(controlnet_prepare_model(cn_types["sample"], cn_types["timestep"], tuple(timestep.shape)),
                             "cpu", name="prepare")
    cn_feeds = {**feeds, **run_host(prepare, {**feeds, "schedule_timesteps": feeds["schedule_timesteps"].astype(cn_types["timestep"])})}
    residuals = run_host(controlnet, cn_feeds)
    return run_host(step, {**feeds, **residuals})


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_merged_step_graph_equals_the_three_graphs_it_replaces(optimized, exporter):
    _, folder = optimized("sd15-controlnet", exporter)
    merged_path = folder / "merged_step.onnx"
    assert merged_parts(merged_path) == ("controlnet/step.onnx", "unet/step.onnx")
    merged = create_session(merged_path, "cpu", name="merged", threads=THREADS)
    step = create_session(folder / "unet" / "step.onnx", "cpu", name="step", threads=THREADS)
    controlnet = create_session(folder / "controlnet" / "step.onnx", "cpu", name="controlnet", threads=THREADS)
    expected_inputs = ({i.name for i in step.get_inputs()} - {o.name for o in controlnet.get_outputs()}
                       | {i.name for i in controlnet.get_inputs()}) - {"sample", "timestep"}
    assert {i.name for i in merged.get_inputs()} == expected_inputs
    assert [o.name for o in merged.get_outputs()] == ["latents_out", "state_out", "step_index_out", "guided_output"]
    feeds = step_feeds(folder, np.random.default_rng(0))
    got, want = run_host(merged, feeds), run_chained(folder, feeds)
    for name, value in want.items():  # TorchScript: bit-identical; dynamo: 1.2e-6 of the scale (ORT fuses in one graph)
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-5 * max(1.0, float(np.abs(value).max())), err_msg=name)
    # The ControlNet is inside: another conditioning scale changes the step's output.
    other = run_host(merged, {**feeds, "conditioning_scale": np.array([0.0], np.float32)})
    assert np.abs(other["latents_out"] - got["latents_out"]).max() > 1e-3 * np.abs(got["latents_out"]).max()


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_merged_step_refers_to_the_component_data_files(optimized, exporter):
    _, folder = optimized("sd15-controlnet", exporter)
    path = folder / "merged_step.onnx"
    onnx.checker.check_model(str(path))  # external data locations inside the model's folder
    proto = onnx.load(str(path), load_external_data=False)
    locations, largest_inline = set(), 0
    for tensor in proto.graph.initializer:
        where = {kv.key: kv.value for kv in tensor.external_data}
        if where:
            locations.add(where["location"])
        else:
            largest_inline = max(largest_inline, onnx.numpy_helper.to_array(tensor).nbytes)
    assert locations == {f"unet/{DATA_NAMES[exporter]}", f"controlnet/{DATA_NAMES[exporter]}"}
    assert largest_inline < 1024  # what the components keep inline too (small constants), nothing more
    assert sorted(p.name for p in folder.iterdir() if p.is_file() and "onnx" in p.name) == ["merged_step.onnx"]


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("io_binding", [False, True], ids=["host-loop", "bound-loop"])
def test_generate_with_the_merged_step_equals_the_separate_graphs(optimized, io_binding, exporter):
    _, folder = optimized("sd15-controlnet", exporter)
    merged = Pipeline.load(folder, "cpu", io_binding=io_binding, threads=THREADS)
    separate = Pipeline.load(folder, "cpu", io_binding=io_binding, merged_step=False, threads=THREADS)
    assert merged.session_runs_per_step() == 1 and "controlnet" not in merged.sessions
    assert separate.session_runs_per_step() == (3 if io_binding else 2)
    for seed in (SEED, SEED + 5):  # the second image reuses the bound buffers
        a = merged(**request("sd15-controlnet", seed=seed))
        b = separate(**request("sd15-controlnet", seed=seed))
        assert a.timings["step"].startswith("merged_step.onnx (unet/step.onnx + controlnet/step.onnx)")
        assert a.timings["session_runs_per_step"] == 1
        scale = float(np.abs(b.latents).max())
        np.testing.assert_allclose(a.latents, b.latents, rtol=0, atol=1e-6 * scale)
        np.testing.assert_allclose(a.pixels, b.pixels, rtol=0, atol=1e-5)
    assert len(merged._device_loops) == (1 if io_binding else 0)
    # step reuse reads the merged graph's guided output as it reads the step graph's
    a, b = merged(**request("sd15-controlnet", reuse="2")), separate(**request("sd15-controlnet", reuse="2"))
    assert a.timings["unet_steps"] == STEPS - 1
    np.testing.assert_allclose(a.latents, b.latents, rtol=0, atol=1e-6 * float(np.abs(b.latents).max()))


ABLATION = [  # (switches, the step's source, sessions present)
    ({}, "merged_step.onnx (unet/step.onnx + controlnet/step.onnx) + step.context_kv.onnx", {"context", "hint", "step"}),
    ({"merged_step": False}, "unet/step.onnx + step.context_kv.onnx", {"context", "hint", "step", "controlnet"}),
    ({"merged_step": False, "controlnet_hint": False}, "unet/step.onnx + step.context_kv.onnx",
     {"context", "step", "controlnet"}),
    ({"controlnet_hint": False}, "unet/step.onnx + step.context_kv.onnx", {"context", "step", "controlnet"}),
    ({"context_kv": False, "controlnet_hint": False, "merged_step": False}, "built in memory from unet/model.onnx",
     {"step", "controlnet"}),
]


def test_ablation_switches_select_their_graphs_and_keep_the_image(optimized):
    """Each switch chooses the graphs it names (the merged graph only with the graphs it was built
    from: with the hint off, the separate ControlNet runs); every choice gives the same image."""
    _, folder = optimized("sd15-controlnet")
    reference = None
    for switches, source, sessions in ABLATION:
        pipe = Pipeline.load(folder, "cpu", threads=THREADS, **switches)
        result = pipe(**request("sd15-controlnet"))
        assert result.timings["step"] == source, switches
        assert sessions <= set(pipe.sessions) and not ({"context", "hint", "controlnet"} - sessions) & set(pipe.sessions)
        if "controlnet" in sessions:
            reads = {i.name for i in pipe.sessions["controlnet"].get_inputs()}
            assert ("controlnet_cond" in reads) == (switches.get("controlnet_hint") is False)
        reference = result if reference is None else reference
        np.testing.assert_allclose(result.latents, reference.latents, rtol=0, atol=1e-5 * np.abs(reference.latents).max())


def test_a_merge_that_does_not_fit_is_refused_with_one_line(optimized):
    from onnxopt.loading import load_model

    _, folder = optimized("sd15-controlnet")
    with pytest.raises(UnsupportedModelError, match="not a UNet step graph: no input latents"):
        build_merged_step(load_model(folder / "unet" / "model.onnx"), load_model(folder / "controlnet" / "step.onnx"))
    hint = load_model(folder / "controlnet" / "step.hint.onnx")
    with pytest.raises(UnsupportedModelError, match="not a ControlNet graph: no input sample"):
        build_merged_step(load_model(folder / "unet" / "step.onnx"), hint)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_sdxl_added_conditioning_runs_once_per_prompt(optimized, exporter):
    """The context companion takes text_embeds and time_ids and hands over add_embedding's output;
    the step graph reads that and the cached K/V, not the text; the image is the source folder's."""
    src, folder = optimized("sdxl", exporter)
    pipe = Pipeline.load(folder, "cpu", threads=THREADS)
    context_reads = {i.name for i in pipe.sessions["context"].get_inputs()}
    step_reads = {i.name for i in pipe.sessions["step"].get_inputs()}
    if exporter == "torchscript":
        assert context_reads == {"encoder_hidden_states", "text_embeds", "time_ids"}
        assert "add_embedding.linear_2.out" in step_reads and not step_reads & context_reads
    else:  # dynamo reshapes time_ids' projection by Shape(sample): the cut stops before the concat (see the report)
        assert context_reads == {"encoder_hidden_states", "time_ids"} and "text_embeds" in step_reads
        assert not step_reads & context_reads
    result = pipe(**request("sdxl"))
    source = Pipeline.load(src, "cpu", threads=THREADS)(**request("sdxl"))
    scale = float(np.abs(source.latents).max())
    np.testing.assert_allclose(result.latents, source.latents, rtol=0, atol=1e-5 * scale)
    without = Pipeline.load(folder, "cpu", threads=THREADS, context_kv=False)
    assert {"text_embeds", "time_ids"} <= {i.name for i in without.sessions["step"].get_inputs()}
    np.testing.assert_allclose(without(**request("sdxl")).latents, source.latents, rtol=0, atol=1e-5 * scale)


def test_launch_timing_splits_the_step_without_changing_it(optimized):
    """launch_timing: the step's run returns once queued and the loop waits after it; the image is
    the same and the timings hold the host's part of a step (on the CPU EP it is the whole step)."""
    _, folder = optimized("sd15-controlnet")
    timed = Pipeline.load(folder, "cpu", io_binding=True, launch_timing=True, threads=THREADS)(**request("sd15-controlnet"))
    plain = Pipeline.load(folder, "cpu", io_binding=True, threads=THREADS)(**request("sd15-controlnet"))
    np.testing.assert_array_equal(timed.latents, plain.latents)
    assert 0 < timed.timings["step_launch_mean_s"] and "step_launch_mean_s" not in plain.timings


# --- CUDA EP (the lead runs these on the GPU machine: pytest -m gpu tests/test_pipeline_merged_step.py) ---

def _cuda():
    from onnxopt.runners.ort_cuda import cuda_available

    return cuda_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs onnxruntime-gpu and a CUDA device")
def test_merged_step_on_the_cuda_ep_with_cuda_graph(tmp_path):
    """The ort-cuda folder on the CUDA EP with CUDA graph capture: the merged step (one captured
    graph per parity) gives the separate graphs' image within the fused kernels' run-to-run spread
    (test_pipeline_generate.py: 2e-3 of the latents' scale), at one session run per step; prints
    both step times and their host parts for the ablation notes."""
    from models.pipelines import write_onnx_folder

    src, folder = tmp_path / "src", tmp_path / "ort-cuda"
    write_onnx_folder("sd15-controlnet", src, "tiny", "torchscript", SEED, data_name="model.onnx_data")
    optimize_folder(src, folder, target="ort-cuda")
    results = {}
    for merged in (True, False):
        pipe = Pipeline.load(folder, "cuda", cuda_graph=True, merged_step=merged, launch_timing=True, two_streams=False)
        pipe(**request("sd15-controlnet", steps=10))
        results[merged] = pipe(**request("sd15-controlnet", steps=10))  # replays the captured graphs
        assert results[merged].timings["cuda_graph"] is True
        assert results[merged].timings["session_runs_per_step"] == (1 if merged else 3)
        t = results[merged].timings
        print(f"merged={merged}: step {t['step_mean_s'] * 1e3:.3f} ms, host part {t['step_launch_mean_s'] * 1e3:.3f} ms")
    scale = float(np.abs(results[False].latents).max())
    np.testing.assert_allclose(results[True].latents, results[False].latents, rtol=0, atol=2e-3 * scale)
