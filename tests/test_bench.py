"""onnxopt bench: the ablation's models (built on CPU from a committed fixture), and the table and
JSON with ratios to the first model that ran; the GPU sessions are replaced by a fake with known timings."""

import json
from collections import Counter

import onnx
import pytest

from onnxopt import bench as bench_module, registry
from onnxopt.bench import BenchReport, BenchRow, ablation_plan, bench_ablation, build_ablation
from onnxopt.cli import main
from onnxopt.runners.ort_cuda import Timing
from tests.conftest import FIXTURES

UNET = FIXTURES / "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx"
FUSIONS = ["upsample-to-skip", "fuse-rotary-embedding", "fuse-attention", "fold-value-bias", "split-concat-projection", "fuse-group-norm", "fuse-skip-group-norm", "fuse-bias-split-gelu",
           "fuse-layer-norm", "fuse-adaln-modulation", "fuse-rms-norm", "fuse-fast-gelu", "fuse-bias-add", "fuse-skip-layer-norm",
           "fuse-parallel-gemm", "nhwc-conv", "fold-conv-bias", "fuse-bias-layer-norm"]
# The file each ablation step writes: 00 source, 01 cleanup, then one per fusion in FUSIONS' order.
AT = {name: i for i, name in enumerate(FUSIONS, start=2)}


def test_ablation_plan_adds_one_fusion_per_step_with_fp16_last():
    steps = ablation_plan(["ort-cuda", "fp16"])
    assert [s.label for s in steps] == (["source fp16", "+ cleanup"] + [f"+ {f}" for f in FUSIONS[:-1]]
                                        + ["+ fuse-bias-layer-norm (= ort-cuda,fp16)"])
    assert steps[0].passes == ["fp16"]
    assert all(s.passes[-1] == "fp16" for s in steps)
    assert steps[-1].passes == registry.expand(["ort-cuda"]) + ["fp16"]  # the last step is the whole preset
    for before, after in zip(steps[1:], steps[2:]):
        assert after.added == [after.label.split()[1]]
        fusions_before = [p for p in before.passes if registry.get_pass(p).is_fusion]
        fusions_after = [p for p in after.passes if registry.get_pass(p).is_fusion]
        assert fusions_after == fusions_before + after.added
        assert after.passes[-3:] == ["eliminate-dead-nodes", "infer-shapes", "fp16"]  # what every step ends with


def test_ablation_plan_without_fp16_starts_from_the_source_itself():
    steps = ablation_plan(["cleanup"])
    assert [(s.label, s.passes) for s in steps] == [("source", []), ("+ cleanup", ["cleanup"])]  # a fixpoint sequence: one step


def contrib_ops(path) -> Counter:
    model = onnx.load(str(path), load_external_data=False)
    return Counter(n.op_type for n in model.graph.node if n.domain == "com.microsoft")


def fp16_share(path) -> float:
    """Share of the floating-point weight elements stored as float16."""
    model = onnx.load(str(path))
    counts = Counter()
    for init in model.graph.initializer:
        if init.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            counts[init.data_type] += onnx.numpy_helper.to_array(init).size
    return counts[onnx.TensorProto.FLOAT16] / max(1, sum(counts.values()))


