"""``onnxopt generate --provider tensorrt``: a pipeline's components run on their TensorRT engines.

    require_engine_runtime()                      # before any session: TensorRT, and a GPU it runs engines on
    session = component_engine_session(Path("OUT/unet/model.onnx"), "unet")   # runs OUT/unet/model.plan

The engines are the ones ``onnxopt optimize ... --target tensorrt --build-engines`` writes beside each
component's model.onnx (:mod:`onnxopt.runners.folder_engines`), run by TensorRT's runtime through
Polygraphy's ``TrtRunner``. :class:`EngineSession` answers the part of ONNX Runtime's
``InferenceSession`` the pipeline's host loop calls (``get_inputs``, ``get_outputs``, ``run``), so
the pipeline runs unchanged on it: numpy in and out, the UNet and diffusers' scheduler step by
step (the unfused loop); the fused step graph, IO binding and CUDA graphs stay ORT CUDA's.

Where it runs: the full TensorRT on the GPU it built for; TensorRT-RTX on compute capability
8.0 8.6 8.9 12.x. On any other GPU (an H100 or H200, 9.0) :func:`require_engine_runtime` stops with
one line naming those and the ORT CUDA path. Not run here (no such GPU): written against
Polygraphy's documented ``TrtRunner`` API.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnxopt.errors import MissingDependencyError, OnnxoptError
from onnxopt.runners.tensorrt import _first_line, import_tensorrt, require_runnable_gpu

ENGINE_FILE = "model.plan"


def require_engine_runtime() -> tuple[int, int]:
    """The GPU's compute capability, where the chosen TensorRT runs engines on it; else a one-line
    error (exit 2): TensorRT missing, no GPU, or a GPU TensorRT-RTX does not run engines on."""
    try:
        import_tensorrt()
        return require_runnable_gpu()
    except MissingDependencyError as exc:
        raise MissingDependencyError(f"the tensorrt provider needs TensorRT and an NVIDIA GPU: {exc}") from exc


def engine_path_for(model: Path) -> Path | None:
    """The engine ``--build-engines`` wrote for a component's ``model.onnx``, when there is one."""
    if not isinstance(model, Path) or model.name != "model.onnx":
        return None
    engine = model.with_name(ENGINE_FILE)
    return engine if engine.is_file() else None


def component_engine_session(model, name: str) -> "EngineSession":
    """An :class:`EngineSession` on the engine beside ``model``; one line (exit 2) when there is none."""
    engine = engine_path_for(model)
    if engine is None:
        raise OnnxoptError(f"{name}: no TensorRT engine beside {model}: optimize the folder with --target tensorrt "
                           "--build-engines (the tensorrt provider runs engines, built for this GPU's compute capability)")
    return EngineSession(engine, name)


@dataclass(frozen=True)
class TensorInfo:
    """What ``InferenceSession.get_inputs()`` items tell: name, ORT type string, shape (None: dynamic)."""

    name: str
    type: str
    shape: list


def _ort_type(dtype) -> str:
    from onnxopt.runtime import ORT_TYPES

    names = {np.dtype(v): k for k, v in ORT_TYPES.items()}
    return names.get(np.dtype(dtype), f"tensor({np.dtype(dtype).name})")


class EngineSession:
    """A TensorRT engine behind ``InferenceSession``'s host-side interface (one execution context)."""

    def __init__(self, engine: Path, name: str):
        from polygraphy.backend.common import BytesFromPath
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        self.engine_path, self.name = Path(engine), name
        self.runner = TrtRunner(EngineFromBytes(BytesFromPath(str(engine))), name=f"trt:{name}")
        try:
            self.runner.activate()
        except Exception as exc:  # Polygraphy raises after TensorRT's log: the engine is for another GPU or version
            raise OnnxoptError(f"{name}: TensorRT cannot load {self.engine_path}: {_first_line(exc)} "
                               "(rebuild it here: onnxopt build, or optimize --build-engines)") from exc
        trt = import_tensorrt()
        engine_ = self.runner.engine
        tensors = [engine_.get_tensor_name(i) for i in range(engine_.num_io_tensors)]

        def info(tensor: str) -> TensorInfo:
            shape = [d if d >= 0 else None for d in engine_.get_tensor_shape(tensor)]
            return TensorInfo(tensor, _ort_type(trt.nptype(engine_.get_tensor_dtype(tensor))), shape)

        self._inputs = [info(t) for t in tensors if engine_.get_tensor_mode(t) == trt.TensorIOMode.INPUT]
        self._outputs = [info(t) for t in tensors if engine_.get_tensor_mode(t) == trt.TensorIOMode.OUTPUT]

    def get_inputs(self) -> list[TensorInfo]:
        return list(self._inputs)

    def get_outputs(self) -> list[TensorInfo]:
        return list(self._outputs)

    def run(self, names, feeds: dict) -> list[np.ndarray]:
        try:
            out = self.runner.infer({k: np.asarray(v, order="C") for k, v in feeds.items()})
        except Exception as exc:  # a shape outside the engine's profile, mostly
            shapes = ", ".join(f"{k}={tuple(np.shape(v))}" for k, v in feeds.items())
            raise OnnxoptError(f"{self.name}: the engine {self.engine_path} cannot run {shapes}: {_first_line(exc)} "
                               "(engines are built for one size: rebuild with onnxopt build --profile)") from exc
        return [np.asarray(out[n]) for n in (names or [o.name for o in self._outputs])]

