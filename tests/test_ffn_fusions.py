"""Claims about the feed-forward / norm fusions: fuse-bias-split-gelu (with slices-to-split),
fuse-bias-add, fuse-layer-norm and fuse-skip-layer-norm.

On real tiny exports (``@pytest.mark.models``), after ``cleanup``:
* every diffusers GEGLU becomes one BiasSplitGelu;
* every Transformer2DModel gets one BiasAdd: the feed-forward residual Add of its *last*
  BasicTransformerBlock (every other Linear + residual Add in a transformer feeds a LayerNorm and
  becomes a SkipLayerNormalization with bias instead);
* every nn.LayerNorm is a LayerNormalization or a SkipLayerNormalization; only the first norm1
  of each Transformer2DModel (after proj_in, no residual) stays a LayerNormalization in UNets, and
  none does in the CLIP text encoders;
* the fused graph computes what the source does.
The tiny models' GEGLU hidden sizes are not ones ORT's CUDA BiasSplitGelu kernel takes, so those
tests turn its kernel-size check off (the NumPy reference kernels take any size); a separate test
shows that by default the same sites are matched and refused with the kernel's reason.

Hand-built graphs cover the exact kernel sizes and the lookalikes that must not fuse.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import load_model, optimize
from onnxopt.passes.bias_split_gelu import FuseBiasSplitGelu
from onnxopt.verify import assert_same_computation
from tests.conftest import EXPORT_VARIANTS, export_cases, op_counts

RNG = np.random.default_rng(7)


def ffn_passes(check_kernel_sizes: bool = True) -> list:
    return ["fuse-layer-norm", "fuse-skip-layer-norm", FuseBiasSplitGelu(check_kernel_sizes=check_kernel_sizes), "fuse-bias-add"]


def results(report) -> dict:
    """PassResult by pass name (auto-inserted passes included)."""
    return {p.name: p.result for p in report.passes}


# ================================================================ real exports

GEGLU_FAMILIES = ["unet-sd15", "unet-sd21", "unet-sdxl", "controlnet"]
TEXT_FAMILIES = ["clip-text", "openclip-text"]
TORCHSCRIPT_DYNAMIC = ("torchscript", "dynamic", "sdpa")
EVERY_EXPORTER_AND_SHAPES = [v for v in EXPORT_VARIANTS if v[2] == "sdpa"]  # attention does not touch the FFN


def _variants(families, always: dict[str, list]) -> list:
    """Every family x EXPORT_VARIANTS; those outside ``always`` are marked slow."""
    return export_cases(families, lambda family, variant: variant in always.get(family, [TORCHSCRIPT_DYNAMIC]))


GEGLU_CASES = _variants(GEGLU_FAMILIES, {"unet-sd15": EVERY_EXPORTER_AND_SHAPES})
TEXT_CASES = _variants(TEXT_FAMILIES, {"clip-text": EVERY_EXPORTER_AND_SHAPES})

_FUSED: dict[tuple, tuple] = {}


def fused(export_tiny, family: str, variant: tuple, check_kernel_sizes: bool = False):
    """(exported, cleaned-up source, fused model, report); computed once per module run."""
    key = (family, variant, check_kernel_sizes)
    if key not in _FUSED:
        exported = export_tiny(family, *variant)
        source, _ = optimize(exported.path, ["cleanup"])
        model, report = optimize(source, ffn_passes(check_kernel_sizes))
        _FUSED[key] = (exported, source, model, report)
    return _FUSED[key]


def transformer_models(built) -> int:
    """Transformer2DModels in the torch model: each ends in one feed-forward residual Add that no
    LayerNorm reads (the BiasAdd site); each starts with one norm1 that reads no residual Add."""
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    return sum(isinstance(m, Transformer2DModel) for m in built.module.modules())


def geglu_hidden_sizes(built) -> set[int]:
    """D of every GEGLU: its Linear's output features (both halves)."""
    from diffusers.models.activations import GEGLU

    return {m.proj.out_features for m in built.module.modules() if isinstance(m, GEGLU)}


