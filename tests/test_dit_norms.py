"""Claims about the diffusion-transformer norm and activation fusions: fuse-rms-norm, the RMSNorm form of
fuse-skip-layer-norm, fuse-fast-gelu, fuse-adaln-modulation, and the AdaLN modulation Linears in
fuse-parallel-gemm.

On a small module built from the real diffusers/transformers pieces (seeded weights) -- diffusers'
RMSNorm with and without a weight, AdaLayerNormZero and AdaLayerNormContinuous (no affine),
FeedForward(activation_fn="gelu-approximate") behind a gated residual, transformers' T5LayerFF
(gated GELU) and a residual + T5LayerNorm -- exported by TorchScript (opset 17) and dynamo (its
default opset, and opset 23 where RMSNorm is ONNX RMSNormalization), ``ort-cuda``:
* every RMSNorm is a SimplifiedLayerNormalization, or a SkipSimplifiedLayerNormalization where a
  residual Add feeds it; no Pow, ReduceMean, Sqrt or RMSNormalization is left;
* both tanh GELUs are FastGelu (the FeedForward's bias folded in); T5's gate Mul stays;
* the two AdaLN modulation Linears of one time embedding are one Gemm, their chunks one Split;
* at batch 1 both AdaLN modulations are the LayerNorm's gamma and beta (D,); at batch 2 its
  scale and bias of shape (B, 1, D), axis 2 (no modulation Mul or Add is left);
* the fused graph computes what the export does (ORT CPU, which has kernels for all three ops),
  and in bfloat16 / float16 within tolerance (onnxopt's reference kernels in that arithmetic).

Hand-built lookalikes must not fuse: a mean over the wrong axis, eps outside the square root, a
GELU with another constant, a bias of the wrong shape.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import optimize
from onnxopt.passes.fp16 import Fp16Pass
from onnxopt.verify import BFLOAT16_TOLERANCE, InputSpec, assert_same_computation
from onnxopt.weights import BFLOAT16, numpy_dtype
from tests.conftest import op_counts, result_of

D = 32
EXPORTS = [
    pytest.param("torchscript", None, id="torchscript-opset17"),
    pytest.param("dynamo", None, id="dynamo-default"),
    pytest.param("dynamo", 23, id="dynamo-opset23"),
]
INPUTS = InputSpec(shapes={"x": (2, 6, D), "temb": (2, D)})


def _dit_pieces():
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from diffusers.models.attention import FeedForward
    from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero, RMSNorm
    from transformers.models.t5.modeling_t5 import T5Config, T5LayerFF, T5LayerNorm

    class DitPieces(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rms = RMSNorm(D, eps=1e-6)
            self.rms_plain = RMSNorm(D, eps=1e-6, elementwise_affine=False)
            self.ada_zero = AdaLayerNormZero(D)
            self.ada_continuous = AdaLayerNormContinuous(D, D, elementwise_affine=False, eps=1e-6)
            self.ff = FeedForward(D, activation_fn="gelu-approximate")
            self.t5_ff = T5LayerFF(T5Config(d_model=D, d_ff=2 * D, feed_forward_proj="gated-gelu", dropout_rate=0.0))
            self.t5_norm = T5LayerNorm(D)

        def forward(self, x, temb):
            a = self.rms(x)
            n, gate, shift_mlp, scale_mlp, gate_mlp = self.ada_zero(x, emb=temb)
            c = self.ada_continuous(a, temb)  # as in a model, each norm reads its own stream
            b = self.rms_plain(c)  # not x: dynamo shares one mean of squares between two RMSNorms of one tensor
            h = x + gate.unsqueeze(1) * self.ff(n)  # AdaLN-Zero's gated residual
            t = self.t5_ff(h)  # T5LayerNorm(h) -> gated GELU -> h + ...
            m = gate_mlp.unsqueeze(1) * (h * (1 + scale_mlp[:, None]) + shift_mlp[:, None])  # every chunk read
            return a, b, c, t, self.t5_norm(t + a), m

    torch.manual_seed(0)
    module = DitPieces().eval()
    with torch.no_grad():
        for p in module.parameters():  # Linear weights keep torch's init; norm weights and biases not 1 / 0
            if p.ndim == 1:
                p.normal_(1.0, 0.2)
    return torch, module


@pytest.fixture(scope="module")
def dit_export(tmp_path_factory):
    cache = {}

    def get(exporter: str, opset: int | None, batch: int = 2, dtype: str = "float32"):
        key = (exporter, opset, batch, dtype)
        if key not in cache:
            torch, module = _dit_pieces()
            module.to(getattr(torch, dtype))
            path = tmp_path_factory.mktemp("dit") / f"dit-{exporter}-{opset}-{batch}-{dtype}.onnx"
            args = (torch.randn(batch, 6, D, dtype=getattr(torch, dtype)), torch.randn(batch, D, dtype=getattr(torch, dtype)))
            kwargs = dict(input_names=["x", "temb"], dynamo=exporter == "dynamo")
            if exporter == "torchscript":
                kwargs["opset_version"] = 17
            elif opset:
                kwargs["opset_version"] = opset
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(module, args, str(path), **kwargs)
            cache[key] = path
        return cache[key]

    return get


@pytest.mark.models
@pytest.mark.parametrize("exporter,opset", EXPORTS)
def test_every_rms_norm_and_tanh_gelu_of_the_dit_pieces_is_fused_and_computes_the_same(dit_export, exporter, opset):
    source = dit_export(exporter, opset)
    if opset == 23:
        assert "RMSNormalization" in {n.op_type for n in onnx.load(source).graph.node}  # the form to canonicalize
    model, report = optimize(str(source), ["ort-cuda"], inputs=INPUTS)
    ops = op_counts(model)
    # RMSNorms: rms, rms_plain -> Simplified; T5's layer_norm (after the gated residual) and the
    # residual + t5_norm -> SkipSimplified
    assert ops["SimplifiedLayerNormalization"] == 2, ops
    assert ops["SkipSimplifiedLayerNormalization"] == 2, ops
    assert not {"Pow", "ReduceMean", "Sqrt", "Reciprocal", "RMSNormalization", "Tanh", "Gelu"} & set(ops), ops
    assert ops["FastGelu"] == 2, ops
    fast_gelus = [n for n in model.graph.nodes if n.op == "FastGelu"]
    assert sorted(len(n.inputs) for n in fast_gelus) == [1, 2]  # the FeedForward's bias folded, T5's wi_0 has none
    # both AdaLN modulation Linears read one SiLU(temb) (each exporter writes the modules' SiLUs once):
    # one Gemm, and one Split hands out all eight shift/scale/gate chunks
    assert result_of(report, "fuse-parallel-gemm").details == {"groups": 1, "members": 2, "from_matmul": 0, "splits_folded": 2}
    [split] = [n for n in model.graph.nodes if n.op == "Split" and n.inputs[0].inputs[0].op == "Gemm"]
    assert len(split.outputs) == 6 + 2
    # batch 2: both AdaLN modulations are per sample: the LayerNorm's (B, 1, D) scale and bias, axis 2
    result = result_of(report, "fuse-adaln-modulation")
    assert (result.sites_rewritten, result.details["stays_elementwise"]) == (2, 0)
    modulated = [n for n in model.graph.nodes if n.op == "LayerNormalization" and n.attrs.get("axis") == 2]
    assert len(modulated) == 2 and all(list(n.inputs[1].shape) == [2, 1, D] for n in modulated), modulated
    assert_same_computation(str(source), model, inputs=INPUTS, atol=1e-4, rtol=1e-3)


@pytest.mark.models
@pytest.mark.parametrize("exporter,opset", EXPORTS)
def test_the_dit_pieces_exported_in_bfloat16_fuse_as_in_float32(dit_export, exporter, opset):
    """Flux and T5 are exported in bfloat16: RMSNorm's statistics in float32 between Casts (two Casts
    of x on TorchScript; diffusers' weightless RMSNorm casts back after the Mul), the tanh-GELU
    constants rounded to bfloat16, and the residual + RMSNorm fuse as in float32, and compute the
    source within bfloat16's rounding (ORT registers bfloat16 CUDA kernels for all of them)."""
    source = dit_export(exporter, opset, dtype="bfloat16")
    model, report = optimize(str(source), ["ort-cuda"], inputs=INPUTS)
    ops = op_counts(model)
    assert (ops["SimplifiedLayerNormalization"], ops["SkipSimplifiedLayerNormalization"], ops["FastGelu"]) == (2, 2, 2), ops
    assert not {"Pow", "ReduceMean", "Sqrt", "Reciprocal", "RMSNormalization", "Tanh", "Gelu"} & set(ops), ops
    assert ops["LayerNormalization"] == 2, ops  # both AdaLN LayerNorms, modulation folded, as in float32
    for node in model.graph.nodes:
        if node.op in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "FastGelu"):
            assert numpy_dtype(node.inputs[0].dtype) == BFLOAT16, (node.name, node.inputs[0].dtype)
    assert_same_computation(str(source), model, inputs=INPUTS, atol=BFLOAT16_TOLERANCE.atol, rtol=BFLOAT16_TOLERANCE.rtol)


