"""img2img, inpainting and several images per prompt: the ONNX pipeline gives diffusers' own images.

The claim: for the tiny SD 1.5 and SDXL folders (and an SD 1.5 inpainting folder: the same builder
with a UNet of 9 input channels), fp32 on the ORT CPU EP, ``Pipeline(..., image=, strength=)``
gives StableDiffusionImg2ImgPipeline's / StableDiffusionXLImg2ImgPipeline's images,
``image=, mask=`` StableDiffusionInpaintPipeline's, and ``num_images=N`` every image of diffusers'
``num_images_per_prompt=N`` batch in its order, with the same weights, scheduler config and seed.
The fused step (a schedule table that starts mid-way) and diffusers' loop both.

Tolerances: those of test_pipeline_generate (the same graphs, kernel rounding only): latents within
1e-4 of their scale, pixels within 1e-4. A wrong generator order, a schedule started at the wrong
index or a multistep solver carrying the full schedule's history moves pixels by 1e-2 or more.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="generating needs torch")
pytest.importorskip("diffusers", reason="generating needs diffusers")
pytest.importorskip("onnxruntime", reason="generating needs onnxruntime")

from onnxopt.pipeline import Pipeline, PipelineFolder  # noqa: E402
from onnxopt.pipeline.plan import GenerationError  # noqa: E402
from onnxopt.pipeline.schedulers import make_scheduler  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "models" / "pipelines" / "sd15-tiny"
SEED, STEPS, GUIDANCE, THREADS = 0, 5, 7.5, 1
PROMPT, NEGATIVE = "a photo of a red cat", "blurry"
LATENT_RTOL, PIXEL_ATOL = 1e-4, 1e-4
IMAGE_SIZE = (49, 33)  # (width, height): diffusers rounds it down to the VAE factor (2 for the tiny VAE): 48x32


def picture(size=IMAGE_SIZE, seed: int = 3):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype(np.uint8))


def mask_picture(size=(48, 32)):
    from PIL import Image

    mask = np.zeros((size[1], size[0]), np.uint8)
    mask[size[1] // 4: 3 * size[1] // 4, size[0] // 3:] = 255
    return Image.fromarray(mask)


class Folder:
    """A tiny kind's torch pipeline and its ONNX folder."""

    def __init__(self, kind: str, root: Path):
        import torch  # noqa: F401

        from models.pipelines import build_torch_pipeline, write_onnx_folder

        self.kind, self.folder = kind, root / kind
        self.torch_pipe = build_torch_pipeline(kind, "tiny", SEED)
        if kind == "sd15":  # the committed folder is this very export (byte for byte): no export needed
            self.folder = COMMITTED
        else:
            write_onnx_folder(kind, self.folder, "tiny", "torchscript", SEED, pipe=self.torch_pipe)
        self.pipelines: dict = {}

    def onnx(self, fused: bool = True) -> Pipeline:
        if fused not in self.pipelines:
            self.pipelines[fused] = Pipeline.load(self.folder, "cpu", fused_step=fused, threads=THREADS)
        return self.pipelines[fused]

    def diffusers(self, cls_name: str, scheduler: str | None):
        """diffusers' ``cls_name`` pipeline as a user makes it from the folder's components and scheduler."""
        import diffusers

        opened = PipelineFolder.open(self.folder)
        own = getattr(diffusers, opened.index["scheduler"][1]).from_config(opened.scheduler_config())
        pipe = getattr(diffusers, cls_name)(**dict(self.torch_pipe.components, scheduler=own))
        if scheduler is not None:
            pipe.scheduler = make_scheduler(scheduler, dict(pipe.scheduler.config))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference(self, cls_name: str, scheduler: str | None, guidance: float = GUIDANCE, **kwargs):
        """diffusers' (final latents, images [N, H, W, 3])."""
        import torch

        final = {}

        def keep(_pipe, _i, _t, tensors):
            final["latents"] = tensors["latents"].clone()
            return tensors

        with torch.no_grad():
            out = self.diffusers(cls_name, scheduler)(
                PROMPT, negative_prompt=NEGATIVE, num_inference_steps=STEPS, guidance_scale=guidance,
                generator=torch.Generator("cpu").manual_seed(SEED), output_type="np", callback_on_step_end=keep,
                **kwargs).images
        return final["latents"].numpy(), out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(kind) -> Folder, exported once per module (the inpainting folder is built here, not committed)."""
    import torch

    root = tmp_path_factory.mktemp("img2img")
    cache: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)

    def get(kind: str) -> Folder:
        if kind not in cache:
            cache[kind] = Folder(kind, root)
        return cache[kind]

    yield get
    torch.set_num_threads(threads)


def assert_same(result, ref_latents, ref_images):
    scale = float(np.abs(ref_latents).max())
    assert result.latents.shape == ref_latents.shape
    np.testing.assert_allclose(result.latents, ref_latents, rtol=0, atol=LATENT_RTOL * scale)
    assert result.all_pixels.shape == ref_images.shape
    np.testing.assert_allclose(result.all_pixels, ref_images, rtol=0, atol=PIXEL_ATOL)


IMG2IMG = {"sd15": "StableDiffusionImg2ImgPipeline", "sdxl": "StableDiffusionXLImg2ImgPipeline"}


@pytest.mark.parametrize("kind, scheduler, fused", [
    ("sd15", "ddim", True), ("sd15", "dpm++2m", True), ("sd15", "euler", False), ("sd15", None, True),
    ("sdxl", None, True), ("sdxl", "dpm++2m", False)])
def test_img2img_gives_the_diffusers_images(tiny, kind, scheduler, fused):
    """Strength 0.6 of 5 steps: int(3.0) = 3 run, from index 2 (DPM-Solver++ starts at first order
    there); two images from one generator; the output is the init image's size rounded down."""
    t = tiny(kind)
    result = t.onnx(fused)(PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=GUIDANCE, seed=SEED,
                           scheduler=scheduler, image=picture(), strength=0.6, num_images=2, progress=False)
    ref_latents, ref_images = t.reference(IMG2IMG[kind], scheduler, image=picture(), strength=0.6,
                                          num_images_per_prompt=2)
    assert result.all_pixels.shape == (2, 32, 48, 3)
    assert_same(result, ref_latents, ref_images)
    if fused and scheduler is not None:
        assert result.timings["steps"] == 3 and "unfused" not in result.timings["step"]


