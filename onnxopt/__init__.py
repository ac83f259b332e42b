"""onnxopt: graph optimizer for diffusion-model ONNX graphs (ORT CUDA EP and TensorRT targets).

    import onnxopt
    model, report = onnxopt.optimize("unet.onnx", ["cleanup"], verify=True)
    print(report.table())
    onnxopt.save_model(model, "unet.opt.onnx")
"""

from onnxopt.api import optimize
from onnxopt.errors import OnnxoptError
from onnxopt.loading import load_model
from onnxopt.manager import PassManager
from onnxopt.model import Model
from onnxopt.pass_infra import Pass, PassResult
from onnxopt.registry import PRESETS, available_passes, register_pass
from onnxopt.saving import save_model

__version__ = "0.1.0"

__all__ = [
    "Model",
    "OnnxoptError",
    "PRESETS",
    "Pass",
    "PassManager",
    "PassResult",
    "available_passes",
    "load_model",
    "optimize",
    "register_pass",
    "save_model",
]
