"""Flux.1 pipelines (dev and schnell) with seeded random weights, and their ONNX folders.

``build_flux_pipeline(kind, size, seed)`` assembles diffusers' ``FluxPipeline`` from the component
builders of this package: the Flux transformer (``models.dit``), CLIP-L (``models.clip``, its
pooled output), the T5 encoder (``models.t5``), the 16-channel VAE (``models.vae``) with Flux's
scaling and shift factors, a ``CLIPTokenizer`` (``models.pipelines.write_tokenizer``), a T5
tokenizer written as ``tokenizer.json`` (a Unigram model over the same prompt words, T5's layout:
``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, ``</s>`` appended) and the scheduler config the public model
ships.  ``write_flux_onnx_folder(kind, out_dir)`` exports it in diffusers' ONNX layout::

    model_index.json                  FluxPipeline (pipeline.save_config)
    scheduler/scheduler_config.json   FlowMatchEulerDiscreteScheduler
    tokenizer/  tokenizer_2/          CLIP's vocab.json + merges.txt; T5's tokenizer.json
    text_encoder/model.onnx           CLIP-L: input_ids (int32) -> last_hidden_state, pooler_output
    text_encoder_2/model.onnx         T5: input_ids (int64) -> last_hidden_state
    transformer/model.onnx            hidden_states [B, HW/4, 64], encoder_hidden_states, pooled_projections,
                                      timestep (float32 [B], sigma in (0, 1]), img_ids [HW/4, 3] and
                                      txt_ids [S, 3] (float32, as diffusers makes them) [dev: guidance [B]]
                                      -> out_hidden_states
    vae_decoder/model.onnx            latent_sample (already / scaling_factor + shift_factor) -> sample
    vae_encoder/model.onnx            sample -> latent_sample (the latent distribution's mean)
    <component>/config.json           the torch component's config

optimum-onnx writes the same folders from ``save_pretrained`` (``models.optimum_fixture``), with
int64 ids and its own output names for the VAE encoder.

Tiny sizes differ from the component builders' tiny configs where a pipeline needs them to agree:
the transformer's ``pooled_projection_dim`` is CLIP's width (32) and its ``joint_attention_dim``
is T5's ``d_model``, which is 24 here (T5's own tiny is 32), so that no two text widths coincide.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .base import BuiltModel, SIZES, check_choice

FLUX_KINDS = ("flux-dev", "flux-schnell")
T5_MAX_LENGTH = 512  # FluxPipeline's max_sequence_length default

# Scheduler configs, written by hand after the public scheduler/scheduler_config.json files.
FLUX_SCHEDULER_CONFIGS = {
    # black-forest-labs/FLUX.1-dev: resolution-dependent shift (mu from the image's token count)
    "flux-dev": dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                     num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True),
    # black-forest-labs/FLUX.1-schnell: a fixed shift of 1
    "flux-schnell": dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                         num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False),
}
FLUX_VAE_FACTORS = (0.3611, 0.1159)  # black-forest-labs/FLUX.1-dev vae/config.json: scaling_factor, shift_factor
T5_TINY_OVERRIDES = dict(d_model=24)
T5_SEED_OFFSET = 1  # T5's seed is the pipeline's + 1 (CLIP's is the pipeline's)
CLIP_TINY_WIDTH = 32


def transformer_overrides(size: str) -> dict:
    """The transformer's text widths, as the pipeline's encoders give them (none at full size)."""
    return dict(pooled_projection_dim=CLIP_TINY_WIDTH, joint_attention_dim=T5_TINY_OVERRIDES["d_model"]) \
        if size == "tiny" else {}


def write_t5_tokenizer(out_dir, vocab_size: int = 512):
    """A ``T5TokenizerFast`` over a small Unigram vocabulary (fits ``vocab_size``), saved to
    ``out_dir`` (``tokenizer.json`` + ``tokenizer_config.json``) and loaded back."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    from .pipelines import _WORDS, _byte_alphabet

    specials = ["<pad>", "</s>", "<unk>"]
    words = list(dict.fromkeys("\u2581" + w for w in _WORDS))
    chars = ["\u2581", *_byte_alphabet()]
    pieces = [(p, 0.0) for p in specials] + [(c, -10.0) for c in chars]
    pieces += [(w, -1.0 - 0.01 * i) for i, w in enumerate(words)][:vocab_size - len(pieces)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    # T5's tokenizer.json: runs of spaces become one, "▁" marks a word's start, </s> ends the text
    tok.normalizer = normalizers.Sequence([normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    out_dir = Path(out_dir)
    fast = T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                           extra_ids=0, model_max_length=T5_MAX_LENGTH)
    fast.save_pretrained(str(out_dir))
    _readable_by_transformers_4(out_dir / "tokenizer_config.json")
    return T5TokenizerFast.from_pretrained(str(out_dir))


def _readable_by_transformers_4(config_path: Path) -> None:
    """transformers 5 writes "extra_special_tokens": [], which transformers 4 (optimum's) cannot read."""
    config = json.loads(config_path.read_text())
    if not config.get("extra_special_tokens", True):
        del config["extra_special_tokens"]
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def name_fast_t5_tokenizer(out_dir) -> None:
    """model_index.json names ``T5TokenizerFast``, as black-forest-labs/FLUX.1-dev's does (transformers 5
    saves its one T5 tokenizer class as ``T5Tokenizer``, which is sentencepiece's in transformers 4), and
    the saved T5 tokenizer config reads in transformers 4."""
    path = Path(out_dir) / "model_index.json"
    index = json.loads(path.read_text())
    index["tokenizer_2"] = ["transformers", "T5TokenizerFast"]
    path.write_text(json.dumps(index, indent=2) + "\n")
    tokenizer_config = Path(out_dir) / "tokenizer_2" / "tokenizer_config.json"
    if tokenizer_config.is_file():
        _readable_by_transformers_4(tokenizer_config)


# model_index.json's entries, as black-forest-labs/FLUX.1-dev's names them
COMPONENT_CLASSES = {"transformer": ["diffusers", "FluxTransformer2DModel"], "text_encoder": ["transformers", "CLIPTextModel"],
                     "text_encoder_2": ["transformers", "T5EncoderModel"], "vae": ["diffusers", "AutoencoderKL"]}


def name_unbuilt_components(out_dir) -> None:
    """model_index.json names the class of a component the pipeline was built without (saved as null: one
    exported on its own)."""
    path = Path(out_dir) / "model_index.json"
    index = json.loads(path.read_text())
    for name, entry in COMPONENT_CLASSES.items():
        if index.get(name) in (None, [None, None]):
            index[name] = entry
    path.write_text(json.dumps(index, indent=2) + "\n")


def _components(kind: str, size: str, seed: int, dtype=None, skip=()) -> dict:
    """The torch modules of the pipeline (eval mode), deterministic in (kind, size, seed).

    ``dtype``: the transformer and T5 are built in it (``torch.bfloat16``: the weights the streamed
    bfloat16 export writes, never 48 GB of float32 first); CLIP and the VAE are float32.
    ``skip``: components not built (None in the result), e.g. those exported on their own."""
    from . import dit
    from .pipelines import _text_encoder
    from .clip import CONFIGS as CLIP_CONFIGS
    from .t5 import make_t5
    from .vae import make_vae

    parts = dict.fromkeys(skip)
    if "transformer" not in skip:
        parts["transformer"] = dit.make_transformer(kind, size, seed, dtype=dtype,
                                                    overrides=transformer_overrides(size)).eval()
    if "vae" not in skip:
        vae = make_vae(size, seed, "vae16-decoder")
        scaling, shift = FLUX_VAE_FACTORS
        vae.register_to_config(scaling_factor=scaling, shift_factor=shift)
        parts["vae"] = vae.eval()
    if "text_encoder" not in skip:
        parts["text_encoder"] = _text_encoder(CLIP_CONFIGS[("clip-text", size)], False, seed).eval()
    if "text_encoder_2" not in skip:
        parts["text_encoder_2"] = make_t5(size, seed=T5_SEED_OFFSET + seed, dtype=dtype,
                                          overrides=t5_overrides(size)).eval()
    return parts


def t5_overrides(size: str) -> dict | None:
    return T5_TINY_OVERRIDES if size == "tiny" else None


def build_flux_pipeline(kind: str, size: str = "tiny", seed: int = 0, tokenizer_dir=None, dtype=None, skip=()):
    """diffusers' ``FluxPipeline`` of ``kind`` with seeded random weights (fp32, CPU); the tokenizers
    are written to ``tokenizer_dir/tokenizer{,_2}`` (a temporary folder when None). ``dtype`` and
    ``skip``: as :func:`_components` (a skipped component is None in the pipeline)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from .pipelines import write_tokenizer

    check_choice("kind", kind, FLUX_KINDS)
    check_choice("size", size, SIZES)
    with tempfile.TemporaryDirectory(prefix="onnxopt-tokenizer-") as tmp:
        root = Path(tokenizer_dir or tmp)
        tokenizer = write_tokenizer(root / "tokenizer", "<|endoftext|>", size)
        tokenizer_2 = write_t5_tokenizer(root / "tokenizer_2")
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(FLUX_SCHEDULER_CONFIGS[kind])
    return FluxPipeline(scheduler=scheduler, tokenizer=tokenizer, tokenizer_2=tokenizer_2,
                        **_components(kind, size, seed, dtype, skip))


def component_models(pipe, kind: str, size: str = "tiny", seed: int = 0, names=None) -> dict[str, BuiltModel]:
    """The exportable components of ``pipe``: folder name -> BuiltModel (wrapper + I/O specs);
    ``names``: only these (the others' modules may be None in ``pipe``)."""
    from . import dit
    from .pipelines import _Wrappers
    from .t5 import T5EncoderWrapper
    from .vae import VAEDecoderWrapper, VAEEncoderWrapper

    wrappers = _Wrappers.get()
    latent = dict(batch=1, height=8, width=12)
    seq = {0: "batch", 1: "sequence"}

    def built(name, module, specs, outputs, dyn, dims, feed_options=None):
        return BuiltModel(family=f"{kind}/{name}", size=size, attention="sdpa", module=module.eval(),
                          input_specs=specs, output_names=outputs, dynamic_axes=dyn, example_dims=dict(dims),
                          alt_dims={}, dim_multiples={}, sites={}, config={}, seed=seed,
                          feed_options=feed_options or {})

    ids = lambda dtype: [dict(name="input_ids", shape=["batch", "sequence"], dtype=dtype, kind="input_ids")]  # noqa: E731

    def transformer():
        model = dit.build(kind, size, seed=seed, overrides=transformer_overrides(size))
        model.module.transformer = pipe.transformer  # the pipeline's own weights (the same seeded ones)
        model.export_patches = {"torchscript": lambda: dit.flux_torchscript_patches(pipe.transformer)}
        model.example_dims = dict(batch=1, height=8, width=12, sequence=20)
        return model

    def image_dims():
        vae_factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        return dict(latent, image_height=vae_factor * 8, image_width=vae_factor * 12)

    makers = {
        "text_encoder": lambda: built(
            "text_encoder", wrappers["TextEncoder"](pipe.text_encoder, False), ids("int32"),
            ["last_hidden_state", "pooler_output"],
            {"input_ids": seq, "last_hidden_state": seq, "pooler_output": {0: "batch"}},
            dict(batch=1, sequence=77), {"vocab": len(pipe.tokenizer), "pad_id": pipe.tokenizer.pad_token_id}),
        "text_encoder_2": lambda: built(
            "text_encoder_2", T5EncoderWrapper(pipe.text_encoder_2), ids("int64"), ["last_hidden_state"],
            {"input_ids": seq, "last_hidden_state": seq}, dict(batch=1, sequence=20),
            {"vocab": len(pipe.tokenizer_2), "pad_id": 0}),
        "transformer": transformer,
        "vae_decoder": lambda: built(
            "vae_decoder", VAEDecoderWrapper(pipe.vae),
            [dict(name="latent_sample", shape=["batch", pipe.vae.config.latent_channels, "height", "width"],
                  dtype="float32", kind="latent")], ["sample"],
            {"latent_sample": {0: "batch", 2: "height", 3: "width"},
             "sample": {0: "batch", 2: "image_height", 3: "image_width"}}, image_dims()),
        "vae_encoder": lambda: built(
            "vae_encoder", VAEEncoderWrapper(pipe.vae),
            [dict(name="sample", shape=["batch", 3, "image_height", "image_width"], dtype="float32", kind="image")],
            ["latent_sample"], {"sample": {0: "batch", 2: "image_height", 3: "image_width"},
                                "latent_sample": {0: "batch", 2: "height", 3: "width"}}, image_dims()),
    }
    return {name: make() for name, make in makers.items() if names is None or name in names}


def write_flux_onnx_folder(kind: str, out_dir, size: str = "tiny", exporter: str = "torchscript", seed: int = 0,
                           pipe=None, names=None) -> dict[str, BuiltModel]:
    """Export the Flux pipeline ``kind`` to ``out_dir`` in diffusers' ONNX layout (module docstring);
    ``pipe``: one from :func:`build_flux_pipeline` with the same kind/size/seed, to skip building it;
    ``names``: only these component folders (with the pipeline's files: model_index.json, scheduler/,
    tokenizers; a full-size transformer and T5 are exported on their own, streamed: models.bigexport).
    Returns folder name -> BuiltModel (its ``module`` is the torch reference of that ONNX file)."""
    from .export import export, inline_external_data
    from .pipelines import EXPORTERS, _write_component_config

    check_choice("kind", kind, FLUX_KINDS)
    check_choice("exporter", exporter, EXPORTERS)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if pipe is None:
        pipe = build_flux_pipeline(kind, size, seed, tokenizer_dir=out_dir)
    else:
        pipe.tokenizer.save_pretrained(str(out_dir / "tokenizer"))
        pipe.tokenizer_2.save_pretrained(str(out_dir / "tokenizer_2"))
    pipe.save_config(str(out_dir))
    name_unbuilt_components(out_dir)
    name_fast_t5_tokenizer(out_dir)
    pipe.scheduler.save_pretrained(str(out_dir / "scheduler"))
    models = component_models(pipe, kind, size, seed, names)
    sources = dict(text_encoder=pipe.text_encoder, text_encoder_2=pipe.text_encoder_2, transformer=pipe.transformer,
                   vae_decoder=pipe.vae, vae_encoder=pipe.vae)
    for name, bm in models.items():
        path = out_dir / name / "model.onnx"
        export(bm, path, exporter, "dynamic")
        if size == "tiny":
            inline_external_data(path)
        _write_component_config(sources[name], out_dir / name)
    return models


def save_torch_pipeline(kind: str, out_dir, size: str = "tiny", seed: int = 0) -> Path:
    """``build_flux_pipeline(...).save_pretrained(out_dir)`` (what optimum-cli exports from)."""
    pipe = build_flux_pipeline(kind, size, seed)
    pipe.save_pretrained(str(out_dir))
    name_fast_t5_tokenizer(out_dir)
    return Path(out_dir)

