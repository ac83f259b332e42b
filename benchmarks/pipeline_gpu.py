"""Text to image end to end on one GPU: onnxopt vs diffusers eager vs diffusers + torch.compile.

    python -m benchmarks.pipeline_gpu --kind sd15 --work /tmp/pipe-bench --budget 540 --out benchmarks/results/pipeline-sd15
    python -m benchmarks.pipeline_gpu --kind sdxl --work /tmp/pipe-bench --budget 540 --out benchmarks/results/pipeline-sdxl
    python -m benchmarks.pipeline_gpu --kind sd15-controlnet --ablation --work /tmp/pipe-bench --out ...
    python -m benchmarks.pipeline_gpu --kind sd15-multi-controlnet --ablation --work /tmp/pipe-bench --out ...
    python -m benchmarks.pipeline_gpu --kind sd15 --dry-run --work /tmp/pipe-dry   # CPU, tiny, fp32: every step once
    python -m benchmarks.pipeline_gpu --kind sdxl --fp8 --skip torch-eager --work /tmp/pipe-bench --out ...  # + the fp8 row
    python -m benchmarks.pipeline_gpu --kind sd35-medium --work /tmp/pipe-bench --budget 540 --out benchmarks/results/pipeline-sd35
    python -m benchmarks.pipeline_gpu --kind sd15-img2img --work /tmp/pipe-bench --budget 530 --out ...
    python -m benchmarks.pipeline_gpu --kind sd15-inpaint --work /tmp/pipe-bench --budget 530 --out ...
    python -m benchmarks.pipeline_gpu --kind flux-schnell --work /tmp/pipe-bench --scratch /dev/shm/pipe-bench --budget 530 --out ...
    python -m benchmarks.pipeline_gpu --kind flux-dev --work /tmp/pipe-bench --scratch /dev/shm/pipe-bench --budget 530 --out ...

Same random weights (``models.pipelines.build_torch_pipeline(kind, "full", seed)``) and seed on
every side; SD 1.5 at 512x512, DDIM, 50 steps; SDXL at 1024x1024, Euler (its own scheduler; its
config leaves DDIM's clip_sample on), 30 steps; guidance 7.5; one image.

SD3.5-Medium (sd35-medium: ``models.sd3.build_torch_sd3_pipeline(size="full")``: CLIP-L, OpenCLIP bigG,
T5-XXL at 256 tokens, the 2.5 B MMDiT, the 16-channel VAE) at 1024x1024, its own
FlowMatchEulerDiscreteScheduler (shift 3), 28 steps, guidance 4.5, bf16: the torch rows in bfloat16,
onnxopt's folder optimized with the fp16 pass at bfloat16 (``low_precision="bfloat16"``; float16
overflows T5). diffusers' StableDiffusion3Pipeline defaults are 28 steps and guidance 7.0; Stability's
model card runs SD3.5-Medium at 40 steps, guidance 4.5. torch.compile compiles the transformer.

img2img (sd15-img2img): the sd15 kind's weights and folder (reused from <work>/sd15 when that kind built
them), a seeded synthetic init image (benchmarks/pipeline_init_image.py) at 512x512, strength 0.75,
DDIM 50 steps, so int(50 x 0.75) = 37 steps run; diffusers' StableDiffusionImg2ImgPipeline, onnxopt's
``image=``/``strength=`` (what ``onnxopt generate --image --strength`` calls). Inpainting
(sd15-inpaint): SD 1.5 with a 9-channel inpainting UNet (``models.pipelines`` kind sd15-inpaint:
stable-diffusion-v1-5/stable-diffusion-inpainting's config), the same init image and a white ellipse as
the mask, 512x512, DDIM 50 steps, strength 1.0; StableDiffusionInpaintPipeline, onnxopt's
``image=``/``mask=``. diffusers draws the encoder's sample and the noise in float32 there, cast to
float16 (pipeline_init_image.float32_draws), as its float32 reference and onnxopt draw them.

Flux (flux-schnell: 1024x1024, 4 steps, no guidance, T5 at 256 tokens; flux-dev: 1024x1024, 28 steps,
embedded guidance 3.5, 512 tokens), bf16: ``models.flux_pipeline`` weights (11.9 B transformer, T5-XXL,
CLIP-L, the 16-channel VAE); the folder is exported in parts (benchmarks/pipeline_flux.py: the
transformer streamed, T5 in bfloat16), its source on --scratch when the work disk cannot hold it beside
the optimized folder, and removed once optimized; diffusers' FluxPipeline in bfloat16 from the same
seeded construction, the transformer compiled. The float32 reference is that pipeline cast to float32
(the same weights), with model CPU offload.

The torch rows need no ONNX folder, so on a machine with two GPUs the two sides of a kind run at
once, each rerun until it prints its table (the machine's RAM and /dev/shm hold both):

    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.pipeline_gpu --kind flux-dev --side torch --work /tmp/pt --budget 5000 --out OUT/torch
    CUDA_VISIBLE_DEVICES=1 python -m benchmarks.pipeline_gpu --kind flux-dev --side onnx --work /tmp/po \
        --scratch /dev/shm/po --budget 5000 --out OUT/onnx
    python -m benchmarks.pipeline_gpu --kind flux-dev --side onnx --work /tmp/po --scratch /dev/shm/po \
        --resume-from OUT/torch --out OUT/all

The ONNX side's rows wait for the float32 reference (``pending-<row>.npz``) and are scored by the last
command, which takes the torch rows and the reference. T5's export (10 minutes) can run beside the
transformer's: start the ONNX side once with ``--skip "folder: transformer"`` and once with
``--skip "folder: text_encoder_2"``, at once (each records its step without dropping the other's),
then rerun it without --skip. On an x4 machine both Flux kinds ran this way in 15 minutes
(benchmarks/results/h100x4-2026-11-27-flux-pipelines/).

Steps (each resumable: its result is recorded in <work>/<kind>/results.json and skipped when
present; the script stops between steps after --budget seconds, so a run spans several
10-minute calls of the device machine -- rerun the same command until it prints the table; a
full-size Flux step runs only as the first step of a call):

  folder: <part>  Flux only: the transformer (streamed) and T5, each exported on its own (a call each)
  folder          export the fp32 ONNX folder (TorchScript, dynamic axes) from those weights (Flux:
                  CLIP-L, the VAE and the pipeline files around the parts; sd15-img2img: the sd15
                  kind's folder when <work>/sd15 holds it)
  optimize        ``optimize_folder(--target ort-cuda, --fp16)`` (+ unet/step.onnx); Flux: then the
                  source folder is removed (disk)
  torch-fp32      diffusers fp32 on the GPU: the quality reference (final latents and image saved)
  torch-eager     diffusers fp16 eager: median of 5 end to end after one warm-up, per stage, quality
  torch-compile   diffusers fp16, UNet under torch.compile(mode="reduce-overhead", fullgraph=True),
                  channels_last, torch._inductor.config.conv_1x1_as_mm = True; cold start = the
                  first image including compilation; then as above
  onnxopt         Pipeline.load(optimized folder, "cuda", cuda_graph=True); cold start = load +
                  session creation + first image (with the graph capture); then as above

  cfg-late graph  with --ablation (not SDXL): unet/step.cfg_late.onnx beside step.onnx
  fp8 step graph  with --fp8 (opt-in lever): unet/step.fp8.onnx, step.onnx with fp8-linear, calibrated on
                  the step inputs of one image of another prompt and seed (recorded on the host loop);
                  then the ablation row FP8_ROW, timed and compared with fp32 like the others
  onnxopt: <row>  with --ablation: the rows of ABLATION (fused step alone, + text side once per
                  prompt, + hint once per image, + one graph per step, two streams, cfg-late,
                  launch timing, + step reuse), each a Pipeline.load of the same optimized folder
                  with that row's switches; ControlNet rows only for ControlNet kinds.

ControlNet (sd15-controlnet): a seeded edge map as the control image on every side; diffusers'
StableDiffusionControlNetPipeline with the UNet and the ControlNet under torch.compile, and its
step time is the ControlNet call plus the UNet call. Two ControlNets (sd15-multi-controlnet): two
seeded edge maps and the scales (1.0, 0.5) on every side; diffusers' MultiControlNetModel (compiled
whole, as diffusers' recipe compiles ``pipe.controlnet``); onnxopt sums the residuals in its step
graph (onnxopt.pipeline.multi_controlnet).

Per stage: text encoder (per prompt, both CFG rows), mean denoising step, VAE encode (init image
kinds), VAE decode; for torch
from one extra run with synchronizing hooks (the timed runs have none), for onnxopt from its own
timings. Quality: PSNR of the uint8 image and max abs of the final latents against torch fp32,
for onnxopt and for torch fp16 (the target: onnxopt deviates at most 1.5x torch fp16's deviation).

This module needs CUDA (except --dry-run) and is never imported by the tests.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.pipeline_flux import FLUX_KINDS, STREAMED_PARTS
from benchmarks.pipeline_table import ablation_table, table
from benchmarks.unet_gpu import Steps

SETTINGS = {
    "sd15": dict(height=512, width=512, steps=50, scheduler="ddim"),
    "sdxl": dict(height=1024, width=1024, steps=30, scheduler="euler"),
    "sd15-controlnet": dict(height=512, width=512, steps=50, scheduler="ddim"),
    "sd15-multi-controlnet": dict(height=512, width=512, steps=50, scheduler="ddim"),
    "sd35-medium": dict(height=1024, width=1024, steps=28, scheduler="flow-match", guidance=4.5, precision="bf16"),
    # model: the models.pipelines kind whose weights (and folder) it runs
    "sd15-img2img": dict(height=512, width=512, steps=50, scheduler="ddim", strength=0.75, model="sd15",
                         defaults="diffusers' StableDiffusionImg2ImgPipeline defaults: strength 0.8, the folder's "
                                  "scheduler (PNDM for SD 1.5), 50 steps, guidance 7.5"),
    "sd15-inpaint": dict(height=512, width=512, steps=50, scheduler="ddim", strength=1.0, mask=True,
                         defaults="diffusers' StableDiffusionInpaintPipeline defaults: strength 1.0, the folder's "
                                  "scheduler (PNDM), 50 steps, guidance 7.5"),
    "flux-schnell": dict(height=1024, width=1024, steps=4, scheduler="flow-match", guidance=0.0, precision="bf16",
                         max_sequence_length=256,
                         defaults="diffusers' FluxPipeline defaults: 28 steps, guidance 3.5, 512 T5 tokens; "
                                  "FLUX.1-schnell's model card: 4 steps, guidance 0, 256 tokens (used here)"),
    "flux-dev": dict(height=1024, width=1024, steps=28, scheduler="flow-match", guidance=3.5, precision="bf16",
                     max_sequence_length=512,
                     defaults="diffusers' FluxPipeline defaults: the same (28 steps, guidance 3.5, 512 T5 tokens, "
                              "1024x1024)"),
}
SD3_KINDS = ("sd35-medium",)
INIT_IMAGE_SEED = 7  # the synthetic init picture's (not the generation's seed)
MULTI_CONTROLNET_SCALES = [1.0, 0.5]  # sd15-multi-controlnet: one conditioning scale per ControlNet
# The ablation (--ablation): the onnxopt pipeline as each rewrite is added, from one optimized folder.
# name -> (Pipeline.load keyword arguments, call keyword arguments, ControlNet kinds only).
SEPARATE = dict(merged_step=False, two_streams=False)
ABLATION = {
    "unfused (UNet graph + diffusers' step on the host)": (dict(fused_step=False), {}, False),
    "fused step, CUDA graph": (dict(context_kv=False, controlnet_hint=False, **SEPARATE), {}, False),
    "+ text side once per prompt": (dict(context_kv=True, controlnet_hint=False, **SEPARATE), {}, False),
    "text encoders on model.onnx (no static graph: not captured)": (dict(static_text=False), {}, False),
    "+ hint once per image": (dict(context_kv=True, controlnet_hint=True, **SEPARATE), {}, True),
    "+ one graph per step": (dict(merged_step=True, two_streams=False), {}, True),
    "two streams instead of one graph (the default)": (dict(two_streams=True, merged_step=False), {}, True),
    "+ cfg-late (step.cfg_late.onnx)": (dict(step_file="step.cfg_late.onnx", **SEPARATE), {}, False),
    "one graph per step, launch timing (host part of a step)": (dict(launch_timing=True, two_streams=False), {}, False),
    "+ step reuse: every 2nd of the last 40% (opt-in)": ({}, dict(reuse="late"), False),
}
# --fp8: the opt-in float8 Linears (passes/fp8_linear.py) as one more ablation row.
FP8_ROW = "fp16 + fp8 Linear (opt-in)"
FP8_STEP_FILE = "step.fp8.onnx"
CALIBRATION_PROMPT = "a watercolor painting of a lighthouse on a cliff at sunset"  # not the timed prompt
CALIBRATION_FEEDS = 6  # step inputs recorded for the fp8 scales, spread over the steps
DRY = dict(height=32, width=32, steps=3)
PROMPT = "a photograph of an astronaut riding a horse on the moon, highly detailed"
NEGATIVE = "blurry, low quality"
GUIDANCE = 7.5
SEED = 0



def free_device_memory() -> None:
    """Between rows: what the last pipeline held goes back to the device. Sessions sit in reference
    cycles (closures), so ``del`` alone leaves them to a later collection, and torch's caching
    allocator keeps what the torch rows reserved; eight ablation rows of SD 1.5 with two ControlNets
    ran into a CUDA error at the eighth load."""
    import gc

    gc.collect()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Bench:
    def __init__(self, args):
        import torch

        self.args, self.kind = args, args.kind
        self.row = "row"  # the step being run (main sets it): names a row's pending quality file
        self.dry = args.dry_run
        self.size = "tiny" if self.dry else "full"
        self.device = "cpu" if self.dry else "cuda"
        self.settings = dict(SETTINGS[self.kind], **(DRY if self.dry else {}))
        self.bf16 = self.settings.get("precision") == "bf16"
        self.dtype = torch.float32 if self.dry else (torch.bfloat16 if self.bf16 else torch.float16)
        self.sd3 = self.kind in SD3_KINDS
        self.flux = self.kind in FLUX_KINDS
        self.dit = self.sd3 or self.flux  # a transformer, not a UNet
        self.model = self.settings.get("model", self.kind)  # the weights' kind (models.pipelines)
        self.init = "strength" in self.settings  # img2img or inpainting
        self.guidance = self.settings.get("guidance", GUIDANCE)
        self.runs = 1 if self.dry else args.runs
        self.work = args.work / self.kind
        self.work.mkdir(parents=True, exist_ok=True)
        scratch = getattr(args, "scratch", None)  # Flux: the source folder's file system (other scripts make a Bench)
        scratch = scratch / self.kind if scratch else self.work
        self.src, self.opt = scratch / "folder", self.work / "optimized"
        self.shared = self.shared_folders(args.work / self.model) if self.model != self.kind else {}
        self.src, self.opt = self.shared.get("folder", self.src), self.shared.get("optimize", self.opt)
        self.multi = self.kind == "sd15-multi-controlnet"
        self.prompt = {"prompt": PROMPT}  # the pipeline call's prompt arguments (torch_pipe sets them)

    def shared_folders(self, other: Path) -> dict:
        """The folders another kind of the same weights built in --work (recorded done, still there)."""
        import json

        results = other / "results.json"
        done = json.loads(results.read_text()) if results.is_file() else {}
        return {step: Path(done[step]["path"]) for step in ("folder", "optimize")
                if isinstance(done.get(step), dict) and "path" in done[step] and "skipped" not in done[step]
                and Path(done[step]["path"]).is_dir()}

    # --- steps ------------------------------------------------------------------------------

    def build_folder(self) -> dict:
        from models.pipelines import folder_bytes, write_onnx_folder

        t0 = time.perf_counter()
        if "folder" in self.shared:
            return {"path": str(self.src), "reused": f"the {self.model} kind's"}
        if self.flux:
            from benchmarks.pipeline_flux import assemble_folder

            return assemble_folder(self.kind, self.src, self.size, SEED)
        if self.sd3:
            from models.sd3 import build_torch_sd3_pipeline, write_sd3_onnx_folder

            tokenizers = self.work / "tokenizers"
            write_sd3_onnx_folder(build_torch_sd3_pipeline(SEED, tokenizers, size=self.size), self.src, tokenizers)
            return {"path": str(self.src), "seconds": time.perf_counter() - t0, "bytes": folder_bytes(self.src)}
        data = None if self.dry else "model.onnx_data"
        write_onnx_folder(self.model, self.src, self.size, "torchscript", SEED, data_name=data)
        return {"path": str(self.src), "seconds": time.perf_counter() - t0, "bytes": folder_bytes(self.src)}

    def folder_part(self, name: str) -> dict:
        """Flux: one component exported on its own (benchmarks/pipeline_flux.py)."""
        from benchmarks.pipeline_flux import export_part

        return export_part(self.kind, name, self.src, self.size, "bfloat16" if self.bf16 and not self.dry else "float32",
                           SEED)

    def optimize(self) -> dict:
        if self.dry:  # the ort-cuda preset writes CUDA-only ops: the dry run uses the source folder
            return {"path": str(self.src), "skipped": "dry run (ort-cuda graphs need the CUDA EP)"}
        if "optimize" in self.shared:
            return {"path": str(self.opt), "reused": f"the {self.model} kind's"}
        from onnxopt.pipeline import optimize_folder

        low = {"low_precision": "bfloat16"} if self.bf16 else None
        if self.flux:  # the optimized folder is about the source's size
            from benchmarks.pipeline_flux import check_room
            from models.pipelines import folder_bytes

            check_room(self.opt.parent, 1.02 * folder_bytes(self.src), "the optimized folder")
        for stale in self.opt.parent.glob(f".{self.opt.name}.tmp-*"):  # what a killed call left
            shutil.rmtree(stale, ignore_errors=True)
        report = optimize_folder(self.src, self.opt, target="ort-cuda", fp16=True, fp16_options=low)
        out = {"path": str(self.opt), "seconds": report.seconds, "table": report.table()}
        if self.flux:  # the torch rows build their weights from the seed: the source is not read again
            shutil.rmtree(self.src)
            out["source_removed"] = str(self.src)
        return out

    def torch_pipe(self, dtype, compiled: bool, reference: bool = False):
        import torch

        from models.pipelines import build_torch_pipeline
        from onnxopt.pipeline.schedulers import make_scheduler

        offload = False
        self.prompt = {"prompt": PROMPT}  # the call's prompt arguments
        if self.sd3:
            from models.sd3 import build_torch_sd3_pipeline

            pipe = build_torch_sd3_pipeline(SEED, self.work / "tokenizers", size=self.size)
        elif self.flux:
            from benchmarks.pipeline_flux import torch_pipeline

            pipe = torch_pipeline(self.kind, self.size, SEED, self.work / "tokenizers", self.src.parent / "torch-weights")
            # the float32 reference: 68 GB of weights; the text encoders run and go before the transformer
            # comes (also in the dry run, on the CPU, where the eager row checks it gives the same image)
            offload = reference
        else:
            pipe = build_torch_pipeline(self.model, self.size, SEED)
            # The config the folder's scheduler_config.json is written from: the torch steps need no ONNX
            # folder, so they can run in a call of their own (--skip folder,optimize,onnxopt).
            pipe.scheduler = make_scheduler(self.settings["scheduler"], dict(pipe.scheduler.config))
            if self.init and "mask" not in self.settings:  # img2img: the same components
                from diffusers import StableDiffusionImg2ImgPipeline

                pipe = StableDiffusionImg2ImgPipeline(**pipe.components)
        if offload:
            from benchmarks.pipeline_flux import float32_text_first

            self.prompt = float32_text_first(pipe, PROMPT, self.settings["max_sequence_length"], self.device)
        else:
            pipe = pipe.to(self.device, dtype)
        pipe.set_progress_bar_config(disable=True)
        if compiled and self.dit:  # diffusers' recipe for SD3 and Flux: the transformer compiled whole
            pipe.transformer = torch.compile(pipe.transformer, mode="reduce-overhead", fullgraph=True)
        elif compiled:
            torch._inductor.config.conv_1x1_as_mm = True
            pipe.unet.to(memory_format=torch.channels_last)
            pipe.unet = torch.compile(pipe.unet, mode="reduce-overhead", fullgraph=True)
            if getattr(pipe, "controlnet", None) is not None:  # diffusers' ControlNet recipe compiles both
                pipe.controlnet.to(memory_format=torch.channels_last)
                pipe.controlnet = torch.compile(pipe.controlnet, mode="reduce-overhead", fullgraph=True)
        return pipe

    def torch_call(self, pipe, output_type="np"):
        import torch

        final = {}

        def keep(_pipe, i, t, kwargs):
            final["latents"] = kwargs["latents"]
            return kwargs

        from benchmarks.pipeline_init_image import float32_draws

        s = self.settings
        # The initial noise is drawn in float32, as the fp32 pipeline and onnxopt draw it, then cast: an fp16
        # pipeline left to draw its own would sample float16 noise, another image altogether.
        factor = pipe.vae_scale_factor
        denoiser = pipe.transformer if self.dit else pipe.unet
        generator = torch.Generator("cpu").manual_seed(SEED)
        if self.flux:
            from benchmarks.pipeline_flux import packed_noise

            noise = packed_noise(pipe, s["height"], s["width"], SEED)
        else:
            channels = pipe.vae.config.latent_channels  # an inpainting UNet takes 9, its latents have 4
            noise = torch.randn((1, channels, s["height"] // factor, s["width"] // factor), generator=generator,
                                dtype=torch.float32)
        extra = dict(negative_prompt=NEGATIVE, height=s["height"], width=s["width"],
                     latents=noise.to(self.device, denoiser.dtype))
        if self.kind.endswith("controlnet"):
            extra["image"] = self.control_image()
            if self.multi:
                extra["controlnet_conditioning_scale"] = MULTI_CONTROLNET_SCALES
        if self.flux:  # no classifier-free guidance: no negative prompt
            del extra["negative_prompt"]
            extra["max_sequence_length"] = s["max_sequence_length"]
        if self.init:  # the generator draws the encoder's sample and the noise, in diffusers' order
            image, mask = self.init_images()
            extra.update(image=image, strength=s["strength"], generator=torch.Generator("cpu").manual_seed(SEED))
            del extra["latents"]
            if mask is None:  # img2img: the init image's size
                del extra["height"], extra["width"]
            else:
                extra["mask_image"] = mask
        with torch.no_grad(), float32_draws():
            image = pipe(**self.prompt, num_inference_steps=s["steps"], guidance_scale=self.guidance,
                         output_type=output_type, callback_on_step_end=keep, **extra).images[0]
        self.sync()
        return final["latents"].float().cpu().numpy(), np.asarray(image, np.float32)

    def init_images(self):
        """The init image and (inpainting) mask every side takes; also saved to <work>/init.png, mask.png."""
        from benchmarks.pipeline_init_image import init_image, inpaint_mask

        s = self.settings
        image = init_image(s["height"], s["width"], INIT_IMAGE_SEED)
        mask = inpaint_mask(s["height"], s["width"]) if s.get("mask") else None
        image.save(self.work / "init.png")
        if mask is not None:
            mask.save(self.work / "mask.png")
        return image, mask

    def sync(self):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn, record):
        """``fn`` with device syncs around it, handing each call's seconds to ``record``."""
        def call(*a, **k):
            self.sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.sync()
            record(time.perf_counter() - t0)
            return out

        return call

    def torch_stages(self, pipe) -> dict:
        """One run with synchronizing timers around the text encoder(s), the UNet and the VAE decode.

        A step is the UNet call plus, in a ControlNet pipeline, the ControlNet call before it."""
        times = {"text_encoder": [], "vae_encode": [], "vae_decode": [], "unet": [], "controlnet": []}
        patched = []  # (object, attribute, its own value before, or None when it had none)

        def patch(obj, attr, key):
            patched.append((obj, attr, obj.__dict__.get(attr)))
            setattr(obj, attr, self.timed(getattr(obj, attr), times[key].append))

        patch(pipe.text_encoder, "forward", "text_encoder")
        for encoder in ("text_encoder_2", "text_encoder_3"):
            if getattr(pipe, encoder, None) is not None:
                patch(getattr(pipe, encoder), "forward", "text_encoder")
        patch(pipe.vae, "decode", "vae_decode")
        if self.init:
            patch(pipe.vae, "encode", "vae_encode")
        # The ControlNet is timed by its forward: diffusers checks that pipe.controlnet is a ControlNetModel.
        if getattr(pipe, "controlnet", None) is not None:
            patch(pipe.controlnet, "forward", "controlnet")
        attribute = "transformer" if self.dit else "unet"  # the denoiser's
        original_unet = getattr(pipe, attribute)
        timed_unet = self.timed(original_unet, times["unet"].append)

        class TimedUNet:  # pipe.unet may be a compiled module: time calls around it
            def __getattr__(self, name):
                return getattr(original_unet, name)

            def __call__(self, *a, **k):
                return timed_unet(*a, **k)

        object.__setattr__(pipe, attribute, TimedUNet())  # not DiffusionPipeline.__setattr__
        try:
            self.torch_call(pipe)
        finally:
            object.__setattr__(pipe, attribute, original_unet)
            for obj, attr, own in reversed(patched):
                if own is None:
                    delattr(obj, attr)
                else:
                    setattr(obj, attr, own)
        step = sum(statistics.mean(c[1:] or c) for c in (times["unet"], times["controlnet"]) if c)
        out = {"text_encoder_s": sum(times["text_encoder"]), "step_mean_s": step,
               "vae_decode_s": sum(times["vae_decode"])}
        if times["vae_encode"]:
            out["vae_encode_s"] = sum(times["vae_encode"])
        return out

    def torch_fp32(self) -> dict:
        import torch

        pipe = self.torch_pipe(torch.float32, compiled=False, reference=True)
        latents, image = self.torch_call(pipe)
        np.save(self.work / "fp32_latents.npy", latents)
        np.save(self.work / "fp32_image.npy", image)
        del pipe
        free_device_memory()
        return {"latents_absmax": float(np.abs(latents).max())}

    def torch_timed(self, compiled: bool) -> dict:
        if compiled and self.dry:
            return {"skipped": "dry run (torch.compile reduce-overhead needs CUDA graphs)"}
        t0 = time.perf_counter()
        pipe = self.torch_pipe(self.dtype, compiled)
        latents, image = self.torch_call(pipe)  # warm-up; with compile: the compilation
        cold = time.perf_counter() - t0
        totals = []
        for _ in range(self.runs):
            t1 = time.perf_counter()
            latents, image = self.torch_call(pipe)
            totals.append(time.perf_counter() - t1)
        out = {"end_to_end_s": statistics.median(totals), "runs_s": totals, "cold_start_s": cold,
               "stages": self.torch_stages(pipe), **self.quality(latents, image)}
        del pipe
        free_device_memory()
        return out

    def control_image(self):
        """A seeded edge map (ControlNet kinds): the same image for every pipeline; two (seeds 0
        and 1) for two ControlNets."""
        from PIL import Image

        s = self.settings
        images = []
        for seed in (SEED, SEED + 1) if self.multi else (SEED,):
            edges = (np.random.default_rng(seed).random((s["height"], s["width"])) > 0.9).astype(np.uint8) * 255
            images.append(Image.fromarray(np.stack([edges] * 3, axis=-1)))
        return images if self.multi else images[0]

    def onnxopt(self, load: dict | None = None, call: dict | None = None) -> dict:
        import inspect

        from onnxopt.pipeline import Pipeline

        folder = self.src if self.dry else self.opt
        provider = "cpu" if self.dry else "cuda"
        s = self.settings
        load, call = dict(load or {}), dict(call or {})
        if call.get("reuse") == "late":  # 30-49:2 at 50 steps, 18-29:2 at 30
            call["reuse"] = f"{-(-6 * s['steps'] // 10)}-{s['steps'] - 1}:2"
        takes = set(inspect.signature(Pipeline.load).parameters)
        unknown = set(load) - takes
        if unknown:
            return {"skipped": f"this Pipeline.load has no {', '.join(sorted(unknown))}"}
        request = dict(negative_prompt=NEGATIVE, steps=s["steps"], guidance=self.guidance, scheduler=s["scheduler"],
                       seed=SEED, height=s["height"], width=s["width"], progress=False, **call)
        if self.flux:  # no classifier-free guidance: no negative prompt
            request.update(negative_prompt=None, max_sequence_length=s["max_sequence_length"])
        if self.init:  # what `onnxopt generate --image --strength [--mask]` passes
            image, mask = self.init_images()
            request.update(image=image, strength=s["strength"])
            if mask is None:  # img2img: the init image's size
                del request["height"], request["width"]
            else:
                request["mask"] = mask
        if self.kind.endswith("controlnet"):
            request["controlnet_image"] = self.control_image()
            if self.multi:
                request["controlnet_scale"] = MULTI_CONTROLNET_SCALES
        t0 = time.perf_counter()
        # the calls' scheduler: the load makes the step graph they run (SD 1.5's own PNDM runs another)
        told = {"scheduler": s["scheduler"]} if "scheduler" in takes else {}
        pipe = Pipeline.load(folder, provider, **{"cuda_graph": True, **told, **load})
        first = pipe(PROMPT, **request)
        cold = time.perf_counter() - t0
        results = []
        for _ in range(self.runs):
            t1 = time.perf_counter()
            results.append((pipe(PROMPT, **request), time.perf_counter() - t1))
        last = results[-1][0]
        totals = [t for _, t in results]
        stages = {k: statistics.median(r.timings[k] for r, _ in results)
                  for k in ("text_encoder_s", "step_mean_s", "vae_encode_s", "vae_decode_s", "vae_run_s", "vae_postprocess_s",
                            "controlnet_hint_s", "reused_step_mean_s", "step_launch_mean_s", "rest_s")
                  if k in last.timings}
        sessions, creation_s = sorted(pipe.sessions), pipe.creation_s
        del pipe  # first, results and last hold images and latents, not sessions
        free_device_memory()
        return {"end_to_end_s": statistics.median(totals), "runs_s": totals, "cold_start_s": cold,
                "sessions": sessions, "unet_steps": last.timings.get("unet_steps"),
                "session_runs_per_step": last.timings.get("session_runs_per_step"),
                "session_creation_s": creation_s, "first_image_s": first.timings["total_s"],
                "first_step_s": first.timings["first_step_s"], "step": last.timings["step"],
                "cuda_graph": last.timings["cuda_graph"], "stages": stages,
                "text_encoders": last.timings.get("text_encoders"),
                **self.quality(last.latents, last.pixels)}

    def cfg_late_graph(self) -> dict:
        """unet/step.cfg_late.onnx beside the optimized folder's step.onnx (the ablation's cfg-late row)."""
        from onnxopt.pipeline import PipelineFolder
        from onnxopt.pipeline.step_graph import write_step_graph

        t0 = time.perf_counter()
        folder = self.src if self.dry else self.opt
        path = write_step_graph(folder / "unet", file_name="step.cfg_late.onnx", cfg_late=True,
                                controlnets=max(1, len(PipelineFolder.open(folder).controlnets)))
        return {"path": str(path), "seconds": time.perf_counter() - t0}

    def fp8_step_graph(self) -> dict:
        """unet/step.fp8.onnx: the optimized step graph with fp8-linear, its activation scales calibrated
        on the step inputs of one image of CALIBRATION_PROMPT and seed SEED + 1."""
        if self.dry:
            return {"skipped": "dry run (GemmFloat8 runs on the CUDA EP only)"}
        import onnxopt
        from onnxopt.pipeline import Pipeline

        t0 = time.perf_counter()
        s = self.settings
        pipe = Pipeline.load(self.opt, "cuda", cuda_graph=False, io_binding=False,  # the host loop: feeds in numpy
                             scheduler=s["scheduler"])
        recorder = StepFeedRecorder(pipe.step_session(), every=max(1, s["steps"] // CALIBRATION_FEEDS))
        pipe.sessions["step"] = recorder
        pipe(CALIBRATION_PROMPT, negative_prompt=NEGATIVE, steps=s["steps"], guidance=GUIDANCE, scheduler=s["scheduler"],
             seed=SEED + 1, height=s["height"], width=s["width"], progress=False)
        del pipe
        model, report = onnxopt.optimize(str(self.opt / "unet" / "step.onnx"), ["fp8-linear"],
                                         options={"fp8-linear": {"calibration": recorder.feeds}})
        path = self.opt / "unet" / FP8_STEP_FILE
        onnxopt.save_model(model, path, external_data=True)
        # Pipeline.load(step_file=...) runs <step file stem>.context_kv.onnx once per prompt: the same graph
        # as step.onnx's (its external data sits beside it, under the name the copy still refers to)
        context = self.opt / "unet" / "step.context_kv.onnx"
        if context.is_file():
            shutil.copyfile(context, path.with_suffix(".context_kv.onnx"))
        result = next(p.result for p in report.passes if p.name == "fp8-linear")
        return {"path": str(path), "seconds": time.perf_counter() - t0, "calibration_feeds": len(recorder.feeds),
                "sites": f"{result.sites_rewritten}/{result.sites_matched}", "refused": dict(result.refusal_counts())}

    def fp8_row(self) -> dict:
        """The pipeline on unet/step.fp8.onnx; without CUDA graphs (said in the row) when the capture fails:
        ORT's GemmFloat8 kernel synchronizes its stream on every call, which a capture forbids."""
        if self.dry:
            return {"skipped": "dry run"}
        try:
            return self.onnxopt(dict(step_file=FP8_STEP_FILE))
        except Exception as exc:  # noqa: BLE001 - keep the row, say why
            result = self.onnxopt(dict(step_file=FP8_STEP_FILE, cuda_graph=False))
            result["note"] = f"no CUDA graph: {str(exc).splitlines()[0][:160]}"
            return result

    def quality(self, latents: np.ndarray, image: np.ndarray) -> dict:
        """PSNR and max abs against the float32 reference; where it is not made yet (the torch rows run on
        another GPU or machine, ``--skip torch-fp32``), the row's final latents and image are kept in
        ``<work>/pending-<row>.npz`` and :func:`settle_pending_quality` scores them once it arrives."""
        if not all((self.work / name).is_file() for name in REFERENCE_FILES):
            pending = self.work / f"pending-{slug(self.row)}.npz"
            np.savez(pending, latents=np.asarray(latents, np.float32), image=np.asarray(image, np.float32))
            return {"quality_pending": pending.name}
        return self.scored(latents, image)

    def scored(self, latents: np.ndarray, image: np.ndarray) -> dict:
        ref_latents = np.load(self.work / "fp32_latents.npy")
        ref_image = np.load(self.work / "fp32_image.npy")
        a = (np.clip(image, 0, 1) * 255).round()
        b = (np.clip(ref_image, 0, 1) * 255).round()
        mse = float(np.mean((a - b) ** 2))
        psnr = float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)
        latents = np.asarray(latents, np.float32).reshape(ref_latents.shape)  # both sides' final latents (Flux: packed)
        return {"psnr_db": psnr, "latents_max_abs": float(np.abs(latents - ref_latents).max()),
                "image_max_abs": float(np.abs(image - ref_image).max())}


class StepFeedRecorder:
    """The step session, keeping (copies of) the feeds of every ``every``-th call, at most ``limit``."""

    def __init__(self, session, every: int, limit: int = CALIBRATION_FEEDS):
        self.session, self.every, self.limit = session, every, limit
        self.calls, self.feeds = 0, []

    def run(self, output_names, feeds):
        if self.calls % self.every == 0 and len(self.feeds) < self.limit:
            self.feeds.append({name: np.array(value) for name, value in feeds.items()})
        self.calls += 1
        return self.session.run(output_names, feeds)

    def __getattr__(self, name):  # get_inputs, get_outputs, ... of the session
        return getattr(self.session, name)


REFERENCE_FILES = ("fp32_latents.npy", "fp32_image.npy")


def slug(key: str) -> str:
    """A step key as a file name part (``onnxopt: + hint once per image`` -> ``onnxopt-hint-once-per-image``)."""
    return "-".join("".join(c if c.isalnum() else " " for c in key).split()) or "row"


def settle_pending_quality(bench, steps) -> list[str]:
    """Score the rows timed before the float32 reference was there (their ``pending-<row>.npz``), once it
    is (made here, or taken by --resume-from): the ONNX side and the torch side of a kind can run at the
    same time on two GPUs."""
    if not all((bench.work / name).is_file() for name in REFERENCE_FILES):
        return []
    settled = []
    for key, row in list(steps.results.items()):
        name = row.get("quality_pending") if isinstance(row, dict) else None
        pending = bench.work / name if name else None
        if pending is None or not pending.is_file():
            continue
        with np.load(pending) as saved:
            row = {k: v for k, v in row.items() if k != "quality_pending"}
            row.update(bench.scored(saved["latents"], saved["image"]))
        steps.record(key, row)
        pending.unlink()
        settled.append(key)
    if settled:
        print(f"scored against the float32 reference now: {', '.join(settled)}", flush=True)
    return settled


def resume_torch_rows(previous: Path, work: Path) -> list[str]:
    """The torch rows (which need no ONNX folder) and the float32 reference of an earlier run's --out,
    into ``work``, where not there already: a kind too long for one machine's hold runs its torch rows
    on one machine and its ONNX steps on another."""
    import json

    taken = []
    for name in REFERENCE_FILES:
        if (previous / name).is_file() and not (work / name).is_file():
            shutil.copyfile(previous / name, work / name)
            taken.append(name)
    earlier = json.loads((previous / "results.json").read_text())
    path = work / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    for key, value in earlier.items():
        if key.startswith("torch-") and key not in results:
            results[key] = value
            taken.append(key)
    path.write_text(json.dumps(results, indent=2, default=str))
    print(f"taken from {previous}: {', '.join(taken) or 'nothing new'}", flush=True)
    return taken


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=list(SETTINGS), default="sd15")
    ap.add_argument("--work", type=Path, default=Path("/tmp/pipe-bench"))
    ap.add_argument("--scratch", type=Path, help="Flux: where the source ONNX folder goes (default: --work), e.g. "
                                                 "/dev/shm/pipe-bench when --work cannot hold it beside the optimized one")
    ap.add_argument("--budget", type=float, default=540, help="seconds; stop between steps after this")
    ap.add_argument("--runs", type=int, default=5, help="timed images after the warm-up (median reported)")
    ap.add_argument("--out", type=Path, help="copy results.json and table.md here (e.g. benchmarks/results/pipeline-sd15)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny weights, fp32, one run of each step (no compile)")
    ap.add_argument("--resume-from", type=Path, metavar="OUT",
                    help="an --out of an earlier run (another machine): its torch rows and float32 reference are "
                         "taken, the ONNX steps run here")
    ap.add_argument("--skip", default="", help="comma-separated steps not to run (e.g. torch-compile)")
    ap.add_argument("--side", choices=["all", "torch", "onnx"], default="all",
                    help="torch: only the torch rows and the float32 reference (no ONNX folder); onnx: every other step, "
                         "its quality scored once the reference is there (--resume-from the torch side's --out). The "
                         "two sides run at once on two GPUs (CUDA_VISIBLE_DEVICES) with their own --work")
    ap.add_argument("--ablation", action="store_true", help="also the onnxopt pipeline as each rewrite is added")
    ap.add_argument("--fp8", action="store_true", help=f"also the row '{FP8_ROW}': unet/{FP8_STEP_FILE} (fp8-linear)")
    args = ap.parse_args(argv)
    bench = Bench(args)
    if args.resume_from:
        resume_torch_rows(args.resume_from, bench.work)
    steps = Steps(bench.work, args.budget)
    plan = [(f"folder: {part}", lambda part=part: bench.folder_part(part)) for part in STREAMED_PARTS if bench.flux]
    plan += [("folder", bench.build_folder), ("optimize", bench.optimize), ("torch-fp32", bench.torch_fp32),
            ("torch-eager", lambda: bench.torch_timed(False)), ("torch-compile", lambda: bench.torch_timed(True)),
            ("onnxopt", bench.onnxopt)]
    if args.ablation:
        controlnet = args.kind.endswith("controlnet")
        if args.kind != "sdxl":  # cfg-late moves 0.5 % of SDXL's FLOPs (the time embedding meets text_embeds)
            plan.append(("cfg-late graph", bench.cfg_late_graph))
        plan += [(f"onnxopt: {label}", lambda load=load, call=call: bench.onnxopt(load, call))
                 for label, (load, call, only_controlnet) in ABLATION.items() if controlnet or not only_controlnet
                 if args.kind != "sdxl" or "step_file" not in load]
    if args.fp8:
        plan += [("fp8 step graph", bench.fp8_step_graph),
                 (f"onnxopt: {FP8_ROW}", bench.fp8_row)]
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - {key for key, _ in plan}
    if args.side != "all":
        skip |= {key for key, _ in plan if key.startswith("torch-") != (args.side == "torch")}
    if unknown:
        ap.error(f"--skip: no step {', '.join(sorted(map(repr, unknown)))} in this run (steps: "
                 f"{', '.join(key for key, _ in plan)})")
    try:
        for key, fn in plan:
            if key not in skip:  # full-size Flux: every step takes minutes, each gets a call of its own
                bench.row = key
                steps.run(key, fn, alone=bench.flux and not args.dry_run)
                settle_pending_quality(bench, steps)
    except TimeoutError as exc:
        print(f"budget spent before step '{exc}': rerun the same command to continue", flush=True)
    settle_pending_quality(bench, steps)
    text = table(args.kind, steps.results, args.dry_run)
    if args.ablation or args.fp8:
        text += "\n\n" + ablation_table(args.kind, steps.results, fp8_only=not args.ablation)
    print(text)
    steps.save(args.out, text)
    if args.out is not None:  # the quality reference travels with the results (--resume-from)
        for name in REFERENCE_FILES:
            if (bench.work / name).is_file():
                shutil.copyfile(bench.work / name, args.out / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
