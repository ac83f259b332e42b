"""Pipeline folders that look whole and are not what their model_index.json says: the shipped tiny
folders copied, one part removed, relabelled or swapped. ``optimize`` refuses each as loading the
folder for ``generate`` does (one line, exit 2, nothing written) before any component is optimized;
the folders they resemble still pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from onnxopt.cli import main
from tests.test_adversarial_lookalike_folders import PIPELINES, copy_of, generate_argv
from tests.test_adversarial_round9 import edit_json, one_line_error
from tests.test_adversarial_round10 import tripwire

OPTIMIZE_WORK = "onnxopt.pipeline.optimize_folder._optimize_component"
LOAD_WORK = "onnxopt.pipeline.runner.Pipeline.load"


def optimize_argv(folder: Path, out: Path) -> list[str]:
    return ["optimize", "-i", str(folder), "-o", str(out), "--target", "tensorrt", "-q"]


def refused_by_both(tmp_path, capsys, monkeypatch, folder: Path, *fragments: str) -> None:
    """``optimize`` and ``generate`` each refuse ``folder`` in one line naming ``fragments``, exit 2,
    before their work begins, and write nothing."""
    tripwire(monkeypatch, OPTIMIZE_WORK)
    out = tmp_path / "opt"
    one_line_error(capsys, main(optimize_argv(folder, out)), 2, *fragments)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    image = tmp_path / "x.png"
    one_line_error(capsys, main(generate_argv(folder, image)), 2, *fragments)
    assert not image.exists()


def passes_the_checks(capsys, monkeypatch, folder: Path, out: Path) -> None:
    """``optimize`` gets past every check of ``folder`` to its first component (a tripwire there)."""
    tripwire(monkeypatch, OPTIMIZE_WORK)
    assert main(optimize_argv(folder, out)) == 3
    assert "WorkBegan" in capsys.readouterr().err and not out.exists()


# ----------------------------------------------------------------------------------- components the class needs

def sd15_relabelled_sdxl(tmp_path: Path) -> Path:
    folder = copy_of(tmp_path, "sd15-tiny")
    edit_json(folder / "model_index.json", _class_name="StableDiffusionXLPipeline")
    return folder


def flux_without_t5(tmp_path: Path) -> Path:
    folder = copy_of(tmp_path, "flux-schnell-tiny-optimum")
    shutil.rmtree(folder / "text_encoder_2")
    index = json.loads((folder / "model_index.json").read_text())
    del index["text_encoder_2"]  # the index no longer names it either: only the class says Flux needs it
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def sd3_without_the_t5_its_index_names(tmp_path: Path) -> Path:
    folder = copy_of(tmp_path, "sd35-tiny-optimum")
    shutil.rmtree(folder / "text_encoder_3")
    return folder


@pytest.mark.parametrize("make, fragments", [
    (sd15_relabelled_sdxl, ("missing component text_encoder_2/model.onnx", "(sdxl pipeline)")),
    (flux_without_t5, ("missing component text_encoder_2/model.onnx", "(flux pipeline)")),
    (sd3_without_the_t5_its_index_names, ("text_encoder_3",)),
], ids=["sd15-relabelled-sdxl", "flux-without-t5", "sd3-without-its-t5"])
def test_optimize_refuses_a_folder_without_a_component_its_pipeline_class_needs(tmp_path, capsys, monkeypatch, make,
                                                                                 fragments):
    """An SD 1.5 folder relabelled StableDiffusionXLPipeline, a Flux folder without its T5: optimize
    wrote them (exit 0) and generate refused the result."""
    refused_by_both(tmp_path, capsys, monkeypatch, make(tmp_path), *fragments)


@pytest.mark.parametrize("name", ["sd15-tiny", "sd15-tiny-optimum", "sd35-tiny-optimum", "flux-schnell-tiny-optimum"])
def test_the_shipped_folders_pass_the_checks_optimize_makes(tmp_path, capsys, monkeypatch, name):
    """diffusers' index (one "vae" entry for vae_decoder/ and vae_encoder/) and optimum's both pass."""
    passes_the_checks(capsys, monkeypatch, copy_of(tmp_path, name), tmp_path / "opt")


def test_sd3_without_t5_runs_as_diffusers_runs_it(tmp_path, capsys, monkeypatch):
    """T5 is optional in StableDiffusion3Pipeline: a folder whose index names none and that has none passes."""
    folder = copy_of(tmp_path, "sd35-tiny-optimum")
    shutil.rmtree(folder / "text_encoder_3")
    shutil.rmtree(folder / "tokenizer_3")
    edit_json(folder / "model_index.json", text_encoder_3=[None, None], tokenizer_3=[None, None])
    passes_the_checks(capsys, monkeypatch, folder, tmp_path / "opt")


# ----------------------------------------------------------------------------------- tokenizers of another family

def only(folder: Path, *keep: str) -> None:
    """Remove every file of ``folder`` but ``keep``."""
    for path in folder.iterdir():
        if path.name not in keep:
            path.unlink()


def t5_tokenizer_json_in_clips_place(tmp_path: Path) -> Path:
    folder = copy_of(tmp_path, "sd15-tiny")
    shutil.rmtree(folder / "tokenizer")
    (folder / "tokenizer").mkdir()
    shutil.copy(PIPELINES / "sd35-tiny-optimum" / "tokenizer_3" / "tokenizer.json", folder / "tokenizer")
    return folder


def clip_tokenizer_in_t5s_place(tmp_path: Path) -> Path:
    folder = copy_of(tmp_path, "flux-schnell-tiny-optimum")
    shutil.rmtree(folder / "tokenizer_2")
    shutil.copytree(PIPELINES / "sd15-tiny" / "tokenizer", folder / "tokenizer_2")
    return folder


def another_bpe_vocabulary(tmp_path: Path) -> Path:
    """CLIP's BPE files with the vocabulary's <|startoftext|> and <|endoftext|> renamed (a GPT-2-like
    vocabulary): transformers adds the two back past the vocabulary's end, ids the encoder lacks."""
    folder = copy_of(tmp_path, "sd15-tiny-optimum")
    vocab_path = folder / "tokenizer" / "vocab.json"
    vocab = json.loads(vocab_path.read_text())
    vocab["<s>"], vocab["</s>"] = vocab.pop("<|startoftext|>"), vocab.pop("<|endoftext|>")
    vocab_path.write_text(json.dumps(vocab))
    return folder


