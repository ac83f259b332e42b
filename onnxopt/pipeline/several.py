"""Several images from one command: a prompts file, and the file names of a batch.

    read_prompts("prompts.txt")          # one prompt a line (LF or CRLF); blank lines skipped
    numbered_outputs("out/img.png", 3)   # out/img.png, out/img-1.png, out/img-2.png

With P prompts and ``--num-images N``, each prompt is its own generation (diffusers'
``pipe(prompt, num_images_per_prompt=N, generator=torch.Generator().manual_seed(seed))``: the same
seed for every prompt) and the P x N images are numbered prompt by prompt: prompt p's image i is
number p * N + i.
"""

from __future__ import annotations

import os
from pathlib import Path

from onnxopt.input_files import refuse_special_file
from onnxopt.pipeline.plan import GenerationError

MAX_PROMPTS = 10_000  # a prompts file is a list of prompts, not a corpus
MAX_PROMPTS_BYTES = 16 << 20  # read no further: 10,000 prompts of CLIP's 77 tokens fit in a few MB


def read_prompts(path) -> list[str]:
    """The prompts of ``path``, one a line; a one-line GenerationError for a folder, a named pipe or
    device, a file over :data:`MAX_PROMPTS_BYTES` (read no further), a file that is not UTF-8
    text, or one without any prompt."""
    path = refuse_special_file(path, "a prompts file (--prompts)", GenerationError)
    if path.is_dir():
        raise GenerationError(f"{path}: is a folder, not a prompts file (--prompts)")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_PROMPTS_BYTES + 1)
        if len(data) > MAX_PROMPTS_BYTES:
            raise GenerationError(f"{path}: over {MAX_PROMPTS_BYTES >> 20} MB, not a prompts file (--prompts: one "
                                  f"prompt a line, at most {MAX_PROMPTS} a run)")
        text = data.decode("utf-8-sig")
    except FileNotFoundError:
        raise GenerationError(f"{path}: no such prompts file (--prompts)") from None
    except UnicodeDecodeError:
        raise GenerationError(f"{path}: not UTF-8 text (--prompts: one prompt a line)") from None
    except OSError as exc:
        raise GenerationError(f"{path}: cannot read: {exc.strerror or exc}") from None
    # a line ends at \n, \r\n or \r (universal newlines), not at what str.splitlines also splits on (\f,
    # \x1c-\x1e, \x85, U+2028...): a prompt holding one became two, and every later image's number shifted
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise GenerationError(f"{path}: no prompt in the file (--prompts: one prompt a line)")
    if len(prompts) > MAX_PROMPTS:
        raise GenerationError(f"{path}: {len(prompts)} prompts, at most {MAX_PROMPTS} a run")
    return prompts


def numbered_outputs(path, count: int) -> list[Path]:
    """``path``, then ``<stem>-1<suffix>``, ``<stem>-2<suffix>``...: ``count`` names in all. A numbered
    name that is a symbolic link is refused: an image is never written through (or in place of) a link."""
    path = Path(path)
    names = [path] + [path.with_name(f"{path.stem}-{k}{path.suffix}") for k in range(1, count)]
    for name in names[1:]:
        if os.path.islink(name):
            raise GenerationError(f"{name}: is a symbolic link; onnxopt does not write images through links "
                                  "(remove it, or choose another -o)")
    return names
