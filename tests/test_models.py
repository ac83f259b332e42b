"""Tests of ``models/``: the committed fixtures (onnx + onnxruntime only) and the
builders/exporters (``@pytest.mark.models``: torch, diffusers, transformers).

Run the quick part only: ``pytest tests/test_models.py -m "not models"``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import models  # noqa: E402  (does not import torch)
from models.feeds import feeds_from_manifest, make_feeds, resolve_shape  # noqa: E402

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

FIXTURES_DIR = models.FIXTURES_DIR
MANIFEST = json.loads(models.MANIFEST.read_text()) if models.MANIFEST.exists() else {"fixtures": []}
ENTRIES = MANIFEST["fixtures"]
IDS = [e["file"] for e in ENTRIES]

ATOL = RTOL = 1e-4


# ----------------------------------------------------------------------------------------------
# Committed fixtures: no torch needed
# ----------------------------------------------------------------------------------------------

def _session(path: Path):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _shape_matches(declared, actual, known: dict) -> bool:
    if len(declared) != len(actual):
        return False
    for d, a in zip(declared, actual):
        if isinstance(d, int) and d != a:
            return False
        if isinstance(d, str):
            # the same symbol must take one value across inputs and outputs
            if known.setdefault(d, a) != a:
                return False
    return True


def test_manifest_present_and_small():
    assert models.MANIFEST.exists(), "run `python -m models fixtures`"
    assert len(ENTRIES) >= 10
    total = sum(f.stat().st_size for f in FIXTURES_DIR.iterdir() if f.is_file())
    assert total < 10e6, f"fixtures take {total / 1e6:.1f} MB"
    for key in ("torch", "diffusers", "transformers", "onnx"):
        assert MANIFEST["versions"].get(key)
    # every file in the directory is in the manifest, and the other way round
    listed = {e["file"] for e in ENTRIES} | {d for e in ENTRIES for d in e["data_files"]} | {"manifest.json"}
    present = {f.name for f in FIXTURES_DIR.iterdir() if f.is_file()}
    assert listed == present


def test_manifest_covers_the_matrix():
    combos = {(e["family"], e["exporter"], e["shapes"], e["attention"]) for e in ENTRIES}
    for c in [("unet-sd15", x, s, "sdpa") for x in ("torchscript", "dynamo") for s in ("static", "dynamic")] + [
        ("unet-sd15", "torchscript", "dynamic", "classic"),
        ("vae-decoder", "torchscript", "dynamic", "sdpa"),
        ("vae-decoder", "dynamo", "static", "sdpa"),
        ("clip-text", "torchscript", "dynamic", "sdpa"),
        ("clip-text", "dynamo", "dynamic", "sdpa"),
        ("controlnet", "torchscript", "dynamic", "sdpa"),
    ]:
        assert c in combos, c
    ext = [e for e in ENTRIES if e["data_files"]]
    assert len(ext) == 1 and ext[0]["exporter"] == "dynamo"


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_fixture_loads_and_matches_manifest(entry):
    check_fixture_file(entry, FIXTURES_DIR)


def check_fixture_file(entry: dict, folder: Path) -> None:
    """The fixture's files have the manifest's digests, pass the checker and declare its I/O and opsets."""
    path = folder / entry["file"]
    import hashlib

    for name, digest in entry["sha256"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
    model = onnx.load(str(path))  # loads external data too
    onnx.checker.check_model(model)
    if entry["external_data"]:
        raw = onnx.load(str(path), load_external_data=False)
        locs = {kv.value for t in raw.graph.initializer for kv in t.external_data if kv.key == "location"}
        assert locs == set(entry["data_files"])
    else:
        assert not any(t.external_data for t in model.graph.initializer)

    def io(values):
        out = []
        for v in values:
            tt = v.type.tensor_type
            shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tt.shape.dim]
            out.append((v.name, shape, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name))
        return out

    assert io(model.graph.input) == [(i["name"], i["shape"], i["dtype"]) for i in entry["inputs"]]
    assert io(model.graph.output) == [(o["name"], o["shape"], o["dtype"]) for o in entry["outputs"]]
    opset = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    assert opset == entry["opset"]
    if entry["exporter"] == "torchscript":
        assert opset["ai.onnx"] == 17
    if entry.get("export_opset"):
        assert opset["ai.onnx"] == entry["export_opset"]
    if entry["shapes"] == "static":
        assert all(isinstance(d, int) for i in entry["inputs"] for d in i["shape"])
    else:
        assert any(isinstance(d, str) for i in entry["inputs"] for d in i["shape"])


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_fixture_runs_on_ort_and_matches_reference(entry):
    check_fixture_outputs(entry, FIXTURES_DIR)


def check_fixture_outputs(entry: dict, folder: Path) -> None:
    """ONNX Runtime CPU on the manifest's feeds gives the manifest's torch reference (example and alt dims)."""
    sess = _session(folder / entry["file"])
    assert [i.name for i in sess.get_inputs()] == [i["name"] for i in entry["inputs"]]
    assert [o.name for o in sess.get_outputs()] == [o["name"] for o in entry["outputs"]]
    for which in ("example", "alt") if entry["shapes"] == "dynamic" else ("example",):
        feeds = feeds_from_manifest(entry, which)
        known: dict = {}
        for i in entry["inputs"]:
            assert _shape_matches(i["shape"], list(feeds[i["name"]].shape), known), i
        outs = sess.run(None, feeds)
        ref = entry["reference"][which]
        for o, got in zip(entry["outputs"], outs):
            r = ref[o["name"]]
            assert list(got.shape) == r["shape"], (which, o["name"])
            assert np.isfinite(got).all()
            flat = got.reshape(-1).astype(np.float64)
            probe = np.array(r["probe_value"])
            np.testing.assert_allclose(flat[r["probe_index"]], probe, atol=ATOL, rtol=RTOL,
                                       err_msg=f"{which} {o['name']}")
            assert abs(flat.mean() - r["mean"]) <= ATOL + RTOL * abs(r["mean"]), (which, o["name"])
            assert abs(flat.std() - r["std"]) <= ATOL + RTOL * r["std"], (which, o["name"])
            assert abs(np.abs(flat).max() - r["abs_max"]) <= ATOL + RTOL * r["abs_max"], (which, o["name"])
            if entry["shapes"] == "static" or all(isinstance(d, str) and d.isidentifier() or isinstance(d, int)
                                                  for d in o["shape"]):
                # named output dims must agree with the input dims of the same name
                assert _shape_matches(o["shape"], list(got.shape), known), (which, o["name"], o["shape"])


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_fixture_sites_and_ops_agree(entry):
    """The graph holds the sites the manifest counts from the torch module."""
    s, ops = entry["sites"], entry["ops"]
    assert ops.get("Softmax", 0) == s["attention"]
    assert ops.get("Conv", 0) == s["conv2d"]
    assert ops.get("InstanceNormalization", 0) == s["group_norm"]  # GroupNorm is exported this way
    assert ops.get("LayerNormalization", 0) == s["layer_norm"]
    assert ops.get("Resize", 0) == s["upsample"]
    if entry["exporter"] == "dynamo":
        assert ops.get("Gelu", 0) == s["geglu"] + s["gelu"]
        assert ops.get("Constant", 0) == 0  # constants are initializers in dynamo graphs
    else:
        assert ops.get("Erf", 0) == s["geglu"] + s["gelu"]
    if entry["shapes"] == "static" and entry["exporter"] == "dynamo":
        assert ops.get("Shape", 0) == 0


def test_feeds_are_deterministic():
    specs = [dict(name="sample", shape=[2, 4, 8, 6], dtype="float32", kind="latent"),
             dict(name="timestep", shape=[2], dtype="float32", kind="timestep"),
             dict(name="time_ids", shape=[2, 6], dtype="float32", kind="time_ids"),
             dict(name="input_ids", shape=[2, 10], dtype="int64", kind="input_ids")]
    a, b = make_feeds(specs, 0, vocab=100), make_feeds(specs, 0, vocab=100)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(make_feeds(specs, 1, vocab=100)["sample"], a["sample"])
    assert a["input_ids"].dtype == np.int64 and a["input_ids"].max() == 99
    assert list(a["time_ids"][0]) == [64, 48, 0, 0, 64, 48]
    assert resolve_shape(["batch", 3, "8*height"], {"batch": 2, "height": 5}) == [2, 3, 40]


# ----------------------------------------------------------------------------------------------
# Builders and exporters: need torch, diffusers, transformers (and onnxscript for dynamo)
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_stack():
    torch = pytest.importorskip("torch", reason="models tests need torch")
    pytest.importorskip("diffusers", reason="models tests need diffusers")
    pytest.importorskip("transformers", reason="models tests need transformers")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    return torch


# Sites counted from the torch modules of the tiny builds (the later fusion tests rely on them).
TINY_SITES = {
    "unet-sd15": dict(attention=8, attention_self=4, attention_cross=4, group_norm=21, layer_norm=12, geglu=4,
                      gelu=0, quick_gelu=0, conv2d=33, linear=50, transformer_block=4, resnet=8, upsample=1,
                      downsample=1),
    "unet-sd21": dict(attention=8, attention_self=4, attention_cross=4, group_norm=21, layer_norm=12, geglu=4,
                      gelu=0, quick_gelu=0, conv2d=25, linear=58, transformer_block=4, resnet=8, upsample=1,
                      downsample=1),
    "unet-sdxl": dict(attention=36, attention_self=18, attention_cross=18, group_norm=30, layer_norm=54,
                      geglu=18, gelu=0, quick_gelu=0, conv2d=35, linear=209, transformer_block=18, resnet=11,
                      upsample=2, downsample=2),
    "vae-encoder": dict(attention=1, attention_self=1, attention_cross=0, group_norm=10, layer_norm=0, geglu=0,
                        gelu=0, quick_gelu=0, conv2d=13, linear=4, transformer_block=0, resnet=4, upsample=0,
                        downsample=1),
    "vae-decoder": dict(attention=1, attention_self=1, attention_cross=0, group_norm=14, layer_norm=0, geglu=0,
                        gelu=0, quick_gelu=0, conv2d=17, linear=4, transformer_block=0, resnet=6, upsample=1,
                        downsample=0),
    "clip-text": dict(attention=2, attention_self=2, attention_cross=0, group_norm=0, layer_norm=5, geglu=0,
                      gelu=0, quick_gelu=2, conv2d=0, linear=12, transformer_block=2, resnet=0, upsample=0,
                      downsample=0),
    "openclip-text": dict(attention=2, attention_self=2, attention_cross=0, group_norm=0, layer_norm=5, geglu=0,
                          gelu=2, quick_gelu=0, conv2d=0, linear=13, transformer_block=2, resnet=0, upsample=0,
                          downsample=0),
    "controlnet": dict(attention=4, attention_self=2, attention_cross=2, group_norm=10, layer_norm=6, geglu=2,
                       gelu=0, quick_gelu=0, conv2d=28, linear=26, transformer_block=2, resnet=4, upsample=0,
                       downsample=1),
}

# (family, exporter, shapes, attention): every family through TorchScript (fast), the
# dynamo exporter on a few (it takes 5-40 s per tiny model on 2 cores).
EXPORT_CASES = [(f, "torchscript", "dynamic", "sdpa") for f in models.FAMILIES] + [
    ("unet-sd21", "torchscript", "dynamic", "classic"),
    ("vae-decoder", "torchscript", "static", "classic"),
    ("clip-text", "torchscript", "static", "classic"),
    ("clip-text", "dynamo", "dynamic", "sdpa"),
    ("openclip-text", "dynamo", "static", "classic"),
    ("vae-encoder", "dynamo", "dynamic", "sdpa"),
    ("unet-sd21", "dynamo", "static", "sdpa"),
]


@pytest.mark.models
@pytest.mark.parametrize("family", models.FAMILIES)
def test_tiny_sites(torch_stack, family):
    bm = models.build(family, "tiny")
    # the diffusion-transformer site keys are 0 in these families
    assert bm.sites == {**dict.fromkeys(models.SITE_KEYS, 0), **TINY_SITES[family]}
    assert list(bm.sites) == list(models.SITE_KEYS)
    # classic attention changes processors, not modules
    assert models.build(family, "tiny", "classic").sites == bm.sites


@pytest.mark.models
@pytest.mark.parametrize("family", models.FAMILIES)
def test_tiny_build_is_seeded_and_well_scaled(torch_stack, family):
    check_seeded_and_well_scaled(torch_stack, family, other_seed=family in ("clip-text", "vae-decoder"))


def check_seeded_and_well_scaled(torch, family: str, other_seed: bool) -> None:
    """Same seed, same weights; no constant parameter; finite, well-scaled outputs at both dims;
    ``other_seed``: another seed gives other weights."""
    a, b = models.build(family, "tiny", seed=3), models.build(family, "tiny", seed=3)
    sa, sb = a.module.state_dict(), b.module.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    # no parameter is left constant (norm weights of 1, zero biases, zero convs)
    for name, p in a.module.named_parameters():
        if p.numel() > 1:
            assert not torch.all(p == p.reshape(-1)[0]), name
    if other_seed:  # cheap ones: another seed, other weights
        c = models.build(family, "tiny", seed=4)
        assert any(not torch.equal(sa[k], v) for k, v in c.module.state_dict().items() if k in sa)
    with torch.no_grad():
        outs = a.module(*a.example_inputs)
        outs_alt = a.module(*a.make_inputs(a.alt_dims))
    assert len(outs) == len(a.output_names)
    for o in list(outs) + list(outs_alt):
        assert torch.isfinite(o).all()
        assert 1e-3 < o.abs().max() < 100
        assert o.std() > 1e-3


@pytest.mark.models
@pytest.mark.parametrize("case", EXPORT_CASES, ids=["-".join(c) for c in EXPORT_CASES])
def test_tiny_export_matches_torch(torch_stack, tmp_path, case):
    from models.export import check_export, describe_io, export, op_counts

    family, exporter, shapes, attention = case
    if exporter == "dynamo":
        pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    bm = models.build(family, "tiny", attention)
    path = tmp_path / "model.onnx"
    res = export(bm, path, exporter, shapes)
    assert res.files[0] == str(path)
    if exporter == "dynamo":
        assert (tmp_path / "model.onnx.data").exists()  # dynamo always writes external data
    c = check_export(bm, path)
    assert c.ok, c
    io = describe_io(path)
    static = all(isinstance(d, int) for i in io["inputs"] for d in i["shape"])
    assert static == (shapes == "static")
    if shapes == "dynamic":
        c2 = check_export(bm, path, dims=bm.alt_dims)
        assert c2.ok, c2
        assert {d for i in io["inputs"] for d in i["shape"] if isinstance(d, str)} <= {
            "batch", "height", "width", "sequence", "image_height", "image_width"}
    ops = op_counts(path)
    assert ops.get("Softmax", 0) == bm.sites["attention"]
    assert ops.get("Conv", 0) == bm.sites["conv2d"]
    assert ops.get("LayerNormalization", 0) == bm.sites["layer_norm"]


@pytest.mark.models
def test_cli_build_and_inline(torch_stack, tmp_path):
    from models.__main__ import main

    out = tmp_path / "clip.onnx"
    assert main(["build", "clip-text", "--exporter", "torchscript", "--shapes", "static",
                 "--attention", "classic", "--batch", "3", "-o", str(out)]) == 0
    m = onnx.load(str(out))
    assert [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim] == [3, 77]


@pytest.mark.models
def test_inline_external_data(torch_stack, tmp_path):
    from models.export import check_export, export, inline_external_data

    bm = models.build("openclip-text", "tiny")
    path = tmp_path / "m.onnx"
    export(bm, path, "dynamo", "static")
    assert (tmp_path / "m.onnx.data").exists()
    inline_external_data(path)
    assert not (tmp_path / "m.onnx.data").exists()
    assert check_export(bm, path).ok


@pytest.mark.models
def test_committed_fixture_is_reproducible(torch_stack, tmp_path):
    """Regenerating a TorchScript fixture with the versions that made them gives the same file."""
    import torch

    from models.make_fixtures import FIXTURES, make_fixture

    v = MANIFEST.get("versions", {})
    import diffusers
    import transformers

    if (v.get("torch"), v.get("diffusers"), v.get("transformers"), v.get("onnx")) != (
            torch.__version__, diffusers.__version__, transformers.__version__, onnx.__version__):
        pytest.skip("fixtures were made with other versions")
    spec = next(s for s in FIXTURES if s.family == "clip-text" and s.exporter == "torchscript")
    entry = make_fixture(spec, tmp_path, verbose=False)
    committed = next(e for e in ENTRIES if e["file"] == spec.name)
    assert entry["sha256"] == committed["sha256"]  # file bytes: exact
    assert_reference_close(entry["reference"], committed["reference"])


# The reference statistics are torch's fp32 CPU output on one machine. Its reductions (matmul,
# conv, norms) are ordered by the CPU's vector width and the thread count, so another CPU gives
# the same numbers up to rounding: each fp32 op rounds with relative error <= 6e-8, and a tiny
# model's ~100 ops in sequence keep the drift near 1e-6 of the output's scale (seen: 2e-7 on an
# AMD EPYC). 1e-5 of the output's largest magnitude sits well above that and far below any real
# change of the model (a changed weight or op moves them by percents).
REFERENCE_RTOL = 1e-5


def assert_reference_close(regenerated: dict, committed: dict) -> None:
    """Shapes and probe positions exactly; float statistics within REFERENCE_RTOL of the scale."""
    assert regenerated.keys() == committed.keys()
    for which, outputs in committed.items():
        assert regenerated[which].keys() == outputs.keys(), which
        for name, want in outputs.items():
            got = regenerated[which][name]
            assert got["shape"] == want["shape"] and got["probe_index"] == want["probe_index"], (which, name)
            scale = max(abs(want["abs_max"]), 1e-30)
            for key in ("mean", "std", "abs_max"):
                assert abs(got[key] - want[key]) <= REFERENCE_RTOL * scale, (which, name, key, got[key], want[key])
            np.testing.assert_allclose(got["probe_value"], want["probe_value"], rtol=0, atol=REFERENCE_RTOL * scale,
                                       err_msg=f"{which} {name}")


def test_reference_comparison_tolerates_rounding_but_not_changes():
    """The comparison above accepts the drift seen across CPUs and refuses a real change."""
    committed = ENTRIES[0]["reference"]
    name = next(iter(committed["example"]))
    drifted = json.loads(json.dumps(committed))
    drifted["example"][name]["mean"] *= 1 + 1e-6  # the AMD EPYC drift, and more
    drifted["example"][name]["probe_value"][0] += 1e-7
    assert_reference_close(drifted, committed)
    changed = json.loads(json.dumps(committed))
    changed["example"][name]["probe_value"][3] *= 1.01
    with pytest.raises(AssertionError):
        assert_reference_close(changed, committed)
