"""upsample-to-skip: each up block's upsampler takes its size from the skip it is concatenated with.

diffusers' UNet2DConditionModel runs at any latent size: where a side is not a multiple of
2 ** (number of downsamplings), its forward hands each up block the skip's size
(``upsample_size = res_samples[-1].shape[2:]``) and Upsample2D calls
``F.interpolate(size=upsample_size, mode="nearest")`` instead of ``scale_factor=2``. A trace at a
multiple size records the fixed factor, so at another size the upsampled tensor is a row or a
column larger than the skip (a stride-2 convolution rounds up: n -> ceil(n / 2) -> 2 ceil(n / 2))
and ONNX Runtime fails in the next Concat. This pass writes the graph form of ``upsample_size``::

    up  = Resize(x, roi?, scales=[1, 1, 2, 2])       nearest, asymmetric, floor (both exporters)
    h   = Conv(up, W[, b])                            Upsample2D's conv: stride 1, spatial size kept
    y   = Concat(h, skip, axis=1)                     the next up block's first resnet input
                         ==>
    sizes = Concat(Shape(x)[0:2], Shape(skip)[2:4])
    up  = Resize(x, -, -, sizes)                      same attributes
    h   = Conv(up, W[, b])
    y   = Concat(h, skip, axis=1)

Why it computes torch's result: ONNX Resize in nearest mode with ``asymmetric`` coordinates and
``floor`` reads input index floor(i * in / out) for output index i, which is torch's nearest
(``nearest_neighbor_compute_source_index``: floor(i * in / out), in / out as ``scale`` when no
scale_factor is given). At a multiple size the skip is exactly twice x and both forms read
floor(i / 2): the rewritten graph computes what the traced one did. At other sizes out = 2 in - 1
(the skip of an odd side) and floor(i * in / out) = floor(i / 2 + i / (2 (2 in - 1))), where the
second term stays under 1/2 for i < out: still floor(i / 2), the first out rows of the 2x
upsample. tests/test_upsample_to_skip.py checks ONNX Runtime's Resize against torch's
F.interpolate index by index for every input side up to 1024.

Conditions (each a refusal the report shows): nearest mode with asymmetric coordinates and floor
rounding (Upsample2D's interpolation: other modes or coordinate rules are not torch's nearest),
constant scales of exactly [1, 1, 2, 2] (the ROI, read only by tf_crop_and_resize, is dropped), ``keep_aspect_ratio_policy`` stretch
(sizes are taken as given), a Conv of stride 1 whose padding keeps the spatial size, a 4-D Concat
on the channel axis, and sizes the graph reads off its tensors: the dynamo exporter writes every size
as a symbolic expression of the inputs' dims traced on the multiple-size branch (an up block's side
is ``2 * ((h - 1) // 2) + 2``), so its reshapes fail at other sizes whatever the upsample does; its
graphs are refused (:func:`sizes_divided_from_inputs`) and keep the exporter's multiple (the
TorchScript exporter, and optimum's export through it, read sizes off the tensors). Not sites: an upsample whose x and skip sides are all static (a static export
runs only at its traced size, where the rewrite changes nothing). A Resize that feeds no such
Concat (the VAE decoder's upsamplers: no skips) does not match the pattern.

Already sized: an upsample whose sizes provably read the skip's sides (what this pass writes, and
what the TorchScript exporter writes when its trace took diffusers' ``upsample_size`` branch, at a
latent side that was not a multiple) is counted (``already_sized``) and left as it is.

The contract with the pipeline: when no site was refused and at least one upsampler takes the
skip's size (rewritten or already), the pass writes the model metadata ``onnxopt.upsample_to_skip``
(:data:`UPSAMPLE_TO_SKIP_METADATA`: how many); a refusal removes it. The graphs built from the optimized UNet (step graph, two-stream and merged step
graphs) copy the metadata; :func:`onnxopt.pipeline.sizes.unet_latent_multiple` reads it from
``unet/model.onnx`` and then accepts any latent size.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxopt.fusion import Emit, Fusion, FusionRun, Refusal, Rule
from onnxopt.pass_infra import SHAPES_INFERRED
from onnxopt.pattern import Const, Match, Pattern, Var, constant_value, op
from onnxopt.pattern.dims import Dims, same_dims, text
from onnxopt.pattern.tensor_facts import rank_of, shape_of, static_dim
from onnxopt.registry import register_pass
from onnxopt.weights import numpy_dtype

UPSAMPLE_TO_SKIP_METADATA = "onnxopt.upsample_to_skip"  # metadata_props key: the graph takes any latent size
DOUBLE_SPATIAL = [1.0, 1.0, 2.0, 2.0]
TORCH_NEAREST = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
RESIZE_DEFAULTS = {"mode": "nearest", "coordinate_transformation_mode": "half_pixel", "nearest_mode": "round_prefer_floor",
                   "keep_aspect_ratio_policy": "stretch"}


def upsample_conv_concat(x, w, skip):
    up = op.Resize(x, Var("roi", optional=True), Const.named("scales"), _name="resize", _outputs=["upsampled"])
    conv = op.Conv(up, w, _name="conv", _extra_inputs=True)
    return op.Concat(conv, skip, axis=1, _name="concat")


UPSAMPLE_INTO_SKIP_CONCAT = Pattern(upsample_conv_concat, name="upsample-conv-concat")


def sized_upsample_conv_concat(x, sizes, w, skip):
    up = op.Resize(x, Var("roi", optional=True), Var("scales", optional=True), sizes, _name="resize")
    conv = op.Conv(up, w, _name="conv", _extra_inputs=True)
    return op.Concat(conv, skip, axis=1, _name="concat")


# What this pass writes, and what the TorchScript exporter writes where its trace took diffusers'
# upsample_size branch (a latent side that was not a multiple at export)
SIZED_UPSAMPLE_INTO_SKIP_CONCAT = Pattern(sized_upsample_conv_concat, name="sized-upsample-conv-concat")


def _attr(node: gs.Node, name: str):
    value = node.attrs.get(name, RESIZE_DEFAULTS.get(name))
    return value.decode() if isinstance(value, bytes) else value


def check(match: Match, run: FusionRun) -> Match:
    """The conditions of the module docstring; the match itself is the site."""
    resize, conv, x, skip = match.node("resize"), match.node("conv"), match["x"], match["skip"]
    if rank_of(x) not in (None, 4) or rank_of(skip) not in (None, 4):
        raise Refusal(f"x {shape_of(x)} and skip {shape_of(skip)}: not 4-D feature maps")
    refuse_static_or_traced_sizes(x, skip, run)
    for name, wanted in TORCH_NEAREST.items():
        if _attr(resize, name) != wanted:
            raise Refusal(f"{name} {_attr(resize, name)}: not torch's nearest ({wanted}), which upsample_size computes")
    scales = constant_value(match["scales"])
    if scales.shape != (4,) or not np.array_equal(scales.astype(np.float64), DOUBLE_SPATIAL):
        raise Refusal(f"scales {scales.tolist()}: not Upsample2D's factor 2 on the spatial axes")
    if _attr(resize, "keep_aspect_ratio_policy") != "stretch" or resize.attrs.get("axes") is not None:
        raise Refusal("keep_aspect_ratio_policy or axes set: the sizes would not be taken as given")
    if not _keeps_spatial_size(conv):
        raise Refusal("the Conv after the upsample changes the spatial size: the skip's size is not the upsample's")
    return match


def refuse_static_or_traced_sizes(x: gs.Tensor, skip: gs.Tensor, run: FusionRun) -> None:
    """Not a site where every side is static; refused where the graph's sizes are traced expressions."""
    if all(static_dim(t, axis) is not None for t in (x, skip) for axis in (2, 3)):
        run.details["static_upsamplers"] += 1
        raise Refusal("static spatial sizes: the graph runs only at its traced size", not_a_site=True)
    if "sizes_traced" not in run.memo:  # one walk of the shape arithmetic per run
        run.memo["sizes_traced"] = sizes_divided_from_inputs(run.graph)
    if run.memo["sizes_traced"]:
        raise Refusal("the exporter computes sizes from the inputs' dims with integer division (dynamo's symbolic "
                      "shapes): the graph's reshapes assume the traced multiple whatever the upsample does")


