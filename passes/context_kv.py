"""context-kv: compute every cross-attention's K/V once per prompt, in a graph of its own.

In a UNet or ControlNet, K and V of each cross-attention (attn2) are projections of
``encoder_hidden_states``, identical at every step of a 20-50 step denoising loop. The pass cuts
the model in two at the edge of what depends on ``encoder_hidden_states`` alone::

    before (one model, run at every step):

        encoder_hidden_states ─ MatMul(W_kv) [+ b_kv] ─ Reshape(0,0,N,2,H) ──┐ packed KV
        x ─ ... ─ MatMul(W_q) ─────────────────────────────────────── MultiHeadAttention ─ ...

    after:

        context_kv (companion, once per prompt):
            encoder_hidden_states ─ MatMul(W_kv) [+ b_kv] ─ Reshape(0,0,N,2,H) ─ <module>.kv   (an output per layer)
        denoiser (every step):
            <module>.kv (input) ─────────────────────────────────────┐
            x ─ ... ─ MatMul(W_q) ─────────────────────────── MultiHeadAttention ─ ...

    with fuse-attention's ``layout=split`` the cut is the Split's K and V, ``<module>.k`` and
    ``<module>.v`` ((B, L, N*H) each).
    without fuse-attention (TensorRT target, or no fusion) the cut is the same rule on the
    exporter's graph, giving plain K and V (``<module>.k``, ``<module>.v``) in the layout the
    attention reads them: K^T and V after the head split (TorchScript; the split's shape comes from
    the Shape of encoder_hidden_states, which depends on nothing else), the projections themselves
    (dynamo, whose head-split shape is computed from the sample's batch).

SDXL's added conditioning (``constant_inputs``, default ``text_embeds`` and ``time_ids`` when the
model has them): these inputs are constant over the steps too, so the rule starts from them as
well, and what the UNet computes from them alone moves to the companion with the K/V::

    text_embeds ───────────────────────────────────┐
    time_ids ─ add_time_proj (sinusoidal) ─ Reshape ─ Concat ─ linear_1 ─ SiLU ─ linear_2 ─ add_embedding.linear_2.out
                                                                  (companion output; the denoiser adds it to the time embedding)

The rule (no pattern: any graph works):
    * A tensor is *context* when it is computed from ``encoder_hidden_states`` and constants only
      (no subgraphs, no random ops on the way); *shape-only* context when only the input's shape
      reaches it (``Shape``, then shape arithmetic).
    * The cut is the set of context tensors (not shape-only) that the rest of the graph reads:
      the companion outputs them, the denoiser takes them as inputs. Everything needed for them
      moves to the companion, weights included (the same constant objects: nothing is copied;
      a small constant both parts read gets a second name over the same values).
    * Shape-only plumbing the denoiser reads (the batch of the query's head split, in
      TorchScript exports) stays in the denoiser, each ``Shape`` of a context tensor rewritten to
      read the same dims from the denoiser's new inputs (or its other inputs), proven equal by
      :mod:`onnxopt.pattern.dims`. So no shape becomes an input, and the denoiser does not take
      ``encoder_hidden_states`` unless something else reads it (or a shape cannot be proven).
    * Layers: each cut tensor belongs to the attention that reads it (a com.microsoft
      MultiHeadAttention, or the Softmax its scores/probabilities meet); a layer's name is its
      torch module (TorchScript node names, the dynamo exporter's name scopes), e.g.
      ``down_blocks.0.attentions.0.transformer_blocks.0.attn2``, else ``cross_attention.<i>``.

Refusal (the model is left as it is, with the reason; ``--strict`` makes it exit 4): no input
``encoder_hidden_states``; nothing reads it but the denoiser's own nodes directly; a graph output
that depends on it alone; control flow; a Shape the denoiser reads that cannot be re-expressed;
an interface tensor of unknown type.

Order (enforced by the pass manager, see ``runs_after``): after fuse-attention, whose packed KV is
the cut for ONNX Runtime (before it, the cross-attention could no longer be fused: its K/V would
be graph inputs). Any order with fp16 and nhwc-conv: passes after this one also run on the
companion, and the manager keeps the handed-over tensors in fp16 (no Cast pair between the parts).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.domains import MS_DOMAIN
from onnxopt.fusion import Emit, NameAuthority, Refusal
from onnxopt.graph_edit import clone_node, copy_tensor, detach, is_absent, replace_inputs, replace_output
from onnxopt.layout import LAYOUT_OPS
from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, Pass, PassResult
from onnxopt.pattern.dims import Dims, same, text
from onnxopt.registry import register_pass
from onnxopt.weights import constant_nbytes, stored_values

CONTEXT_INPUT = "encoder_hidden_states"
# Further inputs constant over the denoising loop: SDXL's pooled text embedding and time ids, from
# which its UNet computes the added conditioning (add_time_proj, concat, linear, SiLU, linear).
CONSTANT_INPUTS = ("text_embeds", "time_ids")
COMPANION = "context_kv"
FUSED_ATTENTION = frozenset({"MultiHeadAttention", "Attention", "PackedMultiHeadAttention"})
RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"})
SHAPE_OPS = frozenset({"Shape", "Size"})
STATIC, SHAPE, DATA = "static", "shape-only", "data"  # kinds of tensors the context input alone determines


@dataclass
class Layer:
    """One cross-attention: the attention node that reads the cut tensors, and those tensors."""

    anchor: gs.Node | None
    module: str | None
    tensors: list[tuple[gs.Variable, str]] = field(default_factory=list)  # (cut tensor, role: kv, k, v, context)


@register_pass
class ContextKV(Pass):
    name = "context-kv"
    description = ("split off encoder_hidden_states -> K/V of every cross-attention into a companion graph run once "
                   "per prompt (saved as <output>.context_kv.onnx); the denoiser reads them as inputs")
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})
    is_fusion = True  # "nothing to extract" is a note, or exit 4 under --strict, as for a fusion
    runs_after = {"fuse-attention": "the ORT cut is the packed KV that MultiHeadAttention reads, and a cross-attention "
                                    "whose K/V are graph inputs can no longer be fused"}
    applies_to_companions = False

    def __init__(self, context_input: str = CONTEXT_INPUT, companion: str = COMPANION,
                 constant_inputs: tuple[str, ...] | str = CONSTANT_INPUTS):
        self.context_input = context_input
        self.companion = companion
        self.constant_inputs = tuple(n for n in constant_inputs.split(",") if n) if isinstance(constant_inputs, str) \
            else tuple(constant_inputs)

    def run(self, model: Model) -> PassResult:
        result = PassResult(modified=False)
        try:
            split = Split(model, self.context_input, self.constant_inputs)
            layers = split.plan()
        except Refusal as refusal:
            result.nothing_to_do = f"nothing to extract: {refusal}"
            return result
        if self.companion in model.companions:
            result.nothing_to_do = f"nothing to extract: the model already has a '{self.companion}' companion"
            return result
        context = split.apply(self.companion)
        model.companions[self.companion] = context
        result.modified = True
        result.sites_matched = result.sites_rewritten = len(layers)
        result.details = split.details(context)
        return result


class Split:
    """The cut of one model: planned on the unchanged graph, then applied."""

    def __init__(self, model: Model, context_input: str, constant_inputs: tuple[str, ...] = ()):
        self.model, self.graph = model, model.graph
        self.input = next((t for t in self.graph.inputs if t.name == context_input), None)
        if self.input is None:
            names = ", ".join(t.name for t in self.graph.inputs)
            raise Refusal(f"the model has no input '{context_input}' (inputs: {names})")
        # the context input first, then the constant inputs the model has (SDXL's added conditioning)
        self.inputs = [self.input] + [t for t in self.graph.inputs if t.name in constant_inputs and t is not self.input]
        self.input_ids = {id(t) for t in self.inputs}
        self.kept_constant_inputs: set[int] = set()  # constant inputs the denoiser still reads
        self.dims = Dims()

    # ------------------------------------------------------------ planning

    def plan(self) -> list[Layer]:
        graph = self.graph
        graph.toposort()
        if any(list(node.subgraphs()) for node in graph.nodes):
            raise Refusal("the graph has control flow (If/Loop/Scan); the split handles flat graphs only")
        self.kind = self._classify()
        context_nodes = {id(n) for n in graph.nodes if n.outputs and all(id(t) in self.kind for t in n.outputs)}
        for out in graph.outputs:
            if self.kind.get(id(out)) in (DATA, SHAPE):
                raise Refusal(f"graph output '{out.name}' depends on {self.input.name} alone")

        # Readers outside the context region: what they read of it is the cut (or shapes of it).
        self.cut: list[gs.Variable] = []
        seen = set()
        for node in graph.nodes:
            if id(node) in context_nodes:
                continue
            for t in node.inputs:
                if self.kind.get(id(t)) == DATA and id(t) not in seen and id(t) not in self.input_ids:
                    seen.add(id(t))
                    self.cut.append(t)
        self.keep_input_reason = next(
            (f"{n.op} '{n.name}' reads it" for n in self.input.outputs if id(n) not in context_nodes), None)
        self.kept_constant_inputs = {id(t) for t in self.inputs[1:] if any(id(n) not in context_nodes for n in t.outputs)}
        if not self.cut:
            raise Refusal(f"no computation depends on {self.input.name} alone"
                          + (f" ({self.keep_input_reason})" if self.keep_input_reason else ""))

        # What each part needs: backward from the outputs (stopping at the cut and at Shapes of
        # context data) and backward from the cut.
        cut_ids = {id(t) for t in self.cut}
        self.denoiser_nodes, self.shape_reads = self._needed(graph.outputs, stop=cut_ids, shape_reads=True)
        self.context_nodes, _ = self._needed(self.cut, stop=set(), shape_reads=False)
        self.layers = self._layers()
        self.resolutions = {id(node): self._resolve(node) for node in self.shape_reads}
        for node in self.shape_reads:
            if self.resolutions[id(node)] is None:
                if node.inputs[0] is self.input:
                    self.keep_input_reason = self.keep_input_reason or f"its shape is read by {node.op} '{node.name}' and cannot be proven from the K/V"
                elif id(node.inputs[0]) in self.input_ids:
                    self.kept_constant_inputs.add(id(node.inputs[0]))
                else:
                    raise Refusal(f"{node.op} '{node.name}' reads the shape of '{node.inputs[0].name}', "
                                  "which the denoiser's inputs cannot be proven to give")
        for t in self.cut:
            if t.dtype is None:
                raise Refusal(f"the type of '{t.name}' is unknown (run infer-shapes first)")
        return self.layers

    def _classify(self) -> dict[int, str]:
        """id(tensor) -> STATIC / SHAPE / DATA for every tensor the context input and constants alone determine."""
        kind = {id(t): DATA for t in self.inputs}
        for node in self.graph.nodes:
            if node.op in RANDOM_OPS:
                continue
            kinds = []
            for t in node.inputs:
                if is_absent(t):
                    continue
                k = STATIC if isinstance(t, gs.Constant) else kind.get(id(t))
                if k is None:
                    break
                kinds.append(k)
            else:
                if node.op in SHAPE_OPS:
                    out = STATIC if all(k == STATIC for k in kinds) else SHAPE
                elif DATA in kinds:
                    out = DATA
                elif SHAPE in kinds:
                    out = SHAPE
                else:
                    out = STATIC
                for t in node.outputs:
                    kind[id(t)] = out
        return kind

    def _needed(self, roots, *, stop: set, shape_reads: bool) -> tuple[list[gs.Node], list[gs.Node]]:
        """Nodes computing ``roots`` (in graph order), not looking past ``stop`` tensors; with
        ``shape_reads``, also not past a Shape/Size of context data (returned apart)."""
        needed, reads = set(), []
        queue = deque(t for t in roots if id(t) not in stop)
        while queue:
            t = queue.popleft()
            for producer in t.inputs:
                if id(producer) in needed:
                    continue
                needed.add(id(producer))
                if shape_reads and producer.op in SHAPE_OPS and self.kind.get(id(producer.inputs[0])) == DATA:
                    reads.append(producer)
                    continue
                queue.extend(x for x in producer.inputs if id(x) not in stop and not isinstance(x, gs.Constant))
        read_ids = {id(n) for n in reads}
        return [n for n in self.graph.nodes if id(n) in needed], [n for n in self.graph.nodes if id(n) in read_ids]

    # ------------------------------------------------------------ layers and names

    def _layers(self) -> list[Layer]:
        by_anchor: dict[int, Layer] = {}
        loose: list[Layer] = []
        for t in self.cut:
            anchor, role = attention_reading(t)
            if anchor is None:  # not read by an attention (SDXL's added conditioning): named by its producer
                producer = t.inputs[0] if t.inputs else None
                module = module_of(producer, self.model.node_scopes) if producer is not None else None
                loose.append(Layer(None, module, [(t, "out" if module else role)]))
                continue
            layer = by_anchor.setdefault(id(anchor), Layer(anchor, module_of(anchor, self.model.node_scopes)))
            layer.tensors.append((t, role))
        order = {id(n): i for i, n in enumerate(self.graph.nodes)}
        layers = sorted(by_anchor.values(), key=lambda layer: order.get(id(layer.anchor), 0)) + loose
        for layer in layers:
            layer.tensors.sort(key=lambda item: ("kv", "k", "v", "context", "out").index(item[1]))
        _strip_wrapper([layer for layer in layers if layer.module])
        return layers

    def interface_names(self) -> dict[int, str]:
        """id(cut tensor) -> its name as companion output and denoiser input."""
        taken = set(self.graph.tensors()) - {t.name for t in self.cut}
        names, used = {}, set()
        for i, layer in enumerate(self.layers):
            base = layer.module or f"cross_attention.{i}"
            roles = [role for _, role in layer.tensors]
            for j, (t, role) in enumerate(layer.tensors):
                suffix = role if roles.count(role) == 1 else f"{role}{j}"
                name = candidate = f"{base}.{suffix}"
                k = 2
                while candidate in taken or candidate in used:
                    candidate = f"{name}_{k}"
                    k += 1
                used.add(candidate)
                names[id(t)] = candidate
        return names

    # ------------------------------------------------------------ shapes the denoiser reads

    def _resolve(self, node: gs.Node) -> list | None:
        """The dims ``node`` (a Shape of context data) computes, each an int or (tensor, axis) the
        denoiser will have: the cut tensors first, then its other inputs."""
        if node.op != "Shape":
            return None
        dims = self.dims.shape(node.inputs[0])
        if dims is None:
            return None
        rank = len(dims)
        start, end = int(node.attrs.get("start", 0)), node.attrs.get("end")
        start = max(0, start + rank if start < 0 else start)
        end = rank if end is None else max(0, int(end) + rank if int(end) < 0 else int(end))
        sources = [(t, self.dims.shape(t)) for t in self.cut]
        sources += [(t, self.dims.shape(t)) for t in self.graph.inputs if id(t) not in self.input_ids]
        pieces = []
        for d in dims[start:min(end, rank)]:
            if d is not None and d.is_int:
                pieces.append(d.value)
                continue
            found = next(((t, axis) for t, shape in sources if shape for axis, s in enumerate(shape) if d is not None and same(s, d)), None)
            if found is None:
                return None
            pieces.append(found)
        return pieces

    # ------------------------------------------------------------ the rewrite

    def apply(self, companion: str) -> Model:
        graph, names = self.graph, self.interface_names()
        self.names = names
        denoiser_ids = {id(n) for n in self.denoiser_nodes}
        context_ids = {id(n) for n in self.context_nodes}
        keep_input = self.keep_input_reason is not None

        new_inputs = {id(t): copy_tensor(t, names[id(t)], self._input_shape(t)) for t in self.cut}

        # Companion: the context region, with its own input and its own copies of what the
        # denoiser also needs (shape plumbing, small constants shared with the denoiser).
        read = {id(t) for n in self.context_nodes for t in n.inputs}
        companion_reads = [t for t in self.inputs if t is self.input or id(t) in read]
        context_inputs = [copy_tensor(t) for t in companion_reads]
        replacement = {id(t): c for t, c in zip(companion_reads, context_inputs)}
        context_nodes = []
        for node in self.context_nodes:
            if id(node) in denoiser_ids:  # needed by both: the companion gets a clone
                clone = clone_node(node)
                replacement.update({id(a): b for a, b in zip(node.outputs, clone.outputs)})
                context_nodes.append(clone)
            else:
                context_nodes.append(node)
        for node in context_nodes:
            for t in node.inputs:
                if isinstance(t, gs.Constant) and any(id(r) in denoiser_ids for r in t.outputs):
                    replacement.setdefault(id(t), gs.Constant(t.name, stored_values(t)))  # same values, no copy
            replace_inputs(node, replacement)
        outputs = []
        for t in self._cut_in_layer_order():
            t.name, t.shape = names[id(t)], new_inputs[id(t)].shape
            outputs.append(t)
        context_graph = gs.Graph(nodes=context_nodes, inputs=context_inputs, outputs=outputs,
                                 name=f"{graph.name or 'model'}_{companion}", opset=graph.opset,
                                 import_domains=graph.import_domains, ir_version=graph.ir_version,
                                 producer_name=graph.producer_name, producer_version=graph.producer_version)
        context_graph.toposort()

        # Denoiser: new inputs in place of the cut tensors, shapes re-expressed on them.
        for node in self.denoiser_nodes:
            replace_inputs(node, new_inputs)
        resolution_nodes = []
        taken = NameAuthority(graph)
        for node in self.shape_reads:
            pieces = self.resolutions[id(node)]
            if pieces is None:
                continue  # a Shape of the context input itself, which the denoiser keeps reading
            pieces = [p if isinstance(p, int) else (new_inputs.get(id(p[0]), p[0]), p[1]) for p in pieces]
            resolution_nodes += shape_from(pieces, node, self.model.opset, Emit(graph, taken, node.name or node.outputs[0].name))

        # Everything else goes: nodes neither part needs are disconnected so no tensor keeps a
        # reader in the other graph.
        resolved = {id(n) for n in self.shape_reads if self.resolutions[id(n)] is not None}
        kept = [n for n in graph.nodes if id(n) in denoiser_ids and id(n) not in resolved]
        kept_ids = {id(n) for n in kept}
        for node in graph.nodes:
            if id(node) not in kept_ids and id(node) not in context_ids:
                detach(node)
        graph.nodes = kept + resolution_nodes
        moved = {id(t) for t in self.inputs[1:] if id(t) in read and id(t) not in self.kept_constant_inputs}
        if not keep_input:
            moved.add(id(self.input))
        graph.inputs = [t for t in graph.inputs if id(t) not in moved] + [new_inputs[id(t)] for t in self._cut_in_layer_order()]
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
        meta = dict(self.model.metadata_props, **{"onnxopt.companion": companion})
        return Model(graph=context_graph, source=self.model.source, metadata_props=meta,
                     model_version=self.model.model_version, doc_string=self.model.doc_string, domain=self.model.domain)

    def _cut_in_layer_order(self) -> list[gs.Variable]:
        return [t for layer in self.layers for t, _ in layer.tensors]

    def _input_shape(self, t: gs.Variable) -> list | None:
        """The annotation, with dims the structural rules name better (``sequence`` for ``unk__3``)."""
        dims = self.dims.shape(t)
        annotated = list(t.shape) if t.shape is not None else None
        if dims is None:
            return annotated
        shape = []
        for i, d in enumerate(dims):
            old = annotated[i] if annotated is not None and i < len(annotated) else None
            if d is not None and d.is_int:
                shape.append(d.value)
            elif d is not None and d.coeff == 1 and len(d.symbols) == 1 and not d.symbols[0].startswith("?"):
                shape.append(d.symbols[0])
            else:
                shape.append(old)
        return shape

    def details(self, context: Model) -> dict:
        layers = []
        listing = []
        for layer, index in zip(self.layers, range(len(self.layers))):
            reads = [self.names[id(t)] for t, _ in layer.tensors]
            shapes = [text(self.dims.shape(t)) for t, _ in layer.tensors]
            module = layer.module or f"cross_attention.{index}"
            layers.append({"module": module, "attention": layer.anchor.name if layer.anchor is not None else None,
                           "reads": reads, "shapes": shapes})
            verb = "reads" if layer.anchor is not None else "computed once:"
            listing.append(f"{module} {verb} " + ", ".join(f"{r} {s}" for r, s in zip(reads, shapes)))
        weights = sum(constant_nbytes(c) for c in context.constants())
        keep = self.keep_input_reason
        moved = [t.name for t in self.inputs[1:] if t.name in {i.name for i in context.graph.inputs}
                 and id(t) not in self.kept_constant_inputs]
        listing.append(f"{len(context.graph.nodes)} nodes and {_size(weights)} of weights moved to the companion; "
                       + (f"the denoiser still reads {self.input.name} ({keep})" if keep else f"the denoiser no longer reads {self.input.name}")
                       + (f" nor {', '.join(moved)}" if moved else ""))
        return {
            "layers": layers,
            "listing": listing,
            "context_nodes": len(context.graph.nodes),
            "context_weights_bytes": weights,
            "denoiser_reads_context_input": keep,
            "constant_inputs_moved": moved,
        }


# ---------------------------------------------------------------- which attention reads a tensor


def attention_reading(t: gs.Tensor) -> tuple[gs.Node | None, str]:
    """(the node that stands for the attention reading ``t``, t's role in it).

    Fused: the com.microsoft node (role kv for the packed key input, k or v). Standard ops: the
    Softmax that V's MatMul reads (V) or that K's scores reach (K)."""
    for reader in t.outputs:
        if reader.domain == MS_DOMAIN and reader.op in FUSED_ATTENTION:
            inputs = list(reader.inputs)
            if len(inputs) > 1 and inputs[1] is t:
                packed = len(inputs) < 3 or not inputs[2].name
                return reader, "kv" if packed else "k"
            if len(inputs) > 2 and inputs[2] is t:
                return reader, "v"
            return reader, "context"
    frontier = [t]
    for _ in range(4):  # V, through its head split: MatMul(probabilities, v)
        for x in frontier:
            for reader in x.outputs:
                if reader.op == "MatMul" and len(reader.inputs) == 2 and reader.inputs[1] is x:
                    softmax = _softmax_above(reader.inputs[0])
                    if softmax is not None:
                        return softmax, "v"
        frontier = [o for x in frontier for r in x.outputs if r.op in LAYOUT_OPS for o in r.outputs]
    softmax = _softmax_below(t)
    return (softmax, "k") if softmax is not None else (None, "context")


def _softmax_above(x: gs.Tensor, depth: int = 6) -> gs.Node | None:
    """The Softmax whose probabilities ``x`` is, through casts and a NaN guard."""
    for _ in range(depth):
        producer = x.inputs[0] if len(x.inputs) == 1 else None
        if producer is None:
            return None
        if producer.op == "Softmax":
            return producer
        if producer.op in ("Cast", "Identity", "Dropout"):
            x = producer.inputs[0]
        elif producer.op == "Where" and len(producer.inputs) == 3:
            x = producer.inputs[2]
        else:
            return None
    return None


SCORE_OPS = frozenset({"Mul", "Div", "MatMul", "Add", "Cast", "Transpose", "Reshape", "Softmax"})


def _softmax_below(t: gs.Tensor, depth: int = 10) -> gs.Node | None:
    """The nearest Softmax that the scores computed from ``t`` reach (K, K^T, scaled K^T; dynamo
    writes K^T as Reshape-Transpose-Reshape-Transpose-Reshape, then Mul and MatMul: 7 nodes)."""
    frontier = [t]
    for _ in range(depth):
        readers = [r for x in frontier for r in x.outputs if r.op in SCORE_OPS]
        for r in readers:
            if r.op == "Softmax":
                return r
        frontier = [o for r in readers for o in r.outputs]
    return None


def module_of(node: gs.Node, scopes: dict[str, str]) -> str | None:
    """The torch module a node came from, dotted: from the dynamo exporter's scopes or from a
    TorchScript path name ('/unet/down_blocks.0/.../attn2/Softmax'). A fused node is named after
    the node it replaced ('node_Softmax_266/MultiHeadAttention')."""
    name = node.name or ""
    for key in (name, name.split("/")[0], name.rsplit("/", 1)[0]):
        if key in scopes:
            return scopes[key]
    parts = [p for p in name.split("/") if p]
    if name.startswith("/") and len(parts) >= 2:
        return ".".join(parts[:-1])
    return None


def _strip_wrapper(layers: list[Layer]) -> None:
    """Drop a first name component every layer shares ('unet.', 'controlnet.': the export
    wrapper's attribute), so names read as the diffusers model's own module names."""
    if len(layers) < 2:
        return
    firsts = {layer.module.split(".")[0] for layer in layers}
    if len(firsts) == 1 and all("." in layer.module for layer in layers):
        for layer in layers:
            layer.module = layer.module.split(".", 1)[1]


def shape_from(pieces: list, node: gs.Node, opset: int, make: Emit) -> list[gs.Node]:
    """Nodes computing into ``node``'s output what ``pieces`` say (ints, or (tensor, axis)),
    detaching ``node``; consecutive ints become one constant. Written by ``make`` (prefix: the
    node's name), returned, not added to the graph."""
    out = node.outputs[0]
    name = make.prefix
    detach(node)
    parts, ints = [], []

    def flush():
        if ints:
            parts.append(make.constant(f"dims{len(parts)}", np.array(ints, dtype=np.int64)))
            ints.clear()

    for piece in pieces:
        if isinstance(piece, int):
            ints.append(piece)
            continue
        flush()
        t, axis = piece
        if opset >= 15:
            part = make.op.Shape(t, start=axis, end=axis + 1, _label=f"dim{len(parts)}", _dtype=np.int64, _shape=[1])
        else:
            whole = make.op.Shape(t, _label=f"shape{len(parts)}", _dtype=np.int64, _shape=[len(t.shape or ())])
            index = make.constant(f"axis{len(parts)}", np.array([axis], dtype=np.int64))
            part = make.op.Gather(whole, index, axis=0, _label=f"dim{len(parts)}", _shape=[1])
        parts.append(part)
    flush()
    if len(parts) == 1 and make.nodes:
        replace_output(make.nodes[-1], parts[0], out)
    elif len(parts) == 1:  # all constant: an Identity keeps the tensor's producer (folding removes it)
        make.op.Identity(parts[0], _name=name, _outputs=[out])
    else:
        make.op.Concat(*parts, axis=0, _name=name, _outputs=[out])
    return make.nodes


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.1f} kB"
