"""onnxopt.reference: NumPy kernels for com.microsoft contrib ops, checked against ONNX Runtime CPU.

Ops with an ORT CPU kernel (MultiHeadAttention with separate Q/K/V, Attention,
SkipLayerNormalization and the GELU family) are compared with ORT directly. Ops without one
(GroupNorm, SkipGroupNorm, BiasSplitGelu, BiasAdd, NhwcConv, packed QKV/KV MultiHeadAttention)
are compared with a composition of standard ONNX ops computing the same thing, run on ORT CPU.
fp16 kernels compute in float32, so fp16 cases compare with the float32 composition.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxopt import reference

MS = "com.microsoft"
F32, F16 = np.float32, np.float16
TOL = {F32: dict(rtol=1e-5, atol=1e-5), F16: dict(rtol=2e-3, atol=3e-3)}


# --------------------------------------------------------------------------- model helpers


def make_model(nodes, inputs: dict[str, np.ndarray], outputs: dict[str, type], initializers=()) -> onnx.ModelProto:
    """A model whose graph inputs are typed after the feeds and whose outputs have the given dtypes."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in inputs.items()],
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(np.dtype(t)), None) for k, t in outputs.items()],
        initializer=list(initializers),
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)  # ORT 1.31 reads IR <= 13


def one_node(op_type, inputs: dict, outputs: list[str], domain=MS, out_dtypes=None, **attrs):
    """A single-node model; inputs maps names to arrays, None = omitted optional input.

    outputs: output names, "" skips an optional output; they are typed like the first input
    unless out_dtypes says otherwise. Returns (model, feeds).
    """
    names = [name if value is not None else "" for name, value in inputs.items()]
    while names and names[-1] == "":
        names.pop()
    feeds = {k: v for k, v in inputs.items() if v is not None}
    first = next(iter(feeds.values())).dtype
    types = {name: (out_dtypes or {}).get(name, first) for name in outputs if name}
    node = helper.make_node(op_type, names, outputs, domain=domain, **attrs)
    return make_model([node], feeds, types), feeds


def ort_run(model, feeds) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def ref_run(model, feeds) -> list[np.ndarray]:
    out = reference.run(model, feeds)
    return [out[o.name] for o in model.graph.output]


def assert_close(actual, expected, dtype=F32, tol=None):
    """actual has dtype and matches expected within the tolerance for tol (default: dtype)."""
    assert actual.dtype == np.dtype(dtype), (actual.dtype, dtype)
    np.testing.assert_allclose(actual.astype(F32), expected.astype(F32), **TOL[tol or dtype])


def assert_differs(a, b):
    assert not np.allclose(a.astype(F32), b.astype(F32), rtol=1e-3, atol=1e-3)


