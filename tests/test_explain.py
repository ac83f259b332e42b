"""Claims about ``--explain`` and near misses: a fusion that does not fire says, per candidate, which
node it stopped at and which condition refused it (onnxopt.fusion, Report.explain, the CLI)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxopt import optimize
from onnxopt.cli import main
from tests.test_attention_fusion import attention_model
from tests.test_group_norm_fusion import ProtoBuilder, X_SHAPE, group_norm_model


def _node_named(model: onnx.ModelProto, op_type: str) -> str:
    (name,) = [n.name for n in model.graph.node if n.op_type == op_type]
    return name


def attention_over_the_query_axis() -> onnx.ModelProto:
    """An attention block whose Softmax normalizes over the query axis (2) instead of the keys (-1)."""
    model = attention_model()
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    softmax.attribute[0].i = 2
    return model


def test_explain_names_the_group_norm_whose_instance_norm_scale_is_not_one_and_the_condition():
    model = group_norm_model(in_scale=np.full(4, 3.0))
    _, report = optimize(model, ["fuse-group-norm"], explain={"fuse-group-norm"})
    text = report.explain()
    norm = _node_named(model, "InstanceNormalization")
    line = next(line for line in text.splitlines() if "REFUSED" in line)
    assert f"'{norm}'" in line and "InstanceNormalization scale is not all ones" in line, text


def test_explain_names_the_attention_whose_softmax_axis_differs_and_the_condition(tmp_path, capsys):
    model = attention_over_the_query_axis()
    source, out = tmp_path / "attention.onnx", tmp_path / "out.onnx"
    onnx.save(model, source)
    code = main(["optimize", "-i", str(source), "-o", str(out), "--passes", "fuse-attention", "--explain", "fuse-attention"])
    text = capsys.readouterr().out
    assert code == 0
    line = next(line for line in text.splitlines() if "REFUSED" in line)
    assert "'probs'" in line and "Softmax over axis 2, not the key axis" in line, text


def test_without_explain_nothing_is_traced():
    _, report = optimize(group_norm_model(), ["fuse-group-norm"])
    assert all(p.result.trace is None for p in report.passes) and report.explain() == ""


def group_norm_scaled_by_div():
    """A GroupNorm lookalike that normalizes each group by its L2 norm (LpNormalization), not by its
    mean and variance: every GroupNorm form (with or without γ/β) misses at that one node. (γ by Div
    instead of Mul is no near miss any more: the bare normalization in front of it is a GroupNorm.)"""
    b = ProtoBuilder()
    x = b.input("x", X_SHAPE)
    grouped = b.node("Reshape", x, b.const([0, 4, -1]))
    normed = b.node("LpNormalization", grouped)
    restored = b.node("Reshape", normed, b.node("Shape", x))
    b.output(b.node("Add", b.node("Mul", restored, b.random((8, 1, 1))), b.random((8, 1, 1))))
    return b.model()


def test_a_requested_fusion_that_matches_nothing_reports_its_near_misses():
    model = group_norm_scaled_by_div()
    _, report = optimize(model, ["fuse-group-norm"])
    (note,) = [n for n in report.notes if n.startswith("fuse-group-norm")]
    lp = _node_named(model, "LpNormalization")
    assert "near miss" in note and "op type is LpNormalization, expected InstanceNormalization" in note, note
    assert f"'{lp}'" in note, note
    assert "near miss" in report.table()


def test_explain_of_a_pass_the_run_does_not_include_is_a_usage_error(tmp_path, capsys):
    source = tmp_path / "gn.onnx"
    onnx.save(group_norm_model(), source)
    code = main(["optimize", "-i", str(source), "-o", str(tmp_path / "o.onnx"), "--passes", "cleanup",
                 "--explain", "fuse-group-norm"])
    assert code == 2 and "does not include" in capsys.readouterr().err


@pytest.mark.parametrize("rewritten", [True, False])
def test_explain_lists_matched_sites_too(rewritten):
    model = group_norm_model() if rewritten else group_norm_model(in_scale=np.full(4, 3.0))
    _, report = optimize(model, ["fuse-group-norm"], explain={"fuse-group-norm"})
    text = report.explain()
    assert ("  ok   Add" in text) == rewritten and ("REFUSED" in text) != rewritten, text


def test_explain_on_the_tiny_unet_prints_the_pattern_one_node_a_line_and_no_wide_line(fixtures_dir, tmp_path, capsys):
    """The attention pattern spelled as one expression was a line of 136,611 characters: now each
    pattern node is one line (``%k = Op(...)``) and no line of the explanation passes 100 columns."""
    source = fixtures_dir / "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx"
    code = main(["optimize", "-i", str(source), "-o", str(tmp_path / "o.onnx"), "--passes", "fuse-attention",
                 "--explain", "fuse-attention", "--quiet"])
    text = capsys.readouterr().out
    assert code == 0
    assert "pattern attention:" in text and "%1 = MatMul(" in text and "candidates (root op" in text, text[:2000]
    assert max(len(line) for line in text.splitlines()) <= 100


def test_an_auto_inserted_pass_can_be_explained_by_name(fixtures_dir, tmp_path, capsys):
    """canonicalize-attention runs only because fuse-attention requires it: --explain names it, and
    its candidates are traced like a listed pass's."""
    source = fixtures_dir / "unet-sd15.tiny.dynamo.static.sdpa.onnx"
    code = main(["optimize", "-i", str(source), "-o", str(tmp_path / "o.onnx"), "--passes", "fuse-attention",
                 "--explain", "canonicalize-attention", "--quiet"])
    text = capsys.readouterr().out
    assert code == 0
    assert text.startswith("canonicalize-attention (for fuse-attention): "), text[:500]
    assert "pattern " in text and "candidates (root op" in text, text[:2000]


def test_a_pass_not_built_on_rules_says_what_it_did():
    """fold-constants traces no pattern: --explain prints whether it changed the graph, its node
    counts and details, not a bare header."""
    _, report = optimize(group_norm_model(), ["fold-constants"], explain={"fold-constants"})
    (header, *body) = report.explain({"fold-constants"}).splitlines()
    assert header.startswith("fold-constants: ") and body, report.explain()
    assert "nodes" in body[0] and ("modified the graph" in body[0] or "left the graph as it was" in body[0])


def test_tracing_comes_from_the_pass_manager_not_from_a_global():
    """The same pass object traces in the run that names it and not in the next one."""
    from onnxopt import registry
    from onnxopt.manager import PassManager
    from onnxopt.loading import load_model

    fusion = registry.get_pass("fuse-group-norm")()
    traced = PassManager([fusion], explain={"fuse-group-norm"}).run(load_model(group_norm_model()))
    plain = PassManager([fusion]).run(load_model(group_norm_model()))
    (traced_step,) = [p for p in traced.passes if p.name == "fuse-group-norm"]
    (plain_step,) = [p for p in plain.passes if p.name == "fuse-group-norm"]
    assert traced_step.result.trace is not None and plain_step.result.trace is None
    import onnxopt.fusion

    assert not hasattr(onnxopt.fusion, "explaining")
