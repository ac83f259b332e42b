"""The fused step graph computes one denoising step exactly as the pipeline would around the UNet.

Claim: on tiny UNets from ``models/`` (SD 1.5 TorchScript and dynamo, SDXL with text_embeds and
time_ids), for b = 1 and 2 images, random latents, state, guidance and coefficients, the step graph's
``latents_out`` and ``state_out`` equal the reference: the source UNet run in ONNX Runtime at batch
2b on concat([latents * c_in] * 2), guidance and the update done in numpy. The same holds for the
step graph of the ``ort-cuda`` UNet (run on onnxopt's reference kernels), of fp16 UNets (fp32 and
fp16 interfaces), and of a UNet with ControlNet residual inputs (passed through). The UNet is left
as it was and its weights are shared, not copied; ``write_step_graph`` writes no weight twice.
"""

import hashlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxopt
from onnxopt import load_model, reference, save_model
from onnxopt.errors import UnsupportedModelError
from onnxopt.pipeline.step_graph import PREFIX, build_step_graph, write_step_graph

ort = pytest.importorskip("onnxruntime")

H, W = 16, 12  # latent size of the tiny exports (multiples of their down factor)


def runner(model_or_path):
    """name -> array function for a Model or a file: ORT CPU, or onnxopt's reference kernels for
    com.microsoft ops that ORT has no CPU kernel for."""
    proto = model_or_path.to_onnx() if isinstance(model_or_path, onnxopt.Model) else None
    if proto is not None and reference.unsupported_on_ort_cpu(proto):
        evaluator = reference.evaluator(proto)
        names = [o.name for o in proto.graph.output]
        return lambda feeds: dict(zip(names, evaluator.run(names, feeds)))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = proto.SerializeToString() if proto is not None else str(model_or_path)
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return lambda feeds: dict(zip(names, session.run(names, feeds)))


def scheduled(feeds: dict, row: int = 1, rows: int = 3) -> dict:
    """One step's feeds (``timestep``, ``step_coefficients``) as the step graph takes them: row
    ``row`` of ``rows``-row schedule tables whose other rows are garbage, and ``step_index`` = row."""
    rng = np.random.default_rng(row)
    timesteps = rng.integers(1, 999, rows).astype(feeds["timestep"].dtype)
    coefficients = rng.uniform(-9, 9, (rows, 6)).astype(np.float32)
    timesteps[row], coefficients[row] = feeds["timestep"][0], feeds["step_coefficients"]
    rest = {n: v for n, v in feeds.items() if n not in ("timestep", "step_coefficients")}
    return dict(rest, step_index=np.array([row], np.int64), schedule_timesteps=timesteps,
                schedule_coefficients=coefficients)


def step_runner(run, row: int = 1):
    """``run`` (a step graph's runner) fed one step's feeds; checks that the counter advanced."""
    def run_one(feeds):
        out = run(scheduled(feeds, row))
        assert out["step_index_out"].tolist() == [row + 1]
        return out
    return run_one


def step_feeds(unet: onnxopt.Model, b: int, seed: int) -> dict:
    """Random step-graph inputs for ``b`` images; conditioning inputs at batch 2b in the UNet's dtypes."""
    rng = np.random.default_rng(seed)
    inputs = {t.name: t for t in unet.graph.inputs}
    timestep_dtype = np.dtype(inputs["timestep"].dtype)
    feeds = {
        "latents": rng.standard_normal((b, 4, H, W)).astype(np.float32),
        "timestep": np.array([rng.integers(1, 999)]).astype(timestep_dtype),
        "guidance_scale": np.array([rng.uniform(1, 9)], np.float32),
        "step_coefficients": rng.uniform(-2, 2, 6).astype(np.float32),
        "state": rng.standard_normal((b, 4, H, W)).astype(np.float32),
    }
    for name, tensor in inputs.items():
        if name in ("sample", "timestep") or name.startswith(("down_block_res", "mid_block_res")):
            continue  # ControlNet residuals: the test gives them (their sizes are the UNet's business)
        shape = [2 * b] + [d if isinstance(d, int) else 77 for d in tensor.shape[1:]]
        feeds[name] = rng.standard_normal(shape).astype(np.dtype(tensor.dtype))
    return feeds


