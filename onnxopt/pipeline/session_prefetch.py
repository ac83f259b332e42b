"""Sessions started ahead of their turn, on a few threads, so that a pipeline's load overlaps them.

:meth:`onnxopt.pipeline.runner.Pipeline.from_plan` makes the plan's sessions one after another, and
the first image makes its text encoders' on first use. Creating an ONNX Runtime session (parsing the
graph, optimizing it, loading its initializers) runs in ORT's C++ code with the GIL released, so
sessions can be created side by side, and beside the Python work of the load (the tokenizers,
whose import of transformers alone is seconds). benchmarks/cold_start.py measures both.

So the load first starts every session it and the first image will ask for by file (the
:class:`Ahead` list), and then makes its entries in the plan's order as before: a request of the
same file, asked the same way, takes the session made ahead (waiting for it when it is not done),
and any other request is made then, as before. The status line, the order in which sessions are
asked for, and which error comes first (its one line, raised where the request is) stay the plan's.
A text encoder's session made ahead for the first image's prompt batch and not taken by it (a static
graph for two rows, where the first image encodes one: guidance at 1 or below, or SDXL without a
negative prompt) is released once that image has taken another graph of the encoder
(:meth:`SessionPrefetch.release`): the pipeline keeps the graph it took, and would otherwise hold the
encoder's weights twice for its life; a later request that asks for the released graph makes it then,
on first use, as the sequential load does.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

LOAD_WORKERS = 4  # sessions created at once, at most (each holds its graph and weights while it is made)


@dataclass(frozen=True)
class Ahead:
    """A session to start ahead: ``component``'s ``model`` file, with CUDA graphs or not."""

    component: str
    model: Path
    cuda_graph: bool = False

    @property
    def key(self) -> tuple[str, bool]:
        return str(Path(self.model).resolve()), self.cuda_graph


class SessionPrefetch:
    """Sessions ``create(ahead)`` makes on up to ``workers`` threads, taken by the request of the same
    file and capture (one thread for a single session still overlaps it with the load's Python work).
    ``workers`` 0 or 1: nothing is made ahead (every request makes its own, in turn: the sequential load)."""

    def __init__(self, create: Callable[[Ahead], object], workers: int = LOAD_WORKERS):
        self.create, self.workers = create, workers
        self.futures: dict[tuple[str, bool], Future] = {}
        self.components: dict[tuple[str, bool], str] = {}  # each future's component, for release
        self.released: set[str] = set()
        self.pool: ThreadPoolExecutor | None = None

    def start(self, requests: list[Ahead]) -> None:
        unique = list({request.key: request for request in requests}.values())
        if self.workers < 2 or not unique:
            return
        self.pool = ThreadPoolExecutor(min(self.workers, len(unique)), thread_name_prefix="onnxopt-session")
        for request in unique:
            self.futures[request.key] = self.pool.submit(self.create, request)
            self.components[request.key] = request.component
        self.pool.shutdown(wait=False)  # its threads end when the last session is made

    def take(self, request: Ahead, make_now: Callable[[], object]):
        """The session made ahead for ``request`` (its exception, raised here, if it failed), else ``make_now()``."""
        future = self.futures.pop(request.key, None)
        return future.result() if future is not None else make_now()

    def made_here(self, request: Ahead, make: Callable[[], object]) -> None:
        """``make()`` run now, on the calling worker, as the session made ahead for ``request``."""
        future: Future = Future()
        try:
            future.set_result(make())
        except BaseException as exc:  # noqa: BLE001 -- raised where the request takes it
            future.set_exception(exc)
        if request.component not in self.released:  # a fallback finishing after its component's release: dropped
            self.futures.setdefault(request.key, future)
            self.components.setdefault(request.key, request.component)

    def release(self, component: str) -> int:
        """Drop the sessions made ahead for ``component`` that no request took (one being made
        finishes and is dropped); how many. Called once the first request has taken its graph."""
        self.released.add(component)
        dropped = [key for key in self.futures if self.components.get(key) == component]
        for key in dropped:
            self.futures.pop(key).cancel()
        return len(dropped)

    def cancel(self) -> None:
        """Drop the sessions not started yet (a load that failed): those being made finish and are dropped."""
        for future in self.futures.values():
            future.cancel()
        self.futures.clear()
