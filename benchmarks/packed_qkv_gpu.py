"""Attention-input subgraphs of the diffusion transformers, from the projection input X to the attention
output, in the forms that packing Q/K/V could take, on the ORT CUDA EP with a CUDA graph.

    PYTHONPATH=/tmp/site:$PWD python -m benchmarks.packed_qkv_gpu --out packed_qkv.json     (GPU, about 3 minutes)
    PYTHONPATH=$PWD python -m benchmarks.packed_qkv_gpu --dry-run --out packed_qkv.json     (CPU, tiny shapes)

Shapes: SD3.5-Medium (batch 2, 4096 image + 333 text tokens, 24 heads of 64, D 1536) and Flux.1-dev
(batch 1, 4096 + 512 tokens, 24 heads of 128, D 3072), float16 and bfloat16. One stream of S tokens
(what SD3.5's attn2 and Flux's single-stream block attend over; joint attention adds the Concat of its
two streams to every form alike). Flux's rotary, between the norm and the attention, is left out: it
is the same in every form (and form ``c`` is not exact across it: see docs/dit-memory-bound-ops.md).

Forms, each ``y = attention(norm(x Wq + bq), norm(x Wk + bk), x Wv + bv)`` (RMSNorm over each head's
H values, gammas g_q and g_k, eps 1e-6; ``e`` and ``a0`` without the norms):

* ``a-separate``: what ort-cuda writes today: three MatMuls and their bias Adds, SimplifiedLayer-
  Normalization on the (B, S, N, H) views of Q and K, MultiHeadAttention on separate Q, K, V;
* ``b-merged-qkv``: one MatMul (N = 3D) and one bias Add, Split into Q, K, V, the two norms, MHA;
* ``c-merged-qk-one-norm``: one MatMul for Q|K (2D) and one norm over the (B, S, 2N, H) rows of both,
  with one gamma: ``sqrt|g_q * g_k|``, the sign of ``g_q * g_k`` folded into Wq's and bq's columns
  (RMSNorm(x * s) = RMSNorm(x) * s for s = +-1, and q.k only sees g_q * g_k); Split into Q and K;
  V's own MatMul and bias Add;
* ``d-packed-concat``: form a's normed Q, K and V concatenated into MHA's packed (B, S, N, 3, H);
* ``e-packed-no-norm``: the upper bound without norms: one MatMul writing (B, S, N, 3, H) straight
  into packed MHA, the biases as MHA's ``bias`` (the CUDA kernel adds them while unpacking);
* ``a0-separate-no-norm``: form a without the norms (what ``e`` is compared with).

ORT 1.31's CUDA MultiHeadAttention unpacks a packed QKV into separate BSNH buffers before its flash or
memory-efficient kernel (``PrepareQkv_MHA_PackedQKV`` in contrib_ops/cuda/bert/attention_prepare_qkv.cu):
packing never saves the read of Q, K and V; only a TensorRT fused runner (float16, no flash) reads it
in place.

Each model holds ``--copies`` independent copies of the form reading one X, each with its own weights
(identical copies would be merged by ONNX Runtime's common-subexpression elimination), each writing
its own (B, S, D) output; one CUDA-graph replay (onnxopt's CapturedSession on ORT's CUDA EP, sharing
torch's stream) runs them back to back; the time is the median per copy over ``--runs`` after a warm-up
(CUDA events, benchmarks/cuda_timing.py). Before timing, copy 0's output is checked against NumPy in
float32 from the same rounded weights, on ``--check-rows`` query tokens (attention over every key).
``--dry-run`` builds every form at tiny shapes in float32 and runs it on ORT's CPU EP, or, where ORT's
CPU build has no kernel (packed-QKV MultiHeadAttention), through onnxopt's NumPy reference kernels.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from onnx import helper

from benchmarks.norm_rows_gpu import EPS, MS, _ints, _model, _tensor, as_stored, finish

SHAPES = {"sd35-medium": (2, 4429, 24, 64), "flux-dev": (1, 4608, 24, 128)}  # batch, tokens, heads, head dim
DRY_SHAPES = {"sd35-medium": (2, 37, 3, 16), "flux-dev": (1, 41, 2, 32)}
FORMS = ("a-separate", "b-merged-qkv", "c-merged-qk-one-norm", "d-packed-concat", "e-packed-no-norm",
         "a0-separate-no-norm")
NORMED = {"a-separate", "b-merged-qkv", "c-merged-qk-one-norm", "d-packed-concat"}
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}  # max abs error / max |reference|


# ---------------------------------------------------------------- weights and the NumPy reference


class Weights:
    """One copy's weights (float32, rounded to ``dtype`` as stored): Wq, Wk, Wv (D, D), their biases
    (D,), and the QK norm's gammas (H,); every fifth of g_q negative, so that form c's sign fold is used."""

    def __init__(self, rng, d: int, h: int, dtype: str):
        def stored(values):
            return as_stored(values.astype(np.float32), dtype)

        self.wq, self.wk, self.wv = (stored(rng.standard_normal((d, d)) / np.sqrt(d)) for _ in range(3))
        self.bq, self.bk, self.bv = (stored(0.5 * rng.standard_normal(d)) for _ in range(3))
        signs = np.where(np.arange(h) % 5 == 0, -1.0, 1.0)
        self.gq, self.gk = stored(signs * (1 + 0.2 * rng.standard_normal(h))), stored(1 + 0.2 * rng.standard_normal(h))


def split_gamma(gq: np.ndarray, gk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gamma, sign) with gamma = sqrt|gq * gk| and sign = sign(gq * gk) (+1 at 0): normalizing Q with
    sign * gamma and K with gamma gives every q.k product of gq and gk; the sign goes into Q's
    projection, ahead of the norm, where RMSNorm passes it through."""
    g = gq.astype(np.float64) * gk.astype(np.float64)
    return np.sqrt(np.abs(g)).astype(np.float32), np.where(g < 0, -1.0, 1.0).astype(np.float32)


