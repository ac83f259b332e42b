"""Folders that look like one family and hold configs of another: the shipped tiny folders copied,
one JSON field changed. Each is refused before the work with the file that says it (exit 2), or
run as diffusers' pipeline of its model_index.json would run it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from onnxopt.cli import main
from tests.test_adversarial_round9 import edit_json, one_line_error

PIPELINES = Path(__file__).resolve().parents[1] / "models" / "pipelines"


def copy_of(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(PIPELINES / name, folder)
    return folder


def generate_argv(folder: Path, out: Path, *extra: str) -> list[str]:
    return ["generate", str(folder), "--prompt", "a cat", "--steps", "2", "--height", "32", "--width", "32", "-q",
            "-o", str(out), *extra]


@pytest.mark.parametrize("component, fields, fragment", [
    ("vae_decoder", {"latent_channels": 16}, "unet/config.json: out_channels 4, but"),
    ("unet", {"in_channels": 8}, "unet/config.json: in_channels 8 is neither the latents' 4"),
    ("unet", {"out_channels": 8}, "unet/config.json: out_channels 8, but"),
], ids=["sd3-vae-config-in-sd15", "instruct-pix2pix-unet-config", "learned-variance-unet-config"])
@pytest.mark.parametrize("command", ["generate", "optimize"])
def test_unet_and_vae_configs_of_different_models_are_refused_by_name(tmp_path, capsys, component, fields, fragment,
                                                                      command):
    """A VAE config of 16 latent channels beside SD 1.5's UNet was refused by generate as "an
    inpainting UNet" (its UNet was not one) and optimized without a word; a UNet config of 8 input or
    output channels was run (the graph's 4 won) or called an inpainting UNet."""
    folder = copy_of(tmp_path, "sd15-tiny")
    edit_json(folder / component / "config.json", **fields)
    out = tmp_path / ("x.png" if command == "generate" else "opt")
    argv = generate_argv(folder, out) if command == "generate" else ["optimize", "-i", str(folder), "-o", str(out), "-q"]
    line = one_line_error(capsys, main(argv), 2, fragment)
    assert "inpainting UNet:" not in line and not out.exists()


@pytest.mark.parametrize("index_class, config_class, expected", [
    ("PNDMScheduler", "HeunDiscreteScheduler", "pndm"),
    ("EulerDiscreteScheduler", "PNDMScheduler", "euler"),
])
def test_the_plan_names_the_scheduler_the_run_makes(tmp_path, capsys, index_class, config_class, expected):
    """diffusers makes model_index.json's scheduler class (the config's _class_name only warns); the
    run did, but --plan read the config's and printed "none onnxopt runs" or the other scheduler."""
    from onnxopt.pipeline import PipelineFolder
    from onnxopt.pipeline.runner import check_request

    folder = copy_of(tmp_path, "sd15-tiny")
    edit_json(folder / "model_index.json", scheduler=["diffusers", index_class])
    edit_json(folder / "scheduler" / "scheduler_config.json", _class_name=config_class)
    assert main(["generate", str(folder), "--plan"]) == 0
    shown = [line.split(":", 1)[1].strip() for line in capsys.readouterr().out.splitlines()
             if line.strip().startswith("scheduler:")]
    assert shown == [expected] == [check_request(PipelineFolder.open(folder), steps=2)]


@pytest.mark.parametrize("name, scheduler_class", [
    ("sd35-tiny-optimum", "DDIMScheduler"),
    ("flux-schnell-tiny-optimum", "DDIMScheduler"),
    ("sd15-tiny", "FlowMatchEulerDiscreteScheduler"),
])
def test_a_folders_own_scheduler_its_denoiser_does_not_run_is_refused_by_the_request_check(tmp_path, capsys, name,
                                                                                            scheduler_class):
    """check_request (generate's, and the service's per request) took a DDIM folder scheduler for an SD3
    folder (the load refused it later) and refused Flux's with diffusers' TypeError text."""
    from onnxopt.pipeline import PipelineFolder
    from onnxopt.pipeline.runner import GenerationError, check_request

    folder = copy_of(tmp_path, name)
    edit_json(folder / "model_index.json", scheduler=["diffusers", scheduler_class])
    edit_json(folder / "scheduler" / "scheduler_config.json", _class_name=scheduler_class)
    with pytest.raises(GenerationError, match=f"scheduler: the folder's scheduler {scheduler_class} .* is not one a") as caught:
        check_request(PipelineFolder.open(folder), steps=2)
    assert "TypeError" not in str(caught.value)
    out = tmp_path / "x.png"
    one_line_error(capsys, main(generate_argv(folder, out)), 2, f"{folder / 'scheduler'}: the folder's scheduler")
    assert not out.exists()


@pytest.mark.parametrize("case", ["model_max_length-512", "t5-tokenizer-in-clips-place"])
def test_optimize_refuses_a_tokenizer_longer_than_its_text_encoder_as_generate_does(tmp_path, capsys, case):
    """generate refused a tokenizer that pads to 512 tokens beside CLIP's 77 positions; optimize wrote
    the folder (exit 0) with ORT's stray "unsupported broadcast between 512 77" and no static text graph."""
    if case == "model_max_length-512":
        folder = copy_of(tmp_path, "sd15-tiny")
        edit_json(folder / "tokenizer" / "tokenizer_config.json", model_max_length=512)
    else:
        folder = copy_of(tmp_path, "flux-schnell-tiny-optimum")
        shutil.rmtree(folder / "tokenizer")
        shutil.copytree(folder / "tokenizer_2", folder / "tokenizer")
    out = tmp_path / "opt"
    one_line_error(capsys, main(["optimize", "-i", str(folder), "-o", str(out), "-q"]), 2,
                   "the tokenizer pads prompts to 512 tokens (model_max_length), text_encoder takes at most 77")
    assert not out.exists()


def test_a_scheduler_class_from_model_index_is_said_to_come_from_there():
    """model_index.json's class is the one diffusers makes; the refusal said "(scheduler_config.json)",
    a file that names another class."""
    from onnxopt.pipeline.schedulers import SchedulerError, folder_scheduler

    with pytest.raises(SchedulerError, match=r"HeunDiscreteScheduler \(model_index.json\)"):
        folder_scheduler({"_class_name": "PNDMScheduler"}, "HeunDiscreteScheduler")
    with pytest.raises(SchedulerError, match=r"HeunDiscreteScheduler \(scheduler_config.json\)"):
        folder_scheduler({"_class_name": "HeunDiscreteScheduler"}, "HeunDiscreteScheduler")
