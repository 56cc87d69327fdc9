"""The plan: placement per component, bytes per component and pool, refusal before loading."""

from __future__ import annotations

import numpy as np
import pytest

import lumen_core as lumen
from lumen_core import plan as plan_mod
from lumen_core.errors import ConfigError, PlanError


def entries(engine_or_plan):
    plan = getattr(engine_or_plan, "plan", engine_or_plan)
    return {e.component: e for e in plan.entries}


@pytest.mark.parametrize("tied", [False, True])
def test_plan_bytes_equal_what_was_loaded(tiny_checkpoint, tied):
    engine = lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5_moe", tie_word_embeddings=tied))}},
                        progress=False)
    by_label, seen = entries(engine), set()
    for (block, layer), tensors in engine.weights.items():
        label = {"layer": f"layers.{layer}", "experts": f"layers.{layer}.experts"}.get(block, block)
        fresh = [t for t in tensors.values() if id(t) not in seen]  # a tied tensor is loaded (and counted) once
        seen.update(id(t) for t in tensors.values())
        assert by_label[label].nbytes == sum(getattr(t, "nbytes", 0) for t in fresh), label
    if tied:
        embed = "model.embed_tokens.weight"
        assert engine.weights[("input-layer", None)][embed] is engine.weights[("output-layer", None)][embed]


def test_cache_bytes_match_the_allocated_cache(tiny_checkpoint):
    engine = lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")),
                                   "hidden-layers": {"kv-cache": {"context-size": 100, "type-k": "f16",
                                                                  "type-v": "f16"}}}}, progress=False)
    cache = engine.model.new_cache(engine.context_size)
    by_label = entries(engine)
    for i, state in enumerate(cache.layers):
        arrays = [state.k, state.v] if hasattr(state, "k") else [state[0].x, state[1].s]
        assert by_label[f"cache.layers.{i}"].nbytes == sum(a.nbytes for a in arrays)
    assert cache.layers[3].k.dtype == np.float16


def test_ranges_and_experts_blocks_place_components(tiny_checkpoint):
    config = {"model": {"path": str(tiny_checkpoint("qwen3_5_moe")), "compute": "cpu", "store": "ram",
                        "hidden-layers": {"experts": {"store": "mmap"},
                                          "ranges": [{"start": 2, "end": 4, "store": "mmap"}]}}}
    engine = lumen.load(config, progress=False)
    e = entries(engine)
    assert e["layers.0"].store == "ram" and e["layers.0.experts"].store == "mmap"
    assert e["layers.2"].store == "mmap" and e["layers.3.experts"].store == "mmap"
    assert e["input-layer"].store == "ram"
    pools = engine.plan.pools()
    assert pools["mmap (page cache)"] == sum(x.nbytes for x in engine.plan.entries if x.store == "mmap")


def test_changing_only_the_config_moves_the_weights(tiny_checkpoint):
    """store: mmap keeps weights as views on the file; store: ram copies them into process memory."""
    path = str(tiny_checkpoint("qwen3_5_moe"))
    ram = lumen.load({"model": {"path": path, "store": "ram"}}, progress=False)
    mm = lumen.load({"model": {"path": path, "store": "ram", "hidden-layers": {"experts": {"store": "mmap"}}}},
                    progress=False)
    name = "model.layers.0.mlp.experts.0.up_proj.weight"
    assert ram.weights[("experts", 0)][name].data.flags.owndata
    assert not mm.weights[("experts", 0)][name].data.flags.owndata
    ids = list(range(3, 40))
    a = ram.model.forward(ids, ram.model.new_cache(64), all_logits=True)
    b = mm.model.forward(ids, mm.model.new_cache(64), all_logits=True)
    assert np.array_equal(a, b)
    assert ram.perplexity(ids) == mm.perplexity(ids)


