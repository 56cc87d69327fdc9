"""Gemma 4 from llama.cpp's GGUF files (architecture ``gemma4``): dense, MoE and E2B-style (per-layer inputs, KV-shared
layers, double-wide MLP), each as F32, F16, Q8_0 and Q4_K_M, converted by llama.cpp's own converter and quantizer
(``tests/data/gguf/README.md`` says how; the HF directory each was converted from sits beside it, in bf16).

- F32 GGUF against Lumen on the HF directory: prefill logits and greedy decode within 1e-5 (the same weights).
- F16 / Q8_0 / Q4_K_M against transformers running the HF model with the GGUF's own weights, dequantized by
  ``gguf.quants`` and put back under their HF names by a table written here (not the plugin's): within 1e-4.
- The config read from the metadata against the HF config, the accounting of every GGUF tensor, errors naming the
  GGUF key, the tokenizer, the CLI, and (where llama-cpp-python is installed) greedy tokens against llama.cpp.

The converter cuts the token embedding to the tokenizer's size (999 tokens; the HF config says 1000): logits are
compared on those 999 columns. Embeddings are scaled by sqrt(hidden) in f32 from a GGUF, as llama.cpp does; on the
bf16 HF directory Lumen scales by the bf16-rounded value as transformers does in bf16, so the F32 comparison puts
the HF engine's scales in f32 first (``hf_engine``).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_models import engine_for

from lumen_core.checkpoint.gguf import GGUFCheckpoint
from lumen_core.errors import CheckpointError

gguf = pytest.importorskip("gguf")

DATA = Path(__file__).parent / "data" / "gguf"
VARIANTS = ("gemma4-dense", "gemma4-moe", "gemma4-e2b")
QUANTIZED = ("f16", "q8_0", "q4_k_m")
PROMPT_LEN, DECODE_STEPS, CONTEXT = 40, 4, 256
EXACT, TOL = 1e-5, 1e-4

# llama.cpp name -> HF name, from llama.cpp's gguf-py tensor table (constants.py / tensor_mapping.py) and Gemma 4's
# converter, written out here so the reference does not go through the plugin's own mapping.
REF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight", "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
REF_LAYER = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.weight": "router.proj.weight", "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale", "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj", "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "inp_gate.weight": "per_layer_input_gate.weight", "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}

pytestmark = pytest.mark.skipif(not all((DATA / v / f"{v}-f32.gguf").is_file() for v in VARIANTS),
                                reason="tests/data/gguf Gemma 4 fixtures missing")


def gguf_file(variant: str, kind: str) -> Path:
    return DATA / variant / f"{variant}-{kind}.gguf"


def load(path: Path, **extra):
    return engine_for(path, **extra)


def ids_for(vocab: int, n: int = PROMPT_LEN, seed: int = 0) -> list[int]:
    return np.random.RandomState(seed).randint(3, vocab, n).tolist()


def lumen_run(engine, ids: list[int]) -> tuple[np.ndarray, list[np.ndarray], list[int]]:
    """Prefill logits (all rows), then greedy decode: each step's logits and token."""
    m = engine.model
    prefill = m.forward(ids, m.new_cache(CONTEXT), all_logits=True)
    cache = m.new_cache(CONTEXT)
    logits, steps, tokens = m.forward(ids, cache)[-1], [], []
    for _ in range(DECODE_STEPS):
        steps.append(logits)
        tokens.append(int(np.argmax(logits)))
        logits = m.forward([tokens[-1]], cache)[-1]
    return prefill, steps, tokens


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def engines(variant):
    return {kind: load(gguf_file(variant, kind)) for kind in ("f32", *QUANTIZED)}


@pytest.fixture(scope="module")
def hf_engine(variant):
    engine = load(DATA / variant / "hf")
    m = engine.model
    assert m.embed.format == "bf16"  # the fixture's HF weights: their scale is rounded to bf16, as transformers does
    m.embed_scale = math.sqrt(engine.arch.args.hidden_size)
    if m.per_layer_dim:
        m.pl_embed_scale = math.sqrt(m.per_layer_dim)
    return engine


# --- the F32 file against the HF directory it was converted from --------------------------------------------------


