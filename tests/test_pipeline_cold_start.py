"""Pipeline.load with its sessions made ahead, side by side (onnxopt.pipeline.session_prefetch).

The claims: on the committed tiny SD3.5 and Flux-dev folders (ORT CPU EP), the concurrent load takes
the sessions it made ahead (the plan's and the first image's text encoders, T5's included) and gives
the sequential load's image bit for bit, and never opens the transformer's own graph beside its step
graph (every weight twice, at the first image); a graph ORT cannot load fails with the sequential load's
one-line error; a graph optimization level onnxopt does not know is a one-line error.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="generating needs torch")
pytest.importorskip("diffusers", reason="generating needs diffusers")
pytest.importorskip("onnxruntime", reason="generating needs onnxruntime")

from onnxopt.errors import OnnxoptError  # noqa: E402
from onnxopt.pipeline import Pipeline  # noqa: E402
from onnxopt.pipeline import runner as runner_module  # noqa: E402
from onnxopt.pipeline.session_prefetch import Ahead, SessionPrefetch  # noqa: E402

PIPELINES = Path(__file__).resolve().parents[1] / "models" / "pipelines"
REQUEST = dict(steps=2, seed=3, height=32, width=32, progress=False)


@pytest.fixture
def made_on(monkeypatch):
    """The graph file of every session ORT is asked to create, by the thread that created it."""
    threads: dict[str, str] = {}
    create = runner_module.create_session

    def recording(model, *args, **kwargs):
        if not isinstance(model, bytes):
            threads[Path(model).relative_to(Path(model).parents[1]).as_posix()] = threading.current_thread().name
        return create(model, *args, **kwargs)

    monkeypatch.setattr(runner_module, "create_session", recording)
    return threads


@pytest.mark.parametrize("folder, ahead", [
    ("sd35-tiny-optimum", {"vae_decoder/model.onnx", "text_encoder/model.onnx", "text_encoder_2/model.onnx",
                           "text_encoder_3/model.onnx"}),
    ("flux-dev-tiny-optimum", {"vae_decoder/model.onnx", "text_encoder/model.onnx", "text_encoder_2/model.onnx"}),
])
def test_the_concurrent_load_makes_its_sessions_ahead_and_the_same_image(folder, ahead, made_on):
    request = dict(REQUEST, guidance=4.5) if folder.startswith("sd35") else REQUEST
    sequential = Pipeline.load(PIPELINES / folder, "cpu", threads=1, load_workers=0)(
        "a red cat", **request).pixels
    assert not any(name.startswith("onnxopt-session") for name in made_on.values())
    made_on.clear()
    concurrent = Pipeline.load(PIPELINES / folder, "cpu", threads=1)("a red cat", **request).pixels
    assert {graph for graph, thread in made_on.items() if thread.startswith("onnxopt-session")} == ahead
    np.testing.assert_array_equal(concurrent, sequential)
    # the fused step's load and first image never open the denoiser's own graph (its weights again)
    assert not {"transformer/model.onnx", "unet/model.onnx"} & set(made_on)


def test_a_graph_made_ahead_that_fails_gives_the_sequential_error(tmp_path):
    folder = tmp_path / "sd35"
    shutil.copytree(PIPELINES / "sd35-tiny-optimum", folder)
    (folder / "vae_decoder" / "model.onnx").write_bytes(b"not a graph")
    errors = []
    for workers in (0, 4):
        with pytest.raises(OnnxoptError) as caught:
            Pipeline.load(folder, "cpu", threads=1, load_workers=workers)
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and errors[0].startswith(f"{folder / 'vae_decoder'}: ONNX Runtime cannot load")


def test_an_unknown_graph_optimization_level_is_one_line():
    with pytest.raises(OnnxoptError, match="unknown graph optimization level 'fast' \\(choose from disable, basic"):
        Pipeline.load(PIPELINES / "sd35-tiny-optimum", "cpu", graph_optimization="fast")


def test_a_request_takes_the_session_made_ahead_only_for_the_same_file_and_capture(tmp_path):
    made = []
    prefetch = SessionPrefetch(lambda ahead: made.append(ahead) or ("ahead", ahead.model.name), workers=2)
    prefetch.start([Ahead("a", tmp_path / "a.onnx"), Ahead("a", tmp_path / "a.onnx"), Ahead("b", tmp_path / "b.onnx")])
    assert prefetch.take(Ahead("b", tmp_path / "b.onnx", cuda_graph=True), lambda: "now") == "now"
    assert prefetch.take(Ahead("a", tmp_path / "a.onnx"), lambda: "now") == ("ahead", "a.onnx")
    assert prefetch.take(Ahead("a", tmp_path / "a.onnx"), lambda: "now") == "now"  # taken once
    assert prefetch.take(Ahead("b", tmp_path / "b.onnx"), lambda: "now") == ("ahead", "b.onnx")
    assert len(made) == 2  # the same file listed twice is made once
    sequential = SessionPrefetch(lambda ahead: made.append(ahead), workers=0)
    sequential.start([Ahead("c", tmp_path / "c.onnx")])
    assert len(made) == 2 and sequential.take(Ahead("c", tmp_path / "c.onnx"), lambda: "now") == "now"


def test_release_drops_a_components_untaken_sessions_and_its_late_fallbacks(tmp_path):
    prefetch = SessionPrefetch(lambda ahead: ("ahead", ahead.model.name), workers=2)
    prefetch.start([Ahead("a", tmp_path / "a1.onnx"), Ahead("a", tmp_path / "a2.onnx"), Ahead("b", tmp_path / "b.onnx")])
    assert prefetch.release("a") == 2 and prefetch.release("a") == 0
    assert prefetch.take(Ahead("a", tmp_path / "a1.onnx"), lambda: "now") == "now"
    prefetch.made_here(Ahead("a", tmp_path / "a2.onnx"), lambda: "plain")  # a capture fallback finishing late
    assert prefetch.take(Ahead("a", tmp_path / "a2.onnx"), lambda: "now") == "now"
    assert prefetch.take(Ahead("b", tmp_path / "b.onnx"), lambda: "now") == ("ahead", "b.onnx")


@pytest.mark.slow  # optimize on the tiny SD3.5 folder: ~17 s on two cores
def test_an_optimized_folder_makes_its_step_graph_and_static_text_graphs_ahead(tmp_path, made_on):
    """``optimize --target tensorrt`` (standard ONNX: the CPU EP runs it) writes transformer/step.onnx and
    the CLIP encoders' static graphs: the concurrent load makes those of the guided request ahead."""
    from onnxopt.cli import main as onnxopt_main

    out = tmp_path / "opt"
    assert onnxopt_main(["optimize", "-i", str(PIPELINES / "sd35-tiny-optimum"), "-o", str(out), "--target", "tensorrt",
                         "-q"]) == 0
    request = dict(REQUEST, guidance=4.5)
    sequential = Pipeline.load(out, "cpu", threads=1, load_workers=0)("a red cat", **request).pixels
    made_on.clear()
    concurrent = Pipeline.load(out, "cpu", threads=1)("a red cat", **request).pixels
    assert {graph for graph, thread in made_on.items() if thread.startswith("onnxopt-session")} == {
        "vae_decoder/model.onnx", "transformer/step.onnx", "text_encoder/model.static.b2.onnx",
        "text_encoder_2/model.static.b2.onnx", "text_encoder_3/model.onnx"}
    np.testing.assert_array_equal(concurrent, sequential)


