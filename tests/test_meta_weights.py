"""Tests of the streamed full-size export (``models/metaweights.py``, ``python -m models export --streamed``).

Claims:

* A Flux transformer built on the meta device makes, one parameter at a time and in any order,
  exactly the seeded weights of the in-RAM build (float32 and bfloat16, bit for bit).
* What the replay cannot reproduce is refused when the model is built: a parameter drawn with
  ``torch.randn`` (the call cannot be traced to the parameter), and models with buffers (SD3).
* The lazy folding of weight transposes materialises nothing: weights are made when written, once.
* (slow) ``--streamed`` writes the graph the in-RAM dynamo export writes (the committed fixture):
  the same ops, the same initializer values, the same ONNX Runtime outputs; the folder is checked
  and renamed into place as without it.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import models  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
ir = pytest.importorskip("onnx_ir")


@pytest.mark.models
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_meta_built_flux_makes_the_in_ram_weights_bit_for_bit(dtype):
    dt = getattr(torch, dtype)
    in_ram = dict(models.build("flux-dev", "tiny", dtype=dt).module.named_parameters())
    meta = models.build("flux-dev", "tiny", dtype=dt, meta=True)
    assert all(p.is_meta for p in meta.module.parameters())
    order = meta.weights.names_in_order()
    assert sorted(order) == sorted(in_ram)
    # construction order (each random number drawn once), then backwards (states replayed)
    for name in order + order[::-1]:
        assert torch.equal(meta.weights.tensor(name), in_ram[name]), name
    # the perturbed norm weights are among them (the in-RAM build's constant parameters)
    assert any("norm" in n and meta.weights.params[n].noise_state is not None for n in order)


@pytest.mark.models
def test_meta_build_refuses_what_it_cannot_replay():
    from models.metaweights import SeededWeights, build_on_meta

    class DrawnWithRandn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

    with pytest.raises(NotImplementedError, match="randn"):
        build_on_meta(DrawnWithRandn)

    class InitialisedThroughData(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(4, 4))
            self.w.data.uniform_()  # .data is another tensor object: not traceable to the parameter

    module, calls = build_on_meta(InitialisedThroughData)
    with pytest.raises(NotImplementedError, match="not one of its parameters"):
        SeededWeights(module, calls)
    with pytest.raises(NotImplementedError, match="buffers"):
        models.build("sd3-medium", "tiny", meta=True)


def test_weight_transposes_fold_lazily_and_are_made_once_when_written(tmp_path):
    from models.bigexport import DATA_NAME, fold_weight_transposes, ir_save

    made = []
    weight = np.arange(6, dtype=np.float32).reshape(2, 3)

    def make():
        made.append(1)
        return ir.tensor(weight)

    w = ir.Value(name="w", shape=ir.Shape([2, 3]), type=ir.TensorType(ir.DataType.FLOAT),
                 const_value=ir.LazyTensor(make, dtype=ir.DataType.FLOAT, shape=ir.Shape([2, 3])))
    x = ir.Value(name="x", shape=ir.Shape([1, 3]), type=ir.TensorType(ir.DataType.FLOAT))
    t = ir.node("Transpose", [w], {"perm": [1, 0]}, num_outputs=1)
    t.outputs[0].name = "w_t"
    mm = ir.node("MatMul", [x, t.outputs[0]], num_outputs=1)
    mm.outputs[0].name = "y"
    graph = ir.Graph([x], mm.outputs, nodes=[t, mm], initializers=[w], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    assert fold_weight_transposes(model) == 1
    assert [n.op_type for n in graph] == ["MatMul"] and list(graph.initializers) == ["w_t"]
    assert made == []  # nothing materialised by the folding
    ir_save(model, tmp_path / "model.onnx")
    assert made == [1]  # made once, when written
    onnxruntime = pytest.importorskip("onnxruntime")
    feed = np.ones((1, 3), np.float32)
    got = onnxruntime.InferenceSession(str(tmp_path / "model.onnx")).run(None, {"x": feed})[0]
    np.testing.assert_array_equal(got, feed @ weight.T)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([DATA_NAME, "model.onnx"])


@pytest.mark.models
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ONNXOPT_STREAMED_EXPORT") != "1",
                    reason="minutes of tracing and rewriting on 2 cores: ONNXOPT_STREAMED_EXPORT=1 runs it")
def test_streamed_export_writes_the_in_ram_exports_graph_and_weights(tmp_path):
    """The committed fixture is the in-RAM dynamo export (optimize=True) of the same seeded model.
    Run where exports are cheap (ONNXOPT_STREAMED_EXPORT=1); the fast tests above prove the weights."""
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    import hashlib

    import onnxscript

    from models.bigexport import export_folder
    from models.export import op_counts, run_onnx

    dit = models.load_manifest("dit")
    if (dit["versions"]["torch"], dit["versions"]["onnxscript"]) != (torch.__version__, onnxscript.__version__):
        pytest.skip("the fixture was exported by another torch / onnxscript")
    entry = next(e for e in dit["fixtures"] if e["file"] == "flux-dev.tiny.dynamo.dynamic.sdpa.onnx")
    fixture = models.DIT_FIXTURES_DIR / entry["file"]
    out = tmp_path / "flux"
    summary = export_folder("flux-dev", out, size="tiny", exporter="dynamo", streamed=True, log=lambda *a: None)
    assert summary["streamed"] and json.loads((out / "export.json").read_text())["peak_rss_gb"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flux"]  # renamed into place, no partial folder
    path = out / "model.onnx"
    assert op_counts(path) == entry["ops"]

    def values(p):
        return sorted(hashlib.sha256(v.const_value.tobytes()).hexdigest()
                      for v in ir.load(str(p)).graph.initializers.values())

    assert values(path) == values(fixture)
    bm = models.build("flux-dev", "tiny")
    for dims in (bm.example_dims, bm.alt_dims):
        feeds = bm.make_feeds(dims)
        for got, want in zip(run_onnx(path, feeds), run_onnx(fixture, feeds)):
            np.testing.assert_array_equal(got, want)
