"""Claim: the presets write the same graphs as when the pins were made (tests/pinned_graphs.json).

For each committed fixture and each tiny family x export variant, under ``ort-cuda``,
``ort-cuda,fp16`` and ``tensorrt``, the optimized graph's op multiset, name-independent
connectivity and weights (see :mod:`tests.graph_pins`) equal the pinned ones. A refactoring of the
passes must keep them; a change of behaviour regenerates the pins on purpose
(``PYTHONPATH=$PWD python3 -m tests.graph_pins``) and says why in its commit. Every property a
pass claims is checked after it on the way (onnxopt.properties).

Cost: the default run pins every fixture (no export) and the two exports the fusion tests make
anyway that no fixture covers (the classic attention processor), about 20 s on a 2-core machine.
The full matrix (8 families x 10 export variants x 3 presets, 80 exports) is marked ``slow`` and
runs only with ``ONNXOPT_PINS=all`` (``ONNXOPT_PINS=all python3 -m pytest -q tests/test_pinned_graphs.py``):
CI runs the slow tests too, and the opset variants alone would add minutes of exports to it.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import FIXTURES
from tests.graph_pins import PRESETS, export_args, export_cases, fixture_cases, load_pins, optimized_fingerprint, versions

PINS = load_pins()
# Exports the default run of the fusion tests makes anyway, of variants no fixture has.
DEFAULT_EXPORTS = {"export:clip-text.torchscript.dynamic.classic", "export:vae-decoder.dynamo.dynamic.classic"}
FULL = os.environ.get("ONNXOPT_PINS") == "all"
EXPORT_VERSIONS = ("torch", "onnx", "onnxscript", "diffusers", "transformers")


def _params():
    params = []
    for case in fixture_cases() + export_cases():
        for preset in PRESETS:
            marks = []
            if case.startswith("export:"):
                marks.append(pytest.mark.models)
                if case not in DEFAULT_EXPORTS:
                    marks += [pytest.mark.slow,
                              pytest.mark.skipif(not FULL, reason="the full pin matrix runs with ONNXOPT_PINS=all")]
            params.append(pytest.param(case, preset, marks=marks, id=f"{case.replace(':', '-')}-{preset}"))
    return params


def test_every_case_is_pinned():
    missing = [f"{case}|{preset}" for case in fixture_cases() + export_cases() for preset in PRESETS
               if f"{case}|{preset}" not in PINS["pins"]]
    assert not missing, f"not pinned (run python3 -m tests.graph_pins): {missing[:5]}"


@pytest.mark.parametrize("case, preset", _params())
def test_the_optimized_graph_is_the_pinned_one(export_tiny, case, preset):
    expected = PINS["pins"][f"{case}|{preset}"]
    if case.startswith("fixture:"):
        path = FIXTURES / case.removeprefix("fixture:")
    else:
        now, then = versions(), PINS["versions"]
        changed = [f"{name} {then.get(name)} -> {now[name]}" for name in EXPORT_VERSIONS if now[name] != then.get(name)]
        if changed:
            pytest.skip(f"exports change with {', '.join(changed)}: regenerate the pins (python3 -m tests.graph_pins)")
        family, exporter, shapes, attention, opset = export_args(case)
        path = export_tiny(family, exporter, shapes, attention, opset=opset).path
    actual = optimized_fingerprint(path, preset, check_properties=True)  # the claims passes make hold, too
    differs = {key: (expected.get(key), actual.get(key)) for key in expected.keys() | actual.keys()
               if expected.get(key) != actual.get(key)}
    if "ops" in differs:
        before, after = differs["ops"]
        before, after = before or {}, after or {}
        differs["ops"] = {op: (before.get(op, 0), after.get(op, 0)) for op in before.keys() | after.keys()
                          if before.get(op, 0) != after.get(op, 0)}
    assert not differs, f"{case} under {preset} differs from its pin (pinned, now): {differs}"
