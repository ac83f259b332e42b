"""onnxopt.pipeline.generate: the ONNX pipeline gives the diffusers torch pipeline's image.

The claim: for the tiny SD 1.5, SDXL and SD 1.5 + ControlNet folders,
exported from the torch pipeline ``models.pipelines.build_torch_pipeline(kind, "tiny", seed)``,
fp32 on the ORT CPU EP, for each of DDIM, Euler and DPM-Solver++ 2M, ``Pipeline`` gives the final
latents and the image of diffusers' own ``__call__`` with the same scheduler object, prompt,
negative prompt, seed, steps, guidance and size.

Tolerances. Both sides run the same fp32 graphs; they differ only by kernel rounding (ORT's vs
torch's GEMM/conv accumulation order, ~1e-7 relative per op), amplified by guidance 7.5 and the
solver over the steps. Measured on the 9 cases: final latents within 1.6e-6 of their scale
(max |latent| ~20), except SDXL + DDIM at 3.2e-5: SDXL's scheduler config leaves DDIM's
``clip_sample`` at its default True, so every step clips x0 to [-1, 1] and the final latents sit at
the clip (scale 1.0) -- diffusers' own ``scheduler.step`` runs it, since clipping is not affine.
Hence latents at ``atol = 1e-4 * scale`` and images in [0, 1] at ``atol = 1e-4`` (measured <= 1.2e-5).
The PNG's uint8 values may then differ by one level where a value lies within 1e-4 of a rounding
boundary (measured: 1 pixel of 4608 in 2 cases); more than 0.5 % would mean a real difference.
A wrong seed, a swapped guidance order or a missing negative prompt moves latents by O(1).

Kept small for CI: 4 steps, 32x48 images (latents 16x24: not square, so H/W mix-ups show).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="generating needs torch (pip install -e '.[models]')")
pytest.importorskip("diffusers", reason="generating needs diffusers")
pytest.importorskip("transformers", reason="generating needs transformers")
pytest.importorskip("onnxruntime", reason="generating needs onnxruntime")

from onnxopt.pipeline import Pipeline, PipelineFolder  # noqa: E402
from onnxopt.runners.captured_session import CapturedSession  # noqa: E402
from onnxopt.pipeline.schedulers import make_scheduler  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMITTED_SD15 = ROOT / "models" / "pipelines" / "sd15-tiny"
KINDS = {"sd15": "sd", "sdxl": "sdxl", "sd15-controlnet": "controlnet"}
SEED = 0
STEPS = 4
GUIDANCE = 7.5
HEIGHT, WIDTH = 32, 48
PROMPT, NEGATIVE = "a photo of a red cat", "blurry"
THREADS = 1  # tiny graphs: one thread each side is fastest on a shared 2-core CI machine
LATENT_RTOL = 1e-4  # of max |latent|
PIXEL_ATOL = 1e-4


def control_image():
    from PIL import Image

    rng = np.random.default_rng(7)
    edges = (rng.random((HEIGHT, WIDTH)) > 0.8).astype(np.uint8) * 255
    return Image.fromarray(np.stack([edges] * 3, axis=-1))


class Built:
    """A tiny kind: its torch pipeline (the reference) and its ONNX folder, made once per module."""

    def __init__(self, kind: str, root: Path):
        from models.pipelines import build_torch_pipeline, write_onnx_folder

        self.kind = kind
        self.torch_pipe = build_torch_pipeline(kind, "tiny", SEED)
        self.torch_pipe.set_progress_bar_config(disable=True)
        self.folder = root / kind
        write_onnx_folder(kind, self.folder, "tiny", "torchscript", SEED, pipe=self.torch_pipe)
        self.pipelines: dict[bool, Pipeline] = {}

    def onnx(self, fused: bool = True) -> Pipeline:
        if fused not in self.pipelines:
            self.pipelines[fused] = Pipeline.load(self.folder, "cpu", fused_step=fused, threads=THREADS)
        return self.pipelines[fused]

    def request(self, **overrides) -> dict:
        request = dict(prompt=PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=GUIDANCE, seed=SEED,
                       height=HEIGHT, width=WIDTH)
        if self.kind == "sd15-controlnet":
            request["controlnet_image"] = control_image()
        request.update(overrides)
        return request

    def diffusers_pipeline(self, scheduler: str | None, folder: Path | None = None):
        """diffusers' pipeline as a user gets it from the folder: its class made with the folder's own
        scheduler (the class's __init__ may correct an outdated scheduler config), then the requested
        scheduler class made from_config of the pipeline's, as users swap schedulers."""
        import diffusers

        opened = PipelineFolder.open(folder or self.folder)
        config = opened.scheduler_config()
        # from_pretrained makes the class model_index.json names, from the config whatever its _class_name
        own = getattr(diffusers, opened.index["scheduler"][1]).from_config(config)
        pipe = type(self.torch_pipe)(**dict(self.torch_pipe.components, scheduler=own))
        if scheduler is not None:
            pipe.scheduler = make_scheduler(scheduler, dict(pipe.scheduler.config))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference(self, scheduler: str | None, folder: Path | None = None, **overrides):
        """diffusers' __call__: (final latents, image [H, W, 3] in [0, 1])."""
        import torch

        r = self.request(**overrides)
        pipe = self.diffusers_pipeline(scheduler, folder)
        final = {}

        def keep_latents(_pipe, i, _t, kwargs):
            final["latents"] = kwargs["latents"].clone()
            return kwargs

        extra = {"image": r["controlnet_image"]} if "controlnet_image" in r else {}
        with torch.no_grad():
            image = pipe(r["prompt"], negative_prompt=r["negative_prompt"], num_inference_steps=r["steps"],
                         guidance_scale=r["guidance"], height=r["height"], width=r["width"],
                         generator=torch.Generator("cpu").manual_seed(r["seed"]), output_type="np",
                         callback_on_step_end=keep_latents, **extra).images[0]
        return final["latents"].numpy(), image


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """built(kind) -> Built, made once per module. Torch runs on THREADS threads meanwhile."""
    import torch

    root = tmp_path_factory.mktemp("pipelines")
    cache: dict[str, Built] = {}

    def get(kind: str) -> Built:
        if kind not in cache:
            cache[kind] = Built(kind, root)
        return cache[kind]

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield get
    torch.set_num_threads(threads)


def assert_same_image(latents, pixels, ref_latents, ref_pixels):
    scale = float(np.abs(ref_latents).max())
    assert latents.shape == ref_latents.shape
    np.testing.assert_allclose(latents, ref_latents, rtol=0, atol=LATENT_RTOL * scale)
    assert pixels.shape == ref_pixels.shape
    np.testing.assert_allclose(pixels, ref_pixels, rtol=0, atol=PIXEL_ATOL)
    levels = np.abs((pixels * 255).round() - (ref_pixels * 255).round())
    assert levels.max() <= 1 and (levels > 0).mean() <= 0.005


@pytest.mark.parametrize("scheduler", ["ddim", "euler", "dpm++2m", "pndm"])  # the others: test_pipeline_scheduler_images
@pytest.mark.parametrize("kind", list(KINDS))
def test_onnx_pipeline_gives_the_diffusers_image(built, kind, scheduler):
    b = built(kind)
    result = b.onnx()(scheduler=scheduler, progress=False, **b.request())
    ref_latents, ref_pixels = b.reference(scheduler)
    assert PipelineFolder.open(b.folder).kind == KINDS[kind]
    assert result.image.size == (WIDTH, HEIGHT)
    assert_same_image(result.latents, result.pixels, ref_latents, ref_pixels)
    assert np.asarray(result.image).tolist() == (result.pixels * 255).round().astype(np.uint8).tolist()
    if (kind, scheduler) == ("sdxl", "ddim"):  # clip_sample (DDIM's default, absent from SDXL's config)
        assert result.timings["step"].startswith("unfused") and "clip_sample" in result.timings["step"]
    elif scheduler == "pndm" and kind == "sd15-controlnet":  # its graphs read six coefficients: diffusers' loop
        assert result.timings["step"].startswith("unfused: PNDM's history is not carried through the ControlNet")
    elif scheduler == "pndm" and kind == "sdxl":  # SDXL's config has no skip_prk_steps: PNDM's default, PRK steps
        assert result.timings["step"].startswith("unfused: PNDMScheduler with skip_prk_steps=False runs Runge-Kutta")
    else:
        assert result.timings["step"] == "built in memory from unet/model.onnx"


def test_the_comparison_sees_another_seed(built):
    """The tolerance above is tight enough to fail: seed 1 is far outside it."""
    b = built("sd15")
    result = b.onnx()(scheduler="ddim", progress=False, **b.request(seed=SEED + 1))
    ref_latents, _ = b.reference("ddim")
    assert np.abs(result.latents - ref_latents).max() > 100 * LATENT_RTOL * np.abs(ref_latents).max()


@pytest.mark.parametrize("kind", list(KINDS))
def test_fused_step_graph_equals_the_unfused_loop(built, kind):
    """The step graph (CFG + scheduler update inside ONNX) = UNet session + diffusers' scheduler.step,
    for the multistep solver (its state input/output used) and for Euler (c_in != 1)."""
    b = built(kind)
    for scheduler in ("dpm++2m", "euler"):
        fused = b.onnx(True)(scheduler=scheduler, progress=False, **b.request(negative_prompt=None))
        unfused = b.onnx(False)(scheduler=scheduler, progress=False, **b.request(negative_prompt=None))
        assert fused.timings["step"] != unfused.timings["step"] == "unfused"
        scale = float(np.abs(unfused.latents).max())
        np.testing.assert_allclose(fused.latents, unfused.latents, rtol=0, atol=LATENT_RTOL * scale)
        np.testing.assert_allclose(fused.pixels, unfused.pixels, rtol=0, atol=PIXEL_ATOL)


@pytest.mark.parametrize("kind", ["sd15-controlnet", "sdxl"])
def test_bound_buffer_loop_equals_the_host_loop(built, kind):
    """The CUDA EP's loop (IO binding, latents/state/step counter ping-pong between two bound buffer
    pairs, the schedule read from bound tables, ControlNet input from the scaling graph into fixed
    residual buffers) run on CPU buffers: the same latents as the numpy loop, for the multistep
    solver (state). Later images reuse the same buffers (a captured CUDA graph replays the addresses
    it was captured with): another scheduler, another step count, another prompt and seed each give
    the numpy loop's latents; another size gets its own buffers. The text encoders and the VAE
    decoder run on buffers bound once per shape (CapturedSession): the same images."""
    b = built(kind)
    bound = Pipeline.load(b.folder, "cpu", io_binding=True, threads=THREADS)
    result = bound(scheduler="dpm++2m", progress=False, **b.request())
    host = b.onnx()(scheduler="dpm++2m", progress=False, **b.request())
    np.testing.assert_allclose(result.latents, host.latents, rtol=0, atol=1e-6 * np.abs(host.latents).max())
    # The text encoders and the VAE decoder ran on bound buffers too (CapturedSession), with the same image.
    np.testing.assert_allclose(result.pixels, host.pixels, rtol=0, atol=1e-6)
    once = {name: s for name, s in bound.sessions.items() if isinstance(s, CapturedSession)}
    assert {"text_encoder", "vae_decoder"} <= set(once)
    loops = dict(bound._device_loops)
    assert len(loops) == 1
    buffers = [id(v) for v in next(iter(loops.values()))._keep]
    for change in ({"scheduler": "euler"}, {"steps": 3}, {"prompt": "another prompt", "seed": 7}):
        request = {**b.request(), "scheduler": "dpm++2m", **change}
        again = bound(progress=False, **request)
        expected = b.onnx()(progress=False, **request)
        assert not again.timings["step"].startswith("unfused")
        np.testing.assert_allclose(again.latents, expected.latents, rtol=0, atol=1e-6 * np.abs(expected.latents).max())
        assert not np.allclose(again.latents, result.latents)  # the request really changed the image
        np.testing.assert_allclose(again.pixels, expected.pixels, rtol=0, atol=1e-6)
    assert bound._device_loops == loops and [id(v) for v in next(iter(loops.values()))._keep] == buffers
    assert all(len(s.cache) == 1 for s in once.values())  # one set of buffers per shape, reused
    if kind == "sdxl":  # another size: its own buffers (and, on a GPU, its own captured graphs)
        request = dict(b.request(), height=b.request()["height"] + 64, scheduler="dpm++2m")
        again, expected = bound(progress=False, **request), b.onnx()(progress=False, **request)
        np.testing.assert_allclose(again.latents, expected.latents, rtol=0, atol=1e-6 * np.abs(expected.latents).max())
        assert len(bound._device_loops) == 2
        np.testing.assert_allclose(again.pixels, expected.pixels, rtol=0, atol=1e-6)
        assert len(once["vae_decoder"].cache) == 2 and len(once["text_encoder"].cache) == 1


def test_generate_writes_the_pipeline_image(tmp_path):
    from PIL import Image

    from onnxopt.pipeline import generate

    out = tmp_path / "a.png"
    result = generate(COMMITTED_SD15, PROMPT, output=out, steps=2, scheduler="euler", progress=False)
    with Image.open(out) as image:
        assert np.array_equal(np.asarray(image), np.asarray(result.image))
    same = Pipeline.load(COMMITTED_SD15, "cpu", threads=THREADS)(PROMPT, steps=2, scheduler="euler", progress=False)
    np.testing.assert_allclose(same.latents, result.latents, rtol=0, atol=1e-6 * np.abs(same.latents).max())


def test_sdxl_without_negative_prompt_uses_zero_conditioning(built):
    """SDXL's force_zeros_for_empty_prompt: no negative prompt gives diffusers' image (zeros), and
    not the image of an explicit empty negative prompt."""
    b = built("sdxl")
    zeros = b.onnx()(scheduler="euler", progress=False, **b.request(negative_prompt=None))
    ref_latents, ref_pixels = b.reference("euler", negative_prompt=None)
    assert_same_image(zeros.latents, zeros.pixels, ref_latents, ref_pixels)
    empty = b.onnx()(scheduler="euler", progress=False, **b.request(negative_prompt=""))
    assert np.abs(empty.latents - zeros.latents).max() > 100 * LATENT_RTOL * np.abs(ref_latents).max()


@pytest.mark.parametrize("kind, context_kv", [("sd15", True), ("sd15", False), ("sdxl", True),
                                              ("sd15-controlnet", True)])
def test_generate_on_an_optimized_folder(built, tmp_path, kind, context_kv):
    """``onnxopt optimize --target tensorrt`` on a folder writes standard ONNX and unet/step.onnx
    (by default with its cross-attention K/V cut into step.context_kv.onnx, run once per prompt;
    a ControlNet's conditioning embedding cut into controlnet/step.hint.onnx, run once per image);
    every component runs on the ORT CPU EP and gives the source folder's image."""
    from onnxopt.pipeline import optimize_folder

    b = built(kind)
    out = tmp_path / f"{kind}-trt"
    optimize_folder(b.folder, out, target="tensorrt", context_kv=context_kv)
    assert (out / "unet" / "step.onnx").is_file()
    assert (out / "unet" / "step.context_kv.onnx").is_file() == context_kv
    pipe = Pipeline.load(out, "cpu", threads=THREADS, merged_step=False)
    optimized = pipe(scheduler="dpm++2m", progress=False, **b.request())
    assert optimized.timings["step"] == "unet/step.onnx" + (" + step.context_kv.onnx" if context_kv else "")
    step_inputs = {i.name for i in pipe.sessions["step"].get_inputs()}
    assert ("encoder_hidden_states" in step_inputs) == (not context_kv)
    if kind == "sd15":  # the folder's PNDM: unet/step.onnx with its history, built in memory from the written one
        pndm = pipe(progress=False, **b.request())
        assert pndm.timings["step"] == optimized.timings["step"] and "step+history" in pipe.sessions
        assert_same_image(pndm.latents, pndm.pixels, *b.reference("pndm"))
    if kind == "sdxl":  # the added conditioning once per prompt too: the step reads add_embedding's output
        assert ("text_embeds" in step_inputs) == (not context_kv) == ("add_embedding.linear_2.out" not in step_inputs)
    if kind == "sd15-controlnet":  # the hint once per image: the ControlNet's step reads it, not the image
        assert (out / "controlnet" / "step.hint.onnx").is_file() and "hint" in pipe.sessions
        # by default the ControlNet and the step graph run as one graph (tests/test_pipeline_merged_step.py)
        merged = Pipeline.load(out, "cpu", threads=THREADS)(scheduler="dpm++2m", progress=False, **b.request())
        assert merged.timings["step"].startswith("merged_step.onnx")
        np.testing.assert_allclose(merged.latents, optimized.latents, rtol=0, atol=1e-6 * np.abs(optimized.latents).max())
        assert {i.name for i in pipe.sessions["controlnet"].get_inputs()} >= {"controlnet_hint", "sample"}
        assert "controlnet_cond" not in {i.name for i in pipe.sessions["controlnet"].get_inputs()}
        bound = Pipeline.load(out, "cpu", io_binding=True, threads=THREADS, merged_step=False)(
            scheduler="dpm++2m", progress=False, **b.request())
        np.testing.assert_allclose(bound.latents, optimized.latents, rtol=0, atol=1e-6 * np.abs(optimized.latents).max())
    source = b.onnx()(scheduler="dpm++2m", progress=False, **b.request())
    scale = float(np.abs(source.latents).max())
    np.testing.assert_allclose(optimized.latents, source.latents, rtol=0, atol=LATENT_RTOL * scale)
    np.testing.assert_allclose(optimized.pixels, source.pixels, rtol=0, atol=PIXEL_ATOL)
    if kind != "sd15-controlnet":  # guidance off: step.onnx without its guidance rows, the text encoder at batch 1
        off = Pipeline.load(out, "cpu", threads=THREADS, guidance=1.0, io_binding=kind == "sdxl")(
            scheduler="dpm++2m", progress=False, **b.request(guidance=1.0))
        assert off.timings["without_guidance"] == ("the step graph of unet/step.onnx without its guidance rows, built "
                                                   "in memory (one row per image)")
        assert off.timings["text_encoders"]["text_encoder" if kind == "sd15" else "text_encoder_2"] == "model.static.b1.onnx"
        source = b.onnx()(scheduler="dpm++2m", progress=False, **b.request(guidance=1.0))
        np.testing.assert_allclose(off.latents, source.latents, rtol=0, atol=LATENT_RTOL * np.abs(source.latents).max())



@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_bound_loop_reads_the_kv_where_the_companion_wrote_them(built, tmp_path, kind):
    """On bound buffers the cross-attention K/V (and SDXL's added conditioning) never visit the
    host: the step loop binds the K/V companion's own output buffers as its inputs, so each new
    prompt's K/V are rewritten in place and read there by the same loop (on a GPU, the same
    captured graph). Two prompts give the host loop's latents, and differ from each other."""
    from onnxopt.pipeline import optimize_folder

    b = built(kind)
    out = tmp_path / f"{kind}-kv"
    optimize_folder(b.folder, out, target="tensorrt")  # standard ONNX: the CPU EP runs every component
    bound = Pipeline.load(out, "cpu", io_binding=True, threads=THREADS)
    host = Pipeline.load(out, "cpu", threads=THREADS)
    latents = []
    for prompt in (PROMPT, "a watercolor of a lighthouse"):
        request = b.request(prompt=prompt, scheduler="dpm++2m")
        got, expected = bound(progress=False, **request), host(progress=False, **request)
        np.testing.assert_allclose(got.latents, expected.latents, rtol=0, atol=1e-6 * np.abs(expected.latents).max())
        latents.append(got.latents)
    assert not np.allclose(*latents)
    (loop,) = bound._device_loops.values()
    (companion,) = bound.sessions["context"].cache.values()
    written = {name: value.data_ptr() for name, value in companion.outputs.items()}
    assert len(written) > 1 and set(written) <= set(loop.static)
    assert {name: loop.static[name].data_ptr() for name in written} == written


@pytest.mark.gpu
def test_captured_step_reads_each_prompts_kv_on_the_device(tmp_path):
    """On a GPU (``pytest -m gpu``): with CUDA graphs, the captured step graph reads the K/V where the
    captured companion graph writes them, so a second prompt's K/V reach the replayed step: two
    prompts give the host loop's latents (uncaptured, no IO binding; fp32 within 1e-3 of the scale,
    cuBLAS may pick other algorithms) and differ from each other."""
    from onnxopt.pipeline import optimize_folder
    from onnxopt.runners import cuda_available

    if not cuda_available():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")
    folder = tmp_path / "ort-cuda"
    optimize_folder(COMMITTED_SD15, folder, target="ort-cuda")
    captured = Pipeline.load(folder, "cuda", cuda_graph=True)
    host = Pipeline.load(folder, "cuda", cuda_graph=False, io_binding=False)
    request = dict(steps=4, scheduler="euler", height=64, width=64, progress=False)
    latents = []
    for prompt in ("a photo of a red cat", "a watercolor of a lighthouse"):
        got, expected = captured(prompt, **request), host(prompt, **request)
        # the two sessions' kernels differ (cuBLAS/cuDNN pick per session): on an H100 the largest
        # difference was 1.1e-3 of the latents' range; another prompt's K/V moves them by far more
        np.testing.assert_allclose(got.latents, expected.latents, rtol=0, atol=3e-3 * np.abs(expected.latents).max())
        latents.append(got.latents)
    assert np.abs(latents[0] - latents[1]).max() > 0.1 * np.abs(latents[0]).max()
    assert captured.cuda_graph and captured.sessions["context"].cuda_graph
    (loop,) = captured._device_loops.values()
    (companion,) = captured.sessions["context"].cache.values()
    assert all(loop.static[name].data_ptr() == value.data_ptr() for name, value in companion.outputs.items())

# --- the CLI on the committed tiny folder ---------------------------------------------------------

def run_cli(*args, cwd=None):
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "onnxopt", "generate", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def test_cli_writes_the_png_and_the_timings(tmp_path):
    from PIL import Image

    png, timings = tmp_path / "cat.png", tmp_path / "timings.json"
    done = run_cli(COMMITTED_SD15, "--prompt", "a photo of a cat", "--steps", "3", "--scheduler", "euler",
                   "--height", "32", "--width", "48", "-o", png, "--json", timings)
    assert done.returncode == 0, done.stderr
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (48, 32) and image.mode == "RGB"
    t = json.loads(timings.read_text())
    for key in ("text_encoder_s", "step_mean_s", "first_step_s", "steps_s", "vae_decode_s", "rest_s", "total_s",
                "session_creation_s", "cold_start_s"):
        assert isinstance(t[key], float) and t[key] >= 0, key
    assert t["steps_s"] >= t["first_step_s"] + 2 * t["step_mean_s"] - 1e-9 and t["rest_s"] < t["total_s"]
    assert t["steps"] == 3 and t["provider"] == "cpu"
    assert "step" in done.stdout and "VAE decode" in done.stdout
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temporary file


@pytest.mark.parametrize("case, expected", [
    (lambda d, o: ["/no/such/folder", "--prompt", "a", "-o", o], "no such folder"),
    (lambda d, o: [d / "unet", "--prompt", "a", "-o", o], "not a pipeline folder"),
    (lambda d, o: [d, "--prompt", "a", "--height", "36", "-o", o], "multiple of 8"),
    (lambda d, o: [d, "--prompt", "a", "--steps", "0", "-o", o], "steps must be at least 1"),
    (lambda d, o: [d, "--prompt", "a", "--scheduler", "lms", "-o", o], "unknown scheduler"),
    (lambda d, o: [d, "--prompt", "a", "-o", Path("/no/such/dir/x.png")], "does not exist"),
    (lambda d, o: [d, "--prompt", "a", "--controlnet-image", o, "-o", o], "has no controlnet"),
    (lambda d, o: [d, "--prompt", "a", "--provider", "tensorrt", "-o", o], "needs TensorRT"),
    (lambda d, o: [d, "--prompt", "a", "--guidance", "nan", "--steps", "1", "-o", o], "guidance must be a finite number"),
    (lambda d, o: [d, "--prompt", "a", "--seed", str(2**64), "--steps", "1", "-o", o], "seed must be an integer"),
], ids=["missing-folder", "not-a-pipeline", "height", "steps", "scheduler", "unwritable-output", "controlnet-image",
        "tensorrt-missing", "nan-guidance", "seed-overflow"])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, case, expected):
    from onnxopt.cli import main

    out = tmp_path / "x.png"
    out.write_bytes(b"")  # exists, so --controlnet-image reaches the folder check
    code = main(["generate", *(str(a) for a in case(COMMITTED_SD15, out))])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and expected in err and "Traceback" not in err


