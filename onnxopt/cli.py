"""The ``onnxopt`` command.

Exit codes: 0 success; 1 verification failed (nothing written); 2 bad input or usage;
3 internal error (a bug: rerun with --debug for the traceback); 4 a requested fusion found
nothing to fuse under --strict; 130 interrupted (Ctrl-C: nothing written).

Every output of a command is checked before its work against every file it reads, under any name
(symbolic links, hard links, bind mounts), and all of them are written or none
(:mod:`onnxopt.outputs`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import time
from pathlib import Path

from onnxopt.cli_args import fp16_options, write_report
from onnxopt.errors import OnnxoptError

# Nothing heavy is imported at module level: Ctrl-C while onnx, ONNX Runtime or torch import (the
# first seconds of any command) reaches main()'s handler, one line and exit 130.
EXIT_OK, EXIT_VERIFY_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_BROKEN_PIPE = 141  # stdout's reader went away (128 + SIGPIPE), as `git log | head` exits


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line (``onnxopt: error: ...``) and exit 2, like every other bad input."""

    def error(self, message):
        command = self.prog.partition(" ")[2]  # "optimize" for "onnxopt optimize", "" for onnxopt itself
        where = f"{command}: " if command else ""
        self.exit(EXIT_BAD_INPUT, f"onnxopt: error: {where}{message} (see {self.prog} --help)\n")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Each option's default in its help, where it has a value to show (not None, not a flag's
    True/False, not already said)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is None or isinstance(default, bool) or default == argparse.SUPPRESS or "default" in text
                or not action.option_strings):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list) else default
        return f"{text} (default: {shown})"


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


def _version() -> str:
    """The installed distribution's version, else the checkout's (onnxopt.__version__)."""
    from importlib import metadata

    try:
        return metadata.version("onnxopt")
    except metadata.PackageNotFoundError:
        from onnxopt import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="onnxopt", description="Optimize diffusion-model ONNX graphs for ORT CUDA and TensorRT.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks; check every property a pass claims after it")
    parser.add_argument("--version", action="version", version=f"onnxopt {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_optimize_parser(sub)
    _add_bench_and_diff_parsers(sub)
    sub.add_parser("passes", help="list passes and presets")
    info = sub.add_parser("info", help="summarise a model (inputs, outputs, ops, weights) or a pipeline folder")
    info.add_argument("model", help="an .onnx file, or a diffusers/optimum ONNX pipeline folder")
    _add_build_parser(sub)
    _add_generate_parser(sub)
    _add_serve_parser(sub)
    return parser


def _add_optimize_parser(sub) -> None:
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
    low = opt.add_mutually_exclusive_group()
    low.add_argument("--fp16", action="store_true", help="add the fp16 pass (a folder: the VAE guarded, see onnxopt/pipeline/optimize_folder.py)")
    low.add_argument("--bf16", action="store_true",
                     help="add the fp16 pass at bfloat16 (--fp16 --low-precision bfloat16: the range of float32, "
                          "for T5 and the diffusion transformers, whose activations overflow float16)")
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
    trt = opt.add_argument_group("TensorRT engines (a pipeline folder, --target tensorrt)")
    trt.add_argument("--build-engines", action="store_true",
                     help="also write each component's TensorRT engine (model.plan) into the output folder")
    trt.add_argument("--compute-capability", type=_capabilities_arg, action="append", default=[], metavar="X.Y",
                     help="with --build-engines: GPU(s) to build for, e.g. 8.9 (TensorRT-RTX: no GPU needed; default: this GPU)")
    opt.add_argument("--strict", action="store_true", help="fail (exit 4) when a requested fusion finds nothing to fuse")
    opt.add_argument("--explain", action="append", default=[], metavar="PASS",
                     help="print, per candidate site of PASS, where its pattern failed or which condition refused it")
    opt.add_argument("-q", "--quiet", action="store_true", help="do not print the report table")


def _add_bench_and_diff_parsers(sub) -> None:
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


def _add_build_parser(sub) -> None:
    build = sub.add_parser("build", help="build a TensorRT engine through Polygraphy (TensorRT-RTX: on any machine, for --compute-capability)")
    build.add_argument("-i", "--input", required=True, help="the .onnx to build (optimize it with --passes tensorrt first)")
    build.add_argument("-o", "--output", required=True, help="the engine file to write (atomically), e.g. model.plan")
    build.add_argument("--compute-capability", type=_capabilities_arg, action="append", default=[], metavar="X.Y",
                       help="GPU(s) to build for, e.g. 8.9 (RTX 40xx, L4, L40S) or 8.6,12.0; no GPU needed with TensorRT-RTX "
                            "(default: the GPU this runs on)")
    build.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default="fp16",
                       help="strongly typed engine precision; a float32 graph is converted by the fp16 pass (default fp16)")
    build.add_argument("--profile", type=_profile_arg, action="append", default=[], metavar="INPUT=MIN:OPT:MAX",
                       help="shape range of one input, e.g. sample=1x4x64x64:2x4x64x64:4x4x128x128 (one shape: fixed)")
    build.add_argument("--dim", type=_dim_arg, action="append", default=[], metavar="DIM=N",
                       help="value of a symbolic dim for inputs without --profile (default: batch 2, others 8)")
    build.add_argument("--timing-cache", type=Path, help="TensorRT timing cache: read if it exists, written after the build")
    build.add_argument("--workspace", type=_int_arg(1), metavar="MB", help="builder workspace limit in MiB")
    build.add_argument("--report-json", type=Path, help="also write the build report (time, size, I/O types, layers) as JSON")


