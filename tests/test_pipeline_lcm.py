"""Guidance-distilled UNets (latent consistency models): the ONNX pipeline gives diffusers' image.

The claim: a folder of diffusers' ``LatentConsistencyModelPipeline`` (``models.pipelines`` kind
``sd15-lcm``: the tiny SD 1.5 with a UNet whose config sets ``time_cond_proj_dim``, exported with
optimum's ``timestep_cond`` input, and LCMScheduler) runs as diffusers runs it: no classifier-free
guidance (one UNet row per image, the negative prompt unused), the guidance fed as its embedding
``get_guidance_scale_embedding(guidance - 1)``, its own defaults (4 steps, guidance 8.5), and the
last step's ``denoised`` decoded. fp32 on the ORT CPU EP, with the fused step graph and with the
host loop, on the exported folder and on it optimized (standard ONNX: the ``tensorrt`` target;
the ``ort-cuda`` one is proven graph by graph on the reference kernels, and on a GPU with
``pytest -m gpu``). A ``StableDiffusionPipeline`` folder holding such a UNet runs as diffusers'
StableDiffusionPipeline runs it (the same embedding, no CFG). Bad configs exit 2 with one line.

Tolerances: those of tests/test_pipeline_generate.py (same graphs both sides, kernel rounding only).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="generating needs torch (pip install -e '.[models]')")
pytest.importorskip("diffusers", reason="generating needs diffusers")
pytest.importorskip("transformers", reason="generating needs transformers")
pytest.importorskip("onnxruntime", reason="generating needs onnxruntime")

from onnxopt.pipeline import Pipeline, PipelineFolder  # noqa: E402
from tests.test_pipeline_generate import LATENT_RTOL, assert_same_image  # noqa: E402

SEED = 0
HEIGHT, WIDTH = 32, 48
PROMPT = "a photo of a red cat"
THREADS = 1


class Built:
    """The tiny LCM: its torch pipeline (the reference) and its ONNX folder."""

    def __init__(self, root: Path):
        from models.pipelines import build_torch_pipeline, write_onnx_folder

        self.torch_pipe = build_torch_pipeline("sd15-lcm", "tiny", SEED)
        self.torch_pipe.set_progress_bar_config(disable=True)
        self.folder = root / "sd15-lcm"
        write_onnx_folder("sd15-lcm", self.folder, "tiny", "torchscript", SEED, pipe=self.torch_pipe)
        self.root = root
        self.pipelines: dict = {}

    def onnx(self, folder: Path | None = None, **load) -> Pipeline:
        key = (folder, tuple(sorted(load.items())))
        if key not in self.pipelines:
            self.pipelines[key] = Pipeline.load(folder or self.folder, "cpu", threads=THREADS, **load)
        return self.pipelines[key]

    def reference(self, pipe_class=None, **call):
        """diffusers' __call__ (its own defaults where ``call`` gives none): (the latents decoded, image)."""
        import torch

        pipe = (pipe_class or type(self.torch_pipe))(**self.torch_pipe.components)
        pipe.set_progress_bar_config(disable=True)
        final = {}

        def keep(_pipe, _i, _t, kwargs):
            final.update({name: value.clone() for name, value in kwargs.items()})
            return kwargs

        # LatentConsistencyModelPipeline decodes `denoised`, StableDiffusionPipeline `latents`
        decoded = "denoised" if pipe_class is None else "latents"
        with torch.no_grad():
            image = pipe(PROMPT, height=HEIGHT, width=WIDTH, generator=torch.Generator("cpu").manual_seed(call.pop("seed", SEED)),
                         output_type="np", callback_on_step_end=keep, callback_on_step_end_tensor_inputs=[decoded],
                         **call).images
        return final[decoded].numpy(), image


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield Built(tmp_path_factory.mktemp("lcm"))
    torch.set_num_threads(threads)


def ask(pipe: Pipeline, **request):
    return pipe(PROMPT, height=HEIGHT, width=WIDTH, progress=False, **request)


def test_guidance_embedding_is_diffusers(built):
    """Op for op diffusers' get_guidance_scale_embedding of guidance - 1: bit-equal, even and odd widths."""
    import torch

    from onnxopt.pipeline.guidance_embedding import guidance_embedding

    for width in (10, 11, 256):
        for guidance in (8.5, 1.0, 0.0, 3.0):
            expected = built.torch_pipe.get_guidance_scale_embedding(torch.tensor(guidance - 1).repeat(3), width)
            np.testing.assert_array_equal(guidance_embedding([guidance] * 3, width), expected.numpy())
    rows = guidance_embedding([8.5, 2.0], 10)  # a batch: each image its own guidance
    np.testing.assert_array_equal(rows[1], guidance_embedding([2.0], 10)[0])


