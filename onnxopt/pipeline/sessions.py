"""ONNX Runtime sessions for a pipeline, and the two ways the denoising step runs on them.

Providers:

* ``cpu``: the ORT CPU EP, plain ``InferenceSession.run`` with numpy in and out (``io_binding=True``
  runs the device loop below on CPU buffers instead: how the tests check that loop without a GPU).
* ``cuda``: the ORT CUDA EP. The text encoders and the VAE run once per image (plain ``run``);
  the step graph (and the ControlNet) run with IO binding on device buffers allocated once for
  the whole run. Per step only the 1-element timestep and the 6 step coefficients change; they
  are written into their device buffers with ``OrtValue.update_inplace``. With ``cuda_graph=True``
  the step is captured as CUDA graphs (the ``enable_cuda_graph`` provider option). The latents
  ping-pong between two buffers A and B, and so does the solver state::

        even steps:  latents=A, state=SA  ->  latents_out=B, state_out=SB     gpu_graph_id 0
        odd steps:   latents=B, state=SB  ->  latents_out=A, state_out=SA     gpu_graph_id 1

  Each parity has its own IOBinding and its own captured graph (ORT's ``gpu_graph_id`` run-config
  entry, onnxruntime PR #19636), so a replay reads and writes exactly the addresses it was
  captured with and no device-to-device copy is needed between steps.
* ``tensorrt``: ORT's TensorRT EP (CUDA EP behind it), the same IO binding. It needs the
  ``tensorrt`` module and an ORT build with the TensorRT EP; without them, a one-line
  :class:`MissingDependencyError` (exit code 2).

:class:`HostStepLoop` and :class:`DeviceStepLoop` run the fused step graph (see
:mod:`onnxopt.pipeline.step_graph`) and have the same interface: ``start`` with the per-image
inputs, ``step`` once per timestep, ``latents`` at the end.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from onnxopt.errors import MissingDependencyError, OnnxoptError
from onnxopt.runtime import import_onnxruntime

PROVIDERS = ("cpu", "cuda", "tensorrt")
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(int32)": np.int32, "tensor(double)": np.float64, "tensor(bool)": np.bool_}


def require_provider(provider: str):
    """Import ORT and check that ``provider`` can run here; one-line errors otherwise."""
    if provider not in PROVIDERS:
        raise OnnxoptError(f"unknown provider '{provider}' (choose from {', '.join(PROVIDERS)})")
    ort = import_onnxruntime()
    available = ort.get_available_providers()
    if provider == "cuda" and "CUDAExecutionProvider" not in available:
        raise MissingDependencyError("the cuda provider needs onnxruntime-gpu (pip install 'onnxopt[gpu]') and an NVIDIA GPU")
    if provider == "tensorrt":
        try:
            import tensorrt  # noqa: F401
        except ImportError:
            raise MissingDependencyError("the tensorrt provider needs TensorRT (pip install 'onnxopt[trt]') and an NVIDIA GPU")
        if "TensorrtExecutionProvider" not in available:
            raise MissingDependencyError("this onnxruntime has no TensorRT execution provider (install onnxruntime-gpu)")
    return ort


def provider_list(provider: str, *, cuda_graph: bool = False, device_id: int = 0, trt_cache: str | None = None) -> list:
    cuda = ("CUDAExecutionProvider", {"device_id": str(device_id), "enable_cuda_graph": "1" if cuda_graph else "0"})
    if provider == "cpu":
        return ["CPUExecutionProvider"]
    if provider == "cuda":
        return [cuda]
    options = {"device_id": str(device_id), "trt_fp16_enable": "1", "trt_cuda_graph_enable": "1" if cuda_graph else "0"}
    if trt_cache:
        options.update(trt_engine_cache_enable="1", trt_engine_cache_path=trt_cache, trt_timing_cache_enable="1")
    return [("TensorrtExecutionProvider", options), cuda]


def create_session(model: Path | bytes, provider: str, *, name: str, cuda_graph: bool = False, device_id: int = 0,
                   threads: int | None = None):
    """An InferenceSession for ``model`` (a path, or serialized bytes with weights inline)."""
    ort = require_provider(provider)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    if provider == "cpu":  # idle worker threads must not spin between runs: the loop's host work shares the cores
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    trt_cache = None
    if provider == "tensorrt" and isinstance(model, Path):
        trt_cache = str(Path(os.environ.get("ONNXOPT_TRT_CACHE", model.parent / ".trt-cache")))
    providers = provider_list(provider, cuda_graph=cuda_graph, device_id=device_id, trt_cache=trt_cache)
    try:
        return ort.InferenceSession(model if isinstance(model, bytes) else str(model), so, providers=providers)
    except Exception as exc:  # ORT raises its own exception types with long messages
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = " (a graph optimized for the CUDA EP: use --provider cuda)" if provider == "cpu" and "NOT_IMPLEMENTED" in first else ""
        raise OnnxoptError(f"{name}: ONNX Runtime cannot load the model: {first}{hint}") from exc


def input_types(session) -> dict[str, np.dtype]:
    return {i.name: np.dtype(_ORT_TYPES.get(i.type, np.float32)) for i in session.get_inputs()}


def run_host(session, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run with numpy feeds cast to the session's input types; outputs by name."""
    types = input_types(session)
    cast = {name: np.ascontiguousarray(np.asarray(value).astype(types[name], copy=False))
            for name, value in feeds.items() if name in types}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, cast)))


