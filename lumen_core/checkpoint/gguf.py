"""A lazy GGUF reader: parse the header ourselves, map the file, hand out numpy views per tensor.

Written here rather than using ``gguf.GGUFReader`` because that reader builds a numpy view for every element
of every metadata array (a 262k-token vocabulary takes ~10 s); this one walks the header with ``struct`` on an
``mmap`` and decodes big string arrays only when they are first read. Block-quantized tensors stay raw bytes
(rows, bytes per row); ``read_f32`` dequantizes with ``gguf.quants.dequantize``, which is what transformers uses.

Layout (GGUF v2/v3, little-endian): ``b"GGUF"``, u32 version, u64 tensor count, u64 KV count, the KVs
(string key, u32 value type, value), the tensor infos (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type,
u64 offset), padding to ``general.alignment`` (32), then the tensor data.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from ..errors import CheckpointError
from . import TensorInfo

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# ggml type id -> (name, elements per block, bytes per block): the types a GGUF can store tensors in and
# `gguf.quants.dequantize` (0.19) can expand.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1),
    25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}
TYPE_IDS = {name: i for i, (name, _, _) in GGML_TYPES.items()}
# Types stored as plain values: read() gives a numpy array of this dtype.
PLAIN_DTYPES = {
    "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
    "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
}

# The f16 scale fields of each block type, as ``gguf.quants`` decodes them: {type: ((byte offset in the block,
# field name), ...)}. IQ1_M spreads its scale over four bytes and MXFP4's e8m0 exponent cannot encode a NaN: not
# listed. One corrupt scale makes a whole block NaN, and with it every logit.
BLOCK_SCALES: dict[str, tuple[tuple[int, str], ...]] = {
    "Q4_0": ((0, "d"),), "Q4_1": ((0, "d"), (2, "m")), "Q5_0": ((0, "d"),), "Q5_1": ((0, "d"), (2, "m")),
    "Q8_0": ((0, "d"),), "Q2_K": ((80, "d"), (82, "dmin")), "Q3_K": ((108, "d"),),
    "Q4_K": ((0, "d"), (2, "dmin")), "Q5_K": ((0, "d"), (2, "dmin")), "Q6_K": ((208, "d"),),
    "IQ2_XXS": ((0, "d"),), "IQ2_XS": ((0, "d"),), "IQ3_XXS": ((0, "d"),), "IQ1_S": ((0, "d"),),
    "IQ4_NL": ((0, "d"),), "IQ3_S": ((0, "d"),), "IQ2_S": ((0, "d"),), "IQ4_XS": ((0, "d"),),
    "TQ1_0": ((52, "d"),), "TQ2_0": ((64, "d"),),
}

# metadata value types: id -> struct format of a scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALAR_STRUCTS = {t: struct.Struct("<" + f) for t, f in _SCALARS.items()}
_STRING, _ARRAY = 8, 9
_U32, _U64, _U32U64 = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<IQ")
# Arrays of strings longer than this stay undecoded until first read (the vocabulary, the merges).
LAZY_STRINGS = 64
MAX_ARRAY_DEPTH = 16  # nested metadata arrays: allowed by the spec, never seen in practice beyond 2


class _Entry(NamedTuple):
    gguf_name: str
    type_name: str  # GGML type as stored
    start: int  # absolute offset in the file
    nbytes: int  # as stored
    shape: tuple[int, ...]  # logical, numpy order
    transform: Callable | None


class GGUFStrings(Sequence):
    """A metadata array of strings, decoded on first access (all at once: the tokenizer wants them all)."""

    def __init__(self, buf, starts: np.ndarray, lengths: np.ndarray, key: str, path: Path):
        self._buf, self._starts, self._lengths = buf, starts, lengths
        self._key, self._path = key, path
        self._items: list[str] | None = None

    def _decoded(self) -> list[str]:
        if self._items is None:
            buf = self._buf
            try:
                self._items = [
                    buf[s:s + n].decode("utf-8")
                    for s, n in zip(self._starts.tolist(), self._lengths.tolist(), strict=True)
                ]
            except UnicodeDecodeError as exc:
                raise CheckpointError(f"{self._path}: metadata {self._key!r} holds a string that is not UTF-8") from exc
            self._buf = None
        return self._items

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index):
        return self._decoded()[index]

    def __iter__(self):
        return iter(self._decoded())

    def __eq__(self, other) -> bool:
        if isinstance(other, (GGUFStrings, list, tuple)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"GGUFStrings({len(self)} strings)"


class _Header:
    """One pass over the header of a mapped GGUF file, with a bounds check on every read."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.size, self.pos = buf, path, len(buf), 0

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: truncated or corrupt GGUF file ({what} at byte {self.pos}, "
                               f"file is {self.size} bytes)")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(what)

    def unpack(self, st: struct.Struct, what: str):
        self.need(st.size, what)
        out = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return out

    def string(self, what: str) -> str:
        (n,) = self.unpack(_U64, what)
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{self.path}: {what} is not valid UTF-8") from exc

    def value(self, vtype: int, key: str):
        if vtype in _SCALARS:
            return self.unpack(_SCALAR_STRUCTS[vtype], f"value of {key!r}")[0]
        if vtype == _STRING:
            return self.string(f"value of {key!r}")
        if vtype == _ARRAY:
            etype, count = self.unpack(_U32U64, f"array header of {key!r}")
            return self.array(etype, count, key)
        raise CheckpointError(f"{self.path}: metadata {key!r} has unknown value type {vtype}")

    def array(self, etype: int, count: int, key: str, depth: int = 1):
        if etype in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[etype])
            self.need(count * dtype.itemsize, f"array {key!r} ({count} values)")
            values = np.frombuffer(self.buf, dtype, count, self.pos)
            self.pos += count * dtype.itemsize
            return values.tolist()
        if etype == _STRING:
            self.need(count * 8, f"array {key!r} ({count} strings)")
            if count <= LAZY_STRINGS:
                return [self.string(f"element of {key!r}") for _ in range(count)]
            return self.string_array(count, key)
        if etype == _ARRAY:  # nested arrays: allowed by the spec, never seen in practice
            if depth >= MAX_ARRAY_DEPTH:
                raise CheckpointError(f"{self.path}: metadata {key!r} nests arrays more than {MAX_ARRAY_DEPTH} deep "
                                      "(corrupt GGUF file)")
            out = []
            for _ in range(count):
                sub, n = self.unpack(_U32U64, f"array header in {key!r}")
                out.append(self.array(sub, n, key, depth + 1))
            return out
        raise CheckpointError(f"{self.path}: metadata {key!r} is an array of unknown type {etype}")

    def string_array(self, count: int, key: str) -> GGUFStrings:
        # Walk the length prefixes only; the strings are decoded when first read.
        starts = np.empty(count, np.int64)
        lengths = np.empty(count, np.int64)
        unpack, buf, pos, size = _U64.unpack_from, self.buf, self.pos, self.size
        try:
            for i in range(count):
                (n,) = unpack(buf, pos)
                starts[i] = pos + 8
                lengths[i] = n
                pos += 8 + n
        except struct.error:
            self.pos = pos
            raise self.fail(f"array {key!r}") from None
        if pos > size:
            self.pos = size
            raise self.fail(f"array {key!r}")
        self.pos = pos
        return GGUFStrings(buf, starts, lengths, key, self.path)