def rms_norm(x: np.ndarray, gamma: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * gamma


def numpy_attention(x: np.ndarray, w: Weights, heads: int, rows: np.ndarray, normed: bool) -> np.ndarray:
    """y[:, rows] in float32: attention of the query tokens ``rows`` over every key."""
    b, s, d = x.shape
    h = d // heads

    def project(tokens, weight, bias):
        return (tokens.reshape(-1, d) @ weight + bias).reshape(b, -1, heads, h)

    q, k, v = project(x[:, rows], w.wq, w.bq), project(x, w.wk, w.bk), project(x, w.wv, w.bv)
    if normed:
        q, k = rms_norm(q, w.gq), rms_norm(k, w.gk)
    scores = np.einsum("bsnh,btnh->bnst", q, k) / np.sqrt(h)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bnst,btnh->bsnh", p, v).reshape(b, len(rows), d)


# ---------------------------------------------------------------- the forms


def form_model(form: str, shape, weights: list[Weights], dtype: str):
    """The ONNX model of ``form``: ``len(weights)`` copies reading x (B, S, D), writing y0, y1, ..."""
    b, s, n, h = shape
    d = n * h
    nodes, inits = [], [_ints("heads", [0, 0, n, h]), _ints("flat", [0, 0, d])]
    if form == "c-merged-qk-one-norm":
        inits += [_ints("qk_heads", [0, 0, 2 * n, h]), _ints("qk_flat", [0, 0, 2 * d]), _ints("halves", [d, d])]
    if form == "b-merged-qkv":
        inits.append(_ints("thirds", [d, d, d]))
    if form == "d-packed-concat":
        inits.append(_ints("slot", [0, 0, n, 1, h]))
    if form == "e-packed-no-norm":
        inits.append(_ints("packed", [0, 0, n, 3, h]))

    def const(name, values):
        inits.append(_tensor(name, values, dtype))
        return name

    def node(op, inputs, output, **attrs):
        nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output

    def linear(i, role, weight, bias):
        return node("Add", [node("MatMul", ["x", const(f"w{role}{i}", weight)], f"p{role}{i}"),
                            const(f"b{role}{i}", bias)], f"{role}{i}")

    def norm(i, role, tensor, gamma):  # SimplifiedLayerNormalization on the (B, S, N, H) view
        heads = node("Reshape", [tensor, "heads"], f"{role}_heads{i}")
        return node("SimplifiedLayerNormalization", [heads, const(f"g{role}{i}", gamma)], f"{role}_normed{i}",
                    axis=-1, epsilon=EPS, stash_type=1)

    def mha(i, *inputs):
        return node("MultiHeadAttention", list(inputs), f"y{i}", domain=MS, num_heads=n)

    for i, w in enumerate(weights):
        if form in ("a-separate", "a0-separate-no-norm", "d-packed-concat"):
            q, k, v = linear(i, "q", w.wq, w.bq), linear(i, "k", w.wk, w.bk), linear(i, "v", w.wv, w.bv)
        elif form == "b-merged-qkv":
            qkv = linear(i, "qkv", np.concatenate([w.wq, w.wk, w.wv], 1), np.concatenate([w.bq, w.bk, w.bv]))
            q, k, v = f"q{i}", f"k{i}", f"v{i}"
            nodes.append(helper.make_node("Split", [qkv, "thirds"], [q, k, v], axis=-1))
        if form in ("a-separate", "b-merged-qkv"):
            q = node("Reshape", [norm(i, "q", q, w.gq), "flat"], f"q_flat{i}")
            k = node("Reshape", [norm(i, "k", k, w.gk), "flat"], f"k_flat{i}")
            mha(i, q, k, v)
        elif form == "a0-separate-no-norm":
            mha(i, q, k, v)
        elif form == "d-packed-concat":
            parts = [node("Reshape", [norm(i, "q", q, w.gq), "slot"], f"q_slot{i}"),
                     node("Reshape", [norm(i, "k", k, w.gk), "slot"], f"k_slot{i}"),
                     node("Reshape", [v, "slot"], f"v_slot{i}")]
            mha(i, node("Concat", parts, f"qkv_packed{i}", axis=3))
        elif form == "c-merged-qk-one-norm":
            gamma, sign = split_gamma(w.gq, w.gk)
            columns = np.tile(sign, n)  # column n*H + j of Q carries gamma's j
            qk = linear(i, "qk", np.concatenate([w.wq * columns, w.wk], 1), np.concatenate([w.bq * columns, w.bk]))
            rows = node("Reshape", [qk, "qk_heads"], f"qk_heads{i}")
            normed = node("SimplifiedLayerNormalization", [rows, const(f"gqk{i}", gamma)], f"qk_normed{i}",
                          axis=-1, epsilon=EPS, stash_type=1)
            q, k = f"q{i}", f"k{i}"
            nodes.append(helper.make_node("Split", [node("Reshape", [normed, "qk_flat"], f"qk_flat{i}"), "halves"],
                                          [q, k], axis=-1))
            mha(i, q, k, linear(i, "v", w.wv, w.bv))
        elif form == "e-packed-no-norm":
            # column n*3H + t*H + j of the packed weight is column n*H + j of W_t (t = q, k, v)
            packed = np.stack([w.wq, w.wk, w.wv], 1).reshape(d, 3, n, h).transpose(0, 2, 1, 3).reshape(d, 3 * d)
            qkv = node("MatMul", ["x", const(f"wqkv{i}", packed)], f"qkv{i}")
            mha(i, node("Reshape", [qkv, "packed"], f"qkv_packed{i}"), "", "",
                const(f"bqkv{i}", np.concatenate([w.bq, w.bk, w.bv])))
    return _model(nodes, (b, s, d), (b, s, d), inits, dtype, len(weights), 17)  # IR 10: ORT 1.31 loads it


# ---------------------------------------------------------------- running


def run_reference(model, x: np.ndarray) -> tuple[dict, np.ndarray]:
    """One run through onnxopt's NumPy reference kernels (a form ORT's CPU build has no kernel for)."""
    import time

    from onnxopt import reference

    t0 = time.perf_counter()
    got = reference.run(model, {"x": x})["y0"]
    return {"median_ms": (time.perf_counter() - t0) * 1e3, "clock": "host, one run", "runner": "onnxopt.reference"}, got


def run_bound(model, x: np.ndarray, device: str, copies: int, warmup: int, runs: int) -> tuple[dict, np.ndarray]:
    """Per-copy median ms of ``runs`` bound runs (onnxopt's CapturedSession: on "cuda" a CUDA-graph replay
    on torch's stream, timed by CUDA events; on "cpu" ORT's CPU EP, the host clock) and copy 0's output."""
    from benchmarks.cuda_timing import timed
    from onnxopt.runners.captured_session import CapturedSession
    from onnxopt.runtime import ORT_TYPES, host_array, import_onnxruntime, inference_session, session_options

    ort = import_onnxruntime()
    if device == "cuda":
        import torch

        providers = [("CUDAExecutionProvider", {"device_id": "0", "enable_cuda_graph": "1",
                                                "user_compute_stream": str(torch.cuda.current_stream().cuda_stream)})]
    else:
        providers = ["CPUExecutionProvider"]
    session = inference_session(model.SerializeToString(), providers, session_options(ort))
    if device == "cuda" and session.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError("ONNX Runtime fell back from the CUDA EP")
    captured = CapturedSession(ort, session, device=device, cuda_graph=device == "cuda")
    run = captured.bind({"x": x.astype(ORT_TYPES[session.get_inputs()[0].type])}, graph_id=captured.graph_ids(1)[0])
    run.run()  # on the GPU: the capture
    result = timed(run.run, warmup, runs, device)
    for key in ("median_ms", "min_ms", "max_ms"):
        result[key] /= copies
    result["clock"] += ", CUDA graph, per copy" if device == "cuda" else ", per copy"
    result["runner"] = f"ort-{device}"
    got = host_array(ort, run.outputs["y0"])
    del run, captured, session
    return result, got


def check(got: np.ndarray, want: np.ndarray, dtype: str) -> tuple[bool, float]:
    """Max abs error relative to the reference's largest value, within the dtype's tolerance."""
    scale = float(np.max(np.abs(want))) or 1.0
    err = float(np.max(np.abs(got - want))) / scale
    return err <= TOLERANCE[dtype], err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, float32, ORT's CPU EP or the reference kernels")
    ap.add_argument("--family", choices=tuple(SHAPES), action="append", help="one model's shapes (repeatable)")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), action="append", help="one precision (repeatable)")
    ap.add_argument("--forms", help="comma-separated forms (default all): " + ", ".join(FORMS))
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--check-rows", type=int, default=32, help="query tokens checked against NumPy")
    args = ap.parse_args(argv)
    from onnxopt import reference

    forms = args.forms.split(",") if args.forms else list(FORMS)
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        print(f"error: unknown form(s) {', '.join(unknown)}; the forms are {', '.join(FORMS)}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    dtypes = ["float32"] if args.dry_run else (args.dtype or ["float16", "bfloat16"])
    copies = 1 if args.dry_run else args.copies
    rows, failed = [], 0
    print(f"{'family':12s} {'dtype':9s} {'form':22s} {'ms':>9s} {'rel err':>9s}  check")
    for family in args.family or list(SHAPES):
        shape = (DRY_SHAPES if args.dry_run else SHAPES)[family]
        b, s, n, h = shape
        check_rows = np.unique(np.linspace(0, s - 1, min(args.check_rows, s)).astype(int))
        for dtype in dtypes:
            weights = [Weights(rng, n * h, h, dtype) for _ in range(copies)]
            x = as_stored(rng.standard_normal((b, s, n * h)).astype(np.float32), dtype)
            wanted = {normed: numpy_attention(x, weights[0], n, check_rows, normed) for normed in (True, False)}
            for form in forms:
                row = {"family": family, "shape": list(shape), "dtype": dtype, "form": form, "copies": copies}
                try:
                    model = form_model(form, shape, weights, dtype)
                    if args.dry_run and reference.unsupported_on_ort_cpu(model):
                        timing, got = run_reference(model, x)
                    else:
                        timing, got = run_bound(model, x, "cpu" if args.dry_run else "cuda", copies,
                                                1 if args.dry_run else args.warmup, 1 if args.dry_run else args.runs)
                except Exception as exc:  # a form without a kernel must not hide the others
                    row["error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                    failed += 1
                    print(f"{family:12s} {dtype:9s} {form:22s} {'-':>9s} {'-':>9s}  no run: {row['error'][:90]}", flush=True)
                    rows.append(row)
                    continue
                ok, err = check(np.asarray(got, np.float32)[:, check_rows], wanted[form in NORMED], dtype)
                failed += not ok
                row.update(timing, rel_err=err, ok=ok)
                print(f"{family:12s} {dtype:9s} {form:22s} {timing['median_ms']:9.4f} {err:9.2e}  {'ok' if ok else 'WRONG'}",
                      flush=True)
                rows.append(row)
    return finish(args, copies, rows, failed)


if __name__ == "__main__":
    sys.exit(main())
