"""ONNX Runtime sessions for a pipeline, and the two ways the denoising step runs on them.

Providers:

* ``cpu``: the ORT CPU EP, plain ``InferenceSession.run`` with numpy in and out (``io_binding=True``
  runs the device loop below on CPU buffers instead: how the tests check that loop without a GPU).
* ``cuda``: the ORT CUDA EP. Every session runs on bound buffers through a
  :class:`~onnxopt.runners.captured_session.CapturedSession`: the text encoders and the VAE once per
  image, on buffers bound once per shape and captured; the step graph (and the ControlNet) on
  device buffers allocated once per pipeline and shape, and reused by every later image: a
  captured CUDA graph replays the addresses it was captured with, so they must stay put. The
  schedule (timesteps and coefficients of every step) is written once per image; the step graph
  reads its row by a step counter that it increments itself. With ``cuda_graph=True`` the step
  is captured as CUDA graphs (the ``enable_cuda_graph`` provider option). The latents, the
  solver state and the step counter ping-pong between two buffers A and B::

        even steps:  latents=A, state=SA, index=IA  ->  latents_out=B, state_out=SB, index_out=IB   graph 2k
        odd steps:   latents=B, state=SB, index=IB  ->  latents_out=A, state_out=SA, index_out=IA   graph 2k+1

  Each parity has its own IOBinding and its own captured graph (ORT's ``gpu_graph_id`` run-config
  entry, onnxruntime PR #19636; k counts the buffer sets of one pipeline), so a replay reads and
  writes exactly the addresses it was captured with and nothing is copied between steps. Each run
  waits for its step to finish: queuing the next replay without that wait
  (``disable_synchronize_execution_providers``) was not faster end to end and moved the GPU time out
  of the step timings into whatever waits next (benchmarks/results/h100-2026-11-25-session6/README.md).
* ``tensorrt``: each component's TensorRT engine (``model.plan``, written by ``optimize --target
  tensorrt --build-engines``) on TensorRT's runtime, numpy in and out
  (:mod:`onnxopt.runners.engine_session`); without TensorRT, an engine, or a GPU TensorRT runs
  engines on, a one-line error (exit code 2).

:class:`HostStepLoop` and :class:`DeviceStepLoop` run the fused step graph (see
:mod:`onnxopt.pipeline.step_graph`) and have the same interface: ``start`` with the plan and the
per-image inputs, ``step`` once per timestep, ``latents`` at the end. Both take one ControlNet
session, or a list of them (more than one ControlNet, :mod:`onnxopt.pipeline.multi_controlnet`),
with one dict of per-image inputs each; ControlNet k's residuals go to the step graph's inputs
``interface_name(residual, k)``, which the step graph sums.

Every graph input is fed the type its graph declares, bfloat16 included (rounded once, to nearest
even, where the graph asks for it), and a bfloat16 output comes back to the host as float32:
:mod:`onnxopt.runtime` says how, with what ONNX Runtime's Python API takes. A session whose input
is of a type onnxopt cannot feed (a string, float8) is refused when it is made (exit code 2).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from onnxopt.errors import MissingDependencyError, OnnxoptError
from onnxopt.runners.captured_session import CapturedSession, write
from onnxopt.runtime import (
    ORT_TYPES,
    as_type,
    graph_optimization_level,
    host_array,
    import_onnxruntime,
    inference_session,
    input_dtype,
    ort_logging,
    run_session,
    session_options,
)

PROVIDERS = ("cpu", "cuda", "tensorrt")


def require_provider(provider: str):
    """Import ORT and check that ``provider`` can run here; one-line errors otherwise."""
    if provider not in PROVIDERS:
        raise OnnxoptError(f"unknown provider '{provider}' (choose from {', '.join(PROVIDERS)})")
    ort = import_onnxruntime()
    available = ort.get_available_providers()
    if provider == "cuda" and "CUDAExecutionProvider" not in available:
        raise MissingDependencyError("the cuda provider needs onnxruntime-gpu (pip install 'onnxopt[gpu]') and an NVIDIA GPU")
    if provider == "tensorrt":  # TensorRT, and a GPU it runs engines on (onnxopt.runners.engine_session)
        from onnxopt.runners.engine_session import require_engine_runtime

        require_engine_runtime()
    return ort


def provider_list(provider: str, *, cuda_graph: bool = False, device_id: int = 0) -> list:
    cuda = ("CUDAExecutionProvider", {"device_id": str(device_id), "enable_cuda_graph": "1" if cuda_graph else "0"})
    return ["CPUExecutionProvider"] if provider == "cpu" else [cuda]


def quiet_sessions():
    """Sessions created inside log nothing but fatal errors (the default already:
    :mod:`onnxopt.runtime`), even when ORT's log was switched on outside."""
    return ort_logging(False)


