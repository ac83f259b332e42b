"""Adversarial round 9: hostile pipeline folders, generate requests, diff/bench reports and --passes
lists. Each case was a traceback-class failure (exit 3), a hang, a silently wrong or overwritten
file, or a run that did nothing while saying it worked; each now gets its documented exit code,
one line on stderr, and leaves every input as it was.

Hostile model files and misused optimize flags are tests/test_adversarial_files.py and
tests/test_adversarial_inputs.py; folder and generate basics are tests/test_pipeline_folders.py and
tests/test_pipeline_generate.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from onnxopt.cli import main
from tests.graphs import make_model

ROOT = Path(__file__).resolve().parents[1]
COMMITTED_SD15 = ROOT / "models" / "pipelines" / "sd15-tiny"
ROOT_IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def file_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def one_line_error(capsys, code: int, expected_code: int, *fragments: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == expected_code, err
    assert "Traceback" not in err and "internal error" not in err, err
    assert len(lines) == 1 and lines[0].startswith("onnxopt: error:"), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def pipeline_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    shutil.copytree(COMMITTED_SD15, folder)
    return folder


def edit_json(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


# The JSON files a run reads, valid JSON of the wrong type: each crashed deep in generate or in
# optimize (exit 3: AttributeError, ValueError, TypeError...), or, for scaling_factor 0, gave a NaN image.
BROKEN_CONFIGS = {
    "tokenizer_config-list": (lambda f: (f / "tokenizer" / "tokenizer_config.json").write_text("[1]"),
                              "tokenizer_config.json: expected a JSON object"),
    "model_max_length-string": (lambda f: edit_json(f / "tokenizer" / "tokenizer_config.json", model_max_length="abc"),
                                "'model_max_length' must be a positive integer, got \"abc\""),
    "unet-config-list": (lambda f: (f / "unet" / "config.json").write_text("[1, 2]"),
                         "unet/config.json: expected a JSON object"),
    "sample_size-string": (lambda f: edit_json(f / "unet" / "config.json", sample_size="big"),
                           "'sample_size' must be a positive integer or [height, width], got \"big\""),
    "sample_size-three": (lambda f: edit_json(f / "unet" / "config.json", sample_size=[8, 8, 8]), "'sample_size'"),
    "in_channels-string": (lambda f: edit_json(f / "unet" / "config.json", in_channels="four"), "'in_channels'"),
    "block_out_channels-int": (lambda f: edit_json(f / "vae_decoder" / "config.json", block_out_channels=5),
                               "'block_out_channels' must be a non-empty list, got 5"),
    "scaling_factor-zero": (lambda f: edit_json(f / "vae_decoder" / "config.json", scaling_factor=0),
                            "'scaling_factor' must be a positive number in float32's range, got 0"),
    "scheduler-list": (lambda f: (f / "scheduler" / "scheduler_config.json").write_text("[1, 2]"),
                       "scheduler_config.json: expected a JSON object"),
}


# ----------------------------------------------------------------------------- optimize on a folder

@pytest.mark.parametrize("case", list(BROKEN_CONFIGS))
def test_optimize_refuses_a_folder_whose_json_generate_cannot_read(tmp_path, capsys, case):
    """Refused before any work (it would be copied as is, and generate refuses it), nothing written."""
    mutate, message = BROKEN_CONFIGS[case]
    src = pipeline_copy(tmp_path)
    mutate(src)
    before = file_hashes(src)
    code = main(["optimize", "-i", str(src), "-o", str(tmp_path / "out"), "--target", "tensorrt", "--fp16", "-q"])
    one_line_error(capsys, code, 2, message)
    assert file_hashes(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no temporary folder


@pytest.mark.parametrize("special", ["named-pipe", "dangling-symlink"])
def test_optimize_refuses_a_special_file_in_the_folder(tmp_path, capsys, special):
    """Copying a named pipe (shutil's SpecialFileError) or a symbolic link to nothing (FileNotFoundError) was exit 3."""
    src = pipeline_copy(tmp_path)
    odd = src / "tokenizer" / "odd"
    os.mkfifo(odd) if special == "named-pipe" else odd.symlink_to("nothing-here")
    code = main(["optimize", "-i", str(src), "-o", str(tmp_path / "out"), "--target", "tensorrt", "-q"])
    one_line_error(capsys, code, 2, str(odd), "named pipe" if special == "named-pipe" else "symbolic link to nothing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_optimize_refuses_output_equal_to_input_and_a_read_only_parent(tmp_path, capsys, monkeypatch):
    src = pipeline_copy(tmp_path)
    before = file_hashes(src)
    code = main(["optimize", "-i", str(src), "-o", str(src), "--target", "tensorrt", "-q"])
    one_line_error(capsys, code, 2, "may not be the input folder")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if ROOT_IS_ROOT:  # root writes anywhere: stand in for an unprivileged user's view of the folder
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked and mode & os.W_OK else access(p, mode))
    try:
        code = main(["optimize", "-i", str(src), "-o", str(locked / "out"), "--target", "tensorrt", "-q"])
        one_line_error(capsys, code, 2, "is not writable")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)
    assert file_hashes(src) == before