def reference_step(run_unet, unet: onnxopt.Model, feeds: dict, *, with_model_output: bool = False):
    """The step computed around the UNet: batch-2b call, guidance and update in numpy (float32):
    (latents_out, state_out), and the UNet's output too if asked."""
    inputs = {t.name: t for t in unet.graph.inputs}
    c_in, c_x, c_eps, c_state, d_x, d_eps = feeds["step_coefficients"]
    x, b = feeds["latents"], feeds["latents"].shape[0]
    sample = np.concatenate([x * c_in] * 2).astype(np.dtype(inputs["sample"].dtype))
    timestep = feeds["timestep"]
    if inputs["timestep"].shape == []:
        timestep = timestep.reshape(())
    elif inputs["timestep"].shape != [1]:  # [1]: one timestep the UNet broadcasts itself
        timestep = np.repeat(timestep, 2 * b)
    conditioning = {n: v for n, v in feeds.items() if n in inputs and n not in ("sample", "timestep")}
    eps2 = next(iter(run_unet(dict(sample=sample, timestep=timestep, **conditioning)).values())).astype(np.float32)
    eps_u, eps_c = eps2[:b], eps2[b:]
    eps = eps_u + feeds["guidance_scale"] * (eps_c - eps_u)
    latents_out, state_out = c_x * x + c_eps * eps + c_state * feeds["state"], d_x * x + d_eps * eps
    if with_model_output == "guided":
        return latents_out, state_out, eps
    return (latents_out, state_out, eps2) if with_model_output else (latents_out, state_out)


def assert_step_matches(unet: onnxopt.Model, step: onnxopt.Model, *, atol: float, seeds=(0, 1), batches=(1, 2)):
    run_unet, run_step = runner(unet), step_runner(runner(step))
    for b, seed in zip(batches, seeds):
        feeds = step_feeds(unet, b, seed)
        expected_latents, expected_state, expected_guided = reference_step(run_unet, unet, feeds, with_model_output="guided")
        got = run_step(feeds)
        np.testing.assert_allclose(got["guided_output"], expected_guided, atol=atol * max(1.0, np.abs(expected_guided).max()),
                                   rtol=0)
        assert got["latents_out"].dtype == np.float32 and got["latents_out"].shape == (b, 4, H, W)
        np.testing.assert_allclose(got["latents_out"], expected_latents, atol=atol, rtol=0)
        np.testing.assert_allclose(got["state_out"], expected_state, atol=atol, rtol=0)


def io(model: onnxopt.Model):
    return [(t.name, np.dtype(t.dtype), t.shape) for t in model.graph.inputs], [t.name for t in model.graph.outputs]


@pytest.mark.parametrize("family, exporter", [
    ("unet-sd15", "torchscript"), ("unet-sdxl", "torchscript"), ("unet-sd15", "dynamo"),
])
def test_step_graph_equals_unet_plus_numpy_update(export_tiny, family, exporter):
    unet = load_model(export_tiny(family, exporter).path)
    before = unet.to_onnx().SerializeToString()
    step = build_step_graph(unet)

    inputs, outputs = io(step)
    names = [n for n, _, _ in inputs]
    conditioning = ["encoder_hidden_states"] + (["text_embeds", "time_ids"] if family == "unet-sdxl" else [])
    assert names == ["latents", "state", "step_index", "schedule_timesteps", "schedule_coefficients",
                     "guidance_scale", *conditioning]
    assert outputs == ["latents_out", "state_out", "step_index_out", "guided_output"]
    shapes = {n: s for n, _, s in inputs}
    assert shapes["step_index"] == [1] and shapes["schedule_coefficients"] == ["schedule", 6]
    assert shapes["schedule_timesteps"] == ["schedule"] and shapes["guidance_scale"] == [1]
    # The UNet is unchanged, its weights are the same objects, and everything new is named step/...
    assert unet.to_onnx().SerializeToString() == before
    weights = {c.name: c for c in unet.constants()}
    assert all(c is weights[c.name] for c in step.constants() if not c.name.startswith(PREFIX))
    assert {c.name for c in step.constants()} >= set(weights)
    unet_nodes = {n.name for n in unet.graph.nodes}
    assert all(n.name.startswith(PREFIX) for n in step.graph.nodes if n.name not in unet_nodes)
    assert len(step.graph.nodes) > len(unet.graph.nodes)

    assert_step_matches(unet, step, atol=1e-5)


