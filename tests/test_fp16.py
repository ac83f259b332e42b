"""Claims about the ``fp16`` pass.

* Every committed fixture (both exporters, static and dynamic; UNet, VAE, CLIP, ControlNet), raw or
  after the fusion passes, converts to a valid model: strict ONNX shape inference, the full checker,
  and ONNX Runtime's graph resolution (which type-checks com.microsoft ops too) all pass; outputs
  are finite and within ERROR_BOUND of float32.
* CLIP's causal mask (TorchScript ``Where(-inf, 0)``, dynamo ``-3.4e38``) becomes a finite
  float16 mask, the attention probabilities above the diagonal are exactly 0, and a padding mask
  that plain conversion turns into NaN stays finite.
* ``fp32_auto`` keeps exactly the nodes around a planted overflow; ``sensitivity`` catches
  cancellation.
* Lookalikes keep their types: Resize scales, Range, shape arithmetic, ConstantOfShape values;
  Cast(to=FLOAT) is retargeted; out-of-range constants are refused, not clamped.
* Converting a model with external data does not load its weights.
* onnxconverter-common 1.16 on the same fixture writes a model ONNX Runtime rejects.

Measured, float16 against the float32 fixture on its manifest inputs (relative L2 / max abs):
ORT CPU 5.8e-4 to 1.1e-3 / at most 4.3e-3; onnxopt's reference evaluator, which computes in float16
where ORT's CPU EP upcasts, 1.5e-3 to 2.3e-3 / at most 5.4e-3; fused graphs on the reference
evaluator 9.4e-4 to 1.6e-3 / at most 3.1e-3. ERROR_BOUND is what is asserted.
"""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from models.feeds import feeds_from_manifest
from onnxopt import reference, registry
from onnxopt.loading import load_model
from onnxopt.manager import PassManager
from onnxopt.passes.fp16 import Fp16Pass
from onnxopt.precision import CONTRIB_SIGNATURES, LOW_PRECISIONS, ort_contrib_signatures, relative_l2
from onnxopt.saving import save_model
from tests.conftest import FIXTURES

ort = pytest.importorskip("onnxruntime")

MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
ENTRIES = MANIFEST["fixtures"]
IDS = [e["file"].replace(".onnx", "") for e in ENTRIES]

# Relative L2 / max abs error of float16 outputs against float32 (measured: at most 1.6e-3 / 6e-3).
ERROR_BOUND = {"rel_l2": 3e-3, "max_abs": 1.5e-2}
BF16_REL_L2 = 3e-2  # bfloat16 has 8 significand bits (measured: 1.5e-2)
FUSIONS = ["cleanup", "fuse-group-norm", "fuse-skip-group-norm", "nhwc-conv"]
# Fusions being written alongside: used when registered.
MORE_FUSIONS = ["canonicalize-attention", "fuse-attention", "fuse-bias-split-gelu", "fuse-bias-add",
                "fuse-layer-norm", "fuse-skip-layer-norm"]
NO_CPU_KERNEL = re.compile(r"NOT_IMPLEMENTED : (Failed to find kernel for com\.microsoft\.|Could not find an implementation for)")
FP16_MIN = float(np.finfo(np.float16).min)


# ---------------------------------------------------------------- helpers


def convert(source, before=(), **options):
    """Load ``source``, run passes ``before`` then fp16(**options); returns (model, fp16 PassResult)."""
    model = load_model(source)
    steps = registry.expand(list(before)) if before else []
    report = PassManager(steps + ["infer-shapes", Fp16Pass(**options)]).run(model)
    return model, next(p.result for p in report.passes if p.name == "fp16" and p.companion is None)


def fusion_passes() -> list[str]:
    known = registry.available_passes()
    return FUSIONS + [p for p in MORE_FUSIONS if p in known]


def ort_session(proto: onnx.ModelProto):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def assert_valid(model) -> onnx.ModelProto:
    """Strict shape inference, the full checker, and ORT's graph resolution accept the model.

    ORT type-checks every node (com.microsoft ones against its contrib schemas) before it looks
    for kernels, so a session that fails only for a missing CPU kernel was type-correct.
    Returns (ModelProto, ORT session or None).
    """
    onnx.shape_inference.infer_shapes(model.skeleton(), check_type=True, strict_mode=True)
    proto = model.to_onnx()
    onnx.checker.check_model(proto, full_check=True)
    names = [n.name for n in proto.graph.node if n.name]
    assert len(names) == len(set(names)), "duplicate node names"
    try:
        session = ort_session(proto)
    except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
        assert NO_CPU_KERNEL.search(str(exc)), f"ONNX Runtime rejects the model: {exc}"
        session = None
    return proto, session


def assert_no_cast_pairs(proto: onnx.ModelProto) -> None:
    """No Cast reads another Cast's output (ping-pong or chains): every Cast is needed."""
    producer = {o: n for n in proto.graph.node for o in n.output}
    for node in proto.graph.node:
        if node.op_type == "Cast":
            src = producer.get(node.input[0])
            assert src is None or src.op_type != "Cast", f"Cast chain {src.name} -> {node.name}"


