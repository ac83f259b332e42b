"""One status line on a terminal while long work runs, and a clean line break when it is cut short.

    with progress.status() as line:          # prints only when stderr is a terminal
        line.show("[2/4] unet: fuse-attention")
        progress.show_pass("fuse-attention")  # from deep inside (the pass manager), no plumbing

The line is rewritten in place (``\\r`` and erase-to-end) and erased when the block ends, so the
report printed after it starts on a clean line. :func:`end_line` ends a line a progress display
(this one, or a tqdm bar such as generate's) left unfinished: "onnxopt: interrupted" after Ctrl-C
starts on a fresh line instead of being glued to the bar.
"""

from __future__ import annotations

import contextlib
import sys
from contextvars import ContextVar
from typing import Iterator


class StatusLine:
    def __init__(self, stream) -> None:
        self.stream, self.prefix, self.open = stream, "", False

    def show(self, text: str) -> None:
        self.prefix = text
        self._write(text)

    def detail(self, text: str) -> None:
        """``prefix: text``: what the current item is doing now (the pass being run)."""
        self._write(f"{self.prefix}: {text}" if self.prefix else text)

    def _write(self, text: str) -> None:
        self.stream.write("\r\x1b[K" + text[: _columns() - 1])
        self.stream.flush()
        self.open = True

    def clear(self) -> None:
        if self.open:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.open = False


class _Silent:
    open = False

    def show(self, text: str) -> None:
        pass

    def detail(self, text: str) -> None:
        pass

    def clear(self) -> None:
        pass


_current: ContextVar[StatusLine | None] = ContextVar("onnxopt_status_line", default=None)


def _columns() -> int:
    import shutil

    return shutil.get_terminal_size((100, 24)).columns


@contextlib.contextmanager
def status(enabled: bool = True) -> Iterator[StatusLine | _Silent]:
    """A status line on stderr when ``enabled`` and stderr is a terminal, else one that prints nothing."""
    stream = sys.stderr
    if not enabled or not getattr(stream, "isatty", lambda: False)():
        yield _Silent()
        return
    line = StatusLine(stream)
    token = _current.set(line)
    try:
        yield line
    except BaseException:
        line.open and end_line()  # an error or Ctrl-C: keep what was shown, its message on the next line
        raise
    else:
        line.clear()
    finally:
        _current.reset(token)


def show_pass(name: str) -> None:
    """The pass now running, on the status line if one is shown (else nothing)."""
    line = _current.get()
    if line is not None:
        line.detail(name)


def end_line() -> None:
    """End a line left unfinished on stderr by a status line or a tqdm bar (then silenced)."""
    unfinished = False
    line = _current.get()
    if line is not None and line.open:
        line.open, unfinished = False, True
    tqdm = sys.modules.get("tqdm.std")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ()):
        if not getattr(bar, "disable", True):
            bar.disable, unfinished = True, True  # it would redraw itself when closed
    if unfinished:
        sys.stderr.write("\n")
        sys.stderr.flush()
