"""More than one ControlNet: the folder diffusers' MultiControlNetModel writes
(``controlnet/``, ``controlnet_1/``), optimized and generated from, gives diffusers' image.

The claims, on the tiny SD 1.5 + two ControlNets folder (``models.pipelines``, kind
``sd15-multi-controlnet``: two ControlNets of different seeds), fp32 on the ORT CPU EP, each
ControlNet with its own image and scale (1.0, 0.5):

* every way the runner runs the step (diffusers' loop, the fused step graph summing the residual
  sets, the bound-buffer loop, two streams, the merged step) gives the final latents and image of
  diffusers' ``StableDiffusionControlNetPipeline(controlnet=[cn0, cn1])`` with the same weights,
  seed, scheduler and scales (the tolerances of tests/test_pipeline_generate.py);
* the step graph summing two residual sets equals the one-set step graph fed their sum, and the
  two-stream graphs chained equal it, on random inputs, for both exporters;
* bad requests and layouts are one-line errors (exit code 2).

Cost in the default run: one TorchScript folder (~9 s), its optimized copy (~4 s), one dynamo UNet
(~20 s), 3-step generations of 32x48 images (~1 s each).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("torch", reason="generating needs torch (pip install -e '.[models]')")
pytest.importorskip("diffusers", reason="generating needs diffusers")
ort = pytest.importorskip("onnxruntime", reason="generating needs onnxruntime")

from onnxopt.pipeline import Pipeline, PipelineFolder  # noqa: E402
from onnxopt.pipeline.schedulers import make_scheduler  # noqa: E402
from tests.test_pipeline_generate import assert_same_image  # noqa: E402
from tests.test_pipeline_two_streams import random_feeds as two_streams_feeds  # noqa: E402
from tests.test_pipeline_two_streams import run  # noqa: E402

pytestmark = pytest.mark.models

KIND = "sd15-multi-controlnet"
SEED, STEPS, GUIDANCE = 0, 3, 7.5
HEIGHT, WIDTH = 32, 48
SCALES = [1.0, 0.5]
PROMPT, NEGATIVE = "a photo of a red cat", "blurry"
THREADS = 1


def control_images(seed: int = 7):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(np.stack([(rng.random((HEIGHT, WIDTH)) > 0.8).astype(np.uint8) * 255] * 3, axis=-1))
            for _ in range(2)]


def generation(**overrides) -> dict:
    return dict(dict(prompt=PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=GUIDANCE, seed=SEED, height=HEIGHT,
                     width=WIDTH, controlnet_image=control_images(), controlnet_scale=SCALES, progress=False), **overrides)


def strengthen_controlnets(pipe) -> None:
    """Make the image matter. Seeded random init leaves the tiny ControlNets' hint to its last conv's
    bias (the image moved the final latents by 1e-4 of their scale: the equality tolerance) and
    their residuals small; the hint's last conv weights x30 and the residual convs x4 make swapping
    the two images move them by 2e-2 and blanking ControlNet 1's image by 5e-3 (measured)."""
    import torch

    with torch.no_grad():
        for net in pipe.controlnet.nets:
            net.controlnet_cond_embedding.conv_out.weight.mul_(30)
            for conv in [*net.controlnet_down_blocks, net.controlnet_mid_block]:
                conv.weight.mul_(4)
                conv.bias.mul_(4)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(torch pipeline, source folder, folder optimized for tensorrt), made once per module."""
    import torch

    from models.pipelines import build_torch_pipeline, write_onnx_folder
    from onnxopt.pipeline import optimize_folder

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    root = tmp_path_factory.mktemp("multi-controlnet")
    pipe = build_torch_pipeline(KIND, "tiny", SEED)
    pipe.set_progress_bar_config(disable=True)
    strengthen_controlnets(pipe)
    write_onnx_folder(KIND, root / KIND, "tiny", "torchscript", SEED, pipe=pipe)
    optimize_folder(root / KIND, root / "trt", target="tensorrt")
    yield pipe, root / KIND, root / "trt"
    torch.set_num_threads(threads)


def diffusers_image(pipe, folder, scheduler: str, **overrides):
    """diffusers' __call__ with the list of ControlNets: (final latents, image [H, W, 3] in [0, 1])."""
    import torch

    r = generation(**overrides)
    pipe.scheduler = make_scheduler(scheduler, PipelineFolder.open(folder).scheduler_config())
    final = {}

    def keep_latents(_pipe, i, _t, kwargs):
        final["latents"] = kwargs["latents"].clone()
        return kwargs

    with torch.no_grad():
        image = pipe(r["prompt"], negative_prompt=r["negative_prompt"], num_inference_steps=r["steps"],
                     guidance_scale=r["guidance"], height=r["height"], width=r["width"], image=r["controlnet_image"],
                     controlnet_conditioning_scale=r["controlnet_scale"], output_type="np",
                     generator=torch.Generator("cpu").manual_seed(r["seed"]), callback_on_step_end=keep_latents).images[0]
    return final["latents"].numpy(), image


