"""A lazy safetensors reader: parse the header, map the file, hand out numpy views per tensor.

Written here rather than using the ``safetensors`` package because its numpy path cannot return bf16/fp8
arrays without a copy, and the plan needs shapes and sizes before anything is read.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import CheckpointError
from . import TensorInfo

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One ``.safetensors`` file: ``infos`` from the header, ``read(name)`` maps lazily."""

    def __init__(self, path: Path):
        self.path = path
        self._map: mmap.mmap | None = None
        self.data_start, header = self._read_header(path)
        self.infos: dict[str, TensorInfo] = {}
        self._offsets: dict[str, tuple[int, int]] = {}
        size = path.stat().st_size - self.data_start
        for name, meta in header.items():
            if name != "__metadata__":
                self._add(name, meta, size)

    @staticmethod
    def _read_header(path: Path) -> tuple[int, dict]:
        try:
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"{path}: truncated safetensors file (no header)")
                (n,) = struct.unpack("<Q", raw)
                if n > MAX_HEADER:
                    raise CheckpointError(f"{path}: corrupt safetensors header (length {n})")
                header = json.loads(f.read(n))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors file: {exc}") from exc
        except RecursionError:
            raise CheckpointError(f"{path}: corrupt safetensors header (JSON nested too deeply)") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
        return 8 + n, header

    def _add(self, name: str, meta: dict, size: int) -> None:
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: corrupt header entry for {name!r}") from exc
        if dtype not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize
        if end - begin != nbytes or not 0 <= begin <= end <= size:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} is corrupt or truncated "
                f"(offsets {begin}..{end}, expected {nbytes} bytes, file holds {size})"
            )
        self.infos[name] = TensorInfo(name, dtype, shape, nbytes)
        self._offsets[name] = (begin, end)

    def read(self, name: str) -> np.ndarray:
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        info = self.infos[name]
        begin, _ = self._offsets[name]
        arr = np.frombuffer(self._map, DTYPES[info.dtype], int(np.prod(info.shape)), self.data_start + begin)
        return arr.reshape(info.shape)
