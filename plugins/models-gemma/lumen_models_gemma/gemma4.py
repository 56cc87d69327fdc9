"""Gemma 4 (``gemma4``, ``gemma4_text``): Gemma 3's layer with plain-``w`` RMSNorm, a weightless value norm, no
query scaling (the q norm does it) and a saved ``layer_scalar``, plus the variants transformers accepts:

- full layers with their own head_dim / KV heads (``per_layer_config``) and "proportional" partial RoPE;
- ``attention_k_eq_v``: full layers without ``v_proj`` (values are the key projection);
- an MoE block beside the dense MLP (router with a scale and per-expert scales, packed experts);
- per-layer inputs (E2B / E4B): a second embedding table and a projection feed every layer a small vector;
- KV sharing: the last ``num_kv_shared_layers`` layers have no k/v weights and read an earlier layer's cache,
  and with ``use_double_wide_mlp`` their MLP is twice as wide (its weights say so).

Also reads llama.cpp's ``gemma4`` GGUF files (``config_from_gguf``, ``gguf_tensor_map``), undoing what its converter
(``conversion/gemma.py``, ``Gemma4Model``) does: norms are stored as ``w`` (no ``1 + w`` shift, unlike Gemma 3),
``layer_scalar`` is ``layer_output_scale``, the router's ``scale`` and ``per_expert_scale`` become
``ffn_gate_inp.scale`` and ``ffn_down_exps.scale``, the full layers' head_dim / KV heads are the ``key_length`` /
``head_count_kv`` entries beside the sliding layers' ``*_swa`` ones, the proportional RoPE's partial factor is
coded in the ``rope_freqs`` tensor (1 for rotated pairs, 1e30 for the rest), ``attention_k_eq_v`` is the absence
of ``attn_v`` and the token embedding is cut to the tokenizer's size. The packed experts (``ffn_gate_up_exps``,
``ffn_down_exps``) are split into one matrix per expert (byte ranges of the file, no copy), so block-quantized
experts stay in their format and run through ``moe_experts`` (the fused GGUF kernels) on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from lumen_core.architecture import ConfigValueError, gguf_float, gguf_int
from lumen_core.errors import CheckpointError

from .common import GemmaArchitecture, LayerSpec, args_from_dict, rope_inv_freq
from .gemma3 import check_supported

DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
MOE_TENSORS = ("router.proj.weight", "router.scale", "router.per_expert_scale", "pre_feedforward_layernorm_2.weight",
               "post_feedforward_layernorm_1.weight", "post_feedforward_layernorm_2.weight")
PLE_TENSORS = ("per_layer_input_gate.weight", "per_layer_projection.weight", "post_per_layer_input_norm.weight")
MEDIA_TOKENS = (("image_token_id", 258_880), ("video_token_id", 258_884), ("audio_token_id", 258_881))

# llama.cpp's gemma4 tensor names -> HF names (Gemma 4's converter stores every norm as it is: nothing to undo).
GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight", "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
GGUF_LAYER = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "layer_output_scale.weight": "layer_scalar",
    # MoE: the router (its input scale is ffn_gate_inp.scale); per_expert_scale scales each expert's output,
    # which llama.cpp applies after ffn_down_exps (the same product as HF's scaled routing weights)
    "ffn_gate_inp.weight": "router.proj.weight", "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    # per-layer inputs (E2B / E4B)
    "inp_gate.weight": "per_layer_input_gate.weight", "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}
GGUF_EXPERTS = {"ffn_gate_up_exps.weight": "gate_up_proj.weight", "ffn_down_exps.weight": "down_proj.weight"}
GGUF_REFUSED = {  # layouts other llama.cpp writers may produce that this reader does not take apart
    "attn_qkv.weight": "a fused attn_qkv (converted with QKV fusion)",
    "ffn_gate_exps.weight": "separate ffn_gate_exps / ffn_up_exps (Gemma 4's converter writes ffn_gate_up_exps)",
    "ffn_up_exps.weight": "separate ffn_gate_exps / ffn_up_exps (Gemma 4's converter writes ffn_gate_up_exps)",
}
ROPE_FREQS = "rope_freqs.weight"
UNROTATED = 1e29  # llama.cpp codes an unrotated pair of the full layers' RoPE as a frequency factor of 1e30


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
    gguf_keys = {  # HF key -> llama.cpp's gemma4.* key, for errors about a GGUF file
        "num_hidden_layers": "block_count", "hidden_size": "embedding_length", "intermediate_size":
        "feed_forward_length", "num_attention_heads": "attention.head_count", "num_key_value_heads":
        "attention.head_count_kv", "head_dim": "attention.key_length_swa", "global_head_dim": "attention.key_length",
        "sliding_window": "attention.sliding_window", "max_position_embeddings": "context_length",
        "rms_norm_eps": "attention.layer_norm_rms_epsilon", "final_logit_softcapping": "final_logit_softcapping",
        "num_experts": "expert_count", "top_k_experts": "expert_used_count",
        "moe_intermediate_size": "expert_feed_forward_length", "num_kv_shared_layers": "attention.shared_kv_layers",
        "hidden_size_per_layer_input": "embedding_length_per_layer_input",
    }
    split_experts = False  # GGUF: one matrix per routed expert (``layout`` sees which)
    embed_scale_format = None  # GGUF: "f32", as llama.cpp scales (None: the embedding's weight format)

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

    def image_processor(self, preprocessor_config: dict | None):
        """Variable-resolution patches (``vision_preprocess.Gemma4ImageProcessor``); patch and pooling sizes
        default to the vision config's. None for a text-only checkpoint (no ``vision_config``)."""
        vision_config = self.config.get("vision_config")
        if not isinstance(vision_config, dict):
            return None
        from lumen_models_gemma.vision_preprocess import Gemma4ImageProcessor

        return Gemma4ImageProcessor(preprocessor_config, vision_config)

    # -- vision (issue 17) -----------------------------------------------------------------------------------
    image_token_key = ("image_token_id", 258_880)

    @property
    def placeholder_id(self) -> int:
        return self.image_token_id  # the processor expands each <|image|> into <|image> + n <|image|> + <image|>

    def image_run(self, image) -> list[int]:
        boi, eoi = self.config.get("boi_token_id", 255_999), self.config.get("eoi_token_id", 258_882)
        return [boi] + [self.image_token_id] * image.num_tokens + [eoi]

    def image_bidirectional(self, spec) -> bool:
        # transformers: with use_bidirectional_attention "vision", sliding layers see their image's later tokens;
        # full layers stay causal (and without it every layer is causal)
        return self.args.use_bidirectional_attention == "vision" and spec.type == "sliding_attention"

    def vision_tensors(self, names) -> dict:
        from .vision import gemma4_tensors

        return gemma4_tensors(self.config, names)

    def vision_tower(self, weights: dict, backend):
        from .vision import Gemma4Tower

        return Gemma4Tower(self, weights, backend)

    def vision_ops(self) -> set[str]:
        clipped = (self.config.get("vision_config") or {}).get("use_clipped_linears", False)
        return {"linear", "rms_norm", "gather", "rope_tables", "apply_rope", "bidirectional_attention",
                "gelu_tanh_mul"} | ({"clamp"} if clipped else set())

    def input_tensors(self) -> list[str]:
        ple = ["embed_tokens_per_layer.weight", "per_layer_model_projection.weight",
               "per_layer_projection_norm.weight"]
        return ["embed_tokens.weight"] + (ple if self.per_layer_dim else [])

    def layer_tensors(self, i: int) -> list[str]:
        extra = ["layer_scalar", *(MOE_TENSORS if self.moe else ()), *(PLE_TENSORS if self.per_layer_dim else ())]
        return super().layer_tensors(i) + extra

    def expert_tensors(self, i: int) -> list[str]:
        if not self.moe:
            return []
        if self.split_experts:
            return [f"experts.{e}.{n}" for e in range(self.args.num_experts) for n in GGUF_EXPERTS.values()]
        return ["experts.gate_up_proj", "experts.down_proj"]

    def layout(self, names):
        names = set(names)
        self.split_experts = any(".experts.0.gate_up_proj.weight" in n for n in names)
        return super().layout(names)

    def required_ops(self, component) -> set[str]:
        if component[0] == "experts" and self.split_experts:
            return {"moe_experts"}
        return super().required_ops(component)

    def mlp_rows(self, i: int) -> int | None:
        return None  # KV-shared layers may be twice as wide (use_double_wide_mlp): the weights say

    def skip_reason(self, name: str) -> str | None:
        if name == ROPE_FREQS:
            return "llama.cpp's RoPE frequency factors of the full layers: read as their partial_rotary_factor"
        parts = name.removeprefix(self.prefix).split(".")
        if len(parts) == 5 and parts[0] == "layers" and parts[2] == "self_attn" and parts[3] in ("k_proj", "v_proj",
                                                                                                  "k_norm", "v_norm"):
            shared = self.specs[int(parts[1])].shared_from
            if shared is not None:
                return f"KV-shared layer: reads layer {shared}'s cache (transformers ignores these weights too)"
        return super().skip_reason(name)

    # -- GGUF ----------------------------------------------------------------------------------------------
    @classmethod
    def config_from_gguf(cls, metadata: dict) -> dict:
        """HF-style config from llama.cpp's ``gemma4`` metadata. Every key is read typed and checked (the error names
        the GGUF key). What the metadata does not hold comes from the tensors (``gguf_tensor_map``: the tied head,
        k_eq_v, the MoE block) or, for the full layers' partial RoPE factor, from ``rope_freqs``
        (``from_checkpoint``)."""
        k = "gemma4."
        layers, hidden = gguf_int(metadata, k + "block_count"), gguf_int(metadata, k + "embedding_length")
        pattern = metadata.get(k + "attention.sliding_window_pattern")
        if not isinstance(pattern, list) or len(pattern) != layers or not all(isinstance(f, (bool, int))
                                                                             for f in pattern):
            shown = "missing" if pattern is None else f"{len(pattern)} values" if isinstance(pattern, list) else \
                type(pattern).__name__
            raise ConfigValueError(k + "attention.sliding_window_pattern", f"must hold one flag per layer ({layers}); "
                                   f"it is {shown}", gguf=True)
        sliding = [bool(f) for f in pattern]
        heads = _uniform(metadata, k + "attention.head_count", layers)
        kv = _per_layer(metadata, k + "attention.head_count_kv", layers, default=heads)
        for i, n in enumerate(kv):
            if heads % n:
                raise ConfigValueError(k + "attention.head_count_kv", f"must divide attention.head_count ({heads}) "
                                       f"evenly; layer {i} has {n}", gguf=True)
        head_full = gguf_int(metadata, k + "attention.key_length", default=None) or hidden // heads
        head_swa = gguf_int(metadata, k + "attention.key_length_swa", default=head_full)
        for key, want in (("attention.value_length", head_full), ("attention.value_length_swa", head_swa),
                          ("rope.dimension_count", head_full), ("rope.dimension_count_swa", head_swa)):
            got = gguf_int(metadata, k + key, default=want)
            if got != want:  # llama.cpp requires the first two; Gemma 4 rotates whole heads (rope_freqs aside)
                raise ConfigValueError(k + key, f"must equal the key length ({want}) for Gemma 4; it is {got}",
                                       gguf=True)
        ff = _per_layer(metadata, k + "feed_forward_length", layers)
        shared = gguf_int(metadata, k + "attention.shared_kv_layers", minimum=0, default=0)
        if shared >= layers:
            raise ConfigValueError(k + "attention.shared_kv_layers", f"must be below block_count ({layers}); it is "
                                   f"{shared}", gguf=True)
        first_shared = layers - shared
        base_kv = next((n for n, s in zip(kv, sliding, strict=True) if s), kv[0])
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        vocab = gguf_int(metadata, k + "vocab_size", default=None) or len(tokens)
        if not vocab:
            raise ConfigValueError(k + "vocab_size", "is missing, and there is no tokenizer.ggml.tokens to count",
                                   gguf=True)
        full_rope = {"rope_type": "proportional", "partial_rotary_factor": 0.25,  # rope_freqs says (from_checkpoint)
                     "rope_theta": gguf_float(metadata, k + "rope.freq_base", 1_000_000.0)}
        if metadata.get(k + "rope.scaling.type") == "linear":
            full_rope["factor"] = gguf_float(metadata, k + "rope.scaling.factor", 1.0)
        experts = gguf_int(metadata, k + "expert_count", default=None)
        config = {
            "model_type": "gemma4_text",
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": ff[0],
            "use_double_wide_mlp": shared > 0 and all(ff[i] == 2 * ff[0] for i in range(first_shared, layers)),
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": base_kv,
            "head_dim": head_swa,
            "global_head_dim": head_full,
            # each layer's attention shape, as transformers resolves it (only the attention reads these)
            "per_layer_config": {str(i): {"head_dim": head_swa if s else head_full, "num_key_value_heads": n}
                                 for i, (s, n) in enumerate(zip(sliding, kv, strict=True))},
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            # required, as llama.cpp requires it: without it the sliding layers would attend to everything
            "sliding_window": gguf_int(metadata, k + "attention.sliding_window") if any(sliding) else 512,
            "max_position_embeddings": gguf_int(metadata, k + "context_length", default=131_072),
            "rms_norm_eps": gguf_float(metadata, k + "attention.layer_norm_rms_epsilon", 1e-6),
            "final_logit_softcapping": gguf_float(metadata, k + "final_logit_softcapping", None),
            "rope_parameters": {"full_attention": full_rope, "sliding_attention": {
                "rope_type": "default", "rope_theta": gguf_float(metadata, k + "rope.freq_base_swa", 10_000.0)}},
            "num_kv_shared_layers": shared,
            "hidden_size_per_layer_input": gguf_int(metadata, k + "embedding_length_per_layer_input", minimum=0,
                                                    default=0),
            "num_experts": experts,
            "top_k_experts": gguf_int(metadata, k + "expert_used_count") if experts else None,
            "moe_intermediate_size": gguf_int(metadata, k + "expert_feed_forward_length") if experts else None,
            "enable_moe_block": False,  # the tensors say (gguf_tensor_map)
            "attention_k_eq_v": False,  # the tensors say (gguf_tensor_map)
            "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id", 0),
            "tie_word_embeddings": True,
        }
        if experts and config["top_k_experts"] > experts:
            raise ConfigValueError(k + "expert_used_count", f"must be at most expert_count ({experts}); it is "
                                   f"{config['top_k_experts']}", gguf=True)
        return config

    @classmethod
    def gguf_tensor_map(cls, config: dict, names: list[str]) -> dict:
        """llama.cpp names -> HF names, and what only the tensors say: a separate head (llama.cpp drops a tied
        one), an MoE block (a router), k_eq_v (full layers with k but no v). ``rope_freqs`` keeps its name (skipped
        on purpose: ``from_checkpoint`` reads it)."""
        have = set(names)
        layers = config["num_hidden_layers"]
        for name in names:
            suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
            if suffix in GGUF_REFUSED:
                raise CheckpointError(f"tensor {name!r}: {GGUF_REFUSED[suffix]} is not supported for Gemma 4")
        config["tie_word_embeddings"] = "output.weight" not in have
        routers = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in have]
        if routers:
            if not config.get("num_experts"):
                raise ConfigValueError("gemma4.expert_count", "is missing, but the file has MoE routers "
                                       f"(blk.{routers[0]}.ffn_gate_inp.weight)", gguf=True)
            config["enable_moe_block"] = True
        first_shared = layers - config["num_kv_shared_layers"]
        full = [i for i, t in enumerate(config["layer_types"][:first_shared]) if t == "full_attention"]
        config["attention_k_eq_v"] = bool(full) and all(f"blk.{i}.attn_k.weight" in have and
                                                        f"blk.{i}.attn_v.weight" not in have for i in full)
        out = {k: (v, None) for k, v in GGUF_GLOBAL.items()}
        experts = config.get("num_experts") or 0
        for i in range(layers):
            for src, dst in GGUF_LAYER.items():
                out[f"blk.{i}.{src}"] = (f"model.layers.{i}.{dst}", None)
            for src, dst in GGUF_EXPERTS.items():  # (E, rows, cols): one name per expert, a byte range each
                out[f"blk.{i}.{src}"] = [(f"model.layers.{i}.experts.{e}.{dst}", None) for e in range(experts)]
        return {k: v for k, v in out.items() if k in have}

    @classmethod
    def from_checkpoint(cls, ckpt):
        arch = super().from_checkpoint(ckpt)
        if getattr(ckpt, "format", "hf") == "gguf":
            arch.embed_scale_format = "f32"  # llama.cpp scales the embeddings by sqrtf(n_embd), whatever the type
            arch._read_rope_freqs(ckpt)
        return arch

    def _read_rope_freqs(self, ckpt) -> None:
        """The full layers' partial RoPE factor from llama.cpp's ``rope_freqs`` (one factor per rotated pair: 1
        where transformers' proportional RoPE rotates, 1e30 — a zero frequency — where it does not)."""
        full = [s for s in self.specs if s.type == "full_attention"]
        if not full:
            return
        if ROPE_FREQS not in ckpt.tensors:
            raise CheckpointError(f"{ckpt.path}: tensor {ROPE_FREQS!r} is missing: the full-attention layers' "
                                  "proportional RoPE is defined by it (llama.cpp requires it too)")
        values = [float(v) for v in ckpt.read_f32(ROPE_FREQS).reshape(-1).tolist()]
        pairs = full[0].head_dim // 2
        rotated = next((j for j, v in enumerate(values) if v != 1.0), len(values))
        if len(values) != pairs or not all(v >= UNROTATED for v in values[rotated:]):
            raise CheckpointError(
                f"{ckpt.path}: tensor {ROPE_FREQS!r} must hold {pairs} factors (attention.key_length / 2), 1 for "
                f"each rotated pair then 1e30 for the unrotated ones (Gemma 4's proportional RoPE); it holds "
                f"{len(values)} values, {values[:8]}{'...' if len(values) > 8 else ''}"
            )
        params = self.args.rope_parameters["full_attention"]
        params["partial_rotary_factor"] = rotated / pairs
        self.inv_freq["full_attention"] = rope_inv_freq(params, full[0].head_dim)


def _per_layer(metadata: dict, key: str, layers: int, default=None) -> list[int]:
    """A per-layer integer llama.cpp writes as one value or an array of one value per layer."""
    value = metadata.get(key, default)
    if isinstance(value, list):
        if len(value) != layers:
            raise ConfigValueError(key, f"must hold one value per layer ({layers}); it holds {len(value)}", gguf=True)
        return [gguf_int({key: v}, key) for v in value]
    if key not in metadata and default is not None:
        return [default] * layers
    return [gguf_int(metadata, key)] * layers


def _uniform(metadata: dict, key: str, layers: int) -> int:
    values = _per_layer(metadata, key, layers)
    if len(set(values)) != 1:
        raise ConfigValueError(key, f"must be the same on every layer for Gemma 4; it is {values}", gguf=True)
    return values[0]
