"""benchmarks/dit_gpu.py's CPU-testable pieces: bfloat16 bound as bfloat16, and the table.

The whole script's --dry-run (export, ORT's optimizer, onnxopt, torch) takes minutes on CI's CPUs;
it is run by hand: ``python -m benchmarks.dit_gpu --family sd35-medium --dry-run --exporter torchscript``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")


def test_a_bfloat16_model_is_bound_and_read_in_bfloat16(tmp_path):
    from benchmarks.dit_gpu import BoundSession

    # bfloat16 and float32 through (ORT's CPU provider has bfloat16 Identity, not Mul): numpy has no
    # bfloat16, so a binding through numpy arrays would hand the session float32 where it wants bfloat16.
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Identity", ["t"], ["u"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 3]),
         helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 3]),
         helper.make_tensor_value_info("u", TensorProto.FLOAT, [2])])
    path = tmp_path / "m.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    session = BoundSession(str(path), "cpu", cuda_graph=False)
    x = np.array([[1.0, 2.0, 0.5], [-1.0, 4.0, 8.0]], np.float32)
    session.bind({"x": x, "t": np.array([1.5, 2.5], np.float32)})
    session.run()
    np.testing.assert_array_equal(session.output(), x)  # exact in bfloat16


def test_the_table_compares_each_row_with_torch_compile_and_lists_the_kernel_families():
    from benchmarks.dit_gpu import table

    kernels = {"busy_ms": 50.0, "families": {"gemm": 30.0, "attention": 15.0, "elementwise": 5.0}}
    results = {
        "reference": {"dims": {"batch": 2}},
        "build:onnxopt-fp16": {"path": "x", "fused": {"fuse-attention": "48/48", "fuse-group-norm": "0/0"}},
        "row:onnxopt-fp16": {"median_ms": 45.0, "rel_l2": 0.01, "max_abs": 0.1, "cuda_graph": True, "kernels": kernels},
        "build:ort": {"error": "RuntimeError: boom"},
        "torch:compile-bf16": {"median_ms": 50.0, "rel_l2": 0.02, "max_abs": 0.2, "compile_s": 65.0, "kernels": kernels},
    }
    text = table("sd35-medium", results, dry=False)
    assert "| onnxopt ort-cuda fp16 | 45.00 | 0.90x | on | 0.01 | 0.1 | attention 48/48 |" in text
    assert "RuntimeError: boom" in text
    assert "| torch.compile(reduce-overhead, fullgraph) bf16 | 50.00 | 1.00x |" in text
    assert "| onnxopt ort-cuda fp16 | 50.00 | 30.00 | 15.00 | 0.00 | 5.00 |" in text


def test_the_sd35_pipeline_table_says_its_settings_and_precision():
    """benchmarks/pipeline_gpu.py's sd35-medium kind: 1024x1024, flow-match 28 steps, guidance 4.5, bf16 on
    every row (its --dry-run, by hand: ``python -m benchmarks.pipeline_gpu --kind sd35-medium --dry-run``)."""
    from benchmarks.pipeline_gpu import table

    row = {"end_to_end_s": 2.0, "cold_start_s": 10.0, "psnr_db": 40.0, "latents_max_abs": 0.05,
           "stages": {"text_encoder_s": 0.02, "step_mean_s": 0.06, "vae_decode_s": 0.1}}
    results = {"torch-eager": dict(row, end_to_end_s=4.0, latents_max_abs=0.1), "torch-compile": row,
               "onnxopt": dict(row, end_to_end_s=1.5, step="transformer/step.onnx", cuda_graph=True, first_step_s=0.5,
                               session_creation_s=3.0)}
    text = table("sd35-medium", results)
    assert text.startswith("### sd35-medium: 1024x1024, flow-match 28 steps, guidance 4.5, bf16")
    assert "| onnxopt ort-cuda bf16 | 1.500 s |" in text
    assert "onnxopt / torch.compile end to end: 0.75x" in text
    assert "onnxopt / torch bf16 deviation from fp32 (final latents max abs): 0.50x" in text
def test_the_lora_swap_benchmark_dry_run_keeps_its_sessions(tmp_path, capsys):
    """benchmarks/lora_swap_gpu.py --dry-run on the committed tiny SD 1.5 folder: every step once, and
    its checks hold (sessions kept across swaps, a swap changes the image, the first scales give the
    first image back)."""
    pytest.importorskip("peft", reason="the benchmark's LoRAs are made with peft")
    from benchmarks.lora_swap_gpu import main

    out = tmp_path / "lora.json"
    assert main(["--kind", "sd15", "--dry-run", "--work", str(tmp_path), "--out", str(out)]) == 0
    result = __import__("json").loads(out.read_text())
    assert result["weights_touched"] > 0 and result["swap_ms"]["runs"] == 3
    assert "| swap median ms |" in capsys.readouterr().out


def test_the_img2img_table_says_the_strength_the_steps_run_and_diffusers_defaults():
    """benchmarks/pipeline_gpu.py's sd15-img2img kind (its --dry-run, by hand: ``python -m
    benchmarks.pipeline_gpu --kind sd15-img2img --dry-run``): 37 of 50 DDIM steps at strength 0.75, where
    diffusers' defaults differ, and the VAE encode stage."""
    from benchmarks.pipeline_gpu import table

    row = {"end_to_end_s": 0.4, "cold_start_s": 10.0, "psnr_db": 40.0, "latents_max_abs": 0.05,
           "stages": {"text_encoder_s": 0.008, "step_mean_s": 0.006, "vae_encode_s": 0.012, "vae_decode_s": 0.03}}
    text = table("sd15-img2img", {"torch-eager": row, "torch-compile": row, "onnxopt": row})
    assert text.startswith("### sd15-img2img: 512x512, ddim 50 steps, guidance 7.5, img2img strength 0.75 (37 steps run), fp16")
    assert "StableDiffusionImg2ImgPipeline defaults: strength 0.8" in text
    assert "| VAE encode | VAE decode |" in text and "| 6.00 ms | 12.0 ms | 30.0 ms |" in text


