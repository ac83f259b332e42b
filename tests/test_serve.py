"""onnxopt serve on the CPU: two replicas of the tiny SD 1.5 folder behind Ray Serve on loopback.

One service is started for the module (Ray's start-up is most of the time) and stopped by the
last test, with SIGTERM, as an operator would. Every test that sends requests at once retries a 503
after its Retry-After, as a client does, where it expects images: Ray's router may refuse a request
before it knows both replicas' capacity (CI saw it on three requests with a queue of two).
"""

from __future__ import annotations

import base64
import io
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="onnxopt serve needs ray[serve] (the serve extra)")
pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "models" / "pipelines" / "sd15-tiny"
START_TIMEOUT_S = 150
MAX_QUEUE = 2
MAX_BATCH = 2

pytestmark = pytest.mark.timeout(300)

from onnxopt.serve.client import ServiceProcess, call, free_port  # noqa: E402 (after the skip)

METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def service():
    service = ServiceProcess(FOLDER, "--provider", "cpu", "--replicas", "2", "--max-batch", str(MAX_BATCH),
                             "--max-queue", str(MAX_QUEUE), "--max-steps", "20", "--metrics-port", str(METRICS_PORT),
                             pythonpath=str(ROOT))
    try:
        service.wait_ready(START_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as exc:
        service.process.kill()
        pytest.fail(str(exc))
    yield service
    if service.process.poll() is None:  # the shutdown test did not run: stop it anyway
        service.stop()


def _pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


def test_concurrent_requests_equal_generate(service):
    """Requests in flight at once, each image equal to the pipeline's own image alone for its
    settings and seed (bit for bit: the PNG's pixels), whether it ran in a batch or not (the first
    request's two images are one batched run; the second's may join them); image i of a request
    with seed s is made with seed s + i."""
    from onnxopt.pipeline import Pipeline

    bodies = [{"prompt": "a red cube", "seed": 7, "n": 2, "steps": 3, "size": "64x64", "guidance": 7.5},
              {"prompt": "a blue sphere", "negative_prompt": "blurry", "seed": 11, "steps": 3, "size": "64x64"},
              {"prompt": "a green cone", "seed": 3, "steps": 2, "scheduler": "euler", "guidance": 1.0}]
    with ThreadPoolExecutor(len(bodies)) as pool:
        # A 503 is the service's answer to a momentarily full queue (Ray's router may hold these
        # before it knows both replicas' capacity); a client retries it, as Retry-After says.
        answers = list(pool.map(lambda b: service.generate(b, busy_retries=5), bodies))
    pipe = Pipeline.load(FOLDER, provider="cpu")
    for body, (status, _, payload) in zip(bodies, answers):
        assert status == 200, payload
        assert [d["seed"] for d in payload["data"]] == [body["seed"] + i for i in range(body.get("n", 1))]
        for image in payload["data"]:
            w, h = (int(p) for p in body["size"].split("x")) if "size" in body else (None, None)
            alone = pipe(body["prompt"], negative_prompt=body.get("negative_prompt"), steps=body["steps"],
                         guidance=body.get("guidance", 7.5), seed=image["seed"], height=h, width=w, progress=False,
                         **({"scheduler": body["scheduler"]} if "scheduler" in body else {}))
            np.testing.assert_array_equal(_pixels(image["b64_json"]), np.asarray(alone.image))


@pytest.mark.parametrize("body, needle", [
    (b"{not json", "not JSON"),
    ([1, 2], "JSON object"),
    ({"n": 1}, "prompt is required"),
    ({"prompt": 3}, "must be a string"),
    ({"prompt": "x", "n": 99}, "n must be in 1..4"),
    ({"prompt": "x", "steps": 500}, "steps must be in 1..20"),
    ({"prompt": "x", "size": "63x64"}, "each side must be a multiple of"),
    ({"prompt": "x", "size": "4096x4096"}, "each side must be a multiple of"),
    ({"prompt": "x", "scheduler": "nope"}, "unknown scheduler"),
    ({"prompt": "x", "guidance": "high"}, "guidance"),
    ({"prompt": "x", "seed": -1}, "seed must be in"),
    ({"prompt": "x", "response_format": "url"}, "b64_json"),
    ({"prompt": "x", "colour": "red"}, "unknown field"),
    ({"prompt": "x" * 1001}, "limit is 1000"),
])
def test_malformed_request_gets_400_and_service_stays_healthy(service, body, needle):
    base = service.base
    status, _, payload = service.generate(body)
    assert status == 400 and needle in payload["error"]["message"], payload
    assert call(base + "/healthz")[0] == 200


def test_wrong_route_and_method(service):
    base = service.base
    assert call(base + "/v1/nothing")[0] == 404
    assert call(base + "/v1/images/generations")[0] == 405


def test_full_queue_answers_503_with_retry_after(service):
    """More requests at once than the replicas take plus the queue holds: the rest get 503 +
    Retry-After at once, every other one its image."""
    base = service.base
    burst = 2 * (2 * MAX_BATCH + 1) + MAX_QUEUE + 6  # 2 replicas: a batch running, one gathering, a slot each
    body = {"prompt": "load", "steps": 2, "size": "64x64", "seed": 1}
    with ThreadPoolExecutor(burst) as pool:
        answers = list(pool.map(lambda _: service.generate(body), range(burst)))
    statuses = [a[0] for a in answers]
    assert set(statuses) <= {200, 503}, statuses
    assert 503 in statuses and 200 in statuses, statuses
    for status, headers, _ in answers:
        if status == 503:
            assert int(headers["retry-after"]) >= 1
    assert call(base + "/healthz")[0] == 200
    metrics = call(base + "/metrics")[2]
    assert metrics["queue_depth"] == 0 and metrics["failed"] == 0, metrics


def _prometheus(name: str) -> list[tuple[dict, float]]:
    """(labels, value) of each sample of ``name`` on the local Ray's metrics export."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=30).read().decode()
    samples = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            samples.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return samples


def test_latency_queue_depth_and_batches_are_prometheus_metrics(service):
    """The replicas' metrics (onnxopt.serve.metrics) reach Prometheus through Ray's export, tagged
    by replica: the latency of the images served above (status ok), each replica's queue depth, and
    batched runs of more than one image (the concurrent test's two-image request)."""
    deadline = time.monotonic() + 60  # Ray exports every few seconds
    while True:
        latency = [(labels, v) for labels, v in _prometheus("ray_onnxopt_request_latency_s_count")
                   if labels.get("status") == "ok"]
        depth = _prometheus("ray_onnxopt_replica_queue_depth")
        runs = _prometheus("ray_onnxopt_batch_images_count")
        single = _prometheus("ray_onnxopt_batch_images_bucket")
        # every figure asserted below, not the first export that has any: a count may lag one export
        if (sum(v for _, v in latency) >= 3 and len({labels["replica"] for labels, _ in depth}) == 2 and runs) \
                or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert sum(v for _, v in latency) >= 3, latency
    assert {labels["deployment"] for labels, _ in depth} == {"ImageService"} and len(depth) == 2, depth
    # a value may be one export old (the burst above): a count of requests, never negative
    assert all(v >= 0 and v == int(v) for _, v in depth), depth
    one_image_runs = sum(v for labels, v in single if labels["le"] == "1.0")
    assert sum(v for _, v in runs) > one_image_runs, (runs, single)  # some run held more than one image


def test_a_killed_replica_fails_its_requests_cleanly(service):
    """benchmarks/serve_load.py's kill, on a short load: one replica SIGKILLed mid-load; every
    request is answered (none hangs, none a dropped connection), each failure a 5xx, and the other
    replica keeps serving. That the replica comes back is the benchmark's to time (its --dry-run
    runs it on the CPU): waiting for Ray's restart here would cost CI ~20 s; the next test stops the
    service while it restarts."""
    from benchmarks.serve_load import offered_step, replica_killer

    killer = replica_killer(service, after_s=0.5, back_within_s=0)
    row = offered_step(service, {"prompt": "load", "steps": 2, "size": "64x64"}, rate=4, seconds=2, deadline_s=120,
                       during=killer)
    assert row["not_http"] == 0 and row["4xx"] == 0 and row["ok"] >= 1, row
    assert killer.report["killed_pid"] is not None, killer.report


def test_sigterm_stops_the_service_and_every_ray_process(service):
    """Also while Ray restarts the replica the test above killed: nothing is left behind."""
    assert service.replica_pids(), "Ray's replicas run under onnxopt serve"
    code, left = service.stop(timeout=90)
    assert code == 0, service.output()[-2000:]
    assert not left, f"left behind: {left}"
    with pytest.raises(OSError):
        urllib.request.urlopen(service.base + "/healthz", timeout=5)
