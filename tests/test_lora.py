"""LoRA on an optimized folder: ``onnxopt generate FOLDER --lora FILE[:SCALE]`` gives diffusers' image.

The claims, on the committed tiny SD 1.5 folder (the torch pipeline
``models.pipelines.build_torch_pipeline("sd15", "tiny", 0)``, exported) and that folder optimized
for ``tensorrt`` and for ``ort-cuda`` (fp32):

* a LoRA made with peft on the torch UNet and text encoder (seeded, ``lora_alpha != r``, on the
  attention projections, the GEGLU projection, a 1x1 ``proj_in`` conv and the resnets' 3x3 ``conv1``),
  saved with diffusers' ``save_lora_weights``, gives the image of diffusers' ``load_lora_weights`` +
  ``set_adapters([name], [scale])``; the same LoRA in kohya's format gives the same image; two
  LoRAs at once give diffusers' two adapters' image;
* changing the scale between two images gives each its own diffusers image, with no session
  created again (counted) and the same bound buffers;
* on the ort-cuda folder (fused ops ORT's CPU build lacks), the weights the map says each LoRA
  module lands in -- packed Q/K/V, packed K/V, NHWC and 1x1-as-MatMul conv weights -- make the
  optimized UNet and text encoder compute what the exported ones compute with the same LoRA merged
  (onnxopt's reference kernels against ORT's CPU EP);
* there, an NhwcConv whose weight a LoRA changes (a graph input, which the CUDA EP refuses for
  NhwcConv) runs as Transpose-Conv-Transpose and computes what the optimized UNet with the LoRA
  folded in computes; a LoRA of no conv leaves every NhwcConv as it was;
* kohya's SDXL format (UNet modules by SGM's block names, ``lora_te1_``/``lora_te2_``) on the tiny SDXL
  folder gives the image of diffusers' ``StableDiffusionXLPipeline.load_lora_weights``;
* a file that is not a LoRA of these formats, or a LoRA for another model, is refused with one line
  and exit code 2.

Tolerances are those of tests/test_pipeline_generate.py (fp32 on both sides, kernel rounding only).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="LoRA tests build their LoRA with torch")
pytest.importorskip("diffusers", reason="the reference is diffusers' pipeline")
peft = pytest.importorskip("peft", reason="the LoRA is made with peft, as diffusers trains one")
pytest.importorskip("safetensors", reason="LoRA files are safetensors")

from onnxopt.pipeline import Pipeline, PipelineFolder  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMITTED_SD15 = ROOT / "models" / "pipelines" / "sd15-tiny"
REQUEST = dict(prompt="a photo of a red cat", negative_prompt="blurry", steps=3, guidance=7.5, seed=0, height=32,
               width=48, scheduler="euler")
THREADS = 1
LATENT_RTOL, PIXEL_ATOL = 1e-4, 1e-4
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "conv1"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1"]


def _torch_pipeline():
    from models.pipelines import build_torch_pipeline

    pipe = build_torch_pipeline("sd15", "tiny", 0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    """LoRA a (rank 4, alpha 8) and b (rank 2, alpha 1) of models.lora, and a in kohya's format."""
    from models.lora import write_kohya, write_lora

    root, pipe = tmp_path_factory.mktemp("loras"), _torch_pipeline()
    a = write_lora(pipe, root / "a", 1, UNET_TARGETS, TEXT_TARGETS, rank=4, alpha=8)
    b = write_lora(pipe, root / "b", 2, ["to_k", "to_out.0", "ff.net.2"], ["v_proj", "fc2"], rank=2, alpha=1)
    return {"a": a, "b": b, "a-kohya": write_kohya(a, root / "a_kohya.safetensors")}