def test_cli_out_of_memory_is_a_one_line_error_not_a_bug(tmp_path, capsys, monkeypatch):
    """An allocation ONNX Runtime cannot make (a size too big for the machine) exits 2 with the size it
    wanted, not 3 ("internal error"); the message is ORT's own, from a 4096x64 image on this machine."""
    import onnxopt.pipeline.runner as runner
    from onnxopt.cli import main, out_of_memory

    ort_message = ("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running FusedMatMul node. "
                   "Status Message: bfc_arena.cc:360 Failed to allocate memory for requested buffer of size 68719476736")

    def fails(*args, **kwargs):
        raise RuntimeError(ort_message)

    monkeypatch.setattr(runner.Pipeline, "__call__", fails)
    out = tmp_path / "x.png"
    assert main(["generate", str(COMMITTED_SD15), "--prompt", "a", "-q", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "onnxopt: error: ONNX Runtime ran out of memory (one buffer of 64.0 GiB): try a smaller image size or batch"
    assert not out.exists()
    assert out_of_memory(RuntimeError("Non-zero status code returned while running Conv node")) is None


def test_cli_missing_component_and_missing_control_image(built, tmp_path, capsys):
    import shutil

    from onnxopt.cli import main

    broken = tmp_path / "broken"
    shutil.copytree(COMMITTED_SD15, broken)
    shutil.rmtree(broken / "vae_decoder")
    assert main(["generate", str(broken), "--prompt", "a", "-o", str(tmp_path / "x.png")]) == 2
    assert "missing component vae_decoder" in capsys.readouterr().err
    controlnet = built("sd15-controlnet").folder
    assert main(["generate", str(controlnet), "--prompt", "a", "-o", str(tmp_path / "x.png")]) == 2
    assert "give a conditioning image" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_cli_controlnet_image_from_a_file(built, tmp_path):
    """--controlnet-image: a PNG on disk gives the image of the same picture passed in memory."""
    from PIL import Image

    b = built("sd15-controlnet")
    edges = tmp_path / "edges.png"
    control_image().save(edges)
    from onnxopt.cli import main

    out = tmp_path / "out.png"
    assert main(["generate", str(b.folder), "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--steps", str(STEPS),
                 "--scheduler", "ddim", "--controlnet-image", str(edges), "-o", str(out), "-q"]) == 0
    in_memory = b.onnx()(scheduler="ddim", progress=False, **b.request())
    with Image.open(out) as image:
        assert image.size == (WIDTH, HEIGHT)  # the control image sets the size, as in diffusers
        assert np.abs(np.asarray(image).astype(int) - np.asarray(in_memory.image).astype(int)).max() <= 1


# --- CUDA EP (the lead runs these on the GPU machine: pytest -m gpu tests/test_pipeline_generate.py) ---

def _cuda():
    from onnxopt.runners.ort_cuda import cuda_available

    return cuda_available()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["io-binding", "cuda-graph"])
@pytest.mark.parametrize("scheduler", ["ddim", "dpm++2m"])
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs onnxruntime-gpu and a CUDA device")
def test_cuda_ep_gives_the_cpu_image(built, kind, cuda_graph, scheduler, tmp_path):
    """CUDA EP, fused step on device buffers (ping-pong latents/state, coefficients updated in
    place): without capture, the CPU EP's image within fp32 GPU rounding (cuDNN's conv algorithms
    differ from the CPU's). CUDA graph capture needs every node on the CUDA EP (a raw export's shape
    arithmetic runs on the CPU), so it runs on the folder optimized for ort-cuda, and its replays give
    that folder's image without capture. The fused fp32 kernels are not bit-deterministic: on an H100
    two sessions of that folder without capture differ by 1e-3 of the latents' scale after 4 steps
    of the tiny random UNet (which grows its latents 4x in 4 steps), as much as capture vs none."""
    from onnxopt.pipeline import optimize_folder

    b = built(kind)
    if kind == "sdxl" and scheduler == "ddim":
        scheduler = "euler"  # SDXL's DDIM config clips (unfused); keep the device loop under test
    cpu = b.onnx()(scheduler=scheduler, progress=False, **b.request())
    folder = b.folder
    if cuda_graph:
        folder = tmp_path / "ort-cuda"
        optimize_folder(b.folder, folder, target="ort-cuda")
    pipe = Pipeline.load(folder, "cuda", cuda_graph=cuda_graph)
    first = pipe(scheduler=scheduler, progress=False, **b.request())
    again = pipe(scheduler=scheduler, progress=False, **b.request())  # replays the captured graphs
    assert first.timings["cuda_graph"] is cuda_graph
    if cuda_graph:
        cpu = Pipeline.load(folder, "cuda", cuda_graph=False)(scheduler=scheduler, progress=False, **b.request())
    tolerance = 2e-3 if cuda_graph else 1e-3
    scale = float(np.abs(cpu.latents).max())
    for result in (first, again):
        np.testing.assert_allclose(result.latents, cpu.latents, rtol=0, atol=tolerance * scale)
        np.testing.assert_allclose(result.pixels, cpu.pixels, rtol=0, atol=2 * tolerance)
    if not cuda_graph:  # the raw export's kernels are deterministic; the fused ones are not (above)
        np.testing.assert_array_equal(first.latents, again.latents)
    else:  # the VAE decoder is captured too (the text encoder's int64 ArgMax runs on the CPU EP: not
        # capturable, it stays on bound buffers); another prompt and seed replay them
        assert pipe.sessions["vae_decoder"].cuda_graph
        other = dict(b.request(), prompt="another prompt", seed=7)
        replayed = pipe(scheduler=scheduler, progress=False, **other)
        expected = Pipeline.load(folder, "cuda", cuda_graph=False)(scheduler=scheduler, progress=False, **other)
        assert not np.allclose(replayed.pixels, first.pixels)
        other_scale = float(np.abs(expected.latents).max())  # this image's own scale, not the first's
        np.testing.assert_allclose(replayed.latents, expected.latents, rtol=0, atol=tolerance * other_scale)
        np.testing.assert_allclose(replayed.pixels, expected.pixels, rtol=0, atol=2 * tolerance)


@pytest.mark.parametrize("target", ["unet/model.onnx", "new.png", "json:model_index.json"])
def test_cli_never_writes_into_the_pipeline_folder(tmp_path, capsys, target):
    """-o or --json onto a file of the folder (or a new file in it) would modify the input: exit 2
    before any work, one line, every file of the folder unchanged. (-o unet/model.onnx used to
    replace the UNet with a PNG.)"""
    import hashlib
    import shutil

    from onnxopt.cli import main

    folder = tmp_path / "sd15"
    shutil.copytree(COMMITTED_SD15, folder)
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}
    args = ["generate", str(folder), "--prompt", "a", "--steps", "1"]
    if target.startswith("json:"):
        args += ["-o", str(tmp_path / "x.png"), "--json", str(folder / target[5:])]
    else:
        args += ["-o", str(folder / target)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "never modifies its input" in err
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()} == before


