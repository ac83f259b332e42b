"""The replica: one optimized pipeline on one GPU (or the CPU), behind Ray Serve's HTTP proxy.

    GET  /healthz                  200 {"status": "ok"} once this replica's pipeline is loaded
    GET  /metrics                  this replica's counters (Prometheus gets Ray Serve's own and
                                   the histograms below through Ray's metrics export)
    POST /v1/images/generations    see onnxopt.serve.api

A request is checked in full before it joins the batch queue (a bad one costs no GPU time). Ray
Serve's ``@serve.batch`` collects the requests waiting on this replica; :mod:`onnxopt.serve.batching`
splits them by compatibility; the pipeline runs in a worker thread so that the replica keeps
answering /healthz while it denoises (``@serve.batch`` runs one batch at a time: the pipeline is
never used by two threads at once).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

from ray import serve
from ray.serve.metrics import Gauge, Histogram
from starlette.requests import Request
from starlette.responses import JSONResponse

from onnxopt.serve import adapter
from onnxopt.serve.api import Limits, RequestError, error_body, parse_generation
from onnxopt.serve.batching import run_grouped

GENERATIONS_PATH = "/v1/images/generations"
LATENCY_BOUNDARIES_S = [0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128]


@dataclass(frozen=True)
class ServiceConfig:
    folder: str
    provider: str = "cpu"
    replicas: int = 1
    max_batch: int = 4  # images in one batched run
    batch_wait_s: float = 0.05  # how long a replica waits for a batch to fill
    max_queued: int = 16  # requests waiting for a replica, over all replicas; then 503
    limits: Limits = field(default_factory=Limits)
    retry_after_s: int = 2


@serve.deployment
class ImageService:
    def __init__(self, config: ServiceConfig):
        self.config = config
        self.pipe = adapter.load_pipeline(config.folder, config.provider)
        defaults, self.size_factor = adapter.folder_defaults(config.folder)
        # a service whose step limit is under generate's default: a request without steps gets the limit
        self.defaults = dataclasses.replace(defaults, steps=min(defaults.steps, config.limits.max_steps))
        self.schedulers = adapter.schedulers()
        self.bad_request = adapter.bad_request_errors()
        self.generate_batched.set_max_batch_size(config.max_batch)
        self.generate_batched.set_batch_wait_timeout_s(config.batch_wait_s)
        self.waiting = 0  # requests checked and queued on this replica, not yet being run
        self.recent_s: deque = deque(maxlen=1000)
        self.served = self.failed = 0
        self.latency = Histogram("onnxopt_request_latency_s", "seconds from a request's arrival at the replica to its answer",
                                 boundaries=LATENCY_BOUNDARIES_S)
        self.queue_depth = Gauge("onnxopt_replica_queue_depth", "requests queued on the replica for a batch")
        self.batch_size = Histogram("onnxopt_batch_images", "images in one batched run", boundaries=[1, 2, 4, 8, 16, 32])

    async def __call__(self, request: Request):
        path = request.url.path.rstrip("/") or "/"
        if path == "/healthz" and request.method == "GET":
            return JSONResponse({"status": "ok"})
        if path == "/metrics" and request.method == "GET":
            return JSONResponse(self.metrics())
        if path != GENERATIONS_PATH:
            return JSONResponse(error_body(f"no such route: {request.method} {path}"), status_code=404)
        if request.method != "POST":
            return JSONResponse(error_body(f"{path} takes POST"), status_code=405)
        return await self.generations(await request.body())

    async def generations(self, raw: bytes) -> JSONResponse:
        start = time.perf_counter()
        try:
            images = parse_generation(raw, self.config.limits, self.defaults, self.schedulers, self.size_factor)
            adapter.check_against_folder(self.pipe, images[0])  # one check serves all: they differ by seed only
        except RequestError as exc:
            return JSONResponse(error_body(str(exc)), status_code=exc.status)
        except self.bad_request as exc:
            return JSONResponse(error_body(str(exc)), status_code=400)
        self.waiting += 1
        self.queue_depth.set(self.waiting)
        try:
            pngs = await self.generate_batched(images)
        except self.bad_request as exc:  # e.g. a guidance that makes a non-finite image
            self.failed += 1
            return JSONResponse(error_body(str(exc)), status_code=400)
        except Exception as exc:  # a fault of the replica, not the request: 500, one line
            self.failed += 1
            first = next((line for line in str(exc).splitlines() if line.strip()), "")
            return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {first}"), status_code=500)
        finally:
            self.latency.observe(time.perf_counter() - start)
        self.served += 1
        self.recent_s.append(time.perf_counter() - start)
        data = [{"b64_json": base64.b64encode(png).decode("ascii"), "seed": image.seed} for png, image in zip(pngs, images)]
        return JSONResponse({"created": int(time.time()), "data": data})

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.05)
    async def generate_batched(self, requests: list) -> list:
        """Each element: one request's images; the answer: each request's PNGs."""
        self.waiting -= len(requests)
        self.queue_depth.set(self.waiting)
        self.batch_size.observe(sum(len(r) for r in requests))
        run = lambda group: adapter.make_images(self.pipe, group)  # noqa: E731
        results = await asyncio.to_thread(run_grouped, requests, self.config.max_batch, run)
        return results

    def metrics(self) -> dict:
        recent = sorted(self.recent_s)
        pick = lambda q: recent[min(len(recent) - 1, int(q * len(recent)))] if recent else None  # noqa: E731
        return {"queue_depth": self.waiting, "served": self.served, "failed": self.failed,
                "latency_p50_s": pick(0.5), "latency_p99_s": pick(0.99)}


def build_app(config: ServiceConfig):
    """The bound deployment: ``config.replicas`` replicas, each on one GPU (cuda) or none (cpu), each
    taking up to ``max_batch`` requests at once; up to ``max_queued`` more wait, the next gets 503."""
    gpus = 0 if config.provider == "cpu" else 1
    return ImageService.options(
        num_replicas=config.replicas,
        ray_actor_options={"num_gpus": gpus, "num_cpus": 0},
        max_ongoing_requests=config.max_batch + 1,  # a batch, and one slot for /healthz or a refusal
        max_queued_requests=config.max_queued,
        backpressure_config={"status_code": 503, "retry_after_s": config.retry_after_s},
        graceful_shutdown_timeout_s=120,  # drain: an image in flight finishes before its replica stops
        health_check_period_s=5,
    ).bind(config)
