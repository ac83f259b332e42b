"""Seeded random LoRA files for a pipeline of this package, written as diffusers and kohya write them.

    path = write_lora(pipe, "out/a", seed=1, unet_targets=["to_q", "to_v"], text_targets=["q_proj"], rank=4, alpha=8)
    write_kohya(path, "out/a_kohya.safetensors")

``write_lora`` adds a peft LoRA (``init_lora_weights=False``: A and B both random, so the delta is not
zero) to a copy-free view of ``pipe``'s UNet and text encoder, and saves it with diffusers'
``save_lora_weights``: peft keys, the text encoder's with ``text_model.`` as files in the wild carry
them (transformers 5's CLIPTextModel has no such level), and peft's config as the file's
``lora_adapter_metadata`` (so ``lora_alpha`` is read back). The pipeline's own modules are left as
they were (the adapters are injected into a deep copy).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np


def write_lora(pipe, out_dir, seed: int, unet_targets, text_targets, rank: int, alpha: float) -> Path:
    """``out_dir/pytorch_lora_weights.safetensors``: a LoRA of ``pipe``'s UNet and text encoder."""
    import torch
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    layers, metadata = {}, {}
    for name, targets, prefix in (("unet", unet_targets, ""), ("text_encoder", text_targets, "text_model.")):
        if not targets:
            continue
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False)
        model = inject_adapter_in_model(config, copy.deepcopy(getattr(pipe, name)))
        layers[name] = {prefix + k: v for k, v in get_peft_model_state_dict(model).items()}
        metadata[name] = config.to_dict()
    StableDiffusionPipeline.save_lora_weights(
        Path(out_dir), unet_lora_layers=layers.get("unet"), text_encoder_lora_layers=layers.get("text_encoder"),
        unet_lora_adapter_metadata=metadata.get("unet"), text_encoder_lora_adapter_metadata=metadata.get("text_encoder"))
    return Path(out_dir) / "pytorch_lora_weights.safetensors"


def write_kohya(peft_file, out) -> Path:
    """The same LoRA in kohya's format: ``lora_unet_`` / ``lora_te_`` names with underscores,
    ``lora_down`` / ``lora_up``, and each module's alpha as a tensor (kohya files carry no peft config)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(peft_file), framework="np") as f:
        config = json.loads(f.metadata()["lora_adapter_metadata"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    kohya = {}
    for key, value in tensors.items():
        component, rest = key.split(".", 1)
        module, role = rest.rsplit(".lora_", 1)
        name = ("lora_unet_" if component == "unet" else "lora_te_") + module.replace(".", "_")
        kohya[f"{name}.{'lora_down' if role.startswith('A') else 'lora_up'}.weight"] = value
        kohya[f"{name}.alpha"] = np.asarray(float(config[f"{component}.lora_alpha"]), np.float32)
    save_file(kohya, str(out))
    return Path(out)