def test_f32_gguf_equals_lumen_on_the_hf_directory(variant, engines, hf_engine):
    ours = engines["f32"]
    vocab = ours.model.vocab_size
    ids = ids_for(vocab)
    prefill, steps, tokens = lumen_run(ours, ids)
    ref_prefill, ref_steps, _ = lumen_run(hf_engine, ids)
    assert prefill.shape == (PROMPT_LEN, vocab)
    assert np.abs(prefill - ref_prefill[:, :vocab]).max() <= EXACT
    # greedy over the GGUF's vocabulary on both sides, the same tokens fed to both
    ref_cache = hf_engine.model.new_cache(CONTEXT)
    ref_logits = hf_engine.model.forward(ids, ref_cache)[-1]
    for step, token in enumerate(tokens):
        assert np.abs(steps[step] - ref_logits[:vocab]).max() <= EXACT, f"step {step}"
        assert token == int(np.argmax(ref_logits[:vocab]))
        ref_logits = hf_engine.model.forward([token], ref_cache)[-1]
    assert ref_steps  # the HF engine decodes too


# --- F16 / Q8_0 / Q4_K_M against transformers on the GGUF's own weights -------------------------------------------


def reference_with_gguf_weights(variant: str, kind: str):
    """transformers' model from the HF directory (f32), every weight replaced by the GGUF's, dequantized by
    ``gguf.quants.dequantize`` (what transformers' own GGUF loader uses). Returns (model, GGUF vocabulary size)."""
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DATA / variant / "hf", dtype=torch.float32).eval()
    state = model.state_dict()
    reader = gguf.GGUFReader(str(gguf_file(variant, kind)))
    assigned, vocab = set(), None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # the partial RoPE factor, already in the HF config
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            hf = f"model.layers.{layer}.{REF_LAYER[rest]}"
        else:
            hf = REF_GLOBAL[t.name]
        values = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        target = state[hf]
        if hf == "model.embed_tokens.weight":  # cut to the tokenizer's size by the converter
            vocab = values.shape[0]
            target = target[:vocab]
        assert tuple(values.shape) == tuple(target.shape), (t.name, hf)
        with torch.no_grad():
            target.copy_(values)
        assigned.add(hf)
    unassigned = {k for k in state if k not in assigned and k != "lm_head.weight"}  # lm_head: tied
    assert not unassigned, unassigned
    return model, vocab


@pytest.mark.parametrize("kind", QUANTIZED)
def test_quantized_gguf_equals_transformers_on_its_weights(variant, engines, kind):
    ours = engines[kind]
    ref, vocab = reference_with_gguf_weights(variant, kind)
    assert ours.model.vocab_size == vocab
    ids = ids_for(vocab, seed=1)
    prefill, steps, tokens = lumen_run(ours, ids)
    with torch.no_grad():
        theirs = ref(input_ids=torch.tensor([ids])).logits[0, :, :vocab].numpy()
        assert np.abs(prefill - theirs).max() <= TOL
        seq = list(ids)
        for step, token in enumerate(tokens):
            logits = ref(input_ids=torch.tensor([seq])).logits[0, -1, :vocab].numpy()
            assert np.abs(steps[step] - logits).max() <= TOL, f"step {step}"
            assert token == int(np.argmax(logits)), f"step {step}"
            seq.append(token)


def test_block_quantized_weights_stay_in_their_format(variant, engines):
    """Q8_0 / Q4_K_M matrices (routed experts included: one matrix per expert, split from llama.cpp's stacked
    tensor) reach the CPU in their GGUF block format, computed by the fused kernels, or (4-6-bit formats held in
    RAM) as their int8 codes (lumen_cpu.int8): never widened to floats."""
    from lumen_cpu.backend import CPUBackend

    for kind in ("q8_0", "q4_k_m"):
        engine = engines[kind]
        ckpt = GGUFCheckpoint(gguf_file(variant, kind))
        formats = {}
        for tensors in engine.weights.values():
            for name, w in tensors.items():
                if hasattr(w, "format"):
                    formats[name] = w.format
        block = {n: f for n, f in formats.items() if f not in ("f32", "f16")}
        assert block, kind
        if engine.arch.moe:
            experts = {n: f for n, f in formats.items() if ".experts." in n}
            assert experts and all(f != "f32" for f in experts.values()), experts
            stacked = {ckpt.ggml_type(f"blk.0.{n}").lower() for n in ("ffn_gate_up_exps.weight",
                                                                       "ffn_down_exps.weight")}
            assert {CPUBackend.stored_format(f, "ram") for f in stacked} == {
                formats[f"model.layers.0.experts.0.{n}.weight"] for n in ("gate_up_proj", "down_proj")}


