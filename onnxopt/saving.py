"""Write a model atomically, streaming every weight from where it lives to where it goes.

Why not ``onnx.save``: it needs the whole ModelProto in memory (weights included), and protobuf
refuses to serialise one over 2 GB (protobuf 7 raises ``EncodeError``). Here the graph structure
is exported as a small skeleton (:meth:`Model.skeleton`) and the initializers are appended to the
serialised graph one at a time, either inline (as ``raw_data``) or into one external data file.
Protobuf allows a message's fields in any order and a repeated field's elements to arrive
separately, so the bytes we write are an ordinary ModelProto.

Atomicity: model and data are written to temporary files in the destination folder and renamed
into place only when both are complete; on any error they are removed.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable

import onnx
from onnx_graphsurgeon.ir.tensor import Constant, LazyValues

from onnxopt.errors import ModelSaveError
from onnxopt.model import Model, SKELETON_THRESHOLD_BYTES
from onnxopt.outputs import Inputs, Outputs, temp_beside
from onnxopt.weight_provenance import map_path
from onnxopt.weight_provenance import weight_map as weight_map_of
from onnxopt.weights import (
    constant_data_type,
    constant_dims,
    constant_nbytes,
    computed_ahead,
    is_raw_encodable,
    iter_constant_bytes,
    read_uncached,
    store_values,
    stored_values,
)

# Above this much weight data the output goes to external data on its own. Kept under 2 GiB so
# the graph structure itself still fits beside the weights.
AUTO_EXTERNAL_BYTES = 1_800_000_000
EXTERNAL_MIN_BYTES = 1024  # smaller tensors stay inline, as onnx's own converter does
INLINE_INTEGER_MAX_BYTES = 64 << 10  # int32/int64 tensors up to this size stay inline (see must_stay_inline)

# Inputs that ONNX shape inference reads as data (shapes, sizes, axes, counts, scales), by op and
# input index. ONNX Runtime runs shape inference when it loads a model, before it loads external
# data, and fails on an external tensor here ("Cannot parse data from external tensors").
SHAPE_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Split": (1,), "Slice": (1, 2, 3, 4), "Resize": (1, 2, 3), "Upsample": (1,),
    "Pad": (1, 2, 3), "Expand": (1,), "Tile": (1,), "TopK": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
    "Unsqueeze": (1,), "Squeeze": (1,), "OneHot": (1,), "CenterCropPad": (1,), "Col2Im": (1, 2), "Trilu": (1,),
    "CumSum": (1,), "DFT": (1, 2), "STFT": (1, 3), "AffineGrid": (1,),
    **{f"Reduce{kind}": (1,) for kind in ("Sum", "Mean", "Max", "Min", "Prod", "L1", "L2", "LogSum", "LogSumExp",
                                           "SumSquare")},
}
_INTEGER_TYPES = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
ALIGN_LARGE = 4096  # page-align big tensors so runtimes can mmap them
ALIGN_LARGE_FROM = 1 << 20

_LEN = 2  # protobuf wire type for length-delimited fields
_GRAPH_FIELD = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number
_INITIALIZER_FIELD = onnx.GraphProto.DESCRIPTOR.fields_by_name["initializer"].number
_RAW_DATA_FIELD = onnx.TensorProto.DESCRIPTOR.fields_by_name["raw_data"].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tag(field_number: int) -> bytes:
    return _varint((field_number << 3) | _LEN)


@dataclass
class _Initializer:
    """One initializer as it will be written: a header proto, then (for inline) its raw bytes."""

    header: bytes  # serialised TensorProto without raw_data
    constant: object
    inline_nbytes: int  # raw bytes appended after the header; 0 when external or fully serialised

    @property
    def size(self) -> int:
        size = len(self.header)
        if self.inline_nbytes:
            size += len(_tag(_RAW_DATA_FIELD)) + len(_varint(self.inline_nbytes)) + self.inline_nbytes
        return size


@dataclass
class SaveInfo:
    path: Path
    data_path: Path | None
    weights_nbytes: int
    external: bool
    companions: dict[str, "SaveInfo"] = field(default_factory=dict)  # name -> where it went


def save_model(
    model: Model,
    path: str | os.PathLike,
    *,
    external_data: bool | None = None,
    data_location: str | None = None,
    reference_external: bool = False,
    weight_map: bool = False,
) -> SaveInfo:
    """Save ``model`` to ``path``, and each companion beside it (``<stem>.<name>.onnx``).

    ``external_data``: True forces one external data file, False forces everything inline,
    None (default) goes external only when the weights exceed ~1.8 GB (decided per file).
    ``data_location``: the main model's data file name, next to it (default ``<name>.data``);
    a companion's is always ``<its file name>.data``.
    ``reference_external``: a weight whose bytes already lie in an external data file inside the
    destination folder is written as a reference to them (same file, offset and length), not
    copied (see :func:`_external_reference`); the files written then depend on that file.
    ``weight_map``: beside each file, ``<stem>.weights.json``: where each source weight went
    (:mod:`onnxopt.weight_provenance`; what ``generate --lora`` reads).
    All files are complete before any is renamed into place: a failure leaves none of them.
    """
    from onnxopt.companions import companion_path

    path = Path(path)
    parts = [(None, model.alone(), path, data_location)]
    parts += [(name, c.alone(), companion_path(path, name), None) for name, c in model.companions.items()]
    for _, _, destination, _ in parts:
        check_destination(destination, model.source)
    check_writes(planned_writes(model, path, external_data=external_data, data_location=data_location), model)
    tmp_files: list[Path] = []
    written: list[tuple[str | None, Path, Path | None, SaveInfo]] = []
    try:
        maps = []
        for name, part, destination, location in parts:
            written.append((name, *_write_beside(part, destination, external_data, location, tmp_files,
                                                 reference_external)))
            if weight_map:
                maps.append((_write_weight_map(part, destination, tmp_files), map_path(destination)))
        for _, model_tmp, data_tmp, info in written:
            if data_tmp:
                os.replace(data_tmp, info.data_path)
            os.replace(model_tmp, info.path)
        for tmp, destination in maps:
            os.replace(tmp, destination)
    except OSError as exc:
        raise ModelSaveError(f"{path}: cannot write: {exc.strerror or exc}") from exc
    finally:
        for tmp in tmp_files:
            if tmp.exists():
                tmp.unlink()
    main = written[0][3]
    main.companions = {name: info for name, _, _, info in written[1:]}
    return main


def _write_beside(model: Model, path: Path, external_data: bool | None, data_location: str | None,
                  tmp_files: list[Path], reference_external: bool = False) -> tuple[Path, Path | None, SaveInfo]:
    """Write ``model`` to temporary files beside ``path``; return them and where they will go."""
    folder = path.parent if str(path.parent) else Path(".")
    referenced = folder.resolve() if reference_external else None
    weights = model.weights_nbytes() - sum(
        constant_nbytes(c) for c in model.constants() if _external_reference(c, referenced) is not None)
    external = weights > AUTO_EXTERNAL_BYTES if external_data is None else external_data
    if not external and weights > AUTO_EXTERNAL_BYTES:
        raise ModelSaveError(f"{path}: {weights / 1e9:.1f} GB of weights cannot be stored inline (protobuf 2 GB limit)")
    data_name = data_location or f"{path.name}.data"
    data_path = folder / data_name if external else None
    model_tmp = _temp_beside(path, tmp_files)
    data_tmp = _temp_beside(data_path, tmp_files) if data_path else None
    try:
        with open(model_tmp, "wb") as model_file:
            data_file = open(data_tmp, "wb") if data_tmp else None
            try:
                _write(model, model_file, data_file, data_name, referenced)
            finally:
                if data_file:
                    data_file.close()
    except OSError as exc:
        raise ModelSaveError(f"{path}: cannot write: {exc.strerror or exc}") from exc
    return model_tmp, data_tmp, SaveInfo(path=path, data_path=data_path, weights_nbytes=weights, external=external)


def _write_weight_map(model: Model, path: Path, tmp_files: list[Path]) -> Path:
    tmp = _temp_beside(map_path(path), tmp_files)
    tmp.write_text(json.dumps(weight_map_of(model)))
    return tmp


def check_destination(path: str | os.PathLike, source: str | os.PathLike | None = None) -> None:
    """Fail early, before any work, when ``path`` cannot be written or is the source itself
    (under any name: see :mod:`onnxopt.outputs`)."""
    Outputs(Inputs().files(source)).file(path)


def must_stay_inline(model: Model) -> set[str]:
    """Names of the constants that stay inline when weights go to external data, whatever their size.

    The rule: a constant stays inline when
      * a node (of the graph or of a subgraph) reads it at an input that shape inference reads as
        data (:data:`SHAPE_INPUTS`: Split sizes, Reshape shape, Slice starts/ends/axes/steps,
        Resize roi/scales/sizes, Pad pads/value/axes, Expand/Tile shape/repeats, TopK k,
        ConstantOfShape, Range, Squeeze/Unsqueeze/Reduce* axes...); or
      * it is an int32/int64 tensor of at most :data:`INLINE_INTEGER_MAX_BYTES`, because shape
        inference also reads integer constants through the ops that compute shapes (Concat,
        Gather, Mul... feeding a Reshape).
    ONNX Runtime runs shape inference at load, before reading external data, and refuses a model
    whose such tensor is external. Weights are float (or low-bit integer) tensors: unaffected.
    """
    from onnxopt.model import all_nodes

    names: set[str] = set()
    for node in all_nodes(model.graph):
        if node.domain in ("", "ai.onnx", None):
            for index in SHAPE_INPUTS.get(node.op, ()):
                if index < len(node.inputs) and isinstance(node.inputs[index], Constant):
                    names.add(node.inputs[index].name)
    for constant in model.constants() + model.subgraph_constants():
        if constant_data_type(constant) in _INTEGER_TYPES and constant_nbytes(constant) <= INLINE_INTEGER_MAX_BYTES:
            names.add(constant.name)
    return names


def planned_writes(model: Model, path: str | os.PathLike, *, external_data: bool | None = None,
                   data_location: str | None = None) -> list[Path]:
    """Every file :func:`save_model` would write for these arguments: the model, its data file
    when it goes external (by the same rule as the save), and the same for each companion."""
    from onnxopt.companions import companion_path

    path = Path(path)
    parts = [(model.alone(), path, data_location)]
    parts += [(c, companion_path(path, name), None) for name, c in model.companions.items()]
    writes = []
    for part, destination, location in parts:
        writes.append(destination)
        if part.weights_nbytes() > AUTO_EXTERNAL_BYTES if external_data is None else external_data:
            writes.append(destination.with_name(location or f"{destination.name}.data"))
    return writes


def check_writes(writes: Iterable[str | os.PathLike], source: Model, inputs: Inputs | None = None) -> None:
    """Refuse, before anything is written, a file to write that is a file the input reads.

    The input is every file of ``source.source_files`` (the .onnx and each external data file it
    names; a companion's too), and ``inputs`` when given. A path to write is compared by identity
    (:mod:`onnxopt.outputs`: symbolic links, hard links and bind mounts are the file they name).
    Two writes to one file (``--report-json out.onnx.data`` beside ``--external-data``) are
    refused as well.
    """
    outputs = Outputs((inputs or Inputs()).model(source))
    for write in writes:
        outputs.file(write)


def _write(model: Model, out: BinaryIO, data: BinaryIO | None, data_name: str, referenced: Path | None = None) -> None:
    # Shape-read tensors stay inline, in a file of our own or referenced from another one.
    inline = must_stay_inline(model) if data is not None or referenced is not None else set()
    with _placed(model.subgraph_constants(), data, data_name, inline):
        skeleton = model.skeleton(threshold=SKELETON_THRESHOLD_BYTES)
    stubbed = {t.name for t in skeleton.graph.initializer if onnx.external_data_helper.uses_external_data(t)}
    # Small initializers stay in the skeleton as they are; the stubs are replaced by streamed tensors.
    kept = [t for t in skeleton.graph.initializer if t.name not in stubbed]
    del skeleton.graph.initializer[:]
    skeleton.graph.initializer.extend(kept)
    _drop_outer_copies(skeleton.graph, {t.name for t in skeleton.graph.initializer} | stubbed)

    by_name = {c.name: c for c in model.constants()}
    # the data file is written in this order: the next derived tensor is computed while one is written
    streamed = [c for name, c in by_name.items() if name in stubbed and name not in inline and data is not None
                and constant_nbytes(c) >= EXTERNAL_MIN_BYTES]
    with computed_ahead(streamed):
        initializers = [(None if name in inline else _external_reference(c, referenced))
                        or _plan(c, data if name not in inline else None, data_name)
                        for name, c in by_name.items() if name in stubbed]

    graph_bytes = skeleton.graph.SerializeToString()
    skeleton.ClearField("graph")
    graph_len = len(graph_bytes) + sum(len(_tag(_INITIALIZER_FIELD)) + len(_varint(i.size)) + i.size for i in initializers)

    out.write(skeleton.SerializeToString())
    out.write(_tag(_GRAPH_FIELD) + _varint(graph_len))
    out.write(graph_bytes)
    for init in initializers:
        out.write(_tag(_INITIALIZER_FIELD) + _varint(init.size))
        out.write(init.header)
        if init.inline_nbytes:
            out.write(_tag(_RAW_DATA_FIELD) + _varint(init.inline_nbytes))
            _copy(iter_constant_bytes(init.constant), out, init.inline_nbytes, init.constant.name)


def _plan(constant, data: BinaryIO | None, data_name: str) -> _Initializer:
    """Build the header of one initializer; for external output, write its bytes to the data file now."""
    nbytes = constant_nbytes(constant)
    if not is_raw_encodable(constant):
        full = onnx.numpy_helper.from_array(read_uncached(constant), constant.name)
        return _Initializer(full.SerializeToString(), constant, 0)
    header = onnx.TensorProto(name=constant.name, data_type=constant_data_type(constant))
    header.dims.extend(constant_dims(constant))
    if data is None or nbytes < EXTERNAL_MIN_BYTES:
        return _Initializer(header.SerializeToString(), constant, nbytes)
    _write_external(header, constant, data, data_name, nbytes)
    return _Initializer(header.SerializeToString(), constant, 0)


@contextlib.contextmanager
def _placed(constants: list[Constant], data: BinaryIO | None, data_name: str, inline: set[str]):
    """Give each subgraph constant, for the time of an export, its TensorProto as written.

    Inline: the whole tensor; external (``data`` given, by the same rule as top-level
    initializers): its bytes go into ``data`` now and the TensorProto points there. The skeleton
    then carries them as they are, neither stubbed nor with the source's old location.
    """
    swapped = []
    try:
        for constant in constants:
            if not is_raw_encodable(constant):
                continue
            header = onnx.TensorProto(name=constant.name, data_type=constant_data_type(constant))
            header.dims.extend(constant_dims(constant))
            nbytes = constant_nbytes(constant)
            if data is None or nbytes < EXTERNAL_MIN_BYTES or constant.name in inline:
                header.raw_data = b"".join(bytes(chunk) for chunk in iter_constant_bytes(constant))
            else:
                _write_external(header, constant, data, data_name, nbytes)
            swapped.append((constant, stored_values(constant)))
            store_values(constant, LazyValues(header))
        yield
    finally:
        for constant, values in swapped:
            store_values(constant, values)


def _drop_outer_copies(graph: onnx.GraphProto, outer: set[str]) -> None:
    """Remove from subgraphs the initializers that repeat an outer-scope one (graphsurgeon exports
    a constant a branch reads from the enclosing graph as the branch's own initializer too)."""
    for node in graph.node:
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                kept = [t for t in sub.initializer if t.name not in outer]
                if len(kept) != len(sub.initializer):
                    del sub.initializer[:]
                    sub.initializer.extend(kept)
                _drop_outer_copies(sub, outer | {t.name for t in sub.initializer})


def _write_external(header: onnx.TensorProto, constant, data: BinaryIO, data_name: str, nbytes: int) -> None:
    offset = _align(data, ALIGN_LARGE if nbytes >= ALIGN_LARGE_FROM else 64)
    _copy(iter_constant_bytes(constant), data, nbytes, constant.name)
    header.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(nbytes))):
        header.external_data.add(key=key, value=value)