@pytest.mark.parametrize("family, variant", GEGLU_CASES)
def test_unet_feed_forwards_and_norms_fuse_exactly_once_per_torch_module(export_tiny, family, variant):
    exported, _, model, report = fused(export_tiny, family, variant)
    sites, ops = exported.sites, op_counts(model)
    n_transformers = transformer_models(exported.built)
    assert sites["geglu"] > 0 and n_transformers > 0

    assert ops["BiasSplitGelu"] == sites["geglu"]
    assert ops["BiasAdd"] == n_transformers
    assert ops["LayerNormalization"] + ops["SkipLayerNormalization"] == sites["layer_norm"]
    assert ops["LayerNormalization"] == n_transformers  # each transformer's first norm1
    assert ops["Erf"] == ops["Gelu"] == 0  # every GELU of the model was a GEGLU's
    by_pass = results(report)
    assert by_pass["fuse-skip-layer-norm"].details["bias_folded"] == ops["SkipLayerNormalization"]  # to_out, ff biases
    assert by_pass["fuse-bias-split-gelu"].sites_matched == by_pass["fuse-bias-split-gelu"].sites_rewritten == sites["geglu"]
    assert by_pass["fuse-bias-add"].sites_rewritten == by_pass["fuse-bias-add"].sites_matched == n_transformers


@pytest.mark.parametrize("family, variant", GEGLU_CASES)
def test_fused_unet_computes_what_the_export_computes(export_tiny, family, variant):
    exported, source, model, _ = fused(export_tiny, family, variant)
    assert_same_computation(source, model, atol=1e-4, rtol=1e-3, inputs=exported.input_spec())


@pytest.mark.parametrize("family, variant", TEXT_CASES)
def test_every_text_encoder_layer_norm_reads_its_residual_add_and_fuses(export_tiny, family, variant):
    exported, source, model, report = fused(export_tiny, family, variant)
    ops = op_counts(model)
    n_layers = exported.sites["transformer_block"]

    assert ops["SkipLayerNormalization"] == exported.sites["layer_norm"]  # embeddings, then every residual Add
    assert ops["LayerNormalization"] == 0
    assert ops["BiasSplitGelu"] == ops["BiasAdd"] == 0
    skip = results(report)["fuse-skip-layer-norm"]
    assert skip.details["bias_folded"] == 2 * n_layers  # attention out_proj and fc2 biases
    assert_same_computation(source, model, atol=1e-4, rtol=1e-3, inputs=exported.input_spec())


@pytest.mark.models
def test_by_default_tiny_geglu_hidden_sizes_are_refused_with_the_cuda_kernels_reason(export_tiny):
    exported, _, model, report = fused(export_tiny, "unet-sd15", TORCHSCRIPT_DYNAMIC, check_kernel_sizes=True)
    split_gelu = results(report)["fuse-bias-split-gelu"]

    assert split_gelu.sites_matched == exported.sites["geglu"] and split_gelu.sites_rewritten == 0
    assert {reason for _, reason in split_gelu.refused} == {
        f"hidden size {d} is not one ORT's CUDA kernel implements (2560, 5120, 6144, 10240, 12288)"
        for d in geglu_hidden_sizes(exported.built)
    }
    n_transformers = transformer_models(exported.built)
    assert op_counts(model)["BiasAdd"] == n_transformers  # BiasAdd takes any channel count
    assert op_counts(model)["SkipLayerNormalization"] == exported.sites["layer_norm"] - n_transformers


# ================================================================ hand-built graphs


