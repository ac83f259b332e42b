"""Claims about the TensorRT target.

* The ``tensorrt`` preset turns every committed fixture and every tiny export (both exporters,
  static and dynamic) into standard ONNX ops only: every nn.GroupNorm a GroupNormalization, every
  attention ``Softmax(MatMul(Mul(q, s), Transpose(k)))`` with its scale on Q; the result loads in ONNX
  Runtime's CPU EP and computes what the source computes.
* trt-group-norm rewrites only provable GroupNorms (lookalikes are refused with a reason) and moves
  opset-17 models to 18 correctly (Reduce axes become inputs); trt-attention-scale moves only a
  scalar scale of attention scores.
* ``onnxopt build`` checks its input and profiles on any machine, then stops with one line naming the
  package when tensorrt is missing, or saying there is no GPU.
* Building and running engines needs tensorrt and a GPU: those tests skip here, saying so.
"""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt.cli import main
from onnxopt.errors import MissingDependencyError, OnnxoptError
from onnxopt.loading import load_model
from onnxopt.runners import tensorrt as trt_runner
from onnxopt.runners.tensorrt import ShapeRange, parse_profile, resolve_profiles
from onnxopt.saving import save_model
from onnxopt.verify import assert_same_computation
from tests.conftest import fixture_models, op_counts, result_of, run_passes

TRT_MISSING = "engine runs need TensorRT (pip install 'onnxopt[trt]') and a GPU it runs engines on"
RTX_MISSING = "TensorRT-RTX is not installed (pip install 'onnxopt[trt]')"


# ---------------------------------------------------------------- helpers


def producer(tensor):
    return tensor.inputs[0] if tensor.inputs else None


def attention_forms(model) -> Counter:
    """How each Softmax's scores are computed: 'MatMul(Mul(q, s), Transpose)' is what TensorRT wants,
    'Mul(MatMul(q, Transpose), s)' has the scale after the first MatMul."""
    forms = Counter()
    for softmax in (n for n in model.graph.nodes if n.op == "Softmax"):
        node = producer(softmax.inputs[0])
        if node is not None and node.op == "Add":  # a mask
            node = next(p for p in map(producer, node.inputs) if p is not None and p.op in ("MatMul", "Mul", "Div"))
        outer = None
        if node.op in ("Mul", "Div"):
            outer, node = node.op, producer(node.inputs[0])
        q, kt = (producer(t) for t in node.inputs)
        scaled = q is not None and q.op == "Mul" and any(isinstance(t, onnx_constant_type()) for t in q.inputs)
        form = f"{node.op}({'Mul(q, s)' if scaled else 'q'}, {kt.op if kt else 'input'})"
        forms[f"{outer}({form}, s)" if outer else form] += 1
    return forms


def onnx_constant_type():
    import onnx_graphsurgeon as gs

    return gs.Constant


def assert_tensorrt_form(source, model, report):
    """Standard ops only; GroupNorms as GroupNormalization; attention scaled on Q; loads in ORT."""
    import onnxruntime as ort

    src = load_model(source)
    assert {n.domain for n in model.graph.nodes} <= {None, "", "ai.onnx"}
    group_norms = op_counts(src)["InstanceNormalization"]
    assert op_counts(model)["InstanceNormalization"] == 0
    assert op_counts(model)["GroupNormalization"] == group_norms
    assert result_of(report, "trt-group-norm").refused == []
    if group_norms:
        assert model.opset == 21
    softmaxes = op_counts(src)["Softmax"]
    assert attention_forms(model) == Counter({"MatMul(Mul(q, s), Transpose)": softmaxes})
    assert result_of(report, "trt-attention-scale").sites_rewritten == softmaxes
    proto = model.to_onnx()
    onnx.checker.check_model(proto)
    ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


# ---------------------------------------------------------------- the preset on real graphs


@pytest.mark.parametrize("path", fixture_models(), ids=lambda p: p.name)
def test_tensorrt_preset_on_every_fixture_gives_standard_ops_in_tensorrt_form_and_equal_outputs(path):
    model, report = run_passes(path, ["tensorrt"])

    assert_tensorrt_form(path, model, report)
    assert_same_computation(path, model)


