"""A fast reader for the GGUF container: metadata, tensor directory, memory-mapped tensor bytes.

Format (little-endian, versions 2 and 3, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count   x  (string key, u32 value_type, value)
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (32 by default), then the data section;
    a tensor's bytes start at data_start + offset.

A string is u64 length + UTF-8 bytes; an array is u32 element type + u64 count + elements.
`dims` are in ggml order (fastest-varying first), so the numpy shape is `dims` reversed: a
linear weight with ggml dims [in, out] is a numpy [out, in] matrix, which is the Hugging Face
layout. Quantized rows are stored as blocks of `GGML_QUANT_SIZES[type]` (elements, bytes).

Why not `gguf.GGUFReader`: it builds several numpy views for every element of every array, which
takes 3-4 s for the 100k-string vocabulary of a small model. Here a string array is read with
`struct` in ~0.1 s and tensor bytes are sliced out of one read-only memory map only when
asked for (a plain ndarray over `mmap`, not `np.memmap`, whose subclass would follow every
intermediate array of the dequantizer and cost ~0.5 s per model).

FLOAT32 scalars are returned as the shortest decimal that rounds to the same float32 (so a
stored `1e-5` reads back as `1e-05`, not `9.999999747378752e-06`).

This is the one GGUF reader: the weight loader (weights/gguf.py) reads tensors through it, and the
tokenizer (tokenizer/gguf_vocab.py) reads only the metadata (`with_tensors=False`: the header stops
before the tensor directory). The metadata path imports neither torch nor the `gguf` package
(~0.9 s to import), so the router, which loads the tokenizer, stays torch-free and starts fast;
the tensor directory needs `gguf`'s quantization tables and imports them when it is read.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

from splitserve.platform.errors import ConfigError, UnsupportedModelError

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_U64 = struct.Struct("<Q")


class GGUFValueType(IntEnum):
    """The metadata value types of the GGUF format (the same numbers as gguf-py's enum)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory. `shape` is the numpy shape (ggml dims reversed)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType | int  # int when this gguf package does not know the type
    offset: int  # absolute byte offset in the file
    num_bytes: int


class GGUFFile:
    """Parses the header on construction; tensor bytes stay on disk until `raw(name)`.
    `with_tensors=False` reads the metadata alone (`tensors` stays empty).

    Owns one read-only memory map of the file; the arrays `raw` returns are views of it, valid
    as long as this object (or the array) lives.
    """

    def __init__(self, path: str, *, with_tensors: bool = True) -> None:
        self.path = path
        self._data = _map_file(path)
        self._buf = memoryview(self._data)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._pos = 0
        tensor_count = self._parse_metadata()
        if with_tensors:
            self._parse_tensors(tensor_count)

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name` as uint8 of shape (*numpy_shape[:-1], bytes_per_row)."""
        info = self.tensors[name]
        flat = self._data[info.offset : info.offset + info.num_bytes]
        rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
        return flat.reshape(*info.shape[:-1], info.num_bytes // rows)

    # -- parsing -------------------------------------------------------------------------

    def _parse_metadata(self) -> int:
        """Reads the header and the metadata; returns the number of tensors in the directory."""
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise UnsupportedModelError(
                f"{self.path} is not a GGUF file (magic {bytes(self._buf[:4])!r}, expected b'GGUF')"
            )
        self._pos = 4
        version = self._read("<I")
        if version not in SUPPORTED_VERSIONS:
            raise UnsupportedModelError(
                f"{self.path}: GGUF version {version} is not supported (big-endian or too old); "
                f"allowed versions: {SUPPORTED_VERSIONS}"
            )
        tensor_count, kv_count = self._read("<Q"), self._read("<Q")
        try:
            for _ in range(kv_count):
                key = self._read_str()
                self.metadata[key] = self._read_value(GGUFValueType(self._read("<I")))
        except (struct.error, ValueError) as exc:  # ValueError: an unknown value type
            raise UnsupportedModelError(
                f"{self.path}: corrupt GGUF metadata near byte {self._pos} ({exc!r}); "
                "re-download or re-convert the file"
            ) from exc
        return tensor_count

    def _parse_tensors(self, tensor_count: int) -> None:
        directory = [self._read_tensor_entry() for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        for name, shape, tensor_type, offset in directory:
            num_bytes = _num_bytes(shape, tensor_type)
            start = data_start + offset
            if start + num_bytes > len(self._data):
                raise ConfigError(f"{self.path}: tensor {name} runs past the end of the file (truncated download?)")
            self.tensors[name] = TensorInfo(name, shape, tensor_type, start, num_bytes)

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _read_str(self) -> str:
        length = self._read("<Q")
        text = bytes(self._buf[self._pos : self._pos + length]).decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _read_value(self, value_type: GGUFValueType) -> Any:
        if value_type == GGUFValueType.STRING:
            return self._read_str()
        if value_type == GGUFValueType.ARRAY:
            return self._read_array()
        value = self._read(_SCALAR_FORMATS[value_type])
        if value_type == GGUFValueType.FLOAT32:
            return float(str(np.float32(value)))
        return value

    def _read_array(self) -> list:
        element_type = GGUFValueType(self._read("<I"))
        count = self._read("<Q")
        if element_type == GGUFValueType.STRING:
            return self._read_strings(count)
        if element_type == GGUFValueType.ARRAY:
            return [self._read_value(element_type) for _ in range(count)]
        dtype = np.dtype(_SCALAR_FORMATS[element_type])
        values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
        self._pos += count * dtype.itemsize
        return values.tolist()

    def _read_strings(self, count: int) -> list[str]:
        """`count` length-prefixed strings in one loop: a vocabulary array (Gemma's 262k tokens) is
        most of a header, and reading it a string at a time through _read_value took ~1 s a parse."""
        buf, pos, out = self._buf, self._pos, []
        length_at = _U64.unpack_from
        for _ in range(count):
            (length,) = length_at(buf, pos)
            pos += 8
            out.append(str(buf[pos : pos + length], "utf-8", "replace"))
            pos += length
        self._pos = pos
        return out

    def _read_tensor_entry(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType | int, int]:
        from gguf import GGMLQuantizationType

        name = self._read_str()
        n_dims = self._read("<I")
        dims = [self._read("<Q") for _ in range(n_dims)]
        type_id = self._read("<I")
        offset = self._read("<Q")
        try:
            tensor_type: GGMLQuantizationType | int = GGMLQuantizationType(type_id)
        except ValueError:
            tensor_type = type_id
        return name, tuple(reversed(dims)), tensor_type, offset


def _map_file(path: str) -> np.ndarray:
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # ValueError: empty file
        raise ConfigError(f"cannot map GGUF file {path}: {exc}") from exc
    return np.frombuffer(mapped, dtype=np.uint8)


def _num_bytes(shape: tuple[int, ...], tensor_type: GGMLQuantizationType | int) -> int:
    from gguf import GGML_QUANT_SIZES

    if tensor_type not in GGML_QUANT_SIZES:
        return 0  # unknown type: rejected when the tensor is read, not when the file is opened
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    num_elements = int(np.prod(shape, dtype=np.int64))
    return num_elements // block_size * type_size
