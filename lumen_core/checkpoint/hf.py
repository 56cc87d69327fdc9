"""Hugging Face checkpoint directories: config.json + model.safetensors (or shards with an index)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError
from . import TensorInfo
from .safetensors import SafetensorsFile


def detect(path: Path) -> bool:
    return path.is_dir()


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"missing file: {path}") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"corrupt JSON in {path}: {exc}") from exc
    except RecursionError:  # json recurses once per level of nesting
        raise CheckpointError(f"corrupt JSON in {path}: arrays or objects nested too deeply to read") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"corrupt JSON in {path}: expected an object")
    return data


class HFCheckpoint:
    """An HF directory. Tensors are read lazily, one at a time, from memory-mapped files."""

    format = "hf"

    def __init__(self, path: Path):
        self.path = path
        if not (path / "config.json").exists():
            raise CheckpointError(
                f"{path} has no config.json: model.path must be a Hugging Face checkpoint directory"
            )
        self.config = read_json(path / "config.json")
        self._files = [SafetensorsFile(p) for p in self._shard_paths()]
        self.tensors: dict[str, TensorInfo] = {}
        self._owner: dict[str, SafetensorsFile] = {}
        for f in self._files:
            for name, info in f.infos.items():
                self.tensors[name] = info
                self._owner[name] = f

    def _shard_paths(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no weight_map")
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not (self.path / s).exists()]
            if missing:
                raise CheckpointError(f"{self.path}: shard(s) named in the index are missing: {missing}")
            return [self.path / s for s in shards]
        single = self.path / "model.safetensors"
        if single.exists():
            return [single]
        found = sorted(self.path.glob("*.safetensors"))
        if found:
            return found
        raise CheckpointError(
            f"{self.path} has no model.safetensors (nor an index of shards); "
            "only safetensors checkpoints are supported (convert .bin files with transformers)"
        )

    def read(self, name: str):
        if name not in self._owner:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        return self._owner[name].read(name)

    def preprocessor_config(self) -> dict | None:
        path = self.path / "preprocessor_config.json"
        return read_json(path) if path.exists() else None

    def tokenizer_dir(self) -> Path | None:
        return self.path if (self.path / "tokenizer.json").exists() else None

    def load_tokenizer(self):
        from ..tokenizer import Tokenizer

        return Tokenizer.from_dir(self.path) if self.tokenizer_dir() else None

    def chat_template(self):
        from ..tokenizer import read_chat_template

        return read_chat_template(self.path)


def open_hf(path: Path) -> HFCheckpoint:
    return HFCheckpoint(path)