@pytest.mark.models
@pytest.mark.parametrize("exporter", ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)])
def test_at_batch_one_the_adaln_modulation_is_the_layer_norms_gamma_and_beta(dit_export, exporter):
    """Flux.1-dev's batch: norm(x) * (1 + scale) + shift is one LayerNormalization whose gamma and beta
    are (1 + scale) and shift reshaped to (D,), for AdaLayerNormZero and AdaLayerNormContinuous."""
    source = dit_export(exporter, None, batch=1)
    one = InputSpec(shapes={"x": (1, 6, D), "temb": (1, D)})
    model, report = optimize(str(source), ["ort-cuda"], inputs=one)
    result = result_of(report, "fuse-adaln-modulation")
    assert (result.sites_rewritten, result.details["stays_elementwise"]) == (2, 0)
    norms = [n for n in model.graph.nodes if n.op in ("LayerNormalization", "SkipLayerNormalization")]
    assert len(norms) == 2 and all(n.inputs[2].inputs and n.inputs[2].inputs[0].op == "Reshape" for n in norms)
    assert_same_computation(str(source), model, inputs=one, atol=1e-4, rtol=1e-3)


@pytest.mark.models
@pytest.mark.parametrize("low,tolerance", [("bfloat16", 8e-2), pytest.param("float16", 2e-2, marks=pytest.mark.slow)])
def test_the_fused_dit_pieces_run_in_low_precision_within_tolerance(dit_export, low, tolerance):
    """The fused ops keep bfloat16/float16 (their ORT CUDA kernels take both) and the result stays
    within the fp16 pass's tolerance of float32, computed in that arithmetic by the reference kernels."""
    source = dit_export("dynamo", None)
    model, report = optimize(str(source), ["ort-cuda", Fp16Pass(low_precision=low)], inputs=INPUTS)
    details = result_of(report, "fp16").details
    kept = set(details["fp32_nodes"])
    for node in model.graph.nodes:
        if node.op in ("SimplifiedLayerNormalization", "FastGelu"):
            assert node.name not in kept, node.name
            assert np.dtype(node.outputs[0].dtype).name == low, (node.name, node.outputs[0].dtype)
    # float16 keeps T5's gated-FFN output projection and the residual after it in float32; bfloat16 does not
    assert ("gated-ffn" in details["fp32_by_kind"]) == (low == "float16"), details["fp32_by_kind"]
    assert_same_computation(str(source), model, inputs=INPUTS, atol=tolerance, rtol=tolerance)


