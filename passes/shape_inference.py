"""infer-shapes: annotate every tensor with the dtype and shape ONNX shape inference derives."""

from __future__ import annotations

from onnxopt.model import Model
from onnxopt.pass_infra import EVERY_PROPERTY, SHAPES_INFERRED, Pass, PassResult
from onnxopt.registry import register_pass
from onnxopt.shapes import infer_shapes


@register_pass
class InferShapes(Pass):
    name = "infer-shapes"
    description = "annotate tensors with inferred dtypes and shapes (2 GB-safe: runs on the weight-free skeleton)"
    provides = frozenset({SHAPES_INFERRED})
    preserves = EVERY_PROPERTY  # annotations change no computation

    def run(self, model: Model) -> PassResult:
        gained = infer_shapes(model)
        # Modified only when an annotation really changed: the cleanup fixpoint stops on it.
        return PassResult(modified=gained > 0, sites_matched=gained, sites_rewritten=gained)