def test_cli_never_writes_over_the_control_image(built, tmp_path, capsys):
    from onnxopt.cli import main

    b = built("sd15-controlnet")
    edges = tmp_path / "edges.png"
    control_image().save(edges)
    before = edges.read_bytes()
    assert main(["generate", str(b.folder), "--prompt", "a", "--controlnet-image", str(edges), "-o", str(edges)]) == 2
    assert "never modifies its input" in capsys.readouterr().err and edges.read_bytes() == before


def test_postprocess_is_diffusers_image_processor_bit_for_bit():
    """images.postprocess does VaeImageProcessor.postprocess(output_type="np")'s arithmetic in NumPy
    (the processor took 12-20 ms per image on the H100 host): the same float32 bits, values outside
    [-1, 1] and fp16 VAE outputs included."""
    import torch
    from diffusers.image_processor import VaeImageProcessor

    from onnxopt.pipeline import images

    rng = np.random.default_rng(5)
    for dtype in (np.float32, np.float16):
        decoded = (rng.standard_normal((2, 3, 24, 40)) * 0.8).astype(dtype)
        decoded[0, 0, 0, :3] = [-1.5, 1.5, 1.0]  # clamped both ways, and the upper bound exactly
        expected = VaeImageProcessor(vae_scale_factor=8).postprocess(torch.from_numpy(decoded.astype(np.float32)),
                                                                     output_type="np")
        got = images.postprocess(decoded)
        assert got.dtype == np.float32 and got.shape == expected.shape == (2, 24, 40, 3)
        np.testing.assert_array_equal(got, expected)


