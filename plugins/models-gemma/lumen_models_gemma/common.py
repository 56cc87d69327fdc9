"""What Gemma 3 and Gemma 4 share: a spec per attention layer, the tensor layout, RoPE frequencies, components.

Each architecture (``gemma3.py``, ``gemma4.py``) reads its config into HF-named args and turns them into one
``LayerSpec`` per layer; ``model.py`` runs any list of specs. No numpy here: only the op contract.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields

from lumen_core.architecture import Architecture, TensorLayout
from lumen_core.errors import CheckpointError, InputError

from .vision import vision_key

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
MLP = ("gate_proj", "up_proj", "down_proj")
NOT_MATRIX = ("layer_scalar", "scale", "per_expert_scale")  # with every *norm*: small f32 tensors
# Where the text model lives: text-only, multimodal (transformers 5), multimodal as Gemma 3 checkpoints ship.
PREFIXES = ("model.", "model.language_model.", "language_model.model.")
SKIPPED_TOWERS = {
    "vision_tower.": "vision tower (not requested)",
    "multi_modal_projector.": "vision projector (not requested)",
    "embed_vision.": "vision embedder (not requested)",
    "audio_tower.": "audio tower (not supported)",
    "embed_audio.": "audio embedder (not supported)",
}


@dataclass(frozen=True)
class LayerSpec:
    type: str  # "sliding_attention" or "full_attention": picks the RoPE table and the mask
    head_dim: int
    kv_heads: int
    window: int | None  # tokens a query sees, itself included; None = all before it
    shared_from: int | None = None  # KV sharing: the earlier layer whose cache this one reads (no k/v weights)
    k_eq_v: bool = False  # no v_proj: the values are the key projection (before k_norm)


def args_from_dict(cls, config: dict):
    """HF field names; unknown keys are ignored, missing ones take HF's defaults. Multimodal configs nest the
    text model under ``text_config``; ``tie_word_embeddings`` is read where transformers reads it (top level)."""
    text = config.get("text_config") or config
    names = {f.name for f in fields(cls)}
    args = cls(**{k: v for k, v in text.items() if k in names})
    args.tie_word_embeddings = config.get("tie_word_embeddings", True)
    return args


def rope_inv_freq(params: dict, head_dim: int) -> list[float]:
    """Inverse frequencies for one layer type, as transformers' ``ROPE_INIT_FUNCTIONS`` compute them."""
    kind = params.get("rope_type", params.get("type", "default"))
    theta, factor = params["rope_theta"], params.get("factor", 1.0)
    if kind == "default":  # Gemma's default ignores partial_rotary_factor: every dim rotates
        return [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    if kind == "proportional":
        # Gemma 4 full layers: the first angles rotate with exponents over the whole head_dim; the rest get a
        # zero frequency (cos 1, sin 0), so the table still spans head_dim and those dims pass unrotated.
        angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv = [1.0 / theta ** (2 * i / head_dim) for i in range(angles)] + [0.0] * (head_dim // 2 - angles)
        return [f / factor for f in inv]
    if kind == "linear":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        return [1.0 / theta ** (i / dim) / factor for i in range(0, dim, 2)]
    raise CheckpointError(f"rope_type {kind!r} is not supported for Gemma (supported: default, linear, proportional)")


def round_to_format(x: float, fmt: str) -> float:
    """``x`` as the weight format holds it: transformers multiplies the embeddings by sqrt(hidden) cast to the
    embedding dtype (bf16 turns sqrt(3072) = 55.4256 into 55.5), and the model was trained with that value."""
    if fmt == "bf16":
        bits = struct.unpack("<I", struct.pack("<f", x))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    if fmt == "f16":
        return struct.unpack("<e", struct.pack("<e", x))[0]
    return struct.unpack("<f", struct.pack("<f", x))[0]


class GemmaArchitecture(Architecture):
    """The parts both generations share; subclasses read their args and fill in the hooks below."""

    norm_offset = 0.0  # RMSNorm multiplies by (w + offset): Gemma 3 stores w - 1, Gemma 4 stores w
    v_norm = False  # Gemma 4 RMS-normalises values without a weight
    layer_scalar = False  # Gemma 4 scales each layer's output by a saved scalar
    int_keys = {**Architecture.int_keys, "sliding_window": 1}  # checked before the config is read

    def __init__(self, config: dict):
        super().__init__(config)
        self.args = self.read_args(config)
        a = self.args
        self.num_layers, self.vocab_size = a.num_hidden_layers, a.vocab_size
        self.max_context = a.max_position_embeddings
        self.prefix = "model."  # where the text model's tensors live; ``layout`` finds it
        self.head = "model.embed_tokens.weight" if a.tie_word_embeddings else "lm_head.weight"
        self.specs = self.layer_specs()
        heads = {s.type: s.head_dim for s in self.specs}  # one RoPE table per layer type, as transformers has
        self.inv_freq = {t: rope_inv_freq(self.rope_parameters()[t], d) for t, d in heads.items()}

    # -- hooks -------------------------------------------------------------------------------------------
    def read_args(self, config: dict):
        raise NotImplementedError

    def layer_specs(self) -> list[LayerSpec]:
        raise NotImplementedError

    def rope_parameters(self) -> dict[str, dict]:
        return self.args.rope_parameters

    @property
    def attn_scale(self) -> float:
        return 1.0

    @property
    def final_softcap(self) -> float | None:
        return self.args.final_logit_softcapping

    def embed_id_map(self) -> dict[int, int]:
        """Token ids the embedding reads as another id (media placeholders without their tower)."""
        return {}

    def input_tensors(self) -> list[str]:
        return ["embed_tokens.weight"]

    def layer_tensors(self, i: int) -> list[str]:
        spec = self.specs[i]
        attn = ["q_proj", "o_proj", "q_norm"]
        if spec.shared_from is None:
            attn += ["k_proj", "k_norm"] + ([] if spec.k_eq_v else ["v_proj"])
        return [f"self_attn.{n}.weight" for n in attn] + [f"{n}.weight" for n in NORMS] + \
            [f"mlp.{n}.weight" for n in MLP]

    def expert_tensors(self, i: int) -> list[str]:
        return []

    # -- vision (issue 17) -----------------------------------------------------------------------------------
    image_token_key = ("image_token_id", None)  # the config key of the image soft token (and its default)

    tower_present = True  # the checkpoint holds the tower's tensors (``layout`` looks)

    def has_vision(self) -> bool:
        """A ``vision_config`` and the tower's tensors (known once ``layout`` has seen the names, which
        ``from_checkpoint`` does); never a GGUF file (llama.cpp keeps the tower in a separate mmproj file)."""
        return bool(self.config.get("vision_config")) and self.tower_present and not self._is_gguf()

    def vision_tensors(self, names) -> dict:
        """``{tensor: (shape, config keys)}`` the vision component loads (the tower, its projector / embedder), as
        the ``vision_config`` sizes them: loaded with a vision block, their shapes checked whenever the checkpoint
        has a tower."""
        raise NotImplementedError

    def vision_tower(self, weights: dict, backend):
        raise NotImplementedError

    @property
    def image_token_id(self) -> int | None:
        key, default = self.image_token_key
        return self.config.get(key, default)

    def image_bidirectional(self, spec: LayerSpec) -> bool:
        """True where a layer's image tokens attend to every token of their image (transformers' blockwise mask)."""
        return True

    def image_run(self, image) -> list[int]:
        """The prompt tokens one image becomes (its placeholder expanded)."""
        raise NotImplementedError

    def expand_image_tokens(self, ids: list[int], images: list) -> list[int]:
        """Each placeholder (``placeholder_id``) of ``ids`` becomes its image's run of tokens, as the family's HF
        processor expands it; InputError when placeholders and images differ in number."""
        ph = self.placeholder_id
        count = sum(1 for t in ids if t == ph)
        if count != len(images):
            raise InputError(f"the prompt holds {count} image placeholder(s) (token {ph}) but {len(images)} image(s) "
                             "were given: one placeholder per image, in order")
        out, it = [], iter(images)
        for t in ids:
            out.extend(self.image_run(next(it)) if t == ph else (t,))
        return out

    def skip_reason(self, name: str) -> str | None:
        rest = name.removeprefix("model.")
        for start, reason in SKIPPED_TOWERS.items():
            if rest.startswith(start):
                return reason
        if name.endswith("lm_head.weight") and self.args.tie_word_embeddings:
            return "tied to embed_tokens (tie_word_embeddings)"
        return None

    # -- Architecture --------------------------------------------------------------------------------------
    def layout(self, names) -> TensorLayout:
        names = set(names)
        self.prefix = next((p for p in PREFIXES if p + "embed_tokens.weight" in names), "model.")
        p = self.prefix
        self.head = p + "embed_tokens.weight" if self.args.tie_word_embeddings else self.head_name(names)
        needs = {("input-layer", None): [p + n for n in self.input_tensors()],
                 ("output-layer", None): [p + "norm.weight", self.head]}
        for i in range(self.num_layers):
            needs[("layer", i)] = [f"{p}layers.{i}.{n}" for n in self.layer_tensors(i)]
            if self.expert_tensors(i):
                needs[("experts", i)] = [f"{p}layers.{i}.{n}" for n in self.expert_tensors(i)]
        # The tower's shapes are checked whenever the checkpoint has one (a vision_config that disagrees with its
        # weights is a damaged checkpoint, as transformers would refuse it); loaded only with a vision block.
        self.tower_present = any(vision_key(n) is not None for n in names)
        tower = self.has_vision()
        self._vision_shapes = self.vision_tensors(names) if tower or self.vision else {}
        if self.vision:
            needs[("vision", None)] = list(self._vision_shapes)
        needed = {n for ns in needs.values() for n in ns}
        skipped = {n: r for n in names - needed if (r := self.skip_reason(n))}
        return TensorLayout(needs, skipped)

    def mlp_rows(self, i: int) -> int | None:
        """Rows of layer i's gate/up projections (None: whatever the weights say)."""
        return self.args.intermediate_size

    def expected_shapes(self) -> dict:
        """The embedding, norms, attention and MLP projections as the config sizes them (the checkpoint header is
        held against these before any weight is read)."""
        a, p, hidden = self.args, self.prefix, self.args.hidden_size
        H = a.num_attention_heads
        hid = ("hidden_size",)
        out = {p + "embed_tokens.weight": ((a.vocab_size, hidden), ("vocab_size", "hidden_size")),
               p + "norm.weight": ((hidden,), hid)}
        for i, s in enumerate(self.specs):
            L = f"{p}layers.{i}."
            q_keys = ("num_attention_heads", "head_dim", "hidden_size")
            out[L + "self_attn.q_proj.weight"] = ((H * s.head_dim, hidden), q_keys)
            out[L + "self_attn.o_proj.weight"] = ((hidden, H * s.head_dim), q_keys)
            out[L + "self_attn.q_norm.weight"] = ((s.head_dim,), ("head_dim",))
            if s.shared_from is None:
                kv_keys = ("num_key_value_heads", "head_dim", "hidden_size")
                out[L + "self_attn.k_proj.weight"] = ((s.kv_heads * s.head_dim, hidden), kv_keys)
                out[L + "self_attn.k_norm.weight"] = ((s.head_dim,), ("head_dim",))
                if not s.k_eq_v:
                    out[L + "self_attn.v_proj.weight"] = ((s.kv_heads * s.head_dim, hidden), kv_keys)
            for n in NORMS:
                out[f"{L}{n}.weight"] = ((hidden,), hid)
            rows, mlp_keys = self.mlp_rows(i), ("intermediate_size", "hidden_size")
            out[L + "mlp.gate_proj.weight"] = ((rows, hidden), mlp_keys)
            out[L + "mlp.up_proj.weight"] = ((rows, hidden), mlp_keys)
            out[L + "mlp.down_proj.weight"] = ((hidden, rows), mlp_keys)
        return {**out, **getattr(self, "_vision_shapes", {})}

    def norm_weight_offset(self, name: str) -> float | None:
        """Every Gemma norm weight multiplies by ``w + norm_offset`` (``rms_norm``'s offset); the vision tower's
        norms are plain (SigLIP's LayerNorms, Gemma 4's RMSNorms), Gemma 3's projector norm is (1 + w)."""
        module = name.removesuffix(".weight").rsplit(".", 1)[-1]
        if vision_key(name) is not None and "norm" in module:
            return self.norm_offset if module == "mm_soft_emb_norm" else 0.0
        return self.norm_offset if "norm" in module else None

    def head_name(self, names) -> str:
        legacy = "language_model.lm_head.weight"  # Gemma 3's multimodal checkpoints keep the old layout
        return legacy if legacy in names else "lm_head.weight"

    def is_matrix(self, name: str) -> bool:
        module = name.removesuffix(".weight").rsplit(".", 1)[-1]
        if vision_key(name) is not None:  # linear maps (and the patch kernel); biases, tables, norms are f32
            return name.endswith("mm_input_projection_weight") or (
                name.endswith(".weight") and "norm" not in module and module != "position_embedding")
        return "norm" not in module and module not in NOT_MATRIX

    def components(self):
        comps = ([("vision", None)] if self.vision else []) + [("input-layer", None)]
        for i in range(self.num_layers):
            comps.append(("layer", i))
            if self.expert_tensors(i):
                comps.append(("experts", i))
        return comps + [("output-layer", None)]

    def cache_bytes(self, layer: int, context: int, kv_bytes: float) -> int:
        s = self.specs[layer]
        if s.shared_from is not None:
            return 0  # reads the cache of layer s.shared_from
        tokens = min(s.window, context) if s.window else context  # sliding layers keep a window-sized ring
        return int(2 * s.kv_heads * s.head_dim * tokens * kv_bytes)

    def required_ops(self, component) -> set[str]:
        block = component[0]
        if block == "vision":
            return self.vision_ops()
        if block == "input-layer":
            return {"embedding", "linear", "rms_norm"} | ({"concat"} if self.vision else set())
        if block == "output-layer":
            return {"rms_norm", "linear", "softcap"}
        if block == "experts":
            return {"moe_experts_packed"}
        return {"rms_norm", "linear", "gelu_tanh_mul", "rope_tables", "apply_rope", "attention", "kv_cache",
                "sliding_kv_cache", "attention_shared", "moe_route", "gather"}

    def vision_ops(self) -> set[str]:
        return set()

    def build(self, weights, backends, kv):
        from .model import GemmaModel

        return GemmaModel(self, weights, backends, kv)