class GGUFCheckpoint:
    """A ``.gguf`` file: llama.cpp metadata and tensor names until an architecture renames them."""

    format = "gguf"

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.path.stat().st_size else b""
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open GGUF file: {exc}") from exc
        h = _Header(self._map, self.path)
        magic = bytes(self._map[:4])
        if magic != MAGIC:
            if len(magic) < 4:
                raise CheckpointError(f"{self.path}: truncated GGUF file ({len(self._map)} bytes, no header)")
            raise CheckpointError(f"{self.path} is not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
        h.pos = 4
        (version,) = h.unpack(_U32, "version")
        if version not in VERSIONS:
            if version & 0xFFFF == 0 and (version >> 24) in VERSIONS:
                raise CheckpointError(f"{self.path}: big-endian GGUF files are not supported")
            raise CheckpointError(f"{self.path}: GGUF version {version} is not supported (supported: 2, 3)")
        self.version = version
        n_tensors, n_kv = h.unpack(struct.Struct("<QQ"), "tensor and metadata counts")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = h.string("metadata key")
            (vtype,) = h.unpack(_U32, f"type of {key!r}")
            self.metadata[key] = h.value(vtype, key)
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path}: GGUF metadata has no general.architecture")
        self.config = {"model_type": arch}
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment % 8:
            raise CheckpointError(f"{self.path}: invalid general.alignment {alignment!r}")
        infos = [self._tensor_info(h) for _ in range(n_tensors)]
        self.data_start = -(-h.pos // alignment) * alignment
        data_size = len(self._map) - self.data_start
        self.tensors: dict[str, TensorInfo] = {}
        self._entries: dict[str, _Entry] = {}  # keyed like self.tensors
        for name, shape, type_name, offset, nbytes in infos:
            if name in self.tensors:
                raise CheckpointError(f"{self.path}: tensor {name!r} appears twice")
            if offset + nbytes > data_size:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} ({type_name}, {nbytes} bytes at data offset {offset}) ends past "
                    f"the end of the file ({data_size} bytes of tensor data): the file is truncated"
                )
            self.tensors[name] = TensorInfo(name, type_name, shape, nbytes)
            self._entries[name] = _Entry(name, type_name, self.data_start + offset, nbytes, shape, None)

    def _tensor_info(self, h: _Header):
        name = h.string("tensor name")
        (n_dims,) = h.unpack(_U32, f"dimensions of {name!r}")
        if not 1 <= n_dims <= 8:
            raise CheckpointError(f"{self.path}: tensor {name!r} has {n_dims} dimensions")
        ne = h.unpack(struct.Struct(f"<{n_dims}Q"), f"shape of {name!r}")
        type_id, offset = h.unpack(_U32U64, f"type of {name!r}")
        if type_id not in GGML_TYPES:
            supported = ", ".join(t for t, _, _ in GGML_TYPES.values())
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has GGML type {type_id}, which Lumen cannot read "
                f"(supported: {supported})"
            )
        type_name, block, type_size = GGML_TYPES[type_id]
        if ne[0] % block:
            raise CheckpointError(f"{self.path}: tensor {name!r} ({type_name}) has rows of {ne[0]} values, "
                                  f"not a multiple of the block size {block}")
        n = 1
        for d in ne:
            n *= d
        return name, tuple(reversed(ne)), type_name, offset, n // block * type_size

    # --- tensors ---------------------------------------------------------------------------------------------

    def _raw(self, name: str) -> tuple[np.ndarray, _Entry]:
        entry = self._entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        if entry.type_name in PLAIN_DTYPES:
            dtype = np.dtype(PLAIN_DTYPES[entry.type_name])
            arr = np.frombuffer(self._map, dtype, entry.nbytes // dtype.itemsize, entry.start)
            return arr.reshape(entry.shape), entry
        _, block, type_size = GGML_TYPES[TYPE_IDS[entry.type_name]]
        arr = np.frombuffer(self._map, np.uint8, entry.nbytes, entry.start)
        return arr.reshape(*entry.shape[:-1], entry.shape[-1] // block * type_size), entry

    def read(self, name: str) -> np.ndarray:
        """F32/F16/BF16 (and the integer types): a read-only view of that dtype shaped ``shape``; block-quantized
        types: raw uint8 blocks, shape (rows, bytes per row). A renamed tensor with a transform comes back
        transformed (as f32); a block-quantized one with a transform can only be read through ``read_f32``."""
        arr, entry = self._raw(name)
        if entry.transform is None:
            return arr
        if entry.type_name not in PLAIN_DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} is {entry.type_name} with a transform "
                f"({_describe(entry.transform)}); a transform needs float values: read it with read_f32"
            )
        return _apply(entry.transform, arr.astype(np.float32), name, self.path)

    def read_f32(self, name: str) -> np.ndarray:
        """The tensor as float32, dequantized exactly as ``gguf.quants.dequantize`` (and transformers) does,
        with the rename's transform applied. F32 without a transform is a read-only view."""
        arr, entry = self._raw(name)
        if entry.type_name == "F32":
            out = arr
        elif entry.type_name in PLAIN_DTYPES:
            out = arr.astype(np.float32)
        else:
            from gguf.quants import GGMLQuantizationType, dequantize

            out = dequantize(arr, GGMLQuantizationType(TYPE_IDS[entry.type_name]))
        return out if entry.transform is None else _apply(entry.transform, out, name, self.path)

    def check_scales(self, name: str) -> None:
        """Refuse a block-quantized tensor with a NaN or infinite block scale (``BLOCK_SCALES``): a strided f16 view
        of one field per block, ~15 ms for every block of the 253 MB Gemma 3 270M file. Plain types: nothing."""
        entry = self._entries.get(name)
        if entry is None or entry.type_name not in BLOCK_SCALES:
            return
        _, block, type_size = GGML_TYPES[TYPE_IDS[entry.type_name]]
        n = entry.nbytes // type_size
        for offset, field in BLOCK_SCALES[entry.type_name]:
            scales = np.ndarray((n,), np.float16, self._map, entry.start + offset, (type_size,))
            ok = np.isfinite(scales)
            if ok.all():
                continue
            i = int(np.argmin(ok))
            row = i // max(entry.shape[-1] // block, 1)
            label = repr(name) if name == entry.gguf_name else f"{name!r} (GGUF {entry.gguf_name!r})"
            raise CheckpointError(
                f"{self.path}: tensor {label} ({entry.type_name}) has a non-finite block scale: {field} = "
                f"{scales[i]} in block {i} (row {row}, byte {entry.start + i * type_size + offset} of the file); "
                f"{int(np.count_nonzero(~ok))} block(s) are affected: the checkpoint is corrupt (damaged on disk or "
                "in transfer): download it again"
            )

    def rename(self, mapping: dict[str, tuple | list[tuple[str, Callable | None]]]) -> None:
        """Key the tensors by ``mapping[gguf name][0]`` and apply ``mapping[gguf name][1]`` (if not None) on
        read; an optional third item reshapes it (same values, same last axis). A list value splits a stacked
        tensor along its first axis (llama.cpp's ``ffn_*_exps``: one matrix per routed expert): item ``e`` names
        slice ``e`` (its bytes, no copy; the list holds one item per slice).
        Tensors missing from the mapping keep their current names (the loader reports them as unused)."""
        tensors: dict[str, TensorInfo] = {}
        entries: dict[str, _Entry] = {}
        for name, info in self.tensors.items():
            entry = self._entries[name]
            target = mapping.get(entry.gguf_name, (name, entry.transform))
            for new_name, transform, part in self._parts(name, entry, target):
                if new_name in tensors:
                    raise CheckpointError(f"{self.path}: two tensors renamed to {new_name!r}")
                dtype, nbytes = info.dtype, part.nbytes
                if transform is not None and entry.type_name in PLAIN_DTYPES:
                    # read() hands out the transformed values as f32: say so
                    dtype, nbytes = "F32", int(np.prod(part.shape)) * 4
                tensors[new_name] = TensorInfo(new_name, dtype, part.shape, nbytes)
                entries[new_name] = part._replace(transform=transform)
        self.tensors, self._entries = tensors, entries

    def _parts(self, name: str, entry: _Entry, target) -> list[tuple[str, Callable | None, _Entry]]:
        if not isinstance(target, list):
            if len(target) > 2 and target[2] is not None:  # (name, transform, shape): a reshape, no copy
                return [(target[0], target[1], self._reshaped(name, entry, tuple(target[2])))]
            return [(target[0], target[1], entry)]
        count = entry.shape[0] if len(entry.shape) >= 2 else 0
        if len(target) != count:
            raise CheckpointError(f"{self.path}: tensor {name!r} of shape {entry.shape} cannot be split into "
                                  f"{len(target)} slices along its first axis")
        step = entry.nbytes // count
        return [(new_name, transform, entry._replace(start=entry.start + e * step, nbytes=step,
                                                     shape=entry.shape[1:]))
                for e, (new_name, transform) in enumerate(target)]

    def _reshaped(self, name: str, entry: _Entry, shape: tuple[int, ...]) -> _Entry:
        """The entry under another shape of as many values and the same rows (llama.cpp drops unit axes: its
        quantizer writes a (1, n) matrix as (n,), its converter squeezes Qwen's (C, 1, K) conv kernel). A shape
        that does not fit leaves the stored one: the architecture's shape check then names the metadata key."""
        if int(np.prod(shape)) != int(np.prod(entry.shape)) or shape[-1:] != entry.shape[-1:]:
            return entry
        return entry._replace(shape=shape)

    def gguf_name(self, name: str) -> str:
        """The GGUF name of a (possibly renamed) tensor."""
        return self._entries[name].gguf_name

    def ggml_type(self, name: str) -> str:
        """The GGML type the tensor is stored in ("Q4_K", "F32", ...), whatever ``tensors[name].dtype`` says."""
        return self._entries[name].type_name

    # --- tokenizer -------------------------------------------------------------------------------------------

    def load_tokenizer(self):
        """A ``lumen_core.tokenizer.Tokenizer`` rebuilt from the ``tokenizer.*`` metadata (None without one)."""
        if "tokenizer.ggml.model" not in self.metadata:
            return None
        from ..gguf_tokenizer import tokenizer_from_metadata

        return tokenizer_from_metadata(self.metadata, self.path)

    def chat_template(self):
        from ..gguf_tokenizer import chat_template_from_metadata

        return chat_template_from_metadata(self.metadata)


def _apply(transform: Callable, arr: np.ndarray, name: str, path: Path) -> np.ndarray:
    out = np.asarray(transform(arr), dtype=np.float32)
    if out.shape != arr.shape:
        raise CheckpointError(f"{path}: the transform of {name!r} changed its shape {arr.shape} -> {out.shape}")
    return out


def _describe(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def open_gguf(path: Path) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)