def test_step_graph_of_a_static_unet(fixtures_dir):
    """A static export (dynamo, opset 20, batch 2): the step graph takes one image, statically."""
    unet = load_model(fixtures_dir / "unet-sd15.tiny.dynamo.static.sdpa.onnx")
    step = build_step_graph(unet)
    shapes = {n: s for n, _, s in io(step)[0]}
    assert shapes["latents"] == shapes["state"] == [1, 4, H, W]
    assert [t.shape for t in step.graph.outputs] == [[1, 4, H, W]] * 2 + [[1]] + [[1, 4, H, W]]
    assert_step_matches(unet, step, atol=1e-5, batches=(1,))


def test_a_wrong_update_is_caught(export_tiny):
    """The comparison can fail: a step graph with c_x and c_eps swapped differs from the reference."""
    unet = load_model(export_tiny("unet-sd15").path)
    step = build_step_graph(unet)
    node = next(n for n in step.graph.nodes if n.name == f"{PREFIX}c_x_latents")
    split = next(n for n in step.graph.nodes if n.name == f"{PREFIX}coefficient")
    node.inputs[0] = split.outputs[2]
    with pytest.raises(AssertionError):
        assert_step_matches(unet, step, atol=1e-5, seeds=(0, 0))


def test_step_graph_of_the_ort_cuda_unet(export_tiny):
    """Fused com.microsoft ops inside: run on onnxopt's reference kernels, the step matches the
    same optimized UNet run on the same kernels plus the numpy update."""
    unet, _ = onnxopt.optimize(export_tiny("unet-sd15").path, ["ort-cuda"])
    step = build_step_graph(unet)
    assert reference.unsupported_on_ort_cpu(step.to_onnx())  # really the fused graph
    assert_step_matches(unet, step, atol=1e-5)