def feed_for(proto: onnx.ModelProto, feeds: dict) -> dict:
    types = {i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in proto.graph.input}
    return {k: np.asarray(v).astype(types[k]) for k, v in feeds.items()}


def run(proto, feeds, session=None) -> list[np.ndarray]:
    feeds = feed_for(proto, feeds)
    if session is not None:
        return session.run(None, feeds)
    return list(reference.run(proto, feeds).values())


def fp32_outputs(entry) -> tuple[dict, list[np.ndarray]]:
    feeds = feeds_from_manifest(entry)
    return feeds, ort_session(onnx.load(str(FIXTURES / entry["file"]))).run(None, feeds)


def errors(expected, got) -> dict:
    got = [np.asarray(g, dtype=np.float32) for g in got]
    assert all(np.isfinite(g).all() for g in got), "NaN/inf in the outputs"
    return {
        "rel_l2": max(relative_l2(e, g) for e, g in zip(expected, got)),
        "max_abs": max(float(np.abs(e - g).max()) for e, g in zip(expected, got)),
    }


def assert_within_bound(err: dict, bound=ERROR_BOUND):
    assert err["rel_l2"] <= bound["rel_l2"] and err["max_abs"] <= bound["max_abs"], err


def elem_types(proto: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(proto)
    types = {i.name: i.data_type for i in proto.graph.initializer}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        types[vi.name] = vi.type.tensor_type.elem_type
    for node in proto.graph.node:
        if node.op_type == "Constant":
            types[node.output[0]] = node.attribute[0].t.data_type
    return types


class Builder:
    """Small ModelProtos: ``y = b.node("Add", x, b.const(...))``, names generated."""

    def __init__(self):
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self.k = 0

    def name(self, prefix):
        self.k += 1
        return f"{prefix}{self.k}"

    def input(self, name, shape, dtype=TensorProto.FLOAT):
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def const(self, value, dtype=np.float32, name=None):
        name = name or self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def node(self, op, *inputs, name=None, outputs=1, domain=None, **attrs):
        outs = [self.name(f"{op.lower()}_") for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=name or self.name(op), domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def output(self, name, dtype=TensorProto.FLOAT):
        self.outputs.append(helper.make_tensor_value_info(name, dtype, None))

    def model(self, opset=17) -> onnx.ModelProto:
        model = helper.make_model(helper.make_graph(self.nodes, "g", self.inputs, self.outputs, self.inits),
                                  opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        return model


_converted: dict = {}


def converted_fixture(file: str, fused: bool = False):
    """(model, result, proto, session) for a fixture converted once per test session."""
    key = (file, fused)
    if key not in _converted:
        model, result = convert(FIXTURES / file, before=fusion_passes() if fused else ())
        proto, session = assert_valid(model)
        _converted[key] = (model, result, proto, session)
    return _converted[key]


# ---------------------------------------------------------------- every fixture


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_fixture_converts_to_a_valid_float16_model_close_to_float32(entry, tmp_path):
    model, result, proto, session = converted_fixture(entry["file"])
    assert session is not None, "ORT CPU runs every standard op in float16 (casting where it lacks a kernel)"
    assert result.sites_rewritten > 0.9 * result.sites_matched, result.details["fp32_nodes"]
    assert_no_cast_pairs(proto)
    # interface unchanged (keep_io_types); weights stored in float16 (float32 left: the timestep
    # frequencies, γ/β of unfused norms' shapes, scales: under 1% of the bytes)
    source_inputs = onnx.load(str(FIXTURES / entry["file"]), load_external_data=False).graph.input
    assert [i.type.tensor_type.elem_type for i in proto.graph.input] == [i.type.tensor_type.elem_type for i in source_inputs]
    nbytes = {}
    for t in proto.graph.initializer:
        size = int(np.prod(t.dims)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        nbytes[t.data_type] = nbytes.get(t.data_type, 0) + size
    assert nbytes.get(TensorProto.FLOAT, 0) < 0.01 * sum(nbytes.values()), nbytes
    feeds, expected = fp32_outputs(entry)
    got = run(proto, feeds, session)
    assert_within_bound(errors(expected, got))
    # saved as onnxopt saves (weights streamed, external data when the source had it): the same model
    saved = tmp_path / "fp16.onnx"
    save_model(model, saved, external_data=entry["external_data"])
    onnx.checker.check_model(str(saved), full_check=True)
    from_file = ort.InferenceSession(str(saved), providers=["CPUExecutionProvider"]).run(None, feed_for(proto, feeds))
    for a, b in zip(got, from_file):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_fused_fixture_converts_and_its_contrib_ops_get_the_types_their_kernels_take(entry):
    model, result, proto, session = converted_fixture(entry["file"], fused=True)
    assert_no_cast_pairs(proto)
    types = elem_types(proto)
    contrib = [n for n in proto.graph.node if n.domain == "com.microsoft"]
    assert contrib, "the fusions produced contrib ops"
    for node in contrib:
        sig = CONTRIB_SIGNATURES[node.op_type]
        bound: dict[str, set[int]] = {}
        for i, name in enumerate(node.input):
            if name:
                bound.setdefault(sig.input_param(i), set()).add(types[name])
        assert all(len(v) == 1 for v in bound.values()), (node.name, bound)
        data_type = types[node.input[0]]
        assert data_type == TensorProto.FLOAT16, node.name
        if node.op_type in ("GroupNorm", "SkipGroupNorm"):
            # γ/β (type M) float32, as ONNX Runtime's optimizer emits them; the kernels take both
            assert types[node.input[1]] == types[node.input[2]] == TensorProto.FLOAT, node.name
        if node.op_type == "SkipLayerNormalization":
            assert types[node.input[2]] == TensorProto.FLOAT16, node.name  # γ: type T, same as input
    feeds, expected = fp32_outputs(entry)
    assert_within_bound(errors(expected, run(proto, feeds, session)))


def test_contrib_signatures_match_the_onnxruntime_registry():
    registry_sigs = ort_contrib_signatures()
    for name, sig in CONTRIB_SIGNATURES.items():
        theirs = registry_sigs[name]
        assert (sig.inputs, sig.outputs, sig.allowed) == (theirs.inputs, theirs.outputs, theirs.allowed), name


# ---------------------------------------------------------------- CLIP masks

CLIP = [e for e in ENTRIES if e["family"] == "clip-text"]


@pytest.mark.parametrize("entry", CLIP, ids=[e["exporter"] for e in CLIP])
def test_clip_causal_mask_becomes_finite_and_stays_causal(entry):
    model, result, proto, session = converted_fixture(entry["file"])
    source = onnx.load(str(FIXTURES / entry["file"]))
    masks = result.details["masks_clamped"]
    # TorchScript: one -inf Constant per layer; dynamo: one shared -3.4e38 initializer
    expected = {"torchscript": -np.inf, "dynamo": float(np.finfo(np.float32).min)}[entry["exporter"]]
    assert masks and all(v == pytest.approx(expected) for v in masks.values()), masks
    values = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    values.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in proto.graph.node if n.op_type == "Constant"})
    for name in masks:
        assert values[name].dtype == np.float16 and float(values[name].min()) == LOW_PRECISIONS["float16"].mask_fill
    for name, v in values.items():
        if v.dtype == np.float16:
            assert np.isfinite(v).all(), f"{name} holds inf in float16"
    # causal structure: every attention probability above the diagonal is exactly 0, rows sum to 1
    feeds, expected_out = fp32_outputs(entry)
    probs_names = [n.output[0] for n in proto.graph.node if n.op_type == "Softmax"]
    assert len(probs_names) == len([n for n in source.graph.node if n.op_type == "Softmax"]) == 2
    results = reference.evaluator(proto).run(None, feed_for(proto, feeds), intermediate=True)
    for name in probs_names:
        p = results[name]
        assert p.dtype == np.float16 and np.isfinite(p).all()
        seq = p.shape[-1]
        assert (p[..., np.triu_indices(seq, 1)[0], np.triu_indices(seq, 1)[1]] == 0).all()
        np.testing.assert_allclose(p.astype(np.float32).sum(-1), 1.0, atol=1e-2)
    err = errors(expected_out, run(proto, feeds, session))
    assert err["rel_l2"] < 2e-3, err


def padding_attention_model() -> onnx.ModelProto:
    """HF-style padding mask: Where(keep, 0, finfo(float32).min) added to the scores."""
    b = Builder()
    x = b.input("x", [2, 6, 8])
    keep = b.input("keep", [2, 1, 6], TensorProto.BOOL)
    rng = np.random.default_rng(0)
    q = b.node("MatMul", x, b.const(rng.standard_normal((8, 8)) * 0.3))
    k = b.node("MatMul", x, b.const(rng.standard_normal((8, 8)) * 0.3))
    v = b.node("MatMul", x, b.const(rng.standard_normal((8, 8)) * 0.3))
    scores = b.node("MatMul", q, b.node("Transpose", k, perm=[0, 2, 1]))
    mask = b.node("Where", keep, b.const(0.0), b.const(np.finfo(np.float32).min, name="mask_min"), name="mask")
    probs = b.node("Softmax", b.node("Add", scores, mask, name="add_mask"), axis=-1, name="softmax")
    b.output(b.node("MatMul", probs, v, name="context"))
    return b.model()


def test_padding_mask_that_overflows_in_float16_stays_finite():
    """-3.4e38 is -inf in float16: a fully masked (padding) row becomes NaN when converted as is."""
    with np.errstate(over="ignore"):
        assert np.float16(np.finfo(np.float32).min) == -np.inf
    source = padding_attention_model()
    rng = np.random.default_rng(1)
    keep = np.ones((2, 1, 6), bool)
    keep[0, 0, 2:] = False  # batch 0: four padded keys
    feeds = {"x": rng.standard_normal((2, 6, 8)).astype(np.float32), "keep": keep}
    expected = reference.run(source, feeds)
    model, result = convert(source)
    proto, session = assert_valid(model)
    assert result.details["masks_clamped"] == {"mask_min": pytest.approx(float(np.finfo(np.float32).min))}
    got = reference.run(proto, feeds)
    out = list(got.values())[0].astype(np.float32)
    assert np.isfinite(out).all()
    assert relative_l2(list(expected.values())[0], out) < 2e-3
    # the same model with the mask converted as is (-inf) and every key of a row masked: NaN
    naive = onnx.ModelProto()
    naive.CopyFrom(proto)
    for t in naive.graph.initializer:
        if t.name == "mask_min":
            t.CopyFrom(numpy_helper.from_array(np.array(-np.inf, np.float16), t.name))
    all_masked = dict(feeds, keep=np.zeros((2, 1, 6), bool))
    with np.errstate(invalid="ignore"):
        assert np.isnan(list(reference.run(naive, all_masked).values())[0]).any()
        assert np.isfinite(list(reference.run(proto, all_masked).values())[0]).all()


# ---------------------------------------------------------------- fp32_auto


def overflow_model() -> onnx.ModelProto:
    """x @ W, scaled by 1e3 twice (|h| reaches ~1e7 > 65504) and back, then Relu."""
    b = Builder()
    x = b.input("x", ["batch", 8])
    k = b.const(1000.0, name="k")
    h = b.node("MatMul", x, b.const(np.random.default_rng(0).standard_normal((8, 8))), name="matmul")
    h = b.node("Mul", h, k, name="scale1")
    h = b.node("Mul", h, k, name="scale2")
    h = b.node("Div", h, k, name="unscale1")
    h = b.node("Div", h, k, name="unscale2")
    b.output(b.node("Relu", h, name="relu"))
    return b.model()


def test_fp32_auto_keeps_exactly_the_nodes_around_an_overflow(tmp_path):
    source = overflow_model()
    feeds = {"x": np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)}
    expected = list(reference.run(source, feeds).values())
    plain, _ = convert(source)
    plain_proto, _ = assert_valid(plain)
    with np.errstate(over="ignore", invalid="ignore"):
        assert not np.isfinite(run(plain_proto, feeds)[0]).all(), "plain float16 overflows"
    np.savez(tmp_path / "calibration.npz", **feeds)
    for calibration, per_run in ((None, None), (tmp_path / "calibration.npz", 2)):
        model, result = convert(source, fp32_auto=True, calibration=calibration, calibration_outputs_per_run=per_run)
        # scale2 writes the overflowing tensor, unscale1 reads it; nothing else needs float32
        assert set(result.details["fp32_nodes"]) == {"scale2", "unscale1"}, result.details["fp32_nodes"]
        assert "reaches" in result.details["fp32_nodes"]["scale2"]
        assert result.details["calibration"]["runner"] == "onnxruntime-cpu"
        assert result.details["calibration"]["runs"] == (1 if per_run is None else 3)  # 6 tensors, 2 a run
        proto, _ = assert_valid(model)
        assert_no_cast_pairs(proto)
        assert relative_l2(expected[0], run(proto, feeds)[0]) < 2e-3


def test_fp32_auto_on_a_fused_graph_calibrates_with_the_reference_evaluator():
    entry = next(e for e in ENTRIES if e["file"] == "vae-decoder.tiny.dynamo.static.sdpa.onnx")
    model, result = convert(FIXTURES / entry["file"], before=FUSIONS, fp32_auto=True)
    assert result.details["calibration"]["runner"] == "onnxopt-reference"
    assert result.details["fp32_by_kind"] == {}, "tiny models stay far inside the float16 range"
    proto, _ = assert_valid(model)
    feeds, expected = fp32_outputs(entry)
    assert_within_bound(errors(expected, run(proto, feeds)))


def test_the_reference_calibration_sees_every_value_and_drops_each_after_its_last_reader():
    """What fp32_auto's reference-evaluator calibration records: the values run(intermediate=True)
    holds, each once, while at most a fraction of them are alive at a time (SDXL's VAE decoder
    held 4.5 GB of intermediates at a 32x32 latent before)."""
    import weakref

    entry = next(e for e in ENTRIES if e["file"] == "vae-decoder.tiny.dynamo.static.sdpa.onnx")
    model = load_model(FIXTURES / entry["file"])
    PassManager(registry.expand(FUSIONS)).run(model)
    proto = model.to_onnx()
    assert reference.unsupported_on_ort_cpu(proto), "the fused graph must need the reference kernels"
    feeds, _ = fp32_outputs(entry)
    evaluator = reference.evaluator(proto)
    everything = evaluator.run(None, feeds, intermediate=True)
    computed = {n for n in everything if n and n not in feeds and n not in evaluator.rt_inits_}
    seen, alive = {}, []

    def observe(name, value):
        assert name not in seen, f"{name} observed twice"
        np.testing.assert_array_equal(value, everything[name])
        seen[name] = weakref.ref(value)
        alive.append(sum(ref() is not None for ref in seen.values()))

    outputs = evaluator.run_observed(feeds, observe)
    assert set(seen) == computed
    for name, value in outputs.items():
        np.testing.assert_array_equal(value, everything[name])
    assert max(alive) < len(computed) / 4, (max(alive), len(computed))


def test_sensitivity_keeps_a_cancellation_and_its_producer_in_float32():
    b = Builder()
    x = b.input("x", ["batch", 8])
    h = b.node("MatMul", x, b.const(np.random.default_rng(0).standard_normal((8, 8))), name="matmul")
    shifted = b.node("Add", h, b.const(1000.0), name="shift")  # float16 ulp at 1000 is 0.5
    b.output(b.node("Relu", b.node("Sub", shifted, b.const(1000.0), name="unshift"), name="relu"))
    source = b.model()
    feeds = {"x": np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)}
    expected = list(reference.run(source, feeds).values())[0]
    plain, _ = convert(source, fp32_auto=True)
    assert relative_l2(expected, run(plain.to_onnx(), feeds)[0]) > 1e-2
    model, result = convert(source, fp32_auto=True, sensitivity=1e-2, calibration=feeds)
    assert set(result.details["fp32_nodes"]) == {"shift", "unshift"}
    proto, _ = assert_valid(model)
    assert relative_l2(expected, run(proto, feeds)[0]) < 2e-3


