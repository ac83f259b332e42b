"""The QK-RMSNorm forms of SD3.5 and Flux, and a Linear's bias, one op at a time on the ORT CUDA EP.

    PYTHONPATH=/tmp/site:$PWD python -m benchmarks.norm_rows_gpu --out norm_rows.json     (GPU, about 2 minutes)
    PYTHONPATH=$PWD python -m benchmarks.norm_rows_gpu --dry-run --out norm_rows.json     (CPU EP, small shapes)

Norm cases, for x of the QK norm's shape: SD3.5-Medium (2, 4429, 24, 64) (batch 2, 4096 image + 333
text tokens, 24 heads of 64) and Flux.1-dev (1, 4608, 24, 128), in float16 and bfloat16:

* ``simplified-4d``: SimplifiedLayerNormalization(axis=-1) on the 4-D tensor (what fuse-rms-norm writes);
* ``bias-add+simplified-4d``: the projection's bias Add (over (B, S, H*d)) in front of it (the graph
  before fuse-bias-layer-norm's per-head form);
* ``simplified-3d``: the same norm on the (B, S*H, d) view;
* ``skip-rows-zero``: SkipSimplifiedLayerNormalization on (B*S*H, 1, d) rows with a zero (1, d) skip;
* ``skip-heads-bias``: SkipSimplifiedLayerNormalization on (B*S, H, d) with the bias as an (H, d)
  skip (what fuse-bias-layer-norm writes for a QK norm): computes the bias Add too;
* ``rms-23``: ONNX RMSNormalization (opset 23) on the 4-D tensor.

ORT's SkipLayerNorm CUDA kernel takes input 2-D or 3-D with skip (B, S, D), (1, S, D) or (S, D)
(contrib_ops/cpu/skip_layer_norm_helper.h) and broadcasts a 2-D skip as skip[i % (S * D)]; for a
last dim up to 1024 it runs its vectorized "small" kernel, one block of d / ILP threads per row
(contrib_ops/cuda/bert/skip_layer_norm_impl.cu), where LayerNormalization's cuApplyLayerNorm runs a
block of 128 threads per row whatever d.

Linear cases (float16, bfloat16), M = 8858 rows (2 x 4429 tokens), K = 1536, N = 1536 and 6144:
``matmul3d+add`` (the exporters' MatMul on (2, 4429, K) and the bias Add), ``matmul2d+add``,
``gemm2d-bias`` (Gemm with C = the (N,) bias; ORT's CUDA Gemm broadcasts C into Y, then GEMMs with
beta 1).

Each model holds ``--copies`` independent copies of the op reading one input, each with its own
weights (identical copies would be merged by ONNX Runtime's common-subexpression elimination), each
writing its kernel's own output shape (a Reshape to a bound output would add a copy); one CUDA-graph
replay launches them back to back and the time is per copy: IO binding, CUDA graph, torch.cuda.Event,
median of ``--runs`` after a warm-up. Every variant's first output is checked against NumPy in
float32 (from the same rounded inputs). --dry-run runs every variant once on the CPU EP at small
shapes, float32 and float16, and checks them the same way (bfloat16 has no CPU kernels there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

EPS = 1e-6
NORM_SHAPES = {"sd35-medium": (2, 4429, 24, 64), "flux-dev": (1, 4608, 24, 128)}
DRY_NORM_SHAPES = {"sd35-medium": (2, 37, 3, 64), "flux-dev": (1, 40, 3, 128)}
LINEAR_SHAPES = [(2, 4429, 1536, 1536), (2, 4429, 1536, 6144)]  # batch, tokens, K, N
DRY_LINEAR_SHAPES = [(2, 37, 64, 64), (2, 37, 64, 256)]
ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
MS = "com.microsoft"


# ---------------------------------------------------------------- models


def _tensor(name: str, values: np.ndarray, dtype: str) -> onnx.TensorProto:
    if dtype == "bfloat16":  # numpy has no bfloat16: round to nearest even, keep the upper 16 bits
        bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
        upper = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        t = helper.make_tensor(name, TensorProto.BFLOAT16, values.shape, upper.tobytes(), raw=True)
        return t
    return numpy_helper.from_array(values.astype(dtype), name)


def as_stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values a tensor of ``dtype`` holds after rounding ``values``."""
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
        return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    return values.astype(dtype).astype(np.float32)