@pytest.mark.parametrize("strength", [0.6, 0.2, 1.0])
def test_pndm_img2img_and_two_images_on_the_step_graph(tiny, strength):
    """PNDM (the SD 1.5 folder's own scheduler) on the step graph with its history: diffusers'
    img2img starts its PLMS run at ``timesteps[t_start:]`` of the N + 1 (the second timestep twice)
    with an empty history, as a fresh run; strength 0.2 of 5 steps runs one step then its repeat."""
    t = tiny("sd15")
    result = t.onnx()(PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=GUIDANCE, seed=SEED, scheduler="pndm",
                      image=picture(), strength=strength, num_images=2, progress=False)
    assert_same(result, *t.reference(IMG2IMG["sd15"], "pndm", image=picture(), strength=strength,
                                     num_images_per_prompt=2))
    assert result.timings["steps"] == STEPS + 1 - (STEPS - int(STEPS * strength))
    assert "unfused" not in result.timings["step"]


def test_img2img_default_strength_is_diffusers(tiny):
    """No strength: the pipeline's own default (0.8 for SD: int(5 x 0.8) = 4 steps)."""
    t = tiny("sd15")
    result = t.onnx()(PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=GUIDANCE, seed=SEED, scheduler="ddim",
                      image=picture(), progress=False)
    ref_latents, ref_images = t.reference(IMG2IMG["sd15"], "ddim", image=picture())
    assert result.timings["steps"] == 4
    assert_same(result, ref_latents, ref_images)


@pytest.mark.parametrize("kind, scheduler", [("sd15", "ddim"), ("sdxl", None)])
def test_several_images_are_diffusers_batch(tiny, kind, scheduler):
    """num_images=3 is num_images_per_prompt=3: one batch from one generator, in diffusers' order."""
    import diffusers

    t = tiny(kind)
    result = t.onnx()(PROMPT, negative_prompt=NEGATIVE, steps=3, guidance=GUIDANCE, seed=SEED, scheduler=scheduler,
                      height=32, width=48, num_images=3, progress=False)
    import torch

    pipe = t.diffusers(type(t.torch_pipe).__name__, scheduler)
    with torch.no_grad():
        ref = pipe(PROMPT, negative_prompt=NEGATIVE, num_inference_steps=3, guidance_scale=GUIDANCE, height=32,
                   width=48, num_images_per_prompt=3, generator=torch.Generator("cpu").manual_seed(SEED),
                   output_type="np").images
    assert isinstance(pipe, (diffusers.StableDiffusionPipeline, diffusers.StableDiffusionXLPipeline))
    np.testing.assert_allclose(result.all_pixels, ref, rtol=0, atol=PIXEL_ATOL)
    assert len(result.images) == 3 and np.abs(ref[0] - ref[1]).max() > 1e-2  # three different images


