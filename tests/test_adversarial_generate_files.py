"""Hostile files and values beside a pipeline folder: what ``generate`` reads because the user named it
(``--lora``, ``--image``, ``--mask``, ``--prompts``) and the values of a folder's JSON that the run
computes with. Each case was a hang, a traceback-class failure (exit 3), or a run that wrote inf or
NaN weights; each is now one line on stderr with exit 2, before any session exists.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

import numpy as np
import pytest

from onnxopt.cli import main
from tests.test_adversarial_round9 import COMMITTED_SD15, one_line_error

A = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"


def write_lora(path, metadata: dict | None = None, value: float = 0.01):
    from safetensors.numpy import save_file

    save_file({f"{A}.lora_A.weight": np.full((2, 8), value, np.float32),
               f"{A}.lora_B.weight": np.full((8, 2), value, np.float32)}, str(path),
              metadata=None if metadata is None else {"lora_adapter_metadata": json.dumps(metadata)})
    return path


def generate(out, *extra) -> list[str]:
    return ["generate", str(COMMITTED_SD15), "--steps", "1", "-q", "-o", str(out), *extra]


# --- files that are no files --------------------------------------------------------------------

@pytest.mark.timeout(60)  # a named pipe opened for reading blocks until a writer comes: the failure was a hang
@pytest.mark.parametrize("flag", ["--lora", "--image", "--prompts"])
def test_a_named_pipe_named_as_an_input_file_is_refused_before_it_is_opened(tmp_path, capsys, flag):
    fifo = tmp_path / "input"
    os.mkfifo(fifo)
    prompt = [] if flag == "--prompts" else ["--prompt", "a"]
    code = main(generate(tmp_path / "x.png", *prompt, flag, str(fifo)))
    one_line_error(capsys, code, 2, str(fifo), "not a regular file")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["optimize", "info", "diff-inputs"])
def test_a_named_pipe_as_a_model_or_its_inputs_is_refused_before_it_is_opened(tmp_path, capsys, command):
    """onnx.load and np.load of a named pipe waited for a writer forever."""
    fifo = tmp_path / "input"
    os.mkfifo(fifo)
    model = str(COMMITTED_SD15 / "text_encoder" / "model.onnx")
    argv = {"optimize": ["optimize", "-i", str(fifo), "-o", str(tmp_path / "out.onnx")], "info": ["info", str(fifo)],
            "diff-inputs": ["diff", model, model, "--runtime", "cpu", "--inputs", str(fifo)]}[command]
    one_line_error(capsys, main(argv), 2, str(fifo), "not a regular file")
    assert not (tmp_path / "out.onnx").exists()


def test_a_device_as_the_prompts_file_is_refused_and_a_huge_file_is_not_read_whole(tmp_path, capsys, monkeypatch):
    """A device is refused unread (/dev/zero never ends: it was read until memory ran out; /dev/null
    stands for it here). A regular file is read up to the limit, no further."""
    from onnxopt.pipeline import several

    code = main(generate(tmp_path / "x.png", "--prompts", os.devnull))
    one_line_error(capsys, code, 2, os.devnull, "not a regular file")
    big = tmp_path / "prompts.txt"
    big.write_text("a cat\n" * 100)
    monkeypatch.setattr(several, "MAX_PROMPTS_BYTES", 64)
    read = []
    real_open = type(big).open

    def spying_open(self, *args, **kwargs):
        handle = real_open(self, *args, **kwargs)
        real_read = handle.read
        handle.read = lambda size=-1: read.append(size) or real_read(size)
        return handle

    monkeypatch.setattr(type(big), "open", spying_open)
    with pytest.raises(several.GenerationError, match="not a prompts file"):
        several.read_prompts(big)
    assert read == [65]


# --- LoRA files and scales ----------------------------------------------------------------------

@pytest.mark.parametrize("metadata, expected", [
    ({"unet.lora_alpha": "8"}, "its alpha '8' (lora_adapter_metadata) is not a number"),
    ({"unet.alpha_pattern": {"attn1.(to_q": 4}}, "not a regular expression"),
    ({"unet.alpha_pattern": ["to_q"]}, "unet.alpha_pattern is not a JSON object"),
])
def test_lora_metadata_of_the_wrong_type_is_refused_in_one_line(tmp_path, metadata, expected):
    """Each was float()'s ValueError, re.error or an AttributeError: exit 3."""
    from onnxopt.lora import LoraError, read_lora

    with pytest.raises(LoraError) as refused:
        read_lora(write_lora(tmp_path / "a.safetensors", metadata))
    assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_a_scale_after_the_colon_that_is_no_number_names_the_scale(tmp_path):
    """``style.safetensors:abc`` was read as a file named so: "cannot read: No such file"."""
    from onnxopt.lora import LoraError, parse_lora_argument

    path = write_lora(tmp_path / "style.safetensors")
    for scale in ("abc", "nan", "inf", ""):
        with pytest.raises(LoraError, match=f"the LoRA scale after the last colon, '{scale}', is not a finite number"):
            parse_lora_argument(f"{path}:{scale}")
    (tmp_path / "a:b.safetensors").write_bytes(path.read_bytes())  # a name with a colon, when it exists, is the file
    assert parse_lora_argument(f"{tmp_path}/a:b.safetensors") == (tmp_path / "a:b.safetensors", 1.0)