def test_the_folder_has_diffusers_multi_controlnet_layout(built):
    import json

    _, folder, _ = built
    index = json.loads((folder / "model_index.json").read_text())
    assert index["controlnet"] == ["diffusers", "MultiControlNetModel"]
    opened = PipelineFolder.open(folder)
    assert opened.kind == "controlnet" and opened.controlnets == ["controlnet", "controlnet_1"]


@pytest.mark.parametrize("scheduler", ["ddim", "dpm++2m"])
def test_source_folder_gives_the_diffusers_image(built, scheduler):
    """The source folder: the fused step graph built in memory (summing the two residual sets) on the
    host loop, and diffusers' own loop (the residuals summed on the host, as MultiControlNetModel does)."""
    pipe, folder, _ = built
    ref = diffusers_image(pipe, folder, scheduler)
    for fused in (True, False):
        onnx_pipe = Pipeline.load(folder, "cpu", fused_step=fused, threads=THREADS)
        result = onnx_pipe(scheduler=scheduler, **generation())
        assert result.timings["session_runs_per_step"] == 3  # the step (or UNet) + two ControlNets
        assert_same_image(result.latents, result.pixels, *ref)


RUNS = [  # (Pipeline.load switches, the step's source, session runs per step)
    ({}, "merged_step.onnx (unet/step.onnx + controlnet/step.onnx + controlnet_1/step.onnx) + step.context_kv.onnx", 1),
    ({"io_binding": True}, "merged_step.onnx (unet/step.onnx + controlnet/step.onnx + controlnet_1/step.onnx)"
     " + step.context_kv.onnx", 1),
    ({"merged_step": False}, "unet/step.onnx + step.context_kv.onnx", 3),
    ({"merged_step": False, "io_binding": True}, "unet/step.onnx + step.context_kv.onnx", 4),
    ({"io_binding": True, "two_streams": True},
     "step.streams.onnx + step.streams.down.onnx (two streams) + step.context_kv.onnx", 5),
]


@pytest.mark.parametrize("switches, source, runs", RUNS, ids=["merged", "merged-bound", "separate", "separate-bound",
                                                               "two-streams"])
def test_optimized_folder_gives_the_diffusers_image(built, switches, source, runs):
    """optimize a folder: each ControlNet gets its hint split and step graph; the UNet step graph,
    its two-stream split and the merged step take both; every way of running them gives diffusers'
    image, and a second image on the same bound buffers too."""
    pipe, folder, trt = built
    for name in ("controlnet", "controlnet_1"):
        assert (trt / name / "step.hint.onnx").is_file() and (trt / name / "step.onnx").is_file()
    onnx_pipe = Pipeline.load(trt, "cpu", threads=THREADS, **switches)
    if not switches.get("merged_step", True) or switches.get("two_streams"):
        assert {"hint", "hint_1", "controlnet", "controlnet_1"} <= set(onnx_pipe.sessions)
    for seed in (SEED, SEED + 3):
        result = onnx_pipe(scheduler="ddim", **generation(seed=seed))
        assert result.timings["step"] == source and result.timings["session_runs_per_step"] == runs
        assert_same_image(result.latents, result.pixels, *diffusers_image(pipe, folder, "ddim", seed=seed))


def test_each_controlnet_reads_its_own_image_and_scale(built):
    """The lookalikes the equality above must tell apart: swapping the two images, blanking the
    second one, or one scale for both moves the latents by over 10x the equality tolerance."""
    _, _, trt = built
    onnx_pipe = Pipeline.load(trt, "cpu", threads=THREADS)
    base = onnx_pipe(scheduler="ddim", **generation()).latents
    scale = float(np.abs(base).max())
    from PIL import Image

    first, second = control_images()
    blank = Image.new(second.mode, second.size)
    for overrides in (dict(controlnet_image=[second, first]), dict(controlnet_image=[first, blank]),
                      dict(controlnet_scale=1.0)):
        other = onnx_pipe(scheduler="ddim", **generation(**overrides)).latents
        assert np.abs(other - base).max() > 1e-3 * scale, overrides


@pytest.fixture(scope="module")
def dynamo_unet(tmp_path_factory):
    """The dynamo export of the same UNet (no other component: the residual names are the contract's)."""
    from models.pipelines import write_onnx_folder

    root = tmp_path_factory.mktemp("dynamo") / KIND
    write_onnx_folder(KIND, root, "tiny", "dynamo", SEED, components=["unet"])
    return root / "unet"