# ---------------------------------------------------------------- lookalikes


@pytest.mark.parametrize("file", ["unet-sd15.tiny.torchscript.static.sdpa.onnx", "unet-sd15.tiny.dynamo.dynamic.sdpa.onnx"])
def test_resize_scales_stay_float32(file):
    """ORT's converter writes float16 scales on static TorchScript UNets; the schema says tensor(float)."""
    model, result, proto, session = converted_fixture(file)
    types = elem_types(proto)
    resizes = [n for n in proto.graph.node if n.op_type == "Resize"]
    assert resizes
    for node in resizes:
        assert types[node.input[0]] == TensorProto.FLOAT16
        assert types[node.input[2]] == TensorProto.FLOAT


def test_torchscript_time_proj_cast_is_retargeted_and_the_timestep_embedding_stays_float32():
    model, result, proto, session = converted_fixture("unet-sd15.tiny.torchscript.static.sdpa.onnx")
    by_name = {n.name: n for n in proto.graph.node}
    cast = by_name["/unet/Cast"]  # time_proj's .to(dtype): Cast(to=FLOAT) in the float32 export
    assert helper.get_attribute_value(cast.attribute[0]) == TensorProto.FLOAT16
    types = elem_types(proto)
    assert types[cast.input[0]] == TensorProto.FLOAT  # sin/cos embedding computed in float32, as torch does
    for name in ("/unet/time_proj/Sin", "/unet/time_proj/Cos", "/unet/time_proj/Mul"):
        assert types[by_name[name].output[0]] == TensorProto.FLOAT
        assert "periodic" in result.details["fp32_nodes"][name]


