"""Reading and writing the safetensors format with NumPy memory maps.

The format is: 8-byte little-endian header length N, N bytes of JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then the raw
tensor bytes. Reading through `np.memmap` makes a slice read only the bytes it needs, which lets
each device shard be loaded without materialising the whole tensor; bfloat16 comes from ml_dtypes.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsError(ValueError):
    """A safetensors file is missing, truncated or malformed."""


def read_header(path: str) -> tuple[dict, int]:
    """Returns (tensor table, byte offset of the data section) of one safetensors file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise SafetensorsError(f"{path}: header length {n} exceeds file size {size}")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise SafetensorsError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if 8 + n + end > size:
            raise SafetensorsError(f"{path}: tensor {name!r} extends past the end of the file (truncated?)")
    return header, 8 + n


class SafetensorsReader:
    """Lazy, memory-mapped access to the tensors of one or more safetensors files."""

    def __init__(self, files: Iterable[str]):
        self._where: dict[str, tuple[str, dict, int]] = {}
        self._maps: dict[str, np.memmap] = {}
        for path in files:
            header, offset = read_header(path)
            for name, info in header.items():
                self._where[name] = (path, info, offset)

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def get(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of tensor `name` (nothing is read until it is sliced)."""
        path, info, offset = self._where[name]
        if info["dtype"] not in _DTYPES:
            raise SafetensorsError(f"tensor {name!r} has unsupported dtype {info['dtype']}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        buf = self._maps[path][offset + begin: offset + end]
        return buf.view(dtype).reshape(info["shape"])


def write_file(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
    """Writes `tensors` (name -> array) as one safetensors file, atomically (temp file + rename)."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise SafetensorsError(f"tensor {name!r}: dtype {arr.dtype} cannot be stored")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, path)