def create_session(model: Path | bytes, provider: str, *, name: str, cuda_graph: bool = False, device_id: int = 0,
                   threads: int | None = None, external_data_folder: Path | None = None, optimization: str = "all"):
    """An InferenceSession for ``model`` (a path, or serialized bytes: weights inline, or external
    data whose locations are relative to ``external_data_folder``); ``optimization``: ORT's graph
    optimization level (:data:`onnxopt.runtime.OPTIMIZATION_LEVELS`; "all", ORT's
    default, adds the layout rewrites, which on the CPU EP are most of a convolutional UNet's
    session creation: benchmarks/cold_start.py --levels)."""
    ort = require_provider(provider)
    if provider == "tensorrt":  # the engine --build-engines wrote beside the model (onnxopt.runners.engine_session)
        from onnxopt.runners.engine_session import component_engine_session

        return component_engine_session(model, name)
    so = session_options(ort)
    so.graph_optimization_level = graph_optimization_level(ort, optimization)
    if external_data_folder is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(external_data_folder))
    if threads:
        so.intra_op_num_threads = threads
    if provider == "cpu":  # idle worker threads must not spin between runs: the loop's host work shares the cores
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers = provider_list(provider, cuda_graph=cuda_graph, device_id=device_id)
    try:
        session = inference_session(model, providers, so)
    except Exception as exc:  # ORT raises its own exception types with long messages
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = (" (a folder optimized for the CUDA EP, with its contrib ops: run it with --provider cuda, or optimize "
                "it with --target tensorrt, whose standard ONNX every provider runs)"
                if provider == "cpu" and "NOT_IMPLEMENTED" in first else "")
        raise OnnxoptError(f"{name}: ONNX Runtime cannot load the model: {first}{hint}") from exc
    for spec in session.get_inputs():  # refused now, by component, rather than at its first feed
        input_dtype(spec, name)
    return session


def input_types(session) -> dict[str, np.dtype]:
    """Each input's NumPy type, as the graph declares it (bfloat16: ml_dtypes'); a one-line error
    for an input of a type onnxopt cannot feed."""
    return {i.name: input_dtype(i) for i in session.get_inputs()}


def _cast_feeds(session, feeds: dict) -> dict[str, np.ndarray]:
    """The feeds ``session`` reads, as contiguous numpy arrays of its input types (rounded here, once,
    where a graph takes a narrower type than the host computes in)."""
    types = input_types(session)
    return {name: as_type(value, types[name]) for name, value in feeds.items() if name in types}


