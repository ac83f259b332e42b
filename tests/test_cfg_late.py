"""cfg-late: the step graph computes what both guidance halves share once, and still computes the same step.

Claims:

* On the step graphs of the tiny SD 1.5, SD 2.1 and SDXL UNets from both exporters, and of the SD 1.5
  + ControlNet pipeline's UNet (residual inputs), raw and ``ort-cuda``-optimized (run on onnxopt's
  reference kernels), and of the static SD 1.5 exports (constant shapes spelling the batch), the
  rewritten step graph gives the step graph's ``latents_out``, ``state_out``
  and ``guided_output`` on random inputs for b = 1 and 2 images (fp32, within 1e-5 of their scale:
  the half-batch kernels may sum in another order). Its inputs and outputs are the step graph's.
* What moves: the latents' Concat is gone (conv_in and every Shape of the sample read the half);
  SD and ControlNet move their first self-attention and stop at the first cross-attention; SDXL
  stops at its time embedding, which meets the pooled text (``text_embeds``) at once.
* Lookalikes stay: a Concat of two different tensors seeds nothing; a Reshape to an odd leading
  dim, a Transpose that moves the batch, a Reshape whose batch comes from the text side and an Add
  of a batch-carrying constant are frontiers, and the result is still the same computation.
* Shapes of a moved tensor still give the full batch where a full-batch node reads them.
* The comparison can fail: a broadcast of the wrong half is caught.
* A full generate run (fp32, same seed) on an optimized folder with ``cfg_late`` gives the image of
  the folder without it; ``Pipeline.load(step_file=...)`` runs a variant written beside step.onnx.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxopt
from onnxopt import load_model
from onnxopt.passes.cfg_late import CFG_LATE_METADATA, CfgLate, compute_halves_once
from onnxopt.pipeline.step_graph import STEP_INPUTS, build_step_graph
from tests.test_pipeline_step_graph import H, W, runner, step_feeds, step_runner

ort = pytest.importorskip("onnxruntime")

ATTENTION_OPS = ("Softmax", "MultiHeadAttention", "Attention")


def residual_feeds(unet: onnxopt.Model, b: int, seed: int) -> dict:
    """ControlNet residual inputs at batch 2b (their dims are named height, height_div2, ...)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for t in unet.graph.inputs:
        if t.name.startswith(("down_block_res", "mid_block_res")):
            factor = int(t.shape[2].split("div")[1]) if "div" in str(t.shape[2]) else 1
            feeds[t.name] = rng.standard_normal((2 * b, t.shape[1], H // factor, W // factor)).astype(np.float32)
    return feeds


def assert_same_step(unet: onnxopt.Model, step: onnxopt.Model, late: onnxopt.Model, atol: float = 1e-5,
                     batches=(1, 2)):
    run_step, run_late = step_runner(runner(step)), step_runner(runner(late))
    for b in batches:
        feeds = dict(step_feeds(unet, b, b), **residual_feeds(unet, b, b))
        expected, got = run_step(feeds), run_late(feeds)
        for name in ("latents_out", "state_out", "guided_output"):
            assert got[name].shape == expected[name].shape
            np.testing.assert_allclose(got[name], expected[name], rtol=0,
                                       atol=atol * max(1.0, float(np.abs(expected[name]).max())))


def io(model: onnxopt.Model):
    return ([(t.name, np.dtype(t.dtype), t.shape) for t in model.graph.inputs],
            [(t.name, np.dtype(t.dtype)) for t in model.graph.outputs])


def latents_concat(model: onnxopt.Model) -> list:
    """The step graph's Concat([latents * c_in] * 2), if it is still there."""
    return [n for n in model.graph.nodes if n.op == "Concat" and n.name.startswith("step/model_input")]


def late_step(unet: onnxopt.Model):
    """(step graph, step graph with cfg-late, the pass's details)."""
    step = build_step_graph(unet)
    late = build_step_graph(unet)
    result = compute_halves_once(late, STEP_INPUTS)
    assert result.modified
    return step, late, result.details


@pytest.fixture(scope="module")
def controlnet_unet(tmp_path_factory):
    """The UNet of the tiny SD 1.5 + ControlNet pipeline (TorchScript: its residual inputs are varargs,
    which the dynamo exporter's dynamic_axes conversion refuses in models/pipelines.py today)."""
    pytest.importorskip("diffusers")
    from models.pipelines import write_onnx_folder

    root = tmp_path_factory.mktemp("cfg-late-controlnet")
    write_onnx_folder("sd15-controlnet", root, "tiny", "torchscript", 0, components=("unet",))
    return root / "unet" / "model.onnx"


# SDXL's reference-kernel run and the dynamo exports (shared with test_attention_fusion in a full run) are
# the slow ones: marked, and still run by CI's plain ``pytest``.
SLOW = {("unet-sdxl", "dynamo", "raw"), ("unet-sdxl", "torchscript", "ort-cuda"), ("unet-sd15", "dynamo", "raw"),
        ("unet-sd21", "dynamo", "raw")}
UNET_CASES = [pytest.param(family, exporter, preset, id=f"{family}-{exporter}-{preset}",
                           marks=[pytest.mark.slow] if (family, exporter, preset) in SLOW else [])
              for family in ("unet-sd15", "unet-sd21", "unet-sdxl", "sd15-controlnet")
              for exporter in ("torchscript", "dynamo") for preset in ("raw", "ort-cuda")
              if (family, exporter) != ("sd15-controlnet", "dynamo")]


@pytest.mark.models
@pytest.mark.parametrize("family, exporter, preset", UNET_CASES)
def test_cfg_late_step_graph_computes_the_same_step(request, export_tiny, family, exporter, preset):
    path = request.getfixturevalue("controlnet_unet") if family == "sd15-controlnet" else export_tiny(family, exporter).path
    unet = load_model(path) if preset == "raw" else onnxopt.optimize(path, [preset])[0]
    step, late, details = late_step(unet)

    assert io(late) == io(step)  # the pipeline contract: same inputs and outputs
    assert not latents_concat(late)  # the latents' Concat is gone
    moved = details["ops_moved"]
    assert moved.get("Conv", 0) + moved.get("NhwcConv", 0) >= 1  # conv_in at batch b
    frontier_ops = [f["op"] for f in details["frontier"]]
    if family == "unet-sdxl":  # the time embedding meets text_embeds before any attention
        assert not any(moved.get(op) for op in ATTENTION_OPS)
    else:  # the first transformer's self-attention moved; its cross-attention is the frontier
        assert sum(moved.get(op, 0) for op in ATTENTION_OPS) == 1
        assert details["nodes_moved"] >= 30
    assert frontier_ops and details["broadcasts"]
    if preset == "ort-cuda":
        from onnxopt import reference

        assert reference.unsupported_on_ort_cpu(late.to_onnx())  # really the fused graph, on the reference kernels
    # SDXL on the reference kernels takes seconds a run: 2 images only (b = 1 is covered by its raw graphs)
    assert_same_step(unet, step, late, batches=(2,) if (family, preset) == ("unet-sdxl", "ort-cuda") else (1, 2))


@pytest.mark.parametrize("preset", ["raw", "ort-cuda"])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_static_exports_halve_their_constant_shapes(fixtures_dir, exporter, preset):
    """Static exports (batch 2 spelled in every Reshape target): the targets' leading 2 becomes 1,
    the first self-attention still moves, and the one-image step is the same."""
    path = fixtures_dir / f"unet-sd15.tiny.{exporter}.static.sdpa.onnx"
    unet = load_model(path) if preset == "raw" else onnxopt.optimize(path, [preset])[0]
    step, late, details = late_step(unet)
    assert io(late) == io(step) and not latents_concat(late)
    assert sum(details["ops_moved"].get(op, 0) for op in ATTENTION_OPS) == 1
    assert details["ops_moved"].get("Reshape", 0) >= (1 if preset == "ort-cuda" else 4)
    assert_same_step(unet, step, late, batches=(1,))


def test_a_wrong_broadcast_is_caught(export_tiny):
    """The comparison can fail: the first broadcast made of the latents' half and a zero half differs."""
    unet = load_model(export_tiny("unet-sd15").path)
    step, late, details = late_step(unet)
    concat = next(n for n in late.graph.nodes if n.op == "Concat" and n.name.startswith("cfg_late/broadcast"))
    concat.inputs[1] = zeroed(concat.inputs[0], late)
    with pytest.raises(AssertionError):
        assert_same_step(unet, step, late)


def zeroed(t, model):
    """Mul(t, 0): zeros of ``t``'s shape, whatever the batch."""
    import onnx_graphsurgeon as gs

    out = gs.Variable(f"{t.name}/zeroed", dtype=t.dtype, shape=t.shape)
    zero = gs.Constant(f"{t.name}/zero", np.zeros((), np.dtype(t.dtype)))
    model.graph.nodes.append(gs.Node("Mul", f"{t.name}/zeroing", inputs=[t, zero], outputs=[out]))
    model.graph.toposort()
    return out


def test_fp16_step_graph_moves_the_cast_too(export_tiny):
    """The fp16 UNet's step graph: Concat -> Cast(f16) -> conv_in; the Cast and conv_in move, the
    step is the same (ORT CPU runs both the same fp16 kernels at both batches)."""
    unet, _ = onnxopt.optimize(export_tiny("unet-sd15").path, ["fp16"])
    step, late, details = late_step(unet)
    assert details["ops_moved"].get("Cast", 0) >= 1
    assert not latents_concat(late)
    assert_same_step(unet, step, late, atol=2e-3)


# ---------------------------------------------------------------------------- hand-built graphs


def graph_model(nodes, inputs, outputs, initializers=(), opset=17) -> onnxopt.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def value(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def ints(name, values):
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], list(values))


def run_both(model_before: onnx.ModelProto, model_after: onnxopt.Model, feeds: dict):
    before = ort.InferenceSession(model_before.SerializeToString(), providers=["CPUExecutionProvider"])
    after = ort.InferenceSession(model_after.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in before.get_outputs()]
    return before.run(names, feeds), after.run(names, feeds)


def rewrite(model: onnxopt.Model, shared=("a",), small_row_elements=0):
    """The pass on a hand-built graph; its tensors are all small, so the cost rule that sends small
    branches back to the full batch is off unless asked for."""
    before = model.to_onnx()
    details = compute_halves_once(model, shared, small_row_elements).details
    return before, details


def test_a_concat_of_two_different_tensors_seeds_nothing():
    model = graph_model([helper.make_node("Concat", ["a", "b"], ["x"], axis=0),
                         helper.make_node("Relu", ["x"], ["y"])],
                        [value("a", [1, 4]), value("b", [1, 4])], [value("y", [2, 4])])
    result = CfgLate({"a", "b"}).run(model)
    assert not result.modified and "nothing computed" in result.nothing_to_do


def test_cfg_late_is_a_registered_pass_the_manager_runs_by_name():
    """``--passes cfg-late``: the manager infers shapes first (the pass requires them) and again
    after the rewrite (its follower); a lookalike is a refusal in the report, with its reason; the
    graph computes what it did."""
    nodes = [helper.make_node("Concat", ["a", "a"], ["x"], axis=0), helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Transpose", ["r"], ["y"], perm=[1, 0, 2])]
    model = graph_model(nodes, [value("a", [1, 6, 4])], [value("y", [6, 2, 4])])
    before = model.to_onnx()
    model, report = onnxopt.optimize(model, ["cfg-late"])
    steps = [(step.name, step.auto) for step in report.passes]
    assert steps == [("infer-shapes", "cfg-late"), ("cfg-late", None), ("infer-shapes", "cfg-late")]
    result = report.passes[1].result
    assert result.modified and result.sites_rewritten == 1
    assert result.refused == [(next(n.name for n in model.graph.nodes if n.op == "Transpose"),
                               "perm [1, 0, 2] moves the batch axis")]
    feeds = {"a": np.random.default_rng(3).standard_normal((1, 6, 4)).astype(np.float32)}
    expected, got = run_both(before, model, feeds)
    np.testing.assert_array_equal(got[0], expected[0])


@pytest.mark.parametrize("case", ["odd reshape", "transpose", "text batch", "batched constant"])
def test_lookalikes_are_frontiers_and_the_computation_is_kept(case):
    """x = Concat([a, a]) [2, 6, 4]; a row-wise Relu moves; the node under test must not, and
    reads Concat([h, h]) instead; the outputs are unchanged."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Concat", ["a", "a"], ["x"], axis=0), helper.make_node("Relu", ["x"], ["r"])]
    inputs, inits = [value("a", [1, 6, 4])], []
    if case == "odd reshape":  # [2, 6, 4] -> [3, 16]: the batch rows are cut in the middle of a row
        nodes.append(helper.make_node("Reshape", ["r", "target"], ["y"]))
        inits.append(ints("target", [3, 16]))
        out = value("y", [3, 16])
    elif case == "transpose":
        nodes.append(helper.make_node("Transpose", ["r"], ["y"], perm=[1, 0, 2]))
        out = value("y", [6, 2, 4])
    elif case == "text batch":  # Reshape(r, [Shape(text)[0], -1]): a batch read from the text side, not proven even
        nodes += [helper.make_node("Shape", ["text"], ["text_shape"], start=0, end=1),
                  helper.make_node("Concat", ["text_shape", "minus_one"], ["target"], axis=0),
                  helper.make_node("Reshape", ["r", "target"], ["flat"]),
                  helper.make_node("Add", ["flat", "bias"], ["y"])]
        inputs.append(value("text", ["text_batch", 5]))
        inits += [ints("minus_one", [-1]), helper.make_tensor("bias", TensorProto.FLOAT, [1], [0.5])]
        out = value("y", [2, 24])
    else:  # a constant with a batch of its own: its two rows differ
        nodes.append(helper.make_node("Add", ["r", "rows"], ["y"]))
        inits.append(helper.make_tensor("rows", TensorProto.FLOAT, [2, 1, 1], [1.0, -1.0]))
        out = value("y", [2, 6, 4])
    model = graph_model(nodes, inputs, [out], inits)
    before, details = rewrite(model)
    assert details["ops_moved"] == {"Relu": 1}
    (frontier,) = details["frontier"]
    assert frontier["op"] == {"odd reshape": "Reshape", "transpose": "Transpose", "text batch": "Reshape",
                              "batched constant": "Add"}[case]
    assert details["broadcasts"] == ["r"]
    feeds = {"a": rng.standard_normal((1, 6, 4)).astype(np.float32)}
    if case == "text batch":
        feeds["text"] = rng.standard_normal((2, 5)).astype(np.float32)
    expected, got = run_both(before, model, feeds)
    np.testing.assert_array_equal(got[0], expected[0])


def test_an_even_reshape_and_expand_move_and_shapes_keep_the_full_batch():
    """Reshape to an even leading dim ([2, 6, 4] -> [4, 12]: each half is whole rows) and a
    timestep Expand to Shape(x)[0] move; Shape(x) still gives 2 to the full-batch Reshape of the
    text input that reads it."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Concat", ["a", "a"], ["x"], axis=0),
        helper.make_node("Reshape", ["x", "even"], ["folded"]),
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Gather", ["x_shape", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "axis0"], ["batch1"]),
        helper.make_node("Expand", ["t", "batch1"], ["t_batch"]),
        helper.make_node("Unsqueeze", ["t_batch", "axis1"], ["t_col"]),
        helper.make_node("Sin", ["t_col"], ["t_emb"]),
        helper.make_node("Concat", ["batch1", "minus_one"], ["text_target"], axis=0),
        helper.make_node("Reshape", ["text", "text_target"], ["text_flat"]),
        helper.make_node("MatMul", ["folded", "w"], ["projected"]),
    ]
    inits = [ints("even", [4, 12]), helper.make_tensor("zero", TensorProto.INT64, [], [0]), ints("axis0", [0]),
             ints("axis1", [1]), ints("minus_one", [-1]),
             helper.make_tensor("w", TensorProto.FLOAT, [12, 3], rng.standard_normal(36).astype(np.float32).tolist())]
    model = graph_model(nodes, [value("a", [1, 6, 4]), value("t", [1]), value("text", [2, 3, 5])],
                        [value("projected", [4, 3]), value("t_emb", [2, 1]), value("text_flat", [2, 15])], inits)
    before, details = rewrite(model, shared=("a", "t"))
    assert details["ops_moved"] == {"Reshape": 1, "Expand": 1, "Unsqueeze": 1, "Sin": 1, "MatMul": 1}
    assert details["shapes_rewritten"] == 1 and not details["frontier"]
    assert sorted(details["broadcasts"]) == ["projected", "t_emb"]  # graph outputs keep the full batch
    feeds = {"a": rng.standard_normal((1, 6, 4)).astype(np.float32), "t": np.array([0.7], np.float32),
             "text": rng.standard_normal((2, 3, 5)).astype(np.float32)}
    expected, got = run_both(before, model, feeds)
    for e, g in zip(expected, got):
        assert g.shape == e.shape
        np.testing.assert_array_equal(g, e)


