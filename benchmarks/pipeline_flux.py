"""Flux.1 (dev, schnell) for benchmarks/pipeline_gpu.py: the ONNX folder in resumable parts, and diffusers'
FluxPipeline from the same seeded weights.

A full-size folder is too big to export in one piece in RAM or on a 64 GB disk twice over: the
transformer (11.9 B parameters, 23.8 GB in bfloat16) is exported streamed (meta-built, each seeded
weight made as it is written: ``models.bigexport``, ``--streamed``), T5-XXL (4.76 B, 9.5 GB in
bfloat16) built in bfloat16 and exported on its own with dynamo (both then with float32 graph inputs and outputs, a
Cast at each: ``models.bigexport.float32_io``), then CLIP-L, the VAE, tokenizers, scheduler and
model_index.json are written around them (``models.flux_pipeline.write_flux_onnx_folder(names=...)``).
Each part is a step of its own (one 10-minute call each). A part killed mid-way leaves a hidden
``.<name>.partial-<pid>`` folder: the next try removes it first.

Disk: the source folder (~34 GB) and the optimized one (~34 GB) do not fit one 64 GB disk together, so
the source may live on another file system (``--scratch``, e.g. ``/dev/shm``: RAM, 128 GB here) and is
removed once the optimized folder is written (the torch rows build their weights from the seed, not from
the folder).

The torch side: the transformer and T5 are built in bfloat16 by the same builders (bit-identical to
the streamed export's weights), CLIP and the VAE in float32 and cast. The float32 quality reference
is that bfloat16-built pipeline cast to float32 (the same weights; only the arithmetic differs), run
with diffusers' model CPU offload (68 GB of float32 weights do not fit the GPU beside the activations).
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

FLUX_KINDS = ("flux-dev", "flux-schnell")
STREAMED_PARTS = ("transformer", "text_encoder_2")  # exported on their own, before the rest of the folder
SMALL_PARTS = ("text_encoder", "vae_decoder", "vae_encoder")
FULL_BYTES = {"flux-dev": 34.5e9, "flux-schnell": 34.5e9}  # source folder, bfloat16 transformer and T5


def parts_dir(src: Path) -> Path:
    return src.parent / f"{src.name}.parts"


def remove_partials(parent: Path, name: str) -> list[str]:
    """Remove what a killed export left: ``parent/.<name>.partial-*`` (models.bigexport's partial folders)."""
    removed = []
    for partial in parent.glob(f".{name}.partial-*"):
        shutil.rmtree(partial, ignore_errors=True)
        removed.append(partial.name)
    return removed


def free_bytes(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free


def check_room(path: Path, need: float, what: str) -> None:
    """A one-line error before hours of export when ``path``'s file system cannot hold ``need`` bytes."""
    free = free_bytes(path)
    if free < need:
        raise SystemExit(f"{path}: {free / 1e9:.1f} GB free, {what} needs about {need / 1e9:.1f} GB: give --scratch "
                         f"on another file system (e.g. /dev/shm, see `df -h /dev/shm`) or free some")


def export_part(kind: str, name: str, src: Path, size: str, dtype: str, seed: int) -> dict:
    """``transformer`` (streamed, dynamo) or ``text_encoder_2`` (T5, dynamo: the TorchScript exporter fails on
    a bfloat16 T5, "ScalarType ComplexDouble is an unexpected tensor scalar type") into ``<src>.parts/<name>``,
    with its config.json."""
    from models.bigexport import export_folder, float32_io
    from models.flux_pipeline import T5_SEED_OFFSET, t5_overrides, transformer_overrides

    parts = parts_dir(src)
    parts.mkdir(parents=True, exist_ok=True)
    removed = remove_partials(parts, name)
    out = parts / name
    if out.exists():  # complete (renamed into place) but not recorded: the call ended right after
        shutil.rmtree(out)
    if size == "full" and name == "transformer":
        check_room(parts, FULL_BYTES[kind], "the source folder")
    if name == "transformer":
        summary = export_folder(kind, out, size=size, exporter="dynamo", dtype=dtype, seed=seed, streamed=True,
                                overrides=transformer_overrides(size))
        _transformer_config(kind, size, out)
    else:
        summary = export_folder("t5-xxl", out, size=size, exporter="dynamo", dtype=dtype,
                                seed=seed + T5_SEED_OFFSET, overrides=t5_overrides(size))
        from transformers import T5Config

        from models.t5 import CONFIGS

        T5Config(**dict(CONFIGS[size], **(t5_overrides(size) or {}))).save_pretrained(str(out))
    float32 = float32_io(out / "model.onnx")  # the pipeline feeds float32 (onnxopt's fp16 pass keeps I/O types)
    keep = ("seconds", "peak_rss_gb", "params", "files", "export_seconds", "write_seconds")
    return {"path": str(out), "removed_partials": removed, "float32_io": float32,
            **{k: summary.get(k) for k in keep}}


def _transformer_config(kind: str, size: str, out: Path) -> None:
    """The transformer's config.json (diffusers' save_config), from the model built on the meta device."""
    from models import dit
    from models.flux_pipeline import transformer_overrides

    module, _ = dit.make_transformer(kind, size, overrides=transformer_overrides(size), meta=True)
    module.save_config(str(out))


def assemble_folder(kind: str, src: Path, size: str, seed: int) -> dict:
    """CLIP-L, the VAE, tokenizers, scheduler and model_index.json written around the exported parts,
    which are moved in (a rename: same file system); the folder appears whole."""
    from models.flux_pipeline import build_flux_pipeline, write_flux_onnx_folder
    from models.pipelines import folder_bytes

    t0 = time.perf_counter()
    parts = parts_dir(src)
    missing = [n for n in STREAMED_PARTS if not (parts / n / "model.onnx").is_file()]
    if missing:
        raise SystemExit(f"{parts}: no {', '.join(missing)}: run the 'folder: <part>' steps first")
    partial = src.parent / f".{src.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    pipe = build_flux_pipeline(kind, size, seed, tokenizer_dir=partial, skip=("transformer", "text_encoder_2"))
    write_flux_onnx_folder(kind, partial, size, "torchscript", seed, pipe=pipe, names=SMALL_PARTS)
    for name in STREAMED_PARTS:
        (parts / name).rename(partial / name)
    if src.exists():
        shutil.rmtree(src)
    partial.rename(src)
    shutil.rmtree(parts, ignore_errors=True)
    return {"path": str(src), "seconds": time.perf_counter() - t0, "bytes": folder_bytes(src)}


def torch_pipeline(kind: str, size: str, seed: int, tokenizers: Path, cache: Path | None = None):
    """diffusers' FluxPipeline from the folder's weights, on the CPU: transformer and T5 built in bfloat16
    at full size (float32 in the dry run), CLIP and the VAE in float32.

    Building the 11.9 B transformer and the 4.8 B T5 draws their seeded weights on one CPU core (6.5 min
    for T5 alone on the H100 machine): with ``cache``, the first build saves each to
    ``cache/<name>.safetensors`` (when its file system has room) and later builds (one per torch row) load
    them onto modules built on the meta device."""
    from models.flux_pipeline import build_flux_pipeline

    import torch

    build = torch.bfloat16 if size == "full" else None
    cached = [name for name in CACHED_PARTS if cache is not None and (cache / f"{name}.safetensors").is_file()]
    pipe = build_flux_pipeline(kind, size, seed, tokenizer_dir=tokenizers, dtype=build, skip=tuple(cached))
    for name in cached:
        pipe.register_modules(**{name: _load_cached(kind, name, size, build, cache / f"{name}.safetensors")})
    for name in CACHED_PARTS:
        if cache is not None and name not in cached:
            _save_cached(getattr(pipe, name), cache / f"{name}.safetensors")
    return pipe


CACHED_PARTS = ("transformer", "text_encoder_2")  # the components whose seeded build takes minutes


def _save_cached(module, path: Path) -> None:
    """``module``'s weights to ``path`` (renamed into place). T5's tied embedding is one tensor under two
    names, which safetensors refuses: the second name gets a copy (0.26 GB), and the loaded module has
    both filled (transformers' T5 ties them at construction, not on the meta device)."""
    from safetensors.torch import save_file

    state, seen = {}, set()
    for key, tensor in module.state_dict().items():
        state[key] = tensor.clone() if tensor.data_ptr() in seen else tensor.contiguous()
        seen.add(tensor.data_ptr())
    if free_bytes(path.parent) < 1.2 * sum(t.numel() * t.element_size() for t in state.values()):
        return
    partial = path.with_name(path.name + ".partial")
    save_file(state, str(partial))
    partial.rename(path)


def _load_cached(kind: str, name: str, size: str, dtype, path: Path):
    """The component ``name`` built on the meta device, its weights taken from ``path``."""
    import torch
    from safetensors.torch import load_file

    from models import dit
    from models.flux_pipeline import t5_overrides, transformer_overrides

    if name == "transformer":
        module, _ = dit.make_transformer(kind, size, dtype=dtype, overrides=transformer_overrides(size), meta=True)
    else:
        from transformers import T5Config, T5EncoderModel

        from models.t5 import CONFIGS

        with torch.device("meta"):
            module = T5EncoderModel(T5Config(**dict(CONFIGS[size], **(t5_overrides(size) or {}))))
        module.set_attn_implementation("sdpa")
    module.load_state_dict(load_file(str(path)), strict=False, assign=True)
    left = [k for k, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{path}: no weights for {left[:3]} ({len(left)} tensors)")
    return module.eval()


def float32_text_first(pipe, prompt: str, max_sequence_length: int, device: str) -> dict:
    """The float32 reference on one GPU: CLIP and T5 in float32 encode the prompt, are dropped, then the
    transformer and the VAE go to the GPU in float32 (all four at once, 68 GB, leave too little room).
    Returns the pipeline call's prompt arguments (the embeddings)."""
    import torch

    pipe.text_encoder.to(device, torch.float32)
    pipe.text_encoder_2.to(device, torch.float32)
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, device=device,
                                               max_sequence_length=max_sequence_length)
    pipe.register_modules(text_encoder=None, text_encoder_2=None)
    if device == "cuda":
        torch.cuda.empty_cache()
    pipe.transformer.to(device, torch.float32)
    pipe.vae.to(device, torch.float32)
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def packed_noise(pipe, height: int, width: int, seed: int):
    """FluxPipeline's initial latents drawn in float32 from a CPU generator (as the float32 pipeline and
    onnxopt draw them), packed 2x2 as FluxPipeline.prepare_latents packs them."""
    import torch

    channels = pipe.transformer.config.in_channels // 4
    h = 2 * (height // (pipe.vae_scale_factor * 2))
    w = 2 * (width // (pipe.vae_scale_factor * 2))
    noise = torch.randn((1, channels, h, w), generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)
    return pipe._pack_latents(noise, 1, channels, h, w)
