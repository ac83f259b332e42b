"""A once-per-image graph (text encoder, K/V companion, ControlNet hint, VAE decoder) on fixed device buffers.

    run(output_names, feeds)                       (InferenceSession.run's signature; what run_host calls)
        key = the feeds' names, shapes and dtypes
        first time for a key:  device buffers for the inputs, one run with ORT-allocated outputs
                               (its shapes), then fixed output buffers of those shapes and a graph id
        every time:            inputs  host -> their buffers (update_inplace)
                               run_with_iobinding (a captured CUDA graph replays after the first)
                               outputs their buffers -> host (``run``), or left there (``run_bound``)

Why: a plain ``run`` allocates its inputs and outputs on every call and its kernels are launched
one by one; on the H100 the SD 1.5 VAE decode took 11.7 ms alone but 12.8-30.9 ms inside the pipeline
(benchmarks/results/h100-2026-11-25-session6/README.md). Bound buffers that stay put are also what
a CUDA graph needs: a replay reads and writes the addresses it was captured with, so every input
value is copied into the same buffer, and a new input shape gets its own buffers and graph id
(at most ``capture_cache`` shapes kept, least recently used dropped: :mod:`onnxopt.pipeline.capture_cache`).

The wrapper forwards every other attribute to the session (``get_inputs``, ``get_outputs``), so
the runner treats it as one. A session created with ``enable_cuda_graph`` must only ever be run
through this wrapper: ORT replays the captured addresses whatever a plain ``run`` passes.
"""

from __future__ import annotations

import numpy as np

from onnxopt.pipeline.capture_cache import DEFAULT_SIZE, CaptureCache
from onnxopt.pipeline.sessions import fixed_outputs


class _Bound:
    """One key's buffers: inputs and outputs that stay at their addresses, and the run options."""

    def __init__(self, binding, inputs: dict, outputs: dict, options):
        self.binding, self.inputs, self.outputs, self.options = binding, inputs, outputs, options


class BoundSession:
    """``session`` run on device buffers bound once per input shape (and captured when ``cuda_graph``)."""

    def __init__(self, ort, session, *, device: str = "cuda", device_id: int = 0, cuda_graph: bool = False,
                 capture_cache: int = DEFAULT_SIZE):
        self.ort, self.session = ort, session
        self.device, self.device_id, self.cuda_graph = device, device_id, cuda_graph
        self._bound: CaptureCache = CaptureCache(capture_cache)  # input shapes -> _Bound

    def __getattr__(self, name):  # get_inputs, get_outputs, ... of the session
        return getattr(self.session, name)

    def run(self, output_names, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        outputs = self.run_bound(feeds)
        return [outputs[name].numpy() for name in output_names or list(outputs)]

    def run_bound(self, feeds: dict[str, np.ndarray]) -> dict:
        """Run on ``feeds``; the outputs by name, left in their fixed buffers (OrtValues on the
        device): the same buffers for every later run of the same input shapes, so a graph that
        reads them (the step loop reading the K/V companion's output) can bind them once."""
        feeds = {name: np.ascontiguousarray(value) for name, value in feeds.items()}
        key = tuple(sorted((name, value.shape, value.dtype.str) for name, value in feeds.items()))
        bound = self._bound.lookup(key) or self._bind(key, feeds)
        for name, value in feeds.items():
            bound.inputs[name].update_inplace(value)
        self.session.run_with_iobinding(bound.binding, bound.options)
        return dict(bound.outputs)

    def _bind(self, key: tuple, feeds: dict[str, np.ndarray]) -> _Bound:
        ort, device, device_id = self.ort, self.device, self.device_id
        binding = self.session.io_binding()
        inputs = {name: ort.OrtValue.ortvalue_from_numpy(value, device, device_id) for name, value in feeds.items()}
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        outputs = fixed_outputs(ort, self.session, binding, device, device_id, probe_uncaptured=self.cuda_graph)
        options = ort.RunOptions()
        if self.cuda_graph:  # captured on the first run with these buffers, replayed after
            options.add_run_config_entry("gpu_graph_id", str(self._bound.graph_ids(1)[0]))
        return self._bound.insert(key, _Bound(binding, inputs, outputs, options))
