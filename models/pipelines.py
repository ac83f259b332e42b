"""Whole Stable Diffusion pipelines with seeded random weights, and their ONNX folders.

``build_torch_pipeline(kind, size, seed)`` assembles a diffusers pipeline from the
component builders of this package (``unet``, ``vae``, ``clip``, ``controlnet``: same
configs, same seeding), a real ``CLIPTokenizer`` over a small BPE vocabulary written
by :func:`write_tokenizer`, and the scheduler config the public model ships.
``write_onnx_folder(kind, out_dir, ...)`` exports each component of that same
pipeline to the layout diffusers/optimum ONNX folders have::

    model_index.json                  diffusers' (pipeline.save_config)
    scheduler/scheduler_config.json
    tokenizer/ [tokenizer_2/]         vocab.json, merges.txt, tokenizer_config.json, ...
    text_encoder/model.onnx           input_ids (int32) -> last_hidden_state, pooler_output
                                      [SDXL: + hidden_states.0 .. hidden_states.L]
    text_encoder_2/model.onnx         SDXL: input_ids -> text_embeds, last_hidden_state, hidden_states.{i}
    unet/model.onnx                   sample, timestep (float32 [B]), encoder_hidden_states
                                      [SDXL: text_embeds, time_ids] [ControlNet: down_block_res_{i},
                                      mid_block_res] -> out_sample
    controlnet/model.onnx             sample, timestep, encoder_hidden_states, controlnet_cond,
                                      conditioning_scale [1] -> down_block_res_{i}, mid_block_res
    [controlnet_1/model.onnx ...]     the second, third... ControlNet (the same interface), where
                                      diffusers' MultiControlNetModel.save_pretrained puts them
    vae_decoder/model.onnx            latent_sample (already / scaling_factor) -> sample
    vae_encoder/model.onnx            sample -> latent_parameters (the latent distribution's mean and
                                      log-variance, 2 x 4 channels: optimum's output)
    <component>/config.json           the torch component's config

Kinds and what differs from the component builders' configs (tiny size):
  ``sd15``            SD 1.5: clip-text (hidden 32) + unet-sd15 (cross_attention_dim 32); PNDM.
  ``sd21``            SD 2.1: an OpenCLIP-style CLIPTextModel (gelu, pad "!") whose hidden size is the
                      tiny unet-sd21's cross_attention_dim (24); the scheduler of
                      stabilityai/stable-diffusion-2-1-base (PNDMScheduler, epsilon).
  ``sdxl``            SDXL base: clip-text (32) + openclip-text (32, projection 24) = cross 64;
                      VAE scaling_factor 0.13025; EulerDiscreteScheduler.
  ``sd15-controlnet`` SD 1.5 + ControlNet.  The tiny VAE downsamples 2x (two blocks), so the tiny
                      ControlNet's conditioning embedding has two stages (8, 16) -- 2x too -- as
                      diffusers' own tiny test pipelines do; full size keeps 8x on both.
  ``sd15-inpaint``    SD 1.5 inpainting (StableDiffusionInpaintPipeline): the sd15 pipeline with a UNet of
                      9 input channels (latents, mask, masked-image latents), as
                      stable-diffusion-v1-5/stable-diffusion-inpainting's.
  ``sdxl-inpaint``    SDXL inpainting (StableDiffusionXLInpaintPipeline): the sdxl pipeline with a UNet of 9
                      input channels, as diffusers/stable-diffusion-xl-1.0-inpainting-0.1's (its
                      model_index.json: requires_aesthetics_score false, force_zeros_for_empty_prompt true).
  ``sd15-lcm``        a latent consistency model (LatentConsistencyModelPipeline): the sd15 pipeline with the
                      tiny ``unet-lcm`` (``time_cond_proj_dim``: its UNet graph takes ``timestep_cond``
                      [batch, dim] after encoder_hidden_states, optimum's name) and LCMScheduler.
  ``sd15-multi-controlnet`` SD 1.5 + two ControlNets (diffusers' MultiControlNetModel: each its own
                      image and scale, residuals summed): ``controlnet/`` (seed) and ``controlnet_1/``
                      (seed + 1), the same architecture as ``sd15-controlnet``'s.

The text encoders' ``vocab_size`` must hold the tokenizer: the tiny configs have 512 and
the tiny vocabulary is built to fit (printable ASCII + merges + the two special tokens).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .base import BuiltModel, SIZES, check_choice

PIPELINE_KINDS = ("sd15", "sd21", "sdxl", "sd15-controlnet", "sd15-multi-controlnet", "sd15-inpaint", "sdxl-refiner",
                  "sdxl-inpaint", "sd15-lcm")
XL_KINDS = ("sdxl", "sdxl-refiner", "sdxl-inpaint")
INPAINT_CHANNELS = 9  # latents (4) + mask (1) + masked-image latents (4)
CONTROLNET_COUNTS = {"sd15-controlnet": 1, "sd15-multi-controlnet": 2}
EXPORTERS = ("torchscript", "dynamo")
DATA_NAMES = ("model.onnx_data", "model.onnx.data", "weights.pb")
MODEL_MAX_LENGTH = 77

# ---------------------------------------------------------------------------------------------
# Scheduler configs, written by hand after the public scheduler/scheduler_config.json files.
_SD_BETAS = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                 trained_betas=None)
SCHEDULER_CONFIGS = {
    # runwayml/stable-diffusion-v1-5 (also the ControlNet pipelines built on it)
    "sd15": ("PNDMScheduler", dict(_SD_BETAS, clip_sample=False, set_alpha_to_one=False, skip_prk_steps=True,
                                   steps_offset=1)),
    # stabilityai/stable-diffusion-2-1-base: PNDMScheduler, epsilon prediction (the 768 model
    # stabilityai/stable-diffusion-2-1 ships DDIMScheduler with v_prediction instead)
    "sd21": ("PNDMScheduler", dict(_SD_BETAS, clip_sample=False, set_alpha_to_one=False, skip_prk_steps=True,
                                   steps_offset=1, prediction_type="epsilon")),
    # stabilityai/stable-diffusion-xl-base-1.0
    "sdxl": ("EulerDiscreteScheduler", dict(_SD_BETAS, interpolation_type="linear", prediction_type="epsilon",
                                            steps_offset=1, timestep_spacing="leading", use_karras_sigmas=False)),
}
SCHEDULER_CONFIGS["sd15-controlnet"] = SCHEDULER_CONFIGS["sd15-multi-controlnet"] = SCHEDULER_CONFIGS["sd15"]
# stable-diffusion-v1-5/stable-diffusion-inpainting ships SD 1.5's PNDM config
SCHEDULER_CONFIGS["sd15-inpaint"] = SCHEDULER_CONFIGS["sd15"]
# LCMScheduler on SD's betas; original_inference_steps 50: the schedule the LCM was distilled on, which
# set_timesteps draws its few steps from (LCMScheduler's defaults, which LCM folders ship)
SCHEDULER_CONFIGS["sd15-lcm"] = ("LCMScheduler", dict(_SD_BETAS, clip_sample=False, set_alpha_to_one=True,
                                                      steps_offset=1, original_inference_steps=50,
                                                      timestep_spacing="leading", timestep_scaling=10.0,
                                                      prediction_type="epsilon"))
# stabilityai/stable-diffusion-xl-refiner-1.0 ships the base's Euler config
SCHEDULER_CONFIGS["sdxl-refiner"] = SCHEDULER_CONFIGS["sdxl"]
# diffusers/stable-diffusion-xl-1.0-inpainting-0.1 ships EulerDiscreteScheduler with the base's betas
SCHEDULER_CONFIGS["sdxl-inpaint"] = SCHEDULER_CONFIGS["sdxl"]

# SD 2.x text encoder (OpenCLIP ViT-H/14 text tower as stabilityai/stable-diffusion-2-1 text_encoder/config.json).
SD21_TEXT_CONFIGS = {
    "full": dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=23,
                 num_attention_heads=16, max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5,
                 projection_dim=512, bos_token_id=0, eos_token_id=2, pad_token_id=1),
    "tiny": dict(vocab_size=512, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5,
                 projection_dim=24, bos_token_id=0, eos_token_id=2, pad_token_id=1),
}

# Latent dims the components are exported at (dynamic axes keep them free); tiny latents are
# not square so that H/W mix-ups show, and all dims >= 2 (dynamo specialises 0/1).
EXPORT_DIMS = {"tiny": dict(batch=2, height=8, width=12, sequence=MODEL_MAX_LENGTH),
               "full": dict(batch=2, height=64, width=64, sequence=MODEL_MAX_LENGTH)}

# ---------------------------------------------------------------------------------------------
# Tokenizer: a CLIP byte-level BPE vocabulary small enough for the tiny text encoders.

# Words the merges are learned from: the words of typical prompts.
_WORDS = """
a an the of and with in on at by for from to into over under near behind above below
photo photograph picture painting drawing sketch portrait landscape illustration render
astronaut horse riding moon mars space planet star stars galaxy sky cloud clouds sun sunset
sunrise night day light dark shadow city street building house castle tower bridge river lake
sea ocean beach mountain mountains forest tree trees flower flowers garden field grass snow rain
cat dog bird fish lion tiger bear wolf fox rabbit dragon robot car train boat ship plane
man woman girl boy child people person face eyes hair smile old young beautiful cute happy
red green blue yellow orange purple pink black white gray golden silver colorful bright
detailed highly intricate sharp focus high quality best masterpiece realistic photorealistic
cinematic lighting dramatic soft warm cold studio digital art artstation trending concept
style oil watercolor anime cartoon fantasy science fiction futuristic ancient medieval modern
small large tiny huge big little tall long short wide round square
4k 8k hd uhd 35mm lens bokeh depth wide angle closeup close up view top side front
blurry ugly bad deformed low worst cropped watermark text signature noise
""".split()

N_MERGES_TINY = 320   # 94 chars x 2 (with and without </w>) + 320 merges + 2 special tokens = 510 <= 512


def _byte_alphabet() -> list[str]:
    """Printable ASCII (``!`` .. ``~``) in CLIP's byte-to-unicode order (``!`` is id 0, as in CLIP).

    The pre-tokenizer splits on whitespace and lower-cases, so these cover ordinary prompts; any
    other character maps to the unknown token (``<|endoftext|>``), as CLIP's tokenizer does.
    """
    return [chr(b) for b in range(ord("!"), ord("~") + 1)]


def learn_merges(words, n_merges: int) -> list[tuple[str, str]]:
    """BPE merges learned from ``words`` (most frequent pair first, ties in lexical order).

    Words are split into characters with ``</w>`` on the last one, as CLIP's BPE does.
    Deterministic: the same words give the same merges.
    """
    from collections import Counter

    seqs = Counter(tuple(w[:-1]) + (w[-1] + "</w>",) for w in words)
    merges = []
    while len(merges) < n_merges:
        pairs = Counter()
        for seq, n in seqs.items():
            for a, b in zip(seq, seq[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = Counter()
        for seq, n in seqs.items():
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == best:
                    out.append(seq[i] + seq[i + 1])
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            merged[tuple(out)] += n
        seqs = merged
    return merges


def tokenizer_vocab(size: str = "tiny") -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) in CLIP's layout: characters, characters + ``</w>``, merges, then the
    special tokens ``<|startoftext|>`` and ``<|endoftext|>`` (the highest id, as in CLIP: the text
    encoders pool at ``argmax(input_ids)``)."""
    check_choice("size", size, SIZES)
    # Full size would need CLIP's 49408-token vocabulary, which we do not ship; the full text
    # encoders accept any id below 49408, so the tiny vocabulary serves both sizes.
    chars = _byte_alphabet()
    merges = learn_merges(_WORDS, N_MERGES_TINY)
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {}
    for t in tokens:
        vocab.setdefault(t, len(vocab))
    return vocab, merges


