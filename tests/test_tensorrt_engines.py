"""Claims: TensorRT's ONNX parser and builder take what onnxopt writes, on a machine without a GPU.

* Every model family of ``models/`` (both exporters), optimized with ``--passes tensorrt`` or
  ``tensorrt,fp16``, builds a TensorRT-RTX engine for compute capability 8.9 (RTX 40xx, L4, L40S):
  the engine file is written, its inputs and outputs have the ONNX graph's names and types
  (strongly typed: the types onnxopt wrote, float16 where the fp16 pass put it), and the layer
  listing of the engine covers every Softmax, GroupNormalization and LayerNormalization of the graph.
* ``onnxopt build`` writes the same engine and its report (``--report-json``); a failed build
  is one line and leaves nothing behind; the module is chosen once, at import.

CI runs one case per family, each exporter and each pass list covered (about 100 s of building on
a 2-core machine, the tiny SDXL UNet half of it); ``ONNXOPT_TRT_MATRIX=1`` runs every family with
both exporters and both pass lists. Skipped without TensorRT-RTX (``pip install 'onnxopt[trt]'``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from models import FAMILIES
from onnxopt.cli import main
from onnxopt.runners import tensorrt as trt_runner
from onnxopt.saving import save_model
from tests.conftest import FIXTURES, ROOT, run_passes

pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'onnxopt[trt]')")
pytestmark = pytest.mark.skipif(trt_runner.TENSORRT_MODULE != "tensorrt_rtx",
                                reason="these builds are TensorRT-RTX's, for a GPU other than this machine's")

ADA = (8, 9)
TORCHSCRIPT, DYNAMO = ("torchscript", "dynamic", "sdpa"), ("dynamo", "static", "sdpa")
PASS_LISTS = (("tensorrt",), ("tensorrt", "fp16"))
# One case per family; each exporter and each pass list appears. Fixtures where one exists (no
# export), else exports the default test run makes anyway (the session shares them).
CI_CASES = {
    ("unet-sd15", DYNAMO, ("tensorrt", "fp16")),
    ("unet-sd21", TORCHSCRIPT, ("tensorrt",)),
    ("unet-sdxl", TORCHSCRIPT, ("tensorrt", "fp16")),
    ("vae-decoder", TORCHSCRIPT, ("tensorrt",)),
    ("vae-encoder", DYNAMO, ("tensorrt", "fp16")),
    ("clip-text", TORCHSCRIPT, ("tensorrt", "fp16")),
    ("openclip-text", TORCHSCRIPT, ("tensorrt",)),
    ("controlnet", TORCHSCRIPT, ("tensorrt",)),
}
WHOLE_MATRIX = os.environ.get("ONNXOPT_TRT_MATRIX") == "1"


def engine_cases() -> list:
    cases = []
    for family in FAMILIES:
        for variant in (TORCHSCRIPT, DYNAMO):
            for passes in PASS_LISTS:
                ci = (family, variant, passes) in CI_CASES
                marks = [pytest.mark.models] + ([] if ci else [
                    pytest.mark.slow, pytest.mark.skipif(not WHOLE_MATRIX, reason="ONNXOPT_TRT_MATRIX=1 runs the whole matrix")])
                cases.append(pytest.param(family, variant, passes, marks=marks,
                                          id=f"{family}-{variant[0]}-{variant[1]}-{'+'.join(passes)}"))
    return cases


def source_and_shapes(family, variant, export_tiny) -> tuple[Path, dict]:
    """The committed fixture of this export when there is one, else a fresh export; its example input shapes."""
    fixture = FIXTURES / f"{family}.tiny.{'.'.join(variant)}.onnx"
    if fixture.is_file():
        manifest = json.loads((FIXTURES / "manifest.json").read_text())
        entry = next(f for f in manifest["fixtures"] if f["file"] == fixture.name)
        return fixture, {i["name"]: tuple(i["example_shape"]) for i in entry["inputs"]}
    exported = export_tiny(family, *variant)
    return exported.path, {name: tuple(shape) for name, shape in exported.built.input_shapes().items()}


def onnx_io(path: Path) -> list[tuple[str, str, str]]:
    graph = onnx.load(str(path), load_external_data=False).graph
    dtype = lambda t: np.dtype(helper.tensor_dtype_to_np_dtype(t.type.tensor_type.elem_type)).name  # noqa: E731
    return [(t.name, "input", dtype(t)) for t in graph.input] + [(t.name, "output", dtype(t)) for t in graph.output]


def op_count(path: Path, op: str) -> int:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)[op]


@pytest.mark.parametrize("family, variant, passes", engine_cases())
def test_every_family_builds_an_engine_for_compute_capability_8_9(family, variant, passes, export_tiny, tmp_path):
    source, shapes = source_and_shapes(family, variant, export_tiny)
    model, _ = run_passes(source, list(passes))
    optimized = tmp_path / f"{family}.trt.onnx"
    save_model(model, optimized)

    precision = "fp16" if "fp16" in passes else "fp32"  # fp32: the float32 graph exactly as onnxopt wrote it
    info = trt_runner.build_engine(optimized, tmp_path / f"{family}.plan", precision=precision, profiles=shapes,
                                   compute_capabilities=[ADA])

    assert info.engine_path.stat().st_size == info.engine_bytes > 0 and not info.converted
    assert (info.compute_capabilities, info.targeted) == ([ADA], "named")
    assert [(t["name"], t["io"], t["dtype"]) for t in info.io] == onnx_io(optimized)
    if "fp16" in passes:  # the fp16 graph reached TensorRT as float16, inputs and outputs kept float32
        assert any(t["dtype"] == "float32" for t in info.io)
    layers = info.layers
    assert layers["layers"] > 0 and sum(layers["layer_types"].values()) == layers["layers"]
    assert layers["attention"]["softmax_nodes"] == op_count(optimized, "Softmax")
    for op in ("GroupNormalization", "LayerNormalization"):
        assert layers["normalization"].get(op, {}).get("nodes", 0) == op_count(optimized, op), op


# ---------------------------------------------------------------- onnxopt build


@pytest.fixture(scope="module")
def clip_graph(tmp_path_factory):
    """The tiny CLIP text encoder after the tensorrt preset (the fastest engine to build)."""
    model, _ = run_passes(FIXTURES / "clip-text.tiny.torchscript.dynamic.sdpa.onnx", ["tensorrt"])
    path = tmp_path_factory.mktemp("clip") / "clip.trt.onnx"
    save_model(model, path)
    return path


def test_build_cli_writes_the_engine_and_its_report(clip_graph, tmp_path, capsys):
    engine, report, cache = tmp_path / "clip.plan", tmp_path / "build.json", tmp_path / "timing.cache"
    code = main(["build", "-i", str(clip_graph), "-o", str(engine), "--compute-capability", "8.9,8.6",
                 "--profile", "input_ids=1x77:2x77:2x77", "--precision", "fp32", "--timing-cache", str(cache),
                 "--report-json", str(report)])

    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(report.read_text())
    assert data["engine_bytes"] == engine.stat().st_size > 0 and data["compute_capabilities"] == ["8.9", "8.6"]
    assert data["tensorrt"].startswith("TensorRT-RTX") and data["build_seconds"] > 0
    assert not cache.exists() and "TensorRT-RTX has none" in data["notes"][0]  # its timing cache calls are no-ops
    assert [(t["name"], t["dtype"]) for t in data["io"]] == [("input_ids", "int64"), ("last_hidden_state", "float32"),
                                                             ("pooler_output", "float32")]
    assert data["engine_layers"]["layers"] > 0 and data["engine_layers"]["attention"]["softmax_nodes"] == 2
    assert data["profiles"] == [{"input_ids": {"min": [1, 77], "opt": [2, 77], "max": [2, 77]}}]
    assert f"wrote {engine}" in out and "compute capability 8.9 8.6 (named)" in out and "input  input_ids" in out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--compute-capability", "9.0"], "compute capability 9.0: TensorRT-RTX"),
        (["--compute-capability", "8.x"], "'8.x' is not a compute capability like 8.9"),
        (["--compute-capability", "8.9", "--workspace", "0"], "--workspace: expected an integer of 1 or more"),
    ],
    ids=["not a target of TensorRT-RTX", "malformed", "workspace 0"],
)
def test_build_cli_bad_targets_are_one_line_errors(clip_graph, tmp_path, capsys, extra, message):
    assert main(["build", "-i", str(clip_graph), "-o", str(tmp_path / "x.plan"), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "x.plan").exists()


def test_a_graph_tensorrt_cannot_build_is_one_line_with_tensorrts_reason(tmp_path, capsys):
    """A standard op TensorRT's parser has no importer for: TensorRT's own error, in one line, nothing written."""
    node = helper.make_node("Unique", ["x"], ["y"], sorted=1)
    graph = helper.make_graph([node], "unique", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    source = tmp_path / "unique.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), source)

    assert main(["build", "-i", str(source), "-o", str(tmp_path / "u.plan"), "--compute-capability", "8.9",
                 "--precision", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "TensorRT-RTX" in err and "could not build an engine" in err and "Unique" in err
    assert len(err.strip().splitlines()) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["unique.onnx"]


# ---------------------------------------------------------------- the module, chosen once


def chosen_module(tmp_path, env: dict, fake_tensorrt: bool) -> tuple[str, str]:
    """(TENSORRT_MODULE, polygraphy's USE_TENSORRT_RTX) in a fresh interpreter; ``fake_tensorrt``: a
    ``tensorrt`` package on the path (the full TensorRT, as far as finding it goes)."""
    if fake_tensorrt:
        (tmp_path / "tensorrt").mkdir()
        (tmp_path / "tensorrt" / "__init__.py").write_text("")
    code = ("from onnxopt.runners import tensorrt as t; from polygraphy import config; "
            "print(t.TENSORRT_MODULE, config.USE_TENSORRT_RTX)")
    env = {**{k: v for k, v in os.environ.items() if k != "POLYGRAPHY_USE_TENSORRT_RTX"}, **env,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return tuple(out.split())


@pytest.mark.parametrize(
    "env, fake_tensorrt, expected",
    [
        ({}, False, ("tensorrt_rtx", "True")),
        ({}, True, ("tensorrt", "False")),
        ({"POLYGRAPHY_USE_TENSORRT_RTX": "1"}, True, ("tensorrt_rtx", "True")),
    ],
    ids=["TensorRT-RTX alone", "the full TensorRT wins", "Polygraphy's flag asks for TensorRT-RTX"],
)
def test_the_tensorrt_module_is_chosen_once_and_polygraphy_follows(tmp_path, env, fake_tensorrt, expected):
    assert chosen_module(tmp_path, env, fake_tensorrt) == expected


# ---------------------------------------------------------------- optimize FOLDER --build-engines


def test_component_shapes_fill_symbolic_dims_at_the_folders_default_size():
    from onnxopt.runners.folder_engines import component_shapes

    unet = [("sample", ["batch", 4, "height", "width"]), ("timestep", ["batch"]), ("encoder_hidden_states", ["batch", "s", 768])]
    assert component_shapes("unet", unet, 64, 8) == {"sample": (2, 4, 64, 64), "timestep": (2,),
                                                     "encoder_hidden_states": (2, 77, 768)}
    assert component_shapes("vae_encoder", [("sample", ["b", 3, "h", "w"])], 64, 8) == {"sample": (1, 3, 512, 512)}
    assert component_shapes("vae_decoder", [("latent_sample", ["b", 4, "h", "w"])], 96, 8) == {"latent_sample": (1, 4, 96, 96)}
    assert component_shapes("text_encoder", [("input_ids", [1, "sequence"])], 64, 8) == {"input_ids": (1, 77)}


@pytest.fixture
def text_encoder_folder(tmp_path, monkeypatch):
    """A copy of the tiny SD 1.5 pipeline folder whose text encoder alone the CLI optimizes (the Python
    API's ``components``; optimize refuses a folder without the components its pipeline needs): seconds."""
    import functools
    import importlib
    import shutil

    folder = tmp_path / "sd15-text"
    shutil.copytree(ROOT / "models" / "pipelines" / "sd15-tiny", folder)
    module = importlib.import_module("onnxopt.pipeline.optimize_folder")  # the package's attribute is the function
    monkeypatch.setattr(module, "optimize_folder", functools.partial(module.optimize_folder, components=["text_encoder"]))
    return folder


def test_optimize_folder_build_engines_writes_each_components_engine(text_encoder_folder, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["optimize", "-i", str(text_encoder_folder), "-o", str(out), "--target", "tensorrt", "--build-engines",
                 "--compute-capability", "8.9"])

    printed = capsys.readouterr().out
    assert code == 0
    report = json.loads((out / "text_encoder" / "model.plan.json").read_text())
    assert report["engine_bytes"] == (out / "text_encoder" / "model.plan").stat().st_size > 0
    assert report["compute_capabilities"] == ["8.9"] and report["profiles"][0]["input_ids"]["opt"] == [2, 77]
    assert "text_encoder: engine model.plan" in printed and "input_ids=(2, 77)" in printed
    assert not (out / ".trt-timing.cache").exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--target", "ort-cuda", "--build-engines"], "it goes with --target tensorrt"),
        (["--target", "tensorrt", "--compute-capability", "8.9"], "--compute-capability goes with --build-engines"),
        (["--target", "tensorrt", "--build-engines", "--compute-capability", "9.0"], "text_encoder: no engine: compute capability 9.0"),
    ],
    ids=["ort-cuda target", "capability without engines", "a capability TensorRT-RTX does not build for"],
)
def test_build_engines_refusals_are_one_line_and_leave_no_folder(text_encoder_folder, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    assert main(["optimize", "-i", str(text_encoder_folder), "-o", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_build_engines_is_for_a_folder(clip_graph, tmp_path, capsys):
    assert main(["optimize", "-i", str(clip_graph), "-o", str(tmp_path / "c.onnx"), "--build-engines"]) == 2
    assert "onnxopt build -i MODEL -o MODEL.plan" in capsys.readouterr().err


# ---------------------------------------------------------------- generate --provider tensorrt

SD15_TINY = ROOT / "models" / "pipelines" / "sd15-tiny"


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU of the given compute capability, as far as the driver query goes."""
    def install(capability):
        monkeypatch.setattr(trt_runner, "_cuda_driver", lambda: object())
        monkeypatch.setattr(trt_runner, "gpu_compute_capability", lambda device=0: capability)
    return install


def generate(folder, out, capsys) -> tuple[int, str]:
    code = main(["generate", str(folder), "--prompt", "a cat", "--steps", "2", "--provider", "tensorrt", "-q", "-o", str(out)])
    return code, capsys.readouterr().err.strip()


def test_generate_on_a_gpu_tensorrt_rtx_does_not_run_on_names_the_supported_ones_and_ort_cuda(fake_gpu, tmp_path, capsys):
    fake_gpu((9, 0))  # an H100 or H200
    code, err = generate(SD15_TINY, tmp_path / "x.png", capsys)

    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "compute capability 9.0" in err and "8.0 8.6 8.9 12.x" in err
    assert "--target ort-cuda" in err and "--provider cuda" in err and not (tmp_path / "x.png").exists()


def test_generate_on_a_folder_without_engines_says_how_to_build_them(fake_gpu, tmp_path, capsys):
    fake_gpu((8, 9))
    code, err = generate(SD15_TINY, tmp_path / "x.png", capsys)

    assert code == 2 and len(err.splitlines()) == 1 and "no TensorRT engine beside" in err and "--build-engines" in err


@pytest.mark.gpu
def test_generate_runs_the_engines_where_tensorrt_rtx_runs_them_and_refuses_elsewhere(tmp_path, capsys):
    """On this machine's GPU: a compute capability TensorRT-RTX runs engines on generates an image from
    the engines built for it; any other (an H100 or H200: 9.0) exits 2 naming the supported ones."""
    capability = trt_runner.gpu_compute_capability()
    if capability is None:
        pytest.skip("no NVIDIA GPU")
    if not trt_runner.rtx_runs_on(capability):
        code, err = generate(SD15_TINY, tmp_path / "x.png", capsys)
        assert code == 2 and len(err.splitlines()) == 1
        assert f"compute capability {capability[0]}.{capability[1]}" in err and "8.0 8.6 8.9 12.x" in err and "--provider cuda" in err
        return
    out = tmp_path / "sd15-trt"
    assert main(["optimize", "-i", str(SD15_TINY), "-o", str(out), "--target", "tensorrt", "--fp16", "--build-engines", "-q"]) == 0
    code, err = generate(out, tmp_path / "cat.png", capsys)
    assert code == 0, err
    assert (tmp_path / "cat.png").stat().st_size > 0
