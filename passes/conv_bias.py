"""fold-conv-bias: a channels-last convolution's bias moves into the fused op that reads its output.

ONNX Runtime's NhwcConv adds its bias in a cuDNN kernel of its own (``op_generic_tensor_kernel``,
a launch per conv: benchmarks/results/layout-choices.md), and a pointwise conv written as
MatMul (``nhwc-conv pointwise=matmul``) in an Add of its own. Most of these outputs go straight into
an op that takes a per-channel bias anyway::

    NhwcConv(x, W, b) ─ y ─ SkipGroupNorm(y, γ, β, skip[, c])     (input or skip: conv1 + time
        ==>                                                         embedding, conv2 + residual)
    NhwcConv(x, W) ─ y' ─ SkipGroupNorm(y', γ, β, skip, c + b)

    NhwcConv(x, W, b) ─ y ─ Add(y, r) ─ z                         (the residual sum in front of a
        ==>                                                         Concat, Resize or Conv)
    NhwcConv(x, W) ─ y' ─ Reshape(N, HW, C) ─ BiasAdd(·, b [+ b_r], r' (N, HW, C)) ─ Reshape(Shape(y')) ─ z

where, in the second form, r' is r reshaped the same way and, when r is itself the output of a
biased NhwcConv read only by this Add (a resnet's conv_shortcut), its bias joins b.

Why it is the same computation: SkipGroupNorm normalizes X + skip + bias and returns that sum as its
S output, so adding b to its bias adds it exactly where the conv did; BiasAdd computes
X + bias + skip. Reshapes to (N, H·W, C) keep the element order of channels-last data.

Conditions: y (and r, when its bias moves) is read by that one node only; the bias is a 1-D
constant of C values; in the Add form both operands are 4-D with no provable shape difference
(BiasAdd fails loudly, it cannot broadcast) and float32/float16.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.domains import MS_DOMAIN
from onnxopt.fusion import Emit, NameAuthority
from onnxopt.graph_edit import detach, is_absent, replace_output, set_input
from onnxopt.model import Model
from onnxopt.pass_infra import OrtFusion, PassResult
from onnxopt.pattern import constant_value, is_constant
from onnxopt.pattern.tensor_facts import dims_conflict, rank_of, shape_of
from onnxopt.registry import register_pass
from onnxopt.weights import numpy_dtype

KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


class BiasedProducer:
    """A channels-last producer whose per-channel bias can be taken off: NhwcConv(x, W, b), or the
    MatMul + Add(b) of a pointwise conv."""

    def __init__(self, node: gs.Node, bias: gs.Constant, add: gs.Node | None = None):
        self.node, self.bias, self.add = node, bias, add

    @property
    def output(self) -> gs.Tensor:
        return (self.add or self.node).outputs[0]

    def bias_values(self) -> np.ndarray:
        return np.asarray(constant_value(self.bias)).reshape(-1)

    def strip_bias(self) -> None:
        """The producer computes its output without the bias, into the same tensor."""
        if self.add is None:
            self.node.inputs.pop(2)
            return
        out, product = self.add.outputs[0], self.node.outputs[0]  # the MatMul now writes the tensor the Add wrote
        detach(self.add)
        replace_output(self.node, product, out)


def biased_producer(tensor: gs.Tensor) -> BiasedProducer | None:
    if len(tensor.inputs) != 1:
        return None
    node = tensor.inputs[0]
    if node.op == "NhwcConv" and node.domain == MS_DOMAIN and len(node.inputs) > 2 and _is_channel_bias(node.inputs[2]):
        return BiasedProducer(node, node.inputs[2])
    if node.op == "Add" and len(node.inputs) == 2:  # MatMul(x, W) + b from nhwc-conv pointwise=matmul
        for i, b in enumerate(node.inputs):
            other = node.inputs[1 - i]
            if _is_channel_bias(b) and len(other.inputs) == 1 and other.inputs[0].op == "MatMul" and len(other.outputs) == 1:
                return BiasedProducer(other.inputs[0], b, add=node)
    return None


def _is_channel_bias(t: gs.Tensor) -> bool:
    return is_constant(t) and t.shape is not None and len(t.shape) == 1


@register_pass
class FoldConvBias(OrtFusion):
    name = "fold-conv-bias"
    description = "move a channels-last conv's bias into the SkipGroupNorm or residual BiasAdd that reads it (saves cuDNN's bias kernel)"

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        result = PassResult(modified=False)
        names = NameAuthority(graph)
        counts = {"into SkipGroupNorm": 0, "into BiasAdd": 0, "shortcut biases joined": 0}
        for node in list(graph.nodes):
            if node.op not in ("NhwcConv", "Add"):  # the conv itself, or the bias Add after a pointwise MatMul
                continue
            producer = biased_producer(node.outputs[0]) if node.outputs else None
            if producer is None or producer.output is not node.outputs[0]:
                continue
            y = producer.output
            readers = y.outputs
            if len(readers) != 1 or y in graph.outputs:
                continue
            reader = readers[0]
            if reader.op == "SkipGroupNorm" and reader.domain == MS_DOMAIN:
                result.sites_matched += 1
                _into_skip_group_norm(Emit(graph, names, reader.name), reader, producer)
                counts["into SkipGroupNorm"] += 1
                result.sites_rewritten += 1
            elif reader.op == "Add" and reader.domain in ("", None) and len(reader.inputs) == 2 and reader.inputs[0] is not reader.inputs[1]:
                result.sites_matched += 1
                reason = _bias_add_refusal(y, reader)
                if reason:
                    result.refuse(reader.name, reason)
                    continue
                joined = _into_bias_add(Emit(graph, names, reader.name or reader.outputs[0].name), reader, producer)
                counts["into BiasAdd"] += 1
                counts["shortcut biases joined"] += joined
                result.sites_rewritten += 1
        result.details = {k: v for k, v in counts.items() if v}
        if result.sites_rewritten:
            result.modified = True
            graph.cleanup(remove_unused_graph_inputs=False).toposort()
        return result


def _into_skip_group_norm(make: Emit, sgn: gs.Node, producer: BiasedProducer) -> None:
    """SkipGroupNorm(y, γ, β, skip[, c]) -> SkipGroupNorm(y', γ, β, skip, c + b)."""
    bias = producer.bias_values()
    if len(sgn.inputs) > 4 and not is_absent(sgn.inputs[4]):
        bias = bias + np.asarray(constant_value(sgn.inputs[4])).reshape(-1).astype(bias.dtype)
    set_input(sgn, 4, make.constant("bias", bias))
    producer.strip_bias()


def _bias_add_refusal(y: gs.Tensor, add: gs.Node) -> str | None:
    r = add.inputs[1] if add.inputs[0] is y else add.inputs[0]
    if is_constant(r):
        return "the other operand is a constant"
    if rank_of(y) != 4 or rank_of(r) != 4:
        return f"operands of shapes {shape_of(y)} and {shape_of(r)}; the NHWC residual form is 4-D"
    if any(dims_conflict(a, b) for a, b in zip(shape_of(y), shape_of(r))):
        return f"{shape_of(y)} + {shape_of(r)} broadcasts; BiasAdd needs operands of one shape"
    if y.dtype is not None and numpy_dtype(y.dtype) not in KERNEL_DTYPES:
        return f"dtype {numpy_dtype(y.dtype)}; the CUDA kernel takes float32 and float16"
    return None


def _into_bias_add(make: Emit, add: gs.Node, producer: BiasedProducer) -> int:
    """Replace ``add`` by Reshape/BiasAdd/Reshape; returns 1 when the residual's own bias joined."""
    graph = make.graph
    y = producer.output
    r = add.inputs[1] if add.inputs[0] is y else add.inputs[0]
    bias = producer.bias_values()
    joined = 0
    other = biased_producer(r)
    if other is not None and other.output is r and len(r.outputs) == 1 and r not in graph.outputs:
        bias = bias + other.bias_values().astype(bias.dtype)
        other.strip_bias()
        joined = 1
    producer.strip_bias()
    z = add.outputs[0]
    to_3d = make.constant("to_nsc", np.array([0, -1, int(bias.shape[0])], np.int64))
    y3 = make.op.Reshape(y, to_3d, _label="x_to_nsc", _shape=_nsc(y.shape))
    r3 = make.op.Reshape(r, to_3d, _label="skip_to_nsc", _shape=_nsc(r.shape))
    z3 = make.ms.BiasAdd(y3, make.constant("conv_bias", bias), r3, _dtype=z.dtype, _shape=_nsc(z.shape))
    shape = make.op.Shape(y, _dtype=np.int64, _shape=[4])
    detach(add)
    make.op.Reshape(z3, shape, _label="to_nhwc", _outputs=[z])
    make.into(graph)
    return joined


def _nsc(shape):
    if shape is None or len(shape) != 4:
        return None
    n, h, w, c = shape
    hw = h * w if isinstance(h, int) and isinstance(w, int) else None
    return [n, hw, c]



__all__ = ["FoldConvBias", "biased_producer"]
