"""The architecture contract. Model plugins subclass ``Architecture``; the core never imports them.

A component is ``(block, layer)``: ``("input-layer", None)``, ``("layer", i)``, ``("experts", i)``,
``("output-layer", None)``, and with ``use_mtp`` the multi-token-prediction head ``("mtp", None)``. Placement
binds each component to one backend device and store. The plan may split a layer's token mixer off as
``("attention", i)`` (``model.attention`` placing it apart: ``plan.split_mixers``); the loader folds its weights
back into the layer's, and ``backends[("attention", i)]`` says where it computes (the layer's own backend unless
``mixer_compute_apart``).
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError

Component = tuple[str, int | None]
# The layer index in a tensor name: HF ``model.layers.3.mlp...``, llama.cpp ``blk.3.ffn_up...`` (a GGUF tensor the
# architecture did not rename keeps its llama.cpp name).
LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")
_MISSING = object()


class ConfigValueError(CheckpointError):
    """A config (or GGUF metadata) value of the wrong type, or one no model can have. ``key`` names it; the
    architecture sees only a dict, so ``Architecture.from_checkpoint`` puts the file in front."""

    def __init__(self, key: str, problem: str, gguf: bool = False):
        self.key, self.problem, self.gguf = key, problem, gguf
        super().__init__(f"{key!r} {problem}")


def _shown(value) -> str:
    """A value as an error shows it: the string '4', 0, true, null, a list of 3 values."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, Mapping):
        return "an object"
    try:
        return f"a list of {len(value)} values"
    except TypeError:
        return f"a {type(value).__name__}"


def read_int(mapping: Mapping, key: str, minimum: int = 1, default=_MISSING, nullable: bool = False,
             label: str | None = None, gguf: bool = False) -> int | None:
    """``mapping[key]`` as an integer >= ``minimum`` (a bool, a string or a float is refused), ``default`` when the
    key is absent (no default: the key is required), None when it is null and ``nullable``. The error names ``label``
    (default: the key)."""
    label = label or key
    if key not in mapping:
        if default is _MISSING:
            raise ConfigValueError(label, "is missing", gguf)
        return default
    value = mapping[key]
    if value is None and nullable:
        return None
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigValueError(label, f"must be {what}; it is {_shown(value)}", gguf)
    if value < minimum:
        raise ConfigValueError(label, f"must be {what}; it is {value}", gguf)
    return value


def read_float(mapping: Mapping, key: str, default=_MISSING, nullable: bool = False, label: str | None = None,
               gguf: bool = False) -> float | None:
    """``mapping[key]`` as a positive, finite number (an integer is accepted; a bool or a string is not)."""
    label = label or key
    if key not in mapping:
        if default is _MISSING:
            raise ConfigValueError(label, "is missing", gguf)
        return default
    value = mapping[key]
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigValueError(label, f"must be a positive number; it is {_shown(value)}", gguf)
    if not (math.isfinite(value) and value > 0):
        raise ConfigValueError(label, f"must be a positive number; it is {value!r}", gguf)
    return float(value)


def gguf_int(metadata: Mapping, key: str, minimum: int = 1, default=_MISSING) -> int | None:
    """A GGUF metadata integer (``read_int``); the error names the GGUF key."""
    return read_int(metadata, key, minimum, default, gguf=True)


def gguf_float(metadata: Mapping, key: str, default=_MISSING) -> float | None:
    """A positive GGUF metadata number (``read_float``); the error names the GGUF key."""
    return read_float(metadata, key, default, gguf=True)


