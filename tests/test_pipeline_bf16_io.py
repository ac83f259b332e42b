"""Graphs whose inputs and outputs are bfloat16 (a Flux transformer or T5 exported from a bf16 torch
module) are fed the type they declare, on the host path and on bound buffers.

The claims:

* a float32 value fed to a bfloat16 input is rounded once, to nearest even, bit for bit as torch's
  ``.to(torch.bfloat16)`` rounds; a bfloat16 output comes back as float32 (exactly), through
  ``InferenceSession.run``'s place (:func:`onnxopt.pipeline.sessions.run_host`) and through a
  :class:`~onnxopt.runners.captured_session.CapturedSession` on CPU buffers;
* the committed tiny Flux.1-dev folder (optimum's export) whose transformer and T5 take and give
  bfloat16 (``models.bigexport.bfloat16_io``: the fp32 graph between a Cast after each input and a
  Cast before each output, so the CPU EP runs it) generates the fp32 folder's image within bf16
  rounding, by the fused step on host feeds, on bound buffers, and by the unfused loop, and those
  three give one image; the same for the SD3.5 folder's T5 (text_encoder_3) and transformer;
* a graph input of a type onnxopt cannot feed (string, float8) is refused with one line (exit 2).

Tolerance: bf16 keeps 8 significant bits (a half ulp is 2^-9 of a value, 2e-3). Measured on these
folders (3 steps, images in [0, 1]): Flux 1.3e-3 at most, SD3.5 1.0e-2 (classifier-free guidance at
4.5 multiplies the rounding of both rows' outputs). The paths agree with each other to 1e-6.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="feeding needs onnxruntime")
ml_dtypes = pytest.importorskip("ml_dtypes")

import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from onnxopt.errors import OnnxoptError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "models" / "pipelines"
PATHS = {"host": {}, "bound": {"io_binding": True}, "unfused": {"fused_step": False}}


def _session(graph, opset: int = 17):
    from onnxopt.pipeline.sessions import create_session

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return create_session(model.SerializeToString(), "cpu", name="bf16 probe")


def _bf16_square():
    """y = bf16(float32(x)^2) for a bf16 x; also x as float32 (what the graph read)."""
    nodes = [helper.make_node("Cast", ["x"], ["read"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["read", "read"], ["square"]),
             helper.make_node("Cast", ["square"], ["y"], to=TensorProto.BFLOAT16)]
    return helper.make_graph(nodes, "bf16_square", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [None])],
                             [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [None]),
                              helper.make_tensor_value_info("read", TensorProto.FLOAT, [None])])


def _values() -> np.ndarray:
    """Random float32s, and values exactly halfway between two bfloat16s (ties: even wins)."""
    halfway = ((np.arange(1, 2000, dtype=np.uint32) * 7) << 16 | 0x8000).view(np.float32)
    values = np.concatenate([np.random.default_rng(0).standard_normal(3000).astype(np.float32) * 50, halfway])
    return values[np.isfinite(values) & (np.abs(values) < 1e18)]  # their square stays finite


def test_bfloat16_feeds_round_to_nearest_even_as_torch_and_outputs_come_back_float32():
    torch = pytest.importorskip("torch")
    from onnxopt.pipeline.sessions import run_host
    from onnxopt.runners.captured_session import CapturedSession
    from onnxopt.runtime import import_onnxruntime

    values = _values()
    expected = torch.from_numpy(values).to(torch.bfloat16).to(torch.float32).numpy()
    assert (expected != values).sum() > 1000  # rounding happens: a float32 passed through would fail below
    square = (expected * expected).astype(ml_dtypes.bfloat16).astype(np.float32)
    session = _session(_bf16_square())
    captured = CapturedSession(import_onnxruntime(), session, device="cpu")
    for label, run in (("host", lambda: run_host(session, {"x": values})),
                       ("bound", lambda: dict(zip(["y", "read"], captured.run(["y", "read"], {"x": values}))))):
        out = run()
        assert out["read"].dtype == np.float32 and out["y"].dtype == np.float32, label
        np.testing.assert_array_equal(out["read"], expected, err_msg=label)  # rounded once, to nearest even
        np.testing.assert_array_equal(out["y"], square, err_msg=label)
    # a value already bfloat16 (an output of another bf16 graph, read back as float32) is not moved
    np.testing.assert_array_equal(run_host(session, {"x": expected})["read"], expected)


def _copy(name: str, tmp_path: Path, bf16_components=()) -> Path:
    from models.bigexport import bfloat16_io

    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    for component in bf16_components:
        assert bfloat16_io(out / component / "model.onnx")
    return out


def _declares_bfloat16(path: Path) -> bool:
    model = onnx.load(str(path), load_external_data=False)
    return all(v.type.tensor_type.elem_type in (TensorProto.BFLOAT16, TensorProto.INT64)
               for v in [*model.graph.input, *model.graph.output])


@pytest.mark.parametrize("name, components, request_, atol", [
    ("flux-dev-tiny-optimum", ("transformer", "text_encoder_2"),
     dict(prompt="a photo of a cat riding a horse", steps=3, guidance=3.5, height=32, width=48), 5e-3),
    ("sd35-tiny-optimum", ("transformer", "text_encoder_3"),
     dict(prompt="a photo of a cat", negative_prompt="blurry", steps=3, guidance=4.5, height=32, width=24), 3e-2),
], ids=["flux-dev", "sd3.5"])
def test_a_folder_with_bfloat16_transformer_and_t5_gives_the_fp32_image_within_bf16_rounding(
        tmp_path, name, components, request_, atol):
    pytest.importorskip("torch", reason="generating needs torch")
    pytest.importorskip("diffusers", reason="generating needs diffusers")
    from onnxopt.pipeline import Pipeline

    folder = _copy(name, tmp_path, components)
    assert all(_declares_bfloat16(folder / c / "model.onnx") for c in components)
    request = dict(request_, seed=7, progress=False)
    fp32 = Pipeline.load(FIXTURES / name, "cpu", threads=1)(**request).pixels
    images = {path: Pipeline.load(folder, "cpu", threads=1, **load)(**request).pixels for path, load in PATHS.items()}
    for path, image in images.items():
        assert 0 < np.abs(image - fp32).max() <= atol, path  # rounded (not fed float32), and no further off
        np.testing.assert_allclose(image, images["host"], rtol=0, atol=1e-6, err_msg=path)


def test_a_graph_input_onnxopt_cannot_feed_is_refused_with_one_line(tmp_path, capsys):
    """A transformer whose txt_ids is a string tensor (Cast to int64 inside: ORT loads it): exit 2."""
    from onnxopt.cli import main

    folder = _copy("flux-schnell-tiny-optimum", tmp_path)
    path = folder / "transformer" / "model.onnx"
    model = onnx.load(str(path))
    (ids,) = [v for v in model.graph.input if v.name == "txt_ids"]
    ids.type.tensor_type.elem_type = TensorProto.STRING
    for node in model.graph.node:
        node.input[:] = ["txt_ids_int64" if x == "txt_ids" else x for x in node.input]
    model.graph.node.insert(0, helper.make_node("Cast", ["txt_ids"], ["txt_ids_int64"], to=TensorProto.INT64))
    onnx.save(model, str(path))
    assert main(["generate", str(folder), "--prompt", "a cat", "--steps", "1", "--height", "32", "--width", "32",
                 "-o", str(tmp_path / "image.png"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "transformer: input txt_ids is tensor(string)" in err, err
    assert "Traceback" not in err and not (tmp_path / "image.png").exists()


def test_a_float8_input_is_refused_when_its_session_is_made():
    graph = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)], "float8_in",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT8E4M3FN, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(OnnxoptError, match=r"bf16 probe: input x is tensor\(float8e4m3fn\): onnxopt feeds only "):
        _session(graph, opset=19)