def test_plan_that_does_not_fit_is_refused_before_loading(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(plan_mod, "host_available_bytes", lambda: 200_000)
    loaded = []
    monkeypatch.setattr("lumen_core.loader.load_component", lambda *a: loaded.append(a))
    with pytest.raises(PlanError, match=r"host RAM needs .* but 195.3 KiB is available.*Largest there"):
        lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5"))}}, progress=False)
    assert loaded == []


def test_huge_context_is_refused_naming_the_cache(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(plan_mod, "host_available_bytes", lambda: 50 << 20)
    with pytest.raises(PlanError, match="cache.layers.3.*context-size"):
        lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")),
                              "hidden-layers": {"kv-cache": {"context-size": 10_000_000,
                                                             "allow-beyond-trained-context": True}}}},
                   progress=False)


def _plan(path, kv: dict):
    from lumen_core.engine import prepare

    return prepare({"model": {"path": str(path), "hidden-layers": {"kv-cache": kv}}})[3]


def test_context_beyond_the_trained_context_is_refused_naming_both_numbers(tiny_checkpoint):
    """The tiny Qwen's max_position_embeddings is 4096: 4096 plans, 4097 is refused at the context-size key, with
    both numbers, the source of the limit and the override key, before a weight is read."""
    path = tiny_checkpoint("qwen3_5")
    assert _plan(path, {"context-size": 4096}).context_size == 4096
    with pytest.raises(ConfigError) as info:
        _plan(path, {"context-size": 4097})
    err = info.value
    assert err.path == "model.hidden-layers.kv-cache.context-size"
    assert "4097" in err.message and "4096" in err.message and "max_position_embeddings" in err.message
    assert "allow-beyond-trained-context: true" in err.fix and "at most 4096" in err.fix


def test_allow_beyond_trained_context_is_noted_never_silent(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5")
    beyond = _plan(path, {"context-size": 5000, "allow-beyond-trained-context": True})
    assert beyond.context_size == 5000
    assert [n for n in beyond.notes if "beyond the trained context of 4096" in n and "responsibility" in n]
    within = _plan(path, {"allow-beyond-trained-context": True})
    assert within.context_size == 4096
    assert any("allow-beyond-trained-context" in n and "no effect" in n for n in within.notes)
    assert not _plan(path, {"allow-beyond-trained-context": False}).notes


def test_context_check_names_the_gguf_key_and_skips_an_unknown_limit():
    from types import SimpleNamespace

    from lumen_core.config import KVCacheConfig

    gguf = SimpleNamespace(format="gguf", path="m.gguf")
    kv = KVCacheConfig(40_000, None, "f32", "f32")
    with pytest.raises(ConfigError, match=r"40000 is beyond the model's trained context of 32768 tokens \(GGUF "
                                          r"context_length of m.gguf\)"):
        plan_mod.check_context(kv, SimpleNamespace(max_context=32768), gguf)
    assert plan_mod.check_context(kv, SimpleNamespace(max_context=0), gguf) == []  # the checkpoint names no limit


def test_range_past_the_last_layer(tiny_checkpoint):
    with pytest.raises(ConfigError, match=r"ranges\[0\]\.end"):
        lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")),
                              "hidden-layers": {"ranges": [{"start": 0, "end": 9, "store": "mmap"}]}}})
    # end is exclusive (LumenLLM's meaning): end 4 on the 4-layer model ends at its last layer; 5 is past it.
    with pytest.raises(ConfigError) as info:
        lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")),
                              "hidden-layers": {"ranges": [{"start": 2, "end": 5, "store": "mmap"}]}}})
    assert "the model has 4 layers (0-3)" in info.value.message and info.value.fix == "set end to at most 4"


def test_range_end_is_exclusive_in_the_plan(tiny_checkpoint):
    engine = lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")), "hidden-layers": {
        "ranges": [{"start": 0, "end": 2, "store": "mmap"}, {"start": 2, "end": 4, "store": "ram"}]}}},
        progress=False)
    e = entries(engine)
    assert [e[f"layers.{i}"].store for i in range(4)] == ["mmap", "mmap", "ram", "ram"]
    assert engine.plan.notes == []


