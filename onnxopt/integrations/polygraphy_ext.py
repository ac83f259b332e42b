"""A Polygraphy extension module: ``polygraphy run`` with an onnxopt runner.

Polygraphy loads runners from the ``polygraphy.run.plugins`` entry-point group (its documented way
to extend ``polygraphy run``); onnxopt registers :func:`export_argument_groups` there, which adds
``--onnxopt`` to ``polygraphy run``. Beside ``--onnxrt`` it compares an onnxopt-optimized model
with its source on the same inputs, through Polygraphy's own data loader, comparator and
tolerances (``--atol``, ``--rtol``, ``--input-shapes``, ``--save-inputs``, ``--gen-script``)::

    # optimize in memory, then compare with the source (ORT CPU EP):
    polygraphy run unet.onnx --onnxrt --onnxopt --onnxopt-passes ort-cuda
    # an optimized file written earlier:
    polygraphy run unet.onnx --onnxrt --onnxopt --onnxopt-model unet.opt.onnx

The onnxopt runner runs the model where onnxopt's own verification runs it
(:func:`onnxopt.verify.runner_for`): ONNX Runtime's CPU EP when it has a kernel for every op and
the model computes in float32, else ``onnx.reference`` with onnxopt's NumPy kernels for the
com.microsoft fused ops (``--onnxopt-runtime reference`` forces those). So a graph made for the
CUDA EP, whose fused ops ORT's CPU build lacks, is checked on any machine.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from polygraphy.tools.args import ModelArgs
from polygraphy.tools.args.base import BaseRunnerArgs
from polygraphy.tools.script import make_invocable

RUNTIMES = ("auto", "reference")


def onnxopt_runner(path: str, passes: str | None = None, runtime: str = "auto"):
    """A Polygraphy runner for the model at ``path``, optimized first with ``passes`` (comma-
    separated onnxopt pass and preset names) when given. A bad model, pass name or option ends
    the run the way Polygraphy ends one: its one-line critical error (exit 1)."""
    from polygraphy.logger import G_LOGGER

    from onnxopt.api import optimize
    from onnxopt.errors import OnnxoptError
    from onnxopt.loading import load_model
    from onnxopt.verify import ReferenceRunner, runner_for

    try:
        if runtime not in RUNTIMES:
            raise OnnxoptError(f"--onnxopt-runtime must be one of {', '.join(RUNTIMES)}, not {runtime!r}")
        names = [p.strip() for p in (passes or "").split(",") if p.strip()]
        model = optimize(path, names)[0] if names else load_model(path)
        label = f"onnxopt[{','.join(names)}]" if names else f"onnxopt[{Path(path).name}]"
        if runtime == "reference":
            return ReferenceRunner(model.to_onnx(), name=label)
        return runner_for(model, label, Path(tempfile.gettempdir()))
    except OnnxoptError as exc:
        G_LOGGER.critical(f"onnxopt: {exc}")


class OnnxoptRunnerArgs(BaseRunnerArgs):
    """onnxopt: an onnxopt-optimized model, on ORT's CPU EP or onnxopt's NumPy reference kernels.

    Depends on:

        - ModelArgs
    """

    def get_name_opt_impl(self):
        return "onnxopt", "onnxopt"

    def add_parser_args_impl(self):
        self.group.add_argument("--onnxopt-passes", default=None,
                                help="optimize the model with these onnxopt passes and presets (comma-separated, "
                                     "e.g. ort-cuda) before running it")
        self.group.add_argument("--onnxopt-model", default=None,
                                help="run this ONNX file (an optimized model written earlier) instead of the model "
                                     "given to polygraphy run")
        self.group.add_argument("--onnxopt-runtime", choices=RUNTIMES, default="auto",
                                help="auto: ORT CPU EP where it has every kernel and the model is float32, else the "
                                     "reference kernels; reference: always onnx.reference with onnxopt's kernels")

    def parse_impl(self, args):
        self.passes = args.onnxopt_passes
        self.model = args.onnxopt_model
        self.runtime = args.onnxopt_runtime

    def add_to_script_impl(self, script):
        script.add_import(imports=["onnxopt_runner"], frm="onnxopt.integrations.polygraphy_ext")
        path = self.model or self.arg_groups[ModelArgs].path
        script.add_runner(make_invocable("onnxopt_runner", path, passes=self.passes, runtime=self.runtime))


def export_argument_groups():
    """The ``polygraphy.run.plugins`` entry point: the argument groups onnxopt adds to ``polygraphy run``."""
    return [OnnxoptRunnerArgs()]
