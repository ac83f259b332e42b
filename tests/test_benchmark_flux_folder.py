"""The Flux folder benchmarks/pipeline_gpu.py builds in parts gives diffusers' FluxPipeline image.

At full size the folder cannot be exported in one piece (models.flux_pipeline's in-RAM export would hold
the 11.9 B transformer in float32): benchmarks/pipeline_flux.py exports the transformer streamed
(meta-built, dynamo), T5 on its own (models.bigexport), then writes CLIP-L, the VAE and the pipeline
files around them. The claim, on the tiny dev pipeline in fp32 on the ORT CPU EP: onnxopt's image from
that folder equals diffusers' from ``build_flux_pipeline``'s weights (the parts' weights are the same
seeded ones), and model_index.json names every component, those built elsewhere included.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="generating needs torch")
pytest.importorskip("diffusers", reason="generating needs diffusers")
pytest.importorskip("onnxruntime", reason="generating needs onnxruntime")

SEED, STEPS, SIZE, PROMPT = 0, 2, 32, "a photograph of an astronaut riding a horse"


def test_the_small_parts_are_written_with_model_index_naming_the_others(tmp_path):
    from models.flux_pipeline import COMPONENT_CLASSES, build_flux_pipeline, write_flux_onnx_folder

    from benchmarks.pipeline_flux import SMALL_PARTS

    pipe = build_flux_pipeline("flux-schnell", "tiny", SEED, tokenizer_dir=tmp_path / "out",
                               skip=("transformer", "text_encoder_2"))
    assert pipe.transformer is None and pipe.text_encoder_2 is None
    write_flux_onnx_folder("flux-schnell", tmp_path / "out", "tiny", pipe=pipe, names=SMALL_PARTS)
    index = json.loads((tmp_path / "out" / "model_index.json").read_text())
    assert index["transformer"] == COMPONENT_CLASSES["transformer"]
    assert index["text_encoder_2"] == COMPONENT_CLASSES["text_encoder_2"]
    written = {p.parent.name for p in (tmp_path / "out").glob("*/model.onnx")}
    assert written == set(SMALL_PARTS)


@pytest.mark.slow  # the streamed dynamo export of the tiny transformer: ~45 s on two cores
def test_the_folder_built_in_parts_gives_diffusers_image(tmp_path):
    from models.flux_pipeline import build_flux_pipeline
    from onnxopt.pipeline import Pipeline

    from benchmarks.pipeline_flux import STREAMED_PARTS, assemble_folder, export_part, packed_noise

    src = tmp_path / "folder"
    for part in STREAMED_PARTS:
        export_part("flux-dev", part, src, "tiny", "float32", SEED)
    assemble_folder("flux-dev", src, "tiny", SEED)
    assert not (tmp_path / "folder.parts").exists()

    got = Pipeline.load(src, "cpu", threads=1)(PROMPT, steps=STEPS, guidance=3.5, seed=SEED, height=SIZE, width=SIZE,
                                                max_sequence_length=64, progress=False)
    pipe = build_flux_pipeline("flux-dev", "tiny", SEED)
    with torch.no_grad():
        want = pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=3.5, height=SIZE, width=SIZE,
                    latents=packed_noise(pipe, SIZE, SIZE, SEED), max_sequence_length=64, output_type="np").images[0]
    np.testing.assert_allclose(got.pixels, want, atol=1e-5)
