"""Where low precision would change what the graph computes, and the node-level answer to each.

The ``fp16`` pass asks these rules which nodes must stay float32 before it assigns types. Each
rule returns ``{node: reason}``; the mask rule also names the constants that are attention masks,
whose low-precision copy is clamped instead of overflowing to -inf.

1. Constants beyond the low-precision range (``|c| > 65504`` for float16, ``±inf``)::

       c(-inf | -3.4e38) ─ [Where X/Y, Expand, Reshape, Cast, ...] ─ Add(scores) ─ [Add, Reshape, ...] ─ Softmax
       c(-inf | -3.4e38) ─ [...] ─ MultiHeadAttention/Attention(attention_bias)
           ==>  c becomes -max/2 (-32752 in float16, LowPrecision.mask_fill): a finite mask, and
                softmax gives the same result (exp(-32752 + s - max_s) underflows to 0 exactly as
                exp(-inf) does); half the range keeps mask + score and mask + mask finite

       c(+big) ─ Clip(max) | Min    and    c(-big) ─ Clip(min) | Max
           ==>  c converts to ±inf: an inactive bound stays inactive

       any other use  ==>  the consumer (and every value-carrying node between) stays float32,
                           reported as a refusal with the constant's magnitude

   Only *every* use reaching a mask sink makes a constant a mask; a single other use, or a
   positive overflow, makes it a plain out-of-range constant. A mask that also stays float32 (a
   forced-float32 consumer) gets the same fill there, so a Cast of it to low precision further on
   is finite too.

   Rows with at least one unmasked entry (every row of a causal mask) are identical. A fully
   masked row (padding) differs by construction: float32 gives NaN with -inf and uniform weights
   with -3.4e38 (it absorbs the scores); plain conversion gives NaN (the black image); the clamped
   mask gives the softmax of the raw scores, finite. Exporters guard such rows (dynamo's
   ``Where(IsNaN(p), 0, p)``) or never produce them.

2. Small constants (epsilons) whose every non-zero value rounds to zero (1e-12 in float16):
   the consumer stays float32, and so does the chain carrying the value into a divisor::

       v ─ Add(1e-12) ─ Sqrt ─ Div(x, ·)     all float32: x / Sqrt(0 + 1e-12) must not become 0/0

3. Periodic functions need the absolute precision of their argument: ``Sin``/``Cos`` and the
   data-dependent arithmetic producing their argument (timestep × frequency: 999 × 0.79 rounds by
   up to 0.25 rad in float16) stay float32. This is what PyTorch does: diffusers'
   ``get_timestep_embedding`` computes in float32 and casts the embedding to the model dtype, which
   is the TorchScript export's ``time_proj`` ``Cast(to=FLOAT)``.

       t ─ Unsqueeze ─ Cast ─ Mul(freqs) ─ Sin/Cos ─ Concat ─ Cast(to=FLOAT) ─ Gemm
       └───────────── float32 ──────────────────────────┘    └ retargeted ┘ └ low ┘

5. Gated feed-forward outputs (float16 only; bfloat16 has float32's range). T5 v1.1's FFN,
   ``wo(gelu(x W_i0) * (x W_i1))``, overflows float16 with real weights (transformers keeps
   ``wo`` in float32 for this, ``T5PreTrainedModel._keep_in_fp32_modules``, and clamps the hidden
   states). Random weights do not show it, so this is a pattern rule, not a measurement::

       x ─ MatMul(W_i0) ─ GELU ─┐
       x ─ MatMul(W_i1) ────────┴ Mul ─ MatMul(W_o) ─ Add / Skip*Normalization ─ ... residual stream
                                        └────────────── float32 ───────────────────────────────┘

   The output projection stays float32, and so does the residual stream from there on: every
   Add, Sum and Skip(Simplified)LayerNormalization it reaches through sums, and every norm that
   reads it (SimplifiedLayerNormalization / LayerNormalization: their normalized outputs are small
   and go back to float16 for the next MatMul). A GELU is FastGelu, Gelu, BiasGelu or a Mul chain
   reaching Tanh or Erf within a few nodes. Decomposed norms (unfused graphs) are not followed:
   ``--fp32-auto`` calibration covers those.

4. Calibration (``fp32_auto``): a tensor whose magnitude exceeded the range on the calibration
   inputs cannot exist in low precision, so its producer *and* every consumer stay float32
   (keeping only the producer would cast the overflowing value for its consumers). Only those:
   ``x*1e3*1e3/1e3/1e3`` keeps the second Mul and the first Div.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.precision import LowPrecision, ValueStats, values_stats

# Ops that move or select values without arithmetic: a value passes through them unchanged.
DATA_MOVEMENT_OPS = frozenset({
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Gather", "GatherElements",
    "GatherND", "Concat", "Split", "Expand", "Tile", "Identity", "Where", "Pad", "DepthToSpace",
    "SpaceToDepth", "Trilu", "ReverseSequence", "Compress",
})
# Inputs through which a value travels (others are indices, shapes, conditions).
_VALUE_SLOTS = {"Where": (1, 2), "Pad": (0, 2), "Gather": (0,), "GatherElements": (0,), "GatherND": (0,),
                "Compress": (0,), "Reshape": (0,), "Slice": (0,), "Expand": (0,), "Tile": (0,),
                "Trilu": (0,), "Split": (0,), "ReverseSequence": (0,)}
FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)
MASK_SINK_OPS = {"Softmax": 0}  # op -> input index that takes the masked scores
ATTENTION_BIAS_INPUT = {"MultiHeadAttention": 5, "Attention": 5}  # com.microsoft
PERIODIC_OPS = frozenset({"Sin", "Cos", "Tan"})
# What may carry an epsilon-sized value to the divisor it protects (rule 2).
EPSILON_PATH_OPS = frozenset({"Add", "Sqrt", "Pow", "Max", "Clip", "Abs", "Cast"})
# What may produce a periodic function's argument (walked backwards, data-dependent values only).
ARGUMENT_OPS = DATA_MOVEMENT_OPS | {"Mul", "Div", "Add", "Sub", "Neg", "Cast", "Floor", "Ceil", "Round", "Mod"}
MAX_ARGUMENT_NODES = 32


def carries_value(node: gs.Node, index: int) -> bool:
    """True when input ``index`` of ``node`` reaches its output unchanged (data movement, float Cast)."""
    if node.op == "Cast":
        return int(node.attrs.get("to", 0)) in FLOAT_TYPES
    if node.op not in DATA_MOVEMENT_OPS or node.domain not in ("", "ai.onnx", None):
        return False
    slots = _VALUE_SLOTS.get(node.op)
    return slots is None or index in slots


def uses(tensor: gs.Tensor) -> Iterable[tuple[gs.Node, int]]:
    for node in tensor.outputs:
        for i, t in enumerate(node.inputs):
            if t is tensor:
                yield node, i


def node_label(node: gs.Node) -> str:
    return node.name or f"<{node.op} -> {node.outputs[0].name if node.outputs else '?'}>"


@dataclass
class ConstantHazards:
    fp32: dict[int, tuple[gs.Node, str]] = field(default_factory=dict)  # id(node) -> (node, reason)
    masks: dict[str, float] = field(default_factory=dict)  # mask constant (or Constant output) -> its most negative value
    bounds: dict[str, float] = field(default_factory=dict)  # out-of-range inactive bounds (become ±inf)
    scanned: int = 0

    def keep(self, node: gs.Node, reason: str) -> None:
        self.fp32.setdefault(id(node), (node, reason))


def constant_sources(graph: gs.Graph, is_float32: Callable[[gs.Tensor], bool]):
    """(tensor, values, label) for every float32 constant: initializers, Constant and ConstantOfShape outputs."""
    seen = set()
    for node in graph.nodes:
        for t in node.inputs:
            if isinstance(t, gs.Constant) and id(t) not in seen and is_float32(t):
                seen.add(id(t))
                yield t, t, t.name
        if node.op in ("Constant", "ConstantOfShape") and node.outputs and is_float32(node.outputs[0]):
            values = constant_node_value(node)
            if values is not None:
                yield node.outputs[0], values, node.outputs[0].name


def constant_node_value(node: gs.Node):
    """The float value a Constant / ConstantOfShape node produces (a gs.Constant or an array)."""
    value = node.attrs.get("value")
    if isinstance(value, gs.Constant):
        return value
    if node.op == "ConstantOfShape" and value is None:
        return np.zeros(1, np.float32)  # the spec's default
    if "value_float" in node.attrs:
        return np.asarray(node.attrs["value_float"], np.float32)
    if "value_floats" in node.attrs:
        return np.asarray(node.attrs["value_floats"], np.float32)
    return None


def constant_hazards(graph: gs.Graph, low: LowPrecision, is_float32: Callable[[gs.Tensor], bool]) -> ConstantHazards:
    """Rules 1 and 2: scan every float32 constant (a chunk at a time) and decide what each use needs."""
    out = ConstantHazards()
    graph_outputs = {id(t) for t in graph.outputs}
    sources = (((tensor, label), values) for tensor, values, label in constant_sources(graph, is_float32))
    for (tensor, label), stats in values_stats(sources, low):
        out.scanned += 1
        if stats.vanishes:
            compute, movers = _compute_uses(tensor)
            reason = f"constant '{label}' rounds to zero in {low.name}"
            for node in _epsilon_chains(compute) + movers:
                out.keep(node, reason)
            continue
        if not stats.overflows(low):
            continue
        magnitude = "inf" if stats.has_inf else f"{stats.absmax:.3g}"
        if stats.neg_overflow and not stats.pos_overflow and _only_reaches_masks(tensor, graph_outputs):
            out.masks[label] = -float("inf") if stats.has_inf else -stats.absmax
            continue
        compute, movers = _compute_uses(tensor)
        unsafe = [n for n in compute if not _inactive_bound(n, tensor, stats, low)]
        if not unsafe:
            out.bounds[label] = stats.absmax
            continue
        reason = f"constant '{label}' holds {magnitude}, beyond the {low.name} range (±{low.max:g})"
        for node in unsafe + movers:
            out.keep(node, reason)
    return out


def _compute_uses(tensor: gs.Tensor) -> tuple[list[gs.Node], list[gs.Node]]:
    """(nodes that compute with ``tensor``'s values, data-movement nodes that carry them there)."""
    compute: list[gs.Node] = []
    movers: list[gs.Node] = []
    stack, seen = [tensor], set()
    while stack:
        t = stack.pop()
        for node, i in uses(t):
            if id(node) in seen:
                continue
            seen.add(id(node))
            if carries_value(node, i):
                movers.append(node)
                stack.extend(node.outputs)
            else:
                compute.append(node)
    return compute, movers


def _epsilon_chains(nodes: list[gs.Node]) -> list[gs.Node]:
    """``nodes`` and, after each, the chain that carries the epsilon into a divisor.

    ``x / Sqrt(v + eps)``: keeping only the Add float32 would cast ``v + eps`` (= eps for v = 0)
    back to float16, where it is 0 again, and 0/0 is NaN; the chain up to and including the
    division stays float32, and its result (x normalized) is what goes back to low precision.
    """
    chain = list(nodes)
    seen = {id(n) for n in nodes}
    stack = [o for n in nodes for o in n.outputs]
    while stack:
        t = stack.pop()
        for node, i in uses(t):
            if id(node) in seen:
                continue
            if (node.op == "Div" and i == 1) or node.op == "Reciprocal":
                seen.add(id(node))
                chain.append(node)
            elif node.op in EPSILON_PATH_OPS:
                seen.add(id(node))
                chain.append(node)
                stack.extend(node.outputs)
    return chain


def _only_reaches_masks(tensor: gs.Tensor, graph_outputs: set[int]) -> bool:
    """Every path from the constant ends in an additive mask before Softmax (or an attention bias)."""

    def masked_scores_ok(t: gs.Tensor, seen: set[int]) -> bool:
        if id(t) in graph_outputs:
            return False
        for node, i in uses(t):
            if (node.op, i) in MASK_SINK_OPS.items() and node.domain in ("", "ai.onnx", None):
                continue
            if ATTENTION_BIAS_INPUT.get(node.op) == i and node.domain == "com.microsoft":
                continue
            if node.op == "Add" or carries_value(node, i):
                if id(node) in seen:
                    continue
                seen.add(id(node))
                if not all(masked_scores_ok(o, seen) for o in node.outputs):
                    return False
                continue
            return False
        return True

    def mask_value_ok(t: gs.Tensor, seen: set[int]) -> bool:
        if id(t) in graph_outputs or not t.outputs:
            return False
        for node, i in uses(t):
            if ATTENTION_BIAS_INPUT.get(node.op) == i and node.domain == "com.microsoft":
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.op == "Add":
                if not all(masked_scores_ok(o, seen) for o in node.outputs):
                    return False
            elif carries_value(node, i):
                if not all(mask_value_ok(o, seen) for o in node.outputs):
                    return False
            else:
                return False
        return True

    return mask_value_ok(tensor, set())


def _inactive_bound(node: gs.Node, tensor: gs.Tensor, stats: ValueStats, low: LowPrecision) -> bool:
    """The constant only bounds ``node`` from the side where it never binds (Clip/Min/Max).

    ``Min(x, 1e5)`` is ``x`` for every float16 x, and so is ``Min(x, inf)``; ``Max(x, 1e5)`` is not.
    """
    if node.domain not in ("", "ai.onnx", None):
        return False
    slots = [i for i, t in enumerate(node.inputs) if t is tensor]
    if not slots:  # reached through data movement: not worth proving
        return False
    upper_only = stats.pos_overflow and not stats.neg_overflow
    lower_only = stats.neg_overflow and not stats.pos_overflow
    if node.op == "Clip":
        return all((i == 1 and lower_only) or (i == 2 and upper_only) for i in slots)
    if node.op == "Min":
        return upper_only
    if node.op == "Max":
        return lower_only
    return False


# ---------------------------------------------------------------- rule 3


def periodic_cones(graph: gs.Graph, data_dependent: set[str], limit: int = MAX_ARGUMENT_NODES):
    """(Sin/Cos node, the data-dependent nodes computing its argument) for every periodic node
    whose argument depends on the inputs; the cone is None when more than ``limit`` nodes compute
    the argument (it climbs a residual stream, not an embedding's arithmetic). Cone nodes are
    reached walking backwards through ARGUMENT_OPS; a node shared by two cones is in the first."""
    claimed: set[int] = set()
    for node in graph.nodes:
        if node.op not in PERIODIC_OPS or not node.inputs or node.inputs[0].name not in data_dependent:
            continue
        claimed.add(id(node))
        cone: dict[int, gs.Node] = {}
        stack = [node.inputs[0]]
        while stack and len(cone) <= limit:
            t = stack.pop()
            if t.name not in data_dependent or len(t.inputs) != 1:
                continue
            producer = t.inputs[0]
            if producer.op not in ARGUMENT_OPS or id(producer) in claimed or id(producer) in cone:
                continue
            cone[id(producer)] = producer
            stack.extend(x for x in producer.inputs if not isinstance(x, gs.Constant))
        if len(cone) <= limit:
            claimed.update(cone)
            yield node, list(cone.values())
        else:
            yield node, None


def periodic_arguments(
    graph: gs.Graph, data_dependent: set[str], limit: int = MAX_ARGUMENT_NODES
) -> dict[int, tuple[gs.Node, str]]:
    """Sin/Cos and the data-dependent arithmetic computing their argument (walked backwards).

    An argument computed by more than ``limit`` such nodes is not an embedding's (it climbs a
    residual stream): then only the Sin/Cos itself stays float32.
    """
    out: dict[int, tuple[gs.Node, str]] = {}
    for node, cone in periodic_cones(graph, data_dependent, limit):
        reason = periodic_reason(node)
        out.setdefault(id(node), (node, reason))
        for n in cone or ():
            out.setdefault(id(n), (n, reason))
    return out


def periodic_reason(node: gs.Node) -> str:
    return f"argument of {node.op} '{node_label(node)}': periodic functions need its absolute precision"


# ---------------------------------------------------------------- rule 4


def calibrated_overflows(graph: gs.Graph, ranges: dict, limit: float, low: LowPrecision) -> dict[int, tuple[gs.Node, str]]:
    """Producers and consumers of every tensor whose calibrated magnitude exceeds ``limit``."""
    out: dict[int, tuple[gs.Node, str]] = {}
    for tensor in graph.tensors().values():
        r = ranges.get(tensor.name)
        if r is None or r.absmax <= limit:
            continue
        for producer in tensor.inputs:
            out.setdefault(id(producer), (producer, f"calibration: output '{tensor.name}' reaches {r.absmax:.3g} "
                                                     f"(> {limit:g}, {low.name} max {low.max:g})"))
        for consumer in tensor.outputs:
            out.setdefault(id(consumer), (consumer, f"calibration: input '{tensor.name}' reaches {r.absmax:.3g} "
                                                     f"(> {limit:g}, {low.name} max {low.max:g})"))
    return out


# ---------------------------------------------------------------- rule 5

GELU_OPS = frozenset({"FastGelu", "Gelu", "BiasGelu"})
RESIDUAL_SUM_OPS = frozenset({"Add", "Sum", "SkipSimplifiedLayerNormalization", "SkipLayerNormalization"})
STREAM_NORM_OPS = frozenset({"SimplifiedLayerNormalization", "LayerNormalization"})
_GELU_CHAIN_DEPTH = 4  # the explicit tanh/erf GELU: Mul <- Mul/Add <- Tanh|Erf


def gated_ffn_outputs(graph: gs.Graph) -> dict[int, tuple[gs.Node, str]]:
    """Rule 5: the output projection of every gated feed-forward, and the residual stream after it."""
    out: dict[int, tuple[gs.Node, str]] = {}
    stream: list[gs.Tensor] = []
    for node in graph.nodes:
        if node.op not in ("MatMul", "Gemm") or not node.inputs or not _is_gated_product(node.inputs[0]):
            continue
        out.setdefault(id(node), (node, "output projection of a gated feed-forward (T5's overflows float16 with real "
                                        "weights; transformers keeps it float32)"))
        stream.extend(node.outputs[:1])
    reason = "residual stream after a gated feed-forward's float32 output projection"
    seen: set[int] = set()
    while stream:
        tensor = stream.pop()
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        for consumer in tensor.outputs:
            if consumer.op in RESIDUAL_SUM_OPS:
                out.setdefault(id(consumer), (consumer, reason))
                sums = consumer.outputs[3:4] if consumer.op.startswith("Skip") else consumer.outputs[:1]
                stream.extend(t for t in sums if t.name)
            elif consumer.op in STREAM_NORM_OPS:
                out.setdefault(id(consumer), (consumer, reason))
    return out


def _is_gated_product(tensor: gs.Tensor) -> bool:
    """``tensor`` is Mul(GELU(a), b) with b a MatMul/Gemm output."""
    if len(tensor.inputs) != 1 or tensor.inputs[0].op != "Mul":
        return False
    a, b = tensor.inputs[0].inputs[:2]
    return (_is_gelu(a) and _is_projection(b)) or (_is_gelu(b) and _is_projection(a))


def _is_projection(tensor: gs.Tensor) -> bool:
    return len(tensor.inputs) == 1 and tensor.inputs[0].op in ("MatMul", "Gemm")


def _is_gelu(tensor: gs.Tensor, depth: int = _GELU_CHAIN_DEPTH) -> bool:
    if len(tensor.inputs) != 1:
        return False
    node = tensor.inputs[0]
    if node.op in GELU_OPS:
        return True
    if node.op in ("Tanh", "Erf"):
        return True
    if depth == 0 or node.op not in ("Mul", "Add"):
        return False
    return any(_is_gelu(t, depth - 1) for t in node.inputs if not isinstance(t, gs.Constant))
