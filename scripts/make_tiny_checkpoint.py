"""Make a tiny random Hugging Face checkpoint for parity tests (dev tool: needs torch + transformers).

    python scripts/make_tiny_checkpoint.py qwen3_5 /tmp/tiny-qwen

Kinds: qwen3_5, qwen3_5_moe (text-only CausalLM) and qwen3_5_vl, qwen3_5_moe_vl (ConditionalGeneration
with a small vision tower, so weights are `model.language_model.*` and `model.visual.*`); gemma3, gemma4
(text-only CausalLM), gemma3_vl (with a SigLIP tower) and gemma4_mm (with vision and audio towers). Gemma
kinds get a Gemma-style tokenizer (`<bos>` prepended, `<eos>`, `<pad>`, turn tokens; Gemma 4's template).
Every parameter is re-drawn from a fixed seed so that no norm weight sits at its trivial 0 or 1 and a
parity test can tell a missing `1 + w` or a swapped projection apart.

The qwen3_5 and qwen3_5_moe kinds take `mtp=...` (`make(kind, out, mtp="random")`; `--mtp random` here): the
checkpoint then carries a multi-token-prediction head as real Qwen 3.5 checkpoints do (`mtp.*` tensors, which
transformers ignores on load, and `mtp_num_hidden_layers: 1` in the config): `"random"` draws it, `"equal"` builds
one that predicts what the model does (`add_mtp`). Without `mtp` the checkpoint is the same, byte for byte.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl", "gemma3", "gemma3_vl", "gemma4", "gemma4_mm")
MTP_KINDS = ("qwen3_5", "qwen3_5_moe")
MTP_MODES = ("random", "equal")
MODEL_VOCAB = 1000

# Chat and vision tokens the Qwen 3.5 template emits; appended after the BPE vocab as Qwen does.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)

# Qwen 3.5's own pre-tokenizer split, so AutoTokenizer (which rebuilds Qwen3_5Tokenizer from vocab + merges)
# and a plain `tokenizers.Tokenizer.from_file` agree on every string.
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# A fixed corpus: the tokenizer (and so every test id) is the same on every run.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model reads the text and writes a reply.
Once upon a time there was a little language model that lived inside a test suite. Every day it was
asked to predict the next token, and every day it tried its best, although its weights were random.
The engine loads the weights from disk, places each layer on a device, and runs the prompt through
the network. Attention layers keep a cache of keys and values; linear attention layers keep a small
recurrent state instead. The mixture of experts routes each token to two of eight experts.
Hello, world! How are you today? I am fine, thank you. What is the weather like in Paris and Berlin?
It is sunny and warm, about 23 degrees. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}
User: Please summarise the following paragraph in one sentence.
Assistant: Sure. The paragraph explains how a tokenizer splits text into pieces called tokens.
Café, naïve, résumé, façade, jalapeño, über, Straße, smörgåsbord, crème brûlée.
日本語のテキストも少し含めます。東京は日本の首都です。中文文本：你好，世界！我们正在测试分词器。
Emoji make byte-level tokenizers split characters: 🙂 👍 🚀 🎉 ❤️ 🇯🇵 👩‍💻.
"""


def make(kind: str, out_dir, seed: int = 0, mtp: str | None = None, **overrides) -> Path:
    """Build, randomise and save a tiny checkpoint of `kind`; `overrides` go to the text config. `mtp`: add a
    multi-token-prediction head ("random" or "equal": `add_mtp`; qwen3_5 and qwen3_5_moe only)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    if mtp is not None:
        if kind not in MTP_KINDS or mtp not in MTP_MODES:
            raise ValueError(f"mtp={mtp!r} with kind {kind!r}: an MTP head is made for the kinds "
                             f"{', '.join(MTP_KINDS)}, as mtp={' or '.join(repr(m) for m in MTP_MODES)}")
        overrides = {**(EQUAL_MTP_OVERRIDES if mtp == "equal" else {}), **overrides, "mtp_num_hidden_layers": 1}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gemma = kind.startswith("gemma")
    special = gemma_special_tokens(kind) if gemma else SPECIAL_TOKENS
    tokenizer = build_tokenizer(special)
    token_ids = {t: tokenizer.token_to_id(t) for t in special}
    config = build_gemma_config(kind, token_ids, overrides) if gemma else build_config(kind, token_ids, overrides)
    torch.manual_seed(seed)
    model = model_class(kind)(config).to(torch.float32).eval()
    randomise(model, seed)
    if mtp == "equal":
        make_mtp_equal_ready(model)
    model.save_pretrained(out)
    if mtp is not None:
        add_mtp(model, config, out, mtp, seed)
    if gemma:
        save_gemma_tokenizer(tokenizer, out, kind, token_ids)
    else:
        save_tokenizer(tokenizer, out)
        write_generation_config(out, token_ids)
    return out


# --- tokenizer -----------------------------------------------------------------------------------------


def build_tokenizer(special: tuple[str, ...] = SPECIAL_TOKENS) -> Tokenizer:
    """A byte-level BPE trained on CORPUS, its special tokens appended last (ids < MODEL_VOCAB)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=MODEL_VOCAB - 24,  # room for the special tokens, below the model's vocab
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.add_special_tokens(list(special))
    assert tok.get_vocab_size() <= MODEL_VOCAB, tok.get_vocab_size()
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=read_template("qwen3_5.jinja"),
    )
    fast.save_pretrained(out)


