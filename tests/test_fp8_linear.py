"""Claims about fp8-linear (opt-in): fp16 Linears as com.microsoft GemmFloat8 on float8e4m3fn.

* The NumPy GemmFloat8 kernel is the scaled float32 product of its float8 inputs.
* A Linear becomes Quantize + GemmFloat8 and computes what it computed within the error float8
  implies: e4m3 rounds each element of x and W by up to 2^-4 relative, which on Gaussian data
  gives a relative L2 error of about 3.7 % per GEMM against fp16 (bound checked: 6 %; and above
  1 %: the rewrite really quantizes).
* Lookalikes are refused with the reason: a weight that is not a constant, K or N not a multiple
  of 16, a GEMM below ``min_macs``, rows (M) not static.
* On the tiny SD 1.5 UNet optimized with ``ort-cuda,fp16`` (both exporters): the 10 Linears whose
  K and N are multiples of 16 are rewritten and the other 28 refused with that reason; the UNet's
  output moves by about 1.4 % relative L2 against fp16 (bound checked: 5 %).
* ``optimize --fp8`` appends fp16 and fp8-linear to the ort-cuda preset, refuses TensorRT, and
  --explain shows the refusals.
* On a GPU (``-m gpu``): the rewritten graphs run on the CUDA EP and agree with the reference.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import optimize, reference
from onnxopt.cli import main
from onnxopt.runners import cuda_available
from tests.conftest import op_counts

ml_dtypes = pytest.importorskip("ml_dtypes")
FP8 = ml_dtypes.float8_e4m3fn
RNG = np.random.default_rng(15)


def rel_l2(got, expected) -> float:
    got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def linear_model(k=64, n=48, rows=(2, 32), opset=17, weight_is_input=False, x_dims=None):
    """y = x @ W with x (*rows, K) float16 and W (K, N) a float16 initializer (or a graph input)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, x_dims or [*rows, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)
    w = (RNG.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16)
    inputs, inits = [x], [numpy_helper.from_array(w, "W")]
    if weight_is_input:
        inputs, inits = [x, helper.make_tensor_value_info("W", TensorProto.FLOAT16, [k, n])], []
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="proj")], "linear", inputs, [y], inits)
    # IR version 10: onnx 1.23 writes 14 by default, which ONNX Runtime 1.31 (the GPU host's) refuses
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def gaussian_feed(k=64, rows=(2, 32), seed=0):
    return {"x": np.random.default_rng(seed).standard_normal((*rows, k)).astype(np.float16)}


def fp8_linear(model, verify=False, **options):
    """(model, fp8-linear's PassResult), calibrated on one Gaussian feed of another seed unless told."""
    options.setdefault("calibration", [gaussian_feed(seed=99)])
    out, report = optimize(model, ["fp8-linear"], verify=verify, options={"fp8-linear": options})
    assert report.first_broken_pass is None  # --verify: within the pass's float8 tolerance
    return out, next(p.result for p in report.passes if p.name == "fp8-linear")


# ---------------------------------------------------------------- the reference kernel


