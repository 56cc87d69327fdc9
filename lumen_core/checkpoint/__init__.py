"""Checkpoint readers: turn a path into a config dict, lazily readable tensors and tokenizer files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..errors import CheckpointError


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string: "F32", "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]
    nbytes: int


class Checkpoint(Protocol):
    format: str  # "hf", "gguf"
    path: Path
    config: dict  # HF-style config ("model_type" at least; GGUF: translated by the architecture)
    tensors: dict[str, TensorInfo]  # shape in numpy order (rows first); nbytes as stored

    def read(self, name: str) -> Any:
        """The tensor as stored, as a read-only numpy array (a view on the mapped file where possible).
        Block-quantized GGUF tensors come back as raw uint8 blocks, shape (rows, bytes per row)."""

    def read_f32(self, name: str) -> Any:
        """(Optional) the tensor dequantized to float32; the loader uses it for small tensors."""

    def load_tokenizer(self):
        """The checkpoint's ``lumen_core.tokenizer.Tokenizer``, or None when it has none."""

    def chat_template(self) -> str | dict[str, str] | None:
        """The chat template the checkpoint carries (None: none), read without building the tokenizer."""

    def preprocessor_config(self) -> dict | None:
        """(Optional) the checkpoint's image preprocessor config (``preprocessor_config.json``), None when absent."""


def open_checkpoint(path: str | Path, registry) -> Checkpoint:
    """Open ``path`` with the first registered checkpoint format that recognises it."""
    from ..plugins import import_object

    p = Path(path).expanduser()
    try:
        exists = p.exists()
    except OSError as exc:  # ENAMETOOLONG and the like: the system cannot even look the path up
        text = str(p)
        shown = text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"
        raise CheckpointError(f"model.path cannot be looked up ({exc.strerror or exc}): {shown}") from None
    if not exists:
        if p.suffix.lower() == ".gguf":
            raise CheckpointError(f"GGUF file not found: {p} (check model.path)")
        raise CheckpointError(f"checkpoint not found: {p} (model.path names an HF checkpoint directory or a "
                              ".gguf file)")
    for entry in registry.checkpoint_formats.values():
        if entry.extra["detect"](p):
            return import_object(entry.value)(p)
    names = ", ".join(sorted(registry.checkpoint_formats)) or "none"
    raise CheckpointError(
        f"{p} is not a checkpoint any installed reader understands (readers: {names}); "
        "expected an HF directory with config.json and *.safetensors"
    )