def write_tokenizer(out_dir, pad_token: str = "<|endoftext|>", size: str = "tiny"):
    """Write vocab.json + merges.txt and save a ``CLIPTokenizer`` over them to ``out_dir``.

    Returns the tokenizer as ``CLIPTokenizer.from_pretrained(out_dir)`` loads it.
    ``pad_token``: SD 1.5 and SDXL's ``tokenizer`` pad with ``<|endoftext|>``; SD 2.x and SDXL's
    ``tokenizer_2`` (OpenCLIP) pad with ``!``.
    """
    from transformers import CLIPTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, merges = tokenizer_vocab(size)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                        encoding="utf-8")
    tok = CLIPTokenizer(vocab=str(out_dir / "vocab.json"), merges=str(out_dir / "merges.txt"),
                        pad_token=pad_token, model_max_length=MODEL_MAX_LENGTH)
    tok.save_pretrained(str(out_dir))
    return CLIPTokenizer.from_pretrained(str(out_dir))


# ---------------------------------------------------------------------------------------------
# torch pipeline

def _text_encoder(config: dict, with_projection: bool, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from .seeding import init_module, seed_everything

    cfg = CLIPTextConfig(**config)
    cfg._attn_implementation = "sdpa"
    seed_everything(seed)
    model = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(cfg)
    return init_module(model, seed)


def _vae(kind: str, size: str, seed: int):
    from .vae import make_vae

    vae = make_vae(size, seed)
    if kind in XL_KINDS:
        # stabilityai/stable-diffusion-xl-base-1.0 vae/config.json: same architecture, other scale
        vae.register_to_config(scaling_factor=0.13025, force_upcast=True)
    return vae


def _controlnet(size: str, seed: int):
    from diffusers import ControlNetModel

    from .controlnet import CONFIGS
    from .seeding import init_module, seed_everything

    cfg = dict(CONFIGS[size])
    if size == "tiny":
        # match the tiny VAE's 2x downsampling (see the module docstring)
        cfg["conditioning_embedding_out_channels"] = (8, 16)
    seed_everything(seed)
    return init_module(ControlNetModel(**cfg), seed)


def make_scheduler(kind: str):
    import diffusers

    cls_name, cfg = SCHEDULER_CONFIGS[kind]
    return getattr(diffusers, cls_name).from_config(cfg)


def build_torch_pipeline(kind: str, size: str = "tiny", seed: int = 0, tokenizer_dir=None):
    """The diffusers pipeline of ``kind`` with seeded random weights (fp32, CPU, eval mode).

    Deterministic: the same ``kind``, ``size`` and ``seed`` give the same weights on every call.
    The tokenizers are written to ``tokenizer_dir`` (a temporary folder when None) and loaded
    back with ``CLIPTokenizer.from_pretrained``.
    """
    import tempfile

    from .clip import CONFIGS as CLIP_CONFIGS
    from .unet import make_unet

    check_choice("kind", kind, PIPELINE_KINDS)
    check_choice("size", size, SIZES)
    tmp = None
    if tokenizer_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="onnxopt-tokenizer-")
        tokenizer_dir = tmp.name
    tokenizer_dir = Path(tokenizer_dir)
    try:
        common = dict(vae=_vae(kind, size, seed), scheduler=make_scheduler(kind))
        if kind == "sdxl-refiner":  # text_encoder_2 alone; time ids end with the aesthetic score (5 of them)
            from diffusers import StableDiffusionXLImg2ImgPipeline

            text_config = CLIP_CONFIGS[("openclip-text", size)]
            unet = make_unet("unet-sdxl", size, seed, cross_attention_dim=text_config["hidden_size"],
                             projection_class_embeddings_input_dim=5 * 8 + text_config["projection_dim"])
            return StableDiffusionXLImg2ImgPipeline(
                text_encoder=None, tokenizer=None, text_encoder_2=_text_encoder(text_config, True, seed + 1),
                tokenizer_2=write_tokenizer(tokenizer_dir / "tokenizer_2", "!", size), unet=unet,
                requires_aesthetics_score=True, force_zeros_for_empty_prompt=False, add_watermarker=False, **common)
        if kind in ("sdxl", "sdxl-inpaint"):
            import diffusers

            inpaint = kind == "sdxl-inpaint"
            cls = diffusers.StableDiffusionXLInpaintPipeline if inpaint else diffusers.StableDiffusionXLPipeline
            switches = {"requires_aesthetics_score": False} if inpaint else {}
            return cls(
                text_encoder=_text_encoder(CLIP_CONFIGS[("clip-text", size)], False, seed),
                text_encoder_2=_text_encoder(CLIP_CONFIGS[("openclip-text", size)], True, seed + 1),
                tokenizer=write_tokenizer(tokenizer_dir / "tokenizer", "<|endoftext|>", size),
                tokenizer_2=write_tokenizer(tokenizer_dir / "tokenizer_2", "!", size),
                unet=make_unet("unet-sdxl", size, seed, **({"in_channels": INPAINT_CHANNELS} if inpaint else {})),
                force_zeros_for_empty_prompt=True, add_watermarker=False, **switches, **common)
        if kind == "sd21":
            text_encoder = _text_encoder(SD21_TEXT_CONFIGS[size], False, seed)
            tokenizer = write_tokenizer(tokenizer_dir / "tokenizer", "!", size)
            unet = make_unet("unet-sd21", size, seed)
        else:
            text_encoder = _text_encoder(CLIP_CONFIGS[("clip-text", size)], False, seed)
            tokenizer = write_tokenizer(tokenizer_dir / "tokenizer", "<|endoftext|>", size)
            inpaint = {"in_channels": INPAINT_CHANNELS} if kind == "sd15-inpaint" else {}
            unet = make_unet("unet-lcm" if kind == "sd15-lcm" else "unet-sd15", size, seed, **inpaint)
        parts = dict(text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, safety_checker=None,
                     feature_extractor=None, requires_safety_checker=False, **common)
        if kind in CONTROLNET_COUNTS:
            from diffusers import StableDiffusionControlNetPipeline

            nets = [_controlnet(size, seed + k) for k in range(CONTROLNET_COUNTS[kind])]
            # a list makes diffusers wrap them in a MultiControlNetModel
            return StableDiffusionControlNetPipeline(controlnet=nets if len(nets) > 1 else nets[0], **parts)
        if kind == "sd15-inpaint":
            from diffusers import StableDiffusionInpaintPipeline

            return StableDiffusionInpaintPipeline(**parts)
        if kind == "sd15-lcm":
            from diffusers import LatentConsistencyModelPipeline

            return LatentConsistencyModelPipeline(**parts)
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline(**parts)
    finally:
        if tmp is not None:
            tmp.cleanup()


