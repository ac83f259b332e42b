"""Bridges to the tools people already use around onnxopt: torch's dynamo exporter
(``ONNXProgram``), onnx-ir models, Olive and Polygraphy. Each module imports its tool lazily and
raises :class:`onnxopt.errors.MissingDependencyError` (exit 2, one line) when it is missing."""

from __future__ import annotations

import importlib

from onnxopt.errors import MissingDependencyError


def require(module: str, install: str):
    """Import ``module`` or raise MissingDependencyError naming what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name and exc.name.split(".")[0] != module.split(".")[0]:  # installed, but a package it imports is not
            raise MissingDependencyError(f"{module} does not import ({exc}): pip install {install}") from exc
        raise MissingDependencyError(f"{module} is not installed: pip install {install}") from exc