@pytest.fixture(scope="module")
def reference(loras):
    """reference({name: scale}[, guidance]) -> (latents, pixels) of diffusers' pipeline with those adapters."""
    import torch

    from onnxopt.pipeline.schedulers import make_scheduler

    pipe = _torch_pipeline()
    own = PipelineFolder.open(COMMITTED_SD15).scheduler_config()
    pipe.scheduler = make_scheduler(REQUEST["scheduler"], dict(type(pipe.scheduler).from_config(own).config))
    for name in ("a", "b"):
        pipe.load_lora_weights(str(loras[name]), adapter_name=name)
    cache = {}

    def run(scales: dict, guidance: float = REQUEST["guidance"]) -> tuple[np.ndarray, np.ndarray]:
        key = (tuple(sorted(scales.items())), guidance)
        if key not in cache:
            pipe.set_adapters(list(scales), list(scales.values()))
            final = {}

            def keep(_pipe, i, _t, kwargs):
                final["latents"] = kwargs["latents"].clone()
                return kwargs

            r = REQUEST
            with torch.no_grad():
                image = pipe(r["prompt"], negative_prompt=r["negative_prompt"], num_inference_steps=r["steps"],
                             guidance_scale=guidance, height=r["height"], width=r["width"], output_type="np",
                             generator=torch.Generator("cpu").manual_seed(r["seed"]), callback_on_step_end=keep).images[0]
            cache[key] = (final["latents"].numpy(), image)
        return cache[key]

    return run


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The committed folder and, made on first use, that folder optimized for a target."""
    from onnxopt.pipeline import optimize_folder

    made = {"source": COMMITTED_SD15}

    def get(target: str) -> Path:
        if target not in made:
            made[target] = tmp_path_factory.mktemp(target) / "sd15"
            # the ort-cuda folder is read for its UNet and text encoder maps only (its fused ops have no CPU kernels)
            light = dict(step_graph=False, static_text=False) if target == "ort-cuda" else {}
            optimize_folder(COMMITTED_SD15, made[target], target=target, **light)
        return made[target]

    return get


def assert_image(result, expected):
    latents, pixels = expected
    np.testing.assert_allclose(result.latents, latents, rtol=0, atol=LATENT_RTOL * float(np.abs(latents).max()))
    np.testing.assert_allclose(result.pixels, pixels, rtol=0, atol=PIXEL_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("target, io_binding", [("source", False), ("tensorrt", True)])
def test_lora_gives_the_diffusers_image(loras, reference, folders, target, io_binding):
    pipe = Pipeline.load(folders(target), "cpu", threads=THREADS, io_binding=io_binding, loras=[f"{loras['a']}:0.7"])
    assert_image(pipe(progress=False, **REQUEST), reference({"a": 0.7}))
    plain = reference({"a": 0.0})  # the LoRA moves the image far beyond the tolerance
    assert np.abs(reference({"a": 0.7})[1] - plain[1]).max() > 100 * PIXEL_ATOL
    # guidance off: the step graph without guidance (made now, from step.onnx or the UNet) takes the LoRA too
    assert_image(pipe(progress=False, **{**REQUEST, "guidance": 1.0}), reference({"a": 0.7}, 1.0))


@pytest.mark.slow
def test_kohya_file_and_two_loras_at_once(loras, reference, folders):
    folder = folders("tensorrt")
    kohya = Pipeline.load(folder, "cpu", threads=THREADS, loras=[(loras["a-kohya"], 0.7)])
    assert_image(kohya(progress=False, **REQUEST), reference({"a": 0.7}))
    both = Pipeline.load(folder, "cpu", threads=THREADS, loras=[f"{loras['a']}:0.7", f"{loras['b']}:-1.5"])
    assert_image(both(progress=False, **REQUEST), reference({"a": 0.7, "b": -1.5}))


@pytest.mark.slow
def test_swapping_the_scale_creates_no_session(loras, reference, folders, monkeypatch):
    """The bound-buffer loop (what the CUDA EP runs, captured there) on CPU buffers: a new scale is
    written into the weight buffers the sessions were bound to; no session is made again, the step
    loop keeps its buffers, and each image is diffusers' at its scale."""
    import onnxopt.pipeline.runner as runner

    made = []
    create = runner.create_session
    monkeypatch.setattr(runner, "create_session", lambda *a, **k: made.append(a[0]) or create(*a, **k))
    pipe = Pipeline.load(folders("tensorrt"), "cpu", threads=THREADS, io_binding=True,
                         loras=[f"{loras['a']}:0.7", f"{loras['b']}:0"])
    assert_image(pipe(progress=False, **REQUEST), reference({"a": 0.7, "b": 0.0}))
    sessions, loops, count = dict(pipe.sessions), dict(pipe._device_loops), len(made)
    for scales in ([0.3, -1.5], [0.7, 0.0]):
        pipe.set_lora_scales(scales)
        assert_image(pipe(progress=False, **REQUEST), reference({"a": scales[0], "b": scales[1]}))
    assert len(made) == count and pipe.sessions == sessions and pipe._device_loops == loops
    assert len(pipe.lora.sessions) >= 3  # text encoder, K/V companion, step graph


