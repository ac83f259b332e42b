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



@pytest.mark.parametrize("architecture, renamed", [
    ("CLIPTextModel", {"embeddings.token_embedding.weight": "text_model.embeddings.token_embedding.weight",
                       "text_model.final_layer_norm.weight": "text_model.final_layer_norm.weight"}),
    # its projection sits beside text_model in both transformers versions: prefixing it would lose it
    ("CLIPTextModelWithProjection", {"text_model.final_layer_norm.weight": "text_model.final_layer_norm.weight",
                                     "text_projection.weight": "text_projection.weight"}),
    ("T5EncoderModel", {"shared.weight": "shared.weight",
                        "encoder.final_layer_norm.weight": "encoder.final_layer_norm.weight"}),
])
def test_only_clip_text_model_weights_are_saved_again_with_the_text_model_prefix(tmp_path, architecture, renamed):
    import json

    from safetensors.numpy import load_file, save_file

    from models.optimum_fixture import clip_keys_for_transformers_4

    encoder = tmp_path / "text_encoder_2"
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    weights = {key: np.full(2, i, np.float32) for i, key in enumerate(renamed)}
    save_file(weights, str(encoder / "model.safetensors"))

    clip_keys_for_transformers_4(tmp_path)

    saved = load_file(str(encoder / "model.safetensors"))
    assert sorted(saved) == sorted(renamed.values())
    assert all((saved[renamed[key]] == value).all() for key, value in weights.items())