# ================================================================ hand-built graphs and lookalikes

FLOAT = TensorProto.FLOAT


def _model(nodes, inits, opset=17, shape=(2, 5, 8)):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", FLOAT, None)],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _rms_norm(axes=(-1,), eps_outside=False, weight=True, mean_input="sq"):
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", [mean_input], ["ms"], axes=list(axes), keepdims=1),
    ]
    if eps_outside:  # sqrt(ms) + eps: another function
        nodes += [helper.make_node("Sqrt", ["ms"], ["r0"]), helper.make_node("Add", ["r0", "eps"], ["r"])]
    else:
        nodes += [helper.make_node("Add", ["ms", "eps"], ["v"]), helper.make_node("Sqrt", ["v"], ["r"])]
    nodes += [helper.make_node("Reciprocal", ["r"], ["inv"]),
              helper.make_node("Mul", ["x", "inv"], ["n" if weight else "y"])]
    inits = {"two": 2.0, "eps": 1e-6}
    if weight:
        nodes.append(helper.make_node("Mul", ["w", "n"], ["y"]))
        inits["w"] = np.linspace(0.5, 1.5, 8)
    return _model(nodes, inits)


def test_a_weighted_rms_norm_becomes_simplified_layer_norm():
    model, report = optimize(_rms_norm(), ["fuse-rms-norm"])
    assert op_counts(model) == {"SimplifiedLayerNormalization": 1}
    assert_same_computation(_rms_norm(), model, atol=1e-5)


