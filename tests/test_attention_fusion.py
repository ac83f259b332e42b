"""Claims about fuse-attention and the canonicalize-attention pass it requires.

On real tiny exports (``@pytest.mark.models``): for every family with attention and every export
variant, each attention module of the torch model becomes exactly one fused node (self and cross
counted apart), CLIP's causal mask becomes ``unidirectional``, VAE/CLIP projection biases are kept,
and the fused model computes what the export computes. Raw exporter output (no cleanup) fuses too.
Variants outside a default set that covers every exporter form are marked ``slow``.

On hand-built graphs: lookalikes that must not fuse, or must keep their mask, each with a check
that fails if the pass fused them wrongly (the outputs are compared with the source).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import optimize
from onnxopt.verify import assert_same_computation
from tests.conftest import EXPORT_VARIANTS, export_cases, op_counts

ATTENTION_FAMILIES = [
    "unet-sd15", "unet-sd21", "unet-sdxl", "vae-encoder", "vae-decoder", "clip-text", "openclip-text", "controlnet",
]
TEXT_ENCODERS = {"clip-text", "openclip-text"}
VAES = {"vae-encoder", "vae-decoder"}
FUSED_OPS = {"MultiHeadAttention", "Attention"}

TS_DYNAMIC = ("torchscript", "dynamic", "sdpa")
TS_STATIC = ("torchscript", "static", "sdpa")
DYNAMO_DYNAMIC = ("dynamo", "dynamic", "sdpa")
DYNAMO_STATIC = ("dynamo", "static", "sdpa")
TS_CLASSIC = ("torchscript", "dynamic", "classic")
DYNAMO_CLASSIC = ("dynamo", "dynamic", "classic")

# Every exporter form is in the default run: the UNet (self + cross, both processors, both
# exporters; its dynamo classic export alone takes a minute, and the VAE covers that form), the
# VAE (biases, one head, every variant) and CLIP (causal masks, every variant). The rest: slow.
DEFAULT_VARIANTS = {
    "unet-sd15": [v for v in EXPORT_VARIANTS if v != DYNAMO_CLASSIC],
    "vae-decoder": EXPORT_VARIANTS,
    "clip-text": EXPORT_VARIANTS,
}
RAW_DEFAULT = {
    ("unet-sd15", TS_DYNAMIC),  # the scale computed from Shape at run time
    ("unet-sd15", TS_STATIC),  # the same chain on static shapes, not folded
    ("vae-decoder", DYNAMO_STATIC),  # dynamo's K^T chain with constant shapes
    ("clip-text", DYNAMO_DYNAMIC),  # the K^T chain on Shape, the NaN guard, the range-built mask
    ("clip-text", TS_CLASSIC),  # eager CLIP: casts around Softmax, finfo.min mask
    ("vae-decoder", DYNAMO_CLASSIC),  # bmm form: Expand(0) bias, heads folded into the batch
}


def _cases(default: dict) -> list:
    return export_cases(ATTENTION_FAMILIES, lambda family, variant: variant in default.get(family, [TS_DYNAMIC]))


def _raw_cases() -> list:
    return export_cases(ATTENTION_FAMILIES, lambda family, variant: (family, variant) in RAW_DEFAULT, prefix="raw-")


def fusion_result(report):
    return next(step.result for step in report.passes if step.name == "fuse-attention")


def fused_nodes(model):
    return [n for n in model.graph.nodes if n.op in FUSED_OPS and n.domain == "com.microsoft"]


def assert_every_module_fused(exported, model, report):
    sites = exported.sites
    result = fusion_result(report)
    assert result.refused == []
    assert result.sites_matched == result.sites_rewritten == sites["attention"]
    assert result.details.get("self", 0) == sites["attention_self"]
    assert result.details.get("cross", 0) == sites["attention_cross"]
    assert len(fused_nodes(model)) == sites["attention"]
    assert not [n for n in model.graph.nodes if n.op == "Softmax"]
    family = exported.built.family
    if family in TEXT_ENCODERS:  # the causal mask is proven and becomes unidirectional
        assert result.details.get("causal") == sites["attention"]
        assert all(n.attrs.get("unidirectional") == 1 for n in fused_nodes(model))
    if family in VAES | TEXT_ENCODERS:  # every projection bias goes into the fused node
        assert result.details.get("with projection bias") == sites["attention"]
        assert {n.op for n in fused_nodes(model)} == {"Attention"}


# ---------------------------------------------------------------- real exports


@pytest.mark.parametrize("family, variant", _cases(DEFAULT_VARIANTS))
def test_after_cleanup_every_attention_module_becomes_one_fused_node_computing_the_same(export_tiny, family, variant):
    exported = export_tiny(family, *variant)
    model, report = optimize(exported.path, ["cleanup", "fuse-attention"])
    assert_every_module_fused(exported, model, report)
    assert_same_computation(exported.path, model, atol=1e-5, rtol=1e-4, inputs=exported.input_spec())


@pytest.mark.parametrize("family, variant", _raw_cases())
def test_raw_exporter_output_fuses_without_cleanup(export_tiny, family, variant):
    exported = export_tiny(family, *variant)
    model, report = optimize(exported.path, ["fuse-attention"])
    inserted = {step.name for step in report.passes if step.auto}
    assert inserted == {"canonicalize-attention", "infer-shapes"}  # the manager establishes the requirements
    assert_every_module_fused(exported, model, report)
    assert_same_computation(exported.path, model, atol=1e-5, rtol=1e-4, inputs=exported.input_spec())


@pytest.mark.models
def test_vae_attention_keeps_its_q_k_v_biases(export_tiny):
    """ORT's own VAE fusion replaces these biases with zeros (output error 0.15)."""
    exported = export_tiny("vae-decoder", *TS_DYNAMIC)
    source = onnx.load(str(exported.path))
    biases = {init.name: numpy_helper.to_array(init) for init in source.graph.initializer}
    expected = np.concatenate([next(v for k, v in biases.items() if f"to_{t}.bias" in k) for t in "qkv"])
    assert np.abs(expected).min() > 0  # the fixture's biases are not zero: dropping them would show
    model, _ = optimize(exported.path, ["cleanup", "fuse-attention"])
    (node,) = fused_nodes(model)
    assert node.op == "Attention" and node.attrs["num_heads"] == 1
    np.testing.assert_array_equal(node.inputs[2].values, expected)
    assert_same_computation(exported.path, model, atol=1e-5, rtol=1e-4, inputs=exported.input_spec())


