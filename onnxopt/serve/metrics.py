"""What a replica measures: exported to Prometheus through Ray's metrics, and as JSON on GET /metrics.

    onnxopt_request_latency_s    Histogram  a generation request's arrival at the replica to its answer,
                                            by status (ok | 4xx | 5xx)
    onnxopt_requests_total       Counter    answered generation requests, by status
    onnxopt_replica_queue_depth  Gauge      requests checked and waiting on this replica for their batch
    onnxopt_batch_images         Histogram  images in one batched denoising run

In the replica the metric classes are ``ray.serve.metrics``' (Counter, Gauge, Histogram), which tag
every value with the application, deployment and replica; Ray's metrics agent serves them, prefixed
``ray_``, on each node's metrics export port (``onnxopt serve --metrics-port``), next to Ray Serve's
own: ``ray_serve_deployment_queued_queries`` (requests waiting at the router for a replica: the
queue that answers 503 when full), ``ray_serve_num_router_requests_total``,
``ray_serve_deployment_processing_latency_ms``. Ray exports a histogram's buckets and count
exactly and its sum from the bucket midpoints: read quantiles from the buckets.

Nothing here imports Ray: the classes are passed in (tests pass their own).
"""

from __future__ import annotations

from collections import deque

LATENCY_BOUNDARIES_S = [0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128]
BATCH_BOUNDARIES = [1, 2, 4, 8, 16, 32]


def status_class(status: int) -> str:
    return "ok" if status < 400 else "4xx" if status < 500 else "5xx"


class ReplicaMetrics:
    """One replica's metrics, made with ``counter``, ``gauge`` and ``histogram`` (classes taking
    ``ray.serve.metrics``' arguments), and the last ``recent`` latencies for :meth:`snapshot`."""

    def __init__(self, counter, gauge, histogram, recent: int = 1000):
        self.latency = histogram("onnxopt_request_latency_s",
                                 "seconds from a generation request's arrival at the replica to its answer",
                                 boundaries=LATENCY_BOUNDARIES_S, tag_keys=("status",))
        self.requests = counter("onnxopt_requests_total", "generation requests answered by the replica",
                                tag_keys=("status",))
        self.queue_depth = gauge("onnxopt_replica_queue_depth", "requests queued on the replica for a batch")
        self.batch_images = histogram("onnxopt_batch_images", "images in one batched denoising run",
                                      boundaries=BATCH_BOUNDARIES)
        self.waiting = 0
        self.answered = {"ok": 0, "4xx": 0, "5xx": 0}
        self.recent_s: deque = deque(maxlen=recent)
        self.queue_depth.set(0)

    def queued(self, requests: int = 1) -> None:
        self.waiting += requests
        self.queue_depth.set(self.waiting)

    def dequeued(self, requests: int) -> None:
        self.waiting -= requests
        self.queue_depth.set(self.waiting)

    def batch_run(self, images: int) -> None:
        self.batch_images.observe(images)

    def answer(self, status: int, seconds: float) -> None:
        tags = {"status": status_class(status)}
        self.latency.observe(seconds, tags=tags)
        self.requests.inc(1, tags=tags)
        self.answered[tags["status"]] += 1
        if status < 400:
            self.recent_s.append(seconds)

    def snapshot(self) -> dict:
        """This replica's numbers as JSON: queue depth, answers by status, p50/p99 of recent successes."""
        recent = sorted(self.recent_s)
        pick = lambda q: recent[min(len(recent) - 1, int(q * len(recent)))] if recent else None  # noqa: E731
        return {"queue_depth": self.waiting, "served": self.answered["ok"], "failed": self.answered["5xx"],
                "refused": self.answered["4xx"], "latency_p50_s": pick(0.5), "latency_p99_s": pick(0.99)}
