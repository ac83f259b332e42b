"""SDXL inpainting: a StableDiffusionXLInpaintPipeline folder gives diffusers' own images.

The claim: for a tiny folder of diffusers/stable-diffusion-xl-1.0-inpainting-0.1's layout (the tiny
SDXL pipeline with a UNet of 9 input channels; model_index.json ``StableDiffusionXLInpaintPipeline``
without aesthetic scores, so 6 time ids), fp32 on the ORT CPU EP, ``image=, mask=`` gives
StableDiffusionXLInpaintPipeline's final latents and images from the same weights, scheduler config
and seed (tolerances of test_pipeline_img2img: kernel rounding only):

* the default strength is that pipeline's 0.9999 (int(5 x 0.9999) = 4 steps, the latents start from
  the noised image's), and strengths 1.0 (pure noise, 5 steps) and 0.75 (3 steps) run as it runs them;
* on the fused step graph and on diffusers' host loop, with guidance and without (guidance 1: the
  prompt's row alone, the inpainting channels one row per image);
* on the source folder and on the folder ``optimize --target tensorrt`` writes (standard ONNX the
  CPU EP runs: the step graph reading ``inpaint_channels``);
* the encoded image is scaled by scaling_factor alone, as the inpainting pipeline's
  ``_encode_vae_image`` does, even where the VAE has latents_mean/std (SDXL img2img normalizes
  with them; the inpainting pipeline decodes with them only);
* hostile masks (another size, RGBA, 16-bit, all black, all white), read from files, give what
  diffusers gives for the mask as ``diffusers.utils.load_image`` reads it, on the SD 1.5 and SDXL
  inpainting folders alike;
* ``denoising_end`` stops the loop where diffusers' SDXL pipelines stop it (from any strength),
  fused and on the host loop; a value outside (0, 1), one that leaves no step, or one on an SD
  folder (its pipelines have none) is refused in one line;
* a StableDiffusionXLInpaintPipeline folder whose UNet has 4 input channels (diffusers then blends
  the image back after every step) is refused in one line.

``optimize --target ort-cuda`` on the folder keeps every component's outputs (onnxopt's diff on
the CPU with its reference kernels; slow). The CUDA path (``pytest -m gpu``) is at the end.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch", reason="generating needs torch (pip install -e '.[models]')")
pytest.importorskip("diffusers", reason="generating needs diffusers")
pytest.importorskip("onnxruntime", reason="generating needs onnxruntime")

from onnxopt.pipeline import Pipeline  # noqa: E402
from onnxopt.pipeline.plan import GenerationError  # noqa: E402
from tests.test_pipeline_img2img import (COMMITTED, GUIDANCE, LATENT_RTOL, NEGATIVE, PIXEL_ATOL, PROMPT, SEED, STEPS,  # noqa: E402
                                         THREADS, Folder, assert_same, mask_picture, picture)
from tests.test_pipeline_img2img import tiny  # noqa: E402,F401  (the fixture: each tiny folder exported once per module)

KIND = "sdxl-inpaint"
INPAINT_CLASSES = {"sd15-inpaint": "StableDiffusionInpaintPipeline", KIND: "StableDiffusionXLInpaintPipeline"}
SIZE = dict(height=32, width=48)


@pytest.fixture(scope="module")
def inpaint(tiny) -> Folder:
    return tiny(KIND)


def request(strength, guidance=GUIDANCE, mask=None):
    """The onnxopt request and diffusers' keyword arguments for the same inpainting call (two images)."""
    strength = {} if strength is None else {"strength": strength}
    mask = mask_picture() if mask is None else mask
    ours = dict(prompt=PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=guidance, seed=SEED, image=picture(),
                mask=mask, num_images=2, progress=False, **SIZE, **strength)
    theirs = dict(image=picture(), mask_image=mask, num_images_per_prompt=2, **SIZE, **strength)
    return ours, theirs


@pytest.mark.parametrize("strength, fused, guidance, steps", [
    (None, True, GUIDANCE, 4), (None, False, GUIDANCE, 4), (1.0, True, GUIDANCE, 5), (1.0, False, GUIDANCE, 5),
    (0.75, True, GUIDANCE, 3), (0.75, False, GUIDANCE, 3), (1.0, True, 1.0, 5), (0.75, False, 1.0, 3)])
