"""Claims about the dynamo exporter's newer opsets (``models.OPSET_VARIANTS``) and onnxopt on them.

On real tiny exports (``@pytest.mark.models``), every family of ``models/`` at opset 23, all but the
SDXL UNet at 21, and the UNet and a text encoder at 18 and 24 (``CASES`` says why):

* What the exporter writes, counted against the torch modules (``built.sites``): at 23 and 24 every
  attention module is one ONNX ``Attention`` (no Softmax left); from 21 every nn.GroupNorm is one
  ``GroupNormalization`` (before, Reshape-InstanceNormalization-Reshape); from 20 every GELU is one
  ``Gelu`` (before, an Erf chain); every nn.LayerNorm is one ``LayerNormalization`` at all of them,
  and no family writes ``RMSNormalization``.
* ``ort-cuda`` fuses every site of each: each attention module becomes one MultiHeadAttention or
  Attention (self and cross counted apart; at 23+ through canonicalize-attention's lowering of the
  ONNX op, CLIP's boolean causal mask proven causal), each GroupNorm one GroupNorm or SkipGroupNorm,
  each GEGLU is matched by fuse-bias-split-gelu (and refused for the kernel's hidden sizes on these
  tiny models, as at every other opset), each LayerNorm stays one (Skip)LayerNormalization; the
  fused graph computes what the export computes (fused ops on onnxopt's reference kernels).
* ``tensorrt`` at 23 keeps GroupNormalization-21 and writes attention as MatMul-Softmax-MatMul with
  the scale on Q (the form TensorRT's MHA fusion reads), no com.microsoft op.
* ``fp16`` reads the opset-23 schemas: alone, it keeps ONNX Attention and GroupNormalization-21 in
  float16 on ORT's CPU EP; after ``ort-cuda`` too; both within the README's bound of float32.

On hand-built graphs: the lowering of ONNX Attention computes what Attention computes (ORT's CPU EP
runs Attention-23) for a custom scale, a float mask, softmax_precision and is_causal, and refuses what it
cannot express, with the reason (is_causal with query and key lengths not proven equal among them).

On CLIP text encoders whose SDPA got no mask (transformers skips it where it can and lets SDPA's
is_causal do the work; the export then carries ``Attention(is_causal=1)``): every attention becomes a
MultiHeadAttention/Attention with ``unidirectional=1``, computing what the export computes.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from models import FAMILIES, OPSET_VARIANTS
from models.coverage import KERNEL_REFUSAL
from onnxopt import optimize
from onnxopt.verify import InputSpec, assert_same_computation
from tests.conftest import result_of

# Every family at 23 (ONNX Attention) and 21 (GroupNormalization-21, Gelu; the SDXL UNet, the slowest
# export, only at 23: at 21 it has the SD UNets' forms). Opset 18 differs from the exporter's default
# (20, every family in EXPORT_VARIANTS) only by GELU as an Erf chain, and 24 from 23 only by
# Attention's version: each on the UNet and a text encoder. Exports are most of the time (the 54
# tests: 197 s on a shared 2-core machine, 183 s of it exporting);
# `python -m models coverage --variants dynamo-dynamic-sdpa-18 ...` covers every family at every
# opset (benchmarks/results/coverage-tiny.md).
CASES = ([(family, 23) for family in FAMILIES] + [(family, 21) for family in FAMILIES if family != "unet-sdxl"]
         + [("unet-sd15", 18), ("openclip-text", 18), ("unet-sd15", 24), ("clip-text", 24)])
CONTRIB = "com.microsoft"


def _params():
    variant = {v[3]: v for v in OPSET_VARIANTS}
    return [pytest.param(family, variant[opset], marks=pytest.mark.models, id=f"{family}-opset{opset}")
            for family, opset in CASES]


def ops(model) -> Counter:
    return Counter(n.op for n in model.graph.nodes if n.domain in ("", "ai.onnx", None))


def contrib_ops(model) -> Counter:
    return Counter(n.op for n in model.graph.nodes if n.domain == CONTRIB)


# ---------------------------------------------------------------- real exports


@pytest.mark.parametrize("family, variant", _params())
def test_the_export_writes_the_opsets_fused_ops_one_per_torch_module(export_tiny, family, variant):
    exported = export_tiny(family, *variant)
    opset, sites = variant[3], exported.sites
    written = Counter(n.op_type for n in onnx.load(str(exported.path), load_external_data=False).graph.node)
    assert written["Attention"] == (sites["attention"] if opset >= 23 else 0)
    assert written["Softmax"] == (0 if opset >= 23 else sites["attention"])
    assert written["GroupNormalization"] == (sites["group_norm"] if opset >= 21 else 0)
    assert written["InstanceNormalization"] == (0 if opset >= 21 else sites["group_norm"])
    gelus = sites["geglu"] + sites["gelu"]
    assert (written["Gelu"], written["Erf"]) == ((gelus, 0) if opset >= 20 else (0, gelus))
    assert written["LayerNormalization"] == sites["layer_norm"]
    assert written["RMSNormalization"] == 0


@pytest.mark.parametrize("family, variant", _params())
def test_ort_cuda_fuses_every_site_and_computes_the_same(export_tiny, family, variant):
    exported = export_tiny(family, *variant)
    opset, sites = variant[3], exported.sites
    model, report = optimize(exported.path, ["ort-cuda"])

    attention = result_of(report, "fuse-attention")
    assert attention.refused == []
    assert attention.sites_rewritten == sites["attention"]
    assert attention.details.get("self", 0) == sites["attention_self"]
    assert attention.details.get("cross", 0) == sites["attention_cross"]
    lowered = result_of(report, "canonicalize-attention").details.get("onnx-attention", 0)
    assert lowered == (sites["attention"] if opset >= 23 else 0)
    fused = contrib_ops(model)
    assert fused["MultiHeadAttention"] + fused["Attention"] == sites["attention"]
    assert fused["GroupNorm"] + fused["SkipGroupNorm"] == sites["group_norm"]
    gelu = result_of(report, "fuse-bias-split-gelu")
    kernel_refused = sum(1 for _, reason in gelu.refused if KERNEL_REFUSAL in reason)
    assert gelu.sites_matched == sites["geglu"] == gelu.sites_rewritten + kernel_refused
    assert ops(model)["LayerNormalization"] + fused["SkipLayerNormalization"] == sites["layer_norm"]
    left = ops(model)
    assert left["Attention"] == left["Softmax"] == left["GroupNormalization"] == left["InstanceNormalization"] == 0
    inputs = InputSpec(shapes={n: tuple(s) for n, s in exported.built.input_shapes().items()})
    assert_same_computation(exported.path, model, atol=1e-5, rtol=1e-4, inputs=inputs)


OPSET_23 = next(v for v in OPSET_VARIANTS if v[3] == 23)


@pytest.mark.models
@pytest.mark.parametrize("family", ["unet-sd15", "clip-text"])
def test_tensorrt_keeps_group_normalization_and_lowers_onnx_attention_with_the_scale_on_q(export_tiny, family):
    exported = export_tiny(family, *OPSET_23)
    sites = exported.sites
    model, report = optimize(exported.path, ["tensorrt"])
    assert not contrib_ops(model)
    left = ops(model)
    assert left["GroupNormalization"] == sites["group_norm"] and model.opset == 23
    assert left["Attention"] == 0 and left["Softmax"] == sites["attention"]
    assert result_of(report, "trt-attention-scale").sites_rewritten == sites["attention"]
    inputs = InputSpec(shapes={n: tuple(s) for n, s in exported.built.input_shapes().items()})
    assert_same_computation(exported.path, model, atol=1e-5, rtol=1e-4, inputs=inputs)


@pytest.mark.models
@pytest.mark.parametrize("passes", [["fp16"], ["ort-cuda", "fp16"]], ids=["fp16", "ort-cuda,fp16"])
def test_fp16_reads_the_opset_23_schemas_and_stays_within_the_bound(export_tiny, passes):
    from tests.test_fp16 import ERROR_BOUND, assert_valid, assert_within_bound, elem_types, errors, run
    from tests.test_fp16_matrix import fp32_reference, mask_constants_are_finite

    exported = export_tiny("unet-sd15", *OPSET_23)
    model, _ = optimize(exported.path, passes)
    proto, session = assert_valid(model)
    types = elem_types(proto)
    kept = [n for n in proto.graph.node if n.op_type in ("Attention", "GroupNormalization", "MultiHeadAttention", "GroupNorm")]
    assert kept
    assert all(types[n.input[0]] == TensorProto.FLOAT16 for n in kept), [n.name for n in kept if types[n.input[0]] != TensorProto.FLOAT16]
    if passes == ["fp16"]:
        assert session is not None, "ORT's CPU EP runs Attention-23 and GroupNormalization-21 in float16"
        assert Counter(n.op_type for n in kept) == {"Attention": exported.sites["attention"], "GroupNormalization": exported.sites["group_norm"]}
    mask_constants_are_finite(proto)
    feeds, expected = fp32_reference(exported)
    assert_within_bound(errors(expected, run(proto, feeds, session)), ERROR_BOUND)


# ---------------------------------------------------------------- hand-built ONNX Attention


def attention_model(*, shape=(2, 3, 5, 8), kv_shape=None, mask=None, opset=23, outputs=1, **attrs):
    """q, k, v (B, N, S, H) graph inputs -> Attention(q, k, v [, mask]) -> y."""
    kv_shape = kv_shape or shape
    inits, inputs = [], ["q", "k", "v"]
    if mask is not None:
        inits.append(onnx.numpy_helper.from_array(mask, "mask"))
        inputs.append("mask")
    names = ["y", "present_key", "present_value"][:outputs]
    node = helper.make_node("Attention", inputs, names, name="attn", **attrs)
    graph = helper.make_graph(
        [node], "attention",
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, list(shape))]
        + [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(kv_shape)) for n in "kv"],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def lowered(proto):
    model, report = optimize(proto, ["infer-shapes", "canonicalize-attention"])
    return model, result_of(report, "canonicalize-attention")


@pytest.mark.parametrize("attrs, mask", [
    ({}, None),
    ({"scale": 0.3}, None),
    ({}, np.random.default_rng(0).standard_normal((5, 5)).astype(np.float32)),
    ({"softmax_precision": TensorProto.DOUBLE}, np.full((2, 1, 5, 5), -1e9, np.float32)),
    ({"is_causal": 1}, None),
    ({"is_causal": 1, "scale": 0.3, "softmax_precision": TensorProto.DOUBLE}, None),
], ids=["default-scale", "scale", "float-mask", "softmax-precision-double", "causal", "causal-scale-double"])
def test_onnx_attention_is_lowered_to_matmul_softmax_computing_what_attention_computes(attrs, mask):
    proto = attention_model(mask=mask, **attrs)
    model, result = lowered(proto)
    assert result.details.get("onnx-attention") == 1 and result.refused == []
    left = ops(model)
    assert left["Attention"] == 0 and left["Softmax"] == 1 and left["MatMul"] == 2
    assert_same_computation(proto, model, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("make, reason", [
    (lambda: attention_model(is_causal=1, kv_shape=(2, 3, 7, 8)), "query length (5) and key length (7) not proven equal"),
    (lambda: attention_model(is_causal=1, mask=np.zeros((5, 5), np.float32)), "is_causal=1 with attn_mask"),
    (lambda: attention_model(softcap=30.0), "softcap=30.0"),
    (lambda: attention_model(kv_shape=(2, 1, 5, 8)), "grouped-query attention"),
    (lambda: attention_model(shape=(2, 5, 24), q_num_heads=3, kv_num_heads=3), "only 4-D"),
    (lambda: attention_model(outputs=2), "output 1 ('present_key'"),
    (lambda: attention_model(mask=np.tril(np.ones((5, 5), bool))), "boolean and not proven causal"),
    (lambda: attention_model(mask=np.zeros((5, 3), np.float32)), "not proven to be the key length"),
    (lambda: attention_model(mask=np.full((5, 5), -np.inf, np.float32)), "may hold -inf"),
], ids=["causal-q-len-not-kv-len", "causal-with-mask", "softcap", "gqa", "3d", "present-key-read", "bool-mask", "short-mask", "inf-mask"])
def test_attention_forms_the_lowering_cannot_express_are_refused_and_kept(make, reason):
    proto = make()
    model, result = lowered(proto)
    assert result.sites_rewritten == 0
    assert len(result.refused) == 1 and reason in result.refused[0][1], result.refused
    assert ops(model)["Attention"] == 1


def test_the_causal_lowering_is_the_mask_fuse_attention_proves_causal():
    from onnxopt.attention_masks import is_causal
    from onnxopt.pattern.dims import Dim, Dims

    model, _ = lowered(attention_model(is_causal=1))
    (add,) = [n for n in model.graph.nodes if n.op == "Add"]
    mask = next(t for t in add.inputs if t.inputs and t.inputs[0].op == "Where")
    q_len = model.graph.inputs[0].shape[2]
    assert is_causal(model.graph, mask, Dims(), {Dim(q_len)})


@pytest.fixture(scope="module")
def causal_sdpa_export(tmp_path_factory):
    """export(family) -> (path, built): the dynamo export at opset 23 of a text encoder whose
    transformers SDPA call got no mask and is_causal=True (transformers skips the mask outside
    torch.export; here the skip is forced so that the exporter sees that call)."""
    pytest.importorskip("torch", reason="exporting models needs torch")
    pytest.importorskip("transformers", reason="exporting models needs transformers")
    from unittest import mock

    import transformers.masking_utils as masking
    from models import build
    from models.export import export

    root, cache = tmp_path_factory.mktemp("causal-sdpa"), {}

    def skip_mask(padding_mask, q_length, kv_length, *args, **kwargs):
        return padding_mask is None and q_length == kv_length

    def get(family):
        if family not in cache:
            built = build(family, size="tiny")
            path = root / f"{family}.onnx"
            with mock.patch.object(masking, "_ignore_causal_mask_sdpa", skip_mask):
                export(built, path, exporter="dynamo", shapes="dynamic", opset=23)
            cache[family] = path, built
        return cache[family]

    return get


@pytest.mark.models
@pytest.mark.parametrize("family", ["clip-text", "openclip-text"])
def test_is_causal_attention_of_a_clip_text_encoder_becomes_unidirectional_and_computes_the_same(causal_sdpa_export, family):
    path, built = causal_sdpa_export(family)
    written = [n for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "Attention"]
    sites = built.sites["attention"]
    assert len(written) == sites and all(helper.get_attribute_value(a) == 1 for n in written
                                         for a in n.attribute if a.name == "is_causal")
    model, report = optimize(path, ["ort-cuda"])

    attention = result_of(report, "fuse-attention")
    assert attention.refused == [] and attention.sites_rewritten == sites
    assert attention.details.get("causal") == sites
    fused = [n for n in model.graph.nodes if n.op in ("MultiHeadAttention", "Attention") and n.domain == CONTRIB]
    assert len(fused) == sites
    for node in fused:  # causal by the attribute, no attention_bias
        assert node.attrs.get("unidirectional") == 1
        assert len(node.inputs) < 6 or not node.inputs[5].name
    inputs = InputSpec(shapes={n: tuple(s) for n, s in built.input_shapes().items()})
    assert_same_computation(path, model, atol=1e-5, rtol=1e-4, inputs=inputs)
