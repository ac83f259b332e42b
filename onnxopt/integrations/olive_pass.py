"""onnxopt as an Olive pass: any pass list or preset, with its options, on an ``ONNXModelHandler``.

Recipe step (``type`` is the name :mod:`onnxopt.integrations.olive_config` registers)::

    {"type": "Onnxopt", "passes": "ort-cuda", "options": {"fuse-attention": {...}},
     "verify": true, "dims": {"batch": 2}, "atol": 1e-4, "rtol": 1e-3}

Olive finds third-party passes through a package config (``olive run --package-config FILE``):
``python -m onnxopt.integrations.olive_config FILE`` writes one (see that module for why it holds
all of Olive's passes too).

Pipelines: Olive runs a pass on each component of a ``CompositeModelHandler`` itself (the pass
does not declare that it takes composite models), so every component gets the same passes.

What the step leaves behind: the optimized ``model.onnx`` (external data beside it past ~1.8 GB,
or with ``external_data: true``), ``onnxopt_report.json`` (the full report) in the same folder,
and a summary in ``model_attributes["onnxopt_reports"]`` (one entry per onnxopt step, carried by
Olive to later steps). A failed ``verify`` fails the step (Olive logs the one-line reason).

Evaluating: the evaluator type ``OnnxoptReportEvaluator`` (registered when this module is imported:
name a script that imports it as the evaluator's ``user_script``) is Olive's ONNX evaluator, so
the recipe's metrics (latency, accuracy...) run as usual, plus a metric ``onnxopt`` read from
those summaries (:func:`report_metrics`). (An Olive ``custom`` metric would be the lighter way,
but olive-ai 0.13.0 cannot serialise a run config holding one: ``Metric.serialize_backend`` calls
``model_dump()`` on the ``None`` backend every custom metric gets.)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Union

from onnxopt.integrations import require

OLIVE_INSTALL = "'onnxopt[olive]' (olive-ai)"
require("olive", OLIVE_INSTALL)

from olive.evaluator.metric_result import MetricResult, SubMetricResult, flatten_metric_result  # noqa: E402
from olive.evaluator.olive_evaluator import OnnxEvaluator  # noqa: E402
from olive.evaluator.registry import Registry  # noqa: E402
from olive.hardware.accelerator import AcceleratorSpec  # noqa: E402
from olive.model import ONNXModelHandler  # noqa: E402
from olive.passes import Pass  # noqa: E402
from olive.passes.pass_config import BasePassConfig, PassConfigParam  # noqa: E402

REPORT_FILE = "onnxopt_report.json"
REPORTS_ATTRIBUTE = "onnxopt_reports"


class OnnxoptPass(Pass):
    """Run onnxopt passes and presets on an ONNX model (see the module docstring)."""

    @classmethod
    def _default_config(cls, accelerator_spec: AcceleratorSpec) -> dict[str, PassConfigParam]:
        return {
            "passes": PassConfigParam(type_=Union[str, list[str]], default_value="cleanup",
                                      description="onnxopt pass and preset names, a list or comma-separated "
                                                  "(`onnxopt passes` lists them)."),
            "options": PassConfigParam(type_=dict[str, dict[str, Any]], default_value=None,
                                       description="pass name -> that pass's options, as onnxopt.optimize takes them."),
            "verify": PassConfigParam(type_=bool, default_value=False,
                                      description="Compare every pass's result with the source on random inputs; "
                                                  "a difference beyond atol/rtol fails the step."),
            "atol": PassConfigParam(type_=Optional[float], default_value=None, description="verify: absolute tolerance"),
            "rtol": PassConfigParam(type_=Optional[float], default_value=None, description="verify: relative tolerance"),
            "dims": PassConfigParam(type_=dict[str, int], default_value=None,
                                    description="verify: values of symbolic dims (default batch 2, others 8)."),
            "shapes": PassConfigParam(type_=dict[str, list[int]], default_value=None,
                                      description="verify: whole input shapes by input name."),
            "strict": PassConfigParam(type_=bool, default_value=False,
                                      description="A requested fusion that finds nothing to fuse fails the step."),
            "external_data": PassConfigParam(type_=Optional[bool], default_value=None,
                                             description="Weights in model.onnx.data: true, false, or null (only "
                                                         "past ~1.8 GB)."),
        }

    def _run_for_config(self, model: ONNXModelHandler, config: type[BasePassConfig],
                        output_model_path: str) -> ONNXModelHandler:
        from onnxopt.api import optimize
        from onnxopt.saving import save_model
        from onnxopt.verify import InputSpec, Tolerance

        passes = config.passes.split(",") if isinstance(config.passes, str) else list(config.passes)
        tolerance = None
        if config.atol is not None or config.rtol is not None:
            default = Tolerance()
            tolerance = Tolerance(atol=default.atol if config.atol is None else config.atol,
                                  rtol=default.rtol if config.rtol is None else config.rtol)
        inputs = InputSpec(shapes={k: tuple(v) for k, v in (config.shapes or {}).items()}, dims=dict(config.dims or {}))
        result, report = optimize(model.model_path, [p.strip() for p in passes if p.strip()], verify=config.verify,
                                  tolerance=tolerance, inputs=inputs, strict=config.strict, options=config.options)
        if report.first_broken_pass:
            from onnxopt.errors import VerificationError

            broken = next((p for p in report.passes if p.verification and not p.verification.ok), None)
            raise VerificationError(f"onnxopt verification failed at pass '{report.first_broken_pass}'"
                                    + (f": {broken.verification.message}" if broken else ""))
        folder = Path(output_model_path).with_suffix("") if Path(output_model_path).suffix == ".onnx" \
            else Path(output_model_path)
        folder.mkdir(parents=True, exist_ok=True)
        output = folder / Path(model.model_path).name
        save_model(result, output, external_data=config.external_data)
        (folder / REPORT_FILE).write_text(report.to_json())
        attributes = dict(model.model_attributes or {})
        attributes[REPORTS_ATTRIBUTE] = [*attributes.get(REPORTS_ATTRIBUTE, []), _summary(report, passes)]
        return ONNXModelHandler(model_path=str(folder), onnx_file_name=output.name,
                                inference_settings=model.inference_settings, model_attributes=attributes)


def _summary(report, passes: list[str]) -> dict[str, Any]:
    """What the evaluator reads: JSON-safe numbers from the onnxopt report."""
    verification = report.final_verification
    return {
        "passes": ",".join(passes),
        "nodes_before": report.nodes_before,
        "nodes_after": report.nodes_after,
        "sites_rewritten": sum(p.result.sites_rewritten for p in report.passes),
        "verified": bool(verification and verification.ok),
        "max_abs_error": float(verification.max_abs_error) if verification and math.isfinite(verification.max_abs_error) else None,
        "seconds": round(report.seconds, 3),
    }


HIGHER_IS_BETTER = {"nodes_before": False, "nodes_after": False, "sites_rewritten": True, "verified": True,
                    "max_abs_error": False}


def report_metrics(model, device=None, execution_providers=None) -> dict[str, float]:
    """The onnxopt steps' reports on ``model`` (an Olive model handler), summed up; also usable as
    a custom metric's ``evaluate_func``.

    Sub-metrics: ``nodes_before`` (of the first onnxopt step), ``nodes_after`` (of the last),
    ``sites_rewritten`` (all steps), ``verified`` (1 when every step that verified passed, else
    0), ``max_abs_error`` (the largest verified error; 0 when none verified)."""
    reports = (model.model_attributes or {}).get(REPORTS_ATTRIBUTE) or []
    if not reports:
        raise ValueError("the model carries no onnxopt report: run an Onnxopt step before evaluating it")
    errors = [r["max_abs_error"] for r in reports if r.get("max_abs_error") is not None]
    return {
        "nodes_before": float(reports[0]["nodes_before"]),
        "nodes_after": float(reports[-1]["nodes_after"]),
        "sites_rewritten": float(sum(r["sites_rewritten"] for r in reports)),
        "verified": float(all(r["verified"] for r in reports)),
        "max_abs_error": float(max(errors, default=0.0)),
    }


@Registry.register("OnnxoptReportEvaluator")
class OnnxoptReportEvaluator(OnnxEvaluator):
    """Olive's ONNX evaluator plus the metric ``onnxopt`` (``onnxopt-nodes_after``, ...: see
    :func:`report_metrics`), read from the report the Onnxopt steps left on the model."""

    def evaluate(self, model, metrics, device="cpu", execution_providers=None) -> MetricResult:
        measured = super().evaluate(model, metrics, device, execution_providers) if metrics else None
        report = MetricResult.model_validate({
            name: SubMetricResult(value=value, priority=-1, higher_is_better=HIGHER_IS_BETTER[name])
            for name, value in report_metrics(model).items()
        })
        ours = flatten_metric_result({"onnxopt": report})
        return MetricResult.model_validate({**(measured.root if measured else {}), **ours.root})