DIMS = {"batch": 2, "height": 8, "width": 12, "height_div2": 4, "width_div2": 6, "height_div4": 2, "width_div4": 3,
        "sequence": 7, "schedule": 5, "images": 1}


def random_feeds(session, rng) -> dict:
    return two_streams_feeds(session, rng, DIMS)


@pytest.mark.parametrize("exporter", ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)])
def test_summing_step_graph_and_its_two_streams_equal_the_one_set_step_graph(built, request, tmp_path, exporter):
    """The step graph reading two residual sets equals the one-set step graph fed their sum, and its
    two-stream split (down, then rest) chained equals it: every output, on random inputs."""
    from onnxopt.pipeline.multi_controlnet import interface_name
    from onnxopt.pipeline.step_graph import write_step_graph
    from onnxopt.pipeline.two_streams import write_two_stream_graphs

    unet = tmp_path / "unet"
    shutil.copytree(built[1] / "unet" if exporter == "torchscript" else request.getfixturevalue("dynamo_unet"), unet)
    one = write_step_graph(unet, file_name="one.onnx", context_kv=False)
    two = write_step_graph(unet, context_kv=False, controlnets=2)
    residuals = [i.name for i in ort.InferenceSession(str(one)).get_inputs() if i.name.startswith(("down_block_res",
                                                                                                   "mid_block_res"))]
    assert len(residuals) == 5
    write_two_stream_graphs(unet, [interface_name(r, k) for k in (0, 1) for r in residuals])
    one, two, down, rest = (ort.InferenceSession(str(unet / name)) for name in
                            ("one.onnx", "step.onnx", "step.streams.down.onnx", "step.streams.onnx"))
    assert {i.name for i in two.get_inputs()} == {i.name for i in one.get_inputs()} | {f"controlnet_1.{r}" for r in residuals}
    assert not any("block_res" in i.name for i in down.get_inputs())
    for seed in range(2):
        feeds = random_feeds(two, np.random.default_rng(seed))
        summed = {**feeds, **{r: feeds[r] + feeds[f"controlnet_1.{r}"] for r in residuals}}
        expected = run(one, summed)
        for got in (run(two, feeds), run(rest, {**feeds, **run(down, feeds)})):
            for name, value in expected.items():
                np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5 * float(np.abs(value).max() or 1),
                                           err_msg=name)
        # the second set is read: without it the output moves
        alone = run(two, {**feeds, **{f"controlnet_1.{r}": np.zeros_like(feeds[r]) for r in residuals}})
        assert np.abs(alone["latents_out"] - expected["latents_out"]).max() > 1e-4 * np.abs(expected["latents_out"]).max()


# --- bad requests and layouts: one line, exit code 2 -------------------------------------------------

