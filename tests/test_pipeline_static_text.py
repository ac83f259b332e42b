"""Text encoders at the pipeline's one input shape run every node on the CUDA EP and compute what model.onnx does.

Claims (the text side of a prompt):

* On the tiny SD 1.5 and SDXL text encoders exported by TorchScript and by dynamo, optimized for
  ``ort-cuda`` in fp32 and fp16, ``model.static.b{b}.onnx`` (input_ids [b, 77]) has no node that
  ORT's CUDA EP would not run, while the ``model.onnx`` it comes from has some (the integer ArgMax
  and the shape arithmetic): the check can fail. On ids from the folder's real tokenizer
  (padded, so the EOS id repeats: ArgMax ties) and on random ids, every output of the static graph
  equals model.onnx's (fp32: within 1e-6 of the output's scale; fp16: two fp16 steps, since ORT's
  CPU fp16 kernels round a broadcast Add differently once one operand is a folded constant).
* The integer ArgMax rewrite gives ONNX's answer, ties included, for either ``select_last_index``,
  on any axis and integer type.
* ``Pipeline`` runs the static graphs (timings say so) and gives the image of the same folder
  without them (test_pipeline_generate's tolerances), for SD 1.5 (batch 2) and SDXL with (batch 2)
  and without (batch 1) a negative prompt, on the host loop and on bound buffers; a batch without
  its static graph falls back to model.onnx and says why.

CPU, tiny models: the module takes about 40 s (two torch pipelines, eight text-encoder exports).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytest.importorskip("torch", reason="exporting needs torch (pip install -e '.[models]')")
pytest.importorskip("diffusers", reason="exporting needs diffusers")
pytest.importorskip("transformers", reason="tokenizers need transformers")
ort = pytest.importorskip("onnxruntime")

from onnxopt.api import optimize  # noqa: E402
from onnxopt.loading import load_model  # noqa: E402
from onnxopt.pipeline.optimize_folder import component_passes  # noqa: E402
from onnxopt.pipeline.static_text import (  # noqa: E402
    make_static,
    nodes_off_cuda,
    rewrite_integer_argmax,
    static_file_name,
    text_batches,
    write_static_text_encoders,
)
from onnxopt.saving import save_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMITTED_SD15 = ROOT / "models" / "pipelines" / "sd15-tiny"
KINDS = {"sd15": "sd", "sdxl": "sdxl"}
ENCODERS = {"sd15": ("text_encoder",), "sdxl": ("text_encoder", "text_encoder_2")}
TOKENIZER = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}
PROMPTS = ["", "a photo of a red cat", "blurry"]
THREADS = 1


def session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = THREADS
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run(path, ids):
    s = session(path)
    names = [o.name for o in s.get_outputs()]
    dtype = np.int32 if "int32" in s.get_inputs()[0].type else np.int64
    return dict(zip(names, s.run(names, {"input_ids": ids.astype(dtype)})))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """exported(kind, exporter) -> the folder holding the kind's tiny text encoders and tokenizers
    (SDXL by TorchScript: the whole pipeline folder, for the Pipeline tests)."""
    import torch

    from models.pipelines import build_torch_pipeline, write_onnx_folder

    root = tmp_path_factory.mktemp("static-text")
    pipes, folders = {}, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)

    def get(kind: str, exporter: str) -> Path:
        if (kind, exporter) not in folders:
            pipe = pipes.setdefault(kind, build_torch_pipeline(kind, "tiny", 0))
            folder = root / f"{kind}-{exporter}"
            whole = kind == "sdxl" and exporter == "torchscript"
            write_onnx_folder(kind, folder, "tiny", exporter, 0, pipe=pipe,
                              components=None if whole else list(ENCODERS[kind]))
            folders[kind, exporter] = folder
        return folders[kind, exporter]

    yield get
    torch.set_num_threads(threads)


def token_ids(folder: Path, encoder: str, batch: int) -> np.ndarray:
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(str(folder / TOKENIZER[encoder]))
    ids = tokenizer(PROMPTS[:batch] if batch > 1 else PROMPTS[1:2], padding="max_length",
                    max_length=tokenizer.model_max_length, truncation=True, return_tensors="np").input_ids
    assert ids.shape == (batch, 77) and (ids == ids[0, -1]).sum() > batch  # padded (SD's "tokenizer" pads with EOS)
    return ids


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_static_graph_runs_on_cuda_and_equals_model_onnx(exported, tmp_path, kind, exporter, fp16):
    folder = exported(kind, exporter)
    for encoder in ENCODERS[kind]:
        component = tmp_path / encoder
        component.mkdir()
        optimized, _ = optimize(folder / encoder / "model.onnx", component_passes(encoder, "ort-cuda", fp16))
        save_model(optimized, component / "model.onnx")
        source_off = nodes_off_cuda(load_model(component / "model.onnx"))
        assert any("(ArgMax int" in line and "no ArgMax kernel" in line for line in source_off), source_off
        assert any("shape arithmetic" in line for line in source_off), source_off

        written = write_static_text_encoders(component, text_batches(KINDS[kind]))
        assert [p.name for p, _ in written] == [static_file_name(b) for b in text_batches(KINDS[kind])]
        for (path, off), batch in zip(written, text_batches(KINDS[kind])):
            assert off == [] and nodes_off_cuda(load_model(path)) == []
            static_ids = session(path).get_inputs()[0]
            assert static_ids.shape == [batch, 77]
            rng = np.random.default_rng(batch)
            for ids in (token_ids(folder, encoder, batch), rng.integers(0, 400, (batch, 77))):
                expected, got = run(component / "model.onnx", ids), run(path, ids)
                assert list(got) == list(expected)
                for name, value in expected.items():
                    scale = float(np.abs(value).max()) or 1.0
                    tolerance = 2 * 2.0 ** -10 * scale if fp16 else 1e-6 * scale
                    np.testing.assert_allclose(got[name], value, rtol=0, atol=tolerance, err_msg=f"{encoder} {name}")


def test_the_comparison_sees_a_tie_broken_the_other_way(exported):
    """SD's tokenizer pads with the EOS id (the largest), so the pooling ArgMax meets ties; its
    pooled output is the last hidden state at the first EOS. Pooling at the last EOS instead moves
    it far outside the tolerance above: a tie broken the wrong way fails that test."""
    folder = exported("sd15", "torchscript")
    ids = token_ids(folder, "text_encoder", 2)
    out = run(folder / "text_encoder" / "model.onnx", ids)
    hidden, pooled = out["last_hidden_state"], out["pooler_output"]
    rows = np.arange(len(ids))
    first, last = ids.argmax(-1), ids.shape[1] - 1 - np.flip(ids, -1).argmax(-1)
    assert (first < last).all()  # ties
    np.testing.assert_allclose(pooled, hidden[rows, first], rtol=0, atol=1e-6 * np.abs(pooled).max())
    assert np.abs(hidden[rows, last] - pooled).max() > 1e3 * 1e-6 * np.abs(pooled).max()


def argmax_model(dtype, axis: int, last: int, shape) -> onnx.ModelProto:
    node = helper.make_node("ArgMax", ["x"], ["y"], axis=axis, keepdims=0, select_last_index=last)
    graph = helper.make_graph([node], "argmax", [helper.make_tensor_value_info("x", dtype, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("dtype", [TensorProto.INT32, TensorProto.INT64])
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("last", [0, 1])
def test_integer_argmax_becomes_a_tie_free_float_argmax(tmp_path, dtype, axis, last):
    """ONNX's answer (first or last maximum) on rows full of ties, ids up to CLIP's 49407, after the
    rewrite leaves ArgMax over float32 only (what the CUDA EP has a kernel for)."""
    shape = [3, 77]
    proto = argmax_model(dtype, axis, last, shape)
    model = load_model(proto)
    assert len(nodes_off_cuda(model)) == 1
    assert rewrite_integer_argmax(model.graph, shape[axis]) == 1
    assert nodes_off_cuda(model) == []
    path = save_model(model, tmp_path / "static.onnx").path
    rng = np.random.default_rng(last)
    np_dtype = np.int32 if dtype == TensorProto.INT32 else np.int64
    x = rng.integers(0, 5, shape).astype(np_dtype)  # few distinct values: ties everywhere
    x[0, :] = 49407
    x[1, 10:] = 49407
    x[2, [3, 40, 76]] = 49407
    expected = session_run_proto(proto, x)
    got = session(path).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, expected)
    reference = x.argmax(axis) if not last else (x.shape[axis] - 1 - np.flip(x, axis).argmax(axis))
    np.testing.assert_array_equal(got, reference)


def session_run_proto(proto, x):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    s = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def test_static_graph_refers_to_the_weights_of_model_onnx(tmp_path):
    """A weight of 1 MB or more stays in model.onnx's data file: the static graph points at it
    (same file, offset, length) and no other data file appears."""
    emb = onnx.numpy_helper.from_array(np.random.default_rng(0).random((5000, 64)).astype(np.float32), "embedding")
    nodes = [helper.make_node("Gather", ["embedding", "input_ids"], ["hidden"]),
             helper.make_node("ArgMax", ["input_ids"], ["eos"], axis=-1, keepdims=0)]
    graph = helper.make_graph(nodes, "te", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
                              [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("eos", TensorProto.INT64, None)], [emb])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "model.onnx"),
              save_as_external_data=True, location="model.onnx_data", size_threshold=0)
    [(path, off)] = write_static_text_encoders(tmp_path, (2,))
    weight_map = path.name.removesuffix(".onnx") + ".weights.json"  # where each weight went (for --lora)
    assert off == [] and sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.onnx", "model.onnx_data", path.name,
                                                                                weight_map])
    stored = {t.name: t for t in onnx.load(str(path), load_external_data=False).graph.initializer}
    assert {(k.key, k.value) for k in stored["embedding"].external_data} >= {("location", "model.onnx_data")}
    assert path.stat().st_size < 4096
    ids = np.random.default_rng(1).integers(0, 5000, (2, 77))
    ids[:, 5:] = 4999
    expected, got = run(tmp_path / "model.onnx", ids), run(path, ids)
    assert all(np.array_equal(got[name], value) for name, value in expected.items())


def test_make_static_refuses_what_is_not_a_text_encoder():
    from onnxopt.errors import UnsupportedModelError

    node = helper.make_node("Identity", ["sample"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("sample", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    with pytest.raises(UnsupportedModelError, match="not a text encoder"):
        make_static(load_model(helper.make_model(graph)), 2)


# --- the pipeline ---------------------------------------------------------------------------------

def with_static_graphs(source: Path, destination: Path, kind: str, batches=None) -> Path:
    shutil.copytree(source, destination)
    for encoder in ENCODERS[kind]:
        write_static_text_encoders(destination / encoder, batches or text_batches(KINDS[kind]))
    return destination


REQUEST = dict(steps=2, scheduler="euler", seed=0, height=32, width=48, progress=False)


@pytest.mark.parametrize("kind, io_binding", [("sd15", False), ("sd15", True), ("sdxl", True)],
                         ids=["sd15-host", "sd15-bound", "sdxl-bound"])
def test_pipeline_runs_the_static_graphs_with_the_same_image(exported, tmp_path, kind, io_binding):
    from onnxopt.pipeline import Pipeline

    source = COMMITTED_SD15 if kind == "sd15" else exported("sdxl", "torchscript")
    folder = with_static_graphs(source, tmp_path / kind, kind)
    pipe = Pipeline.load(folder, "cpu", threads=THREADS, io_binding=io_binding)
    plain = Pipeline.load(source, "cpu", threads=THREADS, io_binding=io_binding)
    negatives = [None, "blurry"] if kind == "sdxl" else ["blurry"]
    for negative in negatives:
        batch = 1 if negative is None else 2
        got = pipe("a photo of a red cat", negative_prompt=negative, **REQUEST)
        expected = plain("a photo of a red cat", negative_prompt=negative, **REQUEST)
        assert got.timings["text_encoders"] == {e: static_file_name(batch) for e in ENCODERS[kind]}
        assert all(s.startswith("model.onnx") for s in expected.timings["text_encoders"].values())
        # test_pipeline_generate's tolerances (ORT fuses the static graph's kernels differently: the
        # text differs by ~1e-7 relative); swapped or wrong text rows move the latents by O(1)
        np.testing.assert_allclose(got.latents, expected.latents, rtol=0, atol=1e-4 * np.abs(expected.latents).max())
        np.testing.assert_allclose(got.pixels, expected.pixels, rtol=0, atol=1e-4)
    text_sessions = sorted(k for k in pipe.sessions if k.startswith("text_encoder"))
    batches = [1, 2] if kind == "sdxl" else [2]
    assert text_sessions == sorted(f"{e}/b{b}" for e in ENCODERS[kind] for b in batches)  # model.onnx never loaded


def test_a_batch_without_its_static_graph_falls_back_and_says_why(tmp_path):
    from onnxopt.pipeline import Pipeline

    folder = with_static_graphs(COMMITTED_SD15, tmp_path / "sd15", "sd15", batches=(1,))
    pipe = Pipeline.load(folder, "cpu", threads=THREADS)
    result = pipe("a photo of a red cat", negative_prompt="blurry", **REQUEST)
    assert result.timings["text_encoders"] == {
        "text_encoder": "model.onnx: no static graph for batch 2 (it has model.static.b1.onnx)"}
    off = Pipeline.load(folder, "cpu", threads=THREADS, static_text=False)("a photo of a red cat", **REQUEST)
    assert off.timings["text_encoders"] == {"text_encoder": "model.onnx: static graphs off (static_text=False)"}


def test_sdxl_without_a_negative_prompt_makes_the_one_row_graphs_ahead_and_no_other(exported, tmp_path, monkeypatch):
    """Told that the calls give no negative prompt (``generate`` without --negative-prompt), the load
    makes the text graphs of the prompt alone ahead (SDXL's force_zeros_for_empty_prompt): the first
    image takes them, and no two-row graph is made at all."""
    from onnxopt.pipeline import Pipeline
    from onnxopt.pipeline import runner as runner_module

    folder = with_static_graphs(exported("sdxl", "torchscript"), tmp_path / "sdxl", "sdxl")
    made, create = [], runner_module.create_session
    monkeypatch.setattr(runner_module, "create_session", lambda model, *a, **k: made.append(model) or create(model, *a, **k))
    pipe = Pipeline.load(folder, "cpu", threads=THREADS, negative_prompt=False)
    result = pipe("a photo of a red cat", **REQUEST)
    assert result.timings["text_encoders"] == {e: static_file_name(1) for e in ENCODERS["sdxl"]}
    text = sorted(Path(m).relative_to(folder).as_posix() for m in made
                  if not isinstance(m, bytes) and Path(m).parent.name.startswith("text_encoder"))
    assert text == [f"{e}/{static_file_name(1)}" for e in ENCODERS["sdxl"]]


# --- CUDA EP (the lead runs these on the GPU machine: pytest -m gpu tests/test_pipeline_static_text.py) ---

def _cuda():
    from onnxopt.runners.ort_cuda import cuda_available

    return cuda_available()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs onnxruntime-gpu and a CUDA device")
def test_captured_text_encoder_replays_a_second_prompt(exported, tmp_path, kind):
    """On the folder optimized for ort-cuda, the static text encoders are captured as CUDA graphs
    (ORT accepts capture only when every node is on the CUDA EP); a second and a third prompt
    replay the captured graph on the same buffers and give what an uncaptured session of the same
    graph gives (fp32: within 1e-3 of the scale, cuBLAS' algorithms may differ between sessions)."""
    from onnxopt.pipeline import Pipeline, optimize_folder
    from onnxopt.runners.captured_session import CapturedSession

    source = COMMITTED_SD15 if kind == "sd15" else exported("sdxl", "torchscript")
    folder = tmp_path / "ort-cuda"
    optimize_folder(source, folder, target="ort-cuda")
    captured = Pipeline.load(folder, "cuda", cuda_graph=True)
    uncaptured = Pipeline.load(folder, "cuda", cuda_graph=False)
    for prompt, negative in (("a photo of a red cat", "blurry"), ("a dog", "low quality"), ("a red cat", "")):
        got = captured.encode_prompt(prompt, negative)
        expected = uncaptured.encode_prompt(prompt, negative)
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-3 * np.abs(value).max(), err_msg=name)
    first = captured.encode_prompt("a photo of a red cat", "blurry")
    assert np.abs(first["encoder_hidden_states"] - got["encoder_hidden_states"]).max() > 1e-2  # prompts differ
    for encoder in ENCODERS[kind]:
        session = captured.sessions[f"{encoder}/b2"]
        assert isinstance(session, CapturedSession) and session.cuda_graph, f"{encoder}: not captured"
        assert len(session.cache) == 1  # every prompt replayed the same buffers
    result = captured("a photo of a red cat", negative_prompt="blurry", **REQUEST)
    assert result.timings["text_encoders"] == {e: static_file_name(2) for e in ENCODERS[kind]}


def test_incomplete_symbolic_shape_inference_writes_nothing_into_the_working_directory(tmp_path, monkeypatch):
    """ORT's tool saves its partial model as sym_shape_infer_temp.onnx in the working directory before it
    raises; onnxopt's wrapper raises the same refusal and leaves the user's folder as it was."""
    from onnxopt.errors import UnsupportedModelError
    from onnxopt.pipeline.static_text import symbolic_shapes

    unknown = helper.make_node("Unknown", ["x"], ["y"], domain="example.unknown")
    graph = helper.make_graph([unknown, helper.make_node("Relu", ["y"], ["z"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.unknown", 1)])
    before = model.SerializeToString()
    theirs = tmp_path / "sym_shape_infer_temp.onnx"
    theirs.write_bytes(b"the user's own file")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedModelError, match="shapes unknown"):
        symbolic_shapes(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sym_shape_infer_temp.onnx"]
    assert theirs.read_bytes() == b"the user's own file"
    assert model.SerializeToString() == before  # the skeleton itself is untouched