@pytest.mark.models
@pytest.mark.parametrize("cross_layout", ["separate", "packed"])
def test_unet_self_attention_packs_qkv_and_cross_attention_reads_kv_per_torch_module(export_tiny, cross_layout):
    """Self-attention: packed QKV (B, S, N, 3, H). Cross-attention: by default K and V each a
    MatMul of encoder_hidden_states, (B, L, N*H) (fuse-parallel-gemm merges them across blocks);
    with cross_layout="packed" one packed KV (B, L, N, 2, H)."""
    exported = export_tiny("unet-sd15", *DYNAMO_DYNAMIC)
    model, _ = optimize(exported.path, ["cleanup", "fuse-attention"], options={"fuse-attention": {"cross_layout": cross_layout}})
    found = []
    for node in fused_nodes(model):
        assert node.op == "MultiHeadAttention"
        assert "scale" not in node.attrs  # diffusers' scale is MHA's default 1/sqrt(head_dim)
        inputs = [t for t in node.inputs if t.name]  # packed QKV: the query only; cross: query, K and V or packed KV
        if len(inputs) == 3:  # cross-attention, K and V apart
            k, v = inputs[1:]
            assert [k.inputs[0].op, v.inputs[0].op] == ["MatMul", "MatMul"]
            assert k.inputs[0].inputs[0].name == v.inputs[0].inputs[0].name == "encoder_hidden_states"
            found.append([2, node.attrs["num_heads"], k.inputs[0].inputs[1].shape[-1] // node.attrs["num_heads"]])
            continue
        reshape = inputs[-1].inputs[0]
        assert reshape.op == "Reshape"
        shape = [int(v) for v in reshape.inputs[1].values]
        assert shape[:3] == [0, 0, node.attrs["num_heads"]]
        found.append([shape[3], shape[2], shape[4]])
    expected = [
        [2 if attn.is_cross_attention else 3, attn.heads, attn.to_q.out_features // attn.heads]
        for attn in torch_attention_modules(exported.built.module)
    ]
    assert sorted(found) == sorted(expected)
    cross = sum(attn.is_cross_attention for attn in torch_attention_modules(exported.built.module))
    apart = sum(len([t for t in n.inputs if t.name]) == 3 for n in fused_nodes(model))
    assert apart == (cross if cross_layout == "separate" else 0)


def torch_attention_modules(module) -> list:
    from diffusers.models.attention_processor import Attention

    return [m for m in module.modules() if isinstance(m, Attention)]


# ---------------------------------------------------------------- hand-built graphs

RNG = np.random.default_rng(11)
B, S, L, D_IN = 2, 5, 7, 8


def attention_model(
    *,
    heads: int = 2,
    head_dim: int = 4,
    kv_heads: int | None = None,
    cross: bool = False,
    v_input: str | None = None,
    biases: bool = True,
    kv_biases: bool | None = None,
    scale="default",
    mask=None,
    nan_guard: bool = False,
    merge_shape=None,
    v_split: tuple[int, int] | None = None,
    context_batch: int = B,
) -> onnx.ModelProto:
    """One attention in the 4-D layout the exporters write (Reshape(0,0,N,H) -> Transpose ...).

    ``scale``: "default" (1/sqrt(H)), a float, or "input" (a graph input). ``mask``: None, an
    array, "input" (B,1,S,L graph input), "causal" / "anti-causal" (TorchScript's Trilu form).
    ``v_input``: a separate graph input V is projected from. ``kv_heads``: heads of K and V.
    """
    kv_heads = kv_heads or heads
    kv_biases = biases if kv_biases is None else kv_biases
    seq_kv = L if cross else S
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, D_IN])]
    if cross:
        inputs.append(helper.make_tensor_value_info("context", TensorProto.FLOAT, [context_batch, L, D_IN]))
    if v_input:
        inputs.append(helper.make_tensor_value_info(v_input, TensorProto.FLOAT, [B, seq_kv, D_IN]))
    inits, nodes = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op_type, ins, out, **attrs):
        nodes.append(helper.make_node(op_type, ins, [out], name=out, **attrs))
        return out

    def project(t, src, n):
        y = node("MatMul", [src, const(f"W{t}", RNG.standard_normal((D_IN, n * head_dim)).astype(np.float32))], f"{t}_mm")
        if (biases if t == "q" else kv_biases):
            y = node("Add", [y, const(f"b{t}", RNG.standard_normal(n * head_dim).astype(np.float32))], f"{t}_proj")
        split = v_split if t == "v" and v_split else (n, head_dim)
        return node("Reshape", [y, const(f"{t}_shape", np.array([0, 0, *split], np.int64))], f"{t}_split")

    source = "context" if cross else "x"
    q = node("Transpose", [project("q", "x", heads)], "q_heads", perm=[0, 2, 1, 3])
    kt = node("Transpose", [project("k", source, kv_heads)], "k_heads_t", perm=[0, 2, 3, 1])
    v = node("Transpose", [project("v", v_input or source, kv_heads)], "v_heads", perm=[0, 2, 1, 3])
    scores = node("MatMul", [q, kt], "scores")
    if scale == "input":
        inputs.append(helper.make_tensor_value_info("scale", TensorProto.FLOAT, [1]))
        scores = node("Mul", [scores, "scale"], "scaled")
    elif scale is not None:
        value = 1 / math.sqrt(head_dim) if scale == "default" else scale
        scores = node("Mul", [scores, const("scale", np.array([value], np.float32))], "scaled")
    if mask is not None:
        scores = node("Add", [scores, _mask(mask, seq_kv, inputs, const, node)], "masked")
    probs = node("Softmax", [scores], "probs", axis=-1)
    if nan_guard:
        nan = node("IsNaN", [probs], "probs_nan")
        probs = node("Where", [nan, const("zero", np.array(0, np.float32)), probs], "probs_guarded")
    o = node("Transpose", [node("MatMul", [probs, v], "context_heads")], "context_t", perm=[0, 2, 1, 3])
    merge = merge_shape if merge_shape is not None else [0, 0, heads * head_dim]
    node("Reshape", [o, const("merge_shape", np.array(merge, np.int64))], "out")
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "sequence", "hidden"])
    graph = helper.make_graph(nodes, "attention", inputs, [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _mask(kind, seq_kv, inputs, const, node):
    if isinstance(kind, np.ndarray):
        return const("mask", kind.astype(np.float32))
    if kind == "input":
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, [B, 1, S, seq_kv]))
        return "mask"
    # TorchScript's SDPA(is_causal=True): where(tril(ones(S, L)) == 0, -inf, 0); "anti-causal" uses triu.
    ones = node("Expand", [const("one", np.array([1.0], np.float32)), const("mask_shape", np.array([S, seq_kv], np.int64))], "ones")
    kept = node("Trilu", [ones], "kept", upper=0 if kind == "causal" else 1)
    hidden = node("Equal", [kept, const("zero_f", np.array([0.0], np.float32))], "hidden")
    return node("Where", [hidden, const("neg_inf", np.array([-np.inf], np.float32)), const("zero_m", np.array([0.0], np.float32))], "mask")


