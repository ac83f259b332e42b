"""Runtimes onnxopt builds and runs its output on (ORT CUDA; TensorRT comes with its own target)."""

from onnxopt.runners.ort_cuda import OrtCudaSession, cuda_available

__all__ = ["OrtCudaSession", "cuda_available"]