@pytest.mark.parametrize("strength, mask_size, fused", [(1.0, (48, 32), True), (0.6, (20, 14), True),
                                                       (0.6, (48, 32), False)])
def test_inpainting_gives_the_diffusers_images(tiny, strength, mask_size, fused):
    """StableDiffusionInpaintPipeline: strength 1 (pure noise) and 0.6 (the image's latents noised,
    encoded before the masked image); a mask of another size is resized to the image's, as diffusers
    does. The fused step graph reads the mask channels as an input (inpaint_channels); diffusers' loop too."""
    t = tiny("sd15-inpaint")
    mask = mask_picture(mask_size)
    result = t.onnx(fused)(PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=GUIDANCE, seed=SEED, scheduler="ddim",
                      image=picture(), mask=mask, strength=strength, height=32, width=48, num_images=2, progress=False)
    ref_latents, ref_images = t.reference("StableDiffusionInpaintPipeline", "ddim", image=picture(), mask_image=mask,
                                          strength=strength, height=32, width=48, num_images_per_prompt=2)
    assert_same(result, ref_latents, ref_images)
    assert ("unfused" in result.timings["step"]) is not fused


ODD_SIZE = (45, 37)  # (width, height): neither a multiple of the VAE factor nor, rounded down (44x36), of 8


def test_img2img_of_an_image_of_any_size_is_diffusers(tiny):
    """An init image whose sides are multiples of nothing: resized (lanczos) to its size rounded down
    to the VAE factor, as StableDiffusionImg2ImgPipeline's VaeImageProcessor does, though that is no
    multiple of 8, and diffusers' image at that size (the tiny SDXL UNet's latents must be multiples of
    4, 8 pixels: IMAGE_SIZE above covers it)."""
    t = tiny("sd15")
    result = t.onnx()(PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=GUIDANCE, seed=SEED, scheduler="ddim",
                      image=picture(ODD_SIZE), strength=0.6, progress=False)
    assert result.all_pixels.shape == (1, 36, 44, 3)
    assert_same(result, *t.reference(IMG2IMG["sd15"], "ddim", image=picture(ODD_SIZE), strength=0.6))


def test_inpainting_of_images_of_any_size_is_diffusers(tiny):
    """An init image and a mask of other odd sizes, at a --height/--width that StableDiffusionInpaintPipeline
    takes (multiples of the VAE factor, not of 8): both resized to it by their processors, diffusers' image."""
    t = tiny("sd15-inpaint")
    mask = mask_picture((31, 23))
    result = t.onnx()(PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=GUIDANCE, seed=SEED, scheduler="ddim",
                      image=picture(ODD_SIZE), mask=mask, strength=0.6, height=36, width=44, progress=False)
    assert result.all_pixels.shape == (1, 36, 44, 3)
    assert_same(result, *t.reference("StableDiffusionInpaintPipeline", "ddim", image=picture(ODD_SIZE), mask_image=mask,
                                     strength=0.6, height=36, width=44))


def test_pndm_inpainting_on_the_step_graph(tiny):
    """PNDM's history beside the inpainting UNet's mask channels: StableDiffusionInpaintPipeline's images."""
    t = tiny("sd15-inpaint")
    result = t.onnx()(PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=GUIDANCE, seed=SEED, scheduler="pndm",
                      image=picture(), mask=mask_picture(), strength=0.6, height=32, width=48, num_images=2,
                      progress=False)
    assert_same(result, *t.reference("StableDiffusionInpaintPipeline", "pndm", image=picture(), mask_image=mask_picture(),
                                     strength=0.6, height=32, width=48, num_images_per_prompt=2))
    assert "unfused" not in result.timings["step"]


@pytest.mark.parametrize("kind, guidance, fused", [("sd15", 1.0, True), ("sdxl", 0.7, False), ("sd15-inpaint", 1.0, True),
                                                   ("sd15-inpaint", 0.5, False)])
def test_img2img_and_inpainting_without_guidance_are_diffusers(tiny, kind, guidance, fused):
    """At guidance <= 1 the img2img and inpainting pipelines run the prompt's row alone (the inpainting
    channels one row per image, not both guidance rows); two images of one generator."""
    t = tiny(kind)
    inpaint = {"mask": mask_picture(), "height": 32, "width": 48} if kind == "sd15-inpaint" else {}
    result = t.onnx(fused)(PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=guidance, seed=SEED,
                           scheduler="ddim", image=picture(), strength=0.6, num_images=2, progress=False, **inpaint)
    assert result.timings["classifier_free_guidance"] is False and ("unfused" in result.timings["step"]) is not fused
    if inpaint:
        inpaint["mask_image"] = inpaint.pop("mask")
    cls_name = "StableDiffusionInpaintPipeline" if inpaint else IMG2IMG[kind]
    assert_same(result, *t.reference(cls_name, "ddim", guidance, image=picture(), strength=0.6, num_images_per_prompt=2,
                                     **inpaint))