def test_wrong_image_or_scale_count_is_refused(built, tmp_path, capsys):
    from onnxopt.cli import main
    from onnxopt.pipeline.runner import GenerationError

    _, folder, _ = built
    onnx_pipe = Pipeline.load(folder, "cpu", threads=THREADS)
    with pytest.raises(GenerationError, match="2 ControlNets .*controlnet, controlnet_1.*got 1"):
        onnx_pipe(scheduler="ddim", **generation(controlnet_image=control_images()[0]))
    with pytest.raises(GenerationError, match="one conditioning scale for all or one each .*got 3"):
        onnx_pipe(scheduler="ddim", **generation(controlnet_scale=[1.0, 0.5, 0.2]))
    edges = tmp_path / "edges.png"
    control_images()[0].save(edges)
    out = tmp_path / "x.png"
    cases = [["--controlnet-image", str(edges)],
             ["--controlnet-image", str(edges)] * 3,
             ["--controlnet-image", str(edges)] * 2 + ["--controlnet-scale", "1.0", "0.5", "0.2"],
             ["--controlnet-image", str(edges)] * 2 + ["--controlnet-scale", "1.0", "nan"]]  # was: a NaN image
    for args in cases:
        assert main(["generate", str(folder), "--prompt", "a", "-o", str(out), "-q", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "ControlNet" in err
    assert not out.exists()


def test_cli_takes_one_image_and_scale_per_controlnet(built, tmp_path):
    """--controlnet-image twice and --controlnet-scale 1.0 0.5: the API's image."""
    from PIL import Image

    from onnxopt.cli import main

    _, _, trt = built
    paths = []
    for k, image in enumerate(control_images()):
        paths += ["--controlnet-image", str(tmp_path / f"edges{k}.png")]
        image.save(paths[-1])
    out = tmp_path / "x.png"
    assert main(["generate", str(trt), "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--steps", str(STEPS),
                 "--height", str(HEIGHT), "--width", str(WIDTH), "--scheduler", "ddim", *paths,
                 "--controlnet-scale", "1.0", "0.5", "-o", str(out), "-q"]) == 0
    expected = Pipeline.load(trt, "cpu", threads=THREADS)(scheduler="ddim", **generation()).image
    np.testing.assert_array_equal(np.asarray(Image.open(out)), np.asarray(expected))


def test_controlnet_1_without_controlnet_is_refused(built, tmp_path, capsys):
    """A folder with controlnet_1/ but no controlnet/: diffusers would drop it silently; here
    opening, generating and optimizing it say why, in one line."""
    from onnxopt.cli import main
    from onnxopt.errors import OnnxoptError
    from onnxopt.pipeline import optimize_folder
    from onnxopt.pipeline.folder import PipelineFolderError

    _, folder, _ = built
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken, ignore=shutil.ignore_patterns("vae_encoder"))
    shutil.rmtree(broken / "controlnet")
    with pytest.raises(PipelineFolderError, match="controlnet_1/ without controlnet/model.onnx"):
        PipelineFolder.open(broken)
    assert main(["generate", str(broken), "--prompt", "a", "-o", str(tmp_path / "x.png"), "-q"]) == 2
    assert "controlnet_1/ without controlnet/" in capsys.readouterr().err
    with pytest.raises(OnnxoptError, match="controlnet_1/ without controlnet/"):
        optimize_folder(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- CUDA EP (the lead runs these on the GPU machine: pytest -m gpu tests/test_pipeline_multi_controlnet.py) ---

def _cuda() -> bool:
    return "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs onnxruntime-gpu and a CUDA device")
def test_two_controlnets_on_the_cuda_ep(built, tmp_path):
    """The source folder on the CUDA EP gives the CPU image (fp32 GPU rounding, as in
    tests/test_pipeline_generate.py); the ort-cuda folder with CUDA graphs, with two streams (down,
    the input graph and both ControlNets, rest: each captured) and with the merged step, gives that
    folder's image without capture, for two prompts/seeds on the same captured graphs."""
    from onnxopt.pipeline import optimize_folder

    _, folder, _ = built
    cpu = Pipeline.load(folder, "cpu", threads=THREADS)(scheduler="ddim", **generation())
    plain = Pipeline.load(folder, "cuda", cuda_graph=False)(scheduler="ddim", **generation())
    scale = float(np.abs(cpu.latents).max())
    np.testing.assert_allclose(plain.latents, cpu.latents, rtol=0, atol=1e-3 * scale)
    np.testing.assert_allclose(plain.pixels, cpu.pixels, rtol=0, atol=2e-3)

    out = tmp_path / "ort-cuda"
    optimize_folder(folder, out, target="ort-cuda")
    two = Pipeline.load(out, "cuda", two_streams=True)
    merged = Pipeline.load(out, "cuda", two_streams=False)
    uncaptured = Pipeline.load(out, "cuda", cuda_graph=False, two_streams=False, merged_step=False)
    assert two.cuda_graph and "down" in two.sessions and {"controlnet", "controlnet_1"} <= set(two.sessions)
    assert merged.cuda_graph and merged.merged_step and merged.session_runs_per_step() == 1
    for prompt, seed in ((PROMPT, SEED), ("a tree", SEED + 3)):
        expected = uncaptured(scheduler="ddim", **generation(prompt=prompt, seed=seed))
        scale = float(np.abs(expected.latents).max())
        for pipe in (two, merged, two):  # the second two-stream run replays its captured graphs
            result = pipe(scheduler="ddim", **generation(prompt=prompt, seed=seed))
            np.testing.assert_allclose(result.latents, expected.latents, rtol=0, atol=2e-3 * scale)
            np.testing.assert_allclose(result.pixels, expected.pixels, rtol=0, atol=4e-3)
    assert two(scheduler="ddim", **generation()).timings["session_runs_per_step"] == 5


def test_a_step_graph_for_another_controlnet_count_is_never_run(built, tmp_path, capsys):
    """A step graph reading one residual set in a two-ControlNet folder would drop ControlNet 1's
    residuals without a word: unet/step.onnx is passed over for one built in memory (with a note),
    and a named step_file is refused in one line."""
    from onnxopt.pipeline.runner import GenerationError
    from onnxopt.pipeline.step_graph import write_step_graph

    _, folder, _ = built
    copy = tmp_path / "folder"
    shutil.copytree(folder, copy)
    write_step_graph(copy / "unet", context_kv=False)  # one residual set
    write_step_graph(copy / "unet", file_name="one.onnx", context_kv=False)
    pipe = Pipeline.load(copy, "cpu", threads=THREADS)
    assert "reads the residuals of 1 ControlNet(s), the folder has 2" in capsys.readouterr().err
    assert pipe.step_source == "built in memory from unet/model.onnx"
    with pytest.raises(GenerationError, match="reads the residuals of 1 ControlNet.*controlnets=2"):
        Pipeline.load(copy, "cpu", threads=THREADS, step_file="one.onnx")
