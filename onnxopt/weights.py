"""Where a constant's bytes live, and how to stream them without a second copy.

onnxopt never loads a model's weights up front. Initializers stay where they are:

* inline in the parsed protobuf (small models): graphsurgeon's ``LazyValues`` keeps the
  ``TensorProto`` and decodes it only if a pass asks for ``.values``;
* in external data files (models over 2 GB, dynamo exports): :class:`ExternalValues` keeps only
  the file, offset and length, and reads the bytes when a pass needs them or when the model is
  saved, a chunk at a time.

So a pass that rewires a 3.4 GB UNet touches only the tensors it changes, and saving streams each
tensor from its source to its destination.

This module is the only one that touches graphsurgeon's private ``Constant._values``: the rest
of onnxopt reads a constant with :func:`read_uncached` (never ``Constant.values``, which keeps
what it loads for good) and moves data sources with :func:`stored_values` / :func:`store_values`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import ml_dtypes
import numpy as np
import onnx
from onnx import external_data_helper, helper
from onnx_graphsurgeon.ir.tensor import Constant, LazyValues, SparseValues

from onnxopt import weight_provenance

CHUNK_BYTES = 64 << 20
# External tensors from this size on are mapped, not read: a read copies the bytes into fresh
# memory, and on a VM every fresh page is a fault (reading a 1 GiB weight slice took 1.5-1.9 s
# of CPU that way, mapping it 0.13 s; benchmarks/results/cpu-2core-2026-11-25-sdxl-optimizer.md).
# Smaller ones are read: thousands of tiny mappings would crowd the process's map count.
MAP_FROM_BYTES = 1 << 20


def onnx_dtype_to_numpy(data_type: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(data_type))


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)  # NumPy's view of ONNX's bfloat16 (ONNX's own ml_dtypes type)


def numpy_dtype(dtype) -> np.dtype:
    """The NumPy dtype of a tensor's ``dtype`` as onnx-graphsurgeon holds it.

    onnx-graphsurgeon keeps a NumPy dtype where NumPy has one, and the ONNX element type (an int)
    where it has none: bfloat16 and the float8 types. ``np.dtype(16)`` raises; this maps those
    through ONNX's ml_dtypes types (``ml_dtypes.bfloat16``...), which compare, print and convert
    like NumPy dtypes."""
    if isinstance(dtype, (int, np.integer)):
        return onnx_dtype_to_numpy(int(dtype))
    return np.dtype(dtype)


@dataclass(frozen=True)
class ExternalLocation:
    path: Path
    offset: int
    length: int


def external_location(tensor: onnx.TensorProto, base_dir: Path) -> ExternalLocation:
    """Resolve a tensor's external-data entry against the model's folder.

    Raises ValueError (the caller words it for the user) when the location is not inside
    ``base_dir`` once resolved: an absolute or ``../`` path, or a symbolic link (the data file
    itself or a folder on its way) that leads outside, as onnx and ONNX Runtime refuse it; or when
    the entry's length is not the tensor's size (dtype x shape). The path returned is the
    resolved one, so what is read is what was checked.
    """
    info = external_data_helper.ExternalDataInfo(tensor)
    location = Path(info.location)
    if location.is_absolute() or ".." in location.parts:
        # The ONNX spec requires locations relative to the model; anything else is a path escape.
        raise ValueError(f"external data location '{info.location}' of tensor '{tensor.name}' is not a relative path")
    folder = Path(os.path.realpath(base_dir))
    path = Path(os.path.realpath(folder / location))
    if not path.is_relative_to(folder):
        raise ValueError(f"external data location '{info.location}' of tensor '{tensor.name}' leads outside the "
                         f"model's folder through a symbolic link (to {path}); onnxopt reads only inside it")
    nbytes = int(np.prod(tensor.dims, dtype=np.int64)) * onnx_dtype_to_numpy(tensor.data_type).itemsize
    length = info.length if info.length is not None and info.length > 0 else nbytes
    if length != nbytes:
        raise ValueError(f"external data of tensor '{tensor.name}' is {length} bytes long, but its type and shape "
                         f"({onnx.TensorProto.DataType.Name(tensor.data_type).lower()} {list(tensor.dims)}) need {nbytes}")
    return ExternalLocation(path, info.offset or 0, length)


class ExternalValues(LazyValues):
    """Constant values that stay in an external data file until someone reads them."""

    def __init__(self, tensor: onnx.TensorProto, base_dir: Path):
        super().__init__(tensor)
        self.location = external_location(tensor, base_dir)

    def load(self) -> np.ndarray:
        """The tensor's array; from :data:`MAP_FROM_BYTES` on a read-only view of the file mapped
        into memory (onnxopt never writes its input, and replaces outputs by renaming, so the
        mapped bytes stay what they were)."""
        dtype = onnx_dtype_to_numpy(self.tensor.data_type)
        count = self.location.length // dtype.itemsize
        if self.location.length >= MAP_FROM_BYTES:
            return self._mapped(dtype, count).reshape(tuple(self.tensor.dims))
        with open(self.location.path, "rb") as f:
            f.seek(self.location.offset)
            array = np.fromfile(f, dtype=dtype, count=count)
        return array.reshape(tuple(self.tensor.dims))

    def _mapped(self, dtype: np.dtype, count: int) -> np.ndarray:
        self._check_file_length()
        mapped = np.memmap(self.location.path, dtype=dtype, mode="r", offset=self.location.offset, shape=(count,))
        return np.asarray(mapped)  # a plain ndarray view; the mapping lives as long as it does

    def _check_file_length(self) -> None:
        """A mapping past the file's end would fault (SIGBUS) on access: refuse it up front, as a read would."""
        if file_size(self.location.path) < self.location.offset + self.location.length:
            raise OSError(f"external data file {self.location.path} ended early")

    def iter_bytes(self) -> Iterator[bytes | memoryview]:
        if self.location.length >= MAP_FROM_BYTES:
            view = memoryview(self._mapped(np.dtype(np.uint8), self.location.length))
            for start in range(0, len(view), CHUNK_BYTES):
                yield view[start : start + CHUNK_BYTES]
            return
        remaining = self.location.length
        with open(self.location.path, "rb") as f:
            f.seek(self.location.offset)
            while remaining:
                chunk = f.read(min(CHUNK_BYTES, remaining))
                if not chunk:
                    raise OSError(f"external data file {self.location.path} ended early")
                remaining -= len(chunk)
                yield chunk

    def __str__(self):
        return f"ExternalValues(shape={self.shape}, dtype={self.dtype}, file={self.location.path.name})"


