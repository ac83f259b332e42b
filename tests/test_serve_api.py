"""The service's request checks, batch grouping and metrics, without Ray or a pipeline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from onnxopt.serve.api import SEED_MAX, Defaults, Limits, RequestError, parse_generation
from onnxopt.serve.batching import compatible_groups, run_grouped
from onnxopt.serve.metrics import ReplicaMetrics

SCHEDULERS = ("ddim", "euler")


def parse(body, limits=Limits()):
    return parse_generation(json.dumps(body).encode(), limits, Defaults(), SCHEDULERS, size_factor=8)


def test_n_images_get_consecutive_seeds_and_the_request_settings():
    images = parse({"prompt": "a cat", "n": 3, "seed": 40, "size": "96x64", "steps": 7, "guidance": 3})
    assert [i.seed for i in images] == [40, 41, 42]
    assert {(i.width, i.height, i.steps, i.guidance, i.scheduler) for i in images} == {(96, 64, 7, 3.0, None)}


def test_a_request_without_seed_gets_one_and_defaults():
    images = parse({"prompt": "a cat", "n": 2})
    assert images[1].seed == images[0].seed + 1 and images[0].steps == Defaults().steps


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "x", "seed": SEED_MAX, "n": 2}, "seed must be in"),
    ({"prompt": "x", "n": True}, "n must be an integer"),
    ({"prompt": "x", "guidance": float("nan")}, "finite"),
    ({"prompt": "x", "size": "512"}, "WIDTHxHEIGHT"),
    ({"prompt": "x", "size": "+8x8"}, "WIDTHxHEIGHT"),
    ({"prompt": "  "}, "empty"),
    ({"prompt": "x", "steps": 0}, "steps must be in"),
])
def test_refusals(body, needle):
    with pytest.raises(RequestError, match=needle):
        parse(body)


def test_limits_are_the_configured_ones():
    tight = Limits(max_n=1, max_side=64, max_steps=5, max_prompt_chars=3)
    for body in ({"prompt": "x", "n": 2}, {"prompt": "x", "size": "72x64"}, {"prompt": "x", "steps": 6},
                 {"prompt": "abcd"}):
        with pytest.raises(RequestError):
            parse(body, tight)
    assert parse({"prompt": "abc", "size": "64x64", "steps": 5}, tight)


def test_compatible_requests_share_a_group_up_to_the_batch_size():
    a = parse({"prompt": "a", "n": 3, "seed": 0, "size": "64x64", "steps": 4})
    b = parse({"prompt": "b", "seed": 9, "size": "64x64", "steps": 4})
    other_size = parse({"prompt": "c", "seed": 0, "size": "128x64", "steps": 4})
    no_cfg = parse({"prompt": "d", "seed": 0, "size": "64x64", "steps": 4, "guidance": 1})
    groups = compatible_groups([a, other_size, b, no_cfg], max_images=2)
    assert groups == [[(0, 0), (0, 1)], [(0, 2), (2, 0)], [(1, 0)], [(3, 0)]]  # in order of each group's first image


def test_results_go_back_to_their_requests_in_order():
    a = parse({"prompt": "a", "n": 2, "seed": 0, "steps": 4})
    b = parse({"prompt": "b", "seed": 5, "steps": 4})
    out = run_grouped([a, b], 4, lambda group: [(r.prompt, r.seed) for r in group])
    assert out == [[("a", 0), ("a", 1)], [("b", 5)]]


def test_images_share_a_group_only_with_the_guidance_their_step_applies():
    """The step graph takes one guidance scale: 7.5 and 5 are two runs; guidance <= 1 (off) is one."""
    from onnxopt.pipeline.batch import run_key

    guidances = [7.5, 5, 7.5, 1, 0.5, 1.0]
    images = [parse({"prompt": "a", "seed": 0, "size": "64x64", "steps": 4, "guidance": g})[0] for g in guidances]
    assert compatible_groups([[i] for i in images], max_images=8) == [[(0, 0), (2, 0)], [(1, 0)],
                                                                       [(3, 0), (4, 0), (5, 0)]]
    for a in images:  # the service's key and the pipeline's own run key agree
        for b in images:
            assert (a.compatible_key() == b.compatible_key()) == (run_key(a.guidance) == run_key(b.guidance))


def test_a_failing_group_fails_its_own_requests_only():
    a = parse({"prompt": "a", "n": 2, "seed": 0, "steps": 4})
    b = parse({"prompt": "b", "seed": 5, "steps": 4, "size": "64x64"})
    c = parse({"prompt": "c", "seed": 9, "steps": 4})

    def run(group):
        if any(r.prompt == "b" for r in group):
            raise RuntimeError("device lost")
        return [r.seed for r in group]
    out = run_grouped([a, b, c], 4, run)
    assert out[0] == [0, 1] and out[2] == [9]
    assert isinstance(out[1], RuntimeError) and str(out[1]) == "device lost"


class FakeMetric:
    """Records what the replica reports, with ray.serve.metrics' constructor and method signatures."""

    made: dict = {}

    def __init__(self, name, description="", boundaries=None, tag_keys=None):
        self.name, self.tag_keys, self.values = name, tag_keys or (), []
        FakeMetric.made[name] = self

    def _record(self, value, tags=None):
        assert set(tags or {}) <= set(self.tag_keys), (self.name, tags)
        self.values.append((value, dict(tags or {})))

    inc = set = observe = _record


