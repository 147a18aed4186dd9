"""A minimal streaming reader/writer of the safetensors file format (no dependency).

Format: 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``
(padded with spaces to a multiple of 8), then the raw little-endian bytes of every
tensor, back to back. Because every shape and dtype is known up front, the header
can be written first and the tensors one at a time after it: a writer holds at most
one tensor, and a reader reads only the bytes of the tensor asked for.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPE_NAMES[getattr(torch, _name)] = _code
DTYPES = {code: dtype for dtype, code in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * torch.empty((), dtype=self.dtype).element_size()


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The little-endian bytes of ``tensor`` in row-major order."""
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise NotImplementedError("writing safetensors on a big-endian host is not supported")
    try:
        return flat.numpy().tobytes()
    except (RuntimeError, ImportError):  # torch built without numpy support
        return bytes(flat.tolist())


class SafetensorsWriter:
    """Write the header for ``specs``, then each tensor in order with ``write``."""

    def __init__(self, path: str, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> None:
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for spec in specs:
            if spec.dtype not in DTYPE_NAMES:
                raise TypeError(f"safetensors cannot store {spec.name!r} of dtype {spec.dtype}")
            header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._pending = list(specs)
        self._file: BinaryIO = open(path, "wb")
        self._file.write(struct.pack("<Q", len(text)))
        self._file.write(text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if not self._pending or self._pending[0].name != name:
            expected = self._pending[0].name if self._pending else "nothing more"
            raise ValueError(f"safetensors writer expected {expected!r} next, got {name!r}")
        spec = self._pending.pop(0)
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{name!r}: header says {spec.dtype} {spec.shape}, got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        self._file.write(tensor_bytes(tensor))

    def close(self) -> None:
        missing = [s.name for s in self._pending]
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if missing:
            raise ValueError(f"safetensors file closed before these tensors were written: {missing}")


def read_header(path: str) -> tuple[dict[str, dict], int]:
    """The tensor entries of a safetensors file and where its data starts."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path!r} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > os.path.getsize(path):
            raise ValueError(f"{path!r} is not a safetensors file (header length {length} exceeds the file)")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def read_tensor(path: str, entry: dict, data_start: int) -> torch.Tensor:
    """One tensor of a safetensors file, reading only its bytes."""
    begin, end = entry["data_offsets"]
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise TypeError(f"unsupported safetensors dtype {entry['dtype']!r}")
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        data = bytearray(f.read(end - begin))
    if not data:
        return torch.empty(entry["shape"], dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(entry["shape"])  # owns `data`
