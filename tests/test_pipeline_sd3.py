"""SD3 / SD3.5 folders from prompt to image: ``onnxopt generate`` gives diffusers' StableDiffusion3Pipeline image.

The claim: for the tiny SD3.5 pipeline (``models.sd3.build_torch_sd3_pipeline``: CLIP-L, CLIP-G, T5, the
SD3.5-Medium MMDiT with dual attention and QK RMSNorm, the 16-channel VAE, FlowMatchEulerDiscreteScheduler
with shift 3), exported by optimum-onnx (committed: ``models/pipelines/sd35-tiny-optimum``, its int64
ids, its 1-D ``step`` timestep, its tokenizer configs) and by onnxopt's own TorchScript export with
diffusers' index (written here; T5's tokenizer as ``tokenizer.json`` alone), fp32 on the ORT CPU EP,
the image equals diffusers' ``StableDiffusion3Pipeline.__call__`` from the same torch weights, prompt,
negative prompt, seed, steps, guidance and size: the latents drawn by torch's generator, the CLIP
penultimate states and pooled embeddings, T5's 256 tokens (or another ``--max-sequence-length``),
classifier-free guidance as batch 2, the flow-matching schedule with its shift, and the VAE's
``latents / scaling_factor + shift_factor``.

Tolerance: both sides run the same fp32 graphs and differ by kernel rounding only; measured at most
9e-7 on images in [0, 1] over 3 steps at guidance 4.5. Images are compared at ``atol = 1e-5``; a wrong
seed, shift, pad token, timestep scale or VAE shift moves them by 1e-2 or more.

Kept small for CI: 3 steps, 32x24 images (latents 16x12: not square).
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
from onnxopt.pipeline import Pipeline, PipelineFolder  # noqa: E402
from tests.test_pipeline_generate import RowsFed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "models" / "pipelines" / "sd35-tiny-optimum"
SEED, STEPS, GUIDANCE, HEIGHT, WIDTH = 7, 3, 4.5, 32, 24
PROMPT, NEGATIVE = "a photo of a red cat", "blurry"
PIXEL_ATOL = 1e-5


class Reference:
    """diffusers' pipeline from the same seeded weights, run once per request."""

    def __init__(self, tmp: Path, t5: bool = True):
        from models.sd3 import build_torch_sd3_pipeline

        self.pipe = build_torch_sd3_pipeline(0, tmp / "tokenizers", t5=t5)
        self.pipe.set_progress_bar_config(disable=True)
        self.tokenizers = tmp / "tokenizers"
        self.images: dict = {}

    def image(self, max_sequence_length: int = 256, guidance: float = GUIDANCE, **size) -> np.ndarray:
        size = size or dict(height=HEIGHT, width=WIDTH)
        key = (max_sequence_length, guidance, tuple(sorted(size.items())))
        if key not in self.images:
            self.images[key] = self.pipe(PROMPT, negative_prompt=NEGATIVE, num_inference_steps=STEPS,
                                         guidance_scale=guidance, generator=torch.Generator("cpu").manual_seed(SEED),
                                         max_sequence_length=max_sequence_length, output_type="np", **size).images[0]
        return self.images[key]


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    from models.sd3 import write_sd3_onnx_folder

    tmp = tmp_path_factory.mktemp("sd3")
    reference = Reference(tmp)
    folders = {"optimum": COMMITTED,
               "diffusers": write_sd3_onnx_folder(reference.pipe, tmp / "diffusers", reference.tokenizers)}
    return reference, folders


def run(folder, fused: bool = True, **options):
    request = dict(steps=STEPS, guidance=GUIDANCE, seed=SEED, height=HEIGHT, width=WIDTH, progress=False)
    return Pipeline.load(folder, "cpu", fused_step=fused, threads=1)(PROMPT, NEGATIVE, **{**request, **options})


@pytest.mark.parametrize("layout", ["optimum", "diffusers"])
def test_generate_writes_diffusers_image(sd3, tmp_path, layout):
    """The CLI's PNG is diffusers' image (T5 at its default 256 tokens), and --json names the step graph."""
    from PIL import Image

    reference, folders = sd3
    out = tmp_path / "image.png"
    assert onnxopt_main(["generate", str(folders[layout]), "--prompt", PROMPT, "--negative-prompt", NEGATIVE,
                         "--steps", str(STEPS), "--guidance", str(GUIDANCE), "--seed", str(SEED), "--height",
                         str(HEIGHT), "--width", str(WIDTH), "-o", str(out), "--json", str(tmp_path / "t.json"),
                         "-q"]) == 0
    expected = np.round(reference.image() * 255).astype(np.int16)
    written = np.asarray(Image.open(out)).astype(np.int16)
    assert written.shape == (HEIGHT, WIDTH, 3)
    assert np.abs(written - expected).max() <= 1  # a level where a value lies on a rounding boundary
    timings = json.loads((tmp_path / "t.json").read_text())
    assert timings["step"] == "built in memory from transformer/model.onnx"
    assert timings["plan"]["scheduler"] == "flow-match"


