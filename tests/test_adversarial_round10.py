"""Adversarial round 10: paths that alias an input, outputs checked before the work, pipeline
folders read only after every path of them is checked, refusals that were crashes, Ctrl-C at any
moment, a dependency no extra declared, and a newcomer's small surprises.

Each claim holds for every command that writes or reads the thing in question; a command's work is
replaced by a tripwire where the claim is that it never starts (a refusal must come first).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from onnxopt.cli import main
from tests.test_adversarial_round9 import COMMITTED_SD15, file_hashes, one_line_error, pipeline_copy

ROOT = Path(__file__).resolve().parents[1]


class WorkBegan(Exception):
    """Raised by a tripwire: the command got past its checks."""


def tripwire(monkeypatch, target: str) -> None:
    """Replace ``module.attr`` or ``module.Class.attr`` (the module as imported, not a same-named
    package attribute: onnxopt.pipeline.optimize_folder is also a function) by a function that raises."""
    import importlib

    def fail(*args, **kwargs):
        raise WorkBegan(target)
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        monkeypatch.setattr(owner, parts[-1], fail)
        return


def relu(path: Path, shape=(2, 3, 4)) -> Path:
    x = helper.make_tensor_value_info("x", T.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", T.FLOAT, list(shape))
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)]), path)
    return path


def edit_index(folder: Path, **fields) -> None:
    path = folder / "model_index.json"
    index = {**json.loads(path.read_text()), **fields}
    path.write_text(json.dumps({k: v for k, v in index.items() if v is not None}))


def generate(folder, out, *extra) -> list[str]:
    return ["generate", str(folder), "--prompt", "a cat", "--steps", "2", "-o", str(out), *extra]


def optimize_folder_args(src, out, *extra) -> list[str]:
    return ["optimize", "-i", str(src), "-o", str(out), "--target", "tensorrt", "-q", *extra]


# ----------------------------------------------------------------------------------- 1. paths before reads

class OpenedFiles:
    """Every file Python opens (the 'open' audit event), while recording."""

    paths: list[str] = []
    recording = False

    @classmethod
    def hook(cls, event, args):
        if cls.recording and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            cls.paths.append(os.fsdecode(args[0]))


sys.addaudithook(OpenedFiles.hook)


@contextlib.contextmanager
def recording_opens():
    OpenedFiles.paths, OpenedFiles.recording = [], True
    try:
        yield OpenedFiles.paths
    finally:
        OpenedFiles.recording = False


def folder_commands(src: Path, tmp_path: Path) -> dict[str, list[str]]:
    return {"optimize": optimize_folder_args(src, tmp_path / "out"), "generate": generate(src, tmp_path / "a.png"),
            "info": ["info", str(src)]}


@pytest.mark.parametrize("command", ["optimize", "generate", "info"])
@pytest.mark.parametrize("component", ["unet", "tokenizer", "scheduler"])
def test_a_folder_linked_out_of_the_pipeline_is_refused_before_any_file_outside_is_read(
        tmp_path, capsys, monkeypatch, command, component):
    src = pipeline_copy(tmp_path)
    outside = tmp_path / "outside"
    shutil.move(src / component, outside)
    (src / component).symlink_to(outside, target_is_directory=True)
    tripwire(monkeypatch, "onnxopt.pipeline.runner.Pipeline.load")
    with recording_opens() as opened:
        code = main(folder_commands(src, tmp_path)[command])
    one_line_error(capsys, code, 2, "a symbolic link out of the input folder")
    assert not [p for p in opened if str(outside) in os.path.realpath(p)], opened
    assert not (tmp_path / "out").exists() and not (tmp_path / "a.png").exists()


@pytest.mark.timeout(60)  # a named pipe opened for reading blocks until a writer comes: today's failure is a hang
@pytest.mark.parametrize("command", ["optimize", "generate", "info"])
@pytest.mark.parametrize("where", ["unet/model.onnx", "unet/config.json", "model_index.json.d/x", "tokenizer/vocab.json"])
def test_a_named_pipe_in_the_folder_is_refused_before_any_read(tmp_path, capsys, monkeypatch, command, where):
    src = pipeline_copy(tmp_path)
    path = src / where
    path.parent.mkdir(exist_ok=True)
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    tripwire(monkeypatch, "onnxopt.pipeline.runner.Pipeline.load")
    with recording_opens() as opened:
        code = main(folder_commands(src, tmp_path)[command])
    one_line_error(capsys, code, 2, str(path), "not a regular file")
    assert not [p for p in opened if p.endswith(".json") or p.endswith(".onnx")], opened  # nothing opened first


def test_a_dangling_link_and_a_link_to_a_file_outside_are_refused_by_every_folder_command(tmp_path, capsys, monkeypatch):
    tripwire(monkeypatch, "onnxopt.pipeline.runner.Pipeline.load")
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    for target, message in ((secret, "a symbolic link out of the input folder"),
                            (tmp_path / "src" / "nothing", "a symbolic link out of the input folder")):
        for command in ("optimize", "generate", "info"):
            src = tmp_path / "src"
            shutil.rmtree(src, ignore_errors=True)
            pipeline_copy(tmp_path)
            (src / "unet" / "config.json").unlink()
            (src / "unet" / "config.json").symlink_to(target)
            with recording_opens() as opened:
                code = main(folder_commands(src, tmp_path)[command])
            line = one_line_error(capsys, code, 2)
            assert "symbolic link" in line, line
            assert str(secret) not in opened


# ----------------------------------------------------------------------------------- 2. hard links onto inputs

def test_generate_json_hard_linked_to_the_folders_scheduler_config_is_refused(tmp_path, capsys, monkeypatch):
    src = pipeline_copy(tmp_path)
    before = file_hashes(src)
    tripwire(monkeypatch, "onnxopt.pipeline.runner.Pipeline.load")
    for name, flag in (("t.json", "--json"), ("t.png", "-o")):
        link = tmp_path / name
        os.link(src / "scheduler" / "scheduler_config.json", link)
        argv = generate(src, tmp_path / "a.png", "--json", str(link)) if flag == "--json" else generate(src, link)
        one_line_error(capsys, main(argv), 2, "scheduler_config.json", "never modifies its input")
        link.unlink()
    # a path through a symbolic link and '..': the link's parent, not the lexical one
    hop = tmp_path / "hop"
    hop.symlink_to(src / "scheduler", target_is_directory=True)
    one_line_error(capsys, main(generate(src, tmp_path / "a.png", "--json", f"{hop}/../model_index.json")), 2,
                   "never modifies its input")
    assert file_hashes(src) == before


def test_generate_output_hard_linked_to_the_control_image_is_refused(tmp_path, capsys, monkeypatch):
    src = controlnet_folder(tmp_path)
    image = tmp_path / "hint.png"
    write_png_header(image, 64, 64)
    os.link(image, tmp_path / "same.png")
    tripwire(monkeypatch, "onnxopt.pipeline.runner.Pipeline.load")
    code = main(generate(src, tmp_path / "same.png", "--controlnet-image", str(image)))
    one_line_error(capsys, code, 2, "hint.png", "never modifies its input")


def test_diff_json_hard_linked_to_any_input_is_refused(tmp_path, capsys):
    a, b = relu(tmp_path / "a.onnx"), relu(tmp_path / "b.onnx")
    np.savez(tmp_path / "in.npz", x=np.ones((2, 3, 4), np.float32))
    for target in (tmp_path / "in.npz", a, b):
        before = target.read_bytes()
        link = tmp_path / "j.json"
        os.link(target, link)
        code = main(["diff", str(a), str(b), "--inputs", str(tmp_path / "in.npz"), "--json", str(link)])
        one_line_error(capsys, code, 2, "never modifies its input")
        assert target.read_bytes() == before
        link.unlink()


def test_optimize_report_hard_linked_to_the_calibration_or_into_the_input_folder_is_refused(tmp_path, capsys, monkeypatch):
    model = relu(tmp_path / "m.onnx")
    np.savez(tmp_path / "cal.npz", x=np.ones((2, 3, 4), np.float32))
    os.link(tmp_path / "cal.npz", tmp_path / "r.json")
    code = main(["optimize", "-i", str(model), "-o", str(tmp_path / "o.onnx"), "--passes", "cleanup,fp16", "--fp32-auto",
                 "--calibration", str(tmp_path / "cal.npz"), "--report-json", str(tmp_path / "r.json")])
    one_line_error(capsys, code, 2, "cal.npz", "never modifies its input")
    assert np.load(tmp_path / "cal.npz")["x"].shape == (2, 3, 4) and not (tmp_path / "o.onnx").exists()
    # a folder: the report hard-linked to one of the folder's files
    src = pipeline_copy(tmp_path)
    before = file_hashes(src)
    os.link(src / "model_index.json", tmp_path / "report.json")
    tripwire(monkeypatch, "onnxopt.pipeline.optimize_folder._optimize_component")
    code = main(optimize_folder_args(src, tmp_path / "out", "--report-json", str(tmp_path / "report.json")))
    one_line_error(capsys, code, 2, "model_index.json", "never modifies its input")
    assert file_hashes(src) == before and not (tmp_path / "out").exists()


def test_bench_and_build_outputs_hard_linked_to_an_input_are_refused(tmp_path, capsys):
    model = relu(tmp_path / "m.onnx")
    os.link(model, tmp_path / "table.md")
    one_line_error(capsys, main(["bench", str(model), "--markdown", str(tmp_path / "table.md")]), 2, "never modifies its input")
    (tmp_path / "cache.bin").write_bytes(b"timing cache")
    os.link(tmp_path / "cache.bin", tmp_path / "engine.plan")
    code = main(["build", "-i", str(model), "-o", str(tmp_path / "engine.plan"), "--timing-cache", str(tmp_path / "cache.bin")])
    one_line_error(capsys, code, 2, "cache.bin", "never modifies its input")
    assert (tmp_path / "cache.bin").read_bytes() == b"timing cache"


# ----------------------------------------------------------------------------------- 3. outputs before the work

@pytest.mark.parametrize("report", ["out", "out/model_index.json", "out/unet/model.onnx", "out/scheduler/scheduler_config.json",
                                    "out/missing/r.json"])
def test_a_folder_report_that_collides_with_the_output_is_refused_before_the_work(tmp_path, capsys, monkeypatch, report):
    src = pipeline_copy(tmp_path)
    tripwire(monkeypatch, "onnxopt.pipeline.optimize_folder._optimize_component")
    code = main(optimize_folder_args(src, tmp_path / "out", "--report-json", str(tmp_path / report)))
    one_line_error(capsys, code, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_generate_writes_the_image_and_the_timings_both_or_neither(tmp_path, capsys, monkeypatch):
    """The timings' folder disappears during the work: the image is not left behind alone."""
    src = pipeline_copy(tmp_path)
    (tmp_path / "timings").mkdir()
    fake_pipeline(monkeypatch, during=lambda: (tmp_path / "timings").rmdir())
    code = main(generate(src, tmp_path / "a.png", "--json", str(tmp_path / "timings" / "t.json"), "-q"))
    one_line_error(capsys, code, 2, "t.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_generate_checks_both_outputs_before_the_work(tmp_path, capsys, monkeypatch):
    src = pipeline_copy(tmp_path)
    tripwire(monkeypatch, "onnxopt.pipeline.runner.Pipeline.load")
    (tmp_path / "dir").mkdir()
    for extra in (["--json", str(tmp_path / "dir")], ["--json", str(tmp_path / "no" / "t.json")],
                  ["--json", str(src / "unet" / "t.json")]):
        one_line_error(capsys, main(generate(src, tmp_path / "a.png", *extra)), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "src"]


# ----------------------------------------------------------------------------------- a real folder run, shared

def vae_folder(tmp_path: Path) -> Path:
    """A copy of the committed folder; these tests optimize its VAE decoder alone (:func:`vae_only`)."""
    src = tmp_path / "vae"
    shutil.copytree(COMMITTED_SD15, src)
    return src


def vae_only(monkeypatch) -> None:
    """The CLI's folder optimization optimizes the VAE decoder alone (the Python API's ``components``;
    the folder is checked whole, the other components copied unchanged): fast, and a real run."""
    import functools
    import importlib

    module = importlib.import_module("onnxopt.pipeline.optimize_folder")  # the package's attribute is the function
    monkeypatch.setattr(module, "optimize_folder", functools.partial(module.optimize_folder, components=["vae_decoder"]))


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    """optimize -i VAE_FOLDER -o LINK --report-json LINK/report.json, LINK a symbolic link to an empty
    folder, under umask 002 and with stderr a terminal: (folder, stdout, stderr, exit code)."""
    tmp = tmp_path_factory.mktemp("optimized")
    src = vae_folder(tmp)
    (tmp / "empty").mkdir()
    (tmp / "link").symlink_to(tmp / "empty", target_is_directory=True)
    out, err = io.StringIO(), FakeTTY()
    previous = os.umask(0o002)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.MonkeyPatch.context() as patch:
            vae_only(patch)
            code = main(["optimize", "-i", str(src), "-o", str(tmp / "link"), "--target", "tensorrt",
                         "--report-json", str(tmp / "link" / "report.json")])
    finally:
        os.umask(previous)
    return tmp / "empty", out.getvalue(), err.getvalue(), code


def test_output_through_a_symbolic_link_to_an_empty_folder_is_written_there(optimized):
    folder, out, err, code = optimized
    assert code == 0, err
    assert (folder / "vae_decoder" / "model.onnx").is_file() and (folder.parent / "link").is_symlink()
    assert json.loads((folder / "report.json").read_text())["target"] == "tensorrt"  # written with the folder


def test_outputs_follow_the_umask(optimized, tmp_path, monkeypatch, capsys):
    folder, _, _, _ = optimized
    modes = {p.relative_to(folder): stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.rglob("*")]}
    assert {m for p, m in modes.items() if (folder / p).is_dir()} == {0o775}, modes
    assert {m for p, m in modes.items() if (folder / p).is_file()} == {0o664}, modes
    fake_pipeline(monkeypatch)
    previous = os.umask(0o022)
    try:
        assert main(generate(COMMITTED_SD15, tmp_path / "a.png", "--json", str(tmp_path / "t.json"), "-q")) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "a.png").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "t.json").stat().st_mode) == 0o644