def test_refusals(tiny):
    """Requests diffusers would fail on, or onnxopt cannot run as diffusers does: a one-line error."""
    sd, inpaint = tiny("sd15"), tiny("sd15-inpaint")
    pipe = sd.onnx()
    run = dict(prompt=PROMPT, steps=STEPS, progress=False)
    cases = [
        (pipe, dict(image=picture(), strength=0.0), "strength must be"),
        (pipe, dict(image=picture(), strength=1.5), "strength must be"),
        (pipe, dict(image=picture(), strength=float("nan")), "strength must be"),
        (pipe, dict(image=picture(), strength=0.1), "= 0 of the 5 steps"),
        (pipe, dict(image=picture(), mask=mask_picture()), "--mask needs an inpainting UNet"),
        (pipe, dict(strength=0.5), "--strength needs an init image"),
        (pipe, dict(image=picture(), height=32, width=48), "img2img takes the init image's size"),
        (pipe, dict(image=picture((1, 9))), "rounds down to no pixels"),
        (pipe, dict(image=picture((47, 37))), "latents whose sides are multiples of 2"),  # 46x36: latents 23x18
        (tiny("sdxl").onnx(), dict(image=picture(ODD_SIZE)), "latents whose sides are multiples of 4"),
        (inpaint.onnx(), dict(image=picture(), mask=mask_picture(), height=36, width=45), "multiple of 2"),
        (inpaint.onnx(), dict(image=picture(), mask=mask_picture(), height=36, width=46), "multiples of 2"),
        (pipe, dict(num_images=10**6), "number of images"),
        (inpaint.onnx(), dict(image=picture()), "needs --mask"),
        (inpaint.onnx(), dict(), "give --image and --mask"),
    ]
    for target, kwargs, message in cases:
        with pytest.raises(GenerationError, match=message):
            target(**run, **kwargs)


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "onnxopt", "generate", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})



def test_cli_writes_numbered_images_and_prompts_file(tmp_path):
    """-o DIR/img.png with --num-images 2 and a --prompts file of two prompts (CRLF lines): 4 files
    img.png, img-1.png, img-2.png, img-3.png, prompt by prompt; the images are the API's."""
    picture().save(tmp_path / "init.png")
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"a red cat\r\n\r\na blue dog\r\n")
    out = tmp_path / "out" / "img.png"
    out.parent.mkdir()
    (out.parent / "img-1.png").write_bytes(b"old")  # an existing sibling is replaced
    done = cli(COMMITTED, "--prompts", prompts, "--image", tmp_path / "init.png", "--strength", "0.5",
               "--steps", 4, "--num-images", 2, "--scheduler", "ddim", "-q", "-o", out)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["img-1.png", "img-2.png", "img-3.png", "img.png"]
    from PIL import Image

    pipe = Pipeline.load(COMMITTED, "cpu", threads=THREADS)
    result = pipe("a blue dog", steps=4, scheduler="ddim", image=picture(), strength=0.5, num_images=2, progress=False)
    for k, image in enumerate(result.images):
        written = np.asarray(Image.open(out.parent / f"img-{2 + k}.png"), np.int16)
        assert np.abs(written - np.asarray(image, np.int16)).max() <= 1


