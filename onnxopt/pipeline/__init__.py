"""Whole pipelines: folders of ONNX components optimized together, and image generation from them.

    from onnxopt.pipeline import Pipeline, generate
    pipe = Pipeline.load("models/pipelines/sd15-tiny", provider="cpu")
    result = pipe("a photo of a cat", steps=20, scheduler="ddim", seed=0)   # Result(latents, pixels, timings); .image: PIL
    generate("models/pipelines/sd15-tiny", "a photo of a cat", output="cat.png")

Importing this package needs neither torch nor diffusers; generating does (the ``pipeline`` extra).
"""

from onnxopt.pipeline.folder import PipelineFolder
from onnxopt.pipeline.runner import Pipeline, Result, generate

__all__ = ["Pipeline", "PipelineFolder", "Result", "generate"]

from onnxopt.pipeline.optimize_folder import optimize_folder  # noqa: E402

__all__.append("optimize_folder")
