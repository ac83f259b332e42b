"""Driving an ``onnxopt serve`` process from outside: start it, wait for /healthz, call it, find
its replicas, stop it with SIGTERM. The tests and benchmarks/serve_load.py share it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, body=None, timeout: float = 120) -> tuple[int, dict, dict]:
    """(status, headers with lower-case names, JSON body) of a GET (``body`` None) or a POST (a
    dict, or raw bytes). A body that is not JSON comes back as {"raw": text}."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as answer:
            status, headers, text = answer.status, answer.headers, answer.read()
    except urllib.error.HTTPError as exc:
        status, headers, text = exc.code, exc.headers, exc.read()
    try:
        payload = json.loads(text)
    except ValueError:
        payload = {"raw": text.decode(errors="replace")}
    return status, {k.lower(): v for k, v in headers.items()}, payload


def process_tree(pid: int) -> set[tuple[int, str]]:
    """(pid, start time) of every process under ``pid`` (from /proc; the start time tells a reused pid apart)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(int(entry))
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry))
            starts[int(entry)] = fields[19]
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add((child, starts[child]))
            todo.append(child)
    return found


def alive(process: tuple[int, str]) -> bool:
    fields = _stat(process[0])
    return bool(fields) and fields[19] == process[1] and fields[0] != "Z"


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), or None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class ServiceProcess:
    """``python -m onnxopt serve FOLDER ARGS...`` on a free loopback port."""

    def __init__(self, folder, *args: str, port: int | None = None, pythonpath: str | None = None):
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen([sys.executable, "-m", "onnxopt", "serve", str(folder), "--port", str(self.port),
                                         *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"onnxopt serve exited ({self.process.returncode}): {self.output()[-2000:]}")
            try:
                if call(self.base + "/healthz", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"onnxopt serve did not answer /healthz in {timeout:.0f} s")

    def generate(self, body: dict, timeout: float = 600, busy_retries: int = 0):
        """POST one request. With ``busy_retries``, a 503 (the queue was full) is retried after the
        Retry-After the service sent, as a well-behaved client does, up to that many times."""
        for attempt in range(busy_retries + 1):
            status, headers, payload = call(self.base + "/v1/images/generations", body, timeout)
            if status != 503 or attempt == busy_retries:
                return status, headers, payload
            time.sleep(float(headers.get("retry-after", 1)))

    def replica_pids(self) -> list[int]:
        return sorted(pid for pid, _ in process_tree(self.process.pid) if "ServeReplica" in command_line(pid))

    def stop(self, timeout: float = 120) -> tuple[int, list[str]]:
        """SIGTERM; (exit code, command lines of processes left behind, which are then killed)."""
        tree = process_tree(self.process.pid)
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout)
        deadline = time.monotonic() + 20
        while any(map(alive, tree)) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [process for process in tree if alive(process)]
        names = [command_line(pid)[:100] for pid, _ in left]
        for pid, _ in left:
            os.kill(pid, signal.SIGKILL)
        return code, names

    def output(self) -> str:
        if self.process.poll() is None:
            return ""
        return self.process.stdout.read() if self.process.stdout else ""
