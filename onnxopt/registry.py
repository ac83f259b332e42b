"""Which passes exist, and which presets chain them.

Built-in passes live in ``onnxopt.passes`` (the repo's ``passes/`` folder) and register
themselves with :func:`register_pass`. Third-party packages add passes through the entry-point
group ``onnxopt.passes``: each entry point names a :class:`~onnxopt.pass_infra.Pass` subclass
(or a module that registers passes on import).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib import metadata

from onnxopt.errors import UnknownPassError
from onnxopt.pass_infra import Pass, Sequence

ENTRY_POINT_GROUP = "onnxopt.passes"

_PASSES: dict[str, type[Pass]] = {}
_loaded = False


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    passes: tuple[str, ...]
    target: str | None = None
    # Repeat ``passes`` until none of them modifies the model (the pass manager runs each as its
    # own step; see onnxopt.pass_infra.Sequence). Another preset lists it by name, as one step.
    fixpoint: bool = False


PRESETS: dict[str, Preset] = {
    "cleanup": Preset(
        "cleanup",
        "remove Identity and dead nodes, fold constants, drop redundant Casts and neutral arithmetic, infer shapes",
        # Shapes first: graphsurgeon folds Shape ops only where it knows the shapes. Repeated until
        # nothing changes: new shapes let more fold, folding lets shape inference resolve more.
        ("remove-identity", "infer-shapes", "remove-redundant-casts", "remove-neutral-arithmetic", "remove-slice-concat",
         "fold-constants", "eliminate-dead-nodes"),
        fixpoint=True,
    ),
}
PRESETS["ort-cuda"] = Preset(
    "ort-cuda",
    "cleanup, then every fusion into ONNX Runtime's com.microsoft ops, then NHWC convolutions",
    ("cleanup",)
    + (
        "upsample-to-skip",  # a UNet's up-block upsamplers sized by their skip: any latent size (before nhwc-conv)
        "fuse-rotary-embedding",  # before fuse-attention: MHA then reads Q and K from RotaryEmbedding's (B, S, N*H)
        "fuse-attention",  # first: it reads the exporters' attention as written, before layout changes
        "fold-value-bias",  # a self-attention's V bias into the output projection's bias (reads MultiHeadAttention)
        "split-concat-projection",  # Linear(Concat(attn, mlp)) as two Linears, after fold-value-bias (it reads the Concat form)
        "fuse-group-norm",
        "fuse-skip-group-norm",
        "fuse-bias-split-gelu",
        "fuse-layer-norm",  # before bias-add: BiasAdd leaves the Adds that feed a LayerNorm to SkipLayerNorm
        "fuse-adaln-modulation",  # AdaLN's (1 + scale), shift into the LayerNorm's scale and bias, before skip-layer-norm
        "fuse-rms-norm",  # RMSNorm (and ONNX RMSNormalization) -> SimplifiedLayerNormalization, before skip-layer-norm
        "fuse-fast-gelu",  # tanh GELU (+ its bias Add) -> FastGelu, before bias-add takes the bias Add
        "fuse-bias-add",
        "fuse-skip-layer-norm",
        "fuse-parallel-gemm",  # after fuse-attention: the time-embedding Linears as one Gemm, every cross-attention K/V as one MatMul
        "nhwc-conv",  # last fusion: it wraps Convs (and finds GroupNorms) in Transposes and sinks them
        "fold-conv-bias",  # after nhwc-conv: conv biases move into the SkipGroupNorm / BiasAdd reading them
        "fuse-bias-layer-norm",  # the LayerNorms left (norm1 after proj_in) onto ORT's faster SkipLayerNorm kernel
        "eliminate-dead-nodes",
        "infer-shapes",
    ),
    target="ort-cuda",
)
PRESETS["tensorrt"] = Preset(
    "tensorrt",
    "cleanup, then standard ONNX ops TensorRT's parser fuses: attention with the scale on Q, GroupNormalization",
    # No com.microsoft op: TensorRT's parser reads standard ops only. LayerNormalization (both
    # exporters) and GELU (Erf chain or Gelu op) are left as written: TensorRT fuses them itself.
    ("cleanup",)
    + (
        "upsample-to-skip",  # a UNet's up-block upsamplers sized by their skip: any latent size
        # one attention form: constant scale, K^T one Transpose, no NaN guard; ONNX Attention (opset 23+)
        # lowered to MatMul-Softmax-MatMul, which every TensorRT 10 parser reads and its MHA fusion fuses
        "canonicalize-attention",
        "trt-attention-scale",  # the scale onto Q, before the first MatMul (TensorRT's MHA fusion)
        "trt-group-norm",  # Reshape-InstanceNorm-Reshape -> GroupNormalization (the model moves to opset 21)
        "eliminate-dead-nodes",
        "infer-shapes",
    ),
    target="tensorrt",
)


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass available by its ``name``."""
    for attr in ("name", "description"):
        if not getattr(cls, attr, None):
            raise TypeError(f"pass {cls.__qualname__} must define '{attr}'")
    existing = _PASSES.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"two passes named '{cls.name}': {existing.__module__} and {cls.__module__}")
    _PASSES[cls.name] = cls
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    importlib.import_module("onnxopt.passes")
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = entry.load()
        except Exception as exc:  # a broken plugin must not take the tool down
            import warnings

            warnings.warn(f"onnxopt: could not load pass plugin '{entry.name}' ({entry.value}): {exc}")
            continue
        if inspect.isclass(obj) and issubclass(obj, Pass):
            register_pass(obj)


def available_passes() -> dict[str, type[Pass]]:
    _load()
    return dict(sorted(_PASSES.items()))


_SEQUENCES: dict[tuple, type[Sequence]] = {}


def fixpoint_sequence(name: str, description: str, steps: tuple[str, ...]) -> type[Sequence]:
    """The :class:`Sequence` pass that repeats ``steps`` to a fixpoint (a fixpoint preset's pass)."""
    key = (name, description, tuple(steps))
    if key not in _SEQUENCES:
        _SEQUENCES[key] = type(f"Fixpoint[{name}]", (Sequence,),
                               {"name": name, "description": description, "steps": tuple(steps), "fixpoint": True,
                                "lookup": staticmethod(get_pass)})
    return _SEQUENCES[key]


def get_pass(name: str) -> type[Pass]:
    preset = PRESETS.get(name)
    if preset is not None and preset.fixpoint:
        return fixpoint_sequence(preset.name, preset.description, preset.passes)
    passes = available_passes()
    if name not in passes:
        raise UnknownPassError(f"unknown pass or preset '{name}'{_suggest(name)}; 'onnxopt passes' lists them")
    return passes[name]


def provider_of(prop: str) -> type[Pass] | None:
    for cls in available_passes().values():
        if prop in cls.provides:
            return cls
    return None


def expand(names: list[str]) -> list[str]:
    """Expand preset names into pass names, keeping order; unknown names raise UnknownPassError."""
    out: list[str] = []
    for name in names:
        name = name.strip()
        if not name:
            continue
        if name in PRESETS:  # a fixpoint preset stays one step (a Sequence); others are spelled out
            out.extend([name] if PRESETS[name].fixpoint else expand(list(PRESETS[name].passes)))
        else:
            get_pass(name)
            out.append(name)
    return out


def _suggest(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(available_passes()) + list(PRESETS), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
