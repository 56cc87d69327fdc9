"""Qwen 3.5 (``qwen3_5``, ``qwen3_5_text``): Gated-DeltaNet layers with periodic gated full attention.

Written against the op contract only: no numpy here. Text-only positions are equal on the three M-RoPE
axes, so the rotary tables reduce to plain partial RoPE over the first ``head_dim × partial_rotary_factor``
dims (rotate-half pairing).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from lumen_core.architecture import Architecture, ConfigValueError, TensorLayout

LINEAR_TENSORS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight",
                  "out_proj.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight")
FULL_TENSORS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight",
                "k_norm.weight")
MLP_TENSORS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
NOT_MATRIX = ("norm.weight", "conv1d.weight")  # small vectors/filters: kept as f32 tensors


@dataclass
class ModelArgs:
    """Hugging Face field names; unknown keys are ignored, missing ones take HF's defaults."""

    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list | None = None
    full_attention_interval: int = 4
    rope_parameters: dict = field(default_factory=dict)
    hidden_act: str = "silu"
    # MoE (qwen3_5_moe)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_dict(cls, config: dict) -> ModelArgs:
        text = config.get("text_config") or config
        names = {f.name for f in fields(cls)}
        args = cls(**{k: v for k, v in text.items() if k in names})
        if "tie_word_embeddings" not in text and "tie_word_embeddings" in config:
            args.tie_word_embeddings = config["tie_word_embeddings"]
        if args.layer_types is None:
            n = args.full_attention_interval
            args.layer_types = ["full_attention" if (i + 1) % n == 0 else "linear_attention"
                                for i in range(args.num_hidden_layers)]
        if not args.rope_parameters:  # older configs keep rope fields at the top level
            args.rope_parameters = {k: text[k] for k in ("rope_theta", "partial_rotary_factor") if k in text}
        return args

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope_parameters.get("partial_rotary_factor", 0.25))

    def inv_freq(self) -> list[float]:
        theta, dim = self.rope_parameters.get("rope_theta", 10_000_000.0), self.rotary_dim
        return [1.0 / theta ** (i / dim) for i in range(0, dim, 2)]