def _model(nodes, x_shape, out_shape, inits, dtype: str, copies: int, opset: int) -> onnx.ModelProto:
    elem = ELEM[dtype]
    graph = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("x", elem, list(x_shape))],
                              [helper.make_tensor_value_info(f"y{i}", elem, list(out_shape)) for i in range(copies)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    model.ir_version = 11 if opset >= 23 else 10  # what ONNX Runtime 1.31 loads
    return model


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def norm_variants(shape, dtype: str, copies: int, rng) -> tuple[dict, np.ndarray, callable]:
    """{label: model}, x, and the NumPy reference (fp32) of copy 0 for x.

    Every copy has its own gamma (and bias): identical copies of a node would be merged by ONNX
    Runtime's common-subexpression elimination. Each form writes its kernel's own output shape
    (a Reshape to a bound graph output would add a copy); the check compares the values."""
    b, s, h, d = shape
    gammas = [(1 + 0.1 * rng.standard_normal(d)).astype(np.float32) for _ in range(copies)]
    biases = [(0.5 * rng.standard_normal(h * d)).astype(np.float32) for _ in range(copies)]
    x = rng.standard_normal(shape).astype(np.float32)
    g, bi = as_stored(gammas[0], dtype), as_stored(biases[0], dtype)

    def rms(v):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + EPS) * g

    def reference(label, xs):
        return rms(xs + bi.reshape(h, d)) if "bias" in label else rms(xs)

    gamma_inits = [_tensor(f"gamma{i}", gammas[i], dtype) for i in range(copies)]
    variants = {}
    nodes = [helper.make_node("SimplifiedLayerNormalization", ["x", f"gamma{i}"], [f"y{i}"], axis=-1, epsilon=EPS, stash_type=1)
             for i in range(copies)]
    variants["simplified-4d"] = _model(nodes, shape, shape, gamma_inits, dtype, copies, 17)
    # the projection bias Add in front (over (B, S, H*d)), then the 4-D norm: the graph fuse-rms-norm leaves
    nodes = [helper.make_node("Reshape", ["x", "flat_shape"], ["flat"])]
    for i in range(copies):
        nodes += [helper.make_node("Add", ["flat", f"bias{i}"], [f"biased{i}"]),
                  helper.make_node("Reshape", [f"biased{i}", "heads_shape"], [f"heads{i}"]),
                  helper.make_node("SimplifiedLayerNormalization", [f"heads{i}", f"gamma{i}"], [f"y{i}"], axis=-1,
                                   epsilon=EPS, stash_type=1)]
    variants["bias-add+simplified-4d"] = _model(nodes, shape, shape, gamma_inits + [
        _tensor(f"bias{i}", biases[i], dtype) for i in range(copies)] + [
        _ints("flat_shape", [b, s, h * d]), _ints("heads_shape", list(shape))], dtype, copies, 17)
    # the 3-D view (B, S*H, d)
    nodes = [helper.make_node("Reshape", ["x", "view"], ["x3"])]
    nodes += [helper.make_node("SimplifiedLayerNormalization", ["x3", f"gamma{i}"], [f"y{i}"], axis=-1, epsilon=EPS, stash_type=1)
              for i in range(copies)]
    variants["simplified-3d"] = _model(nodes, shape, (b, s * h, d), gamma_inits + [_ints("view", [b, s * h, d])], dtype, copies, 17)
    # SkipSimplifiedLayerNormalization: rows (N, 1, d) with a zero (1, d) skip; heads (B*S, H, d) with the bias as skip
    for label, view in (("skip-rows-zero", [b * s * h, 1, d]), ("skip-heads-bias", [b * s, h, d])):
        skips = [np.zeros((1, d), np.float32) if label == "skip-rows-zero" else biases[i].reshape(h, d) for i in range(copies)]
        nodes = [helper.make_node("Reshape", ["x", "view"], ["x3"])]
        nodes += [helper.make_node("SkipSimplifiedLayerNormalization", ["x3", f"skip{i}", f"gamma{i}"], [f"y{i}"], domain=MS,
                                   epsilon=EPS) for i in range(copies)]
        variants[label] = _model(nodes, shape, view, gamma_inits + [_tensor(f"skip{i}", skips[i], dtype) for i in range(copies)]
                                 + [_ints("view", view)], dtype, copies, 17)
    # ONNX RMSNormalization (opset 23)
    nodes = [helper.make_node("RMSNormalization", ["x", f"gamma{i}"], [f"y{i}"], axis=-1, epsilon=EPS, stash_type=1)
             for i in range(copies)]
    variants["rms-23"] = _model(nodes, shape, shape, gamma_inits, dtype, copies, 23)
    return variants, x, reference