@pytest.mark.parametrize("make, fragments", [
    (t5_tokenizer_json_in_clips_place, ("tokenizer: tokenizer.json holds a Unigram tokenizer, not CLIP's BPE",)),
    (clip_tokenizer_in_t5s_place, ("tokenizer_2: tokenizer.json holds a BPE tokenizer, not T5's Unigram",)),
    (another_bpe_vocabulary, ("tokenizer: the tokenizer's vocabulary has no <|startoftext|> or <|endoftext|>",)),
], ids=["t5-in-a-clip-slot", "clip-in-the-t5-slot", "bpe-without-clips-tokens"])
def test_a_tokenizer_of_another_family_is_refused_by_optimize_and_generate(tmp_path, capsys, monkeypatch, make,
                                                                           fragments):
    """Another model's tokenizer in a slot loaded (CLIPTokenizer and T5TokenizerFast each build their own
    model from any vocabulary) and turned every prompt into wrong token ids."""
    refused_by_both(tmp_path, capsys, monkeypatch, make(tmp_path), *fragments)


@pytest.mark.parametrize("name, tokenizer, keep", [
    ("sd15-tiny", "tokenizer", ("tokenizer.json",)),  # CLIPTokenizerFast's file alone
    ("sd15-tiny", "tokenizer", ("vocab.json", "merges.txt")),  # the slow tokenizer's files alone
    ("sd35-tiny-optimum", "tokenizer_3", ("tokenizer.json",)),  # T5's, as diffusers' save_pretrained writes it
], ids=["clip-fast-only", "clip-slow-only", "t5-json-only"])
def test_the_tokenizer_layouts_diffusers_writes_pass(tmp_path, capsys, monkeypatch, name, tokenizer, keep):
    folder = copy_of(tmp_path, name)
    only(folder / tokenizer, *keep)
    passes_the_checks(capsys, monkeypatch, folder, tmp_path / "opt")


def test_components_names_what_to_optimize_and_the_folder_is_checked_whole(tmp_path):
    """optimize_folder(components=[...]) optimizes those and copies the others byte for byte; a name the
    folder lacks is refused, and so is a folder generate refuses, whichever component is asked for."""
    from onnxopt.errors import OnnxoptError
    from onnxopt.pipeline import optimize_folder
    from tests.test_adversarial_round9 import file_hashes

    folder = copy_of(tmp_path, "sd15-tiny")
    with pytest.raises(OnnxoptError, match="no component transformer to optimize"):
        optimize_folder(folder, tmp_path / "out", components=["transformer"])
    report = optimize_folder(folder, tmp_path / "out", target="tensorrt", components=["vae_decoder"])
    assert [c.name for c in report.components] == ["vae_decoder"]
    source, written = file_hashes(folder), file_hashes(tmp_path / "out")
    assert {k: v for k, v in written.items() if not k.startswith("vae_decoder/model.")} == \
        {k: v for k, v in source.items() if not k.startswith("vae_decoder/model.")}
    shutil.rmtree(folder / "unet")
    with pytest.raises(OnnxoptError, match="missing component unet/model.onnx"):
        optimize_folder(folder, tmp_path / "again", components=["vae_decoder"])
    assert not (tmp_path / "again").exists()


