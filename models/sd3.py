"""A tiny SD3.5 pipeline (diffusers' ``StableDiffusion3Pipeline`` with seeded random weights) and its
ONNX folder, as ``onnxopt generate`` reads it.

    pipe = build_torch_sd3_pipeline(seed=0, tokenizer_dir=tmp)         # torch, fp32, CPU
    write_sd3_onnx_folder(pipe, out_dir)                                # ONNX folder, diffusers' index

The components keep SD3.5-Medium's structure at tiny widths:

* ``text_encoder`` CLIP-L and ``text_encoder_2`` CLIP-G (OpenCLIP bigG), both
  ``CLIPTextModelWithProjection`` (models/clip.py tiny configs), exported with every hidden state
  (``text_embeds``, ``last_hidden_state``, ``hidden_states.0..L``: optimum's names);
* ``text_encoder_3`` the T5 v1.1 encoder (models/t5.py tiny, d_model widened to 64 so that it
  is the transformer's ``joint_attention_dim`` and wider than the two CLIPs' 32 + 32, as in the
  real model: diffusers pads the CLIP states to T5's width);
* ``transformer`` the tiny SD3.5-Medium MMDiT (models/dit.py: dual attention, QK RMSNorm) with
  ``joint_attention_dim`` 64 and ``pooled_projection_dim`` 32 + 24 (the two CLIP projections);
* ``vae_decoder`` / ``vae_encoder`` the tiny 16-channel VAE with SD3's scaling and shift factors;
* ``scheduler`` FlowMatchEulerDiscreteScheduler with SD3.5-Medium's ``shift`` 3.0;
* tokenizers: the tiny CLIP BPE (``tokenizer`` pads with ``<|endoftext|>``, ``tokenizer_2`` with
  ``!``, as SD3's do) and a tiny T5 unigram tokenizer written as ``tokenizer.json`` alone
  (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, as T5's).

The folder's layout is the one optimum-onnx writes for StableDiffusion3Pipeline (component folders
``text_encoder*/``, ``transformer/``, ``vae_decoder/``, ``vae_encoder/``), with model_index.json as
diffusers' ``save_pretrained`` writes it (optimum's exporter writes the torch pipeline's own index
too); the graphs are onnxopt's TorchScript exports with optimum's input and output names.

``models/pipelines/sd35-tiny-optimum`` is the same torch pipeline exported by optimum-onnx itself::

    python3 -m models.sd3 --optimum-cli /work/venvs/optimum/bin/optimum-cli   # see models/optimum_fixture.py
"""
from __future__ import annotations

import json
from pathlib import Path

SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
T5_OVERRIDES = dict(d_model=64)
TRANSFORMER_OVERRIDES = dict(joint_attention_dim=64, pooled_projection_dim=32 + 24)
T5_WORDS = ("a photo of cat dog red blue green house tree sky sun night city street big small old new bright dark "
            "painting portrait landscape detailed").split()