def linear_variants(batch, tokens, k, n, dtype: str, copies: int, rng) -> tuple[dict, np.ndarray, callable]:
    """As norm_variants: each copy its own weight and bias; each form its own output shape."""
    ws = [(rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32) for _ in range(copies)]
    biases = [rng.standard_normal(n).astype(np.float32) for _ in range(copies)]
    x = rng.standard_normal((batch, tokens, k)).astype(np.float32)
    wq, bq = as_stored(ws[0], dtype), as_stored(biases[0], dtype)

    def reference(label, xs):
        return xs.reshape(-1, k) @ wq + bq

    inits = [_tensor(f"w{i}", ws[i], dtype) for i in range(copies)] + [_tensor(f"bias{i}", biases[i], dtype) for i in range(copies)]
    m = batch * tokens
    variants = {}
    nodes = []
    for i in range(copies):
        nodes += [helper.make_node("MatMul", ["x", f"w{i}"], [f"p{i}"]), helper.make_node("Add", [f"p{i}", f"bias{i}"], [f"y{i}"])]
    variants["matmul3d+add"] = _model(nodes, (batch, tokens, k), (batch, tokens, n), inits, dtype, copies, 17)
    for label, op in (("matmul2d+add", "MatMul"), ("gemm2d-bias", "Gemm")):
        nodes = [helper.make_node("Reshape", ["x", "rows"], ["x2"])]
        for i in range(copies):
            if op == "Gemm":
                nodes.append(helper.make_node("Gemm", ["x2", f"w{i}", f"bias{i}"], [f"y{i}"]))
            else:
                nodes += [helper.make_node("MatMul", ["x2", f"w{i}"], [f"p{i}"]),
                          helper.make_node("Add", [f"p{i}", f"bias{i}"], [f"y{i}"])]
        variants[label] = _model(nodes, (batch, tokens, k), (m, n), inits + [_ints("rows", [-1, k])], dtype, copies, 17)
    return variants, x, reference


# ---------------------------------------------------------------- running


def run_cpu(model: onnx.ModelProto, x: np.ndarray, dtype: str) -> tuple[float, np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # the variants that do not read every shared initializer
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"x": x.astype(dtype)}
    t0 = time.perf_counter()
    first = session.run(["y0"], feeds)[0]
    return (time.perf_counter() - t0) * 1e3, first.astype(np.float32)


