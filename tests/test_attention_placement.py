"""LumenLLM's ``model.attention`` block places every layer's token mixer (full attention and Gated-DeltaNet weights)
apart from the rest of its layer (issue 16): ``hidden-layers.store: ram`` + ``attention.store: vram`` keeps the
mixers in VRAM and streams only the MLP / MoE weights from host RAM.

On the CPU the same split is ``attention.store: ram`` with the layers in ``mmap``: the stores differ, the numbers may
not, so greedy tokens and logits equal the all-in-RAM run exactly. On the GPU, tests/test_cuda_lumenllm.py runs
LumenLLM's three published examples as written.
"""

from __future__ import annotations

import numpy as np
import pytest

import lumen_core as lumen
from lumen_core.config import Placement, load_config
from lumen_core.errors import ConfigError
from lumen_core.sampling import SamplingParams

MOE_GEMMA = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
KINDS = {"qwen3_5": ("qwen3_5", {}), "qwen3_5_moe": ("qwen3_5_moe", {}), "gemma3": ("gemma3", {}),
         "gemma4": ("gemma4", {}), "gemma4-moe": ("gemma4", MOE_GEMMA)}
CONTEXT = 128


def split(path, compute="cpu", layers="mmap", attention="ram", **model) -> dict:
    return {"model": {"path": str(path), "compute": compute, "store": layers, "attention": {"store": attention},
                      "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}, **model}}


def whole(path, compute="cpu", store="ram") -> dict:
    return {"model": {"path": str(path), "compute": compute, "store": store,
                      "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}}}


def rows(engine) -> dict[str, tuple[str, str, int]]:
    return {e.component: (e.device, e.store, e.nbytes) for e in engine.plan.entries if e.kind == "weights"}


def greedy(engine, ids, n=6) -> list[int]:
    return list(engine.generate_tokens(ids, n, SamplingParams(temperature=0.0)))


@pytest.mark.parametrize("name", sorted(KINDS))
def test_token_mixers_stored_apart_on_the_cpu_compute_exactly_the_same(name, tiny_checkpoint):
    kind, overrides = KINDS[name]
    path = tiny_checkpoint(kind, **overrides)
    apart, ref = lumen.load(split(path), progress=False), lumen.load(whole(path), progress=False)
    mine, theirs = rows(apart), rows(ref)
    n = apart.arch.num_layers
    for i in range(n):
        assert mine[f"layers.{i}.attention"][1] == "ram" and mine[f"layers.{i}"][1] == "mmap"
        # the split moves bytes between the two rows, never adds or drops any
        assert mine[f"layers.{i}.attention"][2] + mine[f"layers.{i}"][2] == theirs[f"layers.{i}"][2]
        assert mine[f"layers.{i}.attention"][2] > 0
    assert sum(b for _, _, b in mine.values()) == sum(b for _, _, b in theirs.values())
    # every tensor a mixer row holds is a token-mixer tensor, and it is loaded where the plan says
    for i in range(n):
        names = [k for k in apart.weights[("layer", i)] if apart.arch.is_mixer(k)]
        assert names and all(".self_attn." in k or ".linear_attn." in k for k in names)
    ids = np.random.RandomState(3).randint(3, ref.model.vocab_size, 20).tolist()
    a = apart.model.forward(ids, apart.model.new_cache(CONTEXT), all_logits=True)
    b = ref.model.forward(ids, ref.model.new_cache(CONTEXT), all_logits=True)
    np.testing.assert_array_equal(a, b)
    assert greedy(apart, ids) == greedy(ref, ids)


def test_no_split_where_the_attention_block_says_what_the_layer_says(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5")
    engine = lumen.load(split(path, layers="ram", attention="ram"), progress=False)
    assert not [c for c in rows(engine) if c.endswith(".attention")]


def test_the_attention_block_follows_ranges_and_only_splits_where_it_differs(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5")
    raw = split(path, layers="ram", attention="ram")
    raw["model"]["hidden-layers"]["ranges"] = [{"start": 2, "end": 4, "store": "mmap"}]
    engine = lumen.load(raw, progress=False)
    got = rows(engine)
    assert [c for c in got if c.endswith(".attention")] == ["layers.2.attention", "layers.3.attention"]
    assert got["layers.2"][1] == "mmap" and got["layers.2.attention"][1] == "ram" and got["layers.0"][1] == "ram"


def test_show_plan_lists_the_token_mixers_apart(tiny_checkpoint, write_config, capsys):
    from lumen_core.cli import main

    path = tiny_checkpoint("qwen3_5_moe")
    try:
        main(["show-plan", "--config", str(write_config(split(path)))])
    except SystemExit as exc:
        assert not exc.code
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("layers.0.attention "))
    assert line.split()[1:4] == ["cpu", "cpu", "ram"]


def test_placements_resolve_from_the_attention_block():
    raw = {"model": {"path": "m", "compute": "cuda:0", "store": "vram", "attention": {"store": "gpu"},
                     "hidden-layers": {"store": "ram", "ranges": [{"start": 4, "end": 8, "store": "vram"}]}}}
    config = load_config(raw)
    assert config.placement("attention", 0) == Placement("cuda:0", "vram")
    assert config.placement("layer", 0) == Placement("cuda:0", "ram")
    assert config.placement("experts", 0) == Placement("cuda:0", "ram")
    assert config.placement("attention", 5) == config.placement("layer", 5) == Placement("cuda:0", "vram")
    # without the block a mixer goes with its layer
    del raw["model"]["attention"]
    assert load_config(raw).placement("attention", 0) == Placement("cuda:0", "ram")


def test_attention_store_vram_over_layers_on_the_cpu_is_refused_by_name():
    raw = {"model": {"path": "m", "compute": "cuda:0", "attention": {"store": "vram"},
                     "hidden-layers": {"ranges": [{"start": 2, "end": 4, "compute": "cpu", "store": "ram"}]}}}
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    err = info.value
    assert err.path == "model.attention.store"
    assert "needs a GPU compute device" in err.message and "model.hidden-layers.ranges[0]" in err.message
    # with its own compute the same attention block is fine: the mixers of the CPU range compute on cuda:0
    raw["model"]["attention"]["compute"] = "cuda:0"
    assert load_config(raw).placement("attention", 2) == Placement("cuda:0", "vram")


# ------------------------------------------------------------------ a mixer computed on another device
# (numpy_gpu: a stand-in cuda:0 that computes with numpy, tests/conftest.py)

@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("layers, attention", [("cpu", "cuda:0"), ("cuda:0", "cpu")])
def test_token_mixers_computed_on_another_device_equal_the_cpu(kind, layers, attention, tiny_checkpoint, numpy_gpu):
    path = tiny_checkpoint(kind)
    store = {"cpu": "ram", "cuda:0": "vram"}
    raw = {"model": {"path": str(path), "compute": layers, "store": store[layers],
                     "attention": {"compute": attention, "store": store[attention]},
                     "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}}}
    apart, ref = lumen.load(raw, progress=False), lumen.load(whole(path), progress=False)
    entries = {e.component: e for e in apart.plan.entries}
    for i in range(apart.arch.num_layers):
        assert (entries[f"layers.{i}"].device, entries[f"layers.{i}.attention"].device) == (layers, attention)
        assert entries[f"cache.layers.{i}"].device == attention  # the KV cache / recurrent state: with the mixer
        layer = apart.model.layers[i]
        assert layer.mixer_backend is apart.backends[("attention", i)] is not layer.backend
    ids = np.random.RandomState(3).randint(3, ref.model.vocab_size, 20).tolist()
    before = numpy_gpu.takes
    a = apart.model.forward(ids, apart.model.new_cache(CONTEXT), all_logits=True)
    assert numpy_gpu.takes - before >= apart.arch.num_layers  # every layer crossed to the stand-in and back
    b = ref.model.forward(ids, ref.model.new_cache(CONTEXT), all_logits=True)
    np.testing.assert_array_equal(a, b)
    assert greedy(apart, ids) == greedy(ref, ids)


def test_an_architecture_that_cannot_compute_its_mixers_apart_is_refused_by_name(tiny_checkpoint, numpy_gpu):
    from lumen_core.errors import ConfigError as Refused

    path = tiny_checkpoint("gemma4")
    raw = {"model": {"path": str(path), "compute": "cpu", "attention": {"compute": "cuda:0", "store": "vram"}}}
    with pytest.raises(Refused) as info:
        lumen.load(raw, progress=False)
    assert info.value.path == "model.attention"
    assert "gemma4 architecture cannot compute a layer's attention on another device" in info.value.message
    assert "set it to cpu" in info.value.fix