class DerivedValues(LazyValues):
    """Constant values computed from other constants only when read (or saved).

    Passes that rewrite weights (transposing a Conv weight, concatenating Q/K/V, converting to
    fp16) describe the result instead of computing it, so a 3.4 GB model is rewritten without
    loading it; the save streams each derived tensor as it is computed.

    ``elements_of``: when the result only rearranges other tensors' elements (a transpose, a
    concatenation, Q/K/V packing), their stored values (:func:`stored_values`, of the same dtype).
    Whoever needs only facts about the elements, such as fp16's range scan, then reads the sources
    and never computes the result: on SDXL that spares computing 1.36 GB of concatenated K/V
    weights once more before the save computes it.
    """

    def __init__(self, shape, dtype, compute: Callable[[], np.ndarray], name: str = "", elements_of=None):
        proto = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(numpy_dtype(dtype)))
        proto.dims.extend(int(d) for d in shape)
        super().__init__(proto)
        self._compute = compute
        self.elements_of = tuple(elements_of) if elements_of is not None else None

    def load(self) -> np.ndarray:
        array = np.asarray(self._compute(), order="C")  # ascontiguousarray would make a 0-d scalar (1,)
        expected = tuple(self.tensor.dims)
        if array.shape != expected:
            raise ValueError(f"derived tensor '{self.tensor.name}': computed shape {array.shape}, declared {expected}")
        return array

    def __str__(self):
        return f"DerivedValues(shape={self.shape}, dtype={self.dtype})"