# --- diffusers' semantics for what the folder and the request say ---------------------------------

def copy_folder(source: Path, dest: Path, **edits) -> Path:
    """A copy of a pipeline folder with JSON files edited: ``edits`` maps a relative path
    ("scheduler/scheduler_config.json") to the keys to set in it."""
    import shutil

    shutil.copytree(source, dest)
    for relative, keys in edits.items():
        path = dest / relative
        path.write_text(json.dumps({**json.loads(path.read_text()), **keys}, indent=2))
    return dest


class RowsFed:
    """A session that records how many rows of ``name`` each run is fed (the denoiser's batch)."""

    def __init__(self, session, name: str):
        self.session, self.name, self.rows = session, name, []

    def run(self, outputs, feeds, *args, **kwargs):
        self.rows.append(len(feeds[self.name]))
        return self.session.run(outputs, feeds, *args, **kwargs)

    def __getattr__(self, attribute):
        return getattr(self.session, attribute)


@pytest.mark.parametrize("kind, guidance, fused", [
    ("sd15", 1.0, True), ("sd15", 0.7, False), ("sd15", 0.0, True), ("sd15", -3.0, False),
    ("sd15-controlnet", 1.0, True), ("sdxl", 1.0, True), ("sdxl", 0.7, False),
])
def test_guidance_at_most_one_turns_guidance_off_as_diffusers_does(built, kind, guidance, fused):
    """diffusers' do_classifier_free_guidance is guidance > 1: at 1 or below, the UNet runs the prompt's
    row alone and the negative prompt is never encoded. So does onnxopt: diffusers' image, the denoiser
    fed one row per image (the step graph without its guidance rows, or the unfused UNet), and another
    negative prompt changes not one bit (onnxopt used to run the negative row and cancel it with
    guidance 1: equal within rounding only). A ControlNet folder's graphs take two rows per image: there
    the prompt's row runs twice, and the guidance cancels exactly."""
    from onnxopt.pipeline.plan import NO_CFG_STEP

    b = built(kind)
    pipe = b.onnx(fused)
    result = pipe(scheduler="euler", progress=False, **b.request(guidance=guidance))
    assert result.timings["classifier_free_guidance"] is False
    assert result.timings["step"].startswith("unfused") != fused
    ref_latents, ref_pixels = b.reference("euler", guidance=guidance)
    assert_same_image(result.latents, result.pixels, ref_latents, ref_pixels)
    rows_per_image = 2 if kind == "sd15-controlnet" else 1
    key = (NO_CFG_STEP if rows_per_image == 1 else "step") if fused else "unet"
    spy = pipe.sessions[key] = RowsFed(pipe.sessions[key], "encoder_hidden_states")
    try:
        other = pipe(scheduler="euler", progress=False, **b.request(guidance=guidance, negative_prompt="a dog, oil paint"))
    finally:
        pipe.sessions[key] = spy.session
    np.testing.assert_array_equal(other.latents, result.latents)
    assert spy.rows == [rows_per_image] * STEPS
    assert ("twice" in result.timings["without_guidance"]) == (rows_per_image == 2)


