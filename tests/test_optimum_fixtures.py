"""The committed optimum-onnx folders (``models/pipelines/*-optimum``) hold the weights their builders
make from the seed: each text encoder computes what the torch module the builder makes computes, on
a prompt its tokenizer writes.

optimum-onnx runs transformers 4, which loads a checkpoint it does not recognize (transformers 5
saves CLIPTextModel without the ``text_model.`` prefix) as a randomly initialized model with only a
warning; such a folder still runs, so nothing else would notice (models/optimum_fixture.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

PIPELINES = Path(__file__).parent.parent / "models" / "pipelines"
PROMPT = "a photo of a red cat"


def _sd15():
    from models.pipelines import build_torch_pipeline

    return build_torch_pipeline("sd15", "tiny", seed=0)


def _flux(kind):
    def build():
        from models.flux_pipeline import build_flux_pipeline

        return build_flux_pipeline(kind, "tiny", seed=0)
    return build


def _sd35():
    from models.sd3 import build_torch_sd3_pipeline

    return build_torch_sd3_pipeline(seed=0)


# folder -> the torch pipeline it was exported from (as its PROVENANCE.txt names it)
BUILDERS = {"sd15-tiny-optimum": _sd15, "flux-dev-tiny-optimum": _flux("flux-dev"),
            "flux-schnell-tiny-optimum": _flux("flux-schnell"), "sd35-tiny-optimum": _sd35}


def test_every_optimum_folder_has_its_builder():
    assert sorted(p.name for p in PIPELINES.glob("*-optimum")) == sorted(BUILDERS)


def text_encoder_mismatches(folder: Path, pipe, atol: float = 1e-4) -> dict[str, float]:
    """``{"text_encoder/last_hidden_state": max |onnx - torch|, ...}`` for every output of every
    ``text_encoder*/model.onnx`` in ``folder`` that differs from ``pipe``'s module by more than ``atol``
    (``hidden_states.i``: the i-th of torch's hidden states)."""
    import onnxruntime as ort
    import torch

    mismatches = {}
    for path in sorted(folder.glob("text_encoder*/model.onnx")):
        name = path.parent.name
        tokenizer = getattr(pipe, name.replace("text_encoder", "tokenizer"))
        length = min(tokenizer.model_max_length, 77)
        ids = tokenizer([PROMPT], padding="max_length", max_length=length, truncation=True, return_tensors="np").input_ids
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        (feed,) = session.get_inputs()
        outputs = session.run(None, {feed.name: ids.astype(np.int32 if feed.type == "tensor(int32)" else np.int64)})
        with torch.no_grad():
            expected = getattr(pipe, name)(torch.from_numpy(ids.astype(np.int64)), output_hidden_states=True)
        for meta, got in zip(session.get_outputs(), outputs):
            key, _, index = meta.name.partition(".")
            want = expected[key][int(index)] if index else expected[key]
            error = float(np.abs(got - want.numpy()).max())
            if not error <= atol:
                mismatches[f"{name}/{meta.name}"] = error
    return mismatches


@pytest.mark.parametrize("folder", sorted(BUILDERS))
def test_the_text_encoders_of_an_optimum_folder_are_its_builders(folder):
    assert text_encoder_mismatches(PIPELINES / folder, BUILDERS[folder]()) == {}
