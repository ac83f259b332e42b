"""upsample-to-skip: a UNet's up-block upsamplers sized by their skip, so the graph runs at any latent size.

The claims:
- ONNX Runtime's nearest Resize (asymmetric, floor) to a size reads torch's F.interpolate(size=...,
  mode="nearest") indices, for every input side up to 1024 and the two sizes an up block asks
  (2n, and 2n - 1 after an odd side);
- on a hand-built upsample -> conv -> skip Concat the rewrite computes torch's
  ``cat([conv(interpolate(x, size=skip)), skip])`` at an odd size, where the source graph fails, and
  the source's result at a multiple size; lookalikes (linear mode, half_pixel coordinates, a factor 3,
  a Resize that meets no skip Concat) are left as they are, the refused ones with their reason;
- on the committed tiny SD 1.5 TorchScript export (dynamic axes) the rewritten graph gives diffusers'
  torch UNet output at an odd latent size (15x13), where the source fails in the up block's Concat,
  and the source's output at a multiple size; it carries the metadata the pipeline reads;
- a TorchScript trace at a non-multiple size (diffusers took its upsample_size branch) already reads the
  skips' sizes: counted as such, the graph marked;
- the dynamo export is refused with its reason (its reshapes carry the traced multiple) and carries no
  metadata; static exports and the VAE decoders are not sites (unchanged, no metadata);
- end to end: ``generate`` on an optimized tiny SD 1.5 folder whose UNet has 4 levels (latent sides
  multiples of 8 without the rewrite) at 40x56 pixels (latents 20x28: sides 10x14 and 5x7 inside, 2 mod
  4 and odd) gives diffusers' image; the unoptimized folder is refused by the CLI
  (exit 2, one line, no image).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import result_of, run_passes
from tests.graphs import make_model

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "models" / "fixtures"
TORCHSCRIPT_UNET = FIXTURES / "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx"
PASS = "upsample-to-skip"


def _session(model):
    import onnxruntime as ort

    data = model if isinstance(model, bytes) else (model.SerializeToString() if isinstance(model, onnx.ModelProto)
                                                   else Path(model).read_bytes())
    options = ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def _proto(model) -> onnx.ModelProto:
    return model.to_onnx()


def test_ort_nearest_resize_to_a_size_reads_torchs_indices():
    torch = pytest.importorskip("torch")
    resize = make_model(
        [helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="nearest",
                          coordinate_transformation_mode="asymmetric", nearest_mode="floor")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, "n", 1]),
         helper.make_tensor_value_info("sizes", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, "m", 1])])
    session = _session(resize)
    for n in range(1, 1025):
        x = np.arange(n, dtype=np.float32).reshape(1, 1, n, 1)
        for m in (2 * n - 1, 2 * n):
            got = session.run(None, {"x": x, "sizes": np.array([1, 1, m, 1], np.int64)})[0]
            expected = torch.nn.functional.interpolate(torch.from_numpy(x), size=(m, 1), mode="nearest").numpy()
            np.testing.assert_array_equal(got, expected, err_msg=f"{n} -> {m}")


def upsample_into_skip(mode="nearest", coordinates="asymmetric", scale=2.0, concat=True) -> onnx.ModelProto:
    """x -> Resize(scales [1, 1, s, s]) -> Conv 3x3 (padding 1) -> Concat(·, skip, axis=1), symbolic sides."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    scales = numpy_helper.from_array(np.array([1, 1, scale, scale], np.float32), "scales")
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["up"], name="upsampler", mode=mode,
                              coordinate_transformation_mode=coordinates, nearest_mode="floor"),
             helper.make_node("Conv", ["up", "w", "b"], ["h" if concat else "out"], name="conv", kernel_shape=[3, 3],
                              pads=[1, 1, 1, 1])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, "h", "w"])]
    if concat:
        nodes.append(helper.make_node("Concat", ["h", "skip"], ["out"], name="skip_concat", axis=1))
        inputs.append(helper.make_tensor_value_info("skip", TensorProto.FLOAT, ["batch", 4, "H", "W"]))
    return make_model(nodes, inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                      [weight, bias, scales])


def _torch_upsample_into_skip(source: onnx.ModelProto, x, skip):
    """diffusers' Upsample2D with upsample_size, then the up block's cat."""
    import torch

    w, b = (torch.from_numpy(numpy_helper.to_array(t).copy()) for t in source.graph.initializer[:2])
    up = torch.nn.functional.interpolate(torch.from_numpy(x), size=skip.shape[2:], mode="nearest")
    return torch.cat([torch.nn.functional.conv2d(up, w, b, padding=1), torch.from_numpy(skip)], dim=1).numpy()