def test_tensorrt_preset_output_saves_and_runs_from_disk(tmp_path):
    import onnxruntime as ort

    source = next(p for p in fixture_models() if p.name == "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx")
    model, _ = run_passes(source, ["tensorrt"])
    out = tmp_path / "unet.trt.onnx"
    save_model(model, out)

    saved = onnx.load(out)
    assert {o.domain or "ai.onnx": o.version for o in saved.opset_import} == {"ai.onnx": 21}
    onnx.checker.check_model(saved)
    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert_same_computation(source, out)


TINY_CASES = [
    ("unet-sd15", "torchscript", "dynamic"),
    ("unet-sd15", "torchscript", "static"),
    ("unet-sd15", "dynamo", "dynamic"),
    ("unet-sd15", "dynamo", "static"),
    ("vae-decoder", "dynamo", "dynamic"),
    ("clip-text", "torchscript", "dynamic"),
]


@pytest.mark.models
@pytest.mark.parametrize("family, exporter, shapes", TINY_CASES, ids=["-".join(c) for c in TINY_CASES])
def test_tensorrt_preset_on_tiny_exports_fuses_every_group_norm_and_attention(export_tiny, family, exporter, shapes):
    exported = export_tiny(family, exporter, shapes)

    model, report = run_passes(exported.path, ["tensorrt"])

    assert_tensorrt_form(exported.path, model, report)
    assert op_counts(model)["GroupNormalization"] == exported.sites["group_norm"]
    assert op_counts(model)["Softmax"] == exported.sites["attention"]
    assert_same_computation(exported.path, model, inputs=exported.input_spec())


# ---------------------------------------------------------------- trt-group-norm on hand-built graphs


def group_norm_model(*, opset=17, channels=8, groups=4, in_scale=None, group_shape=None, gamma_shape=None,
                     restore="shape", extra_nodes=(), extra_inits=(), seed=0):
    """x (N, C, 5, 3) ─ Reshape([0, G, -1]) ─ InstanceNorm ─ Reshape(Shape(x)) ─ Mul(γ) ─ Add(β) ─ y."""
    rng = np.random.default_rng(seed)
    gamma_shape = gamma_shape or (channels, 1, 1)
    inits = [
        numpy_helper.from_array(np.array(group_shape or [0, groups, -1], np.int64), "group_shape"),
        numpy_helper.from_array(np.ones(groups, np.float32) if in_scale is None else np.asarray(in_scale, np.float32), "in_scale"),
        numpy_helper.from_array(np.zeros(groups, np.float32), "in_bias"),
        numpy_helper.from_array(rng.standard_normal(gamma_shape).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.standard_normal(gamma_shape).astype(np.float32), "beta"),
        *extra_inits,
    ]
    nodes = [
        helper.make_node("Reshape", ["x", "group_shape"], ["grouped"]),
        helper.make_node("InstanceNormalization", ["grouped", "in_scale", "in_bias"], ["normed"], epsilon=1e-5),
    ]
    if restore == "shape":
        nodes.append(helper.make_node("Shape", ["x"], ["x_shape"]))
    else:
        inits.append(numpy_helper.from_array(np.array(restore, np.int64), "x_shape"))
    nodes += [
        helper.make_node("Reshape", ["normed", "x_shape"], ["restored"]),
        helper.make_node("Mul", ["restored", "gamma"], ["scaled"]),
        helper.make_node("Add", ["scaled", "beta"], ["gn"]),
        *extra_nodes,
    ]
    out = extra_nodes[-1].output[0] if extra_nodes else "gn"
    graph = helper.make_graph(
        nodes, "gn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", channels, 5, 3])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10 if opset >= 21 else 8
    return model


def test_opset_17_group_norm_becomes_group_normalization_with_gamma_beta_and_the_model_opset_21():
    source = group_norm_model(opset=17)
    model, report = run_passes(source, ["trt-group-norm"])

    result = result_of(report, "trt-group-norm")
    assert (result.sites_matched, result.sites_rewritten) == (1, 1)
    assert model.opset == 21 and result.details["opset"] == "17 -> 21" and model.graph.ir_version >= 10
    assert op_counts(model) == Counter({"GroupNormalization": 1})  # γ and β absorbed
    (gn,) = model.graph.nodes
    assert gn.attrs["num_groups"] == 4 and gn.attrs["epsilon"] == pytest.approx(1e-5)
    gamma = numpy_helper.to_array(source.graph.initializer[3]).reshape(-1)
    np.testing.assert_array_equal(gn.inputs[1].values, gamma)
    onnx.checker.check_model(model.to_onnx())  # GroupNormalization-18 would be rejected as deprecated
    assert_same_computation(source, model)


