"""``onnxopt serve FOLDER``: start (or join) Ray, run the image service, stop it all on SIGTERM.

A local Ray instance is started and owned by this process, and ``ray.shutdown()`` stops its
processes (GCS, raylet, workers) when the service stops; with ``--address`` the service joins that
cluster and on SIGTERM deletes only its own application, leaving the cluster up.
"""

from __future__ import annotations

import signal
import threading

from onnxopt.errors import MissingDependencyError, OnnxoptError

APP_NAME = "onnxopt"


def add_parser(sub) -> None:
    serve = sub.add_parser("serve", help="an HTTP image service for a pipeline folder on Ray Serve (pip install 'onnxopt[serve]')")
    serve.add_argument("folder", help="an ONNX pipeline folder (as onnxopt generate takes)")
    serve.add_argument("--host", default="127.0.0.1", help="address the HTTP proxy listens on (default loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--replicas", type=_positive, default=1, help="pipelines, one GPU each with cuda (default 1)")
    serve.add_argument("--provider", choices=["cuda", "cpu"], default="cuda")
    serve.add_argument("--max-batch", type=_positive, default=4, help="images run as one batch (default 4; 1: no batching)")
    serve.add_argument("--max-queue", type=_positive, default=16,
                       help="requests waiting for a replica before the service answers 503 (default 16)")
    serve.add_argument("--max-n", type=_positive, default=4, help="largest n of one request (default 4)")
    serve.add_argument("--max-side", type=_positive, default=1024, help="largest width or height in pixels (default 1024)")
    serve.add_argument("--max-steps", type=_positive, default=100, help="largest steps of one request (default 100)")
    serve.add_argument("--max-prompt-chars", type=_positive, default=1000)
    serve.add_argument("--address", default=None, help="join this Ray cluster (default: start a local Ray)")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="the local Ray's Prometheus metrics on http://127.0.0.1:PORT/metrics (onnxopt_* and Ray "
                            "Serve's; default: a port Ray picks); with --address, the cluster's own export port")


def _positive(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def cmd_serve(args) -> int:
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise MissingDependencyError("onnxopt serve needs Ray Serve: pip install 'onnxopt[serve]'") from exc
    from onnxopt.pipeline import PipelineFolder
    from onnxopt.serve.api import Limits
    from onnxopt.serve.deployment import ServiceConfig, build_app

    from onnxopt.serve.adapter import check_servable

    folder = PipelineFolder.open(args.folder)  # a bad folder is refused before Ray starts
    check_servable(folder)
    for name, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if port is not None and not 0 < port < 65536:
            raise OnnxoptError(f"{name} must be in 1..65535, got {port}")
    if args.metrics_port is not None and args.address is not None:
        raise OnnxoptError("--metrics-port sets the local Ray's metrics port; a cluster (--address) exports on its own")
    limits = Limits(max_n=args.max_n, max_side=args.max_side, max_steps=args.max_steps, max_prompt_chars=args.max_prompt_chars)
    config = ServiceConfig(folder=str(folder.root.resolve()), provider=args.provider, replicas=args.replicas,
                           max_batch=args.max_batch, max_queued=args.max_queue, limits=limits)
    own_ray = args.address is None
    if own_ray:  # the local replicas run in this environment: a missing runtime is this line, not a failed deployment
        from onnxopt.runtime import import_onnxruntime

        import_onnxruntime()
    # workers inherit this process's environment (PYTHONPATH included) from the local raylet
    metrics = {"_metrics_export_port": args.metrics_port} if args.metrics_port is not None else {}
    ray.init(address=args.address, include_dashboard=False, log_to_driver=False, **metrics)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own SIGTERM handler
        signal.signal(sig, lambda *_: stop.set())
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        if args.provider == "cuda" and gpus < args.replicas:  # Ray would wait for GPUs forever
            raise OnnxoptError(f"--replicas {args.replicas} with cuda needs {args.replicas} GPUs; the Ray cluster has "
                               f"{gpus:g} (--provider cpu, or fewer replicas)")
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"onnxopt serve: {args.replicas} replica(s) of {folder.root} on {args.provider}, "
              f"http://{args.host}:{args.port}/v1/images/generations"
              + (f", metrics http://127.0.0.1:{args.metrics_port}/metrics" if args.metrics_port else ""), flush=True)
        while not stop.wait(0.5):
            pass
        print("onnxopt serve: stopping (draining requests in flight)", flush=True)
    finally:
        if own_ray:
            serve.shutdown()  # the application, its replicas (graceful: requests in flight finish), the proxy
        else:
            serve.delete(APP_NAME)
        ray.shutdown()
    return 0
