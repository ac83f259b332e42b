"""Claims about the pipeline folder optimum-onnx writes (``models/pipelines/sd15-tiny-optimum``, made by
``python3 -m models.optimum_fixture``: the repo's tiny SD 1.5 pipeline through
``optimum-cli export onnx --task text-to-image``; versions in its PROVENANCE.txt).

* Its CLIP text encoder (transformers' SDPA, TorchScript exporter) slices the causal mask to the key
  length, ``mask[:, :, :, :key_len]``, of a mask expanded to ``seq + (seq - seq)`` keys, added to
  position embeddings sliced ``[:, :seq]`` from 77: ``Dims`` proves the mask's last dims (S, L) from
  what the graph computes, so every attention fuses, computing what the export computes; that mask,
  transformers 4's ``Where(j < i + 1, 0, min)`` expanded and sliced, is proven causal
  (``unidirectional=1``, no attention_bias), as the TorchScript exports' own causal masks are.
* A mask sliced to another length than the keys' stays refused; a mask that lets each query see one
  key ahead (``j < i + 2``) is not causal and goes to attention_bias, computing the same.
* A fusion's refused sites show in the folder summary, not only in --report-json.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from onnxopt import optimize
from onnxopt.pattern.dims import Dim, Dims, same
from onnxopt.verify import InputSpec, assert_same_computation
from tests.conftest import result_of

FOLDER = __import__("pathlib").Path(__file__).parent.parent / "models" / "pipelines" / "sd15-tiny-optimum"
TEXT_ENCODER = FOLDER / "text_encoder" / "model.onnx"
LAYERS = 2  # the tiny CLIP's
TEXT_INPUTS = InputSpec(shapes={"input_ids": (2, 77)})


def test_optimum_clip_attention_fuses_with_its_mask_sliced_to_the_key_length():
    model, report = optimize(TEXT_ENCODER, ["ort-cuda"])
    attention = result_of(report, "fuse-attention")
    assert attention.refused == [] and attention.sites_rewritten == LAYERS
    assert attention.details.get("causal") == LAYERS and not attention.details.get("attention_bias")
    fused = [n for n in model.graph.nodes if n.domain == "com.microsoft" and n.op in ("MultiHeadAttention", "Attention")]
    assert len(fused) == LAYERS and all(n.attrs.get("unidirectional") == 1 for n in fused)
    assert_same_computation(TEXT_ENCODER, model, atol=1e-5, rtol=1e-4, inputs=TEXT_INPUTS)


def test_a_mask_that_lets_a_query_see_one_key_ahead_is_not_causal_and_stays_an_attention_bias(tmp_path):
    graph = gs.import_onnx(onnx.load(str(TEXT_ENCODER)))
    (next_row,) = [n for n in graph.nodes if n.op == "Add" and any(t.inputs and t.inputs[0].op == "Range" for t in n.inputs)]
    next_row.inputs[1] = gs.Constant("two", np.array(2, np.int64))  # j < i + 2
    path = tmp_path / "text_encoder.onnx"
    onnx.save(gs.export_onnx(graph), str(path))

    model, report = optimize(path, ["ort-cuda"])

    attention = result_of(report, "fuse-attention")
    assert attention.sites_rewritten == LAYERS and attention.refused == []
    assert not attention.details.get("causal") and attention.details.get("attention_bias") == LAYERS
    assert_same_computation(path, model, atol=1e-5, rtol=1e-4, inputs=TEXT_INPUTS)


def test_a_mask_sliced_to_another_length_than_the_keys_is_refused(tmp_path):
    proto = onnx.load(str(TEXT_ENCODER))
    graph = gs.import_onnx(proto)
    sliced = [n for n in graph.nodes if n.op == "Slice" and "self_attn" in n.name]
    assert len(sliced) == LAYERS
    sliced[0].inputs[2] = gs.Constant("three_keys", np.array([3], np.int64))  # mask[..., :3]
    path = tmp_path / "text_encoder.onnx"
    onnx.save(gs.export_onnx(graph), str(path))

    _, report = optimize(path, ["ort-cuda"])

    attention = result_of(report, "fuse-attention")
    assert attention.sites_rewritten == LAYERS - 1 and len(attention.refused) == 1
    assert "cannot prove its last dims are (S, L)" in attention.refused[0][1]


def test_a_refused_site_of_a_fusion_shows_in_the_folder_summary(tmp_path):
    from onnxopt.pipeline.optimize_folder import FolderReport, _optimize_component, read_components
    from onnxopt.verify import Tolerance

    (unet,) = [c for c in read_components(FOLDER) if c.name == "unet"]
    out = tmp_path / "unet"
    out.mkdir()
    component = _optimize_component(unet, out, FOLDER, "ort-cuda", False, False, Tolerance(), {}, 0.0)
    folder = FolderReport(str(FOLDER), str(tmp_path), "ort-cuda", False, components=[component])
    # the tiny UNet's GEGLU widths are not ones ORT's BiasSplitGelu kernel implements
    assert "unet: fuse-bias-split-gelu: refused 3 site(s): hidden size 64 is not one" in folder.table()


# ---------------------------------------------------------------- the Dims rules that prove it


def test_dims_prove_a_mask_sliced_to_the_key_length_from_what_the_graph_computes():
    x = gs.Variable("x", np.float32, ["batch", "seq", 8])
    mask = gs.Variable("mask", np.float32, ["batch", 1, "seq", 1])
    graph = gs.Graph(inputs=[x, mask], opset=17)
    length = graph.layer(op="Shape", inputs=[x], outputs=["length"], attrs={"start": 1, "end": 2})[0]
    zero = graph.layer(op="Sub", inputs=[length, length], outputs=["zero"])[0]  # transformers' past length
    keys = graph.layer(op="Add", inputs=[length, zero], outputs=["keys"])[0]
    starts, last = gs.Constant("starts", np.array([0], np.int64)), gs.Constant("last", np.array([3], np.int64))
    expanded = graph.layer(op="Expand", inputs=[mask, graph.layer(op="Concat", inputs=[
        gs.Constant("b1", np.array([1, 1], np.int64)), length, keys], outputs=["target"], attrs={"axis": 0})[0]],
        outputs=["expanded"])[0]
    kept = graph.layer(op="Slice", inputs=[expanded, starts, length, last], outputs=["kept"])[0]
    short = graph.layer(op="Slice", inputs=[expanded, starts, gs.Constant("three", np.array([3], np.int64)), last],
                        outputs=["short"])[0]
    positions = gs.Constant("positions", np.zeros((1, 77, 8), np.float32))
    first = graph.layer(op="Slice", inputs=[positions, starts, length, gs.Constant("axis1", np.array([1], np.int64))],
                        outputs=["first"])[0]
    summed = graph.layer(op="Add", inputs=[x, first], outputs=["summed"])[0]
    seq = Dim(1, ("seq",))
    dims = Dims()
    assert dims.vector(zero) == [Dim(0)] and dims.vector(keys) == [seq]
    assert same(dims.shape(kept)[3], seq)                    # [..., :seq] of seq keys: seq
    assert not same(dims.shape(short)[3], seq)               # [..., :3]: min(seq, 3), not the keys
    assert same(dims.shape(summed)[1], seq)                  # seq + min(77, seq) broadcast: seq


def test_the_host_loop_feeds_optimums_scalar_timestep_as_a_scalar(tmp_path):
    """optimum exports the UNet's ``timestep`` as a 0-d tensor. The host loop (the folder's own PNDM,
    or ``fused_step=False``) once fed it as shape (1,) (np.ascontiguousarray makes a 0-d array 1-d) and
    ONNX Runtime failed inside the time projection; now the unfused DDIM loop gives the fused step
    graph's latents, and ``generate`` with the folder's own scheduler writes its image."""
    import numpy as np

    from onnxopt.cli import main
    from onnxopt.pipeline import Pipeline

    request = dict(prompt="a red cube", steps=3, scheduler="ddim", seed=0, progress=False)
    unfused = Pipeline.load(FOLDER, "cpu", fused_step=False)(**request)
    fused = Pipeline.load(FOLDER, "cpu")(**request)
    np.testing.assert_allclose(unfused.latents, fused.latents, rtol=0, atol=1e-4 * float(np.abs(fused.latents).max()))
    assert main(["generate", str(FOLDER), "--prompt", "a red cube", "--steps", "2", "-q", "-o", str(tmp_path / "a.png")]) == 0
    assert (tmp_path / "a.png").stat().st_size > 0