def test_cli_summary_after_several_prompts(tmp_path):
    """Without -q, generate prints what it wrote and the timings; with a --prompts file only the first
    image of the load has a cold start (the summary crashed with KeyError 'cold_start_s', exit 3)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\na blue dog\n")
    done = cli(COMMITTED, "--prompts", prompts, "--steps", 1, "-o", tmp_path / "img.png")
    assert done.returncode == 0, done.stderr
    assert "wrote " in done.stdout and "and 1 more (img-1.png)" in done.stdout
    assert done.stdout.count("cold start") == 1, done.stdout


def test_a_call_that_fails_clears_the_status_line_it_leaves(monkeypatch):
    """An error raised inside a pipeline call starts its own line: a startup status line shown when it
    raised is cleared first (runner.clears_status on ``Pipeline.__call__``)."""
    from onnxopt.pipeline.runner import StartupStatus

    pipe = Pipeline.load(COMMITTED, "cpu", threads=THREADS)

    def fails_with_a_line_shown(*args, **kwargs):
        StartupStatus.line_shown = True  # a session made on first use shows its line, then fails
        raise RuntimeError("made to fail")

    monkeypatch.setattr(pipe, "_conditioning", fails_with_a_line_shown)
    with pytest.raises(RuntimeError, match="made to fail"):
        pipe("a cat", steps=2, progress=False)
    assert StartupStatus.line_shown is False


def test_cli_refusals_leave_nothing(tmp_path, capsys):
    """Bad input: exit 2, one line, nothing written (an output through a symbolic link is refused)."""
    picture().save(tmp_path / "init.png")
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "empty.txt").write_text("\n \n")
    out = tmp_path / "o" / "img.png"
    out.parent.mkdir()
    (out.parent / "img-1.png").symlink_to(tmp_path / "init.png")
    base = (COMMITTED, "--steps", 2, "-q", "-o", out)
    cases = [
        (("--prompt", "x", "--image", tmp_path / "notes.txt"), "not a readable image"),
        (("--prompt", "x", "--image", tmp_path), "is a folder"),
        (("--prompt", "x", "--image", tmp_path / "init.png", "--strength", "nan"), "strength must be"),
        (("--prompt", "x", "--image", tmp_path / "init.png", "--mask", tmp_path / "init.png"), "inpainting UNet"),
        (("--prompt", "x", "--num-images", 100000), "num-images"),
        (("--prompts", tmp_path / "empty.txt"), "no prompt"),
        (("--prompts", tmp_path), "is a folder"),
        (("--prompt", "x", "--prompts", tmp_path / "empty.txt"), "not both"),
        (("--prompt", "x", "--num-images", 2), "is a symbolic link"),
    ]
    from onnxopt.cli import main

    for args, message in cases:  # in this process: a subprocess a case cost 10 s of imports each
        code = main(["generate", *map(str, base), *map(str, args)])
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (args, err)
        assert sorted(p.name for p in out.parent.iterdir()) == ["img-1.png"], args
    assert (tmp_path / "init.png").is_file() and (out.parent / "img-1.png").is_symlink()


def test_cli_image_on_a_folder_without_vae_encoder(tmp_path, capsys):
    import shutil

    from onnxopt.cli import main

    folder = tmp_path / "no-encoder"
    shutil.copytree(COMMITTED, folder, ignore=shutil.ignore_patterns("vae_encoder"))
    picture().save(tmp_path / "init.png")
    code = main(["generate", str(folder), "--prompt", "x", "--image", str(tmp_path / "init.png"), "-q", "-o",
                 str(tmp_path / "x.png")])
    assert code == 2 and "no vae_encoder/" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


# --- CUDA EP (the lead runs these on the GPU machine: pytest -m gpu tests/test_pipeline_img2img.py) ---

@pytest.mark.gpu
@pytest.mark.parametrize("kind, scheduler", [("sd15", "dpm++2m"), ("sdxl", "euler"), ("sd15-inpaint", "ddim")])
def test_cuda_captured_steps_start_mid_way(tiny, kind, scheduler, tmp_path):
    """On a GPU: img2img and inpainting on the folder optimized for ort-cuda, bound buffers and captured
    steps, give that folder's image without capture (a schedule table that starts mid-way; a second
    strength replays the graphs on the same buffers with another table), within 4e-3 of the
    latents' scale: two CUDA sessions differ by up to 2e-3 of it per image (test_pipeline_generate's
    CUDA test), and on the H100 SDXL's Euler img2img differed by 2.1e-3 at 2 of 3072 values (a wrong
    buffer or table differs everywhere, by the latents' own size)."""
    from onnxopt.pipeline import optimize_folder
    from onnxopt.runners.ort_cuda import cuda_available

    if not cuda_available():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")
    folder = tmp_path / "ort-cuda"
    optimize_folder(tiny(kind).folder, folder, target="ort-cuda")
    captured = Pipeline.load(folder, "cuda", cuda_graph=True)
    plain = Pipeline.load(folder, "cuda", cuda_graph=False, io_binding=False)
    extra = dict(mask=mask_picture(), height=32, width=48) if kind == "sd15-inpaint" else {}
    for strength in (0.6, 0.8):
        request = dict(prompt=PROMPT, steps=STEPS, scheduler=scheduler, image=picture(), strength=strength,
                       num_images=2, progress=False, **extra)
        got, expected = captured(**request), plain(**request)
        scale = float(np.abs(expected.latents).max())
        np.testing.assert_allclose(got.latents, expected.latents, rtol=0, atol=4e-3 * scale)
        assert got.timings["steps"] == int(STEPS * strength) and "unfused" not in got.timings["step"]
    assert captured.cuda_graph
