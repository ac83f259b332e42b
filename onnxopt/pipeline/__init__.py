"""Whole pipelines: optimize a diffusers/optimum ONNX folder, run it (see the pipeline contract)."""

from onnxopt.pipeline.optimize_folder import optimize_folder  # noqa: F401