def _patched(path: Path, lora_set, component: str):
    """The graph at ``path`` with the weights ``lora_set`` changes replaced by their values."""
    import onnx
    from onnx import numpy_helper

    from onnxopt.weight_provenance import map_path

    proto = onnx.load(str(path))
    targets = lora_set.targets(component, proto, path if map_path(path).is_file() else None, path.parent)
    for i, tensor in enumerate(proto.graph.initializer):
        if tensor.name in targets:
            proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(targets[tensor.name].value(lora_set.scales),
                                                                         tensor.name))
    return proto, targets


@pytest.mark.slow
def test_the_ort_cuda_weight_map_puts_each_delta_in_its_slice(loras, folders):
    import onnxruntime as ort

    from onnxopt.lora import pipeline_loras
    from onnxopt.pipeline.plan import plan_generation
    from onnxopt.pipeline.sessions import input_types
    from onnxopt.reference import run as reference_run

    folder = PipelineFolder.open(folders("ort-cuda"))
    lora_set = pipeline_loras(folder, plan_generation(folder, "cpu"), [f"{loras['a']}:0.8"], "cpu").loras
    rng = np.random.default_rng(0)
    feeds = {"unet": {"sample": rng.standard_normal((2, 4, 8, 8), np.float32), "timestep": np.array([500], np.int64),
                      "encoder_hidden_states": rng.standard_normal((2, 77, 32), np.float32)},
             "text_encoder": {"input_ids": rng.integers(0, 500, (2, 77)).astype(np.int64)}}
    for component, packed in (("unet", "qkv"), ("text_encoder", "Attention")):
        optimized, targets = _patched(folder.root / component / "model.onnx", lora_set, component)
        assert any(packed in name for name in targets)  # the LoRA landed in packed weights
        source, _ = _patched(COMMITTED_SD15 / component / "model.onnx", lora_set, component)
        plain = ort.InferenceSession(str(COMMITTED_SD15 / component / "model.onnx"))
        feed = {name: feeds[component][name].astype(dtype) for name, dtype in input_types(plain).items()}
        expected = ort.InferenceSession(source.SerializeToString()).run(None, feed)[0]
        got = list(reference_run(optimized, feed).values())[0]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
        assert np.abs(plain.run(None, feed)[0] - expected).max() > 1e-2 * np.abs(expected).max()