def _image_side_arg(text: str) -> int:
    """--height/--width: pixels, at most what the latents' shape can hold (a huge side overflowed in torch, exit 3)."""
    from onnxopt.pipeline.folder import MAX_IMAGE_SIDE

    return _int_arg(1, MAX_IMAGE_SIDE)(text)


def _add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="text to image from an ONNX pipeline folder (ORT CPU, CUDA or TensorRT)",
                         formatter_class=DefaultsHelpFormatter)
    gen.add_argument("folder", help="a diffusers/optimum ONNX pipeline folder (model_index.json, unet/, ...)")
    gen.add_argument("--prompt", help="what the image shows (required unless --prompts or --plan)")
    gen.add_argument("--prompts", type=Path, metavar="FILE",
                     help="one prompt a line (blank lines skipped), each generated with the same seed; the images are "
                          "numbered prompt by prompt: -o img.png gives img.png, img-1.png, ...")
    gen.add_argument("--negative-prompt", default=None, help="what it should not show (classifier-free guidance)")
    gen.add_argument("--steps", type=int, default=None,
                     help="denoising steps (default: the folder's pipeline's, as diffusers': 50; SD3 and Flux 28)")
    gen.add_argument("--guidance", type=float, default=None,
                     help="classifier-free guidance scale, 1 or less: no guidance; Flux dev: its embedded guidance "
                          "(default: the folder's pipeline's, as diffusers': 7.5; SD3 7.0; Flux 3.5)")
    gen.add_argument("--scheduler", default=None, help="ddim | euler | dpm++2m | euler-a | dpm++2m-karras | lcm | pndm | unipc; flow-match for SD3 and Flux (diffusers' classes, from the folder's "
                     "config; default: the folder's own scheduler, as diffusers' pipeline runs it)")
    gen.add_argument("--seed", type=int, default=0, help="as diffusers: torch.Generator('cpu').manual_seed(SEED)")
    gen.add_argument("--max-sequence-length", type=int, default=None, metavar="TOKENS",
                     help="SD3 and Flux: the T5 prompt length in tokens (default: diffusers', 256 for SD3, 512 for Flux)")
    gen.add_argument("--height", type=_image_side_arg, metavar="PIXELS",
                     help="image height (default: the UNet's sample_size times the VAE factor)")
    gen.add_argument("--width", type=_image_side_arg, metavar="PIXELS", help="image width (default: the UNet's sample_size times the VAE factor)")
    gen.add_argument("--controlnet-image", type=Path, action="append",
                     help="conditioning image (ControlNet folders only); once per ControlNet, in the order "
                          "controlnet/, controlnet_1/, ...")
    gen.add_argument("--controlnet-scale", type=float, nargs="+", default=[1.0], metavar="SCALE",
                     help="ControlNet conditioning scale: one for all, or one per ControlNet")
    gen.add_argument("--image", type=Path, metavar="PNG",
                     help="init image: img2img (StableDiffusion(XL)Img2ImgPipeline), any size: resized (lanczos, as "
                          "diffusers) to its size rounded down to a multiple of the VAE factor, the output's size; with "
                          "--mask, inpainting on a folder whose UNet is an inpainting one (image and mask resized to "
                          "--height/--width)")
    gen.add_argument("--mask", type=Path, metavar="PNG", help="inpainting mask (white: repaint), as StableDiffusion(XL)InpaintPipeline")
    gen.add_argument("--strength", type=float, default=None,
                     help="how much of --image is repainted, in (0, 1]: int(steps x strength) steps run (default: "
                          "diffusers' pipeline's: 0.8 SD img2img, 0.3 SDXL img2img, 1.0 SD inpainting, "
                          "0.9999 SDXL inpainting)")
    gen.add_argument("--denoising-end", type=float, default=None, metavar="FRACTION",
                     help="SDXL folders: stop after this fraction of the schedule, the latents left noisy "
                          "(diffusers' denoising_end, in (0, 1); default: every step)")
    gen.add_argument("--num-images", type=_int_arg(1, 64), default=1, metavar="N",
                     help="images per prompt (diffusers' num_images_per_prompt: one batch from one generator); "
                          "-o img.png writes img.png, img-1.png, ... img-(N-1).png")
    gen.add_argument("--reuse", metavar="STEPS", help="opt-in approximation: these 0-based steps reuse the previous step's "
                     "prediction instead of running the UNet, e.g. 30-49:2 (onnxopt.pipeline.step_reuse)")
    gen.add_argument("--lora", action="append", default=[], metavar="FILE[:SCALE]",
                     help="a LoRA (.safetensors, diffusers/peft or kohya format) on the UNet and text encoders, its "
                          "scale after the last colon (default 1.0); repeatable")
    gen.add_argument("--provider", choices=["cpu", "cuda", "tensorrt"], default="cpu", help="where the graphs run")
    gen.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", help="cuda/tensorrt: do not capture the step")
    gen.add_argument("--unfused", dest="fused_step", action="store_false", help="UNet + diffusers' scheduler.step (no fused step graph)")
    gen.add_argument("-o", "--output", type=Path,
                     help="the image to write (atomically), in the format its suffix names: .png, .jpg, .webp... "
                          "(required unless --plan)")
    gen.add_argument("--json", type=Path, help="also write the per-stage timings and the generation plan as JSON")
    gen.add_argument("--plan", action="store_true",
                     help="print what the generation would run (components, step graph, sessions) and exit")
    gen.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no timings table")