def test_diffusers_img2img_draws_float32_numbers_cast_to_the_pipeline_dtype():
    """A float16 img2img/inpainting pipeline draws the encoder's sample and the noise as float32 numbers,
    cast, under pipeline_init_image.float32_draws: the stream of the float32 reference, not another one
    (1000 numbers: off torch's vectorised normal kernel, where float16 draws its own)."""
    pytest.importorskip("diffusers")
    from diffusers.models.autoencoders import vae
    from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_img2img as img2img

    from benchmarks.pipeline_init_image import float32_draws

    def draw(module):
        return module.randn_tensor((1000,), generator=torch.Generator().manual_seed(0), dtype=torch.float16)

    want = torch.randn((1000,), generator=torch.Generator().manual_seed(0), dtype=torch.float32).half()
    with float32_draws():
        for module in (img2img, vae):
            assert torch.equal(draw(module), want)
    assert not torch.equal(draw(img2img), want)  # restored: float16's own stream


def test_float32_io_casts_at_the_boundary_of_a_bfloat16_graph(tmp_path):
    """models.bigexport.float32_io: a graph exported in bfloat16 takes and gives float32 (numpy has no
    bfloat16; onnxopt's pipeline feeds float32), Casts at the boundary, its int inputs untouched, the
    values those of the bfloat16 graph."""
    import onnxruntime as ort

    from models.bigexport import float32_io

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["h"]), helper.make_node("Identity", ["h"], ["y"]),
         helper.make_node("Identity", ["ids"], ["ids_out"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [3]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [3]),
         helper.make_tensor_value_info("ids_out", TensorProto.INT64, [2])])
    path = tmp_path / "model.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    assert float32_io(path) == ["x", "y"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.type for i in session.get_inputs()] == ["tensor(float)", "tensor(int64)"]
    y, ids = session.run(None, {"x": np.array([1.0, 1.00390625, 3.0], np.float32), "ids": np.array([4, 5])})
    np.testing.assert_array_equal(y, [1.0, 1.0, 3.0])  # through bfloat16: 1 + 2^-8 rounds to 1
    np.testing.assert_array_equal(ids, [4, 5])
    assert float32_io(path) == []  # nothing left to change


