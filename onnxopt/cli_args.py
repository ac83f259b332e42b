"""What the command line's flags mean to the API, for both ``optimize`` commands (one model, and a
pipeline folder in :mod:`onnxopt.pipeline.optimize_folder`): in a module of its own so that the
folder command does not import the CLI back."""

from __future__ import annotations

from pathlib import Path


def fp16_options(args) -> dict:
    """The fp16 pass's options from ``--low-precision``, ``--fp32-ops``, ... (the flags given only)."""
    options = {
        "low_precision": args.low_precision,
        "fp32_ops": tuple(filter(None, (args.fp32_ops or "").split(","))) or None,
        "fp32_nodes": tuple(filter(None, (args.fp32_nodes or "").split(","))) or None,
        "keep_io_types": args.keep_io_types,
        "fp32_auto": args.fp32_auto or None,
        "calibration": args.calibration,
    }
    return {k: v for k, v in options.items() if v is not None}


def write_report(path: Path, text: str) -> None:
    """One report file, written atomically (checked before the work as an output of the command)."""
    from onnxopt.outputs import staged

    with staged() as stage:
        stage.text(path, text)
