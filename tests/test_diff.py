"""onnxopt diff: metrics on known arrays, verdicts and exit codes on the committed fixtures, --bisect
naming a planted wrong rewrite, and one-line errors where a runtime is missing."""

import json
import math
import sys
import types

import numpy as np
import pytest

from onnxopt import optimize, save_model
from onnxopt.cli import main
from onnxopt.diff import compare_outputs, diff, is_image_like, psnr_db, relative_l2
from onnxopt.errors import MissingDependencyError
from onnxopt.runners import cuda_available
from onnxopt.verify import Tolerance
from tests.conftest import FIXTURES
from tests.test_pass_manager import plugins  # noqa: F401  (fixture)

UNET = FIXTURES / "unet-sd15.tiny.torchscript.static.sdpa.onnx"
UNET_DYNAMIC = FIXTURES / "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx"


def optimized(tmp_path, passes, source=UNET, name="opt.onnx", options=None):
    model, _ = optimize(str(source), passes, options=options)
    path = tmp_path / name
    save_model(model, path)
    return path


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# ------------------------------------------------------------------------------ metrics


def test_metrics_of_a_known_perturbation():
    rng = np.random.default_rng(0)
    image = rng.uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)
    image[0, 0, 0, 0], image[0, 0, 0, 1] = -1.0, 1.0  # dynamic range exactly 2
    features = rng.standard_normal((2, 320, 8, 8)).astype(np.float32)
    delta = 0.01
    (m_image, m_features) = compare_outputs(
        {"image": image, "features": features}, {"image": image + delta, "features": features - delta}, Tolerance(0.02, 0.0)
    )
    assert m_image.max_abs == pytest.approx(delta, rel=1e-3) and m_image.median_abs == pytest.approx(delta, rel=1e-3)
    assert m_image.p99_abs == pytest.approx(delta, rel=1e-3)
    assert m_image.rel_l2 == pytest.approx(delta * math.sqrt(image.size) / np.linalg.norm(image.astype(np.float64)), rel=1e-3)
    assert m_image.psnr_db == pytest.approx(10 * math.log10(2.0**2 / delta**2), abs=0.01)  # 46.02 dB
    assert m_features.psnr_db is None  # 320 channels: not an image
    assert m_image.passed and m_features.passed
    tight = compare_outputs({"image": image}, {"image": image + delta}, Tolerance(1e-3, 1e-3))
    assert not tight[0].passed


def test_relative_error_is_relative_to_the_reference():
    reference, candidate = np.full((4,), 2.0, np.float32), np.full((4,), 3.0, np.float32)
    (m,) = compare_outputs({"y": reference}, {"y": candidate}, Tolerance(0.0, 0.6))
    assert m.max_rel == pytest.approx(0.5) and m.passed  # |3 - 2| / |2|, not / |3|


def test_identical_outputs_and_non_finite_candidates():
    x = np.linspace(-1, 1, 3 * 8 * 8, dtype=np.float32).reshape(1, 3, 8, 8)
    (same,) = compare_outputs({"y": x}, {"y": x.copy()}, Tolerance())
    assert same.passed and same.max_abs == 0 and same.rel_l2 == 0 and same.psnr_db == math.inf
    broken = x.copy()
    broken[0, 1, 2, 3] = np.nan
    (nan,) = compare_outputs({"y": x}, {"y": broken}, Tolerance(1.0, 1.0))
    assert not nan.passed and nan.nonfinite == 1


@pytest.mark.parametrize("shape, image", [
    ((1, 3, 64, 64), True), ((2, 4, 64, 64), True), ((1, 64, 64, 3), True), ((1, 1, 8, 8), True),
    ((2, 320, 8, 8), False), ((2, 4, 4, 4), False), ((2, 77, 768), False), ((1, 3, 64), False),
])
def test_image_like_outputs(shape, image):
    assert is_image_like(shape) is image