def _vae_folder(tmp_path: Path, sample_size=None) -> Path:
    """A copy of the committed folder, whose VAE decoder these tests optimize alone (components=)."""
    src = pipeline_copy(tmp_path)
    if sample_size is not None:
        edit_json(src / "unet" / "config.json", sample_size=sample_size)
    return src


def test_external_data_in_a_subfolder_of_the_component_is_read_and_written_beside_the_model(tmp_path):
    """location 'sub/w.bin' (inside the component's folder, valid ONNX) became the output's data
    name, which the save refuses (ValueError: exit 3); it is now written as model.onnx_data."""
    from onnxopt.pipeline import optimize_folder

    src = _vae_folder(tmp_path)
    model = onnx.load(str(src / "vae_decoder" / "model.onnx"))
    (src / "vae_decoder" / "sub").mkdir()
    onnx.save(model, str(src / "vae_decoder" / "model.onnx"), save_as_external_data=True, location="sub/w.bin",
              size_threshold=1024)
    optimize_folder(src, tmp_path / "out", target="tensorrt", step_graph=False, static_text=False,
                    components=["vae_decoder"])
    written = tmp_path / "out" / "vae_decoder"
    assert (written / "model.onnx_data").is_file() and not (written / "sub" / "w.bin").exists()
    _assert_same_vae(src, tmp_path / "out")


def _assert_same_vae(src: Path, out: Path) -> None:
    import onnxruntime as ort

    latent = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    runs = [ort.InferenceSession(str(f / "vae_decoder" / "model.onnx"), providers=["CPUExecutionProvider"])
            .run(None, {"latent_sample": latent})[0] for f in (src, out)]
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-4, atol=1e-4)


def test_fp16_vae_calibration_takes_a_height_width_sample_size(tmp_path):
    """unet sample_size [h, w] (diffusers allows it, and generate reads it) crashed the VAE's fp16
    calibration (int() of a list: exit 3)."""
    from onnxopt.pipeline import optimize_folder
    from onnxopt.pipeline.optimize_folder import vae_calibration_feed
    from onnxopt.loading import load_model

    src = _vae_folder(tmp_path, sample_size=[8, 16])
    feed = vae_calibration_feed(load_model(src / "vae_decoder" / "model.onnx"), "vae_decoder", src)
    assert feed["latent_sample"].shape == (1, 4, 8, 8)  # the smaller side, square
    report = optimize_folder(src, tmp_path / "out", fp16=True, step_graph=False, static_text=False,
                             components=["vae_decoder"])
    assert report.component("vae_decoder").precision in ("float16", "float32")


# ----------------------------------------------------------------------------- generate

def generate_args(folder: Path, out: Path, *extra: str) -> list[str]:
    return ["generate", str(folder), "--prompt", "a cat", "--steps", "1", "--height", "16", "--width", "16", "-q",
            "-o", str(out), *extra]


GENERATE_CONFIGS = {
    **BROKEN_CONFIGS,
    "scaling_factor-string": (lambda f: edit_json(f / "vae_decoder" / "config.json", scaling_factor="x"),
                              "'scaling_factor'"),
    "num_train_timesteps-string": (lambda f: edit_json(f / "scheduler" / "scheduler_config.json", num_train_timesteps="1000"),
                                   "scheduler_config.json: num_train_timesteps must be a positive integer, got '1000'"),
    "beta_start-string": (lambda f: edit_json(f / "scheduler" / "scheduler_config.json", beta_start="a"),
                          "scheduler_config.json: beta_start must be a number in [0, 1), got 'a'"),
    "empty-tokenizer": (lambda f: [p.unlink() for p in (f / "tokenizer").iterdir()],
                        "no tokenizer vocabulary (tokenizer.json, or vocab.json and merges.txt)"),
}