def test_a_folders_verify_says_what_was_verified(tmp_path, capsys, monkeypatch):
    """The comparison itself is the pass manager's (tests/test_pipeline_folders.py); here, what is said
    about it: the component's verification is stood in for, to keep this fast."""
    from onnxopt.report import Verification

    module = sys.modules["onnxopt.pipeline.optimize_folder"]
    real = module._optimize_component

    def verified(c, out_dir, src, target, fp16, verify, *args):
        assert verify
        component = real(c, out_dir, src, target, fp16, False, *args)
        component.report.final_verification = Verification(True, 1.5e-6, 2e-5, "sample")
        return component

    monkeypatch.setattr(module, "_optimize_component", verified)
    vae_only(monkeypatch)
    code = main(["optimize", "-i", str(vae_folder(tmp_path)), "-o", str(tmp_path / "out"), "--verify", "-q"])
    out = capsys.readouterr().out
    assert code == 0
    (line,) = [line for line in out.splitlines() if line.startswith("verify:")]
    assert "1 component " in line and "atol=0.0001" in line and "vae_decoder 1.5e-06" in line and "not compared" in line, line


def test_optimize_shows_each_component_and_pass_on_a_terminal(optimized):
    _, _, err, _ = optimized
    for shown in ("[1/1] vae_decoder", "vae_decoder: remove-identity", "vae_decoder: trt-group-norm"):
        assert shown in err, err
    assert err.endswith("\r\x1b[K")  # the status line is erased before the report


