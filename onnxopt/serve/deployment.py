"""The replica: one optimized pipeline on one GPU (or the CPU), behind Ray Serve's HTTP proxy.

    GET  /healthz                  200 {"status": "ok", "pid": the replica's process} once its pipeline is loaded
    GET  /metrics                  this replica's numbers as JSON (Prometheus gets them, and Ray
                                   Serve's own, from Ray's metrics export: onnxopt.serve.metrics)
    POST /v1/images/generations    see onnxopt.serve.api

A request is checked in full before it joins the batch queue (a bad one costs no GPU time). Ray
Serve's ``@serve.batch`` collects the requests waiting on this replica; :mod:`onnxopt.serve.batching`
splits them by compatibility, each group one batched denoising run (a group that fails fails its own
requests only); the pipeline runs in a worker thread so that the replica keeps
answering /healthz while it denoises (``@serve.batch`` runs one batch at a time: the pipeline is
never used by two threads at once). Each request encodes its own PNGs in a worker thread after its
batch returns, so the encoding (CPU) overlaps the next batch's denoising (GPU).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import time
from dataclasses import dataclass, field

from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram
from starlette.requests import Request
from starlette.responses import JSONResponse

from onnxopt.serve import adapter
from onnxopt.serve.api import Limits, RequestError, error_body, parse_generation
from onnxopt.serve.batching import run_grouped
from onnxopt.serve.metrics import ReplicaMetrics

GENERATIONS_PATH = "/v1/images/generations"


@dataclass(frozen=True)
class ServiceConfig:
    folder: str
    provider: str = "cpu"
    replicas: int = 1
    max_batch: int = 4  # requests the replica takes at once, and images in one batched run
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
        self.metrics = ReplicaMetrics(Counter, Gauge, Histogram)

    async def __call__(self, request: Request):
        path = request.url.path.rstrip("/") or "/"
        if path == "/healthz" and request.method == "GET":
            return JSONResponse({"status": "ok", "pid": os.getpid()})  # which replica answered (a restart shows)
        if path == "/metrics" and request.method == "GET":
            return JSONResponse(self.metrics.snapshot())
        if path != GENERATIONS_PATH:
            return JSONResponse(error_body(f"no such route: {request.method} {path}"), status_code=404)
        if request.method != "POST":
            return JSONResponse(error_body(f"{path} takes POST"), status_code=405)
        start = time.perf_counter()
        answer = await self.generations(await request.body())
        self.metrics.answer(answer.status_code, time.perf_counter() - start)
        return answer

    async def generations(self, raw: bytes) -> JSONResponse:
        try:
            images = parse_generation(raw, self.config.limits, self.defaults, self.schedulers, self.size_factor)
            adapter.check_against_folder(self.pipe, images[0])  # one check serves all: they differ by seed only
        except RequestError as exc:
            return JSONResponse(error_body(str(exc)), status_code=exc.status)
        except self.bad_request as exc:
            return JSONResponse(error_body(str(exc)), status_code=400)
        self.metrics.queued()
        try:
            made = await self.generate_batched(images)
            if isinstance(made, Exception):  # its group's run failed (batching.run_grouped)
                raise made
            # encoded here, in this request's own worker thread, while the replica's next batch runs
            pngs = await asyncio.gather(*(asyncio.to_thread(adapter.png_bytes, image) for image in made))
        except self.bad_request as exc:  # e.g. a guidance that makes a non-finite image
            return JSONResponse(error_body(str(exc)), status_code=400)
        except Exception as exc:  # a fault of the replica, not the request: 500, one line
            first = next((line for line in str(exc).splitlines() if line.strip()), "")
            return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {first}"), status_code=500)
        data = [{"b64_json": base64.b64encode(png).decode("ascii"), "seed": image.seed} for png, image in zip(pngs, images)]
        return JSONResponse({"created": int(time.time()), "data": data})

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.05)
    async def generate_batched(self, requests: list) -> list:
        """Each element: one request's images; the answer: each request's PIL images (or its group's exception)."""
        self.metrics.dequeued(len(requests))
        sizes: list[int] = []

        def run(group):
            sizes.append(len(group))
            return adapter.make_images(self.pipe, group)
        results = await asyncio.to_thread(run_grouped, requests, self.config.max_batch, run)
        for images in sizes:  # recorded here, on the replica's event loop, not in the worker thread
            self.metrics.batch_run(images)
        return results


def build_app(config: ServiceConfig):
    """The bound deployment: ``config.replicas`` replicas, each on one GPU (cuda) or none (cpu), each
    taking up to ``max_batch`` requests at once; up to ``max_queued`` more wait, the next gets 503."""
    gpus = 0 if config.provider == "cpu" else 1
    return ImageService.options(
        num_replicas=config.replicas,
        ray_actor_options={"num_gpus": gpus, "num_cpus": 0},
        # a batch running, the next one gathering on the replica (else the batch that follows a full one
        # starts with the one request that slipped in: at full load batches shrank, measured on an H100),
        # and one slot for /healthz or a refusal
        max_ongoing_requests=2 * config.max_batch + 1,
        max_queued_requests=config.max_queued,
        backpressure_config={"status_code": 503, "retry_after_s": config.retry_after_s},
        graceful_shutdown_timeout_s=120,  # drain: an image in flight finishes before its replica stops
        health_check_period_s=5,
    ).bind(config)
