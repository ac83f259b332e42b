"""Fusion coverage of the ``ort-cuda`` preset: sites fused / sites present, per family x export variant.

    python -m models coverage [--families unet-sd15 clip-text] [--variants torchscript-dynamic-sdpa ...]
                              [--json out.json] [--markdown out.md]

For every tiny model: export it (:func:`models.export.export`), run ``onnxopt.optimize(path,
["ort-cuda"], verify=True)`` (fused graphs run on onnx.reference with onnxopt's kernels for the
com.microsoft ops ORT's CPU EP lacks), and compare what the passes fused with what the torch model
has. Sites present come from the torch modules:

* attention self / cross, GroupNorm, LayerNorm, BiasSplitGelu (GEGLU), NhwcConv (Conv2d):
  ``built.sites``;
* SkipGroupNorm / SkipLayerNorm: the nn.GroupNorm / nn.LayerNorm modules whose input is a sum of
  two tensors (a residual or the broadcast time embedding; through data movement and ``/ 1.0``,
  which cleanup removes), found by tracing one forward pass; LayerNorm counts every nn.LayerNorm
  (LayerNormalization or SkipLayerNormalization both cover it);
* BiasAdd: the sums of a biased nn.Linear's (3-D) or nn.Conv2d's (4-D) output and a tensor of
  the same shape that no LayerNorm or GroupNorm reads (those become SkipLayerNorm / SkipGroupNorm
  with the bias folded in): the last feed-forward of every Transformer2DModel, and the residuals
  after a conv that fold-conv-bias turns into BiasAdd.

Fused counts are the fused ops in the final graph (attention self/cross from fuse-attention's
report; NhwcConv: the convs nhwc-conv rewrote, as NhwcConv or, 1x1, as a channels-last MatMul). A cell is ``fused/present``; ``!`` marks a difference. BiasSplitGelu sites that the pass
matched and refused because ORT's CUDA kernel lacks the hidden size (every tiny model) show as
``refused (kernel)``: by design, not a miss.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from models import EXPORT_VARIANTS, OPSET_VARIANTS

VARIANTS = EXPORT_VARIANTS + OPSET_VARIANTS

COLUMNS = [
    ("attn_self", "attention self"),
    ("attn_cross", "attention cross"),
    ("group_norm", "GroupNorm"),
    ("skip_group_norm", "SkipGroupNorm"),
    ("bias_split_gelu", "BiasSplitGelu"),
    ("bias_add", "BiasAdd"),
    ("layer_norm", "LayerNorm"),
    ("skip_layer_norm", "SkipLayerNorm"),
    ("nhwc_conv", "NhwcConv"),
]
KERNEL_REFUSAL = "is not one ORT's CUDA kernel implements"


def variant_id(variant) -> str:
    """torchscript-dynamic-sdpa; an opset variant ends in its opset: dynamo-dynamic-sdpa-23."""
    return "-".join(str(part) for part in variant)


def parse_variant(text: str) -> tuple:
    parts = text.split("-")
    return tuple(parts[:3]) + tuple(int(p) for p in parts[3:])


# ---------------------------------------------------------------- torch side


def traced_sites(built) -> dict[str, int]:
    """Sites that need one traced forward pass: norms reading a sum, Linear + residual sums."""
    import torch
    import torch.nn as nn
    from torch.overrides import TorchFunctionMode

    data_movement = {"view", "reshape", "transpose", "permute", "flatten", "contiguous", "squeeze", "unsqueeze"}
    adds = {"add", "__add__", "__radd__", "__iadd__", "add_"}
    scale = {"mul", "__mul__", "__rmul__", "div", "__truediv__"}
    root_of: dict[int, int] = {}  # id of a sum (or a view / scale-by-1 of it) -> id of the sum
    linear_roots: set[int] = set()  # sums with a biased nn.Linear (3-D) or nn.Conv2d (4-D) output as an operand
    linear_out: set[int] = set()
    read_by_norm: set[int] = set()
    keep: list = []  # every traced tensor stays alive: ids must not be reused

    def is_one(v) -> bool:
        return isinstance(v, (int, float)) and float(v) == 1.0

    class Trace(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = getattr(func, "__name__", "")
            if not isinstance(out, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
                return out
            keep.append(out)
            first = args[0]
            if name in adds and len(args) > 1 and isinstance(args[1], torch.Tensor):
                a, b = args[0], args[1]
                if not isinstance(a, nn.Parameter) and not isinstance(b, nn.Parameter) and a.dim() > 0 and b.dim() > 0:
                    root_of[id(out)] = id(out)
                    # BiasAdd takes (B, S, C) of the same shape: not SDXL's 2-D time + add embeddings
                    if (id(a) in linear_out or id(b) in linear_out) and out.dim() in (3, 4) and a.shape == b.shape:
                        linear_roots.add(id(out))
            elif name in data_movement and id(first) in root_of:
                root_of[id(out)] = root_of[id(first)]
            elif name in scale and len(args) > 1 and is_one(args[1]):
                if id(first) in root_of:
                    root_of[id(out)] = root_of[id(first)]
                if id(first) in linear_out:
                    linear_out.add(id(out))
            return out

    counts = Counter()

    def norm_hook(kind):
        def hook(module, args):
            x = args[0]
            if id(x) in root_of:
                counts[f"{kind}_after_sum"] += 1
                read_by_norm.add(root_of[id(x)])
        return hook

    def linear_hook(module, args, out):
        if module.bias is not None:
            keep.append(out)
            linear_out.add(id(out))

    modules = list(built.module.modules())
    handles = [m.register_forward_pre_hook(norm_hook("group_norm")) for m in modules if isinstance(m, nn.GroupNorm)]
    handles += [m.register_forward_pre_hook(norm_hook("layer_norm")) for m in modules if isinstance(m, nn.LayerNorm)]
    handles += [m.register_forward_hook(linear_hook) for m in modules if isinstance(m, (nn.Linear, nn.Conv2d))]
    try:
        with torch.no_grad(), Trace():
            built.module(*built.example_inputs)
    finally:
        for h in handles:
            h.remove()
    return {
        "skip_group_norm": counts["group_norm_after_sum"],
        "skip_layer_norm": counts["layer_norm_after_sum"],
        # a sum read by a LayerNorm / GroupNorm is a SkipLayerNorm / SkipGroupNorm site (bias folded in)
        "bias_add": len(linear_roots - read_by_norm),
    }


def present_sites(built) -> dict[str, int]:
    sites = built.sites
    traced = traced_sites(built)
    return {
        "attn_self": sites["attention_self"],
        "attn_cross": sites["attention_cross"],
        "group_norm": sites["group_norm"],
        "skip_group_norm": traced["skip_group_norm"],
        "bias_split_gelu": sites["geglu"],
        "bias_add": traced["bias_add"],
        "layer_norm": sites["layer_norm"],
        "skip_layer_norm": traced["skip_layer_norm"],
        "nhwc_conv": sites["conv2d"],
    }


# ---------------------------------------------------------------- ONNX side


def fused_sites(model, report) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """(fused counts, refusals by pass: {reason: count}) from the optimized model and its report."""
    from onnxopt.pattern import is_zero_constant

    ops = Counter(n.op for n in model.graph.nodes)
    # fuse-bias-layer-norm runs a plain LayerNorm on the SkipLayerNorm kernel with a zero skip:
    # a LayerNorm site, not a SkipLayerNorm one.
    zero_skip = sum(1 for n in model.graph.nodes if n.op == "SkipLayerNormalization" and is_zero_constant(n.inputs[1]))
    by_pass = {p.name: p.result for p in report.passes}
    attention = by_pass.get("fuse-attention")
    fused = {
        "attn_self": attention.details.get("self", 0) if attention else 0,
        "attn_cross": attention.details.get("cross", 0) if attention else 0,
        "group_norm": ops["GroupNorm"] + ops["SkipGroupNorm"],
        "skip_group_norm": ops["SkipGroupNorm"],
        "bias_split_gelu": ops["BiasSplitGelu"],
        "bias_add": ops["BiasAdd"],
        "layer_norm": ops["LayerNormalization"] + ops["SkipLayerNormalization"],
        "skip_layer_norm": ops["SkipLayerNormalization"] - zero_skip,
        # nhwc-conv: every Conv runs channels-last, pointwise ones as a MatMul (details["as MatMul"])
        "nhwc_conv": by_pass["nhwc-conv"].sites_rewritten if "nhwc-conv" in by_pass else ops["NhwcConv"],
    }
    refusals = {}
    for p in report.passes:
        counts = dict(p.result.refusal_counts())
        if counts:
            refusals.setdefault(p.name, Counter()).update(counts)
    return fused, {k: dict(v) for k, v in refusals.items()}


def kernel_refused(refusals: dict) -> int:
    return sum(n for reason, n in refusals.get("fuse-bias-split-gelu", {}).items() if KERNEL_REFUSAL in reason)


def measure(family: str, variant: tuple, workdir: Path) -> dict:
    from onnxopt import optimize
    from onnxopt.verify import InputSpec

    from . import build
    from .export import export

    exporter, shapes, attention, *opset = variant
    row = {"family": family, "variant": variant_id(variant)}
    t0 = time.perf_counter()
    built = build(family, size="tiny", attention=attention)
    row["present"] = present_sites(built)
    path = workdir / family / variant_id(variant) / f"{family}.onnx"
    export(built, path, exporter=exporter, shapes=shapes, opset=opset[0] if opset else None)
    t1 = time.perf_counter()
    spec = InputSpec(shapes={k: tuple(v) for k, v in built.input_shapes().items()})
    model, report = optimize(path, ["ort-cuda"], verify=True, inputs=spec)
    row["fused"], row["refusals"] = fused_sites(model, report)
    v = report.final_verification
    row["verify"] = {"ok": bool(v and v.ok), "max_abs_error": v.max_abs_error if v else None,
                     "max_rel_error": v.max_rel_error if v else None,
                     "first_broken_pass": report.first_broken_pass}
    row["nodes"] = [report.nodes_before, report.nodes_after]
    row["seconds"] = {"export": round(t1 - t0, 1), "optimize": round(time.perf_counter() - t1, 1)}
    row["kernel_refused"] = kernel_refused(row["refusals"])
    return row


# ---------------------------------------------------------------- table


def cell(row: dict, key: str) -> str:
    present, fused = row["present"][key], row["fused"][key]
    if present == 0 and fused == 0:
        return "–"
    text = f"{fused}/{present}"
    if key == "bias_split_gelu" and fused == 0 and row.get("kernel_refused", 0) == present:
        return f"refused (kernel) 0/{present}"
    return text if fused == present else f"**{text} !**"


def misses(row: dict) -> list[str]:
    out = []
    for key, label in COLUMNS:
        present, fused = row["present"][key], row["fused"][key]
        if fused == present:
            continue
        if key == "bias_split_gelu" and fused == 0 and row.get("kernel_refused", 0) == present:
            continue
        out.append(f"{label} {fused}/{present}")
    return out


def markdown(rows: list[dict]) -> str:
    header = ["family", "variant"] + [label for _, label in COLUMNS] + ["verify max abs err"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['family']} | {row['variant']} | " + f"ERROR: {row['error']}" + " |" * (len(header) - 2))
            continue
        v = row["verify"]
        err = f"{v['max_abs_error']:.1e}" + ("" if v["ok"] else f" FAIL ({v['first_broken_pass']})")
        lines.append("| " + " | ".join([row["family"], row["variant"]] + [cell(row, k) for k, _ in COLUMNS] + [err]) + " |")
    notes = []
    for row in rows:
        if "error" in row:
            continue
        m = misses(row)
        if m:
            reasons = "; ".join(f"{p}: {r} ({n}x)" for p, rs in row["refusals"].items() for r, n in rs.items()
                                if p != "fuse-bias-split-gelu" or KERNEL_REFUSAL not in r)
            notes.append(f"* {row['family']} {row['variant']}: " + ", ".join(m) + (f" — refusals: {reasons}" if reasons else ""))
    text = "\n".join(lines)
    if notes:
        text += "\n\nDifferences (`!`):\n\n" + "\n".join(notes)
    # Refusals that are not misses (every torch-side site fused): lookalikes the passes matched and
    # left alone, with the reason, grouped by family.
    other: dict[tuple, list[str]] = {}
    for row in rows:
        if "error" in row or misses(row):
            continue
        for pass_name, reasons in row["refusals"].items():
            for reason, n in reasons.items():
                if pass_name == "fuse-bias-split-gelu" and KERNEL_REFUSAL in reason:
                    continue
                other.setdefault((row["family"], pass_name, reason, n), []).append(row["variant"])
    if other:
        text += "\n\nOther refusals (sites matched that are not torch-side sites; nothing missed):\n\n"
        text += "\n".join(f"* {family}, {pass_name}, {n} per model ({len(variants)} variants): {reason}"
                           for (family, pass_name, reason, n), variants in other.items())
    return text + "\n"


def main(argv=None) -> int:
    from . import FAMILIES

    p = argparse.ArgumentParser(prog="python -m models coverage", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--variants", nargs="*", default=[variant_id(v) for v in VARIANTS],
                   choices=[variant_id(v) for v in VARIANTS])
    p.add_argument("--json", help="write the rows (present, fused, refusals, verification) as JSON")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--workdir", help="where to export (default: a temporary directory)")
    args = p.parse_args(argv)
    variants = [parse_variant(v) for v in args.variants]
    rows = []
    with tempfile.TemporaryDirectory(prefix="onnxopt-coverage-") as tmp:
        workdir = Path(args.workdir or tmp)
        for family in args.families:
            for variant in variants:
                try:
                    row = measure(family, variant, workdir)
                except Exception as exc:  # noqa: BLE001 - one broken export must not lose the table
                    row = {"family": family, "variant": variant_id(variant), "error": f"{type(exc).__name__}: {exc}"[:300]}
                rows.append(row)
                print(f"{family} {variant_id(variant)}: " + (row.get("error") or ", ".join(misses(row)) or "all fused")
                      + (f" [{row['seconds']}]" if "seconds" in row else ""), file=sys.stderr, flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    table = markdown(rows)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 1 if any("error" in r or misses(r) or not r["verify"]["ok"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