def test_optimize_of_one_model_shows_each_pass_on_a_terminal(tmp_path, monkeypatch):
    err = FakeTTY()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["optimize", "-i", str(relu(tmp_path / "m.onnx")), "-o", str(tmp_path / "o.onnx")]) == 0
    assert "m.onnx: remove-identity" in err.getvalue() and err.getvalue().endswith("\r\x1b[K"), repr(err.getvalue())


def test_optimize_is_silent_on_stderr_when_it_is_not_a_terminal(tmp_path, capsys):
    from onnxopt import progress

    stream = io.StringIO()
    with contextlib.redirect_stderr(stream), progress.status() as line:
        line.show("[1/1] unet")
        progress.show_pass("cleanup")
    assert stream.getvalue() == ""


# ----------------------------------------------------------------------------------- 5. crashes that are refusals

def fake_pipeline(monkeypatch, during=lambda: None):
    """Pipeline.load -> a pipeline whose call returns a 8x8 image at once (no session, no model run)."""
    from PIL import Image

    from onnxopt.pipeline import runner

    class Result:
        image = Image.new("RGB", (8, 8))
        images = [image]
        timings = {"steps": 1}

    def call(*args, **kwargs):
        during()
        return Result()

    monkeypatch.setattr(runner.Pipeline, "load", classmethod(lambda cls, *a, **k: call))