@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "host-loop"])
def test_lcm_folder_gives_the_diffusers_image(built, fused):
    """Its own defaults (4 steps, guidance 8.5, LCMScheduler with original_inference_steps 50), no CFG,
    the embedding as timestep_cond, `denoised` decoded: diffusers' latents and image. The negative prompt
    is ignored, as diffusers' LatentConsistencyModelPipeline ignores it."""
    pipe = built.onnx(fused_step=fused)
    assert PipelineFolder.open(built.folder).kind == "lcm"
    result = ask(pipe)
    ref_latents, ref_images = built.reference()
    assert_same_image(result.latents, result.pixels, ref_latents, ref_images[0])
    assert result.timings["steps"] == 4 and result.timings["classifier_free_guidance"] is False
    assert pipe.plan.guidance_text().startswith("CFG never") and "timestep_cond" in pipe.plan.text()
    assert (result.timings["step"] == "built in memory from unet/model.onnx") == fused
    step = pipe.sessions["step" if fused else "unet"]
    assert {i.name: i.shape for i in step.get_inputs()}["timestep_cond"][1] == 10
    assert {i.name: i.shape[0] for i in step.get_inputs()}["encoder_hidden_states"] != 2  # one row per image
    negative = ask(pipe, negative_prompt="blurry, low quality")
    np.testing.assert_array_equal(negative.latents, result.latents)


def test_guidance_reaches_the_unet(built, monkeypatch):
    """The embedding is what moves the image: another guidance gives diffusers' other image, far from
    the first; a zero embedding in its place would miss diffusers' image by far."""
    import onnxopt.pipeline.guidance_embedding as embedding

    pipe = built.onnx()
    base = ask(pipe, guidance=8.5)
    other = ask(pipe, guidance=2.0, steps=2)
    ref_latents, ref_images = built.reference(guidance_scale=2.0, num_inference_steps=2)
    assert_same_image(other.latents, other.pixels, ref_latents, ref_images[0])
    scale = float(np.abs(base.latents).max())
    assert np.abs(ask(pipe, guidance=2.0).latents - base.latents).max() > 100 * LATENT_RTOL * scale
    real = embedding.guidance_embedding
    monkeypatch.setattr(embedding, "guidance_embedding", lambda guidance, width: np.zeros_like(real(guidance, width)))
    zeros = ask(pipe, guidance=8.5)
    assert np.abs(zeros.latents - base.latents).max() > 100 * LATENT_RTOL * scale


def test_the_prompts_row_twice_where_the_graphs_take_two_rows(built):
    """TensorRT's engines are built for two rows per image: there the UNet runs the prompt's row (and
    its embedding) twice and the pipeline reads one: diffusers' image still (here on the CPU EP's host
    loop, with the plan's rows set as TensorRT's plan sets them)."""
    from onnxopt.pipeline.plan import plan_generation

    assert plan_generation(PipelineFolder.open(built.folder), "tensorrt").no_cfg_rows == 2
    pipe = Pipeline.load(built.folder, "cpu", fused_step=False, threads=THREADS)
    pipe.plan.no_cfg_rows = 2
    result = ask(pipe)
    ref_latents, ref_images = built.reference()
    assert_same_image(result.latents, result.pixels, ref_latents, ref_images[0])


def test_several_images_each_with_its_noise(built):
    """num_images: one batch from one generator, each row its embedding, in diffusers' order."""
    result = ask(built.onnx(), num_images=2, seed=3)
    ref_latents, ref_images = built.reference(num_images_per_prompt=2, seed=3)
    for k in range(2):
        assert_same_image(result.latents[k:k + 1], result.all_pixels[k], ref_latents[k:k + 1], ref_images[k])


def test_stable_diffusion_pipeline_with_a_guidance_distilled_unet(built, tmp_path):
    """StableDiffusionPipeline feeds such a UNet timestep_cond and runs no CFG (its
    do_classifier_free_guidance is False with time_cond_proj_dim): its defaults (guidance 7.5), here 4
    LCM steps; the negative prompt unused there too."""
    from diffusers import StableDiffusionPipeline

    folder = tmp_path / "sd-lcm-unet"
    shutil.copytree(built.folder, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps(dict(index, _class_name="StableDiffusionPipeline")))
    assert PipelineFolder.open(folder).kind == "sd"
    pipe = Pipeline.load(folder, "cpu", threads=THREADS)
    result = ask(pipe, steps=4, negative_prompt="blurry")
    assert result.timings["classifier_free_guidance"] is False
    ref_latents, ref_images = built.reference(StableDiffusionPipeline, num_inference_steps=4, negative_prompt="blurry")
    assert_same_image(result.latents, result.pixels, ref_latents, ref_images[0])