def test_sdxl_inpainting_gives_the_diffusers_images(inpaint, strength, fused, guidance, steps):
    ours, theirs = request(strength, guidance)
    result = inpaint.onnx(fused)(**ours)
    assert_same(result, *inpaint.reference(INPAINT_CLASSES[KIND], None, guidance, **theirs))
    assert result.timings["steps"] == steps and ("unfused" in result.timings["step"]) is not fused
    assert result.timings["classifier_free_guidance"] is (guidance > 1)
    assert result.all_pixels.shape == (2, 32, 48, 3)


@pytest.mark.parametrize("strength, fused, denoising_end, steps", [
    (1.0, True, 0.6, 3), (1.0, False, 0.6, 3), (0.75, True, 0.85, 2), (None, False, 0.5, 1)])
def test_denoising_end_stops_where_diffusers_stops(inpaint, strength, fused, denoising_end, steps):
    """``denoising_end``: the steps whose timestep is at or above round(1000 - end x 1000) run, from
    wherever the strength starts; the image is the decoded noisier latents, as diffusers' (output_type np)."""
    ours, theirs = request(strength)
    result = inpaint.onnx(fused)(**ours, denoising_end=denoising_end)
    assert_same(result, *inpaint.reference(INPAINT_CLASSES[KIND], None, denoising_end=denoising_end, **theirs))
    assert result.timings["steps"] == steps


def test_encoded_latents_are_not_normalized_by_latents_mean_and_std(inpaint, tmp_path):
    """A VAE with latents_mean/std: StableDiffusionXLInpaintPipeline scales the encoded image by
    scaling_factor alone and decodes with mean and std (SDXL img2img would encode with them too)."""
    from models.pipelines import copy_folder

    stats = {"latents_mean": [0.1, -0.2, 0.3, 0.05], "latents_std": [0.9, 1.2, 0.8, 1.1]}
    folder = tmp_path / "with-stats"
    copy_folder(inpaint.folder, folder)
    for component in ("vae_decoder", "vae_encoder"):
        path = folder / component / "config.json"
        path.write_text(json.dumps(dict(json.loads(path.read_text()), **stats)))
    vae = inpaint.torch_pipe.vae
    vae.register_to_config(**stats)
    try:
        ours, theirs = request(0.75)
        expected = inpaint.reference(INPAINT_CLASSES[KIND], None, **theirs)
    finally:
        vae.register_to_config(latents_mean=None, latents_std=None)
    result = Pipeline.load(folder, "cpu", fused_step=False, threads=THREADS)(**ours)
    assert_same(result, *expected)


@pytest.fixture(scope="module")
def optimized(inpaint, tmp_path_factory):
    """The folder ``optimize --target tensorrt`` writes: standard ONNX, the step graph beside the UNet."""
    from onnxopt.cli import main

    out = tmp_path_factory.mktemp("optimized") / "tensorrt"
    assert main(["optimize", "-i", str(inpaint.folder), "-o", str(out), "--target", "tensorrt", "-q"]) == 0
    return out


@pytest.mark.parametrize("strength, fused, guidance", [(1.0, True, GUIDANCE), (0.75, True, GUIDANCE),
                                                       (0.75, False, GUIDANCE), (0.75, True, 1.0)])
def test_the_optimized_folder_gives_the_diffusers_images(inpaint, optimized, strength, fused, guidance):
    pipe = Pipeline.load(optimized, "cpu", fused_step=fused, threads=THREADS)
    ours, theirs = request(strength, guidance)
    result = pipe(**ours)
    assert_same(result, *inpaint.reference(INPAINT_CLASSES[KIND], None, guidance, **theirs))
    assert ("unfused" in result.timings["step"]) is not fused
    if fused:
        assert "inpaint_channels" in {i.name for i in pipe.sessions["step"].get_inputs()}


@pytest.mark.slow
def test_optimize_ort_cuda_keeps_every_component(inpaint, tmp_path):
    """``optimize --target ort-cuda``: the UNet of 9 input channels, the text encoders and the VAE compute
    what their sources compute (onnxopt's diff, CPU with the reference kernels), and the step graph
    reads the mask and masked-image latents as ``inpaint_channels`` [batch, 5, h, w]."""
    import onnx

    from onnxopt.cli import main
    from tests.test_pipeline_folders import assert_optimized_matches_source

    out = tmp_path / "ort-cuda"
    assert main(["optimize", "-i", str(inpaint.folder), "-o", str(out), "--target", "ort-cuda", "-q"]) == 0
    assert_optimized_matches_source(inpaint.folder, out)
    step = onnx.load(str(out / "unet" / "step.onnx"), load_external_data=False)
    (channels,) = [i for i in step.graph.input if i.name == "inpaint_channels"]
    assert channels.type.tensor_type.shape.dim[1].dim_value == 5


