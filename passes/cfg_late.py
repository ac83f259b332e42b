"""CFG duplication late: compute at batch b what both classifier-free-guidance halves share.

The step graph (:mod:`onnxopt.pipeline.step_graph`) runs the UNet at batch 2b on two copies of the
same latents and one timestep; the halves differ only where the text side (batch 2b: uncond rows,
then cond rows) comes in. This pass computes what comes before that once, at batch b, and
broadcasts at the frontier::

    before (batch 2b throughout):
        latents ─ Mul(c_in) ─ Concat(axis 0, [x, x]) ─ conv_in ─ resnet ─ self-attention ─ to_q ─┐
        t ─ Expand([2b]) ─ time embedding ──────────────┘                                         │
        K/V of the text [2b] ──────────────────────────────────────────── cross-attention (attn2) ─ ...
    after:
        latents ─ Mul(c_in) ─ conv_in ─ resnet ─ self-attention ─ to_q ─ Concat(axis 0, [q, q]) ─┐
        t ─ Expand([b]) ─ time embedding ──┘             (batch b)                                 │
        K/V of the text [2b] ──────────────────────────────────────────── cross-attention (attn2) ─ ...

    SDXL: the time embedding meets the pooled text (text_embeds) at once, so only conv_in, the
    time projection and the first resnet's first GroupNorm/conv move.

The rule (no pattern: any graph works). A tensor is *duplicated* when its value is ``Concat([h, h],
axis 0)`` for a tensor ``h`` the rewritten graph computes at half the batch. The seeds:

  * ``Concat(axis 0, [a, a])`` (the same tensor twice): ``h = a``;
  * ``Expand(x, shape)`` and ``ConstantOfShape(shape)`` whose output rows along axis 0 are all
    equal (x broadcasts along axis 0) and whose leading target dim is even (below).

A node whose inputs are duplicated or *free* (the same in both halves: constants, the inputs the
caller names ``shared_inputs`` -- the step's latents, state, schedule and guidance -- and values
computed from them alone) and that is proven *row-wise along axis 0* by :data:`ROW_WISE` moves
to the half batch: it reads the ``h`` tensors and writes its own. Anything else that reads a
duplicated tensor is the *frontier*: it reads ``Concat([h, h], axis 0)``, written once per tensor.
Row-wise, in short (the table says it exactly): elementwise ops whose free inputs do not carry a
batch (dim 0 is 1, or a lower rank); Conv, NhwcConv, pooling, Instance/Group/LayerNorm and
com.microsoft GroupNorm, SkipGroupNorm, BiasAdd, BiasSplitGelu, SkipLayerNormalization with free
weights; MatMul by free weights, or of two duplicated tensors of one rank >= 3 (self-attention's
scores); Gemm; MultiHeadAttention whose query, key and value are all duplicated (self-attention),
no mask; Transpose with perm[0] = 0; Softmax, Concat, Split, Gather, Slice, reductions and
Unsqueeze/Squeeze away from axis 0; Reshape and Expand with the leading target dim halved (below).

Shapes. A ``Shape`` of a duplicated tensor must still give the full batch wherever its value goes,
so it becomes ``Concat(Mul(Shape(h, 0, 1), 2), Shape(h, 1))``: every shape computation reads the
values it read before. The 1-D int vectors computed from shapes are evaluated by
:class:`onnxopt.pattern.dims.Dims` on the graph as it was, where a duplicated tensor's dim 0 is the
symbol ``FULL_BATCH``: an element without it is *same* in both worlds (with its value when known),
one linear in it is *doubled* (the full world's value is twice the half world's: ``Shape(dup)[0]``,
its products by same elements). A half-batch ``Reshape`` or ``Expand`` reads its target with the
leading element halved:

  * the leading element must be doubled, an even constant (static exports spell the batch 2b),
    0 (Reshape: copy dim 0) or -1 (Reshape: only when the output's dim 0 is an exact multiple of
    the input's, by :mod:`onnxopt.pattern.dims`); every other element must be *same*.
  * Why any even leading dim is right: ``Concat([h, h], axis 0)`` is, in row-major order, ``h``'s
    elements twice in a row, and Reshape keeps that order; a target ``[2m, rest]`` cuts them at
    the midpoint, so ``Reshape(Concat([h, h]), [2m, rest]) = Concat([Reshape(h, [m, rest])] * 2)``.
    A leading dim that is odd, unknown or read from the text side (``Shape(text)[0]``) is a frontier.

Cost. A moved node whose outputs only the full batch reads and are one small vector per row (each
resnet's projection of the time embedding) goes back to the full batch when that adds no
broadcast: one Concat of the shared embedding instead of one per resnet (``small_row_elements``).

The rule is generic, but which inputs are the same in both halves only the step graph knows, and a
plain UNet has no seed (its 2b rows come in as they are): :func:`onnxopt.pipeline.step_graph.build_step_graph`
runs it (``cfg_late=True``) under the pass manager with the step graph's inputs as ``shared_inputs``.
Registered, it runs on any graph by name (``--passes cfg-late``): with no ``shared_inputs`` only
constants are taken as the same in both halves, which is always sound.

The result says what moved (``details``: nodes moved and their ops, the frontier with the reason
each node is one, the tensors broadcast), so a report or test can read it. The graph's inputs and
outputs are not changed: the pipeline contract holds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.domains import MS_DOMAIN
from onnxopt.fusion import Emit, NameAuthority, Refusal
from onnxopt.graph_edit import replace_output
from onnxopt.model import Model
from onnxopt.pass_infra import SHAPES_INFERRED, Pass, PassResult
from onnxopt.registry import register_pass
from onnxopt.pattern.constants import constant_shape, constant_value, is_constant
from onnxopt.pattern.dims import Dim, Dims
from onnxopt.weights import numpy_dtype

DUP, FREE, FULL = "duplicated", "free", "full"
# The full batch of the tensors the pass halves, as a symbol of :class:`Dim`: an element of a shape
# vector (what :class:`Dims` computes) with this symbol once is *doubled*, without it *same*.
FULL_BATCH = "cfg-late:full-batch"
PREFIX = "cfg_late"
CFG_LATE_METADATA = "onnxopt.cfg_late"  # metadata_props key of a step graph the pass rewrote
RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                        "Bernoulli"})

# Elementwise ops (outputs broadcast from all inputs): row-wise when every duplicated input has the
# output's rank and every free input does not carry the batch.
ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Equal", "Less", "LessOrEqual", "Greater",
    "GreaterOrEqual", "And", "Or", "Xor", "Not", "Mod", "Sum", "Mean", "PRelu",
    "Cast", "CastLike", "Identity", "Relu", "Sigmoid", "Tanh", "Erf", "Sqrt", "Neg", "Abs", "Exp", "Log",
    "Reciprocal", "Sin", "Cos", "Softplus", "Softsign", "Mish", "HardSigmoid", "HardSwish", "LeakyRelu", "Elu",
    "Selu", "Celu", "Gelu", "IsNaN", "IsInf", "Floor", "Ceil", "Round", "Sign", "Clip",
    "FastGelu", "BiasGelu", "QuickGelu",  # com.microsoft (bias inputs: free, 1-D)
})
# Ops computing each sample from its own row: input 0 duplicated, every other input free (weights).
PER_SAMPLE = frozenset({
    "Conv", "ConvTranspose", "NhwcConv", "InstanceNormalization", "GroupNormalization", "BatchNormalization",
    "GroupNorm", "BiasSplitGelu", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool",
})
# Ops with an axis attribute that must not be the batch axis (input 0 duplicated, others free).
AXIS_OPS = {"Softmax": 1, "LogSoftmax": 1, "Hardmax": 1, "LayerNormalization": -1, "Flatten": 1,
            "LpNormalization": -1, "CumSum": None}
REDUCE_OPS = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                        "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin"})
# Shape arithmetic whose values the pass follows (1-D int vectors and scalars, through Dims).
VECTOR_OPS = frozenset({"Shape", "Size", "Constant", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Reshape",
                        "Identity", "Cast", "Mul", "Add", "Sub", "Div", "Neg", "Flatten", "Equal", "Where",
                        "ConstantOfShape"})
MAX_VECTOR = 16  # longer int tensors are data, not shapes


@dataclass
class Frontier:
    node: str
    op: str
    reason: str


@dataclass
class HalfBatchPlan:
    """What the pass did: the nodes now at batch b, the frontier, the Concats written."""

    moved: list[gs.Node] = field(default_factory=list)
    frontier: list[Frontier] = field(default_factory=list)
    broadcasts: list[str] = field(default_factory=list)  # names of the tensors rebuilt by Concat([h, h])
    shapes_rewritten: int = 0

    def details(self) -> dict:
        ops = Counter(n.op for n in self.moved)
        reasons = Counter(f.reason for f in self.frontier)
        return {
            "nodes_moved": len(self.moved),
            "ops_moved": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
            "frontier": [{"node": f.node, "op": f.op, "reason": f.reason} for f in self.frontier],
            "frontier_reasons": dict(reasons),
            "broadcasts": list(self.broadcasts),
            "shapes_rewritten": self.shapes_rewritten,
        }


@register_pass
class CfgLate(Pass):
    """The pass (module docstring). ``shared_inputs``: graph inputs that are the same in both
    halves' worlds (the step graph's latents, state, schedule and guidance); every other input is
    taken to differ between the halves. ``small_row_elements``: a moved branch whose outputs have
    at most this many elements per batch row and are read only at the full batch goes back to
    the full batch when that saves broadcasts (:meth:`_HalfBatch.keep_small_branches_full`; 0: never)."""

    name = "cfg-late"
    description = ("compute what both classifier-free-guidance halves share (latents, timestep) once at batch b; "
                   "broadcast where the text side comes in")
    requires = frozenset({SHAPES_INFERRED})
    is_fusion = True

    def __init__(self, shared_inputs=(), small_row_elements: int = 4096):
        self.shared_inputs = frozenset(shared_inputs)
        self.small_row_elements = small_row_elements

    possible_followers = frozenset({"infer-shapes"})

    def followers(self, result: PassResult) -> list[str]:
        return ["infer-shapes"] if result.modified else []  # the half-batch tensors get their shapes

    def run(self, model: Model) -> PassResult:
        result = PassResult(modified=False)
        graph = model.graph
        graph.toposort()
        if any(list(node.subgraphs()) for node in graph.nodes):
            result.nothing_to_do = "the graph has control flow (If/Loop/Scan); the pass handles flat graphs only"
            return result
        rewrite = _HalfBatch(model, self.shared_inputs, self.small_row_elements)
        plan = rewrite.run()
        result.details = plan.details()
        if not plan.moved:
            result.nothing_to_do = "nothing computed from duplicated rows alone (no Concat(axis 0, [x, x]) seed)"
            return result
        result.modified = True
        result.sites_matched = result.sites_rewritten = len(plan.moved)
        for f in plan.frontier:
            result.refuse(f.node, f.reason)
        return result


def compute_halves_once(model: Model, shared_inputs=(), small_row_elements: int = 4096) -> PassResult:
    """Run :class:`CfgLate` on ``model`` in place under the pass manager (which infers shapes
    first, and again after a rewrite: the pass's follower); returns the pass's result."""
    from onnxopt.manager import PassManager

    report = PassManager([CfgLate(shared_inputs, small_row_elements)]).run(model)
    return next(step.result for step in report.passes if step.name == CfgLate.name)


# ---------------------------------------------------------------------------- the analysis and rewrite


class _HalfBatch:
    def __init__(self, model: Model, shared_inputs: frozenset, small_row_elements: int):
        self.model, self.graph = model, model.graph
        self.small_row_elements = small_row_elements
        self.opset = model.opset
        self.names = NameAuthority(self.graph)
        self.kind: dict[int, str] = {}
        self.half: dict[int, gs.Tensor] = {}  # id(full tensor) -> its half-batch tensor
        self.halved: dict[int, gs.Tensor] = {}  # id(shape vector) -> its leading element halved
        self.half_shape_of: dict[int, gs.Tensor] = {}  # id(rewritten Shape output) -> Shape(h): its half value
        self.plan = HalfBatchPlan()
        self.pairs: list[tuple[gs.Tensor, gs.Tensor]] = []  # (full, half) of the seeds
        self.full_of: dict[int, gs.Tensor] = {}  # id(half output of a moved node) -> the full tensor
        self.new_nodes: list[gs.Node] = []
        self.original_inputs: dict[int, list] = {}  # id(moved node) -> its inputs before the move
        for t in self.graph.inputs:
            self.kind[id(t)] = FREE if t.name in shared_inputs else FULL
        self.batch_symbols: dict = {}  # full batch dim name -> the half batch's (from the seeds)
        self.minus_one_ok = self._reshapes_with_leading_minus_one()
        # Shape vectors, evaluated in the graph as it was: a halved tensor's dim 0 is FULL_BATCH.
        self.dims = Dims(annotated_only=True, leading_dim=lambda t: Dim(1, (FULL_BATCH,)) if id(t) in self.half else None)

    # ------------------------------------------------------------ facts about tensors

    def kind_of(self, t: gs.Tensor) -> str:
        if id(t) in self.half:
            return DUP
        if isinstance(t, gs.Constant):
            return FREE
        return self.kind.get(id(t), FULL)

    @staticmethod
    def present(t: gs.Tensor) -> bool:
        return isinstance(t, gs.Constant) or bool(t.name)

    @staticmethod
    def rank(t: gs.Tensor) -> int | None:
        return len(t.shape) if t.shape is not None else None

    def _reshapes_with_leading_minus_one(self) -> set[int]:
        """Reshapes (on the unchanged graph) whose output dim 0 is provably an integer multiple of the
        input's: with a -1 leading target element they stay row-wise at the half batch."""
        dims, ok = Dims(), set()
        for node in self.graph.nodes:
            if node.op != "Reshape" or len(node.inputs) < 2:
                continue
            value = _small_value(node.inputs[1])
            if value is not None and (value.ndim != 1 or not len(value) or value[0] != -1):
                continue
            x_shape, out = dims.shape(node.inputs[0]), dims.reshaped(node)
            if x_shape and out and x_shape[0] is not None and out[0] is not None:
                if out[0].divided_by(x_shape[0]) is not None:
                    ok.add(id(node))
        return ok

    # ------------------------------------------------------------ shape vectors

    def vector_tags(self, t: gs.Tensor) -> list | None:
        """The elements of the shape vector ``t`` (:meth:`Dims.vector`; ``_doubled`` / ``_same`` say
        how each relates the two halves' worlds), None for a tensor that is not a short int vector."""
        vector = self.dims.vector(t)
        return vector if vector is not None and len(vector) <= MAX_VECTOR else None

    def _classify_vector(self, node: gs.Node) -> bool:
        """Record ``node``'s output as a shape vector: free when every element is the same in both
        worlds, full otherwise. False when it is not a vector the pass can follow."""
        tags = self.vector_tags(node.outputs[0])
        if tags is None:
            return False
        self.kind[id(node.outputs[0])] = FREE if all(_same(e) for e in tags) else FULL
        return True

    # ------------------------------------------------------------ the walk

    def run(self) -> HalfBatchPlan:
        for node in list(self.graph.nodes):
            self.visit(node)
        self.finish()
        return self.plan

    def visit(self, node: gs.Node) -> None:
        ins = [t for t in node.inputs if self.present(t)]
        kinds = [self.kind_of(t) for t in ins]
        if self._is_seed(node):
            a, full = node.inputs[0], node.outputs[0]
            self.half[id(full)] = a
            self.pairs.append((full, a))
            if a.shape and full.shape and isinstance(full.shape[0], str) and isinstance(a.shape[0], str):
                self.batch_symbols[full.shape[0]] = a.shape[0]
            return
        if node.op in ("Shape", "Size") and kinds and kinds[0] == DUP and (node.op == "Size" or self.rank(ins[0]) is not None):
            if not self._classify_vector(node):  # evaluated before the rewrite: the full world's value
                self.kind[id(node.outputs[0])] = FULL
            self._rewrite_shape(node)
            return
        if node.op in VECTOR_OPS and DUP not in kinds and len(node.outputs) == 1 and self._classify_vector(node):
            return
        if DUP not in kinds:
            if node.op in ("Expand", "ConstantOfShape") and FULL in kinds:
                try:  # a batch-free value expanded to the (doubled) batch: a seed
                    self._move(node, self._row_wise(node))
                    return
                except Refusal:
                    pass
            out_kind = FREE if all(k == FREE for k in kinds) and node.op not in RANDOM_OPS else FULL
            for o in node.outputs:
                self.kind[id(o)] = out_kind
            return
        try:
            replacements = self._row_wise(node)
        except Refusal as refusal:
            self.plan.frontier.append(Frontier(node.name, node.op, refusal.reason))
            for o in node.outputs:
                self.kind[id(o)] = FULL
            return
        self._move(node, replacements)

    def _is_seed(self, node: gs.Node) -> bool:
        """Concat(axis 0, [a, a]): the same tensor twice along the batch."""
        if node.op != "Concat" or len(node.inputs) != 2 or node.inputs[0] is not node.inputs[1]:
            return False
        rank = self.rank(node.inputs[0])
        axis = int(node.attrs.get("axis", 0))
        return rank is not None and rank > 0 and axis % rank == 0

    # ------------------------------------------------------------ the row-wise table

    def _row_wise(self, node: gs.Node) -> dict[int, gs.Tensor]:
        """{} or the shape operands to replace (input index -> half-batch tensor) when ``node`` is
        row-wise along axis 0 (module docstring); raises Refusal with the reason otherwise."""
        rule = ROW_WISE.get(node.op)
        if rule is None:
            raise Refusal(f"{node.op} is not known to be row-wise along the batch axis")
        return rule(self, node) or {}

    # helpers the rules share

    def need(self, node, index: int, *kinds: str, optional: bool = False) -> gs.Tensor | None:
        if index >= len(node.inputs) or not self.present(node.inputs[index]):
            if optional:
                return None
            raise Refusal(f"input {index} is missing")
        t = node.inputs[index]
        kind = self.kind_of(t)
        if kind not in kinds:
            what = {DUP: "duplicated", FREE: "batch-free", FULL: "different in the two halves"}[kind]
            raise Refusal(f"reads '{t.name}', which is {what}")
        return t

    def free_rest(self, node, first: int) -> None:
        for i in range(first, len(node.inputs)):
            self.need(node, i, FREE, optional=True)

    def absent_from(self, node, first: int) -> None:
        if any(self.present(t) for t in node.inputs[first:]):
            raise Refusal(f"has inputs past {first - 1} (masks, caches): not proven row-wise")

    def rank_of(self, t: gs.Tensor) -> int:
        r = self.rank(t)
        if r is None:
            raise Refusal(f"the rank of '{t.name}' is unknown")
        return r

    def batch_free_operand(self, t: gs.Tensor, out_rank: int) -> None:
        """A free input broadcast against duplicated ones must not carry a batch of its own."""
        r = self.rank_of(t)
        if r >= out_rank and not (t.shape and t.shape[0] == 1):
            raise Refusal(f"the batch-free input '{t.name}' has a leading dim {t.shape[0] if t.shape else '?'} "
                          "that meets the batch axis")

    def axis_not_batch(self, node, axis: int, rank: int | None) -> None:
        if axis < 0:
            if rank is None:
                raise Refusal("a negative axis on a tensor of unknown rank")
            axis += rank
        if axis == 0:
            raise Refusal(f"{node.op} works along axis 0, the batch axis")

    def constant_ints(self, node, index: int, what: str) -> list[int]:
        value = _small_value(node.inputs[index]) if index < len(node.inputs) else None
        if value is None:
            raise Refusal(f"its {what} are not constant")
        return [int(v) for v in value.reshape(-1)]

    def same_vector(self, t: gs.Tensor, where: str) -> None:
        tags = self.vector_tags(t)
        if self.kind_of(t) != FREE and (tags is None or not all(_same(e) for e in tags)):
            raise Refusal(f"{where} '{t.name}' differs between the halves' worlds")

    # ------------------------------------------------------------ rewriting

    def _move(self, node: gs.Node, replacements: dict[int, gs.Tensor]) -> None:
        """``node`` now computes at the half batch: duplicated inputs -> their halves, shape operands
        -> ``replacements`` (input index -> tensor), each output -> a new half tensor."""
        self.original_inputs[id(node)] = list(node.inputs)
        for i, t in enumerate(node.inputs):
            if i in replacements:
                node.inputs[i] = replacements[i]
            elif id(t) in self.half:
                node.inputs[i] = self.half[id(t)]
        for o in list(node.outputs):
            if not self.present(o):
                continue
            h = Emit(self.graph, self.names, PREFIX).variable(f"{o.name}/half", o.dtype, self._half_shape(o.shape))
            replace_output(node, o, h)
            self.half[id(o)] = h
            self.full_of[id(h)] = o
        self.plan.moved.append(node)

    def _half_shape(self, shape):
        if shape is None or not len(shape):
            return None if shape is None else list(shape)
        first = shape[0]
        first = first // 2 if isinstance(first, int) else self.batch_symbols.get(first)
        return [first, *shape[1:]]

    def _rewrite_shape(self, node: gs.Node) -> None:
        """Shape(x) of a duplicated x -> the same values computed from its half: the full batch
        where dim 0 is included (Concat(Mul(Shape(h, 0, 1), 2), Shape(h, 1, end)))."""
        x, out = node.inputs[0], node.outputs[0]
        h = self.half[id(x)]
        make = Emit(self.graph, self.names, f"{PREFIX}/{node.name or out.name}")
        node.inputs.clear()
        node.outputs.clear()
        self.plan.shapes_rewritten += 1
        if node.op == "Size":
            size = make.op.Size(h, _dtype=np.int64, _shape=[])
            make.node("Mul", [size, make.constant("two", np.array(2, np.int64))], np.int64, [], outputs=[out])
            self.new_nodes += make.nodes
            return
        r = self.rank(x)
        start, end = _shape_range(node, r)
        if self.opset < 15:
            whole = make.op.Shape(h, _dtype=np.int64, _shape=[r])
            doubled = make.op.Mul(whole, make.constant("batch_twice", np.array([2] + [1] * (r - 1), np.int64)),
                                  _dtype=np.int64, _shape=[r])
            if (start, end) == (0, r):
                make.node("Identity", [doubled], np.int64, [r], outputs=[out])
            else:
                make.node("Slice", [doubled, make.constant("start", np.array([start], np.int64)),
                                    make.constant("end", np.array([end], np.int64))], np.int64, [end - start],
                          outputs=[out])
            self.new_nodes += make.nodes
            return
        if start > 0 or end == 0:
            make.node("Shape", [h], np.int64, [max(end - start, 0)], outputs=[out], start=start, end=end)
            self.new_nodes += make.nodes
            self.half_shape_of[id(out)] = out
            return
        first = make.op.Shape(h, _dtype=np.int64, _shape=[1], start=0, end=1)
        half_first = first
        if end == 1:
            make.node("Mul", [first, make.constant("two", np.array([2], np.int64))], np.int64, [1], outputs=[out])
            self.half_shape_of[id(out)] = half_first
        else:
            doubled = make.op.Mul(first, make.constant("two", np.array([2], np.int64)), _dtype=np.int64, _shape=[1])
            rest = make.op.Shape(h, _dtype=np.int64, _shape=[end - 1], start=1, end=end)
            make.node("Concat", [doubled, rest], np.int64, [end], outputs=[out], axis=0)
            self.half_shape_of[id(out)] = make.op.Shape(h, _dtype=np.int64, _shape=[end], start=0, end=end)
        self.new_nodes += make.nodes

    def halve_leading(self, t: gs.Tensor, where: str) -> gs.Tensor:
        """The shape vector ``t`` for the half batch: its leading element halved (doubled, or an even
        constant), every other element the same."""
        tags = self.vector_tags(t)
        if tags is None or not tags:
            raise Refusal(f"{where}: the shape '{t.name}' is not a vector onnxopt can follow")
        if not all(_same(e) for e in tags[1:]):
            raise Refusal(f"{where}: the shape '{t.name}' carries the batch beyond its first element")
        first = tags[0]
        if not _doubled(first) and not (_value(first) is not None and _value(first) > 0 and _value(first) % 2 == 0):
            raise Refusal(f"{where}: the leading dim of '{t.name}' is not proven twice the half batch")
        if id(t) in self.halved:
            return self.halved[id(t)]
        if id(t) in self.half_shape_of:
            self.halved[id(t)] = self.half_shape_of[id(t)]
            return self.halved[id(t)]
        make = Emit(self.graph, self.names, f"{PREFIX}/{t.name}")
        mask = np.ones(len(tags), dtype=numpy_dtype(t.dtype) if t.dtype is not None else np.int64)
        mask[0] = 2
        if is_constant(t):
            value = constant_value(t)
            halved = make.constant("half", (value // mask.reshape(value.shape)).astype(value.dtype))
        else:
            halved = make.op.Div(t, make.constant("batch_twice", mask), _dtype=t.dtype, _shape=t.shape)
            self.new_nodes += make.nodes
        self.halved[id(t)] = halved
        return halved

    def keep_small_branches_full(self) -> None:
        """A moved node whose outputs only the full batch reads, and are small per row (a time
        embedding's [2b, C] projection for each resnet), goes back to the full batch when that
        does not add broadcasts: one Concat of the shared time embedding instead of one per
        resnet, for no FLOPs to speak of. Repeated from the end, so chains go back whole."""
        outputs = {id(t) for t in self.graph.outputs}
        full_of = dict(self.full_of)
        full_of.update({id(h): full for full, h in self.pairs})

        def live(full) -> bool:  # read at the full batch: it needs its Concat (a broadcast or the seed's)
            return bool(full.outputs) or id(full) in outputs

        changed = True
        while changed:
            changed = False
            for node in reversed(list(self.plan.moved)):
                halves = [o for o in node.outputs if id(o) in self.full_of]
                if any(h.outputs for h in halves) or not all(_small_rows(self.full_of[id(h)], self.small_row_elements) for h in halves):
                    continue
                dup_inputs = {id(t): full_of[id(t)] for t in node.inputs if id(t) in full_of}
                added = sum(1 for full in dup_inputs.values() if not live(full))
                removed = sum(1 for h in halves if live(self.full_of[id(h)]))
                if added > removed:
                    continue
                for i, t in enumerate(self.original_inputs.pop(id(node))):
                    node.inputs[i] = t
                for h in halves:
                    full = self.full_of.pop(id(h))
                    replace_output(node, h, full)
                    del self.half[id(full)]
                self.plan.moved.remove(node)
                changed = True

    def finish(self) -> None:
        """Concat([h, h], axis 0) for every duplicated tensor something full still reads."""
        self.keep_small_branches_full()
        outputs = {id(t) for t in self.graph.outputs}
        for node in self.plan.moved:
            self.pairs += [(self.full_of[id(o)], o) for o in node.outputs if id(o) in self.full_of]
        for full, h in self.pairs:
            if full.inputs or not (full.outputs or id(full) in outputs):
                continue  # still computed (a seed Concat), or read by nothing full
            make = Emit(self.graph, self.names, f"{PREFIX}/broadcast")
            make.node("Concat", [h, h], full.dtype, full.shape, outputs=[full], axis=0)
            self.new_nodes += make.nodes
            self.plan.broadcasts.append(full.name)
        self.graph.nodes.extend(self.new_nodes)
        self.graph.cleanup(remove_unused_graph_inputs=False).toposort()


# ---------------------------------------------------------------------------- the row-wise table
#
# Each rule: (pass state, node) -> None or {input index: half-batch shape operand}; raises Refusal
# with the reason the node is a frontier. "dup" = duplicated, "free" = the same in both worlds.


def _elementwise(s: _HalfBatch, node: gs.Node):
    """Broadcasting ops: duplicated inputs have the output's rank; free ones no batch dim."""
    present = [t for t in node.inputs if s.present(t)]
    out_rank = max(s.rank_of(t) for t in present)
    for i, t in enumerate(node.inputs):
        if not s.present(t):
            continue
        kind = s.need(node, i, DUP, FREE) and s.kind_of(t)
        if kind == DUP and s.rank_of(t) != out_rank:
            raise Refusal(f"the duplicated input '{t.name}' broadcasts into the batch axis")
        if kind == FREE:
            s.batch_free_operand(t, out_rank)


def _per_sample(s, node):
    """Input 0 duplicated, the rest free: weights and biases."""
    s.need(node, 0, DUP)
    s.free_rest(node, 1)
    if node.op == "BatchNormalization" and int(node.attrs.get("training_mode", 0)):
        raise Refusal("training-mode BatchNormalization: statistics over the batch")


def _along_axis(default):
    def rule(s, node):
        x = s.need(node, 0, DUP)
        s.free_rest(node, 1)
        axis = node.attrs.get("axis", default)
        if node.op in ("Softmax", "LogSoftmax", "Hardmax") and s.opset < 13:
            axis = node.attrs.get("axis", 1)  # coerced to 2-D [prod(:axis), prod(axis:)]: rows kept when axis >= 1
        if node.op == "CumSum":
            axis = s.constant_ints(node, 1, "axis")[0]
        s.axis_not_batch(node, int(axis), s.rank(x))
    return rule


def _reduce(s, node):
    x = s.need(node, 0, DUP)
    if node.op in ("ArgMax", "ArgMin"):
        axes = [int(node.attrs.get("axis", 0))]
    elif "axes" in node.attrs:
        axes = [int(a) for a in node.attrs["axes"]]
    else:
        axes = s.constant_ints(node, 1, "axes")
        if not axes:
            raise Refusal("reduces over every axis")
    for axis in axes:
        s.axis_not_batch(node, axis, s.rank(x))


def _transpose(s, node):
    s.need(node, 0, DUP)
    perm = node.attrs.get("perm")
    if perm is None or int(perm[0]) != 0:
        raise Refusal(f"perm {list(perm) if perm is not None else 'reversed'} moves the batch axis")


def _reshape(s, node):
    s.need(node, 0, DUP)
    target = s.need(node, 1, FREE, FULL)
    tags = s.vector_tags(target)
    if tags is None or not tags:
        raise Refusal(f"its target shape '{target.name}' is not a vector onnxopt can follow")
    lead = _value(tags[0])
    kept = ((lead == 0 and not int(node.attrs.get("allowzero", 0)))  # copies the (duplicated) dim 0
            or (lead == -1 and id(node) in s.minus_one_ok))           # dim 0 a proven multiple of the input's
    if kept:
        s.same_vector(target, "its target shape")
        return {}
    return {1: s.halve_leading(target, "its target shape")}


def _expand(s, node):
    x = s.need(node, 0, DUP, FREE)
    shape = s.need(node, 1, FREE, FULL)
    tags = s.vector_tags(shape)
    if tags is None:
        raise Refusal(f"its shape '{shape.name}' is not a vector onnxopt can follow")
    rx = s.rank_of(x)
    if s.kind_of(x) == DUP:
        if len(tags) > rx:
            raise Refusal("expands to a higher rank: the batch moves off axis 0")
        if len(tags) < rx or _value(tags[0]) == 1:
            s.same_vector(shape, "its shape")
            return {}
        return {1: s.halve_leading(shape, "its shape")}
    if len(tags) < rx or (len(tags) == rx and not (x.shape and x.shape[0] == 1)):
        raise Refusal(f"'{x.name}' does not broadcast along the batch axis")
    return {1: s.halve_leading(shape, "its shape")}


def _constant_of_shape(s, node):
    shape = s.need(node, 0, FULL, FREE)
    return {0: s.halve_leading(shape, "its shape")}


def _tile(s, node):
    s.need(node, 0, DUP)
    if s.constant_ints(node, 1, "repeats")[:1] != [1]:
        raise Refusal("tiles along the batch axis")


def _gemm(s, node):
    s.need(node, 0, DUP)
    s.free_rest(node, 1)
    if int(node.attrs.get("transA", 0)):
        raise Refusal("transA: the batch is the contracted axis")
    if len(node.inputs) > 2 and s.present(node.inputs[2]):
        s.batch_free_operand(node.inputs[2], 2)


def _matmul(s, node):
    a, b = node.inputs[0], node.inputs[1]
    ka, kb = s.need(node, 0, DUP, FREE) and s.kind_of(a), s.need(node, 1, DUP, FREE) and s.kind_of(b)
    ra, rb = s.rank_of(a), s.rank_of(b)
    if ka == DUP and kb == DUP:
        if ra < 3 or ra != rb:
            raise Refusal("both operands duplicated but not batched alike (rank < 3 or different ranks)")
        return
    dup, free, rd, rf = (a, b, ra, rb) if ka == DUP else (b, a, rb, ra)
    if rd < 2 or (dup is b and rd < 3):
        raise Refusal(f"the duplicated operand '{dup.name}' has its batch on a contracted or broadcast axis")
    if rf > 2 and (rf > rd or (rf == rd and not (free.shape and free.shape[0] == 1))):
        raise Refusal(f"the batch-free operand '{free.name}' has batch dims of its own")


def _concat(s, node):
    for i in range(len(node.inputs)):
        s.need(node, i, DUP)
    s.axis_not_batch(node, int(node.attrs.get("axis", 0)), s.rank(node.inputs[0]))


def _split(s, node):
    x = s.need(node, 0, DUP)
    s.free_rest(node, 1)
    s.axis_not_batch(node, int(node.attrs.get("axis", 0)), s.rank(x))


def _gather(s, node):
    x = s.need(node, 0, DUP)
    s.need(node, 1, FREE)
    s.axis_not_batch(node, int(node.attrs.get("axis", 0)), s.rank(x))


def _axes(s, node, index: int, missing: str) -> list[int]:
    """The node's axes: its ``axes`` attribute (older opsets) or its constant input ``index``."""
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    if len(node.inputs) > index and s.present(node.inputs[index]):
        return s.constant_ints(node, index, "axes")
    raise Refusal(missing)


def _slice(s, node):
    x = s.need(node, 0, DUP)
    s.free_rest(node, 1)
    if s.opset < 10 and "axes" not in node.attrs:  # Slice-1: every axis starts lists, from 0
        axes = list(range(len(node.attrs.get("starts", []))))
    else:
        axes = _axes(s, node, 3, "no axes: it slices from axis 0")
    for axis in axes:
        s.axis_not_batch(node, axis, s.rank(x))


def _unsqueeze(s, node):
    s.need(node, 0, DUP)
    for axis in _axes(s, node, 1, "no axes"):
        s.axis_not_batch(node, axis, s.rank(node.outputs[0]))


def _squeeze(s, node):
    x = s.need(node, 0, DUP)
    for axis in _axes(s, node, 1, "squeezes every size-1 axis (the batch may be one)"):
        s.axis_not_batch(node, axis, s.rank(x))


def _resize(s, node):
    """Resize(X, roi, scales, sizes): scales constant with 1 on the batch axis, or sizes halved."""
    s.need(node, 0, DUP)
    s.need(node, 1, FREE, optional=True)
    if len(node.inputs) > 3 and s.present(node.inputs[3]):
        return {3: s.halve_leading(s.need(node, 3, FREE, FULL), "its sizes")}
    scales = _small_value(node.inputs[2]) if len(node.inputs) > 2 else None
    if scales is None or not scales.size or float(scales.reshape(-1)[0]) != 1.0:
        raise Refusal("its scales are not constant with 1 on the batch axis")


def _pad(s, node):
    x = s.need(node, 0, DUP)
    s.free_rest(node, 1)
    if len(node.inputs) > 3 and s.present(node.inputs[3]):
        raise Refusal("pads chosen axes (an axes input)")
    pads = [int(p) for p in node.attrs["pads"]] if "pads" in node.attrs else s.constant_ints(node, 1, "pads")
    r = s.rank_of(x)
    if pads[0] or pads[r]:
        raise Refusal("pads the batch axis")


def _skip_norm(s, node):
    """SkipGroupNorm(X, gamma, beta, skip, bias) / SkipLayerNormalization(input, skip, gamma, beta, bias)."""
    x = s.need(node, 0, DUP)
    skip_index = 3 if node.op == "SkipGroupNorm" else 1
    skip = s.need(node, skip_index, DUP, FREE)
    if s.kind_of(skip) == FREE:
        s.batch_free_operand(skip, s.rank_of(x))
    for i in range(1, len(node.inputs)):
        if i != skip_index:
            s.need(node, i, FREE, optional=True)


def _bias_add(s, node):
    s.need(node, 0, DUP)
    s.need(node, 1, FREE)
    s.need(node, 2, DUP)


def _multi_head_attention(s, node):
    """Self-attention: query, key and value all duplicated (or packed into query / key), no masks."""
    s.need(node, 0, DUP)
    for i in (1, 2):
        s.need(node, i, DUP, optional=True)
    s.need(node, 3, FREE, optional=True)
    s.absent_from(node, 4)


def _ms_attention(s, node):
    s.need(node, 0, DUP)
    s.need(node, 1, FREE)
    s.need(node, 2, FREE, optional=True)
    s.absent_from(node, 3)


def _onnx_attention(s, node):
    for i in range(3):
        s.need(node, i, DUP)
    s.absent_from(node, 3)


def _dispatch_attention(s, node):
    return (_ms_attention if node.domain == MS_DOMAIN else _onnx_attention)(s, node)


ROW_WISE = {op: _elementwise for op in ELEMENTWISE}
ROW_WISE.update({op: _per_sample for op in PER_SAMPLE})
ROW_WISE.update({op: _along_axis(default) for op, default in AXIS_OPS.items()})
ROW_WISE.update({op: _reduce for op in REDUCE_OPS})
ROW_WISE.update({
    "Transpose": _transpose, "Reshape": _reshape, "Expand": _expand, "ConstantOfShape": _constant_of_shape,
    "Tile": _tile, "Gemm": _gemm, "MatMul": _matmul, "Concat": _concat, "Split": _split, "Gather": _gather,
    "Slice": _slice, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze, "Resize": _resize, "Pad": _pad,
    "SkipGroupNorm": _skip_norm, "SkipLayerNormalization": _skip_norm, "BiasAdd": _bias_add,
    "MultiHeadAttention": _multi_head_attention, "Attention": _dispatch_attention,
})


def _small_rows(t: gs.Tensor, limit: int) -> bool:
    """Each row a vector (an embedding: [B, C], [B, C, 1, 1], [B, 1, 1, C]) of at most ``limit``
    elements: every dim but the batch known, at most one of them above 1."""
    dims = t.shape[1:] if t.shape is not None else None
    if dims is None or not all(isinstance(d, int) for d in dims):
        return False
    return sum(d > 1 for d in dims) <= 1 and int(np.prod(dims)) <= limit


def _small(t: gs.Tensor) -> bool:
    """A constant small enough to be a shape (read without loading a weight)."""
    shape = constant_shape(t)
    return shape is not None and len(shape) <= 1 and int(np.prod(shape)) <= MAX_VECTOR


def _small_value(t: gs.Tensor) -> np.ndarray | None:
    """The value of a small constant (a shape, axes, indices), None for anything else."""
    return constant_value(t) if is_constant(t) and _small(t) else None


def _shape_range(node: gs.Node, rank: int) -> tuple[int, int]:
    start, end = int(node.attrs.get("start", 0)), node.attrs.get("end")
    start = min(max(0, start + rank if start < 0 else start), rank)
    end = rank if end is None else min(max(0, int(end) + rank if int(end) < 0 else int(end)), rank)
    return start, max(start, end)


def _same(d: Dim | None) -> bool:
    """The element is the same in both worlds (known or not)."""
    return d is not None and FULL_BATCH not in d.symbols


def _doubled(d: Dim | None) -> bool:
    """The full world's value is twice the half world's: linear in the full batch."""
    return d is not None and d.symbols.count(FULL_BATCH) == 1


def _value(d: Dim | None) -> int | None:
    """A same element's integer value (None: unknown or not the same in both worlds)."""
    return d.value if d is not None else None
