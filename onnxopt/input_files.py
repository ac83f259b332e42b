"""Files a user names as inputs beside a model (a LoRA, an image, a mask, a prompts file): only
regular files are read.

A named pipe blocks the first read until some writer comes (forever, for a command run alone), a
device never ends (/dev/zero, /dev/urandom) or answers nothing: each is refused with one line
before it is opened, as the pipeline folder's own entries are
(:func:`onnxopt.pipeline.folder.check_folder_paths`). A missing file and a folder are left to the
reader, which says so in its own words.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from onnxopt.errors import OnnxoptError


def refuse_special_file(path, what: str, error: type[OnnxoptError] = OnnxoptError) -> Path:
    """``path`` (a symbolic link followed), or ``error`` when it names a named pipe, socket or device."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # missing, unreadable, or a name with a NUL: the reader says which
        return path
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise error(f"{path}: not a regular file (a named pipe, socket or device); {what} is read from a file")
    return path