def run_host(session, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run with numpy feeds cast to the session's input types; outputs by name (a bfloat16 output as
    float32: :func:`onnxopt.runtime.run_session`)."""
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, run_session(import_onnxruntime(), session, names, _cast_feeds(session, feeds))))


def run_on_device(session, feeds: dict[str, np.ndarray]) -> dict:
    """Like :func:`run_host`, but the outputs stay where a :class:`~onnxopt.runners.captured_session.CapturedSession`
    wrote them: its fixed device buffers (OrtValues), which a step loop then binds as inputs with no
    copy. A plain session has no such buffers: its outputs come back as numpy arrays."""
    if not hasattr(session, "run_bound"):
        return run_host(session, feeds)
    return session.run_bound(_cast_feeds(session, feeds))


def is_device_value(value) -> bool:
    """An OrtValue (``shape`` is a method), not a numpy array."""
    return callable(getattr(value, "shape", None))


def value_shape(value) -> tuple:
    return tuple(value.shape()) if is_device_value(value) else np.shape(value)


def timestep_feed(session, value, batch: int, name: str = "timestep") -> np.ndarray:
    """The timestep as ``session`` takes it (input ``name``): a scalar, [1], or [batch] (exports differ),
    in its dtype."""
    spec = next(i for i in session.get_inputs() if i.name == name)
    dtype = input_dtype(spec)
    if len(spec.shape) == 0:
        return as_type(value, dtype)
    return as_type(np.full([1 if spec.shape[0] == 1 else batch], value), dtype)


def as_list(value) -> list:
    """None -> [], a list or tuple -> a list, anything else -> [it] (one ControlNet's session or inputs)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def controlnet_sample(latents: np.ndarray, c_in: float, batch_copies: int = 2) -> np.ndarray:
    """The ControlNet's ``sample``: concat([latents * c_in] * 2), what the step graph feeds its UNet."""
    scaled = (latents * np.float32(c_in)).astype(latents.dtype, copy=False)
    return np.concatenate([scaled] * batch_copies, axis=0)


def schedule_tables(plan, timestep_dtype, capacity: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The step graph's ``schedule_timesteps`` [T] and ``schedule_coefficients`` [T, 6] for ``plan``
    ([T, 31] for PLMS's history, :func:`~onnxopt.pipeline.schedulers.plan_plms`), zero-padded to
    ``capacity`` rows (a bound buffer keeps its shape across runs of any step count)."""
    rows = capacity or len(plan)
    if rows < len(plan):
        raise ValueError(f"a schedule of {len(plan)} steps does not fit {rows} rows")
    timesteps = np.zeros([rows], np.dtype(timestep_dtype))
    coefficients = np.zeros([rows, plan.coefficients.shape[1]], np.float32)
    timesteps[: len(plan)] = as_type(np.asarray(plan.timesteps, dtype=np.float64), timestep_dtype)
    coefficients[: len(plan)] = plan.coefficients
    return timesteps, coefficients


def state_shape(step_session, latents_shape) -> tuple:
    """The step graph's ``state`` for latents of ``latents_shape``: theirs, or with the history's slots
    first where the graph carries them (:func:`~onnxopt.pipeline.step_graph.with_history`)."""
    # None: a graph without a state (the two-stream loop's down half, which runs no history)
    declared = next((i.shape for i in step_session.get_inputs() if i.name == "state"), None)
    if declared and len(declared) == len(latents_shape) + 1 and isinstance(declared[0], int):
        return (declared[0], *latents_shape)
    return tuple(latents_shape)


def coefficient_width(step_session) -> int:
    """The width of the step graph's ``schedule_coefficients`` rows (6; wider with a history; 6 for a
    graph without them, the two-stream loop's down half)."""
    declared = next((i.shape for i in step_session.get_inputs() if i.name == "schedule_coefficients"), None)
    return declared[1] if declared and len(declared) == 2 and isinstance(declared[1], int) else 6


class HostStepLoop:
    """The fused step on numpy buffers (CPU EP, or any provider without IO binding)::

        loop.start(plan, latents, static, guidance[, controlnet])
        for k in range(len(plan)): loop.step()
        loop.latents()
    """

    def __init__(self, step_session, controlnet_session=None, reuse_session=None):
        self.step_session = step_session
        self.controlnet_sessions = as_list(controlnet_session)
        self.reuse_session = reuse_session  # the update alone (onnxopt.pipeline.step_reuse)
        self.types = input_types(step_session)

    def start(self, plan, latents: np.ndarray, static: dict[str, np.ndarray], guidance: float,
              controlnet: dict[str, np.ndarray] | None = None):
        self.plan = plan
        timesteps, coefficients = schedule_tables(plan, self.types["schedule_timesteps"])
        self.feeds = {**static, "latents": as_type(latents, self.types["latents"]),
                      "state": np.zeros(state_shape(self.step_session, latents.shape), self.types["state"]),
                      "step_index": np.zeros([1], np.int64),
                      "schedule_timesteps": timesteps, "schedule_coefficients": coefficients,
                      "guidance_scale": np.asarray([guidance], np.float32)}
        self.controlnet_static = as_list(controlnet) or [{}] * len(self.controlnet_sessions)

    def step(self, reuse: bool = False) -> None:
        """One step; ``reuse``: the update alone, on the last computed step's guided output."""
        feeds = dict(self.feeds)
        if reuse:
            out = run_host(self.reuse_session, {**feeds, "guided_output": self.guided})
            self.feeds.update(latents=out["latents_out"], state=out["state_out"], step_index=out["step_index_out"])
            return
        if self.controlnet_sessions:
            from onnxopt.pipeline.multi_controlnet import interface_feeds

            step = int(feeds["step_index"][0])
            sample = controlnet_sample(feeds["latents"], self.plan.coefficients[step][0])
            for k, (session, static) in enumerate(zip(self.controlnet_sessions, self.controlnet_static)):
                t = timestep_feed(session, self.plan.timesteps[step], sample.shape[0])
                feeds.update(interface_feeds(run_host(session, {**static, "sample": sample, "timestep": t}), k))
        out = run_host(self.step_session, feeds)
        self.feeds.update(latents=out["latents_out"], state=out["state_out"], step_index=out["step_index_out"])
        self.guided = out["guided_output"]

    def write_state(self, value: np.ndarray) -> None:
        """The next step's ``state`` input (a stochastic scheduler's noise for that step)."""
        self.feeds["state"] = as_type(value, self.types["state"])

    def latents(self) -> np.ndarray:
        return self.feeds["latents"]


class DeviceStepLoop:
    """The fused step on device buffers that stay put across steps and across images (CUDA / TensorRT EP).

    ``bind`` allocates every buffer once and binds them (the ping-pong pairs of the module
    docstring, the schedule tables, the conditioning), each session through a
    :class:`~onnxopt.runners.captured_session.CapturedSession`; ``start`` writes an image's values
    into those same buffers, so a captured CUDA graph stays valid for every later image of the same
    shapes. Each step is one bound run: the latents, the state and the step index go from one step
    to the next on the device, and nothing is written from the host. The ControlNet, when present,
    reads its ``sample`` and ``timestep`` from a small graph run on the same buffers
    (:func:`controlnet_prepare_model`) and writes its residuals into fixed buffers that the step
    graph reads. The loop is one entry of the pipeline's capture cache (keyed by :meth:`key`); its
    ``graph_ids`` name the two parities' graphs in each of its sessions.
    """

    def __init__(self, ort, step_session, controlnet_session=None, prepare_session=None, reuse_session=None, *,
                 cuda_graph: bool = False, graph_ids: tuple[int, int] = (0, 1), device_id: int = 0, device: str = "cuda",
                 launch_timing: bool = False):
        self.ort, self.step_session, self.cuda_graph, self.device_id = ort, step_session, cuda_graph, device_id
        # The step's host side (its CPU-side overhead): the step graph's run returns
        # once its work is queued, and the loop then waits for it (synchronize), so a step
        # still ends when the device is done; ``launches`` holds each step's time to that return.
        self.launch_timing = launch_timing
        self.launches: list[float] = []
        self.device = device  # "cpu" runs the same bindings on the CPU EP (how CI tests this loop)
        self.controlnet_sessions, self.prepare_session = as_list(controlnet_session), prepare_session
        self.reuse_session = reuse_session
        self.graph_ids = graph_ids
        self.types = input_types(step_session)
        self.step_captured = self._captured_session(step_session)
        self._keep: list = []
        self.bound = False

    def _captured_session(self, session) -> CapturedSession:
        """``session`` on this loop's device, its graph ids as the loop captures."""
        return CapturedSession(self.ort, session, device=self.device, device_id=self.device_id,
                               cuda_graph=self.cuda_graph)

    def _zeros(self, shape, dtype):
        value = self.step_captured.buffer(np.zeros(shape, dtype))
        self._keep.append(value)
        return value

    @staticmethod
    def key(latents: np.ndarray, static: dict, controlnet, capacity: int) -> tuple:
        """What the bound buffers depend on: a new key needs its own buffers and captured graphs."""
        # a device value (the K/V companion's output buffer) is bound as it is: its address is part of the key
        shapes = lambda values: tuple(sorted((n, value_shape(v), v.data_ptr() if is_device_value(v) else None)  # noqa: E731
                                             for n, v in (values or {}).items()))
        return np.shape(latents), shapes(static), tuple(shapes(c) for c in as_list(controlnet)), capacity

    def bind(self, latents: np.ndarray, static: dict[str, np.ndarray], capacity: int, controlnet=None) -> None:
        types = self.types
        shape = latents.shape
        self.buffers = [self._zeros(shape, types["latents"]), self._zeros(shape, types["latents"])]
        self.state_shape = state_shape(self.step_session, shape)
        self.states = [self._zeros(self.state_shape, types["state"]), self._zeros(self.state_shape, types["state"])]
        self.indices = [self._zeros([1], np.int64), self._zeros([1], np.int64)]
        self.timesteps = self._zeros([capacity], types["schedule_timesteps"])
        self.coefficients = self._zeros([capacity, coefficient_width(self.step_session)], np.float32)
        self.guidance = self._zeros([1], np.float32)
        # device values (the K/V the companion graph wrote, once per prompt) are read where they are
        self.static = {name: self._as_bound(name, value) if is_device_value(value) else self._zeros(np.shape(value), types[name])
                       for name, value in static.items() if name in types}
        self.guided = self._zeros(shape, np.float32)  # the last computed step's guided output (step reuse)
        self.residuals = self._bind_controlnets(latents, as_list(controlnet), capacity) if self.controlnet_sessions else {}
        self._bind_steps()
        self._bind_reuse()
        self.bound = True

    def _as_bound(self, name: str, value):
        """A device value as the step graph's input ``name``: it must already be of the input's type."""
        dtype = ORT_TYPES.get(value.data_type())
        if dtype is None or np.dtype(dtype) != np.dtype(self.types[name]):
            raise OnnxoptError(f"step input {name}: the K/V companion writes {value.data_type()}, "
                               f"the step graph reads {np.dtype(self.types[name])}")
        return value

    def _bind_steps(self) -> None:
        """The step graph's two parities: two bindings of its session, two graphs (the launch-timed
        run returns once queued: only this run, a separate ControlNet session on its own stream must
        finish before the step reads it)."""
        self.step_runs = [self.step_captured.bind(self.step_inputs(parity), self.step_outputs(parity),
                                                  graph_id=self.graph_ids[parity], queue_only=self.launch_timing)
                          for parity in (0, 1)]

    def step_inputs(self, parity: int) -> dict:
        """Every buffer a step graph of this parity may read, by input name."""
        return {**self.static, **self.residuals, "latents": self.buffers[parity], "state": self.states[parity],
                "step_index": self.indices[parity], "schedule_timesteps": self.timesteps,
                "schedule_coefficients": self.coefficients, "guidance_scale": self.guidance}

    def step_outputs(self, parity: int) -> dict:
        return {"latents_out": self.buffers[1 - parity], "state_out": self.states[1 - parity],
                "step_index_out": self.indices[1 - parity], "guided_output": self.guided}

    def _bind_reuse(self) -> None:
        """The update alone (step reuse), on the same ping-pong buffers; never captured."""
        self.reuse_runs = []
        if self.reuse_session is None:
            return
        reuse = self._captured_session(self.reuse_session)
        for parity in (0, 1):
            inputs = {"latents": self.buffers[parity], "state": self.states[parity], "step_index": self.indices[parity],
                      "schedule_coefficients": self.coefficients, "guided_output": self.guided}
            outputs = {"latents_out": self.buffers[1 - parity], "state_out": self.states[1 - parity],
                       "step_index_out": self.indices[1 - parity]}
            self.reuse_runs.append(reuse.bind(inputs, outputs))

    def start(self, plan, latents: np.ndarray, static: dict[str, np.ndarray], guidance: float, controlnet=None) -> None:
        """Write one image's values into the bound buffers (same shapes as ``bind`` got); ``controlnet``:
        the per-image inputs of the ControlNet (a dict), or of each ControlNet (a list of dicts)."""
        timesteps, coefficients = schedule_tables(plan, self.types["schedule_timesteps"], self.timesteps.shape()[0])
        writes = [(self.buffers[0], latents, self.types["latents"]), (self.states[0], np.zeros(self.state_shape), self.types["state"]),
                  (self.indices[0], np.zeros([1]), np.int64), (self.timesteps, timesteps, None),
                  (self.coefficients, coefficients, None), (self.guidance, np.asarray([guidance]), np.float32)]
        for name, value in static.items():
            if name not in self.static:
                continue
            if is_device_value(value):  # bound as it is (the key holds its address): nothing to copy
                if value.data_ptr() != self.static[name].data_ptr():
                    raise OnnxoptError(f"step input {name}: a device value other than the one bound")
                continue
            writes.append((self.static[name], value, self.types[name]))
        if self.controlnet_sessions:
            cn_timesteps, _ = schedule_tables(plan, self.cn_timestep_dtype, self.timesteps.shape()[0])
            writes.append((self.cn_timesteps, cn_timesteps, None))
            for buffers, types, values in zip(self.cn_static, self.cn_types, as_list(controlnet)):
                writes += [(buffers[name], value, types[name]) for name, value in values.items()]
        for target, value, dtype in writes:
            write(target, value, dtype)
        self.index = 0
        self.launches = []

    def _bind_controlnets(self, latents, controlnets: list[dict], capacity) -> dict:
        """Bind the input graph and each ControlNet on fixed buffers; returns the residual buffers by
        the step graph's input names. The input graph runs once per step for all the ControlNets:
        they read the same ``sample`` and ``timestep`` buffers (one dtype, one timestep shape)."""
        from onnxopt.pipeline.multi_controlnet import interface_name, same_dtype

        sessions = self.controlnet_sessions
        self.cn_types = [input_types(session) for session in sessions]
        sample_dtype = same_dtype([types["sample"] for types in self.cn_types], "sample")
        timestep_dtype = same_dtype([types["timestep"] for types in self.cn_types], "timestep")
        self.cn_timestep_dtype = input_types(self.prepare_session)["schedule_timesteps"]
        sample = self._zeros([2 * latents.shape[0], *latents.shape[1:]], sample_dtype)
        timestep_shapes = {timestep_feed(session, 0, sample.shape()[0]).shape for session in sessions}
        if len(timestep_shapes) > 1:
            raise OnnxoptError("the ControlNets take timesteps of different shapes: export them alike")
        timestep = self._zeros(timestep_shapes.pop(), timestep_dtype)
        self.cn_timesteps = self._zeros([capacity], self.cn_timestep_dtype)
        prepare = self._captured_session(self.prepare_session)
        self.prepare_runs = [prepare.bind({"latents": self.buffers[parity], "step_index": self.indices[parity],
                                           "schedule_timesteps": self.cn_timesteps,
                                           "schedule_coefficients": self.coefficients},
                                          {"sample": sample, "timestep": timestep}, graph_id=self.graph_ids[parity])
                             for parity in (0, 1)]
        self.prepare_runs[0].run_uncaptured()  # the ControlNets' shape probes below read sample and timestep
        residuals, self.cn_static, self.controlnet_runs = {}, [], []
        for k, (session, types, values) in enumerate(zip(sessions, self.cn_types, controlnets)):
            static = {name: self._zeros(np.shape(value), types[name]) for name, value in values.items()}
            # one binding for both parities (it reads sample and timestep): one graph id;
            # the residual shapes from one uncaptured run on zeros (they may be symbolic)
            run = self._captured_session(session).bind({**static, "sample": sample, "timestep": timestep},
                                              graph_id=self.graph_ids[0])
            self._keep += run.outputs.values()
            for name, value in run.outputs.items():
                residuals[interface_name(name, k)] = value
            self.cn_static.append(static)
            self.controlnet_runs.append(run)
        return residuals

    def step(self, reuse: bool = False) -> None:
        """Run step ``index`` (returns when the device has finished it); ``reuse``: the update alone,
        on the last computed step's guided output (no UNet, no ControlNet)."""
        parity = self.index % 2
        if reuse:
            self.reuse_runs[parity].run()
            self.index += 1
            return
        start = time.perf_counter()
        if self.controlnet_sessions:  # separate sessions (own streams): each run waits
            self.controlnet_step(parity)
        self.step_runs[parity].run()
        if self.launch_timing:
            self.launches.append(time.perf_counter() - start)
            self.step_runs[parity].synchronize()
        self.index += 1

    def controlnet_step(self, parity: int) -> None:
        """The ControlNets' input graph, then each ControlNet, into the residual buffers (each captured
        when its session was created with CUDA graphs: the graph ids are ignored otherwise)."""
        self.prepare_runs[parity].run()
        for run in self.controlnet_runs:
            run.run()

    def write_state(self, value: np.ndarray) -> None:
        """The next step's ``state`` buffer (a stochastic scheduler's noise for that step): a write
        into the bound buffer, which the captured graph reads where it was captured."""
        write(self.states[self.index % 2], value, self.types["state"])

    def latents(self) -> np.ndarray:
        """The latents after the last step."""
        return host_array(self.ort, self.buffers[self.index % 2])


def controlnet_prepare_model(dtype=np.float32, timestep_dtype=np.float32, timestep_shape: tuple = (1,)) -> bytes:
    """The ControlNet's per-step inputs ``sample`` and ``timestep`` as a graph of their own, on the
    bound buffers: :func:`onnxopt.pipeline.merged_step.emit_controlnet_inputs`'s nodes (the merged
    step graph holds the same ones). ``timestep_shape`` is the ControlNet's timestep: () a scalar,
    (1,) one value, else one per row."""
    import onnx_graphsurgeon as gs

    from onnxopt.fusion import Emit, NameAuthority
    from onnxopt.pipeline.merged_step import emit_controlnet_inputs

    graph = gs.Graph(name="controlnet_prepare", opset=17)
    make = Emit(graph, NameAuthority(graph), "prepare")
    inputs = [make.variable(name, kind, shape, exact=True) for name, kind, shape in (
        ("latents", np.float32, ["batch", 4, "height", "width"]), ("step_index", np.int64, [1]),
        ("schedule_timesteps", np.dtype(timestep_dtype), ["schedule"]), ("schedule_coefficients", np.float32, ["schedule", 6]))]
    graph.inputs = inputs
    sample, timestep = emit_controlnet_inputs(make, *inputs, sample_dtype=dtype, timestep_dtype=timestep_dtype,
                                              timestep_shape=tuple(timestep_shape))
    sample.name, sample.shape = "sample", ["batch2", 4, "height", "width"]
    timestep.name = "timestep"
    timestep.shape = [] if len(timestep_shape) == 0 else [1] if tuple(timestep_shape) == (1,) else ["batch2"]
    make.into(graph)
    graph.outputs = [sample, timestep]
    return serialized_graph(graph)


def serialized_graph(graph) -> bytes:
    """A small graph onnxopt builds for a session of its own (the ControlNet's input graph, the
    reuse step), checked and serialized (IR version 8: every ORT build reads it)."""
    import onnx
    import onnx_graphsurgeon as gs

    model = gs.export_onnx(graph)
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()
