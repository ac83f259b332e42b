"""Claims about the diffusion transformers' attention: fuse-attention (attention over head tensors, two
additive masks) and fuse-rotary-embedding.

On tiny modules built from diffusers/transformers (tests/dit_attention_modules.py) and exported by
both exporters (``@pytest.mark.models``): SD3/SD3.5's MMDiT joint attention (with and without the QK
RMSNorm), Flux's double-stream and single-stream attention with its RoPE computed from the ids in
the graph, and the T5 encoder's unscaled attention with its relative-position bias. Each attention
becomes one MultiHeadAttention (no Softmax, no ONNX Attention left), each Flux rotary one
RotaryEmbedding(interleaved=1) per Q and K, and the fused graph computes what the torch module does.

On hand-built lookalikes: what must not fuse, each checked against the source.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from onnxopt.verify import assert_same_computation
from onnxopt.weights import numpy_dtype
from tests.conftest import op_counts, result_of, run_passes

PASSES = ["cleanup", "fuse-rotary-embedding", "fuse-attention"]

#: (module, exporter, shapes, opset). TorchScript bakes the traced batch and sequence into Flux's
#: rotary Reshapes (its "dynamic" export runs only at the traced sizes): Flux goes static there.
CASES = [
    ("sd3-joint", "torchscript", "dynamic", None),
    ("sd3-joint", "dynamo", "dynamic", None),
    ("sd3-joint", "dynamo", "dynamic", 23),
    ("sd3-joint-plain", "torchscript", "dynamic", None),
    ("flux-double", "torchscript", "static", None),
    ("flux-double", "dynamo", "dynamic", None),
    ("flux-double", "dynamo", "dynamic", 23),
    ("flux-single", "torchscript", "static", None),
    ("flux-single", "dynamo", "dynamic", None),
    ("flux-single", "dynamo", "dynamic", 23),
    ("t5", "torchscript", "dynamic", None),
    ("t5", "dynamo", "dynamic", None),
    ("t5", "dynamo", "dynamic", 23),
]
# One of each form in the default run: joint attention with the QK RMSNorm as ONNX Attention (opset
# 23), Flux's rotary on dynamo's dynamic dims and on TorchScript's Split form, T5's two masks.
FAST = {("sd3-joint", "dynamo", "dynamic", 23), ("flux-double", "dynamo", "dynamic", None),
        ("flux-single", "torchscript", "static", None), ("t5", "dynamo", "dynamic", None)}
ROTARY = {"flux-double": 2, "flux-single": 2}  # Q and K


def _params():
    out = []
    for case in CASES:
        marks = [pytest.mark.models] + ([] if case in FAST else [pytest.mark.slow])
        name, exporter, shapes, opset = case
        out.append(pytest.param(case, marks=marks, id=f"{name}-{exporter}-{shapes}{f'-opset{opset}' if opset else ''}"))
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from tests.dit_attention_modules import export_module

    cache = {}
    root = tmp_path_factory.mktemp("dit-attention")

    def get(case):
        if case not in cache:
            name, exporter, shapes, opset = case
            path = root / "-".join(str(c) for c in case) / f"{name}.onnx"
            cache[case] = (path, export_module(name, path, exporter, shapes, opset))
        return cache[case]

    return get


def _torch_outputs(built) -> list[np.ndarray]:
    import torch

    with torch.no_grad():
        out = built.module(*built.inputs.values())
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


@pytest.mark.parametrize("case", _params())
def test_every_dit_attention_becomes_one_multi_head_attention(exported, case):
    path, built = exported(case)
    model, report = run_passes(path, PASSES)
    counts = op_counts(model)
    fusion = result_of(report, "fuse-attention")
    assert fusion.refused == []
    assert fusion.sites_rewritten == built.attentions
    assert counts["MultiHeadAttention"] == built.attentions
    assert counts["Softmax"] == 0 and counts["Attention"] == 0  # nothing left unfused, ONNX Attention included
    assert counts["RotaryEmbedding"] == ROTARY.get(built.name, 0)
    if built.name == "t5":
        mha = [n for n in model.graph.nodes if n.op == "MultiHeadAttention"]
        assert all(n.attrs["scale"] == 1.0 and n.inputs[5].name for n in mha)  # unscaled, relative-position bias
        # query, key and value apart: ORT's CUDA MHA cannot unpack T5-XXL's packed QKV in bfloat16 beside a bias
        assert all(n.inputs[1].name and n.inputs[2].name for n in mha)
        assert fusion.details["attention_bias: separate Q, K, V"] == built.attentions
        assert fusion.details["two additive masks"] == built.attentions
    assert_same_computation(path, model, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", [p for p in _params() if p.values[0][0].startswith("flux")
                                  or p.values[0][0] == "sd3-joint"])
def test_the_fused_graph_computes_what_the_torch_module_does(exported, case):
    """Against the source itself, on its own inputs (Flux's ids give real rotary tables)."""
    path, built = exported(case)
    model, _ = run_passes(path, PASSES)
    session = ort.InferenceSession(model.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: built.inputs[i.name].numpy() for i in session.get_inputs()}
    for got, want in zip(session.run(None, feeds), _torch_outputs(built)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


# Flux is served in bfloat16: diffusers rotates ``x.float()`` in float32 and casts back, torch.nn.RMSNorm
# upcasts and multiplies its weight in float32, the TorchScript exporter casts x once per use.
BF16_CASES = [
    pytest.param(("flux-double", "torchscript", "static", None), marks=pytest.mark.models, id="flux-double-torchscript"),
    pytest.param(("flux-single", "dynamo", "dynamic", None), marks=pytest.mark.models, id="flux-single-dynamo"),
    pytest.param(("flux-double", "dynamo", "dynamic", 23), marks=[pytest.mark.models, pytest.mark.slow], id="flux-double-opset23"),
    pytest.param(("flux-single", "torchscript", "static", None), marks=[pytest.mark.models, pytest.mark.slow], id="flux-single-torchscript"),
]
QK_NORMS = {"flux-double": 4, "flux-single": 2}  # norm_q, norm_k (+ the text stream's norm_added_q/k)


@pytest.mark.parametrize("case", BF16_CASES)
def test_a_bfloat16_flux_attention_fuses_as_its_float32_export_does(tmp_path, case):
    """Rotary (in float32, between the export's Casts: ORT's bfloat16 kernel would round in
    bfloat16), the QK RMSNorms and the attention all fuse, within bfloat16's rounding of the source:
    two units in the last place of the output's largest value (flux-single's outputs reach ~300, where
    the source itself, rounding its attention scores to bfloat16, is 2.3 from torch's float32)."""
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from onnxopt.verify import BFLOAT16_TOLERANCE
    from tests.dit_attention_modules import BUILDERS, export_module

    name, exporter, shapes, opset = case
    path = tmp_path / f"{name}.onnx"
    built = export_module(name, path, exporter, shapes, opset, dtype="bfloat16")
    model, report = run_passes(path, [*PASSES, "fuse-rms-norm"])
    counts = op_counts(model)
    assert counts["MultiHeadAttention"] == built.attentions and counts["Softmax"] == 0, counts
    rotaries = [n for n in model.graph.nodes if n.op == "RotaryEmbedding"]
    assert len(rotaries) == ROTARY[name] and all(numpy_dtype(n.inputs[0].dtype) == np.float32 for n in rotaries)
    assert result_of(report, "fuse-rotary-embedding").details["in_float32"] == ROTARY[name]
    assert counts["SimplifiedLayerNormalization"] == QK_NORMS[name] and counts["Pow"] == 0, counts
    largest = max(float(np.abs(y).max()) for y in _torch_outputs(BUILDERS[name]()))
    atol = max(BFLOAT16_TOLERANCE.atol, 2 * largest * 2.0 ** -8)  # bfloat16 keeps 8 significant bits
    assert_same_computation(path, model, atol=atol, rtol=BFLOAT16_TOLERANCE.rtol)


# ---------------------------------------------------------------- lookalikes (hand-built torch modules)

HEADS, HEAD_DIM, TOKENS = 2, 8, 6


def _lookalike(tmp_path, variant: str):
    """A head-split attention with Flux's interleaved rotary on Q and K, but for ``variant``; exported
    by TorchScript (static). Returns (path, module, inputs)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    width = HEADS * HEAD_DIM

    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.q, self.k, self.v = (torch.nn.Linear(width, width) for _ in range(3))
            self.pos_embed = FluxPosEmbed(theta=10000, axes_dim=[2, 2, 4])

        def rotary(self, x, cos, sin):  # x (B, S, N, H), tables (S, H)
            cos, sin = cos[None, :, None, :], sin[None, :, None, :]
            if variant == "rotate-half":  # the non-interleaved form (halves, not pairs)
                x1, x2 = x.chunk(2, dim=-1)
                return x * cos + torch.cat([-x2, x1], dim=-1) * sin
            real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
            pair = [imag, -real] if variant == "rotation-reversed" else [-imag, real]
            return x * cos + torch.stack(pair, dim=-1).flatten(3) * sin

        def forward(self, x, ids, cos_in, sin_in):
            cos, sin = (cos_in, sin_in) if variant == "tables-as-inputs" else self.pos_embed(ids)
            if variant == "rotate-half":
                half = cos[:, 0::2]
                cos, sin = torch.cat([half, half], -1), torch.cat([sin[:, 0::2], sin[:, 0::2]], -1)
            q, k, v = (p(x).unflatten(-1, (HEADS, HEAD_DIM)) for p in (self.q, self.k, self.v))
            q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            scores = q @ k.transpose(-1, -2)
            if variant == "scale-per-head":
                scores = scores * torch.tensor([0.3, 0.4]).reshape(1, HEADS, 1, 1)
            else:
                scores = scores * HEAD_DIM ** -0.5
            if variant == "multiplicative-mask":
                scores = scores * cos_in[None, None, :, :TOKENS]
            probs = scores.softmax(dim=-2 if variant == "softmax-over-queries" else -1)
            out = (probs @ v).transpose(1, 2).flatten(2)
            if variant == "probabilities-read":
                return out, probs
            if variant == "k-read":
                return out, k
            return out

    ids = torch.zeros(TOKENS, 3)
    ids[:, 2] = torch.arange(TOKENS)
    g = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(2, TOKENS, width, generator=g), "ids": ids,
              "cos_in": torch.randn(TOKENS, HEAD_DIM, generator=g), "sin_in": torch.randn(TOKENS, HEAD_DIM, generator=g)}
    module = Heads().eval()
    path = tmp_path / f"{variant}.onnx"
    import contextlib
    import io
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(module, tuple(inputs.values()), str(path), dynamo=False, opset_version=17,
                          input_names=list(inputs))
    return path


def _fuse(path):
    model, report = run_passes(path, PASSES)
    assert_same_computation(path, model, atol=1e-5, rtol=1e-4)
    return model, report


@pytest.mark.models
def test_the_lookalike_module_itself_fuses(tmp_path):
    """The baseline the lookalikes below differ from: rotary and attention both fuse."""
    model, _ = _fuse(_lookalike(tmp_path, "interleaved"))
    counts = op_counts(model)
    assert counts["RotaryEmbedding"] == 2 and counts["MultiHeadAttention"] == 1 and counts["Softmax"] == 0


@pytest.mark.models
@pytest.mark.parametrize("variant, reason", [
    ("rotate-half", None),  # halves, not pairs: the pattern does not see a rotary
    ("rotation-reversed", None),  # (x1, x2) -> (x2, -x1): the pattern wants Neg on the odd channel
    ("tables-as-inputs", "is not proven pair-repeated ('cos_in' is a graph input)"),
])
def test_a_rotary_that_is_not_the_interleaved_form_is_not_fused(tmp_path, variant, reason):
    model, report = _fuse(_lookalike(tmp_path, variant))
    assert op_counts(model)["RotaryEmbedding"] == 0
    assert op_counts(model)["MultiHeadAttention"] == 1  # the attention still fuses
    refused = result_of(report, "fuse-rotary-embedding").refused
    if reason is None:
        assert refused == []
    else:
        assert len(refused) == 2 and all(reason in why for _, why in refused)


@pytest.mark.models
@pytest.mark.parametrize("variant, reason", [
    ("softmax-over-queries", "Softmax over axis"),
    ("scale-per-head", "has 2 elements, not one"),
    ("probabilities-read", None),  # the probabilities escape: the pattern does not match
    ("multiplicative-mask", None),  # scores * mask: not an additive mask, the pattern does not match
])
def test_an_attention_lookalike_keeps_its_softmax(tmp_path, variant, reason):
    model, report = _fuse(_lookalike(tmp_path, variant))
    assert op_counts(model)["MultiHeadAttention"] == 0 and op_counts(model)["Softmax"] == 1
    refused = result_of(report, "fuse-attention").refused
    if reason is None:
        assert refused == []
    else:
        assert len(refused) == 1 and reason in refused[0][1]


@pytest.mark.models
def test_a_key_read_elsewhere_still_fuses_and_stays_readable(tmp_path):
    """MHA reads K beside its other reader; nothing inside the fused attention escapes."""
    model, _ = _fuse(_lookalike(tmp_path, "k-read"))
    assert op_counts(model)["MultiHeadAttention"] == 1 and op_counts(model)["RotaryEmbedding"] == 2


# ---------------------------------------------------------------- the RotaryEmbedding reference kernel


@pytest.mark.parametrize("rank, positions, interleaved", [(3, "offset", 1), (4, "offset", 1), (3, "ids", 1), (4, "ids", 0)])
def test_the_rotary_reference_kernel_agrees_with_onnx_runtime(rank, positions, interleaved):
    from onnx import TensorProto, helper

    from onnxopt import reference

    b, s, n, h = 2, 5, 3, 8
    shape = [b, s, n * h] if rank == 3 else [b, n, s, h]
    attrs = {"interleaved": interleaved, **({"num_heads": n} if rank == 3 else {})}
    node = helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], domain="com.microsoft", **attrs)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
              helper.make_tensor_value_info("pos", TensorProto.INT64, None),
              helper.make_tensor_value_info("cos", TensorProto.FLOAT, [s + 2, h // 2]),
              helper.make_tensor_value_info("sin", TensorProto.FLOAT, [s + 2, h // 2])]
    graph = helper.make_graph([node], "rotary", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    rng = np.random.default_rng(0)
    angles = rng.standard_normal((s + 2, h // 2)).astype(np.float32)
    pos = np.array([1], np.int64) if positions == "offset" else rng.integers(0, s + 2, (b, s)).astype(np.int64)
    feeds = {"x": rng.standard_normal(shape).astype(np.float32), "pos": pos, "cos": np.cos(angles), "sin": np.sin(angles)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = reference.run(model, feeds)["y"]
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert not np.allclose(got, feeds["x"])  # it rotated something


# ---------------------------------------------------------------- ONNX's RotaryEmbedding (opset 23)


def _onnx_rotary(with_positions: bool, interleaved: int):
    from onnx import TensorProto, helper

    b, s, n, h = 2, 5, 3, 8
    tables = [s + 1, h // 2] if with_positions else [b, s, h // 2]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, n, s, h]),
              helper.make_tensor_value_info("cos", TensorProto.FLOAT, tables),
              helper.make_tensor_value_info("sin", TensorProto.FLOAT, tables)]
    if with_positions:
        inputs.append(helper.make_tensor_value_info("pos", TensorProto.INT64, [b, s]))
    node = helper.make_node("RotaryEmbedding", [i.name for i in inputs], ["y"], interleaved=interleaved)
    graph = helper.make_graph([node], "rotary", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, n, s, h])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 11
    rng = np.random.default_rng(0)
    angles = rng.standard_normal(tables).astype(np.float32)
    feeds = {"x": rng.standard_normal((b, n, s, h)).astype(np.float32), "cos": np.cos(angles), "sin": np.sin(angles)}
    if with_positions:
        feeds["pos"] = rng.integers(0, s + 1, (b, s)).astype(np.int64)
    return model, feeds


@pytest.mark.parametrize("with_positions", [True, False], ids=["position-ids", "per-batch-tables"])
@pytest.mark.parametrize("interleaved", [1, 0])
def test_onnx_rotary_embedding_becomes_the_contrib_op(with_positions, interleaved):
    """An ONNX RotaryEmbedding left in an opset-23 graph counts as unfused: it becomes com.microsoft's,
    and computes the same (per-batch tables become one table read at b*S + s)."""
    model, feeds = _onnx_rotary(with_positions, interleaved)
    fused, report = run_passes(model, ["cleanup", "fuse-rotary-embedding"])
    rotary = [n for n in fused.graph.nodes if n.op == "RotaryEmbedding"]
    assert len(rotary) == 1 and rotary[0].domain == "com.microsoft"
    assert result_of(report, "fuse-rotary-embedding").sites_rewritten == 1

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    np.testing.assert_allclose(run(fused.to_onnx()), run(model), atol=1e-6)


# ---------------------------------------------------------------- the committed DiT fixtures (models/fixtures/dit)

FIXTURES = "models/fixtures/dit"
# fixture -> (attention sites, rotary sites); the tiny configs have 2 joint + 2 single-stream (Flux)
# or 4 joint/dual attentions (SD3.5 Medium: dual attention in the first blocks), T5 2 layers.
FIXTURE_SITES = {
    "sd35-medium.tiny.torchscript.dynamic.sdpa.onnx": (4, 0),
    "sd35-medium.tiny.dynamo.dynamic.sdpa.onnx": (4, 0),
    "flux-dev.tiny.dynamo.dynamic.sdpa.onnx": (4, 8),
    "flux-dev.tiny.dynamo.dynamic.sdpa.opset23.onnx": (4, 8),
    "flux-dev.tiny.torchscript.dynamic.sdpa.onnx": (4, 8),  # the builders' strided-slice rotary
    "t5-xxl.tiny.torchscript.dynamic.sdpa.onnx": (2, 0),
}
NOT_YET = {
    # ONNX Attention with T5's summed mask: canonicalize-attention cannot prove the mask finite
    "t5-xxl.tiny.dynamo.dynamic.sdpa.opset23.onnx": (2, 0),
}


@pytest.mark.parametrize("fixture", [*FIXTURE_SITES, *(pytest.param(f, marks=pytest.mark.xfail(strict=True)) for f in NOT_YET)])
def test_every_attention_of_the_dit_fixtures_fuses(fixture):
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / FIXTURES / fixture
    if not path.exists():
        pytest.skip(f"{fixture} is not in this checkout")
    attentions, rotary = {**FIXTURE_SITES, **NOT_YET}[fixture]
    model, report = run_passes(path, PASSES)
    counts = op_counts(model)
    assert counts["Softmax"] == 0 and counts["Attention"] == 0
    assert counts["MultiHeadAttention"] == attentions and counts["RotaryEmbedding"] == rotary
    assert_same_computation(path, model, atol=1e-5, rtol=1e-4)