# ---------------------------------------------------------------------------------------------
# ONNX export wrappers: plain-tensor signatures with optimum's input/output names.

def _torch():
    import torch

    return torch


class _Wrappers:
    """Namespace for the wrapper classes (built on first use: importing this module needs no torch)."""

    _made = None

    @classmethod
    def get(cls):
        if cls._made is None:
            cls._made = _make_wrappers()
        return cls._made


def _make_wrappers():
    torch = _torch()

    class TextEncoder(torch.nn.Module):
        """(input_ids int32,) -> CLIPTextModel: (last_hidden_state, pooler_output[, hidden_states.0 .. L]);
        CLIPTextModelWithProjection: (text_embeds, last_hidden_state[, hidden_states.0 .. L])"""

        def __init__(self, model, hidden_states: bool):
            super().__init__()
            self.model, self.hidden_states = model, hidden_states

        def forward(self, input_ids):
            out = self.model(input_ids=input_ids.long(), output_hidden_states=self.hidden_states, return_dict=True)
            if hasattr(out, "text_embeds"):
                head = (out.text_embeds, out.last_hidden_state)
            else:
                head = (out.last_hidden_state, out.pooler_output)
            return (*head, *out.hidden_states) if self.hidden_states else head

    class UNet(torch.nn.Module):
        """(sample, timestep, encoder_hidden_states[, timestep_cond][, text_embeds, time_ids][, *down_res, mid_res])
        -> (out_sample,)"""

        def __init__(self, unet, xl: bool, n_res: int):
            super().__init__()
            self.unet, self.xl, self.n_res = unet, xl, n_res
            self.time_cond = unet.config.time_cond_proj_dim is not None

        # Named optional arguments, not *rest: the dynamo exporter maps dynamic axes to a flat signature
        # (with *rest it failed: "Failed to convert 'dynamic_axes' to 'dynamic_shapes'").
        def forward(self, sample, timestep, encoder_hidden_states, a0=None, a1=None, a2=None, a3=None, a4=None,
                    a5=None, a6=None, a7=None, a8=None, a9=None, a10=None, a11=None, a12=None, a13=None, a14=None,
                    a15=None):
            rest = [a for a in (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15) if a is not None]
            kwargs = {}
            if self.time_cond:
                kwargs["timestep_cond"], rest = rest[0], rest[1:]
            if self.xl:
                kwargs["added_cond_kwargs"] = {"text_embeds": rest[0], "time_ids": rest[1]}
                rest = rest[2:]
            if self.n_res:
                kwargs["down_block_additional_residuals"] = list(rest[:-1])
                kwargs["mid_block_additional_residual"] = rest[-1]
            return (self.unet(sample, timestep, encoder_hidden_states, return_dict=False, **kwargs)[0],)

    class ControlNet(torch.nn.Module):
        """(sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale) -> (*down_res, mid_res)"""

        def __init__(self, controlnet):
            super().__init__()
            self.controlnet = controlnet

        def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale):
            down, mid = self.controlnet(sample, timestep, encoder_hidden_states, controlnet_cond,
                                        conditioning_scale=conditioning_scale, return_dict=False)
            return (*down, mid)

    from .vae import VAEDecoderWrapper, VAELatentParametersWrapper  # the VAE families' own wrappers

    return dict(TextEncoder=TextEncoder, UNet=UNet, ControlNet=ControlNet, VAEDecoder=VAEDecoderWrapper,
                VAEEncoder=VAELatentParametersWrapper)