@pytest.mark.parametrize("case", list(GENERATE_CONFIGS))
def test_generate_refuses_a_folder_whose_json_it_cannot_use(tmp_path, capsys, case):
    """Each was exit 3 (a TypeError or ValueError inside diffusers, transformers or the runner), or
    a silently wrong image: scaling_factor 0 (NaN, written black), an empty tokenizer folder (every
    word the unknown token)."""
    mutate, message = GENERATE_CONFIGS[case]
    src = pipeline_copy(tmp_path)
    mutate(src)
    out = tmp_path / "x.png"
    one_line_error(capsys, main(generate_args(src, out)), 2, message)
    assert not out.exists()


def test_generate_pads_to_77_when_the_tokenizer_sets_no_length(tmp_path, capsys):
    """No model_max_length in tokenizer_config.json: transformers' placeholder (1e30) overflowed the
    padding (OverflowError, exit 3); CLIP's 77 is what the text encoder takes (and optimize's static graphs)."""
    src = pipeline_copy(tmp_path)
    config = src / "tokenizer" / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "model_max_length"}))
    out = tmp_path / "x.png"
    assert main(generate_args(src, out)) == 0, capsys.readouterr().err
    reference = tmp_path / "ref.png"
    assert main(generate_args(COMMITTED_SD15, reference)) == 0
    assert out.read_bytes() == reference.read_bytes()


@pytest.mark.parametrize("extra, message", [
    (["--steps", "1001"], "steps must be at most 1000 (num_train_timesteps"),
    (["--guidance", "1e39"], "guidance must be a finite number (in float32's range), got 1e+39"),
    (["--prompt", "a\udcff"], "the prompt is not valid UTF-8 text"),
    (["--negative-prompt", "\udcffblurry"], "the negative prompt is not valid UTF-8 text"),
], ids=["steps-over-train-timesteps", "guidance-float32-overflow", "prompt-not-utf8", "negative-not-utf8"])
def test_generate_refuses_a_bad_request(tmp_path, capsys, extra, message):
    """Steps over the scheduler's 1000 were diffusers' ValueError (exit 3); a guidance of 1e39 became
    inf in float32 and wrote a black image (exit 0); a prompt argument that is not UTF-8 (lone
    surrogates) was the tokenizer's TypeError (exit 3)."""
    out = tmp_path / "x.png"
    one_line_error(capsys, main(generate_args(COMMITTED_SD15, out, *extra)), 2, message)
    assert not out.exists()


def test_generate_json_onto_the_image_is_refused(tmp_path, capsys):
    """--json X -o X wrote the PNG, then replaced it with the timings (exit 0)."""
    out = tmp_path / "x.png"
    one_line_error(capsys, main(generate_args(COMMITTED_SD15, out, "--json", str(out))), 2, "--json is the image -o writes")
    assert not out.exists()


def test_a_non_finite_image_is_an_error_and_nothing_is_written(tmp_path, monkeypatch):
    """A NaN out of the VAE decoder was written as a black PNG, RuntimeWarnings on stderr."""
    from onnxopt.pipeline import generate
    from onnxopt.pipeline.runner import GenerationError, Pipeline

    monkeypatch.setattr(Pipeline, "_unscale", lambda self, latents: latents * np.float32(np.nan))
    out = tmp_path / "x.png"
    with pytest.raises(GenerationError, match="the image is not finite"):
        generate(COMMITTED_SD15, "a cat", output=out, steps=1, height=16, width=16, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_huge_reuse_range_is_refused_without_building_it():
    """--reuse 1-99999999999999999999 built the set of every step in it: the process filled the
    memory (23 GB, killed). Run under a 1 GiB address-space limit so the old behaviour cannot hurt."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))\n"
            "from onnxopt.pipeline.step_reuse import ReuseScheduleError, parse_reuse\n"
            "try:\n    parse_reuse('1-99999999999999999999', 4)\nexcept ReuseScheduleError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "--reuse: step 4 is outside 0..3", done.stderr[-500:]
    from onnxopt.pipeline.step_reuse import parse_reuse

    assert parse_reuse("2-6:5", 6) == {2}  # the range ends past the last step, its steps do not


# ----------------------------------------------------------------------------- one line, whatever fails

def test_torch_cpu_allocation_failure_is_out_of_memory_not_a_bug():
    """torch's message for the initial latents of --height/--width 800000 (exit 3 before)."""
    from onnxopt.cli import out_of_memory

    torch_message = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                     "tried to allocate 2560000000000 bytes. Error code 12 (Cannot allocate memory)")
    assert out_of_memory(RuntimeError(torch_message)) == "out of memory (2384.2 GiB): try a smaller image size"


