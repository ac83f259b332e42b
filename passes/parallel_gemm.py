"""fuse-parallel-gemm: Linears that read one tensor become one Gemm and a Split (horizontal fusion).

    x ─┬─ Gemm(x, W1, b1, transB=1) ──── y1
       ├─ Gemm(x, W2, transB=0) ──────── y2        (no bias)
       └─ Add(MatMul(x, W3), b3) ─────── y3
                         ==>
    x ─ Gemm(x, W, b, transB=t) ─ Split(axis=-1, sizes=[N1, N2, N3]) ─ y1, y2, y3
    (x N-D: MatMul(x, W) [+ Add(b)] in place of the Gemm, W (K, ΣN))

    W = [W1 | W2 | W3] along the output (N) axis, every member in one layout:
        t=1: W (ΣN, K), rows W1, W2ᵀ, W3ᵀ;   t=0: W (K, ΣN), columns W1ᵀ, W2, W3
    b = [b1 | 0 (N2 zeros) | b3]              (no C at all when no member has a bias)

Where it fires: in SD UNets and ControlNets the time embedding ``SiLU(temb)`` (B, 1280) feeds one
Linear per ResnetBlock2D (``time_emb_proj``: 22 in SD 1.5). Both exporters write them as
``Gemm(transB=1)`` reading one SiLU output (every block computes the same SiLU(temb); TorchScript
and dynamo both keep one: the first block's Sigmoid-Mul, dynamo's ``silu``). Tiny models: SD 1.5
8 members, SD 2.1 8, SDXL 11, ControlNet 4, one group each, nothing else merged. The pass writes
standard ops only, for ORT and TensorRT alike. Measurements: benchmarks/results/layout-choices.md.

Members (each a Linear reading x; a *site* is a Linear whose input another Linear also reads):

* ``Gemm(x, W, C)``: alpha=1, transA=0, transB 0 or 1, W a constant 2-D weight, C absent or a
  constant of shape (N,) or (1, N) with beta=1 (beta is irrelevant without C).
* ``Add(MatMul(x, W), b)``: x 2-D, W a constant (K, N), b a constant (N,) or (1, N), the product
  read by the Add alone.
* ``MatMul(x, W)``: the same without a bias (also where the Add's constant is not one value per
  output column: that Add then stays, after the Split).

MatMuls of a 3-D (or unknown-rank) input are sites only when cross-attention alone reads their
product, as MultiHeadAttention's key or value, with a query not projected from the same tensor:
the K and V projections of the text context (``encoder_hidden_states``, 77 tokens), which every
transformer block reads. fuse-attention writes them apart (its ``cross_layout="separate"``) and
this pass computes all of them (32 in SD 1.5) with one MatMul and a Split, so MultiHeadAttention
reads K and V in place, without unpacking. Other N-D MatMuls are not sites: self-attention's
Q/K/V read thousands of image tokens, and a Split copying their product costs more than the
launches it saves; packing those is fuse-attention's job.

Conditions: the members of a group read the same tensor x, with one dtype and one K; a member
failing a condition above is refused with the reason and left as it was; a group left with one
member is left alone (refused: no other mergeable Linear reads x).

The merged weight takes the layout most members have (transB=1 on a tie: torch's (N, K)); the
other members' weights are transposed when it is computed. It is a ``DerivedValues``: built only
when read or saved, one member weight at a time into the result, so a large model is never held
twice; the members' initializers leave the graph with them (cleanup) unless something else reads
them. Each output column is the same dot product as before; only the order in which a GEMM kernel
sums may differ.

Order: after fuse-attention (``runs_after``, enforced by the pass manager), for two reasons. The
cross-attention K/V members exist only once fuse-attention has written MultiHeadAttention. And
onnxopt's symbolic dims (:mod:`onnxopt.pattern.dims`) follow a batch dim through a Gemm but not
through a Split, and fuse-attention proves that a Q Reshape keeps the batch from dims that, in
TorchScript exports with dynamic axes, come through the time embedding: run first, this pass left
4 of the 8 attentions of the tiny SD 1.5 UNet unfused (ControlNet: 2 of 4). After it, or anywhere
in the tensorrt preset, every other pass fused exactly what it fuses without this pass (tiny UNet
and ControlNet fixtures).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, NameAuthority
from onnxopt.graph_edit import detach, is_standard
from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, Pass, PassResult
from onnxopt.pattern import Const, Pattern, Var, constant_shape, constant_value, is_constant, op
from onnxopt.pattern.tensor_facts import normalize_axis, rank_of, static_dim, static_ints
from onnxopt.registry import register_pass
from onnxopt.weight_provenance import concatenated, record_sources, transpose
from onnxopt.weights import DerivedValues, numpy_dtype, read_uncached, stored_values


def gemm(x, w, c=Var("c", optional=True)):
    return op.Gemm(x, w, c, alpha=Var("alpha"), beta=Var("beta"), transA=Var("transA"), transB=Var("transB"), _name="linear")


def matmul_bias(x, w, c=Const()):
    return op.Add(op.MatMul(x, w, _name="linear", _outputs=["product"]), c, _name="bias")


def matmul(x, w):
    return op.MatMul(x, w, _name="linear")


MAX_WEIGHT_BYTES = 1 << 30  # one merged weight at most: computing it when saved holds it whole (Flux: 13 GB in all)
ATTENTION_OPS = frozenset({"MultiHeadAttention"})  # com.microsoft ops whose key/value inputs may be merged


def _is_site_input(x: gs.Tensor, output: gs.Tensor) -> bool:
    """A MatMul is a site for a 2-D input, or for an N-D one whose product only cross-attention
    reads, as key or value: the K/V projections of a short text context."""
    return rank_of(x) == 2 or _only_cross_attention_kv_reads(output, x)


def _only_cross_attention_kv_reads(tensor: gs.Tensor, x: gs.Tensor) -> bool:
    """Every reader is a MultiHeadAttention taking ``tensor`` as key or value, whose query is not
    projected from ``x`` too (that would be self-attention over the image tokens: thousands of
    rows, where the Split's copy costs more than the launches it saves)."""
    readers = list(tensor.outputs)
    return bool(readers) and all(
        node.op in ATTENTION_OPS and node.domain == "com.microsoft"
        and all(i in (1, 2) for i, t in enumerate(node.inputs) if t is tensor)
        and not _projected_from(node.inputs[0], x)
        for node in readers)


def _projected_from(query: gs.Tensor, x: gs.Tensor) -> bool:
    """The query is computed by a node reading x (self-attention's Q MatMul)."""
    return any(t is x for producer in query.inputs for t in producer.inputs)


LINEAR = Pattern(gemm, matmul_bias, name="linear")  # roots Gemm and Add
BARE_MATMUL = Pattern(matmul, name="matmul")  # MatMuls no biased match took


@dataclass
class Linear:
    """One member: ``output = x @ W (transposed if trans_b) [+ bias]``, computed by ``nodes``."""

    node: gs.Node  # the Gemm or MatMul
    nodes: list[gs.Node]  # what computes output (MatMul and its bias Add)
    x: gs.Tensor
    w: gs.Tensor
    bias: gs.Tensor | None
    trans_b: int
    output: gs.Tensor
    attrs: dict

    @property
    def name(self) -> str:
        return self.node.name or self.output.name

    @property
    def n(self) -> int:
        return int(constant_shape(self.w)[0 if self.trans_b else 1])

    @property
    def k(self) -> int:
        return int(constant_shape(self.w)[1 if self.trans_b else 0])


@register_pass
class FuseParallelGemm(Pass):
    name = "fuse-parallel-gemm"
    description = ("Linears (Gemm, MatMul[+Add]) that read one 2-D tensor, or cross-attention K/V projections of one "
                   "context -> one Gemm/MatMul with concatenated weights + Split")
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})
    is_fusion = True
    runs_after = {"fuse-attention": "the cross-attention K/V it merges are fuse-attention's MultiHeadAttention inputs, and "
                                    "fuse-attention's batch-dim proofs follow the time embedding through a Gemm, not through the "
                                    "Split this pass writes (TorchScript dynamic-axes exports lose half their attention fusions)"}

    def __init__(self, *, max_weight_bytes: int = MAX_WEIGHT_BYTES):
        """max_weight_bytes: the largest merged weight; a group whose members' weights exceed it is
        merged in consecutive chunks, each at most this size (a member larger than it stays alone)."""
        self.max_weight_bytes = int(max_weight_bytes)

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        by_input: dict[int, list[Linear]] = {}
        for linear in _linears(graph):
            by_input.setdefault(id(linear.x), []).append(linear)
        position = {id(n): i for i, n in enumerate(graph.nodes)}
        names = NameAuthority(graph)
        groups = members = from_matmul = splits_folded = 0
        for readers in by_input.values():
            if len(readers) < 2:
                continue  # nothing reads x in parallel with it: not a site
            readers.sort(key=lambda m: position[id(m.node)])
            result.sites_matched += len(readers)
            eligible: dict[tuple, list[Linear]] = {}
            for linear in readers:
                reason = _refusal(linear)
                if reason is not None:
                    result.refuse(linear.name, reason)
                    continue
                eligible.setdefault((_dtype(linear.w), linear.k), []).append(linear)
            for group in eligible.values():
                if len(group) < 2:
                    result.refuse(group[0].name, f"no other mergeable Linear reads {group[0].x.name} (with this dtype and K)")
                    continue
                for chunk in _chunks(group, self.max_weight_bytes):
                    if len(chunk) < 2:
                        result.refuse(chunk[0].name, f"its weight and its neighbours' exceed max_weight_bytes={self.max_weight_bytes}")
                        continue
                    splits_folded += _merge(Emit(graph, names, f"{chunk[0].x.name}__parallel_gemm"), chunk)
                    groups += 1
                    members += len(chunk)
                    from_matmul += sum(m.node.op == "MatMul" for m in chunk)
        result.sites_rewritten = members
        result.details.update(groups=groups, members=members, from_matmul=from_matmul)
        if splits_folded:
            result.details["splits_folded"] = splits_folded
        if not result.sites_matched:
            result.nothing_to_do = ("no two Linears (Gemm, MatMul of a 2-D input, or a cross-attention K/V projection) "
                                    "read the same tensor")
        result.modified = groups > 0
        if result.modified:
            graph.cleanup(remove_unused_graph_inputs=False).toposort()
        return result