@pytest.mark.parametrize("sample_size", [10**20, 2**40, [8, 10**19]])
def test_a_sample_size_too_large_for_an_image_is_refused_by_generate_and_optimize(tmp_path, capsys, monkeypatch, sample_size):
    src = pipeline_copy(tmp_path)
    config = json.loads((src / "unet" / "config.json").read_text())
    (src / "unet" / "config.json").write_text(json.dumps({**config, "sample_size": sample_size}))
    tripwire(monkeypatch, "onnxopt.pipeline.runner.Pipeline.load")
    tripwire(monkeypatch, "onnxopt.pipeline.optimize_folder._optimize_component")
    one_line_error(capsys, main(generate(src, tmp_path / "a.png")), 2, "sample_size")
    one_line_error(capsys, main(optimize_folder_args(src, tmp_path / "out")), 2, "sample_size")
    one_line_error(capsys, main(generate(src, tmp_path / "a.png", "--height", str(10**20))), 2, "--height")


def write_png_header(path: Path, width: int, height: int) -> None:
    """A PNG that declares width x height RGB pixels (its data is one empty row: a header is all PIL reads first)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b""))


def controlnet_folder(tmp_path: Path) -> Path:
    """sd15-tiny plus a controlnet/ (the UNet's graph stands in: nothing runs it here)."""
    src = pipeline_copy(tmp_path)
    (src / "controlnet").mkdir()
    shutil.copy(src / "unet" / "model.onnx", src / "controlnet" / "model.onnx")
    edit_index(src, _class_name="StableDiffusionControlNetPipeline", controlnet=["diffusers", "ControlNetModel"])
    return src


@pytest.mark.parametrize("side", [30000, 12000])  # PIL raises above 2 * MAX_IMAGE_PIXELS and warns above it
def test_a_control_image_that_declares_too_many_pixels_is_refused_before_the_work(tmp_path, capsys, monkeypatch, side):
    from onnxopt.errors import OnnxoptError
    from onnxopt.pipeline import images

    src = controlnet_folder(tmp_path)
    bomb = tmp_path / "bomb.png"
    write_png_header(bomb, side, side)
    tripwire(monkeypatch, "onnxopt.pipeline.runner.Pipeline.load")
    one_line_error(capsys, main(generate(src, tmp_path / "a.png", "--controlnet-image", str(bomb))), 2, "bomb.png", "pixels")
    with pytest.raises(OnnxoptError, match="pixels"):
        images.load_image(bomb)
    assert not (tmp_path / "a.png").exists()


# ----------------------------------------------------------------------------------- 6. refused, not accepted

@pytest.mark.parametrize("case", ["no text_encoder/", "no tokenizer/", "text_encoder_2 named", "no scheduler config",
                                  "no vae_decoder/"])
def test_a_component_the_index_names_and_the_folder_lacks_is_refused_by_optimize(tmp_path, capsys, monkeypatch, case):
    src = pipeline_copy(tmp_path)
    if case == "text_encoder_2 named":
        edit_index(src, text_encoder_2=["transformers", "CLIPTextModelWithProjection"])
    else:
        name = {"no text_encoder/": "text_encoder", "no tokenizer/": "tokenizer", "no scheduler config": "scheduler",
                "no vae_decoder/": "vae_decoder"}[case]
        shutil.rmtree(src / name)
    tripwire(monkeypatch, "onnxopt.pipeline.optimize_folder._optimize_component")
    said = ("model_index.json names", "text_encoder_2") if case == "text_encoder_2 named" else ("missing", f"{name}/")
    one_line_error(capsys, main(optimize_folder_args(src, tmp_path / "out")), 2, *said)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["StableDiffusion3Img2ImgPipeline", "FluxImg2ImgPipeline", "StableDiffusionXLControlNetPipeline",
                                  "StableDiffusionUpscalePipeline", "PixArtAlphaPipeline"])
