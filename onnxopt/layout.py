"""Tensor layouts: the NCHW <-> NHWC permutations, and the ops that move data without computing."""

from __future__ import annotations

TO_NHWC = [0, 2, 3, 1]  # Transpose perm: NCHW -> NHWC
TO_NCHW = [0, 3, 1, 2]  # Transpose perm: NHWC -> NCHW

# Ops that change only how values are laid out or typed, not which values there are.
LAYOUT_OPS = frozenset({"Reshape", "Transpose", "Cast", "Squeeze", "Unsqueeze", "Identity"})


def permuted(shape, perm):
    """``shape`` after Transpose(perm); None (an unknown shape) stays None."""
    return None if shape is None else [shape[p] for p in perm]


def inverse(perm: list[int]) -> list[int]:
    """The perm that undoes ``perm``."""
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = i
    return out
