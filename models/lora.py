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


def write_kohya_sdxl(pipe, out, seed: int, rank: int, alpha: float) -> Path:
    """A seeded LoRA of an SDXL pipeline's UNet attention projections and both text encoders, in kohya's
    SDXL format: ``lora_unet_`` with SGM's block names (``input_blocks_4_1_transformer_blocks_0_attn1_to_q``,
    ``middle_block_1_...``, ``output_blocks_3_1_...``: kohya trains SDXL on SGM's UNet), ``lora_te1_`` and
    ``lora_te2_`` with ``text_model_`` as files in the wild have it, and each module's alpha as a tensor."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict
    from safetensors.numpy import save_file

    torch.manual_seed(seed)
    layers = pipe.unet.config.layers_per_block
    kohya = {}
    # out_proj in both text encoders: diffusers' load_lora_weights infers a kohya text encoder LoRA's
    # key format from its out_proj keys (it refuses one without any)
    for name, targets, prefix in (("unet", ["to_q", "to_k", "to_v", "to_out.0"], "lora_unet_"),
                                  ("text_encoder", ["q_proj", "out_proj"], "lora_te1_text_model_"),
                                  ("text_encoder_2", ["k_proj", "out_proj"], "lora_te2_text_model_")):
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
        model = inject_adapter_in_model(config, copy.deepcopy(getattr(pipe, name)))
        for key, value in get_peft_model_state_dict(model).items():
            module, role = key.rsplit(".lora_", 1)
            module = _sgm_name(module, layers) if name == "unet" else module.removeprefix("text_model.")
            kohya_name = prefix + module.replace(".", "_")
            kohya[f"{kohya_name}.{'lora_down' if role.startswith('A') else 'lora_up'}.weight"] = value.detach().numpy()
            kohya[f"{kohya_name}.alpha"] = np.asarray(float(alpha), np.float32)
    save_file(kohya, str(out))
    return Path(out)


def _sgm_name(module: str, layers_per_block: int) -> str:
    """A diffusers UNet attention module's name as SGM's UNet names it (the inverse of diffusers'
    ``_maybe_map_sgm_blocks_to_diffusers`` for attentions)."""
    parts = module.split(".")
    if parts[0] == "mid_block":  # mid_block.attentions.0 -> middle_block.1
        return ".".join(["middle_block", "1", *parts[3:]])
    block, index = int(parts[1]), int(parts[3])
    if parts[0] == "down_blocks":
        return ".".join(["input_blocks", str(1 + block * (layers_per_block + 1) + index), "1", *parts[4:]])
    return ".".join(["output_blocks", str(block * (layers_per_block + 1) + index), "1", *parts[4:]])
