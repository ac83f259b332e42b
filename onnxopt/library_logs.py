"""The log lines of the libraries onnxopt drives, kept off the user's screen.

Polygraphy's and graphsurgeon's lines ([W] ..., [E] ..., about 300 "Found distinct tensors that
share the same name" warnings for one SD folder) and ONNX Runtime's warnings are not for onnxopt's
users: what went wrong reaches them as onnxopt's own one line (the libraries raise as well as log).
The CLI's ``--debug`` shows them; through the Python API, set the ``onnxopt`` logger to DEBUG.
"""

from __future__ import annotations

import contextlib
import logging


def debugging() -> bool:
    """The Python API's switch: ``logging.getLogger("onnxopt").setLevel(logging.DEBUG)``."""
    return logging.getLogger("onnxopt").isEnabledFor(logging.DEBUG)


@contextlib.contextmanager
def quiet_libraries(quiet: bool | None = None):
    """Silence graphsurgeon, Polygraphy and ONNX Runtime's default logger for the block (``quiet``
    None: unless :func:`debugging`)."""
    if quiet is None:
        quiet = not debugging()
    if not quiet:
        yield
        return
    from onnx_graphsurgeon.logger import G_LOGGER as GS_LOGGER
    from polygraphy.logger import G_LOGGER

    silent = max(G_LOGGER.CRITICAL, GS_LOGGER.CRITICAL) + 1
    previous = GS_LOGGER.severity
    GS_LOGGER.severity = silent
    try:
        import onnxruntime

        from onnxopt.runtime import ORT_QUIET

        onnxruntime.set_default_logger_severity(ORT_QUIET)  # they come back as exceptions: onnxopt's one line
    except ImportError:
        pass
    try:
        with G_LOGGER.verbosity(silent):
            yield
    finally:
        GS_LOGGER.severity = previous
