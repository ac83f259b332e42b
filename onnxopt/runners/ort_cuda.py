"""ONNX Runtime on the CUDA EP, the way a diffusion pipeline runs it.

* IO binding on device buffers: inputs are copied to the GPU once, outputs are preallocated there,
  so a timed run moves no data across PCIe.
* CUDA graphs (``cuda_graph=True``): ORT captures the first run and replays it; this needs the
  fixed buffers of IO binding (both: :class:`~onnxopt.runners.captured_session.CapturedSession`).
* ``prefer_nhwc``: the CUDA EP's own channels-last layout for standard Convs.
* When torch with CUDA is importable, ORT runs on torch's current stream (``user_compute_stream``)
  so that CUDA events recorded on that stream time exactly ORT's work; without torch, runs are
  timed on the host around a synchronous run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from onnxopt.errors import MissingDependencyError, OnnxoptError
from onnxopt.runners.captured_session import CapturedSession
from onnxopt.runtime import (
    as_type,
    graph_optimization_level as optimization_level,
    host_array,
    import_onnxruntime,
    inference_session,
    input_dtype,
    session_options,
)


def gpu_memory_used_mb(device_id: int = 0) -> float | None:
    """Device memory in use (all processes), from NVML; None without pynvml."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(device_id)).used / 2**20
    finally:
        pynvml.nvmlShutdown()


def cuda_available() -> bool:
    try:
        ort = import_onnxruntime()
    except MissingDependencyError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


def _require_cuda():
    ort = import_onnxruntime()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise MissingDependencyError(
            "ONNX Runtime's CUDA execution provider is not available: install onnxruntime-gpu "
            "(pip install 'onnxopt[gpu]') on a machine with an NVIDIA GPU"
        )
    return ort


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    runs: int
    clock: str  # "cuda-events" or "host"


class OrtCudaSession:
    """One model on the CUDA EP with IO binding (and optionally CUDA graphs)."""

    def __init__(self, path: str, *, cuda_graph: bool = False, prefer_nhwc: bool = False, device_id: int = 0,
                 graph_optimization_level: str = "all", log_severity: int | None = None, provider_options: dict | None = None):
        ort = _require_cuda()
        self.ort = ort
        self.device_id = device_id
        self.cuda_graph = cuda_graph
        self.torch = _torch_cuda()
        options = {"device_id": str(device_id), "enable_cuda_graph": "1" if cuda_graph else "0",
                   "prefer_nhwc": "1" if prefer_nhwc else "0"}
        options.update({k: str(v) for k, v in (provider_options or {}).items()})  # e.g. sdpa_kernel
        if self.torch is not None:
            self.torch.cuda.set_device(device_id)
            options["user_compute_stream"] = str(self.torch.cuda.current_stream().cuda_stream)
        so = session_options(ort)
        if log_severity is not None:
            so.log_severity_level = log_severity
        so.graph_optimization_level = optimization_level(ort, graph_optimization_level)
        try:
            self.session = inference_session(path, [("CUDAExecutionProvider", options)], so)
        except Exception as exc:  # ORT raises its own exception types with long messages
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise OnnxoptError(f"{path}: ONNX Runtime CUDA EP cannot load the model: {first}") from exc
        if self.session.get_providers()[0] != "CUDAExecutionProvider":
            raise MissingDependencyError("ONNX Runtime fell back from the CUDA EP: check the CUDA/cuDNN installation")
        self.path = str(path)
        self.captured = CapturedSession(ort, self.session, device="cuda", device_id=device_id, cuda_graph=cuda_graph)
        self.bound = None

    def input_types(self) -> dict[str, np.dtype]:
        return {i.name: input_dtype(i, self.path) for i in self.session.get_inputs()}

    def bind(self, feeds: dict[str, np.ndarray]) -> None:
        """Copy ``feeds`` to the GPU (cast to the model's input types) and preallocate the outputs:
        fixed device buffers of the shapes one uncaptured run gives (a CUDA graph replays the
        addresses it captured), on a graph id never used before (a new binding captures anew)."""
        types = self.input_types()
        inputs = {name: as_type(feeds[name], dtype) for name, dtype in types.items()}
        self.bound = self.captured.bind(inputs, graph_id=self.captured.graph_ids(1)[0])

    def run(self) -> None:
        self.bound.run()

    def outputs(self) -> dict[str, np.ndarray]:
        return {name: host_array(self.captured.ort, value) for name, value in self.bound.outputs.items()}

    def time(self, warmup: int = 10, runs: int = 40) -> Timing:
        for _ in range(warmup):
            self.run()
        samples = []
        if self.torch is not None:
            torch = self.torch
            torch.cuda.synchronize()
            for _ in range(runs):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.run()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            clock = "cuda-events"
        else:
            for _ in range(runs):
                t0 = time.perf_counter()
                self.run()
                samples.append((time.perf_counter() - t0) * 1000)
            clock = "host"
        return Timing(float(np.median(samples)), float(np.min(samples)), float(np.max(samples)), runs, clock)