def test_moving_to_opset_21_gives_reduce_mean_its_axes_as_an_input():
    reduce_node = helper.make_node("ReduceMean", ["gn"], ["mean"], axes=[2, 3], keepdims=1)
    source = group_norm_model(opset=17, extra_nodes=[reduce_node])
    model, report = run_passes(source, ["trt-group-norm"])

    assert model.opset == 21 and "1 Reduce nodes" in result_of(report, "trt-group-norm").details["opset"]
    (mean,) = [n for n in model.graph.nodes if n.op == "ReduceMean"]
    assert "axes" not in mean.attrs and list(mean.inputs[1].values) == [2, 3]
    assert_same_computation(source, model)


def test_an_op_that_changed_meaning_keeps_the_model_at_its_opset_and_the_instance_norm_form():
    grid = numpy_helper.from_array(np.zeros((1, 2, 2, 2), np.float32), "grid")
    sample = helper.make_node("GridSample", ["gn", "grid"], ["sampled"], mode="bilinear")  # renamed 'linear' in 20
    source = group_norm_model(opset=17, extra_nodes=[sample], extra_inits=[grid])
    source.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    model, report = run_passes(source, ["trt-group-norm"])

    result = result_of(report, "trt-group-norm")
    assert result.sites_rewritten == 0 and "GridSample" in result.refused[0][1]
    assert model.opset == 17 and op_counts(model)["InstanceNormalization"] == 1


def test_a_gamma_that_is_not_per_channel_stays_outside_the_op():
    source = group_norm_model(opset=21, gamma_shape=(1, 1, 3))  # broadcasts along W, not per channel
    model, report = run_passes(source, ["trt-group-norm"])

    assert result_of(report, "trt-group-norm").details["affine_absorbed"] == 0
    assert op_counts(model) == Counter({"GroupNormalization": 1, "Mul": 1, "Add": 1})
    (gn,) = [n for n in model.graph.nodes if n.op == "GroupNormalization"]
    assert np.all(gn.inputs[1].values == 1) and gn.inputs[1].values.shape == (8,) and not np.any(gn.inputs[2].values)
    assert_same_computation(source, model)


def test_constant_restore_shape_fuses_on_a_static_input():
    source = group_norm_model(opset=20, restore=[2, 8, 5, 3])
    source.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    model, report = run_passes(source, ["trt-group-norm"])

    assert result_of(report, "trt-group-norm").sites_rewritten == 1
    assert_same_computation(source, model)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"in_scale": [1, 2, 1, 1]}, "scale is not all ones"),
        ({"groups": 3}, "does not divide"),  # 3 groups of 8 channels: not a GroupNorm
        ({"groups": 30, "group_shape": [0, -1, 4]}, "is not [N, G, -1]"),  # normalizes 30 rows of 4
        ({"restore": [2, 8, 3, 5]}, "does not provably restore"),
    ],
    ids=["non-unit InstanceNorm scale", "groups do not divide C", "wrong group reshape", "wrong restore shape"],
)
def test_group_norm_lookalikes_are_refused_with_the_reason_and_left_alone(kwargs, reason):
    source = group_norm_model(**kwargs)
    if isinstance(kwargs.get("restore"), list):
        source.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    model, report = run_passes(source, ["trt-group-norm"])

    result = result_of(report, "trt-group-norm")
    assert (result.sites_matched, result.sites_rewritten) == (1, 0)
    assert reason in result.refused[0][1]
    assert op_counts(model)["InstanceNormalization"] == 1 and op_counts(model)["GroupNormalization"] == 0
    assert model.opset == 17  # no move to opset 21 without a rewrite
    assert_same_computation(source, model)


# ---------------------------------------------------------------- trt-attention-scale on hand-built graphs


