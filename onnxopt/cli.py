"""The ``onnxopt`` command.

Exit codes: 0 success; 1 verification failed (nothing written); 2 bad input or usage;
3 internal error (a bug: rerun with --debug for the traceback); 4 a requested fusion found
nothing to fuse under --strict.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import sys
import time
from pathlib import Path

from onnxopt import registry
from onnxopt.errors import OnnxoptError
from onnxopt.properties import checking

EXIT_OK, EXIT_VERIFY_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line (``onnxopt: error: ...``) and exit 2, like every other bad input."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"onnxopt: error: {self.prog}: {message} (see {self.prog} --help)\n")


def _shape_arg(text: str) -> tuple[str, tuple[int, ...]]:
    name, _, dims = text.rpartition("=")
    try:
        shape = tuple(int(d) for d in dims.replace("x", ",").split(",") if d)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=D1,D2,..., got '{text}'")
    if not name or any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(f"expected NAME=D1,D2,... with dims of 0 or more, got '{text}'")
    return name, shape


def _tolerance_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of 0 or more, got '{text}'")
    return value


def _int_arg(minimum: int, maximum: int | None = None):
    """An argparse type: an integer in minimum..maximum (``--runs 0`` timed nothing; a diff seed outside
    0..2**32 - 1 was NumPy's ValueError, exit 3)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            expected = f"in {minimum}..{maximum}" if maximum is not None else f"of {minimum} or more"
            raise argparse.ArgumentTypeError(f"expected an integer {expected}, got '{text}'")
        return value
    return parse


def _dim_arg(text: str) -> tuple[str, int]:
    name, _, value = text.rpartition("=")
    if not name or not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected DIM=VALUE, got '{text}'")
    return name, int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="onnxopt", description="Optimize diffusion-model ONNX graphs for ORT CUDA and TensorRT.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks; check every property a pass claims after it")
    sub = parser.add_subparsers(dest="command", required=True)

    opt = sub.add_parser("optimize", help="run passes over a model")
    opt.add_argument("-i", "--input", required=True, help="source .onnx, or a diffusers/optimum ONNX pipeline folder (never modified)")
    opt.add_argument("-o", "--output", required=True, help="where to write the result (atomically; for a folder: a new folder)")
    opt.add_argument("--passes", default=None, help="comma-separated passes and presets (default: cleanup)")
    opt.add_argument("--target", choices=["ort-cuda", "tensorrt"], help="the target's preset (a folder: each component's preset, default ort-cuda)")
    opt.add_argument("--no-context-kv", dest="context_kv", action="store_false",
                     help="a folder: keep the cross-attention K/V inside the step graph (default: computed once per prompt)")
    opt.add_argument("--cfg-late", action="store_true",
                     help="a folder: in the step graph, compute what both guidance halves share (latents, timestep) "
                          "once, at batch b, up to the first cross-attention (default: off until measured on a GPU)")
    opt.add_argument("--fp16", action="store_true", help="add the fp16 pass (a folder: the VAE guarded, see onnxopt/pipeline/optimize_folder.py)")
    opt.add_argument("--verify", action="store_true", help="compare with the source after every pass; name the first that breaks the tolerance")
    opt.add_argument("--atol", type=_tolerance_arg, default=1e-4)
    opt.add_argument("--rtol", type=_tolerance_arg, default=1e-3)
    opt.add_argument("--shape", type=_shape_arg, action="append", default=[], metavar="INPUT=D1,D2,..", help="input shape for --verify")
    opt.add_argument("--dim", type=_dim_arg, action="append", default=[], metavar="DIM=N", help="value of a symbolic dim for --verify")
    ext = opt.add_mutually_exclusive_group()
    ext.add_argument("--external-data", dest="external_data", action="store_true", default=None, help="always write weights to <output>.data")
    ext.add_argument("--no-external-data", dest="external_data", action="store_false", help="keep weights inline (fails over 2 GB)")
    opt.add_argument("--report-json", type=Path, help="also write the report as JSON")
    fp16 = opt.add_argument_group("fp16 pass")
    fp16.add_argument("--low-precision", choices=["float16", "bfloat16"], help="the fp16 pass's low precision (default float16)")
    fp16.add_argument("--fp32-ops", help="comma-separated op types kept in float32")
    fp16.add_argument("--fp32-nodes", help="comma-separated node names kept in float32")
    fp16.add_argument("--keep-io-types", dest="keep_io_types", action="store_true", default=None, help="model inputs/outputs stay float32 (default)")
    fp16.add_argument("--no-keep-io-types", dest="keep_io_types", action="store_false", help="model inputs/outputs become float16")
    fp16.add_argument("--fp32-auto", action="store_true", help="keep float32 the nodes whose values leave the fp16 range on calibration inputs")
    fp16.add_argument("--calibration", help=".npz of calibration inputs for --fp32-auto (default: random inputs)")
    fp8 = opt.add_argument_group("fp8-linear pass (opt-in, Hopper: costs accuracy)")
    fp8.add_argument("--fp8", action="store_true",
                     help="with --target ort-cuda: fp16, then fp8-linear (Linears as float8 GemmFloat8 with calibrated scales)")
    fp8.add_argument("--fp8-calibration", help=".npz of calibration inputs for --fp8's activation scales (default: random inputs)")
    opt.add_argument("--strict", action="store_true", help="fail (exit 4) when a requested fusion finds nothing to fuse")
    opt.add_argument("--explain", action="append", default=[], metavar="PASS",
                     help="print, per candidate site of PASS, where its pattern failed or which condition refused it")
    opt.add_argument("-q", "--quiet", action="store_true", help="do not print the report table")

    bench = sub.add_parser("bench", help="latency on the ORT CUDA EP of several models on the same inputs")
    bench.add_argument("models", nargs="+", help="models to time; with --ablation: SOURCE, then extra models to time beside it")
    bench.add_argument("--labels", help="comma-separated names for the table (with --ablation: for the extra models)")
    bench.add_argument("--ablation", metavar="PASSES", help="time SOURCE in fp16 alone, then with the passes added one fusion at a time (e.g. ort-cuda,fp16)")
    bench.add_argument("--work", type=Path, help="folder for the ablation models (default: <SOURCE stem>.ablation beside it); reused when present")
    bench.add_argument("--build-only", action="store_true", help="with --ablation: build the models, time nothing (no GPU needed)")
    bench.add_argument("--markdown", type=Path, help="also write the table to this file")
    bench.add_argument("--shape", type=_shape_arg, action="append", default=[], metavar="INPUT=D1,D2,..")
    bench.add_argument("--dim", type=_dim_arg, action="append", default=[], metavar="DIM=N")
    bench.add_argument("--cuda-graph", choices=["off", "on", "both"], default="both")
    bench.add_argument("--warmup", type=_int_arg(0), default=10)
    bench.add_argument("--runs", type=_int_arg(1), default=40)
    bench.add_argument("--prefer-nhwc", action="store_true")
    bench.add_argument("--json", type=Path, help="also write every number as JSON")

    diff = sub.add_parser("diff", help="accuracy of an optimized model against its fp32 source; --bisect names the pass that broke it")
    diff.add_argument("source", help="the source model (runs in float32 on ORT CPU)")
    diff.add_argument("optimized", nargs="?", help="the optimized model (optional with --bisect)")
    diff.add_argument("--runtime", choices=["cuda", "trt", "cpu", "reference"],
                      help="where the optimized model runs (default: cuda if available, else cpu if ORT CPU has every kernel, else reference)")
    diff.add_argument("--atol", type=_tolerance_arg, default=1e-4)
    diff.add_argument("--rtol", type=_tolerance_arg, default=1e-3)
    diff.add_argument("--shape", type=_shape_arg, action="append", default=[], metavar="INPUT=D1,D2,..")
    diff.add_argument("--dim", type=_dim_arg, action="append", default=[], metavar="DIM=N")
    diff.add_argument("--inputs", type=Path, help=".npz of inputs, keyed by input name (default: random)")
    diff.add_argument("--seed", type=_int_arg(0, 2**32 - 1), default=0, help="seed of the random inputs (0 .. 2**32 - 1)")
    diff.add_argument("--json", type=Path, help="also write every metric as JSON")
    diff.add_argument("--bisect", action="store_true", help="apply --passes to SOURCE one at a time and name the first that breaks the tolerance")
    diff.add_argument("--passes", help="passes and presets for --bisect (e.g. ort-cuda,fp16)")
    diff.add_argument("--prefer-nhwc", action="store_true", help="--runtime cuda: the CUDA EP's prefer_nhwc option")
    diff.add_argument("--precision", help="--runtime trt: the engine precision (default: fp16 for a model with fp16 tensors, else fp32)")

    sub.add_parser("passes", help="list passes and presets")

    info = sub.add_parser("info", help="summarise a model: inputs, outputs, ops, weights")
    info.add_argument("model")

    build = sub.add_parser("build", help="build a TensorRT engine (through Polygraphy; needs tensorrt and an NVIDIA GPU)")
    build.add_argument("-i", "--input", required=True, help="the .onnx to build (optimize it with --passes tensorrt first)")
    build.add_argument("-o", "--output", required=True, help="the engine file to write (atomically), e.g. model.plan")
    build.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default="fp16",
                       help="strongly typed engine precision; a float32 graph is converted by the fp16 pass (default fp16)")
    build.add_argument("--profile", type=_profile_arg, action="append", default=[], metavar="INPUT=MIN:OPT:MAX",
                       help="shape range of one input, e.g. sample=1x4x64x64:2x4x64x64:4x4x128x128 (one shape: fixed)")
    build.add_argument("--dim", type=_dim_arg, action="append", default=[], metavar="DIM=N",
                       help="value of a symbolic dim for inputs without --profile (default: batch 2, others 8)")
    build.add_argument("--timing-cache", type=Path, help="TensorRT timing cache: read if it exists, written after the build")
    build.add_argument("--workspace", type=int, metavar="MB", help="builder workspace limit in MiB")
    _add_generate_parser(sub)
    _add_serve_parser(sub)
    return parser


