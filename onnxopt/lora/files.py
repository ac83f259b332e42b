"""Reading a LoRA file: diffusers/peft's ``save_lora_weights`` format and kohya's, as low-rank pairs.

    read_lora("style.safetensors", 0.8) -> LoraFile(path, scale=0.8, modules=[LoraModule, ...])

Keys understood (``COMPONENTS``: unet, text_encoder, text_encoder_2)::

    peft / diffusers   unet.<module>.lora_A.weight, .lora_B.weight        (A: down, B: up)
                       text_encoder.text_model.encoder.layers.N.self_attn.q_proj.lora_A.weight ...
                       older diffusers: .lora.down.weight / .lora.up.weight, .lora_linear_layer.down/up
                       alpha: the file's ``lora_adapter_metadata`` (``<component>.lora_alpha``, its
                       ``alpha_pattern`` / ``rank_pattern``, ``use_rslora``), else a ``<module>.alpha``
                       key, else the rank (peft's and diffusers' default)
    kohya              lora_unet_<module_with_underscores>.lora_down.weight / .lora_up.weight / .alpha
                       lora_te_ (text_encoder), lora_te1_ / lora_te2_ (SDXL's two encoders)
                       SDXL's UNet blocks by SGM's names (lora_unet_input_blocks_4_1_transformer_blocks_0_
                       attn1_to_q): renamed to diffusers' blocks by diffusers' own converter, with the
                       UNet's layers_per_block, as load_lora_weights does

Each module's delta is what peft's LoRA layer adds to the weight: ``(alpha / rank) * B @ A`` (a
conv LoRA's factors flattened to matrices and the product given the conv weight's shape);
``use_rslora``: ``alpha / sqrt(rank)``. The file is read with the ``safetensors`` library after
a check of its header size; a file that is not a LoRA of these formats (an unknown key, a missing
half, shapes that do not multiply, a NaN or infinity, a header larger than the file) is refused
with one line (:class:`LoraError`, exit code 2).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnxopt.errors import OnnxoptError
from onnxopt.input_files import refuse_special_file

COMPONENTS = ("unet", "text_encoder", "text_encoder_2")
KOHYA_PREFIXES = {"lora_unet_": "unet", "lora_te_": "text_encoder", "lora_te1_": "text_encoder",
                  "lora_te2_": "text_encoder_2"}
DOWN = (".lora_A.weight", ".lora.down.weight", ".lora_linear_layer.down.weight", ".lora_down.weight")
UP = (".lora_B.weight", ".lora.up.weight", ".lora_linear_layer.up.weight", ".lora_up.weight")
ALPHA = ".alpha"
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit


class LoraError(OnnxoptError):
    """A LoRA file or argument onnxopt cannot apply: one line, exit code 2."""


@dataclass
class LoraModule:
    component: str  # unet | text_encoder | text_encoder_2
    module: str  # as the file names it: dotted (peft) or with underscores (kohya)
    kohya: bool
    down: np.ndarray  # A: [rank, in] or [rank, in, kh, kw]
    up: np.ndarray  # B: [out, rank] or [out, rank, 1, 1]
    factor: float  # alpha / rank (or alpha / sqrt(rank))

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    def delta(self) -> np.ndarray:
        """``factor * B @ A`` in the weight's shape ([out, in] or [out, in, kh, kw]), float32."""
        a = self.down.reshape(self.rank, -1).astype(np.float32)
        b = self.up.reshape(self.up.shape[0], self.rank).astype(np.float32)
        product = np.float32(self.factor) * (b @ a)
        return product.reshape((self.up.shape[0], *self.down.shape[1:]))


@dataclass
class LoraFile:
    path: Path
    scale: float
    modules: list[LoraModule] = field(default_factory=list)


def parse_lora_argument(text: str) -> tuple[Path, float]:
    """``FILE[:SCALE]``: the scale after the last colon (default 1.0), so a path may hold colons."""
    path, _, scale = text.rpartition(":")
    if path and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", scale.strip()):
        value = float(scale)
        return Path(path), value
    if path and not os.path.lexists(text) and os.path.isfile(path):  # FILE:SCALE whose scale is no number
        raise LoraError(f"{text}: the LoRA scale after the last colon, {scale!r}, is not a finite number "
                        f"(FILE[:SCALE], e.g. {path}:0.8)")
    return Path(text), 1.0