class Net:
    """Builds a small ONNX model op by op: ``h = net.op("Add", x, net.const(b))``; names are generated."""

    def __init__(self, opset: int = 17):
        self.opset, self.nodes, self.inputs, self.initializers = opset, [], [], []
        self._n = 0

    def _name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def input(self, name: str, shape, dtype=TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def const(self, value, dtype=np.float32) -> str:
        name = self._name("c")
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def ints(self, *values) -> str:
        return self.const(list(values), np.int64)

    def op(self, op_type: str, *inputs, outputs: int = 1, domain: str = "", **attrs):
        names = [self._name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=self._name(op_type), domain=domain, **attrs))
        return names[0] if outputs == 1 else names

    def model(self, *outputs: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "g", self.inputs,
                                  [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 8
        return model


def weights(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32) * 0.3


def erf_gelu(net: Net, g: str) -> str:
    """GELU as the TorchScript exporter writes it."""
    erf = net.op("Erf", net.op("Div", g, net.const(math.sqrt(2.0))))
    return net.op("Mul", net.op("Mul", g, net.op("Add", erf, net.const(1.0))), net.const(0.5))


def geglu_net(d: int = 2560, *, gate: str = "right", chunk: str = "split", split_sizes=None, opset: int = 17,
              weight_input: bool = False):
    """x (2, 5, 8) @ W (8, d) + b, cut in two along the last axis, one part gating the other.

    chunk: "split" (dynamo's Split), "slices" (TorchScript's two Slices with Shape-derived bounds) or
    "constant-slices" (bounds given by ``split_sizes``).
    """
    net = Net(opset)
    x = net.input("x", [2, 5, 8])
    w = net.input("w", [8, d]) if weight_input else net.const(weights(8, d))
    h = net.op("Add", net.op("MatMul", x, w), net.const(weights(d)))
    sizes = split_sizes or [d // 2, d - d // 2]
    if chunk == "split":
        first, second = net.op("Split", h, net.ints(*sizes), axis=-1, outputs=2)
    elif chunk == "slices":  # chunk size = (d + 1) // 2, computed from Shape(h) at run time
        half = net.op("Div", net.op("Add", net.op("Gather", net.op("Shape", h), net.ints(-1)), net.ints(1)), net.ints(2))
        end0, end1 = net.op("Mul", half, net.ints(1)), net.op("Mul", half, net.ints(2))
        first = net.op("Slice", h, net.ints(0), end0, net.ints(-1))
        second = net.op("Slice", h, end0, end1, net.ints(-1))
    else:
        first = net.op("Slice", h, net.ints(0), net.ints(sizes[0]), net.ints(-1))
        second = net.op("Slice", h, net.ints(sizes[0]), net.ints(sizes[0] + sizes[1]), net.ints(-1))
    gated, gate_input = (first, second) if gate == "right" else (second, first)
    out = net.op("Mul", gated, erf_gelu(net, gate_input))
    return net.model(out)


def fuse(proto, *passes):
    model, report = optimize(proto, list(passes))
    return model, results(report)


@pytest.mark.parametrize("chunk", ["split", "slices"])
def test_a_geglu_of_a_cuda_hidden_size_becomes_bias_split_gelu(chunk):
    proto = geglu_net(2560, chunk=chunk)
    model, by_pass = fuse(proto, "fuse-bias-split-gelu")
    assert by_pass["fuse-bias-split-gelu"].sites_rewritten == 1
    assert [n.op for n in model.graph.nodes] == ["MatMul", "BiasSplitGelu"]
    assert_same_computation(proto, model, atol=1e-4, rtol=1e-3)


def test_the_dynamo_form_split_with_num_outputs_and_gelu_op_fuses():
    net = Net(opset=20)
    x = net.input("x", [2, 5, 8])
    h = net.op("Add", net.op("MatMul", x, net.const(weights(8, 5120))), net.const(weights(5120)))
    a, g = net.op("Split", h, axis=2, num_outputs=2, outputs=2)
    proto = net.model(net.op("Mul", a, net.op("Gelu", g, approximate="none")))
    model, by_pass = fuse(proto, "fuse-bias-split-gelu")
    assert op_counts(model) == Counter({"MatMul": 1, "BiasSplitGelu": 1})
    assert_same_computation(proto, model, atol=1e-4, rtol=1e-3)


def test_a_geglu_gating_the_left_half_fuses_with_the_weight_halves_swapped():
    proto = geglu_net(2560, gate="left")
    model, by_pass = fuse(proto, "fuse-bias-split-gelu")
    assert by_pass["fuse-bias-split-gelu"].details["gated_half_swapped"] == 1
    assert op_counts(model) == Counter({"MatMul": 1, "BiasSplitGelu": 1})
    assert_same_computation(proto, model, atol=1e-4, rtol=1e-3)


def test_a_geglu_gating_the_left_half_of_run_time_weights_is_refused():
    proto = geglu_net(2560, gate="left", weight_input=True)
    model, by_pass = fuse(proto, "fuse-bias-split-gelu")
    result = by_pass["fuse-bias-split-gelu"]
    assert (result.sites_matched, result.sites_rewritten) == (1, 0)
    assert "gates the left half" in result.refused[0][1]
    assert "BiasSplitGelu" not in op_counts(model)


@pytest.mark.parametrize("chunk", ["split", "constant-slices"])
def test_a_cut_into_unequal_parts_is_refused(chunk):
    # [2559, 1]: the one-column part broadcasts in the Mul, so the graph is valid -- and no GEGLU.
    proto = geglu_net(2560, chunk=chunk, split_sizes=[2559, 1])
    model, by_pass = fuse(proto, "fuse-bias-split-gelu")
    result = by_pass["fuse-bias-split-gelu"]
    assert (result.sites_matched, result.sites_rewritten) == (1, 0)
    assert result.refused[0][1] == "splits into [2559, 1], not halves [1280, 1280]"
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-5)


def test_slices_that_do_not_tile_the_axis_stay_slices_and_nothing_fuses():
    proto = geglu_net(2560, chunk="constant-slices", split_sizes=[1280, 1279])  # the last column is left out
    model, by_pass = fuse(proto, "fuse-bias-split-gelu")
    assert by_pass["slices-to-split"].sites_matched == 0
    assert by_pass["fuse-bias-split-gelu"].sites_matched == 0
    assert op_counts(model)["Slice"] == 2


def test_a_split_into_three_parts_is_refused():
    net = Net()
    x = net.input("x", [2, 5, 8])
    h = net.op("Add", net.op("MatMul", x, net.const(weights(8, 2561))), net.const(weights(2561)))
    a, g, _ = net.op("Split", h, net.ints(1280, 1280, 1), axis=-1, outputs=3)
    proto = net.model(net.op("Mul", a, erf_gelu(net, g)))
    _, by_pass = fuse(proto, "fuse-bias-split-gelu")
    assert by_pass["fuse-bias-split-gelu"].refused[0][1] == "splits into 3 parts, not halves"


def test_a_hidden_size_the_cuda_kernel_lacks_is_refused_unless_the_check_is_off():
    proto = geglu_net(128)
    _, by_pass = fuse(proto, "fuse-bias-split-gelu")
    assert by_pass["fuse-bias-split-gelu"].refused == [
        (by_pass["fuse-bias-split-gelu"].refused[0][0], "hidden size 128 is not one ORT's CUDA kernel implements (2560, 5120, 6144, 10240, 12288)")
    ]
    model, by_pass = fuse(proto, FuseBiasSplitGelu(check_kernel_sizes=False))
    assert by_pass["fuse-bias-split-gelu"].sites_rewritten == 1
    assert_same_computation(proto, model, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------- BiasAdd


def linear_residual_net(c: int = 320, skip_shape=None, then_layer_norm: bool = False):
    net = Net()
    x = net.input("x", [2, 6, 16])
    skip = net.input("skip", skip_shape or [2, 6, c])
    out = net.op("Add", net.op("Add", net.op("MatMul", x, net.const(weights(16, c))), net.const(weights(c))), skip)
    if then_layer_norm:
        out = net.op("LayerNormalization", out, net.const(weights(c)), net.const(weights(c)), axis=-1, epsilon=1e-5)
    return net.model(out)


@pytest.mark.parametrize("channels", [320, 24])
def test_a_linear_plus_residual_becomes_bias_add(channels):
    proto = linear_residual_net(channels)
    model, by_pass = fuse(proto, "fuse-bias-add")
    assert op_counts(model) == Counter({"MatMul": 1, "BiasAdd": 1})
    assert by_pass["fuse-bias-add"].details["dims_assumed_equal"] == 0
    assert_same_computation(proto, model, atol=1e-4, rtol=1e-3)


def test_bias_add_refuses_a_residual_that_broadcasts():
    _, by_pass = fuse(linear_residual_net(320, skip_shape=[2, 1, 320]), "fuse-bias-add")
    assert by_pass["fuse-bias-add"].refused[0][1] == (
        "[2, 6, 320] + [2, 1, 320] broadcasts; BiasAdd needs skip of the input's shape"
    )


def test_a_residual_sum_read_by_a_layer_norm_is_left_to_skip_layer_norm():
    proto = linear_residual_net(320, then_layer_norm=True)
    model, by_pass = fuse(proto, "fuse-bias-add")
    assert by_pass["fuse-bias-add"].sites_matched == 0
    assert by_pass["fuse-bias-add"].details["left_for_skip_layer_norm"] == 1
    model, by_pass = fuse(proto, "fuse-skip-layer-norm", "fuse-bias-add")
    assert op_counts(model) == Counter({"MatMul": 1, "SkipLayerNormalization": 1})
    assert_same_computation(proto, model, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------- LayerNorm and SkipLayerNorm


def decomposed_layer_norm_net(axes=(-1,), gamma_shape=(16,), opset: int = 17):
    net = Net(opset)
    x = net.input("x", [2, 6, 16])
    mean_kw = {"axes": list(axes)}
    d = net.op("Sub", x, net.op("ReduceMean", x, **mean_kw))
    var = net.op("ReduceMean", net.op("Pow", d, net.const(2.0)), **mean_kw)
    normed = net.op("Div", d, net.op("Sqrt", net.op("Add", var, net.const(1e-5))))
    out = net.op("Add", net.op("Mul", normed, net.const(weights(*gamma_shape) + 1)), net.const(weights(*gamma_shape)))
    return net.model(out)


@pytest.mark.parametrize("gamma_shape", [(16,), (1, 1, 16)])
def test_a_decomposed_layer_norm_becomes_layer_normalization(gamma_shape):
    proto = decomposed_layer_norm_net(gamma_shape=gamma_shape)
    model, by_pass = fuse(proto, "fuse-layer-norm")
    assert [n.op for n in model.graph.nodes] == ["LayerNormalization"]
    (node,) = model.graph.nodes
    assert node.attrs == {"axis": -1, "epsilon": pytest.approx(1e-5)}
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-4)


def test_a_decomposed_norm_over_another_axis_is_refused():
    _, by_pass = fuse(decomposed_layer_norm_net(axes=(1,)), "fuse-layer-norm")
    assert by_pass["fuse-layer-norm"].refused[0][1] == "the mean is over axes [1], not the last axis alone"


def test_a_decomposed_layer_norm_before_opset_17_is_refused():
    _, by_pass = fuse(decomposed_layer_norm_net(opset=13), "fuse-layer-norm")
    assert by_pass["fuse-layer-norm"].refused[0][1] == "opset 13 has no LayerNormalization (it came in opset 17)"


def before_and_after(proto, model, feeds):
    """The single output of the source graph and of the rewritten model, both on ORT CPU."""
    import onnxruntime as ort

    (expected,) = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)
    (actual,) = ort.InferenceSession(model.to_onnx().SerializeToString()).run(None, feeds)
    return expected, actual


def residual_layer_norm_net(a_shape, b_shape, *, axis: int = -1, biased: bool = False, sum_read_after: bool = False):
    """LayerNormalization(a [@ W + bias] + b), optionally with the sum also read by a later Add."""
    net = Net()
    a, b = net.input("a", a_shape), net.input("b", b_shape)
    d = a_shape[-1]
    if biased:
        a = net.op("Add", net.op("MatMul", a, net.const(weights(d, d))), net.const(weights(d)))
    s = net.op("Add", a, b)
    norm_shape = a_shape[axis:]
    y = net.op("LayerNormalization", s, net.const(weights(*norm_shape) + 1), net.const(weights(*norm_shape)), axis=axis, epsilon=1e-5)
    outputs = [y]
    if sum_read_after:
        outputs.append(net.op("Add", s, net.op("Relu", y)))
    return net.model(*outputs)


def test_add_then_layer_norm_becomes_skip_layer_norm_whose_sum_output_feeds_the_residual_stream():
    proto = residual_layer_norm_net([2, 6, 16], [2, 6, 16], biased=True, sum_read_after=True)
    model, by_pass = fuse(proto, "fuse-skip-layer-norm")
    (skip_ln,) = [n for n in model.graph.nodes if n.op == "SkipLayerNormalization"]
    assert len(skip_ln.inputs) == 5 and skip_ln.inputs[4].name  # the Linear's bias folded in
    assert skip_ln.outputs[3].outputs[0].op == "Add"  # input + skip + bias, read by the residual Add
    assert skip_ln.attrs["epsilon"] == pytest.approx(1e-5)
    assert op_counts(model) == Counter({"MatMul": 1, "SkipLayerNormalization": 1, "Relu": 1, "Add": 1})
    assert_same_computation(proto, model, atol=1e-4, rtol=1e-3)


def test_a_batch_one_operand_becomes_the_skip_whichever_side_of_the_add_it_is_on():
    # CLIP's position embedding (1, S, D) added to token embeddings (B, S, D).
    proto = residual_layer_norm_net([1, 6, 16], [2, 6, 16])
    model, by_pass = fuse(proto, "fuse-skip-layer-norm")
    (skip_ln,) = model.graph.nodes
    assert [t.name for t in skip_ln.inputs[:2]] == ["b", "a"]
    assert by_pass["fuse-skip-layer-norm"].details["dims_assumed_equal"] == 0
    assert_same_computation(proto, model, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("batches", [(1, 2), (2, 1), (2, 2)])
def test_batch_dims_not_proven_equal_keep_the_add_broadcast(batches):
    """a: (ba, 4, 16) + b: (bb, 4, 16), two symbols: ORT's kernel computed batch 1 + batch 2 at
    the input's shape (1, 4, 16) where the Add gives (2, 4, 16). The fused graph broadcasts first."""
    proto = residual_layer_norm_net(["ba", 4, 16], ["bb", 4, 16])
    model, by_pass = fuse(proto, "fuse-skip-layer-norm")
    assert op_counts(model)["SkipLayerNormalization"] == 1
    assert by_pass["fuse-skip-layer-norm"].details["batch_broadcast_kept"] == 1
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((batches[0], 4, 16)).astype(np.float32),
             "b": rng.standard_normal((batches[1], 4, 16)).astype(np.float32)}
    expected, actual = before_and_after(proto, model, feeds)
    assert actual.shape == expected.shape == (2, 4, 16)
    np.testing.assert_allclose(actual, expected, atol=1e-5, rtol=1e-4)


def test_batch_dims_of_one_symbol_need_no_broadcast():
    proto = residual_layer_norm_net(["batch", 4, 16], ["batch", 4, 16])
    model, by_pass = fuse(proto, "fuse-skip-layer-norm")
    assert op_counts(model) == Counter({"SkipLayerNormalization": 1})
    assert by_pass["fuse-skip-layer-norm"].details["batch_broadcast_kept"] == 0


@pytest.mark.parametrize(
    "a_shape, b_shape, reason",
    [
        ([2, 6, 16], [2, 1, 16], "[2, 6, 16] + [2, 1, 16] broadcasts along axis -2; swapped: [2, 1, 16] + [2, 6, 16] broadcasts along axis -2"),
        ([2, 6, 16], [16], "the skip would have shape [16]; SkipLayerNormalization takes (B, S, D), (1, S, D) or (S, D)"
         "; swapped: the input would have rank 1; SkipLayerNormalization takes 2-D or 3-D"),
        ([2, 3, 6, 16], [2, 3, 6, 16], "the input would have rank 4; SkipLayerNormalization takes 2-D or 3-D"),
    ],
    ids=["sequence-broadcast", "bias-only", "4-d"],
)
def test_an_add_whose_operands_broadcast_in_a_way_the_kernel_cannot_is_refused(a_shape, b_shape, reason):
    proto = residual_layer_norm_net(a_shape, b_shape)
    model, by_pass = fuse(proto, "fuse-skip-layer-norm")
    result = by_pass["fuse-skip-layer-norm"]
    assert (result.sites_matched, result.sites_rewritten) == (1, 0)
    assert result.refused[0][1] == reason
    assert op_counts(model) == Counter({"Add": 1, "LayerNormalization": 1})


def test_a_layer_norm_over_more_than_the_last_axis_is_refused():
    proto = residual_layer_norm_net([2, 6, 16], [2, 6, 16], axis=-2)
    _, by_pass = fuse(proto, "fuse-skip-layer-norm")
    assert by_pass["fuse-skip-layer-norm"].refused[0][1] == "normalizes from axis -2; SkipLayerNormalization normalizes the last axis only"


# ---------------------------------------------------------------- shape arithmetic (onnxopt.pattern.tensor_facts)


def test_shape_arithmetic_is_static_where_it_reads_only_static_dims():
    from onnxopt.pattern.tensor_facts import static_value

    net = Net()
    h = net.input("h", ["batch", "seq", 7])
    shape = net.op("Shape", h)
    last = net.op("Gather", shape, net.ints(-1))
    chunk = net.op("Div", net.op("Add", last, net.ints(1)), net.ints(2))  # torch.chunk(2): ceil(7 / 2)
    negative = net.op("Div", net.op("Neg", last), net.ints(2))  # ONNX integer Div truncates toward zero
    batch = net.op("Gather", shape, net.ints(0))
    graph = load_model(net.model(chunk, negative, batch)).graph
    values = {t.name: static_value(t) for t in graph.outputs}
    assert values[chunk].tolist() == [4]
    assert values[negative].tolist() == [-3]
    assert values[batch] is None


def test_the_one_shape_oracle_evaluates_what_the_exporters_compute_shape_values_with():
    """tensor_facts reads Dims (one evaluator): Size, Max/Min, Mod, computed Slice bounds and Gather
    indices are static where the dims they read are; a symbolic dim stays unknown through them."""
    from onnxopt.pattern.tensor_facts import static_ints

    net = Net()
    h = net.input("h", ["batch", 6, 8])
    shape = net.op("Shape", h)
    last = net.op("Gather", shape, net.ints(-1))
    size_of = net.op("Size", net.input("w", [3, 4]))
    biggest = net.op("Max", last, net.op("Gather", shape, net.op("Sub", net.ints(2), net.ints(1))))  # max(8, 6)
    smallest = net.op("Min", last, net.ints(5))
    rest = net.op("Mod", last, net.ints(3))
    tail = net.op("Slice", shape, net.op("Sub", net.ints(3), net.ints(2)), net.ints(3))  # shape[1:3]
    batch = net.op("Max", net.op("Gather", shape, net.ints(0)), net.ints(1))
    graph = load_model(net.model(size_of, biggest, smallest, rest, tail, batch)).graph
    values = {t.name: static_ints(t) for t in graph.outputs}
    assert (values[size_of], values[biggest], values[smallest], values[rest], values[tail]) == ([12], [8], [5], [2], [6, 8])
    assert values[batch] is None  # max(batch, 1): the batch is symbolic


def residual_branch_net(branch_reads_other_input: bool):
    """LayerNormalization(a + F), F = (a @ W + bias) viewed through a Reshape that copies dim 0 [* c]."""
    net = Net()
    a = net.input("a", ["ba", 4, 16])
    f = net.op("Add", net.op("MatMul", a, net.const(weights(16, 16))), net.const(weights(16)))
    f = net.op("Reshape", f, net.ints(0, -1, 16))  # a view that copies the batch (dim 0)
    if branch_reads_other_input:
        f = net.op("Mul", f, net.input("c", ["bc", 4, 16]))  # a batch can broadcast in here
    s = net.op("Add", f, a)
    return net.model(net.op("LayerNormalization", s, net.const(weights(16) + 1), net.const(weights(16)), axis=-1, epsilon=1e-5))


@pytest.mark.parametrize("reads_other_input", [False, True])
def test_the_residual_proof_follows_row_wise_ops_back_to_the_skip(reads_other_input):
    """a + F(a): F (MatMul by a weight, bias, a Reshape that copies dim 0) is computed from a row by row, so
    the batches are one; F times another input c is not (c's batch may broadcast in)."""
    from onnxopt.passes.skip_layer_norm import _computed_row_by_row

    model = load_model(residual_branch_net(branch_reads_other_input=reads_other_input))
    (add,) = [n for n in model.graph.nodes if n.op == "Add" and n.outputs[0].outputs[0].op == "LayerNormalization"]
    branch, a = add.inputs
    assert _computed_row_by_row(branch, a) is not reads_other_input
    assert _computed_row_by_row(a, branch) is False


@pytest.mark.parametrize("batches", [(1, 2), (2, 1)])
def test_a_residual_branch_that_reads_another_batch_keeps_the_broadcast(batches):
    """The lookalike: F also multiplies by another input, whose batch can broadcast F's: not proven."""
    proto = residual_branch_net(branch_reads_other_input=True)
    model, by_pass = fuse(proto, "infer-shapes", "fuse-skip-layer-norm")
    assert by_pass["fuse-skip-layer-norm"].details["batch_broadcast_kept"] == 1
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((batches[0], 4, 16)).astype(np.float32),
             "c": rng.standard_normal((batches[1], 4, 16)).astype(np.float32)}
    expected, actual = before_and_after(proto, model, feeds)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["unet-sdxl", "controlnet"])