@pytest.fixture
def text_sessions_alive(monkeypatch):
    """The text-encoder sessions ORT made that something still holds: (graph file, session) for each."""
    import weakref

    made = []
    create = runner_module.create_session

    def recording(model, *args, **kwargs):
        session = create(model, *args, **kwargs)
        if not isinstance(model, bytes) and Path(model).parent.name.startswith("text_encoder"):
            made.append((Path(model).name, weakref.ref(session)))
        return session

    monkeypatch.setattr(runner_module, "create_session", recording)

    def alive() -> list[str]:
        import gc

        gc.collect()
        return sorted(name for name, ref in made if ref() is not None)

    return made, alive


def test_a_text_graph_made_ahead_for_another_prompt_batch_is_released(tmp_path, text_sessions_alive):
    """The load makes the static text graph of two rows ahead (the guidance unknown: classifier-free
    guidance assumed); a first image at guidance 1 encodes one row with the batch-1 graph: the
    two-row session is then released, not held beside it for the pipeline's life. No graph is made
    twice; a later guided image makes the two-row graph on first use, and a third takes what is held."""
    from tests.test_pipeline_static_text import with_static_graphs

    folder = with_static_graphs(PIPELINES / "sd15-tiny", tmp_path / "sd15", "sd15")
    made, alive = text_sessions_alive
    pipe = Pipeline.load(folder, "cpu", threads=1)
    pipe("a red cat", guidance=1.0, **REQUEST)
    assert sorted(name for name, _ in made) == ["model.static.b1.onnx", "model.static.b2.onnx"]
    assert alive() == ["model.static.b1.onnx"]
    for _ in range(2):
        pipe("a red cat", guidance=7.5, **REQUEST)
    assert len(made) == 3 and alive() == ["model.static.b1.onnx", "model.static.b2.onnx"]


