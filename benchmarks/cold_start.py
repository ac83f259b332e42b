"""Cold start of a pipeline folder: where ``Pipeline.load`` and the first image spend their time.

    python -m benchmarks.cold_start FOLDER --provider cuda --out benchmarks/results/cold-start-KIND
    python -m benchmarks.cold_start --dry-run --out /tmp/cold-dry   # CPU, the committed tiny SD3.5 folder

On the GPU machine, the optimized folders benchmarks/pipeline_gpu.py builds (bf16, the settings of
its kinds)::

    python -m benchmarks.cold_start /tmp/pipe-bench/sd35-medium/optimized --provider cuda \\
        --steps 28 --height 1024 --width 1024 --guidance 4.5 --out benchmarks/results/cold-start-sd35
    python -m benchmarks.cold_start /tmp/pipe-bench/flux-dev/optimized --provider cuda \\
        --steps 28 --height 1024 --width 1024 --guidance 3.5 --out benchmarks/results/cold-start-flux-dev

Two parts, written to ``--out`` as ``cold_start.json`` and ``README.md``:

* **components**: every graph the load and the first image open (the plan's sessions and the text
  encoders of one prompt), its size on disk (graph and external data), and for each ORT graph
  optimization level (``--levels``) its session creation, split by ORT's profiler into model
  loading (parsing the graph) and session initialization (graph optimization, and the initializers
  read and placed on the device), and the nodes ORT's optimized graph holds (``--node-counts``:
  ORT writes the optimized graph, on the CPU EP only, whose layout is not the CUDA EP's).
* **loads**: each variant in a fresh process (imports included, files already in the page cache
  after the first): the imports, ``Pipeline.load`` (``creation_s``: sessions and tokenizers), the
  first image with its stages (the text encoders' sessions are made there when not ahead), the
  cold start (load + first image, as pipeline_gpu.py's ``cold_start_s``), and a second image's
  stages (the steady state each level's graphs run at). Variants: the sequential load at ORT's
  default level (the baseline), sessions made concurrently (``load_workers``), and each other
  level with them. Each image is compared with the baseline's, bit for bit.

A level below "all" is worth taking only where its second image is as fast, stage by stage, and its
image the same as at "all" (or within the noise floor of that provider).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DRY_FOLDER = ROOT / "models" / "pipelines" / "sd35-tiny-optimum"
LEVELS = ("all", "extended", "basic", "disable")
PROMPT = "a photograph of an astronaut riding a horse"


def graph_bytes(model: Path) -> int:
    """The graph file and the external data files beside it that it names."""
    import onnx

    total = model.stat().st_size
    graph = onnx.load(str(model), load_external_data=False)
    locations = {entry.value for tensor in onnx.external_data_helper._get_all_tensors(graph)
                 for entry in tensor.external_data if entry.key == "location"}
    return total + sum((model.parent / name).stat().st_size for name in locations if (model.parent / name).is_file())


def planned_graphs(folder: Path, provider: str, guidance: float | None) -> list[tuple[str, Path, bool]]:
    """(component, graph, cuda_graph) of every session the load and the first image open by file."""
    from onnxopt.pipeline.folder import PipelineFolder
    from onnxopt.pipeline.plan import PlanOptions, plan_generation
    from onnxopt.pipeline.runner import _SessionMaker
    from onnxopt.pipeline.runner import StartupStatus

    opened = PipelineFolder.open(folder)
    plan = plan_generation(opened, provider, PlanOptions(guidance=guidance))
    maker = _SessionMaker(opened, plan, 0, None, StartupStatus(False))
    return [(a.component, Path(a.model), a.cuda_graph) for a in maker.ahead()]


def time_creation(model: Path, provider: str, level: str, cuda_graph: bool, node_counts: bool, scratch: Path) -> dict:
    """One session of ``model`` at ``level``: wall time, ORT's profile of its phases, the optimized node count."""
    from onnxopt.pipeline.sessions import provider_list, require_provider
    from onnxopt.runtime import graph_optimization_level, session_options

    ort = require_provider(provider)
    options = session_options(ort)
    options.graph_optimization_level = graph_optimization_level(ort, level)
    options.enable_profiling = True
    options.profile_file_prefix = str(scratch / "profile")
    if node_counts:
        options.optimized_model_filepath = str(scratch / "optimized.onnx")
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    start = time.perf_counter()
    session = ort.InferenceSession(str(model), options, providers=provider_list(provider, cuda_graph=cuda_graph))
    wall = time.perf_counter() - start
    profile = Path(session.end_profiling())
    phases = {e["name"]: e["dur"] / 1e6 for e in json.loads(profile.read_text()) if e.get("cat") == "Session"}
    profile.unlink()
    out = {"create_s": wall, "model_loading_s": phases.get("model_loading_uri"),
           "session_initialization_s": phases.get("session_initialization")}
    if node_counts:
        import collections

        import onnx

        optimized = onnx.load(str(scratch / "optimized.onnx"), load_external_data=False)
        out["nodes"] = len(optimized.graph.node)
        out["ops"] = dict(collections.Counter(n.op_type for n in optimized.graph.node).most_common())
        for name in ("optimized.onnx", "optimized.data"):
            (scratch / name).unlink(missing_ok=True)
    del session
    return out