def _external_reference(constant, folder: Path | None) -> _Initializer | None:
    """For ``reference_external``: the header of a constant whose bytes lie in an external data file
    inside ``folder`` (the destination's, resolved), pointing at them; None for any other constant."""
    from onnxopt.weights import ExternalValues

    values = stored_values(constant)
    if folder is None or not isinstance(values, ExternalValues):
        return None
    try:
        location = values.location.path.resolve().relative_to(folder)
    except ValueError:
        return None
    header = onnx.TensorProto(name=constant.name, data_type=constant_data_type(constant))
    header.dims.extend(constant_dims(constant))
    header.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location.as_posix()), ("offset", str(values.location.offset)),
                       ("length", str(values.location.length))):
        header.external_data.add(key=key, value=value)
    return _Initializer(header.SerializeToString(), constant, 0)


def _copy(chunks: Iterable, out: BinaryIO, expected: int, name: str) -> None:
    written = 0
    for chunk in chunks:
        out.write(chunk)
        written += len(chunk)
    if written != expected:
        raise ModelSaveError(f"tensor '{name}': expected {expected} bytes, its source gave {written}")


def _align(f: BinaryIO, alignment: int) -> int:
    position = f.tell()
    padding = -position % alignment
    if padding:
        f.write(b"\0" * padding)
    return position + padding


def _temp_beside(path: Path, registry: list[Path]) -> Path:
    registry.append(temp_beside(path))
    return registry[-1]