def _residual_layout(unet_config: dict) -> list[tuple[int, int]]:
    """(channels, downsampling exponent k) of each ControlNet down-block residual, in order:
    conv_in, then per down block its resnets and its downsampler (not after the last block)."""
    ch = unet_config["block_out_channels"]
    out = [(ch[0], 0)]
    for i, c in enumerate(ch):
        out += [(c, i)] * unet_config["layers_per_block"]
        if i < len(ch) - 1:
            out.append((c, i + 1))
    return out


def _dims_name(k: int) -> tuple[str, str]:
    return ("height", "width") if k == 0 else (f"height_div{2 ** k}", f"width_div{2 ** k}")


def component_models(pipe, kind: str, size: str = "tiny", seed: int = 0) -> dict[str, BuiltModel]:
    """The exportable components of ``pipe``: folder name -> BuiltModel (wrapper + I/O specs)."""
    W = _Wrappers.get()
    dims = dict(EXPORT_DIMS[size])
    vae_factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    vocab = len(pipe.tokenizer or pipe.tokenizer_2)
    out = {}

    def built(name, module, specs, outputs, dyn, example_dims=dims, feed_options=None):
        out[name] = BuiltModel(
            family=f"{kind}/{name}", size=size, attention="sdpa", module=module.eval(), input_specs=specs,
            output_names=outputs, dynamic_axes=dyn, example_dims=dict(example_dims), alt_dims={},
            dim_multiples={}, sites={}, config={}, seed=seed, feed_options=feed_options or {})

    ids = [dict(name="input_ids", shape=["batch", "sequence"], dtype="int32", kind="input_ids")]
    ids_dyn = {"input_ids": {0: "batch", 1: "sequence"}}
    seq = {0: "batch", 1: "sequence"}
    xl = kind in XL_KINDS
    te_outs = ["last_hidden_state", "pooler_output"]
    te_dyn = dict(ids_dyn, last_hidden_state=seq, pooler_output={0: "batch"})
    if pipe.text_encoder is not None:  # the SDXL refiner has text_encoder_2 alone
        if xl:
            n = pipe.text_encoder.config.num_hidden_layers + 1
            te_outs += [f"hidden_states.{i}" for i in range(n)]
            te_dyn.update({f"hidden_states.{i}": seq for i in range(n)})
        text_feeds = {"vocab": vocab, "pad_id": pipe.tokenizer.pad_token_id}
        built("text_encoder", W["TextEncoder"](pipe.text_encoder, xl), ids, te_outs, te_dyn, feed_options=text_feeds)
    if xl:
        n = pipe.text_encoder_2.config.num_hidden_layers + 1
        hs = [f"hidden_states.{i}" for i in range(n)]
        built("text_encoder_2", W["TextEncoder"](pipe.text_encoder_2, True), ids,
              ["text_embeds", "last_hidden_state", *hs],
              dict(ids_dyn, text_embeds={0: "batch"}, last_hidden_state=seq, **{h: seq for h in hs}),
              feed_options={"vocab": vocab, "pad_id": pipe.tokenizer_2.pad_token_id})

    ucfg = pipe.unet.config
    latent_dyn = {0: "batch", 2: "height", 3: "width"}
    unet_specs = [
        dict(name="sample", shape=["batch", ucfg.in_channels, "height", "width"], dtype="float32", kind="latent"),
        dict(name="timestep", shape=["batch"], dtype="float32", kind="timestep"),
        dict(name="encoder_hidden_states", shape=["batch", "sequence", ucfg.cross_attention_dim],
             dtype="float32", kind="hidden"),
    ]
    unet_dyn = {"sample": latent_dyn, "timestep": {0: "batch"}, "encoder_hidden_states": seq,
                "out_sample": latent_dyn}
    if ucfg.time_cond_proj_dim is not None:  # the guidance embedding (LCM), as optimum names it
        unet_specs.append(dict(name="timestep_cond", shape=["batch", ucfg.time_cond_proj_dim], dtype="float32",
                               kind="hidden"))
        unet_dyn["timestep_cond"] = {0: "batch"}
    if xl:
        time_ids = 5 if getattr(pipe.config, "requires_aesthetics_score", False) else 6  # the refiner's end with a score
        text_dim = ucfg.projection_class_embeddings_input_dim - time_ids * ucfg.addition_time_embed_dim
        unet_specs += [dict(name="text_embeds", shape=["batch", text_dim], dtype="float32", kind="hidden"),
                       dict(name="time_ids", shape=["batch", time_ids], dtype="float32", kind="time_ids")]
        unet_dyn.update(text_embeds={0: "batch"}, time_ids={0: "batch"})
    res_specs, res_dyn, n_res = [], {}, 0
    if kind in CONTROLNET_COUNTS:
        layout = _residual_layout(dict(ucfg))
        for i, (c, k) in enumerate(layout + [layout[-1]]):
            name = f"down_block_res_{i}" if i < len(layout) else "mid_block_res"
            h, w = _dims_name(k)
            dims[h], dims[w] = dims["height"] // 2 ** k, dims["width"] // 2 ** k
            res_specs.append(dict(name=name, shape=["batch", c, h, w], dtype="float32", kind="hidden"))
            res_dyn[name] = {0: "batch", 2: h, 3: w}
        n_res = len(res_specs)
    built("unet", W["UNet"](pipe.unet, xl, n_res), unet_specs + res_specs, ["out_sample"],
          dict(unet_dyn, **res_dyn))
    if kind in CONTROLNET_COUNTS:
        dims["image_height"], dims["image_width"] = vae_factor * dims["height"], vae_factor * dims["width"]
        cn_specs = unet_specs[:3] + [
            dict(name="controlnet_cond", shape=["batch", 3, "image_height", "image_width"], dtype="float32",
                 kind="cond_image"),
            dict(name="conditioning_scale", shape=[1], dtype="float32", kind="hidden"),
        ]
        for name, net in zip(controlnet_folders(CONTROLNET_COUNTS[kind]), _controlnets(pipe)):
            built(name, W["ControlNet"](net), cn_specs, [s["name"] for s in res_specs],
                  dict({k: v for k, v in unet_dyn.items() if k != "out_sample"},
                       controlnet_cond={0: "batch", 2: "image_height", 3: "image_width"}, **res_dyn))

    image_dyn = {0: "batch", 2: "image_height", 3: "image_width"}
    vdims = dict(dims, image_height=vae_factor * dims["height"], image_width=vae_factor * dims["width"])
    built("vae_decoder", W["VAEDecoder"](pipe.vae),
          [dict(name="latent_sample", shape=["batch", 4, "height", "width"], dtype="float32", kind="latent")],
          ["sample"], {"latent_sample": latent_dyn, "sample": image_dyn}, vdims)
    built("vae_encoder", W["VAEEncoder"](pipe.vae),
          [dict(name="sample", shape=["batch", 3, "image_height", "image_width"], dtype="float32", kind="image")],
          ["latent_parameters"], {"sample": image_dyn, "latent_parameters": latent_dyn}, vdims)
    return out