@pytest.mark.slow
def test_ablation_builds_every_model_on_the_tiny_unet_and_reuses_them(tmp_path, capsys):
    work = tmp_path / "work"
    assert main(["bench", "--ablation", "ort-cuda,fp16", str(UNET), "--work", str(work), "--build-only"]) == 0
    printed = capsys.readouterr().out
    assert "fuse-attention 8/8" in printed and "fuse-group-norm 21/21" in printed
    files = sorted(work.glob("*.onnx"))
    assert [f.name for f in files] == ["00-source-fp16.onnx", "01-cleanup.onnx"] + [
        f"{i:02d}-{name}.onnx" for i, name in enumerate(FUSIONS[:-1], start=2)] + [
        f"{AT['fuse-bias-layer-norm']:02d}-fuse-bias-layer-norm-ort-cuda-fp16.onnx"]
    ops = [contrib_ops(f) for f in files]
    assert ops[0] == ops[1] == Counter()  # fp16 alone, then cleanup: nothing fused yet
    assert ops[AT["fuse-rotary-embedding"]] == Counter()  # a UNet has no rotary embedding
    assert ops[AT["fuse-attention"]] == Counter({"MultiHeadAttention": 8})
    assert ops[AT["fuse-group-norm"]]["GroupNorm"] == 21
    assert ops[AT["fuse-skip-group-norm"]]["SkipGroupNorm"] == 15 and ops[AT["fuse-skip-group-norm"]]["GroupNorm"] == 6
    for nothing_in_a_unet in ("fold-value-bias", "split-concat-projection", "fuse-adaln-modulation", "fuse-rms-norm",
                              "fuse-fast-gelu"):
        assert ops[AT[nothing_in_a_unet]] == ops[AT[nothing_in_a_unet] - 1]
    assert ops[AT["fuse-bias-add"]]["BiasAdd"] == 4 and ops[AT["fuse-skip-layer-norm"]]["SkipLayerNormalization"] == 8
    assert ops[AT["fuse-parallel-gemm"]] == ops[AT["fuse-skip-layer-norm"]]  # standard ops (one Gemm + Split)
    assert ops[AT["nhwc-conv"]]["NhwcConv"] == 33 - 13  # the 13 1x1 convs run as channels-last MatMuls
    assert ops[AT["fold-conv-bias"]]["BiasAdd"] == 4 + 5  # fold-conv-bias: conv + residual sums
    assert ops[AT["fuse-bias-layer-norm"]]["SkipLayerNormalization"] == 8 + 4  # each transformer's norm1
    assert all(sum(after.values()) >= sum(before.values()) for before, after in zip(ops, ops[1:]))
    assert fp16_share(UNET) == 0 and all(fp16_share(f) > 0.95 for f in files)  # every step is fp16
    for f in files:
        onnx.checker.check_model(str(f))

    mtimes = [f.stat().st_mtime_ns for f in files]
    steps = build_ablation(UNET, ["ort-cuda", "fp16"], work, log=lambda _: None)
    assert all(s.reused for s in steps) and [f.stat().st_mtime_ns for f in files] == mtimes
    assert steps[AT["fuse-attention"]].rewritten == "fuse-attention 8/8"
    # Other passes under the same file name are rebuilt, not reused.
    steps = build_ablation(UNET, ["cleanup"], work, log=lambda _: None)
    assert not steps[1].reused and steps[1].path.endswith("01-cleanup.onnx") and contrib_ops(steps[1].path) == Counter()


class FakeSession:
    """Stands in for OrtCudaSession: 10 ms for the source, 5 ms for anything else, halved with CUDA graphs."""

    created = []

    def __init__(self, path, *, cuda_graph=False, prefer_nhwc=False):
        if "broken" in str(path):
            raise RuntimeError("CUDA EP cannot load the model\nsecond line")
        self.path, self.cuda_graph = str(path), cuda_graph
        FakeSession.created.append((self.path, cuda_graph))

    def bind(self, feeds):
        assert set(feeds) == {"sample", "timestep", "encoder_hidden_states"}
        self.shapes = {k: v.shape for k, v in feeds.items()}

    def time(self, warmup, runs):
        ms = (10.0 if self.path == str(UNET) else 5.0) / (2 if self.cuda_graph else 1)
        return Timing(ms, ms * 0.9, ms * 1.5, runs, "cuda-events")


@pytest.fixture
def fake_gpu(monkeypatch):
    FakeSession.created = []
    memory = iter(range(0, 10_000, 100))
    monkeypatch.setattr(bench_module, "OrtCudaSession", FakeSession)
    monkeypatch.setattr(bench_module, "_create_cuda_context", lambda *a: None)
    monkeypatch.setattr(bench_module, "device_memory_mb", lambda *a: (float(next(memory)), "nvml-process"))
    monkeypatch.setattr("onnxopt.runners.ort_cuda._require_cuda", lambda: None)


