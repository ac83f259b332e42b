"""onnxopt.optimize takes what torch.onnx.export(..., dynamo=True) returns, and an onnx-ir model,
and gives back the same kind, computing what the source computes, with the torch module's own
weight buffers (the pointers are compared: nothing was copied in or out)."""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import pytest

import onnxopt
from onnxopt.verify import InputSpec

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[models]')")
ir = pytest.importorskip("onnx_ir", reason="needs onnx-ir (comes with onnxscript)")
pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def unet_program():
    """The tiny SD 1.5 UNet from models/, exported by the dynamo exporter (static shapes)."""
    pytest.importorskip("diffusers")
    from models import build

    built = build("unet-sd15", size="tiny")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(built.module, built.example_inputs, dynamo=True,
                                    input_names=built.input_names, output_names=built.output_names)
    return built, program


def _parameter_pointers(module) -> dict[str, int]:
    return {name: p.data_ptr() for name, p in module.state_dict(keep_vars=True).items()}


def _copies_of_parameters(ir_model, module) -> list[str]:
    """Initializers that hold a parameter's exact bytes in a buffer of their own (a copy)."""
    by_bytes = {}
    for name, p in module.state_dict(keep_vars=True).items():
        by_bytes.setdefault(p.detach().numpy().tobytes(), set()).add(p.data_ptr())
    copies = []
    for name, value in ir_model.graph.initializers.items():
        array = value.const_value.numpy()
        owners = by_bytes.get(array.tobytes()) if array.nbytes >= 1024 else None
        if owners and array.ctypes.data not in owners:
            copies.append(name)
    return copies


def _initializer_pointers(ir_model) -> dict[str, int]:
    return {name: v.const_value.numpy().ctypes.data for name, v in ir_model.graph.initializers.items()
            if v.const_value is not None and v.const_value.nbytes >= 1024}


def test_onnx_program_in_and_out_equal_to_torch_without_copying_weights(unet_program, tmp_path):
    built, program = unet_program
    feeds = built.make_feeds()
    before = {name: v.const_value for name, v in program.model.graph.initializers.items()}
    result, report = onnxopt.optimize(program, ["ort-cuda"], verify=True, returns="same",
                                      inputs=InputSpec(shapes={k: v.shape for k, v in feeds.items()}))
    assert isinstance(result, torch.onnx.ONNXProgram) and result is not program
    assert report.final_verification.ok, report.table()  # reference kernels: result == source
    assert report.nodes_after < report.nodes_before
    ops = {node.op_type for node in result.model.graph}
    assert {"MultiHeadAttention", "GroupNorm"} <= ops  # it was fused, not passed through
    # The source program is untouched: same initializer objects, no fused op.
    assert {name: v.const_value for name, v in program.model.graph.initializers.items()} == before
    assert "MultiHeadAttention" not in {node.op_type for node in program.model.graph}

    # No weight copied in or out: every large initializer the passes did not rewrite is the torch
    # parameter's own storage, in the source program and in the result alike.
    # (ort-cuda rewrites most weights: packed QKV, NHWC convs; those are new tensors.)
    params = _parameter_pointers(built.module)
    source_ptrs, result_ptrs = _initializer_pointers(program.model), _initializer_pointers(result.model)
    named = [name for name in params if name in source_ptrs]
    assert len(named) > 20 and all(source_ptrs[name] == params[name] for name in named)
    kept = {name: ptr for name, ptr in result_ptrs.items() if name in params}
    assert kept and kept == {name: params[name] for name in kept}
    assert _copies_of_parameters(result.model, built.module) == []

    # The program given back saves like any program, and the file is the optimized model.
    result.save(str(tmp_path / "unet.onnx"))
    assert onnxopt.load_model(tmp_path / "unet.onnx").graph.nodes.__len__() == report.nodes_after


def test_onnx_ir_model_round_trip_runs_on_ort_and_shares_buffers(unet_program, tmp_path):
    built, program = unet_program
    feeds = built.make_feeds()
    result, report = onnxopt.optimize(program.model, ["tensorrt"], verify=True, returns="same")
    assert report.final_verification.ok, report.table()
    assert isinstance(result, ir.Model)
    params = _parameter_pointers(built.module)
    kept = {name: ptr for name, ptr in _initializer_pointers(result).items() if name in params}
    assert len(kept) > 20
    assert kept == {name: params[name] for name in kept}
    assert _copies_of_parameters(result, built.module) == []
    source = program.model.graph.initializers
    assert all(result.graph.initializers[name].const_value is source[name].const_value for name in kept)

    # The tensorrt preset writes standard ONNX: ORT's CPU EP runs it, and it matches torch.
    import onnxruntime as ort

    path = tmp_path / "unet.trt.onnx"
    ir.save(result, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)
    with torch.no_grad():
        expected = built.module(*built.example_inputs)
    expected = expected if isinstance(expected, (tuple, list)) else [expected]
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e.numpy(), atol=1e-4, rtol=1e-3)


def test_onnx_ir_model_read_from_files_keeps_its_external_tensors(fixtures_dir):
    """ir.load() leaves weights in the .data file (ExternalTensor); they come back as the same
    objects, still unread, after verification read them through a memory map."""
    source = ir.load(fixtures_dir / "unet-sd15.tiny.dynamo.dynamic.sdpa.onnx")
    external = {name: v.const_value for name, v in source.graph.initializers.items()
                if isinstance(v.const_value, ir.ExternalTensor)}
    assert len(external) > 20
    result, report = onnxopt.optimize(source, ["tensorrt"], verify=True, returns="same",
                                      inputs=InputSpec(dims={"height": 16, "width": 16}))
    assert report.final_verification.ok, report.table()
    kept = {name: v.const_value for name, v in result.graph.initializers.items() if name in external}
    assert len(kept) > 20 and all(tensor is external[name] for name, tensor in kept.items())


def test_other_sources_keep_their_kind(fixtures_dir):
    import onnx
    import onnx_graphsurgeon as gs

    proto = onnx.load(str(fixtures_dir / "clip-text.tiny.torchscript.dynamic.sdpa.onnx"))
    out, _ = onnxopt.optimize(proto, ["cleanup"], returns="same")
    assert isinstance(out, onnx.ModelProto) and len(out.graph.node) < len(proto.graph.node)
    graph, _ = onnxopt.optimize(gs.import_onnx(proto), ["cleanup"], returns="same")
    assert isinstance(graph, gs.Graph)
    model, _ = onnxopt.optimize(proto, ["cleanup"])
    assert isinstance(model, onnxopt.Model)
    with pytest.raises(onnxopt.OnnxoptError, match="returns must be"):
        onnxopt.optimize(proto, ["cleanup"], returns="ir")