def read_lora(path: str | Path, scale: float = 1.0, unet_config: dict | None = None) -> LoraFile:
    """The low-rank modules of the LoRA file at ``path``; :class:`LoraError` when it is none.
    ``unet_config``: the folder's UNet config (its ``layers_per_block`` places SGM's block numbers)."""
    path = Path(path)
    if not math.isfinite(scale):
        raise LoraError(f"{path}: the LoRA scale must be a finite number, not {scale}")
    tensors, metadata = _read_safetensors(path)
    tensors = _sgm_blocks_as_diffusers(path, tensors, unet_config)
    pairs, alphas, unknown = _sort_keys(tensors)
    if unknown:
        raise LoraError(f"{path}: {len(unknown)} of {len(tensors)} keys are not LoRA weights of the diffusers/peft or "
                        f"kohya formats (first: {unknown[0]!r})")
    if not pairs:
        raise LoraError(f"{path}: no LoRA weights in the file")
    config = _adapter_metadata(path, metadata)
    modules = [_module(path, key, halves, alphas.get(key), config) for key, halves in sorted(pairs.items())]
    return LoraFile(path, float(scale), modules)


def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    refuse_special_file(path, "a LoRA", LoraError)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise LoraError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if len(head) < 8:
        raise LoraError(f"{path}: not a safetensors file (shorter than its header)")
    (header_bytes,) = struct.unpack("<Q", head)
    if header_bytes > min(size - 8, MAX_HEADER_BYTES):
        raise LoraError(f"{path}: not a safetensors file (a header of {header_bytes} bytes in a file of {size})")
    try:
        import torch  # bfloat16 LoRAs: numpy has no bfloat16
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key).to(torch.float32).numpy() for key in f.keys()}
    except ImportError as exc:
        raise LoraError("reading a LoRA needs safetensors and torch: pip install 'onnxopt[pipeline]'") from exc
    except Exception as exc:  # safetensors raises its own error types with long messages
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise LoraError(f"{path}: not a readable safetensors file ({first})") from exc
    for key, value in tensors.items():
        if not np.isfinite(value).all():
            raise LoraError(f"{path}: {key} holds NaN or infinite values")
    return tensors, metadata


SGM_BLOCKS = ("input_blocks", "middle_block", "output_blocks")


def _sgm_blocks_as_diffusers(path: Path, tensors: dict, unet_config: dict | None) -> dict:
    """A kohya file that names the UNet's modules as SGM's UNet does (kohya trains SDXL on it), with
    its UNet modules renamed to diffusers' (``unet.<module>.lora_down.weight``...) by diffusers' own
    converters, as ``load_lora_weights`` renames them: ``_maybe_map_sgm_blocks_to_diffusers`` (block
    numbers, from the UNet's layers_per_block), ``_convert_unet_lora_key`` (SGM's module names) and
    ``convert_unet_state_dict_to_peft``. The text encoders' kohya names are read as they are."""
    kohya = all(key.startswith(tuple(KOHYA_PREFIXES)) for key in tensors)
    if not kohya or not any(key.startswith("lora_unet_") and any(b in key for b in SGM_BLOCKS) for key in tensors):
        return tensors
    layers = (unet_config or {}).get("layers_per_block")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise LoraError(f"{path}: its UNet modules are named by SGM's blocks (input_blocks...): placing them needs "
                        "the UNet's layers_per_block (unet/config.json)")
    from types import SimpleNamespace

    from diffusers.loaders.lora_conversion_utils import _convert_unet_lora_key, _maybe_map_sgm_blocks_to_diffusers
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

    try:
        renamed = _maybe_map_sgm_blocks_to_diffusers(dict(tensors), SimpleNamespace(layers_per_block=layers))
    except (ValueError, IndexError) as exc:  # diffusers refuses a block it cannot place
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise LoraError(f"{path}: its SGM block names do not map to diffusers' UNet ({first})") from None
    converted = {}
    for key, value in renamed.items():
        name, _, suffix = key.partition(".")  # kohya's module names hold no dot
        if not name.startswith("lora_unet_"):
            converted[key] = value
            continue
        (peft,) = convert_unet_state_dict_to_peft({_convert_unet_lora_key(f"{name}.lora_down.weight"): None})
        converted[f"unet.{peft.removesuffix('.lora_A.weight')}.{suffix}"] = value
    return converted