def shape_arithmetic_model() -> onnx.ModelProto:
    """Float shape arithmetic (Cast->Div->Floor->Cast to int), a float Range, a ConstantOfShape."""
    b = Builder()
    x = b.input("x", ["batch", 8])
    n = b.node("Gather", b.node("Shape", x), b.const(1, np.int64), axis=0, name="dim")
    n_float = b.node("Cast", n, to=TensorProto.FLOAT, name="n_float")
    half = b.node("Floor", b.node("Div", n_float, b.const(2.0), name="halve"), name="floor")
    half_int = b.node("Cast", half, to=TensorProto.INT64, name="back_to_int")
    ramp = b.node("Range", b.const(0.0), b.node("Cast", n, to=TensorProto.FLOAT, name="limit"), b.const(1.0), name="range")
    ones = b.node("ConstantOfShape", b.node("Shape", x, name="shape2"),
                  value=numpy_helper.from_array(np.array([0.5], np.float32)), name="fill")
    y = b.node("Mul", b.node("Add", x, ones, name="add_fill"), ramp, name="mul_ramp")
    end = b.node("Unsqueeze", half_int, b.const([0], np.int64))
    sliced = b.node("Slice", y, b.const([0], np.int64), end, b.const([1], np.int64), name="slice")
    b.output(b.node("Relu", sliced, name="relu"))
    return b.model()


