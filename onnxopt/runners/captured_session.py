"""An ONNX Runtime session run on bound buffers that stay put, and captured as CUDA graphs: the one
place onnxopt binds IO and names graph ids. The pipeline's sessions (once-per-image graphs, the
step loops, the ControlNets, the LoRA update) and ``onnxopt bench`` all run through it::

    captured = CapturedSession(ort, session, device="cuda", cuda_graph=True)

    run = captured.bind(inputs, outputs, graph_id=captured.graph_ids(1)[0])     one BoundRun
        inputs[name]   an OrtValue: bound as it is (a buffer shared with another binding or session:
                       the step loop's ping-pong pair, the K/V companion's output the step reads)
                       an array: a fresh buffer of its own, holding it
        outputs        given OrtValues, bound as they are; None: fixed buffers of the shapes one run
                       with outputs ORT allocates gives, that run under graph id -1 (never captured)
        graph_id       the run options' ``gpu_graph_id`` when the session captures (None: no id)
    run.write(feeds)   host values into its input buffers, in place (``update_inplace``)
    run.run()          ``run_with_iobinding``: a graph id's first run captures, every later one replays

    captured.run_bound(feeds)          the keyed use (text encoders, K/V companion, hint, VAE decoder)
        key = the feeds' names, shapes and dtypes
        first time for a key:  bind(feeds) on a fresh graph id, kept in the CaptureCache
        every time:            write(feeds), run(); the outputs left in their fixed buffers
    captured.run(names, feeds)         the same, the outputs copied to the host (InferenceSession.run's signature)
    captured.stats()                   the cache's counts: shapes kept, captures, evictions

Why bound buffers: a plain ``run`` allocates its inputs and outputs on every call and its kernels
are launched one by one; on the H100 the SD 1.5 VAE decode took 11.7 ms alone but 12.8-30.9 ms
inside the pipeline (benchmarks/results/h100-2026-11-25-session6/README.md). Bound buffers that stay
put are also what a CUDA graph needs: a replay reads and writes the addresses it was captured with,
so every input value is copied into the same buffer, and a new input shape gets its own buffers and
graph id (at most ``capture_cache`` shapes kept, least recently used dropped:
:mod:`onnxopt.runners.capture_cache`; ids are never reused, an evicted shape's id would replay into
freed buffers).

Why the shape probe runs under graph id -1: on a graph id, ORT's first run also captures, and the
captured graph would then write into the probe's temporary outputs forever after (a wrong image,
benchmarks/results/h100-2026-11-25-session7/README.md). Several bindings of one session may each
have their own graph id (ORT's ``gpu_graph_id`` run-config entry, onnxruntime PR #19636): the step
loop's two parities are two bindings and two captured graphs of one session.

A session created with ``enable_cuda_graph`` must only ever be run through this type: ORT replays
the captured addresses whatever a plain ``run`` passes. A session wrapper may feed some inputs
itself from buffers it owns (the LoRA weights, :mod:`onnxopt.lora.session`): it names them in
``bound_inputs`` (name -> OrtValue), hides them from ``get_inputs``, and every binding made here
binds them. Every other attribute is the session's (``get_inputs``, ``get_outputs``), so the
runner treats a CapturedSession as the session it wraps.
"""

from __future__ import annotations

import numpy as np

from onnxopt.runners.capture_cache import DEFAULT_SIZE, CaptureCache
from onnxopt.runtime import ORT_TYPES

UNCAPTURED = -1  # ORT's graph id for a run that is never captured


def write(buffer, value, dtype=None) -> None:
    """``value`` (cast to ``dtype``) into ``buffer`` in place: the address a captured graph reads stays."""
    array = np.asarray(value)
    buffer.update_inplace(np.asarray(array.astype(dtype or array.dtype, copy=False), order="C"))


class BoundRun:
    """One IO binding of a session: its input and output buffers at fixed addresses, and the run
    options that name its captured graph (``graph_id``; None: none)."""

    def __init__(self, owner: CapturedSession, binding, inputs: dict, outputs: dict, graph_id: int | None, options):
        self.owner, self.binding, self.inputs, self.outputs = owner, binding, inputs, outputs
        self.graph_id, self.options = graph_id, options

    def write(self, feeds: dict) -> None:
        for name, value in feeds.items():
            write(self.inputs[name], value)

    def run(self) -> None:
        self.owner.session.run_with_iobinding(self.binding, self.options)

    def run_uncaptured(self) -> None:
        """One run that no graph id captures (its outputs are not the ones a graph will replay into)."""
        self.owner.session.run_with_iobinding(self.binding, self.owner.run_options(UNCAPTURED))

    def synchronize(self) -> None:
        """Wait for a run queued without waiting (``queue_only``)."""
        self.binding.synchronize_outputs()


