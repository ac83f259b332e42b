"""Text encoders at the pipeline's one input shape, every node on the CUDA EP: capturable as CUDA graphs.

The pipeline feeds a text encoder ``input_ids`` of one shape per call site, [batch, 77]
(:meth:`onnxopt.pipeline.runner.Pipeline.encode_prompt`: batch 2, negative and prompt; batch 1, the
prompt alone, without classifier-free guidance or, for SDXL, without a negative prompt). An
exported CLIP text encoder takes [batch, sequence] and computes with those dims at run time, and it
pools at the EOS token with an integer ArgMax: ONNX Runtime's CUDA EP runs neither (the shape
arithmetic goes to the CPU EP, and ArgMax has CUDA kernels for float, double and float16 only:
``reduction_ops.cc``), and ORT refuses CUDA graph
capture when a node on the CPU EP needs a copy between host and device (here: the ArgMax reads
the ids from the device, the position ids and the causal mask go back to it); each such copy
also costs a round trip when not captured. :func:`make_static` rewrites the graph for one shape::

    input_ids [batch, sequence]   ==>  input_ids [b, L]                       (L: tokenizer max length)
    shapes of every tensor             static: ORT's symbolic shape inference (it knows the
                                       com.microsoft ops the ort-cuda preset writes)
    Shape ─ Gather ─ Concat ─ Range    constants: the fold-constants pass, repeated until nothing
    (the causal mask, the pooling        folds
     row index, the Reshape shapes)

    ArgMax(ids: int, axis a)       ==>  ArgMax(Cast(ids, float32) * L - positions, axis a)
                                        select_last_index=1:  ... * L + positions
        positions = 0, 1, ..., L-1 along axis a. The scores are distinct, so the result does not
        depend on how a kernel breaks ties (cuDNN's reduction, which ORT's CUDA ArgMax calls, does
        not document it; CLIP padded with EOS has many ties), and it is the ONNX answer: a larger
        id scores at least L - (L - 1) = 1 more whatever the positions, and equal ids order by
        position. Exact while |id| * L + L <= 2^24 (float32 integers): ids below 217,885 at
        L = 77; CLIP's vocabulary has 49,408. The equality form ``(ids == eos).int().argmax()``
        scores 0/1 and is exact too.

:func:`write_static_text_encoders` writes ``model.static.b{b}.onnx`` beside a component's
optimized ``model.onnx``, its weights of 1 MB or more referring to model.onnx's data file (the
matrices: not written twice); smaller ones (norms, biases, the folded constants) are written
inline, as is everything of an inline model.onnx. It is written when the folder is optimized, not at
load: the rewrite loads the whole graph and runs shape inference and constant folding, work that
would otherwise land in every cold start (the issue's target: 15 s for SD 1.5).

:func:`nodes_off_cuda` lists the nodes the CUDA EP would not run (no kernel for the op and dtype,
or shape arithmetic ORT places on the CPU); the static graphs must have none. It is stricter than
ORT's capture rule, which lets shape arithmetic stay on the CPU when only shape inputs read it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxopt.errors import UnsupportedModelError
from onnxopt.model import Model
from onnxopt.pipeline.folder import STATIC_TEXT_PREFIX
from onnxopt.weights import numpy_dtype

STATIC_PREFIX = STATIC_TEXT_PREFIX  # model.static.b{batch}.onnx: the folder's name (onnxopt.pipeline.folder)
DEFAULT_SEQUENCE = 77
MAX_FOLD_ROUNDS = 4
MS = "com.microsoft"

F32, F16, F64 = "float32", "float16", "float64"
FLOATS = frozenset({F32, F16, F64})
MS_FLOATS = frozenset({F32, F16})
ANY = None  # every tensor type (data movement: the kernel copies bytes)

# (domain, op) -> the dtypes of the type-constrained input (input 0; :data:`TYPED_INPUT` where
# not) that ORT's CUDA EP has a kernel for. Read from ORT's registrations
# (core/providers/cuda/cuda_execution_provider.cc, reduction/reduction_ops.cc, tensor/where.cc,
# contrib_ops/cuda/cuda_contrib_kernels.cc); only the ops SD text encoders and their optimized
# forms contain are listed: any other op is reported as unverified, so the check stays sound.
CUDA_KERNELS: dict[tuple[str, str], frozenset | None] = {
    # (Constant: ORT makes it an initializer)
    **{("", op): ANY for op in ("Constant", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Transpose",
                                "Gather", "GatherND", "Expand", "Slice", "Split", "Identity")},
    ("", "Where"): MS_FLOATS | {"uint8", "int32", "int64"},  # tensor/where.cc (its T is input 1)
    ("", "ArgMax"): FLOATS,  # reduction_ops.cc: REGISTER_KERNEL_HFD(ArgMax), no integer kernel
    **{("", op): FLOATS | {"int32", "int64"} for op in ("Add", "Sub", "Mul", "Div")},
    **{("", op): FLOATS for op in ("MatMul", "Gemm", "Softmax", "Sigmoid", "Erf", "Tanh", "Sqrt", "Pow",
                                   "LayerNormalization", "ReduceMean", "Gelu")},
    ("", "Equal"): FLOATS | {"int32", "int64", "bool"},
    **{(MS, op): MS_FLOATS for op in ("Attention", "MultiHeadAttention", "SkipLayerNormalization", "Gelu",
                                      "FastGelu", "BiasGelu", "QuickGelu", "BiasAdd")},
}
TYPED_INPUT = {"Where": 1}
# Shape arithmetic: ORT computes it on the host (its CUDA Shape kernel writes CPU memory, and the
# nodes fed by it are placed on the CPU EP). Capture tolerates that only while no result goes back
# to the device; listing every such node keeps the check simple and on the safe side.
HOST_SHAPE_OPS = frozenset({"Shape", "Size", "Range"})


# The batches Pipeline.encode_prompt feeds each kind's text encoders: negative and prompt; the prompt
# alone without classifier-free guidance (guidance <= 1) and, for SDXL, without a negative prompt
# (force_zeros_for_empty_prompt); LatentConsistencyModelPipeline's and FluxPipeline's (no CFG): the prompt
# alone, always.
TEXT_BATCHES = {"sd": (1, 2), "controlnet": (1, 2), "sdxl": (1, 2), "sd3": (1, 2), "lcm": (1,), "flux": (1,)}


def text_batches(kind: str) -> tuple[int, ...]:
    return TEXT_BATCHES.get(kind, (2,))


def static_file_name(batch: int) -> str:
    return f"{STATIC_PREFIX}{batch}.onnx"


def nodes_off_cuda(model: Model) -> list[str]:
    """One line per node ORT's CUDA EP would not run: ``name (op dtype): why``. Empty: every node
    can be assigned to the CUDA EP (what CUDA graph capture needs)."""
    off = []
    for node in model.graph.nodes:
        domain = "" if node.domain in ("", "ai.onnx", None) else node.domain
        typed = TYPED_INPUT.get(node.op, 0)
        dtype = _dtype_name(node.inputs[typed]) if len(node.inputs) > typed else None
        where = f"{node.name} ({node.op}{' ' + dtype if dtype else ''})"
        if domain == "" and node.op in HOST_SHAPE_OPS:
            off.append(f"{where}: shape arithmetic, computed on the host")
            continue
        key = (domain, node.op)
        if key not in CUDA_KERNELS:
            off.append(f"{where}: not in the verified list of CUDA EP kernels")
            continue
        types = CUDA_KERNELS[key]
        if types is not ANY and dtype not in types:
            off.append(f"{where}: the CUDA EP has no {node.op} kernel for {dtype} (only {', '.join(sorted(types))})")
    return off


def _dtype_name(tensor: gs.Tensor) -> str | None:
    if tensor.dtype is None:
        return None
    try:
        return numpy_dtype(tensor.dtype).name
    except TypeError:
        return str(tensor.dtype)


def make_static(model: Model, batch: int, sequence: int = DEFAULT_SEQUENCE) -> dict:
    """Rewrite ``model`` (a text encoder: one input ``input_ids``) in place for input_ids
    [batch, sequence] (see the module docstring); returns what it did. Raises
    UnsupportedModelError when the graph is not a text encoder or a shape stays unknown."""
    graph = model.graph
    if len(graph.inputs) != 1 or graph.inputs[0].name != "input_ids":
        raise UnsupportedModelError(f"not a text encoder: inputs {[t.name for t in graph.inputs]}, expected input_ids")
    ids = graph.inputs[0]
    if ids.shape is not None and len(ids.shape) != 2:
        raise UnsupportedModelError(f"input_ids has rank {len(ids.shape)}, expected [batch, sequence]")
    ids.shape = [batch, sequence]
    folded = 0
    for _ in range(MAX_FOLD_ROUNDS):
        _infer_static_shapes(model)
        nodes = len(graph.nodes)
        _fold(model)
        folded += nodes - len(graph.nodes)
        if len(graph.nodes) == nodes:
            break
    _infer_static_shapes(model)
    dynamic = [t.name for t in graph.tensors().values()
               if isinstance(t, gs.Variable) and not (t.shape is not None and all(isinstance(d, int) for d in t.shape))]
    if dynamic:
        raise UnsupportedModelError(f"{len(dynamic)} tensors keep a dynamic shape at input_ids [{batch}, {sequence}] "
                                    f"(first: {dynamic[0]})")
    argmax = rewrite_integer_argmax(graph, sequence)
    graph.cleanup().toposort()
    return {"batch": batch, "sequence": sequence, "nodes_folded": folded, "argmax_rewritten": argmax}


def _infer_static_shapes(model: Model) -> None:
    """Every tensor's shape from ORT's symbolic shape inference on the graph skeleton (weights
    stubbed: 2 GB-safe). ONNX's own inference stops at com.microsoft ops and would leave the dims
    after them symbolic."""
    from onnxopt.shapes import _dims

    skeleton = model.skeleton()
    del skeleton.graph.value_info[:]
    _stubs_as_inputs(skeleton)
    for output in skeleton.graph.output:  # the export's symbolic annotations must not win
        output.type.tensor_type.ClearField("shape")
    try:
        inferred = symbolic_shapes(skeleton)
    except Exception as exc:  # the tool raises plain Exceptions and asserts
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsupportedModelError(f"ORT's symbolic shape inference failed: {first}") from None
    if inferred is None:
        raise UnsupportedModelError("ORT's symbolic shape inference could not complete")
    tensors = model.graph.tensors()
    for info in list(inferred.graph.value_info) + list(inferred.graph.output):
        tensor = tensors.get(info.name)
        if not isinstance(tensor, gs.Variable) or not info.type.HasField("tensor_type"):
            continue
        tensor.shape = _dims(info.type)
        if tensor.dtype is None and info.type.tensor_type.elem_type:
            tensor.dtype = onnx.helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type)


def symbolic_shapes(skeleton: onnx.ModelProto) -> onnx.ModelProto | None:
    """``SymbolicShapeInference.infer_shapes(skeleton)`` without its side effect: when inference is
    incomplete, the tool saves its partial model as ``sym_shape_infer_temp.onnx`` in the working
    directory (ORT 1.18-1.31) before raising, which is a file written into the user's folder (and one
    of theirs overwritten). Its own loop is run here without that save; where a release lacks the
    steps, the tool runs in a temporary working directory."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    tool = SymbolicShapeInference(2**31 - 1, False, False, 0)  # int_max, auto_merge, guess_output_rank, verbose
    steps = ("_preprocess", "_infer_impl", "_update_output_from_vi", "run_")
    if not all(hasattr(tool, step) for step in steps):
        import contextlib
        import tempfile

        with tempfile.TemporaryDirectory(prefix="onnxopt-shapes-") as scratch, contextlib.chdir(scratch):
            return SymbolicShapeInference.infer_shapes(skeleton, auto_merge=False, guess_output_rank=False)
    tool._preprocess(skeleton)
    complete = False
    while tool.run_:
        complete = tool._infer_impl()
    tool._update_output_from_vi()
    if not complete:
        raise UnsupportedModelError("it left some shapes unknown")
    return tool.out_mp_