def test_an_upsample_into_a_skip_concat_takes_the_skips_size():
    pytest.importorskip("torch")
    source = upsample_into_skip()
    model, report = run_passes(source, [PASS])
    result = result_of(report, PASS)
    assert (result.sites_matched, result.sites_rewritten, result.refused) == (1, 1, [])
    assert model.metadata_props == {"onnxopt.upsample_to_skip": "1"}
    (resize,) = [n for n in model.graph.nodes if n.op == "Resize"]
    assert resize.inputs[2].name == "" and resize.inputs[3].inputs[0].op == "Concat"
    again, report = run_passes(model.to_onnx(), [PASS])  # what the pass wrote reads as already sized
    assert result_of(report, PASS).details["already_sized"] == 1 and again.metadata_props == model.metadata_props
    before, after = _session(source), _session(_proto(model))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 4, 3)).astype(np.float32)
    for skip_sides in [(8, 6), (7, 5), (8, 5)]:
        skip = rng.standard_normal((2, 4, *skip_sides)).astype(np.float32)
        got = after.run(None, {"x": x, "skip": skip})[0]
        np.testing.assert_allclose(got, _torch_upsample_into_skip(source, x, skip), rtol=1e-5, atol=1e-5)
        if skip_sides == (8, 6):
            np.testing.assert_array_equal(got, before.run(None, {"x": x, "skip": skip})[0])
        else:
            with pytest.raises(Exception, match="Concat"):
                before.run(None, {"x": x, "skip": skip})


@pytest.mark.parametrize("lookalike, reason", [
    (dict(mode="linear"), "mode linear"),
    (dict(coordinates="half_pixel"), "coordinate_transformation_mode half_pixel"),
    (dict(scale=3.0), r"scales \[1.0, 1.0, 3.0, 3.0\]"),
    (dict(concat=False), None),  # a VAE decoder's upsampler: no skip
])
def test_lookalikes_stay_as_they_are(lookalike, reason):
    model, report = run_passes(upsample_into_skip(**lookalike), [PASS])
    result = result_of(report, PASS)
    assert result.sites_rewritten == 0 and "onnxopt.upsample_to_skip" not in model.metadata_props
    assert [n.inputs[2].name for n in model.graph.nodes if n.op == "Resize"] == ["scales"]
    if reason is None:
        assert result.sites_matched == 0
    else:
        (refusal,) = result.refused
        assert re.search(reason, refusal[1]), refusal


def _unet_feeds(height: int, width: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"sample": rng.standard_normal((2, 4, height, width), dtype=np.float32),
            "timestep": np.array([3.0, 700.0], np.float32),
            "encoder_hidden_states": rng.standard_normal((2, 77, 32), dtype=np.float32)}


def test_the_torchscript_unet_runs_at_any_latent_size():
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from models import build

    unet = build("unet-sd15", size="tiny").module
    model, report = run_passes(TORCHSCRIPT_UNET, [PASS])
    assert result_of(report, PASS).sites_rewritten == 1  # the tiny UNet's one upsampler (2 levels)
    assert model.metadata_props["onnxopt.upsample_to_skip"] == "1"
    source, rewritten = _session(TORCHSCRIPT_UNET), _session(_proto(model))
    odd = _unet_feeds(15, 13)
    with torch.no_grad():
        expected = unet(*(torch.from_numpy(odd[k]) for k in ("sample", "timestep", "encoder_hidden_states")))[0]
    np.testing.assert_allclose(rewritten.run(None, odd)[0], expected.numpy(), rtol=1e-4, atol=1e-5)
    with pytest.raises(Exception, match="Concat"):
        source.run(None, odd)
    multiple = _unet_feeds(16, 12)
    np.testing.assert_allclose(rewritten.run(None, multiple)[0], source.run(None, multiple)[0], rtol=0, atol=1e-6)