def fuse(model: onnx.ModelProto):
    fused, report = optimize(model, ["fuse-attention"])
    return fused, fusion_result(report)


def assert_refused(model: onnx.ModelProto, reason: str):
    """The site is recognised, refused with ``reason``, left as it was, and still computes the same."""
    fused, result = fuse(model)
    assert (result.sites_matched, result.sites_rewritten) == (1, 0)
    assert len(result.refused) == 1 and reason in result.refused[0][1], result.refused
    assert fused_nodes(fused) == [] and [n.op for n in fused.graph.nodes].count("Softmax") == 1
    assert_same_computation(model, fused, atol=1e-5, rtol=1e-4)
    return result


def test_self_attention_without_biases_packs_qkv_into_one_matmul():
    model = attention_model(biases=False)
    fused, result = fuse(model)
    assert (result.sites_matched, result.sites_rewritten, result.details["self"]) == (1, 1, 1)
    (mha,) = fused_nodes(fused)
    assert mha.op == "MultiHeadAttention" and mha.attrs == {"num_heads": 2}
    assert [n.op for n in fused.graph.nodes] == ["MatMul", "Reshape", "MultiHeadAttention"]
    assert mha.inputs[0].shape == [B, S, 2, 3, 4]
    assert_same_computation(model, fused, atol=1e-5, rtol=1e-4)