@pytest.mark.parametrize("trans_b", [0, 1])
def test_reference_gemm_float8_is_the_scaled_product_of_its_float8_inputs(trans_b):
    a = RNG.standard_normal((8, 32)).astype(FP8)
    b = RNG.standard_normal((16, 32) if trans_b else (32, 16)).astype(FP8)
    scale_a, scale_b = np.array([0.5], np.float32), np.array([0.25], np.float32)
    node = helper.make_node("GemmFloat8", ["A", "B", "", "sa", "sb"], ["Y"], domain="com.microsoft",
                            transB=trans_b, dtype=TensorProto.FLOAT16)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT8E4M3FN, a.shape),
         helper.make_tensor_value_info("B", TensorProto.FLOAT8E4M3FN, b.shape)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT16, [8, 16])],
        [numpy_helper.from_array(scale_a, "sa"), numpy_helper.from_array(scale_b, "sb")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    y = reference.run(model, {"A": a, "B": b})["Y"]
    b32 = b.astype(np.float32).T if trans_b else b.astype(np.float32)
    expected = (a.astype(np.float32) @ b32) * 0.125
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.astype(np.float32), expected, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------- the rewrite, proven


def test_a_linear_becomes_quantize_and_gemm_float8_within_the_error_of_float8():
    source = linear_model(opset=17)
    model, result = fp8_linear(source, verify=True, min_macs=0)
    assert (result.sites_matched, result.sites_rewritten) == (1, 1)
    proto = model.to_onnx()
    ops = [(n.domain or "", n.op_type) for n in proto.graph.node]
    assert ops == [("", "Reshape"), ("", "QuantizeLinear"), ("com.microsoft", "GemmFloat8"), ("", "Reshape")]
    gemm = next(n for n in proto.graph.node if n.op_type == "GemmFloat8")
    assert {a.name: helper.get_attribute_value(a) for a in gemm.attribute} == {"transA": 0, "transB": 1, "dtype": TensorProto.FLOAT16}
    weight = next(i for i in proto.graph.initializer if i.name == gemm.input[1])
    assert (weight.data_type, list(weight.dims)) == (TensorProto.FLOAT8E4M3FN, [48, 64])  # (N, K): cuBLASLt's TN form
    assert model.opset == 21 and result.details["opset_moved_to"] == 21  # QuantizeLinear to float8 needs opset 19+
    feed = gaussian_feed(seed=1)
    expected, got = reference.run(source, feed)["y"], reference.run(proto, feed)["y"]
    assert got.dtype == np.float16 and got.shape == expected.shape == (2, 32, 48)
    assert 0.01 < rel_l2(got, expected) < 0.06


def test_an_sd_sized_projection_passes_the_default_min_macs_and_the_time_embedding_size_does_not():
    big = linear_model(k=320, n=320, rows=(2, 1024))  # 2048 rows x 320 x 320 = 210M MACs
    _, result = fp8_linear(big, calibration=[gaussian_feed(k=320, rows=(2, 1024), seed=99)])
    assert result.sites_rewritten == 1
    small = linear_model(k=320, n=1280, rows=(2,))  # a time-embedding-sized Linear: 819k MACs
    _, result = fp8_linear(small, calibration=[gaussian_feed(k=320, rows=(2,), seed=99)])
    assert result.sites_rewritten == 0 and "below min_macs" in result.refused[0][1]


def test_the_float8_weight_survives_a_save_and_a_reload(tmp_path):
    from onnxopt.saving import save_model

    model, _ = fp8_linear(linear_model(), min_macs=0)
    feed = gaussian_feed(seed=2)
    in_memory = reference.run(model.to_onnx(), feed)["y"]
    save_model(model, tmp_path / "fp8.onnx", external_data=True)
    reloaded = onnx.load(str(tmp_path / "fp8.onnx"))
    assert any(i.data_type == TensorProto.FLOAT8E4M3FN for i in reloaded.graph.initializer)
    np.testing.assert_array_equal(reference.run(reloaded, feed)["y"], in_memory)


def test_a_2d_input_needs_no_reshape_and_symbolic_rows_keep_their_dims():
    two_d, _ = fp8_linear(linear_model(rows=(64,)), min_macs=0, calibration=[gaussian_feed(rows=(64,))])
    assert [n.op for n in two_d.graph.nodes] == ["QuantizeLinear", "GemmFloat8"]
    source = linear_model(x_dims=["batch", "tokens", 64], opset=20)
    symbolic, result = fp8_linear(source, min_macs=0)
    assert result.sites_rewritten == 1 and "opset_moved_to" not in result.details  # opset 20 is new enough
    feed = gaussian_feed(rows=(3, 5), seed=3)
    got = reference.run(symbolic.to_onnx(), feed)["y"]
    assert got.shape == (3, 5, 48)
    assert rel_l2(got, reference.run(source, feed)["y"]) < 0.06


# ---------------------------------------------------------------- lookalikes that must not fuse


@pytest.mark.parametrize("case, options, reason", [
    (dict(weight_is_input=True), dict(min_macs=0), "the weight is not a constant"),
    (dict(k=24), dict(min_macs=0), "K=24 is not a multiple of 16"),
    (dict(n=40), dict(min_macs=0), "N=40 is not a multiple of 16"),
    (dict(), dict(min_macs=10**9), "below min_macs=1000000000"),
    (dict(x_dims=["batch", "tokens", 64]), dict(), "is not static"),
])
def test_lookalikes_are_refused_with_the_reason(case, options, reason):
    model, result = fp8_linear(linear_model(**case), **options)
    assert (result.sites_matched, result.sites_rewritten) == (1, 0)
    assert reason in result.refused[0][1]
    assert op_counts(model)["GemmFloat8"] == 0


def test_calibration_that_sees_only_zeros_refuses_the_site():
    _, result = fp8_linear(linear_model(), min_macs=0, calibration=[{"x": np.zeros((2, 32, 64), np.float16)}])
    assert result.sites_rewritten == 0 and "only zeros" in result.refused[0][1]


# ---------------------------------------------------------------- the tiny UNet, both exporters


@pytest.mark.models
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_tiny_unet_linears_with_aligned_dims_become_gemm_float8(export_tiny, exporter):
    from models import build

    exported = export_tiny("unet-sd15", exporter, "dynamic")
    fp16, _ = optimize(str(exported.path), ["ort-cuda", "fp16"])
    calibration = build("unet-sd15", size="tiny", seed=1).make_feeds()
    fp8, report = optimize(fp16, ["fp8-linear"], options={"fp8-linear": {"min_macs": 0, "calibration": [calibration]}})
    result = next(p.result for p in report.passes if p.name == "fp8-linear")
    assert (result.sites_matched, result.sites_rewritten) == (38, 10)
    assert all("multiple" in reason for _, reason in result.refused)  # the tiny widths 8 and 24
    assert op_counts(fp8)["GemmFloat8"] == 10 and op_counts(fp8)["QuantizeLinear"] == 10
    feed = exported.built.make_feeds()
    expected = next(iter(reference.run(fp16.to_onnx(), feed).values()))
    got = next(iter(reference.run(fp8.to_onnx(), feed).values()))
    assert 1e-3 < rel_l2(got, expected) < 0.05


# ---------------------------------------------------------------- the command line


def test_cli_fp8_appends_fp16_and_fp8_linear_and_explains_refusals(tmp_path, capsys):
    src, out = tmp_path / "linear.onnx", tmp_path / "out.onnx"
    onnx.save(linear_model(k=24), str(src))
    code = main(["optimize", "-i", str(src), "-o", str(out), "--target", "ort-cuda", "--fp8", "--explain", "fp8-linear"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "fp16" in text and "fp8-linear" in text and "K=24 is not a multiple of 16" in text


@pytest.mark.parametrize("args, message", [
    (["--target", "tensorrt", "--fp8"], "--fp8 is for --target ort-cuda"),
    (["--fp8"], "--fp8 is for --target ort-cuda"),
    (["--target", "ort-cuda", "--fp8-calibration", "x.npz"], "--fp8-calibration goes with --fp8"),
    # refused before any pass: on a dynamic model every site is refused before calibration reads the file
    (["--target", "ort-cuda", "--fp8", "--fp8-calibration", "{tmp}/missing.npz"], "cannot read inputs"),
    (["--target", "ort-cuda", "--fp8", "--fp8-calibration", "{tmp}/wrong.npz"], "no array for input(s) x"),
])
def test_cli_fp8_misuse_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    src = tmp_path / "linear.onnx"
    onnx.save(linear_model(x_dims=["batch", "tokens", 64]), str(src))
    np.savez(tmp_path / "wrong.npz", y=np.zeros(3))
    args = [a.format(tmp=tmp_path) for a in args]
    assert main(["optimize", "-i", str(src), "-o", str(tmp_path / "out.onnx"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.onnx").exists()


def test_fp8_linear_is_in_no_preset():
    from onnxopt.registry import PRESETS

    assert all("fp8-linear" not in preset.passes for preset in PRESETS.values())


# ---------------------------------------------------------------- on a GPU


def _cuda_session(proto, strict: bool = True):
    """``strict``: every node on the CUDA EP, or the session fails (graphs without shape computations)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if strict:
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CUDAExecutionProvider"])
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    return session


def gpu_only(test):
    """``-m gpu``; skipped where onnxruntime-gpu or a CUDA device is missing (CI)."""
    skip = pytest.mark.skipif(not cuda_available(), reason="needs onnxruntime-gpu and a CUDA device")
    return pytest.mark.gpu(skip(test))


@pytest.mark.parametrize("rows, k, n, opset", [((2, 4096), 320, 320, 20), ((2, 1024), 1280, 5120, 20), ((2, 77), 2048, 640, 20),
                                             ((64,), 64, 48, 20), ((2, 4096), 320, 320, 17)])  # 17: moved to 21
@gpu_only
def test_gpu_fp8_linear_runs_on_cuda_and_matches_its_reference(rows, k, n, opset):
    source = linear_model(k=k, n=n, rows=rows, opset=opset)
    model, result = fp8_linear(source, min_macs=0, calibration=[gaussian_feed(k=k, rows=rows, seed=99)])
    assert result.sites_rewritten == 1
    proto = model.to_onnx()
    feed = gaussian_feed(k=k, rows=rows, seed=4)
    got = _cuda_session(proto).run(None, feed)[0]
    assert rel_l2(got, reference.run(proto, feed)["y"]) < 5e-3  # same float8 inputs: accumulation order, fp16 output
    assert rel_l2(got, reference.run(source, feed)["y"]) < 0.06


@pytest.mark.models
@gpu_only
def test_gpu_tiny_unet_with_fp8_linears_runs_on_cuda_and_matches_its_reference(export_tiny):
    from models import build

    exported = export_tiny("unet-sd15", "dynamo", "dynamic")
    fp16, _ = optimize(str(exported.path), ["ort-cuda", "fp16"])
    calibration = build("unet-sd15", size="tiny", seed=1).make_feeds()
    fp8, _ = optimize(fp16, ["fp8-linear"], options={"fp8-linear": {"min_macs": 0, "calibration": [calibration]}})
    proto = fp8.to_onnx()
    feed = exported.built.make_feeds()
    got = _cuda_session(proto, strict=False).run(None, {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in feed.items()})[0]
    expected = next(iter(reference.run(proto, feed).values()))
    assert rel_l2(got, expected) < 1e-2


@gpu_only
@pytest.mark.xfail(strict=False, reason="ORT's GemmFloat8 CUDA kernel (gemm_float8.cu) synchronizes its stream, creates a "
                   "cuBLASLt handle and cudaMallocs a 32 MB workspace on every call; a CUDA graph capture forbids the sync")
def test_gpu_fp8_linear_runs_under_a_cuda_graph(tmp_path):
    """XPASS on an ORT whose kernel can be captured; XFAIL says this one cannot."""
    from onnxopt.runners.ort_cuda import OrtCudaSession
    from onnxopt.saving import save_model

    rows, k, n = (2, 4096), 320, 320
    model, _ = fp8_linear(linear_model(k=k, n=n, rows=rows, opset=20), min_macs=0,
                          calibration=[gaussian_feed(k=k, rows=rows, seed=99)])
    save_model(model, tmp_path / "fp8.onnx")
    session = OrtCudaSession(str(tmp_path / "fp8.onnx"), cuda_graph=True)
    feed = gaussian_feed(k=k, rows=rows, seed=5)
    session.bind(feed)
    session.run()
    session.run()
    got = next(iter(session.outputs().values()))
    assert rel_l2(got, reference.run(model.to_onnx(), feed)["y"]) < 5e-3