def timestep_feed(session, value, batch: int) -> np.ndarray:
    """The timestep as ``session`` takes it: a scalar, [1], or [batch] (exports differ), in its dtype."""
    spec = next(i for i in session.get_inputs() if i.name == "timestep")
    dtype = _ORT_TYPES.get(spec.type, np.float32)
    if len(spec.shape) == 0:
        return np.asarray(value, dtype=dtype)
    return np.full([1 if spec.shape[0] == 1 else batch], value, dtype=dtype)


def controlnet_sample(latents: np.ndarray, c_in: float, batch_copies: int = 2) -> np.ndarray:
    """The ControlNet's ``sample``: concat([latents * c_in] * 2), what the step graph feeds its UNet."""
    scaled = (latents * np.float32(c_in)).astype(latents.dtype, copy=False)
    return np.concatenate([scaled] * batch_copies, axis=0)


class HostStepLoop:
    """The fused step on numpy buffers (CPU EP, or any provider without IO binding)."""

    def __init__(self, step_session, controlnet_session=None):
        self.step_session = step_session
        self.controlnet_session = controlnet_session
        self.types = input_types(step_session)

    def start(self, latents: np.ndarray, static: dict[str, np.ndarray], controlnet: dict[str, np.ndarray] | None = None):
        self.latents_value = latents.astype(self.types["latents"])
        self.state = np.zeros_like(self.latents_value)
        self.static = static
        self.controlnet_static = controlnet or {}

    def step(self, timestep, coefficients: np.ndarray, guidance: float) -> None:
        feeds = dict(self.static)
        if self.controlnet_session is not None:
            sample = controlnet_sample(self.latents_value, coefficients[0])
            t = timestep_feed(self.controlnet_session, timestep, sample.shape[0])
            feeds.update(run_host(self.controlnet_session, {**self.controlnet_static, "sample": sample, "timestep": t}))
        feeds.update(latents=self.latents_value, timestep=np.asarray([timestep], dtype=self.types["timestep"]),
                     state=self.state, guidance_scale=np.asarray([guidance], np.float32),
                     step_coefficients=coefficients.astype(np.float32))
        out = run_host(self.step_session, feeds)
        self.latents_value, self.state = out["latents_out"], out["state_out"]

    def latents(self) -> np.ndarray:
        return self.latents_value


