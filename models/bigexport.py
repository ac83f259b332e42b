"""Export a full-size model into a folder of its own: streamed, 2 GB-safe, weights held once.

    python -m models export flux-dev --size full --exporter dynamo --dtype bfloat16 -o /data/flux-dev-bf16
    python -m models export t5-xxl --size full --exporter torchscript -o /data/t5-xxl-ts

What it does, in order:

1. Builds the seeded model directly in ``dtype`` (``torch.set_default_dtype`` around the
   constructor: a bfloat16 Flux-dev is never 48 GB of float32 first).
2. ``--check``: torch's outputs at small dims, computed now (the export drops the torch weights).
3. Exports into a hidden sibling folder ``.<name>.partial-<pid>``:
   * ``dynamo``: exported with ``optimize=False`` (the ONNX program references the module's
     parameters, no copy) and saved, a tensor at a time, into one data file; the torch model is
     dropped; then the optimizer the exporter runs by default (onnxscript's, whose constant
     folding transposes every Linear weight: a copy of nearly all weights) runs on the saved
     file, its tensors memory-mapped, and the result is written to ``model.onnx`` +
     ``model.onnx.data``. Peak: about one copy of the weights plus mapped file pages.
   * ``torchscript``: past 2 GB the exporter writes one file per tensor; they are then merged,
     streamed through onnx_ir (memory-mapped in, one tensor at a time out), into
     ``model.onnx.data`` and removed. Its constant folding stores the transposed Linear weights,
     a second copy while it runs: in float32 the full Flux-dev needs about 2x its weights (see
     the README's measurements); prefer ``--dtype bfloat16`` or the dynamo exporter there.
4. ``--check``: ONNX Runtime CPU runs the file on the same feeds (torch is gone by then: the
   weights are never in both at once) and the relative L2 error is compared with ``--tolerance``.
   ONNX Runtime's CPU provider lacks bfloat16 and float16 kernels for most ops: those exports
   get onnx's full check (with strict shape inference) and an ONNX Runtime load, which fails
   for bfloat16 (no bfloat16 MatMul on CPU) and is reported, not raised.
5. Renames the folder into place (and writes ``export.json``: config, sites, dims, op counts,
   bytes, seconds, peak RSS). A failure removes the partial folder; nothing is left behind.

``--streamed`` (Flux, dynamo): the model is built on the meta device, its initialisation recorded
(:mod:`models.metaweights`); the dynamo exporter traces it without weights; every initializer
becomes an ``onnx_ir.LazyTensor`` that makes its seeded weight (bit-identical to the in-RAM build's)
when it is written; the weight transposes the exporter's optimizer would fold (materialising every
weight) are folded lazily first (:func:`fold_weight_transposes`), then the optimizer runs and
the model is written a tensor at a time. Peak: the traced graph plus one weight. ``--check`` there
is the load check only (torch's outputs would need the weights in RAM).

``--layers N`` keeps the full widths with N blocks (Flux: N double + N single), to try the
full-size path on a small machine: Flux at full width with one block of each passes 2 GB.
"""
from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
# families whose builders take a dtype (build in it directly)
DTYPE_FAMILIES = ("sd3-medium", "sd35-medium", "sd35-large", "flux-dev", "flux-schnell", "t5-xxl", "vae16-encoder",
                  "vae16-decoder", "vae-encoder", "vae-decoder")
DATA_NAME = "model.onnx.data"
# families whose builders build on the meta device (--streamed)
STREAMED_FAMILIES = ("flux-dev", "flux-schnell")