def _add_serve_parser(sub) -> None:
    from onnxopt.serve.command import add_parser  # imports neither Ray nor the pipeline

    add_parser(sub)


def cmd_generate(args) -> int:
    import json

    from onnxopt.outputs import Inputs, Outputs, staged
    from onnxopt.pipeline import PipelineFolder, images
    from onnxopt.pipeline.runner import (Pipeline, check_request, check_sequence_length, default_sequence_length, fusable,
                                         reuse_steps)
    from onnxopt.pipeline.several import numbered_outputs, read_prompts
    from onnxopt.pipeline.sessions import quiet_sessions

    folder = PipelineFolder.open(args.folder)
    if args.plan:
        return print_generation_plan(folder, args)
    if args.prompt is not None and args.prompts is not None:
        raise OnnxoptError("give --prompt or --prompts, not both")
    missing = [flag for flag, value in (("--prompt", args.prompt if args.prompts is None else ""),
                                        ("-o/--output", args.output)) if value is None]
    if missing:
        raise OnnxoptError(f"generate needs {' and '.join(missing)} (or --plan, which generates nothing)")
    prompts = [args.prompt] if args.prompts is None else read_prompts(args.prompts)
    args.steps = folder.family.default_steps if args.steps is None else args.steps
    guidance_asked = args.guidance is not None
    args.guidance = folder.family.default_guidance if args.guidance is None else args.guidance
    args.scheduler = check_request(folder, steps=args.steps, scheduler=args.scheduler, height=args.height, width=args.width,
                                   controlnet_image=args.controlnet_image, controlnet_scale=args.controlnet_scale,
                                   status=False if args.quiet else None, image=args.image, mask=args.mask,
                                   strength=args.strength, num_images=args.num_images,
                                   denoising_end=args.denoising_end)
    reuse_steps(args.reuse, args.steps)  # a bad schedule is refused before any session exists
    asked = args.max_sequence_length is not None
    if not asked:
        args.max_sequence_length = default_sequence_length(folder)
    check_sequence_length(folder, args.max_sequence_length, asked)
    for image in args.controlnet_image or ():
        images.check_image(image)  # not an image, or a decompression bomb: before any session exists
    if args.json and Path(os.path.realpath(args.json)) == Path(os.path.realpath(args.output)):  # the timings replaced the PNG
        raise OnnxoptError(f"{args.json}: --json is the image -o writes; give another path")
    from onnxopt.lora import parse_lora_argument

    reads = [*(args.controlnet_image or ()), args.image, args.mask, args.prompts,
             *(parse_lora_argument(spec)[0] for spec in args.lora)]
    outputs = Outputs(Inputs().folder(folder.root).files(*reads))
    names = numbered_outputs(args.output, len(prompts) * args.num_images)
    for name in names:
        outputs.file(name, "-o")  # an input's name, whatever its suffix, says so first
    image_format = images.image_format(args.output)  # a suffix Pillow cannot write is refused before the work
    if args.json:
        outputs.file(args.json, "--json")
    with contextlib.nullcontext() if args.debug else quiet_sessions():  # ORT's errors come back as one line
        pipe = Pipeline.load(folder, args.provider, fused_step=args.fused_step and fusable(args.scheduler),
                             cuda_graph=args.cuda_graph, status=False if args.quiet else None, loras=args.lora,
                             guidance=args.guidance, scheduler=args.scheduler,
                             negative_prompt=args.negative_prompt is not None)
        if guidance_asked and not pipe.uses_guidance():
            print("onnxopt: warning: this folder's transformer takes no guidance (Flux schnell): --guidance is "
                  "unused, as in diffusers' FluxPipeline", file=sys.stderr)
        # an init image, a mask and several images are the UNet families' (onnxopt.pipeline.img2img)
        init = {k: v for k, v in (("image", args.image), ("mask", args.mask), ("strength", args.strength),
                                  ("num_images", args.num_images), ("denoising_end", args.denoising_end))
                if v not in (None, 1)}
        results = [pipe(prompt, negative_prompt=args.negative_prompt, steps=args.steps, guidance=args.guidance,
                        scheduler=args.scheduler, seed=args.seed, height=args.height, width=args.width,
                        controlnet_image=args.controlnet_image, controlnet_scale=args.controlnet_scale,
                        progress=not args.quiet, reuse=args.reuse, max_sequence_length=args.max_sequence_length, **init)
                   for prompt in prompts]
    result = results[-1]
    with staged() as stage:  # every image and the timings: all or nothing
        for name, image in zip(names, (image for r in results for image in r.images)):
            stage.write(name, lambda out, image=image: image.save(out, format=image_format))
        if args.json:
            plan = getattr(pipe, "plan", None)  # what the run loaded (Pipeline.from_plan's)
            report = dict(result.timings) if len(results) == 1 else {"runs": [r.timings for r in results]}
            report.update({"plan": plan.as_dict()} if plan is not None else {})
            stage.text(args.json, json.dumps(report, indent=2) + "\n")
    if not args.quiet:
        print_generation_summary(args.output, names, results)
    return EXIT_OK


