"""Hostile files, through the command line: the input is read only inside its folder and never
modified, and a failure is exit 2 with one line, leaving every file as it was and nothing new.

Each case builds a small model (``out = x @ W + b``, weights in external data ``weights.bin``) in
a temporary folder, with something wrong around it, and runs ``onnxopt optimize`` on it. Before
and after, every file under the folder is hashed (a symbolic link by its target): a refused case
must leave the same set of files with the same bytes, so no output, partial or ``.tmp`` file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxopt.cli import main
from tests.graphs import linear_model

ROOT_IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
SD15_TS_DYNAMIC = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx"


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root`` (a link: 'link -> target'; a folder: 'dir')."""
    files = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            path = Path(folder) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                files[key] = f"link -> {os.readlink(path)}"
            elif path.is_dir():
                files[key] = "dir"
            else:
                files[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def write_source(tmp_path: Path, location: str = "weights.bin", name: str = "model.onnx") -> Path:
    """``tmp_path/model/<name>`` whose tensors name ``location`` as their external data file; the
    bytes are in ``tmp_path/model/weights.bin`` (a case moves them where ``location`` leads)."""
    proto, _, _ = linear_model()
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    path = folder / name
    onnx.save(proto, path, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    if location != "weights.bin":
        saved = onnx.load(str(path), load_external_data=False)
        for tensor in saved.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = location
        path.write_bytes(saved.SerializeToString())
    return path


def expected_output(x: np.ndarray) -> np.ndarray:
    _, w, b = linear_model()
    return x @ w + b


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def assert_refused(capsys, tmp_path: Path, argv: list[str], message: str, code: int = 2) -> str:
    """The contract for a refused run: ``code``, one line naming the problem, no traceback,
    every file as it was (same bytes), nothing new (no output, no partial or temporary file)."""
    before = snapshot(tmp_path)
    got, err = run_cli(capsys, argv)
    assert got == code, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnxopt: error:"), err
    assert message in lines[0], lines[0]
    assert snapshot(tmp_path) == before
    return lines[0]


def assert_written(capsys, tmp_path: Path, argv: list[str], new_files: set[str]) -> None:
    """The contract for a run that succeeds: exit 0, every pre-existing file unchanged, exactly
    ``new_files`` added (no temporary left), and the output computes x @ W + b on ORT CPU."""
    before = snapshot(tmp_path)
    got, err = run_cli(capsys, argv)
    assert got == 0, err
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert set(after) - set(before) == new_files
    out = argv[argv.index("-o") + 1]
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    got = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, expected_output(x), rtol=1e-5, atol=1e-5)


def optimize(src: Path, out: Path, *extra: str) -> list[str]:
    return ["optimize", "-i", str(src), "-o", str(out), "--passes", "cleanup", "-q", *extra]


# ---------------------------------------------------------------- reading outside the model's folder

def test_data_file_that_is_a_symlink_to_outside_the_folder_is_refused(tmp_path, capsys):
    src = write_source(tmp_path)
    (tmp_path / "outside").mkdir()
    shutil.move(src.parent / "weights.bin", tmp_path / "outside" / "weights.bin")
    (src.parent / "weights.bin").symlink_to(tmp_path / "outside" / "weights.bin")
    line = assert_refused(capsys, tmp_path, optimize(src, tmp_path / "out.onnx"), "outside the model's folder through a symbolic link")
    assert "weights.bin" in line


def test_data_file_behind_a_symlinked_folder_to_outside_is_refused(tmp_path, capsys):
    src = write_source(tmp_path, location="shared/weights.bin")
    (tmp_path / "outside").mkdir()
    shutil.move(src.parent / "weights.bin", tmp_path / "outside" / "weights.bin")
    (src.parent / "shared").symlink_to(tmp_path / "outside", target_is_directory=True)
    assert_refused(capsys, tmp_path, optimize(src, tmp_path / "out.onnx"), "outside the model's folder through a symbolic link")


def test_relative_symlink_that_climbs_out_is_refused(tmp_path, capsys):
    src = write_source(tmp_path)
    shutil.move(src.parent / "weights.bin", tmp_path / "weights.bin")
    (src.parent / "weights.bin").symlink_to("../weights.bin")
    assert_refused(capsys, tmp_path, optimize(src, tmp_path / "out.onnx"), "symbolic link")


@pytest.mark.parametrize("location", ["../weights.bin", "/ABSOLUTE/weights.bin"])
def test_absolute_and_parent_locations_are_refused(tmp_path, capsys, location):
    location = location.replace("/ABSOLUTE", str(tmp_path))
    src = write_source(tmp_path, location=location)
    shutil.copy(src.parent / "weights.bin", tmp_path / "weights.bin")
    assert_refused(capsys, tmp_path, optimize(src, tmp_path / "out.onnx"), "is not a relative path")


def test_symlink_and_hard_link_that_stay_inside_the_folder_are_read(tmp_path, capsys):
    src = write_source(tmp_path, location="link.bin")
    (src.parent / "link.bin").symlink_to("weights.bin")
    assert_written(capsys, tmp_path, optimize(src, tmp_path / "out.onnx"), {"out.onnx"})
    hard = write_source(tmp_path, location="hard.bin", name="hard.onnx")
    os.link(src.parent / "weights.bin", src.parent / "hard.bin")
    assert_written(capsys, tmp_path, optimize(hard, tmp_path / "out2.onnx", "--external-data"), {"out2.onnx", "out2.onnx.data"})


# ---------------------------------------------------------------- bad external data

def test_truncated_data_file_is_refused(tmp_path, capsys):
    src = write_source(tmp_path)
    data = src.parent / "weights.bin"
    data.write_bytes(data.read_bytes()[:1000])
    assert_refused(capsys, tmp_path, optimize(src, tmp_path / "out.onnx"), "is truncated")


def test_external_data_length_that_is_not_the_tensor_size_is_refused(tmp_path, capsys):
    src = write_source(tmp_path)
    proto = onnx.load(str(src), load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "length":
            entry.value = str(int(entry.value) - 4)  # the file is long enough; the entry is wrong
    src.write_bytes(proto.SerializeToString())
    line = assert_refused(capsys, tmp_path, optimize(src, tmp_path / "out.onnx"), "bytes long, but its type and shape")
    assert "need 16384" in line


def test_directory_named_like_the_data_file_is_refused(tmp_path, capsys):
    src = write_source(tmp_path)
    (src.parent / "weights.bin").unlink()
    (src.parent / "weights.bin").mkdir()
    assert_refused(capsys, tmp_path, optimize(src, tmp_path / "out.onnx"), "weights.bin")


# ---------------------------------------------------------------- writing over the input

def test_output_onto_the_input_data_file_is_refused(tmp_path, capsys):
    src = write_source(tmp_path)
    line = assert_refused(capsys, tmp_path, optimize(src, src.parent / "weights.bin"), "a file the input reads")
    assert "never modifies its input" in line


def test_output_onto_the_input_itself_is_refused(tmp_path, capsys):
    src = write_source(tmp_path)
    assert_refused(capsys, tmp_path, optimize(src, src), "never modifies its input")


def test_output_data_file_onto_the_input_data_file_is_refused(tmp_path, capsys):
    src = write_source(tmp_path, location="out.onnx.data")
    shutil.move(src.parent / "weights.bin", src.parent / "out.onnx.data")
    assert_refused(capsys, tmp_path, optimize(src, src.parent / "out.onnx", "--external-data"), "a file the input reads")
    # Without external data nothing goes to out.onnx.data: that is allowed, and it stays untouched.
    assert_written(capsys, tmp_path, optimize(src, src.parent / "out.onnx", "--no-external-data"), {"model/out.onnx"})


@pytest.mark.parametrize("target", ["model.onnx", "weights.bin"])
def test_report_json_onto_an_input_file_is_refused(tmp_path, capsys, target):
    src = write_source(tmp_path)
    argv = optimize(src, tmp_path / "out.onnx", "--report-json", str(src.parent / target))
    assert_refused(capsys, tmp_path, argv, "a file the input reads")


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
@pytest.mark.parametrize("written", ["output", "report"])
def test_links_to_an_input_file_are_seen_through(tmp_path, capsys, link, written):
    src = write_source(tmp_path)
    alias = tmp_path / "alias.bin"
    (alias.symlink_to if link == "symlink" else alias.hardlink_to)(src.parent / "weights.bin")
    argv = optimize(src, alias, "--external-data") if written == "output" else \
        optimize(src, tmp_path / "out.onnx", "--report-json", str(alias))
    assert_refused(capsys, tmp_path, argv, "a file the input reads")


def test_report_json_onto_the_output_data_file_is_refused(tmp_path, capsys):
    src = write_source(tmp_path)
    argv = optimize(src, tmp_path / "out.onnx", "--external-data", "--report-json", str(tmp_path / "out.onnx.data"))
    assert_refused(capsys, tmp_path, argv, "would be written twice")


def test_companion_onto_the_input_is_refused(tmp_path, capsys):
    """context-kv writes out.context_kv.onnx beside out.onnx: here that is the input."""
    folder = tmp_path / "model"
    folder.mkdir()
    src = folder / "out.context_kv.onnx"
    shutil.copy(SD15_TS_DYNAMIC, src)
    argv = ["optimize", "-i", str(src), "-o", str(folder / "out.onnx"), "--passes", "cleanup,context-kv", "-q"]
    assert_refused(capsys, tmp_path, argv, "never modifies its input")


# ---------------------------------------------------------------- where the output goes

def test_missing_output_folder_is_refused(tmp_path, capsys):
    src = write_source(tmp_path)
    assert_refused(capsys, tmp_path, optimize(src, tmp_path / "no" / "such" / "out.onnx"), "does not exist")


def test_output_that_is_a_folder_is_refused(tmp_path, capsys):
    src = write_source(tmp_path)
    (tmp_path / "out.onnx").mkdir()
    assert_refused(capsys, tmp_path, optimize(src, tmp_path / "out.onnx"), "is a folder")


def test_output_data_file_that_is_a_folder_is_refused(tmp_path, capsys):
    src = write_source(tmp_path)
    (tmp_path / "out.onnx.data").mkdir()
    assert_refused(capsys, tmp_path, optimize(src, tmp_path / "out.onnx", "--external-data"), "is a folder")


def test_read_only_output_folder_is_refused(tmp_path, capsys, monkeypatch):
    src = write_source(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if ROOT_IS_ROOT:  # root may write anywhere: stand in for an unprivileged user's view of the folder
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked and mode & os.W_OK else access(p, mode))
    try:
        assert_refused(capsys, tmp_path, optimize(src, locked / "out.onnx"), "not writable")
    finally:
        locked.chmod(0o755)


def test_output_over_an_existing_unrelated_file_replaces_it_whole(tmp_path, capsys):
    src = write_source(tmp_path)
    (tmp_path / "out.onnx").write_bytes(b"previous")
    (tmp_path / "out.onnx.data").write_bytes(b"previous")
    before = snapshot(src.parent)
    got, err = run_cli(capsys, optimize(src, tmp_path / "out.onnx", "--external-data"))
    assert got == 0, err
    assert snapshot(src.parent) == before
    assert not list(tmp_path.rglob("*.tmp"))
    x = np.ones((1, 64), np.float32)
    out = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(out, expected_output(x), rtol=1e-5, atol=1e-5)


def test_disk_full_while_writing_leaves_the_old_output_and_no_temporary_file(tmp_path, capsys, monkeypatch):
    src = write_source(tmp_path)
    (tmp_path / "out.onnx").write_bytes(b"previous")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("onnxopt.saving._copy", disk_full)
    assert_refused(capsys, tmp_path, optimize(src, tmp_path / "out.onnx", "--external-data"), "No space left on device")
