"""fp16: run the graph in float16 (or bfloat16), with forced-float32 nodes, valid by construction.

    x:f32 ─ Conv(W) ─ GroupNorm(γ, β) ─ Add(mask) ─ Softmax ─ Resize(scales) ─ y:f32
        ==>   (keep_io_types=True)
    x:f32 ─ Cast(f16) ─ Conv(W:f16) ─ GroupNorm(γ, β: f32) ─ Add(mask: f16, -inf → -32752) ─ Softmax
          ─ Resize(scales: f32) ─ Cast(f32) ─ y:f32

    a node kept float32 (fp32_ops, fp32_nodes, a hazard, fp32_auto):
    ─ A:f16 ─ Cast(f32) ─ K:f32 ─ Reshape:f32 ─ K2:f32 ─ Cast(f16) ─ B:f16      (no Cast pair between K and K2)

How types are chosen (per input, from the operator schemas, :mod:`onnxopt.precision`):

* Every node input/output is bound to a type parameter of its op's schema (``onnx.defs`` for
  ai.onnx, ONNX Runtime's registry for com.microsoft). A parameter runs in low precision when its
  constraint allows it and it carries data to an output. Inputs of a fixed type
  (``Resize.scales: tensor(float)``) and parameters whose constraint lacks float16
  (``Range``, bfloat16 ``Conv``) stay float32. A parameter bound only to inputs (``GroupNorm`` γ/β
  ``M``, ``Resize`` roi ``T2``, ``Equal``'s operands) takes the type of the data-dependent tensors
  it is given, and float32 for constants: ORT's GroupNorm kernels take float32 γ/β with float16
  X, exactly as ONNX Runtime's own optimizer emits them. A parameter bound only to outputs
  (``LayerNormalization``/``SkipLayerNormalization`` mean and inv_std ``U``) stays float32.
* Data-dependent tensors (those that depend on graph-input values) get their type going forward.
  Data movement (Reshape, Transpose, Concat, Where, ...) and no-op ``Cast(to=FLOAT)`` inherit it
  from their inputs, so a float32 region extends through them instead of bouncing through casts.
* Everything computed from constants and shapes only (shape arithmetic, masks built from
  ``Shape``, the TorchScript attention scale) takes the type its consumers ask for, going
  backward; float32 when any consumer needs float32 (a ``Cast`` to an integer type, a fixed
  float input), so shape arithmetic never rounds. Constants (initializers, ``Constant`` and
  ``ConstantOfShape`` values) and ``Cast(to=FLOAT)`` of non-float32 tensors are converted
  offline or retargeted; one wanted in both types gets a low-precision twin.
* A ``Cast(to=FLOAT)`` in a converted region becomes ``Cast(to=FLOAT16)`` (TorchScript's
  ``time_proj`` cast), and no-op casts and lossless chains are removed after it
  (``remove-redundant-casts``, which the pass manager runs right after fp16 as a step of its own).
* Casts are inserted once per tensor and type; a tensor cast down from float32 is read back by
  float32 consumers from its float32 original, never through a second Cast.

Which nodes stay float32, with the reason in ``details["fp32_nodes"]``: ``fp32_ops``,
``fp32_nodes``, nodes without a known schema or with subgraphs, ops ONNX Runtime has no kernel
of the low type for (``KERNEL_GAPS``: bfloat16 Resize), and the hazards of
:mod:`onnxopt.fp16_hazards` (out-of-range constants other than attention masks, which are clamped
to -32752 instead; vanishing epsilons; Sin/Cos arguments; in float16, the output projection of a
gated feed-forward and the residual stream after it (T5); with ``fp32_auto``, tensors that exceed the
range on calibration inputs, and optionally nodes whose own low-precision error exceeds
``sensitivity``).

Weights are never loaded for conversion: a converted initializer is a ``DerivedValues`` computed
when the model is saved (one tensor at a time); the range scan streams each weight in chunks.
The output is a strongly typed low-precision graph, the form TensorRT 11 reads as well (why, and
the measurements on the full-size UNet and on ONNX Runtime's CUDA EP: benchmarks/results/fp16-notes.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.logger import G_LOGGER

from onnxopt import precision
from onnxopt.fp16_hazards import (
    DATA_MOVEMENT_OPS,
    FLOAT_TYPES,
    calibrated_overflows,
    constant_hazards,
    constant_node_value,
    gated_ffn_outputs,
    node_label,
    periodic_arguments,
    uses,
)
from onnxopt.domains import MS_DOMAIN
from onnxopt.fusion import Emit, NameAuthority
from onnxopt.model import SKELETON_THRESHOLD_BYTES, Model
from onnxopt.pass_infra import CONSTANTS_FOLDED, SHAPES_INFERRED, Pass, PassResult
from onnxopt.precision import (
    FLOAT,
    LowPrecision,
    calibrate,
    calibration_feeds,
    data_dependent,
    domain_versions,
    element_types,
    signature,
    tensor_errors,
)
from onnxopt.registry import register_pass
from onnxopt.verify import BFLOAT16_TOLERANCE
from onnxopt.weight_provenance import record
from onnxopt.weights import DerivedValues, constant_nbytes, read_uncached, store_values, stored_values
from onnxopt.passes.widen_periodic import cones_to_widen

LOW, F32, BOTH = "low", "float32", "both"

# Ops whose schema admits the low-precision type but for which ONNX Runtime 1.31.1 registers no
# kernel of that type on its CUDA or CPU EP: a session refuses the model ("Provider type for
# Resize node ... is not set", seen on an H100). With bfloat16 Resize kept float32, every fixture
# (raw and fused) runs on the CUDA EP. Applied unless ``kernel_gaps=False``.
KERNEL_GAPS = {
    "float16": {},
    "bfloat16": {"Resize": "ONNX Runtime has no bfloat16 Resize kernel (CUDA or CPU)"},
}


@register_pass
class Fp16Pass(Pass):
    name = "fp16"
    # --verify compares fp16 results with the fp32 source: half precision's rounding is expected.
    verify_tolerance = (2e-2, 2e-2)
    BFLOAT16_VERIFY_TOLERANCE = (BFLOAT16_TOLERANCE.atol, BFLOAT16_TOLERANCE.rtol)
    description = "float32 -> float16/bfloat16 with per-input schema typing, forced-fp32 nodes, safe masks, lazy weights"
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})

    def __init__(
        self,
        *,
        low_precision: str = "float16",
        fp32_ops=(),
        fp32_nodes=(),
        keep_io_types: bool = True,
        fp32_auto: bool = False,
        calibration=None,
        calibration_inputs=None,
        calibration_outputs_per_run: int | None = None,
        range_limit: float | None = None,
        sensitivity: float | None = None,
        fp32_periodic: bool = True,
        kernel_gaps: bool = True,
    ):
        """
        low_precision: "float16" or "bfloat16".
        fp32_ops / fp32_nodes: op types / node names that stay float32.
        keep_io_types: graph inputs and outputs stay float32 (Casts at the boundary).
        fp32_auto: calibrate the float32 model and keep float32 every node producing or consuming a
            tensor whose magnitude exceeds ``range_limit`` (default: the format's max, 65504).
        calibration: None (random inputs, ``calibration_inputs`` an onnxopt.verify.InputSpec for
            symbolic dims), a path to an .npz of inputs, a feed dict or a list of them.
        calibration_outputs_per_run: at most this many intermediate tensors per ORT calibration run
            (the model runs once per group; bounds memory on full-size models).
        sensitivity: with fp32_auto, also keep float32 the nodes whose output's relative L2 error
            in a trial conversion exceeds this and at least doubles their inputs' error.
        fp32_periodic: keep Sin/Cos and their argument's arithmetic float32 (hazard rule 3).
        kernel_gaps: keep float32 the ops ONNX Runtime has no low-precision kernel for (KERNEL_GAPS).
        """
        self.low = low_precision if isinstance(low_precision, LowPrecision) else precision.low_precision(low_precision)
        self.fp32_ops = frozenset(fp32_ops)
        self.fp32_nodes = frozenset(fp32_nodes)
        self.keep_io_types = keep_io_types
        self.fp32_auto = fp32_auto
        self.calibration = calibration
        self.calibration_inputs = calibration_inputs
        self.calibration_outputs_per_run = calibration_outputs_per_run
        self.range_limit = range_limit
        self.sensitivity = sensitivity
        self.fp32_periodic = fp32_periodic
        self.kernel_gaps = KERNEL_GAPS.get(self.low.name, {}) if kernel_gaps else {}
        if self.low.name == "bfloat16":
            self.verify_tolerance = self.BFLOAT16_VERIFY_TOLERANCE

    # ------------------------------------------------------------------ decisions

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        graph.toposort()
        result = PassResult(modified=False)
        nodes = list(graph.nodes)
        types = element_types(graph)

        def is_f32(t: gs.Tensor) -> bool:
            return bool(t.name) and types.get(t.name) == FLOAT

        kept: dict[int, tuple[str, str]] = {}  # node index -> (kind, reason)
        position = {id(n): i for i, n in enumerate(nodes)}

        def keep(node: gs.Node, kind: str, reason: str) -> None:
            i = position.get(id(node))
            if i is not None and i not in kept:
                kept[i] = (kind, reason)

        unknown = sorted(self.fp32_nodes - {n.name for n in nodes})
        for node in nodes:
            if node.op in self.fp32_ops:
                keep(node, "user", f"fp32_ops: {node.op}")
            elif node.name and node.name in self.fp32_nodes:
                keep(node, "user", "fp32_nodes")
        versions = domain_versions(graph)
        for node in nodes:
            reason = _structural_refusal(node, versions, is_f32)
            if reason:
                keep(node, "schema", reason)
            elif node.op in self.kernel_gaps and node.domain in ("", "ai.onnx", None):
                keep(node, "kernel", self.kernel_gaps[node.op])
            elif (reason := _contrib_kernel_gap(node, versions, is_f32, self.low)) is not None:
                keep(node, "kernel", reason)

        hazards = constant_hazards(graph, self.low, is_f32)
        for node, reason in hazards.fp32.values():
            keep(node, "constant", reason)
        dependent = data_dependent(graph)
        periodic_low = 0
        if self.fp32_periodic:
            for node, reason in periodic_arguments(graph, dependent).values():
                keep(node, "periodic", reason)
            periodic_low = len(cones_to_widen(graph, types))
        if self.low.name == "float16":  # bfloat16 has float32's exponent range
            for node, reason in gated_ffn_outputs(graph).values():
                keep(node, "gated-ffn", reason)
        calibration_info = None
        if self.fp32_auto:
            feeds = calibration_feeds(model, self.calibration, inputs=self.calibration_inputs)
            cal = calibrate(model, feeds, outputs_per_run=self.calibration_outputs_per_run)
            limit = self.range_limit if self.range_limit is not None else self.low.max
            for node, reason in calibrated_overflows(graph, cal.ranges, limit, self.low).values():
                keep(node, "calibration", reason)
            calibration_info = {"runner": cal.runner, "runs": cal.runs, "tensors": len(cal.ranges), "limit": limit}
            if self.sensitivity is not None:
                trial = model.copy()
                _Conversion(trial, self.low, dict(kept), set(hazards.masks), self.keep_io_types).apply()
                errors = tensor_errors(model, trial, feeds[:1])
                flagged = _sensitive_nodes(nodes, errors, self.sensitivity)
                for node, reason in flagged:
                    keep(node, "sensitivity", reason)
                calibration_info["sensitivity_flagged"] = len(flagged)

        conversion = _Conversion(model, self.low, kept, set(hazards.masks), self.keep_io_types)
        stats = conversion.apply()

        result.sites_matched = stats.candidates
        result.sites_rewritten = stats.nodes_low
        for i, (kind, reason) in sorted(kept.items()):
            if stats.had_float32[i]:
                result.refuse(node_label(nodes[i]), reason)
        result.modified = stats.changed
        result.details = {
            "low_precision": self.low.name,
            "keep_io_types": self.keep_io_types,
            "nodes_low_precision": stats.nodes_low,
            "nodes_float32": stats.candidates - stats.nodes_low,
            "fp32_nodes": {node_label(nodes[i]): reason for i, (kind, reason) in sorted(kept.items()) if stats.had_float32[i]},
            "fp32_by_kind": _count(kind for i, (kind, _) in kept.items() if stats.had_float32[i]),
            "casts_inserted": stats.casts_inserted,
            "casts_retargeted": stats.casts_retargeted,
            "constants_converted": stats.constants_converted,
            "constant_twins": stats.constant_twins,
            "masks_clamped": {name: hazards.masks[name] for name in sorted(stats.masks_clamped)},
            "mask_fill": self.low.mask_fill if stats.masks_clamped else None,
            "inactive_bounds": hazards.bounds,
            "constants_scanned": hazards.scanned,
        }
        if periodic_low:  # the source rounds them in low precision: widen-periodic-arguments follows
            result.details["periodic_arguments_in_low_precision"] = periodic_low
        if unknown:
            result.details["fp32_nodes_not_found"] = unknown
        if calibration_info:
            result.details["calibration"] = calibration_info
        return result

    possible_followers = frozenset({"widen-periodic-arguments", "remove-redundant-casts"})

    def followers(self, result: PassResult) -> list[str]:
        """widen-periodic-arguments where the source computes part of a Sin/Cos argument in low
        precision (rule 3 for a float16/bfloat16 source), then remove-redundant-casts after a run
        that changed types; the manager runs each as its own step."""
        widen = ["widen-periodic-arguments"] if result.details.get("periodic_arguments_in_low_precision") else []
        return widen + (["remove-redundant-casts"] if result.modified or widen else [])


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def _structural_refusal(node: gs.Node, versions: dict[str, int], is_f32) -> str | None:
    """Why a node with float32 tensors cannot be typed from its schema, if it cannot."""
    if not any(is_f32(t) for t in (*node.inputs, *node.outputs)):
        return None
    if any(isinstance(v, gs.Graph) for v in node.attrs.values()):
        return "has a subgraph (If/Loop/Scan bodies are not converted)"
    sig = signature(node, versions)
    if sig is None:
        return f"no schema known for {node.domain or 'ai.onnx'}::{node.op}"
    if sig.heterogeneous:
        return "heterogeneous variadic signature"
    if "dtype" in sig.attributes and node.op != "Cast":
        return "its output type is set by its 'dtype' attribute"
    return None


def _contrib_kernel_gap(node: gs.Node, versions: dict[str, int], is_f32, low: LowPrecision) -> str | None:
    """Why a fused com.microsoft op computes in float32: its data input's type admits no ``low``.
    ONNX Runtime 1.31's schemas and CUDA kernels agree on this for the ops the fusions write
    (GroupNorm, SkipGroupNorm, BiasSplitGelu, BiasAdd and NhwcConv take no bfloat16:
    docs/bf16-kernels.md); the typing would keep them float32 anyway, this says so in the report."""
    if node.domain != MS_DOMAIN or not node.inputs or not is_f32(node.inputs[0]):
        return None
    sig = signature(node, versions)
    param = sig.input_param(0) if sig is not None else None
    if param is None or sig.is_fixed(param) or sig.allows(param, low.type_str):
        return None
    return f"ONNX Runtime has no {low.name} kernel for com.microsoft {node.op} (it takes {', '.join(sorted(sig.allowed[param]))})"


def _sensitive_nodes(nodes: list[gs.Node], errors: dict[str, float], threshold: float) -> list[tuple[gs.Node, str]]:
    """Nodes whose low-precision output error exceeds ``threshold`` and at least doubles their inputs'.

    Such a node amplifies rounding (cancellation in ``(x + 1000) - 1000``, a large argument into
    ``Sin``): it is kept float32 *with the producers of its inputs*, so that it reads unrounded
    values; keeping it alone would only cast already-rounded inputs back up.
    """
    flagged = []
    for node in nodes:
        out = [errors[o.name] for o in node.outputs if o.name in errors]
        if not out:
            continue
        out_err = max(out)
        in_err = max((errors[t.name] for t in node.inputs if t.name in errors), default=0.0)
        if out_err > threshold and out_err > 2 * in_err:
            reason = f"sensitivity: '{node_label(node)}' output error {out_err:.3g} (inputs {in_err:.3g}) > {threshold:g}"
            flagged.append((node, reason))
            for t in node.inputs:
                if not isinstance(t, gs.Constant):
                    flagged.extend((producer, reason) for producer in t.inputs)
    return flagged


# ---------------------------------------------------------------------- conversion


@dataclass
class _Stats:
    candidates: int = 0
    nodes_low: int = 0
    casts_inserted: int = 0
    casts_retargeted: int = 0
    constants_converted: int = 0
    constant_twins: int = 0
    masks_clamped: set[str] = field(default_factory=set)
    changed: bool = False
    had_float32: dict[int, bool] = field(default_factory=dict)


class _Conversion:
    """Plans every float32 tensor's type (forward for data-dependent values, backward for the rest),
    then rewrites the graph: casts where a consumer wants the other type, converted constants,
    retargeted casts, boundary casts."""

    def __init__(self, model: Model, low: LowPrecision, kept: dict[int, tuple[str, str]], masks: set[str], keep_io_types: bool):
        self.model = model
        self.graph = model.graph  # topologically sorted by Fp16Pass.run (copies keep the order)
        self.nodes = list(self.graph.nodes)
        self.position = {id(n): i for i, n in enumerate(self.nodes)}
        self.low = low
        self.kept = kept
        self.masks = masks
        self.keep_io = keep_io_types
        self.versions = domain_versions(self.graph)
        self.types = element_types(self.graph, self.versions)
        self.dependent = data_dependent(self.graph)
        self.sigs = [signature(n, self.versions) for n in self.nodes]
        self.type: dict[str, str] = {}  # float32 tensor name -> LOW | F32 | BOTH
        self.demand: dict[tuple[int, int], str] = {}  # (node index, input index) -> LOW | F32
        self.graph_outputs = {id(t) for t in self.graph.outputs}
        self.names = NameAuthority(self.graph)  # the x__fp16 tensors and their Casts
        self.stats = _Stats()

    # ---------------------------------------------------------------- planning

    def is_f32(self, t: gs.Tensor) -> bool:
        return bool(t.name) and self.types.get(t.name) == FLOAT

    def is_source(self, node: gs.Node) -> bool:
        """Nodes whose float32 output can be produced in either type at no cost."""
        if not node.outputs or not self.is_f32(node.outputs[0]):
            return False
        if node.op in ("Constant", "ConstantOfShape") and node.domain in ("", "ai.onnx", None):
            return constant_node_value(node) is not None
        if node.op == "Cast":
            return not (node.inputs and self.is_f32(node.inputs[0]))
        return False

    def is_float_cast(self, node: gs.Node) -> bool:
        """Cast(to=FLOAT) of a float32 tensor: a no-op in the float32 graph."""
        return (node.op == "Cast" and int(node.attrs.get("to", 0)) == FLOAT and bool(node.inputs) and bool(node.outputs)
                and self.is_f32(node.inputs[0]))

    def source_can_be_low(self, i: int) -> bool:
        """Whether a source's schema lets its output be the low-precision type (ConstantOfShape-17: no bfloat16)."""
        node, sig = self.nodes[i], self.sigs[i]
        if node.op == "Constant":
            return True
        param = sig.output_param(0) if sig else None
        return param is not None and sig.allows(param, self.low.type_str)

    def plan(self) -> None:
        self.sources = [self.is_source(n) for n in self.nodes]
        for t in self.graph.inputs:
            if self.is_f32(t):
                self.type[t.name] = F32 if self.keep_io else LOW
        for i, node in enumerate(self.nodes):  # forward: data-dependent values
            if self.sources[i]:
                low_ok = i not in self.kept and self.source_can_be_low(i)
                self.type[node.outputs[0].name] = LOW if low_ok else F32  # provisional
            elif any(o.name in self.dependent for o in node.outputs):
                self.assign(i, node, F32 if i in self.kept else LOW, inherit=True)
        for i in reversed(range(len(self.nodes))):  # backward: constants, shapes, sources
            node = self.nodes[i]
            if self.sources[i]:
                out = node.outputs[0]
                low_ok = i not in self.kept and self.source_can_be_low(i)
                self.type[out.name] = self.resolve(self.demands(out), twin=True) if low_ok else F32
            elif self.is_float_cast(node):
                # Cast(to=FLOAT) carrying float32 (a float32 region's edge, the TorchScript time_proj
                # cast) into consumers that all want low precision: retarget it to do the cast.
                out = node.outputs[0]
                if i not in self.kept and self.type.get(out.name) == F32 and self.demands(out) == {LOW}:
                    self.type[out.name] = LOW
                elif out.name not in self.dependent:
                    self.assign(i, node, F32 if i in self.kept else self.resolve(self.demands(out), twin=False), inherit=False)
            elif not any(o.name in self.dependent for o in node.outputs):
                float_outputs = [o for o in node.outputs if self.is_f32(o)]
                if i in self.kept:
                    run_in = F32
                elif float_outputs:
                    run_in = self.resolve(set().union(*(self.demands(o) for o in float_outputs)), twin=False)
                else:
                    run_in = None  # Shape, comparisons: only parameters of inputs, typed by what they are given
                self.assign(i, node, run_in, inherit=False)
        for t in self.graph.tensors().values():
            if isinstance(t, gs.Constant) and self.is_f32(t):
                self.type[t.name] = self.resolve(self.demands(t), twin=True)

    @staticmethod
    def resolve(wanted: set[str], twin: bool) -> str:
        if wanted == {LOW}:
            return LOW
        if LOW in wanted and twin:
            return BOTH
        return F32

    def demands(self, t: gs.Tensor) -> set[str]:
        wanted = set()
        for node, k in uses(t):
            d = self.demand.get((self.position.get(id(node), -1), k))
            if d:
                wanted.add(d)
            elif node.op == "Cast" and int(node.attrs.get("to", 0)) not in FLOAT_TYPES and t.name not in self.dependent:
                wanted.add(F32)  # shape arithmetic going back to integers: no rounding
        if id(t) in self.graph_outputs:
            wanted.add(F32 if self.keep_io else LOW)
        return wanted

    def assign(self, i: int, node: gs.Node, run_in: str | None, inherit: bool) -> None:
        """Decide the types of node ``i``'s float32 slots when its data runs in ``run_in``."""
        if node.op == "Cast":
            x = node.inputs[0] if node.inputs else None
            if int(node.attrs.get("to", 0)) == FLOAT and x is not None and self.is_f32(x) and node.outputs:
                t = run_in or F32
                if run_in == LOW and inherit and x.name in self.dependent:
                    t = self.type.get(x.name, LOW)  # a no-op cast carries its input's type
                self.demand[(i, 0)] = t
                self.type[node.outputs[0].name] = t
            return
        sig = self.sigs[i]
        if sig is None:
            run_in = F32
        groups: dict[str | None, tuple[list[int], list[int]]] = {}
        for k, t in enumerate(node.inputs):
            if self.is_f32(t):
                groups.setdefault(sig.input_param(k) if sig else None, ([], []))[0].append(k)
        for k, t in enumerate(node.outputs):
            if self.is_f32(t):
                groups.setdefault(sig.output_param(k) if sig else None, ([], []))[1].append(k)
        movement = inherit and node.op in DATA_MOVEMENT_OPS and node.domain in ("", "ai.onnx", None)
        for param, (ins, outs) in groups.items():
            t = self.param_type(node, sig, param, ins, outs, run_in, movement)
            for k in ins:
                self.demand[(i, k)] = t
            for k in outs:
                self.type[node.outputs[k].name] = t

    def param_type(self, node, sig, param, ins, outs, run_in, movement) -> str:
        """The type of one type parameter's float32 slots; ``run_in`` None: the node has no preference."""
        if run_in == F32 or sig is None or param is None or sig.is_fixed(param):
            return F32
        if not sig.allows(param, self.low.type_str):
            return F32
        if not ins:
            return F32  # output-only parameter (normalization statistics): stays as declared
        given = [self.type.get(node.inputs[k].name, LOW) for k in ins if node.inputs[k].name in self.dependent]
        if not outs:  # parameter of inputs only: take what the data-dependent inputs are, float32 for constants
            return LOW if given and all(g == LOW for g in given) else F32
        if run_in is None:
            return F32
        if movement and given and all(g == F32 for g in given):
            return F32
        return LOW

    # ---------------------------------------------------------------- rewriting

    def write(self, prefix: str) -> Emit:
        """A builder for nodes named ``{prefix}/{Op}`` (a Cast after the tensor it computes)."""
        return Emit(self.graph, self.names, prefix)

    def apply(self) -> _Stats:
        self.plan()
        self.origin: dict[str, gs.Tensor] = {}
        self.casts: dict[tuple[str, str], gs.Tensor] = {}
        self.twins: dict[str, gs.Tensor] = {}
        stats = self.stats
        for i, node in enumerate(self.nodes):
            slots = [t for t in (*node.inputs, *node.outputs) if self.is_f32(t)]
            stats.had_float32[i] = bool(slots)
            if not slots or node.op in ("Constant",):
                continue
            stats.candidates += 1
            if any(self.demand.get((i, k)) == LOW for k in range(len(node.inputs))) or any(
                self.type.get(o.name) in (LOW, BOTH) for o in node.outputs if self.is_f32(o)
            ):
                stats.nodes_low += 1
        if stats.nodes_low == 0 and all(self.type.get(t.name) != LOW for t in self.graph.tensors().values()):
            return stats
        stats.changed = True
        # 1. every consumer gets its tensor in the type it wants
        for i, node in enumerate(self.nodes):
            for k, t in enumerate(list(node.inputs)):
                want = self.demand.get((i, k))
                if want is None or not self.is_f32(t):
                    continue
                node.inputs[k] = self.version(t, want)
        # 2. types of what stays where it is
        for name, t in list(self.graph.tensors().items()):
            if not self.is_f32(t):
                continue
            kind = self.type.get(name)
            if kind != LOW:
                if isinstance(t, gs.Variable) and t.dtype is None:
                    t.dtype = np.dtype(np.float32)
                if isinstance(t, gs.Constant) and name in self.masks:
                    self.clamp_float32_mask(t)
                continue
            if isinstance(t, gs.Constant):
                store_values(t, self.low_values(t, t.name))
                t.export_dtype = None  # Model.copy pins the original dtype as the export dtype
                self.stats.constants_converted += 1
            else:
                t.dtype = self.low.np_dtype
        for i, node in enumerate(self.nodes):
            if self.sources[i]:
                if self.type.get(node.outputs[0].name) == LOW:
                    self.retype_source(node, node)
                elif node.outputs[0].name in self.masks and node.op != "Cast":
                    self.clamp_float32_mask(node)
            elif node.op == "Cast" and node.outputs and self.type.get(node.outputs[0].name) == LOW:
                node.attrs["to"] = self.low.onnx_type
                node.outputs[0].dtype = self.low.np_dtype
                self.stats.casts_retargeted += 1
        # 3. the graph's outputs
        for k, out in enumerate(list(self.graph.outputs)):
            kind = self.type.get(out.name)
            if kind is None or isinstance(out, gs.Constant) or any(out is t for t in self.graph.inputs):
                continue
            want = F32 if self.keep_io else LOW
            have = F32 if kind in (F32, BOTH) else LOW
            if have == want:
                continue
            final = self.write(out.name).variable(out.name, self._np(want), out.shape, exact=True)
            out.name = self.names(f"{out.name}__{self.low.name if have == LOW else 'float32'}")
            self._cast(out, final, want)
            self.graph.outputs[k] = final
        self.graph.cleanup(remove_unused_graph_inputs=False)
        self.graph.toposort()
        return stats

    def _np(self, kind: str):
        return self.low.np_dtype if kind == LOW else np.dtype(np.float32)

    def _cast(self, x: gs.Tensor, y: gs.Tensor, to: str) -> None:
        """Append ``y = Cast(x)`` (node ``{y}/Cast``) to the graph."""
        self.stats.casts_inserted += 1
        make = self.write(y.name)
        make.op.Cast(x, to=self.low.onnx_type if to == LOW else FLOAT, _outputs=[y])
        make.into(self.graph)

    def version(self, t: gs.Tensor, want: str) -> gs.Tensor:
        """``t`` in type ``want``: itself, its twin, its float32 original, or a (shared) Cast of it."""
        have = self.type.get(t.name, F32)
        if have == want:
            return t
        if have == BOTH:
            return t if want == F32 else self.twin(t)
        if want == F32 and t.name in self.origin:
            return self.origin[t.name]
        key = (t.name, want)
        if key not in self.casts:
            suffix = self.low.name if want == LOW else "float32"
            y = self.write(t.name).variable(f"{t.name}__{suffix}", self._np(want), t.shape)
            self._cast(t, y, want)
            self.type[y.name] = want
            self.casts[key] = y
            if want == LOW:
                self.origin[y.name] = t
        return self.casts[key]

    def twin(self, t: gs.Tensor) -> gs.Tensor:
        """The low-precision copy of a constant or source output wanted in both types."""
        if t.name in self.twins:
            return self.twins[t.name]
        name = self.names(f"{t.name}__{self.low.name}")
        if isinstance(t, gs.Constant):
            twin = gs.Constant(name, self.low_values(t, name))
            self.stats.constants_converted += 1
        else:
            source = t.inputs[0]
            make = self.write(t.name)
            twin = make.variable(name, self.low.np_dtype, t.shape, exact=True)
            clone_name = self.names(f"{source.name or t.name}__{self.low.name}")
            make.node(source.op, list(source.inputs), None, None, outputs=[twin], domain=source.domain,
                      name=clone_name, **dict(source.attrs))
            self.retype_source(source, make.nodes[-1])
            make.into(self.graph)
        self.stats.constant_twins += 1
        self.type[name] = LOW
        self.twins[t.name] = twin
        return twin

    def retype_source(self, original: gs.Node, node: gs.Node) -> None:
        """Make a Constant / ConstantOfShape / Cast node produce the low-precision type."""
        label = original.outputs[0].name
        if node.op == "Cast":
            node.attrs["to"] = self.low.onnx_type
            self.stats.casts_retargeted += 1
        else:
            value = constant_node_value(original)
            array = read_uncached(value)
            for key in ("value_float", "value_floats"):
                node.attrs.pop(key, None)
            node.attrs["value"] = gs.Constant(f"{label}__value", self.low.convert(array, mask=label in self.masks))
            if label in self.masks:
                self.stats.masks_clamped.add(label)
            self.stats.constants_converted += 1
        node.outputs[0].dtype = self.low.np_dtype

    def clamp_float32_mask(self, where: gs.Constant | gs.Node) -> None:
        """A mask that (also) stays float32 gets the same finite fill: whatever is cast from it to
        low precision later (a mask computed in float32 for a float32 consumer and cast for a
        low-precision one) stays finite. The float32 softmax is unchanged (exp(-32752) is 0)."""
        fill = self.low.mask_fill

        def clamp(array):
            return np.asarray(np.maximum(array, np.float32(fill)), dtype=np.float32)  # an array also when 0-d

        if isinstance(where, gs.Constant):
            source = stored_values(where)
            if constant_nbytes(where) < SKELETON_THRESHOLD_BYTES:
                store_values(where, clamp(read_uncached(source)))
            else:
                store_values(where, DerivedValues(where.shape, np.float32, lambda: clamp(read_uncached(source)), name=where.name))
            self.stats.masks_clamped.add(where.name)
        else:
            value = constant_node_value(where)
            array = read_uncached(value)
            for key in ("value_float", "value_floats"):
                where.attrs.pop(key, None)
            where.attrs["value"] = gs.Constant(f"{where.outputs[0].name}__value", clamp(array))
            self.stats.masks_clamped.add(where.outputs[0].name)

    def low_values(self, constant: gs.Constant, name: str):
        """The constant in low precision: computed now when small, else when read or saved."""
        source = stored_values(constant)
        low, mask = self.low, constant.name in self.masks
        if mask:
            self.stats.masks_clamped.add(constant.name)
        # Small results are computed now: the saver writes tensors under the skeleton threshold
        # from the skeleton itself, where a DerivedValues would be exported without its data.
        if int(np.prod(constant.shape, dtype=np.int64)) * low.np_dtype.itemsize < SKELETON_THRESHOLD_BYTES:
            return record(low.convert(read_uncached(source), mask), [(source, [])])  # a cast: same layout
        with _graphsurgeon_quiet():  # graphsurgeon has no NumPy name for bfloat16 and says so per tensor
            values = DerivedValues(constant.shape, low.np_dtype, lambda: low.convert(read_uncached(source), mask), name=name)
        return record(values, [(source, [])])


@contextlib.contextmanager
def _graphsurgeon_quiet():
    severity = G_LOGGER.severity
    G_LOGGER.severity = max(severity, G_LOGGER.ERROR)  # never louder than the caller asked
    try:
        yield
    finally:
        G_LOGGER.severity = severity


