"""NHWC: every Conv becomes NhwcConv, Transposes stay only at NHWC region edges, results unchanged."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import load_model, optimize
from onnxopt.manager import PassManager
from onnxopt.verify import assert_same_computation
from tests.conftest import FIXTURES, result_of
from tests.graphs import make_model

F32 = TensorProto.FLOAT
TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]
NHWC_OPS = {"NhwcConv", "GroupNorm", "SkipGroupNorm"}
LAYOUT_FREE = {"Add", "Sub", "Mul", "Div", "Sigmoid", "Concat", "Resize", "Cast", "Relu", "Neg"}

CONV_FIXTURES = [
    "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx",
    "unet-sd15.tiny.torchscript.static.sdpa.onnx",
    "unet-sd15.tiny.dynamo.dynamic.sdpa.onnx",
    "unet-sd15.tiny.dynamo.static.sdpa.onnx",
    "vae-decoder.tiny.torchscript.dynamic.sdpa.onnx",
    "vae-decoder.tiny.dynamo.static.sdpa.onnx",
    "controlnet.tiny.torchscript.dynamic.sdpa.onnx",
]


def _manifest_sites(name):
    import json

    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    return next(e for e in manifest["fixtures"] if e["file"] == name)["sites"]


def uncancelled_pairs(graph) -> list[str]:
    """Transpose(to NCHW) that reaches a Transpose(to NHWC) through layout-free ops only."""
    found = []
    for node in graph.nodes:
        if node.op != "Transpose" or list(node.attrs["perm"]) != TO_NCHW:
            continue
        frontier = list(node.outputs[0].outputs)
        seen = set()
        while frontier:
            consumer = frontier.pop()
            if id(consumer) in seen:
                continue
            seen.add(id(consumer))
            if consumer.op == "Transpose" and list(consumer.attrs["perm"]) == TO_NHWC:
                found.append(f"{node.name} -> ... -> {consumer.name}")
            elif consumer.op in LAYOUT_FREE:
                frontier.extend(c for out in consumer.outputs for c in out.outputs)
    return found


# The VAE mid-block attention works on (N, C, H*W) views of NCHW data; its residual Add pairs an
# NCHW attention output with the block input, so one NHWC->NCHW->NHWC round trip stays there
# until attention itself runs channels-last.
EXPECTED_ROUND_TRIPS = {"vae-decoder": 1}


@pytest.mark.parametrize("name", CONV_FIXTURES)
def test_every_conv_runs_nhwc_with_transposes_only_at_region_edges(name):
    path = FIXTURES / name
    model, report = optimize(path, ["cleanup", "fuse-group-norm", "nhwc-conv"])
    step = next(p for p in report.passes if p.name == "nhwc-conv")
    assert report.passes[-1].label == "sink-transposes (for nhwc-conv)"  # a step of its own, after it
    convs = _manifest_sites(name)["conv2d"]
    assert (step.result.sites_matched, step.result.sites_rewritten) == (convs, convs)
    ops = [n.op for n in model.graph.nodes]
    pointwise = step.result.details.get("as MatMul", 0)  # 1x1 convs become MatMuls over channels
    assert ops.count("NhwcConv") + pointwise == convs and "Conv" not in ops
    round_trips = uncancelled_pairs(model.graph)
    assert len(round_trips) == EXPECTED_ROUND_TRIPS.get(name.split(".")[0], 0), round_trips
    layout_transposes = sum(1 for n in model.graph.nodes if n.op == "Transpose" and list(n.attrs["perm"]) in (TO_NHWC, TO_NCHW))
    # ONNX Runtime's own pass leaves two per Conv on static dynamo graphs.
    assert layout_transposes < convs
    assert_same_computation(path, model, atol=1e-4, rtol=1e-3)


def test_conv_with_computed_weight_is_refused():
    rng = np.random.default_rng(0)
    proto = make_model(
        [
            helper.make_node("Mul", ["w_raw", "w_scale"], ["w"]),
            helper.make_node("Conv", ["x", "w"], ["out"], pads=[1, 1, 1, 1]),
        ],
        [helper.make_tensor_value_info("x", F32, [1, 4, 8, 8]), helper.make_tensor_value_info("w_scale", F32, [1])],
        [helper.make_tensor_value_info("out", F32, [1, 6, 8, 8])],
        [numpy_helper.from_array(rng.standard_normal((6, 4, 3, 3)).astype(np.float32), "w_raw")],
    )
    model = load_model(proto)
    report = PassManager(["nhwc-conv"]).run(model)
    result = report.passes[0].result
    assert (result.sites_matched, result.sites_rewritten) == (1, 0)
    assert "not a constant" in result.refused[0][1]
    assert [n.op for n in model.graph.nodes] == ["Mul", "Conv"]


def _chain_model():
    """conv -> Add(bias c,1,1) -> Sigmoid -> Resize(x2 nearest) -> Concat(axis=1, with itself) -> conv."""
    rng = np.random.default_rng(1)
    c = 4
    inits = [
        numpy_helper.from_array(rng.standard_normal((c, c, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((c, 1, 1)).astype(np.float32), "bias"),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
        numpy_helper.from_array(rng.standard_normal((c, 2 * c, 1, 1)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["a", "bias"], ["b"]),
        helper.make_node("Sigmoid", ["b"], ["s"]),
        helper.make_node("Resize", ["s", "", "scales"], ["r"], mode="nearest"),
        helper.make_node("Concat", ["r", "r"], ["cat"], axis=1),
        helper.make_node("Conv", ["cat", "w2"], ["out"]),
    ]
    return make_model(nodes, [helper.make_tensor_value_info("x", F32, ["n", c, 6, 6])],
                      [helper.make_tensor_value_info("out", F32, ["n", c, 12, 12])], inits)


def test_transposes_sink_through_add_sigmoid_resize_and_concat():
    proto = _chain_model()
    model = load_model(proto)
    PassManager(["nhwc-conv"]).run(model)
    transposes = [n for n in model.graph.nodes if n.op == "Transpose"]
    assert len(transposes) == 2  # graph input and graph output only
    concat = next(n for n in model.graph.nodes if n.op == "Concat")
    assert concat.attrs["axis"] == 3
    resize = next(n for n in model.graph.nodes if n.op == "Resize")
    assert list(resize.inputs[2].values) == [1, 2, 2, 1]
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-4)


def test_sinking_is_what_makes_the_difference():
    """Without sinking, each Conv keeps its own pair: the chain above would have four Transposes."""
    from onnxopt.passes.nhwc_conv import NhwcConvPass

    model = load_model(_chain_model())
    PassManager([NhwcConvPass(sink=False)]).run(model)
    assert sum(1 for n in model.graph.nodes if n.op == "Transpose") == 4


@pytest.mark.parametrize("external", [False, True])
def test_saved_nhwc_model_is_valid_and_carries_every_transposed_weight(tmp_path, external):
    """Transposed weights are derived lazily; small ones must still be written with their data."""
    from onnxopt import save_model

    path = FIXTURES / "unet-sd15.tiny.dynamo.static.sdpa.onnx"
    model, _ = optimize(path, ["cleanup", "nhwc-conv"])
    out = tmp_path / "nhwc.onnx"
    save_model(model, out, external_data=external)
    onnx.checker.check_model(str(out), full_check=True)
    assert_same_computation(path, out, atol=1e-4, rtol=1e-3)


def test_pointwise_conv_option_keeps_every_conv_an_nhwc_conv():
    name = "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx"
    path = FIXTURES / name
    model, report = optimize(path, ["cleanup", "nhwc-conv"], options={"nhwc-conv": {"pointwise": "conv"}})
    convs = _manifest_sites(name)["conv2d"]
    assert [n.op for n in model.graph.nodes].count("NhwcConv") == convs
    assert "as MatMul" not in result_of(report, "nhwc-conv").details
    matmuls, _ = optimize(path, ["cleanup", "nhwc-conv"])
    assert [n.op for n in matmuls.graph.nodes].count("NhwcConv") < convs


def test_unknown_pointwise_option_is_a_clear_error():
    from onnxopt.errors import PassOptionError

    with pytest.raises(PassOptionError, match="pointwise must be one of"):
        optimize(FIXTURES / "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx", ["nhwc-conv"], options={"nhwc-conv": {"pointwise": "gemm"}})


# ---------------------------------------------------------------- fold-conv-bias


def _biased(graph) -> int:
    """Convs that still add their own bias: NhwcConv with 3 inputs, or a pointwise MatMul + Add(const)."""
    from onnxopt.passes.conv_bias import biased_producer

    count = 0
    for n in graph.nodes:
        producer = biased_producer(n.outputs[0]) if n.outputs else None
        if producer is None or producer.output is not n.outputs[0]:
            continue
        # a conv's: an NhwcConv, or the MatMul nhwc-conv made of a 1x1 conv (its weight is W[:, :, 0, 0]^T)
        count += producer.node.op == "NhwcConv" or producer.node.inputs[1].name.endswith("__cm")
    return count


@pytest.mark.parametrize("name", [n for n in CONV_FIXTURES if n.startswith(("unet", "controlnet"))])
def test_conv_biases_move_into_the_skip_group_norms_and_bias_adds_reading_them(name):
    path = FIXTURES / name
    model, report = optimize(path, ["ort-cuda"])
    step = next(s for s in report.passes if s.name == "fold-conv-bias")
    result = step.result
    assert result.refused == []
    assert result.details["into SkipGroupNorm"] >= 11 and result.details["into BiasAdd"] >= 2
    convs = _manifest_sites(name)["conv2d"]
    # conv_in, conv_out, down/up samplers and proj_in (read by a LayerNorm) keep theirs
    assert _biased(model.graph) <= convs - result.sites_rewritten
    sgn_biases = [n for n in model.graph.nodes if n.op == "SkipGroupNorm" and len(n.inputs) == 5]
    # a SkipGroupNorm whose input and skip are both conv outputs takes both biases
    assert 0 < len(sgn_biases) <= result.details["into SkipGroupNorm"]
    assert_same_computation(path, model, atol=1e-4, rtol=1e-3)


def _conv_add_model(residual: str):
    """Conv(x) + residual, the sum an output; residual: 'full' (another Conv), 'broadcast' (N,C,1,1), 'shared'."""
    rng = np.random.default_rng(3)
    c = 8
    inits = [numpy_helper.from_array(rng.standard_normal((c, c, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.standard_normal((c, c, 1, 1)).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b2")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["a"], pads=[1, 1, 1, 1])]
    outputs = [helper.make_tensor_value_info("out", F32, None)]
    inputs = [helper.make_tensor_value_info("x", F32, ["n", c, 6, 6])]
    if residual == "broadcast":
        inputs.append(helper.make_tensor_value_info("t", F32, ["n", c, 1, 1]))
        nodes.append(helper.make_node("Add", ["a", "t"], ["out"]))
    else:
        nodes.append(helper.make_node("Conv", ["x", "w2", "b2"], ["r"]))
        nodes.append(helper.make_node("Add", ["a", "r"], ["out"]))
        if residual == "shared":  # the conv output is read twice: its bias must stay
            nodes.append(helper.make_node("Neg", ["a"], ["other"]))
            outputs.append(helper.make_tensor_value_info("other", F32, None))
    return make_model(nodes, inputs, outputs, inits)


def test_residual_sum_of_two_biased_convs_becomes_one_bias_add_with_both_biases():
    proto = _conv_add_model("full")
    model, report = optimize(proto, ["infer-shapes", "nhwc-conv", "fold-conv-bias"])
    result = report.passes[-1].result
    assert (result.sites_rewritten, result.details) == (1, {"into BiasAdd": 1, "shortcut biases joined": 1})
    assert _biased(model.graph) == 0
    assert [n.op for n in model.graph.nodes].count("BiasAdd") == 1
    assert_same_computation(proto, model, atol=1e-4, rtol=1e-3)


def test_broadcast_residual_is_refused_and_a_shared_conv_output_keeps_its_bias():
    model, report = optimize(_conv_add_model("broadcast"), ["infer-shapes", "nhwc-conv", "fold-conv-bias"])
    result = report.passes[-1].result
    assert result.sites_rewritten == 0 and "broadcasts" in result.refused[0][1]
    shared = _conv_add_model("shared")
    model, report = optimize(shared, ["infer-shapes", "nhwc-conv", "fold-conv-bias"])
    assert report.passes[-1].result.sites_rewritten == 0 or _biased(model.graph) >= 1
    assert "BiasAdd" not in [n.op for n in model.graph.nodes if n.inputs and n.inputs[0].name.startswith("a")]
    # the conv read twice (Add and Neg) keeps its bias; only the other operand's bias may move
    shared_conv = next(n for n in model.graph.nodes if n.op == "NhwcConv" and len(n.inputs[1].shape) == 4
                       and n.inputs[1].shape[1:3] == [3, 3])
    assert len(shared_conv.inputs) == 3
    assert_same_computation(shared, model, atol=1e-4, rtol=1e-3)


def _qk_norm_model(norm_axis=-1, perm=(0, 2, 1, 3), norm="LayerNormalization", heads=2):
    """A diffusion transformer's QK norm and joint attention input, written out: two token streams,
    each (B, S, H, Dh) -> Transpose -> norm over Dh -> Concat over the tokens -> inverse Transpose
    -> Reshape (B, S, H*Dh), the attention's input."""
    rng = np.random.default_rng(2)
    h, dh = heads, 8
    inits = [numpy_helper.from_array(rng.standard_normal(dh).astype(np.float32), "g"),
             numpy_helper.from_array(np.array([0, 0, -1], np.int64), "heads_merged")]
    inverse = [perm.index(i) for i in range(4)]
    nodes = []
    for stream in ("img", "txt"):
        nodes += [helper.make_node("Transpose", [stream], [f"{stream}_t"], perm=list(perm)),
                  helper.make_node(norm, [f"{stream}_t", "g"], [f"{stream}_n"], axis=norm_axis, epsilon=1e-6)]
    nodes += [helper.make_node("Concat", ["txt_n", "img_n"], ["joint"], axis=2 if perm == (0, 2, 1, 3) else 1),
              helper.make_node("Transpose", ["joint"], ["joint_t"], perm=inverse),
              helper.make_node("Reshape", ["joint_t", "heads_merged"], ["out"])]
    inputs = [helper.make_tensor_value_info(stream, F32, ["b", s, h, dh]) for stream, s in (("img", 6), ("txt", 3))]
    return make_model(nodes, inputs, [helper.make_tensor_value_info("out", F32, None)], inits)


