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
    "unet-lcm": "unet",  # not in FAMILIES: the SD 1.5 UNet's graph with one input more (tests/test_pipeline_lcm.py)
    "vae-encoder": "vae",
    "vae-decoder": "vae",
    "clip-text": "clip",
    "openclip-text": "clip",
    "controlnet": "controlnet",
    "sd3-medium": "dit",
    "sd35-medium": "dit",
    "sd35-large": "dit",
    "flux-dev": "dit",
    "flux-schnell": "dit",
    "t5-xxl": "t5",
    "vae16-encoder": "vae",
    "vae16-decoder": "vae",
}
# The SD-class families (UNet generation): the fusion tests, coverage and graph pins iterate over these.
FAMILIES = ("unet-sd15", "unet-sd21", "unet-sdxl", "vae-encoder", "vae-decoder", "clip-text", "openclip-text",
            "controlnet")
# Diffusion transformers and their encoders (SD3 / SD3.5, Flux.1, T5 v1.1 XXL, the 16-channel VAE).
DIT_FAMILIES = ("sd3-medium", "sd35-medium", "sd35-large", "flux-dev", "flux-schnell", "t5-xxl", "vae16-encoder",
                "vae16-decoder")
# Guidance-distilled UNets (LCM: a timestep_cond input), kept out of the fusion matrices over FAMILIES
GUIDANCE_EMBEDDING_FAMILIES = ("unet-lcm",)
ALL_FAMILIES = FAMILIES + DIT_FAMILIES + GUIDANCE_EMBEDDING_FAMILIES

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


def build(family: str, size: str = "tiny", attention: str = "sdpa", seed: int = 0, **options) -> BuiltModel:
    """Build ``family`` at ``size`` with ``attention`` ("sdpa" or "classic"), seeded.

    ``options`` go to the family's builder (the transformer builders take ``dtype``)."""
    if family not in REGISTRY:
        raise KeyError(f"unknown family {family!r}; known: {', '.join(ALL_FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    mod = importlib.import_module(f".{REGISTRY[family]}", __name__)
    return mod.build(family, size=size, attention=attention, seed=seed, **options)


DIT_FIXTURES_DIR = FIXTURES_DIR / "dit"
DIT_MANIFEST = DIT_FIXTURES_DIR / "manifest.json"


def load_manifest(fixture_set: str = "sd") -> dict:
    """The fixtures' manifest: ``sd`` (models/fixtures) or ``dit`` (models/fixtures/dit)."""
    import json

    return json.loads((DIT_MANIFEST if fixture_set == "dit" else MANIFEST).read_text())


def fixture_path(name: str) -> Path:
    """Path of a committed fixture, by file name (``unet-sd15.tiny.torchscript.dynamic.sdpa.onnx``)."""
    return FIXTURES_DIR / name