def print_generation_plan(folder, args) -> int:
    """``generate --plan``: what a run of these options would load and run, generating nothing."""
    from onnxopt.pipeline.plan import PlanOptions, folder_scheduler_name, plan_generation

    options = PlanOptions(fused_step=args.fused_step, cuda_graph=args.cuda_graph,
                          scheduler=args.scheduler or folder_scheduler_name(folder),
                          guidance=folder.family.default_guidance if args.guidance is None else args.guidance)
    print(plan_generation(folder, args.provider, options).text())
    return EXIT_OK


def print_generation_summary(output, names: list, results: list) -> None:
    """The files written and the last run's stage timings, two lines; the cold start is the first run's
    (only the first image of a load has one)."""
    t, result = results[-1].timings, results[-1]
    cold = results[0].timings.get("cold_start_s")
    wrote = f"{output}" + (f" and {len(names) - 1} more ({names[-1].name})" if len(names) > 1 else "")
    print(f"wrote {wrote} ({result.image.width}x{result.image.height}, {t['steps']} steps, {t['step']})")
    print(f"  text encoder {t['text_encoder_s'] * 1e3:.1f} ms | step {t['step_mean_s'] * 1e3:.2f} ms mean, "
          f"first {t['first_step_s'] * 1e3:.1f} ms | VAE decode {t['vae_decode_s'] * 1e3:.1f} ms | "
          f"total {t['total_s']:.2f} s | sessions {t['session_creation_s']:.2f} s"
          + (f" | cold start {cold:.2f} s" if cold is not None else ""))


