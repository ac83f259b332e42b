"""onnxopt: graph optimizer for diffusion-model ONNX graphs (ORT CUDA EP and TensorRT targets).

    import onnxopt
    model, report = onnxopt.optimize("unet.onnx", ["cleanup"], verify=True)
    print(report.table())
    onnxopt.save_model(model, "unet.opt.onnx")
"""

# Imported on first use (PEP 562): ``import onnxopt`` and the command line start in milliseconds,
# so that Ctrl-C while the heavy modules import is already onnxopt's to answer (one line, exit 130).
_EXPORTS = {
    "context_and_denoiser": "onnxopt.api", "optimize": "onnxopt.api", "OnnxoptError": "onnxopt.errors",
    "load_model": "onnxopt.loading", "PassManager": "onnxopt.manager", "Model": "onnxopt.model",
    "Pass": "onnxopt.pass_infra", "PassResult": "onnxopt.pass_infra", "PRESETS": "onnxopt.registry",
    "available_passes": "onnxopt.registry", "register_pass": "onnxopt.registry", "save_model": "onnxopt.saving",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'onnxopt' has no attribute '{name}'")


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
    ``import onnxopt.passes`` finds them there (also when the checkout is used without installing,
    PYTHONPATH=.). Only the finder is installed here: the passes import when the registry asks."""
    import importlib.abc
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "passes"
    if "onnxopt.passes" in sys.modules or not (folder / "__init__.py").is_file():
        return

    class CheckoutPasses(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "onnxopt.passes":
                return None
            return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])

    sys.meta_path.insert(0, CheckoutPasses())


_map_checkout_passes()