def test_residual_sites_of_torchscript_exports_are_proven_without_broadcast(export_tiny, family):
    """ort-cuda on the TorchScript dynamic exports: every skip-LayerNorm site is a residual block whose
    batch the data flow proves (GEGLU's Split included, where the kernel refuses BiasSplitGelu)."""
    exported = export_tiny(family, "torchscript", "dynamic", "sdpa")
    model, report = optimize(exported.path, ["ort-cuda"], verify=True, inputs=exported.input_spec())
    (skip_ln,) = [p for p in report.passes if p.name == "fuse-skip-layer-norm"]
    assert skip_ln.result.sites_rewritten > 0 and skip_ln.result.details["batch_broadcast_kept"] == 0
    assert report.first_broken_pass is None


def test_residual_sites_of_the_torchscript_unet_are_proven_without_broadcast():
    """On the committed TorchScript dynamic UNets (SDPA and classic attention) every skip-LayerNorm
    site is a residual block: none keeps the Expand (it cost 0.85 ms a call on SDXL, H100), and the
    result still computes what the export does."""
    from tests.conftest import FIXTURES

    for name in ("unet-sd15.tiny.torchscript.dynamic.sdpa.onnx", "unet-sd15.tiny.torchscript.dynamic.classic.onnx"):
        model, report = optimize(FIXTURES / name, ["ort-cuda"], verify=True)
        (skip_ln,) = [p for p in report.passes if p.name == "fuse-skip-layer-norm"]
        assert skip_ln.result.sites_rewritten == 8 and skip_ln.result.details["batch_broadcast_kept"] == 0, name
        assert report.first_broken_pass is None