@pytest.mark.parametrize("fused", [True, False])
def test_the_fused_step_and_diffusers_loop_give_diffusers_pixels(sd3, fused):
    """Fused: the flow-match update inside the step graph; unfused: the transformer and diffusers' own
    FlowMatchEulerDiscreteScheduler.step. T5 at 20 tokens (--max-sequence-length)."""
    reference, folders = sd3
    result = run(folders["optimum"], fused, max_sequence_length=20)
    np.testing.assert_allclose(result.pixels, reference.image(20), rtol=0, atol=PIXEL_ATOL)
    assert result.timings["step"] == ("unfused" if not fused else "built in memory from transformer/model.onnx")


def test_the_tokenizers_pad_with_their_own_tokens(sd3):
    """SD3's CLIP-G tokenizer pads with "!", CLIP-L's with <|endoftext|>; T5's comes from tokenizer.json alone
    in the diffusers-layout folder (the optimum export writes its tokenizer_config.json too)."""
    _, folders = sd3
    folder = PipelineFolder.open(folders["diffusers"])
    assert sorted(p.name for p in (folders["diffusers"] / "tokenizer_3").iterdir()) == ["tokenizer.json"]
    assert folder.tokenizer("tokenizer_2").pad_token == "!"
    assert folder.tokenizer("tokenizer").pad_token == "<|endoftext|>"
    t5 = folder.tokenizer("tokenizer_3")
    assert (t5.pad_token_id, t5.eos_token_id) == (0, 1)
    ids = t5("a cat", padding="max_length", max_length=6).input_ids
    assert ids[2:] == [1, 0, 0, 0]  # two words, </s>, then <pad>


def test_without_t5_the_folder_runs_as_diffusers_does(sd3, tmp_path):
    """diffusers' StableDiffusion3Pipeline takes text_encoder_3=None and puts zeros in T5's place: so does onnxopt."""
    reference, folders = sd3
    folder = tmp_path / "no-t5"
    shutil.copytree(folders["diffusers"], folder)
    for name in ("text_encoder_3", "tokenizer_3"):
        shutil.rmtree(folder / name)
    index = json.loads((folder / "model_index.json").read_text())
    index.update(text_encoder_3=[None, None], tokenizer_3=[None, None])
    (folder / "model_index.json").write_text(json.dumps(index))
    without = Reference(tmp_path, t5=False)
    result = run(folder, max_sequence_length=20)
    np.testing.assert_allclose(result.pixels, without.image(20), rtol=0, atol=PIXEL_ATOL)
    assert np.abs(result.pixels - reference.image(20)).max() > 1e-3  # T5's states mattered


def test_optimize_then_generate(sd3, tmp_path):
    """``optimize --target tensorrt`` (standard ONNX, so the CPU EP runs it) writes transformer/step.onnx
    beside the transformer; generate runs it and still gives diffusers' image."""
    reference, folders = sd3
    out = tmp_path / "out"
    assert onnxopt_main(["optimize", "-i", str(folders["optimum"]), "-o", str(out), "--target", "tensorrt", "-q"]) == 0
    assert (out / "transformer" / "step.onnx").is_file()
    result = run(out, max_sequence_length=20)
    assert result.timings["step"] == "transformer/step.onnx"
    np.testing.assert_allclose(result.pixels, reference.image(20), rtol=0, atol=PIXEL_ATOL)
    off = run(out, max_sequence_length=20, guidance=1.0)  # transformer/step.onnx without its guidance rows
    assert off.timings["without_guidance"].startswith("the step graph of transformer/step.onnx without")
    np.testing.assert_allclose(off.pixels, reference.image(20, guidance=1.0), rtol=0, atol=PIXEL_ATOL)