@pytest.mark.parametrize("kwargs,reason", [
    (dict(axes=(1,)), "not the last axis"),
    (dict(eps_outside=True), None),  # eps outside the root: no match at all
    (dict(mean_input="x"), None),  # a mean of x, not of its square
], ids=["mean-over-sequence", "eps-outside-sqrt", "mean-of-x"])
def test_rms_norm_lookalikes_do_not_fuse(kwargs, reason):
    model, report = optimize(_rms_norm(**kwargs), ["fuse-rms-norm"])
    assert "SimplifiedLayerNormalization" not in op_counts(model)
    result = result_of(report, "fuse-rms-norm")
    if reason:
        assert any(reason in r for _, r in result.refused), result.refused


def _tanh_gelu(k=math.sqrt(2 / math.pi), bias_shape=(8,)):
    """TorchScript's aten::gelu(approximate="tanh") after a bias Add."""
    nodes = [
        helper.make_node("Add", ["x", "b"], ["h"]),
        helper.make_node("Mul", ["h", "h"], ["h2"]), helper.make_node("Mul", ["h", "h2"], ["h3"]),
        helper.make_node("Mul", ["c", "h3"], ["ch3"]), helper.make_node("Add", ["h", "ch3"], ["inner"]),
        helper.make_node("Mul", ["k", "inner"], ["scaled"]), helper.make_node("Tanh", ["scaled"], ["t"]),
        helper.make_node("Add", ["one", "t"], ["t1"]), helper.make_node("Mul", ["h", "t1"], ["p"]),
        helper.make_node("Mul", ["half", "p"], ["y"]),
    ]
    inits = {"b": np.linspace(-1, 1, int(np.prod(bias_shape))).reshape(bias_shape), "c": 0.044715, "k": k,
             "one": 1.0, "half": 0.5}
    return _model(nodes, inits)


def test_a_biased_tanh_gelu_becomes_fast_gelu_with_the_bias():
    model, _ = optimize(_tanh_gelu(), ["fuse-fast-gelu"])
    assert op_counts(model) == {"FastGelu": 1}
    assert len(model.graph.nodes[0].inputs) == 2
    assert_same_computation(_tanh_gelu(), model, atol=1e-5)


def test_a_gelu_with_another_constant_is_not_fast_gelu():
    model, _ = optimize(_tanh_gelu(k=0.8), ["fuse-fast-gelu"])
    assert "FastGelu" not in op_counts(model)


def test_a_bias_that_is_not_per_channel_stays_outside_fast_gelu():
    source = _tanh_gelu(bias_shape=(5, 8))  # one value per (token, channel): not FastGelu's bias
    model, report = optimize(source, ["fuse-fast-gelu"])
    fast = [n for n in model.graph.nodes if n.op == "FastGelu"]
    assert len(fast) == 1 and len(fast[0].inputs) == 1 and op_counts(model)["Add"] == 1
    assert result_of(report, "fuse-fast-gelu").details["bias_left_outside"] == 1
    assert_same_computation(source, model, atol=1e-5)