def model_inputs(*paths) -> "Inputs":
    """Every file the models at ``paths`` read (each .onnx and its external data), for the output checks."""
    from onnxopt.loading import load_model
    from onnxopt.outputs import Inputs

    inputs = Inputs()
    for path in filter(None, paths):
        inputs.files(path)
        if Path(path).is_file():
            inputs.model(load_model(path))
    return inputs


def _capabilities_arg(text: str) -> list[tuple[int, int]]:
    from onnxopt.runners.tensorrt import parse_compute_capability

    try:
        return [parse_compute_capability(part) for part in text.split(",") if part.strip()] or [parse_compute_capability(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))


def _profile_arg(text: str):
    from onnxopt.runners.tensorrt import parse_profile

    try:
        return parse_profile(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))


def cmd_optimize(args) -> int:
    from onnxopt import registry
    from onnxopt.api import optimize
    from onnxopt.loading import load_model
    from onnxopt.outputs import Inputs, Outputs, staged
    from onnxopt.progress import status
    from onnxopt.report import process_memory
    from onnxopt.saving import check_destination, planned_writes, save_model
    from onnxopt.verify import InputSpec, Tolerance, check_dim_names, load_feeds

    _resolve_bf16(args)
    if args.fp8 and Path(args.input).is_dir():
        raise OnnxoptError("--fp8 rewrites one model; for a pipeline folder, run it on unet/step.onnx "
                           "(benchmarks/pipeline_gpu.py --fp8 writes unet/step.fp8.onnx)")
    if Path(args.input).is_dir():  # a pipeline folder: each component with its preset
        from onnxopt.pipeline.optimize_folder import cli_optimize_folder

        return cli_optimize_folder(args)
    if args.cfg_late:
        raise OnnxoptError("--cfg-late rewrites a pipeline folder's step graph: give a folder as --input")
    if args.build_engines or args.compute_capability:
        raise OnnxoptError("--build-engines is for a pipeline folder; for one model: onnxopt build -i MODEL -o MODEL.plan")
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
    load_start = time.perf_counter()
    source = load_model(args.input)  # lazy: weights stay on disk; optimize() works on a copy
    load_seconds = time.perf_counter() - load_start
    check_dim_names(source, dict(args.dim))
    # every file written (model, data files, companions, report) against every file read, before the work
    outputs = Outputs(Inputs().model(source).files(args.calibration, args.fp8_calibration))
    for path in planned_writes(source, args.output, external_data=args.external_data):
        outputs.file(path, "-o")
    if args.report_json:
        outputs.file(args.report_json, "--report-json")
    for path in (args.calibration, args.fp8_calibration):
        if path:  # refused now, not only when (or if) a pass gets to read it: fp8-linear may refuse every site first
            load_feeds(path, source)
    inputs = InputSpec(shapes=dict(args.shape), dims=dict(args.dim))
    start = time.perf_counter()
    explained = _explained_passes(args.explain, expanded)
    with status(not args.quiet) as line:  # on a terminal: the pass being run
        line.show(Path(args.input).name)
        model, report = optimize(
            source, passes, verify=args.verify, tolerance=Tolerance(args.atol, args.rtol), inputs=inputs, strict=args.strict,
            options={"fp16": fp16_options(args), "fp8-linear": _fp8_options(args, inputs)}, explain=explained,
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
    with staged() as stage:  # the model's files are renamed into place by save_model, the report right after
        info = save_model(model, args.output, external_data=args.external_data)
        report.save_seconds, report.memory_after_save = time.perf_counter() - save_start, process_memory()
        if args.report_json:
            stage.text(args.report_json, report.to_json())
    where = f"{info.path}" + (f" (+ {info.data_path.name})" if info.data_path else "")
    if not args.quiet:
        print(f"wrote {where}: {info.weights_nbytes / 1e6:.1f} MB of weights, {time.perf_counter() - start:.1f} s in all")
        print(f"  load {load_seconds:.1f} s, passes {report.seconds:.1f} s, save {report.save_seconds:.1f} s; "
              f"peak RSS {report.memory_after_save.peak_bytes / 1e6:.0f} MB; CPU {time.process_time():.1f} s (this process, in all)")
        for name, part in info.companions.items():  # context-kv: the graph run once per prompt, beside it
            print(f"wrote {part.path}" + (f" (+ {part.data_path.name})" if part.data_path else "") + f": companion '{name}'")
    return EXIT_OK


def _explained_passes(names: list[str], passes: list[str]) -> set[str]:
    """--explain's passes (comma-separated or repeated), each one the run may include: listed, a
    preset's step, auto-inserted for a requirement, or a pass's follower."""
    from onnxopt import registry
    from onnxopt.manager import passes_in_run

    explained = {n.strip() for name in names for n in name.split(",") if n.strip()}
    possible = passes_in_run(passes) if explained else set()
    for name in sorted(explained):
        registry.get_pass(name)  # an unknown name: exit 2 with a suggestion
        if name not in possible:
            raise OnnxoptError(f"--explain {name}: the run does not include that pass (passes: {', '.join(dict.fromkeys(passes))})")
    return explained


def _resolve_bf16(args) -> None:
    """``--bf16`` is the fp16 pass at bfloat16: ``--fp16 --low-precision bfloat16``."""
    if args.bf16:
        if args.low_precision == "float16":
            raise OnnxoptError("--bf16 is the fp16 pass at bfloat16: give --bf16 or --low-precision float16, not both")
        args.fp16, args.low_precision = True, "bfloat16"


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


def cmd_passes(args) -> int:
    from onnxopt import registry

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

    if Path(args.model).is_dir():
        return _info_folder(args.model)
    model = load_model(args.model)
    g = model.graph
    print(f"{args.model}: opset {model.opset}, {len(g.nodes)} nodes, {model.weights_nbytes() / 1e6:.1f} MB of weights")
    for label, tensors in (("input", g.inputs), ("output", g.outputs)):
        for t in tensors:
            print(f"  {label} {t.name}: {t.dtype} {t.shape}")
    ops = Counter(n.op if n.domain in ("", None, "ai.onnx") else f"{n.domain}.{n.op}" for n in g.nodes)
    print("  ops: " + ", ".join(f"{op} {count}" for op, count in ops.most_common()))
    return EXIT_OK


def _info_folder(path) -> int:
    """A pipeline folder: its class and kind, then each component's graphs with their inputs,
    outputs and size on disk (headers only: no weight is read)."""
    import onnx

    from onnxopt.pipeline import PipelineFolder

    folder = PipelineFolder.open(path)  # every path checked before any file is read
    name = folder.index.get("_class_name", "no _class_name")
    print(f"{folder.root}: {name} ({folder.kind} pipeline), {len(folder.components)} components, "
          f"{sum(c.nbytes() for c in folder.components.values()) / 1e6:.1f} MB")
    for component in folder.components.values():
        graphs = [component.model] + sorted(p for p in component.folder.glob("*.onnx") if p != component.model)
        for graph in graphs:
            proto = onnx.load(str(graph), load_external_data=False)
            size = graph.stat().st_size + (sum(p.stat().st_size for p in component.external_data) if graph == component.model else 0)
            print(f"  {component.name}/{graph.name}: opset {_opset(proto)}, {len(proto.graph.node)} nodes, {size / 1e6:.1f} MB")
            for label, values in (("input", proto.graph.input), ("output", proto.graph.output)):
                for v in values:
                    print(f"    {label} {v.name}: {_value_type(v)}")
    return EXIT_OK


def _opset(proto) -> int | str:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), "?")


