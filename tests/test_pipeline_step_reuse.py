"""Step reuse (``--reuse``): a reused step is diffusers' ``scheduler.step`` on the last computed
guided prediction, and nothing else.

Claims, on tiny folders from ``models/`` (fp32, CPU EP):
* the fused loop with a reuse schedule (host loop, and the bound-buffer loop of the CUDA EP run on
  CPU buffers) gives the unfused loop's latents with the same schedule, which calls diffusers'
  own ``scheduler.step`` with the cached prediction, for DDIM-free configs of every scheduler;
* reused steps run no UNet (the step graph's run count) and really change the image;
* an empty schedule is the plain loop; bad schedules are one-line errors (exit 2 in the CLI).
"""

import subprocess
import sys

import numpy as np
import pytest

from onnxopt.pipeline import Pipeline
from onnxopt.pipeline.runner import GenerationError
from onnxopt.pipeline.step_reuse import ReuseScheduleError, parse_reuse
from tests.test_pipeline_generate import COMMITTED_SD15, PROMPT, ROOT, THREADS, built  # noqa: F401

STEPS = 6
REUSE = "2-5:2"  # steps 2 and 4 reuse steps 1's and 3's predictions


def request(b, **overrides):
    return {**b.request(), "steps": STEPS, "progress": False, **overrides}


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


@pytest.mark.parametrize("kind, scheduler", [("sd15", "dpm++2m"), ("sd15", "euler"), ("sd15-controlnet", "dpm++2m")])
def test_reused_steps_equal_diffusers_step_on_the_cached_prediction(built, kind, scheduler):
    b = built(kind)
    unfused = Pipeline.load(b.folder, "cpu", fused_step=False, threads=THREADS)(
        **request(b, scheduler=scheduler, reuse=REUSE))
    fused = b.onnx()(**request(b, scheduler=scheduler, reuse=REUSE))
    bound = Pipeline.load(b.folder, "cpu", io_binding=True, threads=THREADS)(**request(b, scheduler=scheduler, reuse=REUSE))
    assert fused.timings["unet_steps"] == unfused.timings["unet_steps"] == STEPS - 2
    close(fused.latents, unfused.latents)
    close(bound.latents, unfused.latents)
    full = b.onnx()(**request(b, scheduler=scheduler))
    assert not np.allclose(fused.latents, full.latents, rtol=0, atol=1e-3 * np.abs(full.latents).max())


def test_reused_steps_do_not_run_the_unet(built):
    b = built("sd15")
    pipe = Pipeline.load(b.folder, "cpu", io_binding=True, threads=THREADS, scheduler="euler")
    runs = {"step": 0, "reuse": 0}
    for name in runs:
        session = pipe.sessions[name]
        original = session.run_with_iobinding

        def counted(*args, _name=name, _original=original, **kwargs):
            runs[_name] += 1
            return _original(*args, **kwargs)

        session.run_with_iobinding = counted
    pipe(**request(b, scheduler="euler", reuse="1,3-5"))
    assert runs == {"step": 2, "reuse": 4}


def test_an_empty_schedule_is_the_plain_loop(built):
    b = built("sd15")
    plain = b.onnx()(**request(b, scheduler="euler"))
    for empty in (None, "", [], " "):
        np.testing.assert_array_equal(b.onnx()(**request(b, scheduler="euler", reuse=empty)).latents, plain.latents)


@pytest.mark.parametrize("spec, steps, expected", [
    ("30-49:2", 50, set(range(30, 50, 2))), ("3,5", 6, {3, 5}), ("1-3", 4, {1, 2, 3}), (" 2 , 4-4 ", 5, {2, 4}),
    ([1, 2], 3, {1, 2}),
])
def test_schedules_parse(spec, steps, expected):
    assert parse_reuse(spec, steps) == expected


@pytest.mark.parametrize("spec, message", [
    ("0,2", "step 0 has no previous prediction"), ("2-9", "step 6 is outside 0..5"), ("a", "cannot read 'a'"),
    ("4-2", "cannot read '4-2'"), ("1-3:0", "cannot read '1-3:0'"), ("1,,2", "cannot read ''"),
])
def test_bad_schedules_are_refused(spec, message):
    with pytest.raises(ReuseScheduleError, match=message):
        parse_reuse(spec, 6)


def test_the_cli_reuses_and_refuses(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "onnxopt", "generate", str(COMMITTED_SD15), "--prompt", PROMPT,
                               "--steps", "3", "--scheduler", "euler", "-q", *map(str, args)], capture_output=True,
                              text=True, cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})

    done = cli("--reuse", "2", "-o", tmp_path / "a.png", "--json", tmp_path / "a.json")
    assert done.returncode == 0, done.stderr
    assert __import__("json").loads((tmp_path / "a.json").read_text())["unet_steps"] == 2
    bad = cli("--reuse", "0", "-o", tmp_path / "b.png")
    assert bad.returncode == 2 and not (tmp_path / "b.png").exists()
    assert "step 0 has no previous prediction" in bad.stderr and "Traceback" not in bad.stderr
    with pytest.raises(GenerationError, match="outside"):
        Pipeline.load(COMMITTED_SD15, "cpu")(PROMPT, steps=3, reuse="5", progress=False)


def test_the_quality_curve_command_runs(tmp_path):
    """benchmarks/step_reuse_curve.py on the committed tiny folder (CPU): one row per schedule and
    one per 'fewer steps' of the same compute, each against the full schedule."""
    import json

    from benchmarks.step_reuse_curve import main

    assert main(["--folder", str(COMMITTED_SD15), "--steps", "4", "--scheduler", "euler", "--schedules", "2-3:2", "3",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["schedule"], r["unet_steps"]) for r in rows] == [
        ("full", 4), ("reuse 2-3:2", 3), ("3 steps", 3), ("reuse 3", 3), ("3 steps", 3)]
    assert rows[0]["latents_max_abs"] == 0 and all(r["latents_max_abs"] > 0 for r in rows[1:])