@pytest.mark.parametrize("command", ["optimize", "generate", "info"])
def test_a_pipeline_class_onnxopt_does_not_run_is_refused_by_name(tmp_path, capsys, monkeypatch, name, command):
    src = pipeline_copy(tmp_path)
    edit_index(src, _class_name=name)
    tripwire(monkeypatch, "onnxopt.pipeline.optimize_folder._optimize_component")
    tripwire(monkeypatch, "onnxopt.pipeline.runner.Pipeline.load")
    one_line_error(capsys, main(folder_commands(src, tmp_path)[command]), 2, name, "does not run")


def test_the_supported_pipelines_are_one_table():
    from onnxopt.pipeline.folder import KINDS, PIPELINE_CLASSES, REQUIRED_MODELS

    assert set(PIPELINE_CLASSES.values()) == set(KINDS) == set(REQUIRED_MODELS)


@pytest.mark.parametrize("shape", [(24,), (1, 2, 3, 4), (2, 4, 3), (4, 3, 2)])
def test_diff_inputs_of_another_rank_or_shape_are_refused_not_reshaped(tmp_path, capsys, shape):
    a, b = relu(tmp_path / "a.onnx"), relu(tmp_path / "b.onnx")
    np.savez(tmp_path / "in.npz", x=np.ones(shape, np.float32))
    code = main(["diff", str(a), str(b), "--inputs", str(tmp_path / "in.npz")])
    one_line_error(capsys, code, 2, "in.npz", "'x'", str(list(shape)))


