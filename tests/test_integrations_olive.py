"""onnxopt as an Olive pass.

The recipe in examples/olive/ (dynamo export through Olive's OnnxConversion, then onnxopt, then
onnxopt's fp16, evaluated by OnnxoptReportEvaluator) runs under ``olive run`` on the tiny UNet on
the CPU (``unet_sd15_tiny_cpu.json``: the ``tensorrt`` preset and ``verify`` in place of
``ort-cuda``, whose fused ops ORT's CPU build lacks); Olive's output loads in ORT and computes
what the torch module computes.
The pass itself is also run in-process on a pipeline (Olive's composite model) and on bad input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("olive", reason="needs olive-ai (pip install -e '.[olive]')")
from tests.test_pass_manager import plugins  # noqa: E402,F401  (a planted wrong pass, test-add-to-sub)
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "olive" / "unet_sd15_dynamo.json"  # the GPU recipe: ort-cuda
TINY_RECIPE = ROOT / "examples" / "olive" / "unet_sd15_tiny_cpu.json"  # what the README and CI run
FP16_REL_L2 = 3e-3  # the README's fp16 bound


# Where the CI recipe may differ from the GPU one: the model, the device, the preset and verify.
TINY_CPU_CHANGES = {
    ("input_model", "model_loader"), ("input_model", "io_config", "input_shapes"),
    ("systems", "local_system", "accelerators"), ("evaluators", "onnxopt_report", "metrics"),
    ("passes", "onnxopt", "passes"), ("passes", "onnxopt", "verify"), ("passes", "fp16", "verify"), ("output_dir",),
}


def _differences(a, b, path=()) -> set[tuple]:
    if isinstance(a, dict) and isinstance(b, dict):
        return {d for key in a.keys() | b.keys() for d in _differences(a.get(key), b.get(key), path + (key,))}
    return set() if a == b else {path}


def test_ci_recipe_is_the_example_recipe_on_the_tiny_model_and_the_cpu():
    full, tiny = (json.loads((ROOT / "examples" / "olive" / f).read_text()) for f in (RECIPE.name, TINY_RECIPE.name))
    assert _differences(full, tiny) == TINY_CPU_CHANGES
    assert full["passes"]["onnxopt"]["passes"] == "ort-cuda" and tiny["passes"]["onnxopt"]["passes"] == "tensorrt"
    assert [p["type"] for p in full["passes"].values()] == ["OnnxConversion", "Onnxopt", "Onnxopt"]
    assert full["passes"]["conversion"]["use_dynamo_exporter"] is True


@pytest.mark.models
@pytest.mark.slow  # ~30 s: olive's start-up (6 s) and the dynamo export (7 s) dominate; CI runs it
def test_olive_run_recipe_tiny_unet_on_cpu(tmp_path):
    pytest.importorskip("diffusers")
    import onnxruntime as ort
    import torch

    from models import build

    built = build("unet-sd15", size="tiny")
    recipe = json.loads(TINY_RECIPE.read_text())
    assert recipe["input_model"]["io_config"]["input_shapes"] == [list(s) for s in built.input_shapes().values()]
    recipe["cache_dir"], recipe["output_dir"] = str(tmp_path / "cache"), str(tmp_path / "out")  # not in the checkout
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    # The README's two commands, from the repository root.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OLIVE_DISABLE_TELEMETRY="1")  # no telemetry from CI
    packages = tmp_path / "olive_packages.json"
    subprocess.run([sys.executable, "-m", "onnxopt.integrations.olive_config", str(packages)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=120)
    run = subprocess.run(["olive", "run", "--config", str(tmp_path / "recipe.json"), "--package-config", str(packages)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    out = tmp_path / "out"
    attributes = json.loads((out / "model_config.json").read_text())["config"]["model_attributes"]
    trt_step, fp16_step = attributes["onnxopt_reports"]
    assert trt_step["passes"] == "tensorrt" and trt_step["verified"] and trt_step["max_abs_error"] < 1e-4
    assert trt_step["nodes_after"] < trt_step["nodes_before"]
    assert fp16_step["passes"] == "fp16" and fp16_step["verified"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["onnxopt-verified"]["value"] == 1.0  # the evaluator read onnxopt's report
    assert metrics["onnxopt-nodes_after"]["value"] == fp16_step["nodes_after"]
    assert metrics["latency-avg"]["value"] > 0  # Olive's own metric ran the model in ORT
    assert json.loads((out / "onnxopt_report.json").read_text())["final_verification"]["ok"]

    # Olive's output loads in ORT's CPU EP and computes what the torch module computes.
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = built.make_feeds()
    (got,) = session.run(None, feeds)
    with torch.no_grad():
        expected = built.module(*built.example_inputs)
    expected = (expected[0] if isinstance(expected, (tuple, list)) else expected).numpy()
    rel_l2 = np.linalg.norm(got.astype(np.float64) - expected) / np.linalg.norm(expected)
    assert rel_l2 <= FP16_REL_L2, rel_l2
    assert any(t.data_type == 10 for t in __import__("onnx").load(str(out / "model.onnx")).graph.initializer)  # fp16


def _pass(config: dict):
    from olive.passes.olive_pass import create_pass_from_dict

    from onnxopt.integrations.olive_pass import OnnxoptPass

    return create_pass_from_dict(OnnxoptPass, config, disable_search=True)


def test_pass_runs_on_each_component_of_a_pipeline(tmp_path, fixtures_dir):
    from olive.model import CompositeModelHandler, ONNXModelHandler

    from onnxopt.verify import InputSpec, Verifier
    import onnxopt

    names = {"text_encoder": "clip-text.tiny.torchscript.dynamic.sdpa.onnx",
             "vae_decoder": "vae-decoder.tiny.torchscript.dynamic.sdpa.onnx"}
    pipeline = CompositeModelHandler([ONNXModelHandler(model_path=str(fixtures_dir / f)) for f in names.values()],
                                     list(names))
    result = _pass({"passes": ["cleanup"], "verify": True, "dims": {"height": 8, "width": 8}}).run(
        pipeline, str(tmp_path / "out"))
    assert isinstance(result, CompositeModelHandler)
    for name, component in result.get_model_components():
        source = onnxopt.load_model(fixtures_dir / names[name])
        optimized = onnxopt.load_model(component.model_path)
        assert len(optimized.graph.nodes) < len(source.graph.nodes), name
        (report,) = component.model_attributes["onnxopt_reports"]
        assert report["verified"] and report["nodes_after"] == len(optimized.graph.nodes)
        verifier = Verifier(source, inputs=InputSpec(dims={"height": 8, "width": 8}))
        try:
            assert verifier(optimized).ok, name  # independently of the pass's own verify
        finally:
            verifier.close()


def test_pass_errors_are_one_line(tmp_path, fixtures_dir, plugins):
    from olive.model import ONNXModelHandler

    import onnxopt

    model = ONNXModelHandler(model_path=str(fixtures_dir / "clip-text.tiny.torchscript.dynamic.sdpa.onnx"))
    with pytest.raises(onnxopt.OnnxoptError, match="no-such-pass"):
        _pass({"passes": "cleanup,no-such-pass"}).run(model, str(tmp_path / "a"))
    with pytest.raises(onnxopt.OnnxoptError) as info:
        _pass({"passes": "cleanup,test-add-to-sub", "verify": True}).run(model, str(tmp_path / "b"))
    assert info.value.exit_code == 1 and "verification failed at pass 'test-add-to-sub'" in str(info.value)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "b").exists()  # nothing written


def test_package_config_keeps_olives_passes_and_adds_onnxopt(tmp_path):
    from olive.package_config import OlivePackageConfig

    from onnxopt.integrations.olive_config import main

    path = tmp_path / "packages.json"
    assert main([str(path)]) == 0
    config = OlivePackageConfig.parse_file_or_obj(str(path))
    default = OlivePackageConfig.load_default_config()
    assert set(default.passes) < set(config.passes)  # Olive's own passes are all still there
    assert config.import_pass_module("Onnxopt").__name__ == "OnnxoptPass"
    assert main([]) == 2


@pytest.mark.gpu
@pytest.mark.models
def test_olive_run_gpu_recipe_tiny_unet_on_cuda(tmp_path):
    """The GPU recipe as shipped (ort-cuda, then fp16, on the CUDA EP), on the tiny UNet."""
    from onnxopt.runners import cuda_available

    if not cuda_available():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")
    import onnxruntime as ort
    import torch

    from models import build

    built = build("unet-sd15", size="tiny")
    recipe = json.loads(RECIPE.read_text())
    recipe["input_model"]["model_loader"] = "load_unet_sd15_tiny"
    recipe["input_model"]["io_config"]["input_shapes"] = [list(s) for s in built.input_shapes().values()]
    recipe["cache_dir"], recipe["output_dir"] = str(tmp_path / "cache"), str(tmp_path / "out")
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OLIVE_DISABLE_TELEMETRY="1")  # no telemetry from CI
    subprocess.run([sys.executable, "-m", "onnxopt.integrations.olive_config", str(tmp_path / "p.json")], cwd=ROOT,
                   env=env, check=True, capture_output=True, timeout=120)
    run = subprocess.run(["olive", "run", "--config", str(tmp_path / "recipe.json"), "--package-config",
                          str(tmp_path / "p.json")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "out"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["latency-avg"]["value"] > 0 and metrics["onnxopt-sites_rewritten"]["value"] > 0
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CUDAExecutionProvider"])
    (got,) = session.run(None, built.make_feeds())
    with torch.no_grad():
        expected = built.module(*built.example_inputs)
    expected = (expected[0] if isinstance(expected, (tuple, list)) else expected).numpy()
    assert np.linalg.norm(got.astype(np.float64) - expected) / np.linalg.norm(expected) <= FP16_REL_L2