def layer_overrides(family: str, layers: int | None) -> dict:
    """Config entries that keep ``layers`` blocks (full widths)."""
    if layers is None:
        return {}
    if family.startswith("flux"):
        return {"num_layers": layers, "num_single_layers": layers}
    if family.startswith("sd3"):
        from .dit import CONFIGS

        dual = CONFIGS[(family, "full")].get("dual_attention_layers", ())
        return {"num_layers": layers, "dual_attention_layers": tuple(i for i in dual if i < layers)}
    if family == "t5-xxl":
        return {"num_layers": layers}
    raise ValueError(f"--layers applies to the transformer and T5 families, not {family}")


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def float32_io(path: Path) -> list[str]:
    """Make the bfloat16/float16 graph inputs and outputs of the model at ``path`` float32, a ``Cast`` at
    each boundary (rewrites ``model.onnx`` only; external weights are untouched). A model built in
    bfloat16 exports bfloat16 I/O, which numpy cannot hold: a pipeline feeds float32, as it feeds a
    graph whose fp16 pass kept its I/O types. Returns the names changed."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    low = {TensorProto.BFLOAT16, TensorProto.FLOAT16}
    front, back, changed = [], [], []

    def rename(old: str, new: str, outputs: bool) -> None:
        for node in graph.node:
            node.input[:] = [new if x == old else x for x in node.input]
            if outputs:
                node.output[:] = [new if x == old else x for x in node.output]
        for info in graph.value_info:
            if info.name == old:
                info.name = new

    for value in graph.input:
        t = value.type.tensor_type
        if t.elem_type in low:
            inside = f"{value.name}__{TensorProto.DataType.Name(t.elem_type).lower()}"
            rename(value.name, inside, outputs=False)
            front.append(helper.make_node("Cast", [value.name], [inside], to=t.elem_type, name=f"{inside}__cast"))
            t.elem_type = TensorProto.FLOAT
            changed.append(value.name)
    for value in graph.output:
        t = value.type.tensor_type
        if t.elem_type in low:
            inside = f"{value.name}__{TensorProto.DataType.Name(t.elem_type).lower()}"
            rename(value.name, inside, outputs=True)
            back.append(helper.make_node("Cast", [inside], [value.name], to=TensorProto.FLOAT, name=f"{inside}__cast"))
            t.elem_type = TensorProto.FLOAT
            changed.append(value.name)
    if changed:
        nodes = [*front, *graph.node, *back]
        del graph.node[:]
        graph.node.extend(nodes)
        onnx.save(model, str(path))
    return changed


def merge_external_data(path: Path, data_name: str = DATA_NAME) -> int:
    """Rewrite ``path`` so that every external tensor lives in one ``data_name`` file next to it,
    copied file to file in 64 MB chunks (never a whole tensor in memory); the old files go.
    Returns how many files were merged.

    Written by hand: onnx_ir 1.1's load + save(external_data=...) wrote wrong bytes for the
    TorchScript exporter's per-tensor files of a 2.2 GB Flux (ONNX Runtime's output went from
    relative L2 4e-7 to 1.0), while the same files, unmerged, were right."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    tensors = [t for t in _tensors(proto) if t.external_data]
    old = {kv.value for t in tensors for kv in t.external_data if kv.key == "location"}
    if old <= {data_name}:
        return 0
    folder = path.parent
    tmp = folder / (data_name + ".merging")
    offset = 0
    with open(tmp, "wb") as out:
        for t in tensors:
            info = {kv.key: kv.value for kv in t.external_data}
            src = folder / info["location"]
            start = int(info.get("offset", 0))
            length = int(info["length"]) if "length" in info else src.stat().st_size - start
            with open(src, "rb") as f:
                f.seek(start)
                left = length
                while left:
                    chunk = f.read(min(left, 1 << 26))
                    if not chunk:
                        raise ValueError(f"{src.name}: {length} bytes expected at {start}, file too short")
                    out.write(chunk)
                    left -= len(chunk)
            del t.external_data[:]
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
                t.external_data.add(key=key, value=value)
            offset += length
    onnx.save(proto, str(path.with_name(path.name + ".merging")))
    for name in old:
        (folder / name).unlink()
    os.replace(tmp, folder / data_name)
    os.replace(path.with_name(path.name + ".merging"), path)
    return len(old)


def _tensors(proto):
    from onnx import external_data_helper

    return external_data_helper._get_all_tensors(proto)