def read_template(name: str) -> str:
    """A real chat template, as the model plugins ship it (their READMEs name the source)."""
    from lumen_core.chat import package_template

    return package_template("lumen_models_qwen" if name.startswith("qwen") else "lumen_models_gemma", name)


def write_generation_config(out: Path, token_ids: dict[str, int]) -> None:
    gen = {"eos_token_id": token_ids["<|im_end|>"], "pad_token_id": token_ids["<|endoftext|>"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")


# --- config and model ----------------------------------------------------------------------------------


def text_config_dict(moe: bool, token_ids: dict[str, int], overrides: dict) -> dict:
    cfg = dict(
        vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0], "mrope_interleaved": True,
        },
        max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=token_ids["<|im_end|>"], pad_token_id=token_ids["<|endoftext|>"],
    )
    if moe:
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48)
        del cfg["intermediate_size"]
    cfg.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        cfg["layer_types"] = None  # let the config derive the 3-linear-1-full pattern for the new depth
    return cfg


def vision_config_dict(text_hidden: int) -> dict:
    return dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
        temporal_patch_size=2, out_hidden_size=text_hidden, num_position_embeddings=16,
    )


def build_config(kind: str, token_ids: dict[str, int], overrides: dict):
    moe = "moe" in kind
    overrides = dict(overrides)
    vision_overrides = overrides.pop("vision_config", {})
    text = text_config_dict(moe, token_ids, overrides)
    if not kind.endswith("_vl"):
        cls = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
        return cls(**text)
    vision = {**vision_config_dict(text["hidden_size"]), **vision_overrides}
    cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    return cls(
        text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"],
        image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"], vision_end_token_id=token_ids["<|vision_end|>"],
    )



# --- the multi-token-prediction head (Qwen 3.5) -----------------------------------------------------------

# The "equal" head's model: one full-attention layer (the one layer the head copies).
EQUAL_MTP_OVERRIDES = {"num_hidden_layers": 1, "layer_types": ["full_attention"]}


@torch.no_grad()
def make_mtp_equal_ready(model: torch.nn.Module) -> None:
    """The main model's changes for an "equal" MTP head (`add_mtp`): every embedding row rescaled to RMS 1, and the
    attention's o_proj zeroed, so the one layer computes x + mlp(post_norm(x)) of the token's own embedding."""
    embed = model.model.embed_tokens.weight
    embed.copy_(embed / embed.pow(2).mean(-1, keepdim=True).sqrt())
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()


