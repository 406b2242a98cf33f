"""Minimal safetensors reader (memory-mapped, zero-copy, validated) and streaming writer.

Why not the `safetensors` package: it is not a runtime dependency of hopdec, its NumPy API reads
whole files into memory instead of mapping them, and it has no NumPy type for F8_E8M0 (the UE8M0
scale bytes of every V4.1 FP8/MXFP4 weight). The format is small enough to own:

    [u64 little-endian N][N bytes of JSON header][data bytes]
    header = {"__metadata__": {str: str}?, name: {"dtype", "shape", "data_offsets": [begin, end]}}

Offsets are relative to the start of the data section. Like the reference implementation, the
reader requires the tensors to tile the data section exactly (sorted by offset: no overlap, no
hole, nothing after the last tensor), so truncation and trailing garbage are both caught.

Arrays returned by the reader are read-only views onto one `mmap` of the file. E4M3 comes back as
`ml_dtypes.float8_e4m3fn`, E8M0 as raw `uint8` exponent bytes (0xFF is NaN), BF16 as
`ml_dtypes.bfloat16`. Every error names the file, and the tensor where there is one.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import ml_dtypes
import numpy as np

# safetensors dtype name -> numpy dtype. E8M0 scales stay raw bytes (uint8) throughout hopdec.
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(np.uint8),
}

# A header larger than this is corrupt, not big: 100 MB is the reference implementation's limit too.
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A safetensors file is malformed; the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """One header entry. `begin`/`end` are absolute file offsets of the tensor's bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _header_entry(path: Path, name: str, entry: object, data_start: int) -> TensorInfo:
    """Validate one header entry on its own (dtype known, shape sane, span matches)."""
    where = f"{path}: tensor '{name}'"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise SafetensorsError(f"{where}: header entry must have dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise SafetensorsError(f"{where}: unknown dtype {dtype!r} (known: {sorted(DTYPES)})")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SafetensorsError(f"{where}: shape must be a list of non-negative ints, got {shape}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
        raise SafetensorsError(f"{where}: data_offsets must be [begin, end], 0 <= begin <= end, "
                               f"got {offsets}")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != expected:
        raise SafetensorsError(f"{where}: {dtype}{shape} needs {expected} bytes but data_offsets "
                               f"{offsets} span {offsets[1] - offsets[0]}")
    return TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def read_header(path: Path, f: BinaryIO, file_bytes: int) -> tuple[dict[str, TensorInfo], dict]:
    """Read and validate the header of open file `f` against the file size (reads only the
    header); returns (tensors by name, __metadata__)."""
    if file_bytes < 8:
        raise SafetensorsError(f"{path}: {file_bytes} bytes, too short for a safetensors header")
    (header_bytes,) = struct.unpack("<Q", f.read(8))
    if header_bytes > min(MAX_HEADER_BYTES, file_bytes - 8):
        raise SafetensorsError(f"{path}: header length {header_bytes} is impossible for a file of "
                               f"{file_bytes} bytes (limit {MAX_HEADER_BYTES})")
    try:
        header = json.loads(f.read(header_bytes).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{path}: header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header must be a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{path}: __metadata__ must be an object of strings")
    data_start = 8 + header_bytes
    tensors = {name: _header_entry(path, name, e, data_start) for name, e in header.items()}
    # The tensors must tile [data_start, file end) exactly, in offset order.
    cursor, previous = data_start, "the header"
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin < cursor:
            raise SafetensorsError(f"{path}: tensor '{info.name}' overlaps {previous} "
                                   f"(starts at byte {info.begin}, previous ends at {cursor})")
        if info.begin > cursor:
            raise SafetensorsError(f"{path}: {info.begin - cursor} unindexed bytes before tensor "
                                   f"'{info.name}'")
        cursor, previous = info.end, f"tensor '{info.name}'"
    if cursor > file_bytes:
        raise SafetensorsError(f"{path}: truncated: {previous} ends at byte {cursor} but the file "
                               f"has {file_bytes} bytes")
    if cursor < file_bytes:
        raise SafetensorsError(f"{path}: {file_bytes - cursor} trailing bytes after {previous}")
    return tensors, metadata


class SafetensorsFile:
    """One validated, memory-mapped safetensors file. Use as a context manager or call close().

    `get(name)` returns a read-only zero-copy view. Views outlive close(): the mapping is released
    when the last view is garbage-collected (the file descriptor itself is closed at open).
    """

    def __init__(self, path: Path, tensors: dict[str, TensorInfo], metadata: dict,
                 mapping: mmap.mmap | None, file_bytes: int):
        self.path = path
        self.tensors = tensors
        self.metadata = metadata
        self.file_bytes = file_bytes
        self._mmap = mapping
        self._bytes = None if mapping is None else np.frombuffer(mapping, dtype=np.uint8)

    @classmethod
    def open(cls, path: str | os.PathLike) -> SafetensorsFile:
        path = Path(path)
        try:
            with open(path, "rb") as f:
                file_bytes = os.fstat(f.fileno()).st_size
                tensors, metadata = read_header(path, f, file_bytes)
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if file_bytes else None
        except OSError as exc:
            raise SafetensorsError(f"{path}: cannot read: {exc.strerror or exc}") from None
        return cls(path, tensors, metadata, mapping, file_bytes)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> np.ndarray:
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor '{name}'")
        if self._bytes is None:
            raise SafetensorsError(f"{self.path}: file is closed (reading '{name}')")
        raw = self._bytes[info.begin:info.end]
        return raw.view(DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        self._bytes = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # caller still holds views; the mapping dies with the last of them
            self._mmap = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dtype_name(array: np.ndarray) -> str:
    """The safetensors dtype of an array (uint8 is U8; pass E8M0 explicitly to the writer)."""
    for name, dt in DTYPES.items():
        if dt == array.dtype and name != "F8_E8M0":
            return name
    raise SafetensorsError(f"no safetensors dtype for numpy dtype {array.dtype}")


@dataclass(frozen=True)
class TensorToWrite:
    """What the writer must know up front: the header is written before any data."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def write_safetensors(path: str | os.PathLike, tensors: Iterable[TensorToWrite],
                      produce: Callable[[TensorToWrite], np.ndarray],
                      metadata: dict[str, str] | None = None) -> int:
    """Stream tensors into `path`, one `produce(t)` call at a time; returns the file size.

    Tensors are stored in the order given. The header is padded with spaces to 8 bytes so
    8-byte-aligned tensors stay aligned in the mapping. The file appears atomically: it is written
    as `path.partial` and renamed; on any error the partial file is removed.
    """
    path = Path(path)
    tensors = list(tensors)
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for t in tensors:
        if t.dtype not in DTYPES:
            raise SafetensorsError(f"{path}: tensor '{t.name}': unknown dtype {t.dtype!r}")
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for t in tensors:
                array = np.asarray(produce(t))
                if array.shape != t.shape or array.dtype != DTYPES[t.dtype]:
                    raise SafetensorsError(f"{path}: tensor '{t.name}': produced {array.dtype}"
                                           f"{list(array.shape)}, header says {t.dtype}"
                                           f"{list(t.shape)}")
                # uint8 view: the buffer protocol has no bf16/fp8 format codes
                f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return 8 + len(blob) + offset


def save_arrays(path: str | os.PathLike, arrays: dict[str, np.ndarray],
                dtypes: dict[str, str] | None = None) -> int:
    """Write a small dict of arrays (tests, tools). `dtypes` overrides, e.g. {'x.scale': 'F8_E8M0'}."""
    dtypes = dtypes or {}
    specs = [TensorToWrite(n, dtypes.get(n) or dtype_name(a), tuple(a.shape))
             for n, a in arrays.items()]
    return write_safetensors(path, specs, lambda t: arrays[t.name])
