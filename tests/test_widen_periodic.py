"""Claims about ``widen-periodic-arguments`` (and the fp16 pass that runs it):

* on the tiny Flux-dev exported in bfloat16 (dynamo and TorchScript), ``ort-cuda,fp16`` and
  ``fp16`` at ``--low-precision bfloat16`` compute ``timestep * 1000`` and ``guidance * 1000`` in
  float32, and the output is at least twice as close to the float32 module's as the source's is
  (the source rounds guidance 3.5 * 1000 to 3504 before the sinusoidal embedding, as diffusers'
  ``FluxTransformer2DModel`` does in bfloat16);
* hand-built time embeddings: a low-precision Mul by a constant, a Cast to bfloat16 in the cone
  and a bfloat16 Sin are widened, the result equals the float32 computation; lookalikes keep
  their types: a Mul by a constant on an activation feeding Cast(to=FLOAT) outside any Sin/Cos
  cone, a Sin cone over an activation (refused, with its size), a float32 source (no follower);
* ``--verify`` compares the widened result with the source widened the same way, and passes.
"""

from __future__ import annotations

import copy

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import optimize, reference
from onnxopt.precision import relative_l2
from onnxopt.properties import checking
from tests.conftest import FIXTURES, result_of, run_passes

BF16 = np.dtype(ml_dtypes.bfloat16)
FREQS = np.array([[1.0, 0.1, 0.01, 0.001]], np.float32)
WIDEN = "widen-periodic-arguments"


def bf16_constant(name: str, values) -> onnx.TensorProto:
    a = np.asarray(values, np.float32).astype(BF16)
    return helper.make_tensor(name, TensorProto.BFLOAT16, a.shape, a.view(np.uint16).tobytes(), raw=True)