def test_small_branches_read_only_at_the_full_batch_go_back_to_it():
    """The cost rule: a shared embedding e = Sigmoid(Concat([a, a])) feeds one projection on the
    moved path and two that only the text side reads (each resnet's time-embedding projection).
    Without the rule each of those is a broadcast; with it they run at the full batch on one
    broadcast of e, as do small nodes whose only readers are full (Relu); the result is the same."""
    rng = np.random.default_rng(2)
    weights = [helper.make_tensor(f"w{i}", TensorProto.FLOAT, [8, 8], rng.standard_normal(64).astype(np.float32).tolist())
               for i in range(3)]
    nodes = [helper.make_node("Concat", ["a", "a"], ["x"], axis=0), helper.make_node("Sigmoid", ["x"], ["e"]),
             helper.make_node("MatMul", ["e", "w0"], ["p0"]), helper.make_node("Add", ["p0", "x"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"]), helper.make_node("Mul", ["r", "text"], ["y0"])]
    for i in (1, 2):
        nodes += [helper.make_node("MatMul", ["e", f"w{i}"], [f"p{i}"]), helper.make_node("Add", [f"p{i}", "text"], [f"y{i}"])]
    inputs = [value("a", [1, 8]), value("text", [2, 8])]
    outputs = [value(f"y{i}", [2, 8]) for i in range(3)]
    feeds = {"a": rng.standard_normal((1, 8)).astype(np.float32), "text": rng.standard_normal((2, 8)).astype(np.float32)}
    broadcasts = {}
    for limit in (0, 4096):
        model = graph_model(nodes, inputs, outputs, weights)
        before, details = rewrite(model, small_row_elements=limit)
        broadcasts[limit] = sorted(details["broadcasts"])
        expected, got = run_both(before, model, feeds)
        for e, g in zip(expected, got):
            np.testing.assert_allclose(g, e, rtol=0, atol=1e-6)
    assert broadcasts[0] == ["p1", "p2", "r"]
    assert broadcasts[4096] == ["e", "s"]


# ---------------------------------------------------------------------------- the pipeline


COMMITTED_SD15 = Path(__file__).resolve().parents[1] / "models" / "pipelines" / "sd15-tiny"


@pytest.mark.models
def test_generate_with_cfg_late_gives_the_same_image(tmp_path):
    """optimize_folder(cfg_late=True) (TensorRT target: standard ONNX the CPU runs) writes a step.onnx
    that says what moved; a full generate run (fp32, DPM-Solver++ 2M, same seed) gives the image of
    the folder without cfg-late. In that folder, write_step_graph(file_name=...) adds the variant
    beside step.onnx (with its own context_kv part), and Pipeline.load(step_file=...) runs it."""
    pytest.importorskip("diffusers")
    from onnxopt.pipeline import Pipeline, optimize_folder
    from onnxopt.pipeline.runner import GenerationError
    from onnxopt.pipeline.step_graph import write_step_graph

    plain, late = tmp_path / "plain", tmp_path / "late"
    optimize_folder(COMMITTED_SD15, plain, target="tensorrt")
    report = optimize_folder(COMMITTED_SD15, late, target="tensorrt", cfg_late=True)
    assert any("cfg-late:" in note and "nodes at batch b" in note for note in report.component("unet").notes)
    props = {p.key: p.value for p in onnx.load(str(late / "unet" / "step.onnx"), load_external_data=False).metadata_props}
    assert "nodes at batch b" in props[CFG_LATE_METADATA]

    request = dict(prompt="a red cat", negative_prompt="blurry", steps=3, guidance=7.5, scheduler="dpm++2m", seed=0,
                   height=32, width=48, progress=False)
    reference = Pipeline.load(plain, "cpu", threads=1)(**request)
    with_late = Pipeline.load(late, "cpu", threads=1)(**request)
    scale = float(np.abs(reference.latents).max())
    np.testing.assert_allclose(with_late.latents, reference.latents, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(with_late.pixels, reference.pixels, rtol=0, atol=1e-5)
    other_seed = Pipeline.load(late, "cpu", threads=1)(**dict(request, seed=1))
    assert np.abs(other_seed.latents - reference.latents).max() > 1e-2 * scale  # the check can fail

    write_step_graph(plain / "unet", file_name="step.cfg_late.onnx", cfg_late=True)
    assert (plain / "unet" / "step.cfg_late.context_kv.onnx").is_file()
    variant = Pipeline.load(plain, "cpu", threads=1, step_file="step.cfg_late.onnx")
    result = variant(**request)
    assert result.timings["step"] == "unet/step.cfg_late.onnx + step.cfg_late.context_kv.onnx"
    np.testing.assert_allclose(result.latents, reference.latents, rtol=0, atol=1e-5 * scale)
    with pytest.raises(GenerationError, match="no step graph of that name"):
        Pipeline.load(plain, "cpu", step_file="../model.onnx")


def test_cfg_late_needs_a_folder(tmp_path, capsys):
    from onnxopt.cli import main

    model = graph_model([helper.make_node("Relu", ["x"], ["y"])], [value("x", [1])], [value("y", [1])])
    onnxopt.save_model(model, tmp_path / "m.onnx")
    assert main(["optimize", "-i", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx"), "--cfg-late"]) == 2
    assert "--cfg-late rewrites a pipeline folder's step graph" in capsys.readouterr().err


@pytest.mark.gpu
def test_cfg_late_fp16_step_graph_on_the_cuda_ep(export_tiny):
    """On a GPU (``pytest -m gpu``): the ``ort-cuda,fp16`` step graph with cfg-late runs on the CUDA EP
    and gives the step graph's output within a few fp16 ulps (kernels at batch b may round otherwise)."""
    from onnxopt.runners import cuda_available

    if not cuda_available():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")
    unet, _ = onnxopt.optimize(export_tiny("unet-sd15").path, ["ort-cuda", "fp16"])
    step, late, _ = late_step(unet)

    def cuda(model):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(model.to_onnx().SerializeToString(), options,
                                       providers=["CUDAExecutionProvider"])
        assert session.get_providers()[0] == "CUDAExecutionProvider"
        names = [o.name for o in session.get_outputs()]
        return step_runner(lambda feeds: dict(zip(names, session.run(names, feeds))))

    run_step, run_late = cuda(step), cuda(late)
    for b in (1, 2):
        feeds = step_feeds(unet, b, b)
        expected, got = run_step(feeds)["guided_output"], run_late(feeds)["guided_output"]
        assert np.abs(got - expected).max() <= 8 * 2.0**-11 * (1 + 2 * feeds["guidance_scale"][0]) * np.abs(expected).max()


@pytest.mark.gpu
def test_cfg_late_folder_on_the_cuda_ep_with_cuda_graphs(tmp_path):
    """On a GPU: an ``ort-cuda`` fp16 folder's step graph with cfg-late (written beside step.onnx)
    is captured as a CUDA graph like step.onnx, and a generate run gives step.onnx's latents within
    fp16 rounding (kernels at batch b may round otherwise: 1e-2 of the latents' scale)."""
    from onnxopt.pipeline import Pipeline, optimize_folder
    from onnxopt.pipeline.step_graph import write_step_graph
    from onnxopt.runners import cuda_available

    if not cuda_available():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")
    out = tmp_path / "ort-cuda-fp16"
    optimize_folder(COMMITTED_SD15, out, target="ort-cuda", fp16=True)
    write_step_graph(out / "unet", file_name="step.cfg_late.onnx", cfg_late=True)
    request = dict(prompt="a red cat", negative_prompt="blurry", steps=3, guidance=7.5, scheduler="ddim", seed=0,
                   height=64, width=64, progress=False)
    plain = Pipeline.load(out, "cuda", cuda_graph=True)
    late = Pipeline.load(out, "cuda", cuda_graph=True, step_file="step.cfg_late.onnx")
    assert plain.cuda_graph and late.cuda_graph
    expected, got = plain(**request), late(**request)
    scale = float(np.abs(expected.latents).max())
    np.testing.assert_allclose(got.latents, expected.latents, rtol=0, atol=1e-2 * scale)
