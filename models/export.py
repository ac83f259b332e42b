"""Export switches and export checking.

exporter:  ``torchscript`` -> ``torch.onnx.export(..., dynamo=False, opset_version=17)``
           ``dynamo``      -> ``torch.onnx.export(..., dynamo=True)`` (default opset, 18+;
                              the onnxscript optimizer runs, as by default)
shapes:    ``static``  -> every dim fixed to the example inputs
           ``dynamic`` -> batch, spatial and sequence dims symbolic (``dynamic_axes``; the
                          dynamo exporter turns them into ``Dim.AUTO`` dynamic shapes)
attention: chosen when the model is built (see :mod:`models.base`).

External data: the TorchScript exporter switches to external data by itself once
the model passes 2 GB and then writes one file per tensor next to the .onnx
file; the dynamo exporter always writes one ``<name>.onnx.data`` file (even for
tiny models).  Export full-size models into a directory of their own.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EXPORTERS = ("torchscript", "dynamo")
SHAPES = ("static", "dynamic")
TORCHSCRIPT_OPSET = 17


@dataclass
class ExportResult:
    path: str
    exporter: str
    shapes: str
    seconds: float
    files: list[str]          # every file written for this model (the .onnx plus external data)
    total_bytes: int


def model_files(path) -> list[str]:
    """The .onnx file followed by the external data files its tensors point to."""
    import onnx

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    locs = []
    for t in _all_tensors(model):
        for kv in t.external_data:
            if kv.key == "location" and kv.value not in locs:
                locs.append(kv.value)
    return [str(path)] + [str(path.parent / loc) for loc in locs]


def export(built, path, exporter: str = "torchscript", shapes: str = "dynamic", *,
           opset: int | None = None, quiet: bool = True, optimize: bool = True) -> ExportResult:
    """Export ``built`` (a :class:`models.base.BuiltModel`) to ``path``."""
    import torch

    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS}, got {exporter!r}")
    if shapes not in SHAPES:
        raise ValueError(f"shapes must be one of {SHAPES}, got {shapes!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    args = built.example_inputs
    dynamic_axes = built.dynamic_axes if shapes == "dynamic" else None
    t0 = time.perf_counter()
    with _exporting(built, exporter, quiet):
        if exporter == "torchscript":
            torch.onnx.export(
                built.module, args, str(path),
                dynamo=False,
                opset_version=opset or TORCHSCRIPT_OPSET,
                input_names=built.input_names,
                output_names=built.output_names,
                dynamic_axes=dynamic_axes,
                do_constant_folding=True,
            )
        else:
            kwargs = {}
            if opset:
                kwargs["opset_version"] = opset
            torch.onnx.export(
                built.module, args, str(path),
                dynamo=True,
                input_names=built.input_names,
                output_names=built.output_names,
                dynamic_axes=dynamic_axes,
                external_data=True,
                optimize=optimize,
                **kwargs,
            )
    secs = time.perf_counter() - t0
    files = model_files(path)
    return ExportResult(str(path), exporter, shapes, secs, files, sum(os.path.getsize(f) for f in files))


def dynamo_program(built, shapes: str = "dynamic", *, opset: int | None = None, quiet: bool = True):
    """The dynamo exporter's ONNX program for ``built``, unsaved and unoptimized (``optimize=False``).
    A module on the meta device is traced with meta inputs: its initializers hold no data."""
    import torch

    if shapes not in SHAPES:
        raise ValueError(f"shapes must be one of {SHAPES}, got {shapes!r}")
    device = next(built.module.parameters()).device
    args = tuple(a.to(device) for a in built.example_inputs)
    kwargs = {"opset_version": opset} if opset else {}
    with _exporting(built, "dynamo", quiet):
        return torch.onnx.export(built.module, args, None, dynamo=True, input_names=built.input_names,
                                 output_names=built.output_names,
                                 dynamic_axes=built.dynamic_axes if shapes == "dynamic" else None,
                                 optimize=False, **kwargs)


@contextlib.contextmanager
def _exporting(built, exporter: str, quiet: bool):
    """What every export call runs inside: no grad, the builder's patches for ``exporter``, and (quiet)
    the exporters' output and warnings swallowed."""
    import torch

    if quiet:
        # torch.onnx logs a warning per torchvision op it cannot register, on every dynamo export
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    sink = io.StringIO()
    redirect = (contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink)) if quiet else ()
    with contextlib.ExitStack() as stack, torch.no_grad():
        for r in redirect:
            stack.enter_context(r)
        if exporter in built.export_patches:
            stack.enter_context(built.export_patches[exporter]())
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        yield