def test_ablation_bench_times_every_step_and_the_extra_models(tmp_path, fake_gpu):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"")
    steps, report = bench_ablation(UNET, ["cleanup"], tmp_path / "work", extra=[str(UNET), str(broken)],
                                   extra_labels=["again", "broken"], cuda_graph=(False, True), runs=7, log=lambda _: None)
    labels = [(r.label, r.cuda_graph) for r in report.rows]
    assert labels == [(name, g) for g in (False, True) for name in ("source", "+ cleanup", "again", "broken")]
    assert [report.ratio(r) for r in report.rows] == [1.0, 0.5, 1.0, None] * 2
    assert [r.gpu_memory_mb for r in report.rows if r.timing] == [100.0] * 6  # after - before, per session
    failed = [r for r in report.rows if r.timing is None]
    assert [r.error for r in failed] == ["CUDA EP cannot load the model"] * 2
    assert report.inputs["sample"] == [2, 4, 8, 8] and report.memory_probe == "nvml-process"
    assert len(FakeSession.created) == 6


def test_bench_cli_ablation_writes_markdown_and_json(tmp_path, fake_gpu, capsys):
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    code = main(["bench", "--ablation", "cleanup", str(UNET), str(UNET), "--labels", "ORT optimizer", "--work", str(tmp_path / "w"),
                 "--cuda-graph", "on", "--dim", "height=16", "--dim", "width=12", "--json", str(js), "--markdown", str(md)])
    assert code == 0
    out = capsys.readouterr().out
    assert "| source | on | 5.00 |" in out and "| + cleanup | on | 2.50 |" in out and "| ORT optimizer | on | 5.00 |" in out
    assert "| 0.50x |" in out and md.read_text().startswith("| model |") and out.rstrip().endswith(md.read_text().rstrip())
    data = json.loads(js.read_text())
    assert [(r["label"], r["ratio_to_first"]) for r in data["rows"]] == [("source", 1.0), ("+ cleanup", 0.5), ("ORT optimizer", 1.0)]
    assert data["inputs"]["sample"] == [2, 4, 16, 12]
    assert data["rows"][0]["timing"]["median_ms"] == 5.0 and data["rows"][0]["timing"]["clock"] == "cuda-events"


def test_bench_cli_label_count_must_match(tmp_path, fake_gpu, capsys):
    assert main(["bench", str(UNET), str(UNET), "--labels", "one"]) == 2
    assert "1 labels for 2 models" in capsys.readouterr().err


def test_markdown_ratios_are_per_cuda_graph_mode_and_failures_keep_their_row():
    t = lambda ms: Timing(ms, ms, ms, 3, "cuda-events")  # noqa: E731
    report = BenchReport(rows=[
        BenchRow("a", "a.onnx", False, t(8.0), 1000.0), BenchRow("b", "b.onnx", False, t(2.0), None, note="fuse-attention 32/32"),
        BenchRow("c", "c.onnx", False, None, error="out of memory"),
        BenchRow("a", "a.onnx", True, t(4.0), 1100.0), BenchRow("b", "b.onnx", True, t(3.0), 900.0),
    ], inputs={"sample": [2, 4, 64, 64]}, memory_probe="nvml-process")
    lines = report.markdown().splitlines()
    assert lines[0] == "| model | CUDA graph | median ms | min | max | vs first | GPU MB | added |"
    assert lines[2] == "| a | off | 8.00 | 8.00 | 8.00 | 1.00x | 1000 |  |"
    assert lines[3] == "| b | off | 2.00 | 2.00 | 2.00 | 0.25x | - | fuse-attention 32/32 |"
    assert lines[4].startswith("| c | off | failed: out of memory |")
    assert lines[6] == "| b | on | 3.00 | 3.00 | 3.00 | 0.75x | 900 |  |"
    assert "sample 2x4x64x64" in lines[-1] and "cuda-events" in lines[-1]
    data = json.loads(report.to_json())
    assert [r["ratio_to_first"] for r in data["rows"]] == [1.0, 0.25, None, 1.0, 0.75]


def test_when_the_first_model_fails_in_a_mode_the_next_that_ran_is_the_baseline():
    from onnxopt.bench import BenchReport, BenchRow
    from onnxopt.runners.ort_cuda import Timing

    def t(ms):
        return Timing(median_ms=ms, min_ms=ms, max_ms=ms, runs=40, clock="cuda-events")

    report = BenchReport(rows=[
        BenchRow("source", "a", True, None, error="cannot capture"),
        BenchRow("+ attention", "b", True, t(8.0)),
        BenchRow("+ all", "c", True, t(6.0)),
    ])
    assert [report.ratio(r) for r in report.rows] == [None, 1.0, 0.75]
    assert "| + all | on | 6.00 | 6.00 | 6.00 | 0.75x |" in report.markdown()