def _stubs_as_inputs(skeleton: onnx.ModelProto) -> None:
    """The skeleton's stubbed weights as graph inputs of their type and shape: the tool reads an
    initializer's values wherever it could be shape data (any Add or Mul input), and a stub has none."""
    from onnxopt.model import STUB_LOCATION

    graph = skeleton.graph
    stubs = [t for t in graph.initializer if any(kv.key == "location" and kv.value == STUB_LOCATION
                                                  for kv in t.external_data)]
    for tensor in stubs:
        graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    kept = [t for t in graph.initializer if t not in stubs]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _fold(model: Model) -> None:
    from onnxopt import registry

    registry.get_pass("fold-constants")().run(model)


def rewrite_integer_argmax(graph: gs.Graph, sequence: int) -> int:
    """Every ArgMax over an integer tensor becomes the tie-free float32 ArgMax of the module
    docstring (exact for values below 2^24 / length: token ids); returns how many."""
    from onnxopt.fusion import Emit, NameAuthority

    names = NameAuthority(graph)
    count = 0
    for node in [n for n in graph.nodes if n.op == "ArgMax" and n.domain in ("", "ai.onnx", None)]:
        x = node.inputs[0]
        if x.dtype is None or not np.issubdtype(numpy_dtype(x.dtype), np.integer):
            continue
        if not x.shape or not all(isinstance(d, int) for d in x.shape):
            raise UnsupportedModelError(f"{node.name}: ArgMax input {x.name} has no static shape")
        axis = int(node.attrs.get("axis", 0)) % len(x.shape)
        length = x.shape[axis]
        positions = np.arange(length, dtype=np.float32).reshape([length] + [1] * (len(x.shape) - 1 - axis))
        last = bool(node.attrs.get("select_last_index", 0))
        make = Emit(graph, names, node.name or x.name)
        scores = make.op.Cast(x, to=onnx.TensorProto.FLOAT, _dtype=np.float32, _shape=x.shape)
        scores = make.op.Mul(scores, make.constant("positions_per_id", np.array(length, np.float32)), _shape=x.shape)
        scores = (make.op.Add if last else make.op.Sub)(scores, make.constant("positions", positions), _shape=x.shape)
        make.into(graph)
        node.inputs[0] = scores
        node.attrs["select_last_index"] = 0
        count += 1
    return count


def write_static_text_encoders(component_dir: str | os.PathLike, batches,
                               sequence: int = DEFAULT_SEQUENCE) -> list[tuple[Path, list[str]]]:
    """Write ``model.static.b{b}.onnx`` for each batch beside ``component_dir/model.onnx``
    (atomically; weights of 1 MB or more referred to in model.onnx's data file); returns each path written with
    the nodes that stay off the CUDA EP (:func:`nodes_off_cuda`: none for an ort-cuda graph; a
    tensorrt graph may keep standard ops this check has not verified, which TensorRT runs).
    Raises UnsupportedModelError when the graph cannot be made static."""
    from onnxopt.loading import load_model
    from onnxopt.saving import save_model

    component_dir = Path(component_dir)
    written = []
    for batch in batches:
        model = load_model(component_dir / "model.onnx")
        make_static(model, batch, sequence)
        path = save_model(model, component_dir / static_file_name(batch), reference_external=True, weight_map=True).path
        written.append((path, nodes_off_cuda(model)))
    return written