def _value_type(value) -> str:
    import onnx

    t = value.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
    return f"{onnx.helper.tensor_dtype_to_np_dtype(t.elem_type) if t.elem_type else '?'} {dims}"


def cmd_bench(args) -> int:
    from onnxopt.bench import bench, bench_ablation, build_ablation
    from onnxopt.runners.ort_cuda import _require_cuda
    from onnxopt.verify import InputSpec

    from onnxopt import registry
    from onnxopt.outputs import Outputs, staged

    if args.build_only and not args.ablation:
        raise OnnxoptError("--build-only goes with --ablation")
    inputs = model_inputs(*args.models)
    if args.ablation:  # its models are read (reused) from the work folder
        inputs.folder(args.work or Path(args.models[0]).with_name(Path(args.models[0]).stem + ".ablation"))
    outputs = Outputs(inputs)
    for path, flag in ((args.json, "--json"), (args.markdown, "--markdown")):
        if path:
            outputs.file(path, flag)
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
    with staged() as stage:  # both reports or neither
        for path, content in ((args.json, report.to_json()), (args.markdown, text + "\n")):
            if path:
                stage.text(path, content)
    return EXIT_OK


def cmd_diff(args) -> int:
    from onnxopt.diff import diff
    from onnxopt.outputs import Outputs
    from onnxopt.verify import InputSpec, Tolerance

    if args.bisect and not args.passes:
        raise OnnxoptError("--bisect needs --passes (the passes that made the optimized model, e.g. ort-cuda,fp16)")
    if args.passes and not args.bisect:
        raise OnnxoptError("--passes goes with --bisect")
    if args.optimized is None and not args.bisect:
        raise OnnxoptError("give the optimized model to compare, or --bisect --passes ...")
    passes = [p for p in (args.passes or "").split(",") if p.strip()]
    if args.json:
        Outputs(model_inputs(args.source, args.optimized).files(args.inputs)).file(args.json, "--json")
    report = diff(args.source, args.optimized, runtime=args.runtime, tolerance=Tolerance(args.atol, args.rtol),
                  inputs=InputSpec(shapes=dict(args.shape), dims=dict(args.dim)), feeds_path=args.inputs,
                  bisect=passes or None, prefer_nhwc=args.prefer_nhwc, precision=args.precision, seed=args.seed)
    print(report.table())
    if args.json:
        write_report(args.json, report.to_json())
    return EXIT_OK if report.ok else EXIT_VERIFY_FAILED