def test_the_norm_rows_benchmark_dry_run_checks_every_variant_against_numpy(tmp_path):
    """benchmarks/norm_rows_gpu.py --dry-run: every QK-norm form and Linear form runs on the CPU EP at
    small shapes and computes what NumPy computes (exit 0), and the JSON holds every row."""
    import json

    from benchmarks.norm_rows_gpu import main

    out = tmp_path / "norm_rows.json"
    assert main(["--dry-run", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["variant"] for r in rows} >= {"simplified-4d", "skip-heads-bias", "rms-23", "gemm2d-bias"}
    assert all(r.get("ok") for r in rows)


def test_the_packed_qkv_benchmark_dry_run_checks_every_form_against_numpy(tmp_path):
    """benchmarks/packed_qkv_gpu.py --dry-run: every attention-input form (separate, merged QKV, merged
    Q|K under one norm with the gammas split, packed by a Concat, packed without norms) runs at tiny
    shapes (ORT's CPU EP through CapturedSession, or the reference kernels for packed QKV) and computes
    what NumPy computes (exit 0); the float16 and bfloat16 models the GPU run builds type-check, every
    weight in their precision (onnx's checker has no schema for ORT's SimplifiedLayerNormalization)."""
    import json

    import onnx

    from benchmarks.packed_qkv_gpu import DRY_SHAPES, FORMS, Weights, form_model, main

    out = tmp_path / "packed_qkv.json"
    assert main(["--dry-run", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["family"], r["form"]) for r in rows} == {(f, form) for f in DRY_SHAPES for form in FORMS}
    assert all(r.get("ok") for r in rows)
    assert {r["runner"] for r in rows} == {"ort-cpu", "onnxopt.reference"}
    shape = DRY_SHAPES["sd35-medium"]
    for dtype in ("float16", "bfloat16"):
        weights = [Weights(np.random.default_rng(0), shape[2] * shape[3], shape[3], dtype) for _ in range(2)]
        for form in FORMS:
            model = form_model(form, shape, weights, dtype)
            assert model.ir_version <= 10
            onnx.shape_inference.infer_shapes(model, check_type=True)
            elem = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}[dtype]
            assert {t.data_type for t in model.graph.initializer} == {elem, onnx.TensorProto.INT64}


def test_the_packed_qkv_benchmark_refuses_an_unknown_form(capsys):
    from benchmarks.packed_qkv_gpu import main

    assert main(["--dry-run", "--forms", "a-separate,z-nothing"]) == 2
    assert "unknown form(s) z-nothing" in capsys.readouterr().err


def test_the_cold_start_benchmark_lists_the_graphs_a_first_image_opens_and_tabulates_them():
    """benchmarks/cold_start.py's pieces (its --dry-run, by hand: ``python -m benchmarks.cold_start --dry-run``):
    the graphs of the committed tiny SD3.5 folder that the load and the first image open, and the table."""
    from benchmarks.cold_start import DRY_FOLDER, planned_graphs, table

    graphs = {(component, model.relative_to(DRY_FOLDER).as_posix()) for component, model, _ in
              planned_graphs(DRY_FOLDER, "cpu", None)}
    assert graphs == {("vae_decoder", "vae_decoder/model.onnx"), ("text_encoder", "text_encoder/model.onnx"),
                      ("text_encoder_2", "text_encoder_2/model.onnx"), ("text_encoder_3", "text_encoder_3/model.onnx")}
    load = {"import_torch_s": 1.0, "import_diffusers_s": 0.5, "import_transformers_s": 0.5, "load_s": 3.0,
            "cold_start_s": 5.0, "first_image": {"total_s": 2.0, "text_encoder_s": 0.5},
            "second_image": {"text_encoder_s": 0.1, "step_mean_s": 0.2, "vae_decode_s": 0.3},
            "image_equal_to_sequential_all": False, "image_max_abs_vs_sequential_all": 2e-6}
    results = {"folder": "f", "provider": "cpu", "steps": 2, "height": 64, "width": 64, "guidance": None,
               "levels": ["all", "extended"],
               "components": [{"component": "unet", "graph": "unet/step.onnx", "bytes": 3.4e9, "levels": {
                   "all": {"create_s": 10.0, "model_loading_s": 0.1, "session_initialization_s": 9.9, "nodes": 900},
                   "extended": {"error": "RuntimeError: boom"}}}],
               "loads": {"4 workers, extended": load, "sequential, all": {"error": "OnnxoptError: x"}}}
    text = table(results)
    assert "| unet | unet/step.onnx | 3400 | 10.00 (0.10 / 9.90), 900 nodes | RuntimeError: boom |" in text
    assert "| 4 workers, extended | 2.00 | 3.00 | 2.00 | 0.50 | 5.00 | 0.100 | 0.200 | 0.300 | max abs 2e-06 |" in text


