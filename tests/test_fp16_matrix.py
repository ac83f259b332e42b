"""Claims about the ``fp16`` pass on every family x export variant of ``models/`` (``@pytest.mark.models``).

For each family in ``models.FAMILIES`` and each of ``EXPORT_VARIANTS`` (TorchScript / dynamo,
static / dynamic, SDPA / classic attention), on the tiny export the other test files share
(``export_tiny``, same keys):

* ``fp16`` on the plain graph gives a model that passes strict shape inference, the full checker
  and ONNX Runtime's graph resolution, runs on ORT's CPU EP, and whose outputs are finite and
  within the README's bound (``tests.test_fp16.ERROR_BOUND``) of the float32 export on the same
  inputs (the builder's seeded feeds: real token ids, timesteps up to 999).
* ``ort-cuda,fp16`` gives a valid model too. ORT's CPU EP type-checks com.microsoft nodes against
  their schemas when it creates a session and only then fails for the ops it has no CPU kernel
  for (GroupNorm, NhwcConv, packed MultiHeadAttention, ...): a session that fails for nothing but
  a missing kernel was type-correct (``tests.test_fp16.assert_valid``). Every contrib op reads
  float16 data. Such graphs run on onnx.reference with onnxopt's kernels, which compute in float16
  where ORT's CPU EP would upcast; outputs are finite and within the same bound.
* Text encoders: every attention of the fused graph is causal (the mask was proven, not passed
  as a float16 bias), and the float16 plain graph's mask constants are finite.

Measured (relative L2 / max abs against float32): plain 5.7e-4 to 1.1e-3 / at most 5.0e-3 (the
text encoders: at most 1.1e-3 / 5.0e-3); fused on the reference kernels 9.1e-4 to 1.7e-3 / at most
3.2e-3. On the exports, all 96 cases take about 3 minutes on 2 cores.

Cases outside a default set (every exporter form on unet-sd15 and clip-text, the VAE in its
classic form) are marked ``slow``; CI runs them too. Exports are shared with the fusion tests.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from models import FAMILIES
from onnxopt import optimize
from tests.conftest import EXPORT_VARIANTS, export_cases
from tests.test_fp16 import ERROR_BOUND, assert_valid, assert_within_bound, convert, elem_types, errors, ort_session, run

TS_DYNAMIC = ("torchscript", "dynamic", "sdpa")
TS_STATIC = ("torchscript", "static", "sdpa")
DYNAMO_DYNAMIC = ("dynamo", "dynamic", "sdpa")
DYNAMO_STATIC = ("dynamo", "static", "sdpa")
TS_CLASSIC = ("torchscript", "dynamic", "classic")
DYNAMO_CLASSIC = ("dynamo", "dynamic", "classic")
TEXT_ENCODERS = {"clip-text", "openclip-text"}

# Exports the default run of the fusion tests makes anyway (no extra export time), covering both
# exporters, static and dynamic shapes, both attention forms and CLIP's two mask constructions.
DEFAULT = {
    ("unet-sd15", TS_DYNAMIC),
    ("unet-sd15", DYNAMO_STATIC),
    ("clip-text", TS_CLASSIC),  # finfo.min mask, casts around Softmax
    ("clip-text", DYNAMO_DYNAMIC),  # mask built with Range, NaN guard
    ("vae-decoder", DYNAMO_CLASSIC),  # bmm attention, one head
}


def _cases(prefix: str) -> list:
    return export_cases(FAMILIES, lambda family, variant: (family, variant) in DEFAULT, prefix=prefix)


_FP32: dict = {}


def fp32_reference(exported) -> tuple[dict, list[np.ndarray]]:
    """(feeds, float32 outputs of the export on ORT CPU), once per export."""
    key = str(exported.path)
    if key not in _FP32:
        feeds = exported.built.make_feeds()
        _FP32[key] = feeds, ort_session(onnx.load(str(exported.path))).run(None, feeds)
    return _FP32[key]


def mask_constants_are_finite(proto: onnx.ModelProto) -> None:
    for tensor in proto.graph.initializer:
        if tensor.data_type == TensorProto.FLOAT16:
            values = numpy_helper.to_array(tensor)
            assert np.isfinite(values).all(), f"{tensor.name}: non-finite float16 constant"
    for node in proto.graph.node:
        if node.op_type in ("Constant", "ConstantOfShape") and node.attribute:
            t = node.attribute[0].t
            if t.data_type == TensorProto.FLOAT16:
                assert np.isfinite(numpy_helper.to_array(t)).all(), f"{node.name}: non-finite float16 value"


@pytest.mark.parametrize("family, variant", _cases("plain-"))
def test_plain_export_converts_to_valid_float16_running_on_ort_cpu_within_the_bound(export_tiny, family, variant):
    exported = export_tiny(family, *variant)
    model, result = convert(exported.path)
    proto, session = assert_valid(model)
    assert session is not None, "ORT CPU runs every standard op in float16 (casting where it lacks a kernel)"
    assert result.sites_rewritten > 0.9 * result.sites_matched, result.details["fp32_nodes"]
    mask_constants_are_finite(proto)
    feeds, expected = fp32_reference(exported)
    assert_within_bound(errors(expected, run(proto, feeds, session)), ERROR_BOUND)


@pytest.mark.parametrize("family, variant", _cases("fused-"))
def test_ort_cuda_fused_export_converts_to_valid_float16_within_the_bound(export_tiny, family, variant):
    exported = export_tiny(family, *variant)
    model, report = optimize(exported.path, ["ort-cuda", "fp16"])
    proto, session = assert_valid(model)
    types = elem_types(proto)
    contrib = [n for n in proto.graph.node if n.domain == "com.microsoft"]
    assert contrib, "the fusions produced contrib ops"
    for node in contrib:
        assert types[node.input[0]] == TensorProto.FLOAT16, node.name
    if family in TEXT_ENCODERS:  # the causal mask is proven: no float16 bias reaches the kernels
        attention = [n for n in contrib if n.op_type in ("Attention", "MultiHeadAttention")]
        assert len(attention) == exported.sites["attention"]
        assert all(any(a.name == "unidirectional" and a.i == 1 for a in n.attribute) for n in attention)
    feeds, expected = fp32_reference(exported)
    assert_within_bound(errors(expected, run(proto, feeds, session)), ERROR_BOUND)


def test_a_scalar_mask_constant_node_is_clamped_to_a_finite_float16_value():
    """Eager CLIP exported by TorchScript (classic attention): the causal mask fill is a 0-d
    Constant node (finfo(float32).min) feeding Where; its float16 copy is a 0-d tensor, -32752."""
    from tests.test_fp16 import Builder

    b = Builder()
    scores = b.input("scores", ["batch", 4, 4])
    fill = b.node("Constant", value=numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32)), name="fill")
    causal = b.const(np.triu(np.ones((4, 4), bool), 1), dtype=bool)
    masked = b.node("Where", causal, fill, b.const(np.zeros((4, 4))), name="mask")
    b.output(b.node("Softmax", b.node("Add", scores, masked, name="add_mask"), axis=-1, name="softmax"))
    source = b.model()
    model, result = convert(source)
    proto, session = assert_valid(model)
    value = next(n for n in proto.graph.node if n.name == "fill").attribute[0].t
    assert value.data_type == TensorProto.FLOAT16 and list(value.dims) == []
    assert float(numpy_helper.to_array(value)) == -32752.0
    feeds = {"scores": np.random.default_rng(0).standard_normal((2, 4, 4)).astype(np.float32)}
    out = run(proto, feeds, session)[0]
    assert np.isfinite(out).all() and (out[:, np.triu(np.ones((4, 4), bool), 1)] == 0).all()
    expected = ort_session(source).run(None, feeds)
    assert_within_bound(errors(expected, [out]))