def _add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="text to image from an ONNX pipeline folder (ORT CPU, CUDA or TensorRT)")
    gen.add_argument("folder", help="a diffusers/optimum ONNX pipeline folder (model_index.json, unet/, ...)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--negative-prompt", default=None)
    gen.add_argument("--steps", type=int, default=50)
    gen.add_argument("--guidance", type=float, default=7.5)
    gen.add_argument("--scheduler", default="ddim", help="ddim | euler | dpm++2m (diffusers' classes, from the folder's config)")
    gen.add_argument("--seed", type=int, default=0, help="as diffusers: torch.Generator('cpu').manual_seed(SEED)")
    gen.add_argument("--height", type=int, help="pixels (default: the UNet's sample_size times the VAE factor)")
    gen.add_argument("--width", type=int)
    gen.add_argument("--controlnet-image", type=Path, action="append",
                     help="conditioning image (ControlNet folders only); once per ControlNet, in the order "
                          "controlnet/, controlnet_1/, ...")
    gen.add_argument("--controlnet-scale", type=float, nargs="+", default=[1.0], metavar="SCALE",
                     help="ControlNet conditioning scale: one for all, or one per ControlNet (default 1.0)")
    gen.add_argument("--reuse", metavar="STEPS", help="opt-in approximation: these 0-based steps reuse the previous step's "
                     "prediction instead of running the UNet, e.g. 30-49:2 (onnxopt.pipeline.step_reuse)")
    gen.add_argument("--provider", choices=["cpu", "cuda", "tensorrt"], default="cpu")
    gen.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", help="cuda/tensorrt: do not capture the step")
    gen.add_argument("--unfused", dest="fused_step", action="store_false", help="UNet + diffusers' scheduler.step (no fused step graph)")
    gen.add_argument("-o", "--output", required=True, type=Path, help="the PNG to write (atomically)")
    gen.add_argument("--json", type=Path, help="also write the per-stage timings as JSON")
    gen.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no timings table")