class DeviceStepLoop:
    """The fused step on device buffers that stay put for the whole run (CUDA / TensorRT EP).

    Inputs that never change during a run (text conditioning, the control image) are copied to
    the device once in ``start``; the timestep and the coefficients are updated in place; the
    latents and the state ping-pong between two buffer pairs (module docstring). The ControlNet,
    when present, reads its ``sample`` from a small scaling graph run on the same device buffers
    and writes its residuals into fixed buffers that the step graph reads.
    """

    def __init__(self, ort, step_session, controlnet_session=None, prepare_session=None, *, cuda_graph: bool = False,
                 device_id: int = 0, device: str = "cuda"):
        self.ort, self.step_session, self.cuda_graph, self.device_id = ort, step_session, cuda_graph, device_id
        self.device = device  # "cpu" runs the same bindings on the CPU EP (how CI tests this loop)
        self.controlnet_session, self.prepare_session = controlnet_session, prepare_session
        self.types = input_types(step_session)
        self._keep: list = []

    def _device(self, array: np.ndarray, dtype=None):
        value = self.ort.OrtValue.ortvalue_from_numpy(
            np.ascontiguousarray(array.astype(dtype or array.dtype, copy=False)), self.device, self.device_id)
        self._keep.append(value)
        return value

    def _empty(self, shape, dtype):
        value = self.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.dtype(dtype).type, self.device, self.device_id)
        self._keep.append(value)
        return value

    def start(self, latents: np.ndarray, static: dict[str, np.ndarray], controlnet: dict[str, np.ndarray] | None = None):
        dtype = self.types["latents"]
        latents = latents.astype(dtype)
        self.buffers = [self._device(latents), self._empty(latents.shape, dtype)]
        self.states = [self._device(np.zeros_like(latents)), self._empty(latents.shape, dtype)]
        self.timestep = self._device(np.zeros([1], self.types["timestep"]))
        self.coefficients = self._device(np.zeros([6], np.float32))
        self.guidance = self._device(np.zeros([1], np.float32))
        shared = {name: self._device(value, self.types.get(name)) for name, value in static.items() if name in self.types}
        residuals = self._start_controlnet(latents, controlnet) if self.controlnet_session is not None else {}
        self.bindings = []
        for parity in (0, 1):
            binding = self.step_session.io_binding()
            for name, value in {**shared, **residuals}.items():
                binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_input("latents", self.buffers[parity])
            binding.bind_ortvalue_input("state", self.states[parity])
            binding.bind_ortvalue_input("timestep", self.timestep)
            binding.bind_ortvalue_input("guidance_scale", self.guidance)
            binding.bind_ortvalue_input("step_coefficients", self.coefficients)
            binding.bind_ortvalue_output("latents_out", self.buffers[1 - parity])
            binding.bind_ortvalue_output("state_out", self.states[1 - parity])
            self.bindings.append(binding)
        self.index = 0

    def _start_controlnet(self, latents: np.ndarray, controlnet: dict[str, np.ndarray]) -> dict:
        """Bind the scaling graph and the ControlNet on fixed buffers; returns the residual buffers."""
        cn_types = input_types(self.controlnet_session)
        batch = self.controlnet_batch = 2 * latents.shape[0]
        sample = self._empty([batch, *latents.shape[1:]], cn_types["sample"])
        self.prepare_bindings = []
        for parity in (0, 1):
            binding = self.prepare_session.io_binding()
            binding.bind_ortvalue_input("latents", self.buffers[parity])
            binding.bind_ortvalue_input("step_coefficients", self.coefficients)
            binding.bind_ortvalue_output("sample", sample)
            self.prepare_bindings.append(binding)
        binding = self.controlnet_session.io_binding()
        for name, value in controlnet.items():
            binding.bind_ortvalue_input(name, self._device(value, cn_types[name]))
        binding.bind_ortvalue_input("sample", sample)
        self.controlnet_timestep = self._device(timestep_feed(self.controlnet_session, 0, batch))
        binding.bind_ortvalue_input("timestep", self.controlnet_timestep)
        # One run with ORT-allocated outputs tells the residual shapes; then fixed buffers are bound.
        for output in self.controlnet_session.get_outputs():
            binding.bind_output(output.name, self.device, self.device_id)
        self.prepare_session.run_with_iobinding(self.prepare_bindings[0])
        self.controlnet_session.run_with_iobinding(binding)
        residuals = {}
        for output, value in zip(self.controlnet_session.get_outputs(), binding.get_outputs()):
            dtype = np.float16 if "float16" in value.data_type() else np.float32
            residuals[output.name] = self._empty(value.shape(), dtype)
        binding.clear_binding_outputs()
        for name, value in residuals.items():
            binding.bind_ortvalue_output(name, value)
        self.controlnet_binding = binding
        return residuals

    def _run_options(self, parity: int):
        options = self.ort.RunOptions()
        if self.cuda_graph:
            options.add_run_config_entry("gpu_graph_id", str(parity))
        return options

    def step(self, timestep, coefficients: np.ndarray, guidance: float) -> None:
        parity = self.index % 2
        t = np.asarray([timestep], dtype=self.types["timestep"])
        self.timestep.update_inplace(t)
        self.coefficients.update_inplace(np.ascontiguousarray(coefficients, dtype=np.float32))
        self.guidance.update_inplace(np.asarray([guidance], np.float32))
        if self.controlnet_session is not None:
            self.controlnet_timestep.update_inplace(
                timestep_feed(self.controlnet_session, timestep, self.controlnet_batch))
            self.prepare_session.run_with_iobinding(self.prepare_bindings[parity])
            self.controlnet_session.run_with_iobinding(self.controlnet_binding)
        self.step_session.run_with_iobinding(self.bindings[parity], self._run_options(parity))
        self.index += 1

    def latents(self) -> np.ndarray:
        return self.buffers[self.index % 2].numpy()


def controlnet_prepare_model(dtype=np.float32) -> bytes:
    """A two-node graph: sample = Concat([latents * c_in] * 2), c_in = step_coefficients[0].

    On the device path the ControlNet's input is computed where the latents live, as the step
    graph computes its UNet input.
    """
    import onnx
    from onnx import TensorProto, helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        helper.make_node("Slice", ["step_coefficients", "zero", "one"], ["c_in"]),
        helper.make_node("Cast", ["c_in"], ["c_in_cast"], to=elem),
        helper.make_node("Mul", ["latents", "c_in_cast"], ["scaled"]),
        helper.make_node("Concat", ["scaled", "scaled"], ["sample"], axis=0),
    ]
    graph = helper.make_graph(
        nodes, "controlnet_prepare",
        [helper.make_tensor_value_info("latents", elem, ["batch", 4, "height", "width"]),
         helper.make_tensor_value_info("step_coefficients", TensorProto.FLOAT, [6])],
        [helper.make_tensor_value_info("sample", elem, ["batch2", 4, "height", "width"])],
        initializer=[helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
                     helper.make_tensor("one", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()
