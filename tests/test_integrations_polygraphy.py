"""``polygraphy run SOURCE --onnxrt --onnxopt``: Polygraphy compares an onnxopt-optimized model with
its source, through onnxopt's extension module (the ``polygraphy.run.plugins`` entry point).

The ort-cuda UNet holds com.microsoft fused ops ORT's CPU build lacks: the onnxopt runner runs it
on onnxopt's reference kernels. A planted wrong model must fail the comparison."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import onnx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "onnxopt.integrations.polygraphy_ext:export_argument_groups"


@pytest.fixture(scope="module")
def polygraphy(tmp_path_factory):
    """Run ``polygraphy ARGS`` in a subprocess; returns (exit code, output). Where this checkout is
    not pip-installed (so its entry point is not registered), a stand-in distribution declares it."""
    if shutil.which("polygraphy") is None:
        pytest.skip("the polygraphy command is not on PATH")
    paths = [str(ROOT)]
    registered = [ep for ep in metadata.entry_points(group="polygraphy.run.plugins") if ep.value == PLUGIN]
    if not registered:
        site = tmp_path_factory.mktemp("site")
        dist = site / "onnxopt_polygraphy_plugin-0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: onnxopt-polygraphy-plugin\nVersion: 0\n")
        (dist / "entry_points.txt").write_text(f"[polygraphy.run.plugins]\nonnxopt = {PLUGIN}\n")
        paths.append(str(site))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]))

    def run(*args):
        done = subprocess.run(["polygraphy", *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        return done.returncode, done.stdout + done.stderr

    return run


UNET = ROOT / "models" / "fixtures" / "unet-sd15.tiny.torchscript.static.sdpa.onnx"
README_COMMAND = ("polygraphy run models/fixtures/unet-sd15.tiny.torchscript.static.sdpa.onnx --onnxrt --onnxopt "
                  "--onnxopt-passes ort-cuda --atol 1e-4 --rtol 1e-3")  # the README's, run as written
CLIP = ROOT / "models" / "fixtures" / "clip-text.tiny.torchscript.dynamic.sdpa.onnx"


def test_polygraphy_compares_ort_cuda_graph_with_its_source(polygraphy):
    code, out = polygraphy(*README_COMMAND.split()[1:])
    assert code == 0, out[-3000:]
    assert "onnxrt-runner" in out and "onnxopt[ort-cuda]" in out
    assert "PASSED | simple | All outputs matched" in out


def test_polygraphy_compares_a_saved_optimized_file_and_fails_a_wrong_one(polygraphy, tmp_path):
    optimized = tmp_path / "clip.opt.onnx"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "onnxopt", "optimize", "-i", CLIP, "-o", optimized, "--passes", "ort-cuda"],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    assert any(n.domain == "com.microsoft" for n in onnx.load(str(optimized)).graph.node)
    code, out = polygraphy("run", CLIP, "--onnxrt", "--onnxopt", "--onnxopt-model", optimized, "--atol", "1e-4")
    assert code == 0, out[-3000:]
    assert "PASSED | simple | All outputs matched" in out

    # The same file with one Add turned into a Sub: Polygraphy must see the difference.
    wrong = onnx.load(str(optimized))
    next(n for n in wrong.graph.node if n.op_type == "Add").op_type = "Sub"
    onnx.save(wrong, str(tmp_path / "wrong.onnx"))
    code, out = polygraphy("run", CLIP, "--onnxrt", "--onnxopt", "--onnxopt-model", tmp_path / "wrong.onnx",
                           "--onnxopt-runtime", "reference")
    assert code != 0 and "Difference exceeds tolerance" in out, out[-3000:]


def test_bad_pass_name_is_one_line(polygraphy):
    code, out = polygraphy("run", CLIP, "--onnxrt", "--onnxopt", "--onnxopt-passes", "cleanup,no-such-pass")
    assert code != 0
    assert "[!] onnxopt: unknown pass or preset 'no-such-pass'" in out and "Traceback" not in out
