"""Claims about context-kv: the cross-attention K/V split into a companion graph run once per prompt.

On real tiny exports (``@pytest.mark.models``): for every UNet family and ControlNet, every export
variant, before fusion (plain K and V) and after fuse-attention (packed KV, run on onnxopt's
reference kernels; split K and V; and the ort-cuda default: separate K and V projections that
fuse-parallel-gemm computes in one MatMul), running the context graph and then the denoiser computes what the export
computes; the report lists exactly the torch model's cross-attention modules, each with the input
it now reads. A default set covers every exporter form; the rest is marked ``slow``.

On the committed fixtures: fp16 and nhwc-conv compose in either order (the handed-over tensors
stay fp16), the TensorRT preset's plain K/V, weights moved and not copied, both files written
beside each other and chained by hand on ONNX Runtime, and one-line errors.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from onnxopt import PassManager, context_and_denoiser, load_model, optimize, registry, save_model
from onnxopt.cli import main
from onnxopt.errors import PassOrderError
from onnxopt.verify import InputSpec, assert_same_computation, random_feeds
from tests.conftest import EXPORT_VARIANTS, FIXTURES

FAMILIES = ["unet-sd15", "unet-sd21", "unet-sdxl", "controlnet"]
STAGES = {  # stage -> (passes, fuse-attention's cross-attention layout; None: not fused)
    "plain": (["cleanup", "context-kv"], None),
    "packed": (["cleanup", "fuse-attention", "context-kv"], "packed"),
    "split": (["cleanup", "fuse-attention", "context-kv"], "split"),
    "separate": (["cleanup", "fuse-attention", "fuse-parallel-gemm", "context-kv"], "separate"),  # the ort-cuda default
}
CONTEXT = "encoder_hidden_states"
CONSTANT_INPUTS = ("text_embeds", "time_ids")  # SDXL's added conditioning, constant over the steps
TS_DYNAMIC = ("torchscript", "dynamic", "sdpa")
DEFAULT = {  # (family, variant, stage) run by default; every exporter form and every stage appear
    ("unet-sd15", TS_DYNAMIC, "plain"), ("unet-sd15", TS_DYNAMIC, "packed"), ("unet-sd15", TS_DYNAMIC, "split"),
    ("unet-sd15", ("torchscript", "static", "sdpa"), "packed"),
    ("unet-sd15", ("dynamo", "dynamic", "sdpa"), "plain"), ("unet-sd15", ("dynamo", "dynamic", "sdpa"), "packed"),
    ("unet-sd15", ("dynamo", "static", "sdpa"), "split"), ("unet-sd15", TS_DYNAMIC, "separate"),
    ("unet-sd15", ("dynamo", "dynamic", "sdpa"), "separate"),
    ("unet-sd15", ("torchscript", "dynamic", "classic"), "plain"),
    ("unet-sd21", TS_DYNAMIC, "plain"), ("unet-sdxl", TS_DYNAMIC, "packed"),
    ("controlnet", TS_DYNAMIC, "plain"), ("controlnet", TS_DYNAMIC, "packed"), ("controlnet", TS_DYNAMIC, "split"),
}
SD15_TS_DYNAMIC = FIXTURES / "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx"
SD15_DYNAMO_DYNAMIC = FIXTURES / "unet-sd15.tiny.dynamo.dynamic.sdpa.onnx"
VAE = FIXTURES / "vae-decoder.tiny.torchscript.dynamic.sdpa.onnx"
TINY_SD15_CROSS = [  # the tiny SD 1.5 UNet's cross-attention modules (models/unet.py), for the fixtures
    "down_blocks.0.attentions.0.transformer_blocks.0.attn2",
    "mid_block.attentions.0.transformer_blocks.0.attn2",
    "up_blocks.1.attentions.0.transformer_blocks.0.attn2",
    "up_blocks.1.attentions.1.transformer_blocks.0.attn2",
]


def _cases() -> list:
    cases = []
    for family in FAMILIES:
        for variant in EXPORT_VARIANTS:
            for stage in STAGES:
                marks = [pytest.mark.models] + ([] if (family, variant, stage) in DEFAULT else [pytest.mark.slow])
                cases.append(pytest.param(family, variant, stage, marks=marks, id=f"{family}-{'-'.join(variant)}-{stage}"))
    return cases


def context_kv_result(report):
    return next(step.result for step in report.passes if step.name == "context-kv" and step.companion is None)


def assert_split(model, report, source_inputs: list[str], cross_modules: list[str], *, layout: str | None):
    """The split is complete and minimal: one layer per cross-attention module, the denoiser's
    inputs are the source's minus encoder_hidden_states plus one float K/V tensor per module
    (layout "packed") or two (K and V: fused with layout "split" or "separate", or not fused:
    None), and the companion maps encoder_hidden_states to exactly those. An SDXL UNet's
    text_embeds and time_ids move too: the companion computes the added conditioning
    (add_embedding's output, one tensor), which the denoiser reads instead."""
    packed = layout == "packed"
    context, denoiser = context_and_denoiser(model)
    details = context_kv_result(report).details
    layers = [layer for layer in details["layers"] if layer["attention"] is not None]
    added = [layer for layer in details["layers"] if layer["attention"] is None]
    constant = [n for n in source_inputs if n in CONSTANT_INPUTS]
    assert sorted(layer["module"] for layer in layers) == sorted(cross_modules)
    assert all(layer["reads"] == [f"{layer['module']}.{role}" for role in (["kv"] if packed else ["k", "v"])] for layer in layers)
    assert [layer["reads"] for layer in added] == ([["add_embedding.linear_2.out"]] if constant else [])
    assert details["constant_inputs_moved"] == constant
    attention_interface = [name for layer in layers for name in layer["reads"]]
    interface = attention_interface + [name for layer in added for name in layer["reads"]]
    assert [t.name for t in denoiser.graph.inputs] == [n for n in source_inputs if n != CONTEXT and n not in constant] + interface
    assert [t.name for t in context.graph.inputs] == [CONTEXT] + constant
    assert [t.name for t in context.graph.outputs] == interface
    assert all(np.issubdtype(np.dtype(t.dtype), np.floating) for t in context.graph.outputs)  # no shape plumbing handed over
    assert details["denoiser_reads_context_input"] is None
    readers = {t.name: {n.op for n in t.outputs} for t in denoiser.graph.inputs if t.name in attention_interface}
    kv = [t for t in context.graph.outputs if t.name in attention_interface]
    if packed:
        assert all(ops == {"MultiHeadAttention"} for ops in readers.values())
        assert all(len(t.shape) == 5 and t.shape[3] == 2 for t in kv)  # (B, L, N, 2, H)
    elif layout in ("split", "separate"):
        assert all(ops == {"MultiHeadAttention"} for ops in readers.values())
        assert all(len(t.shape) == 3 for t in kv)  # (B, L, N*H) each
    else:
        assert not any(n.domain == "com.microsoft" for n in denoiser.graph.nodes)


# ---------------------------------------------------------------- real exports


@pytest.mark.parametrize("family, variant, stage", _cases())
def test_context_graph_then_denoiser_equals_the_export_and_lists_the_torch_cross_attention_modules(export_tiny, family, variant, stage):
    exported = export_tiny(family, *variant)
    passes, layout = STAGES[stage]
    model, report = optimize(exported.path, passes, options={"fuse-attention": {"cross_layout": layout}} if layout else None)
    source_inputs = exported.built.input_names
    assert_split(model, report, source_inputs, exported.built.site_modules["attention_cross"], layout=layout)
    assert len([layer for layer in context_kv_result(report).details["layers"] if layer["attention"]]) == exported.sites["attention_cross"]
    # The chain (context graph, then the denoiser fed its outputs) against the export; packed KV
    # runs on onnxopt.reference (ORT's CPU build has no packed-KV MultiHeadAttention kernel).
    assert_same_computation(exported.path, model, atol=1e-5, rtol=1e-4, inputs=exported.input_spec())


# ---------------------------------------------------------------- committed fixtures


@pytest.mark.parametrize("passes", ["ort-cuda,context-kv,fp16", "ort-cuda,fp16,context-kv"])
def test_fp16_and_nhwc_compose_in_either_order_and_the_handed_over_kv_stays_fp16(passes):
    model, report = optimize(SD15_TS_DYNAMIC, passes.split(","))
    context, denoiser = context_and_denoiser(model)
    assert_split(model, report, ["sample", "timestep", CONTEXT], TINY_SD15_CROSS, layout="separate")
    # ort-cuda's fuse-parallel-gemm computes every K and V in one MatMul: it moved to the companion.
    assert [n.op for n in context.graph.nodes if n.op in ("MatMul", "Split")] == ["MatMul", "Split"]
    interface = {t.name for t in context.graph.outputs}
    assert {np.dtype(t.dtype) for t in context.graph.outputs} == {np.dtype(np.float16)}
    assert {np.dtype(t.dtype) for t in denoiser.graph.inputs if t.name in interface} == {np.dtype(np.float16)}
    assert not [n for n in context.graph.nodes if n.op == "Cast" and n.outputs[0].name in interface]  # no f16->f32->f16 trip
    assert np.dtype(context.graph.inputs[0].dtype) == np.float32  # the user-facing input keeps its type
    assert any(n.op == "NhwcConv" for n in denoiser.graph.nodes) and not any(n.op == "NhwcConv" for n in context.graph.nodes)
    if passes.endswith("fp16"):  # fp16 ran on both parts: the report shows the companion's run
        assert any(step.name == "fp16" and step.companion == "context_kv" and step.result.modified for step in report.passes)
    assert_same_computation(SD15_TS_DYNAMIC, model, atol=2e-2, rtol=2e-2)


def test_tensorrt_preset_then_context_kv_hands_over_plain_k_and_v():
    model, report = optimize(SD15_DYNAMO_DYNAMIC, ["tensorrt", "context-kv"])
    assert_split(model, report, ["sample", "timestep", CONTEXT], TINY_SD15_CROSS, layout=None)
    assert_same_computation(SD15_DYNAMO_DYNAMIC, model, atol=1e-5, rtol=1e-4)


def test_kv_weights_move_to_the_context_graph_and_are_not_copied():
    model = load_model(SD15_TS_DYNAMIC)
    PassManager(registry.expand(["cleanup", "fuse-attention"])).run(model)
    reads_context = [n for n in model.graph.nodes if n.op == "MatMul" and n.inputs[0].name == CONTEXT]
    kv_values = {id(n.inputs[1]._values) for n in reads_context}
    assert len(kv_values) == 2 * len(TINY_SD15_CROSS)  # K and V apart (the default cross_layout), the exporter's weights
    before = {id(c._values): c for c in model.constants()}
    PassManager(["context-kv"]).run(model)
    context = model.companions["context_kv"]
    moved = {id(c._values) for c in context.constants()}
    assert kv_values <= moved and not kv_values & {id(c._values) for c in model.constants()}
    assert moved <= set(before)  # every companion constant is an original's values object: nothing new, nothing copied
    shared = moved & {id(c._values) for c in model.constants()}
    assert sum(before[i]._values.nbytes for i in shared) < 1024  # only tiny constants serve both parts


def test_verifier_runs_the_chain_and_notices_a_broken_context_graph():
    model, _ = optimize(SD15_TS_DYNAMIC, ["cleanup", "context-kv"])
    assert_same_computation(SD15_TS_DYNAMIC, model, atol=1e-5, rtol=1e-4)
    context, _ = context_and_denoiser(model)
    weight = next(c for c in context.constants() if c.values.ndim == 2)
    weight.values = np.zeros_like(weight.values)
    with pytest.raises(AssertionError, match="models differ"):
        assert_same_computation(SD15_TS_DYNAMIC, model, atol=1e-5, rtol=1e-4)


def test_cli_writes_denoiser_and_context_graph_side_by_side_and_they_chain_on_onnxruntime(tmp_path, capsys):
    import onnxruntime as ort

    out, js = tmp_path / "unet.opt.onnx", tmp_path / "report.json"
    code = main(["optimize", "-i", str(SD15_TS_DYNAMIC), "-o", str(out), "--passes", "cleanup,context-kv", "--verify",
                 "--external-data", "--report-json", str(js)])
    text = capsys.readouterr().out
    assert code == 0
    companion = tmp_path / "unet.opt.context_kv.onnx"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["unet.opt.onnx", "unet.opt.onnx.data", "unet.opt.context_kv.onnx", "unet.opt.context_kv.onnx.data", "report.json"])
    assert f"wrote {companion}" in text and "final model equal to the source" in text
    for module in TINY_SD15_CROSS:  # the table lists each layer and the inputs it now reads
        assert f"context-kv: {module} reads {module}.k " in text
    layers = next(p for p in json.loads(js.read_text())["passes"] if p["pass"] == "context-kv")["details"]["layers"]
    assert [layer["module"] for layer in layers] == TINY_SD15_CROSS

    # By hand, as a pipeline would: the context graph once, then the denoiser with its outputs.
    feeds = random_feeds(load_model(SD15_TS_DYNAMIC), InputSpec(dims={"sequence": 77}), seed=3)[0]
    cpu = ["CPUExecutionProvider"]
    expected = ort.InferenceSession(str(SD15_TS_DYNAMIC), providers=cpu).run(None, feeds)[0]
    context = ort.InferenceSession(str(companion), providers=cpu)
    kv = dict(zip([o.name for o in context.get_outputs()], context.run(None, {CONTEXT: feeds[CONTEXT]})))
    denoiser = ort.InferenceSession(str(out), providers=cpu)
    assert CONTEXT not in [i.name for i in denoiser.get_inputs()]
    got = denoiser.run(None, {**{k: v for k, v in feeds.items() if k != CONTEXT}, **kv})[0]
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4)


