"""fuse-bias-split-gelu: diffusers' GEGLU feed-forward input as one com.microsoft BiasSplitGelu.

    h = x @ W + b                   Add(X, b)            b: a 1-D constant (D)
    a, g = chunk(h, 2, dim=-1)      Split(h, halves, axis=last)
    y = a * gelu(g)                 Mul(a, Gelu(g))      Gelu op or the erf chain, any operand order
                         ==>
    y = BiasSplitGelu(X, b)         (com.microsoft; X = x @ W stays)

Conditions: the split is exactly in halves along the last axis (no split input, or [D/2, D/2]);
h is 3-D (N, S, D) and fp32/fp16 (the CUDA kernel takes nothing else); D is one of the hidden
sizes ORT 1.31's CUDA kernel implements (2560, 5120, 6144, 10240, 12288; SD 1.x/2.x/XL use 2560,
5120 and 10240 at 320/640/1280 channels) -- any other D fails at run time with INVALID_ARGUMENT --
unless ``check_kernel_sizes=False`` (tests on tiny models; the NumPy reference takes any D).
The kernel gates the *right* half: ``left * gelu(right)``, diffusers' order. A GEGLU that gates
the left half is fused too when x @ W has a constant 2-D W: the halves of W's columns and of b
are swapped offline, so the left half of the new product is the old right half:

    y = g * gelu(a)  with  [a | g] = x @ W + b   ==>   BiasSplitGelu(x @ W', b'),
        W' = [W[:, D/2:] | W[:, :D/2]],  b' = [b[D/2:] | b[:D/2]]

Otherwise it is refused with the reason.

The TorchScript exporter writes ``chunk`` as two Slices with Shape-derived bounds; the dynamo
exporter writes a Split. ``slices-to-split`` (below, required by this fusion and inserted by the
pass manager) first rewrites Slices that tile one axis of a tensor as one Split, so the fusion
matches a single form.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.domains import MS_DOMAIN
from onnxopt.fusion import Emit, Fusion, FusionRun, NameAuthority, Refusal, Rule
from onnxopt.graph_edit import detach, is_standard
from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, SLICES_AS_SPLIT, OrtFusion, Pass, PassResult
from onnxopt.pattern import Const, Match, OneOf, Pattern, constant_shape, constant_value, is_constant, op
from onnxopt.pattern.tensor_facts import normalize_axis, rank_of, shape_of, static_dim, static_ints
from onnxopt.registry import register_pass
from onnxopt.weight_provenance import place, record, take
from onnxopt.weights import DerivedValues, numpy_dtype, stored_values

# ORT 1.31.1's CUDA kernel, run on an H100: "hidden size should be 2560, 5120, 6144, 10240 or 12288".
CUDA_HIDDEN_SIZES = (2560, 5120, 6144, 10240, 12288)
KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
SQRT2 = math.sqrt(2.0)


# ---------------------------------------------------------------- slices-to-split


@register_pass
class SlicesToSplit(Pass):
    """Slices of one tensor whose ranges tile one axis (``torch.chunk`` as TorchScript writes it)
    become one Split with those sizes; the Slice outputs become the Split's outputs.

        t -> Slice[0:a], Slice[a:b], ..., Slice[y:D]   (same axis, step 1)   ==>   Split(t, [a, b-a, ..., D-y])

    Bounds may be computed from Shape: they only need to be static once the dims are (see
    onnxopt.pattern.tensor_facts). The axis size D must be static, t a float tensor (activations:
    Slices of int64 shape vectors are shape plumbing and stay).
    """

    name = "slices-to-split"
    description = "rewrite Slices that tile one axis of a tensor (TorchScript's torch.chunk) as one Split"
    requires = frozenset({SHAPES_INFERRED})
    provides = frozenset({SLICES_AS_SPLIT})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        names = NameAuthority(graph)
        for data in _tensors_sliced_twice(graph):
            if data.dtype is None or not np.issubdtype(numpy_dtype(data.dtype), np.floating):
                continue  # shape plumbing (int64 vectors) stays as the exporter wrote it
            by_axis: dict[int, list[tuple[int, int, gs.Node]]] = {}
            for node in [c for c in data.outputs if c.op == "Slice" and is_standard(c) and c.inputs[0] is data]:
                bounds = _slice_bounds(node)
                if bounds is not None:
                    axis, start, end = bounds
                    by_axis.setdefault(axis, []).append((start, end, node))
            for axis, parts in by_axis.items():
                parts.sort(key=lambda p: (p[0], p[1]))
                if len(parts) < 2 or not _tile(parts, static_dim(data, axis)):
                    continue  # not a chunk: shape plumbing slices parts of a shape vector, a gap leaves a part out
                outputs = [node.outputs[0] for _, _, node in parts]
                for _, _, node in parts:
                    detach(node)
                _split(Emit(graph, names, parts[0][2].name), data, axis, parts, outputs)
                result.sites_matched += 1
                result.sites_rewritten += 1
        result.modified = result.sites_rewritten > 0
        if result.modified:
            graph.cleanup(remove_unused_graph_inputs=False).toposort()
        return result


def _tensors_sliced_twice(graph: gs.Graph) -> list[gs.Tensor]:
    seen: dict[int, gs.Tensor] = {}
    counts: dict[int, int] = {}
    for node in graph.nodes:
        if node.op == "Slice" and is_standard(node) and node.inputs:
            data = node.inputs[0]
            seen[id(data)] = data
            counts[id(data)] = counts.get(id(data), 0) + 1
    return [seen[k] for k, n in counts.items() if n >= 2]


def _slice_bounds(node: gs.Node) -> tuple[int, int, int] | None:
    """(axis, start, end) of a one-axis, step-1 Slice whose bounds are static, clamped to the axis."""
    inputs = node.inputs
    if len(inputs) < 3 or "starts" in node.attrs:  # opset < 10 form: not written by today's exporters
        return None
    starts, ends = static_ints(inputs[1]), static_ints(inputs[2])
    axes = static_ints(inputs[3]) if len(inputs) > 3 and inputs[3].name else [0]
    steps = static_ints(inputs[4]) if len(inputs) > 4 and inputs[4].name else [1]
    if None in (starts, ends, axes, steps) or not len(starts) == len(ends) == len(axes) == len(steps) == 1:
        return None
    if steps[0] != 1:
        return None
    data = inputs[0]
    axis = normalize_axis(axes[0], rank_of(data))
    size = static_dim(data, axis) if axis is not None else None
    if axis is None or size is None:
        return None
    start, end = (min(max(v + size if v < 0 else v, 0), size) for v in (starts[0], ends[0]))
    return axis, start, end


def _tile(parts: list[tuple[int, int, gs.Node]], size: int | None) -> bool:
    """The sorted ranges are non-empty, contiguous and cover [0, size)."""
    position = 0
    for start, end, _ in parts:
        if start != position or end <= start:
            return False
        position = end
    return position == size


def _split(make: Emit, data: gs.Tensor, axis: int, parts, outputs: list[gs.Tensor]) -> None:
    """Split(data) into the parts' sizes, computing ``outputs`` (the Slices' outputs)."""
    sizes = np.array([end - start for start, end, _ in parts], dtype=np.int64)
    if make.graph.opset >= 13:
        make.op.Split(data, make.constant("split_sizes", sizes), axis=axis, _outputs=outputs)
    else:
        make.op.Split(data, axis=axis, split=sizes.tolist(), _outputs=outputs)
    make.into(make.graph)


# ---------------------------------------------------------------- fuse-bias-split-gelu


def gelu(x):
    """Exact GELU: the Gelu op (ONNX 20 or com.microsoft), or the erf chain in the usual groupings."""
    erf = op.Erf(OneOf(x / SQRT2, x * (1.0 / SQRT2))) + 1.0
    return OneOf(
        op.Gelu(x, approximate="none"),
        op.Gelu(x, _domain=MS_DOMAIN),
        (x * erf) * 0.5,          # TorchScript: Mul(Mul(x, Add(Erf, 1)), 0.5)
        (x * 0.5) * erf,
        x * (erf * 0.5),
    )


def _halves(h):
    return op.Split(h, _outputs=2, _extra_inputs=True, _name="split")


def geglu(x, bias=Const()):
    """diffusers GEGLU: the left half gated by the GELU of the right half (the kernel's order)."""
    left, right = _halves(op.Add(x, bias, _name="bias_add"))
    return op.Mul(left, gelu(right))


def geglu_gating_left(x, bias=Const()):
    """The halves the other way round: right * gelu(left); fusable by swapping W's and b's halves."""
    left, right = _halves(op.Add(x, bias, _name="bias_add"))
    return op.Mul(right, gelu(left))


GEGLU = Pattern(geglu, name="geglu")
GEGLU_GATING_LEFT = Pattern(geglu_gating_left, name="geglu-gating-left")


def check(match: Match, run: FusionRun) -> Match:
    """The conditions of the module docstring; the match itself is the site."""
    bias_shape = constant_shape(match["bias"])
    if len(bias_shape) != 1:
        raise Refusal(f"bias has shape {list(bias_shape)}; BiasSplitGelu takes a 1-D bias")
    d = int(bias_shape[0])
    h = match.node("bias_add").outputs[0]
    rank = rank_of(h)
    if rank != 3:
        raise Refusal(f"the GEGLU input has rank {rank if rank is not None else 'unknown'}; BiasSplitGelu takes (N, S, D)")
    if static_dim(match["x"], -1) != d:
        raise Refusal(f"the bias of {d} is added to a last dim of {shape_of(match['x'])[-1]!r}, not {d}")
    reason = _halves_refusal(match.node("split"), d, rank)
    if reason is not None:
        raise Refusal(reason)
    dtype = h.dtype if h.dtype is not None else match["x"].dtype
    if dtype is not None and numpy_dtype(dtype) not in KERNEL_DTYPES:
        raise Refusal(f"dtype {numpy_dtype(dtype)}; the CUDA kernel takes float32 and float16")
    if run.fusion.check_kernel_sizes and d not in CUDA_HIDDEN_SIZES:
        raise Refusal(f"hidden size {d} is not one ORT's CUDA kernel implements {CUDA_HIDDEN_SIZES}")
    if match.pattern is GEGLU_GATING_LEFT:
        if _weight_of(match["x"]) is None:
            raise Refusal("gates the left half, and its input is not x @ W with a constant 2-D W whose column halves could be swapped")
        run.details["gated_half_swapped"] += 1
    return match


def emit(make: Emit, match: Match) -> list[gs.Tensor]:
    """BiasSplitGelu(x, b); the gated-left form reads a MatMul with W's and b's halves swapped.

    The original MatMul is left in place; cleanup drops it when nothing else reads it.
    """
    product, bias = match["x"], match["bias"]
    if match.pattern is GEGLU_GATING_LEFT:
        x, w = _weight_of(product)
        b = match.value("bias")
        half = b.shape[0] // 2
        w_swapped = make.constant("W_halves_swapped", _column_halves_swapped(w, half))
        bias = make.constant("bias_halves_swapped", np.concatenate([b[half:], b[:half]]))
        product = make.op.MatMul(x, w_swapped, _dtype=product.dtype, _shape=product.shape)
    return [make.ms.BiasSplitGelu(product, bias, _shape=match.output.shape)]


@register_pass
class FuseBiasSplitGelu(Fusion, OrtFusion):
    name = "fuse-bias-split-gelu"
    description = "fuse GEGLU (x@W + b, chunk in halves, a * gelu(g)) into com.microsoft BiasSplitGelu"
    requires = frozenset({SHAPES_INFERRED, SLICES_AS_SPLIT})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED, SLICES_AS_SPLIT})
    rules = (Rule(GEGLU, check, emit), Rule(GEGLU_GATING_LEFT, check, emit))

    def __init__(self, check_kernel_sizes: bool = True):
        self.check_kernel_sizes = check_kernel_sizes

    def finish(self, run: FusionRun) -> None:
        run.result.details["gated_half_swapped"] = run.details["gated_half_swapped"]