def const(name, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def rand(rng, *shape, dtype=F32):
    return rng.standard_normal(shape).astype(dtype)


# --------------------------------------------------------------------------- activations vs ORT


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_fast_gelu_matches_ort(dtype, with_bias):
    rng = np.random.default_rng(0)
    x = rand(rng, 2, 7, 32, dtype=dtype) * 3
    bias = rand(rng, 32, dtype=dtype) if with_bias else None
    model, feeds = one_node("FastGelu", {"X": x, "bias": bias}, ["Y"])
    assert_close(ref_run(model, feeds)[0], ort_run(model, feeds)[0], dtype)


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_bias_gelu_matches_ort(dtype):
    rng = np.random.default_rng(1)
    model, feeds = one_node("BiasGelu", {"A": rand(rng, 3, 5, 24, dtype=dtype) * 3, "B": rand(rng, 24, dtype=dtype)}, ["C"])
    assert_close(ref_run(model, feeds)[0], ort_run(model, feeds)[0], dtype)


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_gelu_matches_ort(dtype):
    rng = np.random.default_rng(2)
    model, feeds = one_node("Gelu", {"X": rand(rng, 4, 33, dtype=dtype) * 4}, ["Y"])
    assert_close(ref_run(model, feeds)[0], ort_run(model, feeds)[0], dtype)


@pytest.mark.parametrize("alpha", [None, 1.0, -0.5], ids=["default_alpha", "alpha_1", "alpha_neg"])
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_quick_gelu_matches_ort(dtype, alpha):
    rng = np.random.default_rng(3)
    attrs = {} if alpha is None else {"alpha": alpha}
    model, feeds = one_node("QuickGelu", {"X": rand(rng, 2, 3, 40, dtype=dtype) * 5}, ["Y"], **attrs)
    assert_close(ref_run(model, feeds)[0], ort_run(model, feeds)[0], dtype)


def test_gelu_is_the_erf_form_not_tanh():
    # Gelu(1) = 0.5 * (1 + erf(1/sqrt(2))) = 0.841344746..., the tanh form gives 0.841191990...
    model, feeds = one_node("Gelu", {"X": np.array([1.0], F32)}, ["Y"])
    assert ref_run(model, feeds)[0][0] == pytest.approx(0.5 * (1 + math.erf(1 / math.sqrt(2))), abs=1e-7)


# --------------------------------------------------------------------------- SkipLayerNormalization vs ORT


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("skip_shape", ["BSD", "1SD", "SD"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("with_beta", [False, True], ids=["no_beta", "beta"])
def test_skip_layer_norm_matches_ort(with_beta, with_bias, skip_shape, dtype):
    rng = np.random.default_rng(4)
    b, s, d = 2, 5, 48
    skip = rand(rng, *{"BSD": (b, s, d), "1SD": (1, s, d), "SD": (s, d)}[skip_shape], dtype=dtype)
    inputs = {
        "input": rand(rng, b, s, d, dtype=dtype) * 2 + 1,
        "skip": skip,
        "gamma": rand(rng, d, dtype=dtype),
        "beta": rand(rng, d, dtype=dtype) if with_beta else None,
        "bias": rand(rng, d, dtype=dtype) if with_bias else None,
    }
    outputs = ["output", "mean", "inv_std_var", "input_skip_bias_sum"]
    stats = {"mean": F32, "inv_std_var": F32}
    model, feeds = one_node("SkipLayerNormalization", inputs, outputs, out_dtypes=stats, epsilon=1e-5)
    for name, got, want in zip(outputs, ref_run(model, feeds), ort_run(model, feeds), strict=True):
        assert got.shape == want.shape
        assert_close(got, want, stats.get(name, dtype), tol=dtype)


def test_skip_layer_norm_only_requested_outputs():
    rng = np.random.default_rng(5)
    inputs = {"input": rand(rng, 1, 3, 8), "skip": rand(rng, 1, 3, 8), "gamma": rand(rng, 8)}
    model, feeds = one_node("SkipLayerNormalization", inputs, ["output", "", "", "sum"])
    got, want = ref_run(model, feeds), ort_run(model, feeds)
    assert [g.shape for g in got] == [(1, 3, 8), (1, 3, 8)]
    for g, w in zip(got, want):
        assert_close(g, w)


# --------------------------------------------------------------------------- attention helpers


def key_mask(rng, kind, b, s, t):
    """An int32 mask of the given kind that leaves at least key 0 visible in every row."""
    if kind == "lengths":
        return rng.integers(1, t + 1, size=b).astype(np.int32)
    if kind == "start_end":  # (2B): exclusive ends, then inclusive starts
        end = rng.integers(2, t + 1, size=b)
        start = rng.integers(0, end - 1)
        return np.concatenate([end, start]).astype(np.int32)
    shape = {"2d": (b, t), "3d": (b, s, t)}[kind]
    mask = (rng.random(shape) > 0.35).astype(np.int32)
    mask[..., 0] = 1
    return mask


def attention_bias(rng, dims, b, n, s, t, dtype):
    return rand(rng, b if dims[0] == "B" else 1, n if dims[1] == "N" else 1, s, t, dtype=dtype)


# --------------------------------------------------------------------------- MultiHeadAttention vs ORT

MHA_CASES = {
    "self": dict(),
    "cross": dict(s=3, t=7),
    "bias": dict(bias=True),
    "v_hidden_differs": dict(dv=24, bias=True),
    "attn_bias_1x1": dict(attn_bias=("1", "1")),
    "attn_bias_BxN": dict(attn_bias=("B", "N")),
    "attn_bias_1xN": dict(attn_bias=("1", "N"), bias=True),
    "mask_2d": dict(mask="2d", t=7, s=4),
    "mask_lengths": dict(mask="lengths"),
    "mask_3d": dict(mask="3d", s=4, t=6),
    "causal": dict(unidirectional=1),
    "causal_mask_attn_bias": dict(unidirectional=1, mask="2d", attn_bias=("B", "1"), bias=True),
    "scale_and_filter_value": dict(scale=0.3, mask="2d", mask_filter_value=-300.0),
    "present_kv": dict(bias=True, present=True, t=7, s=4),
    "fp16": dict(dtype=F16, bias=True, mask="2d"),
}


def mha_inputs(rng, b=2, s=5, t=5, n=2, d=16, dv=None, bias=False, mask=None, attn_bias=None, dtype=F32, **_):
    dv = dv or d
    return {
        "query": rand(rng, b, s, d, dtype=dtype),
        "key": rand(rng, b, t, d, dtype=dtype),
        "value": rand(rng, b, t, dv, dtype=dtype),
        "bias": rand(rng, 2 * d + dv, dtype=dtype) if bias else None,
        "key_padding_mask": key_mask(rng, mask, b, s, t) if mask else None,
        "attention_bias": attention_bias(rng, attn_bias, b, n, s, t, dtype) if attn_bias else None,
    }


def mha_attrs(case, n=2):
    attrs = {"num_heads": n}
    for name in ("unidirectional", "scale", "mask_filter_value"):
        if name in case:
            attrs[name] = case[name]
    return attrs


@pytest.mark.parametrize("case", list(MHA_CASES.values()), ids=list(MHA_CASES))
def test_multi_head_attention_matches_ort(case):
    rng = np.random.default_rng(6)
    dtype = case.get("dtype", F32)
    outputs = ["output", "present_key", "present_value"] if case.get("present") else ["output"]
    model, feeds = one_node("MultiHeadAttention", mha_inputs(rng, **case), outputs, **mha_attrs(case))
    got, want = ref_run(model, feeds), ort_run(model, feeds)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert_close(g, w, dtype)


def test_multi_head_attention_4d_key_value_matches_ort():
    # key/value already split into heads, (B, N, L, H): the "past as key" cross-attention form.
    rng = np.random.default_rng(7)
    inputs = {"query": rand(rng, 2, 3, 16), "key": rand(rng, 2, 2, 6, 8), "value": rand(rng, 2, 2, 6, 8)}
    model, feeds = one_node("MultiHeadAttention", inputs, ["output"], num_heads=2)
    assert_close(ref_run(model, feeds)[0], ort_run(model, feeds)[0])


@pytest.mark.parametrize("op", ["MultiHeadAttention", "Attention"])
def test_fully_masked_rows_match_ort(op):
    # Query 0 of batch 0 has no visible key: padding hides key 0, causality keys 1... ORT drops future
    # keys outright (-inf) but only adds mask_filter_value to padded ones, so that row attends to key 0.
    rng = np.random.default_rng(28)
    mask = np.array([[0, 1, 1, 1], [1, 1, 0, 1]], np.int32)
    if op == "MultiHeadAttention":
        inputs = {**mha_inputs(rng, s=4, t=4), "key_padding_mask": mask}
    else:
        inputs = {"input": rand(rng, 2, 4, 8), "weights": rand(rng, 8, 48), "bias": rand(rng, 48), "mask_index": mask}
    model, feeds = one_node(op, inputs, ["output"], num_heads=2, unidirectional=1)
    assert_close(ref_run(model, feeds)[0], ort_run(model, feeds)[0])


@pytest.mark.parametrize("unidirectional", [0, 1])
def test_multi_head_attention_causal_flag_changes_result(unidirectional):
    # Non-vacuity: the kernel run with the other unidirectional value disagrees with ORT.
    rng = np.random.default_rng(8)
    inputs = mha_inputs(rng)
    model, feeds = one_node("MultiHeadAttention", inputs, ["output"], num_heads=2, unidirectional=unidirectional)
    flipped, _ = one_node("MultiHeadAttention", inputs, ["output"], num_heads=2, unidirectional=1 - unidirectional)
    assert_close(ref_run(model, feeds)[0], ort_run(model, feeds)[0])
    assert_differs(ref_run(flipped, feeds)[0], ort_run(model, feeds)[0])


# --------------------------------------------------------------------------- packed MultiHeadAttention vs unpacked ORT


PACKED_CASES = {
    "plain": dict(),
    "bias": dict(bias=True),
    "causal": dict(unidirectional=1),
    "mask_2d_attn_bias": dict(mask="2d", attn_bias=("B", "N"), bias=True),
    "fp16": dict(dtype=F16, bias=True),
}


@pytest.mark.parametrize("case", list(PACKED_CASES.values()), ids=list(PACKED_CASES))
def test_packed_qkv_matches_unpacked_ort(case):
    rng = np.random.default_rng(9)
    b, s, n, h = 2, 5, 2, 8
    dtype = case.get("dtype", F32)
    unpacked = mha_inputs(rng, b=b, s=s, t=s, n=n, d=n * h, **case)
    packed = np.stack([unpacked[k].reshape(b, s, n, h) for k in ("query", "key", "value")], axis=3)
    assert packed.shape == (b, s, n, 3, h)
    ref_model, ref_feeds = one_node(
        "MultiHeadAttention", {**unpacked, "query": packed, "key": None, "value": None}, ["output"], **mha_attrs(case)
    )
    ort_model, ort_feeds = one_node("MultiHeadAttention", unpacked, ["output"], **mha_attrs(case))
    assert_close(ref_run(ref_model, ref_feeds)[0], ort_run(ort_model, ort_feeds)[0], dtype)


@pytest.mark.parametrize("case", list(PACKED_CASES.values()), ids=list(PACKED_CASES))
def test_packed_kv_matches_unpacked_ort(case):
    rng = np.random.default_rng(10)
    b, s, n, h = 2, 4, 2, 8
    t = s if case.get("unidirectional") else 6  # causal needs kv length == query length
    dtype = case.get("dtype", F32)
    unpacked = mha_inputs(rng, b=b, s=s, t=t, n=n, d=n * h, **case)
    packed = np.stack([unpacked[k].reshape(b, t, n, h) for k in ("key", "value")], axis=3)
    assert packed.shape == (b, t, n, 2, h)
    ref_inputs = {**unpacked, "key": packed, "value": None}
    ref_model, ref_feeds = one_node("MultiHeadAttention", ref_inputs, ["output"], **mha_attrs(case))
    ort_model, ort_feeds = one_node("MultiHeadAttention", unpacked, ["output"], **mha_attrs(case))
    assert_close(ref_run(ref_model, ref_feeds)[0], ort_run(ort_model, ort_feeds)[0], dtype)


def test_packed_qkv_wrong_slot_order_differs():
    # Non-vacuity: packing as (K, Q, V) instead of (Q, K, V) must not pass.
    rng = np.random.default_rng(11)
    b, s, n, h = 1, 5, 2, 8
    unpacked = mha_inputs(rng, b=b, s=s, t=s, n=n, d=n * h)
    swapped = np.stack([unpacked[k].reshape(b, s, n, h) for k in ("key", "query", "value")], axis=3)
    ref_model, ref_feeds = one_node("MultiHeadAttention", {"query": swapped}, ["output"], num_heads=n)
    ort_model, ort_feeds = one_node("MultiHeadAttention", unpacked, ["output"], num_heads=n)
    assert_differs(ref_run(ref_model, ref_feeds)[0], ort_run(ort_model, ort_feeds)[0])


# --------------------------------------------------------------------------- Attention vs ORT

ATTENTION_CASES = {
    "basic": dict(),
    "causal": dict(unidirectional=1),
    "mask_2d": dict(mask="2d"),
    "mask_lengths": dict(mask="lengths"),
    "mask_start_end": dict(mask="start_end"),
    "mask_3d": dict(mask="3d"),
    "causal_mask_2d": dict(unidirectional=1, mask="2d"),
    "attn_bias": dict(attn_bias=("B", "N")),
    "attn_bias_broadcast": dict(attn_bias=("1", "1"), mask="lengths"),
    "qkv_hidden_sizes": dict(sizes=(16, 16, 24)),
    "scale_and_filter_value": dict(scale=0.5, mask="2d", mask_filter_value=-200.0),
    "present": dict(present=True, mask="2d"),
    "fp16": dict(dtype=F16, mask="2d", unidirectional=1),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES.values()), ids=list(ATTENTION_CASES))
def test_attention_matches_ort(case):
    rng = np.random.default_rng(12)
    b, s, k_in, n = 2, 6, 12, 2
    dtype = case.get("dtype", F32)
    sizes = case.get("sizes", (16, 16, 16))
    inputs = {
        "input": rand(rng, b, s, k_in, dtype=dtype),
        "weights": (rand(rng, k_in, sum(sizes)) / math.sqrt(k_in)).astype(dtype),
        "bias": rand(rng, sum(sizes), dtype=dtype),  # always given: ORT 1.31's CPU kernel crashes without it
        "mask_index": key_mask(rng, case["mask"], b, s, s) if "mask" in case else None,
        "past": None,
        "attention_bias": attention_bias(rng, case["attn_bias"], b, n, s, s, dtype) if "attn_bias" in case else None,
    }
    attrs = mha_attrs(case, n)
    if "sizes" in case:
        attrs["qkv_hidden_sizes"] = list(sizes)
    outputs = ["output", "present"] if case.get("present") else ["output"]
    model, feeds = one_node("Attention", inputs, outputs, **attrs)
    for g, w in zip(ref_run(model, feeds), ort_run(model, feeds), strict=True):
        assert g.shape == w.shape
        assert_close(g, w, dtype)


# --------------------------------------------------------------------------- GroupNorm / SkipGroupNorm vs composition


def group_norm_composition(groups, epsilon, silu, channels_last, skip=False, bias=False):
    """Standard-op GroupNorm in float32: [Add skip/bias] -> (NHWC->NCHW) -> Reshape (N, G, -1) ->
    InstanceNormalization -> Reshape back -> * gamma + beta -> [x * Sigmoid(x)] -> (NCHW->NHWC).
    Graph inputs X, gamma, beta[, skip[, bias]]; outputs Y[, S]. Returns (nodes, initializers)."""
    nodes, x = [], "X"
    if skip:
        nodes.append(helper.make_node("Add", ["X", "skip"], ["S0" if bias else "S"]))
        if bias:
            nodes.append(helper.make_node("Add", ["S0", "bias"], ["S"]))
        x = "S"
    if channels_last:
        nodes.append(helper.make_node("Transpose", [x], ["xc"], perm=[0, 3, 1, 2]))
        x = "xc"
    nodes += [
        helper.make_node("Shape", [x], ["shape"]),
        helper.make_node("Reshape", [x, "grouped_shape"], ["xg"]),
        helper.make_node("InstanceNormalization", ["xg", "ones", "zeros"], ["xn"], epsilon=epsilon),
        helper.make_node("Reshape", ["xn", "shape"], ["xr"]),
        helper.make_node("Unsqueeze", ["gamma", "hw_axes"], ["g3"]),
        helper.make_node("Unsqueeze", ["beta", "hw_axes"], ["b3"]),
        helper.make_node("Mul", ["xr", "g3"], ["xm"]),
        helper.make_node("Add", ["xm", "b3"], ["y0"]),
    ]
    y = "y0"
    if silu:
        nodes += [helper.make_node("Sigmoid", [y], ["sig"]), helper.make_node("Mul", [y, "sig"], ["y1"])]
        y = "y1"
    if channels_last:
        nodes.append(helper.make_node("Transpose", [y], ["Y"], perm=[0, 2, 3, 1]))
    else:
        nodes.append(helper.make_node("Identity", [y], ["Y"]))
    inits = [
        const("grouped_shape", np.array([0, groups, -1], np.int64)),
        const("ones", np.ones(groups, F32)),
        const("zeros", np.zeros(groups, F32)),
        const("hw_axes", np.array([1, 2], np.int64)),
    ]
    return nodes, inits


def run_composition(nodes, inits, feeds, outputs):
    feeds32 = {k: v.astype(F32) for k, v in feeds.items()}
    return ort_run(make_model(nodes, feeds32, {o: F32 for o in outputs}, inits), feeds32)


GN_SHAPES = {"2x4x4x32_g8": ((2, 4, 4, 32), 8), "1x8x8x16_g4": ((1, 8, 8, 16), 4), "1x3x5x12_g3": ((1, 3, 5, 12), 3)}


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape_groups", list(GN_SHAPES.values()), ids=list(GN_SHAPES))
@pytest.mark.parametrize("channels_last", [1, 0], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("activation", [0, 1], ids=["no_act", "silu"])
def test_group_norm_matches_composition(activation, channels_last, shape_groups, dtype):
    rng = np.random.default_rng(13)
    nhwc, groups = shape_groups
    shape = nhwc if channels_last else (nhwc[0], nhwc[3], nhwc[1], nhwc[2])
    c = nhwc[3]
    inputs = {"X": rand(rng, *shape, dtype=dtype) * 2 + 0.5, "gamma": rand(rng, c) + 1, "beta": rand(rng, c)}
    model, feeds = one_node(
        "GroupNorm", inputs, ["Y"], groups=groups, activation=activation, channels_last=channels_last, epsilon=1e-5
    )
    nodes, inits = group_norm_composition(groups, 1e-5, activation == 1, channels_last)
    assert_close(ref_run(model, feeds)[0], run_composition(nodes, inits, feeds, ["Y"])[0], dtype)


def test_group_norm_default_layout_is_nhwc_and_gamma_may_be_fp16():
    # No channels_last / epsilon attributes: NHWC and 1e-5 are the defaults.
    rng = np.random.default_rng(14)
    inputs = {"X": rand(rng, 1, 4, 4, 8), "gamma": rand(rng, 8, dtype=F16), "beta": rand(rng, 8, dtype=F16)}
    model, feeds = one_node("GroupNorm", inputs, ["Y"], groups=2, activation=0)
    nodes, inits = group_norm_composition(2, 1e-5, False, channels_last=True)
    assert_close(ref_run(model, feeds)[0], run_composition(nodes, inits, feeds, ["Y"])[0])


def test_group_norm_with_wrong_groups_differs():
    # Non-vacuity: the composition with 8 groups disagrees with the kernel run with 4.
    rng = np.random.default_rng(15)
    inputs = {"X": rand(rng, 2, 4, 4, 32) * 2 + 0.5, "gamma": rand(rng, 32) + 1, "beta": rand(rng, 32)}
    model, feeds = one_node("GroupNorm", inputs, ["Y"], groups=4, activation=1)
    nodes, inits = group_norm_composition(8, 1e-5, True, channels_last=True)
    assert_differs(ref_run(model, feeds)[0], run_composition(nodes, inits, feeds, ["Y"])[0])


SKIP_SHAPES = {
    "NHWC": lambda n, h, w, c: (n, h, w, c),
    "N11C": lambda n, h, w, c: (n, 1, 1, c),
    "NC": lambda n, h, w, c: (n, c),
}


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("skip_shape", list(SKIP_SHAPES))
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("activation", [0, 1], ids=["no_act", "silu"])
def test_skip_group_norm_matches_composition(activation, with_bias, skip_shape, dtype):
    rng = np.random.default_rng(16)
    n, h, w, c, groups = 2, 4, 4, 32, 8
    skip = rand(rng, *SKIP_SHAPES[skip_shape](n, h, w, c), dtype=dtype)
    inputs = {
        "X": rand(rng, n, h, w, c, dtype=dtype) + 0.5,
        "gamma": rand(rng, c) + 1,
        "beta": rand(rng, c),
        "skip": skip,
        "bias": rand(rng, c, dtype=dtype) if with_bias else None,
    }
    model, feeds = one_node("SkipGroupNorm", inputs, ["Y", "S"], groups=groups, activation=activation, epsilon=1e-5)
    nodes, inits = group_norm_composition(groups, 1e-5, activation == 1, True, skip=True, bias=with_bias)
    comp_feeds = {**feeds, "skip": skip.reshape(n, 1, 1, c) if skip.ndim == 2 else skip}
    for got, want in zip(ref_run(model, feeds), run_composition(nodes, inits, comp_feeds, ["Y", "S"]), strict=True):
        assert got.shape == (n, h, w, c)
        assert_close(got, want, dtype)


def test_skip_group_norm_without_sum_output():
    rng = np.random.default_rng(17)
    inputs = {"X": rand(rng, 1, 2, 2, 8), "gamma": rand(rng, 8), "beta": rand(rng, 8), "skip": rand(rng, 1, 8)}
    model, feeds = one_node("SkipGroupNorm", inputs, ["Y"], groups=4, activation=0)
    nodes, inits = group_norm_composition(4, 1e-5, False, True, skip=True)
    want = run_composition(nodes, inits, {**feeds, "skip": feeds["skip"].reshape(1, 1, 1, 8)}, ["Y"])[0]
    assert_close(ref_run(model, feeds)[0], want)


# --------------------------------------------------------------------------- BiasSplitGelu / BiasAdd vs composition


def bias_split_gelu_composition(gate_right=True):
    """Add bias -> Split in halves -> left * Gelu(right), Gelu(x) = 0.5 * x * (1 + Erf(x / sqrt(2)))."""
    a, g = ("left", "right") if gate_right else ("right", "left")
    nodes = [
        helper.make_node("Add", ["X", "bias"], ["xb"]),
        helper.make_node("Split", ["xb"], ["left", "right"], axis=-1),
        helper.make_node("Mul", [g, "inv_sqrt2"], ["gs"]),
        helper.make_node("Erf", ["gs"], ["ge"]),
        helper.make_node("Add", ["ge", "one"], ["g1"]),
        helper.make_node("Mul", [g, "g1"], ["g2"]),
        helper.make_node("Mul", ["g2", "half"], ["gelu"]),
        helper.make_node("Mul", [a, "gelu"], ["Y"]),
    ]
    inits = [
        const("inv_sqrt2", np.array(1 / math.sqrt(2), F32)),
        const("one", np.array(1, F32)),
        const("half", np.array(0.5, F32)),
    ]
    return nodes, inits


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(2, 16, 64), (1, 5, 20)], ids=["2x16x64", "1x5x20"])
def test_bias_split_gelu_matches_composition(shape, dtype):
    rng = np.random.default_rng(18)
    inputs = {"X": rand(rng, *shape, dtype=dtype) * 2, "bias": rand(rng, shape[-1], dtype=dtype)}
    model, feeds = one_node("BiasSplitGelu", inputs, ["Y"])
    got = ref_run(model, feeds)[0]
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    assert_close(got, run_composition(*bias_split_gelu_composition(), feeds, ["Y"])[0], dtype)


def test_bias_split_gelu_gates_the_right_half():
    # Non-vacuity: gating the left half instead is a different function.
    rng = np.random.default_rng(19)
    model, feeds = one_node("BiasSplitGelu", {"X": rand(rng, 1, 4, 16) * 2, "bias": rand(rng, 16)}, ["Y"])
    gate_left = run_composition(*bias_split_gelu_composition(gate_right=False), feeds, ["Y"])[0]
    assert_differs(ref_run(model, feeds)[0], gate_left)


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_bias_add_matches_composition(dtype):
    rng = np.random.default_rng(20)
    inputs = {
        "X": rand(rng, 2, 16, 40, dtype=dtype),
        "bias": rand(rng, 40, dtype=dtype),
        "skip": rand(rng, 2, 16, 40, dtype=dtype),
    }
    model, feeds = one_node("BiasAdd", inputs, ["Y"])
    nodes = [helper.make_node("Add", ["X", "bias"], ["xb"]), helper.make_node("Add", ["xb", "skip"], ["Y"])]
    assert_close(ref_run(model, feeds)[0], run_composition(nodes, [], feeds, ["Y"])[0], dtype)


# --------------------------------------------------------------------------- NhwcConv vs Transpose + Conv + Transpose

CONV_CASES = {
    "3x3_pad1": dict(k=(3, 3), attrs=dict(pads=[1, 1, 1, 1])),
    "3x3_stride2": dict(k=(3, 3), attrs=dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    "3x3_dilation2": dict(k=(3, 3), attrs=dict(pads=[2, 2, 2, 2], dilations=[2, 2])),
    "asym_pads_kernel_shape": dict(k=(2, 3), attrs=dict(pads=[0, 1, 1, 2], kernel_shape=[2, 3])),
    "group2": dict(k=(3, 3), group=2, attrs=dict(pads=[1, 1, 1, 1], group=2)),
    "depthwise": dict(k=(3, 3), group=8, m=8, attrs=dict(pads=[1, 1, 1, 1], group=8)),
    "same_upper_stride2": dict(k=(3, 3), attrs=dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    "1x1_no_bias": dict(k=(1, 1), bias=False, attrs={}),
    "fp16": dict(k=(3, 3), dtype=F16, attrs=dict(pads=[1, 1, 1, 1])),
}


def nhwc_conv_inputs(rng, case):
    n, h, w, c = 2, 7, 6, 8
    m, group, dtype = case.get("m", 12), case.get("group", 1), case.get("dtype", F32)
    return {
        "X": rand(rng, n, h, w, c, dtype=dtype),
        "W": (rand(rng, m, *case["k"], c // group) / 4).astype(dtype),  # (M, kH, kW, C/group)
        "B": rand(rng, m, dtype=dtype) if case.get("bias", True) else None,
    }


def conv_composition(attrs, with_bias):
    return [
        helper.make_node("Transpose", ["X"], ["xc"], perm=[0, 3, 1, 2]),
        helper.make_node("Transpose", ["W"], ["wc"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["xc", "wc", "B"] if with_bias else ["xc", "wc"], ["yc"], **attrs),
        helper.make_node("Transpose", ["yc"], ["Y"], perm=[0, 2, 3, 1]),
    ]


@pytest.mark.parametrize("case", list(CONV_CASES.values()), ids=list(CONV_CASES))
def test_nhwc_conv_matches_transposed_conv(case):
    rng = np.random.default_rng(21)
    inputs = nhwc_conv_inputs(rng, case)
    model, feeds = one_node("NhwcConv", inputs, ["Y"], **case["attrs"])
    got = ref_run(model, feeds)[0]
    want = run_composition(conv_composition(case["attrs"], inputs["B"] is not None), [], feeds, ["Y"])[0]
    assert got.shape == want.shape
    assert_close(got, want, case.get("dtype", F32))


def test_nhwc_conv_weight_layout_matters():
    # Non-vacuity: the same weights read as an NCHW filter (M, C, kH, kW) give another result.
    rng = np.random.default_rng(22)
    x, w = rand(rng, 1, 5, 5, 3), rand(rng, 4, 3, 3, 3)
    model, feeds = one_node("NhwcConv", {"X": x, "W": w}, ["Y"], pads=[1, 1, 1, 1])
    nodes = [
        helper.make_node("Transpose", ["X"], ["xc"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["xc", "W"], ["yc"], pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["yc"], ["Y"], perm=[0, 2, 3, 1]),
    ]
    assert_differs(ref_run(model, feeds)[0], run_composition(nodes, [], feeds, ["Y"])[0])


# --------------------------------------------------------------------------- a small fused graph end to end


def test_fused_graph_runs_through_reference_run(tmp_path):
    """NhwcConv -> GroupNorm(SiLU) -> BiasAdd chain, via run() on a saved model path."""
    rng = np.random.default_rng(23)
    n, h, w, c = 1, 4, 4, 16
    weights = {
        "W": rand(rng, c, 3, 3, c) / 8,
        "B": rand(rng, c),
        "gamma": rand(rng, c) + 1,
        "beta": rand(rng, c),
        "bias": rand(rng, c),
    }
    nodes = [
        helper.make_node("NhwcConv", ["X", "W", "B"], ["conv"], domain=MS, pads=[1, 1, 1, 1]),
        helper.make_node("GroupNorm", ["conv", "gamma", "beta"], ["gn"], domain=MS, groups=4, activation=1),
        helper.make_node("Reshape", ["gn", "nsc"], ["gn3"]),
        helper.make_node("Reshape", ["X", "nsc"], ["x3"]),
        helper.make_node("BiasAdd", ["gn3", "bias", "x3"], ["Y"], domain=MS),
    ]
    inits = [const(k, v) for k, v in weights.items()] + [const("nsc", np.array([n, h * w, c], np.int64))]
    x = rand(rng, n, h, w, c)
    model = make_model(nodes, {"X": x}, {"Y": F32}, inits)
    path = tmp_path / "fused.onnx"
    onnx.save(model, path)
    got = reference.run(path, {"X": x})
    assert list(got) == ["Y"]

    # The same computation with standard ops only.
    conv_feeds = {"X": x, "W": weights["W"], "B": weights["B"]}
    conv = run_composition(conv_composition({"pads": [1, 1, 1, 1]}, True), [], conv_feeds, ["Y"])[0]
    gn_nodes, gn_inits = group_norm_composition(4, 1e-5, True, True)
    gn = run_composition(gn_nodes, gn_inits, {"X": conv, "gamma": weights["gamma"], "beta": weights["beta"]}, ["Y"])[0]
    want = gn.reshape(n, h * w, c) + weights["bias"] + x.reshape(n, h * w, c)
    assert_close(got["Y"], want)


def test_unbound_optional_outputs_do_not_leak_into_omitted_inputs():
    # The first node leaves mean/inv_std_var unbound (""), the second omits beta (""): the evaluator
    # resolves both through the name "", so a stored output would reach the second node as its beta.
    rng = np.random.default_rng(29)
    x, skip, gamma, bias = rand(rng, 1, 3, 8), rand(rng, 1, 3, 8), rand(rng, 8), rand(rng, 8)
    nodes = [
        helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma"], ["out", "", "", "sum"], domain=MS),
        helper.make_node("SkipLayerNormalization", ["out", "sum", "gamma", "", "bias"], ["y"], domain=MS),
    ]
    feeds = {"x": x, "skip": skip, "gamma": gamma, "bias": bias}
    model = make_model(nodes, feeds, {"y": F32})
    assert_close(ref_run(model, feeds)[0], ort_run(model, feeds)[0])


def test_unbound_outputs_of_standard_ops_do_not_leak_either():
    # Same hazard with stock ops: LayerNormalization's unbound mean would become Clip's min.
    rng = np.random.default_rng(30)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma"], ["y", "", "inv_std"]),
        helper.make_node("Clip", ["y", "", "hi"], ["z"]),
    ]
    feeds = {"x": rand(rng, 3, 8), "gamma": rand(rng, 8), "hi": np.array(0.5, F32)}
    model = make_model(nodes, feeds, {"z": F32})
    assert_close(ref_run(model, feeds)[0], ort_run(model, feeds)[0])


def test_evaluator_and_output_selection():
    rng = np.random.default_rng(24)
    inputs = {"input": rand(rng, 1, 2, 8), "skip": rand(rng, 1, 2, 8), "gamma": rand(rng, 8)}
    model, feeds = one_node("SkipLayerNormalization", inputs, ["out", "", "", "sum"])
    ev = reference.evaluator(model)
    assert isinstance(ev, ReferenceEvaluator)
    only_sum = reference.run(model, feeds, output_names=["sum"])
    assert list(only_sum) == ["sum"]
    np.testing.assert_allclose(only_sum["sum"], inputs["input"] + inputs["skip"], rtol=1e-6)
    assert {cls.__name__ for cls in reference.CONTRIB_OPS} == {
        "GroupNorm", "SkipGroupNorm", "SkipLayerNormalization", "BiasSplitGelu", "BiasAdd", "FastGelu",
        "BiasGelu", "QuickGelu", "Gelu", "NhwcConv", "MultiHeadAttention", "Attention", "GemmFloat8",
        "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
    }  # fmt: skip
    # ONNX Runtime registers SimplifiedLayerNormalization in the ONNX domain; the rest are com.microsoft
    assert {cls.__name__ for cls in reference.CONTRIB_OPS if cls.op_domain != MS} == {"SimplifiedLayerNormalization"}


# --------------------------------------------------------------------------- rejected features raise clearly


def _gn_inputs():
    return {"X": np.zeros((1, 2, 2, 4), F32), "gamma": np.ones(4, F32), "beta": np.zeros(4, F32)}


def _mha_inputs(**extra):
    rng = np.random.default_rng(25)
    return {**mha_inputs(rng, b=1, s=3, t=3), **extra}


def _attention_inputs(**extra):
    rng = np.random.default_rng(26)
    base = {"input": rand(rng, 1, 3, 4), "weights": rand(rng, 4, 12), "bias": rand(rng, 12)}
    return {**base, **extra}


REJECTED = {
    "SkipGroupNorm_nchw": (
        lambda: one_node("SkipGroupNorm", {**_gn_inputs(), "skip": np.zeros((1, 4), F32)}, ["Y"], groups=2, activation=0,
                         channels_last=0), r"channels_last=0"),
    "MHA_past_key": (
        lambda: one_node("MultiHeadAttention", _mha_inputs(past_key=np.zeros((1, 2, 1, 8), F32),
                                                           past_value=np.zeros((1, 2, 1, 8), F32)),
                         ["output"], num_heads=2), r"'past_key'"),
    "MHA_qk_output": (
        lambda: one_node("MultiHeadAttention", _mha_inputs(), ["output", "", "", "qk"], num_heads=2), r"'qk'"),
    "MHA_mask_3B+2": (
        lambda: one_node("MultiHeadAttention", _mha_inputs(key_padding_mask=np.zeros(5, np.int32)), ["output"], num_heads=2),
        r"3 \* batch_size \+ 2"),
    "MHA_causal_cross_attention": (
        lambda: one_node("MultiHeadAttention", _mha_inputs(key=np.zeros((1, 4, 16), F32), value=np.zeros((1, 4, 16), F32)),
                         ["output"], num_heads=2, unidirectional=1), r"unidirectional=1 with kv_sequence_length"),
    "MHA_bias_with_4d_kv": (
        lambda: one_node("MultiHeadAttention", {"query": np.zeros((1, 3, 16), F32), "key": np.zeros((1, 2, 3, 8), F32),
                                                "value": np.zeros((1, 2, 3, 8), F32), "bias": np.zeros(48, F32)},
                         ["output"], num_heads=2), r"bias together with 4-D"),
    "Attention_do_rotary": (
        lambda: one_node("Attention", _attention_inputs(), ["output"], num_heads=2, do_rotary=1), r"do_rotary=1"),
    "Attention_past": (
        lambda: one_node("Attention", _attention_inputs(mask_index=None, past=np.zeros((2, 1, 2, 1, 2), F32)), ["output"],
                         num_heads=2), r"past state"),
    "Attention_share_buffer": (
        lambda: one_node("Attention", _attention_inputs(), ["output"], num_heads=2, past_present_share_buffer=1),
        r"past_present_share_buffer=1"),
    "Attention_4d_mask": (
        lambda: one_node("Attention", _attention_inputs(mask_index=np.ones((1, 1, 3, 3), np.int32)), ["output"],
                         num_heads=2),
        r"mask_index of shape \(1, 1, 3, 3\)"),
}  # fmt: skip


@pytest.mark.parametrize("build, message", list(REJECTED.values()), ids=list(REJECTED))
def test_rejected_features_raise_not_implemented(build, message):
    model, feeds = build()
    with pytest.raises(NotImplementedError, match=message) as err:
        reference.run(model, feeds)
    assert "com.microsoft." in str(err.value)


INVALID = {
    "GroupNorm_missing_groups": (
        lambda: one_node("GroupNorm", _gn_inputs(), ["Y"], activation=0), r"required attribute 'groups'"),
    "GroupNorm_activation_2": (
        lambda: one_node("GroupNorm", _gn_inputs(), ["Y"], groups=2, activation=2), r"activation must be 0 \(none\) or 1"),
    "GroupNorm_groups_not_dividing_C": (
        lambda: one_node("GroupNorm", _gn_inputs(), ["Y"], groups=3, activation=0), r"groups=3 must divide"),
    "SkipGroupNorm_skip_shape": (
        lambda: one_node("SkipGroupNorm", {**_gn_inputs(), "skip": np.zeros((1, 2, 1, 4), F32)}, ["Y"], groups=2,
                         activation=0), r"skip must be"),
    "BiasSplitGelu_odd_width": (
        lambda: one_node("BiasSplitGelu", {"X": np.zeros((1, 2, 5), F32), "bias": np.zeros(5, F32)}, ["Y"]), r"even D"),
    "MHA_packed_qkv_with_key": (
        lambda: one_node("MultiHeadAttention", {"query": np.zeros((1, 3, 2, 3, 8), F32), "key": np.zeros((1, 3, 16), F32)},
                         ["output"], num_heads=2), r"key and value must be absent"),
    "MHA_attention_bias_shape": (
        lambda: one_node("MultiHeadAttention", _mha_inputs(attention_bias=np.zeros((1, 3, 3, 3), F32)), ["output"],
                         num_heads=2), r"attention_bias must be"),
    "Attention_qkv_hidden_sizes": (
        lambda: one_node("Attention", _attention_inputs(), ["output"], num_heads=2, qkv_hidden_sizes=[4, 2, 6]),
        r"qkv_hidden_sizes \[4, 2, 6\]"),
}  # fmt: skip


@pytest.mark.parametrize("build, message", list(INVALID.values()), ids=list(INVALID))
def test_invalid_inputs_raise_value_error(build, message):
    model, feeds = build()
    with pytest.raises(ValueError, match=message) as err:
        reference.run(model, feeds)
    assert "com.microsoft." in str(err.value)


# --------------------------------------------------------------------------- unsupported_on_ort_cpu


def _node_model(op_type, inputs, domain=MS):
    return helper.make_model(helper.make_graph([helper.make_node(op_type, inputs, ["y"], domain=domain)], "g", [], []))


UNSUPPORTED = {
    "GroupNorm": (_node_model("GroupNorm", ["x", "g", "b"]), {"com.microsoft.GroupNorm"}),
    "SkipGroupNorm": (_node_model("SkipGroupNorm", ["x", "g", "b", "s"]), {"com.microsoft.SkipGroupNorm"}),
    "BiasSplitGelu": (_node_model("BiasSplitGelu", ["x", "b"]), {"com.microsoft.BiasSplitGelu"}),
    "BiasAdd": (_node_model("BiasAdd", ["x", "b", "s"]), {"com.microsoft.BiasAdd"}),
    "NhwcConv": (_node_model("NhwcConv", ["x", "w"]), {"com.microsoft.NhwcConv"}),
    "MHA_unpacked": (_node_model("MultiHeadAttention", ["q", "k", "v"]), set()),
    "MHA_packed_qkv": (_node_model("MultiHeadAttention", ["qkv"]), {"com.microsoft.MultiHeadAttention"}),
    "MHA_packed_qkv_with_bias": (
        _node_model("MultiHeadAttention", ["qkv", "", "", "bias"]), {"com.microsoft.MultiHeadAttention"}),
    "MHA_packed_kv": (_node_model("MultiHeadAttention", ["q", "kv"]), {"com.microsoft.MultiHeadAttention"}),
    "Attention_with_bias": (_node_model("Attention", ["x", "w", "b"]), set()),
    "Attention_without_bias": (_node_model("Attention", ["x", "w"]), {"com.microsoft.Attention"}),
    "SkipLayerNormalization": (_node_model("SkipLayerNormalization", ["x", "s", "g"]), set()),
    "FastGelu": (_node_model("FastGelu", ["x"]), set()),
    "standard_GroupNormalization": (_node_model("GroupNormalization", ["x", "s", "b"], domain=""), set()),
}


@pytest.mark.parametrize("model, expected", list(UNSUPPORTED.values()), ids=list(UNSUPPORTED))
def test_unsupported_on_ort_cpu(model, expected):
    assert reference.unsupported_on_ort_cpu(model) == expected


def test_unsupported_on_ort_cpu_uses_ranks_and_subgraphs():
    q5 = helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 2, 2, 3, 4])
    mha = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["y"], domain=MS, num_heads=2)
    model = helper.make_model(helper.make_graph([mha], "g", [q5], []))
    assert reference.unsupported_on_ort_cpu(model) == {"com.microsoft.MultiHeadAttention"}

    then = helper.make_graph([helper.make_node("BiasAdd", ["x", "b", "s"], ["t"], domain=MS)], "then", [], [])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [])
    gn = helper.make_node("GroupNorm", ["x", "g", "b"], ["z"], domain=MS)
    cond = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
    model = helper.make_model(helper.make_graph([gn, cond], "g", [], []))
    assert reference.unsupported_on_ort_cpu(model) == {"com.microsoft.GroupNorm", "com.microsoft.BiasAdd"}


UNRUNNABLE = {  # each node form unsupported_on_ort_cpu reports (Attention without bias would crash the process)
    "GroupNorm": lambda rng: one_node("GroupNorm", {"X": rand(rng, 1, 2, 2, 8), "gamma": rand(rng, 8), "beta": rand(rng, 8)},
                                      ["Y"], groups=2, activation=0),
    "SkipGroupNorm": lambda rng: one_node("SkipGroupNorm", {"X": rand(rng, 1, 2, 2, 8), "gamma": rand(rng, 8),
                                                            "beta": rand(rng, 8), "skip": rand(rng, 1, 2, 2, 8)},
                                          ["Y"], groups=2, activation=0),
    "BiasSplitGelu": lambda rng: one_node("BiasSplitGelu", {"X": rand(rng, 1, 2, 8), "bias": rand(rng, 8)}, ["Y"]),
    "BiasAdd": lambda rng: one_node("BiasAdd", {"X": rand(rng, 1, 2, 8), "bias": rand(rng, 8), "skip": rand(rng, 1, 2, 8)},
                                    ["Y"]),
    "NhwcConv": lambda rng: one_node("NhwcConv", {"X": rand(rng, 1, 3, 3, 4), "W": rand(rng, 2, 1, 1, 4)}, ["Y"]),
    "MHA_packed_qkv": lambda rng: one_node("MultiHeadAttention", {"query": rand(rng, 1, 3, 2, 3, 4)}, ["output"],
                                           num_heads=2),
    "MHA_packed_kv": lambda rng: one_node("MultiHeadAttention",
                                          {"query": rand(rng, 1, 3, 8), "key": rand(rng, 1, 3, 2, 2, 4)},
                                          ["output"], num_heads=2),
}  # fmt: skip


@pytest.mark.parametrize("build", list(UNRUNNABLE.values()), ids=list(UNRUNNABLE))
def test_reported_forms_really_fail_on_ort_cpu(build):
    """Keeps unsupported_on_ort_cpu honest for the installed ORT; if this starts failing, ORT's CPU EP
    gained a kernel: drop the form from the set and compare the kernel with ORT directly."""
    model, feeds = build(np.random.default_rng(27))
    assert reference.unsupported_on_ort_cpu(model)
    with pytest.raises(Exception, match=r"NOT_IMPLEMENTED|not implemented"):
        ort_run(model, feeds)
    reference.run(model, feeds)  # ... while the reference kernel runs it
