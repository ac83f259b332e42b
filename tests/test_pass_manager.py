"""Pass manager: requirements, reporting, verification that names the first broken pass, plugins."""

import json
from importlib import metadata

import numpy as np
import pytest

from onnxopt import PassManager, available_passes, load_model, optimize, registry
from onnxopt.errors import PassNotApplicableError, UnknownPassError
from onnxopt.pass_infra import Pass, PassResult
from tests.graphs import linear_model
from tests.plugin_passes import AddToSub, NeedsB, NeverMatches, ProvidesA, ProvidesB


PLUGINS = (AddToSub, NeverMatches, ProvidesA, ProvidesB, NeedsB)


@pytest.fixture
def plugins(monkeypatch):
    """Register the test passes through a fake installed distribution's entry points."""
    real = metadata.entry_points
    eps = [
        metadata.EntryPoint(name=cls.name, value=f"tests.plugin_passes:{cls.__name__}", group=registry.ENTRY_POINT_GROUP)
        for cls in PLUGINS
    ]

    def entry_points(**kwargs):
        if kwargs.get("group") == registry.ENTRY_POINT_GROUP:
            return eps
        return real(**kwargs)

    monkeypatch.setattr(registry.metadata, "entry_points", entry_points)
    monkeypatch.setattr(registry, "_loaded", False)
    yield
    for cls in PLUGINS:
        registry._PASSES.pop(cls.name, None)


def test_every_builtin_pass_describes_itself():
    for name, cls in available_passes().items():
        assert cls.name == name and cls.description and cls.targets


def test_entry_point_plugins_are_discovered(plugins):
    assert {"test-add-to-sub", "test-fuse-nothing"} <= set(available_passes())


def test_missing_requirement_is_established_first():
    model = load_model(linear_model()[0])
    report = PassManager(["remove-redundant-casts"]).run(model)
    assert [(p.name, p.auto) for p in report.passes] == [
        ("infer-shapes", "remove-redundant-casts"),
        ("remove-redundant-casts", None),
    ]


def test_report_counts_and_json():
    model, report = optimize(linear_model()[0], ["cleanup"])
    identity = next(p for p in report.passes if p.name == "remove-identity")
    assert (identity.result.sites_matched, identity.result.sites_rewritten) == (1, 1)
    assert (identity.nodes_before, identity.nodes_after) == (3, 2)
    data = json.loads(report.to_json())
    assert data["nodes_before"] == 3 and data["nodes_after"] == 2
    assert {"pass", "sites_matched", "sites_rewritten", "nodes_before", "nodes_after", "seconds"} <= set(data["passes"][0])
    assert "remove-identity" in report.table()


class _Holds64MB(Pass):
    """Keeps 64 MB of touched memory alive on the model: its row must show it."""

    name = "test-holds-64mb"
    description = "allocates 64 MB and keeps it"

    def run(self, model):
        model.held = np.ones(64 << 20, dtype=np.uint8)
        return PassResult(modified=False)


def test_report_rows_show_resident_memory_after_each_pass():
    model = load_model(linear_model()[0])
    report = PassManager(["remove-identity", _Holds64MB()]).run(model)
    identity, holder = report.passes
    assert holder.memory.rss_bytes - identity.memory.rss_bytes >= 60 << 20
    assert holder.memory.peak_bytes >= holder.memory.rss_bytes >= 60 << 20
    assert report.memory_before.peak_bytes <= identity.memory.peak_bytes <= holder.memory.peak_bytes
    data = json.loads(report.to_json())
    assert data["passes"][1]["peak_rss_mb"] == round(holder.memory.peak_bytes / 1e6, 1)
    assert "peak MB" in report.table().splitlines()[0]


def test_verify_names_the_first_broken_pass(plugins):
    model, report = optimize(linear_model()[0], ["remove-identity", "test-add-to-sub", "cleanup"], verify=True)
    assert report.first_broken_pass == "test-add-to-sub"
    assert report.passes[0].verification.ok
    assert not report.passes[-1].verification.ok
    assert report.passes[-1].name == "test-add-to-sub"  # the run stops at the broken pass


def test_verify_passes_for_correct_passes():
    _, report = optimize(linear_model()[0], ["cleanup"], verify=True)
    assert report.first_broken_pass is None and report.final_verification.ok


def test_nothing_to_fuse_is_a_note_or_with_strict_an_error(plugins):
    _, report = optimize(linear_model()[0], ["test-fuse-nothing"])
    assert any("nothing to fuse" in n for n in report.notes)
    with pytest.raises(PassNotApplicableError, match="nothing to fuse"):
        optimize(linear_model()[0], ["test-fuse-nothing"], strict=True)


def test_unknown_pass_suggests_a_name():
    with pytest.raises(UnknownPassError, match="did you mean 'fold-constants'"):
        optimize(linear_model()[0], ["fold-constant"])


def test_preset_fusions_that_do_not_apply_are_not_errors(plugins, monkeypatch):
    """--strict is about passes the user named: a preset's fusion that finds nothing is normal."""
    monkeypatch.setitem(registry.PRESETS, "test-preset", registry.Preset("test-preset", "test", ("test-fuse-nothing",)))
    _, report = optimize(linear_model()[0], ["test-preset"], strict=True)
    assert report.notes == []


def test_requirements_of_auto_inserted_passes_come_first(plugins):
    model = load_model(linear_model()[0])
    report = PassManager(["test-needs-b"]).run(model)
    assert [(p.name, p.auto) for p in report.passes] == [
        ("test-provides-a", "test-provides-b"),
        ("test-provides-b", "test-needs-b"),
        ("test-needs-b", None),
    ]
