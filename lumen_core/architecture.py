"""The architecture contract. Model plugins subclass ``Architecture``; the core never imports them.

A component is ``(block, layer)``: ``("input-layer", None)``, ``("layer", i)``, ``("experts", i)``,
``("output-layer", None)``. Placement binds each component to one backend device and store.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

Component = tuple[str, int | None]


def component_label(c: Component) -> str:
    block, layer = c
    if block == "layer":
        return f"layers.{layer}"
    if block == "experts":
        return f"layers.{layer}.experts"
    return block


@dataclass
class TensorLayout:
    """Which checkpoint tensors each component needs, and which ones the architecture skips on purpose."""

    needs: dict[Component, list[str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> reason (vision tower, MTP head...)


class Architecture(ABC):
    """A model family bound to one checkpoint's config."""

    model_type: str = ""
    num_layers: int = 0
    vocab_size: int = 0
    max_context: int = 0

    def __init__(self, config: dict):
        self.config = config

    @classmethod
    def from_checkpoint(cls, ckpt) -> Architecture:
        """Build from an opened checkpoint. GGUF files carry llama.cpp metadata and tensor names: the
        architecture translates them (``config_from_gguf``, ``gguf_tensor_map``) and renames the tensors."""
        if getattr(ckpt, "format", "hf") != "gguf":
            return cls(ckpt.config)
        config = cls.config_from_gguf(ckpt.metadata)
        ckpt.rename(cls.gguf_tensor_map(config, list(ckpt.tensors)))
        return cls(config)

    @classmethod
    def config_from_gguf(cls, metadata: dict) -> dict:
        """An HF-style config dict from GGUF metadata (``{key: value}``, arrays as lists)."""
        raise NotImplementedError(f"{cls.__name__} cannot read GGUF checkpoints")

    @classmethod
    def gguf_tensor_map(cls, config: dict, names: list[str]) -> dict[str, tuple[str, Any]]:
        """``{gguf name: (HF name, transform or None)}``; transform(f32 array) -> array, applied on read
        (e.g. llama.cpp stores Gemma norm weights as 1 + w)."""
        raise NotImplementedError(f"{cls.__name__} cannot read GGUF checkpoints")

    @abstractmethod
    def layout(self, names: Iterable[str]) -> TensorLayout:
        """Map the checkpoint's tensor names to components (a tied tensor may serve two)."""

    @abstractmethod
    def is_matrix(self, name: str) -> bool:
        """True for weights consumed by linear/embedding ops (stored in a weight format)."""

    @abstractmethod
    def components(self) -> list[Component]:
        """Every component of this model, in execution order."""

    def cache_bytes(self, layer: int, context: int, kv_bytes: float) -> int:
        """Bytes of cache (KV or recurrent state) that ``layer`` needs for ``context`` tokens."""
        return 0

    def required_ops(self, component: Component) -> set[str]:
        """Ops the component calls; the plan refuses a backend that lacks one."""
        return set()

    @abstractmethod
    def build(self, weights: dict[Component, dict[str, Any]], backends: dict[Component, Any], kv: dict):
        """Return a ``Model`` running on the given per-component backends."""


class Model(ABC):
    """A loaded model: ``forward`` over a cache that holds every layer's state."""

    vocab_size: int = 0

    @abstractmethod
    def new_cache(self, context_size: int) -> Any:
        """A preallocated cache for ``context_size`` tokens (``.pos`` is the number of tokens seen)."""

    @abstractmethod
    def forward(self, ids: list[int], cache: Any, all_logits: bool = False, host: bool = True) -> Any:
        """Run ``ids`` after ``cache.pos`` tokens; return logits (T or 1, vocab) as f32: a numpy array, or with
        ``host=False`` the output layer's backend array (a decode runner samples it on the device)."""

    def input_id(self, token: int) -> int:
        """The id the embedding reads for ``token`` (a model may remap some, e.g. media placeholders). A decode
        runner that feeds ids from device memory writes this value there."""
        return token