def time_embedding(*, input_type=TensorProto.BFLOAT16, cast_to_low=False, low_sin=False, rows=None) -> onnx.ModelProto:
    """Flux's ``get_timestep_embedding(t.to(bf16) * 1000)`` as a bfloat16 export writes it:
    t ─ [Cast(to=BF16)] ─ Mul(1000) ─ Unsqueeze ─ Cast(to=FLOAT) ─ Mul(freqs) ─ Sin ─ y (float32).
    ``low_sin``: the frequencies and the Sin in bfloat16 too (no Cast(to=FLOAT)). ``rows``: t is
    (B, rows, 64), an activation, not a timestep."""
    shape = ["batch"] if rows is None else ["batch", rows, 64]
    axes = [len(shape)]
    nodes, t = [], "t"
    if cast_to_low:
        nodes.append(helper.make_node("Cast", ["t"], ["t_low"], to=TensorProto.BFLOAT16, name="to_bf16"))
        t = "t_low"
    nodes += [helper.make_node("Mul", [t, "thousand"], ["scaled"], name="times_1000"),
              helper.make_node("Unsqueeze", ["scaled", "axes"], ["column"], name="column")]
    inits = [bf16_constant("thousand", 1000.0), numpy_helper.from_array(np.array(axes, np.int64), "axes")]
    if low_sin:
        nodes += [helper.make_node("Mul", ["column", "freqs"], ["arg"], name="freqs"),
                  helper.make_node("Sin", ["arg"], ["y"], name="sin")]
        inits.append(bf16_constant("freqs", FREQS))
        out_type = TensorProto.BFLOAT16
    else:
        nodes += [helper.make_node("Cast", ["column"], ["column_f32"], to=TensorProto.FLOAT, name="upcast"),
                  helper.make_node("Mul", ["column_f32", "freqs"], ["arg"], name="freqs"),
                  helper.make_node("Sin", ["arg"], ["y"], name="sin")]
        inits.append(numpy_helper.from_array(FREQS.reshape([1] * len(shape) + [4]), "freqs"))
        out_type = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "time_embedding", [helper.make_tensor_value_info("t", input_type, shape)],
                              [helper.make_tensor_value_info("y", out_type, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def outputs(model_or_proto, t: np.ndarray) -> np.ndarray:
    proto = model_or_proto if isinstance(model_or_proto, onnx.ModelProto) else model_or_proto.to_onnx()
    (y,) = reference.run(proto, {"t": t}).values()
    return np.asarray(y, np.float32)


def output_types(proto: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(proto)
    infos = [*inferred.graph.value_info, *inferred.graph.output]
    types = {vi.name: vi.type.tensor_type.elem_type for vi in infos}
    return {n.name: types.get(n.output[0]) for n in inferred.graph.node}


GUIDANCE = np.array([3.5, 5.0], np.float32)  # Flux-dev's guidance, * 1000: 3504 and 4992 in bfloat16
EXACT = np.sin(GUIDANCE.astype(np.float64)[:, None] * 1000 * FREQS)


@pytest.mark.parametrize("form", ["mul", "cast-to-low", "low-sin"])
def test_the_argument_of_a_time_embedding_is_computed_in_float32(form):
    proto = time_embedding(cast_to_low=form == "cast-to-low", low_sin=form == "low-sin",
                           input_type=TensorProto.FLOAT if form == "cast-to-low" else TensorProto.BFLOAT16)
    t = GUIDANCE if form == "cast-to-low" else GUIDANCE.astype(BF16)
    model, report = run_passes(proto, [WIDEN])
    result = result_of(report, WIDEN)
    assert (result.sites_matched, result.sites_rewritten) == (1, 1)
    widened = {"times_1000", "column"} | ({"to_bf16"} if form == "cast-to-low" else set()) \
        | ({"freqs", "sin"} if form == "low-sin" else set())
    assert set(result.details["widened"]) == widened
    assert all("argument of Sin 'sin': computed in float32 where the source computed in bfloat16" in reason
               for reason in result.details["widened"].values())
    out = model.to_onnx()
    types = output_types(out)
    assert all(types[name] == TensorProto.FLOAT for name in widened)
    assert "upcast" not in types  # the Cast(to=FLOAT) it fed is gone
    assert [vi.type.tensor_type.elem_type for vi in out.graph.output] == [vi.type.tensor_type.elem_type
                                                                          for vi in proto.graph.output]
    exact = EXACT
    if form == "low-sin":  # the bfloat16 frequencies are the source's values (rounded at export)
        exact = np.sin(GUIDANCE.astype(np.float64)[:, None] * 1000 * FREQS.astype(BF16).astype(np.float64))
    tol = 8e-3 if form == "low-sin" else 1e-5  # a bfloat16 output is rounded once, at the end
    np.testing.assert_allclose(outputs(out, t), exact, atol=tol)
    assert np.abs(outputs(proto, t) - exact).max() > 0.3  # the source: phase off by 4 and 8 rad


def test_the_fp16_pass_runs_it_on_a_bfloat16_source_and_verify_compares_with_the_widened_source():
    proto = time_embedding()
    model, report = optimize(proto, ["fp16"], options={"fp16": {"low_precision": "bfloat16"}}, verify=True)
    steps = [p.label for p in report.passes]
    assert steps.index("fp16") < steps.index(f"{WIDEN} (for fp16)") < steps.index("remove-redundant-casts (for fp16)")
    assert report.final_verification.ok, report.final_verification
    assert any(f"from {WIDEN} on, compared with the source rewritten by {WIDEN}" in n for n in report.notes)
    np.testing.assert_allclose(outputs(model, GUIDANCE.astype(BF16)), EXACT, atol=1e-5)


def test_without_the_rebase_verification_would_fail_on_what_the_source_rounded():
    """The check above could not pass by accident: the widened model is far from the source."""
    from onnxopt.verify import Verifier

    source = run_passes(time_embedding(), [])[0]
    widened = run_passes(time_embedding(), [WIDEN])[0]
    verifier = Verifier(source)
    try:
        assert not verifier(widened).ok
    finally:
        verifier.close()


def test_a_low_precision_mul_by_a_constant_outside_any_periodic_cone_is_untouched():
    """x:bf16 (B, S, 64) ─ Mul(1000) ─ Cast(to=FLOAT) ─ Softmax: the same shape as Flux's t * 1000, no Sin."""
    x = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["batch", 16, 64])
    nodes = [helper.make_node("Mul", ["x", "thousand"], ["scaled"], name="times_1000"),
             helper.make_node("Cast", ["scaled"], ["up"], to=TensorProto.FLOAT, name="upcast"),
             helper.make_node("Softmax", ["up"], ["y"], axis=-1, name="softmax")]
    graph = helper.make_graph(nodes, "activation", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [bf16_constant("thousand", 1000.0)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model, report = run_passes(proto, [WIDEN])
    result = result_of(report, WIDEN)
    assert not result.modified and result.sites_matched == 0
    assert output_types(model.to_onnx())["times_1000"] == TensorProto.BFLOAT16


def test_a_periodic_cone_over_an_activation_is_refused_with_its_size():
    proto = time_embedding(rows=128)  # (B, 128, 64): 8192 values per sample
    model, report = run_passes(proto, [WIDEN])
    result = result_of(report, WIDEN)
    assert not result.modified and (result.sites_matched, result.sites_rewritten) == (1, 0)
    [(site, reason)] = result.refused
    assert site == "argument of Sin 'sin'" and "8192 values per sample" in reason
    assert output_types(model.to_onnx())["times_1000"] == TensorProto.BFLOAT16


def test_a_float32_source_gets_no_widening_step():
    """The float32 tiny Flux (dynamo fixture): fp16 keeps its Sin/Cos arguments float32 itself."""
    model, report = optimize(FIXTURES / "dit" / "flux-dev.tiny.dynamo.dynamic.sdpa.onnx", ["fp16"],
                             options={"fp16": {"low_precision": "bfloat16"}})
    assert WIDEN not in {p.name for p in report.passes}
    assert "periodic_arguments_in_low_precision" not in result_of(report, "fp16").details


# ---------------------------------------------------------------- the tiny Flux-dev, exported in bfloat16


def torch_float32_output(built) -> np.ndarray:
    """The float32 module with the bfloat16 weights (the same values) on the example feeds."""
    import torch

    feeds = built.make_feeds()
    module = copy.deepcopy(built.module).float().eval()
    with torch.no_grad():
        return module(*[torch.from_numpy(feeds[n]) for n in built.input_names])[0].float().numpy()


def run_bf16(proto: onnx.ModelProto, feeds: dict) -> np.ndarray:
    types = {vi.name: vi.type.tensor_type.elem_type for vi in proto.graph.input}
    f = {n: feeds[n].astype(BF16) if types[n] == TensorProto.BFLOAT16 else feeds[n] for n in types}
    return np.asarray(next(iter(reference.run(proto, f).values())), np.float32)


@pytest.mark.models
@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_the_bf16_tiny_flux_dev_gets_closer_to_float32(export_tiny, exporter):
    exported = export_tiny("flux-dev", exporter=exporter, dtype="bfloat16")
    feeds = exported.built.make_feeds()
    expected = torch_float32_output(exported.built)
    source = onnx.load(str(exported.path))
    source_error = relative_l2(expected, run_bf16(source, feeds))
    assert source_error > 0.03  # measured 0.041: guidance 3.5 * 1000 is 3504 in bfloat16
    for passes in (["ort-cuda", "fp16"], ["fp16"]):
        with checking():  # the shapes and folded constants it claims to keep
            model, report = optimize(exported.path, passes, options={"fp16": {"low_precision": "bfloat16"}})
        result = result_of(report, WIDEN)
        assert (result.sites_matched, result.sites_rewritten) == (2, 2), result.refused  # timestep, guidance
        out = model.to_onnx()
        types = output_types(out)
        muls = [n for n in result.details["widened"] if n in types and next(x for x in out.graph.node if x.name == n).op_type == "Mul"]
        assert len(muls) == 2 and all(types[n] == TensorProto.FLOAT for n in muls)
        error = relative_l2(expected, run_bf16(out, feeds))
        assert error < source_error / 2, (passes, error, source_error)  # measured 0.0068 to 0.0071