def controlnet_folders(count: int) -> list[str]:
    """``controlnet``, ``controlnet_1``, ``controlnet_2``...: MultiControlNetModel.save_pretrained's names."""
    return ["controlnet" if k == 0 else f"controlnet_{k}" for k in range(count)]


def _controlnets(pipe) -> list:
    """The pipeline's ControlNets in order (one, or a MultiControlNetModel's nets)."""
    controlnet = getattr(pipe, "controlnet", None)
    if controlnet is None:
        return []
    return list(controlnet.nets) if hasattr(controlnet, "nets") else [controlnet]


def _component_config_source(pipe, name: str):
    controlnets = dict(zip(controlnet_folders(len(_controlnets(pipe))), _controlnets(pipe)))
    return {"text_encoder": pipe.text_encoder, "text_encoder_2": getattr(pipe, "text_encoder_2", None),
            "unet": pipe.unet, "vae_decoder": pipe.vae, "vae_encoder": pipe.vae, **controlnets}[name]


def _write_component_config(model, out_dir: Path) -> None:
    if hasattr(model, "save_config"):          # diffusers ConfigMixin: config.json
        model.save_config(str(out_dir))
    else:                                       # transformers PreTrainedModel
        model.config.save_pretrained(str(out_dir))


def resave_external(path, data_name: str) -> None:
    """Re-save ``path`` with every tensor in one external file ``data_name`` next to it
    (removing the data files it pointed to before)."""
    import onnx

    from .export import model_files

    path = Path(path)
    old = [Path(f) for f in model_files(path)[1:]]
    model = onnx.load(str(path), load_external_data=True)
    for f in old:
        f.unlink()
    # Tensors under 1 KB stay inline (onnx's default): ORT's shape inference reads small
    # initializers (Unsqueeze axes, Reshape shapes) only from inline data.
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=data_name)


