"""onnxopt: graph optimizer for diffusion-model ONNX graphs (ORT CUDA EP and TensorRT targets).

    import onnxopt
    model, report = onnxopt.optimize("unet.onnx", ["cleanup"], verify=True)
    print(report.table())
    onnxopt.save_model(model, "unet.opt.onnx")
"""

from onnxopt.api import context_and_denoiser, optimize
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
    "context_and_denoiser",
    "load_model",
    "optimize",
    "register_pass",
    "save_model",
]


def _map_checkout_passes() -> None:
    """``passes/`` ships as ``onnxopt.passes`` (package-dir in pyproject). In a source checkout,
    the passes beside this package are the ones that belong to it, whatever another install maps:
    import them from there (also when the checkout is used without installing, PYTHONPATH=.)."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "passes"
    if "onnxopt.passes" in sys.modules or not (folder / "__init__.py").is_file():
        return
    spec = importlib.util.spec_from_file_location("onnxopt.passes", folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["onnxopt.passes"] = module
    globals()["passes"] = module
    spec.loader.exec_module(module)


_map_checkout_passes()