class _ComputedAhead(DerivedValues):
    """A derived tensor whose computation a worker thread started before anyone asked for it."""

    def __init__(self, original: DerivedValues, result: Callable[[], np.ndarray]):
        # the original's TensorProto and facts as they are (graphsurgeon would re-derive them, and
        # complain per tensor about bfloat16)
        self.tensor, self.shape, self.dtype, self.nbytes = original.tensor, original.shape, original.dtype, original.nbytes
        self._compute = result
        self.elements_of = original.elements_of


# How many derived tensors :func:`computed_ahead` computes (on as many threads) before they are
# read. Their computation (reading sources, packing, converting to fp16; NumPy releases the GIL)
# overlaps the writing of the current one; each holds one extra tensor in memory. Two keep both
# cores of a 2-core machine busy, and on a crowded one give this process more of its share.
COMPUTE_AHEAD = 2


@contextlib.contextmanager
def computed_ahead(constants: list[Constant]) -> Iterator[None]:
    """While a saver reads ``constants`` in this order, compute each derived one on a worker
    thread :data:`COMPUTE_AHEAD` tensors before it is read. Reading out of order is allowed
    (a tensor not started yet is started when read), only slower; the values are put back after."""
    derived = [c for c in constants if isinstance(c._values, DerivedValues)]
    if COMPUTE_AHEAD < 1 or len(derived) < 2:
        yield
        return
    from concurrent.futures import ThreadPoolExecutor

    originals = [c._values for c in derived]
    futures: dict[int, object] = {}
    pool = ThreadPoolExecutor(max_workers=COMPUTE_AHEAD, thread_name_prefix="onnxopt-compute-ahead")

    def start(i: int) -> None:
        if i < len(originals) and i not in futures:
            futures[i] = pool.submit(originals[i].load)

    def result(i: int) -> np.ndarray:
        start(i)
        for ahead in range(i + 1, i + 1 + COMPUTE_AHEAD):
            start(ahead)
        return futures.pop(i).result()

    try:
        for i, constant in enumerate(derived):
            constant._values = _ComputedAhead(originals[i], lambda i=i: result(i))
        start(0)
        yield
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        futures.clear()
        for constant, values in zip(derived, originals):
            constant._values = values


def read_uncached(values) -> np.ndarray:
    """The array behind a Constant (or its ``_values``) without caching it on the constant.

    graphsurgeon's ``Constant.values`` keeps a loaded weight in memory for good; a pass that reads
    every weight of a large model (to transpose, concatenate or convert it) would hold them all
    (every conv weight of a full SD UNet: 2.7 GB peak while saving). Lazy values stay lazy."""
    if isinstance(values, Constant):
        values = values._values
    return values.load() if isinstance(values, LazyValues) else np.asarray(values)


def stored_values(constant: Constant) -> LazyValues | np.ndarray:
    """What holds the constant's data now, not read: a lazy source (protobuf, file, derived) or an array."""
    return constant._values


def store_values(constant: Constant, values: LazyValues | np.ndarray) -> None:
    """Give ``constant`` new data, an array or a lazy source; the old one is not read. New data
    that says nothing of where it came from holds the old (the same weight read into memory, or
    put back after a save): :mod:`onnxopt.weight_provenance` follows it."""
    if not weight_provenance.sources(values):
        weight_provenance.record(values, [(constant._values, [])])
    constant._values = values


@contextlib.contextmanager
def values_replaced(replacements: list[tuple[Constant, LazyValues | np.ndarray]]) -> Iterator[None]:
    """Give each constant the values paired with it for the duration, then put the old ones back."""
    saved = [(constant, constant._values) for constant, _ in replacements]
    try:
        for constant, values in replacements:
            constant._values = values
        yield
    finally:
        for constant, values in saved:
            constant._values = values