def test_replica_metrics_export_latency_queue_depth_and_batches():
    FakeMetric.made.clear()
    metrics = ReplicaMetrics(FakeMetric, FakeMetric, FakeMetric)
    made = FakeMetric.made
    assert set(made) == {"onnxopt_request_latency_s", "onnxopt_requests_total", "onnxopt_replica_queue_depth",
                         "onnxopt_batch_images"}
    metrics.queued()
    metrics.queued()
    metrics.dequeued(2)
    metrics.batch_run(3)
    for status, seconds in ((200, 1.5), (200, 0.5), (400, 0.01), (500, 2.0)):
        metrics.answer(status, seconds)
    assert [v for v, _ in made["onnxopt_replica_queue_depth"].values] == [0, 1, 2, 0]
    assert made["onnxopt_batch_images"].values == [(3, {})]
    assert made["onnxopt_request_latency_s"].values == [(1.5, {"status": "ok"}), (0.5, {"status": "ok"}),
                                                        (0.01, {"status": "4xx"}), (2.0, {"status": "5xx"})]
    assert [t["status"] for _, t in made["onnxopt_requests_total"].values] == ["ok", "ok", "4xx", "5xx"]
    assert metrics.snapshot() == {"queue_depth": 0, "served": 2, "failed": 1, "refused": 1,
                                  "latency_p50_s": 1.5, "latency_p99_s": 1.5}


def _row(scenario, replicas, max_batch, load_x, images_per_s, single_s=1.0, p99_s=1.5):
    return {"scenario": scenario, "replicas": replicas, "max_batch": max_batch, "steps": 20, "load_x": load_x,
            "images_per_s": images_per_s, "single_image_s": single_s, "p99_s": p99_s}


def test_load_benchmark_summary_compares_peaks_against_their_baselines():
    from benchmarks.serve_load import _parse, markdown, summary

    dry = _parse(["models/pipelines/sd15-tiny", "--dry-run"])
    assert (dry.provider, dry.size, dry.steps) == ("cpu", "64x64", [2]) and dry.step_s <= 10
    rows = [_row("batching-off", 1, 1, 1, 2.0), _row("batching-off", 1, 1, 3, 2.5), _row("batching-on", 1, 4, 1, 2.0),
            _row("batching-on", 1, 4, 3, 4.0, p99_s=1.8), _row("replicas-2", 2, 4, 3, 7.8),
            dict(_row("replica-killed", 2, 4, 2, 3.0), replica_back_s=20.0)]
    summed = {r["scenario"]: r for r in summary(rows)}
    assert set(summed) == {"batching-off", "batching-on", "replicas-2"}  # a kill run is no throughput peak
    assert summed["batching-off"]["gain"] is None
    assert summed["batching-on"]["gain"] == pytest.approx(1.6) and summed["batching-on"]["p99_over_single"] == 1.8
    assert summed["replicas-2"]["gain"] == pytest.approx(1.95)
    table = markdown(rows, list(summed.values()))
    assert "| replica-killed | 2 | 4 |" in table and "| 1.95 |" in table


class FakeService:
    """Answers as a service under a kill would: images, a full queue, a dead replica, a dropped connection."""

    def __init__(self, answers):
        self.answers = answers

    def generate(self, body, timeout=None):
        answer = self.answers[body["seed"] % len(self.answers)]
        if isinstance(answer, Exception):
            raise answer
        return answer, {}, {"data": [{}]} if answer == 200 else {"error": {"message": "x"}}


def test_load_step_counts_each_kind_of_failure_apart():
    from benchmarks.serve_load import offered_step

    service = FakeService([200, 503, 500, ConnectionResetError("reset"), 200, TimeoutError("timed out")])
    row = offered_step(service, {"prompt": "x"}, rate=200, seconds=0.06, deadline_s=1)
    assert row["requests"] == 12 and row["ok"] == 4
    assert (row["503"], row["other_5xx"], row["4xx"], row["not_http"]) == (2, 2, 0, 4)


def parse_raw(raw: bytes):
    return parse_generation(raw, Limits(), Defaults(), SCHEDULERS, size_factor=8)