def _unet_with_lora(folders, loras, names):
    """The ort-cuda UNet (with its weights), its LoRA targets for ``names`` at 0.8, and a seeded feed."""
    import onnx

    from onnxopt.lora import pipeline_loras
    from onnxopt.pipeline.plan import plan_generation

    folder = PipelineFolder.open(folders("ort-cuda"))
    lora_set = pipeline_loras(folder, plan_generation(folder, "cpu"), [f"{loras[n]}:0.8" for n in names], "cpu").loras
    path = folder.root / "unet" / "model.onnx"
    proto = onnx.load(str(path))
    targets = lora_set.targets("unet", proto, path, path.parent)
    rng = np.random.default_rng(0)
    values = {"sample": rng.standard_normal((2, 4, 8, 8)), "timestep": np.array([500]),
              "encoder_hidden_states": rng.standard_normal((2, 77, 32))}
    feed = {i.name: values[i.name].astype(onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
            for i in proto.graph.input}
    return path, proto, targets, lora_set, feed


def _nhwc_convs(proto) -> list:
    return [n for n in proto.graph.node if n.op_type == "NhwcConv"]


@pytest.mark.slow
def test_an_nhwc_conv_the_lora_changes_runs_as_conv_with_the_weight_an_input(loras, folders):
    """The LoRA session's graph of the ort-cuda UNet (conv1 LoRAs: NhwcConv weights as inputs, which
    the CUDA EP refuses) computes, with the weights fed, what the optimized UNet with the LoRA folded
    in computes (reference kernels); only the NhwcConvs whose weight the LoRA changes were rewritten."""
    import onnx

    from onnxopt.lora.session import weights_as_inputs
    from onnxopt.reference import run as reference_run

    path, proto, targets, lora_set, feed = _unet_with_lora(folders, loras, ["a"])
    rewritten = onnx.load_from_string(weights_as_inputs(proto, set(targets)))
    changed = [n for n in _nhwc_convs(proto) if n.input[1] in targets]
    kept = [n for n in _nhwc_convs(proto) if n.input[1] not in targets]
    assert changed and kept  # the LoRA's conv1 weights, and convs it leaves alone
    assert _nhwc_convs(rewritten) == kept
    convs = [n for n in rewritten.graph.node if n.op_type == "Conv"]
    assert len(convs) == len(changed) and {n.input[1] for n in changed} <= {i.name for i in rewritten.graph.input}
    weights = {name: t.value(lora_set.scales) for name, t in targets.items()}
    got = reference_run(rewritten, {**feed, **weights})
    folded, _ = _patched(path, lora_set, "unet")
    expected = reference_run(folded, feed)
    for name, want in expected.items():
        np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow
def test_a_lora_of_no_conv_leaves_every_nhwc_conv_as_it_was(loras, folders):
    from onnx import load_from_string

    from onnxopt.lora.session import weights_as_inputs

    _, proto, targets, _, _ = _unet_with_lora(folders, loras, ["b"])  # to_k, to_out.0, ff.net.2
    assert targets and _nhwc_convs(proto)
    rewritten = load_from_string(weights_as_inputs(proto, set(targets)))
    assert list(rewritten.graph.node) == list(proto.graph.node)


# --- refusals -------------------------------------------------------------------------------------

def _write_safetensors(path: Path, tensors: dict, metadata: dict | None = None) -> Path:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


A = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"


def _bad_files(tmp: Path):
    ok = {f"{A}.lora_A.weight": np.ones((2, 8), np.float32), f"{A}.lora_B.weight": np.ones((8, 2), np.float32)}
    huge = tmp / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    yield huge, "a header of"
    truncated = tmp / "truncated.safetensors"
    truncated.write_bytes(_write_safetensors(tmp / "t.safetensors", ok).read_bytes()[:-8])
    yield truncated, "not a readable safetensors file"
    yield _write_safetensors(tmp / "unknown.safetensors", {**ok, "unet.x.dora_scale": np.ones(8, np.float32)}), "1 of 3 keys"
    yield _write_safetensors(tmp / "nan.safetensors", {**ok, f"{A}.lora_A.weight": np.full((2, 8), np.nan, np.float32)}), "NaN"
    yield _write_safetensors(tmp / "half.safetensors", {f"{A}.lora_A.weight": ok[f"{A}.lora_A.weight"]}), "no up (B)"
    yield _write_safetensors(tmp / "rank.safetensors", {**ok, f"{A}.lora_B.weight": np.ones((8, 3), np.float32)}), "not a LoRA pair"
    yield _write_safetensors(tmp / "shape.safetensors", {f"{A}.lora_A.weight": np.ones((2, 5), np.float32),
                                                          f"{A}.lora_B.weight": np.ones((8, 2), np.float32)}), "does not fit"
    other = {f"unet.no_such_block.to_q.lora_{h}.weight": np.ones((2, 8) if h == "A" else (8, 2), np.float32) for h in "AB"}
    yield _write_safetensors(tmp / "other.safetensors", {**ok, **other}), "1 of 2 LoRA modules match"
    sdxl = {f"lora_unet_input_blocks_4_1_proj_in.lora_{r}.weight": np.ones((2, 8) if r == "down" else (8, 2), np.float32)
            for r in ("down", "up")}
    yield _write_safetensors(tmp / "sdxl_kohya.safetensors", sdxl), "0 of 1 LoRA modules match"
    yield tmp / "missing.safetensors", "cannot read"


def test_a_file_that_is_no_lora_for_this_folder_is_refused_in_one_line(tmp_path):
    from onnxopt.lora import LoraError, pipeline_loras
    from onnxopt.pipeline.plan import plan_generation

    folder = PipelineFolder.open(COMMITTED_SD15)
    plan = plan_generation(folder, "cpu")
    for path, expected in _bad_files(tmp_path):
        with pytest.raises(LoraError) as refused:
            pipeline_loras(folder, plan, [str(path)], "cpu")
        message = str(refused.value)
        assert expected in message and "\n" not in message, (path.name, message)


def test_the_cli_refuses_a_bad_lora_with_exit_2_before_any_image(tmp_path, capsys):
    from onnxopt.cli import main

    bad = _write_safetensors(tmp_path / "nan.safetensors", {f"{A}.lora_A.weight": np.full((2, 8), np.nan, np.float32),
                                                            f"{A}.lora_B.weight": np.ones((8, 2), np.float32)})
    out = tmp_path / "x.png"
    for args, expected in (([f"{bad}:0.5"], "NaN"), ([str(bad), "--provider", "tensorrt"], "TensorRT"),
                           ([str(bad), "-o", str(bad)], "nan.safetensors")):
        code = main(["generate", str(COMMITTED_SD15), "--prompt", "a", "-o", str(out), "--steps", "2", "--lora", *args])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
        assert not out.exists() and bad.stat().st_size > 0  # -o may not be the LoRA it reads


@pytest.mark.slow
def test_an_sdxl_kohya_file_with_sgm_block_names_gives_the_diffusers_image(tmp_path):
    """kohya's SDXL LoRA (lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q..., middle_block_1,
    output_blocks; lora_te1_ and lora_te2_): on the tiny SDXL folder, the image of diffusers'
    StableDiffusionXLPipeline.load_lora_weights + set_adapters at scale 0.8."""
    import torch

    from models.lora import write_kohya_sdxl
    from models.pipelines import build_torch_pipeline, write_onnx_folder

    torch_pipe = build_torch_pipeline("sdxl", "tiny", 0)
    torch_pipe.set_progress_bar_config(disable=True)
    write_onnx_folder("sdxl", tmp_path / "sdxl", "tiny", "torchscript", 0, pipe=torch_pipe)
    kohya = write_kohya_sdxl(torch_pipe, tmp_path / "sdxl_kohya.safetensors", 3, rank=4, alpha=2)
    keys = set(__import__("safetensors.numpy", fromlist=["load_file"]).load_file(str(kohya)))
    for block in ("lora_unet_input_blocks_", "lora_unet_middle_block_1_", "lora_unet_output_blocks_"):
        assert any(k.startswith(block) for k in keys), block
    assert any(k.startswith("lora_te1_") for k in keys) and any(k.startswith("lora_te2_") for k in keys)
    request = dict(REQUEST, height=64, width=64)
    pipe = Pipeline.load(tmp_path / "sdxl", "cpu", threads=THREADS, loras=[f"{kohya}:0.8"])
    result = pipe(progress=False, **request)
    from onnxopt.pipeline.schedulers import make_scheduler

    own = PipelineFolder.open(tmp_path / "sdxl").scheduler_config()
    torch_pipe.scheduler = make_scheduler("euler", dict(type(torch_pipe.scheduler).from_config(own).config))
    plain = torch_pipe(request["prompt"], negative_prompt=request["negative_prompt"], num_inference_steps=request["steps"],
                       guidance_scale=request["guidance"], height=64, width=64, output_type="np",
                       generator=torch.Generator("cpu").manual_seed(0)).images[0]
    torch_pipe.load_lora_weights(str(kohya), adapter_name="kohya")
    torch_pipe.set_adapters(["kohya"], [0.8])
    final = {}

    def keep(_pipe, i, _t, kwargs):
        final["latents"] = kwargs["latents"].clone()
        return kwargs

    with torch.no_grad():
        image = torch_pipe(request["prompt"], negative_prompt=request["negative_prompt"], num_inference_steps=request["steps"],
                           guidance_scale=request["guidance"], height=64, width=64, output_type="np",
                           generator=torch.Generator("cpu").manual_seed(0), callback_on_step_end=keep).images[0]
    assert_image(result, (final["latents"].numpy(), image))
    assert np.abs(image - plain).max() > 100 * PIXEL_ATOL  # the LoRA moved the image


@pytest.mark.parametrize("module, expected", [
    # diffusers' converter places block 99 in down block 49, which the UNet lacks
    ("input_blocks_99_1_transformer_blocks_0_attn1_to_q",
     "0 of 1 LoRA modules match a weight of this pipeline; no unet weight of the pipeline is "
     "'down_blocks.49.attentions.0.transformer_blocks.0.attn1.to_q'"),
    # a middle block SGM's UNet has not (0, 1, 2 only): diffusers' converter refuses it
    ("middle_block_7_transformer_blocks_0_attn1_to_q", "its SGM block names do not map to diffusers' UNet"),
])
def test_a_kohya_sgm_module_that_maps_nowhere_exits_2_in_one_line(tmp_path, capsys, module, expected):
    from onnxopt.cli import main

    bad = _write_safetensors(tmp_path / "far.safetensors", {
        f"lora_unet_{module}.lora_{r}.weight": np.ones((2, 8) if r == "down" else (8, 2), np.float32)
        for r in ("down", "up")})
    out = tmp_path / "x.png"
    code = main(["generate", str(COMMITTED_SD15), "--prompt", "a", "-o", str(out), "--steps", "2", "--lora", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert not out.exists()


@pytest.mark.parametrize("text, expected", [("a.safetensors", ("a.safetensors", 1.0)), ("a.safetensors:0.5", ("a.safetensors", 0.5)),
                                            ("C:/x:y/a.safetensors:-1e-1", ("C:/x:y/a.safetensors", -0.1)),
                                            ("dir:v2/a.safetensors", ("dir:v2/a.safetensors", 1.0))])
def test_the_scale_comes_after_the_last_colon(text, expected):
    from onnxopt.lora import parse_lora_argument

    path, scale = parse_lora_argument(text)
    assert (str(path), scale) == expected


@pytest.mark.gpu
def test_captured_step_replays_with_the_swapped_weights(loras, tmp_path):
    """On a GPU (``pytest -m gpu``): the ort-cuda folder with CUDA graphs; after a scale swap the
    replayed graphs read the new weights (the image of a pipeline loaded at that scale without
    capture, within the fused fp32 kernels' run-to-run spread) and no session is made again."""
    from onnxopt.runners import cuda_available

    if not cuda_available():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")
    from onnxopt.pipeline import optimize_folder

    folder = tmp_path / "ort-cuda"
    optimize_folder(COMMITTED_SD15, folder, target="ort-cuda")
    spec = [f"{loras['a']}:0.7", f"{loras['b']}:0"]
    captured = Pipeline.load(folder, "cuda", cuda_graph=True, loras=spec)
    first = captured(progress=False, **REQUEST)
    sessions = dict(captured.sessions)
    for scales in ([0.2, -1.5], [0.7, 0.0]):
        captured.set_lora_scales(scales)
        got = captured(progress=False, **REQUEST)
        expected = Pipeline.load(folder, "cuda", cuda_graph=False,
                                 loras=[f"{loras['a']}:{scales[0]}", f"{loras['b']}:{scales[1]}"])(progress=False, **REQUEST)
        scale = float(np.abs(expected.latents).max())
        np.testing.assert_allclose(got.latents, expected.latents, rtol=0, atol=3e-3 * scale)
    assert captured.cuda_graph and captured.sessions == sessions
    assert np.abs(got.latents - first.latents).max() <= 3e-3 * float(np.abs(first.latents).max())