def _linears(graph: gs.Graph) -> list[Linear]:
    """Every Gemm, MatMul+bias Add and bare MatMul of a 2-D input, as Linears."""
    linears: list[Linear] = []
    taken: set[int] = set()
    for match in LINEAR.find(graph):
        node = match.node("linear")
        if node.op == "Gemm":
            taken.add(id(node))
            linears.append(Linear(node, [node], match["x"], match["w"], match.get("c"), int(match.attrs["transB"]),
                                  match.output, dict(match.attrs)))
        elif _per_column(match["c"], match["w"]) and _is_site_input(match["x"], match.output):
            taken.add(id(node))
            linears.append(Linear(node, [node, match.node("bias")], match["x"], match["w"], match["c"], 0, match.output, {}))
        elif _is_site_input(match["x"], match["product"]):  # the Add's constant is not a bias: the MatMul alone is the member
            taken.add(id(node))
            linears.append(Linear(node, [node], match["x"], match["w"], None, 0, match["product"], {}))
    for match in BARE_MATMUL.find(graph):
        node = match.node("linear")
        if id(node) not in taken and _is_site_input(match["x"], match.output):
            linears.append(Linear(node, [node], match["x"], match["w"], None, 0, match.output, {}))
    return linears


def _per_column(bias: gs.Tensor, w: gs.Tensor) -> bool:
    """bias is one value per output column of x @ w (w (K, N)): shape (N,) or (1, N)."""
    w_shape, b_shape = constant_shape(w), constant_shape(bias)
    if w_shape is None or len(w_shape) != 2 or b_shape is None:
        return False
    return tuple(b_shape) in ((w_shape[1],), (1, w_shape[1]))