def attention_model(*, scale=0.125, div=False, mask=False, k_const=False, extra_use=False):
    """Softmax([Add(] Mul(MatMul(q, Transpose(k)), s) [, mask)]) @ v, q/k/v inputs (B, N, S, H)."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(np.asarray(1 / scale if div else scale, np.float32), "s")]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2, 6, 4]) for n in ("q", "v")]
    if k_const:  # q @ W: a projection, not attention
        inits.append(numpy_helper.from_array(rng.standard_normal((2, 2, 4, 6)).astype(np.float32), "kt"))
        nodes = []
    else:
        inputs.append(helper.make_tensor_value_info("k", TensorProto.FLOAT, [2, 2, 6, 4]))
        nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2])]
    nodes += [
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Div" if div else "Mul", ["qk", "s"], ["scores"]),
    ]
    scores = "scores"
    if mask:
        inits.append(numpy_helper.from_array(np.triu(np.full((6, 6), -1e4, np.float32), 1), "mask"))
        nodes.append(helper.make_node("Add", ["mask", "scores"], ["masked"]))
        scores = "masked"
    nodes += [helper.make_node("Softmax", [scores], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["out"])]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
    if extra_use:
        outputs.append(helper.make_tensor_value_info("qk", TensorProto.FLOAT, None))
    model = helper.make_model(helper.make_graph(nodes, "attn", inputs, outputs, inits), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("kwargs", [{}, {"div": True}, {"mask": True}], ids=["Mul(scores, s)", "Div(scores, c)", "with mask"])
def test_attention_scale_moves_onto_q(kwargs):
    source = attention_model(**kwargs)
    model, report = run_passes(source, ["trt-attention-scale"])

    assert result_of(report, "trt-attention-scale").sites_rewritten == 1
    assert attention_forms(model) == Counter({"MatMul(Mul(q, s), Transpose)": 1})
    assert op_counts(model)["Div"] == 0
    (mul,) = [n for n in model.graph.nodes if n.op == "Mul"]
    assert mul.inputs[0].name == "q" and mul.inputs[1].values.size == 1 and np.isclose(mul.inputs[1].values.item(), 0.125)
    assert_same_computation(source, model, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, form",
    [
        ({"k_const": True}, "Mul(MatMul(q, input), s)"),
        ({"scale": np.full((1, 2, 1, 1), 0.125, np.float32)}, "Mul(MatMul(q, Transpose), s)"),
        ({"extra_use": True}, "Mul(MatMul(q, Transpose), s)"),
    ],
    ids=["K is a constant (a projection)", "per-head scale", "unscaled scores used elsewhere"],
)
def test_attention_scale_leaves_lookalikes_alone(kwargs, form):
    source = attention_model(**kwargs)
    model, report = run_passes(source, ["trt-attention-scale"])

    assert result_of(report, "trt-attention-scale").sites_rewritten == 0
    assert attention_forms(model) == Counter({form: 1})
    assert_same_computation(source, model, atol=1e-5)


# ---------------------------------------------------------------- profiles


def test_parse_profile_reads_min_opt_max_and_single_shapes():
    assert parse_profile("sample=1x4x64x64:2x4x64x64:4x4x128x128") == (
        "sample", ShapeRange((1, 4, 64, 64), (2, 4, 64, 64), (4, 4, 128, 128)))
    assert parse_profile("timestep=1") == ("timestep", ShapeRange((1,), (1,), (1,)))
    assert parse_profile("a=b=2,3") == ("a=b", ShapeRange((2, 3), (2, 3), (2, 3)))
    for bad in ("sample", "sample=1x4:2x4", "sample=1xAx4", "=1x2", "sample="):
        with pytest.raises(ValueError):
            parse_profile(bad)


INPUTS = [("sample", ["batch", 4, "height", "width"]), ("timestep", []), ("context", ["batch", 77, 768])]


def test_profiles_default_static_dims_and_symbolic_ones_from_dims_or_defaults():
    (profile,), defaulted = resolve_profiles(INPUTS, {"context": "1x77x768:2x77x768:4x77x768"}, dims={"height": 64})

    assert profile["sample"] == ShapeRange.fixed((2, 4, 64, 8))  # batch 2, height from dims, width 8
    assert profile["timestep"] == ShapeRange.fixed(())
    assert profile["context"] == ShapeRange((1, 77, 768), (2, 77, 768), (4, 77, 768))
    assert list(profile) == ["sample", "timestep", "context"] and defaulted == ["sample"]


def test_several_profiles_become_several_engine_profiles():
    profiles, _ = resolve_profiles(INPUTS, [{"sample": (1, 4, 64, 64)}, {"sample": "2x4x128x128"}])
    assert [p["sample"].opt for p in profiles] == [(1, 4, 64, 64), (2, 4, 128, 128)]


@pytest.mark.parametrize(
    "given, message",
    [
        ({"latent": (1, 4, 8, 8)}, "the model's inputs are sample, timestep, context"),
        ({"sample": (1, 4, 8)}, "has rank 3, the input has rank 4"),
        ({"sample": ((1, 3, 8, 8), (1, 3, 8, 8), (1, 3, 8, 8))}, "axis 1 is 4 in the model"),
        ({"sample": ((2, 4, 8, 8), (1, 4, 8, 8), (4, 4, 8, 8))}, "min <= opt <= max"),
    ],
    ids=["unknown input", "wrong rank", "contradicts a static dim", "min > opt"],
)
def test_bad_profiles_are_one_line_errors(given, message):
    with pytest.raises(OnnxoptError, match="profile") as info:
        resolve_profiles(INPUTS, given)
    assert message in str(info.value)


# ---------------------------------------------------------------- the graph TensorRT gets


def test_float32_graph_is_converted_by_the_fp16_pass_for_fp16_and_bf16(tmp_path):
    source = next(p for p in fixture_models() if p.name == "vae-decoder.tiny.torchscript.dynamic.sdpa.onnx")
    model, _ = run_passes(source, ["tensorrt"])
    trt_graph = tmp_path / "vae.trt.onnx"
    save_model(model, trt_graph)

    loaded = trt_runner.load_checked(trt_graph, "fp16")
    assert trt_runner.graph_precision(loaded) == "fp32"
    assert trt_runner.typed_graph(loaded, trt_graph, "fp32", tmp_path) == (trt_graph, False)
    path, converted = trt_runner.typed_graph(loaded, trt_graph, "fp16", tmp_path)
    assert converted and trt_runner.graph_precision(load_model(path)) == "fp16"
    assert trt_runner.typed_graph(load_model(path), path, "fp16", tmp_path) == (path, False)  # already fp16
    assert_same_computation(source, path, atol=2e-2, rtol=2e-2)
    with pytest.raises(OnnxoptError, match="already fp16"):
        trt_runner.load_checked(path, "fp32")
    bf16_path, _ = trt_runner.typed_graph(loaded, trt_graph, "bf16", tmp_path)
    assert trt_runner.graph_precision(load_model(bf16_path)) == "bf16"


# ---------------------------------------------------------------- onnxopt build without TensorRT


@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setattr(trt_runner, "TENSORRT_MODULE", None)  # what the import-time choice finds without either module


@pytest.fixture(scope="module")
def trt_graph(tmp_path_factory):
    source = next(p for p in fixture_models() if p.name == "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx")
    model, _ = run_passes(source, ["tensorrt"])
    path = tmp_path_factory.mktemp("trt-graph") / "unet.trt.onnx"
    save_model(model, path)
    return path


def build_cli(trt_graph, tmp_path, *extra):
    return main(["build", "-i", str(trt_graph), "-o", str(tmp_path / "unet.plan"), *extra])


def test_build_without_tensorrt_exits_2_naming_the_package(no_tensorrt, trt_graph, tmp_path, capsys):
    code = build_cli(trt_graph, tmp_path, "--profile", "sample=1x4x8x8:2x4x8x8:4x4x16x16", "--timing-cache", str(tmp_path / "c"))

    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("onnxopt: error: TensorRT is not installed") and len(err.strip().splitlines()) == 1
    assert "pip install 'onnxopt[trt]'" in err and "tensorrt" in err and "https://pypi.nvidia.com" in err
    assert "Traceback" not in err and not (tmp_path / "unet.plan").exists()


def test_runner_without_tensorrt_raises_the_same_error(no_tensorrt, trt_graph, tmp_path):
    with pytest.raises(MissingDependencyError, match=r"onnxopt\[trt\]"):
        trt_runner.polygraphy_runner(trt_graph)
    engine = tmp_path / "e.plan"
    engine.write_bytes(b"not an engine")
    with pytest.raises(MissingDependencyError, match=r"onnxopt\[trt\]"):
        trt_runner.polygraphy_runner(engine)


def test_build_without_a_gpu_or_a_compute_capability_says_to_pass_one(monkeypatch, trt_graph, tmp_path, capsys):
    pytest.importorskip("tensorrt_rtx", reason=RTX_MISSING)
    monkeypatch.setattr(trt_runner, "TENSORRT_MODULE", "tensorrt_rtx")
    monkeypatch.setattr(trt_runner, "gpu_compute_capability", lambda device=0: None)
    code = build_cli(trt_graph, tmp_path)

    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "no NVIDIA GPU here" in err and "--compute-capability" in err and "8.9" in err
    assert not (tmp_path / "unet.plan").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--profile", "latent=1x4x8x8"], "the model's inputs are sample, timestep, encoder_hidden_states"),
        (["--profile", "sample=1x4x8x8", "--profile", "sample=2x4x8x8"], "names the same input twice"),
        (["--precision", "fp32", "--profile", "sample=1x3x8x8"], "axis 1 is 4 in the model"),
    ],
    ids=["unknown input", "input twice", "contradicts a static dim"],
)
def test_build_reports_bad_profiles_before_looking_for_tensorrt(no_tensorrt, trt_graph, tmp_path, capsys, extra, message):
    assert build_cli(trt_graph, tmp_path, *extra) == 2
    assert message in capsys.readouterr().err


def test_build_refuses_ort_fused_graphs_pointing_at_the_tensorrt_preset(no_tensorrt, tmp_path, capsys):
    source = next(p for p in fixture_models() if p.name == "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx")
    model, _ = run_passes(source, ["ort-cuda"])
    fused = tmp_path / "unet.ort.onnx"
    save_model(model, fused)

    assert build_cli(fused, tmp_path) == 2
    err = capsys.readouterr().err
    assert "com.microsoft." in err and "--passes tensorrt" in err


def test_build_rejects_a_malformed_profile_as_usage(trt_graph, tmp_path, capsys):
    assert build_cli(trt_graph, tmp_path, "--profile", "sample=1x4x8x8:2x4x8x8") == 2  # a usage error: one line, exit 2
    assert "min:opt:max" in capsys.readouterr().err


def test_build_never_overwrites_its_input(no_tensorrt, trt_graph, capsys):
    before = trt_graph.read_bytes()
    assert main(["build", "-i", str(trt_graph), "-o", str(trt_graph)]) == 2
    assert "never modifies its input" in capsys.readouterr().err and trt_graph.read_bytes() == before


# ---------------------------------------------------------------- with TensorRT and a GPU (skipped here)


@pytest.mark.gpu
@pytest.mark.parametrize("precision, atol", [("fp32", 1e-3), ("fp16", 3e-2)])
def test_engine_of_the_tensorrt_graph_matches_ort_cpu(trt_graph, tmp_path, precision, atol):
    try:
        trt_runner.import_tensorrt()
        trt_runner.require_runnable_gpu()
    except OnnxoptError as exc:
        pytest.skip(f"{TRT_MISSING}: {exc}")
    from polygraphy.comparator import Comparator, CompareFunc

    from onnxopt.verify import InputSpec, random_feeds, runner_for

    cache = tmp_path / "timing.cache"
    profile = {"sample": "1x4x8x8:2x4x8x8:2x4x16x16", "encoder_hidden_states": "1x77x32:2x77x32:2x77x32"}
    info = trt_runner.build_engine(trt_graph, tmp_path / "unet.plan", precision=precision, profiles=profile, timing_cache=cache)
    assert info.engine_path.stat().st_size == info.engine_bytes > 0 and cache.stat().st_size > 0
    assert info.converted == (precision == "fp16")

    model = load_model(trt_graph)
    feeds = random_feeds(model, InputSpec(dims={"batch": 2, "height": 8, "width": 8, "sequence": 77}))  # inside the profile
    runners = [runner_for(model, "ort-cpu", tmp_path), trt_runner.polygraphy_runner(info.engine_path)]
    results = Comparator.run(runners, data_loader=feeds)
    assert bool(Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol=atol, rtol=atol)))