def test_experts_mapped_from_the_file_give_the_same_logits():
    """store mmap: every matrix, per-expert byte ranges included, is a view on the mapped file. The same values as
    the int8 layout of store ram (bit for bit: tests/test_int8_repack.py), summed in another order (the int8
    layout's C kernels): logits equal to f32 rounding."""
    path = gguf_file("gemma4-moe", "q4_k_m")
    ram = load(path)
    mapped = load(path, store="mmap", **{"hidden-layers": {"kv-cache": {"context-size": CONTEXT},
                                                            "experts": {"store": "mmap"}}})
    assert {e.store for e in mapped.plan.entries if e.component.endswith(".experts")} == {"mmap"}
    ids = ids_for(ram.model.vocab_size, seed=3)
    a = ram.model.forward(ids, ram.model.new_cache(CONTEXT), all_logits=True)
    b = mapped.model.forward(ids, mapped.model.new_cache(CONTEXT), all_logits=True)
    assert np.abs(b - a).max() <= 1e-5 * np.abs(a).max()


# --- config and tensors ------------------------------------------------------------------------------------------


def test_config_from_gguf_agrees_with_the_hf_config(variant):
    from lumen_models_gemma.gemma4 import Gemma4

    from lumen_core.checkpoint import open_checkpoint
    from lumen_core.plugins import get_registry

    ours = Gemma4.from_checkpoint(GGUFCheckpoint(gguf_file(variant, "q8_0")))
    theirs = Gemma4.from_checkpoint(open_checkpoint(DATA / variant / "hf", get_registry()))
    a, b = ours.args, theirs.args
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_activation", "max_position_embeddings", "pad_token_id",
                "tie_word_embeddings", "attention_bias", "sliding_window", "layer_types", "final_logit_softcapping",
                "hidden_size_per_layer_input", "attention_k_eq_v", "num_kv_shared_layers", "enable_moe_block",
                "num_experts", "top_k_experts", "moe_intermediate_size"):
        assert getattr(a, key) == getattr(b, key), key
    if b.num_kv_shared_layers:
        assert a.use_double_wide_mlp == b.use_double_wide_mlp
    assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps, rel=1e-6)  # stored as an f32
    assert ours.specs == theirs.specs  # every layer's type, head_dim, KV heads, window, KV sharing, k_eq_v
    assert ours.rope_parameters() == theirs.rope_parameters()
    assert ours.inv_freq == theirs.inv_freq
    assert (ours.num_layers, ours.max_context, ours.per_layer_dim, ours.moe, ours.final_softcap) == \
        (theirs.num_layers, theirs.max_context, theirs.per_layer_dim, theirs.moe, theirs.final_softcap)
    # the vocabulary: the converter cuts the embedding to the tokenizer's size
    tokens = len(GGUFCheckpoint(gguf_file(variant, "q8_0")).metadata["tokenizer.ggml.tokens"])
    assert ours.vocab_size == tokens <= theirs.vocab_size


@pytest.mark.parametrize("kind", ("f32", *QUANTIZED))
def test_every_gguf_tensor_is_used_or_skipped_on_purpose(variant, engines, kind):
    engine = engines[kind]
    report = engine.report
    assert report.unused == []
    assert set(report.skipped) == {"rope_freqs.weight"}  # read at load as the full layers' partial RoPE factor
    ckpt = GGUFCheckpoint(gguf_file(variant, kind))
    experts = engine.arch.args.num_experts or 0
    expected = sum(experts if "_exps.weight" in n else 1 for n in ckpt.tensors) - 1  # stacked experts split
    assert len(report.loaded) == expected


def test_rope_freqs_give_the_partial_rotary_factor():
    from lumen_models_gemma.gemma4 import Gemma4

    arch = Gemma4.from_checkpoint(GGUFCheckpoint(gguf_file("gemma4-dense", "f32")))
    full = arch.rope_parameters()["full_attention"]
    assert full["rope_type"] == "proportional" and full["partial_rotary_factor"] == 0.25
    inv = arch.inv_freq["full_attention"]
    assert len(inv) == 16 and all(f > 0 for f in inv[:4]) and all(f == 0 for f in inv[4:])


def test_what_only_the_tensors_say():
    """No metadata key says k_eq_v, a separate head or an MoE block: the tensor names do (llama.cpp reads them the
    same way); stacked experts map to one name per expert."""
    from lumen_models_gemma.gemma4 import Gemma4

    ckpt = GGUFCheckpoint(gguf_file("gemma4-moe", "q8_0"))
    names = list(ckpt.tensors)
    config = Gemma4.config_from_gguf(ckpt.metadata)
    mapping = Gemma4.gguf_tensor_map(config, names)
    assert config["enable_moe_block"] and config["tie_word_embeddings"] and not config["attention_k_eq_v"]
    assert set(mapping) == set(names) - {"rope_freqs.weight"}
    split = mapping["blk.1.ffn_gate_up_exps.weight"]
    assert [n for n, _ in split] == [f"model.layers.1.experts.{e}.gate_up_proj.weight" for e in range(4)]
    assert all(t is None for v in mapping.values() for _, t in (v if isinstance(v, list) else [v]))  # no 1 + w
    # full layers with k and no v: k_eq_v; an output tensor: an untied head
    k_eq_v = [n for n in names if n != "blk.1.attn_v.weight"] + ["output.weight"]
    config = Gemma4.config_from_gguf(ckpt.metadata)
    mapping = Gemma4.gguf_tensor_map(config, k_eq_v)
    assert config["attention_k_eq_v"] and not config["tie_word_embeddings"]
    assert mapping["output.weight"] == ("lm_head.weight", None)
    assert Gemma4(config).specs[1].k_eq_v and not Gemma4(config).specs[0].k_eq_v