@pytest.mark.parametrize("keep_io_types", [True, False])
def test_step_graph_of_an_fp16_unet(export_tiny, keep_io_types):
    """fp16 UNet with float32 or float16 io: the step graph's latents, state and coefficients stay
    float32 (Casts around the UNet), and the step matches the same fp16 UNet run on the same
    fp16-cast input plus the numpy update, within a few fp16 ulps of the model output: ORT's CPU EP
    runs fp16 ops in float32 between Casts it inserts, and drops the Cast pairs where the step
    graph's float32 arithmetic meets the UNet, so an fp16 rounding of the UNet's input or output
    (relative 2**-11) may be skipped in one graph and not in the other (seen even with ORT's graph
    optimizations off). Guidance multiplies that by up to 1 + 2g. Against the fp32 UNet the step
    is fp16-close."""
    path = export_tiny("unet-sd15").path
    unet, _ = onnxopt.optimize(path, ["fp16"], options={"fp16": {"keep_io_types": keep_io_types}})
    step = build_step_graph(unet)
    dtypes = {n: d for n, d, _ in io(step)[0]}
    io_dtype = np.float32 if keep_io_types else np.float16
    assert dtypes == {"latents": np.float32, "state": np.float32, "step_index": np.int64,
                      "schedule_timesteps": io_dtype, "schedule_coefficients": np.float32,
                      "guidance_scale": np.float32, "encoder_hidden_states": io_dtype}
    run_unet, run_step = runner(unet), step_runner(runner(step))
    fp32 = load_model(path)
    run_fp32 = runner(fp32)
    for b in (1, 2):
        feeds = step_feeds(unet, b, b)
        expected, expected_state, eps2 = reference_step(run_unet, unet, feeds, with_model_output=True)
        got = run_step(feeds)
        assert got["latents_out"].dtype == np.float32 and got["state_out"].dtype == np.float32
        _, _, c_eps, _, _, d_eps = feeds["step_coefficients"]
        # a few fp16 ulps of the model output, through guidance (1 + 2g) and the coefficient
        ulps = 4 * 2.0**-11 * np.abs(eps2).max() * (1 + 2 * feeds["guidance_scale"][0])
        assert np.abs(got["latents_out"] - expected).max() <= ulps * abs(c_eps)
        assert np.abs(got["state_out"] - expected_state).max() <= ulps * abs(d_eps)

        as_fp32 = {n: v.astype(np.float32) if v.dtype == np.float16 else v for n, v in feeds.items()}
        from_fp32, _ = reference_step(run_fp32, fp32, as_fp32)
        # fp16 rounding of every activation of the UNet (relative ~1e-3 each, a few layers deep)
        assert np.abs(got["latents_out"] - from_fp32).max() <= 2e-2 * np.abs(from_fp32).max()


@pytest.mark.parametrize("context_kv", [False, True])
def test_write_step_graph_references_the_unet_external_data(export_tiny, tmp_path, context_kv):
    """step.onnx (and with context_kv its once-per-prompt part) refer to the UNet's own data file:
    same file, offsets and lengths, every external weight of the UNet in exactly one of them."""
    unet_dir = tmp_path / "unet"
    unet_dir.mkdir()
    save_model(load_model(export_tiny("unet-sd15").path), unet_dir / "model.onnx", external_data=True,
               data_location="model.onnx_data")
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in unet_dir.iterdir()}

    path = write_step_graph(unet_dir, context_kv=context_kv)

    written = ["step.onnx"] + (["step.context_kv.onnx"] if context_kv else [])
    maps = [name.removesuffix(".onnx") + ".weights.json" for name in written]  # each graph's weight map (for --lora)
    assert path == unet_dir / "step.onnx"
    assert sorted(p.name for p in unet_dir.iterdir()) == sorted(["model.onnx", "model.onnx_data", *written, *maps])
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in unet_dir.iterdir() if p.name not in written + maps}
    assert after == before  # the UNet's files are untouched
    unet_proto = onnx.load(str(unet_dir / "model.onnx"), load_external_data=False)
    external = {t.name: list(t.external_data) for t in unet_proto.graph.initializer if t.external_data}
    step_external = {}
    for name in written:
        proto = onnx.load(str(unet_dir / name), load_external_data=False)
        for t in proto.graph.initializer:
            if t.external_data:
                assert t.name not in step_external  # no weight in both parts
                step_external[t.name] = list(t.external_data)
        inline = sum(len(t.raw_data) for t in proto.graph.initializer)
        assert inline <= sum(len(t.raw_data) for t in unet_proto.graph.initializer) + 256  # + the step's own constants
    assert step_external == external and external  # same file, offset and length: nothing copied
    if context_kv:
        return  # the chain of both parts is proven in test_pipeline_generate (optimized folders)

    unet = load_model(unet_dir / "model.onnx")
    in_memory = step_runner(runner(build_step_graph(unet)))
    on_disk = step_runner(runner(path))  # ORT resolves the data file beside step.onnx
    for b in (1, 2):
        feeds = step_feeds(unet, b, b)
        expected, got = in_memory(feeds), on_disk(feeds)
        for name in ("latents_out", "state_out"):
            np.testing.assert_array_equal(got[name], expected[name])