def test_self_attention_with_biases_becomes_attention_with_every_bias():
    model = attention_model(biases=True)
    fused, _ = fuse(model)
    (node,) = fused_nodes(fused)
    assert node.op == "Attention"
    expected = np.concatenate([numpy_helper.to_array(i) for t in "qkv" for i in model.graph.initializer if i.name == f"b{t}"])
    np.testing.assert_array_equal(node.inputs[2].values, expected)
    assert_same_computation(model, fused, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layout, ops", [
    ("split", {"MatMul": 1, "Add": 1, "Split": 1, "MultiHeadAttention": 1}),  # one GEMM, one bias Add, split into Q, K, V
    ("separate", {"MatMul": 3, "Add": 3, "MultiHeadAttention": 1}),  # one projection (and bias) each
])
def test_biased_self_attention_is_written_in_the_layout_asked_for(layout, ops):
    """A self-attention with Q/K/V biases (VAE, CLIP) under layout split/separate: MHA reads
    q, k, v with every bias added (it used to become the packed Attention op whatever the layout)."""
    model = attention_model(biases=True)
    fused, report = optimize(model, ["fuse-attention"], options={"fuse-attention": {"layout": layout}})
    (mha,) = fused_nodes(fused)
    assert mha.op == "MultiHeadAttention" and len(mha.inputs) == 3
    assert dict(op_counts(fused)) == ops
    assert_same_computation(model, fused, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cross_layout", ["separate", "packed"])
def test_cross_attention_keeps_its_kv_biases(cross_layout):
    """K and V apart (the default): each projection keeps its bias Add; packed: one Add of the
    packed bias before the (B, L, N, 2, H) Reshape."""
    model = attention_model(cross=True, biases=True)
    fused, report = optimize(model, ["fuse-attention"], options={"fuse-attention": {"cross_layout": cross_layout}})
    assert fusion_result(report).details["cross"] == 1
    (mha,) = fused_nodes(fused)
    assert mha.inputs[0].inputs[0].op == "Add"  # the query keeps its projection and bias
    if cross_layout == "packed":
        assert mha.inputs[1].inputs[0].op == "Reshape" and mha.inputs[1].inputs[0].inputs[0].inputs[0].op == "Add"
    else:
        assert [t.inputs[0].op for t in mha.inputs[1:3]] == ["Add", "Add"]
        assert [t.inputs[0].inputs[0].inputs[0].op for t in mha.inputs[1:3]] == ["MatMul", "MatMul"]
    assert_same_computation(model, fused, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("scale, attr", [("default", None), (0.2, 0.2), (None, 1.0)])
def test_mha_scale_is_the_graph_scale_and_omitted_only_when_default(scale, attr):
    model = attention_model(biases=False, scale=scale)
    fused, _ = fuse(model)
    (mha,) = fused_nodes(fused)
    assert mha.attrs.get("scale") == pytest.approx(attr) if attr is not None else "scale" not in mha.attrs
    assert_same_computation(model, fused, atol=1e-5, rtol=1e-4)


def test_causal_trilu_mask_becomes_unidirectional():
    model = attention_model(mask="causal")
    fused, result = fuse(model)
    (node,) = fused_nodes(fused)
    assert node.attrs["unidirectional"] == 1 and len(node.inputs) == 3  # the mask is gone
    assert result.details["causal"] == 1
    assert_same_computation(model, fused, atol=1e-5, rtol=1e-4)


def test_anti_causal_lookalike_keeps_its_mask_as_attention_bias():
    """tril -> triu: the same nodes but the future is visible; unidirectional would be wrong."""
    model = attention_model(mask="anti-causal")
    fused, result = fuse(model)
    (node,) = fused_nodes(fused)
    assert "unidirectional" not in node.attrs and node.inputs[5].name
    assert result.details["attention_bias"] == 1
    assert_same_computation(model, fused, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mask", ["input", "constant"])
def test_non_causal_additive_mask_is_passed_as_attention_bias(mask):
    mask = mask if mask == "input" else np.where(RNG.random((S, S)) < 0.3, -1e4, RNG.standard_normal((S, S)))
    model = attention_model(mask=mask)
    fused, _ = fuse(model)
    (node,) = fused_nodes(fused)
    assert "unidirectional" not in node.attrs
    bias = node.inputs[5]
    assert (bias.inputs[0].op if bias.inputs else None) == (None if isinstance(mask, str) else "Unsqueeze")
    assert_same_computation(model, fused, atol=1e-5, rtol=1e-4)


def test_cross_attention_to_a_context_of_another_batch_is_refused():
    """A context of batch 1 broadcasts against queries of batch 2 in the export; MHA would fail."""
    model = attention_model(cross=True, context_batch=1)
    assert_refused(model, "cannot prove query and key/value have the same batch")


def test_mask_of_the_wrong_shape_is_refused():
    assert_refused(attention_model(mask=RNG.standard_normal((B, 1, 1, S))), "cannot prove its last dims are (S, L)")


def test_value_projected_from_another_input_is_refused():
    assert_refused(attention_model(v_input="y"), "K and V project different tensors")


def test_scale_that_is_not_a_constant_is_refused():
    assert_refused(attention_model(scale="input"), "is not a constant")


def test_heads_broadcast_from_fewer_kv_heads_is_refused():
    """Q with 2 heads, K and V with 1 (broadcast by MatMul): valid, but not multi-head attention."""
    assert_refused(attention_model(heads=2, kv_heads=1), "projection widths differ: Q 8, K 4, V 4")


def test_value_split_into_other_heads_than_query_and_key_is_refused():
    """V as 1 head of 8 against Q and K as 2 heads of 4 (the probabilities broadcast over V)."""
    assert_refused(attention_model(v_split=(1, 8), merge_shape=[0, 0, 16]), "head count/dim differ: Q 2 heads of 4, K 2 heads of 4, V 1 heads of 8")


def test_output_merge_that_is_not_heads_times_head_dim_is_refused():
    assert_refused(attention_model(merge_shape=[0, -1, 4]), "output merge gives")


def test_nan_guard_over_a_mask_that_may_hide_a_whole_row_is_refused():
    assert_refused(attention_model(mask="input", nan_guard=True), "NaN-guarded")


def test_nan_guard_over_a_finite_mask_is_dropped_and_fused():
    model = attention_model(mask=np.full((S, S), -3.4e38) * np.triu(np.ones((S, S)), 1), nan_guard=True)
    fused, result = fuse(model)
    assert result.sites_rewritten == 1 and not [n for n in fused.graph.nodes if n.op in ("IsNaN", "Where")]
    assert_same_computation(model, fused, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- canonicalize-attention


def k_transpose_chain_model(unflatten_swapped: bool) -> onnx.ModelProto:
    """dynamo's K^T: Reshape(-1, L, H) -> Transpose(0,2,1) -> Reshape(B, N, H, L), on Shape(k)."""
    n, h = 2, 4
    nodes = [
        helper.make_node("Shape", ["k"], ["shape"]),
        *[helper.make_node("Slice", ["shape", f"s{i}", f"e{i}"], [f"d{i}"]) for i in range(4)],
        helper.make_node("Concat", ["minus_one", "d2", "d3"], ["flat"], axis=0),
        helper.make_node("Reshape", ["k", "flat"], ["k3"]),
        helper.make_node("Transpose", ["k3"], ["k3t"], perm=[0, 2, 1]),
        helper.make_node("Concat", ["d0", "d1", "d2", "d3"] if unflatten_swapped else ["d0", "d1", "d3", "d2"], ["unflat"], axis=0),
        helper.make_node("Reshape", ["k3t", "unflat"], ["kt"]),
    ]
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "minus_one")]
    for i in range(4):
        inits += [numpy_helper.from_array(np.array([i], np.int64), f"s{i}"), numpy_helper.from_array(np.array([i + 1], np.int64), f"e{i}")]
    graph = helper.make_graph(
        nodes, "kt", [helper.make_tensor_value_info("k", TensorProto.FLOAT, ["batch", n, "seq", h])],
        [helper.make_tensor_value_info("kt", TensorProto.FLOAT, ["batch", n, h, "seq"])], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("swapped", [False, True])
def test_k_transpose_chain_folds_into_one_transpose_only_when_it_is_one(swapped):
    model = k_transpose_chain_model(unflatten_swapped=swapped)
    canonical, report = optimize(model, ["canonicalize-attention"])
    result = report.passes[-1].result
    ops = [n.op for n in canonical.graph.nodes]
    if swapped:  # (B, N, L, H) back: a reshape, not a transpose; it stays and says why
        assert "Transpose" in ops and ops.count("Reshape") == 2
        assert any("second Reshape gives" in reason for _, reason in result.refused)
    else:
        assert ops == ["Transpose"] and canonical.graph.nodes[0].attrs["perm"] == [0, 1, 3, 2]
    assert_same_computation(model, canonical, atol=0, rtol=0)


def test_scale_computed_from_the_head_dim_at_run_time_becomes_one_constant_on_the_scores():
    """TorchScript's SDPA: q * sqrt(1/sqrt(H)) and k * sqrt(1/sqrt(H)), H = Shape(q)[-1] at run time."""
    model = attention_model(biases=False, scale=None)
    graph = model.graph
    extra = [
        helper.make_node("Shape", ["q_heads"], ["q_shape_rt"]),
        helper.make_node("Slice", ["q_shape_rt", "last", "end"], ["head_dim_i"]),
        helper.make_node("Cast", ["head_dim_i"], ["head_dim"], to=TensorProto.FLOAT),
        helper.make_node("Sqrt", ["head_dim"], ["sqrt_h"]),
        helper.make_node("Div", ["one_f", "sqrt_h"], ["inv_sqrt_h"]),
        helper.make_node("Sqrt", ["inv_sqrt_h"], ["half_scale_q"]),
        helper.make_node("Sqrt", ["inv_sqrt_h"], ["half_scale_k"]),
        helper.make_node("Mul", ["q_heads", "half_scale_q"], ["q_scaled"]),
        helper.make_node("Mul", ["k_heads_t", "half_scale_k"], ["k_scaled"]),
    ]
    graph.initializer.extend([
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
        numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "end"),
        numpy_helper.from_array(np.array([1.0], np.float32), "one_f"),
    ])
    scores = next(n for n in graph.node if n.name == "scores")
    scores.input[:] = ["q_scaled", "k_scaled"]
    position = list(graph.node).index(scores)
    for i, n in enumerate(extra):
        graph.node.insert(position + i, n)
    canonical, report = optimize(model, ["canonicalize-attention"])
    details = report.passes[-1].result.details
    assert details["sdpa-scale-from-shape"] == 1 and details["qk-scale"] == 1
    (mul,) = [n for n in canonical.graph.nodes if n.op == "Mul"]
    assert mul.inputs[0].inputs[0].op == "MatMul"
    assert float(mul.inputs[1].values.reshape(-1)[0]) == pytest.approx(0.5, rel=1e-6)  # 1/sqrt(4)
    assert_same_computation(model, canonical, atol=1e-6, rtol=1e-5)
    fused, result = fuse(model)
    assert result.sites_rewritten == 1 and "scale" not in fused_nodes(fused)[0].attrs
    assert_same_computation(model, fused, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layout", ["separate", "split"])
@pytest.mark.parametrize("name", [
    "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx", "unet-sd15.tiny.dynamo.static.sdpa.onnx",
    "unet-sd15.tiny.torchscript.dynamic.classic.onnx",
])
def test_unpacked_layouts_hand_mha_q_k_v_and_compute_the_same(name, layout):
    from tests.conftest import FIXTURES

    path = FIXTURES / name
    model, report = optimize(path, ["cleanup", "fuse-attention"], options={"fuse-attention": {"layout": layout, "cross_layout": layout}})
    result = fusion_result(report)
    assert result.refused == [] and result.sites_rewritten == 8
    mha = [n for n in fused_nodes(model) if n.op == "MultiHeadAttention"]
    assert len(mha) == 8
    for node in mha:  # query, key and value each a (B, S, N*H) tensor: no packed tensor
        assert len([t for t in node.inputs[:3] if t.name]) == 3
        assert all(t.shape is None or len(t.shape) == 3 for t in node.inputs[:3])
    assert not [n for n in model.graph.nodes if n.name.endswith(("qkv_packed", "kv_packed"))]
    splits = [n for n in model.graph.nodes if n.op == "Split" and n.name.endswith("/split")]
    if layout == "split":  # one projection GEMM per attention, its output split into K, V (and Q)
        assert len(splits) == 8
        assert sorted(len(n.outputs) for n in splits) == [2] * 4 + [3] * 4
        assert all(n.inputs[0].inputs[0].op == "MatMul" for n in splits)
    else:
        assert splits == []
    assert_same_computation(path, model, atol=1e-4, rtol=1e-3)


def test_unknown_attention_layout_is_a_clear_error():
    from onnxopt.errors import PassOptionError
    from tests.conftest import FIXTURES

    with pytest.raises(PassOptionError, match="layout must be one of"):
        optimize(FIXTURES / "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx", ["fuse-attention"],
                 options={"fuse-attention": {"layout": "interleaved"}})