def test_a_text_graph_made_ahead_and_taken_is_kept_and_made_once(tmp_path, text_sessions_alive):
    from tests.test_pipeline_static_text import with_static_graphs

    folder = with_static_graphs(PIPELINES / "sd15-tiny", tmp_path / "sd15", "sd15")
    made, alive = text_sessions_alive
    pipe = Pipeline.load(folder, "cpu", threads=1, guidance=1.0)  # one row known: the batch-1 graph ahead
    for guidance in (1.0, 0.5):
        pipe("a red cat", guidance=guidance, **REQUEST)
    assert [name for name, _ in made] == ["model.static.b1.onnx"] and alive() == ["model.static.b1.onnx"]


def test_a_graph_ort_refuses_to_capture_is_made_ahead_again_without_capture(monkeypatch, tmp_path):
    """The fallback of ``_SessionMaker.captured`` (ORT refuses CUDA graphs when a node is not on the
    CUDA EP), done ahead: the captured request gets the refusal, the plain request the session."""
    from onnxopt.pipeline.folder import PipelineFolder
    from onnxopt.pipeline.plan import PlanOptions, plan_generation

    def create(model, provider, *, cuda_graph=False, **kwargs):
        if cuda_graph:
            raise OnnxoptError(f"{model}: cannot capture")
        return ("plain", Path(model).name)

    monkeypatch.setattr(runner_module, "create_session", create)
    folder = PipelineFolder.open(PIPELINES / "sd35-tiny-optimum")
    maker = runner_module._SessionMaker(folder, plan_generation(folder, "cpu", PlanOptions()), 0, None,
                                        runner_module.StartupStatus(False))
    captured = Ahead("vae_decoder", folder.component("vae_decoder").model, cuda_graph=True)
    maker.prefetch.start([captured])
    with pytest.raises(OnnxoptError, match="cannot capture"):
        maker.prefetch.take(captured, lambda: "made in turn")
    assert maker.prefetch.take(Ahead("vae_decoder", captured.model), lambda: "made in turn") == ("plain", "model.onnx")



@pytest.fixture
def unet_sessions(monkeypatch):
    """The graph of every UNet session ORT is asked to create (a step graph built in memory: its bytes)."""
    made = []
    create = runner_module.create_session

    def recording(model, *args, **kwargs):
        if Path(str(kwargs.get("name", ""))).name == "unet":
            made.append(model)
        return create(model, *args, **kwargs)

    monkeypatch.setattr(runner_module, "create_session", recording)
    return made


@pytest.mark.parametrize("guidance, step", [(None, "step"), (1.0, "step_no_cfg")])
def test_the_folders_pndm_makes_its_history_step_at_load_and_the_plain_step_on_first_use(unet_sessions, guidance, step):
    """An SD 1.5 folder's own PNDM (skip_prk_steps) runs the step graph with its history: the load
    makes that one UNet session (its weights once on the device) and the first image makes none; the
    plain step is made once, by the first request with another scheduler."""
    request = dict(REQUEST, guidance=guidance) if guidance is not None else REQUEST
    pipe = Pipeline.load(PIPELINES / "sd15-tiny-optimum", "cpu", threads=1, guidance=guidance)
    assert [key for key in pipe.sessions if key.startswith("step")] == [step + "+history"]
    assert len(unet_sessions) == 1
    pipe("a red cat", **request)
    assert len(unet_sessions) == 1
    for _ in range(2):
        pipe("a red cat", scheduler="ddim", **request)
        assert len(unet_sessions) == 2 and step in pipe.sessions
    assert pipe.step_session(step) is pipe.sessions[step]


def test_a_load_for_another_scheduler_makes_the_plain_step_alone(unet_sessions):
    """The load told the calls' scheduler (``generate --scheduler ddim``) makes the step they run, and only it."""
    pipe = Pipeline.load(PIPELINES / "sd15-tiny-optimum", "cpu", threads=1, scheduler="ddim")
    pipe("a red cat", scheduler="ddim", **REQUEST)
    assert [key for key in pipe.sessions if key.startswith("step")] == ["step"] and len(unet_sessions) == 1