@torch.no_grad()
def add_mtp(model: torch.nn.Module, config, out: Path, mode: str, seed: int) -> None:
    """Write an MTP head's tensors into the saved safetensors, as Qwen 3.5 checkpoints carry it: `mtp.fc.weight`
    (H, 2H) over [embedding, hidden], `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
    `mtp.norm.weight` ((1 + w) RMSNorms) and one full-attention decoder layer `mtp.layers.0.*` (the model's MLP
    kind: dense, or the MoE block). transformers ignores `mtp.*` on load (`_keys_to_ignore_on_load_unexpected`).

    "random": every tensor drawn as `randomise` draws the model's (norms 0.1·N(0,1) around the (1 + w) of 1,
    matrices 0.05·N(0,1)), from seed + 1, so the model's own weights are the same as without `mtp`.

    "equal": a head that provably predicts what the model predicts, to check a draft/verify loop end to end. The
    model has one full-attention layer (`EQUAL_MTP_OVERRIDES`), embedding rows of RMS exactly 1 and a zero o_proj
    (`make_mtp_equal_ready`). The head: `pre_fc_norm_embedding` = 0, so its (1 + w) = 1 and the norm is the identity
    on a unit-RMS row (up to the eps in sqrt(1 + eps)); fc = [I | 0], so the hidden half is ignored and the head's
    layer gets the token's embedding, as the model's layer does; `mtp.layers.0.*` copies `layers.0.*` and
    `mtp.norm` copies `model.norm`. Attention is the one thing the two could differ by: the head's cache has no row
    for the first token (position 0 has no previous hidden), so its attention would average other rows than the
    model's; with o_proj = 0 both layers are their MLP and norms, and the head's logits for (token, any hidden)
    equal the model's logits after that token."""
    from safetensors.torch import load_file, save_file

    H = config.hidden_size
    if mode == "equal":
        layer = model.model.layers[0]
        head = {"fc.weight": torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1),
                "pre_fc_norm_embedding.weight": torch.zeros(H),
                "pre_fc_norm_hidden.weight": 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(seed + 1)),
                "norm.weight": model.model.norm.weight.detach().clone()}
    else:
        one = type(config)(**{**config.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]})
        layer = type(model.model.layers[0])(one, 0).to(torch.float32)
        randomise(layer, seed + 1)
        gen = torch.Generator().manual_seed(seed + 2)
        head = {"fc.weight": 0.05 * torch.randn(H, 2 * H, generator=gen)}
        for name in ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"):
            head[name] = 0.1 * torch.randn(H, generator=gen)
    head.update({f"layers.0.{k}": v for k, v in saved_layer(model, config, layer).items()})
    path = out / "model.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{path}: add_mtp writes into a single-file checkpoint, and save_pretrained sharded "
                                "this one; make it smaller")
    tensors = load_file(path)
    tensors.update({f"mtp.{k}": v.detach().to(torch.float32).contiguous() for k, v in head.items()})
    save_file(tensors, path, metadata={"format": "pt"})


@torch.no_grad()
def saved_layer(model: torch.nn.Module, config, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A full-attention decoder layer's tensors as a checkpoint stores them (names under the layer): saved through a
    one-layer model of the same class, so transformers writes its fused MoE experts per expert, as on disk."""
    import tempfile

    from safetensors.torch import load_file

    one = type(config)(**{**config.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]})
    holder = type(model)(one).to(torch.float32)
    holder.model.layers[0].load_state_dict(layer.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        holder.save_pretrained(tmp)
        saved = load_file(Path(tmp) / "model.safetensors")
    return {k.removeprefix("model.layers.0."): v for k, v in saved.items() if k.startswith("model.layers.0.")}


# --- Gemma 3 / Gemma 4 -----------------------------------------------------------------------------------

GEMMA_BASE_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
GEMMA3_TOKENS = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")
# What the Gemma 4 chat template (lumen_models_gemma/templates/gemma4.jinja) emits, plus the media delimiters.
GEMMA4_TOKENS = (
    "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>", "<|tool>", "<tool|>", "<|tool_call>",
    "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|image|>", "<|audio|>", "<|video|>",
    "<|image>", "<image|>", "<|audio>", "<audio|>",
)


def gemma_special_tokens(kind: str) -> tuple[str, ...]:
    return GEMMA_BASE_TOKENS + (GEMMA4_TOKENS if kind.startswith("gemma4") else GEMMA3_TOKENS)


def save_gemma_tokenizer(tok: Tokenizer, out: Path, kind: str, token_ids: dict[str, int]) -> None:
    """Gemma tokenizers prepend <bos>: as transformers 5 reads only tokenizer.json's post-processor, put it there."""
    bos = token_ids["<bos>"]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)]),
    ])
    gemma4 = kind.startswith("gemma4")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        add_bos_token=True, chat_template=read_template("gemma4.jinja") if gemma4 else None,
    )
    fast.save_pretrained(out)
    end_of_turn = token_ids["<turn|>" if gemma4 else "<end_of_turn>"]
    gen = {"bos_token_id": bos, "eos_token_id": [token_ids["<eos>"], end_of_turn], "pad_token_id": token_ids["<pad>"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")


def gemma_text_dict(kind: str, token_ids: dict[str, int], overrides: dict) -> dict:
    """Tiny Gemma text config: 4 layers mixing sliding (window 8) and full attention, 4 heads / 2 KV heads."""
    cfg = dict(
        vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=4096,
        bos_token_id=token_ids["<bos>"], eos_token_id=token_ids["<eos>"], pad_token_id=token_ids["<pad>"],
    )
    if kind.startswith("gemma4"):
        # Full layers get their own head_dim (global_head_dim, "proportional" partial RoPE); the per-layer
        # embedding defaults (256 wide, 262,144 rows) are cut to fit the tiny vocab.
        cfg.update(layer_types=["sliding_attention", "full_attention"] * 2, global_head_dim=32,
                   hidden_size_per_layer_input=0, vocab_size_per_layer_input=MODEL_VOCAB)
    else:
        cfg.update(layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   query_pre_attn_scalar=16)
    cfg.update(overrides)
    return cfg


def build_gemma_config(kind: str, token_ids: dict[str, int], overrides: dict):
    overrides = dict(overrides)
    vision_overrides = overrides.pop("vision_config", {})
    text = gemma_text_dict(kind, token_ids, overrides)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(**text)
    if kind == "gemma4":
        return transformers.Gemma4TextConfig(**text)
    if kind == "gemma3_vl":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=16, patch_size=4, **vision_overrides)
        return transformers.Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4,
            tie_word_embeddings=text.get("tie_word_embeddings", True),
            image_token_index=token_ids["<image_soft_token>"], boi_token_index=token_ids["<start_of_image>"],
            eoi_token_index=token_ids["<end_of_image>"],
        )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64,
                  pooling_kernel_size=2, **vision_overrides)
    audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                 output_proj_dims=32, conv_kernel_size=3)
    return transformers.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=audio,
        tie_word_embeddings=text.get("tie_word_embeddings", True),
        image_token_id=token_ids["<|image|>"], audio_token_id=token_ids["<|audio|>"],
        video_token_id=token_ids["<|video|>"], boi_token_id=token_ids["<|image>"], eoi_token_id=token_ids["<image|>"],
        boa_token_id=token_ids["<|audio>"], eoa_token_index=token_ids["<audio|>"],
    )


