"""Tests of the diffusion-transformer builders (``models/dit.py``: SD3 / SD3.5 / Flux.1; ``models/t5.py``;
the 16-channel VAE in ``models/vae.py``), their committed fixtures (``models/fixtures/dit``) and the
full-size export path (``models/bigexport.py``, exercised on tiny configs).

Claims:

* The tiny builds have exactly the sites listed in TINY_SITES (fusion tests assert these counts),
  and the exported graphs hold them: one Softmax per attention (an ``Attention`` op at opset 23),
  one ``LayerNormalization`` per nn.LayerNorm, one Tanh per tanh-GELU (TorchScript) / ``Gelu``
  (dynamo), one ``RMSNormalization`` per torch.nn.RMSNorm at opset 23.
* TorchScript exports of every family (dynamic) match torch at the example and the alt dims; the
  dynamo exports (default opset and 23) are proven by the committed fixtures (a tiny MMDiT takes
  1-2 minutes to export with dynamo on 2 cores: too slow for CI).
* Flux needs the TorchScript patches: without the written-out RMSNorm the exporter refuses
  ``aten::rms_norm``; without the strided rotary split the dynamic export fails at other dims.
  The patches compute what diffusers computes, and are undone after the export.
* ``python -m models export`` writes a checked folder atomically, merges per-tensor external data
  into one file, and leaves nothing behind on failure.
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

import models  # noqa: E402
from models.feeds import make_feeds, resolve_shape  # noqa: E402
from tests.test_models import check_fixture_file, check_fixture_outputs, check_seeded_and_well_scaled  # noqa: E402

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

DIT_MANIFEST = json.loads(models.DIT_MANIFEST.read_text()) if models.DIT_MANIFEST.exists() else {"fixtures": []}
ENTRIES = DIT_MANIFEST["fixtures"]
IDS = [e["file"] for e in ENTRIES]

# Sites of the tiny builds (zero keys left out). Joint attentions count as self-attention too.
TINY_SITES = {
    # block 0 joint; block 1 joint, context_pre_only (text stream: AdaLayerNormContinuous, no ff_context)
    "sd3-medium": dict(attention=2, attention_self=2, attention_joint=2, layer_norm=8, conv2d=1, linear=32,
                       transformer_block=2, gelu_tanh=3, ada_layer_norm=5, modulation=8),
    # block 0 dual (joint + image-only attn2, SD35AdaLayerNormZeroX: 2 modulations); QK RMSNorm on all
    "sd35-medium": dict(attention=4, attention_self=4, attention_joint=3, layer_norm=12, conv2d=1, linear=50,
                        transformer_block=3, rms_norm=14, gelu_tanh=5, ada_layer_norm=7, modulation=13),
    "sd35-large": dict(attention=2, attention_self=2, attention_joint=2, layer_norm=8, conv2d=1, linear=32,
                       transformer_block=2, rms_norm=8, gelu_tanh=3, ada_layer_norm=5, modulation=8),
    # 2 double (joint) + 2 single-stream blocks; rotary on Q and K of all 4 attentions
    "flux-dev": dict(attention=4, attention_self=4, attention_joint=2, layer_norm=11, linear=50, transformer_block=4,
                     rms_norm=12, gelu_tanh=6, ada_layer_norm=7, modulation=11, rotary=8),
    "flux-schnell": dict(attention=4, attention_self=4, attention_joint=2, layer_norm=11, linear=48,
                         transformer_block=4, rms_norm=12, gelu_tanh=6, ada_layer_norm=7, modulation=11, rotary=8),
    # 2 layers: 2 x (attention + ff) RMSNorms + the final one
    "t5-xxl": dict(attention=2, attention_self=2, linear=14, transformer_block=2, rms_norm=5, gelu_tanh=2,
                   gated_gelu=2),
    "vae16-encoder": dict(attention=1, attention_self=1, group_norm=10, conv2d=12, linear=4, resnet=4, downsample=1),
    "vae16-decoder": dict(attention=1, attention_self=1, group_norm=14, conv2d=16, linear=4, resnet=6, upsample=1),
}

# Full-size configs: the published numbers (the builders write them by hand).
FULL_CONFIGS = {
    "sd3-medium": dict(num_layers=24, num_attention_heads=24, attention_head_dim=64, caption_projection_dim=1536,
                       pos_embed_max_size=192),
    "sd35-medium": dict(num_layers=24, num_attention_heads=24, caption_projection_dim=1536, pos_embed_max_size=384,
                        dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
    "sd35-large": dict(num_layers=38, num_attention_heads=38, caption_projection_dim=2432, pos_embed_max_size=192,
                       qk_norm="rms_norm"),
    "flux-dev": dict(num_layers=19, num_single_layers=38, num_attention_heads=24, attention_head_dim=128,
                     guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
    "flux-schnell": dict(num_layers=19, num_single_layers=38, guidance_embeds=False),
}


@pytest.fixture(scope="module")
def torch_stack():
    torch = pytest.importorskip("torch", reason="models tests need torch")
    pytest.importorskip("diffusers", reason="models tests need diffusers")
    pytest.importorskip("transformers", reason="models tests need transformers")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    return torch


# ---------------------------------------------------------------- committed fixtures (no torch)


def test_dit_manifest_lists_every_file():
    assert models.DIT_MANIFEST.exists(), "run `python -m models fixtures --set dit`"
    listed = {e["file"] for e in ENTRIES} | {d for e in ENTRIES for d in e["data_files"]} | {"manifest.json"}
    present = {f.name for f in models.DIT_FIXTURES_DIR.iterdir() if f.is_file()}
    assert listed == present
    combos = {(e["family"], e["exporter"], e["shapes"], e.get("export_opset")) for e in ENTRIES}
    for c in [("sd35-medium", "torchscript", "dynamic", None), ("sd35-medium", "dynamo", "dynamic", None),
              ("flux-dev", "torchscript", "dynamic", None), ("flux-dev", "dynamo", "dynamic", None),
              ("flux-dev", "dynamo", "dynamic", 23), ("t5-xxl", "torchscript", "dynamic", None),
              ("t5-xxl", "dynamo", "dynamic", 23)]:
        assert c in combos, c
    for e in ENTRIES:
        assert e["bytes"] < 1.5e6, e["file"]


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_dit_fixture_loads_and_matches_manifest(entry):
    check_fixture_file(entry, models.DIT_FIXTURES_DIR)


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_dit_fixture_runs_on_ort_and_matches_reference(entry):
    check_fixture_outputs(entry, models.DIT_FIXTURES_DIR)


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_dit_fixture_sites_and_ops_agree(entry):
    s, ops = entry["sites"], entry["ops"]
    assert s == {**dict.fromkeys(models.SITE_KEYS, 0), **TINY_SITES[entry["family"]]}
    opset23 = (entry.get("export_opset") or 0) >= 23
    assert ops.get("Attention" if opset23 else "Softmax", 0) == s["attention"]
    assert ops.get("LayerNormalization", 0) == s["layer_norm"]
    # every RMSNorm (torch.nn.RMSNorm, diffusers' and T5's written-out ones) is one op at opset 23,
    # written out (Pow-ReduceMean-Add-Sqrt-...) before
    assert ops.get("RMSNormalization", 0) == (s["rms_norm"] if opset23 else 0)
    assert ops.get("RotaryEmbedding", 0) == 0  # diffusers' rotary stays elementwise at every opset
    if entry["exporter"] == "dynamo" and entry["family"] != "t5-xxl":
        assert ops.get("Gelu", 0) == s["gelu_tanh"]
    else:  # TorchScript writes the tanh GELU out; T5's gelu_new is written out in torch
        assert ops.get("Tanh", 0) == s["gelu_tanh"]


# ---------------------------------------------------------------- feeds (no torch)


def test_flux_feeds_follow_the_packed_latent_grid():
    dims = {"batch": 2, "height": 6, "width": 4, "sequence": 5}
    assert resolve_shape(["batch", "height*width/4", 64], dims) == [2, 6, 64]
    with pytest.raises(ValueError):
        resolve_shape(["height*width/4"], {"height": 3, "width": 3})
    specs = [dict(name="img_ids", shape=[6, 3], dtype="float32", kind="img_ids"),
             dict(name="txt_ids", shape=[5, 3], dtype="float32", kind="txt_ids"),
             dict(name="timestep", shape=[2], dtype="float32", kind="sigma"),
             dict(name="guidance", shape=[2], dtype="float32", kind="guidance")]
    feeds = make_feeds(specs, 0, dims=dims)
    # (0, row, column) of each 2x2 patch, row-major over the 3 x 2 patch grid
    np.testing.assert_array_equal(feeds["img_ids"], [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1]])
    assert not feeds["txt_ids"].any()
    np.testing.assert_allclose(feeds["timestep"], [1.0, 0.5])
    np.testing.assert_allclose(feeds["guidance"], [3.5, 5.0])
    with pytest.raises(ValueError):
        make_feeds(specs[:1], 0, dims={"height": 4, "width": 4})  # 4 positions for a 2x2 grid, not 6


# ---------------------------------------------------------------- builders


@pytest.mark.models
@pytest.mark.parametrize("family", models.DIT_FAMILIES)
def test_dit_tiny_sites(torch_stack, family):
    bm = models.build(family, "tiny")
    assert bm.sites == {**dict.fromkeys(models.SITE_KEYS, 0), **TINY_SITES[family]}
    assert list(bm.sites) == list(models.SITE_KEYS)


@pytest.mark.models
@pytest.mark.parametrize("family", ["flux-dev", "t5-xxl"])
def test_dit_tiny_build_is_seeded_and_well_scaled(torch_stack, family):
    check_seeded_and_well_scaled(torch_stack, family, other_seed=family == "t5-xxl")


@pytest.mark.models
def test_full_configs_are_the_published_ones(torch_stack):
    from models.dit import CONFIGS
    from models.t5 import CONFIGS as T5
    from models.vae import VAE16_CONFIGS, VAE16_FACTORS

    for family, want in FULL_CONFIGS.items():
        cfg = CONFIGS[(family, "full")]
        assert {k: cfg.get(k) for k in want} == want, family
    assert {k: T5["full"][k] for k in ("d_model", "d_ff", "num_layers", "num_heads", "d_kv", "feed_forward_proj")} == \
        dict(d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64, feed_forward_proj="gated-gelu")
    vae = VAE16_CONFIGS["full"]
    assert (vae["latent_channels"], vae["scaling_factor"], vae["shift_factor"]) == (16, 1.5305, 0.0609)
    assert VAE16_FACTORS["flux"] == (0.3611, 0.1159)
    # every tiny config keeps its family's structural switches
    for family in FULL_CONFIGS:
        full, tiny = CONFIGS[(family, "full")], CONFIGS[(family, "tiny")]
        for key in ("qk_norm", "guidance_embeds", "patch_size", "in_channels"):
            assert tiny.get(key) == full.get(key), (family, key)
        assert bool(tiny.get("dual_attention_layers")) == bool(full.get("dual_attention_layers")), family


@pytest.mark.models
def test_classic_attention_is_refused_for_the_mmdit(torch_stack):
    with pytest.raises(ValueError, match="sdpa"):
        models.build("flux-dev", "tiny", "classic")


# ---------------------------------------------------------------- exports


# every family once (static for two of them: a static export of each kind of model)
TORCHSCRIPT_CASES = [(f, "static" if f in ("sd35-large", "flux-schnell") else "dynamic") for f in models.DIT_FAMILIES]


@pytest.mark.models
@pytest.mark.parametrize("family, shapes", TORCHSCRIPT_CASES, ids=["-".join(c) for c in TORCHSCRIPT_CASES])
def test_dit_tiny_torchscript_export_matches_torch(torch_stack, tmp_path, family, shapes):
    from models.export import check_export, describe_io, export, op_counts

    bm = models.build(family, "tiny")
    path = tmp_path / "model.onnx"
    export(bm, path, "torchscript", shapes)
    for dims in (None, bm.alt_dims) if shapes == "dynamic" else (None,):
        c = check_export(bm, path, dims=dims)
        assert c.ok, c
    io = describe_io(path)
    symbols = {d for i in io["inputs"] for d in i["shape"] if isinstance(d, str)}
    assert symbols <= {"batch", "height", "width", "sequence", "image_height", "image_width", "image_sequence"}
    assert bool(symbols) == (shapes == "dynamic")
    ops = op_counts(path)
    assert ops.get("Softmax", 0) == bm.sites["attention"]
    assert ops.get("LayerNormalization", 0) == bm.sites["layer_norm"]
    assert ops.get("Tanh", 0) == bm.sites["gelu_tanh"]
    assert ops.get("ATen", 0) == 0


@pytest.mark.models
def test_flux_torchscript_needs_the_written_out_rms_norm(torch_stack, tmp_path):
    from models.export import export

    bm = models.build("flux-dev", "tiny")
    bm.export_patches = {}
    with pytest.raises(Exception, match="rms_norm"):
        export(bm, tmp_path / "model.onnx", "torchscript", "dynamic")


@pytest.mark.models
def test_flux_torchscript_needs_the_strided_rotary_split(torch_stack, tmp_path):
    """With RMSNorm written out but diffusers' rotary reshape, the dynamic export runs only at the example dims."""
    from models.dit import rms_norm_written_out
    from models.export import check_export, export

    bm = models.build("flux-dev", "tiny")
    model = bm.module.transformer
    bm.export_patches = {"torchscript": lambda: rms_norm_written_out(model)}
    path = tmp_path / "model.onnx"
    export(bm, path, "torchscript", "dynamic")
    assert check_export(bm, path).ok
    with pytest.raises(Exception, match="Reshape"):
        check_export(bm, path, dims=bm.alt_dims)