def test_range_shape_arithmetic_and_constant_of_shape_keep_correct_types():
    source = shape_arithmetic_model()
    model, result = convert(source)
    proto, session = assert_valid(model)
    types = elem_types(proto)
    by_name = {n.name: n for n in proto.graph.node}
    assert all(types[i] == TensorProto.FLOAT for i in by_name["range"].input)  # Range has no float16 kernel type
    assert types[by_name["halve"].output[0]] == TensorProto.FLOAT  # feeds an integer: never rounded
    assert types[by_name["floor"].output[0]] == TensorProto.FLOAT
    fill = by_name["fill"]
    assert helper.get_attribute_value(fill.attribute[0]).data_type == TensorProto.FLOAT16
    assert types[by_name["mul_ramp"].output[0]] == TensorProto.FLOAT16
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)}
    expected = list(reference.run(source, feeds).values())
    assert_within_bound(errors(expected, run(proto, feeds, session)))


def test_cast_to_float_of_an_integer_input_is_retargeted():
    b = Builder()
    t = b.input("t", ["batch", 4], TensorProto.INT64)
    f = b.node("Cast", t, to=TensorProto.FLOAT, name="to_float")
    b.output(b.node("MatMul", f, b.const(np.eye(4) * 0.5), name="matmul"))
    model, result = convert(b.model())
    proto, session = assert_valid(model)
    cast = next(n for n in proto.graph.node if n.name == "to_float")
    assert helper.get_attribute_value(cast.attribute[0]) == TensorProto.FLOAT16
    assert result.details["casts_retargeted"] >= 1
    np.testing.assert_allclose(run(proto, {"t": np.arange(8).reshape(2, 4)}, session)[0], np.arange(8).reshape(2, 4) * 0.5)