# --- errors name the GGUF key ------------------------------------------------------------------------------------


def broken(variant: str, edit) -> GGUFCheckpoint:
    ckpt = GGUFCheckpoint(gguf_file(variant, "q8_0"))
    edit(ckpt.metadata)
    return ckpt


def _set(key, value):
    def edit(meta):
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    return edit


@pytest.mark.parametrize(("variant_name", "key", "value", "message"), [
    ("gemma4-dense", "gemma4.block_count", None, "'gemma4.block_count' is missing"),
    ("gemma4-dense", "gemma4.embedding_length", "32", "'gemma4.embedding_length' must be a positive integer; it "
     "is the string '32'"),
    ("gemma4-dense", "gemma4.attention.head_count", 0, "'gemma4.attention.head_count' must be a positive integer"),
    ("gemma4-dense", "gemma4.attention.head_count_kv", 3, "'gemma4.attention.head_count_kv' must divide"),
    ("gemma4-dense", "gemma4.attention.sliding_window_pattern", None,
     "'gemma4.attention.sliding_window_pattern' must hold one flag per layer (4); it is missing"),
    ("gemma4-dense", "gemma4.attention.sliding_window_pattern", [True, False],
     "'gemma4.attention.sliding_window_pattern' must hold one flag per layer (4); it is 2 values"),
    ("gemma4-dense", "gemma4.attention.sliding_window", None, "'gemma4.attention.sliding_window' is missing"),
    ("gemma4-dense", "gemma4.attention.layer_norm_rms_epsilon", -1.0,
     "'gemma4.attention.layer_norm_rms_epsilon' must be a positive number"),
    ("gemma4-dense", "gemma4.rope.freq_base", float("nan"), "'gemma4.rope.freq_base' must be a positive number"),
    ("gemma4-dense", "gemma4.attention.key_length_swa", 1.5, "'gemma4.attention.key_length_swa' must be a positive "
     "integer"),
    ("gemma4-dense", "gemma4.rope.dimension_count", 8, "'gemma4.rope.dimension_count' must equal the key length"),
    ("gemma4-e2b", "gemma4.feed_forward_length", [128, 128], "'gemma4.feed_forward_length' must hold one value per "
     "layer (4); it holds 2"),
    ("gemma4-e2b", "gemma4.attention.shared_kv_layers", 4, "'gemma4.attention.shared_kv_layers' must be below"),
    ("gemma4-moe", "gemma4.expert_count", None, "'gemma4.expert_count' is missing, but the file has MoE routers"),
    ("gemma4-moe", "gemma4.expert_used_count", 9, "'gemma4.expert_used_count' must be at most expert_count (4)"),
    ("gemma4-moe", "gemma4.expert_feed_forward_length", None, "'gemma4.expert_feed_forward_length' is missing"),
])
def test_a_missing_or_corrupt_metadata_key_is_named(variant_name, key, value, message):
    from lumen_models_gemma.gemma4 import Gemma4

    ckpt = broken(variant_name, _set(key, value))
    with pytest.raises(CheckpointError) as info:
        Gemma4.from_checkpoint(ckpt)
    text = str(info.value)
    assert str(ckpt.path) in text and "GGUF metadata" in text and message in text, text


def test_a_layer_count_that_disagrees_with_the_tensors_names_the_key():
    from lumen_models_gemma.gemma4 import Gemma4

    def edit(meta):
        meta["gemma4.block_count"] = 2
        meta["gemma4.attention.sliding_window_pattern"] = [True, False]
    with pytest.raises(CheckpointError, match=r"GGUF metadata 'gemma4.block_count' says the model has 2 layers"):
        Gemma4.from_checkpoint(broken("gemma4-dense", edit))


