"""The SDXL refiner: text_encoder_2 alone and aesthetic-score conditioning, img2img as diffusers runs it.

The claim: a tiny folder of stabilityai/stable-diffusion-xl-refiner-1.0's layout (model_index.json
``StableDiffusionXLImg2ImgPipeline`` with ``requires_aesthetics_score`` and no text_encoder; its UNet
takes 5 time ids: original size, crop, aesthetic score) is recognized as a refiner, and with an init
image gives StableDiffusionXLImg2ImgPipeline's latents and images (fp32, CPU EP, tolerances of
test_pipeline_img2img), fused and unfused, with the folder's scheduler and euler-a. The time ids'
last column is the aesthetic score (2.5 for the negative row, 6.0 for the prompt's): a run with the
target size there instead is far off. A refiner folder without the aesthetic switch is refused in
one line before any work (diffusers fails mid-call on it).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch", reason="generating needs torch (pip install -e '.[models]')")
pytest.importorskip("diffusers", reason="generating needs diffusers")
pytest.importorskip("onnxruntime", reason="generating needs onnxruntime")

from onnxopt.pipeline import Pipeline, PipelineFolder  # noqa: E402
from onnxopt.pipeline.plan import GenerationError  # noqa: E402
from tests.test_pipeline_img2img import LATENT_RTOL, Folder, assert_same, picture  # noqa: E402

KIND = "sdxl-refiner"
REFINER_CLASS = "StableDiffusionXLImg2ImgPipeline"


class Refiner(Folder):
    def diffusers(self, cls_name: str, scheduler: str | None):
        """As from_pretrained makes it: model_index.json's switches registered (the components alone
        would leave requires_aesthetics_score at its default, False)."""
        pipe = super().diffusers(cls_name, scheduler)
        index = json.loads((self.folder / "model_index.json").read_text())
        pipe.register_to_config(**{k: index[k] for k in ("requires_aesthetics_score", "force_zeros_for_empty_prompt")})
        return pipe


@pytest.fixture(scope="module")
def refiner(tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Refiner(KIND, tmp_path_factory.mktemp("refiner"))
    torch.set_num_threads(threads)


def test_the_folder_is_a_refiner(refiner):
    folder = PipelineFolder.open(refiner.folder)
    assert folder.kind == "sdxl" and folder.refiner and folder.requires_aesthetics_score
    assert folder.text_encoders == ("text_encoder_2",) and not (refiner.folder / "text_encoder").exists()
    plan = Pipeline.load(refiner.folder, "cpu", threads=1).plan
    assert plan.components == ["text_encoder_2", "unet", "vae_decoder"]


@pytest.mark.parametrize("scheduler, fused", [(None, True), (None, False), ("euler-a", True)])
def test_refiner_gives_the_diffusers_images(refiner, scheduler, fused):
    result = refiner.onnx(fused)(prompt="a photo of a red cat", negative_prompt="blurry", steps=5, guidance=7.5,
                                 scheduler=scheduler, image=picture(), strength=0.6, progress=False)
    ref_latents, ref_images = refiner.reference(REFINER_CLASS, scheduler, image=picture(), strength=0.6)
    assert_same(result, ref_latents, ref_images)
    assert result.timings["step"].startswith("unfused") != fused


def test_the_aesthetic_score_is_read(refiner, monkeypatch):
    from onnxopt.pipeline import runner

    ref_latents, _ = refiner.reference(REFINER_CLASS, None, image=picture(), strength=0.6)
    monkeypatch.setattr(runner, "sdxl_time_ids", lambda folder, h, w: np.asarray([[h, w, 0, 0, h]] * 2, np.float32))
    result = refiner.onnx()(prompt="a photo of a red cat", negative_prompt="blurry", steps=5, guidance=7.5,
                            image=picture(), strength=0.6, progress=False)
    assert np.abs(result.latents - ref_latents).max() > 100 * LATENT_RTOL * np.abs(ref_latents).max()


def test_a_refiner_without_the_aesthetic_switch_is_refused(refiner, tmp_path):
    """Its UNet takes 5 time ids; without requires_aesthetics_score the pipeline would make 6."""
    from models.pipelines import copy_folder

    folder = tmp_path / "no-score"
    copy_folder(refiner.folder, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index.pop("requires_aesthetics_score")
    (folder / "model_index.json").write_text(json.dumps(index))
    pipe = Pipeline.load(folder, "cpu", threads=1)
    with pytest.raises(GenerationError) as caught:
        pipe("a cat", steps=2, image=picture(), strength=0.6, progress=False)
    message = str(caught.value)
    assert "takes 5 time ids" in message and "requires_aesthetics_score" in message and "\n" not in message