# ----------------------------------------------------------------------------------- model_index.json entries

@pytest.mark.parametrize("entry, fragments", [
    ({"unet": "UNet2DConditionModel"}, ("'unet' must be [library, class] or [null, null]",)),
    ({"unet": ["diffusers", "UNet2DConditionModel", "x"]}, ("'unet' must be [library, class]",)),
    ({"text_encoder": [None, "CLIPTextModel"]}, ("'text_encoder' must be [library, class]",)),
    ({"scheduler": ["diffusers", 5]}, ("'scheduler' must be [library, class]",)),
    ({"unet": ["transformers", "UNet2DConditionModel"]}, ("'unet' names", "diffusers loads unet from diffusers")),
    ({"tokenizer": ["diffusers", "CLIPTokenizer"]}, ("'tokenizer' names", "from transformers")),
], ids=["a-string", "three-items", "null-library", "class-not-a-name", "unet-from-transformers",
        "tokenizer-from-diffusers"])
def test_an_index_entry_diffusers_could_not_load_is_refused(tmp_path, capsys, monkeypatch, entry, fragments):
    """An entry of another shape, or a class from a library diffusers does not load that component
    from: diffusers' from_pretrained fails on the folder; onnxopt ran it without a word."""
    folder = copy_of(tmp_path, "sd15-tiny")
    edit_json(folder / "model_index.json", **entry)
    refused_by_both(tmp_path, capsys, monkeypatch, folder, "model_index.json", *fragments)


def test_diffusers_onnx_pipelines_index_passes(tmp_path, capsys, monkeypatch):
    """diffusers' OnnxStableDiffusionPipeline names its every model ["diffusers", "OnnxRuntimeModel"]."""
    folder = copy_of(tmp_path, "sd15-tiny")
    model = ["diffusers", "OnnxRuntimeModel"]
    edit_json(folder / "model_index.json", _class_name="OnnxStableDiffusionPipeline", text_encoder=model, unet=model,
              vae=None, vae_decoder=model, vae_encoder=model)
    passes_the_checks(capsys, monkeypatch, folder, tmp_path / "opt")


# ----------------------------------------------------------------------------------- the scheduler's config

@pytest.mark.parametrize("value, fragment", [
    (0, "num_train_timesteps must be a positive integer, got 0"),
    (-1000, "num_train_timesteps must be a positive integer, got -1000"),
    (10 ** 9, "num_train_timesteps must be at most 100000, got 1000000000"),  # diffusers' tables filled the memory
])
def test_a_scheduler_config_no_scheduler_can_be_made_from_is_refused_by_optimize_too(tmp_path, capsys, monkeypatch,
                                                                                       value, fragment):
    """generate refused num_train_timesteps 0 (and filled the memory with a billion's tables); optimize
    wrote the folder: every scheduler, --scheduler's too, is made from these values."""
    folder = copy_of(tmp_path, "sd15-tiny")
    edit_json(folder / "scheduler" / "scheduler_config.json", num_train_timesteps=value)
    refused_by_both(tmp_path, capsys, monkeypatch, folder, fragment)


def test_a_scheduler_class_onnxopt_does_not_run_is_optimized_and_generate_says_to_choose_one(tmp_path, capsys,
                                                                                              monkeypatch):
    """The folder runs with --scheduler (the step graph reads the schedule as data: optimize needs no
    scheduler), so optimize takes it; generate without --scheduler names the choice."""
    folder = copy_of(tmp_path, "sd15-tiny")
    edit_json(folder / "model_index.json", scheduler=["diffusers", "FooScheduler"])
    edit_json(folder / "scheduler" / "scheduler_config.json", _class_name="FooScheduler")
    passes_the_checks(capsys, monkeypatch, folder, tmp_path / "opt")
    image = tmp_path / "x.png"
    one_line_error(capsys, main(generate_argv(folder, image)), 2, "FooScheduler", "choose one with --scheduler")
    assert not image.exists()


# ----------------------------------------------------------------------------------- configs against graphs

def unet_and_vae_of_16_latents(tmp_path: Path) -> Path:
    """Configs that agree with each other (so check_unet_latents passes), not with the 4-channel graphs."""
    folder = copy_of(tmp_path, "sd15-tiny")
    edit_json(folder / "unet" / "config.json", in_channels=16, out_channels=16)
    edit_json(folder / "vae_decoder" / "config.json", latent_channels=16)
    return folder


