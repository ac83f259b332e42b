"""Seeded random initialisation for models built from configs.

Default initialisation leaves many parameters constant: norm weights of 1,
zero biases (transformers zeroes every Linear bias), ControlNet's zero
convolutions, zero-initialised output convolutions.  Constant tensors hide
optimizer bugs (a dropped bias, a swapped scale/bias, a fused zero conv all
give the right answer) and they change what the exporters write (constant
folding can remove an ``Add`` of zeros).  :func:`perturb_constant_parameters`
replaces every constant parameter with a small amount of seeded noise around
its value.
"""
from __future__ import annotations

import random

import numpy as np

try:  # torch is optional for the package as a whole (fixtures tests need only onnx/ORT)
    import torch
except ImportError:  # pragma: no cover
    torch = None

DEFAULT_SEED = 0

# Noise scales for parameters the default init leaves constant.
ONES_NOISE = 0.1     # weight of 1  ->  1 + 0.1 * randn   (GroupNorm / LayerNorm gamma)
BIAS_NOISE = 0.05    # 1-D zeros    ->  0.05 * randn      (biases, norm beta)
WEIGHT_NOISE = 0.02  # N-D zeros    ->  0.02 * randn      (zero convs, zero-initialised conv_out)
OTHER_NOISE = 0.05   # any other constant c -> c + 0.05 * randn * max(|c|, 1)
# The perturbation draws from its own generator, seeded with seed + this (the global one seeds the init).
PERTURB_SEED_OFFSET = 1_000_003


def seed_everything(seed: int = DEFAULT_SEED) -> None:
    """Seed python, numpy and torch RNGs (CPU)."""
    random.seed(seed)
    np.random.seed(seed)
    if torch is not None:
        torch.manual_seed(seed)


def is_constant(t: "torch.Tensor") -> bool:
    if t.numel() <= 1:
        return False
    flat = t.detach().reshape(-1)
    return bool(torch.all(flat == flat[0]))


def perturb_constant_parameters(module: "torch.nn.Module", seed: int = DEFAULT_SEED) -> dict:
    """Replace constant parameters with seeded noise around their value.

    Returns a summary ``{"ones": n, "zero_bias": n, "zero_weight": n, "other": n}``
    counting the tensors that were changed.
    """
    with torch.no_grad():
        return _perturb(module, seed)


def _perturb(module, seed):
    gen = torch.Generator().manual_seed(seed + PERTURB_SEED_OFFSET)
    summary = {"ones": 0, "zero_bias": 0, "zero_weight": 0, "other": 0}
    for _, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        if not p.dtype.is_floating_point or not is_constant(p):
            continue
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
        summary[perturb_constant(p, noise)] += 1
    return summary


def perturb_constant(p: "torch.Tensor", noise: "torch.Tensor") -> str:
    """Replace the constant tensor ``p`` with ``noise`` scaled around its value, in place; returns
    which kind of constant it was (a key of :func:`perturb_constant_parameters`' summary)."""
    c = float(p.reshape(-1)[0])
    if c == 1.0:
        p.copy_(1.0 + ONES_NOISE * noise)
        return "ones"
    if c == 0.0 and p.dim() == 1:
        p.copy_(BIAS_NOISE * noise)
        return "zero_bias"
    if c == 0.0:
        p.copy_(WEIGHT_NOISE * noise)
        return "zero_weight"
    p.copy_(c + OTHER_NOISE * max(abs(c), 1.0) * noise)
    return "other"


def init_module(module: "torch.nn.Module", seed: int = DEFAULT_SEED) -> "torch.nn.Module":
    """Perturb constant parameters and put the module in eval mode (no grads)."""
    perturb_constant_parameters(module, seed)
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module
