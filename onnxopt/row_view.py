"""A tensor (..., K) seen as the rows of a 2-D matrix (M, K), and a GEMM's (M, N) result seen back as
(..., N): the two Reshapes around a Linear that is run as one 2-D GEMM.

Both Reshapes read a contiguous tensor, so ONNX Runtime runs them as views (its Reshape kernel
aliases its input): no copy, no kernel.

The shape back to (..., N) is a constant where that is exact: every leading dim static and
positive, or all but one, which is then -1 (Reshape's allowzero=0 reads a 0 in the shape as "copy
the input's dim", hence positive dims only). Otherwise it is ``Concat(Shape(x, end=-1), [N])``,
which needs opset 15 (Shape's ``end`` attribute).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.pattern import Pattern, op

SHAPE_SLICE_OPSET = 15  # Shape(start, end)


def linear(x, w):
    return op.MatMul(x, w, _name="matmul")


LINEAR = Pattern(linear, name="linear")  # y = x @ W: the site of the passes that run a Linear on rows


@dataclass
class LinearRows:
    """A Linear y = x @ W to run on rows: W (K, N), x (..., K)."""

    x: gs.Tensor
    w: gs.Tensor
    k: int
    n: int
    leading: list  # x's dims but the last (static ints, or symbols)
    output: gs.Tensor


def leading_dims(x: gs.Tensor) -> list:
    """x's dims but the last: ints where static, else whatever shape inference left (a symbol or None)."""
    return list(x.shape[:-1])


def static_positive(dim) -> bool:
    return isinstance(dim, (int, np.integer)) and int(dim) > 0


def rows_of(leading: list) -> int | None:
    """M, the product of the leading dims, when all are static."""
    return int(np.prod(leading, dtype=np.int64)) if all(isinstance(d, (int, np.integer)) for d in leading) else None


def constant_shape_back(leading: list, n: int) -> list[int] | None:
    """The target shape (..., N) as constant ints with allowzero=0 semantics, or None when only the
    run-time shape of x can say it (two or more unknown leading dims, or a static 0)."""
    unknown = [i for i, d in enumerate(leading) if not static_positive(d)]
    if n <= 0 or len(unknown) > 1 or any(isinstance(leading[i], (int, np.integer)) for i in unknown):
        return None
    return [-1 if i in unknown else int(d) for i, d in enumerate(leading)] + [n]


def needs_runtime_shape(leading: list, n: int) -> bool:
    return constant_shape_back(leading, n) is None


def to_rows(make, x: gs.Tensor, k: int, leading: list) -> gs.Tensor:
    """Reshape(x, [-1, K]): (M, K)."""
    return make.op.Reshape(x, make.constant("rows_by_k", np.array([-1, k], np.int64)), _shape=[rows_of(leading), k],
                           _label="to_rows")


def from_rows(make, y2: gs.Tensor, x: gs.Tensor, leading: list, n: int, *, shape=None, dtype=None) -> gs.Tensor:
    """Reshape(y2, [x's leading dims..., N]); ``shape``/``dtype`` annotate the result (the tensor it replaces)."""
    target = constant_shape_back(leading, n)
    if target is not None:
        out_shape = make.constant("out_shape", np.array(target, np.int64))
    else:
        dims = make.op.Shape(x, end=-1, _dtype=np.int64, _shape=[len(leading)], _label="leading_dims")
        out_shape = make.op.Concat(dims, make.constant("n", np.array([n], np.int64)), axis=0, _shape=[len(leading) + 1])
    extra = {"_dtype": dtype} if dtype is not None else {}
    return make.op.Reshape(y2, out_shape, _shape=shape if shape is not None else [*leading, n], _label="from_rows", **extra)


__all__ = ["LINEAR", "SHAPE_SLICE_OPSET", "LinearRows", "constant_shape_back", "from_rows", "leading_dims", "needs_runtime_shape", "rows_of", "to_rows"]