def test_out_of_range_constants_are_refused_not_clamped_and_inactive_bounds_convert():
    b = Builder()
    x = b.input("x", ["batch", 8])
    scaled = b.node("Mul", x, b.const(1e5), name="times_1e5")  # 1e5 > 65504 and not a mask
    unscaled = b.node("Div", scaled, b.const(1e5), name="div_1e5")
    clipped = b.node("Clip", unscaled, b.const(-1.0), b.const(1e5), name="clip")  # max never binds
    b.output(b.node("Relu", clipped, name="relu"))
    source = b.model()
    model, result = convert(source)
    proto, session = assert_valid(model)
    kept = result.details["fp32_nodes"]
    assert set(kept) == {"times_1e5", "div_1e5"} and "beyond the float16 range" in kept["times_1e5"]
    assert dict(result.refusal_counts())  # refusals carry the reason for the report
    assert "clip" not in kept and list(result.details["inactive_bounds"].values()) == [1e5]
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)}
    expected = list(reference.run(source, feeds).values())
    assert_within_bound(errors(expected, run(proto, feeds)))


def test_vanishing_epsilon_keeps_the_chain_to_its_divisor_float32():
    """RMS-norm-like x / Sqrt(Mean(x²) + 1e-12): the epsilon is 0 in float16, an all-zero row 0/0."""
    assert np.float16(1e-12) == 0
    b = Builder()
    x = b.input("x", ["batch", 8])
    mean_sq = b.node("ReduceMean", b.node("Mul", x, x, name="square"), axes=[-1], keepdims=1, name="mean")
    denom = b.node("Sqrt", b.node("Add", mean_sq, b.const(1e-12), name="add_eps"), name="sqrt")
    b.output(b.node("Mul", b.node("Div", x, denom, name="div"), b.const(np.linspace(0.5, 1.5, 8)), name="gamma"))
    source = b.model()
    model, result = convert(source)
    kept = result.details["fp32_nodes"]
    assert set(kept) == {"add_eps", "sqrt", "div"} and "rounds to zero" in kept["add_eps"]
    proto, _ = assert_valid(model)
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)}
    feeds["x"][1] = 0
    out = run(proto, feeds)[0]
    assert np.isfinite(out).all() and (out[1] == 0).all()
    assert_within_bound(errors(list(reference.run(source, feeds).values()), [out]))


def test_forced_fp32_ops_and_nodes_get_casts_only_at_the_region_edges():
    entry = next(e for e in CLIP if e["exporter"] == "dynamo")
    model, result = convert(FIXTURES / entry["file"], fp32_ops=["Softmax"], fp32_nodes=["node_Add_80", "no_such_node"])
    proto, session = assert_valid(model)
    assert_no_cast_pairs(proto)
    types = elem_types(proto)
    for node in proto.graph.node:
        if node.op_type == "Softmax" or node.name == "node_Add_80":
            assert types[node.output[0]] == TensorProto.FLOAT, node.name
    assert result.details["fp32_nodes_not_found"] == ["no_such_node"]
    # the mask feeds a float32 Add (layer 0) and a float16 one (layer 1): finite in both types
    values = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    assert float(values["val_79"]) == LOW_PRECISIONS["float16"].mask_fill and values["val_79"].dtype == np.float32
    # the mask Add and the Softmax after it are both float32: no Cast between them
    add = next(n for n in proto.graph.node if n.name == "node_Add_80")
    assert [n.op_type for n in proto.graph.node if add.output[0] in n.input] == ["Softmax"]
    feeds, expected = fp32_outputs(entry)
    assert_within_bound(errors(expected, run(proto, feeds, session)))


# ---------------------------------------------------------------- options