def flux_packed_width_of_another_model(tmp_path: Path) -> Path:
    folder = copy_of(tmp_path, "flux-schnell-tiny-optimum")
    edit_json(folder / "transformer" / "config.json", in_channels=32)
    return folder


@pytest.mark.parametrize("make, fragment", [
    (unet_and_vae_of_16_latents, "unet/config.json: in_channels 16, but unet's graph takes latents of 4 channels"),
    (flux_packed_width_of_another_model,
     "transformer/config.json: in_channels 32, but transformer's graph takes latents of 64 channels"),
], ids=["unet-16-channels", "flux-packed-32"])
def test_a_denoiser_config_its_graph_contradicts_is_refused_by_optimize_and_generate(tmp_path, capsys, monkeypatch,
                                                                                      make, fragment):
    """optimize wrote both; generate refused the UNet's at load and failed on Flux's with ORT's
    "Got invalid dimensions" (exit 3): Flux's latents are packed, [batch, sequence, in_channels]."""
    refused_by_both(tmp_path, capsys, monkeypatch, make(tmp_path), fragment)


# ----------------------------------------------------------------------------------- the folder's own files

@pytest.mark.parametrize("name", ["unet", "tokenizer", "scheduler", "vae_encoder"])
def test_a_file_where_a_component_folder_belongs_is_refused_by_name(tmp_path, capsys, monkeypatch, name):
    """A required one was "missing", an optional one (vae_encoder) passed unread."""
    folder = copy_of(tmp_path, "sd15-tiny")
    shutil.rmtree(folder / name)
    (folder / name).write_text("{}")
    refused_by_both(tmp_path, capsys, monkeypatch, folder, f"{folder / name}: a file where the folder {name}/")


@pytest.mark.parametrize("location", ["../../secret.bin", "ABSOLUTE"])
def test_external_data_outside_a_component_is_refused_before_any_component_is_optimized(tmp_path, capsys,
                                                                                       monkeypatch, location):
    """The VAE decoder's weights named a file outside the folder: refused after the text encoder and
    UNet were optimized (wasted work); now before the first, and the file is never opened."""
    import onnx
    import numpy as np
    from onnx import TensorProto

    from tests.test_adversarial_round10 import recording_opens

    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.zeros(1 << 12, np.float32).tobytes())
    location = str(secret) if location == "ABSOLUTE" else location
    folder = copy_of(tmp_path, "sd15-tiny")
    model = onnx.load(str(folder / "vae_decoder" / "model.onnx"))
    tensor = next(t for t in model.graph.initializer if t.data_type == TensorProto.FLOAT and t.dims)
    size = int(np.prod(tensor.dims)) * 4
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(size))):
        tensor.external_data.add(key=key, value=value)
    onnx.save(model, str(folder / "vae_decoder" / "model.onnx"))
    tripwire(monkeypatch, OPTIMIZE_WORK)
    out = tmp_path / "opt"
    with recording_opens() as opened:
        code = main(optimize_argv(folder, out))
    one_line_error(capsys, code, 2, "vae_decoder/model.onnx", f"external data location '{location}'")
    assert str(secret) not in opened and not out.exists()


# ----------------------------------------------------------------------------------- JSON nested past the decoder

@pytest.mark.parametrize("name, relative", [
    ("flux-dev-tiny-optimum", "model_index.json"),
    ("flux-dev-tiny-optimum", "scheduler/scheduler_config.json"),
    ("flux-dev-tiny-optimum", "transformer/config.json"),
    ("sd35-tiny-optimum", "vae_decoder/config.json"),
])
def test_json_nested_deeper_than_the_decoder_goes_is_a_one_line_refusal(tmp_path, capsys, monkeypatch, name, relative):
    """Python's JSON decoder recurses once per level: a 200,000-deep ``[[[...]]]`` raised RecursionError,
    an internal error (exit 3) in optimize and generate alike."""
    folder = copy_of(tmp_path, name)
    (folder / relative).write_text("[" * 200_000 + "]" * 200_000)
    refused_by_both(tmp_path, capsys, monkeypatch, folder, relative.split("/")[-1], "nests deeper")


def test_a_weight_map_nested_too_deep_leaves_the_weights_untraced(tmp_path):
    """The weight map beside a graph (LoRA targets read it): too deep to decode is a malformed map."""
    from onnxopt.weight_provenance import map_path, read_map

    model = tmp_path / "model.onnx"
    model.write_bytes(b"")
    map_path(model).write_text("{\"a\":" * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(ValueError, match="nests too deep"):
        read_map(model)