def hostile_masks(tmp_path):
    """Mask files a user may give: {name: path}."""
    from PIL import Image

    base = np.asarray(mask_picture((48, 32)))
    masks = {
        "another size": Image.fromarray(np.asarray(mask_picture((21, 13)))),
        "rgba": Image.fromarray(np.dstack([base, base, base, 255 - base])),  # alpha the inverse of the mask
        "16-bit": Image.fromarray(base.astype(np.uint16) * 257),  # white is 65535
        "all black": Image.fromarray(np.zeros_like(base)),
        "all white": Image.fromarray(np.full_like(base, 255)),
    }
    paths = {}
    for name, image in masks.items():
        paths[name] = tmp_path / f"{name.replace(' ', '-')}.png"
        image.save(paths[name])
    assert Image.open(paths["16-bit"]).mode == "I;16" and Image.open(paths["rgba"]).mode == "RGBA"
    return paths


@pytest.mark.parametrize("kind", ["sd15-inpaint", KIND])
def test_hostile_masks_behave_as_diffusers(tiny, kind, tmp_path):
    """Each mask file, as onnxopt reads it (``--mask PATH``), gives diffusers' image for the mask as
    diffusers.utils.load_image reads that file (RGB: alpha dropped, 16-bit values clipped to 255);
    another size is resized to the image's. The SD 1.5 and SDXL inpainting folders alike.

    An all-white mask masks the whole image: the VAE encodes a constant image, where each GroupNorm
    divides a variance of rounding noise by sqrt(eps) (the ONNX encoder's latent parameters differ
    from torch's by 2.8e-4 there, by 1e-6 on a random image), so the images agree within 1e-2
    (measured: 3.8e-3 of the latents' scale); a mask read inverted or a masked image left unmasked
    moves them by the latents' own size."""
    from diffusers.utils import load_image

    t = tiny(kind)
    pipe = t.onnx()
    scheduler = "ddim" if kind == "sd15-inpaint" else None  # SD 1.5's PNDM: ddim, as test_pipeline_img2img
    for name, path in hostile_masks(tmp_path).items():
        ours, theirs = request(0.75, mask=load_image(str(path)))
        result = pipe(**dict(ours, mask=str(path), scheduler=scheduler, num_images=1))
        ref_latents, ref_images = t.reference(INPAINT_CLASSES[kind], scheduler, **dict(theirs, num_images_per_prompt=1))
        latent_atol, pixel_atol = (1e-2, 1e-2) if name == "all white" else (LATENT_RTOL, PIXEL_ATOL)
        scale = float(np.abs(ref_latents).max())
        np.testing.assert_allclose(result.latents, ref_latents, rtol=0, atol=latent_atol * scale, err_msg=name)
        np.testing.assert_allclose(result.all_pixels, ref_images, rtol=0, atol=pixel_atol, err_msg=name)


def test_refusals(inpaint, tmp_path):
    """Requests StableDiffusionXLInpaintPipeline fails on, or onnxopt cannot run as it does: one line."""
    from models.pipelines import copy_folder
    from onnxopt.pipeline import PipelineFolder
    from onnxopt.pipeline.runner import check_request

    pipe = inpaint.onnx()
    run = dict(prompt=PROMPT, steps=STEPS, progress=False)
    cases = [
        (dict(image=picture()), "needs --mask"),
        (dict(), "give --image and --mask"),
        (dict(image=picture(), mask=mask_picture(), strength=0.1), "= 0 of the 5 steps"),
        (dict(image=picture(), mask=mask_picture(), strength=0.0), "strength must be"),
        (dict(image=picture(), mask=mask_picture(), height=30, width=48), "multiple of 8"),
        (dict(image=picture(), mask=mask_picture(), denoising_end=1.0), "denoising_end must be"),
        (dict(image=picture(), mask=mask_picture(), denoising_end=float("nan")), "denoising_end must be"),
        (dict(image=picture(), mask=mask_picture(), denoising_end=0.01), "stops before the first"),
        (dict(image=picture(), mask=mask_picture(), strength=0.5, denoising_end=0.3), "stops before the first"),
    ]
    for kwargs, message in cases:
        with pytest.raises(GenerationError, match=message):
            pipe(**run, **kwargs)
    with pytest.raises(GenerationError, match="the SDXL pipelines'"):  # diffusers' SD pipelines have no denoising_end
        check_request(PipelineFolder.open(COMMITTED), steps=STEPS, denoising_end=0.5)
    four = tmp_path / "four-channels"  # the class of an inpainting folder, the UNet of a base one
    copy_folder(inpaint.folder, four)
    config = four / "unet" / "config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), in_channels=4)))
    with pytest.raises(GenerationError) as caught:
        check_request(PipelineFolder.open(four), steps=STEPS, image=picture(), mask=mask_picture())
    message = str(caught.value)
    assert "StableDiffusionXLInpaintPipeline" in message and "blends" in message and "\n" not in message