def _sort_keys(tensors: dict) -> tuple[dict, dict, list]:
    """({(component, module, kohya): {"down": A, "up": B}}, {(component, module, kohya): alpha}, unknown keys)."""
    pairs: dict = {}
    alphas: dict = {}
    unknown = []
    for key, value in tensors.items():
        where = _component_module(key)
        if where is None:
            unknown.append(key)
            continue
        (component, rest, kohya) = where
        for role, suffixes in (("down", DOWN), ("up", UP)):
            suffix = next((s for s in suffixes if rest.endswith(s)), None)
            if suffix is not None:
                pairs.setdefault((component, rest[: -len(suffix)], kohya), {})[role] = value
                break
        else:
            if rest.endswith(ALPHA) and value.size == 1:
                alphas[(component, rest[: -len(ALPHA)], kohya)] = float(value.reshape(-1)[0])
            else:
                unknown.append(key)
    return pairs, alphas, unknown


def _component_module(key: str) -> tuple[str, str, bool] | None:
    for prefix, component in KOHYA_PREFIXES.items():
        if key.startswith(prefix):
            return component, key[len(prefix):], True
    head, _, rest = key.partition(".")
    return (head, rest, False) if head in COMPONENTS and rest else None


def _adapter_metadata(path: Path, metadata: dict) -> dict:
    """diffusers' ``lora_adapter_metadata``: peft's LoraConfig per component, keys ``<component>.<field>``."""
    text = metadata.get("lora_adapter_metadata")
    if not text:
        return {}
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the decoder goes
        raise LoraError(f"{path}: its lora_adapter_metadata is not JSON") from exc
    if not isinstance(config, dict):
        raise LoraError(f"{path}: its lora_adapter_metadata is not a JSON object")
    return config


def _pattern_value(path: Path, key: str, patterns, module: str):
    """peft's rank_pattern / alpha_pattern (the metadata's ``key``): a key matches a module name that
    ends with it. A pattern that is no regular expression, or patterns that are no JSON object, are
    the file's fault: one line."""
    if patterns is None:
        return None
    if not isinstance(patterns, dict):
        raise LoraError(f"{path}: its lora_adapter_metadata's {key} is not a JSON object")
    for pattern, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({pattern})$", module):
                return value
        except re.error as exc:
            raise LoraError(f"{path}: its lora_adapter_metadata's {key} holds {pattern!r}, not a regular expression "
                            f"({exc})") from None
    return None


def _module(path: Path, key: tuple, halves: dict, alpha: float | None, config: dict) -> LoraModule:
    component, module, kohya = key
    name = f"{component}.{module}"
    if set(halves) != {"down", "up"}:
        missing = "up (B)" if "up" not in halves else "down (A)"
        raise LoraError(f"{path}: {name} has no {missing} weight")
    down, up = halves["down"], halves["up"]
    rank = down.shape[0] if down.ndim else 0
    shapes_fit = (down.ndim in (2, 4) and up.ndim == down.ndim and rank > 0 and up.shape[1] == rank
                  and (up.ndim == 2 or up.shape[2:] == (1, 1)))
    if not shapes_fit:
        raise LoraError(f"{path}: {name}: A {list(down.shape)} and B {list(up.shape)} are not a LoRA pair "
                        "(A [rank, in(, kh, kw)], B [out, rank(, 1, 1)])")
    if alpha is None and config:
        alpha = _pattern_value(path, f"{component}.alpha_pattern", config.get(f"{component}.alpha_pattern"), module)
        alpha = config.get(f"{component}.lora_alpha") if alpha is None else alpha
    if alpha is not None and (not isinstance(alpha, (int, float)) or isinstance(alpha, bool)):
        raise LoraError(f"{path}: {name}: its alpha {alpha!r} (lora_adapter_metadata) is not a number")
    alpha = float(rank if alpha is None else alpha)
    rslora = bool(config.get(f"{component}.use_rslora", False))
    factor = alpha / (math.sqrt(rank) if rslora else rank)
    if not math.isfinite(factor):
        raise LoraError(f"{path}: {name}: alpha {alpha} is not a finite number")
    return LoraModule(component, module, kohya, down, up, factor)
