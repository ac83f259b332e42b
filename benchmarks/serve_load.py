"""Load on ``onnxopt serve``: stepped offered load, images/s, p50/p99 latency, failures.

    python -m benchmarks.serve_load FOLDER --json serve_load.json --markdown serve_load.md       # one GPU
    python -m benchmarks.serve_load FOLDER --scenarios replicas --replicas 1 2 --json r.json     # 2 GPUs
    python -m benchmarks.serve_load models/pipelines/sd15-tiny --dry-run        # CPU, checks the script

Scenarios (each starts its own service, stopped with SIGTERM after):

* ``batching``: one replica with ``--max-batch 1``, then with ``--max-batch B``.
* ``replicas``: each count of ``--replicas`` (batching on), one GPU each; a count over the GPUs
  here is named as not run.
* ``kill``: one replica's process is killed (SIGKILL) in the middle of a load step: every request
  must end before its deadline (none hangs), every failure must be an HTTP 5xx (none a dropped
  connection), and the replica must come back (Ray Serve restarts it): the time until a new
  replica answers /healthz.

Offered load is open-loop: requests start at a fixed rate whatever the answers, a step at a time,
each rate a multiple of the service's single-image throughput (replicas / the latency of one image
alone, measured first on that service). A 503 (queue full) is a failure of its own column. Before
the load, each batch size up to B is warmed up (its bound buffers and captured graphs are made on
first use). The summary compares the peak images/s of batching on and off, and of each replica
count against one, and the p99 latency at the peak against one image alone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from onnxopt.serve.client import ServiceProcess, call

ROOT = Path(__file__).resolve().parents[1]


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--provider", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--size", default="512x512")
    p.add_argument("--steps", type=int, nargs="+", default=[20, 50])
    p.add_argument("--loads", type=float, nargs="+", default=[0.5, 1, 1.5, 2, 3, 4],
                   help="offered rates as multiples of one replica's single-image throughput")
    p.add_argument("--step-s", type=float, default=60, help="seconds of offered load per step")
    p.add_argument("--scheduler", help="the requests' scheduler (default: the folder's own, as a request without one)")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--scenarios", nargs="+", default=["batching", "replicas", "kill"],
                   choices=["batching", "replicas", "kill"])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="replica counts of the replicas scenario")
    p.add_argument("--start-timeout-s", type=float, default=900)
    p.add_argument("--json", type=Path, help="write every row here")
    p.add_argument("--markdown", type=Path, help="write the rows and the summary here as markdown tables")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, 64x64, 2 steps, two short load steps: checks the script, measures nothing")
    args = p.parse_args(argv)
    if args.dry_run:
        args.provider, args.size, args.steps, args.loads, args.step_s = "cpu", "64x64", [2], [1, 3], 6
        args.max_batch, args.max_queue, args.start_timeout_s = 2, 4, 300
    return args


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def offered_step(service: ServiceProcess, body: dict, rate: float, seconds: float, deadline_s: float,
                 during=None) -> dict:
    """Requests at ``rate`` per second for ``seconds`` (open loop); every answer awaited up to
    ``deadline_s``. ``during(t0)``: run on a thread beside the load (the replica kill)."""
    count = max(1, int(round(rate * seconds)))
    results: list = [None] * count

    def one(k: int):
        start = time.perf_counter()
        try:
            status, _, payload = service.generate(dict(body, seed=k), timeout=deadline_s)
            results[k] = (status, time.perf_counter() - start, len(payload.get("data", ())))
        except OSError as exc:  # a dropped connection or a request past its deadline: not a clean failure
            results[k] = (type(exc).__name__, time.perf_counter() - start, 0)

    t0 = time.perf_counter()
    side = threading.Thread(target=during, args=(t0,)) if during else None
    if side:
        side.start()
    with ThreadPoolExecutor(min(count, 512)) as pool:
        for k in range(count):
            time.sleep(max(0.0, t0 + k / rate - time.perf_counter()))
            pool.submit(one, k)
    wall = time.perf_counter() - t0
    if side:
        side.join()
    ok = [r for r in results if r[0] == 200]
    lat = np.array([r[1] for r in ok]) if ok else np.array([np.nan])
    return {"offered_per_s": rate, "requests": count, "ok": len(ok),
            "images_per_s": sum(r[2] for r in ok) / wall, "p50_s": float(np.percentile(lat, 50)),
            "p99_s": float(np.percentile(lat, 99)), "503": sum(r[0] == 503 for r in results),
            "other_5xx": sum(isinstance(r[0], int) and r[0] >= 500 and r[0] != 503 for r in results),
            "4xx": sum(isinstance(r[0], int) and 400 <= r[0] < 500 for r in results),
            "not_http": sum(not isinstance(r[0], int) for r in results), "wall_s": wall}


def warm_up(service: ServiceProcess, body: dict, max_batch: int) -> None:
    """b requests at once for each b up to ``max_batch``, twice: each batch size's bound buffers and
    captured graphs are made before the load (a new batch size is otherwise a slow first run)."""
    for _ in range(2):
        for b in range(1, max_batch + 1):
            with ThreadPoolExecutor(b) as pool:
                list(pool.map(lambda k: service.generate(dict(body, seed=k), busy_retries=5), range(b)))


def single_image_s(service: ServiceProcess, body: dict, runs: int = 3) -> float:
    """The latency of one image alone: the median of ``runs`` requests one after another (a single
    request once read 0.52 s where the load step at that rate answered in 0.31 s)."""
    times = []
    for k in range(runs):
        t = time.perf_counter()
        status, _, payload = service.generate(dict(body, seed=k))
        times.append(time.perf_counter() - t)
        assert status == 200, payload
    return float(np.median(times))


def run_service(args, label: str, rows: list, *, replicas: int, max_batch: int, kill: bool = False) -> None:
    service = ServiceProcess(args.folder, "--provider", args.provider, "--replicas", str(replicas),
                             "--max-batch", str(max_batch), "--max-queue", str(args.max_queue),
                             "--max-steps", str(max(args.steps)), pythonpath=str(ROOT))
    try:
        service.wait_ready(args.start_timeout_s)
        for steps in args.steps:
            body = {"prompt": "a photograph of an astronaut riding a horse", "size": args.size, "steps": steps}
            if args.scheduler:
                body["scheduler"] = args.scheduler
            warm_up(service, body, max_batch)
            single_s = single_image_s(service, body)
            deadline_s = max(60.0, 20 * single_s * (1 + args.max_queue / max(1, replicas * max_batch)))
            loads = [args.loads[len(args.loads) // 2]] if kill else args.loads
            for f in loads:
                rate = f * replicas / single_s
                during = replica_killer(service, args.step_s / 3) if kill else None
                row = offered_step(service, body, rate, args.step_s, deadline_s, during)
                row.update(scenario=label, replicas=replicas, max_batch=max_batch, steps=steps, size=args.size,
                           single_image_s=single_s, load_x=f)
                if during:
                    row.update(during.report)
                rows.append(row)
                print(_line(row), flush=True)
    finally:
        if service.process.poll() is None:
            code, left = service.stop()
            if left or code:
                print(f"  {label}: stop exit {code}, left behind: {left}", flush=True)


def replica_killer(service: ServiceProcess, after_s: float, back_within_s: float = 600):
    """A callable ``during(t0)`` that SIGKILLs one replica ``after_s`` into the load step and times
    its return: until /healthz is answered by a replica process that was not there before the kill
    (Ray Serve's restart, loaded and routed to). ``during.report``: killed_pid, replica_back_s (None:
    not back within ``back_within_s``; 0 does not wait)."""
    def during(t0: float):
        time.sleep(max(0.0, t0 + after_s - time.perf_counter()))
        before = service.replica_pids()
        if not before:
            during.report = {"killed_pid": None, "replica_back_s": None}
            return
        os.kill(before[0], signal.SIGKILL)
        killed = time.perf_counter()
        back = None
        while back is None and time.perf_counter() - killed < back_within_s:
            try:
                status, _, payload = call(service.base + "/healthz", timeout=30)
            except OSError:
                status, payload = None, {}
            if status == 200 and payload.get("pid") not in (None, *before):
                back = time.perf_counter() - killed
            else:
                time.sleep(0.5)
        during.report = {"killed_pid": before[0], "replica_back_s": back}
    during.report = {}
    return during


def _line(row: dict) -> str:
    return (f"{row['scenario']:<16} r={row['replicas']} B={row['max_batch']} {row['steps']:>2} steps "
            f"load {row['load_x']:.1f}x ({row['offered_per_s']:.2f}/s): {row['images_per_s']:.2f} img/s, "
            f"p50 {row['p50_s']:.2f} s, p99 {row['p99_s']:.2f} s, ok {row['ok']}/{row['requests']}, "
            f"503 {row['503']}, 5xx {row['other_5xx']}, not-http {row['not_http']}"
            + (f", replica back in {row['replica_back_s']:.1f} s" if row.get("replica_back_s") else "")
            + (", replica NOT back" if "replica_back_s" in row and row["replica_back_s"] is None else ""))


def summary(rows: list) -> list[dict]:
    """Per scenario and steps: the peak images/s, the p99 there against one image alone, and the
    peak against the baseline (batching-off for batching-on, one replica for more)."""
    peaks: dict = {}
    for row in rows:
        if row["scenario"] == "replica-killed":
            continue
        key = (row["scenario"], row["replicas"], row["steps"])
        if key not in peaks or row["images_per_s"] > peaks[key]["images_per_s"]:
            peaks[key] = row
    out = []
    for (scenario, replicas, steps), row in peaks.items():
        base = peaks.get(("batching-off", 1, steps)) if scenario == "batching-on" else \
            peaks.get(("batching-on", 1, steps)) if scenario.startswith("replicas") and replicas > 1 else None
        out.append({"scenario": scenario, "replicas": replicas, "steps": steps, "peak_images_per_s": row["images_per_s"],
                    "at_load_x": row["load_x"], "p99_s": row["p99_s"], "single_image_s": row["single_image_s"],
                    "p99_over_single": row["p99_s"] / row["single_image_s"],
                    "gain": row["images_per_s"] / base["images_per_s"] if base else None})
    return out


def markdown(rows: list, summed: list) -> str:
    cols = ["scenario", "replicas", "max_batch", "steps", "load_x", "offered_per_s", "images_per_s", "p50_s", "p99_s",
            "ok", "requests", "503", "other_5xx", "4xx", "not_http", "replica_back_s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    scols = ["scenario", "replicas", "steps", "peak_images_per_s", "at_load_x", "p99_s", "single_image_s",
             "p99_over_single", "gain"]
    lines += ["", "| " + " | ".join(scols) + " |", "|" + "---|" * len(scols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in scols) + " |" for r in summed]
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    return "" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def main(argv=None) -> int:
    args = _parse(argv)
    rows: list = []
    gpus = gpu_count() if args.provider == "cuda" else max(args.replicas)
    if "batching" in args.scenarios:
        run_service(args, "batching-off", rows, replicas=1, max_batch=1)
        run_service(args, "batching-on", rows, replicas=1, max_batch=args.max_batch)
    if "replicas" in args.scenarios:
        for count in args.replicas:
            if count > gpus:
                print(f"replicas {count}: not run ({gpus} GPU(s) on this machine)", flush=True)
            elif count == 1 and "batching" in args.scenarios:
                continue  # batching-on above is the one-replica row
            else:
                run_service(args, "batching-on" if count == 1 else f"replicas-{count}", rows, replicas=count,
                            max_batch=args.max_batch)
    if "kill" in args.scenarios:
        run_service(args, "replica-killed", rows, replicas=min(2, max(1, gpus)), max_batch=args.max_batch, kill=True)
    summed = summary(rows)
    for row in summed:
        print(f"peak {row['scenario']} r={row['replicas']} {row['steps']} steps: {row['peak_images_per_s']:.2f} img/s "
              f"at {row['at_load_x']:.1f}x, p99 {row['p99_over_single']:.2f}x one image alone"
              + (f", {row['gain']:.2f}x its baseline" if row["gain"] else ""), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summed}, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(rows, summed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