def _halves_refusal(split: gs.Node, d: int, rank: int) -> str | None:
    if len(split.outputs) != 2:
        return f"splits into {len(split.outputs)} parts, not halves"
    axis = normalize_axis(int(split.attrs.get("axis", 0)), rank)
    if axis != rank - 1:
        return f"splits axis {split.attrs.get('axis', 0)}, not the last axis"
    if d % 2:
        return f"an odd last dim ({d}) cannot be split in halves"
    sizes = split.attrs.get("split")
    if sizes is None and len(split.inputs) > 1 and split.inputs[1].name:
        sizes = static_ints(split.inputs[1])
        if sizes is None:
            return "split sizes are not static"
    if sizes is not None and list(sizes) != [d // 2, d // 2]:
        return f"splits into {list(sizes)}, not halves [{d // 2}, {d // 2}]"
    return None


def _weight_of(product: gs.Tensor) -> tuple[gs.Tensor, gs.Tensor] | None:
    """(x, W) when ``product`` is ``MatMul(x, W)`` with a constant 2-D W."""
    producer = product.inputs[0] if isinstance(product, gs.Variable) and len(product.inputs) == 1 else None
    if producer is None or producer.op != "MatMul" or not is_standard(producer):
        return None
    x, w = producer.inputs
    if not is_constant(w) or len(constant_shape(w)) != 2:
        return None
    return x, w


def _column_halves_swapped(w: gs.Tensor, half: int):
    """W (K, D) as [W[:, half:] | W[:, :half]]; computed when read or saved (W may be external)."""

    def swapped() -> np.ndarray:
        values = constant_value(w)
        return np.concatenate([values[:, half:], values[:, :half]], axis=1)

    if not isinstance(w, gs.Constant):  # a Constant node's value: small, computed now
        return swapped()
    k, d = w.shape
    result = DerivedValues(tuple(w.shape), w.dtype, swapped, name=f"{w.name}__halves_swapped", elements_of=[stored_values(w)])
    return record(result, [(stored_values(w), [take((0, half), (k, d)), place((k, d), (0, 0))]),
                           (stored_values(w), [take((0, 0), (k, half)), place((k, d), (0, d - half))])])


__all__ = ["CUDA_HIDDEN_SIZES", "GEGLU", "GEGLU_GATING_LEFT", "FuseBiasSplitGelu", "SLICES_AS_SPLIT", "SlicesToSplit", "gelu"]