def test_keep_io_types_false_gives_a_float16_interface():
    entry = next(e for e in ENTRIES if e["file"] == "unet-sd15.tiny.dynamo.dynamic.sdpa.onnx")
    model, result = convert(FIXTURES / entry["file"], keep_io_types=False)
    proto, session = assert_valid(model)
    assert {i.type.tensor_type.elem_type for i in proto.graph.input} == {TensorProto.FLOAT16}
    assert {o.type.tensor_type.elem_type for o in proto.graph.output} == {TensorProto.FLOAT16}
    feeds, expected = fp32_outputs(entry)
    assert_within_bound(errors(expected, run(proto, feeds, session)))


@pytest.mark.parametrize("file", ["clip-text.tiny.dynamo.dynamic.sdpa.onnx", "unet-sd15.tiny.torchscript.static.sdpa.onnx"])
def test_bfloat16_gives_a_valid_model(file):
    """Valid and checked; ORT's CPU EP has almost no bfloat16 kernels, so it runs on the reference evaluator.

    Ops whose opset-17 schema lacks bfloat16 (Conv, InstanceNormalization, Sin, ConstantOfShape)
    stay float32 with Casts around them, and so does Resize, which ORT has no bfloat16 kernel for
    (with it, every fixture ran on ORT's CUDA EP on an H100; without, none with a Resize did).
    """
    entry = next(e for e in ENTRIES if e["file"] == file)
    model, result = convert(FIXTURES / file, low_precision="bfloat16")
    proto, session = assert_valid(model)
    types = elem_types(proto)
    assert sum(t.data_type == TensorProto.BFLOAT16 for t in proto.graph.initializer) > 10
    for node in proto.graph.node:
        if node.op_type in ("Conv", "InstanceNormalization", "Resize"):
            assert types[node.output[0]] == TensorProto.FLOAT
        if node.op_type == "MatMul":
            assert types[node.output[0]] == TensorProto.BFLOAT16
    feeds, expected = fp32_outputs(entry)
    err = errors(expected, run(proto, feeds, session))
    assert err["rel_l2"] < BF16_REL_L2, err


def test_converting_twice_changes_nothing():
    model, _, _, _ = converted_fixture("unet-sd15.tiny.torchscript.static.sdpa.onnx")
    again = model.copy()
    result = next(p.result for p in PassManager(["infer-shapes", Fp16Pass()]).run(again).passes if p.name == "fp16")
    assert not result.modified and result.details["casts_inserted"] == result.details["constants_converted"] == 0


def test_fp16_runs_from_the_optimize_api_with_verification():
    from onnxopt import optimize
    from onnxopt.verify import Tolerance

    model, report = optimize(FIXTURES / "vae-decoder.tiny.dynamo.static.sdpa.onnx", ["cleanup", "fp16"],
                             verify=True, tolerance=Tolerance(atol=1e-2, rtol=1e-2))
    assert report.first_broken_pass is None and report.final_verification.ok
    assert report.final_verification.max_abs_error > 0  # it is float16 now


def test_unknown_low_precision_is_rejected():
    with pytest.raises(ValueError, match="float16"):
        Fp16Pass(low_precision="float8")


# ---------------------------------------------------------------- memory