def test_write_step_graph_of_an_inline_unet_is_inline(export_tiny, tmp_path):
    unet_dir = tmp_path / "unet"
    unet_dir.mkdir()
    save_model(load_model(export_tiny("unet-sd15").path), unet_dir / "model.onnx", external_data=False)
    path = write_step_graph(unet_dir, file_name="fused.onnx", context_kv=False)
    assert sorted(p.name for p in unet_dir.iterdir()) == ["fused.onnx", "fused.weights.json", "model.onnx"]
    assert not any(t.external_data for t in onnx.load(str(path), load_external_data=False).graph.initializer)
    unet = load_model(unet_dir / "model.onnx")
    feeds = step_feeds(unet, 1, 0)
    expected = step_runner(runner(build_step_graph(unet)))(feeds)
    np.testing.assert_array_equal(step_runner(runner(path))(feeds)["latents_out"], expected["latents_out"])


def test_reference_external_copies_what_lies_outside_the_folder(export_tiny, tmp_path):
    """save_model(reference_external=True) references only data files inside the destination
    folder; a model saved elsewhere gets its own data file with the bytes, as without the option."""
    source_dir, elsewhere = tmp_path / "unet", tmp_path / "elsewhere"
    source_dir.mkdir(), elsewhere.mkdir()
    save_model(load_model(export_tiny("unet-sd15").path), source_dir / "model.onnx", external_data=True)
    unet = load_model(source_dir / "model.onnx")

    beside = save_model(unet, source_dir / "again.onnx", external_data=True, reference_external=True)
    away = save_model(unet, elsewhere / "again.onnx", external_data=True, reference_external=True)

    assert beside.data_path.stat().st_size == 0  # nothing left to write: every weight referenced
    assert away.data_path.stat().st_size >= unet.weights_nbytes() - 1024 * len(unet.constants())
    locations = {e.value for t in onnx.load(str(beside.path), load_external_data=False).graph.initializer
                 for e in t.external_data if e.key == "location"}
    assert locations == {"model.onnx.data"}
    feeds = step_feeds(unet, 1, 0)
    feeds = {"sample": np.concatenate([feeds["latents"]] * 2), "timestep": np.repeat(feeds["timestep"], 2),
             "encoder_hidden_states": feeds["encoder_hidden_states"]}
    expected = runner(unet)(feeds)["out_sample"]
    for info in (beside, away):
        np.testing.assert_array_equal(runner(info.path)(feeds)["out_sample"], expected)


