"""The onnxopt command: reports, exit codes, one-line errors and an untouched input."""

import json
import subprocess
import sys

import onnx
import pytest

from onnxopt.cli import main
from tests.conftest import FIXTURES as FIXTURES_DIR, fixture_models
from tests.graphs import linear_model
from tests.test_pass_manager import plugins  # noqa: F401  (fixture)


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "in.onnx"
    onnx.save(linear_model()[0], path)
    return path


def test_optimize_prints_report_and_writes_output(tmp_path, model_path, capsys):
    before = model_path.read_bytes()
    out, js = tmp_path / "out.onnx", tmp_path / "report.json"
    assert main(["optimize", "-i", str(model_path), "-o", str(out), "--passes", "cleanup", "--verify", "--report-json", str(js)]) == 0
    text = capsys.readouterr().out
    assert "remove-identity" in text and "final model equal to the source" in text
    onnx.checker.check_model(str(out))
    data = json.loads(js.read_text())
    assert data["final_verification"]["ok"] is True
    assert data["load_seconds"] > 0 and data["save_seconds"] > 0  # the JSON is written after the save
    assert data["peak_rss_mb_after_save"] >= max(p["peak_rss_mb"] for p in data["passes"]) > 0
    assert "peak RSS" in text.splitlines()[-1]
    assert model_path.read_bytes() == before


def test_verification_failure_exits_1_and_writes_nothing(tmp_path, model_path, capsys, plugins):  # noqa: F811
    out = tmp_path / "out.onnx"
    code = main(["optimize", "-i", str(model_path), "-o", str(out), "--passes", "test-add-to-sub", "--verify"])
    assert code == 1 and not out.exists()
    assert "test-add-to-sub" in capsys.readouterr().err


def test_strict_nothing_to_fuse_exits_4(tmp_path, model_path, capsys, plugins):  # noqa: F811
    code = main(["optimize", "-i", str(model_path), "-o", str(tmp_path / "o.onnx"), "--passes", "test-fuse-nothing", "--strict"])
    assert code == 4
    assert "nothing to fuse" in capsys.readouterr().err


@pytest.mark.parametrize(
    "setup, args_out, message",
    [
        ("not-onnx", None, "not an ONNX model"),
        ("missing", None, "no such file"),
        ("external-missing", None, "missing external data"),
        ("ok", "no/such/dir/out.onnx", "does not exist"),
        ("ok", "same", "never modifies its input"),
    ],
)
def test_bad_input_gets_one_line_and_exit_2(tmp_path, setup, args_out, message, capsys):
    src = tmp_path / "in.onnx"
    if setup == "not-onnx":
        src.write_text("hello, I am a text file\n")
    elif setup == "external-missing":
        onnx.save(linear_model()[0], src, save_as_external_data=True, location="in.onnx.data", size_threshold=0)
        (tmp_path / "in.onnx.data").unlink()
    elif setup == "ok":
        onnx.save(linear_model()[0], src)
    out = {None: tmp_path / "out.onnx", "same": src}.get(args_out, tmp_path / str(args_out))
    code = main(["optimize", "-i", str(src), "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_unknown_pass_exit_2(model_path, tmp_path, capsys):
    assert main(["optimize", "-i", str(model_path), "-o", str(tmp_path / "o.onnx"), "--passes", "cleanup,nope"]) == 2
    assert "unknown pass or preset 'nope'" in capsys.readouterr().err


def test_console_script_runs_as_a_process(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01garbage")
    proc = subprocess.run([sys.executable, "-m", "onnxopt", "optimize", "-i", str(bad), "-o", str(tmp_path / "o.onnx")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "onnxopt: error:" in proc.stderr


def test_passes_and_info_commands(model_path, capsys):
    assert main(["passes"]) == 0
    assert "cleanup" in capsys.readouterr().out
    assert main(["info", str(model_path)]) == 0
    assert "MatMul 1" in capsys.readouterr().out


@pytest.mark.parametrize("path", fixture_models()[:4], ids=lambda p: p.name)
def test_cli_cleanup_verify_on_fixtures(path, tmp_path, capsys):
    assert main(["optimize", "-i", str(path), "-o", str(tmp_path / "out.onnx"), "--passes", "cleanup", "--verify"]) == 0
    assert "final model equal to the source" in capsys.readouterr().out


def test_bench_without_cuda_names_the_package_to_install(model_path, capsys):
    from onnxopt.runners import cuda_available

    if cuda_available():
        pytest.skip("this machine has the CUDA EP")
    assert main(["bench", str(model_path)]) == 2
    err = capsys.readouterr().err
    assert "onnxruntime-gpu" in err and "Traceback" not in err


def test_verify_after_fp16_uses_half_precision_tolerance(tmp_path, capsys):
    path = FIXTURES_DIR / "unet-sd15.tiny.torchscript.static.sdpa.onnx"
    assert main(["optimize", "-i", str(path), "-o", str(tmp_path / "o.onnx"), "--passes", "cleanup,fp16", "--verify"]) == 0
    assert "final model equal to the source" in capsys.readouterr().out


def test_readme_first_command_runs(tmp_path, capsys):
    """The README's first command (install, then every onnxopt step of it: optimize the shipped tiny
    pipeline folder, generate an image from the result) keeps working; what it writes goes to a
    temporary folder."""
    import shlex

    from PIL import Image

    from tests.conftest import ROOT

    first = next(line for line in (ROOT / "README.md").read_text().splitlines() if "onnxopt optimize" in line)
    steps = [shlex.split(part) for part in first.split("&&")]
    steps = [step[1:] for step in steps if step[0] == "onnxopt"]
    assert [step[0] for step in steps] == ["optimize", "generate"]

    def written(path: str) -> str:
        return str(tmp_path / path)

    optimize, generate = steps
    optimize[optimize.index("-i") + 1] = str(ROOT / optimize[optimize.index("-i") + 1])  # the shipped folder
    optimize[optimize.index("-o") + 1] = written(optimize[optimize.index("-o") + 1])
    generate[1] = written(generate[1])  # the folder optimize wrote
    generate[generate.index("-o") + 1] = written(generate[generate.index("-o") + 1])
    for step in steps:
        assert main(step) == 0, step
    with Image.open(generate[generate.index("-o") + 1]) as image:
        assert image.size[0] > 0
    assert "step graph written" in capsys.readouterr().out


def test_a_reader_that_stops_early_gets_no_traceback():
    """`onnxopt info FOLDER | head -0`: the reader closes the pipe (here before onnxopt writes, so the
    write surely fails); onnxopt stops silently with the shell's SIGPIPE status (141), not
    "internal error: BrokenPipeError" (exit 3)."""
    import subprocess
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "models" / "pipelines" / "sd15-tiny"
    proc = subprocess.Popen([sys.executable, "-m", "onnxopt", "info", str(folder)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    assert proc.wait(timeout=120) == 141
    assert b"error" not in proc.stderr.read()