@pytest.mark.parametrize("options", [{}, {"denoising_end": 0.6}])
def test_cli_writes_the_inpainted_image(inpaint, tmp_path, capsys, options):
    """``onnxopt generate FOLDER --image --mask`` (default strength 0.9999; ``--denoising-end``) writes
    the API's image."""
    from PIL import Image

    from onnxopt.cli import main

    picture().save(tmp_path / "init.png")
    mask_picture().save(tmp_path / "mask.png")
    out = tmp_path / "out.png"
    code = main(["generate", str(inpaint.folder), "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--steps",
                 str(STEPS), "--image", str(tmp_path / "init.png"), "--mask", str(tmp_path / "mask.png"),
                 "--height", "32", "--width", "48", "-q", "-o", str(out),
                 *(arg for k, v in options.items() for arg in (f"--{k.replace('_', '-')}", str(v)))])
    assert code == 0, capsys.readouterr().err
    ours, _ = request(None)
    expected = inpaint.onnx()(**dict(ours, num_images=1, image=str(tmp_path / "init.png"),
                                     mask=str(tmp_path / "mask.png"), **options))
    written = np.asarray(Image.open(out), np.int16)
    assert np.abs(written - np.asarray(expected.images[0], np.int16)).max() <= 1


# --- CUDA EP (the lead runs these on the GPU machine: pytest -m gpu tests/test_pipeline_sdxl_inpaint.py) ---

@pytest.mark.gpu
def test_cuda_captured_sdxl_inpainting_is_the_cpu_image(inpaint, tmp_path):
    """On a GPU: the folder optimized for ort-cuda, bound buffers and captured steps, gives the image
    of the same folder without capture (within 4e-3 of the latents' scale, as
    test_pipeline_img2img's captured img2img/inpainting test), and the CPU EP's image of the source
    folder, which is diffusers' (within 1e-2 of the scale: the fused CUDA kernels against the CPU's).
    Strength 1.0, 0.75 and the default; a second strength replays the graphs on the same buffers with
    another schedule table (denoising_end: a shorter one); guidance 1 runs the step graph without its
    guidance rows."""
    from onnxopt.pipeline import optimize_folder
    from onnxopt.runners.ort_cuda import cuda_available

    if not cuda_available():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")
    folder = tmp_path / "ort-cuda"
    optimize_folder(inpaint.folder, folder, target="ort-cuda")
    captured = Pipeline.load(folder, "cuda", cuda_graph=True)
    plain = Pipeline.load(folder, "cuda", cuda_graph=False, io_binding=False)
    cpu = inpaint.onnx()
    for strength, guidance, end in ((1.0, GUIDANCE, None), (0.75, GUIDANCE, None), (None, GUIDANCE, None),
                                    (0.75, 1.0, None), (1.0, GUIDANCE, 0.6)):
        ours, _ = request(strength, guidance)
        ours["denoising_end"] = end
        got, expected, host = captured(**ours), plain(**ours), cpu(**ours)
        scale = float(np.abs(host.latents).max())
        np.testing.assert_allclose(got.latents, expected.latents, rtol=0, atol=4e-3 * scale)
        np.testing.assert_allclose(got.latents, host.latents, rtol=0, atol=1e-2 * scale)
        np.testing.assert_allclose(got.all_pixels, host.all_pixels, rtol=0, atol=1e-2)
        assert got.timings["steps"] == host.timings["steps"] and "unfused" not in got.timings["step"]
    assert captured.cuda_graph