def _layer_norm_without_affine():
    """nn.LayerNorm(elementwise_affine=False) written out, then a per-sample-like Mul that is no gamma."""
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1], keepdims=1), helper.make_node("Sub", ["x", "m"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["d2"]), helper.make_node("ReduceMean", ["d2"], ["v"], axes=[-1], keepdims=1),
        helper.make_node("Add", ["v", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["s"]),
        helper.make_node("Div", ["d", "s"], ["n"]), helper.make_node("Mul", ["n", "mod"], ["y"]),
    ]
    return _model(nodes, {"two": 2.0, "eps": 1e-6, "mod": np.linspace(0.5, 1.5, 40).reshape(5, 8)})


def test_a_layer_norm_without_affine_becomes_layer_normalization_and_the_modulation_stays():
    source = _layer_norm_without_affine()
    model, _ = optimize(source, ["fuse-layer-norm"])
    assert op_counts(model) == {"LayerNormalization": 1, "Mul": 1}
    assert_same_computation(source, model, atol=1e-5)


def _modulated_layer_norm(x_shape):
    """LayerNormalization(x) * (1 + Unsqueeze(scale, 1)) + Unsqueeze(shift, 1), scale/shift (B, 8) inputs."""
    batch = x_shape[0]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "ones"], ["n"], axis=-1, epsilon=1e-6),
        helper.make_node("Unsqueeze", ["scale", "axis1"], ["scale_u"]), helper.make_node("Add", ["scale_u", "one"], ["g"]),
        helper.make_node("Mul", ["n", "g"], ["ng"]), helper.make_node("Unsqueeze", ["shift", "axis1"], ["shift_u"]),
        helper.make_node("Add", ["ng", "shift_u"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.ones(8, np.float32), "ones"), numpy_helper.from_array(np.float32(1.0), "one"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    inputs = [helper.make_tensor_value_info(n, FLOAT, shape) for n, shape in
              (("x", x_shape), ("scale", [batch, 8]), ("shift", [batch, 8]))]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_per_sample_modulation_of_a_dynamic_batch_is_the_layer_norms_batched_scale_and_bias():
    """A batch that is not statically 1: scale and bias (B, 1, D), axis 2, checked at batch 3."""
    source = _modulated_layer_norm(["B", "S", 8])
    model, report = optimize(source, ["fuse-adaln-modulation"])
    assert result_of(report, "fuse-adaln-modulation").sites_rewritten == 1
    [ln] = [n for n in model.graph.nodes if n.op == "LayerNormalization"]
    assert ln.attrs["axis"] == 2 and "Mul" not in op_counts(model), op_counts(model)
    three = InputSpec(shapes={"x": (3, 5, 8), "scale": (3, 8), "shift": (3, 8)})
    assert_same_computation(source, model, inputs=three, atol=1e-5)


def test_a_per_sample_modulation_of_a_rank_four_x_stays_elementwise():
    """ONNX Runtime broadcasts a per-sample scale only against a rank-3 x: a (B, H, S, D) one keeps its Mul and Add."""
    source = _modulated_layer_norm([2, 2, 5, 8])
    model, report = optimize(source, ["fuse-adaln-modulation"])
    assert result_of(report, "fuse-adaln-modulation").details["stays_elementwise"] == 1
    assert {"Mul", "Add"} <= set(op_counts(model))


@pytest.mark.parametrize("op", ["SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"])
def test_the_rms_norm_reference_kernels_compute_what_onnx_runtime_cpu_computes(op):
    """fp16/bf16 verification runs these kernels: proven against ORT's own CPU kernels in float32."""
    from onnxopt import reference
    from onnxopt.domains import MS_DOMAIN

    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(3)
    x, skip = (rng.standard_normal((2, 5, 8)).astype(np.float32) * 3 for _ in range(2))
    inits = {"gamma": rng.standard_normal(8), "bias": rng.standard_normal(8)}
    if op == "SimplifiedLayerNormalization":
        node = helper.make_node(op, ["x", "gamma"], ["y"], axis=-1, epsilon=1e-6)
        feeds, graph_inputs = {"x": x}, ["x"]
    else:
        node = helper.make_node(op, ["x", "skip", "gamma", "bias"], ["y", "", "", "sum"], domain=MS_DOMAIN, epsilon=1e-6)
        feeds, graph_inputs = {"x": x, "skip": skip}, ["x", "skip"]
    outputs = [o for o in node.output if o]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, FLOAT, [2, 5, 8]) for n in graph_inputs],
                              [helper.make_tensor_value_info(o, FLOAT, None) for o in outputs],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)])
    expected = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = reference.run(proto, feeds)
    for name, value in zip(outputs, expected):
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5)