class CapturedSession:
    """``session`` run on device buffers bound once per input shape (captured when ``cuda_graph``).

    ``device``: "cuda", or "cpu" (the same bindings on the CPU EP: how CI tests them without a GPU).
    ``capture_cache``: the shapes :meth:`run_bound` keeps (an int), or a CaptureCache to share."""

    def __init__(self, ort, session, *, device: str = "cuda", device_id: int = 0, cuda_graph: bool = False,
                 capture_cache: int | CaptureCache = DEFAULT_SIZE):
        self.ort, self.session = ort, session
        self.device, self.device_id, self.cuda_graph = device, device_id, cuda_graph
        self.cache = capture_cache if isinstance(capture_cache, CaptureCache) else CaptureCache(capture_cache)

    def __getattr__(self, name):  # get_inputs, get_outputs, ... of the session
        return getattr(self.session, name)

    # --- buffers and bindings ---------------------------------------------------------------------

    def empty(self, shape, dtype):
        """A fresh buffer on this session's device (its contents undefined)."""
        return self.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.dtype(dtype).type, self.device,
                                                              self.device_id)

    def buffer(self, value, dtype=None):
        """A fresh buffer holding ``value`` (cast to ``dtype``): on a GPU a copy; on the CPU, ORT's
        ``ortvalue_from_numpy`` uses the (contiguous, cast) array's own memory."""
        array = np.asarray(value)
        array = np.asarray(array.astype(dtype or array.dtype, copy=False), order="C")
        return self.ort.OrtValue.ortvalue_from_numpy(array, self.device, self.device_id)

    def run_options(self, graph_id: int | None, *, queue_only: bool = False):
        """ORT's run options: ``gpu_graph_id`` when this session captures (or -1, never captured);
        ``queue_only``: the run returns once its work is queued (``synchronize`` waits)."""
        options = self.ort.RunOptions()
        if graph_id is not None and (self.cuda_graph or graph_id == UNCAPTURED):
            options.add_run_config_entry("gpu_graph_id", str(graph_id))
        if queue_only:
            options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        return options

    def bind(self, inputs: dict, outputs: dict | None = None, *, graph_id: int | None = None,
             queue_only: bool = False) -> BoundRun:
        """A binding of each of the session's inputs that ``inputs`` names (an OrtValue as it is, an
        array in a fresh buffer) and of its outputs (``outputs``' OrtValues, or None: fixed buffers of
        the probed shapes); see the module docstring."""
        binding = self.session.io_binding()
        for name, value in getattr(self.session, "bound_inputs", {}).items():
            binding.bind_ortvalue_input(name, value)
        bound = {}
        for spec in self.session.get_inputs():
            if spec.name in inputs:
                value = inputs[spec.name]
                bound[spec.name] = value if isinstance(value, self.ort.OrtValue) else self.buffer(value)
                binding.bind_ortvalue_input(spec.name, bound[spec.name])
        outputs = self._probed_outputs(binding) if outputs is None else outputs
        for spec in self.session.get_outputs():
            binding.bind_ortvalue_output(spec.name, outputs[spec.name])
        options = self.run_options(graph_id, queue_only=queue_only)
        return BoundRun(self, binding, bound, dict(outputs), graph_id, options)

    def _probed_outputs(self, binding) -> dict:
        """A buffer per output of the shape (they may be symbolic) and type one run with outputs ORT
        allocates gives, under graph id -1."""
        names = [o.name for o in self.session.get_outputs()]
        for name in names:
            binding.bind_output(name, self.device, self.device_id)
        self.session.run_with_iobinding(binding, self.run_options(UNCAPTURED))
        outputs = {name: self.empty(value.shape(), ORT_TYPES.get(value.data_type(), np.float32))
                   for name, value in zip(names, binding.get_outputs())}
        binding.clear_binding_outputs()
        return outputs

    # --- the keyed use: one binding per input shape -----------------------------------------------

    def graph_ids(self, n: int) -> tuple[int, ...]:
        return self.cache.graph_ids(n)

    def stats(self) -> dict:
        return self.cache.stats()

    def run_bound(self, feeds: dict[str, np.ndarray]) -> dict:
        """Run on ``feeds``; the outputs by name, left in their fixed buffers (OrtValues on the
        device): the same buffers for every later run of the same input shapes, so a graph that
        reads them (the step loop reading the K/V companion's output) can bind them once."""
        feeds = {name: np.asarray(value, order="C") for name, value in feeds.items()}  # 0-d stays 0-d
        key = tuple(sorted((name, value.shape, value.dtype.str) for name, value in feeds.items()))
        run = self.cache.lookup(key)
        if run is None:  # captured on the first run with these buffers, replayed after
            run = self.cache.insert(key, self.bind(feeds, graph_id=self.graph_ids(1)[0]))
        else:
            run.write(feeds)
        run.run()
        return dict(run.outputs)

    def run(self, output_names, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        outputs = self.run_bound(feeds)
        return [outputs[name].numpy() for name in output_names or list(outputs)]