def test_scales_that_take_a_weight_past_its_dtype_are_refused_before_any_weight_is_written(tmp_path, capsys):
    """The update graph computes base + scale * delta in float32 and casts to the weight's dtype: a
    scale of 3e38 on a delta of 2, or a float16 weight under a delta past 65504, wrote inf (NaN images)."""
    from onnxopt.lora.files import LoraError
    from onnxopt.lora.session import check_scales
    from onnxopt.lora.targets import Target

    ones = write_lora(tmp_path / "ones.safetensors", value=1.0)  # delta: (alpha / rank) * B @ A = 2 everywhere
    out = tmp_path / "x.png"
    code = main(generate(out, "--prompt", "a", "--lora", f"{ones}:3e38"))
    one_line_error(capsys, code, 2, "ones.safetensors at 3e+38", "beyond float32's finite range")
    assert not out.exists()
    half = Target("w", np.ones((2, 2), np.float16), [np.full((2, 2), 4e4, np.float32), None])
    check_scales({"w": half}, [1.0, 5.0], ["a", "b"])  # 1 + 4e4 fits float16
    for scales in ([2.0, 0.0], [math.nan, 0.0]):
        with pytest.raises(LoraError):
            check_scales({"w": half}, scales, ["a", "b"])
    inf_delta = Target("w", np.ones((2, 2), np.float32), [np.full((2, 2), np.inf, np.float32)])
    with pytest.raises(LoraError, match="finite range"):  # even at scale 0: 0 * inf is NaN
        check_scales({"w": inf_delta}, [0.0], ["a"])


# --- a folder's values ------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, expected", [
    ("beta_end", -1.0, "beta_end must be a number in [0, 1)"),  # torch.linspace of complex sqrt: exit 3
    ("beta_start", "0.1", "beta_start must be a number in [0, 1)"),
    ("shift", -1.0, "shift must be a positive number"),  # a warning, then timesteps outside 0..999
    ("shift", "3", "shift must be a positive number"),
    ("shift", 1e308, "shift must be a positive number"),
    ("base_shift", "x", "base_shift must be a finite number"),  # Flux's calculate_shift: TypeError, exit 3
    ("max_shift", None, "max_shift must be a finite number"),
    ("max_image_seq_len", 256, "two different positive integers"),  # the line through one point: ZeroDivisionError
])
def test_scheduler_values_diffusers_fails_on_mid_run_are_refused(field, value, expected):
    from onnxopt.pipeline.schedulers import SchedulerError, check_config_values

    with pytest.raises(SchedulerError, match=re.escape(expected)):
        check_config_values({"num_train_timesteps": 1000, "base_image_seq_len": 256, field: value})


def test_a_vae_factor_outside_float32_is_refused(tmp_path):
    """scaling_factor 1e39 is finite in JSON and inf in the float32 latents: a RuntimeWarning and a black image."""
    from onnxopt.pipeline.folder import PipelineFolderError, check_config

    for value in (1e39, 1e-300, -0.0):
        with pytest.raises(PipelineFolderError, match="'scaling_factor' must be a positive number in float32's range"):
            check_config(tmp_path / "config.json", "vae_decoder", {"scaling_factor": value})
    check_config(tmp_path / "config.json", "vae_decoder", {"scaling_factor": 0.18215, "shift_factor": None})


# --- images -----------------------------------------------------------------------------------------

def test_an_image_is_read_upright_by_its_exif_orientation_as_diffusers_load_image_reads_it(tmp_path):
    """A phone's photo is stored sideways with the turn in its EXIF: it was used sideways (another
    size and image than diffusers' ``load_image`` gives)."""
    from diffusers.utils import load_image as diffusers_load_image
    from PIL import Image

    from onnxopt.pipeline.images import load_image

    stored = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90° clockwise to view
    path = tmp_path / "photo.png"
    stored.save(path, exif=exif)
    image = load_image(path)
    assert image.size == (48, 64)
    assert np.array_equal(np.asarray(image), np.asarray(diffusers_load_image(str(path))))


# --- python -m models --------------------------------------------------------------------------------

def test_python_m_models_names_the_extra_when_a_package_is_missing(tmp_path, capsys, monkeypatch):
    """A missing torch was a traceback; a missing module of the project itself still is one (a bug)."""
    from models.__main__ import main as models_main

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch: ModuleNotFoundError
    code = models_main(["pipeline", "sd15", "--size", "tiny", "-o", str(tmp_path / "sd15")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == ["python -m models: error: torch is not installed: "
                                              "pip install 'onnxopt[cpu,models]'"], err
    monkeypatch.setitem(sys.modules, "models.pipelines", None)
    with pytest.raises(ModuleNotFoundError):
        models_main(["pipeline", "sd15", "--size", "tiny", "-o", str(tmp_path / "sd15b")])




def test_a_prompts_file_is_split_at_newlines_only(tmp_path):
    """A byte-order mark and CRLF or CR line ends are read as an editor writes them; a form feed, a
    record separator, NEL or U+2028 inside a prompt (text pasted from JSON or a spreadsheet) split it
    in two (str.splitlines), and every later image took the next prompt's number."""
    from onnxopt.pipeline.several import read_prompts

    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("\ufeffa cat\r\na dog\rred\u2028car\nsea\x0cside\x1eview\n\u0085\r\n  \nlast".encode())
    assert read_prompts(prompts) == ["a cat", "a dog", "red\u2028car", "sea\x0cside\x1eview", "last"]
