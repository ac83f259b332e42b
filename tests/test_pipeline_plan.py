"""Claims about the generation plan: one object, computed from the folder and the options before any
session exists, that says what a generation runs; the runner makes exactly its sessions.

* The tiny SD 1.5 folder's plan on the CPU lists its components, its step graph (built in memory
  from unet/model.onnx: the folder has no step.onnx) and one session entry per graph, the text
  encoder made on first use; on CUDA the same graphs are on bound buffers with capture asked.
* ``fused_step=False``: diffusers' loop, the UNet at every step.
* ``Pipeline.load`` makes the plan's sessions, no others.
* ``onnxopt generate FOLDER --plan`` prints it and writes nothing (a scheduler the fused step cannot
  run plans diffusers' loop); ``--json`` of a run carries it.
* Guidance <= 1 (diffusers' do_classifier_free_guidance False): the plan says CFG is off, the prompt
  alone, and which step runs (the step graph without its guidance rows, made at load instead of the
  guided one; or the UNet at one row per image).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onnxopt.cli import main
from onnxopt.pipeline import PipelineFolder
from onnxopt.pipeline.plan import BOUND, HOST, STEP_LOOP, PlanOptions, plan_generation

SD15 = Path(__file__).resolve().parents[1] / "models" / "pipelines" / "sd15-tiny"


def test_the_tiny_folders_plan_lists_its_components_and_step_graph():
    plan = plan_generation(PipelineFolder.open(SD15), "cpu")
    assert plan.kind == "sd" and plan.components == ["text_encoder", "unet", "vae_decoder"]
    assert plan.step == "built in memory from unet/model.onnx" and plan.build_step_graph
    assert plan.step_loop == "host feeds" and not plan.capture
    entries = {e.key: e for e in plan.sessions}
    assert list(entries) == ["vae_decoder", "vae_encoder", "text_encoder", "step", "step+history", "step_no_cfg",
                             "step_no_cfg+history", "reuse"]
    # guidance per request: the guided one at load, the other on first use; the folder's PNDM: the one with its
    # history in the plain one's place, the plain one on first use (by a request with another scheduler)
    assert not entries["step+history"].lazy and entries["step"].lazy
    assert entries["step_no_cfg"].lazy and entries["step_no_cfg+history"].lazy
    assert entries["step+history"].graph == "unet/model.onnx, built in memory, with PNDM's history"
    assert entries["vae_decoder"].graph == "vae_decoder/model.onnx" and entries["vae_decoder"].binds == HOST
    assert entries["text_encoder"].lazy and entries["step"].binds == STEP_LOOP
    assert json.loads(json.dumps(plan.as_dict()))["sessions"][3]["graph"] == "unet/model.onnx, built in memory"


def test_on_cuda_the_same_graphs_are_bound_and_captured():
    plan = plan_generation(PipelineFolder.open(SD15), "cuda")
    entries = {e.key: e for e in plan.sessions}
    assert plan.step_loop == "bound buffers" and plan.capture
    assert entries["vae_decoder"].binds == BOUND and entries["vae_decoder"].capture and entries["step"].capture
    assert not plan_generation(PipelineFolder.open(SD15), "cuda", PlanOptions(cuda_graph=False)).capture


def test_the_unfused_plan_runs_the_unet_every_step():
    plan = plan_generation(PipelineFolder.open(SD15), "cpu", PlanOptions(fused_step=False))
    assert plan.step == plan.step_loop == "unfused"
    assert [e.key for e in plan.sessions] == ["vae_decoder", "vae_encoder", "text_encoder", "unet"]


@pytest.mark.parametrize("fused_step", [True, False])
def test_load_makes_the_plans_sessions_and_no_other(fused_step):
    pytest.importorskip("diffusers")
    from onnxopt.pipeline.runner import Pipeline

    pipe = Pipeline.load(SD15, "cpu", threads=1, fused_step=fused_step)
    assert set(pipe.sessions) == {e.key for e in pipe.plan.sessions if not e.lazy}
    assert pipe.step_source == pipe.plan.step


def test_generate_plan_prints_it_and_writes_nothing(tmp_path, capsys):
    """With DDIM the step graph is built from the UNet; with the folder's own scheduler (PNDM) too,
    with its history; UniPC (its corrector) runs diffusers' loop, and no step graph is built."""
    out = tmp_path / "cat.png"
    assert main(["generate", str(SD15), "--plan", "--scheduler", "ddim", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "components: text_encoder, unet, vae_decoder" in text and "step graph: built in memory" in text
    assert "vae_decoder/model.onnx: once per image" in text
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert main(["generate", str(SD15), "--plan"]) == 0
    text = capsys.readouterr().out
    assert "scheduler:  pndm" in text and "step graph: built in memory" in text
    assert "step+history         unet/model.onnx, built in memory, with PNDM's history: every step" in text
    assert "with PNDM's history: every step (PNDM), step loop\n" in text
    assert "step                 unet/model.onnx, built in memory: every step, step loop, made on first use" in text
    assert main(["generate", str(SD15), "--plan", "--scheduler", "unipc"]) == 0
    text = capsys.readouterr().out
    assert "step graph: unfused" in text and "unet/model.onnx: every step" in text


@pytest.mark.parametrize("scheduler, guidance, says", [
    ("ddim", "1", "CFG off (guidance <= 1): the prompt alone, the negative prompt ignored; the step graph of "
                  "unet/model.onnx without its guidance rows, built in memory (one row per image)"),
    ("ddim", "0.7", "CFG off"),
    ("unipc", "1", "CFG off (guidance <= 1): the prompt alone, the negative prompt ignored; unet on the prompt's "
                   "row alone (one row per image)"),
    ("ddim", "7.5", "CFG on (guidance > 1): [negative; prompt] rows, two per image"),
    ("ddim", None, "CFG on (guidance > 1)"),  # the family's default guidance, 7.5
])
def test_generate_plan_says_whether_cfg_runs(capsys, scheduler, guidance, says):
    assert main(["generate", str(SD15), "--plan", "--scheduler", scheduler, *(["--guidance", guidance] if guidance else [])]) == 0
    text = capsys.readouterr().out
    assert f"guidance:   {says}" in text
    no_cfg = "step_no_cfg          the step graph of unet/model.onnx without its guidance rows, built in memory: every step"
    assert (no_cfg in text) == (scheduler == "ddim")  # unipc: unfused
    if guidance in ("1", "0.7") and scheduler == "ddim":  # made at load; the guided one only on first use
        assert "made on first use" not in text.split("step_no_cfg")[1].splitlines()[0]
        assert "every step with guidance > 1, step loop, made on first use" in text


def test_load_for_guidance_off_makes_the_step_without_guidance_alone():
    pytest.importorskip("diffusers")
    from onnxopt.pipeline.plan import HISTORY_STEP, NO_CFG_STEP, STEP_SESSIONS
    from onnxopt.pipeline.runner import Pipeline

    pipe = Pipeline.load(SD15, "cpu", threads=1, guidance=1.0)  # the folder's PNDM: its history's step at load
    assert set(pipe.sessions) & set(STEP_SESSIONS) == {NO_CFG_STEP + HISTORY_STEP} and pipe.fused_step
    pipe("a cat", steps=2, guidance=1.0, height=32, width=48, progress=False)
    assert set(pipe.sessions) & set(STEP_SESSIONS) == {NO_CFG_STEP + HISTORY_STEP}
    assert pipe.plan.as_dict()["classifier_free_guidance"] is False


def test_generate_without_a_prompt_or_output_is_a_usage_error(tmp_path, capsys):
    assert main(["generate", str(SD15), "-o", str(tmp_path / "x.png")]) == 2
    assert "needs --prompt" in capsys.readouterr().err


@pytest.mark.models
def test_generate_json_carries_the_plan(tmp_path):
    pytest.importorskip("diffusers")
    out, timings = tmp_path / "cat.png", tmp_path / "t.json"
    assert main(["generate", str(SD15), "--prompt", "a cat", "--steps", "1", "--height", "32", "--width", "32",
                 "--scheduler", "ddim", "-o", str(out), "--json", str(timings), "-q"]) == 0
    plan = json.loads(timings.read_text())["plan"]
    assert plan["components"] == ["text_encoder", "unet", "vae_decoder"] and plan["step"].startswith("built in memory")