def _add_serve_parser(sub) -> None:
    from onnxopt.serve.command import add_parser  # imports neither Ray nor the pipeline

    add_parser(sub)


def cmd_generate(args) -> int:
    import json

    from onnxopt.pipeline import PipelineFolder, images
    from onnxopt.pipeline.runner import Pipeline, reuse_steps, check_request
    from onnxopt.pipeline.sessions import quiet_sessions

    folder = PipelineFolder.open(args.folder)
    check_request(folder, steps=args.steps, scheduler=args.scheduler, height=args.height, width=args.width,
                  controlnet_image=args.controlnet_image, controlnet_scale=args.controlnet_scale)
    reuse_steps(args.reuse, args.steps)  # a bad schedule is refused before any session exists
    for written in filter(None, (args.output, args.json)):
        _refuse_input(written, folder.root, *(args.controlnet_image or ()))
        images.check_writable(written)
    if args.json and Path(args.json).resolve() == Path(args.output).resolve():  # the timings replaced the PNG
        raise OnnxoptError(f"{args.json}: --json is the image -o writes; give another path")
    with contextlib.nullcontext() if args.debug else quiet_sessions():  # ORT's errors come back as one line
        pipe = Pipeline.load(folder, args.provider, fused_step=args.fused_step, cuda_graph=args.cuda_graph)
        result = pipe(args.prompt, negative_prompt=args.negative_prompt, steps=args.steps, guidance=args.guidance,
                      scheduler=args.scheduler, seed=args.seed, height=args.height, width=args.width,
                      controlnet_image=args.controlnet_image, controlnet_scale=args.controlnet_scale,
                      progress=not args.quiet, reuse=args.reuse)
    images.write_png(result.image, args.output)
    if args.json:
        try:
            args.json.write_text(json.dumps(result.timings, indent=2) + "\n")
        except OSError as exc:
            raise OnnxoptError(f"{args.json}: cannot write: {exc.strerror or exc}")
    if not args.quiet:
        t = result.timings
        print(f"wrote {args.output} ({result.image.width}x{result.image.height}, {t['steps']} steps, {t['step']})")
        print(f"  text encoder {t['text_encoder_s'] * 1e3:.1f} ms | step {t['step_mean_s'] * 1e3:.2f} ms mean, "
              f"first {t['first_step_s'] * 1e3:.1f} ms | VAE decode {t['vae_decode_s'] * 1e3:.1f} ms | "
              f"total {t['total_s']:.2f} s | sessions {t['session_creation_s']:.2f} s | cold start {t['cold_start_s']:.2f} s")
    return EXIT_OK