class Qwen3_5(Architecture):
    model_type = "qwen3_5"
    int_keys = {**Architecture.int_keys, "linear_conv_kernel_dim": 1, "linear_key_head_dim": 1,
                "linear_value_head_dim": 1, "linear_num_key_heads": 1, "linear_num_value_heads": 1,
                "full_attention_interval": 1}

    def __init__(self, config: dict):
        super().__init__(config)
        self.args = ModelArgs.from_dict(config)
        for i, t in enumerate(self.args.layer_types):
            if t not in ("linear_attention", "full_attention"):
                raise ConfigValueError("layer_types", f"holds {t!r} (layer {i}); Qwen 3.5 layers are "
                                       "'linear_attention' or 'full_attention'")
        self.num_layers = self.args.num_hidden_layers
        self.vocab_size = self.args.vocab_size
        self.max_context = self.args.max_position_embeddings
        self.prefix = "model."

    # -- tensor layout -----------------------------------------------------------------------------------
    def layout(self, names) -> TensorLayout:
        names = set(names)
        if any(n.startswith("model.language_model.") for n in names):
            self.prefix = "model.language_model."
        p, a = self.prefix, self.args
        embed = p + "embed_tokens.weight"
        head = embed if a.tie_word_embeddings else "lm_head.weight"
        needs = {("input-layer", None): [embed], ("output-layer", None): [p + "norm.weight", head]}
        for i in range(self.num_layers):
            needs[("layer", i)] = [f"{p}layers.{i}.{n}" for n in self.layer_tensors(i)]
            experts = [f"{p}layers.{i}.{n}" for n in self.expert_tensors()]
            if experts:
                needs[("experts", i)] = experts
        skipped = {n: _skip_reason(n) for n in names if _skip_reason(n)}
        return TensorLayout(needs, skipped)

    def layer_tensors(self, i: int) -> list[str]:
        if self.args.layer_types[i] == "linear_attention":
            mixer = [f"linear_attn.{n}" for n in LINEAR_TENSORS]
        else:
            mixer = [f"self_attn.{n}" for n in FULL_TENSORS]
        norms = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        return mixer + norms + self.mlp_tensors()

    def mlp_tensors(self) -> list[str]:
        return [f"mlp.{n}" for n in MLP_TENSORS]

    def expert_tensors(self) -> list[str]:
        return []

    def is_matrix(self, name: str) -> bool:
        return name.endswith(".weight") and not name.endswith(NOT_MATRIX)

    def norm_weight_offset(self, name: str) -> float | None:
        """The layer and q/k norms multiply by ``1 + w``; the gated norm of the linear attention by ``w``."""
        if name.endswith("linear_attn.norm.weight"):
            return 0.0
        return 1.0 if name.endswith(("layernorm.weight", "_norm.weight", ".norm.weight")) else None

    def expected_shapes(self) -> dict:
        """Embedding, head, norms, both token mixers and the MLP as the config sizes them."""
        a, p, hidden = self.args, self.prefix, self.args.hidden_size
        hid, vocab = ("hidden_size",), ("vocab_size", "hidden_size")
        out = {p + "embed_tokens.weight": ((a.vocab_size, hidden), vocab), p + "norm.weight": ((hidden,), hid)}
        if not a.tie_word_embeddings:
            out["lm_head.weight"] = ((a.vocab_size, hidden), vocab)
        H, Hkv, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        Hk, Dk = a.linear_num_key_heads, a.linear_key_head_dim
        Hv, Dv = a.linear_num_value_heads, a.linear_value_head_dim
        lin = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim")
        for i in range(self.num_layers):
            L = f"{p}layers.{i}."
            if a.layer_types[i] == "linear_attention":
                m = L + "linear_attn."
                out.update({
                    m + "in_proj_qkv.weight": ((2 * Hk * Dk + Hv * Dv, hidden), lin + hid),
                    m + "in_proj_z.weight": ((Hv * Dv, hidden), lin[2:] + hid),
                    m + "in_proj_a.weight": ((Hv, hidden), lin[2:3] + hid),
                    m + "in_proj_b.weight": ((Hv, hidden), lin[2:3] + hid),
                    m + "out_proj.weight": ((hidden, Hv * Dv), lin[2:] + hid),
                    m + "conv1d.weight": ((self.conv_dim, 1, a.linear_conv_kernel_dim),
                                          lin + ("linear_conv_kernel_dim",)),
                    m + "A_log": ((Hv,), lin[2:3]), m + "dt_bias": ((Hv,), lin[2:3]),
                    m + "norm.weight": ((Dv,), lin[3:]),
                })
            else:
                m, heads = L + "self_attn.", ("num_attention_heads", "head_dim", "hidden_size")
                kv = ("num_key_value_heads", "head_dim", "hidden_size")
                out.update({
                    m + "q_proj.weight": ((2 * H * D, hidden), heads),  # per head: query then output gate
                    m + "k_proj.weight": ((Hkv * D, hidden), kv), m + "v_proj.weight": ((Hkv * D, hidden), kv),
                    m + "o_proj.weight": ((hidden, H * D), heads),
                    m + "q_norm.weight": ((D,), ("head_dim",)), m + "k_norm.weight": ((D,), ("head_dim",)),
                })
            out[L + "input_layernorm.weight"] = out[L + "post_attention_layernorm.weight"] = ((hidden,), hid)
            out.update(self.mlp_shapes(L))
        return out

    def mlp_shapes(self, L: str) -> dict:
        a, keys = self.args, ("intermediate_size", "hidden_size")
        rows, hidden = a.intermediate_size, a.hidden_size
        return {L + "mlp.gate_proj.weight": ((rows, hidden), keys), L + "mlp.up_proj.weight": ((rows, hidden), keys),
                L + "mlp.down_proj.weight": ((hidden, rows), keys)}

    def components(self):
        comps = [("input-layer", None)]
        for i in range(self.num_layers):
            comps.append(("layer", i))
            if self.expert_tensors():
                comps.append(("experts", i))
        return comps + [("output-layer", None)]

    # -- caches and ops ----------------------------------------------------------------------------------
    def cache_bytes(self, layer: int, context: int, kv_bytes: float) -> int:
        a = self.args
        if a.layer_types[layer] == "full_attention":
            return int(2 * a.num_key_value_heads * a.head_dim * context * kv_bytes)
        conv = (a.linear_conv_kernel_dim - 1) * self.conv_dim * 4
        return conv + a.linear_num_value_heads * a.linear_key_head_dim * a.linear_value_head_dim * 4

    @property
    def conv_dim(self) -> int:
        a = self.args
        return 2 * a.linear_num_key_heads * a.linear_key_head_dim + a.linear_num_value_heads * a.linear_value_head_dim

    def required_ops(self, component) -> set[str]:
        block = component[0]
        if block == "input-layer":
            return {"embedding"}
        if block == "output-layer":
            return {"rms_norm", "linear"}
        if block == "experts":
            return {"moe_experts"}
        return {"rms_norm", "rms_norm_gated", "linear", "silu_mul", "sigmoid", "softplus", "exp",
                "rope_tables", "apply_rope", "attention", "kv_cache", "causal_conv1d", "conv_state",
                "gated_delta_rule", "delta_state", "moe_route"}

    def build(self, weights, backends, kv):
        from .model import QwenModel

        return QwenModel(self, weights, backends, kv)


def _skip_reason(name: str) -> str | None:
    if name.startswith(("model.visual.", "visual.")):
        return "vision tower (not requested)"
    if name.startswith("mtp."):
        return "multi-token-prediction head (speculative decoding is not supported yet)"
    return None