def write_t5_tokenizer(out_dir) -> None:
    """A tiny T5-style unigram tokenizer as ``tokenizer.json`` alone: ``<pad>`` 0, ``</s>`` 1,
    ``<unk>`` 2, then ``▁``-prefixed words and single characters; ``</s>`` appended to every text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -2.0 - i * 0.01) for i, w in enumerate(T5_WORDS)]
    pieces += [(c, -10.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?-\u2581"]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Replace("  ", " "), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                             special_tokens=[("</s>", 1)])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))


def build_torch_sd3_pipeline(seed: int = 0, tokenizer_dir=None, t5: bool = True, size: str = "tiny"):
    """The tiny StableDiffusion3Pipeline (fp32, CPU, eval). ``tokenizer_dir``: where the tokenizers are
    written (and loaded back from). ``t5=False``: without text_encoder_3 / tokenizer_3, as diffusers allows.
    ``size="full"``: SD3.5-Medium's published configs (models/dit.py, clip.py, t5.py, vae.py: CLIP-L,
    OpenCLIP bigG, T5-XXL, the 2.5 B MMDiT, the 16-channel VAE), 7.7 B parameters, 31 GB in fp32; the
    tiny tokenizers serve both sizes (their ids are valid for the full vocabularies)."""
    import tempfile

    import diffusers
    from transformers import T5TokenizerFast

    from .clip import CONFIGS as CLIP_CONFIGS
    from .dit import make_transformer
    from .pipelines import _text_encoder, write_tokenizer
    from .t5 import make_t5
    from .vae import make_vae

    tmp = None
    if tokenizer_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="onnxopt-sd3-tokenizer-")
        tokenizer_dir = tmp.name
    tokenizer_dir = Path(tokenizer_dir)
    tiny = size == "tiny"
    try:
        parts = dict(
            transformer=make_transformer("sd35-medium", size, seed,
                                         overrides=TRANSFORMER_OVERRIDES if tiny else None).eval(),
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER_CONFIG),
            vae=make_vae(size, seed, family="vae16-decoder").eval(),
            text_encoder=_text_encoder(CLIP_CONFIGS[("clip-text", size)], True, seed).eval(),
            tokenizer=write_tokenizer(tokenizer_dir / "tokenizer", "<|endoftext|>"),
            text_encoder_2=_text_encoder(CLIP_CONFIGS[("openclip-text", size)], True, seed + 1).eval(),
            tokenizer_2=write_tokenizer(tokenizer_dir / "tokenizer_2", "!"),
            text_encoder_3=None, tokenizer_3=None)
        if t5:
            write_t5_tokenizer(tokenizer_dir / "tokenizer_3")
            parts["text_encoder_3"] = make_t5(size, seed=seed + 2, overrides=T5_OVERRIDES if tiny else None).eval()
            parts["tokenizer_3"] = T5TokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer_3" / "tokenizer.json"))
        return diffusers.StableDiffusion3Pipeline(**parts)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _export(module, args: tuple, path: Path, inputs: list[str], outputs: list[str], dynamic: dict) -> None:
    """TorchScript export; weights inline under 2 GB, else in one ``model.onnx_data`` (optimum's name)."""
    import torch

    from .bigexport import merge_external_data
    from .export import inline_external_data

    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(module, args, str(path), input_names=inputs, output_names=outputs, dynamic_axes=dynamic,
                          opset_version=17, dynamo=False)
    if sum(p.numel() * p.element_size() for p in module.parameters()) < 1_800_000_000:
        inline_external_data(path)
    else:  # past 2 GB the exporter wrote one file per tensor
        merge_external_data(path, "model.onnx_data")


def write_sd3_onnx_folder(pipe, out_dir, tokenizer_dir=None) -> Path:
    """Export ``pipe`` (from :func:`build_torch_sd3_pipeline`) to an ONNX pipeline folder at ``out_dir``
    (TorchScript exporter, opset 17, dynamic batch, sequence and size). ``tokenizer_dir``: where
    build_torch_sd3_pipeline wrote the tokenizers (copied as they are: T5's is tokenizer.json alone)."""
    import shutil

    import torch

    from .dit import SD3Wrapper
    from .pipelines import _Wrappers
    from .t5 import T5EncoderWrapper
    from .vae import VAEDecoderWrapper, VAEEncoderWrapper

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_config(str(out))
    pipe.scheduler.save_pretrained(str(out / "scheduler"))
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        if getattr(pipe, name, None) is None:
            continue
        if tokenizer_dir is not None and (Path(tokenizer_dir) / name).is_dir():
            shutil.copytree(Path(tokenizer_dir) / name, out / name, dirs_exist_ok=True)
        else:
            getattr(pipe, name).save_pretrained(str(out / name))

    seq = {0: "batch", 1: "sequence"}
    ids = torch.ones(2, 77, dtype=torch.int32)
    TextEncoder = _Wrappers.get()["TextEncoder"]
    for name in ("text_encoder", "text_encoder_2"):
        model = getattr(pipe, name)
        hidden = [f"hidden_states.{i}" for i in range(model.config.num_hidden_layers + 1)]
        outputs = ["text_embeds", "last_hidden_state", *hidden]
        _export(TextEncoder(model, True).eval(), (ids,), out / name / "model.onnx", ["input_ids"], outputs,
                {"input_ids": seq, "text_embeds": {0: "batch"}, **{o: seq for o in outputs[1:]}})
        model.config.save_pretrained(str(out / name))
    if pipe.text_encoder_3 is not None:
        _export(T5EncoderWrapper(pipe.text_encoder_3).eval(), (torch.ones(2, 20, dtype=torch.int64),),
                out / "text_encoder_3" / "model.onnx", ["input_ids"], ["last_hidden_state"],
                {"input_ids": seq, "last_hidden_state": seq})
        pipe.text_encoder_3.config.save_pretrained(str(out / "text_encoder_3"))

    cfg = pipe.transformer.config
    latent = {0: "batch", 2: "height", 3: "width"}
    example = (torch.randn(2, cfg.in_channels, 8, 6), torch.randn(2, 20, cfg.joint_attention_dim),
               torch.randn(2, cfg.pooled_projection_dim), torch.tensor([500.0, 500.0]))
    _export(SD3Wrapper(pipe.transformer).eval(), example, out / "transformer" / "model.onnx",
            ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"], ["out_hidden_states"],
            {"hidden_states": latent, "encoder_hidden_states": seq, "pooled_projections": {0: "batch"},
             "timestep": {0: "batch"}, "out_hidden_states": latent})
    pipe.transformer.save_config(str(out / "transformer"))

    image = {0: "batch", 2: "image_height", 3: "image_width"}
    channels = pipe.vae.config.latent_channels
    _export(VAEDecoderWrapper(pipe.vae).eval(), (torch.randn(1, channels, 8, 6),), out / "vae_decoder" / "model.onnx",
            ["latent_sample"], ["sample"], {"latent_sample": latent, "sample": image})
    _export(VAEEncoderWrapper(pipe.vae).eval(), (torch.randn(1, 3, 16, 12),), out / "vae_encoder" / "model.onnx",
            ["sample"], ["latent_sample"], {"sample": image, "latent_sample": latent})
    for name in ("vae_decoder", "vae_encoder"):
        pipe.vae.save_config(str(out / name))
    return out


DEFAULT_OUT = Path(__file__).parent / "pipelines" / "sd35-tiny-optimum"


def write_with_optimum(out: Path, optimum_cli: Path, seed: int = 0) -> None:
    """``build_torch_sd3_pipeline(seed)`` saved by diffusers, then exported by optimum-onnx's
    ``optimum-cli export onnx --task text-to-image`` from its own venv (it pins transformers 4)."""
    import shutil
    import tempfile

    from .optimum_fixture import export_with_optimum

    with tempfile.TemporaryDirectory(prefix="onnxopt-optimum-sd3-") as tmp:
        torch_dir, onnx_dir = Path(tmp) / "torch", Path(tmp) / "onnx"
        build_torch_sd3_pipeline(seed, Path(tmp) / "tok").save_pretrained(str(torch_dir))
        # transformers 5 writes tokenizer configs transformers 4 cannot read: the files as written here,
        # and T5's tokenizer.json alone (transformers 4's T5TokenizerFast; the slow one needs sentencepiece)
        for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
            shutil.rmtree(torch_dir / name)
            shutil.copytree(Path(tmp) / "tok" / name, torch_dir / name)
        index = json.loads((torch_dir / "model_index.json").read_text())
        index["tokenizer_3"] = ["transformers", "T5TokenizerFast"]
        (torch_dir / "model_index.json").write_text(json.dumps(index, indent=2))
        export_with_optimum(torch_dir, onnx_dir, out, optimum_cli, f"models.sd3.build_torch_sd3_pipeline(seed={seed})")


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="write models/pipelines/sd35-tiny-optimum with optimum-onnx")
    parser.add_argument("--optimum-cli", type=Path, required=True, help="optimum-cli of a venv with optimum-onnx")
    parser.add_argument("-o", "--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    write_with_optimum(args.out, args.optimum_cli)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
