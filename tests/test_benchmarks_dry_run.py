"""benchmarks/dit_gpu.py's CPU-testable pieces: bfloat16 bound as bfloat16, and the table.

The whole script's --dry-run (export, ORT's optimizer, onnxopt, torch) takes minutes on CI's CPUs;
it is run by hand: ``python -m benchmarks.dit_gpu --family sd35-medium --dry-run --exporter torchscript``.
"""

from __future__ import annotations

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