def run_cuda(model: onnx.ModelProto, x: np.ndarray, dtype: str, copies: int, warmup: int, runs: int) -> tuple[float, np.ndarray]:
    """Per-copy median ms (CUDA graph, IO binding, torch.cuda.Event) and the first output as float32."""
    import onnxruntime as ort
    import torch

    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    x_dev = torch.from_numpy(x).to("cuda", tdtype).contiguous()
    out_shape = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    outs = [torch.empty(out_shape, dtype=tdtype, device="cuda") for _ in range(copies)]
    options = {"device_id": "0", "enable_cuda_graph": "1",
               "user_compute_stream": str(torch.cuda.current_stream().cuda_stream)}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.onnx")
        onnx.save(model, path)
        session_options = ort.SessionOptions()
        session_options.log_severity_level = 3
        session = ort.InferenceSession(path, session_options, providers=[("CUDAExecutionProvider", options)])
    binding = session.io_binding()
    elem = ELEM[dtype]  # the int form of element_type: numpy has no bfloat16
    binding.bind_input("x", "cuda", 0, elem, list(x_dev.shape), x_dev.data_ptr())
    for i, out in enumerate(outs):
        binding.bind_output(f"y{i}", "cuda", 0, elem, list(out.shape), out.data_ptr())
    for _ in range(warmup):  # the first run captures the graph
        session.run_with_iobinding(binding)
    torch.cuda.synchronize()
    samples = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        session.run_with_iobinding(binding)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    first = outs[0].float().cpu().numpy()
    del session
    return float(np.median(samples)) / copies, first


def check(got: np.ndarray, want: np.ndarray, dtype: str) -> tuple[bool, float]:
    """Max abs error relative to the reference's scale, within the dtype's tolerance."""
    scale = float(np.max(np.abs(want))) or 1.0
    err = float(np.max(np.abs(got.reshape(want.shape) - want))) / scale
    tolerance = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}[dtype]
    return err <= tolerance, err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--dry-run", action="store_true", help="the CPU EP, small shapes, float32 and float16, one run each")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--only", choices=("norm", "linear"), help="one group of cases")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    dtypes = ("float32", "float16") if args.dry_run else ("float16", "bfloat16")
    copies = 1 if args.dry_run else args.copies
    cases = []
    if args.only in (None, "norm"):
        for family, shape in (DRY_NORM_SHAPES if args.dry_run else NORM_SHAPES).items():
            for dtype in dtypes:
                cases.append((f"qk-norm {family} {tuple(shape)}", dtype, *norm_variants(shape, dtype, copies, rng)))
    if args.only in (None, "linear"):
        for batch, tokens, k, n in DRY_LINEAR_SHAPES if args.dry_run else LINEAR_SHAPES:
            for dtype in dtypes:
                cases.append((f"linear M={batch * tokens} K={k} N={n}", dtype, *linear_variants(batch, tokens, k, n, dtype, copies, rng)))
    rows, failed = [], 0
    print(f"{'case':42s} {'dtype':9s} {'variant':24s} {'ms':>9s} {'rel err':>9s}  check")
    for name, dtype, variants, x, reference in cases:
        xs = as_stored(x, dtype)
        for label, model in variants.items():
            row = {"case": name, "dtype": dtype, "variant": label}
            try:
                if args.dry_run:
                    ms, got = run_cpu(model, xs, dtype)
                else:
                    ms, got = run_cuda(model, xs, dtype, copies, args.warmup, args.runs)
            except Exception as exc:  # a variant without a kernel must not hide the others
                row["error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                print(f"{name:42s} {dtype:9s} {label:24s} {'-':>9s} {'-':>9s}  no run: {row['error'][:90]}", flush=True)
                rows.append(row)
                continue
            ok, err = check(got, reference(label, xs), dtype)
            failed += not ok
            row.update(ms=ms, rel_err=err, ok=ok, clock="host, one run" if args.dry_run else "cuda-events, per copy")
            print(f"{name:42s} {dtype:9s} {label:24s} {ms:9.4f} {err:9.2e}  {'ok' if ok else 'WRONG'}", flush=True)
            rows.append(row)
    return finish(args, copies, rows, failed)


def finish(args, copies: int, rows: list, failed: int) -> int:
    """Write the rows to ``args.out`` (when given) and return the exit code: 1 if a form's check failed."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dry_run": args.dry_run, "copies": copies, "runs": args.runs, "rows": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