def test_conversion_does_not_load_external_weights(tmp_path):
    """Weights stay where they are (ExternalValues) or become DerivedValues until the save streams them."""
    import tracemalloc

    from onnxopt.weights import DerivedValues, ExternalValues

    n = 2000  # 4 weights of 16 MB
    rng = np.random.default_rng(0)
    b = Builder()
    prev = b.input("x", ["batch", n])
    for i in range(4):
        b.inits.append(numpy_helper.from_array(rng.standard_normal((n, n), dtype=np.float32), f"W{i}"))
        prev = b.node("MatMul", prev, f"W{i}")
    b.output(b.node("Relu", prev))
    src = tmp_path / "big.onnx"
    onnx.save(b.model(), src, save_as_external_data=True, location="big.onnx.data")
    weights = 4 * n * n * 4
    del b

    tracemalloc.start()
    model, result = convert(src)
    assert all(isinstance(c._values, (DerivedValues, ExternalValues)) for c in model.constants() if c.name.startswith("W"))
    assert result.details["constants_converted"] == 4
    save_model(model, tmp_path / "out.onnx", external_data=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 0.6 * weights, f"peak {peak / 1e6:.0f} MB for {weights / 1e6:.0f} MB of weights"
    assert (tmp_path / "out.onnx.data").stat().st_size >= weights // 2
    x = rng.standard_normal((1, n)).astype(np.float32) * 0.02
    out = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert relative_l2(ref, out) < 5e-3


# ---------------------------------------------------------------- onnxconverter-common


def test_onnxconverter_common_breaks_where_this_pass_does_not():
    """onnxconverter-common 1.16 on the static TorchScript UNet: the time_proj Cast(to=FLOAT) now
    writes float16 into a float-typed value, and ORT rejects the graph. And it clamps constants to
    ±1e4 (max_finite_val): x * 1e5 * 1e-5 comes out 10x too small, with only a warning."""
    occ = pytest.importorskip("onnxconverter_common.float16")
    file = "unet-sd15.tiny.torchscript.static.sdpa.onnx"
    theirs = occ.convert_float_to_float16(onnx.load(str(FIXTURES / file)), keep_io_types=True)
    with pytest.raises(Exception, match=r"time_proj/Cast"):
        ort_session(theirs)
    converted_fixture(file)  # ours: valid (asserted there) and accurate (test above)

    b = Builder()
    x = b.input("x", ["batch", 4])
    b.output(b.node("Mul", b.node("Mul", x, b.const(1e5), name="up"), b.const(1e-5), name="down"))
    source = b.model()
    feeds = {"x": np.full((1, 4), 1e-3, np.float32)}
    with pytest.warns(UserWarning, match="truncated to 10000"):
        clamped = occ.convert_float_to_float16(source, keep_io_types=True)
    np.testing.assert_allclose(ort_session(clamped).run(None, feeds)[0], 1e-4, rtol=1e-2)  # wrong by 10x
    model, result = convert(source)
    assert set(result.details["fp32_nodes"]) == {"up"}  # 1e5 is out of range: its Mul stays float32
    proto, session = assert_valid(model)
    np.testing.assert_allclose(run(proto, feeds, session)[0], feeds["x"], rtol=5e-3)  # 1e-5 is a float16 subnormal


# ---------------------------------------------------------------- other exports (torch)


@pytest.mark.models
@pytest.mark.parametrize("family,exporter,shapes", [("unet-sdxl", "torchscript", "dynamic"), ("vae-encoder", "dynamo", "static")])
def test_other_exports_convert_to_valid_float16(export_tiny, family, exporter, shapes):
    exported = export_tiny(family, exporter, shapes)
    model, result = convert(exported.path)
    proto, session = assert_valid(model)
    assert session is not None
    feeds = exported.built.make_feeds()
    expected = ort_session(onnx.load(str(exported.path))).run(None, feeds)
    assert_within_bound(errors(expected, run(proto, feeds, session)))
    if family == "unet-sdxl":  # add_time_ids go through their own sin/cos embedding: float32
        assert any("add_time_proj/Sin" in n for n in result.details["fp32_nodes"])


# ------------------------------------------------------------------ --verify computes in float16


def _overflowing_model(kind: str) -> onnx.ModelProto:
    """float32 graphs whose intermediate exceeds 65504 and is scaled back down: finite in float32,
    inf in float16 arithmetic (which ORT's CPU EP does not do: it runs Mul and MatMul in float32)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 128])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 16])
    if kind == "matmul":  # |x| @ 2000: row sums near 128000
        nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("MatMul", ["a", "W"], ["y"]),
                 helper.make_node("Mul", ["y", "s"], ["out"])]
        inits = [numpy_helper.from_array(np.full((128, 16), 2000.0, np.float32), "W"), numpy_helper.from_array(np.array(1e-3, np.float32), "s")]
    else:  # x * 1000 * 1000 / 1000 / 1000, on the first 16 features
        nodes = [helper.make_node("Slice", ["x", "zero", "sixteen", "one"], ["x16"]),
                 helper.make_node("Mul", ["x16", "k"], ["y1"]), helper.make_node("Mul", ["y1", "k"], ["y2"]),
                 helper.make_node("Div", ["y2", "k"], ["y3"]), helper.make_node("Div", ["y3", "k"], ["out"])]
        inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("zero", [0]), ("sixteen", [16]), ("one", [1]))]
        inits.append(numpy_helper.from_array(np.array(1000.0, np.float32), "k"))
    model = helper.make_model(helper.make_graph(nodes, "overflow", [x], [out], inits), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("kind", ["matmul", "mul-chain"])
def test_verify_sees_a_float16_overflow_that_ort_cpu_computes_in_float32(tmp_path, capsys, kind):
    from onnxopt.cli import main

    src, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(_overflowing_model(kind), src)
    assert main(["optimize", "-i", str(src), "-o", str(out), "--passes", "fp16", "--verify"]) == 1
    captured = capsys.readouterr()
    assert "verification failed at pass 'fp16'" in captured.err and not out.exists()
    assert "FAIL inf" in captured.out  # the fp16 row: the overflow, not "ok 0.00e+00"


def test_bfloat16_verify_runs_on_the_reference_evaluator(tmp_path, capsys):
    """ORT's CPU EP has no bfloat16 MatMul: the verifier runs bfloat16 models on the reference
    evaluator, at a tolerance looser than float16's (8 mantissa bits to 11)."""
    from onnxopt.cli import main

    path = FIXTURES / "unet-sd15.tiny.torchscript.static.sdpa.onnx"
    args = ["optimize", "-i", str(path), "-o", str(tmp_path / "o.onnx"), "--passes", "fp16", "--low-precision", "bfloat16", "--verify"]
    assert main(args) == 0
    assert "final model equal to the source" in capsys.readouterr().out
