"""Write ``models/pipelines/<kind>-tiny-optimum``: the repo's tiny SD 1.5 pipeline (seeded random
weights, ``build_torch_pipeline("sd15", "tiny")``) or tiny Flux.1 dev / schnell pipeline
(``models.flux_pipeline.build_flux_pipeline``) exported by optimum-onnx, as a user exports one.

    python3 -m models.optimum_fixture --optimum-cli /work/venvs/optimum/bin/optimum-cli [--kind K] [-o DIR]

optimum-onnx pins an older transformers and huggingface_hub than this project's diffusers takes, so
it runs from its own venv (``python3 -m venv V; V/bin/pip install optimum-onnx torch diffusers``
with a diffusers that accepts huggingface_hub < 1): this script saves the diffusers pipeline with the
project's python, then runs that venv's ``optimum-cli export onnx --task text-to-image`` on it.
The versions used are written to the folder's ``PROVENANCE.txt``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .pipelines import build_torch_pipeline

KINDS = ("sd15", "flux-dev", "flux-schnell")
PIPELINES = Path(__file__).parent / "pipelines"
DEFAULT_OUT = PIPELINES / "sd15-tiny-optimum"


def versions(python: Path) -> str:
    """The versions of the packages that shaped the export, as the optimum venv reports them."""
    code = ("import importlib.metadata as m\n"
            "for p in ('optimum-onnx', 'optimum', 'torch', 'transformers', 'diffusers', 'onnx'):\n"
            "    print(f'{p}=={m.version(p)}')")
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout


def _save_torch_pipeline(kind: str, torch_dir: Path, tokenizer_dir: Path, seed: int) -> str:
    """Save the torch pipeline of ``kind``; returns the call that built it (for PROVENANCE.txt)."""
    if kind == "sd15":
        build_torch_pipeline("sd15", "tiny", seed=seed, tokenizer_dir=tokenizer_dir).save_pretrained(str(torch_dir))
        return f"build_torch_pipeline('sd15', 'tiny', seed={seed})"
    from .flux_pipeline import build_flux_pipeline, name_fast_t5_tokenizer

    build_flux_pipeline(kind, "tiny", seed=seed, tokenizer_dir=tokenizer_dir).save_pretrained(str(torch_dir))
    name_fast_t5_tokenizer(torch_dir)
    return f"build_flux_pipeline('{kind}', 'tiny', seed={seed})"


def clip_keys_for_transformers_4(torch_dir: Path) -> None:
    """transformers 5 saves CLIPTextModel's weights without the ``text_model.`` prefix, which
    transformers 4 (optimum's) then does not find: it exports a randomly initialized encoder, with
    only a warning. Saved with the prefix, both versions load them. CLIPTextModelWithProjection and
    T5EncoderModel are saved with the keys transformers 4 reads (the projection sits beside
    ``text_model``, not in it), so they are left as they are."""
    from safetensors.numpy import load_file, save_file

    for path in torch_dir.glob("text_encoder*/model.safetensors"):
        if json.loads((path.parent / "config.json").read_text()).get("architectures") != ["CLIPTextModel"]:
            continue
        weights = load_file(str(path))
        save_file({k if k.startswith("text_model.") else f"text_model.{k}": v for k, v in weights.items()}, str(path),
                  metadata={"format": "pt"})


def export_with_optimum(torch_dir: Path, onnx_dir: Path, out: Path, optimum_cli: Path, built_by: str) -> None:
    """``optimum-cli export onnx --task text-to-image`` of the diffusers folder ``torch_dir`` (its text
    encoders' weights first saved where transformers 4 finds them) into ``onnx_dir``, with its
    PROVENANCE.txt (``built_by``: what saved ``torch_dir``), then copied to ``out``."""
    clip_keys_for_transformers_4(torch_dir)
    subprocess.run([str(optimum_cli), "export", "onnx", "--model", str(torch_dir), "--task", "text-to-image",
                    str(onnx_dir)], check=True)
    (onnx_dir / "PROVENANCE.txt").write_text(
        f"{built_by} saved by diffusers, then\n"
        "optimum-cli export onnx --model <that folder> --task text-to-image <this folder>\n"
        "with, in optimum's venv:\n" + versions(optimum_cli.parent / "python"))
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(onnx_dir, out)


def write(out: Path, optimum_cli: Path, seed: int = 0, kind: str = "sd15") -> None:
    with tempfile.TemporaryDirectory(prefix="onnxopt-optimum-") as tmp:
        torch_dir, onnx_dir = Path(tmp) / "torch", Path(tmp) / "onnx"
        built = _save_torch_pipeline(kind, torch_dir, Path(tmp) / "tok", seed)
        # transformers 5 saves the tokenizer as tokenizer.json alone; optimum's transformers 4 reads vocab + merges
        shutil.copytree(Path(tmp) / "tok" / "tokenizer", torch_dir / "tokenizer", dirs_exist_ok=True)
        export_with_optimum(torch_dir, onnx_dir, out, optimum_cli, built)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimum-cli", type=Path, required=True, help="optimum-cli of a venv with optimum-onnx")
    parser.add_argument("--kind", choices=KINDS, default="sd15")
    parser.add_argument("-o", "--out", type=Path, help="default: models/pipelines/<kind>-tiny-optimum")
    args = parser.parse_args(argv)
    args.out = args.out or PIPELINES / f"{args.kind}-tiny-optimum"
    write(args.out, args.optimum_cli, kind=args.kind)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out}: {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
