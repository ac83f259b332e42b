"""Load a model from a path, a ModelProto or a graph, with one-line errors for bad input.

External data is resolved but not read (see :mod:`onnxopt.weights`); both layouts work: the
dynamo exporter's single ``model.onnx.data`` and the TorchScript exporter's file per tensor.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError
from onnx import external_data_helper
from onnx_graphsurgeon.ir.tensor import Constant

from onnxopt.errors import ModelLoadError, UnsupportedModelError
from onnxopt.input_files import refuse_special_file
from onnxopt.model import Model, all_nodes
from onnxopt.validity import check_model_structure
from onnxopt.weight_provenance import record_origins
from onnxopt.weights import attach_external_values, external_location, file_size, load_external_attribute

MIN_OPSET = 13  # LayerNormalization-era exports; older graphs should be re-exported or converted
MAX_OPSET = onnx.defs.onnx_opset_version()

ModelSource = "str | os.PathLike | onnx.ModelProto | gs.Graph | Model"


def load_model(source, *, base_dir: str | os.PathLike | None = None) -> Model:
    """Load ``source`` into a :class:`Model` without touching the source.

    ``base_dir`` resolves external data for an in-memory ModelProto (defaults to the file's
    folder for a path, the current directory otherwise).
    """
    if isinstance(source, Model):
        return source.copy()
    if isinstance(source, gs.Graph):
        return Model(graph=source.copy())
    if isinstance(source, onnx.ModelProto):
        return _from_proto(source, Path(base_dir) if base_dir else Path.cwd(), origin=None)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        return _from_proto(_read_proto(path), Path(base_dir) if base_dir else path.parent, origin=path)
    raise TypeError(f"cannot load a model from {type(source).__name__}")


def _read_proto(path: Path) -> onnx.ModelProto:
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a folder, expected an .onnx file")
    refuse_special_file(path, "a model", ModelLoadError)  # onnx.load of a named pipe waited for a writer forever
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not an ONNX model, or the file is truncated ({_first_line(exc)})") from exc
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    # Arbitrary bytes sometimes parse as a protobuf with unknown fields: demand the parts a model has.
    if not proto.HasField("graph") or not proto.opset_import or proto.ir_version <= 0:
        raise ModelLoadError(f"{path}: not an ONNX model (no graph, opset or IR version)")
    return proto


def _from_proto(proto: onnx.ModelProto, base_dir: Path, origin: Path | None) -> Model:
    where = str(origin) if origin else "model"
    _check_opset(proto, where)
    check_model_structure(proto, where)
    data_files = check_external_data(proto, base_dir, where)
    proto, input_defaults = _split_input_defaults(proto)
    try:
        graph = gs.import_onnx(proto)
    except Exception as exc:  # graphsurgeon raises assorted errors on malformed graphs
        raise ModelLoadError(f"{where}: malformed graph ({_first_line(exc)})") from exc
    model = Model(
        graph=graph,
        source=origin,
        metadata_props={p.key: p.value for p in proto.metadata_props},
        model_version=proto.model_version,
        doc_string=proto.doc_string,
        domain=proto.domain,
        node_scopes=node_scopes(proto.graph),
        source_files=tuple(dict.fromkeys([Path(os.path.realpath(origin))] if origin else []) | dict.fromkeys(data_files)),
        input_defaults=input_defaults,
    )
    attach_external_values(model.constants() + model.subgraph_constants(), base_dir)
    _load_external_attributes(model, base_dir)
    record_origins(model, proto, origin)  # which torch parameter each weight holds (LoRA lands by it)
    return model


def _load_external_attributes(model: Model, base_dir: Path) -> None:
    """Read into memory the tensor attributes (a Constant node's ``value``) kept in external data.

    onnx allows them; graphsurgeon would export them with their old location. They are values of
    single nodes, written inline on save like any attribute (their location was checked on load).
    """
    for node in all_nodes(model.graph):
        for value in node.attrs.values():
            if isinstance(value, Constant):
                load_external_attribute(value, base_dir)


def _split_input_defaults(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """Take out the initializers that share a name with a graph input: defaults the caller may
    override. graphsurgeon would import such an input as a Constant (and drop it from the inputs),
    so passes would fold it; kept aside, the input stays a Variable. Also drop the value_info
    annotations of non-tensor values (optional, sequence), which graphsurgeon cannot export
    (shape inference derives them again). ``proto`` is not modified."""
    from onnx_graphsurgeon.importers.onnx_importer import OnnxImporter

    inputs = {i.name for i in proto.graph.input}
    odd_annotations = any(vi.type.WhichOneof("value") != "tensor_type" for vi in proto.graph.value_info)
    if not odd_annotations and not any(t.name in inputs for t in proto.graph.initializer):
        return proto, {}
    defaults = {t.name: OnnxImporter.import_tensor(t) for t in proto.graph.initializer if t.name in inputs}
    stripped = onnx.ModelProto()
    stripped.CopyFrom(proto)
    kept = [t for t in stripped.graph.initializer if t.name not in inputs]
    del stripped.graph.initializer[:]
    stripped.graph.initializer.extend(kept)
    tensors = [vi for vi in stripped.graph.value_info if vi.type.WhichOneof("value") == "tensor_type"]
    del stripped.graph.value_info[:]
    stripped.graph.value_info.extend(tensors)
    return stripped, defaults


TORCH_NAME_SCOPES = "pkg.torch.onnx.name_scopes"  # the dynamo exporter's module path of a node


def node_scopes(graph: onnx.GraphProto) -> dict[str, str]:
    """Node name -> innermost torch module ('unet.mid_block.attentions.0...attn2'), where recorded.

    The dynamo exporter writes ``['', 'unet', 'unet.mid_block', ..., 'linear_8']`` (modules, then
    the op); graphsurgeon drops node metadata, so it is kept here for passes that name things.
    """
    import ast

    scopes = {}
    for node in graph.node:
        for prop in getattr(node, "metadata_props", ()):
            if prop.key == TORCH_NAME_SCOPES:
                try:
                    path = ast.literal_eval(prop.value)
                except (ValueError, SyntaxError):
                    break
                if isinstance(path, list) and len(path) >= 2 and path[-2]:
                    scopes[node.name] = str(path[-2])
                break
    return scopes


def _check_opset(proto: onnx.ModelProto, where: str) -> None:
    versions = {o.domain or "ai.onnx": o.version for o in proto.opset_import}
    opset = versions.get("ai.onnx")
    if opset is None:
        raise UnsupportedModelError(f"{where}: the model imports no ai.onnx opset")
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise UnsupportedModelError(
            f"{where}: ai.onnx opset {opset} is not supported (onnxopt handles {MIN_OPSET} to {MAX_OPSET}); "
            "re-export the model or convert it with onnx.version_converter"
        )


def check_external_data(proto: onnx.ModelProto, base_dir: Path, where: str) -> list[Path]:
    """Check every external data entry (location, length, file size); return the files they name."""
    missing: dict[Path, str] = {}
    files: dict[Path, None] = {}
    for tensor in external_data_helper._get_all_tensors(proto):
        if not external_data_helper.uses_external_data(tensor):
            continue
        try:
            loc = external_location(tensor, base_dir)
        except ValueError as exc:
            raise ModelLoadError(f"{where}: {exc}") from exc
        files[loc.path] = None
        if loc.path.is_dir():
            raise ModelLoadError(f"{where}: external data {loc.path.name} of tensor '{tensor.name}' is a folder, not a file")
        size = file_size(loc.path)
        if size < 0:
            missing.setdefault(loc.path, tensor.name)
        elif size < loc.offset + loc.length:
            raise ModelLoadError(
                f"{where}: external data file {loc.path.name} is truncated: tensor '{tensor.name}' needs bytes "
                f"{loc.offset}..{loc.offset + loc.length}, the file has {size}"
            )
    if missing:
        path, tensor = next(iter(missing.items()))
        more = f" (and {len(missing) - 1} more files)" if len(missing) > 1 else ""
        raise ModelLoadError(
            f"{where}: missing external data: {path.name} (tensor '{tensor}') not found in {base_dir}{more}"
        )
    return list(files)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def read_json_object(path: Path) -> dict:
    """A JSON object file (a component's config.json), or {} where it is missing, unreadable or not an
    object: the defaults then apply."""
    import json

    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested deeper than the decoder goes
        return {}
    return value if isinstance(value, dict) else {}


METADATA_PROPS_FIELD = 14  # ModelProto.metadata_props (onnx.proto)


def read_metadata_props(path) -> dict[str, str]:
    """An .onnx file's ``metadata_props``, read without parsing its graph. onnx reads a model whole
    (an inline 1.7 GB UNet would be parsed to answer a size check), so this walks the ModelProto's
    top-level fields in protobuf's wire format, skipping each by its length, and parses only the
    metadata entries. {} for a file that is not such a protobuf (the model's loader says why)."""
    props: dict[str, str] = {}
    try:
        with open(path, "rb") as f:
            while (key := _read_varint(f)) is not None:
                field, wire = key >> 3, key & 7
                if wire == 0:
                    _read_varint(f)
                elif wire in (1, 5):
                    f.seek(8 if wire == 1 else 4, os.SEEK_CUR)
                elif wire == 2:
                    length = _read_varint(f)
                    if field != METADATA_PROPS_FIELD:
                        f.seek(length, os.SEEK_CUR)
                        continue
                    entry = onnx.StringStringEntryProto.FromString(f.read(length))
                    props[entry.key] = entry.value
                else:
                    return {}
    except (OSError, DecodeError, TypeError):
        return {}
    return props


def _read_varint(f) -> int | None:
    """One base-128 varint from ``f``; None at the end of the file."""
    value, shift = 0, 0
    while byte := f.read(1):
        value |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return value
        shift += 7
    if shift:
        raise DecodeError("truncated varint")
    return None