def test_guidance_off_in_the_cfg_late_step_graph(built, tmp_path):
    """The cfg-late step graph (what both guidance halves share computed once) takes guidance <= 1
    as the others do: diffusers' image without guidance."""
    import shutil

    from onnxopt.pipeline.step_graph import write_step_graph

    b = built("sd15")
    folder = tmp_path / "sd15"
    shutil.copytree(b.folder, folder)
    write_step_graph(folder / "unet", file_name="step.cfg_late.onnx", context_kv=False, cfg_late=True)
    pipe = Pipeline.load(folder, "cpu", threads=THREADS, step_file="step.cfg_late.onnx")
    result = pipe(scheduler="dpm++2m", progress=False, **b.request(guidance=0.0))
    assert result.timings["step"] == "unet/step.cfg_late.onnx"
    assert_same_image(result.latents, result.pixels, *b.reference("dpm++2m", guidance=0.0))


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_latents_mean_and_std_as_the_pipeline_class_reads_them(built, tmp_path, kind):
    """A VAE config with latents_mean/latents_std: StableDiffusionXLPipeline denormalizes with them,
    StableDiffusionPipeline divides by scaling_factor and ignores them. onnxopt applied them in both."""
    b = built(kind)
    stats = {"latents_mean": [0.5, -0.25, 0.125, 1.0], "latents_std": [2.0, 0.5, 1.5, 0.75]}
    folder = copy_folder(b.folder, tmp_path / kind, **{"vae_decoder/config.json": stats})
    vae = b.torch_pipe.vae
    before = {key: vae.config.get(key) for key in stats}
    vae.register_to_config(**stats)
    try:
        ref_latents, ref_pixels = b.reference("euler", folder=folder)
    finally:
        vae.register_to_config(**before)
    result = Pipeline.load(folder, "cpu", threads=THREADS)(scheduler="euler", progress=False, **b.request())
    assert_same_image(result.latents, result.pixels, ref_latents, ref_pixels)
    plain = b.onnx()(scheduler="euler", progress=False, **b.request())
    assert np.array_equal(plain.pixels, result.pixels) == (kind == "sd15")


