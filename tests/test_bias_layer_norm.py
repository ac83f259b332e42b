"""Claims about fuse-bias-layer-norm: a LayerNormalization with no residual Add in front (and the
bias Add of the Linear / 1x1 conv before it) becomes com.microsoft SkipLayerNormalization over
(-1, 1, D) rows with a constant zero (1, D) skip, the bias folded in.

On real tiny UNet exports (``@pytest.mark.models``), after the ort-cuda fusions up to nhwc-conv and
fold-conv-bias:
* the LayerNorms left are exactly the norm1 of the first BasicTransformerBlock of every
  Transformer2DModel: it reads proj_in, with no residual Add in front (diffusers:
  ``norm1(proj_in(...))``; every later block's norm1 reads the previous block's residual sum and is
  fuse-skip-layer-norm's). fuse-bias-layer-norm rewrites each of them, with proj_in's bias folded:
  through the (B, H, W, C) -> (B, H*W, C) Reshape for a conv proj_in (SD 1.5), straight for a Linear
  one (SD 2.1 / SDXL, use_linear_projection); no LayerNormalization remains;
* the result computes what the export computes (NumPy reference kernels: ORT CPU has no NhwcConv).
The tiny SD 1.5 and SD 2.1 UNets have one block per transformer; tiny SDXL has 1 to 3, which shows
that only the first block's norm1 is taken here.

Hand-built graphs, run on ORT CPU (it has a SkipLayerNormalization kernel) against the source:
each form (Reshape between, Linear, no bias), static and dynamic dims, the sum read elsewhere or
not, fp16; and the lookalikes that must not fuse.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto

from onnxopt import load_model, optimize, reference
from onnxopt.errors import PassOrderError
from onnxopt.manager import PassManager
from onnxopt.pattern import constant_value, is_constant
from onnxopt.verify import assert_same_computation
from tests.conftest import EXPORT_VARIANTS, op_counts
from tests.test_ffn_fusions import Net, weights

PASS = "fuse-bias-layer-norm"
# The ort-cuda fusions, in the preset's order, up to where this pass runs.
CHAIN = ["cleanup", "fuse-attention", "fuse-group-norm", "fuse-skip-group-norm", "fuse-bias-split-gelu", "fuse-layer-norm",
         "fuse-bias-add", "fuse-skip-layer-norm", "nhwc-conv", "fold-conv-bias", PASS]


def results(report) -> dict:
    return {p.name: p.result for p in report.passes}


def zero_skip_layer_norms(model) -> list:
    """The SkipLayerNormalizations this pass writes: their skip is a constant zero row (1, D)."""
    found = []
    for n in model.graph.nodes:
        if n.op == "SkipLayerNormalization" and is_constant(n.inputs[1]):
            skip = constant_value(n.inputs[1])
            if skip.shape == (1, n.inputs[2].shape[0]) and not skip.any():
                found.append(n)
    return found


# ================================================================ real exports

SDPA_VARIANTS = [v for v in EXPORT_VARIANTS if v[2] == "sdpa"]  # the attention processor does not touch the norms
EXPORT_CASES = [pytest.param(family, variant, marks=pytest.mark.models, id=f"{family}-{'-'.join(variant)}")
                for family in ("unet-sd15", "unet-sd21") for variant in SDPA_VARIANTS]
EXPORT_CASES.append(pytest.param("unet-sdxl", ("torchscript", "dynamic", "sdpa"), marks=pytest.mark.models,
                                 id="unet-sdxl-torchscript-dynamic-sdpa"))

_CHAINED: dict[tuple, tuple] = {}


def chained(export_tiny, family: str, variant: tuple):
    """(exported, model after CHAIN, report); computed once per module run."""
    key = (family, variant)
    if key not in _CHAINED:
        exported = export_tiny(family, *variant)
        model, report = optimize(exported.path, CHAIN)
        _CHAINED[key] = (exported, model, report)
    return _CHAINED[key]


def proj_in_norms(built) -> dict[str, bool]:
    """Transformer2DModel name -> whether proj_in is a conv, for every transformer whose first
    BasicTransformerBlock's norm1 is a LayerNorm: it reads proj_in's output, no residual Add."""
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.transformers.transformer_2d import Transformer2DModel
    from torch import nn

    found = {}
    for name, m in built.module.named_modules():
        if isinstance(m, Transformer2DModel):
            first = m.transformer_blocks[0]
            assert isinstance(first, BasicTransformerBlock) and first.norm_type == "layer_norm"
            assert isinstance(first.norm1, nn.LayerNorm) and m.is_input_continuous
            assert m.proj_in.bias is not None
            found[name] = not m.use_linear_projection
    return found


def transformer_blocks(built) -> int:
    from diffusers.models.attention import BasicTransformerBlock

    return sum(isinstance(m, BasicTransformerBlock) for m in built.module.modules())


@pytest.mark.parametrize("family, variant", EXPORT_CASES)
def test_every_proj_in_layer_norm_becomes_a_zero_skip_layer_norm_with_proj_ins_bias(export_tiny, family, variant):
    exported, model, report = chained(export_tiny, family, variant)
    norms = proj_in_norms(exported.built)
    n, convs = len(norms), sum(norms.values())
    assert n > 0 and convs == (n if family == "unet-sd15" else 0)
    if family == "unet-sdxl":
        assert transformer_blocks(exported.built) > n  # later blocks' norm1 read a residual: not this pass's

    result = results(report)[PASS]
    assert (result.sites_matched, result.sites_rewritten, result.refused) == (n, n, [])
    dynamic = n if variant[1] == "dynamic" else 0  # reshaped back by Shape, else by constant shapes
    assert result.details == {"bias_folded": n, "through_reshape": convs, "dynamic_shape": dynamic}
    ops = op_counts(model)
    assert ops["LayerNormalization"] == 0
    assert ops["SkipLayerNormalization"] == exported.sites["layer_norm"]

    # Each one normalizes its transformer's first norm1 with its proj_in's bias folded in.
    written = {(sln.inputs[2].name, sln.inputs[4].name) for sln in zero_skip_layer_norms(model)}
    assert written == {(f"{t}.transformer_blocks.0.norm1.weight", f"{t}.proj_in.bias") for t in norms}


@pytest.mark.parametrize("family, variant", EXPORT_CASES)
def test_the_chain_with_bias_layer_norm_computes_what_the_export_computes(export_tiny, family, variant):
    exported, model, _ = chained(export_tiny, family, variant)
    assert_same_computation(exported.path, model, atol=1e-4, rtol=1e-3, inputs=exported.input_spec())


# ================================================================ hand-built graphs

D = 16


def proj_in_net(form: str = "conv", *, dynamic: bool = False, read: str = "none", bias_shape=(D,),
                dtype=np.float32, beta: bool = True) -> tuple:
    """A transformer's proj_in + norm1, as the chain leaves it. Returns (proto, has a bias Add).

    form: "conv" (channels-last 1x1 conv: x (B, H, W, C) @ W + b, Reshape to (B, H*W, D), then the
    LayerNorm), "linear" (x (B, S, C) @ W + b, then the LayerNorm) or "plain" (a LayerNorm of x).
    read: who else reads the LayerNorm's input: "none", "residual" (a later Add, as SD's residual
    stream), "graph-output" (it is one), "before-reshape" (the conv form's Add output, before the
    Reshape, is read by a Sigmoid too). beta=False: the LayerNorm has no beta input.
    """
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    net = Net()
    if form == "conv":
        x = net.input("x", ["batch", "h", "w", 8] if dynamic else [2, 4, 3, 8], elem)
        biased = net.op("Add", net.op("MatMul", x, net.const(weights(8, D), dtype)), net.const(weights(*bias_shape), dtype))
        target = net.ints(0, -1, D) if dynamic else net.ints(2, 12, D)  # 0: batch copied from the input
        t = net.op("Reshape", biased, target)
    elif form == "linear":
        x = net.input("x", ["batch", "seq", 8] if dynamic else [2, 6, 8], elem)
        biased = t = net.op("Add", net.op("MatMul", x, net.const(weights(8, D), dtype)), net.const(weights(*bias_shape), dtype))
    else:
        biased = None
        t = net.input("x", ["batch", "seq", D] if dynamic else [2, 6, D], elem)
    ln_inputs = [t, net.const(weights(D) + 1, dtype)] + ([net.const(weights(D), dtype)] if beta else [])
    y = net.op("LayerNormalization", *ln_inputs, axis=-1, epsilon=1e-5)
    outputs = [y]
    if read == "residual":
        outputs = [net.op("Add", t, net.op("Relu", y))]
    elif read == "graph-output":
        outputs.append(t)
    elif read == "before-reshape":
        outputs.append(net.op("Sigmoid", biased))
    proto = net.model(*outputs)
    for out in proto.graph.output:
        out.type.tensor_type.elem_type = elem
    return proto, biased is not None


def fuse(proto, *passes):
    model, report = optimize(proto, list(passes) or [PASS])
    return model, results(report)


def runs_on_ort_cpu(model) -> bool:
    return reference.unsupported_on_ort_cpu(model.to_onnx()) == set()


READS = {"conv": ("none", "residual", "graph-output", "before-reshape"), "linear": ("none", "residual", "graph-output"),
         "plain": ("none", "residual")}
CASES = [pytest.param(form, read, dynamic, id=f"{form}-{read}-{'dynamic' if dynamic else 'static'}")
         for form, reads in READS.items() for read in reads for dynamic in (False, True)]


@pytest.mark.parametrize("form, read, dynamic", CASES)
def test_a_layer_norm_without_residual_becomes_a_zero_skip_layer_norm_on_rows(form, read, dynamic):
    proto, biased = proj_in_net(form, dynamic=dynamic, read=read)
    model, by_pass = fuse(proto)
    result = by_pass[PASS]
    assert (result.sites_matched, result.sites_rewritten) == (1, 1)
    assert result.details == {"bias_folded": int(biased), "through_reshape": int(form == "conv"), "dynamic_shape": int(dynamic)}
    ops = op_counts(model)
    assert ops["LayerNormalization"] == 0 and ops["Add"] == (read == "residual")  # the bias Add is gone

    (sln,) = [n for n in model.graph.nodes if n.op == "SkipLayerNormalization"]
    to_rows, skip = sln.inputs[0].inputs[0], constant_value(sln.inputs[1])
    assert to_rows.op == "Reshape" and list(constant_value(to_rows.inputs[1])) == [-1, 1, D]
    kernel_reads = to_rows.inputs[0]  # u, the MatMul's output, before the bias; or x itself
    assert (kernel_reads.inputs[0].op == "MatMul") if biased else (kernel_reads.name == "x")
    assert skip.shape == (1, D) and not skip.any()
    assert len(sln.inputs) == (5 if biased else 4)
    # The sum (u + bias) is written only when something besides the LayerNorm reads it.
    assert len(sln.outputs) == (4 if biased and read != "none" else 1)
    backs = [c for out in sln.outputs if out.name for c in out.outputs]
    assert backs and all(c.op == "Reshape" for c in backs)
    assert all(is_constant(c.inputs[1]) != dynamic for c in backs)  # constant shapes when static, else Shape
    assert ops["Shape"] == (0 if not dynamic else 2 if read == "before-reshape" else 1)

    assert runs_on_ort_cpu(model)
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("form", ["linear", "plain"])
def test_a_layer_norm_without_beta_becomes_a_skip_layer_norm_without_beta(form):
    proto, biased = proj_in_net(form, beta=False)
    model, by_pass = fuse(proto)
    (sln,) = zero_skip_layer_norms(model)
    assert not sln.inputs[3].name and len(sln.inputs) == (5 if biased else 4)
    assert runs_on_ort_cpu(model)
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-4)


def test_a_bias_of_shape_1_1_d_is_folded_as_d_values():
    proto, _ = proj_in_net("linear", bias_shape=(1, 1, D))
    model, by_pass = fuse(proto)
    (sln,) = zero_skip_layer_norms(model)
    assert constant_value(sln.inputs[4]).shape == (D,)
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("form", ["conv", "linear"])
def test_fp16_layer_norms_fuse_with_an_fp16_zero_skip(form):
    proto, _ = proj_in_net(form, read="residual", dtype=np.float16)
    model, by_pass = fuse(proto)
    assert by_pass[PASS].sites_rewritten == 1
    (sln,) = zero_skip_layer_norms(model)
    assert constant_value(sln.inputs[1]).dtype == np.float16
    assert runs_on_ort_cpu(model)
    assert_same_computation(proto, model, atol=2e-3, rtol=2e-3)


def test_only_the_layer_norm_input_of_the_right_shape_is_rebuilt_when_both_are_read():
    """The Add output (B, H, W, D) and the Reshape output (B, H*W, D) both read elsewhere: one sum output, two shapes."""
    net = Net()
    x = net.input("x", ["batch", "h", "w", 8])
    biased = net.op("Add", net.op("MatMul", x, net.const(weights(8, D))), net.const(weights(D)))
    t = net.op("Reshape", biased, net.ints(0, -1, D))
    y = net.op("LayerNormalization", t, net.const(weights(D) + 1), net.const(weights(D)), axis=-1, epsilon=1e-5)
    proto = net.model(net.op("Add", t, y), net.op("Sigmoid", biased))
    model, by_pass = fuse(proto)
    (sln,) = zero_skip_layer_norms(model)
    readers = sln.outputs[3].outputs
    assert len(readers) == 2 and all(r.op == "Reshape" for r in readers)
    assert runs_on_ort_cpu(model)
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- lookalikes


def lookalike(kind: str):
    """A LayerNorm with something in front that this pass must leave alone."""
    net = Net()
    ln_kw = dict(axis=-1, epsilon=1e-5)
    gamma, beta = net.const(weights(D) + 1), net.const(weights(D))
    outputs = 1
    if kind == "axis":  # normalizes (S, D)
        t = net.input("x", [2, 6, D])
        gamma, beta, ln_kw["axis"] = net.const(weights(6, D) + 1), net.const(weights(6, D)), -2
    elif kind == "bias-d-1":  # a constant (D, 1): one value per row of the (D, D) matrices
        t = net.op("Add", net.op("MatMul", net.input("x", [2, D, 8]), net.const(weights(8, D))), net.const(weights(D, 1)))
    elif kind == "computed-b-1-d":  # a computed (B, 1, D) tensor added
        t = net.op("Add", net.op("MatMul", net.input("x", [2, 6, 8]), net.const(weights(8, D))), net.input("r", [2, 1, D]))
    elif kind == "residual":  # two full tensors: fuse-skip-layer-norm's
        t = net.op("Add", net.input("a", [2, 6, D]), net.input("b", [2, 6, D]))
    elif kind == "residual-reshaped":
        t = net.op("Reshape", net.op("Add", net.input("a", [2, 4, 3, D]), net.input("b", [2, 4, 3, D])), net.ints(2, 12, D))
    elif kind == "gamma-input":
        t = net.op("Add", net.op("MatMul", net.input("x", [2, 6, 8]), net.const(weights(8, D))), net.const(weights(D)))
        gamma = net.input("gamma", [D])
    elif kind == "last-dim-changed":  # (2, 4, 3, 16) -> (2, 12, 2, 8): the bias is no longer per last element
        biased = net.op("Add", net.op("MatMul", net.input("x", [2, 4, 3, 8]), net.const(weights(8, D))), net.const(weights(D)))
        t = net.op("Reshape", biased, net.ints(2, 12, 2, 8))
        gamma, beta = net.const(weights(8) + 1), net.const(weights(8))
    elif kind == "mean-used":
        t = net.input("x", [2, 6, D])
        outputs = 2
    elif kind == "stash-type-0":
        t = net.input("x", [2, 6, D])
        ln_kw["stash_type"] = 0
    elif kind == "float64":
        t = net.input("x", [2, 6, D], TensorProto.DOUBLE)
        gamma, beta = net.const(weights(D) + 1, np.float64), net.const(weights(D), np.float64)
    else:
        raise ValueError(kind)
    y = net.op("LayerNormalization", t, gamma, beta, outputs=outputs, **ln_kw)
    proto = net.model(*(y if outputs > 1 else [y]))
    if kind == "float64":
        proto.graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    return proto


LOOKALIKES = {
    "axis": "normalizes from axis -2; SkipLayerNormalization normalizes the last axis only",
    "bias-d-1": "the constant added in front has shape [16, 1]; a bias is (16,) or (1, .., 1, 16)",
    "computed-b-1-d": "reads the sum [2, 6, 16] + [2, 1, 16] of two computed tensors: a residual Add, left to fuse-skip-layer-norm",
    "residual": "reads the sum [2, 6, 16] + [2, 6, 16] of two computed tensors: a residual Add, left to fuse-skip-layer-norm",
    "residual-reshaped": "reads the sum [2, 4, 3, 16] + [2, 4, 3, 16] of two computed tensors: a residual Add, left to fuse-skip-layer-norm",
    "gamma-input": "gamma is computed at run time; this rewrite takes constant gamma and beta",
    "last-dim-changed": "the Reshape between the Add and the LayerNorm does not keep the last dim: 16 -> 8",
    "mean-used": "the LayerNorm's mean / inv-std outputs are used",
    "stash-type-0": "stash_type 0; SkipLayerNormalization computes in float32",
    "float64": "dtype float64; the kernels take float32, float16 and bfloat16",
}


@pytest.mark.parametrize("kind", list(LOOKALIKES))
def test_a_lookalike_is_refused_with_its_reason_and_left_as_it_was(kind):
    proto = lookalike(kind)
    source = op_counts(load_model(proto))
    model, by_pass = fuse(proto)
    result = by_pass[PASS]
    assert (result.sites_matched, result.sites_rewritten) == (1, 0)
    assert result.refused[0][1] == LOOKALIKES[kind]
    assert op_counts(model) == source


def test_a_residual_sum_is_left_to_skip_layer_norm_and_a_broadcast_one_to_no_one():
    model, by_pass = fuse(lookalike("residual"), "fuse-skip-layer-norm", PASS)
    assert by_pass["fuse-skip-layer-norm"].sites_rewritten == 1 and by_pass[PASS].sites_matched == 0
    assert op_counts(model) == Counter({"SkipLayerNormalization": 1})
    model, by_pass = fuse(lookalike("computed-b-1-d"), "fuse-skip-layer-norm", PASS)
    assert by_pass["fuse-skip-layer-norm"].sites_rewritten == by_pass[PASS].sites_rewritten == 0
    assert op_counts(model)["LayerNormalization"] == 1


def test_listed_before_fuse_skip_layer_norm_it_is_refused_up_front():
    with pytest.raises(PassOrderError, match="'fuse-bias-layer-norm' must run after 'fuse-skip-layer-norm'"):
        PassManager([PASS, "fuse-skip-layer-norm"])