def controlnet_unet(timestep_shape: list) -> onnx.ModelProto:
    """A small UNet-shaped graph with ControlNet residual inputs (down_block_res_{0,1}, mid_block_res)
    and an int64 timestep of ``timestep_shape``, every input reaching ``out_sample``."""
    rng = np.random.default_rng(0)
    f32 = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("sample", f32, ["batch", 4, "height", "width"]),
        helper.make_tensor_value_info("timestep", TensorProto.INT64, timestep_shape),
        helper.make_tensor_value_info("encoder_hidden_states", f32, ["batch", "sequence", 8]),
        helper.make_tensor_value_info("down_block_res_0", f32, ["batch", 4, "height", "width"]),
        helper.make_tensor_value_info("down_block_res_1", f32, ["batch", 8, "h2", "w2"]),
        helper.make_tensor_value_info("mid_block_res", f32, ["batch", 8, "h2", "w2"]),
    ]
    weight = helper.make_tensor("conv.weight", f32, [4, 4, 3, 3], rng.standard_normal(144).astype(np.float32).tolist())
    nodes = [
        helper.make_node("Conv", ["sample", "conv.weight"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["conv", "down_block_res_0"], ["with_res0"]),
        helper.make_node("ReduceMean", ["down_block_res_1"], ["res1"], axes=[1, 2, 3]),
        helper.make_node("ReduceMean", ["mid_block_res"], ["mid"], axes=[1, 2, 3]),
        helper.make_node("ReduceMean", ["encoder_hidden_states"], ["context"], axes=[1, 2], keepdims=0),
        helper.make_node("Unsqueeze", ["context", "three_axes"], ["context4"]),
        # a [B] or [1] timestep broadcasts as [B, 1, 1, 1]; a scalar as it is
        helper.make_node("Unsqueeze", ["timestep", "three_axes"], ["t4"]) if timestep_shape
        else helper.make_node("Identity", ["timestep"], ["t4"]),
        helper.make_node("Cast", ["t4"], ["t"], to=f32),
        helper.make_node("Mul", ["t", "t_scale"], ["t_scaled"]),
        helper.make_node("Add", ["with_res0", "res1"], ["a"]),
        helper.make_node("Add", ["a", "mid"], ["b"]),
        helper.make_node("Add", ["b", "context4"], ["c"]),
        helper.make_node("Add", ["c", "t_scaled"], ["out_sample"]),
    ]
    initializers = [weight, helper.make_tensor("three_axes", TensorProto.INT64, [3], [1, 2, 3]),
                    helper.make_tensor("t_scale", f32, [], [1e-3])]
    output = helper.make_tensor_value_info("out_sample", f32, ["batch", 4, "height", "width"])
    graph = helper.make_graph(nodes, "controlnet_unet", inputs, [output], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("timestep_shape, timestep_op", [([], "Reshape"), ([1], "Identity"), (["batch"], "Expand")],
                         ids=["scalar", "one", "batch"])
def test_controlnet_residuals_pass_through(timestep_shape, timestep_op):
    unet = load_model(controlnet_unet(timestep_shape))
    step = build_step_graph(unet)
    inputs = {n: (d, s) for n, d, s in io(step)[0]}
    assert list(inputs) == ["latents", "state", "step_index", "schedule_timesteps", "schedule_coefficients",
                            "guidance_scale", "encoder_hidden_states", "down_block_res_0", "down_block_res_1",
                            "mid_block_res"]
    assert inputs["schedule_timesteps"] == (np.int64, ["schedule"])  # the UNet's dtype; made its form inside
    assert next(n for n in step.graph.nodes if n.outputs[0].name == f"{PREFIX}unet_timestep").op == timestep_op
    rng = np.random.default_rng(5)
    for b in (1, 2):
        feeds = step_feeds(unet, b, b)
        feeds["down_block_res_0"] = rng.standard_normal((2 * b, 4, H, W)).astype(np.float32)
        feeds["down_block_res_1"] = rng.standard_normal((2 * b, 8, H // 2, W // 2)).astype(np.float32)
        feeds["mid_block_res"] = rng.standard_normal((2 * b, 8, H // 2, W // 2)).astype(np.float32)
        expected, state = reference_step(runner(unet), unet, feeds)
        got = step_runner(runner(step), row=b)(feeds)
        np.testing.assert_allclose(got["latents_out"], expected, atol=1e-5, rtol=0)
        np.testing.assert_allclose(got["state_out"], state, atol=1e-5, rtol=0)
        feeds["mid_block_res"] = feeds["mid_block_res"] + 1  # the residual really reaches the output
        assert not np.allclose(step_runner(runner(step), row=b)(feeds)["latents_out"], got["latents_out"])


def test_a_graph_that_is_not_a_unet_is_refused():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(UnsupportedModelError, match="not a UNet graph: no input sample, timestep, encoder_hidden_st"):
        build_step_graph(model)


@pytest.mark.gpu
def test_step_graph_of_the_ort_cuda_fp16_unet_on_the_cuda_ep(export_tiny):
    """On a GPU (``pytest -m gpu``): the step graph of the ``ort-cuda`` fp16 UNet runs wholly on the
    CUDA EP and matches that UNet on the CUDA EP plus the numpy update, within fp16 ulps of the
    model output (as the fp16 CPU test above: Casts meet differently at the step graph's edges)."""
    from onnxopt.runners import cuda_available

    if not cuda_available():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")
    unet, _ = onnxopt.optimize(export_tiny("unet-sd15").path, ["ort-cuda", "fp16"])
    step = build_step_graph(unet)

    def cuda(model):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        proto = model.to_onnx().SerializeToString()
        session = ort.InferenceSession(proto, options, providers=["CUDAExecutionProvider"])
        assert session.get_providers()[0] == "CUDAExecutionProvider"
        names = [o.name for o in session.get_outputs()]
        return lambda feeds: dict(zip(names, session.run(names, feeds)))

    run_unet, run_step = cuda(unet), step_runner(cuda(step))
    for b in (1, 2):
        feeds = step_feeds(unet, b, b)
        expected, _, eps2 = reference_step(run_unet, unet, feeds, with_model_output=True)
        got = run_step(feeds)["latents_out"]
        ulps = 4 * 2.0**-11 * np.abs(eps2).max() * (1 + 2 * feeds["guidance_scale"][0])
        assert np.abs(got - expected).max() <= ulps * abs(feeds["step_coefficients"][2])


@pytest.mark.parametrize("scheduler", ["ddim", "euler", "dpm++2m"])
def test_denoising_loop_of_step_graphs_equals_the_diffusers_loop(export_tiny, scheduler):
    """The two halves together: a step graph fed plan_steps' coefficients (state_out fed back as
    state) denoises as diffusers' loop does: scale_model_input, the UNet at batch 2, guidance and
    scheduler.step, on the same initial latents (5 steps, SD 1.5 scheduler config), within 1e-5 of
    the latents' scale. The schedule is the padded table the device loop binds, read by the
    step graph's own counter."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from onnxopt.pipeline.schedulers import make_scheduler, plan_steps
    from tests.test_pipeline_schedulers import SD15

    unet = load_model(export_tiny("unet-sd15").path)
    run_unet, run_step = runner(unet), runner(build_step_graph(unet))
    steps, guidance = 5, 7.5
    plan = plan_steps(make_scheduler(scheduler, SD15), steps)
    reference = make_scheduler(scheduler, SD15)
    reference.set_timesteps(steps)
    rng = np.random.default_rng(0)
    context = rng.standard_normal((2, 77, 32)).astype(np.float32)
    noise = rng.standard_normal((1, 4, H, W)).astype(np.float32)

    x = torch.from_numpy(noise) * reference.init_noise_sigma
    for t in reference.timesteps:
        model_in = torch.cat([reference.scale_model_input(x, t)] * 2).numpy()
        timestep = np.full(2, float(t), np.float32)
        eps2 = run_unet(dict(sample=model_in, timestep=timestep, encoder_hidden_states=context))["out_sample"]
        eps_u, eps_c = np.split(eps2, 2)
        x = reference.step(torch.from_numpy(eps_u + guidance * (eps_c - eps_u)), t, x).prev_sample

    # The schedule written once, the counter and the latents fed back from the step's own outputs.
    from onnxopt.pipeline.sessions import schedule_tables

    timesteps, coefficients = schedule_tables(plan, np.float32, capacity=1000)
    latents, state = (noise * np.float32(plan.init_noise_sigma)).astype(np.float32), np.zeros_like(noise)
    index = np.zeros([1], np.int64)
    for _ in plan.timesteps:
        out = run_step(dict(latents=latents, state=state, step_index=index, schedule_timesteps=timesteps,
                            schedule_coefficients=coefficients, encoder_hidden_states=context,
                            guidance_scale=np.array([guidance], np.float32)))
        latents, state, index = out["latents_out"], out["state_out"], out["step_index_out"]
    assert index.tolist() == [steps]
    np.testing.assert_allclose(latents, x.numpy(), atol=1e-5 * np.abs(x.numpy()).max(), rtol=0)