def cmd_build(args) -> int:
    import json

    from onnxopt.runners.tensorrt import build_engine

    from onnxopt.outputs import Outputs

    profiles = dict(args.profile)
    if len(profiles) != len(args.profile):
        raise OnnxoptError("--profile names the same input twice")
    # the engine may not be the model, its data or the timing cache (which is read, then written)
    outputs = Outputs(model_inputs(args.input).files(args.timing_cache))
    outputs.file(args.output, "-o")
    if args.report_json:
        outputs.file(args.report_json, "--report-json")
    info = build_engine(args.input, args.output, precision=args.precision, profiles=profiles, timing_cache=args.timing_cache,
                        workspace=args.workspace, dims=dict(args.dim),
                        compute_capabilities=[c for group in args.compute_capability for c in group])
    print(info.summary())
    if args.report_json:
        write_report(args.report_json, json.dumps(info.as_dict(), indent=2) + "\n")
    return EXIT_OK


COMMANDS = {"optimize": cmd_optimize, "passes": cmd_passes, "info": cmd_info, "bench": cmd_bench, "diff": cmd_diff}
COMMANDS["build"] = cmd_build
COMMANDS["generate"] = cmd_generate


def cmd_serve(args) -> int:
    from onnxopt.serve.command import cmd_serve as serve  # Ray is imported only by this command

    return serve(args)