def test_an_end_that_reads_inclusive_is_noted_in_the_plan(tiny_checkpoint, capsys):
    """{0, 1} + {2, 3} on the 4-layer model, the inclusive way of writing two halves, leaves layers 1 and 3 in no
    range (hidden-layers' placement): loaded, with a note naming each layer and the fix."""
    engine = lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")), "hidden-layers": {
        "ranges": [{"start": 0, "end": 1, "store": "mmap"}, {"start": 2, "end": 3, "store": "mmap"}]}}},
        progress=False)
    assert [entries(engine)[f"layers.{i}"].store for i in range(4)] == ["mmap", "ram", "mmap", "ram"]
    assert engine.plan.notes == [
        "config model.hidden-layers.ranges[0].end: ranges end is exclusive (LumenLLM's meaning): layer 1 is in no "
        "range and uses hidden-layers' placement; if you meant it inclusive, set end to 2",
        "config model.hidden-layers.ranges[1].end: ranges end is exclusive (LumenLLM's meaning): layer 3 is in no "
        "range and uses hidden-layers' placement; if you meant it inclusive, set end to 4"]
    assert "layer 3 is in no range" in capsys.readouterr().err
    assert "note: config model.hidden-layers.ranges[1].end" in plan_mod.format_plan(engine.plan)


def test_kv_type_the_backend_cannot_keep(tiny_checkpoint):
    """A KV type outside the layer's backend's ``kv_types`` is refused with the types it can keep (the CPU keeps all
    four, and so does cuda, so a backend class that keeps fewer stands in)."""
    from lumen_core.config import load_config

    class Narrow:
        name, kv_types = "narrow", ("f32", "bf16")

    config = load_config({"model": {"path": str(tiny_checkpoint("qwen3_5")),
                                    "hidden-layers": {"kv-cache": {"type-k": "fp8", "type-v": "fp8"}}}})
    with pytest.raises(ConfigError, match=r"(?s)kv-cache.type-k.*cannot keep a fp8 KV cache.*f32, bf16"):
        plan_mod._check_kv_types(config, Narrow)


@pytest.mark.parametrize(("extra", "path", "words"), [
    ({"audio": {"compute": "cpu"}}, "audio", "not supported"),
    # a vision block over a text-only checkpoint: nothing to load, said by name
    ({"vision": {"compute": "cpu", "store": "ram"}}, "vision", "checkpoint without a vision tower"),
])
def test_features_not_yet_supported_are_refused_by_name(tiny_checkpoint, extra, path, words):
    with pytest.raises(ConfigError, match=f"config {path}.*{words}"):
        lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5"))}, **extra})


def test_f16_kv_cache_stays_close_to_f32(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3_5"))
    ids = list(range(3, 60))
    out = []
    for t in ("f32", "f16"):
        e = lumen.load({"model": {"path": path, "hidden-layers": {"kv-cache": {"type-k": t, "type-v": t}}}},
                       progress=False)
        out.append(e.model.forward(ids, e.model.new_cache(64), all_logits=True))
    assert 0 < np.abs(out[0] - out[1]).max() <= 1e-2


def test_experts_placement_on_a_dense_model_is_reported_not_silently_ignored(tiny_checkpoint, capsys):
    config = {"model": {"path": str(tiny_checkpoint("qwen3_5")),
                        "hidden-layers": {"experts": {"store": "mmap"},
                                          "ranges": [{"start": 0, "end": 2, "experts": {"store": "mmap"}}]}}}
    engine = lumen.load(config, progress=False)
    assert engine.plan.notes == [
        "config model.hidden-layers.experts: this model has no routed experts, so this placement has no effect",
        "config model.hidden-layers.ranges[0].experts: this model has no routed experts, so this placement has "
        "no effect",
    ]
    assert "no routed experts" in capsys.readouterr().err
    moe = lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5_moe")),
                                "hidden-layers": {"experts": {"store": "mmap"}}}}, progress=False)
    assert moe.plan.notes == []


