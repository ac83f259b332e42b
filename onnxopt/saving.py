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

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable

import onnx

from onnxopt.errors import ModelSaveError
from onnxopt.model import Model, SKELETON_THRESHOLD_BYTES
from onnxopt.weights import (
    constant_data_type,
    constant_dims,
    constant_nbytes,
    is_raw_encodable,
    iter_constant_bytes,
)

# Above this much weight data the output goes to external data on its own. Kept under 2 GiB so
# the graph structure itself still fits beside the weights.
AUTO_EXTERNAL_BYTES = 1_800_000_000
EXTERNAL_MIN_BYTES = 1024  # smaller tensors stay inline, as onnx's own converter does
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
) -> SaveInfo:
    """Save ``model`` to ``path``, and each companion beside it (``<stem>.<name>.onnx``).

    ``external_data``: True forces one external data file, False forces everything inline,
    None (default) goes external only when the weights exceed ~1.8 GB (decided per file).
    ``data_location``: the main model's data file name, next to it (default ``<name>.data``);
    a companion's is always ``<its file name>.data``.
    ``reference_external``: a weight whose bytes already lie in an external data file inside the
    destination folder is written as a reference to them (same file, offset and length), not
    copied (see :func:`_external_reference`); the files written then depend on that file.
    All files are complete before any is renamed into place: a failure leaves none of them.
    """
    from onnxopt.companions import companion_path

    path = Path(path)
    parts = [(None, model.alone(), path, data_location)]
    parts += [(name, c.alone(), companion_path(path, name), None) for name, c in model.companions.items()]
    for _, _, destination, _ in parts:
        check_destination(destination, model.source)
    tmp_files: list[Path] = []
    written: list[tuple[str | None, Path, Path | None, SaveInfo]] = []
    try:
        for name, part, destination, location in parts:
            written.append((name, *_write_beside(part, destination, external_data, location, tmp_files,
                                                 reference_external)))
        for _, model_tmp, data_tmp, info in written:
            if data_tmp:
                os.replace(data_tmp, info.data_path)
            os.replace(model_tmp, info.path)
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


def check_destination(path: str | os.PathLike, source: str | os.PathLike | None = None) -> None:
    """Fail early, before any work, when ``path`` cannot be written or is the source itself."""
    path = Path(path)
    if source is not None and _same_file(path, Path(source)):
        raise ModelSaveError(f"{path}: output is the input file; onnxopt never modifies its input")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ModelSaveError(f"{path}: folder {folder} does not exist")
    if path.is_dir():
        raise ModelSaveError(f"{path}: is a folder")
    if not os.access(folder, os.W_OK):
        raise ModelSaveError(f"{path}: folder {folder} is not writable")


def _write(model: Model, out: BinaryIO, data: BinaryIO | None, data_name: str, referenced: Path | None = None) -> None:
    skeleton = model.skeleton(threshold=SKELETON_THRESHOLD_BYTES)
    stubbed = {t.name for t in skeleton.graph.initializer if onnx.external_data_helper.uses_external_data(t)}
    # Small initializers stay in the skeleton as they are; the stubs are replaced by streamed tensors.
    kept = [t for t in skeleton.graph.initializer if t.name not in stubbed]
    del skeleton.graph.initializer[:]
    skeleton.graph.initializer.extend(kept)

    by_name = {c.name: c for c in model.constants()}
    initializers = [_external_reference(c, referenced) or _plan(c, data, data_name)
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
        full = onnx.numpy_helper.from_array(constant.values, constant.name)
        return _Initializer(full.SerializeToString(), constant, 0)
    header = onnx.TensorProto(name=constant.name, data_type=constant_data_type(constant))
    header.dims.extend(constant_dims(constant))
    if data is None or nbytes < EXTERNAL_MIN_BYTES:
        return _Initializer(header.SerializeToString(), constant, nbytes)
    offset = _align(data, ALIGN_LARGE if nbytes >= ALIGN_LARGE_FROM else 64)
    _copy(iter_constant_bytes(constant), data, nbytes, constant.name)
    header.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(nbytes))):
        header.external_data.add(key=key, value=value)
    return _Initializer(header.SerializeToString(), constant, 0)


def _external_reference(constant, folder: Path | None) -> _Initializer | None:
    """For ``reference_external``: the header of a constant whose bytes lie in an external data file
    inside ``folder`` (the destination's, resolved), pointing at them; None for any other constant."""
    from onnxopt.weights import ExternalValues

    values = constant._values
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
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    os.close(fd)
    registry.append(Path(name))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(name, 0o666 & ~umask)  # mkstemp makes 0600 files; outputs get the usual permissions
    return Path(name)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and os.path.samefile(a, b)
    except OSError:
        return False