def test_the_scheduler_step_benchmark_runs_fused_and_host_on_the_cpu(capsys):
    """benchmarks/scheduler_step_gpu.py on the committed tiny SD 1.5 folder (CPU, 2 steps, 64x64):
    PNDM fused (its history step) and on the host, PLMS's one extra step, and the two images close."""
    from pathlib import Path

    from benchmarks.scheduler_step_gpu import main

    folder = Path(__file__).resolve().parents[1] / "models" / "pipelines" / "sd15-tiny"
    assert main([str(folder), "--provider", "cpu", "--steps", "2",
                 "--size", "64", "--schedulers", "pndm"]) == 0
    out = capsys.readouterr().out
    assert "| fused | pndm |" in out and "| unfused (host step) | pndm |" in out and "| 3 |" in out
    close = float(out.split("latents max abs ")[1].split(" ")[0])
    assert close < 1e-4


def test_a_row_timed_before_the_fp32_reference_is_scored_when_it_arrives(tmp_path):
    """benchmarks/pipeline_gpu.py --side onnx: the onnxopt row, timed while the torch side (another GPU)
    has not yet made the float32 reference, keeps its final latents and image; once the reference is
    there (--resume-from), the row gets the scores it would have had, and the pending file goes."""
    from types import SimpleNamespace

    from benchmarks.pipeline_gpu import Bench, settle_pending_quality, slug
    from benchmarks.pipeline_table import quality
    from benchmarks.unet_gpu import Steps

    rng = np.random.default_rng(0)
    latents, image = rng.standard_normal((1, 16, 8, 8)).astype(np.float32), rng.random((8, 8, 3)).astype(np.float32)
    bench = SimpleNamespace(work=tmp_path, row="onnxopt: + hint once per image")
    bench.quality, bench.scored = (lambda *a: Bench.quality(bench, *a)), (lambda *a: Bench.scored(bench, *a))
    steps = Steps(tmp_path, budget=60)
    steps.record("onnxopt: + hint once per image", {"end_to_end_s": 1.0, **bench.quality(latents, image)})
    row = steps.results["onnxopt: + hint once per image"]
    assert row["quality_pending"] == f"pending-{slug(bench.row)}.npz" == "pending-onnxopt-hint-once-per-image.npz"
    assert quality(row).startswith("pending")
    assert settle_pending_quality(bench, steps) == []  # no reference yet: nothing to score

    np.save(tmp_path / "fp32_latents.npy", latents + 0.25)
    np.save(tmp_path / "fp32_image.npy", image)
    assert settle_pending_quality(bench, steps) == ["onnxopt: + hint once per image"]
    row = steps.results["onnxopt: + hint once per image"]
    assert "quality_pending" not in row and row["end_to_end_s"] == 1.0
    assert row["latents_max_abs"] == pytest.approx(0.25) and row["psnr_db"] == float("inf")
    assert not (tmp_path / "pending-onnxopt-hint-once-per-image.npz").exists()
    assert settle_pending_quality(bench, steps) == []  # scored once


def test_two_processes_record_steps_of_one_work_folder_without_dropping_each_other(tmp_path):
    """Flux's T5 export runs beside its transformer's in one --work (benchmarks/pipeline_two_gpus.sh):
    each process holds the results it read at start, and a record must keep what the other wrote since."""
    from benchmarks.unet_gpu import Steps

    first, second = Steps(tmp_path, budget=60), Steps(tmp_path, budget=60)  # both start from nothing
    first.record("folder: text_encoder_2", {"seconds": 1})
    second.record("folder: transformer", {"seconds": 2})
    first.record("folder", {"seconds": 3})
    recorded = json.loads((tmp_path / "results.json").read_text())
    assert recorded == {"folder: text_encoder_2": {"seconds": 1}, "folder: transformer": {"seconds": 2},
                        "folder": {"seconds": 3}}
    assert not [p for p in tmp_path.iterdir() if p.name != "results.json"]  # no partial file left