def component_label(c: Component) -> str:
    block, layer = c
    if block == "layer":
        return f"layers.{layer}"
    if block in ("experts", "attention"):
        return f"layers.{layer}.{block}"
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
    # Keys of the (text) config read as integers, with the smallest value each may take, and keys read as
    # positive numbers: ``check_config`` refuses a present key of the wrong type or an impossible value before the
    # architecture reads the config (an absent key takes the architecture's default). null is refused unless the
    # key is in ``nullable_keys``. A plugin extends these with its own keys.
    int_keys: dict[str, int] = {
        "vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1,
        "num_key_value_heads": 1, "head_dim": 1, "intermediate_size": 1, "max_position_embeddings": 1,
    }
    float_keys: tuple[str, ...] = ("rms_norm_eps",)
    nullable_keys: frozenset[str] = frozenset()
    # HF config key -> the GGUF metadata key it is read from, without the ``<architecture>.`` prefix (errors about
    # a GGUF checkpoint name the key in its file): e.g. {"num_hidden_layers": "block_count"}.
    gguf_keys: dict[str, str] = {}
    source: tuple[str, str | None] | None = None  # (file, GGUF architecture or None): set by ``from_checkpoint``

    def __init__(self, config: dict):
        self.config = config

    @classmethod
    def from_checkpoint(cls, ckpt) -> Architecture:
        """Build from an opened checkpoint. GGUF files carry llama.cpp metadata and tensor names: the
        architecture translates them (``config_from_gguf``, ``gguf_tensor_map``) and renames the tensors.

        Before any weight is read, the config is checked (``check_config``: types and values of its keys) and then
        held against the checkpoint's tensors (``check_checkpoint``: layer count, shapes). Every refusal is a
        ``CheckpointError`` that names the file and the key or tensor."""
        gguf = getattr(ckpt, "format", "hf") == "gguf"
        where = str(ckpt.path) if gguf else str(Path(ckpt.path) / "config.json")
        try:
            config = cls.config_from_gguf(ckpt.metadata) if gguf else ckpt.config
            cls.check_config(config)
            mapping = cls.gguf_tensor_map(config, list(ckpt.tensors)) if gguf else None
            arch = cls(config)
        except ConfigValueError as exc:
            key = exc.key
            if not gguf and isinstance(config.get("text_config"), Mapping) and "." not in key and key not in config:
                key = "text_config." + key  # a key the architecture read from the nested text config
            shown = f"{key!r}" if exc.gguf or not gguf else cls._gguf_key(key, ckpt.config.get("model_type", ""))
            what = "GGUF metadata" if gguf else "config"
            raise CheckpointError(f"{where}: {what} {shown} {exc.problem}") from None
        except CheckpointError as exc:  # the architecture's own refusal: it saw a dict, not the file
            raise CheckpointError(f"{where}: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError, AttributeError) as exc:
            raise CheckpointError(
                f"{where}: the {cls.model_type or cls.__name__} architecture cannot read this "
                f"{'metadata' if gguf else 'config'} ({type(exc).__name__}: {exc}): a key has a wrong type or an "
                "impossible value"
            ) from exc
        if mapping is not None:
            ckpt.rename(mapping)
        arch.source = (where, ckpt.config.get("model_type") if gguf else None)
        arch.check_checkpoint(ckpt)
        return arch

    # -- checks before any weight is read ---------------------------------------------------------------------
    @classmethod
    def check_config(cls, config: dict) -> None:
        """Types and values of the keys the architecture reads (``int_keys``, ``float_keys``), ``layer_types``
        (one string per layer), ``tie_word_embeddings`` (a bool), the RoPE bases and factors, and that the query
        heads split evenly over the KV heads. Raises ``ConfigValueError`` naming the key."""
        text, prefix = config, ""
        if config.get("text_config") is not None:
            text, prefix = config["text_config"], "text_config."
            if not isinstance(text, Mapping):
                raise ConfigValueError("text_config", f"must be an object; it is {_shown(text)}")
        for key, minimum in cls.int_keys.items():
            read_int(text, key, minimum, None, key in cls.nullable_keys, prefix + key)
        for key in cls.float_keys:
            read_float(text, key, None, key in cls.nullable_keys, prefix + key)
        for where, mapping in (("", config), (prefix, text)):
            value = mapping.get("tie_word_embeddings")
            if value is not None and not isinstance(value, bool):
                raise ConfigValueError(where + "tie_word_embeddings", f"must be true or false; it is {_shown(value)}")
        heads, kv = text.get("num_attention_heads"), text.get("num_key_value_heads")
        if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
            raise ConfigValueError(prefix + "num_key_value_heads",
                                   f"must divide num_attention_heads ({heads}) evenly; it is {kv}")
        layer_types, layers = text.get("layer_types"), text.get("num_hidden_layers")
        if layer_types is not None:
            if isinstance(layer_types, str) or not all(isinstance(t, str) for t in _iterable(layer_types)):
                raise ConfigValueError(prefix + "layer_types",
                                       f"must be a list of strings; it is {_shown(layer_types)}")
            if isinstance(layers, int) and len(layer_types) != layers:
                raise ConfigValueError(prefix + "layer_types", f"has {len(layer_types)} entries but num_hidden_layers "
                                       f"is {layers}: one layer type per layer")
        _check_rope(text, prefix)

    def check_checkpoint(self, ckpt) -> None:
        """The config against the checkpoint's tensors (names and shapes from the header; nothing is read): the
        layers the tensors hold must be the layers the config has, and each tensor in ``expected_shapes`` must
        have that shape."""
        from .tensors import logical_shape

        layout = self.layout(ckpt.tensors)
        tower = set(layout.needs.get(("vision", None), ()))  # a vision tower's own "layers.N" are not the model's
        first: dict[int, str] = {}  # layer index -> a tensor of it
        for name in ckpt.tensors:
            m = None if name in layout.skipped or name in tower else LAYER_INDEX.search(name)
            if m:
                first.setdefault(int(m.group(1)), name)
        have = max(first) + 1 if first else 0
        if first and have != self.num_layers:
            layers = "layer" if self.num_layers == 1 else "layers"
            raise CheckpointError(
                f"{self.describe('num_hidden_layers')} says the model has {self.num_layers} {layers}, but the "
                f"checkpoint's tensors are for {have} (layers 0-{have - 1}; e.g. {first[have - 1]!r}): the "
                f"{'metadata' if self._is_gguf() else 'config'} does not match the weights (the file is damaged or "
                "was converted wrongly)"
            )
        for name, (shape, keys) in self.expected_shapes().items():
            if name not in ckpt.tensors:
                continue  # check_tensors names what is missing
            got = tuple(logical_shape(ckpt, name))
            if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape, strict=False)):
                want = "(" + ", ".join("any" if w is None else str(w) for w in shape) + ")"
                raise CheckpointError(
                    f"{ckpt.path}: tensor {tensor_label(ckpt, name)} has shape {got}, but the "
                    f"{'metadata' if self._is_gguf() else 'config'} implies {want} from "
                    f"{self.describe_keys(keys)}: the config does not match the weights"
                )

    def expected_shapes(self) -> dict[str, tuple[tuple[int | None, ...], tuple[str, ...]]]:
        """``{tensor: (shape, config keys that set it)}`` for the tensors whose shape follows from the config (None:
        any size on that axis); ``check_checkpoint`` refuses a tensor of another shape. Called after ``layout``."""
        return {}

    def norm_weight_offset(self, name: str) -> float | None:
        """For a norm's weight: what its RMSNorm adds to it before multiplying (``rms_norm``'s offset: 1.0 where
        the checkpoint stores ``w - 1``); None for any other tensor. The loader refuses a norm whose every channel
        would multiply by 0 (a zeroed region of the file), which no trained model has."""
        return None

    # -- naming keys in errors --------------------------------------------------------------------------------
    def _is_gguf(self) -> bool:
        return bool(self.source and self.source[1])

    @classmethod
    def _gguf_key(cls, key: str, arch: str) -> str:
        """A config key as a GGUF file names it (quoted), or the config key, said to come from the metadata."""
        if key in cls.gguf_keys:
            return repr(f"{arch}.{cls.gguf_keys[key]}")
        return f"{key!r} (as translated from the GGUF metadata)"

    def describe(self, key: str) -> str:
        """Where a config key comes from, for an error: ``/m/config.json: 'hidden_size'``, ``/m/x.gguf: GGUF
        metadata 'gemma3.embedding_length'``, or ``'hidden_size'`` (an architecture built without a checkpoint)."""
        if self.source is None:
            return f"{key!r}"
        where, arch = self.source
        if arch:
            return f"{where}: GGUF metadata {self._gguf_key(key, arch)}"
        nested = "text_config." if self.config.get("text_config") is not None else ""
        return f"{where}: {nested + key!r}"

    def describe_keys(self, keys: Iterable[str]) -> str:
        text = self.config.get("text_config") or self.config
        parts = []
        for key in keys:
            value = text.get(key)
            name = key
            if self._is_gguf() and key in self.gguf_keys:
                name = f"{self.source[1]}.{self.gguf_keys[key]}"
            parts.append(f"{name} = {value}" if value is not None else name)
        return ", ".join(parts)

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

    # True where ``build`` computes a layer's token mixer on the backend of ``("attention", i)`` when the plan gives
    # it one (``model.attention.compute`` apart from the layer's device): the mixer's weights, its KV cache or
    # recurrent state and its rope tables live there, the layer hands it the normed hidden state through
    # ``Backend.call``. False: the plan refuses such a placement naming the architecture.
    mixer_compute_apart: bool = False

    def is_mixer(self, name: str) -> bool:
        """True for a layer tensor of its token mixer (full attention or Gated-DeltaNet), which
        ``model.attention`` may store apart from the rest of the layer. Default: HF's ``self_attn.`` and
        ``linear_attn.`` modules."""
        return ".self_attn." in name or ".linear_attn." in name

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

    # -- vision (issue 17) ------------------------------------------------------------------------------------
    # The core sets ``vision = True`` before ``layout`` when the config has a ``vision`` block: the layout then
    # puts the tower's tensors (and its projector / multimodal embedder) in the component ``("vision", None)``,
    # which ``build`` gets in ``weights`` and ``backends``; otherwise they stay skipped.
    vision: bool = False

    def has_vision(self) -> bool:
        """True when this checkpoint carries a vision tower this plugin can run."""
        return False

    def image_processor(self, preprocessor_config: dict | None):
        """The family's preprocessor for this checkpoint (``preprocessor_config`` is the checkpoint's
        ``preprocessor_config.json``, None when absent: the family's defaults), with
        ``preprocess(pil_image) -> lumen_core.images.ImageInput``; None when the family has no vision."""
        return None

    def image_text(self, text: str) -> str:
        """The prompt text with what the family's HF processor writes around each image placeholder before it
        tokenizes (Gemma 3: a blank line before and after the image); the engine calls it on a prompt with images,
        before encoding. Default: the text as it is."""
        return text

    def expand_image_tokens(self, ids: list[int], images: list) -> list[int]:
        """The prompt ``ids`` with each image's placeholder expanded into the image's tokens, as the family's
        HF processor does (e.g. Qwen: one ``<|image_pad|>`` becomes ``num_tokens`` of them); ``images`` are the
        ``ImageInput`` in prompt order. Raise ``InputError`` when placeholders and images differ in number."""
        raise NotImplementedError(f"{type(self).__name__} has no vision")

    # -- multi-token prediction (issue 20) --------------------------------------------------------------------
    # ``mtp_layers``: how many multi-token-prediction layers the checkpoint carries (its ``mtp.*`` tensors); a
    # model plugin sets it, 0 means none. The core sets ``use_mtp = True`` before ``layout`` when the config drafts
    # with the MTP head (``draft.mtp``): the layout then puts the head's tensors in the component ``("mtp", None)``
    # (placed with the output layer, whose lm_head it reads), which ``build`` gets in ``weights`` and ``backends``;
    # otherwise they stay skipped.
    mtp_layers: int = 0
    use_mtp: bool = False

    def mtp_cache_bytes(self, context: int, kv_bytes: float) -> int:
        """Bytes of cache (KV) the MTP head needs for ``context`` tokens; the plan counts them on the output
        layer's device when ``use_mtp``. Default 0 (no head)."""
        return 0

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

    def encode_images(self, images: list) -> list:
        """Each ``ImageInput`` through the vision tower (on the ``("vision", None)`` backend): per image a
        ``(num_tokens, hidden_size)`` array of embeddings in the text model's space, on that backend. Models
        without a tower raise."""
        raise NotImplementedError(f"{type(self).__name__} has no vision tower")

    # ``forward(ids, cache, all_logits, host, images=None)``: a model with vision takes ``images``, a list of
    # ``(ImageInput, embeddings)`` in prompt order, one per run of image tokens in ``ids`` (a forward holds each
    # image's tokens whole); the embeddings replace those tokens' embeddings, and the model's positions follow
    # the family's rules for image tokens (Qwen: 3D M-RoPE positions; later text continues from them, kept in
    # the cache).

    def input_id(self, token: int) -> int:
        """The id the embedding reads for ``token`` (a model may remap some, e.g. media placeholders). A decode
        runner that feeds ids from device memory writes this value there."""
        return token

    def forward_batch(self, segments: list[tuple[list[int], Any]]):
        """One step over several sequences: ``segments`` is ``[(ids, cache)]``, each a different sequence (a
        decode step's one token, or a chunk of a prompt), each run after its own ``cache.pos``. Returns the host
        f32 logits of each segment's last token, ``(len(segments), vocab)``, equal to what ``forward`` gives each
        alone (f32: to the last bits of a GEMM's reduction order). This default runs them one by one; a model
        overrides it to share the weight reads (one GEMM of every segment's rows: ``Segmented`` for the token
        mixers, whose state is per sequence)."""
        import numpy as np

        return np.concatenate([np.asarray(self.forward(list(ids), cache), dtype=np.float32)[-1:]
                               for ids, cache in segments])


