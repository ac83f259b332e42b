"""The ORT CUDA runner and the commands that need it fail with one line naming what to install
(exit 2) where onnxruntime-gpu, ONNX Runtime itself or a GPU is missing, and never show ORT's
multi-line errors or a traceback."""

import sys
import types

import numpy as np
import pytest

from onnxopt.cli import main
from onnxopt.errors import MissingDependencyError, OnnxoptError
from onnxopt import runtime
from onnxopt.runners import ort_cuda
from onnxopt.runners.ort_cuda import OrtCudaSession, cuda_available
from tests.conftest import FIXTURES

UNET = FIXTURES / "unet-sd15.tiny.torchscript.static.sdpa.onnx"
no_cuda = pytest.mark.skipif(cuda_available(), reason="this machine has the CUDA EP")


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@no_cuda
def test_session_without_the_cuda_ep_names_onnxruntime_gpu():
    with pytest.raises(MissingDependencyError, match="install onnxruntime-gpu") as info:
        OrtCudaSession(str(UNET))
    assert "\n" not in str(info.value) and info.value.exit_code == 2


@pytest.fixture
def without_onnxruntime(monkeypatch):
    """As if ONNX Runtime were not installed at all (a None entry makes `import onnxruntime` raise ImportError)."""
    monkeypatch.setitem(sys.modules, "onnxruntime", None)


def test_session_without_onnxruntime_names_both_packages(without_onnxruntime):
    assert not cuda_available()
    with pytest.raises(MissingDependencyError, match=r"ONNX Runtime is not installed: .*onnxruntime-gpu"):
        OrtCudaSession(str(UNET))


@pytest.mark.parametrize("args", [
    ["bench", str(UNET)],
    ["bench", "--ablation", "ort-cuda,fp16", str(UNET)],
    ["diff", str(UNET), str(UNET), "--runtime", "cuda"],
    ["diff", str(UNET), str(UNET), "--runtime", "cpu"],
], ids=["bench", "bench-ablation", "diff-cuda", "diff-cpu"])
def test_commands_without_onnxruntime_exit_2_with_one_line(args, without_onnxruntime, capsys, tmp_path):
    assert main(args) == 2
    assert "ONNX Runtime is not installed" in one_line(capsys)


@no_cuda
def test_bench_ablation_without_cuda_fails_before_building_anything(tmp_path, capsys):
    work = tmp_path / "work"
    assert main(["bench", "--ablation", "ort-cuda,fp16", str(UNET), "--work", str(work)]) == 2
    assert "onnxruntime-gpu" in one_line(capsys)
    assert not work.exists()


class FakeOrt(types.SimpleNamespace):
    """An onnxruntime that lists the CUDA EP, for the failures that happen after that check."""

    def __init__(self, session_error=None, providers=("CUDAExecutionProvider", "CPUExecutionProvider")):
        outer = self

        class SessionOptions:
            log_severity_level = 0
            graph_optimization_level = None

        class InferenceSession:
            def __init__(self, path, options, providers):
                if outer.session_error:
                    raise outer.session_error

            def get_providers(self):
                return list(outer.session_providers)

        super().__init__(SessionOptions=SessionOptions, InferenceSession=InferenceSession,
                         GraphOptimizationLevel=types.SimpleNamespace(ORT_DISABLE_ALL=0, ORT_ENABLE_BASIC=1,
                                                                      ORT_ENABLE_EXTENDED=2, ORT_ENABLE_ALL=99))
        self.session_error, self.session_providers = session_error, providers

    def get_available_providers(self):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def set_default_logger_severity(self, level):  # onnxopt.runtime keeps ORT's own log quiet
        self.logger_severity = level


def test_a_model_the_cuda_ep_cannot_load_is_one_line(monkeypatch):
    error = RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Load model failed\n  at frame 1\n  at frame 2")
    fake = FakeOrt(session_error=error)
    monkeypatch.setattr(ort_cuda, "import_onnxruntime", lambda: fake)
    monkeypatch.setattr(runtime, "import_onnxruntime", lambda: fake)  # sessions are made through onnxopt.runtime
    monkeypatch.setattr(ort_cuda, "_torch_cuda", lambda: None)
    with pytest.raises(OnnxoptError) as info:
        OrtCudaSession(str(UNET))
    message = str(info.value)
    assert message == f"{UNET}: ONNX Runtime CUDA EP cannot load the model: [ONNXRuntimeError] : 1 : FAIL : Load model failed"


def test_a_silent_fallback_to_the_cpu_ep_is_an_error(monkeypatch):
    fake = FakeOrt(providers=("CPUExecutionProvider",))
    monkeypatch.setattr(ort_cuda, "import_onnxruntime", lambda: fake)
    monkeypatch.setattr(runtime, "import_onnxruntime", lambda: fake)  # sessions are made through onnxopt.runtime
    monkeypatch.setattr(ort_cuda, "_torch_cuda", lambda: None)
    with pytest.raises(MissingDependencyError, match="fell back from the CUDA EP"):
        OrtCudaSession(str(UNET))


def test_host_clock_timing_without_torch(monkeypatch):
    """Without torch's CUDA events the session times on the host and says so."""
    session = OrtCudaSession.__new__(OrtCudaSession)
    session.torch, runs = None, []
    session.run = lambda: runs.append(1)
    timing = session.time(warmup=2, runs=5)
    assert timing.clock == "host" and timing.runs == 5 and len(runs) == 7
    assert 0 <= timing.min_ms <= timing.median_ms <= timing.max_ms
    assert np.isfinite(timing.median_ms)