def test_corrupt_rope_freqs_are_refused_naming_the_tensor(tmp_path):
    from lumen_models_gemma.gemma4 import Gemma4

    path = tmp_path / "bad.gguf"
    shutil.copy(gguf_file("gemma4-dense", "f32"), path)
    ckpt = GGUFCheckpoint(path)
    start = ckpt._entries["rope_freqs.weight"].start
    with open(path, "r+b") as f:  # the first rotated pair's factor 1 -> 2
        f.seek(start)
        f.write(np.float32(2.0).tobytes())
    with pytest.raises(CheckpointError, match=r"tensor 'rope_freqs.weight' must hold 16 factors"):
        Gemma4.from_checkpoint(GGUFCheckpoint(path))


def test_a_fused_qkv_file_is_refused_by_name():
    from lumen_models_gemma.gemma4 import Gemma4

    ckpt = GGUFCheckpoint(gguf_file("gemma4-dense", "f32"))
    ckpt.tensors = {("blk.0.attn_qkv.weight" if n == "blk.0.attn_q.weight" else n): t for n, t in ckpt.tensors.items()}
    with pytest.raises(CheckpointError, match=r"'blk.0.attn_qkv.weight': a fused attn_qkv"):
        Gemma4.from_checkpoint(ckpt)


# --- tokenizer, CLI ----------------------------------------------------------------------------------------------


def test_gguf_tokenizer_encodes_like_the_hf_one(variant):
    from lumen_core.tokenizer import Tokenizer

    ours = GGUFCheckpoint(gguf_file(variant, "q8_0")).load_tokenizer()
    theirs = Tokenizer.from_dir(DATA / variant / "hf")
    for text in ("Hello, world!", "The quick brown fox", "  two spaces\n\nand newlines", "<|turn>user\nhi<turn|>",
                 "naïve café 🙂"):
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids), text
    assert ours.bos_id == theirs.bos_id == ours.encode("x")[0]
    # HF also stops on <turn|> (generation_config); from the GGUF the Gemma 4 chat format stops on its text
    assert ours.eos_ids <= theirs.eos_ids and ours.token_to_id("<turn|>") in theirs.eos_ids
    chat = [{"role": "user", "content": "Hi!"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat)


def test_cli_generate_from_a_gguf_file(capsys):
    from test_cli import run

    path = gguf_file("gemma4-moe", "q4_k_m")
    code, out, err = run(capsys, "generate", "--config", str(path), "--prompt", "The quick brown fox", "-n", "6",
                         "--temperature", "0")
    assert code == 0, err
    assert out.strip() and "generated" in err


# --- llama.cpp itself (where llama-cpp-python is installed) ------------------------------------------------------


# llama.cpp's CPU kernels are not exact: GELU from an f16 table, and against block-quantized weights the activations
# are quantized to 8 bits too. Measured max |logit difference| on these files (logits up to ~1.3): F32 0.003,
# F16 0.009, Q8_0 0.14-0.32, Q4_K_M 0.09-0.26.
LLAMA_CPP_NOISE = {"f32": 0.02, "f16": 0.02, "q8_0": 0.5, "q4_k_m": 0.5}


@pytest.mark.parametrize("kind", ("f32", *QUANTIZED))
def test_greedy_tokens_agree_with_llama_cpp(variant, engines, kind):
    """F32 / F16: the same greedy tokens as llama.cpp. Q8_0 / Q4_K_M: llama.cpp's greedy tokens, fed to Lumen, are
    each Lumen's own choice or within llama.cpp's measured noise of it (a near tie its 8-bit activations flip)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    if variant == "gemma4-e2b":
        pytest.skip("llama.cpp refuses this fixture: its per_layer_token_embd has 1000 rows (the HF "
                    "vocab_size_per_layer_input) and llama.cpp wants one per token (999)")
    path = gguf_file(variant, kind)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=CONTEXT, n_batch=CONTEXT, n_threads=2, logits_all=True,
                          type_k=0, type_v=0, verbose=False)  # f32 KV cache, as Lumen's here
    m = engines[kind].model
    assert llm.n_vocab() == m.vocab_size
    ids = ids_for(llm.n_vocab(), seed=2)
    llm.eval(ids)
    cache = m.new_cache(CONTEXT)
    ours = m.forward(ids, cache, all_logits=True)
    noise = float(np.abs(ours - np.array(llm.scores[:len(ids)])).max())
    assert noise <= LLAMA_CPP_NOISE[kind]
    logits, agreed = ours[-1], 0
    for _ in range(8):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        assert logits[token] >= logits.max() - noise
        agreed += token == int(np.argmax(logits))
        llm.eval([token])
        logits = m.forward([token], cache)[-1]
    if kind in ("f32", "f16"):
        assert agreed == 8