def components(folder: Path, args) -> list[dict]:
    rows = []
    scratch = args.out / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    for component, model, cuda_graph in planned_graphs(folder, args.provider, args.guidance):
        row = {"component": component, "graph": str(model.relative_to(folder)), "bytes": graph_bytes(model), "levels": {}}
        for level in args.levels:
            try:
                row["levels"][level] = time_creation(model, args.provider, level, cuda_graph,
                                                     args.node_counts and args.provider == "cpu", scratch)
            except Exception as exc:  # noqa: BLE001 -- a level ORT refuses is a row of the table
                row["levels"][level] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
        print(f"  {component:<16} {row['graph']:<34} " + " ".join(
            f"{lvl} {r.get('create_s', float('nan')):.2f}s" for lvl, r in row["levels"].items()), flush=True)
        rows.append(row)
    scratch.rmdir()
    return rows


def one_load(spec: dict) -> dict:
    """In this (fresh) process: the imports, Pipeline.load, two images; the images saved under spec["image"]."""
    timings = {}
    start = time.perf_counter()
    import torch  # noqa: F401

    timings["import_torch_s"] = time.perf_counter() - start
    mark = time.perf_counter()
    import diffusers  # noqa: F401

    timings["import_diffusers_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    import transformers  # noqa: F401 -- the tokenizers' import, measured apart

    timings["import_transformers_s"] = time.perf_counter() - mark
    from onnxopt.pipeline import Pipeline

    request = dict(steps=spec["steps"], seed=0, progress=False, height=spec["height"], width=spec["width"])
    if spec["guidance"] is not None:
        request["guidance"] = spec["guidance"]
    if spec["scheduler"]:
        request["scheduler"] = spec["scheduler"]
    mark = time.perf_counter()
    pipe = Pipeline.load(spec["folder"], spec["provider"], load_workers=spec["workers"],
                         graph_optimization=spec["level"], guidance=spec["guidance"])
    timings["load_s"] = time.perf_counter() - mark
    first = pipe(PROMPT, **request)
    timings["cold_start_s"] = time.perf_counter() - mark
    timings["first_image"] = {k: v for k, v in first.timings.items() if isinstance(v, float)}
    second = pipe(PROMPT, **request)
    timings["second_image"] = {k: v for k, v in second.timings.items() if isinstance(v, float)}
    timings["process_s"] = time.perf_counter() - start
    np.save(spec["image"], np.asarray(second.pixels))
    return timings


def loads(folder: Path, args) -> dict:
    variants = [("sequential, all", 0, "all"), (f"{args.workers} workers, all", args.workers, "all")]
    variants += [(f"{args.workers} workers, {level}", args.workers, level) for level in args.levels if level != "all"]
    out = {}
    baseline = None
    for name, workers, level in variants:
        image = args.out / f"image-{workers}-{level}.npy"
        spec = dict(folder=str(folder), provider=args.provider, workers=workers, level=level, steps=args.steps,
                    height=args.height, width=args.width, guidance=args.guidance, scheduler=args.scheduler,
                    image=str(image))
        done = subprocess.run([sys.executable, "-m", "benchmarks.cold_start", "--one", json.dumps(spec)],
                              capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if done.returncode != 0:
            out[name] = {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
            print(f"  {name}: {out[name]['error']}", flush=True)
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        pixels = np.load(image)
        image.unlink()
        if baseline is None:
            baseline = pixels
        result["image_equal_to_sequential_all"] = bool(np.array_equal(pixels, baseline))
        result["image_max_abs_vs_sequential_all"] = float(np.abs(pixels.astype(np.float64) - baseline).max())
        out[name] = result
        print(f"  {name}: load {result['load_s']:.2f} s, cold start {result['cold_start_s']:.2f} s, "
              f"equal {result['image_equal_to_sequential_all']}", flush=True)
    return out


def table(results: dict) -> str:
    lines = [f"# Cold start: {results['folder']} ({results['provider']})", "",
             f"{results['steps']} steps, {results['height']}x{results['width']}, guidance {results['guidance']}", "",
             "## Session creation per graph and ORT graph optimization level (s; parse / initialization)", "",
             "| component | graph | MB | " + " | ".join(results["levels"]) + " |",
             "|---|---|---|" + "---|" * len(results["levels"])]
    for row in results["components"]:
        cells = []
        for level in results["levels"]:
            r = row["levels"].get(level, {})
            cell = r.get("error") or f"{r['create_s']:.2f} ({r['model_loading_s'] or 0:.2f} / {r['session_initialization_s'] or 0:.2f})"
            cells.append(cell + (f", {r['nodes']} nodes" if "nodes" in r else ""))
        lines.append(f"| {row['component']} | {row['graph']} | {row['bytes'] / 1e6:.0f} | " + " | ".join(cells) + " |")
    lines += ["", "## Load and first image, each in a fresh process (s)", "",
              "| variant | imports | load | first image | text encoders (1st) | cold start | 2nd: text | 2nd: step mean | 2nd: VAE | same image |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["loads"].items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} |||||||||")
            continue
        imports = r["import_torch_s"] + r["import_diffusers_s"] + r["import_transformers_s"]
        first, second = r["first_image"], r["second_image"]
        same = "bit for bit" if r["image_equal_to_sequential_all"] else f"max abs {r['image_max_abs_vs_sequential_all']:.3g}"
        lines.append(f"| {name} | {imports:.2f} | {r['load_s']:.2f} | {first.get('total_s', 0):.2f} | "
                     f"{first.get('text_encoder_s', 0):.2f} | {r['cold_start_s']:.2f} | {second.get('text_encoder_s', 0):.3f} | "
                     f"{second.get('step_mean_s', 0):.3f} | {second.get('vae_decode_s', 0):.3f} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", type=Path)
    ap.add_argument("--provider", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--guidance", type=float, default=None, help="the request's (default: the folder family's)")
    ap.add_argument("--scheduler", default=None, help="the request's (default: the folder's own)")
    ap.add_argument("--levels", default=",".join(LEVELS), help="ORT graph optimization levels to compare")
    ap.add_argument("--workers", type=int, default=4, help="load_workers of the concurrent variants")
    ap.add_argument("--node-counts", action="store_true", help="(CPU EP) the optimized graph's node count per level")
    ap.add_argument("--skip", default="", help="parts to skip: components, loads")
    ap.add_argument("--out", type=Path, default=Path("/tmp/cold-start"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, the committed tiny SD3.5 folder, 2 steps at 64x64")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one load, its JSON on stdout
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one_load(json.loads(args.one))))
        return 0
    if args.dry_run:
        args.folder = args.folder or DRY_FOLDER
        args.provider, args.steps, args.height, args.width, args.node_counts = "cpu", 2, 64, 64, True
    if args.folder is None:
        ap.error("a pipeline folder (or --dry-run)")
    args.levels = [level.strip() for level in args.levels.split(",") if level.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.folder.resolve()
    skip = set(args.skip.split(","))
    results = {"folder": str(folder), "provider": args.provider, "steps": args.steps, "height": args.height,
               "width": args.width, "guidance": args.guidance, "levels": args.levels}
    print("components:", flush=True)
    results["components"] = components(folder, args) if "components" not in skip else []
    print("loads:", flush=True)
    results["loads"] = loads(folder, args) if "loads" not in skip else {}
    (args.out / "cold_start.json").write_text(json.dumps(results, indent=1))
    (args.out / "README.md").write_text(table(results))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
