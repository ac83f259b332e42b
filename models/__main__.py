"""CLI: ``python -m models {build,fixtures,list,sites,coverage}``.

    python -m models build unet-sd15 --size tiny --exporter torchscript --shapes dynamic \\
        --attention sdpa -o /tmp/unet.onnx
    python -m models fixtures              # regenerate models/fixtures/ + manifest.json
    python -m models list
    python -m models sites unet-sdxl --size full
    python -m models coverage [--families ...] [--variants ...] [--json out.json]   # see models/coverage.py
    python -m models pipeline sd15 --size tiny -o /tmp/sd15-tiny [--exporter dynamo] [--data-name weights.pb]
    python -m models export flux-dev --size full --exporter dynamo --dtype bfloat16 -o DIR   # see models/bigexport.py
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    from . import ALL_FAMILIES as FAMILIES
    from .base import ATTENTIONS, SIZES
    from .bigexport import DTYPES
    from .export import EXPORTERS, SHAPES
    from .pipelines import DATA_NAMES, PIPELINE_KINDS

    p = argparse.ArgumentParser(prog="python -m models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="build a model and export it to ONNX")
    b.add_argument("family", choices=FAMILIES)
    b.add_argument("--size", choices=SIZES, default="tiny")
    b.add_argument("--exporter", choices=EXPORTERS, default="torchscript")
    b.add_argument("--shapes", choices=SHAPES, default="dynamic")
    b.add_argument("--attention", choices=ATTENTIONS, default="sdpa")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--opset", type=int, default=None, help="override the exporter's opset")
    b.add_argument("--batch", type=int, help="example batch (export/check)")
    b.add_argument("--height", type=int, help="example latent height")
    b.add_argument("--width", type=int, help="example latent width")
    b.add_argument("--sequence", type=int, help="example text sequence length")
    b.add_argument("--inline", action="store_true",
                   help="re-save with all tensors inside the .onnx file (< 2 GB models only)")
    b.add_argument("--no-check", action="store_true", help="skip the ONNX Runtime vs torch check")
    b.add_argument("--atol", type=float, default=1e-4)
    b.add_argument("--verbose", action="store_true", help="show exporter output")
    b.add_argument("-o", "--output", required=True, help="output .onnx path (use a directory of its own "
                                                           "for full-size models: external data files)")

    f = sub.add_parser("fixtures", help="regenerate the committed fixtures")
    f.add_argument("--out", default=None, help="output directory (default models/fixtures)")
    f.add_argument("--only", nargs="*", help="fixture file names or families to regenerate")
    f.add_argument("--set", choices=("sd", "dit"), default="sd", dest="fixture_set",
                   help="sd: models/fixtures (SD-class); dit: models/fixtures/dit (transformers, T5)")

    sub.add_parser("list", help="list families and fixtures")

    s = sub.add_parser("sites", help="print the sites counts of a model")
    s.add_argument("family", choices=FAMILIES)
    s.add_argument("--size", choices=SIZES, default="tiny")
    s.add_argument("--attention", choices=ATTENTIONS, default="sdpa")

    pl = sub.add_parser("pipeline", help="write a diffusers/optimum-style ONNX pipeline folder (models/pipelines.py)")
    pl.add_argument("kind", choices=PIPELINE_KINDS)
    pl.add_argument("--size", choices=SIZES, default="tiny")
    pl.add_argument("--exporter", choices=EXPORTERS, default="torchscript")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--data-name", choices=DATA_NAMES, default=None,
                    help="put each component's tensors in this external data file (default: inline for tiny)")
    pl.add_argument("--no-check", action="store_true", help="skip the ONNX Runtime vs torch check")
    pl.add_argument("-o", "--output", required=True, help="output folder (must not exist or be empty)")

    e = sub.add_parser("export", help="export a (full-size) model into a folder of its own: streamed external "
                                      "data, weights held once (models/bigexport.py)")
    e.add_argument("family", choices=FAMILIES)
    e.add_argument("--size", choices=SIZES, default="full")
    e.add_argument("--exporter", choices=EXPORTERS, default="dynamo")
    e.add_argument("--shapes", choices=SHAPES, default="dynamic")
    e.add_argument("--dtype", choices=DTYPES, default="float32", help="build and export in this precision")
    e.add_argument("--opset", type=int, default=None, help="override the exporter's opset")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--layers", type=int, default=None, help="keep N blocks at full width (Flux: N double + N single)")
    for dim in ("batch", "height", "width", "sequence"):
        e.add_argument(f"--{dim}", type=int, default=None, help=f"{dim} of the inputs the exporter traces with")
    e.add_argument("--check", action="store_true", help="compare with torch on ONNX Runtime CPU at small dims "
                                                         "(float32; others: load only)")
    e.add_argument("--tolerance", type=float, default=1e-3, help="relative L2 allowed by --check")
    e.add_argument("--streamed", action="store_true",
                   help="build on the meta device and make each seeded weight as it is written: peak RSS far below "
                        "the weights (Flux; dynamo; the same weights as without it)")
    e.add_argument("-o", "--output", required=True, help="output folder (must not exist or be empty)")

    sub.add_parser("coverage", help="fusion coverage table of the ort-cuda preset (python -m models coverage --help)")
    return p


PROJECT_PACKAGES = {"onnxopt", "models", "passes", "tests", "benchmarks"}
INSTALL_HINT = "pip install 'onnxopt[cpu,models]'"  # the models extra brings every package exporting imports


def main(argv=None) -> int:
    """The command; a third-party package it needs and lacks is one line naming the extra, exit 2
    (a missing module of the project or of Python's own library is a bug: its traceback stays)."""
    try:
        return _run(sys.argv[1:] if argv is None else list(argv))
    except ModuleNotFoundError as exc:
        package = (exc.name or "").partition(".")[0]
        if not package or package in PROJECT_PACKAGES or package in sys.stdlib_module_names:
            raise
        print(f"python -m models: error: {package} is not installed: {INSTALL_HINT}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    if argv[:1] == ["coverage"]:  # its own parser: python -m models coverage --help
        from .coverage import main as coverage_main

        return coverage_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.cmd == "list":
        from . import ALL_FAMILIES as FAMILIES, MANIFEST
        from .make_fixtures import DIT_FIXTURES, FIXTURES

        print("families:", ", ".join(FAMILIES))
        print("fixtures:")
        for spec in FIXTURES + DIT_FIXTURES:
            print("  ", spec.name, "(+ .data)" if spec.external_data else "")
        print("manifest:", MANIFEST)
        return 0
    if args.cmd == "sites":
        from . import build

        bm = build(args.family, args.size, args.attention)
        print(json.dumps(bm.sites, indent=1))
        return 0
    if args.cmd == "fixtures":
        from .make_fixtures import make_all

        make_all(args.out, args.only, fixture_set=args.fixture_set)
        return 0

    if args.cmd == "pipeline":
        return _pipeline(args)
    if args.cmd == "export":
        from .bigexport import main as export_main

        return export_main(args)

    # build
    from . import build
    from .export import check_export, export, inline_external_data

    t0 = time.perf_counter()
    bm = build(args.family, args.size, args.attention, args.seed)
    for k in ("batch", "height", "width", "sequence"):
        v = getattr(args, k)
        if v is not None:
            if k not in bm.example_dims:
                print(f"--{k} does not apply to {args.family}", file=sys.stderr)
                return 2
            bm.example_dims[k] = v
    t_build = time.perf_counter() - t0
    n_params = sum(p.numel() for p in bm.module.parameters())
    print(f"built {args.family} ({args.size}, {args.attention}): {n_params / 1e6:.2f}M parameters "
          f"in {t_build:.1f}s; example dims {bm.example_dims}")
    print("sites:", json.dumps(bm.sites))
    res = export(bm, args.output, args.exporter, args.shapes, opset=args.opset, quiet=not args.verbose)
    print(f"exported ({args.exporter}, {args.shapes}) in {res.seconds:.1f}s: {len(res.files)} file(s), "
          f"{res.total_bytes / 1e6:.1f} MB -> {res.path}")
    if args.inline:
        inline_external_data(res.path)
        print("re-saved with inline tensors")
    if not args.no_check:
        t1 = time.perf_counter()
        c = check_export(bm, res.path, atol=args.atol, rtol=args.atol)
        print(f"check (example dims): {c} [{time.perf_counter() - t1:.1f}s]")
        ok = c.ok
        if args.shapes == "dynamic":
            c2 = check_export(bm, res.path, dims=bm.alt_dims, atol=args.atol, rtol=args.atol)
            print(f"check (alt dims):     {c2}")
            ok = ok and c2.ok
        if not ok:
            return 1
    return 0


def _pipeline(args) -> int:
    """The folder is built in a temporary sibling and renamed to ``-o`` at the end, as onnxopt writes its
    outputs: a failure (or a failed check, exit 1) leaves nothing behind, where it left an empty or half
    written folder."""
    from onnxopt.outputs import temp_folder_beside

    from .export import check_export
    from .pipelines import folder_bytes, write_onnx_folder

    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"{out} exists and is not an empty folder", file=sys.stderr)
        return 2
    try:
        partial = temp_folder_beside(out)
    except OSError as exc:
        print(f"{out}: cannot write in {out.parent}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        t0 = time.perf_counter()
        comps = write_onnx_folder(args.kind, partial, args.size, args.exporter, args.seed, args.data_name)
        print(f"wrote {args.kind} ({args.size}, {args.exporter}) in {time.perf_counter() - t0:.1f}s: "
              f"{', '.join(comps)}; {folder_bytes(partial) / 1e6:.2f} MB -> {out}")
        ok = True
        if not args.no_check:
            for name, bm in comps.items():
                c = check_export(bm, partial / name / "model.onnx")
                print(f"  {name:15s} {c}")
                ok = ok and c.ok
        if not ok:
            print(f"{out}: not written (the check failed)", file=sys.stderr)
            shutil.rmtree(partial)
            return 1
        if out.exists():
            out.rmdir()  # the empty folder checked above
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