def test_dynamo_static_and_vae_graphs_are_left_alone():
    (refusal,) = result_of(run_passes(FIXTURES / "unet-sd15.tiny.dynamo.dynamic.sdpa.onnx", [PASS])[1], PASS).refused
    assert "integer division (dynamo's symbolic shapes)" in refusal[1]
    for name in ["unet-sd15.tiny.dynamo.dynamic.sdpa.onnx", "unet-sd15.tiny.torchscript.static.sdpa.onnx",
                 "unet-sd15.tiny.dynamo.static.sdpa.onnx", "vae-decoder.tiny.torchscript.dynamic.sdpa.onnx",
                 "vae-decoder.tiny.dynamo.static.sdpa.onnx"]:
        model, report = run_passes(FIXTURES / name, [PASS])
        assert not result_of(report, PASS).modified and "onnxopt.upsample_to_skip" not in model.metadata_props, name
        static = ".static." in name and name.startswith("unet")
        assert result_of(report, PASS).details["static_upsamplers"] == (1 if static else 0), name


FOUR_LEVELS = dict(block_out_channels=(8, 8, 16, 16),  # a tiny SD 1.5 UNet of SD 1.5's depth: latent multiple 8
                   down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                   up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)


@pytest.mark.models
def test_a_trace_at_another_size_already_reads_the_skips_sizes(tmp_path):
    """Traced at latents 16x12 (12 is not a multiple of 8), diffusers' UNet took its upsample_size branch:
    the TorchScript graph sizes each upsample by its skip already; the pass proves it and marks the graph."""
    pytest.importorskip("diffusers")
    from models import build
    from models.export import export
    from models.unet import UNetWrapper, make_unet

    built = build("unet-sd15", size="tiny")
    built.module = UNetWrapper(make_unet("unet-sd15", "tiny", 0, **FOUR_LEVELS)).eval()
    export(built, tmp_path / "unet.onnx", exporter="torchscript", shapes="dynamic")
    model, report = run_passes(tmp_path / "unet.onnx", [PASS])
    result = result_of(report, PASS)
    assert (result.sites_matched, result.details["already_sized"]) == (0, 3)
    assert model.metadata_props == {"onnxopt.upsample_to_skip": "3"}


# ------------------------------------------------------------------------- end to end: a folder

SEED, STEPS, HEIGHT, WIDTH = 0, 3, 40, 56  # latents 20x28 (VAE factor 2): not multiples of the UNet's 8


@pytest.mark.slow
def test_generate_at_a_size_the_traced_unet_cannot_take(tmp_path, monkeypatch, capsys):
    pytest.importorskip("diffusers")
    import models.pipelines
    from models.unet import make_unet
    from onnxopt.cli import main
    from onnxopt.pipeline import optimize_folder
    from onnxopt.pipeline.runner import generate
    from tests.test_pipeline_generate import Built, assert_same_image

    from models.pipelines import build_torch_pipeline, write_onnx_folder

    built = Built.__new__(Built)  # the tiny SD 1.5 pipeline with a 4-level UNet (latent multiple 8)
    built.kind, built.pipelines, built.folder = "sd15", {}, tmp_path / "sd15-four-levels"
    built.torch_pipe = build_torch_pipeline("sd15", "tiny", SEED)
    built.torch_pipe.register_modules(unet=make_unet("unet-sd15", "tiny", SEED, **FOUR_LEVELS))
    built.torch_pipe.set_progress_bar_config(disable=True)
    # traced at latents 8x16, multiples of 8: the up blocks upsample by a fixed 2 (at the default 8x12 the
    # trace takes diffusers' upsample_size branch and the graph already reads the skips' sizes)
    monkeypatch.setitem(models.pipelines.EXPORT_DIMS["tiny"], "width", 16)
    write_onnx_folder("sd15", built.folder, "tiny", "torchscript", SEED, pipe=built.torch_pipe)

    request = dict(steps=STEPS, height=HEIGHT, width=WIDTH)
    code = main(["generate", str(built.folder), "--prompt", "a cat", "--steps", str(STEPS), "--height", str(HEIGHT),
                 "--width", str(WIDTH), "-o", str(tmp_path / "cat.png"), "-q"])
    stderr = capsys.readouterr().err
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and not (tmp_path / "cat.png").exists(), stderr
    assert "the image is 56x40 pixels: the exported UNet takes latents whose sides are multiples of 8" in stderr

    optimized = tmp_path / "optimized"
    report = optimize_folder(built.folder, optimized, target="tensorrt")  # standard ONNX: the CPU EP runs all
    (unet,) = [p.result for p in report.component("unet").report.passes if p.name == PASS]
    assert unet.sites_rewritten == 3  # the 4-level UNet's three upsamplers
    asked = built.request(**request)
    result = generate(optimized, asked.pop("prompt"), scheduler="euler", progress=False, **asked)
    ref_latents, ref_pixels = built.reference("euler", **request)
    assert_same_image(result.latents, result.pixels, ref_latents, ref_pixels)