def write_onnx_folder(kind: str, out_dir, size: str = "tiny", exporter: str = "torchscript", seed: int = 0,
                      data_name: str | dict | None = None, components=None, pipe=None) -> dict[str, BuiltModel]:
    """Export the pipeline ``kind`` to an ONNX folder at ``out_dir`` (see the module docstring).

    ``data_name``: None keeps what the exporter writes, made inline for tiny models (the dynamo
    exporter always writes ``model.onnx.data``); a name from :data:`DATA_NAMES` moves every
    component's tensors to that external file; a dict ``{component: name}`` does it for some.
    ``components``: the component folders to write (default all).  ``pipe``: a pipeline from
    :func:`build_torch_pipeline` with the same kind/size/seed, to skip building it again.
    Returns the exported components (folder name -> BuiltModel, whose ``module`` is the torch
    reference of that ONNX file).
    """
    from .export import export, inline_external_data

    check_choice("kind", kind, PIPELINE_KINDS)
    check_choice("exporter", exporter, EXPORTERS)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if pipe is None:
        pipe = build_torch_pipeline(kind, size, seed, tokenizer_dir=out_dir)
    else:
        for name in ("tokenizer", "tokenizer_2"):
            tok = getattr(pipe, name, None)
            if tok is not None:
                tok.save_pretrained(str(out_dir / name))
    pipe.save_config(str(out_dir))                       # model_index.json
    pipe.scheduler.save_pretrained(str(out_dir / "scheduler"))
    models = component_models(pipe, kind, size, seed)
    if components is not None:
        _index_only(out_dir, [k for k in models if k not in components])
        models = {k: v for k, v in models.items() if k in components}
    names = data_name if isinstance(data_name, dict) else {k: data_name for k in models}
    for name, bm in models.items():
        cdir = out_dir / name
        cdir.mkdir(exist_ok=True)
        path = cdir / "model.onnx"
        export(bm, path, exporter, "dynamic")
        dn = names.get(name)
        if dn is None:
            if size == "tiny":
                inline_external_data(path)
        else:
            if dn not in DATA_NAMES:
                raise ValueError(f"data_name must be one of {DATA_NAMES}, got {dn!r}")
            resave_external(path, dn)
        _write_component_config(_component_config_source(pipe, name), cdir)
    return models


def _index_only(out_dir: Path, left_out: list[str]) -> None:
    """model_index.json without the entries of the components not written (an index that names a
    component the folder lacks is refused by onnxopt, as diffusers would fail to load it)."""
    from onnxopt.pipeline.folder import INDEX_ENTRIES

    path = Path(out_dir) / "model_index.json"
    index = json.loads(path.read_text())
    for key, needed in INDEX_ENTRIES.items():
        if key in index and needed.split("/")[0] in left_out:
            index[key] = [None, None]
    path.write_text(json.dumps(index, indent=2))


def copy_folder(src, dst) -> None:
    """Copy a pipeline folder (used to publish built folders)."""
    dst = Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


def folder_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