def test_an_internal_error_with_a_multi_line_message_is_still_one_line(capsys, monkeypatch):
    """torch's and diffusers' exception texts span lines (linspace's list of signatures: 6 lines)."""
    import onnxopt.cli as cli

    def crash(args):
        raise TypeError("linspace() received an invalid combination of arguments:\n * (Tensor start, ...)\n * (Number start, ...)")

    monkeypatch.setitem(cli.COMMANDS, "passes", crash)
    assert main(["passes"]) == 3
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "linspace() received an invalid combination of arguments:" in err


# ----------------------------------------------------------------------------- diff, bench, --passes

def relu(path: Path, input_name: str = "x") -> Path:
    onnx.save(make_model([helper.make_node("Relu", [input_name], ["out"])], [helper.make_tensor_value_info(input_name, T.FLOAT, [2, 3])],
                         [helper.make_tensor_value_info("out", T.FLOAT, [2, 3])]), path)
    return path


@pytest.mark.parametrize("onto", ["source", "optimized", "inputs"])
def test_diff_json_onto_one_of_its_inputs_is_refused(tmp_path, capsys, onto):
    """diff a.onnx b.onnx --json a.onnx replaced the source model with the JSON report (exit 0)."""
    a, b = relu(tmp_path / "a.onnx"), relu(tmp_path / "b.onnx")
    np.savez(tmp_path / "in.npz", x=np.ones((2, 3), np.float32))
    target = {"source": a, "optimized": b, "inputs": tmp_path / "in.npz"}[onto]
    before = file_hashes(tmp_path)
    code = main(["diff", str(a), str(b), "--runtime", "cpu", "--inputs", str(tmp_path / "in.npz"), "--json", str(target)])
    one_line_error(capsys, code, 2, "never modifies its input")
    assert file_hashes(tmp_path) == before


def test_diff_refuses_a_candidate_with_other_input_names(tmp_path, capsys):
    """Source input 'x', candidate input 'y': reported 'within tolerance' (exit 0), the candidate fed
    whatever its runner made up for 'y'."""
    a, b = relu(tmp_path / "a.onnx"), relu(tmp_path / "b.onnx", input_name="y")
    code = main(["diff", str(a), str(b), "--runtime", "cpu"])
    one_line_error(capsys, code, 2, "the candidate has input(s) the source does not have: 'y' (the source's inputs: x)")


def test_bench_report_onto_a_model_is_refused_before_any_work(tmp_path, capsys):
    a = relu(tmp_path / "a.onnx")
    before = file_hashes(tmp_path)
    one_line_error(capsys, main(["bench", str(a), "--markdown", str(a)]), 2, "never modifies its input")
    assert file_hashes(tmp_path) == before


@pytest.mark.parametrize("passes", [",", " , ", ""])
def test_passes_that_name_nothing_are_refused(tmp_path, capsys, passes):
    """--passes , ran no pass at all and wrote a copy (exit 0); --passes '' ran the default cleanup."""
    a = relu(tmp_path / "a.onnx")
    one_line_error(capsys, main(["optimize", "-i", str(a), "-o", str(tmp_path / "o.onnx"), "--passes", passes]), 2,
                   "names no pass or preset")
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("flags", [["--target", "tensorrt", "--fp8"], ["--passes", "tensorrt", "--fp8"]], ids=["target", "passes"])
def test_fp8_with_tensorrt_is_refused(tmp_path, capsys, flags):
    """Already one line (kept: --fp8 is for ort-cuda's GemmFloat8)."""
    a = relu(tmp_path / "a.onnx")
    one_line_error(capsys, main(["optimize", "-i", str(a), "-o", str(tmp_path / "o.onnx"), *flags]), 2,
                   "--fp8 is for --target ort-cuda")


