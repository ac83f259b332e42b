"""Regenerate the committed fixtures in ``models/fixtures/`` (``python -m models fixtures``).

Every fixture is a tiny model, exported, checked against torch on ONNX Runtime
CPU (example dims, and the alternative dims for dynamic exports), then
described in ``manifest.json``.  Dynamo exports are re-saved as single
self-contained .onnx files, except the one listed with ``external_data=True``,
which keeps its ``.onnx.data`` file so that loading external data is exercised.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import FIXTURES_DIR, build
from .export import check_export, describe_io, export, op_counts


@dataclass(frozen=True)
class FixtureSpec:
    family: str
    exporter: str
    shapes: str
    attention: str = "sdpa"
    size: str = "tiny"
    external_data: bool = False
    opset: int | None = None  # None: the exporter's default

    @property
    def name(self) -> str:
        opset = f".opset{self.opset}" if self.opset else ""
        return f"{self.family}.{self.size}.{self.exporter}.{self.shapes}.{self.attention}{opset}.onnx"


FIXTURES = (
    FixtureSpec("unet-sd15", "torchscript", "static"),
    FixtureSpec("unet-sd15", "torchscript", "dynamic"),
    FixtureSpec("unet-sd15", "dynamo", "static"),
    FixtureSpec("unet-sd15", "dynamo", "dynamic", external_data=True),
    FixtureSpec("unet-sd15", "torchscript", "dynamic", "classic"),
    FixtureSpec("vae-decoder", "torchscript", "dynamic"),
    FixtureSpec("vae-decoder", "dynamo", "static"),
    FixtureSpec("clip-text", "torchscript", "dynamic"),
    FixtureSpec("clip-text", "dynamo", "dynamic"),
    FixtureSpec("controlnet", "torchscript", "dynamic"),
)

# Diffusion transformers and their text encoder, in models/fixtures/dit/ with a manifest of their own
# (the SD-class fixture sets -- graph pins, the fp16 matrix -- iterate over the main one).
DIT_FIXTURES = (
    FixtureSpec("sd35-medium", "torchscript", "dynamic"),
    FixtureSpec("sd35-medium", "dynamo", "dynamic"),
    FixtureSpec("flux-dev", "torchscript", "dynamic"),
    FixtureSpec("flux-dev", "dynamo", "dynamic"),
    # RMSNormalization and Attention appear at opset 23 (the rotary embedding stays written out)
    FixtureSpec("flux-dev", "dynamo", "dynamic", opset=23),
    FixtureSpec("t5-xxl", "torchscript", "dynamic"),
    # T5 at opset 23: Attention with the relative-position bias as its mask, RMSNormalization
    FixtureSpec("t5-xxl", "dynamo", "dynamic", opset=23),
)

# fixture set -> (folder under models/fixtures, specs, manifest description)
FIXTURE_SETS = {
    "sd": ("", FIXTURES, "Tiny SD-class ONNX fixtures; regenerate with `python -m models fixtures`."),
    "dit": ("dit", DIT_FIXTURES, "Tiny diffusion-transformer (SD3.5, Flux.1) and T5 ONNX fixtures; regenerate "
                                 "with `python -m models fixtures --set dit`."),
}

# Op types worth tracking per fixture (exporter quirks; see README).
TRACKED_OPS = ("Shape", "Constant", "ConstantOfShape", "Cast", "MatMul", "Softmax",
               "InstanceNormalization", "Resize", "Conv", "Gelu", "Erf", "Split", "Slice",
               "Where", "IsNaN", "Trilu", "LayerNormalization")


def versions() -> dict:
    import numpy
    import onnx
    import onnxruntime
    import torch

    out = {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
           "numpy": numpy.__version__, "python": platform.python_version()}
    for mod in ("diffusers", "transformers", "onnxscript"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:  # pragma: no cover
            out[mod] = None
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


N_PROBES = 16


def probe_indices(n: int, k: int = N_PROBES) -> list[int]:
    """``k`` flat indices spread over ``n`` elements (deterministic)."""
    if n <= k:
        return list(range(n))
    return [int(round(i * (n - 1) / (k - 1))) for i in range(k)]


def reference_outputs(bm, dims) -> dict:
    """Torch outputs on the :mod:`models.feeds` inputs, summarised: shape, stats and probe values."""
    import numpy as np
    import torch

    with torch.no_grad():
        outs = bm.module(*bm.make_inputs(dims))
    ref = {}
    for name, t in zip(bm.output_names, outs):
        a = t.detach().numpy().astype(np.float64)
        flat = a.reshape(-1)
        idx = probe_indices(flat.size)
        ref[name] = {
            "shape": list(a.shape),
            "mean": float(flat.mean()),
            "std": float(flat.std()),
            "abs_max": float(np.abs(flat).max()),
            "probe_index": idx,
            "probe_value": [float(flat[i]) for i in idx],
        }
    return ref


# Node metadata the dynamo exporter writes for debugging.  Stack traces carry the
# absolute paths of the machine that exported (and are half of a tiny dynamo
# graph's bytes); fx_node and class_hierarchy repeat what ``namespace`` says.
# ``namespace`` and ``pkg.torch.onnx.name_scopes`` are kept.
STRIP_METADATA = ("pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node", "pkg.torch.onnx.class_hierarchy")


def strip_debug_metadata(model, keys=STRIP_METADATA) -> int:
    """Remove the listed ``metadata_props`` from every node (subgraphs and functions too)."""
    removed = 0

    def nodes(g):
        for n in g.node:
            yield n
            for a in n.attribute:
                if a.g is not None and len(a.g.node):
                    yield from nodes(a.g)
                for sg in a.graphs:
                    yield from nodes(sg)

    all_nodes = list(nodes(model.graph)) + [n for f in model.functions for n in f.node]
    for n in all_nodes:
        keep = [(p.key, p.value) for p in n.metadata_props if p.key not in keys]
        if len(keep) != len(n.metadata_props):
            removed += len(n.metadata_props) - len(keep)
            del n.metadata_props[:]
            for k, v in keep:
                n.metadata_props.add(key=k, value=v)
    return removed


def make_fixture(spec: FixtureSpec, out_dir: Path, verbose: bool = True) -> dict:
    bm = build(spec.family, spec.size, spec.attention)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp) / "model.onnx"
        res = export(bm, tmp_path, spec.exporter, spec.shapes, opset=spec.opset)
        check = check_export(bm, tmp_path)
        if not check.ok:
            raise RuntimeError(f"{spec.name}: export does not match torch: {check}")
        alt = None
        if spec.shapes == "dynamic":
            alt = check_export(bm, tmp_path, dims=bm.alt_dims)
            if not alt.ok:
                raise RuntimeError(f"{spec.name}: dynamic export fails at {bm.alt_dims}: {alt}")
        dst = out_dir / spec.name
        for old in (dst, dst.with_name(dst.name + ".data")):
            if old.exists():
                old.unlink()
        import onnx

        model = onnx.load(str(tmp_path), load_external_data=True)
        stripped = strip_debug_metadata(model)
        if spec.external_data:
            onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                      location=dst.name + ".data", size_threshold=1024)
        else:
            onnx.save(model, str(dst), save_as_external_data=False)
    files = [dst] + ([dst.with_name(dst.name + ".data")] if spec.external_data else [])
    for f in files:
        f.chmod(0o644)  # onnx writes external data files 0600
    # Re-check the file as committed.
    check2 = check_export(bm, dst)
    if not check2.ok:
        raise RuntimeError(f"{spec.name}: re-saved fixture does not match torch: {check2}")
    io = describe_io(dst)
    shapes_ex = bm.input_shapes(bm.example_dims)
    shapes_alt = bm.input_shapes(bm.alt_dims) if spec.shapes == "dynamic" else None
    for i, s in zip(io["inputs"], bm.input_specs):
        i["kind"] = s["kind"]
        i["example_shape"] = shapes_ex[s["name"]]
        i["alt_shape"] = None if shapes_alt is None else shapes_alt[s["name"]]
    reference = {"example": reference_outputs(bm, bm.example_dims)}
    if spec.shapes == "dynamic":
        reference["alt"] = reference_outputs(bm, bm.alt_dims)
    entry = {
        "file": spec.name,
        "data_files": [f.name for f in files[1:]],
        "family": spec.family,
        "size": spec.size,
        "exporter": spec.exporter,
        "shapes": spec.shapes,
        "attention": spec.attention,
        "export_opset": spec.opset,
        "external_data": spec.external_data,
        "opset": io["opset"],
        "inputs": io["inputs"],
        "outputs": io["outputs"],
        "example_dims": bm.example_dims,
        "alt_dims": bm.alt_dims if spec.shapes == "dynamic" else None,
        "dim_multiples": bm.dim_multiples,
        "sites": bm.sites,
        "ops": {k: v for k, v in op_counts(dst).items()},
        "num_nodes": sum(op_counts(dst).values()),
        "bytes": sum(f.stat().st_size for f in files),
        "sha256": {f.name: _sha256(f) for f in files},
        "check": {"max_abs_err": check2.max_abs_err,
                  "alt_max_abs_err": None if alt is None else alt.max_abs_err},
        "seed": bm.seed,
        "feed_options": bm.feed_options,
        "reference": reference,
        "export_seconds": round(res.seconds, 2),
        "stripped_metadata": list(STRIP_METADATA) if stripped else [],
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in bm.config.items()},
    }
    if verbose:
        print(f"  {spec.name}: {entry['bytes'] / 1024:.0f} KiB, export {res.seconds:.1f}s, "
              f"max err {check2.max_abs_err:.2g}", flush=True)
    return entry


def make_all(out_dir: Path | None = None, only: list[str] | None = None, verbose: bool = True,
             fixture_set: str = "sd") -> dict:
    folder, specs, description = FIXTURE_SETS[fixture_set]
    out_dir = Path(out_dir or FIXTURES_DIR / folder)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    manifest_path = out_dir / "manifest.json"
    old = {}
    if only and manifest_path.exists():
        old = {e["file"]: e for e in json.loads(manifest_path.read_text()).get("fixtures", [])}
    entries = []
    for spec in specs:
        if only and spec.name not in only and spec.family not in only:
            if spec.name in old:
                entries.append(old[spec.name])
            continue
        entries.append(make_fixture(spec, out_dir, verbose))
    known = {e["file"] for e in entries} | {d for e in entries for d in e["data_files"]} | {"manifest.json"}
    for p in out_dir.iterdir():
        if p.is_file() and p.name not in known and (p.suffix in (".onnx", ".data")):
            p.unlink()
    manifest = {
        "description": description,
        "versions": versions(),
        "total_bytes": sum(e["bytes"] for e in entries),
        "fixtures": entries,
    }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    if verbose:
        print(f"wrote {len(entries)} fixtures, {manifest['total_bytes'] / 1e6:.2f} MB, "
              f"in {time.perf_counter() - t0:.0f}s -> {out_dir}")
    return manifest