@pytest.mark.parametrize("guidance, fused", [(1.0, True), (0.7, False), (0.0, True)])
def test_guidance_at_most_one_is_diffusers_without_guidance(sd3, guidance, fused):
    """StableDiffusion3Pipeline's do_classifier_free_guidance is guidance > 1: at 1 or below the transformer
    runs the prompt's row alone and the negative prompt is never encoded. onnxopt gives that image, with the
    text encoders and the transformer at batch 1, and another negative prompt changes not one bit."""
    reference, folders = sd3
    result = run(folders["optimum"], fused, max_sequence_length=20, guidance=guidance)
    assert result.timings["classifier_free_guidance"] is False
    np.testing.assert_allclose(result.pixels, reference.image(20, guidance=guidance), rtol=0, atol=PIXEL_ATOL)
    assert result.timings["text_encoders"]["text_encoder_3"] == "model.onnx: no static graph for batch 1"
    pipe = Pipeline.load(folders["optimum"], "cpu", fused_step=fused, threads=1, guidance=guidance)
    key = "step_no_cfg" if fused else "transformer"
    assert "step" not in pipe.sessions  # the guided step graph is not made for a pipeline loaded for guidance <= 1
    spy = pipe.sessions[key] = RowsFed(pipe.sessions[key], "encoder_hidden_states")
    other = pipe(PROMPT, "a dog, oil paint", steps=STEPS, guidance=guidance, seed=SEED, height=HEIGHT, width=WIDTH,
                 progress=False, max_sequence_length=20)
    np.testing.assert_array_equal(other.pixels, result.pixels)
    assert spy.rows == [1] * STEPS


def test_plan_prints_the_sd3_plan(sd3, capsys):
    _, folders = sd3
    assert onnxopt_main(["generate", str(folders["optimum"]), "--plan"]) == 0
    plan = capsys.readouterr().out
    assert "(sd3) on cpu" in plan and "scheduler:  flow-match" in plan
    assert "text_encoder, text_encoder_2, text_encoder_3, transformer, vae_decoder" in plan
    assert "step                 transformer/model.onnx, built in memory" in plan


# ----------------------------------------------------------------------------------------------- refusals


def one_line_error(capsys, code: int, *fragments: str) -> None:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("onnxopt: error:"), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def sd3_copy(sd3, tmp_path) -> Path:
    folder = tmp_path / "sd3"
    shutil.copytree(sd3[1]["diffusers"], folder)
    return folder


def generate_args(folder, tmp_path, *extra) -> list[str]:
    return ["generate", str(folder), "--prompt", "a cat", "--steps", "2", "-o", str(tmp_path / "x.png"), *extra]


@pytest.mark.parametrize("case,fragments", [
    ("index names T5, folder lacks it", ("model_index.json names 'text_encoder_3'",)),
    ("no tokenizer_3 beside T5", ("missing tokenizer_3/",)),
    ("no transformer", ("missing component transformer/model.onnx",)),
    ("a UNet scheduler", ("its denoiser runs flow-match, not ddim",)),
    ("shift_factor not a number", ("'shift_factor' must be a finite number",)),
    ("in_channels of another VAE", ("in_channels 4", "latents of 16 channels")),
    ("max sequence length 0", ("max sequence length must be an integer in 1..512",)),
    ("SD 1.5 folder named SD3", ("missing component", "(sd3 pipeline)")),
])
def test_bad_sd3_folders_and_requests_exit_2(sd3, tmp_path, capsys, case, fragments):
    folder, extra = sd3_copy(sd3, tmp_path), []
    if case == "index names T5, folder lacks it":
        shutil.rmtree(folder / "text_encoder_3")
    elif case == "no tokenizer_3 beside T5":
        shutil.rmtree(folder / "tokenizer_3")
    elif case == "no transformer":
        shutil.rmtree(folder / "transformer")
    elif case == "a UNet scheduler":
        extra = ["--scheduler", "ddim"]
    elif case in ("shift_factor not a number", "in_channels of another VAE"):
        name, key, value = (("vae_decoder", "shift_factor", "0.06") if case.startswith("shift")
                            else ("transformer", "in_channels", 4))
        config = json.loads((folder / name / "config.json").read_text())
        (folder / name / "config.json").write_text(json.dumps(dict(config, **{key: value})))
    elif case == "max sequence length 0":
        extra = ["--max-sequence-length", "0"]
    else:
        shutil.rmtree(folder)
        shutil.copytree(ROOT / "models" / "pipelines" / "sd15-tiny", folder)
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps(dict(index, _class_name="StableDiffusion3Pipeline")))
    one_line_error(capsys, onnxopt_main(generate_args(folder, tmp_path, *extra)), *fragments)
    assert not (tmp_path / "x.png").exists()


def test_a_flux_img2img_folder_is_refused_until_onnxopt_runs_it(sd3, tmp_path, capsys):
    folder = sd3_copy(sd3, tmp_path)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps(dict(index, _class_name="FluxImg2ImgPipeline")))
    for command in (generate_args(folder, tmp_path), ["optimize", "-i", str(folder), "-o", str(tmp_path / "o")]):
        one_line_error(capsys, onnxopt_main(command), "FluxImg2ImgPipeline", "does not run")
    assert not (tmp_path / "o").exists()
