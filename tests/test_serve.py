"""onnxopt serve on the CPU: two replicas of the tiny SD 1.5 folder behind Ray Serve on loopback.

One service is started for the module (Ray's start-up is most of the time) and stopped by the
last test, with SIGTERM, as an operator would.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> set[tuple[int, str]]:
    """(pid, start time) of every process under ``pid``, read from /proc (start time: a reused pid is another process)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
        starts[int(entry)] = fields[19]
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add((child, starts[child]))
            todo.append(child)
    return found


def _alive(process: tuple[int, str]) -> bool:
    pid, start = process
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[19] == start and fields[0] != "Z"


def request(url: str, body=None, timeout: float = 120):
    """(status, headers, decoded JSON body) of a GET (body None) or a POST."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as answer:
            return answer.status, dict(answer.headers), json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        text = exc.read()
        try:
            payload = json.loads(text)
        except ValueError:
            payload = {"raw": text.decode(errors="replace")}
        return exc.code, dict(exc.headers), payload


@pytest.fixture(scope="module")
def service():
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               RAY_USAGE_STATS_ENABLED="0")
    process = subprocess.Popen(
        [sys.executable, "-m", "onnxopt", "serve", str(FOLDER), "--provider", "cpu", "--replicas", "2",
         "--port", str(port), "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE), "--max-steps", "20"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"onnxopt serve exited: {process.stdout.read()[-2000:]}"
        try:
            if request(base + "/healthz", timeout=5)[0] == 200:
                break
        except (OSError, ValueError):
            pass
        time.sleep(1)
    else:
        process.kill()
        pytest.fail("the service did not answer /healthz in time")
    yield process, base
    if process.poll() is None:  # the shutdown test did not run: stop it anyway
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def _pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


def test_concurrent_requests_equal_generate(service):
    """Requests in flight at once, batched or not, each image equal to the pipeline's own image
    for its settings and seed; image i of a request with seed s is made with seed s + i."""
    from onnxopt.pipeline import Pipeline

    _, base = service
    bodies = [{"prompt": "a red cube", "seed": 7, "n": 2, "steps": 3, "size": "64x64", "guidance": 7.5},
              {"prompt": "a blue sphere", "negative_prompt": "blurry", "seed": 11, "steps": 3, "size": "64x64"},
              {"prompt": "a green cone", "seed": 3, "steps": 2, "scheduler": "euler", "guidance": 1.0}]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: request(base + "/v1/images/generations", b), bodies))
    pipe = Pipeline.load(FOLDER, provider="cpu")
    for body, (status, _, payload) in zip(bodies, answers):
        assert status == 200, payload
        assert [d["seed"] for d in payload["data"]] == [body["seed"] + i for i in range(body.get("n", 1))]
        for image in payload["data"]:
            w, h = (int(p) for p in body["size"].split("x")) if "size" in body else (None, None)
            alone = pipe(body["prompt"], negative_prompt=body.get("negative_prompt"), steps=body["steps"],
                         guidance=body.get("guidance", 7.5), scheduler=body.get("scheduler", "ddim"),
                         seed=image["seed"], height=h, width=w, progress=False)
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
    _, base = service
    status, _, payload = request(base + "/v1/images/generations", body)
    assert status == 400 and needle in payload["error"]["message"], payload
    assert request(base + "/healthz")[0] == 200


def test_wrong_route_and_method(service):
    _, base = service
    assert request(base + "/v1/nothing")[0] == 404
    assert request(base + "/v1/images/generations")[0] == 405


def test_full_queue_answers_503_with_retry_after(service):
    """More requests at once than the replicas take plus the queue holds: the rest get 503 +
    Retry-After at once, every other one its image."""
    _, base = service
    burst = 2 * (MAX_BATCH + 1) + MAX_QUEUE + 6
    body = {"prompt": "load", "steps": 4, "size": "64x64", "seed": 1}
    with ThreadPoolExecutor(burst) as pool:
        answers = list(pool.map(lambda _: request(base + "/v1/images/generations", body), range(burst)))
    statuses = [a[0] for a in answers]
    assert set(statuses) <= {200, 503}, statuses
    assert 503 in statuses and 200 in statuses, statuses
    for status, headers, _ in answers:
        if status == 503:
            assert int({k.lower(): v for k, v in headers.items()}["retry-after"]) >= 1
    assert request(base + "/healthz")[0] == 200
    metrics = request(base + "/metrics")[2]
    assert metrics["queue_depth"] == 0 and metrics["failed"] == 0, metrics


def test_sigterm_stops_the_service_and_every_ray_process(service):
    process, base = service
    tree = _descendants(process.pid)
    assert tree, "Ray's processes run under onnxopt serve"
    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0, process.stdout.read()[-2000:]
    deadline = time.monotonic() + 20
    while any(map(_alive, tree)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [pid for pid, start in tree if _alive((pid, start))]
    names = [Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in left]
    for pid in left:  # not left for the next test run
        os.kill(pid, signal.SIGKILL)
    assert not left, f"left behind: {names}"
    with pytest.raises(OSError):
        urllib.request.urlopen(base + "/healthz", timeout=5)