def check_sized(match: Match, run: FusionRun) -> Match:
    """An upsampler that already takes the skip's size (its sizes provably read the skip's sides, torch's
    nearest): counted (``already_sized``), nothing to write. Computed sizes not provably the skip's: refused."""
    resize, skip, sizes = match.node("resize"), match["skip"], match["sizes"]
    if any(_attr(resize, name) != wanted for name, wanted in TORCH_NEAREST.items()):
        raise Refusal("a sized upsample that is not torch's nearest", not_a_site=True)
    refuse_static_or_traced_sizes(match["x"], skip, run)
    dims = run.memo.setdefault("dims", Dims())
    vector, skip_dims = dims.vector(sizes), dims.shape(skip)
    if vector is None or skip_dims is None or len(vector) != 4 or not same_dims(vector[2:], skip_dims[2:]):
        raise Refusal(f"sizes {text(vector)} are not provably the skip's sides {text(skip_dims)}")
    run.details["already_sized"] += 1
    raise Refusal("already takes the skip's size", not_a_site=True)


def sizes_divided_from_inputs(graph: gs.Graph) -> bool:
    """Whether integer shape arithmetic divides a graph input's dims (Shape(input) -> ... -> integer Div or
    Mod). The dynamo exporter writes every size as a symbolic expression of the input's dims, traced on
    the multiple-size branch (an up block's side is ``2 * ((h - 1) // 2) + 2``): its reshapes then fail
    at other sizes. The TorchScript exporter reads each size off the tensor it reshapes."""
    inputs = {id(t) for t in graph.inputs}
    frontier = [n.outputs[0] for n in graph.nodes if n.op == "Shape" and id(n.inputs[0]) in inputs]
    seen: set[int] = set()
    while frontier:
        for consumer in frontier.pop().outputs:
            if id(consumer) in seen:
                continue
            seen.add(id(consumer))
            integer = [t for t in consumer.outputs if t.dtype is not None and np.issubdtype(numpy_dtype(t.dtype), np.integer)]
            if consumer.op in ("Div", "Mod") and integer:
                return True
            frontier.extend(integer)
    return False