@pytest.mark.parametrize("norm", ["LayerNormalization", "SimplifiedLayerNormalization"])
def test_transposes_sink_through_a_last_axis_norm_and_the_joint_concat_and_cancel(norm):
    proto = _qk_norm_model(norm=norm)
    model = load_model(proto)
    PassManager(["sink-transposes"]).run(model)
    assert [n.op for n in model.graph.nodes if n.op == "Transpose"] == []
    assert next(n for n in model.graph.nodes if n.op == "Concat").attrs["axis"] == 1  # the tokens' axis, untransposed
    if norm == "LayerNormalization":  # ORT's CPU build has SimplifiedLayerNormalization too, onnx.reference not
        assert_same_computation(proto, model, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kwargs", [dict(norm_axis=2, heads=8), dict(perm=(0, 1, 3, 2), heads=8)],
                         ids=["norm-over-another-axis", "perm-moves-the-normalized-axis"])
def test_a_norm_the_transpose_does_not_commute_with_stops_the_sinking(kwargs):
    proto = _qk_norm_model(**kwargs)
    model = load_model(proto)
    PassManager(["sink-transposes"]).run(model)
    norms = [n for n in model.graph.nodes if n.op == "LayerNormalization"]
    assert all(n.inputs[0].inputs[0].op == "Transpose" for n in norms)
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_no_transpose_is_left_around_the_qk_norms_of_the_tiny_sd35_transformer(exporter):
    """The real export: after ort-cuda no Transpose feeds or reads a QK RMSNorm, and the graph computes the same."""
    source = FIXTURES / "dit" / f"sd35-medium.tiny.{exporter}.dynamic.sdpa.onnx"
    model, _ = optimize(str(source), ["ort-cuda"])
    norms = [n for n in model.graph.nodes if n.op == "SimplifiedLayerNormalization"]
    assert norms
    for norm in norms:
        assert not (norm.inputs[0].inputs and norm.inputs[0].inputs[0].op == "Transpose"), norm.name
        assert not any(c.op == "Transpose" for c in norm.outputs[0].outputs), norm.name
    assert_same_computation(str(source), model, atol=1e-4, rtol=1e-3)