@pytest.mark.models
def test_optimized_folder_gives_the_diffusers_image(built, tmp_path):
    """``optimize`` writes unet/step.onnx of one row per image reading timestep_cond (the K/V of the
    prompt in step.context_kv.onnx) and static text graphs at batch 1 (the prompt alone); the fused
    step on host feeds and on bound buffers (the CUDA EP's loop on CPU buffers), and the host loop, give
    diffusers' image."""
    from onnxopt.pipeline import optimize_folder

    out = tmp_path / "trt"
    optimize_folder(built.folder, out, target="tensorrt")  # standard ONNX: the CPU EP runs every component
    assert (out / "unet" / "step.onnx").is_file() and (out / "text_encoder" / "model.static.b1.onnx").is_file()
    assert not (out / "text_encoder" / "model.static.b2.onnx").exists()
    ref_latents, ref_images = built.reference()
    for load in (dict(), dict(io_binding=True), dict(fused_step=False)):
        pipe = built.onnx(out, **load)
        result = ask(pipe)
        assert_same_image(result.latents, result.pixels, ref_latents, ref_images[0])
        if load.get("fused_step", True):
            assert result.timings["step"] == "unet/step.onnx + step.context_kv.onnx"
            inputs = {i.name: i.shape for i in pipe.sessions["step"].get_inputs()}
            assert inputs["timestep_cond"][1] == 10
            assert result.timings["text_encoders"]["text_encoder"] == "model.static.b1.onnx"
    again = ask(built.onnx(out, io_binding=True), guidance=2.0, seed=5)  # the bound embedding is rewritten
    expected = ask(built.onnx(out), guidance=2.0, seed=5)
    np.testing.assert_allclose(again.latents, expected.latents, rtol=0, atol=1e-6 * np.abs(expected.latents).max())


@pytest.mark.models
def test_ort_cuda_folder_fuses_and_is_proven(built, tmp_path):
    """``optimize --target ort-cuda`` on the LCM folder: the UNet's fusions land (attention, GroupNorm)
    and it computes what the source computes on random inputs (timestep_cond among them), on the
    reference kernels; its step graph reads timestep_cond."""
    import onnx

    from onnxopt.cli import main
    from onnxopt.diff import diff
    from onnxopt.verify import InputSpec, Tolerance

    out = tmp_path / "ort-cuda"
    assert main(["optimize", "-i", str(built.folder), "-o", str(out), "--target", "ort-cuda", "-q"]) == 0
    unet = onnx.load(str(out / "unet" / "model.onnx"), load_external_data=False)
    ops = {n.op_type for n in unet.graph.node if n.domain == "com.microsoft"}
    assert {"MultiHeadAttention", "GroupNorm"} <= ops, ops
    dims = dict(batch=2, height=8, width=8, sequence=16)
    report = diff(built.folder / "unet" / "model.onnx", out / "unet" / "model.onnx", tolerance=Tolerance(atol=1e-4, rtol=1e-3),
                  inputs=InputSpec(dims=dims))
    assert report.ok, report.table()
    step = onnx.load(str(out / "unet" / "step.onnx"), load_external_data=False)
    assert "timestep_cond" in {i.name for i in step.graph.input}


@pytest.mark.models
@pytest.mark.parametrize("exporter, opset", [("torchscript", 17), pytest.param("dynamo", None, marks=pytest.mark.slow)])
def test_tiny_lcm_unet_exports_timestep_cond_and_fuses(export_tiny, exporter, opset):
    """The tiny unet-lcm exports with optimum's timestep_cond [batch, time_cond_proj_dim], and ort-cuda's
    fusions on it are verified against the export (the pass manager's check, reference kernels)."""
    import onnx

    from onnxopt.api import optimize

    exported = export_tiny("unet-lcm", exporter=exporter, opset=opset)
    graph = onnx.load(str(exported.path), load_external_data=False).graph
    inputs = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert inputs["timestep_cond"][1] == 10
    model, report = optimize(exported.path, ["ort-cuda"], verify=True, inputs=exported.input_spec())
    assert report.first_broken_pass is None and report.final_verification.ok, report.table()
    assert any(n.op == "MultiHeadAttention" for n in model.graph.nodes)


def _bad(built, tmp_path, edit, name="bad"):
    folder = tmp_path / name
    shutil.copytree(built.folder, folder)
    edit(folder)
    return folder


def _set(path: Path, **values):
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **values)))


