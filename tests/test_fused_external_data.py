"""Every family's fused output, written with external data forced, is a model the runtimes load.

For each family of ``models/`` (tiny, TorchScript dynamic SDPA export) and each of ``ort-cuda``,
``ort-cuda,fp16`` and ``tensorrt``: the result saved with ``external_data=True`` passes
``onnx.checker`` (full check), and ONNX Runtime's CPU EP creates a session on the file and
computes what the in-memory result computes. Where the graph holds ops ORT's CPU build has no
kernel for (GroupNorm, SkipGroupNorm, BiasSplitGelu, BiasAdd, NhwcConv), that cannot be the
test; instead strict shape inference with data propagation runs on the file with its external
data not loaded (what ORT's loader does first, and what failed on the SDXL UNet's Split), and
the reference runtime computes, from the file, what it computes from the in-memory result.
Size thresholds are set to one byte, so every tensor the save's rule lets go external does: a
tiny model then stands for a full-size one (the tiny SDXL UNet's parallel-GEMM Split sizes are
96 bytes; the full one's, 1120, were over the 1024-byte threshold and ORT refused the file).
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from models import FAMILIES
from onnxopt import optimize, reference, save_model
from onnxopt.verify import random_feeds

pytestmark = pytest.mark.models

PASSES = ["ort-cuda", "ort-cuda,fp16", "tensorrt"]
CPU = ["CPUExecutionProvider"]
NO_CPU_KERNEL = ("GroupNorm", "SkipGroupNorm", "BiasSplitGelu", "BiasAdd", "NhwcConv")  # ORT CUDA/ROCm only


@pytest.fixture
def every_tensor_external(monkeypatch):
    """Size thresholds at one byte: every initializer goes to the data file unless the save's rule
    says it must stay inline."""
    monkeypatch.setattr("onnxopt.saving.SKELETON_THRESHOLD_BYTES", 1)
    monkeypatch.setattr("onnxopt.saving.EXTERNAL_MIN_BYTES", 1)


@pytest.mark.parametrize("passes", PASSES)
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_output_with_external_data_loads_and_computes_what_the_model_in_memory_computes(
        export_tiny, tmp_path, every_tensor_external, family, passes):
    exported = export_tiny(family)
    model, _ = optimize(exported.path, passes.split(","))
    path = tmp_path / "fused.onnx"
    info = save_model(model, path, external_data=True)
    assert info.external and info.data_path.stat().st_size > 0
    if family == "unet-sdxl" and "ort-cuda" in passes:
        # fuse-parallel-gemm's Split of every cross-attention's K/V projection: its sizes are what
        # the full SDXL UNet had external (int64[140]) and ORT refused. They stay inline.
        splits = [n for n in model.graph.nodes if n.op == "Split" and "parallel_gemm" in n.name]
        assert splits, "fuse-parallel-gemm wrote no Split: the test no longer covers its sizes"
        inline = {t.name for t in onnx.load(str(path), load_external_data=False).graph.initializer
                  if not onnx.external_data_helper.uses_external_data(t)}
        assert {s.inputs[1].name for s in splits} <= inline
    onnx.checker.check_model(str(path), full_check=True)
    feeds = random_feeds(model, exported.input_spec(), seed=0)[0]
    in_memory = model.to_onnx()
    if not reference.unsupported_on_ort_cpu(onnx.load(str(path), load_external_data=False)):
        expected = ort.InferenceSession(in_memory.SerializeToString(), providers=CPU).run(None, feeds)
        got = ort.InferenceSession(str(path), providers=CPU).run(None, feeds)
    else:
        onnx.shape_inference.infer_shapes_path(str(path), str(tmp_path / "inferred.onnx"), strict_mode=True, data_prop=True)
        assert_ort_loads_up_to_missing_kernels(path)
        expected = list(reference.run(in_memory, feeds).values())
        got = list(reference.run(onnx.load(str(path)), feeds).values())
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


def assert_ort_loads_up_to_missing_kernels(path) -> None:
    """ORT's CPU build loads the file (shape inference, external data) and stops, if at all, only
    where it has no kernel (GroupNorm & co.); a refused load says "Cannot parse data from external
    tensors" or names a file."""
    try:
        ort.InferenceSession(str(path), providers=CPU)
    except Exception as exc:  # onnxruntime's NotImplemented is not importable by name
        assert re.search(rf"NOT_IMPLEMENTED : (Could not find an implementation for |Failed to find kernel for "
                         rf"com\.microsoft\.)({'|'.join(NO_CPU_KERNEL)})\(", str(exc)), str(exc)
