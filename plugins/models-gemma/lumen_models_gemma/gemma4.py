"""Gemma 4 (``gemma4``, ``gemma4_text``): Gemma 3's layer with plain-``w`` RMSNorm, a weightless value norm, no
query scaling (the q norm does it) and a saved ``layer_scalar``, plus the variants transformers accepts:

- full layers with their own head_dim / KV heads (``per_layer_config``) and "proportional" partial RoPE;
- ``attention_k_eq_v``: full layers without ``v_proj`` (values are the key projection);
- an MoE block beside the dense MLP (router with a scale and per-expert scales, packed experts);
- per-layer inputs (E2B / E4B): a second embedding table and a projection feed every layer a small vector;
- KV sharing: the last ``num_kv_shared_layers`` layers have no k/v weights and read an earlier layer's cache,
  and with ``use_double_wide_mlp`` their MLP is twice as wide (its weights say so).
"""

from __future__ import annotations

from dataclasses import dataclass

from lumen_core.errors import CheckpointError

from .common import GemmaArchitecture, LayerSpec, args_from_dict
from .gemma3 import check_supported

DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
MOE_TENSORS = ("router.proj.weight", "router.scale", "router.per_expert_scale", "pre_feedforward_layernorm_2.weight",
               "post_feedforward_layernorm_1.weight", "post_feedforward_layernorm_2.weight")
PLE_TENSORS = ("per_layer_input_gate.weight", "per_layer_projection.weight", "post_per_layer_input_norm.weight")
MEDIA_TOKENS = (("image_token_id", 258_880), ("video_token_id", 258_884), ("audio_token_id", 258_881))


@dataclass
class Gemma4Args:
    """Hugging Face field names and defaults (``Gemma4TextConfig``)."""

    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = True
    rope_parameters: dict | None = None
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: list | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    per_layer_config: dict | None = None  # {"<layer>": {"head_dim": ..., "num_key_value_heads": ...}}
    global_head_dim: int = 512  # older configs: full-layer overrides given globally
    num_global_key_value_heads: int | None = None


class Gemma4(GemmaArchitecture):
    model_type = "gemma4"
    v_norm = True
    layer_scalar = True
    int_keys = {**GemmaArchitecture.int_keys, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
                "vocab_size_per_layer_input": 1, "global_head_dim": 1, "num_global_key_value_heads": 1,
                "num_experts": 1, "top_k_experts": 1, "moe_intermediate_size": 1}
    float_keys = ("rms_norm_eps", "final_logit_softcapping")
    nullable_keys = frozenset({"num_global_key_value_heads", "num_experts", "top_k_experts", "moe_intermediate_size",
                               "hidden_size_per_layer_input", "vocab_size_per_layer_input", "final_logit_softcapping"})

    def read_args(self, config: dict) -> Gemma4Args:
        a = args_from_dict(Gemma4Args, config)
        if a.layer_types is None:
            a.layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention"
                             for i in range(a.num_hidden_layers)]
        a.layer_types = [*a.layer_types[:-1], "full_attention"]  # transformers forces the last layer to full
        a.rope_parameters = a.rope_parameters or DEFAULT_ROPE
        check_supported(a)
        if a.enable_moe_block and not (a.num_experts and a.top_k_experts):
            raise CheckpointError("enable_moe_block needs num_experts and top_k_experts in the config")
        return a

    def layer_overrides(self) -> dict[int, dict]:
        """Per-layer head_dim / KV heads, as transformers resolves them (only attention reads them)."""
        a = self.args
        if a.per_layer_config is not None:
            return {int(i): o for i, o in a.per_layer_config.items()}
        full = {"head_dim": a.global_head_dim}
        if a.attention_k_eq_v and a.num_global_key_value_heads is not None:
            full["num_key_value_heads"] = a.num_global_key_value_heads
        return {i: full for i, t in enumerate(a.layer_types) if t == "full_attention"}

    def layer_specs(self) -> list[LayerSpec]:
        a, over = self.args, self.layer_overrides()
        first_shared = a.num_hidden_layers - a.num_kv_shared_layers
        specs = []
        for i, t in enumerate(a.layer_types):
            o = over.get(i, {})
            specs.append(LayerSpec(
                t, o.get("head_dim", a.head_dim), o.get("num_key_value_heads", a.num_key_value_heads),
                a.sliding_window if t == "sliding_attention" else None,
                shared_from=self._producer(i, first_shared) if i >= first_shared else None,
                k_eq_v=a.attention_k_eq_v and t == "full_attention",
            ))
        return specs

    def _producer(self, i: int, first_shared: int) -> int:
        """The last layer before the shared ones with the same type: its cache serves layer i."""
        t = self.args.layer_types[i]
        producers = [j for j in range(first_shared) if self.args.layer_types[j] == t]
        if not producers:
            raise CheckpointError(f"layer {i} shares a {t} KV cache, but no earlier layer of that type makes one")
        return producers[-1]

    @property
    def per_layer_dim(self) -> int:
        return self.args.hidden_size_per_layer_input or 0

    @property
    def moe(self) -> bool:
        return bool(self.args.enable_moe_block)

    def embed_id_map(self) -> dict[int, int]:
        # The multimodal model embeds media placeholders as padding until their tower fills them in.
        if "text_config" not in self.config:
            return {}
        return {self.config.get(k, d): self.args.pad_token_id or 0 for k, d in MEDIA_TOKENS}

    def input_tensors(self) -> list[str]:
        ple = ["embed_tokens_per_layer.weight", "per_layer_model_projection.weight",
               "per_layer_projection_norm.weight"]
        return ["embed_tokens.weight"] + (ple if self.per_layer_dim else [])

    def layer_tensors(self, i: int) -> list[str]:
        extra = ["layer_scalar", *(MOE_TENSORS if self.moe else ()), *(PLE_TENSORS if self.per_layer_dim else ())]
        return super().layer_tensors(i) + extra

    def expert_tensors(self, i: int) -> list[str]:
        return ["experts.gate_up_proj", "experts.down_proj"] if self.moe else []

    def mlp_rows(self, i: int) -> int | None:
        return None  # KV-shared layers may be twice as wide (use_double_wide_mlp): the weights say

    def skip_reason(self, name: str) -> str | None:
        parts = name.removeprefix(self.prefix).split(".")
        if len(parts) == 5 and parts[0] == "layers" and parts[2] == "self_attn" and parts[3] in ("k_proj", "v_proj",
                                                                                                  "k_norm", "v_norm"):
            shared = self.specs[int(parts[1])].shared_from
            if shared is not None:
                return f"KV-shared layer: reads layer {shared}'s cache (transformers ignores these weights too)"
        return super().skip_reason(name)