@dataclass
class CheckResult:
    ok: bool
    max_abs_err: float
    max_rel_err: float        # max |a-b| / (atol/rtol + |b|): <= 1 within tolerance
    per_output: dict
    dims: dict
    nonfinite: bool

    def __str__(self):
        status = "OK" if self.ok else "MISMATCH"
        return f"{status} max_abs_err={self.max_abs_err:.3g} dims={self.dims}"


def run_onnx(path, feeds: dict, providers=("CPUExecutionProvider",)) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=list(providers))
    return sess.run(None, feeds)


def check_export(built, path, *, dims: dict | None = None, atol: float = 1e-4, rtol: float = 1e-4,
                 check_model: bool = True) -> CheckResult:
    """Load ``path`` with onnx, run it on ONNX Runtime CPU and compare with torch.

    ``dims`` overrides example dims (use ``built.alt_dims`` to check that a dynamic
    export really is dynamic).  Passes when ``|ort - torch| <= atol + rtol * |torch|``
    everywhere and all outputs are finite.
    """
    import onnx
    import torch

    path = str(path)
    if check_model:
        onnx.checker.check_model(path)  # path form: works for >2 GB models with external data
    model = onnx.load(path, load_external_data=False)
    graph_inputs = [i.name for i in model.graph.input]
    graph_outputs = [o.name for o in model.graph.output]
    if graph_inputs != list(built.input_names):
        raise AssertionError(f"graph inputs {graph_inputs} != {built.input_names}")
    if graph_outputs != list(built.output_names):
        raise AssertionError(f"graph outputs {graph_outputs} != {built.output_names}")
    del model
    d = dict(built.example_dims)
    d.update(dims or {})
    inputs = built.make_inputs(d)
    with torch.no_grad():
        ref = [t.detach().cpu().numpy() for t in built.module(*inputs)]
    feeds = {n: t.cpu().numpy() for n, t in zip(built.input_names, inputs)}
    got = run_onnx(path, feeds)
    per = {}
    worst_abs = worst_rel = 0.0
    ok = True
    nonfinite = False
    for name, r, g in zip(built.output_names, ref, got):
        if r.shape != g.shape:
            raise AssertionError(f"{name}: shape {g.shape} != torch {r.shape}")
        if not (np.isfinite(r).all() and np.isfinite(g).all()):
            nonfinite = True
            ok = False
        err = np.abs(g.astype(np.float64) - r.astype(np.float64))
        tol = atol + rtol * np.abs(r.astype(np.float64))
        mabs = float(err.max()) if err.size else 0.0
        mrel = float((err / tol).max()) if err.size else 0.0
        per[name] = {"max_abs_err": mabs, "ref_max_abs": float(np.abs(r).max()) if r.size else 0.0,
                     "shape": list(r.shape)}
        worst_abs, worst_rel = max(worst_abs, mabs), max(worst_rel, mrel)
        ok = ok and mrel <= 1.0
    return CheckResult(ok, worst_abs, worst_rel, per, d, nonfinite)


def inline_external_data(path, out_path=None) -> str:
    """Re-save a model with every tensor inside the .onnx file (models < 2 GB only).

    The dynamo exporter writes ``<name>.onnx.data`` even for tiny models; the
    data file next to the source is removed when ``out_path`` is the same path.
    """
    import onnx

    path = Path(path)
    out_path = Path(out_path or path)
    data_files = set()
    for init in _all_tensors(onnx.load(str(path), load_external_data=False)):
        for kv in init.external_data:
            if kv.key == "location":
                data_files.add(kv.value)
    model = onnx.load(str(path), load_external_data=True)
    onnx.save(model, str(out_path), save_as_external_data=False)
    if out_path == path:
        for f in data_files:
            p = path.parent / f
            if p.exists():
                p.unlink()
    return str(out_path)


def _all_tensors(model):
    from onnx import external_data_helper

    return list(external_data_helper._get_all_tensors(model))


def op_counts(path) -> dict[str, int]:
    import onnx
    from collections import Counter

    model = onnx.load(str(path), load_external_data=False)
    c = Counter()

    def walk(g):
        for n in g.node:
            c[n.op_type] += 1
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sg in a.graphs:
                        walk(sg)

    walk(model.graph)
    for f in model.functions:
        for n in f.node:
            c[n.op_type] += 1
    return dict(sorted(c.items()))


def describe_io(path) -> dict:
    """Graph inputs/outputs as {"inputs": [{name, shape, dtype}], "outputs": [...]}; symbolic dims as strings."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def vi(v):
        tt = v.type.tensor_type
        shape = []
        for dim in tt.shape.dim:
            if dim.HasField("dim_value"):
                shape.append(int(dim.dim_value))
            elif dim.HasField("dim_param"):
                shape.append(dim.dim_param)
            else:
                shape.append(None)
        return {"name": v.name, "shape": shape,
                "dtype": onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name}

    return {"inputs": [vi(v) for v in model.graph.input], "outputs": [vi(v) for v in model.graph.output],
            "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import}}
