"""Flux.1 folders from prompt to image: ``onnxopt generate`` gives diffusers' FluxPipeline image.

The claim: for the tiny Flux.1 dev and schnell pipelines (``models.flux_pipeline.build_flux_pipeline``:
CLIP-L pooled, T5, the Flux transformer with (dev) and without (schnell) the guidance embedding, the
16-channel VAE with Flux's scaling and shift factors, FlowMatchEulerDiscreteScheduler with dev's
dynamic shifting and schnell's fixed shift), in optimum-onnx's export (committed:
``models/pipelines/flux-{dev,schnell}-tiny-optimum``, int64 ids) and in diffusers' layout with
onnxopt's TorchScript export (written here, float32 ids), fp32 on the ORT CPU EP, the image equals
diffusers' ``FluxPipeline.__call__`` from the same torch weights, prompt, seed, steps, guidance and
size: the latents drawn by torch's generator and packed 2x2, img_ids/txt_ids, T5's 512 tokens (or
another ``--max-sequence-length``), the sigmas and ``mu``, ``t / 1000``, and the VAE's
``unpack(latents) / scaling_factor + shift_factor``.

Tolerance: both sides run the same fp32 graphs and differ by kernel rounding only; measured at most
5e-7 on images in [0, 1] over 3 steps. Images are compared at ``atol = 1e-5``; a wrong seed, packing,
id, shift, guidance or VAE factor moves them by 1e-2 or more (the adversarial tests below check
some of these do).

Kept small for CI: 3 steps, 32x48 images (latents 16x24: not square).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="generating needs torch")
pytest.importorskip("diffusers", reason="generating needs diffusers")
pytest.importorskip("onnxruntime", reason="generating needs onnxruntime")

from onnxopt.cli import main as onnxopt_main  # noqa: E402
from onnxopt.pipeline import Pipeline  # noqa: E402
from onnxopt.pipeline.plan import GenerationError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("flux-dev", "flux-schnell")
SEED, STEPS, GUIDANCE, HEIGHT, WIDTH = 7, 3, 3.5, 32, 48
PROMPT = "a photo of a cat riding a horse"
PIXEL_ATOL = 1e-5


class Reference:
    """diffusers' FluxPipeline from the same seeded weights, run once per request."""

    def __init__(self, kind: str):
        from models.flux_pipeline import build_flux_pipeline

        self.pipe = build_flux_pipeline(kind)
        self.pipe.set_progress_bar_config(disable=True)
        self.images: dict = {}

    def image(self, guidance: float = GUIDANCE, max_sequence_length: int = 512, height=HEIGHT, width=WIDTH):
        key = (guidance, max_sequence_length, height, width)
        if key not in self.images:
            self.images[key] = self.pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=guidance, height=height,
                                         width=width, generator=torch.Generator("cpu").manual_seed(SEED),
                                         max_sequence_length=max_sequence_length, output_type="np").images[0]
        return self.images[key]


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """kind -> (Reference, {"optimum": committed folder, "diffusers": written here})."""
    from models.flux_pipeline import write_flux_onnx_folder

    made = {}
    for kind in KINDS:
        reference = Reference(kind)
        diffusers = tmp_path_factory.mktemp(kind) / "diffusers"
        write_flux_onnx_folder(kind, diffusers, pipe=reference.pipe)
        made[kind] = reference, {"optimum": ROOT / "models" / "pipelines" / f"{kind}-tiny-optimum",
                                 "diffusers": diffusers}
    return made


def run(folder, load=None, **options):
    """One image of ``folder`` on the CPU EP; ``load``: Pipeline.load's options."""
    request = dict(steps=STEPS, guidance=GUIDANCE, seed=SEED, height=HEIGHT, width=WIDTH, progress=False)
    return Pipeline.load(folder, "cpu", threads=1, **(load or {}))(PROMPT, **{**request, **options})


