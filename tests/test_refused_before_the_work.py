"""Hostile requests that ran, or failed only after the work: a pipeline class that cannot be told, an
output folder that cannot be written, a T5 prompt length where there is no T5, and ``python -m models
pipeline`` failing half way. Each is now refused before any session exists, on one line (exit 2), or
leaves nothing behind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from onnxopt.cli import main
from onnxopt.errors import ModelSaveError
from onnxopt.outputs import Outputs
from onnxopt.pipeline import PipelineFolder
from onnxopt.pipeline.folder import PipelineFolderError
from onnxopt.pipeline.runner import GenerationError, check_sequence_length
from tests.test_adversarial_round9 import COMMITTED_SD15, edit_json, one_line_error, pipeline_copy


def generate(folder, out, *extra) -> list[str]:
    return ["generate", str(folder), "--prompt", "a cat", "--steps", "1", "-q", "-o", str(out), *extra]


def never_load(monkeypatch):
    """Any session made is a failure of the test: the refusal comes before the work."""
    from onnxopt.pipeline.runner import Pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("the pipeline was loaded: the request was not refused before the work")
    monkeypatch.setattr(Pipeline, "load", classmethod(refuse))


# --- model_index.json's class ------------------------------------------------------------------------

@pytest.mark.parametrize("name", [["StableDiffusionPipeline"], {"a": 1}, 7])
def test_a_class_name_that_is_no_name_is_refused_naming_the_index(tmp_path, capsys, name):
    """A list or an object was an unhashable-type TypeError (exit 3)."""
    src = pipeline_copy(tmp_path)
    edit_json(src / "model_index.json", _class_name=name)
    for argv in (["info", str(src)], ["optimize", "-i", str(src), "-o", str(tmp_path / "out"), "-q"]):
        one_line_error(capsys, main(argv), 2, str(src / "model_index.json"), "'_class_name' must be")
    assert not (tmp_path / "out").exists()


def test_an_index_without_a_class_is_told_by_its_folders(tmp_path):
    """The folder module's contract for hand-written folders: a UNet folder is identified by its components."""
    src = pipeline_copy(tmp_path)
    index = json.loads((src / "model_index.json").read_text())
    index.pop("_class_name")
    (src / "model_index.json").write_text(json.dumps(index))
    assert PipelineFolder.open(src).kind == "sd"


def test_a_transformer_folder_without_a_class_is_refused_unless_its_config_names_it(tmp_path, capsys):
    """SD3's and Flux's folders hold the same component names: one without a class ran as SD3 whatever it was."""
    folder = tmp_path / "dit"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text("{}")
    one_line_error(capsys, main(["info", str(folder)]), 2, str(folder / "model_index.json"), "no '_class_name'",
                   "name the pipeline class")
    from onnxopt.pipeline.folder import kind_of

    for config, kind in (({"_class_name": "FluxTransformer2DModel"}, "flux"), ({"_class_name": "SD3Transformer2DModel"}, "sd3")):
        (folder / "transformer" / "config.json").write_text(json.dumps(config))
        assert kind_of({}, folder) == kind
    (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": ["x"]}))
    with pytest.raises(PipelineFolderError, match="name the pipeline class"):
        kind_of({}, folder)


# --- an output folder that takes no file -------------------------------------------------------------

@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_an_output_in_a_folder_that_takes_no_file_is_refused_before_the_work(tmp_path, capsys, monkeypatch):
    """/proc passes os.access for root, and the run failed only at the end, after the work."""
    with pytest.raises(ModelSaveError, match="is not writable"):
        Outputs().file("/proc/x.png", "-o")
    never_load(monkeypatch)
    one_line_error(capsys, main(generate(COMMITTED_SD15, "/proc/x.png")), 2, "/proc/x.png", "is not writable")
    assert not list(Path("/proc").glob(".x.png.*"))


# --- --max-sequence-length ---------------------------------------------------------------------------

@pytest.mark.parametrize("length, fragment", [(0, "T5 prompt length"), (-3, "T5 prompt length"), (77, "T5 prompt length")])
def test_a_sequence_length_on_a_folder_without_t5_is_refused(tmp_path, capsys, monkeypatch, length, fragment):
    """SD 1.5's CLIP encoders ignored it, a 0 or a negative value too, without a word."""
    never_load(monkeypatch)
    out = tmp_path / "x.png"
    code = main(generate(COMMITTED_SD15, out, "--max-sequence-length", str(length)))
    one_line_error(capsys, code, 2, "--max-sequence-length", fragment)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("length", [0, -1, True, 513])
def test_a_sequence_length_below_one_is_refused_for_every_family(length):
    """The library call as well: the range is checked whatever the folder."""
    with pytest.raises(GenerationError, match="max sequence length must be an integer"):
        check_sequence_length(PipelineFolder.open(COMMITTED_SD15), length)


# --- python -m models pipeline -----------------------------------------------------------------------

def test_models_pipeline_leaves_nothing_behind_when_it_fails(tmp_path, capsys, monkeypatch):
    """It made the -o folder first and left it, empty, when the build failed."""
    from models.__main__ import main as models_main

    monkeypatch.setitem(sys.modules, "torch", None)  # the build fails at its first import of torch
    assert models_main(["pipeline", "sd15", "--size", "tiny", "-o", str(tmp_path / "sd15")]) == 2
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert models_main(["pipeline", "sd15", "--size", "tiny", "-o", str(tmp_path / "full")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["full"]