@pytest.mark.models
def test_flux_torchscript_patches_compute_what_diffusers_computes_and_are_undone(torch_stack):
    torch = torch_stack
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers import transformer_flux

    from models.dit import WrittenOutRMSNorm, flux_torchscript_patches, rotary_traceable

    norm = torch.nn.RMSNorm(12, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(12))
    x = torch.randn(2, 7, 3, 12)
    torch.testing.assert_close(WrittenOutRMSNorm(norm)(x), norm(x), rtol=1e-6, atol=1e-6)
    freqs = (torch.randn(7, 12), torch.randn(7, 12))
    torch.testing.assert_close(rotary_traceable(x, freqs, sequence_dim=1), apply_rotary_emb(x, freqs, sequence_dim=1))

    bm = models.build("flux-dev", "tiny")
    inputs = bm.example_inputs
    with torch.no_grad():
        want = bm.module(*inputs)[0]
        with bm.export_patches["torchscript"]():
            assert transformer_flux.apply_rotary_emb is rotary_traceable
            assert not any(isinstance(m, torch.nn.RMSNorm) for m in bm.module.modules())
            got = bm.module(*inputs)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert transformer_flux.apply_rotary_emb is apply_rotary_emb
    assert sum(isinstance(m, torch.nn.RMSNorm) for m in bm.module.modules()) == TINY_SITES["flux-dev"]["rms_norm"]