@dataclass
class Segmented:
    """A token mixer's view of a batched forward: rows ``spans[i] = (first, end)`` of the call belong to sequence
    ``i``, whose state for this layer is ``states[i]`` and whose first row sits at cache position ``starts[i]``.
    Projections and norms run over all rows at once; the per-sequence part (attention over its KV cache, the
    recurrent step) runs per span through ``each``."""

    spans: list[tuple[int, int]]
    states: list
    starts: list[int]

    def each(self, ops, fn, *arrays):
        """``fn(*slices, state, start)`` per sequence (each array sliced to its rows), the results concatenated
        along the first axis (``ops.concat``)."""
        out = [fn(*(a[first:end] for a in arrays), state, start)
               for (first, end), state, start in zip(self.spans, self.states, self.starts, strict=True)]
        return out[0] if len(out) == 1 else ops.concat(out)


def tensor_label(ckpt, name: str) -> str:
    """A tensor's name for an error; a renamed GGUF tensor also by its name in the file."""
    gguf_name = getattr(ckpt, "gguf_name", None)
    original = gguf_name(name) if gguf_name is not None and name in ckpt.tensors else name
    return f"{name!r}" if original == name else f"{name!r} (GGUF {original!r})"


def _iterable(value) -> list:
    try:
        return list(value)
    except TypeError:
        return [None]  # not a list: refused by the caller


def _check_rope(text: Mapping, prefix: str) -> None:
    """RoPE bases (``rope_theta``) and factors must be positive numbers: at the top level (older configs), in
    ``rope_parameters``, ``rope_scaling``, or ``rope_parameters`` per layer type (Gemma)."""
    read_float(text, "rope_theta", None, True, prefix + "rope_theta")
    for block in ("rope_parameters", "rope_scaling"):
        params = text.get(block)
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise ConfigValueError(prefix + block, f"must be an object; it is {_shown(params)}")
        nested = {k: v for k, v in params.items() if isinstance(v, Mapping)}
        for where, p in [(prefix + block, params)] + [(f"{prefix}{block}.{k}", v) for k, v in nested.items()]:
            for key in ("rope_theta", "factor"):
                read_float(p, key, None, True, f"{where}.{key}")
            frac = p.get("partial_rotary_factor")
            if frac is not None and (isinstance(frac, bool) or not isinstance(frac, (int, float))
                                     or not 0 < frac <= 1):
                raise ConfigValueError(f"{where}.partial_rotary_factor",
                                       f"must be a number in (0, 1]; it is {_shown(frac)}")