def _refusal(linear: Linear) -> str | None:
    w, bias, attrs = linear.w, linear.bias, linear.attrs
    if not is_constant(w):
        return "weight is not a constant: it cannot be concatenated offline"
    if len(constant_shape(w)) != 2:
        return f"weight has shape {list(constant_shape(w))}; a Linear's weight is 2-D"
    if linear.node.op == "Gemm":
        if attrs["alpha"] != 1.0:
            return f"alpha={attrs['alpha']}: the merged Gemm would scale every member by it"
        if attrs["transA"] != 0:
            return "transA=1: the input is read transposed"
        if bias is not None and attrs["beta"] != 1.0:
            return f"beta={attrs['beta']}: the merged Gemm would scale every member's bias by it"
        if bias is not None and not is_constant(bias):
            return "bias is not a constant: it cannot be concatenated offline"
        if bias is not None and tuple(constant_shape(bias)) not in ((linear.n,), (1, linear.n)):
            return f"C has shape {list(constant_shape(bias))}, not one value per output column ({linear.n},)"
    if bias is not None and _dtype(bias) != _dtype(w):
        return f"bias dtype {_dtype(bias)} differs from the weight's {_dtype(w)}"
    k = static_dim(linear.x, -1)
    if k is not None and k != linear.k:
        return f"input has {k} features, the weight {linear.k}"
    return None


