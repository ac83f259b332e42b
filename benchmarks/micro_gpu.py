"""Candidate rewrites timed one op at a time on the ORT CUDA EP, before a pass is written for them.

    python -m benchmarks.micro_gpu [--only conv,upsample,...] [--json out.json]

Each case builds small fp16 ONNX models with the shapes of the SD1.5 UNet (batch 2, 64x64 latent),
one per variant, and times them with IO binding and a CUDA graph. A model holds ``COPIES``
independent copies of the op (own weights, same input), so one replay launches them back to back
as they are launched inside the UNet; the time reported is per copy. Variants of one case are
checked against each other on the same inputs (max abs difference), so a variant that computes
something else shows at once.

Cases: ``conv`` (every 3x3 conv shape of the UNet, with its achieved TFLOP/s), ``upsample``
(nearest 2x Resize + 3x3 conv against the sub-pixel form), ``layernorm`` (proj_in bias + LayerNorm
against SkipLayerNormalization with a zero skip), ``temb`` (the 22 time-embedding Gemms against one
merged Gemm + Split), ``attention`` (MultiHeadAttention layouts and the sdpa_kernel backends),
``cross`` (cross-attention: packed KV against K and V apart, per backend), ``crosskv`` (the 16
cross-attention K/V projections against one MatMul + Split), ``im2col``, ``splitk`` and
``tapgemm`` (3x3 convs rewritten as GEMMs), ``thin`` (conv_in/conv_out channel padding),
``convopts`` (the conv shapes under CUDA EP settings: fuse_conv_bias, the algo search),
``onnxattention`` (ORT's native ONNX Attention-23 kernel, in the exporter's 4-D form and the 3-D
form, against MultiHeadAttention with packed and split inputs, at SD 1.5 and SDXL shapes, self and
cross).
Results: benchmarks/results/h100-2026-11-22-session3/micro.md and .../session4/micro.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

COPIES = 8
F16 = TensorProto.FLOAT16
RNG = np.random.default_rng(0)


def _const(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name)


def _weight(shape, fan_in) -> np.ndarray:
    return (RNG.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))).astype(np.float16)


def _model(nodes, inputs, outputs, inits, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "micro", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8 if opset <= 17 else 11  # opset 23 (Attention) needs IR version 11
    return model


def _io(name, shape, dtype=F16):
    return helper.make_tensor_value_info(name, dtype, shape)


def copies(build, x_shape, extra_inputs=(), opset: int = 17):
    """A model with COPIES independent copies of ``build(i, x) -> (nodes, inits, out_name, out_shape)``."""
    nodes, inits, outputs = [], [], []
    for i in range(COPIES):
        n, w, out, shape = build(i, "x")
        nodes += n
        inits += w
        outputs.append(_io(out, shape))
    return _model(nodes, [_io("x", x_shape), *extra_inputs], outputs, inits, opset=opset)


# ---------------------------------------------------------------------------------------------- conv

def conv3x3(cin, cout, h, w, stride=1):
    def build(i, x):
        wt = _weight((cout, 3, 3, cin), 9 * cin)
        b = _weight((cout,), 1)
        oh, ow = (h + stride - 1) // stride, (w + stride - 1) // stride
        node = helper.make_node("NhwcConv", [x, f"w{i}", f"b{i}"], [f"y{i}"], domain="com.microsoft",
                                kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[stride, stride])
        return [node], [_const(f"w{i}", wt), _const(f"b{i}", b)], f"y{i}", [2, oh, ow, cout]
    return copies(build, [2, h, w, cin])


CONV_SHAPES = [  # (cin, cout, h, w, stride, count in the UNet); h, w of the conv's input
    (4, 320, 64, 64, 1, 1), (320, 320, 64, 64, 1, 7), (320, 320, 64, 64, 2, 1), (320, 640, 32, 32, 1, 1),
    (640, 640, 32, 32, 1, 6), (640, 640, 32, 32, 2, 1), (640, 1280, 16, 16, 1, 1), (1280, 1280, 16, 16, 1, 6),
    (1280, 1280, 16, 16, 2, 1), (1280, 1280, 8, 8, 1, 11), (2560, 1280, 8, 8, 1, 3), (2560, 1280, 16, 16, 1, 2),
    (1920, 1280, 16, 16, 1, 1), (1280, 640, 32, 32, 1, 1), (1920, 640, 32, 32, 1, 1), (960, 640, 32, 32, 1, 1),
    (960, 320, 64, 64, 1, 1), (640, 320, 64, 64, 1, 2), (320, 4, 64, 64, 1, 1),
]


def conv3x3_im2col(cin, cout, h, w, stride=1, weights=None):
    """The same conv as a GEMM: Pad, one Gather of the 3x3 windows (im2col), MatMul, bias Add."""
    oh, ow = (h + stride - 1) // stride, (w + stride - 1) // stride
    rows = np.arange(oh)[:, None, None, None] * stride + np.arange(3)[None, None, :, None]
    cols = np.arange(ow)[None, :, None, None] * stride + np.arange(3)[None, None, None, :]
    windows = (rows * (w + 2) + cols).reshape(oh * ow, 9).astype(np.int64)  # into the padded (h+2)*(w+2) grid

    def build(i, x):
        wt, b = weights(i)
        nodes = [helper.make_node("Pad", [x, "pads"], [f"p{i}"]),
                 helper.make_node("Reshape", [f"p{i}", "flat"], [f"f{i}"]),
                 helper.make_node("Gather", [f"f{i}", "windows"], [f"g{i}"], axis=1),
                 helper.make_node("Reshape", [f"g{i}", "cols"], [f"c{i}"]),
                 helper.make_node("MatMul", [f"c{i}", f"w{i}"], [f"m{i}"]),
                 helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                 helper.make_node("Reshape", [f"a{i}", "out"], [f"y{i}"])]
        inits = [_const(f"w{i}", np.ascontiguousarray(wt.reshape(cout, 9 * cin).T)), _const(f"b{i}", b)]
        if i == 0:
            inits += [_const("pads", np.array([0, 1, 1, 0, 0, 1, 1, 0], np.int64)),
                      _const("flat", np.array([2, (h + 2) * (w + 2), cin], np.int64)), _const("windows", windows),
                      _const("cols", np.array([2, oh * ow, 9 * cin], np.int64)),
                      _const("out", np.array([2, oh, ow, cout], np.int64))]
        return nodes, inits, f"y{i}", [2, oh, ow, cout]
    return copies(build, [2, h, w, cin])


def case_conv_im2col():
    out = []
    for cin, cout, h, w, s, count in CONV_SHAPES:
        if h * w // (s * s) > 1024 and cin > 4:
            continue  # large grids: cuDNN is efficient there, the im2col copy would be large
        state = RNG.bit_generator.state
        direct = conv3x3(cin, cout, h, w, s)
        RNG.bit_generator.state = state
        weights = [(_weight((cout, 3, 3, cin), 9 * cin), _weight((cout,), 1)) for _ in range(COPIES)]
        flops = 2 * 2 * (h // s) * (w // s) * cout * cin * 9
        out.append({"name": f"conv3x3 {cin}->{cout} @{h}x{w} s{s} (x{count})", "flops": flops, "count": count,
                    "variants": {"NhwcConv": direct,
                                 "im2col Gather + MatMul": conv3x3_im2col(cin, cout, h, w, s, lambda i: weights[i])}})
    return out


def conv3x3_tap_gemm(cin, cout, h, w, stride, weights, taps_per_slice=1):
    """The same conv as a split-K GEMM over the kernel taps: Pad, one Gather of the shifted images
    (B, 9/t, OH*OW, t*C), a batched MatMul with the (9/t, t*C, Cout) weight, then ReduceSum over the
    slices. Each slice is its own GEMM in one launch, so a small-grid conv could fill every SM
    (it does not pay: 2-7x slower than cuDNN, session4/micro.md)."""
    oh, ow = (h + stride - 1) // stride, (w + stride - 1) // stride
    slices = 9 // taps_per_slice
    ky, kx = np.divmod(np.arange(9), 3)
    pix_y = (np.arange(oh) * stride)[None, :, None] + ky[:, None, None]          # (9, oh, 1)
    pix_x = (np.arange(ow) * stride)[None, None, :] + kx[:, None, None]          # (9, 1, ow)
    index = (pix_y * (w + 2) + pix_x).reshape(9, oh * ow)                        # (9, oh*ow) into the padded grid
    index = index.reshape(slices, taps_per_slice, oh * ow).transpose(0, 2, 1).astype(np.int64)  # (s, P, t)

    def build(i, x):
        wt, b = weights(i)
        w_taps = wt.transpose(1, 2, 3, 0).reshape(slices, taps_per_slice * cin, cout)  # (s, t*C, Cout)
        nodes = [helper.make_node("Pad", [x, "pads"], [f"p{i}"]),
                 helper.make_node("Reshape", [f"p{i}", "flat"], [f"f{i}"]),
                 helper.make_node("Gather", [f"f{i}", "taps"], [f"g{i}"], axis=1),       # (B, s, P, t, C)
                 helper.make_node("Reshape", [f"g{i}", "slices"], [f"c{i}"]),            # (B, s, P, t*C)
                 helper.make_node("MatMul", [f"c{i}", f"w{i}"], [f"m{i}"]),             # (B, s, P, Cout)
                 helper.make_node("ReduceSum", [f"m{i}", "slice_axis"], [f"r{i}"], keepdims=0),
                 helper.make_node("Add", [f"r{i}", f"b{i}"], [f"a{i}"]),
                 helper.make_node("Reshape", [f"a{i}", "out"], [f"y{i}"])]
        inits = [_const(f"w{i}", np.ascontiguousarray(w_taps)), _const(f"b{i}", b)]
        if i == 0:
            inits += [_const("pads", np.array([0, 1, 1, 0, 0, 1, 1, 0], np.int64)),
                      _const("flat", np.array([2, (h + 2) * (w + 2), cin], np.int64)), _const("taps", index),
                      _const("slices", np.array([2, slices, oh * ow, taps_per_slice * cin], np.int64)),
                      _const("slice_axis", np.array([1], np.int64)),
                      _const("out", np.array([2, oh, ow, cout], np.int64))]
        return nodes, inits, f"y{i}", [2, oh, ow, cout]
    return copies(build, [2, h, w, cin])


TAP_GEMM_SHAPES = [(1280, 1280, 8, 8, 1, 11), (2560, 1280, 8, 8, 1, 3), (1280, 1280, 16, 16, 2, 1),
                   (640, 640, 32, 32, 2, 1), (320, 320, 64, 64, 2, 1), (1280, 1280, 16, 16, 1, 6),
                   (640, 1280, 16, 16, 1, 1), (2560, 1280, 16, 16, 1, 2), (640, 640, 32, 32, 1, 6)]


def case_tap_gemm():
    out = []
    for cin, cout, h, w, s, count in TAP_GEMM_SHAPES:
        state = RNG.bit_generator.state
        direct = conv3x3(cin, cout, h, w, s)
        RNG.bit_generator.state = state
        weights = [(_weight((cout, 3, 3, cin), 9 * cin), _weight((cout,), 1)) for _ in range(COPIES)]
        flops = 2 * 2 * (h // s) * (w // s) * cout * cin * 9
        variants = {"NhwcConv": direct}
        for t in (1, 3):
            variants[f"tap GEMM split-K {9 // t}: Gather + MatMul + ReduceSum"] = conv3x3_tap_gemm(
                cin, cout, h, w, s, lambda i: weights[i], taps_per_slice=t)
        out.append({"name": f"conv3x3 {cin}->{cout} @{h}x{w} s{s} (x{count})", "flops": flops, "count": count,
                    "variants": variants})
    return out


def case_thin_conv():
    """conv_in (4 channels in) and conv_out (4 out): cuDNN runs them at ~10 TFLOP/s; zero-padded channels?"""
    w_in, b_in = _weight((320, 3, 3, 4), 36), _weight((320,), 1)
    w_out, b_out = _weight((4, 3, 3, 320), 9 * 320), _weight((4,), 1)
    variants_in, variants_out = {}, {}
    for c in (4, 8, 16):
        def build_in(i, x, c=c):
            wt = np.zeros((320, 3, 3, c), np.float16)
            wt[..., :4] = w_in
            nodes = ([helper.make_node("Pad", [x, "pads"], [f"p{i}"])] if c > 4 else []) + [
                helper.make_node("NhwcConv", [f"p{i}" if c > 4 else x, f"w{i}", f"b{i}"], [f"y{i}"], domain="com.microsoft",
                                 kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
            inits = [_const(f"w{i}", wt), _const(f"b{i}", b_in)]
            if i == 0 and c > 4:
                inits.append(_const("pads", np.array([0, 0, 0, 0, 0, 0, 0, c - 4], np.int64)))
            return nodes, inits, f"y{i}", [2, 64, 64, 320]
        variants_in[f"Cin {c}" + (" (Pad)" if c > 4 else "")] = copies(build_in, [2, 64, 64, 4])

        def build_out(i, x, c=c):
            wt = np.zeros((c, 3, 3, 320), np.float16)
            wt[:4] = w_out
            b = np.zeros(c, np.float16)
            b[:4] = b_out
            nodes = [helper.make_node("NhwcConv", [x, f"w{i}", f"b{i}"], [f"z{i}" if c > 4 else f"y{i}"], domain="com.microsoft",
                                      kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
            if c > 4:
                nodes.append(helper.make_node("Slice", [f"z{i}", "st", "en", "ax"], [f"y{i}"]))
            inits = [_const(f"w{i}", wt), _const(f"b{i}", b)]
            if i == 0 and c > 4:
                inits += [_const("st", np.array([0], np.int64)), _const("en", np.array([4], np.int64)), _const("ax", np.array([3], np.int64))]
            return nodes, inits, f"y{i}", [2, 64, 64, 4]
        variants_out[f"Cout {c}" + (" (Slice)" if c > 4 else "")] = copies(build_out, [2, 64, 64, 320])
    return [{"name": "conv_in 4->320 @64x64", "count": 1, "variants": variants_in},
            {"name": "conv_out 320->4 @64x64", "count": 1, "variants": variants_out}]


def conv3x3_split_k(cin, cout, h, w, groups, weights):
    """The same conv with its input channels split in ``groups`` slices: one grouped conv (each
    group all cout outputs of one slice, so ``groups`` times the thread blocks), then a ReduceSum
    over the groups. For convs with few output pixels, where cuDNN leaves most SMs idle."""
    def build(i, x):
        wt, b = weights(i)
        part = cin // groups
        w_grouped = np.concatenate([wt[..., g * part:(g + 1) * part] for g in range(groups)], axis=0)  # (groups*cout, 3, 3, part)
        bias = np.concatenate([b] + [np.zeros_like(b)] * (groups - 1))
        nodes = [helper.make_node("NhwcConv", [x, f"w{i}", f"b{i}"], [f"z{i}"], domain="com.microsoft",
                                  kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=groups),
                 helper.make_node("Reshape", [f"z{i}", "grouped"], [f"r{i}"]),
                 helper.make_node("ReduceSum", [f"r{i}", "group_axis"], [f"y{i}"], keepdims=0)]
        inits = [_const(f"w{i}", w_grouped), _const(f"b{i}", bias)]
        if i == 0:
            inits += [_const("grouped", np.array([2, h, w, groups, cout], np.int64)), _const("group_axis", np.array([3], np.int64))]
        return nodes, inits, f"y{i}", [2, h, w, cout]
    return copies(build, [2, h, w, cin])


def case_split_k():
    out = []
    for cin, cout, h, w in [(1280, 1280, 8, 8), (2560, 1280, 8, 8), (1280, 1280, 16, 16), (2560, 1280, 16, 16), (640, 640, 32, 32)]:
        state = RNG.bit_generator.state
        variants = {"NhwcConv": conv3x3(cin, cout, h, w)}
        RNG.bit_generator.state = state
        weights = [(_weight((cout, 3, 3, cin), 9 * cin), _weight((cout,), 1)) for _ in range(COPIES)]
        for groups in (2, 4, 8):
            variants[f"split-K x{groups}: grouped NhwcConv + ReduceSum"] = conv3x3_split_k(cin, cout, h, w, groups, lambda i: weights[i])
        out.append({"name": f"conv3x3 {cin}->{cout} @{h}x{w}", "flops": 2 * 2 * h * w * cout * cin * 9, "count": 1, "variants": variants})
    return out


def case_conv():
    out = []
    for cin, cout, h, w, s, count in CONV_SHAPES:
        flops = 2 * 2 * (h // s) * (w // s) * cout * cin * 9
        out.append({"name": f"conv3x3 {cin}->{cout} @{h}x{w} s{s} (x{count})", "flops": flops, "count": count,
                    "variants": {"NhwcConv": conv3x3(cin, cout, h, w, s)}})
    return out


def case_conv_options():
    """The conv shapes under CUDA EP settings: fuse_conv_bias=1 builds each conv as a cuDNN frontend
    graph (conv + bias), which has other engines than the legacy cudnnFind path; also the search modes."""
    out = []
    for cin, cout, h, w, s, count in CONV_SHAPES:
        flops = 2 * 2 * (h // s) * (w // s) * cout * cin * 9
        out.append({"name": f"conv3x3 {cin}->{cout} @{h}x{w} s{s} (x{count})", "flops": flops, "count": count,
                    "variants": {"NhwcConv": conv3x3(cin, cout, h, w, s)}, "compare_within_variant": True,
                    "option_sets": [{}, {"fuse_conv_bias": "1"}, {"cudnn_conv_algo_search": "HEURISTIC"}]})
    return out


# ------------------------------------------------------------------------------------------ upsample

def upsample_resize_conv(c, h, w):
    def build(i, x):
        wt = _weight((c, 3, 3, c), 9 * c)
        b = _weight((c,), 1)
        nodes = [helper.make_node("Resize", [x, "", "scales"], [f"u{i}"], mode="nearest",
                                  coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
                 helper.make_node("NhwcConv", [f"u{i}", f"w{i}", f"b{i}"], [f"y{i}"], domain="com.microsoft",
                                  kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
        inits = [_const(f"w{i}", wt), _const(f"b{i}", b)] + ([_const("scales", np.array([1, 2, 2, 1], np.float32))] if i == 0 else [])
        return nodes, inits, f"y{i}", [2, 2 * h, 2 * w, c]
    return build


def subpixel_weights(w_nhwc: np.ndarray, b: np.ndarray):
    """(M, 3, 3, C) 3x3 weight after a nearest 2x upsample -> (4M, 2, 2, C) on the low-res input.

    Phase p (rows) / q (cols): 0 is the odd output row (2u-1), 1 the even one (2u), of low-res row u.
    """
    w = w_nhwc.astype(np.float32)
    taps = {0: [[0, 1], [2]], 1: [[0], [1, 2]]}  # phase -> (top taps, bottom taps) of the 3x3 kernel
    m, _, _, c = w.shape
    out = np.zeros((2, 2, m, 2, 2, c), np.float32)
    for p in (0, 1):
        for q in (0, 1):
            for ty in (0, 1):
                for tx in (0, 1):
                    out[p, q, :, ty, tx, :] = w[:, taps[p][ty]][:, :, taps[q][tx]].sum(axis=(1, 2))
    return out.reshape(4 * m, 2, 2, c).astype(np.float16), np.tile(b, 4)


def upsample_subpixel(c, h, w, weights_from):
    def build(i, x):
        wt, b = weights_from(i)
        w2, b2 = subpixel_weights(wt, b)
        nodes = [helper.make_node("NhwcConv", [x, f"w{i}", f"b{i}"], [f"z{i}"], domain="com.microsoft",
                                  kernel_shape=[2, 2], pads=[1, 1, 1, 1]),
                 helper.make_node("Reshape", [f"z{i}", "s5"], [f"r{i}"]),
                 helper.make_node("Transpose", [f"r{i}"], [f"t{i}"], perm=[0, 1, 3, 2, 4]),
                 helper.make_node("Reshape", [f"t{i}", "s4"], [f"f{i}"]),
                 helper.make_node("Slice", [f"f{i}", "starts", "ends", "axes"], [f"y{i}"])]
        inits = [_const(f"w{i}", w2), _const(f"b{i}", b2)]
        if i == 0:
            inits += [_const("s5", np.array([2, h + 1, w + 1, 2, 2 * c], np.int64)),
                      _const("s4", np.array([2, 2 * h + 2, 2 * w + 2, c], np.int64)),
                      _const("starts", np.array([1, 1], np.int64)), _const("ends", np.array([-1, -1], np.int64)),
                      _const("axes", np.array([1, 2], np.int64))]
        return nodes, inits, f"y{i}", [2, 2 * h, 2 * w, c]
    return build


def case_upsample():
    out = []
    for c, h, w in [(1280, 8, 8), (1280, 16, 16), (640, 32, 32)]:
        rng_state = RNG.bit_generator.state
        resize = upsample_resize_conv(c, h, w)
        ref_model = copies(resize, [2, h, w, c])
        RNG.bit_generator.state = rng_state  # same weights for the sub-pixel form
        weights = []
        for i in range(COPIES):
            weights.append((_weight((c, 3, 3, c), 9 * c), _weight((c,), 1)))
        sub_model = copies(upsample_subpixel(c, h, w, lambda i: weights[i]), [2, h, w, c])
        flops = 2 * 2 * (2 * h) * (2 * w) * c * c * 9
        out.append({"name": f"upsample2x+conv3x3 {c} @{h}x{w}", "flops": flops, "count": 1,
                    "variants": {"Resize+NhwcConv": ref_model, "sub-pixel NhwcConv 2x2": sub_model}})
    return out


# ----------------------------------------------------------------------------------------- layernorm

def case_layernorm():
    out = []
    for s, c, count in [(4096, 320, 5), (1024, 640, 5), (256, 1280, 5), (64, 1280, 1)]:
        def add_ln(i, x, c=c, s=s):
            nodes = [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]),
                     helper.make_node("Add", [f"m{i}", f"b{i}"], [f"h{i}"]),
                     helper.make_node("LayerNormalization", [f"h{i}", f"g{i}", f"be{i}"], [f"y{i}"], axis=-1, epsilon=1e-5)]
            inits = [_const(f"w{i}", _weight((c, c), c)), _const(f"b{i}", _weight((c,), 1)),
                     _const(f"g{i}", _weight((c,), 1)), _const(f"be{i}", _weight((c,), 1))]
            return nodes, inits, f"y{i}", [2, s, c]

        def skip_ln(i, x, c=c, s=s):
            nodes = [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]),
                     helper.make_node("SkipLayerNormalization", [f"m{i}", "zeros", f"g{i}", f"be{i}", f"b{i}"],
                                      [f"y{i}", "", "", f"h{i}"], domain="com.microsoft", epsilon=1e-5)]
            inits = [_const(f"w{i}", _weight((c, c), c)), _const(f"b{i}", _weight((c,), 1)),
                     _const(f"g{i}", _weight((c,), 1)), _const(f"be{i}", _weight((c,), 1))]
            if i == 0:
                inits.append(_const("zeros", np.zeros((s, c), np.float16)))
            return nodes, inits, f"y{i}", [2, s, c]

        state = RNG.bit_generator.state
        a = copies(add_ln, [2, s, c])
        RNG.bit_generator.state = state
        b = copies(skip_ln, [2, s, c])
        out.append({"name": f"proj_in bias + LayerNorm {s}x{c} (x{count})", "count": count,
                    "variants": {"MatMul+Add+LayerNormalization": a, "MatMul+SkipLayerNormalization(zero skip)": b}})
    return out


# ---------------------------------------------------------------------------------------------- temb

TEMB_OUT = [320, 320, 640, 640, 1280, 1280, 1280, 1280, 1280, 1280] + [1280] * 6 + [640] * 3 + [320] * 3


def case_temb():
    ws = [(_weight((1280, n), 1280), _weight((n,), 1)) for n in TEMB_OUT]
    sep_nodes, sep_inits, outs = [], [], []
    for i, (w, b) in enumerate(ws):
        sep_nodes.append(helper.make_node("Gemm", ["x", f"w{i}", f"b{i}"], [f"y{i}"]))
        sep_inits += [_const(f"w{i}", w), _const(f"b{i}", b)]
        outs.append(_io(f"y{i}", [2, w.shape[1]]))
    separate = _model(sep_nodes, [_io("x", [2, 1280])], outs, sep_inits)
    merged_w = np.concatenate([w for w, _ in ws], axis=1)
    merged_b = np.concatenate([b for _, b in ws])
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["all"]),
             helper.make_node("Split", ["all", "split"], [f"y{i}" for i in range(len(ws))], axis=1)]
    merged = _model(nodes, [_io("x", [2, 1280])], outs,
                    [_const("w", merged_w), _const("b", merged_b), _const("split", np.array(TEMB_OUT, np.int64))])
    nodes_t = [helper.make_node("Gemm", ["x", "wt", "b"], ["all"], transB=1),
               helper.make_node("Split", ["all", "split"], [f"y{i}" for i in range(len(ws))], axis=1)]
    merged_t = _model(nodes_t, [_io("x", [2, 1280])], outs,
                      [_const("wt", np.ascontiguousarray(merged_w.T)), _const("b", merged_b),
                       _const("split", np.array(TEMB_OUT, np.int64))])
    nodes_m = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["all"]),
               helper.make_node("Split", ["all", "split"], [f"y{i}" for i in range(len(ws))], axis=1)]
    merged_m = _model(nodes_m, [_io("x", [2, 1280])], outs,
                      [_const("w", merged_w), _const("b", merged_b), _const("split", np.array(TEMB_OUT, np.int64))])
    sep_t_nodes, sep_t_inits = [], []
    for i, (w, b) in enumerate(ws):
        sep_t_nodes.append(helper.make_node("Gemm", ["x", f"w{i}", f"b{i}"], [f"y{i}"], transB=1))
        sep_t_inits += [_const(f"w{i}", np.ascontiguousarray(w.T)), _const(f"b{i}", b)]
    separate_t = _model(sep_t_nodes, [_io("x", [2, 1280])], outs, sep_t_inits)
    return [{"name": "time-embedding projections (22 resnets)", "count": 1, "per_model": True,
             "variants": {"22 Gemm": separate, "22 Gemm transB": separate_t, "1 Gemm + Split": merged,
                          "1 Gemm transB + Split": merged_t, "1 MatMul + Add + Split": merged_m}}]


CROSS_KV_WIDTHS = [320] * 5 + [640] * 5 + [1280] * 6  # the 16 cross-attentions of SD1.5, by level


def case_cross_kv():
    """The 16 cross-attention K/V projections all read encoder_hidden_states: 16 MatMuls against one
    MatMul with the concatenated weights and a Split (packed KV per block, or K and V apart)."""
    ws = [_weight((768, 2 * c), 768) for c in CROSS_KV_WIDTHS]
    outs = [_io(f"y{i}", [2, 77, 2 * c]) for i, c in enumerate(CROSS_KV_WIDTHS)]
    ctx = [_io("x", [2, 77, 768])]
    separate = _model([helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(len(ws))], ctx, outs,
                      [_const(f"w{i}", w) for i, w in enumerate(ws)])
    merged = _model([helper.make_node("MatMul", ["x", "w"], ["all"]),
                     helper.make_node("Split", ["all", "split"], [f"y{i}" for i in range(len(ws))], axis=2)], ctx, outs,
                    [_const("w", np.concatenate(ws, axis=1)),
                     _const("split", np.array([2 * c for c in CROSS_KV_WIDTHS], np.int64))])
    kv_outs = [_io(f"{kv}{i}", [2, 77, c]) for i, c in enumerate(CROSS_KV_WIDTHS) for kv in "kv"]
    apart = _model([helper.make_node("MatMul", ["x", "w"], ["all"]),
                    helper.make_node("Split", ["all", "split"], [o.name for o in kv_outs], axis=2)], ctx, kv_outs,
                   [_const("w", np.concatenate(ws, axis=1)),
                    _const("split", np.array([c for c in CROSS_KV_WIDTHS for _ in "kv"], np.int64))])
    return [{"name": "cross-attention K/V projections (16 blocks)", "count": 1, "per_model": True,
             "variants": {"16 MatMul": separate, "1 MatMul + Split(16)": merged, "1 MatMul + Split(32, K and V apart)": apart}}]


# ----------------------------------------------------------------------------------------- attention

def case_attention():
    out = []
    for s, heads, hd in [(4096, 8, 40), (1024, 8, 80), (256, 8, 160)]:
        c = heads * hd

        def packed(i, x, c=c, s=s):
            return ([helper.make_node("Reshape", [x, "shape5"], [f"p{i}"]),
                     helper.make_node("MultiHeadAttention", [f"p{i}"], [f"y{i}"], domain="com.microsoft", num_heads=heads)],
                    [_const("shape5", np.array([2, s, heads, 3, hd], np.int64))] if i == 0 else [], f"y{i}", [2, s, c])

        def separate(i, x, c=c, s=s):
            return ([helper.make_node("Split", [x, "three"], [f"q{i}", f"k{i}", f"v{i}"], axis=2),
                     helper.make_node("MultiHeadAttention", [f"q{i}", f"k{i}", f"v{i}"], [f"y{i}"], domain="com.microsoft", num_heads=heads)],
                    [_const("three", np.array([c, c, c], np.int64))] if i == 0 else [], f"y{i}", [2, s, c])

        variants = {"packed QKV": copies(packed, [2, s, 3 * c]), "Split + separate Q,K,V": copies(separate, [2, s, 3 * c])}
        flops = 4 * 2 * heads * s * s * hd
        out.append({"name": f"self-attention S={s} heads={heads} d={hd}", "flops": flops, "count": 5,
                    # sdpa_kernel 4/32/256 (TRT fused/flash, lean) have no sm90 kernel: they fall back to
                    # the unfused path, 8x slower (session4/micro.md); add them back for other GPUs.
                    "variants": variants, "sdpa_kernels": ["", "1", "2", "8"], "compare_within_variant": True})
    return out


def case_cross_attention():
    out = []
    for s, heads, hd in [(4096, 8, 40), (1024, 8, 80), (256, 8, 160)]:
        c = heads * hd
        ctx = _io("kv", [2, 77, 2 * c])

        def packed(i, x, c=c, s=s):
            return ([helper.make_node("Reshape", ["kv", "shape5"], [f"p{i}"]),
                     helper.make_node("MultiHeadAttention", [x, f"p{i}"], [f"y{i}"], domain="com.microsoft", num_heads=heads)],
                    [_const("shape5", np.array([2, 77, heads, 2, hd], np.int64))] if i == 0 else [], f"y{i}", [2, s, c])

        def split(i, x, c=c, s=s):
            return ([helper.make_node("Split", ["kv", "two"], [f"k{i}", f"v{i}"], axis=2),
                     helper.make_node("MultiHeadAttention", [x, f"k{i}", f"v{i}"], [f"y{i}"], domain="com.microsoft", num_heads=heads)],
                    [_const("two", np.array([c, c], np.int64))] if i == 0 else [], f"y{i}", [2, s, c])

        out.append({"name": f"cross-attention S={s} L=77 heads={heads} d={hd}", "count": 5, "compare_within_variant": True,
                    "sdpa_kernels": ["", "1", "2", "16"],
                    "variants": {"packed KV": copies(packed, [2, s, c], extra_inputs=[ctx]),
                                 "Split + separate K,V": copies(split, [2, s, c], extra_inputs=[ctx])}})
    return out


# SD 1.5 (64x64 latent: 4096 tokens, 8 heads of 40) and SDXL (128x128 latent: 4096 tokens, 10 heads of
# 64, then 1024 tokens, 20 heads of 64); the 1024-token, 10x64 point too. Batch 2, 77 text tokens.
ONNX_ATTENTION_SHAPES = [(4096, 8, 40), (4096, 10, 64), (1024, 10, 64), (1024, 20, 64)]


def _heads_4d(nodes, inits, i, name, source, tokens, heads, hd):
    """(2, tokens, heads*hd) -> (2, heads, tokens, hd), as the dynamo exporter feeds ONNX Attention."""
    if i == 0 and not any(t.name == f"split4d_{tokens}" for t in inits):  # shared by the copies
        inits.append(_const(f"split4d_{tokens}", np.array([2, tokens, heads, hd], np.int64)))
    nodes += [helper.make_node("Reshape", [source, f"split4d_{tokens}"], [f"{name}{i}_r"]),
              helper.make_node("Transpose", [f"{name}{i}_r"], [f"{name}{i}_4d"], perm=[0, 2, 1, 3])]
    return f"{name}{i}_4d"


def _onnx_attention(i, q, k, v, s, l, heads, hd, form, nodes, inits):
    """ONNX Attention-23 on (B, S, N*H) q and (B, L, N*H) k, v; returns the (B, S, N*H) output name."""
    c = heads * hd
    if form == "3d":  # q_num_heads/kv_num_heads: the kernel reads (B, S, N*H) in place, no transposes
        nodes.append(helper.make_node("Attention", [q, k, v], [f"y{i}"], q_num_heads=heads, kv_num_heads=heads))
        return f"y{i}"
    q4, k4, v4 = (_heads_4d(nodes, inits, i, t, src, n, heads, hd) for t, src, n in (("q", q, s), ("k", k, l), ("v", v, l)))
    if i == 0 and not any(t.name == "merge" for t in inits):
        inits.append(_const("merge", np.array([2, s, c], np.int64)))
    nodes += [helper.make_node("Attention", [q4, k4, v4], [f"o{i}"]),  # what the exporter writes at opset 23
              helper.make_node("Transpose", [f"o{i}"], [f"o{i}_t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", [f"o{i}_t", "merge"], [f"y{i}"])]
    return f"y{i}"


def case_onnx_attention():
    """ORT's native ONNX Attention (opset 23) against com.microsoft MultiHeadAttention, self and cross.

    Each variant takes the same inputs (Q|K|V, or the query and K|V of the text); all but packed MHA
    (which reads them as (.., N, 3|2, H)) compute the same outputs, checked against MHA Split +
    separate (max abs difference; packed MHA against its own first run). The 4-D
    Attention form is the dynamo exporter's (Reshape + Transpose per head tensor, one back); the
    3-D form (q_num_heads/kv_num_heads) is what a pass could write without any Transpose.
    """
    out = []
    for s, heads, hd in ONNX_ATTENTION_SHAPES:
        c = heads * hd
        split3 = _const("three", np.array([c, c, c], np.int64))
        split2 = _const("two", np.array([c, c], np.int64))

        def self_mha_packed(i, x, c=c, s=s, heads=heads, hd=hd):
            return ([helper.make_node("Reshape", [x, "shape5"], [f"p{i}"]),
                     helper.make_node("MultiHeadAttention", [f"p{i}"], [f"y{i}"], domain="com.microsoft", num_heads=heads)],
                    [_const("shape5", np.array([2, s, heads, 3, hd], np.int64))] if i == 0 else [], f"y{i}", [2, s, c])

        def self_mha_split(i, x, c=c, s=s, heads=heads, split3=split3):
            return ([helper.make_node("Split", [x, "three"], [f"q{i}", f"k{i}", f"v{i}"], axis=2),
                     helper.make_node("MultiHeadAttention", [f"q{i}", f"k{i}", f"v{i}"], [f"y{i}"], domain="com.microsoft", num_heads=heads)],
                    [split3] if i == 0 else [], f"y{i}", [2, s, c])

        def self_onnx(form, c=c, s=s, heads=heads, hd=hd, split3=split3):
            def build(i, x):
                nodes = [helper.make_node("Split", [x, "three"], [f"q{i}", f"k{i}", f"v{i}"], axis=2)]
                inits = [split3] if i == 0 else []
                return nodes, inits, _onnx_attention(i, f"q{i}", f"k{i}", f"v{i}", s, s, heads, hd, form, nodes, inits), [2, s, c]
            return build

        def cross_mha_packed(i, x, c=c, heads=heads, hd=hd):
            return ([helper.make_node("Reshape", ["kv", "shape5"], [f"p{i}"]),
                     helper.make_node("MultiHeadAttention", [x, f"p{i}"], [f"y{i}"], domain="com.microsoft", num_heads=heads)],
                    [_const("shape5", np.array([2, 77, heads, 2, hd], np.int64))] if i == 0 else [], f"y{i}", [2, s, c])

        def cross_mha_split(i, x, c=c, heads=heads, split2=split2):
            return ([helper.make_node("Split", ["kv", "two"], [f"k{i}", f"v{i}"], axis=2),
                     helper.make_node("MultiHeadAttention", [x, f"k{i}", f"v{i}"], [f"y{i}"], domain="com.microsoft", num_heads=heads)],
                    [split2] if i == 0 else [], f"y{i}", [2, s, c])

        def cross_onnx(form, c=c, s=s, heads=heads, hd=hd, split2=split2):
            def build(i, x):
                nodes = [helper.make_node("Split", ["kv", "two"], [f"k{i}", f"v{i}"], axis=2)]
                inits = [split2] if i == 0 else []
                return nodes, inits, _onnx_attention(i, x, f"k{i}", f"v{i}", s, 77, heads, hd, form, nodes, inits), [2, s, c]
            return build

        ctx = _io("kv", [2, 77, 2 * c])
        flops = 4 * 2 * heads * s * s * hd
        # Packed MHA reads the input as (.., N, 3|2, H), the others as [Q|K|V]: each is checked against
        # its own first run; the Attention variants against MHA Split + separate.
        same_layout = {label: "split" for label in ("MHA Split + separate Q,K,V", "MHA Split + separate K,V",
                                                    "ONNX Attention-23, 4-D (exporter form)", "ONNX Attention-23, 3-D (q_num_heads)")}
        # Graph optimizations off: an earlier H100 run found the 4-D form "faster than the H100 can be" with them
        # on, most likely common-subexpression elimination merging the COPIES identical standard-domain
        # copies (it leaves com.microsoft nodes alone). Nothing here needs ORT's fusions.
        out.append({"name": f"self-attention S={s} heads={heads} d={hd}", "flops": flops, "count": 1,
                    "graph_optimization_level": "disable",
                    "sdpa_kernels": ["", "1", "2"], "compare_with": same_layout,
                    "variants": {"MHA packed QKV": copies(self_mha_packed, [2, s, 3 * c], opset=23),
                                 "MHA Split + separate Q,K,V": copies(self_mha_split, [2, s, 3 * c], opset=23),
                                 "ONNX Attention-23, 4-D (exporter form)": copies(self_onnx("4d"), [2, s, 3 * c], opset=23),
                                 "ONNX Attention-23, 3-D (q_num_heads)": copies(self_onnx("3d"), [2, s, 3 * c], opset=23)}})
        out.append({"name": f"cross-attention S={s} L=77 heads={heads} d={hd}", "count": 1,
                    "graph_optimization_level": "disable",
                    "sdpa_kernels": ["", "1", "2"], "compare_with": same_layout,
                    "variants": {"MHA packed KV": copies(cross_mha_packed, [2, s, c], extra_inputs=[ctx], opset=23),
                                 "MHA Split + separate K,V": copies(cross_mha_split, [2, s, c], extra_inputs=[ctx], opset=23),
                                 "ONNX Attention-23, 4-D (exporter form)": copies(cross_onnx("4d"), [2, s, c], extra_inputs=[ctx], opset=23),
                                 "ONNX Attention-23, 3-D (q_num_heads)": copies(cross_onnx("3d"), [2, s, c], extra_inputs=[ctx], opset=23)}})
    return out


CASES = {"conv": case_conv, "thin": case_thin_conv, "splitk": case_split_k, "im2col": case_conv_im2col, "tapgemm": case_tap_gemm, "convopts": case_conv_options, "crosskv": case_cross_kv, "cross": case_cross_attention, "upsample": case_upsample, "layernorm": case_layernorm, "temb": case_temb,
         "attention": case_attention, "onnxattention": case_onnx_attention}


def time_model(model: onnx.ModelProto, feeds: dict, provider_options=None, graph_optimization_level: str = "all"):
    from onnxopt.runners.ort_cuda import OrtCudaSession

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.onnx")
        onnx.save(model, path)
        session = OrtCudaSession(path, cuda_graph=True, provider_options=provider_options,
                                 graph_optimization_level=graph_optimization_level)
        session.bind(feeds)
        timing = session.time(warmup=10, runs=50)
        outputs = session.outputs()
        del session
    return timing.median_ms, outputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    results = []
    for case_name in args.only.split(","):
        for case in CASES[case_name]():
            first = next(iter(case["variants"].values()))
            x_shape = [d.dim_value for d in first.graph.input[0].type.tensor_type.shape.dim]
            feeds = {i.name: RNG.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float16)
                     for i in first.graph.input}
            row = {"case": case["name"], "variants": {}}
            references: dict = {}
            option_sets = case.get("option_sets") or [{"sdpa_kernel": k} if k else {} for k in case.get("sdpa_kernels", [""])]
            for options in option_sets:
                for label, model in case["variants"].items():
                    key = label + (" [" + ",".join(f"{k}={v}" for k, v in options.items()) + "]" if options else "")
                    try:
                        ms, outputs = time_model(model, feeds, options or None, case.get("graph_optimization_level", "all"))
                    except Exception as exc:  # one failing variant must not hide the others
                        row["variants"][key] = {"error": str(exc).splitlines()[0][:200]}
                        print(f"{case['name']:55s} {key:50s} failed: {str(exc).splitlines()[0][:120]}", flush=True)
                        continue
                    per = ms if case.get("per_model") else ms / COPIES
                    diff = None
                    group = case.get("compare_with", {}).get(label, label if case.get("compare_within_variant") else "")
                    reference = references.setdefault(group, outputs)
                    if reference is not outputs and set(reference) == set(outputs):  # same outputs: same values?
                        diff = max(float(np.max(np.abs(outputs[k].astype(np.float32) - reference[k].astype(np.float32)))) for k in reference)
                    entry = {"ms": per, "max_abs_vs_first": diff}
                    if case.get("flops"):
                        entry["tflops"] = case["flops"] / per / 1e9
                    row["variants"][key] = entry
                    extra = f"{entry['tflops']:.0f} TFLOP/s" if "tflops" in entry else ""
                    print(f"{case['name']:55s} {key:50s} {per * 1000:8.1f} us {extra:>14s} diff {diff}", flush=True)
            results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