@pytest.mark.parametrize("display", ["tqdm", "status line"])
def test_interrupted_starts_on_a_line_of_its_own(capsys, monkeypatch, display):
    from onnxopt import cli, progress

    def interrupted_command(args):
        if display == "tqdm":
            from tqdm.auto import tqdm

            bar = tqdm(total=10, desc="denoising", file=sys.stderr, leave=False)
            bar.update(3)
            raise KeyboardInterrupt
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
        with progress.status() as line:
            line.show("[2/4] unet")
            raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "passes", interrupted_command)
    assert main(["passes"]) == 130
    err = capsys.readouterr().err
    assert "onnxopt: interrupted" in err.split("\n"), repr(err)
    assert "Traceback" not in err


def test_ctrl_c_while_generate_imports_its_modules_is_one_line_and_exit_130(tmp_path):
    """SIGINT as soon as onnx's extension is mapped into the process (the imports of the first seconds)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "onnxopt", "generate", str(COMMITTED_SD15), "--prompt", "a",
                                "-o", str(tmp_path / "a.png"), "--json", str(tmp_path / "t.json")],
                               env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    maps = Path(f"/proc/{process.pid}/maps")
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(OSError):
            if "onnx_cpp2py_export" in maps.read_text():
                break
        time.sleep(0.005)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert err.strip() == "onnxopt: interrupted", err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_ctrl_c_during_generate_writes_nothing(tmp_path, capsys, monkeypatch):
    def interrupt():
        raise KeyboardInterrupt
    fake_pipeline(monkeypatch, during=interrupt)
    assert main(generate(COMMITTED_SD15, tmp_path / "a.png", "--json", str(tmp_path / "t.json"), "-q")) == 130
    assert capsys.readouterr().err == "onnxopt: interrupted\n"
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------- 7. dependencies

# What each extra installs, and what its code imports: tests/test_extras.py.


def test_ci_installs_exactly_cpu_in_a_clean_venv_and_fails_when_that_fails(tmp_path):
    """.ci/run with a python3 whose venv creation fails: CI exits non-zero before the test suite."""
    text = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in text and "--system-site-packages" not in text
    assert "install -q -e '.[cpu]'" in text and "optimize -i models/pipelines/sd15-tiny" in text
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "calls"
    (fake / "python3").write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$2" = venv ] && exit 1\nexit 0\n')
    (fake / "python3").chmod(0o755)
    result = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "pytest" not in log.read_text()


# ----------------------------------------------------------------------------------- 10. small things

def test_the_strict_message_has_no_literal_backslash_n(tmp_path, capsys):
    from tests.test_explain import group_norm_scaled_by_div

    source = tmp_path / "gn.onnx"
    onnx.save(group_norm_scaled_by_div(), source)
    code = main(["optimize", "-i", str(source), "-o", str(tmp_path / "o.onnx"), "--passes", "fuse-group-norm", "--strict"])
    err = capsys.readouterr().err
    assert code == 4 and "\\n" not in err and "near miss" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv", [[], ["optimize"], ["frobnicate"]])
def test_a_usage_error_names_onnxopt_once(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("onnxopt: error: ") and "error: onnxopt" not in err, err


def test_version(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"onnxopt {version('onnxopt')}"


def test_info_summarizes_a_pipeline_folder(capsys):
    assert main(["info", str(COMMITTED_SD15)]) == 0
    out = capsys.readouterr().out
    assert "StableDiffusionPipeline" in out and "sd pipeline" in out, out
    for expected in ("unet/model.onnx", "input sample: float32", "output out_sample", "text_encoder/model.onnx",
                     "vae_decoder/model.onnx", "MB"):
        assert expected in out, out


def test_the_python_api_keeps_library_logs_quiet(tmp_path, capfd, monkeypatch):
    """optimize_folder printed graphsurgeon's warnings (about 300 lines for SD); the CLI never did."""
    from onnx_graphsurgeon.logger import G_LOGGER

    module = sys.modules["onnxopt.pipeline.optimize_folder"]

    src = vae_folder(tmp_path)
    real = module._optimize_component

    def loud(*args, **kwargs):
        G_LOGGER.warning("Found distinct tensors that share the same name")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_optimize_component", loud)
    module.optimize_folder(src, tmp_path / "out", target="tensorrt", step_graph=False, static_text=False,
                           components=["vae_decoder"])
    captured = capfd.readouterr()
    assert "distinct tensors" not in captured.err + captured.out
    assert (tmp_path / "out" / "vae_decoder" / "model.onnx").is_file()


def test_generate_help_shows_the_defaults(capsys):
    assert main(["generate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for default in ("as diffusers': 50; SD3 and Flux 28)", "as diffusers': 7.5; SD3 7.0; Flux 3.5)",
                    "default: the folder's own scheduler", "(default: 0)", "(default: cpu)"):
        assert default in out, out
    assert "(default: None)" not in out and "(default: True)" not in out