SCHEDULER_LOOKALIKES = {  # scheduler_config.json edits that look harmless and change diffusers' schedule
    "clip_sample": {"clip_sample": True},
    "steps_offset_0": {"steps_offset": 0},
    "both": {"clip_sample": True, "steps_offset": 0},
    "no_keys": {"clip_sample": None, "steps_offset": None},  # removed below: the class defaults apply
    "ddim_class": {"_class_name": "DDIMScheduler", "clip_sample": True, "set_alpha_to_one": True},
}


def _lookalike_config(config: dict, name: str) -> dict:
    edited = {**config, **SCHEDULER_LOOKALIKES[name]}
    return {k: v for k, v in edited.items() if v is not None}


@pytest.mark.parametrize("kind", list(KINDS))
def test_scheduler_config_is_the_one_the_diffusers_pipeline_holds(built, kind):
    """For each kind and each lookalike config, every scheduler a run makes has the config of
    diffusers' own: its pipeline class built with the folder's scheduler (StableDiffusionPipeline
    resets steps_offset to 1 and clip_sample to False; SDXL's and the ControlNet pipeline's do not),
    then the requested class from_config of that. Without the pipeline's corrections onnxopt ran
    DDIM with clip_sample (clipping x0 to [-1, 1] every step) where diffusers does not."""
    import diffusers

    from onnxopt.pipeline.schedulers import SCHEDULERS, pipeline_scheduler_config

    b = built(kind)
    config = PipelineFolder.open(b.folder).scheduler_config()
    folder_kind = KINDS[kind]
    differs = 0
    for name in SCHEDULER_LOOKALIKES:
        edited = _lookalike_config(config, name)
        own = getattr(diffusers, edited["_class_name"]).from_config(edited)
        holds = type(b.torch_pipe)(**dict(b.torch_pipe.components, scheduler=own)).scheduler.config
        for scheduler in SCHEDULERS:
            expected = dict(make_scheduler(scheduler, dict(holds)).config)
            got = dict(make_scheduler(scheduler, pipeline_scheduler_config(edited, folder_kind)).config)
            assert got == expected, (name, scheduler)
            differs += got != dict(make_scheduler(scheduler, edited).config)
    assert (differs > 0) == (folder_kind == "sd")  # the corrections matter for the SD pipeline only


