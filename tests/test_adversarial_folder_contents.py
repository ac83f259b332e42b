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
    folder = make(tmp_path)
    tripwire(monkeypatch, OPTIMIZE_WORK)
    out = tmp_path / "opt"
    one_line_error(capsys, main(optimize_argv(folder, out)), 2, *fragments)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    image = tmp_path / "x.png"
    one_line_error(capsys, main(generate_argv(folder, image)), 2, *fragments)
    assert not image.exists()


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