COMMANDS["serve"] = cmd_serve


def _one_line(message: str) -> str:
    """An error message as one line: a newline can only come from a name the user gave (a path), shown escaped."""
    return message.replace("\r", "\\r").replace("\n", "\\n")


@contextlib.contextmanager
def _interrupts_between_imports():
    """Ctrl-C while a module imports is answered when the import is over. Raised inside a C
    extension's initialisation (onnx's, while it calls back into Python), KeyboardInterrupt left it
    half made and the process died of SIGSEGV instead of exit 130. A deferred one is delivered
    again, 20 ms later, by ``_thread.interrupt_main``, until no import is under way."""
    import _thread
    import signal
    import threading

    def importing(frame) -> bool:
        while frame is not None:
            if frame.f_code.co_filename.startswith("<frozen importlib"):
                return True
            frame = frame.f_back
        return False

    def on_interrupt(signum, frame):
        if importing(frame):
            threading.Timer(0.02, _thread.interrupt_main).start()
            return
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGINT, on_interrupt)
    except ValueError:  # not the main thread: signals are not ours to handle
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def main(argv: list[str] | None = None) -> int:
    debug = False
    try:  # from the first import on: Ctrl-C at any moment is one line and exit 130
        with _interrupts_between_imports():
            try:
                args = build_parser().parse_args(argv)
            except SystemExit as exc:  # --help (0) or a usage error (2, its one line printed)
                return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
            debug = args.debug
            from onnxopt.library_logs import quiet_libraries
            from onnxopt.properties import checking
            from onnxopt.runtime import set_ort_logging

            set_ort_logging(args.debug)  # ONNX Runtime's own log lines: only with --debug
            with quiet_libraries(not args.debug), checking(args.debug):  # --debug: property claims are checked
                return COMMANDS[args.command](args)
    except OnnxoptError as exc:
        if debug:
            raise
        print(f"onnxopt: error: {_error_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return _interrupted()
    except BrokenPipeError:  # `onnxopt ... | head`: the reader stopped; say nothing, as a SIGPIPE'd tool does
        return _reader_gone()
    except Exception as exc:  # a bug in onnxopt: still one line, the traceback on request
        if debug:
            raise
        if (why := out_of_memory(exc)) is not None:  # the request is too big for this machine, not a bug
            print(f"onnxopt: error: {_one_line(why)}", file=sys.stderr)
            return EXIT_BAD_INPUT
        first = next((line for line in str(exc).splitlines() if line.strip()), "")  # one line, as the contract says
        print(f"onnxopt: internal error: {type(exc).__name__}: {first} (rerun with --debug for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


def _reader_gone() -> int:
    """stdout's reader closed it: later writes (Python's own flush at exit included) go nowhere, and
    the exit status is the shell's for a process ended by SIGPIPE (128 + 13)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def _interrupted() -> int:
    """Ctrl-C: the message starts on a line of its own; a second Ctrl-C while it prints is ignored."""
    import signal

    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        previous = None
    try:
        if "onnxopt.progress" in sys.modules:
            sys.modules["onnxopt.progress"].end_line()  # a status line or tqdm bar left unfinished
        print("onnxopt: interrupted", file=sys.stderr)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return EXIT_INTERRUPTED


def _error_line(exc: OnnxoptError) -> str:
    """The error as one line. A message onnxopt composed of several lines (a fusion's near misses
    under --strict) is joined with "; "; a newline in a name the user gave is shown escaped."""
    from onnxopt.errors import PassNotApplicableError

    if isinstance(exc, PassNotApplicableError):
        return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return _one_line(str(exc))


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


if __name__ == "__main__":
    sys.exit(main())