def relative_l2(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def export_folder(family: str, out_dir, *, size: str = "full", exporter: str = "dynamo", shapes: str = "dynamic",
                  dtype: str = "float32", opset: int | None = None, seed: int = 0, layers: int | None = None,
                  export_dims: dict | None = None, check: bool = False, check_dims: dict | None = None,
                  tolerance: float = 1e-3, streamed: bool = False, overrides: dict | None = None, log=print) -> dict:
    """Build ``family`` and export it to ``out_dir/model.onnx`` (+ ``model.onnx.data``); see the module doc.
    ``overrides``: config entries of the builder (e.g. a pipeline's text widths), beside ``layers``'."""
    import torch

    from . import build
    from .export import export, op_counts

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an empty folder")
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if streamed and exporter != "dynamo":
        raise ValueError("--streamed exports with the dynamo exporter only")
    if streamed and family not in STREAMED_FAMILIES:
        raise ValueError(f"--streamed builds {', '.join(STREAMED_FAMILIES)} only (their initialisation is replayed "
                         f"a tensor at a time), not {family}")
    if streamed and check and dtype == "float32":
        raise ValueError("--check in float32 compares with torch's outputs, which need the model in RAM: "
                         "drop --streamed")
    summary = {"family": family, "size": size, "exporter": exporter, "shapes": shapes, "dtype": dtype,
               "opset": opset, "seed": seed, "layers": layers, "streamed": streamed}
    t0 = time.perf_counter()
    try:
        partial.mkdir(parents=True)
        kwargs = {} if dtype == "float32" else {"dtype": getattr(torch, dtype)}
        if kwargs and family not in DTYPE_FAMILIES:
            raise ValueError(f"{family} is built in float32 only (--dtype applies to {', '.join(DTYPE_FAMILIES)})")
        overrides = dict(overrides or {}, **layer_overrides(family, layers))
        if overrides:
            kwargs["overrides"] = overrides
        if streamed:
            kwargs["meta"] = True
        built = build(family, size, seed=seed, **kwargs)
        for name, value in (export_dims or {}).items():
            if name not in built.example_dims:
                raise ValueError(f"--{name} does not apply to {family}")
            built.example_dims[name] = value
        summary["export_dims"] = dict(built.example_dims)
        n_params = sum(p.numel() for p in built.module.parameters())
        summary.update(params=n_params, config={k: list(v) if isinstance(v, tuple) else v for k, v in built.config.items()},
                       sites=built.sites, build_seconds=round(time.perf_counter() - t0, 1))
        log(f"built {family} ({size}, {dtype}): {n_params / 1e9:.3f} B parameters in {summary['build_seconds']} s, "
            f"peak RSS {peak_rss_gb():.1f} GB")
        path = partial / "model.onnx"
        want = _reference(built, check_dims) if check and not streamed else None
        if streamed:
            t1 = time.perf_counter()
            model = streamed_program(built, shapes, opset)
            summary["export_seconds"] = round(time.perf_counter() - t1, 1)
            log(f"exported on the meta device and optimized (onnxscript, as the exporter does) in "
                f"{summary['export_seconds']} s; peak RSS {peak_rss_gb():.1f} GB")
            t1 = time.perf_counter()
            ir_save(model, path)
            del model
            summary["write_seconds"] = round(time.perf_counter() - t1, 1)
            log(f"wrote the seeded weights a tensor at a time in {summary['write_seconds']} s; "
                f"peak RSS {peak_rss_gb():.1f} GB")
            release(built)
            del built
        elif exporter == "dynamo":
            # optimize=False: the ONNX program references the module's parameters; the onnxscript
            # optimizer's folding (every Linear weight's Transpose) would copy them all while the
            # module still holds them. It runs below, on the saved file, once torch is gone.
            raw = partial / "unoptimized.onnx"
            res = export(built, raw, exporter, shapes, opset=opset, optimize=False)
        else:
            res = export(built, path, exporter, shapes, opset=opset)
        if not streamed:
            summary["export_seconds"] = round(res.seconds, 1)
            log(f"exported ({exporter}, {shapes}) in {res.seconds:.0f} s, {len(res.files)} file(s); "
                f"peak RSS {peak_rss_gb():.1f} GB")
            release(built)
            del built, res
        gc.collect()
        if exporter == "dynamo" and not streamed:
            t1 = time.perf_counter()
            optimize_streamed(raw, path)
            summary["optimize_seconds"] = round(time.perf_counter() - t1, 1)
            log(f"optimized (onnxscript, as the exporter does) in {summary['optimize_seconds']} s; "
                f"peak RSS {peak_rss_gb():.1f} GB")
        merged = merge_external_data(path)
        if merged:
            log(f"merged {merged} external data files into {DATA_NAME}")
        if check:
            summary["check"] = _check(path, want, dtype, tolerance, log)
        ops = op_counts(path)
        summary.update(ops=ops, num_nodes=sum(ops.values()),
                       files={f.name: f.stat().st_size for f in sorted(partial.iterdir())},
                       peak_rss_gb=round(peak_rss_gb(), 2), seconds=round(time.perf_counter() - t0, 1))
        (partial / "export.json").write_text(json.dumps(summary, indent=1) + "\n")
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    log(f"wrote {out_dir} ({sum(summary['files'].values()) / 1e9:.2f} GB) in {summary['seconds']:.0f} s, "
        f"peak RSS {summary['peak_rss_gb']:.1f} GB")
    return summary


def streamed_program(built, shapes: str, opset: int | None):
    """The dynamo export of a meta-built model (``build(..., meta=True)``), optimized as the exporter
    does, every weight an ``onnx_ir.LazyTensor`` that ``built.weights`` makes when it is written.

    The optimizer's constant folding would transpose every Linear weight, materialising them all: the
    transposes of weights are folded here first, lazily (the folded initializer is the permuted weight,
    made when written), so the optimizer finds none left to fold."""
    import onnx_ir as ir

    from .export import dynamo_program

    model = dynamo_program(built, shapes, opset=opset).model
    for name, value in model.graph.initializers.items():
        if name not in built.weights:
            raise NotImplementedError(f"initializer {name} is not a parameter of the meta-built model")
        value.const_value = ir.LazyTensor(_seeded(built.weights, name), dtype=value.const_value.dtype,
                                          shape=value.const_value.shape, name=name)
    fold_weight_transposes(model)
    _exporter_optimize(model)
    return model


def _seeded(weights, name):
    from torch.onnx._internal.exporter._core import TorchTensor

    return lambda: TorchTensor(weights.tensor(name), name)


def fold_weight_transposes(model) -> int:
    """Replace each ``Transpose`` of a lazy initializer with a lazy initializer holding the transposed
    weight, named as the Transpose's output; the source goes when nothing else reads it.  Returns how
    many were folded."""
    import onnx_ir as ir

    graph = model.graph
    folded = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        src = node.inputs[0]
        if src is None or not src.is_initializer() or not isinstance(src.const_value, ir.LazyTensor):
            continue
        rank = len(src.const_value.shape)
        perm = node.attributes["perm"].as_ints() if "perm" in node.attributes else list(range(rank))[::-1]
        out = node.outputs[0]
        if out.is_graph_output():
            continue
        name, dims = out.name, src.const_value.shape
        lazy = ir.LazyTensor(_permuted(src.const_value, perm, name), dtype=src.const_value.dtype,
                             shape=ir.Shape([dims[i] for i in perm]), name=name)
        value = ir.Value(name=None, shape=lazy.shape, type=ir.TensorType(lazy.dtype), const_value=lazy)
        ir.convenience.replace_all_uses_with(out, value)
        graph.remove(node, safe=True)
        value.name = name
        graph.register_initializer(value)
        if not src.uses():
            graph.initializers.pop(src.name)
        folded += 1
    return folded


def _permuted(source, perm, name):
    from torch.onnx._internal.exporter._core import TorchTensor

    import numpy as np
    import onnx_ir as ir
    import torch

    make = source.raw  # the source LazyTensor's thunk (a TorchTensor of the seeded weight, from streamed_program)

    def permuted():
        tensor = make()
        if isinstance(tensor.raw, torch.Tensor):
            return TorchTensor(tensor.raw.permute(*perm).contiguous(), name)
        return ir.Tensor(np.ascontiguousarray(tensor.numpy().transpose(perm)), dtype=tensor.dtype, name=name)

    return permuted


def ir_save(model, path: Path) -> None:
    """``model`` to ``path`` + one ``model.onnx.data``, a tensor at a time (lazy ones made as they are written)."""
    import onnx_ir as ir

    ir.save(model, str(path), external_data=DATA_NAME)


def release(built) -> None:
    """Drop the builder's references to the torch weights (the module and the export patches' closures)."""
    built.module = None
    built.export_patches = {}


def optimize_streamed(raw: Path, path: Path) -> None:
    """Run the optimizer the dynamo exporter runs (``optimize=True``) on a saved model: its tensors are
    memory-mapped from ``raw``'s data file, the folded ones (transposed weights) are the only copies
    made, and the result is written a tensor at a time into ``path`` + ``model.onnx.data``."""
    import onnx_ir as ir

    model = ir.load(str(raw))
    _exporter_optimize(model)
    ir.save(model, str(path), external_data=DATA_NAME)
    del model
    gc.collect()
    data = {kv for kv in _locations(raw)}
    raw.unlink()
    for name in data:
        (raw.parent / name).unlink(missing_ok=True)


def _exporter_optimize(model) -> None:
    # torch.onnx's own call (ONNXProgram.optimize), through its lazy import of onnxscript's
    # versioned framework API: the same passes, in the same order, as export(optimize=True).
    from torch.onnx._internal._lazy_import import onnxscript_apis

    onnxscript_apis.optimize(model)


def _locations(path: Path) -> set[str]:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return {kv.value for t in _tensors(proto) for kv in t.external_data if kv.key == "location"}


def _reference(built, dims) -> dict:
    """Torch's outputs at small dims (computed before the export, which drops the torch weights)."""
    import torch

    d = dict(built.example_dims)
    d.update(dims or _small_dims(built))
    with torch.no_grad():
        outs = [t.float().numpy() for t in built.module(*built.make_inputs(d))]
    return {"dims": d, "feeds": built.make_feeds(d), "outputs": dict(zip(built.output_names, outs))}


def _check(path, want, dtype, tolerance, log) -> dict:
    """ONNX Runtime CPU on the reference's feeds, against torch's outputs."""
    import numpy as np

    from .export import run_onnx

    d = want["dims"] if want else None  # a streamed export has no torch reference (load checks only)
    if dtype != "float32":
        import onnx
        import onnxruntime as ort

        onnx.checker.check_model(str(path), full_check=True)  # by path: > 2 GB models too; with shape inference
        try:
            ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # graph resolution, kernels
        except Exception as exc:  # noqa: BLE001 - ORT CPU has no bfloat16 MatMul: reported, not an error
            if "NOT_IMPLEMENTED" not in str(exc):
                raise
            log(f"check: onnx full check passes; ONNX Runtime CPU cannot load it: {str(exc).splitlines()[0][-160:]}")
            return {"dims": d, "onnx_full_check": True, "ort_cpu_loads": False}
        log(f"check: loads in ONNX Runtime (its CPU provider lacks {dtype} kernels for most ops to run it)")
        return {"dims": d, "onnx_full_check": True, "ort_cpu_loads": True}
    got = run_onnx(path, want["feeds"])
    errs = {name: relative_l2(g, w) for (name, w), g in zip(want["outputs"].items(), got)}
    ok = all(np.isfinite(g).all() for g in got) and max(errs.values()) <= tolerance
    log(f"check at {d}: relative L2 {errs} ({'OK' if ok else 'MISMATCH'}, tolerance {tolerance})")
    if not ok:
        raise AssertionError(f"ONNX Runtime differs from torch: relative L2 {errs} > {tolerance}")
    return {"dims": d, "relative_l2": errs}


def _small_dims(built) -> dict:
    """Dims a CPU can run a full-size model at quickly."""
    small = {"batch": 1, "height": 16, "width": 16, "sequence": 16}
    return {k: v for k, v in small.items() if k in built.example_dims}


def main(args) -> int:
    try:
        export_folder(args.family, args.output, size=args.size, exporter=args.exporter, shapes=args.shapes,
                      dtype=args.dtype, opset=args.opset, seed=args.seed, layers=args.layers, check=args.check,
                      tolerance=args.tolerance, streamed=args.streamed,
                      export_dims={k: getattr(args, k) for k in ("batch", "height", "width", "sequence")
                                   if getattr(args, k) is not None})
    except FileExistsError as exc:
        print(exc, file=sys.stderr)
        return 2
    except AssertionError as exc:
        print(str(exc).splitlines()[0], file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except (ValueError, KeyError) as exc:  # a family/option this builder refuses
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback (the partial folder is gone)
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"error: {type(exc).__name__}: {first}", file=sys.stderr)
        return 3
    return 0
