"""The in-memory model: a graphsurgeon graph plus what ONNX keeps outside the graph.

Passes edit ``model.graph`` (an ``onnx_graphsurgeon.Graph``) in place. Weights are not loaded:
see :mod:`onnxopt.weights`. :func:`Model.skeleton` exports a ``ModelProto`` whose large
initializers carry only name, type and shape, which is what shape inference, checkers and
serialisation of the graph structure need, at a size far below the protobuf 2 GB limit.

Companions: a pass may split a model in two (``context-kv``: the K/V projections of
``encoder_hidden_states`` go to a graph run once per prompt). The part that runs first is a
*companion* of the main model, kept in ``model.companions`` by name. The convention that ties
them: every companion runs on the caller's inputs first, and each of its outputs feeds the main
model's input of the same name. The pass manager runs later passes over the companions too,
:func:`onnxopt.saving.save_model` writes them beside the main file (``out.onnx`` and
``out.context_kv.onnx``) and :class:`onnxopt.verify.Verifier` runs the chain.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import Constant, LazyValues

from onnxopt.weights import (
    constant_data_type,
    constant_dims,
    constant_nbytes,
    is_sparse,
    needs_materialising,
    read_uncached,
    values_replaced,
)

# Initializers at least this large are left out of skeletons (and go to external data on save).
SKELETON_THRESHOLD_BYTES = 1024
STUB_LOCATION = "__onnxopt_stub__"


@dataclass
class Model:
    graph: gs.Graph
    source: Path | None = None  # file it was loaded from, if any
    metadata_props: dict[str, str] = field(default_factory=dict)
    model_version: int = 0
    doc_string: str = ""
    domain: str = ""
    # Models that run before this one and feed its inputs by name (see the module docstring).
    companions: dict[str, "Model"] = field(default_factory=dict)
    # Node name -> the torch module it came from ("unet.down_blocks.0.attentions.0...attn2"), from
    # the dynamo exporter's node metadata, which graphsurgeon does not keep. TorchScript exports
    # carry the module path in the node names themselves ("/unet/down_blocks.0/.../attn2/MatMul").
    node_scopes: dict[str, str] = field(default_factory=dict)
    # Every file the source was read from: the .onnx and its external data files (resolved paths).
    # Nothing onnxopt writes may land on one (see onnxopt.saving.check_writes).
    source_files: tuple[Path, ...] = ()
    # Graph input name -> its default value (an initializer of the same name in the file). The
    # input stays a Variable in ``graph``, so no pass treats it as a constant; the default is
    # written back beside it on export, for as long as the input exists.
    input_defaults: dict[str, Constant] = field(default_factory=dict)

    @property
    def opset(self) -> int:
        return int(self.graph.opset)

    def constants(self) -> list[Constant]:
        """Constants used by the top-level graph (the ones exported as initializers), input defaults included."""
        return [
            t
            for t in self.graph.tensors().values()
            if isinstance(t, Constant) and not is_sparse(t)
        ] + self._live_defaults()

    def _live_defaults(self) -> list[Constant]:
        inputs = {t.name for t in self.graph.inputs}
        return [c for name, c in self.input_defaults.items() if name in inputs]

    def subgraph_constants(self) -> list[Constant]:
        """Constants of the subgraphs (If/Loop/Scan bodies, at any depth) that are not top-level ones.

        graphsurgeon exports them as the subgraph's initializers; they are few and small in the
        models onnxopt meets, so :func:`onnxopt.saving.save_model` places each one whole (inline, or
        its bytes into the data file) instead of streaming them like top-level initializers.
        """
        seen = {id(c) for c in self.constants()}
        found: list[Constant] = []
        for subgraph in subgraphs(self.graph):
            for tensor in subgraph.tensors().values():
                if isinstance(tensor, Constant) and not is_sparse(tensor) and id(tensor) not in seen:
                    seen.add(id(tensor))
                    found.append(tensor)
        return found

    def weights_nbytes(self) -> int:
        return sum(constant_nbytes(c) for c in self.constants() + self.subgraph_constants())

    def copy(self) -> "Model":
        """A structural copy: new nodes and tensors, constant values shared (never mutated in place)."""
        return Model(
            graph=self.graph.copy(),
            source=self.source,
            metadata_props=dict(self.metadata_props),
            model_version=self.model_version,
            doc_string=self.doc_string,
            domain=self.domain,
            companions={name: c.copy() for name, c in self.companions.items()},
            node_scopes=dict(self.node_scopes),
            source_files=self.source_files,
            input_defaults=dict(self.input_defaults),
        )

    def alone(self) -> "Model":
        """This model without its companions (same graph object): what runs or saves as one file."""
        if not self.companions:
            return self
        return Model(self.graph, self.source, self.metadata_props, self.model_version, self.doc_string, self.domain,
                     node_scopes=self.node_scopes, source_files=self.source_files,
                     input_defaults=self.input_defaults)

    def skeleton(self, threshold: int = SKELETON_THRESHOLD_BYTES) -> onnx.ModelProto:
        """Export the graph with every initializer of ``threshold`` bytes or more reduced to a stub.

        A stub is a TensorProto with name, dims and type and an external-data entry pointing
        nowhere; shape inference reads dims only, so the skeleton is enough for it.
        """
        with stubbed_constants(self.constants(), threshold):
            proto = gs.export_onnx(self.graph, do_type_check=False)
            self._export_defaults(proto)
        self._apply_metadata(proto)
        return proto

    def to_onnx(self) -> onnx.ModelProto:
        """A full in-memory ModelProto (weights loaded). For small models and tests only."""
        with _materialised(self.subgraph_constants()):
            proto = gs.export_onnx(self.graph, do_type_check=False)
        self._export_defaults(proto)
        tensors = {**self.graph.tensors(), **{c.name: c for c in self._live_defaults()}}
        for tensor in proto.graph.initializer:
            if needs_materialising(tensors[tensor.name]):
                tensor.CopyFrom(onnx.numpy_helper.from_array(read_uncached(tensors[tensor.name]), tensor.name))
        self._apply_metadata(proto)
        return proto

    def _export_defaults(self, proto: onnx.ModelProto) -> None:
        from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

        proto.graph.initializer.extend(OnnxExporter.export_tensor_proto(c) for c in self._live_defaults())

    def _apply_metadata(self, proto: onnx.ModelProto) -> None:
        proto.model_version = self.model_version
        proto.doc_string = self.doc_string
        proto.domain = self.domain
        del proto.metadata_props[:]
        for key, value in self.metadata_props.items():
            proto.metadata_props.add(key=key, value=value)


def subgraphs(graph: gs.Graph) -> Iterator[gs.Graph]:
    """Every graph held in a node attribute of ``graph`` (If branches, Loop/Scan bodies), nested ones too."""
    for node in graph.nodes:
        for value in node.attrs.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, gs.Graph):
                    yield sub
                    yield from subgraphs(sub)


def all_nodes(graph: gs.Graph) -> Iterator[gs.Node]:
    """The nodes of ``graph`` and of every subgraph in it."""
    yield from graph.nodes
    for sub in subgraphs(graph):
        yield from sub.nodes


def stub_tensor(constant: Constant) -> onnx.TensorProto:
    stub = onnx.TensorProto(name=constant.name, data_type=constant_data_type(constant))
    stub.dims.extend(constant_dims(constant))
    stub.data_location = onnx.TensorProto.EXTERNAL
    stub.external_data.add(key="location", value=STUB_LOCATION)
    return stub


@contextlib.contextmanager
def _materialised(constants: list[Constant]) -> Iterator[None]:
    """Temporarily give external or derived constants their values in memory (for a full export)."""
    with values_replaced([(c, read_uncached(c)) for c in constants if needs_materialising(c)]):
        yield


@contextlib.contextmanager
def stubbed_constants(constants: list[Constant], threshold: int) -> Iterator[list[Constant]]:
    """Temporarily replace the values of large constants with stubs, then put them back."""
    # A derived or external tensor's TensorProto carries no data: always stub it, whatever its size.
    stubbed = [c for c in constants if constant_nbytes(c) >= threshold or needs_materialising(c)]
    with values_replaced([(c, LazyValues(stub_tensor(c))) for c in stubbed]):
        yield stubbed
