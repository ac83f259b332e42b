"""Model loaders for the Olive recipes in this folder (Olive's ``model_script``), and the import
that registers onnxopt's ``OnnxoptReportEvaluator`` (the evaluator's ``user_script``). The UNets
are the seeded-random-weight SD 1.5 UNets of ``models/``: run ``olive`` from the repository root
so that ``models`` imports."""

import onnxopt.integrations.olive_pass  # noqa: F401  (registers OnnxoptReportEvaluator)


def _unet(size: str):
    from models import build

    return build("unet-sd15", size=size).module.eval()


def load_unet_sd15(model_path=None):
    """The full-size SD 1.5 UNet (860M parameters, 3.4 GB of fp32 weights)."""
    return _unet("full")


def load_unet_sd15_tiny(model_path=None):
    """The tiny SD 1.5-architecture UNet CI runs the recipe on."""
    return _unet("tiny")
