"""Gemma 3 (``gemma3``, ``gemma3_text``): sliding-window layers with a full-attention layer every
``sliding_window_pattern`` (6), q/k norms, GeGLU, four norms a layer, RMSNorm by ``(1 + w)``, embeddings scaled
by sqrt(hidden), tied embeddings. Sliding layers rotate with the local base (10k), full layers with the global
one (1M, linear-scaled on the 4B and larger models). Also reads llama.cpp's ``gemma3`` GGUF files.
"""

from __future__ import annotations

from dataclasses import dataclass

from lumen_core.architecture import ConfigValueError, gguf_float, gguf_int
from lumen_core.errors import CheckpointError

from .common import GemmaArchitecture, LayerSpec, args_from_dict
from .vision import vision_key

LOCAL_THETA, GLOBAL_THETA = 10_000.0, 1_000_000.0
GGUF_LAYER = {  # llama.cpp name -> (HF name, stored as 1 + w)
    "attn_q": ("self_attn.q_proj", False), "attn_k": ("self_attn.k_proj", False),
    "attn_v": ("self_attn.v_proj", False), "attn_output": ("self_attn.o_proj", False),
    "attn_q_norm": ("self_attn.q_norm", True), "attn_k_norm": ("self_attn.k_norm", True),
    "attn_norm": ("input_layernorm", True), "post_attention_norm": ("post_attention_layernorm", True),
    "ffn_norm": ("pre_feedforward_layernorm", True), "post_ffw_norm": ("post_feedforward_layernorm", True),
    "ffn_gate": ("mlp.gate_proj", False), "ffn_up": ("mlp.up_proj", False), "ffn_down": ("mlp.down_proj", False),
}


@dataclass
class Gemma3Args:
    """Hugging Face field names and defaults (``Gemma3TextConfig``)."""

    vocab_size: int = 262_208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    rope_parameters: dict | None = None
    rope_theta: float | None = None  # older configs: rope fields at the top level
    rope_local_base_freq: float | None = None
    rope_scaling: dict | None = None
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 6
    layer_types: list | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool | None = False
    attention_bias: bool = False


def check_supported(a) -> None:
    """Refuse, by name, what no Gemma checkpoint uses and this code does not implement."""
    unknown = set(a.layer_types or ()) - {"sliding_attention", "full_attention"}
    if unknown:
        raise CheckpointError(f"layer_types {sorted(unknown)} are not Gemma layer types (sliding / full attention)")
    if a.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"hidden_activation {a.hidden_activation!r} is not supported (Gemma uses tanh GELU)")
    if a.attention_bias:
        raise CheckpointError("attention_bias: true is not supported (no Gemma checkpoint has attention biases)")
    if a.use_bidirectional_attention in (True, "all"):
        raise CheckpointError("use_bidirectional_attention: this is an embedding model, not a generative one")


BOI = "<start_of_image>"  # Gemma 3's image placeholder (boi_token)