def test_kv_cache_store_is_checked_against_each_layers_backend(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3_5"))
    ok = lumen.load({"model": {"path": path, "store": "mmap", "hidden-layers": {"kv-cache": {"store": "ram"}}}},
                    progress=False)
    assert {e.store for e in ok.plan.entries if e.kind == "cache"} == {"ram"}
    with pytest.raises(ConfigError, match=r"layers\.0 computes on backend 'cpu'.*'vram' there is not supported") as err:
        lumen.load({"model": {"path": path, "hidden-layers": {"kv-cache": {"store": "vram"}}}}, progress=False)
    assert "kv-cache.store" in str(err.value)


def test_expert_cache_setting_is_checked_and_never_silently_ignored(tiny_checkpoint):
    """experts.cache is per GPU (refused inside a range) and, where no experts stream to a GPU, reported as having
    no effect; the schema refuses a cache below 1."""
    path = str(tiny_checkpoint("qwen3_5_moe"))
    with pytest.raises(ConfigError) as info:
        lumen.load({"model": {"path": path, "hidden-layers": {
            "ranges": [{"start": 0, "end": 1, "experts": {"cache": 4}}]}}}, progress=False)
    assert info.value.path == "model.hidden-layers.ranges[0].experts.cache"
    assert "model.hidden-layers.experts.cache" in str(info.value)
    cpu = lumen.load({"model": {"path": path, "hidden-layers": {"experts": {"cache": 4}}}}, progress=False)
    assert cpu.plan.notes == ["config model.hidden-layers.experts.cache: no routed experts are streamed from host "
                              "memory to a GPU (experts.store ram with a GPU compute), so the cache has no effect"]
    assert not any(e.component.startswith("expert cache") for e in cpu.plan.entries)
    with pytest.raises(ConfigError) as info:
        lumen.load({"model": {"path": path, "hidden-layers": {"experts": {"cache": 0}}}}, progress=False)
    assert "cache" in info.value.path


def test_fit_advice_names_what_to_move():
    """A VRAM pool that holds routed experts is told to stream them or compute them on the CPU; any VRAM pool
    about ranges and the context; host RAM about mmap."""
    from lumen_core.plan import PlanEntry, fit_advice

    entries = [PlanEntry("model.layers.0.mlp.experts", "cuda", "cuda:0", "vram", "fp8", 3 << 30),
               PlanEntry("model.layers.0.attn", "cuda", "cuda:0", "vram", "bf16", 1 << 30)]
    vram = fit_advice("cuda:0 VRAM", entries)
    assert "experts: {compute: cuda:0, store: ram}" in vram and "3.00 GiB" in vram and "ranges" in vram
    assert "compute: cpu" in vram and "context-size" in vram
    dense = fit_advice("cuda:0 VRAM", entries[1:])
    assert "experts" not in dense and "ranges" in dense
    assert "store: mmap" in fit_advice("host RAM", entries)


def test_show_plan_names_the_page_locked_part_of_host_ram():
    """Streamed experts (a GPU's, store ram) are page-locked host memory: the host-RAM total says how much of it."""
    from lumen_core.plan import Plan, PlanEntry, format_plan

    plan = Plan([PlanEntry("model.layers.0.mlp.experts", "cuda", "cuda:0", "ram", "fp8", 3 << 30),
                 PlanEntry("model.embed_tokens", "cpu", "cpu", "ram", "bf16", 1 << 30),
                 PlanEntry("expert cache (32 experts)", "cuda", "cuda:0", "vram", "fp8", 100 << 20)],
                capacity={"host RAM": 8 << 30, "cuda:0 VRAM": 16 << 30})
    assert plan.pinned() == 3 << 30
    text = format_plan(plan)
    assert "total host RAM: 4.00 GiB of 8.00 GiB available (of which 3.00 GiB page-locked for GPU streaming)" in text
    assert "total cuda:0 VRAM: 100.0 MiB" in text