@pytest.mark.parametrize("kind, scheduler", [("sd15", "ddim"), ("sd15", None), ("sd15-controlnet", "ddim")])
def test_clip_sample_in_the_folder_gives_the_diffusers_image(built, tmp_path, kind, scheduler):
    """clip_sample true and steps_offset 0 in scheduler_config.json: the SD pipeline resets both
    (DDIM without clipping, the fused step graph), the ControlNet pipeline keeps them (DDIM clips:
    diffusers' step, unfused). The same image as diffusers either way; None: the folder's PNDM."""
    b = built(kind)
    folder = copy_folder(b.folder, tmp_path / kind,
                         **{"scheduler/scheduler_config.json": SCHEDULER_LOOKALIKES["both"]})
    result = Pipeline.load(folder, "cpu", threads=THREADS)(scheduler=scheduler, progress=False, **b.request())
    assert_same_image(result.latents, result.pixels, *b.reference(scheduler, folder=folder))
    if scheduler == "ddim":
        assert result.timings["step"].startswith("unfused") == (kind == "sd15-controlnet")


def test_the_folders_own_scheduler_is_used_by_default(built, tmp_path):
    """SD 1.5 folders ship PNDMScheduler: without a scheduler a run uses it (onnxopt used DDIM),
    and gives diffusers' image with the folder's own scheduler. The class is model_index.json's
    (what from_pretrained makes), even where scheduler_config.json's _class_name says another."""
    b = built("sd15")
    assert PipelineFolder.open(b.folder).scheduler_config()["_class_name"] == "PNDMScheduler"
    # PNDM's own marks: its second timestep twice (steps + 1 runs) on the step graph with its history
    pipe = b.onnx()
    result = pipe(progress=False, **b.request())
    assert result.timings["steps"] == STEPS + 1 and "step+history" in pipe.sessions
    assert_same_image(result.latents, result.pixels, *b.reference(None))
    folder = copy_folder(b.folder, tmp_path / "sd15", **{"scheduler/scheduler_config.json": {"_class_name": "DDIMScheduler"}})
    relabelled_pipe = Pipeline.load(folder, "cpu", threads=THREADS)
    relabelled = relabelled_pipe(progress=False, **b.request())
    assert relabelled.timings["steps"] == STEPS + 1 and "step+history" in relabelled_pipe.sessions
    assert_same_image(relabelled.latents, relabelled.pixels, *b.reference(None, folder=folder))


@pytest.mark.parametrize("length", [20, 77])
def test_a_shorter_tokenizer_length_gives_the_diffusers_image(built, tmp_path, length):
    """model_max_length below the text encoder's positions: diffusers pads prompts to it, and so does a run."""
    b = built("sd15")
    folder = copy_folder(b.folder, tmp_path / "sd15", **{"tokenizer/tokenizer_config.json": {"model_max_length": length}})
    tokenizer = b.torch_pipe.tokenizer
    before, tokenizer.model_max_length = tokenizer.model_max_length, length
    try:
        reference = b.reference("euler", folder=folder)
    finally:
        tokenizer.model_max_length = before
    result = Pipeline.load(folder, "cpu", threads=THREADS)(scheduler="euler", progress=False, **b.request())
    assert_same_image(result.latents, result.pixels, *reference)


