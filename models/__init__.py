"""Builders that export real Stable-Diffusion-class graphs (random weights, seeded).

Registry::

    from models import build, FAMILIES
    bm = build("unet-sd15", size="tiny", attention="sdpa")
    from models.export import export, check_export
    export(bm, "/tmp/unet.onnx", exporter="torchscript", shapes="dynamic")
    print(check_export(bm, "/tmp/unet.onnx", dims=bm.alt_dims))

CLI: ``python -m models build FAMILY ...`` and ``python -m models fixtures``
(see ``models/README.md``).  Importing this package does not import torch;
the builders do.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from .base import ATTENTIONS, SIZES, SITE_KEYS, BuiltModel  # noqa: F401

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
MANIFEST = FIXTURES_DIR / "manifest.json"

# family -> module that builds it
REGISTRY = {
    "unet-sd15": "unet",
    "unet-sd21": "unet",
    "unet-sdxl": "unet",
    "vae-encoder": "vae",
    "vae-decoder": "vae",
    "clip-text": "clip",
    "openclip-text": "clip",
    "controlnet": "controlnet",
}
FAMILIES = tuple(REGISTRY)

# (exporter, shapes, attention processor): what today's exporters write, as tests and coverage cover it
EXPORT_VARIANTS = [
    ("torchscript", "dynamic", "sdpa"),
    ("torchscript", "static", "sdpa"),
    ("dynamo", "dynamic", "sdpa"),
    ("dynamo", "static", "sdpa"),
    ("torchscript", "dynamic", "classic"),
    ("dynamo", "dynamic", "classic"),
]

# (exporter, shapes, attention, opset): the dynamo exporter at the opsets that change what it writes.
# 18: GELU as an Erf chain, GroupNorm as Reshape-InstanceNormalization-Reshape (as at its default, 20,
# but for GELU); 21: GroupNormalization-21 (per-channel) and the Gelu op; 23: SDPA as ONNX Attention;
# 24: the same ops as 23 (Attention-24). Kept out of EXPORT_VARIANTS, over which seven test files
# parametrize: tests/test_new_opsets.py covers these (every family at 23), models/coverage.py all.
OPSET_VARIANTS = [
    ("dynamo", "dynamic", "sdpa", 18),
    ("dynamo", "dynamic", "sdpa", 21),
    ("dynamo", "dynamic", "sdpa", 23),
    ("dynamo", "dynamic", "sdpa", 24),
]


def build(family: str, size: str = "tiny", attention: str = "sdpa", seed: int = 0) -> BuiltModel:
    """Build ``family`` at ``size`` with ``attention`` ("sdpa" or "classic"), seeded."""
    if family not in REGISTRY:
        raise KeyError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    mod = importlib.import_module(f".{REGISTRY[family]}", __name__)
    return mod.build(family, size=size, attention=attention, seed=seed)


def load_manifest() -> dict:
    import json

    return json.loads(MANIFEST.read_text())


def fixture_path(name: str) -> Path:
    """Path of a committed fixture, by file name (``unet-sd15.tiny.torchscript.dynamic.sdpa.onnx``)."""
    return FIXTURES_DIR / name