@pytest.mark.parametrize("raw, needle", [
    (b'{"prompt": "a", "model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"prompt": "a", "guidance": 1' + b"0" * 400 + b"}", "guidance must be a finite number"),
    (b'{"prompt": "a", "size": "\xc2\xb2x512"}', "WIDTHxHEIGHT"),  # superscript two: isdigit() says yes, int() no
    (b'{"prompt": "a", "size": "' + b"9" * 5000 + b'x512"}', "each side must be"),  # past int()'s 4300 digits
    (b'{"prompt": "a", "seed": 1, "seed": 2}', "repeats field 'seed'"),
    (b'{"prompt": "a", "prompt": "b"}', "repeats field 'prompt'"),
], ids=["deep-nesting", "huge-integer-guidance", "superscript-size", "size-of-5000-digits", "repeated-seed",
        "repeated-prompt"])
def test_hostile_bodies_are_a_400_not_a_500(raw, needle):
    """Each raised outside RequestError (RecursionError, OverflowError, ValueError: a 500 with Ray's
    traceback), or took a repeated field's last value where a proxy that checked it reads the first."""
    with pytest.raises(RequestError, match=needle) as refused:
        parse_raw(raw)
    assert refused.value.status == 400 and "\n" not in str(refused.value) and len(str(refused.value)) < 200


@pytest.mark.parametrize("size", ["\u0665\u0661\u0662x\u0665\u0661\u0662", "\uff15\uff11\uff12x\uff15\uff11\uff12",
                                  "512x512\n", "5_12x512"])
def test_a_size_is_ascii_digits_only(size):
    """Arabic-Indic and full-width digits were taken as 512 (str.isdigit and int() read them)."""
    with pytest.raises(RequestError, match="WIDTHxHEIGHT"):
        parse({"prompt": "a", "size": size})


def test_an_echoed_value_is_cut_short():
    """A seed of 4000 digits (json.loads takes up to 4300) came back whole in the message."""
    with pytest.raises(RequestError, match=r"seed must be in .*\(4001 characters\)$") as refused:
        parse_raw(b'{"prompt": "a", "seed": 1' + b"0" * 4000 + b"}")
    assert len(str(refused.value)) < 120


def test_null_is_a_field_left_out():
    """As OpenAI's API reads it: guidance and response_format null were refused where n and steps null
    took the default."""
    left_out = parse({"prompt": "a", "seed": 3})
    assert parse({"prompt": "a", "seed": 3, "n": None, "steps": None, "guidance": None, "scheduler": None,
                  "size": None, "negative_prompt": None, "response_format": None}) == left_out
    with pytest.raises(RequestError, match="prompt is required"):
        parse({"prompt": None})


PIPELINES = Path(__file__).resolve().parents[1] / "models" / "pipelines"


def folder_copy(tmp_path: Path, name: str, **configs) -> Path:
    """A copy of a shipped tiny folder, each ``configs`` entry (a component's config.json, or
    model_index.json as "index") updated with its fields."""
    folder = tmp_path / name
    shutil.copytree(PIPELINES / name, folder)
    for component, fields in configs.items():
        path = folder / ("model_index.json" if component == "index" else f"{component}/config.json")
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return folder


@pytest.mark.parametrize("name, configs, needle", [
    ("sd35-tiny-optimum", {}, "is a sd3 pipeline"),
    ("flux-schnell-tiny-optimum", {}, "is a flux pipeline"),
    ("sd15-tiny", {"unet": {"in_channels": 9}}, "inpainting"),
])
def test_a_folder_the_batched_run_cannot_make_is_refused_before_ray_starts(tmp_path, capsys, monkeypatch, name, configs,
                                                                          needle):
    """SD3 and Flux folders were served and every request was a 500 (AttributeError in the batched
    run, which is the UNet families'); an inpainting folder's every request a 400."""
    ray = pytest.importorskip("ray", reason="onnxopt serve imports Ray before it reads the folder")
    from onnxopt.cli import main

    def started(*args, **kwargs):
        raise AssertionError("Ray started for a folder the service cannot run")
    monkeypatch.setattr(ray, "init", started)
    code = main(["serve", str(folder_copy(tmp_path, name, **configs)), "--provider", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_a_request_without_steps_or_guidance_gets_the_familys_as_generate_does(tmp_path):
    """An LCM folder served 50 steps at guidance 7.5 (SD's) where generate runs its 4 at 8.5."""
    from onnxopt.serve.adapter import check_servable, folder_defaults
    from onnxopt.pipeline import PipelineFolder

    lcm = folder_copy(tmp_path, "sd15-tiny", index={"_class_name": "LatentConsistencyModelPipeline"},
                      unet={"time_cond_proj_dim": 32})
    folder = PipelineFolder.open(lcm)
    check_servable(folder)
    defaults, factor = folder_defaults(str(lcm))
    assert (defaults.steps, defaults.guidance, factor) == (folder.family.default_steps, folder.family.default_guidance,
                                                           folder.vae_scale_factor) == (4, 8.5, 2)