def _refuse_input(path, folder, *files) -> None:
    """A file a command writes may not be in the (pipeline) folder it reads, nor one of its input files."""
    real = Path(path).resolve()
    if folder is not None and Path(folder).resolve() in real.parents:
        raise OnnxoptError(f"{path}: is inside {folder}, an input of this run; onnxopt never modifies its input")
    for f in filter(None, files):
        if real == Path(f).resolve():
            raise OnnxoptError(f"{path}: is {f}, an input of this run; onnxopt never modifies its input")


def check_not_read(path, models, *files) -> None:
    """A report a command writes (``--json``, ``--markdown``) may not be a model it reads, one of the
    models' external data files, nor another input file (``--inputs``): ``diff a.onnx b.onnx --json
    a.onnx`` replaced the source model with the report."""
    from onnxopt.loading import load_model
    from onnxopt.saving import check_destination, check_writes

    _refuse_input(path, None, *files)
    check_destination(path)  # a missing folder: before the work, not after it
    for model in filter(None, models):
        if Path(model).is_file():
            check_writes([path], load_model(model))


def _profile_arg(text: str):
    from onnxopt.runners.tensorrt import parse_profile

    try:
        return parse_profile(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))


def cmd_optimize(args) -> int:
    from onnxopt.api import optimize
    from onnxopt.fusion import explaining
    from onnxopt.loading import load_model
    from onnxopt.report import process_memory
    from onnxopt.saving import check_destination, check_writes, planned_writes, save_model
    from onnxopt.verify import InputSpec, Tolerance, check_dim_names, load_feeds

    if args.fp8 and Path(args.input).is_dir():
        raise OnnxoptError("--fp8 rewrites one model; for a pipeline folder, run it on unet/step.onnx "
                           "(benchmarks/pipeline_gpu.py --fp8 writes unet/step.fp8.onnx)")
    if Path(args.input).is_dir():  # a pipeline folder: each component with its preset
        from onnxopt.pipeline.optimize_folder import cli_optimize_folder

        return cli_optimize_folder(args)
    if args.cfg_late:
        raise OnnxoptError("--cfg-late rewrites a pipeline folder's step graph: give a folder as --input")
    if args.passes is not None and args.target:
        raise OnnxoptError("give --passes or --target, not both")
    passes = [p for p in (args.passes if args.passes is not None else args.target or "cleanup").split(",") if p.strip()]
    if args.passes is not None and not passes:  # "--passes ," ran no pass at all, "--passes ''" the default
        raise OnnxoptError(f"--passes {args.passes!r} names no pass or preset ('onnxopt passes' lists them)")
    passes += ["fp16"] if (args.fp16 or args.fp8) and "fp16" not in passes else []
    passes += _fp8_passes(args, passes)
    expanded = registry.expand(passes)  # unknown names and unwritable outputs fail before any work
    _check_fp16_flags(args, expanded)
    check_destination(args.output, args.input)
    if args.report_json:  # a report that cannot be written failed after the output was written (exit 2, output there)
        check_destination(args.report_json)  # (onto an input file: check_writes below says so)
    load_start = time.perf_counter()
    source = load_model(args.input)  # lazy: weights stay on disk; optimize() works on a copy
    load_seconds = time.perf_counter() - load_start
    check_dim_names(source, dict(args.dim))
    check_writes(planned_writes(source, args.output, external_data=args.external_data) + [p for p in [args.report_json] if p], source)
    for path in (args.calibration, args.fp8_calibration):
        if path:  # refused now, not only when (or if) a pass gets to read it: fp8-linear may refuse every site first
            load_feeds(path, source)
    inputs = InputSpec(shapes=dict(args.shape), dims=dict(args.dim))
    start = time.perf_counter()
    explained = _explained_passes(args.explain, expanded)
    with explaining(explained):
        model, report = optimize(
            source, passes, verify=args.verify, tolerance=Tolerance(args.atol, args.rtol), inputs=inputs, strict=args.strict,
            options={"fp16": _fp16_options(args), "fp8-linear": _fp8_options(args, inputs)},
        )
    report.load_seconds = load_seconds
    if not args.quiet:
        print(report.table())
    if explained:
        print(report.explain(explained))
    if report.first_broken_pass:
        if args.report_json:
            write_report(args.report_json, report.to_json())
        print(f"onnxopt: verification failed at pass '{report.first_broken_pass}'; {args.output} not written", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    save_start = time.perf_counter()
    info = save_model(model, args.output, external_data=args.external_data)
    report.save_seconds, report.memory_after_save = time.perf_counter() - save_start, process_memory()
    if args.report_json:
        write_report(args.report_json, report.to_json())
    where = f"{info.path}" + (f" (+ {info.data_path.name})" if info.data_path else "")
    if not args.quiet:
        print(f"wrote {where}: {info.weights_nbytes / 1e6:.1f} MB of weights, {time.perf_counter() - start:.1f} s in all")
        print(f"  load {load_seconds:.1f} s, passes {report.seconds:.1f} s, save {report.save_seconds:.1f} s; "
              f"peak RSS {report.memory_after_save.peak_bytes / 1e6:.0f} MB; CPU {time.process_time():.1f} s (this process, in all)")
        for name, part in info.companions.items():  # context-kv: the graph run once per prompt, beside it
            print(f"wrote {part.path}" + (f" (+ {part.data_path.name})" if part.data_path else "") + f": companion '{name}'")
    return EXIT_OK


def _explained_passes(names: list[str], passes: list[str]) -> set[str]:
    """--explain's passes (comma-separated or repeated), each one the run includes."""
    explained = {n.strip() for name in names for n in name.split(",") if n.strip()}
    for name in sorted(explained):
        registry.get_pass(name)  # an unknown name: exit 2 with a suggestion
        if name not in passes:
            raise OnnxoptError(f"--explain {name}: the run does not include that pass (passes: {', '.join(dict.fromkeys(passes))})")
    return explained


def write_report(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise OnnxoptError(f"{path}: cannot write report: {exc.strerror or exc}")


def _check_fp16_flags(args, passes: list) -> None:
    """The fp16 pass's flags without the fp16 pass, or --calibration without --fp32-auto, would be ignored."""
    given = [flag for flag, value in (("--low-precision", args.low_precision), ("--fp32-ops", args.fp32_ops),
                                      ("--fp32-nodes", args.fp32_nodes), ("--keep-io-types/--no-keep-io-types", args.keep_io_types),
                                      ("--fp32-auto", args.fp32_auto or None), ("--calibration", args.calibration)) if value is not None]
    names = {getattr(p, "name", p) for p in passes}
    if given and "fp16" not in names:
        what = f"{given[0]} is an option" if len(given) == 1 else f"{', '.join(given)} are options"
        raise OnnxoptError(f"{what} of the fp16 pass, which --passes does not run (e.g. --passes ort-cuda,fp16)")
    if args.calibration and not args.fp32_auto:
        raise OnnxoptError("--calibration goes with --fp32-auto (the inputs it calibrates on)")


def _fp8_passes(args, passes: list[str]) -> list[str]:
    """``--fp8``: fp8-linear after the fp16 pass, for the ort-cuda target only (opt-in, never a preset's)."""
    if args.fp8_calibration and not args.fp8:
        raise OnnxoptError("--fp8-calibration goes with --fp8")
    if not args.fp8:
        return []
    if args.target != "ort-cuda" and "ort-cuda" not in passes:
        raise OnnxoptError("--fp8 is for --target ort-cuda (com.microsoft GemmFloat8); TensorRT makes its own FP8 choices")
    return [] if "fp8-linear" in passes else ["fp8-linear"]


def _fp8_options(args, inputs) -> dict:
    return {"calibration": args.fp8_calibration, "calibration_inputs": inputs} if args.fp8 else {}


def _fp16_options(args) -> dict:
    options = {
        "low_precision": args.low_precision,
        "fp32_ops": tuple(filter(None, (args.fp32_ops or "").split(","))) or None,
        "fp32_nodes": tuple(filter(None, (args.fp32_nodes or "").split(","))) or None,
        "keep_io_types": args.keep_io_types,
        "fp32_auto": args.fp32_auto or None,
        "calibration": args.calibration,
    }
    return {k: v for k, v in options.items() if v is not None}


def cmd_passes(args) -> int:
    passes = registry.available_passes()
    width = max(len(n) for n in list(passes) + list(registry.PRESETS))
    print("passes:")
    for name, cls in passes.items():
        targets = "" if cls.targets == frozenset({"ort-cuda", "tensorrt"}) else f" [{', '.join(sorted(cls.targets))}]"
        print(f"  {name.ljust(width)}  {cls.description}{targets}")
    print("presets:")
    for preset in registry.PRESETS.values():
        print(f"  {preset.name.ljust(width)}  {preset.description}: {', '.join(preset.passes)}")
    return EXIT_OK


def cmd_info(args) -> int:
    from collections import Counter

    from onnxopt.loading import load_model

    model = load_model(args.model)
    g = model.graph
    print(f"{args.model}: opset {model.opset}, {len(g.nodes)} nodes, {model.weights_nbytes() / 1e6:.1f} MB of weights")
    for label, tensors in (("input", g.inputs), ("output", g.outputs)):
        for t in tensors:
            print(f"  {label} {t.name}: {t.dtype} {t.shape}")
    ops = Counter(n.op if n.domain in ("", None, "ai.onnx") else f"{n.domain}.{n.op}" for n in g.nodes)
    print("  ops: " + ", ".join(f"{op} {count}" for op, count in ops.most_common()))
    return EXIT_OK


def cmd_bench(args) -> int:
    from onnxopt.bench import bench, bench_ablation, build_ablation
    from onnxopt.runners.ort_cuda import _require_cuda
    from onnxopt.verify import InputSpec

    if args.build_only and not args.ablation:
        raise OnnxoptError("--build-only goes with --ablation")
    for path in filter(None, (args.json, args.markdown)):
        check_not_read(path, args.models)
    if not args.build_only:
        _require_cuda()  # fail with the install hint before loading or building anything
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.cuda_graph]
    labels = args.labels.split(",") if args.labels else None
    inputs = InputSpec(shapes=dict(args.shape), dims=dict(args.dim))
    if args.ablation:
        names = [n for n in args.ablation.split(",") if n.strip()]
        registry.expand(names)
        source, extra = args.models[0], args.models[1:]
        work = args.work or Path(source).with_name(Path(source).stem + ".ablation")
        if args.build_only:
            for step in build_ablation(source, names, work):
                print(f"{step.label}: {step.path}" + (f" ({step.rewritten})" if step.rewritten else ""))
            return EXIT_OK
        _, report = bench_ablation(source, names, work, extra=extra, extra_labels=labels, inputs=inputs, cuda_graph=modes,
                                   warmup=args.warmup, runs=args.runs, prefer_nhwc=args.prefer_nhwc)
    else:
        report = bench(args.models, labels, inputs=inputs, cuda_graph=modes, warmup=args.warmup, runs=args.runs,
                       prefer_nhwc=args.prefer_nhwc)
    text = report.markdown()
    print(text)
    for path, content in ((args.json, report.to_json()), (args.markdown, text + "\n")):
        if path:
            try:
                path.write_text(content)
            except OSError as exc:
                raise OnnxoptError(f"{path}: cannot write: {exc.strerror or exc}")
    return EXIT_OK


def cmd_diff(args) -> int:
    from onnxopt.diff import diff
    from onnxopt.verify import InputSpec, Tolerance

    if args.bisect and not args.passes:
        raise OnnxoptError("--bisect needs --passes (the passes that made the optimized model, e.g. ort-cuda,fp16)")
    if args.passes and not args.bisect:
        raise OnnxoptError("--passes goes with --bisect")
    if args.optimized is None and not args.bisect:
        raise OnnxoptError("give the optimized model to compare, or --bisect --passes ...")
    passes = [p for p in (args.passes or "").split(",") if p.strip()]
    if args.json:
        check_not_read(args.json, [args.source, args.optimized], args.inputs)
    report = diff(args.source, args.optimized, runtime=args.runtime, tolerance=Tolerance(args.atol, args.rtol),
                  inputs=InputSpec(shapes=dict(args.shape), dims=dict(args.dim)), feeds_path=args.inputs,
                  bisect=passes or None, prefer_nhwc=args.prefer_nhwc, precision=args.precision, seed=args.seed)
    print(report.table())
    if args.json:
        try:
            args.json.write_text(report.to_json())
        except OSError as exc:
            raise OnnxoptError(f"{args.json}: cannot write: {exc.strerror or exc}")
    return EXIT_OK if report.ok else EXIT_VERIFY_FAILED


def cmd_build(args) -> int:
    from onnxopt.runners.tensorrt import build_engine

    profiles = dict(args.profile)
    if len(profiles) != len(args.profile):
        raise OnnxoptError("--profile names the same input twice")
    info = build_engine(args.input, args.output, precision=args.precision, profiles=profiles, timing_cache=args.timing_cache,
                        workspace=args.workspace, dims=dict(args.dim))
    print(info.summary())
    return EXIT_OK


COMMANDS = {"optimize": cmd_optimize, "passes": cmd_passes, "info": cmd_info, "bench": cmd_bench, "diff": cmd_diff}
COMMANDS["build"] = cmd_build
COMMANDS["generate"] = cmd_generate
COMMANDS["serve"] = lambda args: __import__("onnxopt.serve.command", fromlist=["cmd_serve"]).cmd_serve(args)


def _one_line(message: str) -> str:
    """An error message as one line: a newline can only come from a name the user gave (a path), shown escaped."""
    return message.replace("\r", "\\r").replace("\n", "\\n")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, its one line printed)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    try:
        with _quiet_libraries(not args.debug), checking(args.debug):  # --debug: property claims are checked
            return COMMANDS[args.command](args)
    except OnnxoptError as exc:
        if args.debug:
            raise
        print(f"onnxopt: error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("onnxopt: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug in onnxopt: still one line, the traceback on request
        if args.debug:
            raise
        if (why := out_of_memory(exc)) is not None:  # the request is too big for this machine, not a bug
            print(f"onnxopt: error: {_one_line(why)}", file=sys.stderr)
            return EXIT_BAD_INPUT
        first = next((line for line in str(exc).splitlines() if line.strip()), "")  # one line, as the contract says
        print(f"onnxopt: internal error: {type(exc).__name__}: {first} (rerun with --debug for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


def out_of_memory(exc: BaseException) -> str | None:
    """One line for an allocation that failed in ONNX Runtime or NumPy, else None."""
    text = str(exc)
    if isinstance(exc, MemoryError):
        return f"out of memory ({text or 'MemoryError'}): try a smaller size"
    torch_cpu = "can't allocate memory" in text  # torch's CPU allocator (the initial latents of a huge size)
    if "Failed to allocate memory" not in text and "out of memory" not in text.lower() and not torch_cpu:
        return None
    size = re.search(r"buffer of size (\d+)", text) or re.search(r"tried to allocate (\d+) bytes", text)
    if torch_cpu:
        need = f" ({int(size.group(1)) / 2**30:.1f} GiB)" if size else ""
        return f"out of memory{need}: try a smaller image size"
    need = f" (one buffer of {int(size.group(1)) / 2**30:.1f} GiB)" if size else ""
    return f"ONNX Runtime ran out of memory{need}: try a smaller image size or batch"


@contextlib.contextmanager
def _quiet_libraries(quiet: bool):
    """Polygraphy's and graphsurgeon's log lines ([W] ..., [E] ...) and ONNX Runtime's warnings are
    not for onnxopt's users: what went wrong reaches them as onnxopt's own one line (the libraries
    raise as well as log). --debug shows them."""
    if not quiet:
        yield
        return
    from onnx_graphsurgeon.logger import G_LOGGER as GS_LOGGER
    from polygraphy.logger import G_LOGGER

    silent = max(G_LOGGER.CRITICAL, GS_LOGGER.CRITICAL) + 1
    previous = GS_LOGGER.severity
    GS_LOGGER.severity = silent
    try:
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)  # errors only: they come back as exceptions too
    except ImportError:
        pass
    try:
        with G_LOGGER.verbosity(silent):
            yield
    finally:
        GS_LOGGER.severity = previous


if __name__ == "__main__":
    sys.exit(main())