def is_sparse(constant: Constant) -> bool:
    return isinstance(constant._values, SparseValues)


def is_external(constant: Constant) -> bool:
    """True while the constant's data is still in an external data file (not read)."""
    return isinstance(constant._values, ExternalValues)


def load_external_attribute(constant: Constant, base_dir: Path) -> None:
    """Read into memory a tensor attribute (a Constant node's ``value``) kept in external data."""
    values = constant._values
    if isinstance(values, LazyValues) and external_data_helper.uses_external_data(values.tensor):
        constant._values = ExternalValues(values.tensor, base_dir).load()
        constant.data_location = None  # else graphsurgeon stamps EXTERNAL on the inline tensor


def attach_external_values(constants, base_dir: Path) -> int:
    """Swap graphsurgeon's LazyValues for ExternalValues on every externally stored constant.

    Also forget graphsurgeon's ``data_location``: it would stamp EXTERNAL on the TensorProto of a
    constant whose values were later loaded or replaced, making an invalid model. Where a
    constant's bytes live is the business of its values object alone.
    """
    count = 0
    for constant in constants:
        constant.data_location = None
        values = constant._values
        if isinstance(values, LazyValues) and not isinstance(values, (ExternalValues, SparseValues)):
            if external_data_helper.uses_external_data(values.tensor):
                constant._values = ExternalValues(values.tensor, base_dir)
                count += 1
    return count


def constant_nbytes(constant: Constant) -> int:
    values = constant._values
    if isinstance(values, LazyValues):
        return int(values.nbytes)
    return int(values.nbytes)


def constant_data_type(constant: Constant) -> int:
    values = constant._values
    if isinstance(values, LazyValues):
        return values.tensor.data_type
    return helper.np_dtype_to_tensor_dtype(values.dtype)


def constant_dims(constant: Constant) -> list[int]:
    values = constant._values
    if isinstance(values, LazyValues):
        return list(values.tensor.dims)
    return list(values.shape)


def element_sources(constant: Constant) -> list[LazyValues | np.ndarray]:
    """Stored values that hold, together, exactly the constant's elements (in some order): the
    sources of a rearranging :class:`DerivedValues`, followed down; else the constant's own."""
    pending, found = [constant._values], []
    while pending:
        values = pending.pop(0)
        if isinstance(values, DerivedValues) and values.elements_of is not None \
                and all(numpy_dtype(s.dtype) == numpy_dtype(values.dtype) for s in values.elements_of):
            pending[:0] = values.elements_of
        else:
            found.append(values)
    return found


def iter_constant_bytes(constant: Constant) -> Iterator[bytes | memoryview]:
    """The constant's little-endian raw bytes, in chunks, without materialising a copy where avoidable."""
    return iter_values_bytes(constant._values)


def iter_values_bytes(values: LazyValues | np.ndarray) -> Iterator[bytes | memoryview]:
    """:func:`iter_constant_bytes` of stored values."""
    if isinstance(values, ExternalValues):
        yield from values.iter_bytes()
        return
    if isinstance(values, LazyValues) and not isinstance(values, DerivedValues) and values.tensor.HasField("raw_data"):
        yield values.tensor.raw_data
        return
    array = values.load() if isinstance(values, LazyValues) else values
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    view = memoryview(array.reshape(-1).view(np.uint8))
    for start in range(0, len(view), CHUNK_BYTES):
        yield view[start : start + CHUNK_BYTES]


def needs_materialising(constant: Constant) -> bool:
    """True when the constant's exported TensorProto does not carry its data (external or derived)."""
    values = constant._values
    return isinstance(values, (ExternalValues, DerivedValues))


def is_raw_encodable(constant: Constant) -> bool:
    """Strings cannot go to raw_data/external data; everything numeric can."""
    return constant_data_type(constant) != onnx.TensorProto.STRING


def file_size(path: Path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1
