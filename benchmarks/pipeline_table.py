"""The tables benchmarks/pipeline_gpu.py prints: end to end and per stage per pipeline, and the ablation."""

from __future__ import annotations


def quality(row: dict) -> str:
    """The PSNR and latents columns, or why they are empty (the float32 reference not there yet)."""
    if "psnr_db" not in row:
        return "pending (no fp32 reference yet) | "
    return f"{row['psnr_db']:.1f} dB | {row['latents_max_abs']:.3g}"


def table(kind: str, results: dict, dry: bool = False) -> str:
    from benchmarks.pipeline_gpu import DRY, GUIDANCE, SETTINGS

    s = dict(SETTINGS[kind], **(DRY if dry else {}))
    precision = "DRY RUN: tiny weights, fp32, CPU" if dry else s.get("precision", "fp16")
    init = ""
    if "strength" in s:
        init = f", {'inpainting' if s.get('mask') else 'img2img'} strength {s['strength']} ({int(s['steps'] * s['strength'])} steps run)"
    tokens = f", T5 {s['max_sequence_length']} tokens" if "max_sequence_length" in s else ""
    lines = [f"### {kind}: {s['height']}x{s['width']}, {s['scheduler']} {s['steps']} steps, guidance "
             f"{s.get('guidance', GUIDANCE)}{init}{tokens}, {precision}",
             *([f"({s['defaults']})"] if "defaults" in s else []),
             "", "| pipeline | end to end | cold start | text encoder | mean step | VAE encode | VAE decode | rest | PSNR vs fp32 | latents max abs vs fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = (("diffusers eager", "torch-eager"), ("diffusers + torch.compile", "torch-compile"),
            (f"onnxopt ort-cuda {s.get('precision', 'fp16')}", "onnxopt"))
    for label, key in rows:
        r = results.get(key)
        if not r or "skipped" in r:
            lines.append(f"| {label} | {(r or {}).get('skipped', 'not run')} | | | | | | | | |")
            continue
        st = r["stages"]
        rest = f"{st['rest_s'] * 1e3:.1f} ms" if "rest_s" in st else ""  # onnxopt's: outside every stage above
        encode = f"{st['vae_encode_s'] * 1e3:.1f} ms" if "vae_encode_s" in st else ""
        lines.append(f"| {label} | {r['end_to_end_s']:.3f} s | {r['cold_start_s']:.1f} s | {st['text_encoder_s'] * 1e3:.1f} ms | "
                     f"{st['step_mean_s'] * 1e3:.2f} ms | {encode} | {st['vae_decode_s'] * 1e3:.1f} ms | {rest} | {quality(r)} |")
    eager, compiled, ours = (results.get(k) or {} for k in ("torch-eager", "torch-compile", "onnxopt"))
    if "end_to_end_s" in compiled and "end_to_end_s" in ours:
        lines += ["", f"onnxopt / torch.compile end to end: {ours['end_to_end_s'] / compiled['end_to_end_s']:.2f}x"]
    if "latents_max_abs" in eager and "latents_max_abs" in ours:
        ratio = ours["latents_max_abs"] / max(eager["latents_max_abs"], 1e-12)
        lines += [f"onnxopt / torch {s.get('precision', 'fp16')} deviation from fp32 (final latents max abs): {ratio:.2f}x"]
    if "step" in ours:
        lines += [f"onnxopt step: {ours['step']}, CUDA graph {ours['cuda_graph']}, first step {ours['first_step_s'] * 1e3:.0f} ms, "
                  f"sessions {ours['session_creation_s']:.1f} s"]
    return "\n".join(lines)


def ablation_table(kind: str, results: dict, fp8_only: bool = False) -> str:
    """End to end and per stage as each rewrite is added (the --ablation rows; ``fp8_only``: --fp8 alone)."""
    from benchmarks.pipeline_gpu import ABLATION, FP8_ROW

    lines = [f"### {kind}: ablation (onnxopt ort-cuda fp16, one optimized folder)", "",
             "| pipeline | end to end | text side | mean step | host part of a step | runs per step | hint | VAE decode | UNet steps | PSNR vs fp32 | latents max abs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    compiled = (results.get("torch-compile") or {}).get("end_to_end_s")
    for label in [FP8_ROW] if fp8_only else [*ABLATION, FP8_ROW]:
        r = results.get(f"onnxopt: {label}")
        if label == FP8_ROW and r is None:
            continue  # --fp8 not asked for
        if r is None and (ABLATION[label][2] and not kind.endswith("controlnet")
                          or kind == "sdxl" and "step_file" in ABLATION[label][0]):
            continue  # a ControlNet row; cfg-late on SDXL (not measured: 0.5 % of its FLOPs move)
        if not r or "skipped" in r:
            lines.append(f"| {label} | {(r or {}).get('skipped', 'not run')} | | | | | | | | | |")
            continue
        st = r["stages"]
        ms = lambda k: f"{st[k] * 1e3:.2f} ms" if k in st else ""  # noqa: E731
        ratio = f" ({r['end_to_end_s'] / compiled:.2f}x)" if compiled else ""
        label = f"{label} [{r['note']}]" if r.get("note") else label
        lines.append(f"| {label} | {r['end_to_end_s']:.3f} s{ratio} | {ms('text_encoder_s')} | {ms('step_mean_s')} | "
                     f"{ms('step_launch_mean_s')} | {r.get('session_runs_per_step', '')} | {ms('controlnet_hint_s')} | {ms('vae_decode_s')} | {r.get('unet_steps')} | {quality(r)} |")
    if compiled:
        lines += ["", f"(x: end to end / diffusers + torch.compile's {compiled:.3f} s from the same run)"]
    return "\n".join(lines)
