"""widen-periodic-arguments: compute a Sin/Cos argument in float32 where the source rounded it to
float16/bfloat16.

    t:bf16 ─ Mul(1000:bf16) ─ Unsqueeze ─ Cast(to=FLOAT) ─ Mul(freqs) ─ Sin/Cos
             └ rounds: 3.5 × 1000 = 3504 ┘
        ==>
    t:bf16 ─ Cast(to=FLOAT) ─ Mul(1000:f32) ─ Unsqueeze ─ Mul(freqs) ─ Sin/Cos
                              └──────── float32 ───────────────────────────┘

    a periodic node itself in low precision reads the widened argument and hands its result back:
    t:bf16 ─ Mul(freqs:bf16) ─ Sin:bf16 ─ y   ==>   t ─ Cast(f32) ─ Mul(freqs:f32) ─ Sin ─ Cast(bf16) ─ y

A model exported in bfloat16 computes what PyTorch computes in bfloat16: diffusers' Flux
transformer scales ``timestep.to(dtype) * 1000`` and ``guidance.to(dtype) * 1000`` in the model's
dtype, so guidance 3.5 becomes 3504 before ``get_timestep_embedding`` upcasts to float32, and the
sinusoid at frequency 1 is off by 4 radians. The fp16 pass keeps a float32 source's argument
float32 (hazard rule 3 of :mod:`onnxopt.fp16_hazards`); this pass gives a low-precision source the
same rule: what the argument's arithmetic rounded is computed in float32 instead (torch.compile's
inductor does the same, keeping fused intermediates in float32).

Which nodes (the cone is :func:`~onnxopt.fp16_hazards.periodic_cones`' walk, the one the fp16 pass
keeps float32):

* a rounding site: a binary arithmetic node (Mul, Div, Add, Sub, Mod) of the cone computing in
  float16/bfloat16, or a Cast of the cone to float16/bfloat16 from another type;
* every cone node computing in low precision on a widened value (data movement, Floor, the
  Sin/Cos itself): it carries the float32 value on;
* low-precision data movement before the first rounding site stays as it is (it rounds nothing).

Conditions: every tensor widened (inputs and outputs of those nodes) holds at most
``SMALL_PER_SAMPLE`` values per sample (all dims after the first static, their product that
small): the cone of a timestep or guidance embedding, never an activation; a cone with a larger or
unknown tensor is refused whole. Low-precision inputs from outside are cast up (constants are
converted: exact); a Cast to low precision in the cone becomes a Cast to float32; outputs read by
a ``Cast(to=FLOAT)`` go to its readers directly, those read by anything else (or a graph output)
through a Cast back to the low type. The result differs from the source by what the source
rounded, which no tolerance bounds (a phase off by radians): ``--verify`` compares it, and every
step after it, with the source widened by this pass (``rebases_verification``); the tests prove the
widening against the float32 module.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.fp16_hazards import node_label, periodic_cones
from onnxopt.fusion import Emit, NameAuthority
from onnxopt.graph_edit import redirect_consumers, replace_output
from onnxopt.model import Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, Pass, PassResult
from onnxopt.precision import data_dependent, element_types
from onnxopt.registry import register_pass
from onnxopt.weights import read_uncached, stored_values

_T = onnx.TensorProto
LOW_TYPES = {_T.FLOAT16: "float16", _T.BFLOAT16: "bfloat16"}
ROUNDING_OPS = frozenset({"Mul", "Div", "Add", "Sub", "Mod"})
# An embedding's argument: timestep (B,), guidance (B,), t[:, None] * freqs (B, 128); an image
# token stream is (B, 4096, 3072).
SMALL_PER_SAMPLE = 4096


def per_sample(shape) -> int | None:
    """Values per sample (per index of the first dim) of a tensor of ``shape``; None when unknown."""
    if shape is None:
        return None
    count = 1
    for dim in list(shape)[1:]:
        if not isinstance(dim, (int, np.integer)) or dim < 0:
            return None
        count *= int(dim)
    return count


@register_pass
class WidenPeriodicArguments(Pass):
    name = "widen-periodic-arguments"
    description = "compute Sin/Cos arguments in float32 where a float16/bfloat16 source rounded them (Flux's t*1000)"
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})
    # Closer to float32 than the source, and apart from it by the source's own rounding (phases
    # off by radians): --verify compares with the source widened the same way.
    rebases_verification = True

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        graph.toposort()
        result = PassResult(modified=False)
        types = element_types(graph)
        rewrite = _Rewrite(graph, types)
        widened: dict[str, str] = {}
        for periodic, wide in cones_to_widen(graph, types):  # found before any rewrite
            result.sites_matched += 1
            site = f"argument of {periodic.op} '{node_label(periodic)}'"
            too_big = rewrite.too_big(wide)
            if too_big is not None:
                result.refuse(site, f"not widened: {too_big}; widening is for an embedding's small cone")
                continue
            for node in wide:
                low = next(LOW_TYPES[types[o.name]] for o in node.outputs if types.get(o.name) in LOW_TYPES)
                widened[node_label(node)] = f"{site}: computed in float32 where the source computed in {low}"
            rewrite.apply(wide)
            result.sites_rewritten += 1
        if result.sites_rewritten:
            rewrite.finish()
            result.modified = True
        result.details = {"widened": widened, "casts_inserted": rewrite.casts, "constants_widened": rewrite.constants}
        if not result.sites_matched:
            result.nothing_to_do = "no Sin/Cos argument is computed in float16/bfloat16"
        return result


def cones_to_widen(graph: gs.Graph, types: dict[str, int]) -> list[tuple[gs.Node, list[gs.Node]]]:
    """(Sin/Cos, the nodes of its argument's cone to widen) for every cone holding a rounding site
    in low precision; the nodes in graph order (``graph`` topologically sorted)."""
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    out = []
    for periodic, cone in periodic_cones(graph, data_dependent(graph)):
        if cone is not None:
            wide = _widening(sorted([periodic, *cone], key=lambda n: order[id(n)]), types)
            if wide:
                out.append((periodic, wide))
    return out


def _widening(nodes: list[gs.Node], types: dict[str, int]) -> list[gs.Node]:
    """Of a cone's nodes (in graph order): the rounding sites computing in low precision and the
    low-precision nodes after them."""
    wide: list[gs.Node] = []
    widened_outputs: set[int] = set()
    for node in nodes:
        if not any(types.get(o.name) in LOW_TYPES for o in node.outputs):
            continue
        if _rounds(node, types) or any(id(t) in widened_outputs for t in node.inputs):
            wide.append(node)
            widened_outputs.update(id(o) for o in node.outputs)
    return wide


def _rounds(node: gs.Node, types: dict[str, int]) -> bool:
    if node.op == "Cast":
        return int(node.attrs["to"]) in LOW_TYPES and types.get(node.inputs[0].name) != int(node.attrs["to"])
    return node.op in ROUNDING_OPS


class _Rewrite:
    def __init__(self, graph: gs.Graph, types: dict[str, int]):
        self.graph, self.types = graph, types
        self.graph_outputs = {id(t) for t in graph.outputs}
        self.names = NameAuthority(graph)
        self.upcasts: dict[int, gs.Tensor] = {}  # id(low tensor from outside) -> its float32 version
        self.casts = 0
        self.constants = 0

    def low(self, t: gs.Tensor) -> bool:
        return bool(t.name) and self.types.get(t.name) in LOW_TYPES

    def too_big(self, wide: list[gs.Node]) -> str | None:
        for node in wide:
            for t in (*node.inputs, *node.outputs):
                if not self.low(t):
                    continue
                n = per_sample(t.shape)
                if n is None:
                    return f"'{t.name}' has shape {t.shape}, not known to be small per sample"
                if n > SMALL_PER_SAMPLE:
                    return f"'{t.name}' of shape {t.shape} holds {n} values per sample (more than {SMALL_PER_SAMPLE})"
        return None

    def apply(self, wide: list[gs.Node]) -> None:
        inside = {id(n) for n in wide}
        renamed: dict[int, gs.Tensor] = {}  # id(low output) -> its float32 replacement
        for node in wide:
            for k, t in enumerate(node.inputs):
                if id(t) in renamed:
                    node.inputs[k] = renamed[id(t)]
                elif self.low(t) and not (node.op == "Cast" and k == 0):
                    node.inputs[k] = self.upcast(t)
            if node.op == "Cast":
                node.attrs["to"] = _T.FLOAT
            for o in list(node.outputs):
                if not self.low(o):
                    continue
                wide_o = gs.Variable(self.names(f"{o.name}__float32"), dtype=np.float32, shape=o.shape)
                self.types[wide_o.name] = _T.FLOAT
                replace_output(node, o, wide_o)
                renamed[id(o)] = wide_o
                self.hand_back(o, wide_o, inside)

    def hand_back(self, low: gs.Tensor, wide: gs.Variable, inside: set[int]) -> None:
        """Readers outside the widened nodes: a Cast(to=FLOAT) is bypassed, others read ``low``,
        now cast back from ``wide``."""
        for reader in list(low.outputs):
            if id(reader) not in inside and reader.op == "Cast" and int(reader.attrs["to"]) == _T.FLOAT:
                if id(reader.outputs[0]) not in self.graph_outputs:
                    redirect_consumers(reader.outputs[0], wide)  # the Cast is dead now: cleanup removes it
                reader.inputs[0] = wide
        if any(id(r) not in inside for r in low.outputs) or id(low) in self.graph_outputs:
            make = Emit(self.graph, self.names, low.name)
            make.op.Cast(wide, to=self.types[low.name], _outputs=[low])
            make.into(self.graph)
            self.casts += 1

    def upcast(self, t: gs.Tensor) -> gs.Tensor:
        """``t`` in float32: a converted constant, or one shared Cast of it."""
        if id(t) not in self.upcasts:
            values = self.constant_values(t)
            if values is not None:
                self.upcasts[id(t)] = gs.Constant(self.names(f"{t.name}__float32"), values)
                self.constants += 1
            else:
                make = Emit(self.graph, self.names, t.name)
                y = make.variable(f"{t.name}__float32", np.float32, t.shape)
                make.op.Cast(t, to=_T.FLOAT, _outputs=[y])
                make.into(self.graph)
                self.types[y.name] = _T.FLOAT
                self.upcasts[id(t)] = y
                self.casts += 1
        return self.upcasts[id(t)]

    def constant_values(self, t: gs.Tensor) -> np.ndarray | None:
        """A small constant's values in float32 (exact: float32 holds every float16/bfloat16)."""
        if isinstance(t, gs.Constant):
            source = stored_values(t)
        elif len(t.inputs) == 1 and t.inputs[0].op == "Constant" and isinstance(t.inputs[0].attrs.get("value"), gs.Constant):
            source = stored_values(t.inputs[0].attrs["value"])
        else:
            return None
        return np.asarray(read_uncached(source), dtype=np.float32)

    def finish(self) -> None:
        self.graph.cleanup(remove_unused_graph_inputs=False)
        self.graph.toposort()