def test_a_prompt_longer_than_the_tokenizer_takes_is_warned_about_once(capsys):
    """diffusers warns when it cuts a prompt ("The following part of your input was truncated because
    CLIP can only handle sequences up to 77 tokens: ..."); a run did it silently. Now the same warning
    on stderr, naming the part cut, once per prompt; the negative prompt is cut silently, as in diffusers."""
    pipe = Pipeline.load(COMMITTED_SD15, "cpu", threads=THREADS, fused_step=False)
    prompt = " ".join(f"word{k}" for k in range(60)) + " the end"
    tokenizer = pipe.tokenizers["tokenizer"]
    ids = tokenizer(prompt).input_ids
    assert len(ids) > tokenizer.model_max_length
    removed = tokenizer.decode(ids[tokenizer.model_max_length - 1: -1])
    capsys.readouterr()
    for _ in range(2):
        pipe(prompt, negative_prompt=prompt + " again", steps=1, scheduler="euler", height=32, width=32, progress=False)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "truncated because CLIP can only handle sequences up to 77 tokens" in lines[0]
    assert repr(removed) in lines[0] and "the end" in removed
    pipe("a short prompt", steps=1, scheduler="euler", height=32, width=32, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("edits, expected", [
    ({"tokenizer/tokenizer_config.json": {"model_max_length": 100}},
     "pads prompts to 100 tokens (model_max_length), text_encoder takes at most 77"),
    ({"scheduler/scheduler_config.json": {"trained_betas": [0.01] * 10}}, "trained_betas must be a list of"),
    ({"scheduler/scheduler_config.json": {"timestep_spacing": "uniform"}}, "unknown timestep_spacing 'uniform'"),
    ({"scheduler/scheduler_config.json": {"prediction_type": "sample_x"}}, "cannot run 2 steps"),
    ({"model_index.json": {"scheduler": ["diffusers", "LMSDiscreteScheduler"]}}, "choose one with --scheduler"),
    # (a valid one runs, as diffusers runs it: tests/test_pipeline_lcm.py, where a graph without timestep_cond is refused)
    ({"unet/config.json": {"time_cond_proj_dim": "256"}}, "'time_cond_proj_dim' must be a positive integer"),
    ({"text_encoder/config.json": {"use_attention_mask": True}}, "use_attention_mask is set"),
    ({"unet/config.json": {"_diffusers_version": "zero.eight"}}, "is not a version"),
], ids=["tokenizer-longer-than-encoder", "trained-betas-length", "timestep-spacing", "prediction-type",
        "folder-scheduler-class", "guidance-embedding-unet", "text-attention-mask", "unet-version"])
def test_cli_folder_configs_a_run_cannot_take_exit_2_before_the_work(tmp_path, capsys, monkeypatch, edits, expected):
    """Each of these crashed mid-run (exit 3) or ran on a misread config: now one line, exit 2,
    before any session exists."""
    import shutil

    import onnxopt.pipeline.runner as runner
    from onnxopt.cli import main

    folder = tmp_path / "sd15"
    shutil.copytree(COMMITTED_SD15, folder)
    for relative, keys in edits.items():
        path = folder / relative
        path.write_text(json.dumps({**(json.loads(path.read_text()) if path.is_file() else {}), **keys}))
    monkeypatch.setattr(runner.Pipeline, "load", lambda *a, **k: pytest.fail("sessions made for a refused request"))
    out = tmp_path / "x.png"
    assert main(["generate", str(folder), "--prompt", "a", "--steps", "2", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err and "Traceback" not in err, err
    assert not out.exists()


def test_cli_steps_equal_to_num_train_timesteps_is_refused_before_the_work(tmp_path, capsys, monkeypatch):
    """The check said steps <= num_train_timesteps and then diffusers failed at the last step
    (timestep 1000 of 0..999 with "leading" spacing and steps_offset 1): exit 3 after all the work."""
    import onnxopt.pipeline.runner as runner
    from onnxopt.cli import main

    monkeypatch.setattr(runner.Pipeline, "load", lambda *a, **k: pytest.fail("sessions made for a refused request"))
    for scheduler in ("ddim", "pndm", "dpm++2m"):
        args = ["generate", str(COMMITTED_SD15), "--prompt", "a", "--steps", "1000", "--scheduler", scheduler,
                "-o", str(tmp_path / "x.png")]
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "cannot run 1000 steps" in err, err


@pytest.mark.parametrize("name, fmt", [("cat.JPG", "JPEG"), ("cat.webp", "WEBP")])
def test_cli_writes_the_format_the_suffix_names(tmp_path, name, fmt):
    """-o x.jpg wrote PNG bytes under a .jpg name."""
    from PIL import Image

    from onnxopt.cli import main

    out = tmp_path / name
    assert main(["generate", str(COMMITTED_SD15), "--prompt", "a", "--steps", "1", "--scheduler", "euler",
                 "--height", "32", "--width", "32", "-q", "-o", str(out)]) == 0
    with Image.open(out) as image:
        assert image.format == fmt and image.size == (32, 32)


@pytest.mark.parametrize("name", ["cat.txt", "cat", "cat.onnx"])
def test_cli_refuses_an_image_name_pillow_cannot_write_before_the_work(tmp_path, capsys, monkeypatch, name):
    import onnxopt.pipeline.runner as runner
    from onnxopt.cli import main

    monkeypatch.setattr(runner.Pipeline, "load", lambda *a, **k: pytest.fail("sessions made for a refused request"))
    assert main(["generate", str(COMMITTED_SD15), "--prompt", "a", "-o", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ("unknown image format" in err or "no image suffix" in err)
    assert not list(tmp_path.iterdir())


def test_start_up_says_what_it_does_on_a_terminal_only(monkeypatch, capsys):
    """generate showed nothing for its seconds of start-up (imports, sessions, the step graph built in
    memory), then a progress bar: on a terminal, one status line now says what it is doing and is
    cleared before the bar; off a terminal (a pipe, a log file) nothing is written."""
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    pipe = Pipeline.load(COMMITTED_SD15, "cpu", threads=THREADS)
    pipe("a cat", steps=1, scheduler="euler", height=32, width=32, progress=False)
    said = terminal.getvalue()
    for what in ("importing torch and diffusers", "loading vae_decoder", "preparing the step graph", "loading text_encoder"):
        assert f"\r\x1b[Konnxopt: {what}" in said, said  # a loaded component also names its graph file
    assert said.endswith("\r\x1b[K")  # cleared: what comes next starts on a clean line
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    Pipeline.load(COMMITTED_SD15, "cpu", threads=THREADS)("a cat", steps=1, scheduler="euler", height=32, width=32,
                                                          progress=False)
    assert sys.stderr.getvalue() == ""


@pytest.mark.parametrize("kind, written, sample, expected", [
    ("sd15", "0.8.0", 16, 64), ("sd15", "0.9.0", 16, 16), ("sd15", "0.8.1", 96, 96), ("sd15", None, 16, 16),
    ("sd15", "0.8.0", [16, 24], [16, 24]), ("sd15-controlnet", "0.8.0", 16, 16), ("sdxl", "0.8.0", 16, 16),
])
def test_default_size_is_the_one_the_diffusers_pipeline_computes(built, tmp_path, kind, written, sample, expected):
    """StableDiffusionPipeline.__init__ reads a UNet config written before diffusers 0.9 with
    sample_size under 64 as 64 (SD 1.x's old configs); the ControlNet and SDXL pipelines do not.
    The default size (no --height/--width) follows the same class's rule: diffusers' own pipeline
    is built with that config and its default compared."""
    from diffusers.configuration_utils import FrozenDict

    from onnxopt.pipeline.runner import default_size

    b = built(kind)
    keys = {"sample_size": sample, "_diffusers_version": written}
    folder = copy_folder(b.folder, tmp_path / kind, **{"unet/config.json": keys})
    if written is None:
        path = folder / "unet" / "config.json"
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "_diffusers_version"}))
    unet = b.torch_pipe.unet
    before = unet._internal_dict
    unet._internal_dict = FrozenDict({k: v for k, v in {**before, **keys}.items() if v is not None})
    try:
        pipe = type(b.torch_pipe)(**b.torch_pipe.components)
        size = pipe.unet.config.sample_size
    finally:
        unet._internal_dict = before
    assert size == expected
    factor = pipe.vae_scale_factor
    h, w = (size, size) if isinstance(size, int) else size
    assert default_size(PipelineFolder.open(folder)) == (h * factor, w * factor)


def test_a_batch_gives_each_sdxl_image_alone(built):
    """SDXL's batch (onnxopt.pipeline.batch): the pooled text embeddings and time ids concatenated as
    the hidden states are, the zero negative conditioning of an image without negative prompt beside
    another's encoded one; each image bit for bit its image alone (fp32, CPU EP)."""
    from onnxopt.pipeline.batch import BatchImage, generate_batch

    pipe = built("sdxl").onnx()
    images = [BatchImage(PROMPT, seed=1), BatchImage("a watercolor of a lighthouse", seed=2, negative_prompt=NEGATIVE)]
    settings = dict(steps=2, scheduler="euler", height=HEIGHT, width=WIDTH)
    for image, result in zip(images, generate_batch(pipe, images, **settings)):
        expected = pipe(image.prompt, negative_prompt=image.negative_prompt, seed=image.seed, progress=False, **settings)
        assert result.timings["batch_images"] == 2
        np.testing.assert_array_equal(result.latents, expected.latents)
        np.testing.assert_array_equal(result.pixels, expected.pixels)