def test_a_one_pixel_control_image_is_refused_not_resized_to_nothing():
    """A 1x1 --controlnet-image without --height/--width rounds down to 0x0: diffusers' ValueError
    "height and width must be > 0" (exit 3); with a size given it is resized as diffusers does."""
    from PIL import Image

    from onnxopt.errors import OnnxoptError
    from onnxopt.pipeline.images import preprocess_control_image

    dot = Image.new("RGB", (1, 1), (255, 0, 0))
    with pytest.raises(OnnxoptError, match="the conditioning image is smaller than 8 pixels on a side"):
        preprocess_control_image(dot, None, None, 8)
    assert preprocess_control_image(dot, 16, 24, 8).shape == (1, 3, 16, 24)


def test_onnx_runtime_log_lines_do_not_reach_the_user_of_generate(tmp_path, capfd, monkeypatch):
    """A run that fails inside ONNX Runtime (an allocation too big for the machine, here a Reshape fed
    a wrong shape) printed ORT's own "[E:onnxruntime ...]" line above onnxopt's one line."""
    from onnxopt.pipeline import runner
    from onnxopt.pipeline.sessions import create_session

    reshape = make_model([helper.make_node("Reshape", ["x", "shape"], ["out"])],
                         [helper.make_tensor_value_info("x", T.FLOAT, [6]), helper.make_tensor_value_info("shape", T.INT64, [2])],
                         [helper.make_tensor_value_info("out", T.FLOAT, None)]).SerializeToString()

    def fails_in_ort(self, *args, **kwargs):
        session = create_session(reshape, "cpu", name="reshape")
        session.run(None, {"x": np.zeros(6, np.float32), "shape": np.array([4, 4], np.int64)})

    monkeypatch.setattr(runner.Pipeline, "__call__", fails_in_ort)
    code = main(generate_args(COMMITTED_SD15, tmp_path / "x.png"))
    err = capfd.readouterr().err
    assert code == 3 and "[E:onnxruntime" not in err, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err


@pytest.mark.parametrize("dtype, shape", [(T.INT16, [2, 3]), (T.FLOAT, [0, 3])], ids=["int16-zeros", "dim-0"])
def test_diff_of_equal_integer_or_empty_outputs_reports_zero_and_valid_json(tmp_path, capsys, recwarn, dtype, shape):
    """Equal int16 outputs with zeros: max rel NaN (0 / 0; 'NaN' in --json, not JSON) and a
    RuntimeWarning on stderr; an output with a 0 dim: 'Mean of empty slice' warnings."""
    model = make_model([helper.make_node("Identity", ["x"], ["out"])], [helper.make_tensor_value_info("x", dtype, shape)],
                       [helper.make_tensor_value_info("out", dtype, shape)])
    onnx.save(model, tmp_path / "m.onnx")
    report = tmp_path / "diff.json"
    assert main(["diff", str(tmp_path / "m.onnx"), str(tmp_path / "m.onnx"), "--runtime", "cpu", "--json", str(report)]) == 0

    def no_constants(token):
        raise AssertionError(f"{token} in the JSON report")

    (out,) = json.loads(report.read_text(), parse_constant=no_constants)["outputs"]
    assert out["max_rel"] == 0 and out["max_abs"] == 0
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in recwarn]