def _keeps_spatial_size(conv: gs.Node) -> bool:
    """Stride 1 and a padding of dilation * (kernel - 1) per axis (Upsample2D's 3x3 conv, padding 1)."""
    weight = conv.inputs[1]
    kernel = conv.attrs.get("kernel_shape") or (list(weight.shape[2:]) if weight.shape is not None else None)
    if kernel is None or len(kernel) != 2 or conv.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
        return False
    strides = conv.attrs.get("strides", [1, 1])
    dilations = conv.attrs.get("dilations", [1, 1])
    pads = conv.attrs.get("pads", [0, 0, 0, 0])
    return all(int(s) == 1 for s in strides) and all(
        int(pads[a]) + int(pads[a + 2]) == int(dilations[a]) * (int(kernel[a]) - 1) for a in range(2))


def emit(make: Emit, match: Match) -> list[gs.Tensor]:
    resize, conv, x, skip = match.node("resize"), match.node("conv"), match["x"], match["skip"]
    shape = lambda t: shape_of(t) or [None] * 4  # noqa: E731
    batch_channels = _shape_slice(make, x, 0, 2, "batch_channels")
    skip_sides = _shape_slice(make, skip, 2, 4, "skip_sides")
    sizes = make.op.Concat(batch_channels, skip_sides, axis=0, _shape=[4], _label="sizes")
    up_shape = shape(x)[:2] + shape(skip)[2:]
    up = make.op.Resize(x, None, None, sizes, **dict(resize.attrs), _shape=up_shape)
    h = make.op.Conv(up, *conv.inputs[1:], **dict(conv.attrs), _shape=shape(conv.outputs[0])[:2] + shape(skip)[2:])
    out = match.output
    return [make.op.Concat(h, skip, axis=1, _shape=out.shape, _dtype=out.dtype)]


def _shape_slice(make: Emit, t: gs.Tensor, start: int, end: int, label: str) -> gs.Tensor:
    """Shape(t)[start:end]: Shape's start/end attributes from opset 15, a Slice of Shape before."""
    if make.graph.opset >= 15:
        return make.op.Shape(t, start=start, end=end, _dtype=np.int64, _shape=[end - start], _label=label)
    full = make.op.Shape(t, _dtype=np.int64, _shape=[4], _label=f"{label}_shape")
    bounds = [make.constant(f"{label}_{k}", np.array([v], np.int64)) for k, v in (("start", start), ("end", end), ("axis", 0))]
    return make.op.Slice(full, *bounds, _dtype=np.int64, _shape=[end - start], _label=label)


@register_pass
class UpsampleToSkip(Fusion):
    name = "upsample-to-skip"
    description = ("each UNet up block's 2x nearest upsample takes the size of the skip it is concatenated with "
                   "(diffusers' upsample_size): the graph runs at any latent size")
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED})
    rules = (Rule(SIZED_UPSAMPLE_INTO_SKIP_CONCAT, check_sized, emit, site=lambda m: m.node("resize")),
             Rule(UPSAMPLE_INTO_SKIP_CONCAT, check, emit, site=lambda m: m.node("resize")))

    def finish(self, run: FusionRun) -> None:
        result, already = run.result, run.details["already_sized"]
        result.details.update(static_upsamplers=run.details["static_upsamplers"], already_sized=already)
        if result.refused:
            run.model.metadata_props.pop(UPSAMPLE_TO_SKIP_METADATA, None)
        elif result.sites_rewritten + already:
            run.model.metadata_props[UPSAMPLE_TO_SKIP_METADATA] = str(result.sites_rewritten + already)
        if not result.sites_matched:
            result.nothing_to_do = (f"no 2x upsample to rewrite before a skip Concat (a UNet's up blocks; {already} "
                                    f"already take the skip's size, {run.details['static_upsamplers']} static)")


__all__ = ["UPSAMPLE_INTO_SKIP_CONCAT", "UPSAMPLE_TO_SKIP_METADATA", "UpsampleToSkip"]