def _chunks(group: list[Linear], max_bytes: int) -> list[list[Linear]]:
    """Consecutive members whose weights together stay within ``max_bytes``."""
    chunks: list[list[Linear]] = [[]]
    total = 0
    for member in group:
        size = member.n * member.k * _dtype(member.w).itemsize
        if chunks[-1] and total + size > max_bytes:
            chunks.append([])
            total = 0
        chunks[-1].append(member)
        total += size
    return chunks


def _column_split(tensor: gs.Tensor, n: int) -> tuple[gs.Node, list[int]] | None:
    """The Split that alone reads ``tensor`` (a member's output, n columns) along its last axis, with
    its static sizes: AdaLN's ``chunk(6, dim=1)`` of the modulation. None if there is none."""
    readers = list(tensor.outputs)
    if len(readers) != 1 or readers[0].op != "Split" or not is_standard(readers[0]) or readers[0].inputs[0] is not tensor:
        return None
    split = readers[0]
    rank = rank_of(tensor)
    axis = split.attrs.get("axis", 0)
    if rank is None or normalize_axis(axis, rank) != rank - 1:
        return None
    if len(split.inputs) > 1 and split.inputs[1].name:
        sizes = static_ints(split.inputs[1])
    elif "split" in split.attrs:
        sizes = [int(v) for v in split.attrs["split"]]
    else:
        parts = int(split.attrs.get("num_outputs", len(split.outputs)))
        sizes = [n // parts] * parts if parts and n % parts == 0 else None
    if sizes is None or sum(sizes) != n or len(sizes) != len(split.outputs):
        return None
    return split, sizes


def _merge(make: Emit, group: list[Linear]) -> int:
    """One Gemm (MatMul [+ Add] for an N-D input) computes every member's columns; a Split hands
    each member its output tensor -- or, where a member's output was itself split along its columns
    (AdaLN's shift/scale/gate chunks), that Split's outputs: the two Splits become one. Returns how
    many member Splits were folded so."""
    x = group[0].x
    sizes: list[int] = []
    outputs: list[gs.Tensor] = []
    folded = 0
    for member in group:
        inner = _column_split(member.output, member.n)
        if inner is None or any(t is member.output for t in make.graph.outputs):
            sizes.append(member.n)
            outputs.append(member.output)
            continue
        split, inner_sizes = inner
        sizes.extend(inner_sizes)
        outputs.extend(split.outputs)
        detach(split)
        folded += 1
    two_d = rank_of(x) == 2
    trans_b = 1 if two_d and 2 * sum(m.trans_b for m in group) >= len(group) else 0  # MatMul: (K, N) only
    dtype = _dtype(group[0].w)
    weight = make.constant("weight", _concatenated_weight(group, trans_b, f"{make.prefix}.weight"))
    bias = None
    if any(m.bias is not None for m in group):
        bias = make.constant("bias", _concatenated_bias(group, dtype, f"{make.prefix}.bias"))
    leading = list(x.shape[:-1]) if x.shape is not None else None
    shape = [*leading, sum(sizes)] if leading is not None else None
    for member in group:
        for node in member.nodes:
            detach(node)  # its output is handed to the Split below; cleanup drops the node and its weight
    if two_d:
        merged = make.op.Gemm(x, weight, bias, transB=trans_b, _shape=shape)
    else:
        merged = make.op.MatMul(x, weight, _shape=shape)
        if bias is not None:
            merged = make.op.Add(merged, bias)
    make.op.Split(merged, make.constant("split_sizes", np.array(sizes, dtype=np.int64)), axis=-1, _outputs=outputs)
    make.into(make.graph)
    return folded


def _concatenated_weight(group: list[Linear], trans_b: int, name: str) -> DerivedValues:
    """The members' weights side by side along N, in layout ``trans_b``; computed when read or saved."""
    k, total, dtype = group[0].k, sum(m.n for m in group), _dtype(group[0].w)
    shape = (total, k) if trans_b else (k, total)

    def compute() -> np.ndarray:
        out = np.empty(shape, dtype)
        start = 0
        for member in group:  # one member weight loaded at a time
            w = _read(member.w)
            if member.trans_b != trans_b:
                w = w.T
            end = start + member.n
            if trans_b:
                out[start:end] = w
            else:
                out[:, start:end] = w
            start = end
        return out

    constants = [m.w for m in group]
    elements = [stored_values(w) for w in constants] if all(isinstance(w, gs.Constant) for w in constants) else None
    # each member's delta, in the merged layout (a member in the other layout transposed first)
    ops = [([transpose((1, 0))] if m.trans_b != trans_b else []) + part
           for m, part in zip(group, concatenated([(m.n, k) if trans_b else (k, m.n) for m in group], 1 - trans_b))]
    return record_sources(DerivedValues(shape, dtype, compute, name=name, elements_of=elements), constants, ops)


def _concatenated_bias(group: list[Linear], dtype: np.dtype, name: str) -> DerivedValues:
    """The members' biases end to end, zeros for a member without one; computed when read or saved."""
    total = sum(m.n for m in group)

    def compute() -> np.ndarray:
        out = np.zeros(total, dtype)
        start = 0
        for member in group:
            if member.bias is not None:
                out[start : start + member.n] = _read(member.bias).reshape(-1)
            start += member.n
        return out

    return DerivedValues((total,), dtype, compute, name=name)


def _read(tensor: gs.Tensor) -> np.ndarray:
    """A constant's values without caching them on it; a Constant node's value is in memory anyway."""
    return read_uncached(tensor) if isinstance(tensor, gs.Constant) else constant_value(tensor)


def _dtype(tensor: gs.Tensor) -> np.dtype:
    if isinstance(tensor, gs.Constant):
        return numpy_dtype(tensor.dtype)
    return constant_value(tensor).dtype  # a Constant node's value


__all__ = ["BARE_MATMUL", "LINEAR", "FuseParallelGemm"]