# ================================================================ the committed DiT fixtures (models/fixtures/dit)

DIT_FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "dit"
FAST_FIXTURES = {"flux-dev.tiny.dynamo.dynamic.sdpa.opset23.onnx", "t5-xxl.tiny.torchscript.dynamic.sdpa.onnx"}


def _dit_fixtures() -> list:
    manifest = DIT_FIXTURES / "manifest.json"
    if not manifest.exists():
        return []
    entries = json.loads(manifest.read_text())["fixtures"]
    return [pytest.param(e, id=e["file"], marks=[] if e["file"] in FAST_FIXTURES else [pytest.mark.slow]) for e in entries]


@pytest.mark.parametrize("entry", _dit_fixtures())
def test_every_rms_norm_and_tanh_gelu_of_the_dit_fixtures_is_fused(entry):
    """SD3.5-Medium, Flux.1-dev and T5 v1.1 (tiny, both exporters, opset 23): as many
    SimplifiedLayerNormalization + SkipSimplifiedLayerNormalization as the torch model has RMSNorms,
    as many FastGelu as tanh GELUs, none of the decomposed ops left, and the same outputs."""
    sites = entry["sites"]
    inputs = InputSpec(shapes={i["name"]: tuple(i["example_shape"]) for i in entry["inputs"]})
    model, report = optimize(str(DIT_FIXTURES / entry["file"]), ["ort-cuda"], inputs=inputs)
    ops = op_counts(model)
    assert ops["SimplifiedLayerNormalization"] + ops["SkipSimplifiedLayerNormalization"] == sites["rms_norm"], ops
    assert ops["FastGelu"] == sites["gelu_tanh"], ops
    assert not {"Pow", "ReduceMean", "Sqrt", "RMSNormalization", "Tanh", "Gelu"} & set(ops), ops
    if sites["modulation"]:  # every block's AdaLN Linears read one SiLU(temb): one Gemm
        assert result_of(report, "fuse-parallel-gemm").details["groups"] == 1
    assert_same_computation(str(DIT_FIXTURES / entry["file"]), model, inputs=inputs, atol=1e-4, rtol=1e-3)


@pytest.mark.slow
def test_the_torchscript_flux_single_block_modulation_folds_though_shape_inference_lost_its_width():
    """TorchScript's Flux single block normalizes a Concat of Slices whose last dim shape inference
    leaves symbolic: fuse-adaln-modulation takes D from the LayerNorm's constant (D,) scale, so every
    AdaLN modulation folds (as many sites as the dynamo export: 11), no Mul reads a LayerNorm, and
    the graph computes what the export computes."""
    name = "flux-dev.tiny.torchscript.dynamic.sdpa.onnx"
    entry = next(e for e in json.loads((DIT_FIXTURES / "manifest.json").read_text())["fixtures"] if e["file"] == name)
    inputs = InputSpec(shapes={i["name"]: tuple(i["example_shape"]) for i in entry["inputs"]})
    model, report = optimize(str(DIT_FIXTURES / name), ["ort-cuda"], inputs=inputs)
    assert result_of(report, "fuse-adaln-modulation").sites_rewritten == entry["sites"]["modulation"] == 11
    assert not [n for n in model.graph.nodes if n.op == "Mul" and any(
        t.inputs and t.inputs[0].op == "LayerNormalization" for t in n.inputs)]
    assert_same_computation(str(DIT_FIXTURES / name), model, inputs=inputs, atol=1e-4, rtol=1e-3)
