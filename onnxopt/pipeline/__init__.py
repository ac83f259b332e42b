"""Whole pipelines: folders of ONNX components optimized together, and image generation from them."""