# ---------------------------------------------------------------- full-size export path (tiny configs)


@pytest.mark.models
def test_export_folder_cli_writes_a_checked_folder(torch_stack, tmp_path):
    from models.__main__ import main

    out = tmp_path / "flux"
    assert main(["export", "flux-dev", "--size", "tiny", "--exporter", "torchscript", "--check", "-o", str(out)]) == 0
    summary = json.loads((out / "export.json").read_text())
    assert summary["check"]["relative_l2"]["out_hidden_states"] < 1e-5
    assert summary["sites"]["rms_norm"] == TINY_SITES["flux-dev"]["rms_norm"]
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "model.onnx"]
    assert [p.name for p in tmp_path.iterdir()] == ["flux"]  # no partial folder left
    # an existing, non-empty folder is a usage error
    assert main(["export", "flux-dev", "--size", "tiny", "-o", str(out)]) == 2


@pytest.mark.models
def test_export_folder_failure_leaves_nothing(torch_stack, tmp_path):
    from models.bigexport import export_folder

    with pytest.raises(Exception):
        export_folder("t5-xxl", tmp_path / "t5", size="tiny", exporter="torchscript", opset=1, log=lambda *a: None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.models
def test_merge_external_data_makes_one_file(torch_stack, tmp_path):
    """What the TorchScript exporter writes past 2 GB (one file per tensor) becomes one data file."""
    from models.bigexport import merge_external_data
    from models.export import check_export, export

    bm = models.build("t5-xxl", "tiny")
    src = tmp_path / "src.onnx"
    export(bm, src, "torchscript", "dynamic")
    path = tmp_path / "out" / "model.onnx"
    path.parent.mkdir()
    onnx.save(onnx.load(str(src)), str(path), save_as_external_data=True, all_tensors_to_one_file=False,
              size_threshold=256)
    assert len(list(path.parent.iterdir())) > 5
    assert merge_external_data(path) > 5
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert check_export(bm, path).ok
    assert merge_external_data(path) == 0  # already one file


@pytest.mark.models
def test_dynamo_folder_export_optimizes_after_torch_as_the_exporter_does(torch_stack, tmp_path):
    """The streamed path (export unoptimized, drop torch, run the exporter's optimizer on the saved
    file) writes the graph ``export(optimize=True)`` writes, with one data file. A small, fast model."""
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    from models.bigexport import export_folder
    from models.export import check_export, export, op_counts

    out = tmp_path / "clip"
    summary = export_folder("clip-text", out, size="tiny", exporter="dynamo", check=True, log=lambda *a: None)
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "model.onnx", "model.onnx.data"]
    assert max(summary["check"]["relative_l2"].values()) < 1e-5
    bm = models.build("clip-text", "tiny")
    direct = tmp_path / "direct" / "model.onnx"
    export(bm, direct, "dynamo", "dynamic")
    assert op_counts(out / "model.onnx") == op_counts(direct)
    assert check_export(bm, out / "model.onnx", dims=bm.alt_dims).ok