def test_relative_l2_and_psnr_edge_cases():
    zeros = np.zeros(4, np.float32)
    assert relative_l2(zeros, zeros) == 0.0 and relative_l2(zeros, zeros + 1) == math.inf
    assert psnr_db(np.array([0.0, 1.0]), np.array([0.0, 1.0])) == math.inf
    assert psnr_db(np.array([0.0, 1.0]), np.array([0.1, 1.1])) == pytest.approx(20.0)


# ------------------------------------------------------------------------------ diff on fixtures


def test_cleanup_model_is_within_tolerance_exit_0(tmp_path, capsys):
    candidate = optimized(tmp_path, ["cleanup"])
    out = tmp_path / "diff.json"
    assert main(["diff", str(UNET), str(candidate), "--runtime", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "within tolerance" in text and "out_sample" in text
    data = json.loads(out.read_text())
    assert data["ok"] is True and data["runtime"] == "cpu"
    (metrics,) = data["outputs"]
    assert metrics["name"] == "out_sample" and metrics["max_abs"] <= 1e-4 and metrics["psnr_db"] is not None


def test_planted_wrong_rewrite_exits_1_and_bisect_names_it(tmp_path, capsys, plugins):  # noqa: F811
    candidate = optimized(tmp_path, ["cleanup", "test-add-to-sub"])
    assert main(["diff", str(UNET), str(candidate)]) == 1
    assert "OUTSIDE tolerance" in capsys.readouterr().out

    out = tmp_path / "bisect.json"
    code = main(["diff", str(UNET), str(candidate), "--bisect", "--passes", "cleanup,test-add-to-sub", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 1
    assert "first pass to break the tolerance: test-add-to-sub" in text
    bisect = json.loads(out.read_text())["bisect"]
    assert bisect["first_broken_pass"] == "test-add-to-sub"
    assert bisect["metrics"] and not bisect["metrics"][0]["passed"]
    verified = [p for p in bisect["report"]["passes"] if p["verification"]]
    assert all(p["verification"]["ok"] for p in verified[:-1]) and verified[-1]["pass"] == "test-add-to-sub"


def test_bisect_of_correct_passes_exits_0(capsys):
    assert main(["diff", str(UNET), "--bisect", "--passes", "cleanup"]) == 0
    assert "every pass stays within tolerance" in capsys.readouterr().out


def test_bisect_is_skipped_when_the_optimized_model_is_within_tolerance(tmp_path):
    report = diff(UNET, optimized(tmp_path, ["cleanup"]), runtime="cpu", bisect=["cleanup"])
    assert report.ok and report.bisect is None and "no bisection needed" in report.notes[0]


def test_fused_ort_cuda_fixture_runs_on_the_reference_runtime(tmp_path, capsys):
    candidate = optimized(tmp_path, ["ort-cuda"], source=UNET_DYNAMIC)
    assert main(["diff", str(UNET_DYNAMIC), str(candidate), "--runtime", "reference", "--dim", "height=16", "--dim", "width=12"]) == 0
    text = capsys.readouterr().out
    assert "onnx.reference" in text and "2x4x16x12" in text and "within tolerance" in text
    if not cuda_available():  # the default runtime for a fused model on a CPU machine
        assert diff(UNET_DYNAMIC, candidate).runtime == "reference"


def test_fp16_candidate_is_compared_in_fp32(tmp_path):
    candidate = optimized(tmp_path, ["cleanup", "fp16"], options={"fp16": {"keep_io_types": False}})
    report = diff(UNET, candidate, runtime="cpu", tolerance=Tolerance(2e-2, 2e-2))
    (m,) = report.outputs
    assert m.dtype == "float16" and report.ok
    assert 0 < m.max_abs < 2e-2 and 0 < m.rel_l2 < 3e-3
    strict = diff(UNET, candidate, runtime="cpu", tolerance=Tolerance(1e-6, 1e-6))
    assert not strict.ok


def test_supplied_inputs(tmp_path, capsys):
    candidate = optimized(tmp_path, ["cleanup"], source=UNET_DYNAMIC)
    rng = np.random.default_rng(1)
    feeds = tmp_path / "in.npz"
    np.savez(feeds, sample=rng.standard_normal((1, 4, 16, 8)).astype(np.float32), timestep=np.array([3.0], np.float32),
             encoder_hidden_states=rng.standard_normal((1, 5, 32)).astype(np.float32))
    report = diff(UNET_DYNAMIC, candidate, runtime="cpu", feeds_path=feeds)
    assert report.ok and report.inputs["sample"] == [1, 4, 16, 8] and report.outputs[0].shape == [1, 4, 16, 8]
    partial = tmp_path / "partial.npz"
    np.savez(partial, sample=np.zeros((1, 4, 8, 8), np.float32))
    assert main(["diff", str(UNET_DYNAMIC), str(candidate), "--inputs", str(partial)]) == 2
    assert "no array for input(s) timestep, encoder_hidden_states" in one_line_error(capsys)


@pytest.mark.parametrize("args, message", [
    (["--bisect"], "--bisect needs --passes"),
    (["--bisect", "--passes", "cleanup,nope"], "unknown pass or preset 'nope'"),
    (["--passes", "cleanup"], "--passes goes with --bisect"),
])
def test_usage_errors_exit_2(args, message, capsys):
    assert main(["diff", str(UNET), *args]) == 2
    assert message in one_line_error(capsys)


def test_cpu_runtime_refuses_ops_without_cpu_kernels(tmp_path, capsys):
    candidate = optimized(tmp_path, ["ort-cuda"])
    assert main(["diff", str(UNET), str(candidate), "--runtime", "cpu"]) == 2
    err = one_line_error(capsys)
    assert "no kernel for com.microsoft.GroupNorm" in err or "no kernel for com.microsoft.BiasAdd" in err
    assert "--runtime reference" in err


# ------------------------------------------------------------------------------ missing runtimes


def trt_module():
    from onnxopt.runners.tensorrt import TENSORRT_MODULE

    return TENSORRT_MODULE


@pytest.mark.skipif(trt_module() is not None, reason="TensorRT (or TensorRT-RTX) is installed here")
def test_trt_runtime_without_tensorrt_names_the_package(tmp_path, capsys):
    candidate = optimized(tmp_path, ["cleanup"])
    assert main(["diff", str(UNET), str(candidate), "--runtime", "trt"]) == 2
    err = one_line_error(capsys)
    assert "pip install" in err and "tensorrt" in err


def test_trt_runtime_passes_on_the_runner_modules_own_error(tmp_path, capsys, monkeypatch):
    """Whatever onnxopt.runners.tensorrt says when tensorrt is missing reaches the user as one line."""
    fake = types.ModuleType("onnxopt.runners.tensorrt")
    calls = []

    def polygraphy_runner(path, *, precision, profiles, timing_cache):
        calls.append((path, precision, profiles, timing_cache))
        raise MissingDependencyError("TensorRT is not installed: pip install tensorrt")

    fake.polygraphy_runner = polygraphy_runner
    monkeypatch.setitem(sys.modules, "onnxopt.runners.tensorrt", fake)
    candidate = optimized(tmp_path, ["cleanup", "fp16"])
    assert main(["diff", str(UNET), str(candidate), "--runtime", "trt"]) == 2
    assert "TensorRT is not installed: pip install tensorrt" in one_line_error(capsys)
    assert calls == [(str(candidate), "fp16", {"sample": (2, 4, 16, 12), "timestep": (2,), "encoder_hidden_states": (2, 77, 32)}, None)]


@pytest.mark.skipif(cuda_available(), reason="this machine has the CUDA EP")
def test_cuda_runtime_without_gpu_names_the_package(tmp_path, capsys):
    candidate = optimized(tmp_path, ["cleanup"])
    assert main(["diff", str(UNET), str(candidate), "--runtime", "cuda"]) == 2
    assert "onnxruntime-gpu" in one_line_error(capsys)
    assert main(["diff", str(UNET), "--bisect", "--passes", "cleanup", "--runtime", "cuda"]) == 2
    assert "onnxruntime-gpu" in one_line_error(capsys)


# ------------------------------------------------------------------------------ the CUDA path, on CPU


class CpuBackedCudaSession:
    """OrtCudaSession's interface over ORT's CPU EP: exercises diff's Polygraphy runner for --runtime cuda."""

    opened = []

    def __init__(self, path, *, cuda_graph=False, prefer_nhwc=False):
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        folder = __import__("pathlib").Path(path).parent
        CpuBackedCudaSession.opened.append((str(path), sorted(p.name for p in folder.glob("candidate*.onnx"))))

    def input_types(self):
        types = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
        return {i.name: np.dtype(types[i.type]) for i in self.session.get_inputs()}

    def bind(self, feeds):
        self.feeds = {n: np.asarray(feeds[n]).astype(t) for n, t in self.input_types().items()}
        self.bound_types = {n: np.asarray(v).dtype for n, v in feeds.items()}

    def run(self):
        names = [o.name for o in self.session.get_outputs()]
        self._out = dict(zip(names, self.session.run(None, self.feeds)))

    def outputs(self):
        return self._out


@pytest.fixture
def cpu_backed_cuda(monkeypatch):
    from onnxopt.runners import ort_cuda

    CpuBackedCudaSession.opened = []
    monkeypatch.setattr(ort_cuda, "OrtCudaSession", CpuBackedCudaSession)
    monkeypatch.setattr(ort_cuda, "_require_cuda", lambda: None)
    monkeypatch.setattr(ort_cuda, "cuda_available", lambda: True)


def test_cuda_runtime_compares_an_fp16_io_model_through_the_session(tmp_path, cpu_backed_cuda):
    candidate = optimized(tmp_path, ["cleanup", "fp16"], options={"fp16": {"keep_io_types": False}})
    report = diff(UNET, candidate, tolerance=Tolerance(2e-2, 2e-2))  # default runtime: cuda, as on a GPU machine
    assert report.runtime == "cuda" and report.ok
    assert report.outputs[0].dtype == "float16" and 0 < report.outputs[0].max_abs < 2e-2
    assert CpuBackedCudaSession.opened[0][0] == str(candidate)


def test_cuda_bisect_keeps_one_candidate_on_disk_and_names_the_pass(tmp_path, cpu_backed_cuda, plugins):  # noqa: F811
    report = diff(UNET, bisect=["cleanup", "test-add-to-sub"], runtime="cuda")
    assert report.bisect.first_broken_pass == "test-add-to-sub" and not report.ok
    assert len(CpuBackedCudaSession.opened) >= 3  # the candidates of cleanup's modifying passes, the broken one, its metrics
    assert all(len(on_disk) <= 1 for _, on_disk in CpuBackedCudaSession.opened)
    assert not report.bisect.metrics[0].passed


def test_bisect_without_a_runtime_runs_each_candidate_where_diff_would_run_it(tmp_path):
    # fuse-attention writes a packed-QKV MultiHeadAttention ORT CPU cannot run: that candidate goes to
    # the reference kernels, as `diff` itself would choose for it; the source and cleanup run on ORT CPU.
    import onnx

    from tests.test_attention_fusion import attention_model

    source = tmp_path / "attention.onnx"
    onnx.save(attention_model(biases=False), source)
    report = diff(source, bisect=["cleanup", "fuse-attention"])
    assert report.ok and report.bisect.first_broken_pass is None
    fused = [step for step in report.bisect.report.passes if step.name == "fuse-attention"]
    assert fused[0].result.sites_rewritten == 1 and fused[0].verification is not None
    assert "onnx.reference for a candidate with ops ORT CPU lacks" in report.table()