@pytest.mark.parametrize("what", ["model", "folder"])
def test_report_json_into_a_missing_folder_is_refused_before_anything_is_written(tmp_path, capsys, what):
    """--report-json no/such/r.json failed after the save: exit 2 with the output written (a model,
    or the whole optimized folder). A report inside the new output folder is still written there."""
    src = relu(tmp_path / "a.onnx") if what == "model" else COMMITTED_SD15
    out = tmp_path / ("o.onnx" if what == "model" else "out")
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["optimize", "-i", str(src), "-o", str(out), "-q", "--report-json", str(tmp_path / "no" / "r.json"),
                 *(["--target", "tensorrt"] if what == "folder" else [])])
    one_line_error(capsys, code, 2, "does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if what == "folder":
        assert main(["optimize", "-i", str(src), "-o", str(out), "-q", "--target", "tensorrt", "--report-json",
                     str(out / "report.json")]) == 0
        assert json.loads((out / "report.json").read_text())["target"] == "tensorrt"


@pytest.mark.parametrize("component, other, message", [
    ("text_encoder", "vae_decoder", "text_encoder/model.onnx: not a text encoder graph: no input input_ids"),
    ("vae_decoder", "text_encoder", "vae_decoder/model.onnx: not a VAE decoder graph: no input latent_sample"),
], ids=["text-encoder-is-a-vae", "vae-is-a-text-encoder"])
def test_generate_names_a_component_that_is_another_components_graph(tmp_path, capsys, component, other, message):
    """Another component's model.onnx in a component's folder: a KeyError ('input_ids') or ORT's
    ValueError (missing inputs), exit 3."""
    src = pipeline_copy(tmp_path)
    shutil.rmtree(src / component)
    shutil.copytree(COMMITTED_SD15 / other, src / component)
    out = tmp_path / "x.png"
    one_line_error(capsys, main(generate_args(src, out)), 2, message)
    assert not out.exists()


def test_optimize_names_the_source_file_not_the_temporary_one(tmp_path, capsys):
    """A VAE in unet/: the step graph's refusal named '.out.tmp-XXXX/unet/model.onnx', a file the
    failure had just removed."""
    src = pipeline_copy(tmp_path)
    for model in (src / "unet").glob("model.onnx*"):  # the UNet's config stays: the graph is what is refused
        model.unlink()
    for model in (COMMITTED_SD15 / "vae_decoder").glob("model.onnx*"):
        shutil.copy(model, src / "unet" / model.name)
    code = main(["optimize", "-i", str(src), "-o", str(tmp_path / "out"), "--target", "tensorrt", "-q"])
    line = one_line_error(capsys, code, 2, f"{src / 'unet' / 'model.onnx'}: not a UNet graph")
    assert ".tmp-" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("command, flags, message", [
    ("diff", ["--seed", "-1"], "argument --seed: expected an integer in 0..4294967295, got '-1'"),
    ("diff", ["--seed", str(2**32)], "argument --seed"),
    ("bench", ["--runs", "0"], "argument --runs: expected an integer of 1 or more, got '0'"),
    ("bench", ["--warmup", "-1"], "argument --warmup"),
], ids=["seed-negative", "seed-2**32", "runs-0", "warmup-negative"])
def test_counts_and_seeds_out_of_range_are_usage_errors(tmp_path, capsys, command, flags, message):
    """diff --seed -1 (or 2**32) was the random-input generator's ValueError (exit 3); bench --runs 0
    would time nothing (on a GPU: the median of no runs)."""
    a = relu(tmp_path / "a.onnx")
    argv = [command, str(a), *([str(a), "--runtime", "cpu"] if command == "diff" else []), *flags]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == [err] and message in err, err


def test_a_control_image_that_is_a_folder_is_named_as_one(tmp_path):
    """--controlnet-image DIR said 'no such image' of a folder that exists."""
    from types import SimpleNamespace

    from onnxopt.pipeline.runner import GenerationError, check_request

    from onnxopt.pipeline.families import FAMILIES

    controlnet_folder = SimpleNamespace(kind="controlnet", controlnets=["controlnet"], root=tmp_path, vae_scale_factor=8,
                                        config=lambda name: {}, scheduler_config=lambda: {},
                                        family=FAMILIES["controlnet"])
    with pytest.raises(GenerationError, match="is a folder, not an image"):
        check_request(controlnet_folder, controlnet_image=[tmp_path])


@pytest.mark.parametrize("argv", [
    lambda weird, out: ["info", weird],
    lambda weird, out: ["optimize", "-i", weird, "-o", str(out / "o.onnx")],
    lambda weird, out: ["generate", weird, "--prompt", "a", "-o", str(out / "x.png")],
])
def test_a_path_with_a_newline_is_still_one_line(capsys, tmp_path, argv):
    """A name the user gave with a newline in it is shown escaped: the error stays one line."""
    one_line_error(capsys, main(argv(str(tmp_path / "no\nsuch"), tmp_path)), 2, "no\\nsuch")


@pytest.mark.parametrize("flag", [["--prefer-nhwc"], ["--precision", "fp16"]])
def test_diff_refuses_an_option_of_another_runtime(capsys, tmp_path, flag):
    """--prefer-nhwc (CUDA EP) and --precision (TensorRT) on a diff that runs on the CPU were silently
    ignored: the user read a result those options did not shape."""
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", T.FLOAT, [2, 3])],
                       [helper.make_tensor_value_info("y", T.FLOAT, [2, 3])])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    one_line_error(capsys, main(["diff", str(path), str(path), "--runtime", "cpu", *flag]), 2, flag[0], "runs on cpu")
