"""User-facing errors.

Everything a user can cause (a bad file, a missing pass, an unwritable path) raises an
:class:`OnnxoptError` subclass whose message is one readable line. The CLI prints that line and
exits with the error's ``exit_code``; a traceback means a bug in onnxopt, not in the input.
"""

from __future__ import annotations


class OnnxoptError(Exception):
    """Base class: a problem with the user's input or environment, reported as one line."""

    exit_code = 2


class ModelLoadError(OnnxoptError):
    """The input is not a loadable ONNX model (not ONNX, truncated, missing external data...)."""


class UnsupportedModelError(OnnxoptError):
    """The model is valid ONNX but outside what onnxopt handles (e.g. an unsupported opset)."""


class ModelSaveError(OnnxoptError):
    """The output could not be written."""


class UnknownPassError(OnnxoptError):
    """A pass or preset name that is not registered."""


class PassOptionError(OnnxoptError):
    """A pass was given an option value it does not take."""


class PassOrderError(OnnxoptError):
    """Passes listed in an order that cannot work (a pass before one it must follow)."""


class PassNotApplicableError(OnnxoptError):
    """A requested pass found nothing to do and the caller asked for that to be an error."""

    exit_code = 4


class VerificationError(OnnxoptError):
    """The optimized graph does not compute what the source computes, within tolerance."""

    exit_code = 1


class MissingDependencyError(OnnxoptError):
    """An optional dependency (onnxruntime, tensorrt, torch...) is not installed."""
