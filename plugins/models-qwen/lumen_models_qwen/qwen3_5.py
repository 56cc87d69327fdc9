"""Qwen 3.5 (``qwen3_5``, ``qwen3_5_text``; llama.cpp's GGUF ``qwen35``): Gated-DeltaNet layers with periodic
gated full attention.

The forward pass (model.py) is written against the op contract only; numpy here reads GGUF values. Text-only
positions are equal on the three M-RoPE axes, so the rotary tables reduce to plain partial RoPE over the first
``head_dim × partial_rotary_factor`` dims (rotate-half pairing).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from lumen_core.architecture import Architecture, ConfigValueError, TensorLayout, gguf_float, gguf_int, read_int
from lumen_core.errors import CheckpointError, InputError

from . import vision as vt

LINEAR_TENSORS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight",
                  "out_proj.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight")
FULL_TENSORS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight",
                "k_norm.weight")
MLP_TENSORS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
# The multi-token-prediction (MTP) head's own tensors (``mtp.<name>``) besides its decoder layer ``mtp.layers.0.*``;
# its pre-fc norms are (1 + w) RMSNorms like the model's.
MTP_TENSORS = ("fc.weight", "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
MTP_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
NOT_MATRIX = ("norm.weight", "conv1d.weight") + MTP_NORMS  # small vectors/filters: kept as f32 tensors

# llama.cpp's tensor names (``blk.N.<name>``) -> ours (``model.layers.N.<name>``), and whether the converter stored
# the value shifted: it writes the (1 + w) RMSNorm weights as 1 + w (not the gated norm of the linear attention) and
# A_log as -exp(A_log). Its V-head order is kept (``ModelArgs.llama_cpp_layout``); unit axes it drops come back.
GGUF_LAYER = {
    "attn_norm.weight": ("input_layernorm.weight", "minus_one"),
    "post_attention_norm.weight": ("post_attention_layernorm.weight", "minus_one"),
    "attn_q.weight": ("self_attn.q_proj.weight", None),  # per head: query then output gate, as in HF
    "attn_k.weight": ("self_attn.k_proj.weight", None),
    "attn_v.weight": ("self_attn.v_proj.weight", None),
    "attn_output.weight": ("self_attn.o_proj.weight", None),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", "minus_one"),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", "minus_one"),
    "attn_qkv.weight": ("linear_attn.in_proj_qkv.weight", None),
    "attn_gate.weight": ("linear_attn.in_proj_z.weight", None),
    "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", None),
    "ssm_beta.weight": ("linear_attn.in_proj_b.weight", None),
    "ssm_out.weight": ("linear_attn.out_proj.weight", None),
    "ssm_conv1d.weight": ("linear_attn.conv1d.weight", None),
    "ssm_a": ("linear_attn.A_log", "a_log"),
    "ssm_dt.bias": ("linear_attn.dt_bias", None),
    "ssm_norm.weight": ("linear_attn.norm.weight", None),
    "ffn_gate.weight": ("mlp.gate_proj.weight", None),
    "ffn_up.weight": ("mlp.up_proj.weight", None),
    "ffn_down.weight": ("mlp.down_proj.weight", None),
    "ffn_gate_inp.weight": ("mlp.gate.weight", None),
    "ffn_gate_inp_shexp.weight": ("mlp.shared_expert_gate.weight", None),
    "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", None),
    "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", None),
    "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", None),
}


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
    # Set by config_from_gguf (a Lumen key, not HF's): the weights are laid out as llama.cpp's converter writes
    # them: the Gated-DeltaNet V heads tiled over the K heads (V head j reads K head j mod Hk) instead of grouped
    # by K head.
    llama_cpp_layout: bool = False

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
    mixer_compute_apart = True  # model.attention.compute may differ from the layer's (model.DecoderLayer)
    int_keys = {**Architecture.int_keys, "linear_conv_kernel_dim": 1, "linear_key_head_dim": 1,
                "linear_value_head_dim": 1, "linear_num_key_heads": 1, "linear_num_value_heads": 1,
                "full_attention_interval": 1}
    gguf_keys = {  # HF key -> llama.cpp's qwen35.* / qwen35moe.* key, for errors about a GGUF file
        "num_hidden_layers": "block_count", "hidden_size": "embedding_length", "intermediate_size":
        "feed_forward_length", "num_attention_heads": "attention.head_count", "num_key_value_heads":
        "attention.head_count_kv", "head_dim": "attention.key_length", "max_position_embeddings": "context_length",
        "rms_norm_eps": "attention.layer_norm_rms_epsilon", "linear_conv_kernel_dim": "ssm.conv_kernel",
        "linear_key_head_dim": "ssm.state_size", "linear_num_key_heads": "ssm.group_count",
        "linear_num_value_heads": "ssm.time_step_rank", "linear_value_head_dim": "ssm.inner_size",
        "layer_types": "attention.recurrent_layers", "vocab_size": "vocab_size", "num_experts": "expert_count",
        "num_experts_per_tok": "expert_used_count", "moe_intermediate_size": "expert_feed_forward_length",
        "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
    }

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
        vision_config = config.get("vision_config")
        self.vision_args = vt.VisionArgs.from_dict(vision_config) if isinstance(vision_config, dict) else None
        self.visual_prefix: str | None = None  # where the tower's tensors are (set by layout), None: no tower
        # MTP layers the config declares (text_config or top level: checkpoints write either); ``mtp_layers``
        # (what the checkpoint carries) is set by ``layout``, which sees the tensor names
        text = config.get("text_config") or config
        self.mtp_declared = read_int(text if "mtp_num_hidden_layers" in text else config, "mtp_num_hidden_layers",
                                     0, 0)

    # -- GGUF (llama.cpp's qwen35 / qwen35moe) ------------------------------------------------------------
    @classmethod
    def config_from_gguf(cls, metadata: dict) -> dict:
        """HF-style config from llama.cpp's ``qwen35`` / ``qwen35moe`` metadata (as its converter writes it). Every
        key is read typed and checked; an error names the GGUF key."""
        arch = metadata.get("general.architecture")
        k, moe = f"{arch}.", arch == "qwen35moe"
        blocks = gguf_int(metadata, k + "block_count")
        # The converter appends the multi-token-prediction block(s) as extra layers and says how many here.
        mtp = gguf_int(metadata, k + "nextn_predict_layers", minimum=0, default=0)
        layers = blocks - mtp
        if layers < 1:
            raise ConfigValueError(k + "nextn_predict_layers", f"is {mtp}, which leaves none of the {blocks} blocks "
                                   "as a decoder layer", gguf=True)
        hidden, heads = gguf_int(metadata, k + "embedding_length"), gguf_int(metadata, k + "attention.head_count")
        head_dim = gguf_int(metadata, k + "attention.key_length", default=None) or hidden // heads
        if gguf_int(metadata, k + "attention.value_length", default=head_dim) != head_dim:
            raise ConfigValueError(k + "attention.value_length", f"must equal attention.key_length ({head_dim}); "
                                   f"it is {metadata[k + 'attention.value_length']}", gguf=True)
        rotary = gguf_int(metadata, k + "rope.dimension_count", default=head_dim // 4)
        if rotary > head_dim or rotary % 2:
            raise ConfigValueError(k + "rope.dimension_count", f"must be even and at most attention.key_length "
                                   f"({head_dim}); it is {rotary}", gguf=True)
        rope = {"rope_type": "default", "rope_theta": gguf_float(metadata, k + "rope.freq_base", 10_000_000.0),
                "partial_rotary_factor": rotary / head_dim, "mrope_interleaved": True}
        sections = metadata.get(k + "rope.dimension_sections")
        if sections is not None:
            if not isinstance(sections, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                         for x in sections):
                raise ConfigValueError(k + "rope.dimension_sections", f"must be a list of integers >= 0; it is "
                                       f"{sections!r}", gguf=True)
            rope["mrope_section"] = list(sections[:3])
        flags = metadata.get(k + "attention.recurrent_layers")
        if flags is None:
            period = gguf_int(metadata, k + "full_attention_interval", default=4)
            flags = [(i + 1) % period != 0 for i in range(layers)]
        elif not isinstance(flags, list) or len(flags) not in (layers, blocks) or \
                not all(isinstance(f, (bool, int)) for f in flags):
            raise ConfigValueError(k + "attention.recurrent_layers", f"must hold one flag per block ({blocks}); it is "
                                   f"{flags!r}" if not isinstance(flags, list) else
                                   f"must hold one flag per block ({blocks}); it holds {len(flags)} values", gguf=True)
        v_heads, k_heads = gguf_int(metadata, k + "ssm.time_step_rank"), gguf_int(metadata, k + "ssm.group_count")
        if v_heads % k_heads:
            raise ConfigValueError(k + "ssm.time_step_rank", f"(value heads) must be a multiple of ssm.group_count "
                                   f"(key heads, {k_heads}); it is {v_heads}", gguf=True)
        inner = gguf_int(metadata, k + "ssm.inner_size")
        if inner % v_heads:
            raise ConfigValueError(k + "ssm.inner_size", f"must be a multiple of ssm.time_step_rank ({v_heads}); it "
                                   f"is {inner}", gguf=True)
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        vocab = gguf_int(metadata, k + "vocab_size", default=None) or len(tokens)
        if not vocab:
            raise ConfigValueError(k + "vocab_size", "is missing, and there is no tokenizer.ggml.tokens to count",
                                   gguf=True)
        eps = gguf_float(metadata, k + "attention.layer_norm_rms_epsilon", 1e-6)
        config = {
            "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
            "vocab_size": vocab,
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": gguf_int(metadata, k + "attention.head_count_kv", default=heads),
            "head_dim": head_dim,
            "rms_norm_eps": float(str(np.float32(eps))),  # stored as f32: 1e-6 comes back as 9.99999997e-07
            "max_position_embeddings": gguf_int(metadata, k + "context_length", default=262_144),
            "layer_types": ["linear_attention" if f else "full_attention" for f in flags[:layers]],
            "linear_conv_kernel_dim": gguf_int(metadata, k + "ssm.conv_kernel"),
            "linear_key_head_dim": gguf_int(metadata, k + "ssm.state_size"),
            "linear_num_key_heads": k_heads,
            "linear_num_value_heads": v_heads,
            "linear_value_head_dim": inner // v_heads,
            "rope_parameters": rope,
            "hidden_act": "silu",
            "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
            "llama_cpp_layout": True,
        }
        if moe:
            config.update(
                num_experts=gguf_int(metadata, k + "expert_count"),
                num_experts_per_tok=gguf_int(metadata, k + "expert_used_count"),
                moe_intermediate_size=gguf_int(metadata, k + "expert_feed_forward_length"),
                shared_expert_intermediate_size=gguf_int(metadata, k + "expert_shared_feed_forward_length"),
            )
        else:
            config["intermediate_size"] = gguf_int(metadata, k + "feed_forward_length")
        return config

    @classmethod
    def gguf_tensor_map(cls, config: dict, names: list[str]) -> dict:
        """llama.cpp names -> HF names, the converter's value shifts undone (``GGUF_LAYER``); the stacked routed
        experts (``ffn_{gate,up,down}_exps``, expert first) are split into one matrix per expert, no copy."""
        config["tie_word_embeddings"] = "output.weight" not in names  # llama.cpp drops a tied head
        transforms = {"minus_one": minus_one, "a_log": a_log_from_ssm_a, None: None}
        conv = (2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
                + config["linear_num_value_heads"] * config["linear_value_head_dim"])
        out: dict = {"token_embd.weight": ("model.embed_tokens.weight", None),
                     "output_norm.weight": ("model.norm.weight", minus_one),
                     "output.weight": ("lm_head.weight", None)}
        for i in range(config["num_hidden_layers"]):
            g, h = f"blk.{i}.", f"model.layers.{i}."
            for src, (dst, fn) in GGUF_LAYER.items():
                out[g + src] = (h + dst, transforms[fn])
            # unit axes llama.cpp drops: the converter squeezes the conv kernel (C, 1, K) to (C, K), its quantizer
            # writes the (1, H) shared-expert gate as (H,): read back in HF's shape (same bytes)
            out[g + "ssm_conv1d.weight"] += ((conv, 1, config["linear_conv_kernel_dim"]),)
            out[g + "ffn_gate_inp_shexp.weight"] += ((1, config["hidden_size"]),)
            for n in ("gate", "up", "down"):
                out[f"{g}ffn_{n}_exps.weight"] = [(f"{h}mlp.experts.{e}.{n}_proj.weight", None)
                                                  for e in range(config.get("num_experts", 0))]
        return {k: v for k, v in out.items() if k in names}

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
        self.visual_prefix = next((v for v in vt.PREFIXES if any(n.startswith(v) for n in names)), None)
        if self.vision and self.has_vision():  # the tower, as its own component ("vision", None)
            needs[("vision", None)] = vt.tower_tensors(self.vision_args, self.visual_prefix)
        self.mtp_in_file = any(n.startswith(MTP_PREFIX) for n in names)
        self.mtp_layers = self.mtp_declared if self.mtp_in_file else 0
        if self.use_mtp:  # the MTP head, as its own component ("mtp", None), placed with the output layer
            self.check_mtp()
            needs[("mtp", None)] = self.mtp_tensors()
        taken = set(needs.get(("vision", None), ())) | set(needs.get(("mtp", None), ()))
        skipped = {n: _skip_reason(n, self.num_layers) for n in names
                   if n not in taken and _skip_reason(n, self.num_layers)}
        return TensorLayout(needs, skipped)

    # -- multi-token prediction (issue 20) -----------------------------------------------------------------
    def check_mtp(self) -> None:
        """``use_mtp`` needs a checkpoint with one MTP layer (every Qwen 3.5 checkpoint has exactly one)."""
        if self.mtp_layers == 0:
            if self._is_gguf():
                why = "it is a GGUF file: Lumen does not read llama.cpp's MTP block (blk.N.nextn.*) yet"
            elif not self.mtp_in_file:
                why = "the checkpoint has no mtp.* tensors"
            else:
                why = f"{self.describe('mtp_num_hidden_layers')} is 0 or missing"
            raise CheckpointError(f"drafting with the MTP head needs a checkpoint that carries one (mtp.* tensors and "
                                  f"mtp_num_hidden_layers >= 1 in its config), but {why}: draft with a separate "
                                  "draft model instead")
        if self.mtp_layers != 1:
            raise CheckpointError(f"{self.describe('mtp_num_hidden_layers')} is {self.mtp_layers}: Lumen runs an MTP "
                                  "head of exactly one layer (as every Qwen 3.5 checkpoint has); draft with a "
                                  "separate draft model instead")

    def mtp_tensors(self) -> list[str]:
        """The head's tensors: fc, its norms, and one full-attention decoder layer (dense or MoE MLP, experts
        included: the head is one component)."""
        layer = [f"self_attn.{n}" for n in FULL_TENSORS] + ["input_layernorm.weight", "post_attention_layernorm.weight"]
        layer += self.mlp_tensors() + self.expert_tensors()
        return [MTP_PREFIX + n for n in MTP_TENSORS] + [f"{MTP_PREFIX}layers.0.{n}" for n in layer]

    def mtp_cache_bytes(self, context: int, kv_bytes: float) -> int:
        """The MTP layer's KV cache for ``context`` tokens (a full-attention layer's); 0 without a head."""
        a = self.args
        return int(self.mtp_layers * 2 * a.num_key_value_heads * a.head_dim * context * kv_bytes)

    # -- vision (issue 17) ---------------------------------------------------------------------------------
    def has_vision(self) -> bool:
        """A ``vision_config`` and the tower's tensors (``model.visual.*``; known once ``layout`` has seen the
        checkpoint's names, which ``from_checkpoint`` does)."""
        return self.vision_args is not None and self.visual_prefix is not None

    def image_processor(self, preprocessor_config: dict | None):
        """Qwen2-VL's image processor (``vision_preprocess.ImageProcessor``); its patch sizes default to the vision
        config's. None for a text-only checkpoint (no ``vision_config``)."""
        vision_config = self.config.get("vision_config")
        if not isinstance(vision_config, dict):
            return None
        from lumen_models_qwen.vision_preprocess import ImageProcessor

        return ImageProcessor(preprocessor_config, vision_config)

    def is_visual(self, name: str) -> bool:
        return self.visual_prefix is not None and name.startswith(self.visual_prefix)

    def expand_image_tokens(self, ids: list[int], images: list) -> list[int]:
        """Each ``<|image_pad|>`` (the chat template writes one between ``<|vision_start|>`` and
        ``<|vision_end|>``) becomes its image's ``num_tokens`` pads, as transformers' processor expands them."""
        pad = self.image_token_id
        count = sum(1 for t in ids if t == pad)
        if count != len(images):
            raise InputError(f"the prompt holds {count} image placeholder(s) (<|image_pad|>, id {pad}) but "
                             f"{len(images)} image(s) were given: one image per placeholder, in order")
        out, it = [], iter(images)
        for t in ids:
            if t == pad:
                out.extend([pad] * next(it).num_tokens)
            else:
                out.append(t)
        return out

    @property
    def image_token_id(self) -> int:
        return self.config.get("image_token_id", 248056)

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
        if self.is_visual(name):  # the tower's linears and its position table; norms, biases, the conv kernel: f32
            return name.endswith(vt.MATRICES)
        return name.endswith(".weight") and not name.endswith(NOT_MATRIX)

    def norm_weight_offset(self, name: str) -> float | None:
        """The layer and q/k norms multiply by ``1 + w``; the gated norm of the linear attention by ``w``."""
        if name.endswith("linear_attn.norm.weight"):
            return 0.0
        if self.is_visual(name):  # LayerNorms multiply by w
            return 0.0 if name.endswith(("norm1.weight", "norm2.weight", "norm.weight")) else None
        return 1.0 if name.endswith(("layernorm.weight", "_norm.weight", ".norm.weight") + MTP_NORMS) else None

    def expected_shapes(self) -> dict:
        """Embedding, head, norms, both token mixers and the MLP as the config sizes them."""
        a, p, hidden = self.args, self.prefix, self.args.hidden_size
        hid, vocab = ("hidden_size",), ("vocab_size", "hidden_size")
        out = {p + "embed_tokens.weight": ((a.vocab_size, hidden), vocab), p + "norm.weight": ((hidden,), hid)}
        if not a.tie_word_embeddings:
            out["lm_head.weight"] = ((a.vocab_size, hidden), vocab)
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
                out.update(self.attention_shapes(L))
            out[L + "input_layernorm.weight"] = out[L + "post_attention_layernorm.weight"] = ((hidden,), hid)
            out.update(self.mlp_shapes(L))
        if self.vision and self.has_vision():
            out.update(self.vision_args.shapes(self.visual_prefix))
        if self.use_mtp and self.mtp_layers:
            out.update(self.mtp_shapes())
        return out

    def attention_shapes(self, L: str) -> dict:
        """A gated full-attention mixer's tensors under the layer prefix ``L``."""
        a, hidden = self.args, self.args.hidden_size
        H, Hkv, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        m, heads = L + "self_attn.", ("num_attention_heads", "head_dim", "hidden_size")
        kv = ("num_key_value_heads", "head_dim", "hidden_size")
        return {
            m + "q_proj.weight": ((2 * H * D, hidden), heads),  # per head: query then output gate
            m + "k_proj.weight": ((Hkv * D, hidden), kv), m + "v_proj.weight": ((Hkv * D, hidden), kv),
            m + "o_proj.weight": ((hidden, H * D), heads),
            m + "q_norm.weight": ((D,), ("head_dim",)), m + "k_norm.weight": ((D,), ("head_dim",)),
        }

    def mtp_shapes(self) -> dict:
        """The MTP head: fc (H, 2H) over [embedding, hidden], its three norms, and its full-attention layer."""
        hidden, hid, p = self.args.hidden_size, ("hidden_size",), MTP_PREFIX
        out = {p + "fc.weight": ((hidden, 2 * hidden), hid)}
        for n in ("norm.weight",) + MTP_NORMS:
            out[p + n] = ((hidden,), hid)
        L = p + "layers.0."
        out.update(self.attention_shapes(L))
        out[L + "input_layernorm.weight"] = out[L + "post_attention_layernorm.weight"] = ((hidden,), hid)
        out.update(self.mlp_shapes(L))
        return out

    def mlp_shapes(self, L: str) -> dict:
        a, keys = self.args, ("intermediate_size", "hidden_size")
        rows, hidden = a.intermediate_size, a.hidden_size
        return {L + "mlp.gate_proj.weight": ((rows, hidden), keys), L + "mlp.up_proj.weight": ((rows, hidden), keys),
                L + "mlp.down_proj.weight": ((hidden, rows), keys)}

    def components(self):
        comps = [("vision", None)] if self.vision and self.has_vision() else []
        comps.append(("input-layer", None))
        for i in range(self.num_layers):
            comps.append(("layer", i))
            if self.expert_tensors():
                comps.append(("experts", i))
        comps.append(("output-layer", None))
        return comps + [("mtp", None)] if self.use_mtp else comps

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
        if block == "vision":
            return set(vt.OPS)
        if block == "input-layer":  # with images: their embeddings spliced between the text's
            return {"embedding", "concat"} if self.vision else {"embedding"}
        if block == "output-layer":
            return {"rms_norm", "linear"}
        if block == "experts":
            return {"moe_experts"}
        if block == "mtp":  # its embedding and lm_head run on the input and output layers' backends
            moe = {"moe_route", "moe_experts"} if self.expert_tensors() else set()
            return {"rms_norm", "linear", "concat", "gather", "rope_tables", "apply_rope", "attention", "kv_cache",
                    "sigmoid", "silu_mul"} | moe
        return {"rms_norm", "rms_norm_gated", "linear", "silu_mul", "sigmoid", "softplus", "exp",
                "rope_tables", "apply_rope", "attention", "kv_cache", "causal_conv1d", "conv_state",
                "gated_delta_rule", "delta_state", "moe_route"}

    def build(self, weights, backends, kv):
        from .model import QwenModel

        return QwenModel(self, weights, backends, kv)


MTP_PREFIX = "mtp."  # where checkpoints keep the MTP head, for the text and the multimodal models alike


def _skip_reason(name: str, layers: int) -> str | None:
    if name.startswith(("model.visual.", "visual.")):
        return "vision tower (not requested)"
    if name.startswith(MTP_PREFIX):
        return "multi-token-prediction head (not requested: it drafts tokens with draft.mtp)"
    if name.startswith("blk.") and name.split(".")[1].isdigit() and int(name.split(".")[1]) >= layers:
        # llama.cpp appends the MTP block after the decoder layers (qwen35.nextn_predict_layers)
        return "multi-token-prediction layer (llama.cpp's MTP block: Lumen drafts with an HF checkpoint's mtp.*)"
    return None


def minus_one(w):
    """llama.cpp stores the (1 + w) RMSNorm weights as 1 + w."""
    return w - 1.0


def a_log_from_ssm_a(a):
    """llama.cpp stores A_log as ssm_a = -exp(A_log)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.log(-np.asarray(a, dtype=np.float64)).astype(np.float32)  # not negative: NaN, refused on load