class Gemma3(GemmaArchitecture):
    model_type = "gemma3"
    norm_offset = 1.0
    int_keys = {**GemmaArchitecture.int_keys, "sliding_window_pattern": 1}
    float_keys = ("rms_norm_eps", "query_pre_attn_scalar", "rope_local_base_freq", "final_logit_softcapping")
    # sliding_window: null is refused in read_args when a layer slides
    nullable_keys = frozenset({"sliding_window", "rope_local_base_freq", "final_logit_softcapping"})
    gguf_keys = {  # HF key -> llama.cpp's gemma3.* key, for errors about a GGUF file
        "num_hidden_layers": "block_count", "hidden_size": "embedding_length", "intermediate_size":
        "feed_forward_length", "num_attention_heads": "attention.head_count", "num_key_value_heads":
        "attention.head_count_kv", "head_dim": "attention.key_length", "sliding_window": "attention.sliding_window",
        "max_position_embeddings": "context_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
        "final_logit_softcapping": "final_logit_softcapping",
    }

    def read_args(self, config: dict) -> Gemma3Args:
        a = args_from_dict(Gemma3Args, config)
        if a.layer_types is None:
            n = a.sliding_window_pattern
            a.layer_types = ["sliding_attention" if (i + 1) % n else "full_attention"
                             for i in range(a.num_hidden_layers)]
        if a.sliding_window is None and "sliding_attention" in a.layer_types:
            raise ConfigValueError("sliding_window", "is null, but the model has sliding-attention layers")
        check_supported(a)
        # transformers applies the final softcap in Gemma3ForCausalLM only, never in the multimodal model.
        self.softcap = None if "text_config" in config else a.final_logit_softcapping
        return a

    def layer_specs(self) -> list[LayerSpec]:
        a = self.args
        return [LayerSpec(t, a.head_dim, a.num_key_value_heads, a.sliding_window if t == "sliding_attention" else None)
                for t in a.layer_types]

    def rope_parameters(self) -> dict[str, dict]:
        """Per layer type, filled in as transformers does for older configs (``rope_theta``,
        ``rope_local_base_freq`` and ``rope_scaling`` at the top level; the scaling applies to full layers)."""
        a, given = self.args, self.args.rope_parameters or {}
        scaling = dict(a.rope_scaling or {})
        if "type" in scaling:
            scaling.setdefault("rope_type", scaling.pop("type"))
        full = {"rope_type": "default", **(given.get("full_attention") or {}), **scaling}
        full.setdefault("rope_theta", a.rope_theta or GLOBAL_THETA)
        sliding = {"rope_type": "default", **(given.get("sliding_attention") or {})}
        sliding.setdefault("rope_theta", a.rope_local_base_freq or LOCAL_THETA)
        return {"full_attention": full, "sliding_attention": sliding}

    @property
    def attn_scale(self) -> float:
        # attn_logit_softcapping is never applied: transformers' Gemma 3 attention does not pass it on.
        return self.args.query_pre_attn_scalar ** -0.5

    @property
    def final_softcap(self) -> float | None:
        return self.softcap

    # -- vision (issue 17) -----------------------------------------------------------------------------------
    # Text the processor puts around each image run (transformers: "\n\n" before <start_of_image> and after
    # <end_of_image>), as token ids; the architecture has no tokenizer, so whoever has one may set it.
    image_wrap_ids: tuple[int, ...] = ()

    @property
    def image_token_id(self) -> int:
        return self.config.get("image_token_index", self.config.get("image_token_id", 262_144))

    @property
    def placeholder_id(self) -> int:
        return self.config.get("boi_token_index", self.config.get("boi_token_id", 255_999))

    def image_text(self, text: str) -> str:
        """transformers' Gemma3Processor replaces each <start_of_image> with "\n\n<start_of_image>{soft tokens}
        <end_of_image>\n\n" and then tokenizes: the blank lines are text (they merge with neighbouring newlines),
        so they go in here, around the placeholder, and expand_image_tokens adds the tokens between."""
        return text.replace(BOI, f"\n\n{BOI}\n\n")

    def image_run(self, image) -> list[int]:
        eoi = self.config.get("eoi_token_index", self.config.get("eoi_token_id", 256_000))
        wrap = list(self.image_wrap_ids)
        return wrap + [self.placeholder_id] + [self.image_token_id] * image.num_tokens + [eoi] + wrap

    def vision_tensors(self, names) -> dict:
        from .vision import siglip_tensors

        return siglip_tensors(self.config, names)

    def skip_reason(self, name: str) -> str | None:
        key = vision_key(name)
        if self.vision and key is not None and key.startswith("vision_tower.head."):
            return "SigLIP's attention-pooling head (Gemma 3 reads the tower's last hidden state)"
        return super().skip_reason(name)

    def vision_tower(self, weights: dict, backend):
        from .vision import SiglipTower

        return SiglipTower(self, weights, backend)

    def vision_ops(self) -> set[str]:
        act = (self.config.get("vision_config") or {}).get("hidden_act", "gelu_pytorch_tanh")
        return {"linear", "layer_norm", "bidirectional_attention", "rms_norm", "gelu" if act == "gelu" else "gelu_tanh"}

    def embed_id_map(self) -> dict[int, int]:
        image = (self.config.get("image_token_index", self.config.get("image_token_id"))
                 if "text_config" in self.config else None)
        return {image: 0} if image is not None and image >= self.vocab_size else {}

    def image_processor(self, preprocessor_config: dict | None):
        """SigLIP's fixed-size preprocessing (``vision_preprocess.Gemma3ImageProcessor``), ``mm_tokens_per_image``
        tokens per image; None for a text-only checkpoint (no ``vision_config``)."""
        vision_config = self.config.get("vision_config")
        if not isinstance(vision_config, dict):
            return None
        from lumen_models_gemma.vision_preprocess import Gemma3ImageProcessor

        return Gemma3ImageProcessor(preprocessor_config, vision_config, self.config.get("mm_tokens_per_image"))

    # -- GGUF ----------------------------------------------------------------------------------------------
    @classmethod
    def config_from_gguf(cls, metadata: dict) -> dict:
        """HF-style config from llama.cpp's ``gemma3`` metadata, following llama.cpp where it knows more than
        transformers' GGUF reader: rope scaling and the attention scale of the 27B (both ignored there)."""
        # Every key is read typed and checked (a positive integer, a positive number): the error names the key.
        k = "gemma3."
        layers, hidden = gguf_int(metadata, k + "block_count"), gguf_int(metadata, k + "embedding_length")
        heads = gguf_int(metadata, k + "attention.head_count")
        head_dim = gguf_int(metadata, k + "attention.key_length", default=None) or hidden // heads
        full = {"rope_type": "default", "rope_theta": gguf_float(metadata, k + "rope.freq_base", GLOBAL_THETA)}
        factor = gguf_float(metadata, k + "rope.scaling.factor", 1.0)
        if metadata.get(k + "rope.scaling.type") == "linear" and factor != 1.0:
            full.update(rope_type="linear", factor=factor)
        # llama.cpp's 27B (62 layers) scales queries by (hidden / heads)^-0.5, the others by head_dim^-0.5.
        scalar = hidden // heads if layers == 62 else head_dim
        if metadata.get(k + "attention.scale"):
            scalar = gguf_float(metadata, k + "attention.scale") ** -2
        # a period, or one flag per layer in newer files
        pattern = metadata.get(k + "attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            if len(pattern) != layers or not all(isinstance(f, (bool, int)) for f in pattern):
                raise ConfigValueError(k + "attention.sliding_window_pattern", f"must hold one flag per layer "
                                       f"({layers}); it holds {len(pattern)} values", gguf=True)
            sliding = [bool(f) for f in pattern]
        else:
            period = gguf_int(metadata, k + "attention.sliding_window_pattern", default=6)
            sliding = [(i + 1) % period != 0 for i in range(layers)]
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        vocab = gguf_int(metadata, k + "vocab_size", default=None) or len(tokens)
        if not vocab:
            raise ConfigValueError(k + "vocab_size", "is missing, and there is no tokenizer.ggml.tokens to count",
                                   gguf=True)
        heads_kv = gguf_int(metadata, k + "attention.head_count_kv", default=heads)
        return {
            "model_type": "gemma3_text",
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": gguf_int(metadata, k + "feed_forward_length"),
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads_kv,
            "head_dim": head_dim,
            "rms_norm_eps": gguf_float(metadata, k + "attention.layer_norm_rms_epsilon", 1e-6),
            # required, as llama.cpp requires it: without it the sliding layers would attend to everything
            "sliding_window": gguf_int(metadata, k + "attention.sliding_window") if any(sliding) else None,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "max_position_embeddings": gguf_int(metadata, k + "context_length", default=131_072),
            "query_pre_attn_scalar": scalar,
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_THETA}},
            "final_logit_softcapping": gguf_float(metadata, k + "final_logit_softcapping", None),
            "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
            "tie_word_embeddings": True,
        }

    @classmethod
    def gguf_tensor_map(cls, config: dict, names: list[str]) -> dict:
        """llama.cpp names -> HF names. Its converter stores every Gemma norm as ``1 + w``, so they come back
        minus one for the ``(1 + w)`` RMSNorm (transformers' GGUF loader does the same)."""
        config["tie_word_embeddings"] = "output.weight" not in names  # llama.cpp drops a tied head
        out = {"token_embd.weight": ("model.embed_tokens.weight", None),
               "output_norm.weight": ("model.norm.weight", minus_one),
               "output.weight": ("lm_head.weight", None)}
        for i in range(config["num_hidden_layers"]):
            for src, (dst, shifted) in GGUF_LAYER.items():
                out[f"blk.{i}.{src}.weight"] = (f"model.layers.{i}.{dst}.weight", minus_one if shifted else None)
        return {k: v for k, v in out.items() if k in names}


def minus_one(w):
    return w - 1.0