@pytest.mark.parametrize("edit, expected", [
    (lambda f: _set(f / "unet" / "config.json", time_cond_proj_dim="10"), "'time_cond_proj_dim' must be a positive integer"),
    (lambda f: _set(f / "unet" / "config.json", time_cond_proj_dim=-4), "'time_cond_proj_dim' must be a positive integer"),
    (lambda f: _set(f / "unet" / "config.json", time_cond_proj_dim=True), "'time_cond_proj_dim' must be a positive integer"),
    (lambda f: _set(f / "unet" / "config.json", time_cond_proj_dim=12), "the graph's timestep_cond is [batch, 10]"),
    (lambda f: _set(f / "unet" / "config.json", time_cond_proj_dim=None), "needs a UNet with time_cond_proj_dim"),
    (lambda f: (_set(f / "unet" / "config.json", time_cond_proj_dim=None),
                _set(f / "model_index.json", _class_name="StableDiffusionPipeline")), "sets no time_cond_proj_dim"),
    (lambda f: (_set(f / "scheduler" / "scheduler_config.json", _class_name="DDIMScheduler"),
                _set(f / "model_index.json", scheduler=["diffusers", "DDIMScheduler"])), "runs lcm only, not ddim"),
], ids=["string", "negative", "bool", "mismatch", "lcm-without", "graph-without-config", "ddim-folder"])
def test_hostile_configs_exit_2_with_one_line(built, tmp_path, capsys, edit, expected):
    from onnxopt.cli import main

    folder = _bad(built, tmp_path, edit)
    code = main(["generate", str(folder), "--prompt", "a", "-q", "-o", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and expected in err and "Traceback" not in err, err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("args, expected", [
    (["--scheduler", "euler"], "runs lcm only, not euler"),
    (["--image", "IMAGE"], "--image (img2img) is not supported there"),
], ids=["scheduler", "img2img"])
def test_requests_lcm_does_not_run_exit_2(built, tmp_path, capsys, args, expected):
    from PIL import Image

    from onnxopt.cli import main

    image = tmp_path / "init.png"
    Image.new("RGB", (WIDTH, HEIGHT)).save(image)
    args = [str(image) if a == "IMAGE" else a for a in args]
    code = main(["generate", str(built.folder), "--prompt", "a", "-q", "-o", str(tmp_path / "x.png"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err


def test_a_unet_config_with_the_embedding_in_a_controlnet_folder_is_refused():
    """Only the families whose diffusers pipeline feeds the embedding run such a UNet (SD 1.5, LCM)."""
    from onnxopt.pipeline.plan import GenerationError
    from onnxopt.pipeline.runner import check_guidance_embedding_config

    folder = PipelineFolder.open(Path(__file__).resolve().parents[1] / "models" / "pipelines" / "sd15-tiny")
    folder.components["unet"].config = dict(folder.config("unet"), time_cond_proj_dim=8)
    folder.kind = "controlnet"
    with pytest.raises(GenerationError, match="runs in SD 1.5 and LatentConsistencyModelPipeline folders"):
        check_guidance_embedding_config(folder)


def _cuda() -> bool:
    from onnxopt.runners import cuda_available

    return cuda_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs onnxruntime-gpu and a CUDA device")
def test_cuda_captured_step_gives_the_cpu_image(built, tmp_path):
    """On a GPU (``pytest -m gpu``): the folder optimized for ort-cuda, its step graph captured as CUDA
    graphs with timestep_cond bound once per image: the CPU EP's image of the exported folder, and its
    replays (another guidance: the bound embedding rewritten in place, no new capture) that of the same
    folder without capture. Tolerances as tests/test_pipeline_generate.py's CUDA test: the fused fp32
    kernels are not bit-deterministic (2e-3 of the latents' scale between two uncaptured sessions on an
    H100); against the CPU's unfused graphs, 1e-2."""
    from onnxopt.pipeline import optimize_folder

    folder = tmp_path / "ort-cuda"
    optimize_folder(built.folder, folder, target="ort-cuda")
    captured = Pipeline.load(folder, "cuda", cuda_graph=True)
    uncaptured = Pipeline.load(folder, "cuda", cuda_graph=False)
    for guidance, seed in ((8.5, 0), (2.0, 5), (8.5, 0)):
        cpu = ask(built.onnx(), guidance=guidance, seed=seed)
        got, expected = ask(captured, guidance=guidance, seed=seed), ask(uncaptured, guidance=guidance, seed=seed)
        assert got.timings["cuda_graph"] and got.timings["classifier_free_guidance"] is False
        scale = float(np.abs(cpu.latents).max())
        np.testing.assert_allclose(got.latents, expected.latents, rtol=0, atol=2e-3 * scale)
        np.testing.assert_allclose(got.latents, cpu.latents, rtol=0, atol=1e-2 * scale)
        np.testing.assert_allclose(got.pixels, cpu.pixels, rtol=0, atol=2e-2)
    (loop,) = captured._device_loops.values()  # one shape: one set of buffers, captured once
    assert "timestep_cond" in loop.static
    assert captured.step_source == "unet/step.onnx + step.context_kv.onnx"