def model_class(kind: str):
    return {
        "qwen3_5": transformers.Qwen3_5ForCausalLM,
        "qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM,
        "qwen3_5_vl": transformers.Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe_vl": transformers.Qwen3_5MoeForConditionalGeneration,
        "gemma3": transformers.Gemma3ForCausalLM,
        "gemma3_vl": transformers.Gemma3ForConditionalGeneration,
        "gemma4": transformers.Gemma4ForCausalLM,
        "gemma4_mm": transformers.Gemma4ForConditionalGeneration,
    }[kind]


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter so none is trivially 0 or 1 (HF inits norms to exactly that)."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            param.copy_(draw(type(module).__name__, name, param, gen))
    for module in model.modules():
        if type(module).__name__ == "Gemma4TextDecoderLayer":  # a saved buffer, 1 by default
            module.layer_scalar.copy_(0.5 + torch.rand(module.layer_scalar.shape, generator=gen))


def draw(module_type: str, name: str, param: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
    if name == "A_log":
        return param + 0.1 * noise  # keep HF's log-uniform decay spread, just off its exact values
    if name == "dt_bias":
        return param + 0.1 * noise
    if module_type.endswith("RMSNormGated") or module_type == "LayerNorm":
        return 1.0 + 0.1 * noise if name == "weight" else 0.05 * noise
    if module_type == "Gemma4RMSNorm" or module_type == "Gemma4TextRouter":
        return 1.0 + 0.1 * noise  # plain-w norm; router scale and per-expert scale are 1 by default
    if module_type.endswith("RMSNorm"):
        return 0.1 * noise  # the Qwen and Gemma 3 RMSNorm scale by (1 + w)
    if module_type == "Conv1d":
        return noise / math.sqrt(param.shape[-1])  # short depthwise kernel: keep its output near unit scale
    return 0.05 * noise


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--mtp", choices=MTP_MODES, help="add a multi-token-prediction head (qwen3_5, qwen3_5_moe)")
    args = parser.parse_args()
    overrides = {"tie_word_embeddings": True} if args.tie_word_embeddings else {}
    if args.mtp:
        overrides["mtp"] = args.mtp
    out = make(args.kind, args.out_dir, seed=args.seed, **overrides)
    print(out)


if __name__ == "__main__":
    main()