def test_save_model_writes_both_files_or_neither(tmp_path, monkeypatch):
    import onnxopt.saving as saving

    model, _ = optimize(SD15_TS_DYNAMIC, ["cleanup", "context-kv"])
    info = save_model(model, tmp_path / "a.onnx")
    assert info.companions["context_kv"].path == tmp_path / "a.context_kv.onnx"
    onnx.checker.check_model(str(info.companions["context_kv"].path))
    real_write, calls = saving._write, []

    def fail_on_companion(m, *args):
        calls.append(m)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_write(m, *args)

    monkeypatch.setattr(saving, "_write", fail_on_companion)
    with pytest.raises(saving.ModelSaveError, match="No space left"):
        save_model(model, tmp_path / "b.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.context_kv.onnx", "a.onnx"]  # no b.*, no temporaries


def test_context_kv_listed_before_fuse_attention_is_refused_up_front_with_one_line(tmp_path, capsys):
    with pytest.raises(PassOrderError, match="must run after 'fuse-attention'"):
        optimize(SD15_TS_DYNAMIC, ["context-kv", "ort-cuda"])
    out = tmp_path / "o.onnx"
    code = main(["optimize", "-i", str(SD15_TS_DYNAMIC), "-o", str(out), "--passes", "context-kv,ort-cuda"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert len(err.strip().splitlines()) == 1 and "--passes ort-cuda,context-kv" in err


@pytest.mark.parametrize("strict", [False, True])
def test_model_without_encoder_hidden_states_is_a_note_or_exit_4_under_strict(tmp_path, capsys, strict):
    out = tmp_path / "vae.onnx"
    code = main(["optimize", "-i", str(VAE), "-o", str(out), "--passes", "cleanup,context-kv"] + (["--strict"] if strict else []))
    captured = capsys.readouterr()
    message = "context-kv: nothing to extract: the model has no input 'encoder_hidden_states' (inputs: latent_sample)"
    if strict:
        assert code == 4 and message in captured.err and not out.exists()
    else:
        assert code == 0 and f"note: {message}" in captured.out
        assert out.exists() and not (tmp_path / "vae.context_kv.onnx").exists()


def test_a_second_context_kv_finds_nothing_to_extract():
    model, report = optimize(SD15_TS_DYNAMIC, ["cleanup", "context-kv", "context-kv"])
    second = [step for step in report.passes if step.name == "context-kv"][1]
    assert not second.result.modified and "no input 'encoder_hidden_states'" in second.result.nothing_to_do
    assert list(model.companions) == ["context_kv"]


def test_gpu_benchmark_builds_the_full_unet_and_the_split_pair_on_cpu(tmp_path, capsys):
    """benchmarks/context_kv_gpu.py's CPU side: both builds, the pair's files, a table even with nothing timed."""
    from benchmarks.context_kv_gpu import main as bench_main

    assert bench_main(["--source", str(SD15_TS_DYNAMIC), "--work", str(tmp_path), "--build-only", "--out", str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    full, split = results["build:ts-dynamic:full"], results["build:ts-dynamic:split"]
    assert "context_path" not in full and (tmp_path / "split_fp16.context_kv.onnx").exists()
    assert split["context_path"] == str(tmp_path / "split_fp16.context_kv.onnx")
    context = onnx.load(split["context_path"])
    assert [i.name for i in context.graph.input] == [CONTEXT] and len(context.graph.output) == 2 * len(TINY_SD15_CROSS)  # K, V
    table = capsys.readouterr().out
    assert "| denoiser, ort-cuda+context-kv+fp16 | step | failed: not run" in table
