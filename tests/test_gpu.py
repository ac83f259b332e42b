"""On a GPU: the fused com.microsoft ops run on ONNX Runtime's CUDA EP and agree with our NumPy
reference kernels, and every fixture optimized for ort-cuda computes what its source computes.

Skipped where onnxruntime-gpu or a CUDA device is missing (CI); run with ``pytest -m gpu``.
"""

from __future__ import annotations

import numpy as np
import pytest

from onnxopt.runners import cuda_available
from tests.conftest import fixture_models
from onnx import helper, numpy_helper

from tests.test_reference_kernels import make_model, one_node, ref_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs onnxruntime-gpu and a CUDA device"),
]
F16, F32 = np.float16, np.float32


def cuda_run(model, feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    return session.run(None, feeds)


def rand(rng, *shape, dtype=F16, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def cases():
    rng = np.random.default_rng(0)
    n, h, w, c, g = 2, 8, 8, 64, 32
    x = rand(rng, n, h, w, c)
    gamma, beta = rand(rng, c, dtype=F32), rand(rng, c, dtype=F32)
    yield "GroupNorm+SiLU", one_node("GroupNorm", {"X": x, "gamma": gamma, "beta": beta}, ["Y"], groups=g, epsilon=1e-5, activation=1, channels_last=1)
    skip = rand(rng, n, 1, 1, c)
    yield "SkipGroupNorm", one_node("SkipGroupNorm", {"X": x, "gamma": gamma, "beta": beta, "skip": skip}, ["Y", "S"],
                                    groups=g, epsilon=1e-5, activation=1, channels_last=1)
    hidden = 2560
    yield "BiasSplitGelu", one_node("BiasSplitGelu", {"X": rand(rng, n, 16, hidden), "bias": rand(rng, hidden)}, ["Y"])
    yield "BiasAdd", one_node("BiasAdd", {"X": rand(rng, n, 16, 320), "bias": rand(rng, 320), "skip": rand(rng, n, 16, 320)}, ["Y"])
    # The CUDA EP runs NhwcConv only with W (and B) as initializers, as nhwc-conv writes them.
    w4, b4 = rand(rng, 32, 3, 3, c, scale=0.1), rand(rng, 32)
    node = helper.make_node("NhwcConv", ["X", "W", "B"], ["Y"], domain="com.microsoft", pads=[1, 1, 1, 1], kernel_shape=[3, 3])
    yield "NhwcConv", (make_model([node], {"X": x}, {"Y": F16}, [numpy_helper.from_array(w4, "W"), numpy_helper.from_array(b4, "B")]), {"X": x})
    heads, dh, s, kv = 8, 40, 64, 77
    yield "MHA packed QKV", one_node("MultiHeadAttention", {"query": rand(rng, n, s, heads, 3, dh)}, ["out"], num_heads=heads)
    yield "MHA packed KV", one_node("MultiHeadAttention", {"query": rand(rng, n, s, heads * dh), "key": rand(rng, n, kv, heads, 2, dh)},
                                    ["out"], num_heads=heads)
    yield "MHA separate Q,K,V", one_node("MultiHeadAttention", {"query": rand(rng, n, s, heads * dh), "key": rand(rng, n, kv, heads * dh),
                                                                "value": rand(rng, n, kv, heads * dh)}, ["out"], num_heads=heads)
    d = 320
    yield "SkipLayerNorm zero (1, D) skip", one_node(
        "SkipLayerNormalization", {"input": rand(rng, n * s, 1, d), "skip": np.zeros((1, d), F16), "gamma": rand(rng, d),
                                   "beta": rand(rng, d), "bias": rand(rng, d)}, ["output", "", "", "sum"], epsilon=1e-5)

    # the AdaLN modulation per sample (fuse-adaln-modulation at batch 2): scale and bias (B, 1, D), axis 2
    yield "LayerNorm per-sample scale (B, 1, D)", one_node(
        "LayerNormalization", {"X": rand(rng, n, s, d), "Scale": rand(rng, n, 1, d), "B": rand(rng, n, 1, d)}, ["Y"],
        domain="", axis=2, epsilon=1e-6)


CASES = dict(cases())


@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernel_matches_reference(name):
    model, feeds = CASES[name]
    for got, want in zip(cuda_run(model, feeds), ref_run(model, feeds)):
        np.testing.assert_allclose(got.astype(F32), want.astype(F32), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("path", fixture_models(), ids=lambda p: p.name)
def test_ort_cuda_preset_runs_on_cuda_and_matches_source(path):
    import onnxruntime as ort

    from onnxopt import optimize
    from onnxopt.verify import random_feeds

    model, _ = optimize(path, ["ort-cuda"])
    feeds = random_feeds(model)[0]
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = cuda_run(model.to_onnx(), feeds)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=2e-3, rtol=2e-3)