def copy(folder, tmp_path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    return out


@pytest.mark.parametrize("layout", ["optimum", "diffusers"])
@pytest.mark.parametrize("kind", KINDS)
def test_generate_gives_diffusers_image(flux, kind, layout):
    reference, folders = flux[kind]
    result = run(folders[layout])
    np.testing.assert_allclose(result.pixels, reference.image(), rtol=0, atol=PIXEL_ATOL)
    assert result.timings["guidance_embedding"] is (kind == "flux-dev")
    assert result.timings["step"] == "built in memory from transformer/model.onnx"  # the fused step ran


@pytest.mark.parametrize("kind", KINDS)
def test_written_step_graph_on_bound_buffers_and_the_unfused_loop_give_diffusers_image(flux, kind, tmp_path):
    """transformer/step.onnx as optimize writes it, run by the bound-buffer loop (the one CUDA
    replays as captured graphs; on CPU buffers here), and diffusers' own loop around the transformer."""
    from onnxopt.pipeline.families import FLUX_TRANSFORMER
    from onnxopt.pipeline.step_graph import write_step_graph

    reference, folders = flux[kind]
    folder = copy(folders["optimum"], tmp_path)
    write_step_graph(folder / "transformer", context_kv=False, denoiser=FLUX_TRANSFORMER)
    bound = run(folder, load=dict(io_binding=True))
    assert bound.timings["step"] == "transformer/step.onnx"
    np.testing.assert_allclose(bound.pixels, reference.image(), rtol=0, atol=PIXEL_ATOL)
    unfused = run(folder, load=dict(fused_step=False))
    assert unfused.timings["step"].startswith("unfused")
    np.testing.assert_allclose(unfused.pixels, reference.image(), rtol=0, atol=PIXEL_ATOL)


def test_the_cli_writes_diffusers_image_and_prints_the_plan(flux, tmp_path, capsys):
    from PIL import Image

    reference, folders = flux["flux-dev"]
    out = tmp_path / "image.png"
    assert onnxopt_main(["generate", str(folders["optimum"]), "--prompt", PROMPT, "--steps", str(STEPS), "--guidance",
                         str(GUIDANCE), "--seed", str(SEED), "--height", str(HEIGHT), "--width", str(WIDTH), "-o",
                         str(out), "--max-sequence-length", "64", "-q"]) == 0
    expected = np.round(reference.image(max_sequence_length=64) * 255).astype(np.int16)
    written = np.asarray(Image.open(out)).astype(np.int16)
    assert written.shape == (HEIGHT, WIDTH, 3)
    assert np.abs(written - expected).max() <= 1  # a level where a value lies on a rounding boundary
    assert np.abs(reference.image(max_sequence_length=64) - reference.image()).max() > 1e-3  # T5's length matters
    assert onnxopt_main(["generate", str(folders["optimum"]), "--plan"]) == 0
    plan = capsys.readouterr().out
    assert "(flux) on cpu" in plan and "scheduler:  flow-match" in plan
    assert "text_encoder, text_encoder_2, transformer, vae_decoder" in plan
    assert "step graph: built in memory from transformer/model.onnx" in plan


def test_schnell_ignores_guidance_as_diffusers_does(flux):
    """schnell's transformer has no guidance input: any --guidance gives the same image, diffusers' own."""
    reference, folders = flux["flux-schnell"]
    result = run(folders["optimum"], guidance=9.0)
    np.testing.assert_allclose(result.pixels, reference.image(), rtol=0, atol=PIXEL_ATOL)
    dev_reference, _ = flux["flux-dev"]
    assert np.abs(dev_reference.image(guidance=9.0) - dev_reference.image()).max() > 1e-3  # dev's does matter


@pytest.mark.parametrize("kind, given, warned", [("flux-schnell", True, True), ("flux-schnell", False, False),
                                                  ("flux-dev", True, False)])
def test_the_cli_says_when_guidance_is_unused(flux, tmp_path, capsys, kind, given, warned):
    """schnell ignores --guidance as diffusers does (above); the CLI says so when one is given, once."""
    _, folders = flux[kind]
    flags = ["--guidance", "9"] if given else []
    assert onnxopt_main(["generate", str(folders["optimum"]), "--prompt", PROMPT, "--steps", "1", *flags,
                         "--height", str(HEIGHT), "--width", str(WIDTH), "-o", str(tmp_path / "i.png"), "-q"]) == 0
    err = capsys.readouterr().err
    assert err.count("--guidance is unused") == (1 if warned else 0), err


def test_a_scheduler_the_fused_step_cannot_run_falls_back_to_diffusers_step(flux, tmp_path):
    """stochastic_sampling=True adds noise in each step (not affine): the step graph cannot hold it, so the
    image is made by diffusers' own step on the host, as the UNet families fall back (it was exit 2). With
    torch's global generator seeded the same, the noise it draws is diffusers' own: the same image."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    reference, folders = flux["flux-dev"]
    folder = copy(folders["optimum"], tmp_path)
    config_path = folder / "scheduler" / "scheduler_config.json"
    config = dict(json.loads(config_path.read_text()), stochastic_sampling=True)
    config_path.write_text(json.dumps(config))
    torch.manual_seed(7)
    result = run(folder)
    assert result.timings["step"].startswith("unfused: ") and "stochastic_sampling=True" in result.timings["step"]
    pipe = reference.pipe
    deterministic = pipe.scheduler
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    try:
        torch.manual_seed(7)
        expected = pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=HEIGHT, width=WIDTH,
                        generator=torch.Generator("cpu").manual_seed(SEED), output_type="np").images[0]
    finally:
        pipe.scheduler = deterministic
    np.testing.assert_allclose(result.pixels, expected, rtol=0, atol=PIXEL_ATOL)
    assert np.abs(expected - reference.image()).max() > 1e-3  # the noise does change the image


def test_a_size_not_a_multiple_of_the_patch_is_rounded_down_as_diffusers_does(flux, capsys):
    """42x50 with the tiny VAE (factor 2, patches of 4 pixels): FluxPipeline makes a 40x48 image."""
    reference, folders = flux["flux-dev"]
    result = run(folders["diffusers"], height=42, width=50)
    expected = reference.image(height=42, width=50)
    assert result.pixels.shape == expected.shape == (40, 48, 3)
    np.testing.assert_allclose(result.pixels, expected, rtol=0, atol=PIXEL_ATOL)
    assert "not a multiple of 4" in capsys.readouterr().err


def test_int32_ids_are_fed_as_int32(flux, tmp_path):
    """A transformer whose img_ids/txt_ids are int32 inputs gets int32 (each input its declared type)."""
    import onnx

    reference, folders = flux["flux-dev"]
    folder = copy(folders["optimum"], tmp_path)
    path = folder / "transformer" / "model.onnx"
    model = onnx.load(str(path))
    for graph_input in model.graph.input:
        if graph_input.name in ("img_ids", "txt_ids"):
            graph_input.type.tensor_type.elem_type = onnx.TensorProto.INT32
            for node in model.graph.node:
                node.input[:] = [f"{graph_input.name}_int64" if n == graph_input.name else n for n in node.input]
            model.graph.node.insert(0, onnx.helper.make_node("Cast", [graph_input.name], [f"{graph_input.name}_int64"],
                                                             to=onnx.TensorProto.INT64))
    onnx.save(model, str(path))
    np.testing.assert_allclose(run(folder).pixels, reference.image(), rtol=0, atol=PIXEL_ATOL)


def test_a_transformer_without_the_guidance_input_its_config_promises_is_refused(flux, tmp_path):
    """schnell's graph under a config that says guidance_embeds: the guidance would be dropped silently."""
    _, folders = flux["flux-schnell"]
    folder = copy(folders["optimum"], tmp_path)
    config_path = folder / "transformer" / "config.json"
    config_path.write_text(json.dumps(dict(json.loads(config_path.read_text()), guidance_embeds=True)))
    with pytest.raises(GenerationError, match="has no guidance input but its config.json says guidance_embeds=True"):
        run(folder)
    assert onnxopt_main(["generate", str(folder), "--prompt", PROMPT, "--steps", "2", "--height", "32", "--width",
                         "32", "-o", str(tmp_path / "x.png"), "-q"]) == 2
    assert not (tmp_path / "x.png").exists()


def test_a_vae_config_without_shift_factor_is_refused(flux, tmp_path):
    _, folders = flux["flux-schnell"]
    folder = copy(folders["diffusers"], tmp_path)
    config_path = folder / "vae_decoder" / "config.json"
    config = json.loads(config_path.read_text())
    del config["shift_factor"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(GenerationError, match="no shift_factor"):
        run(folder)


def test_t5_tokenizer_from_tokenizer_json_alone(flux, tmp_path):
    reference, folders = flux["flux-schnell"]
    folder = copy(folders["optimum"], tmp_path)
    for path in (folder / "tokenizer_2").iterdir():
        if path.name != "tokenizer.json":
            path.unlink()
    np.testing.assert_allclose(run(folder).pixels, reference.image(), rtol=0, atol=PIXEL_ATOL)


def test_a_negative_prompt_or_a_long_sequence_is_refused(flux):
    _, folders = flux["flux-schnell"]
    with pytest.raises(GenerationError, match="takes no negative prompt"):
        run(folders["optimum"], negative_prompt="blurry")
    with pytest.raises(GenerationError, match="max sequence length"):
        run(folders["optimum"], max_sequence_length=513)


def test_clip_gets_the_one_row_static_graph_flux_feeds_and_t5_none(flux, tmp_path):
    """Flux encodes one prompt row (no CFG): CLIP's static graph is model.static.b1.onnx, the graph the
    first image takes (it was b2 only: never used, CLIP ran uncaptured on the GPU). T5 (text_encoder_2
    here) takes the request's token count: no static graph of a fixed length. The image is unchanged."""
    from onnxopt.pipeline import optimize_folder

    reference, folders = flux["flux-dev"]
    out = tmp_path / "out"
    report = optimize_folder(folders["optimum"], out, target="tensorrt", components=["text_encoder", "text_encoder_2"])
    assert sorted(p.name for p in (out / "text_encoder").glob("model.static.*.onnx")) == ["model.static.b1.onnx"]
    assert not list((out / "text_encoder_2").glob("model.static.*"))
    assert any("model.static.b1.onnx" in note for c in report.components if c.name == "text_encoder" for note in c.notes)
    result = run(out)
    assert result.timings["text_encoders"]["text_encoder"] == "model.static.b1.onnx"
    np.testing.assert_allclose(result.pixels, reference.image(), rtol=0, atol=1e-4)
    with_length = run(out, max_sequence_length=64)  # T5 at another length than its tokenizer's maximum
    np.testing.assert_allclose(with_length.pixels, reference.image(max_sequence_length=64), rtol=0, atol=1e-4)


@pytest.mark.slow  # the optimizer over five components: ~50 s on two cores
def test_optimize_for_ort_cuda_writes_the_folder_and_its_plan(flux, tmp_path, capsys):
    """``optimize --target ort-cuda`` on a Flux folder: every component written (the CPU EP cannot run
    its contrib ops: the image is checked on the GPU), the fused step graph beside the transformer."""
    _, folders = flux["flux-schnell"]
    out = tmp_path / "out"
    assert onnxopt_main(["optimize", "-i", str(folders["optimum"]), "-o", str(out), "--target", "ort-cuda", "-q"]) == 0
    assert (out / "transformer" / "step.onnx").is_file()
    capsys.readouterr()
    assert onnxopt_main(["generate", str(out), "--plan"]) == 0
    plan = capsys.readouterr().out
    assert "(flux) on cpu" in plan and "step graph: transformer/step.onnx" in plan
