"""Every config snippet of LumenLLM's configuration guide (its docs/CONFIG.md, commit fb79b28, quoted below as
written, comments dropped) loads in Lumen with the guide's meaning, or is refused naming the key and the reason
(issue 16, part 1). Where it loads, it runs: on this machine with every GPU device swapped for the CPU
(``on_cpu``: cuda:N -> cpu; a GPU store vram/gpu -> ram, and the guide's slower tier ram -> mmap so fast and slow
memory stay apart), a tiny checkpoint of the right architecture plans and generates exactly the tokens of the same
checkpoint with everything in RAM (on the CPU the store changes where bytes live, never the arithmetic).
"""

from __future__ import annotations

import copy

import pytest
from test_lumenllm_configs import refusal

import lumen_core as lumen
from lumen_core.config import Placement, load_config
from lumen_core.errors import ConfigError
from lumen_core.plan import check_features
from lumen_core.sampling import SamplingParams

# model: the guide's "model" snippet (its hidden-layers elided there: "{ ... }")
MODEL = {
    "path": "/path/to/Model-NVFP4",
    "compute": "cuda:0",
    "store": "vram",
    "input-layer": {"compute": "cuda:0", "store": "ram"},
    "output-layer": {"compute": "cuda:0", "store": "vram"},
    "attention": {"mechanism": "aegis-varlen", "compute": "cuda:0", "store": "vram"},
}
# hidden-layers: "the interesting one"
HIDDEN = {
    "compute": "cuda:0",
    "store": "ram",
    "experts": {"compute": "cpu", "store": "ram"},
    "kv-cache": {"context-size": 262144, "store": "vram", "type-k": "f16", "type-v": "f16"},
    "ranges": [
        {"start": 0, "end": 24, "store": "vram", "compute": "cuda:0"},
        {"start": 24, "end": 48, "store": "ram", "compute": "cpu"},
    ],
}
SAMPLING = {"temperature": 1.0, "top-p": 0.95, "top-k": 50, "min-p": 0.05}
VISION = {"compute": "cuda:0", "store": "vram"}
DRAFT = {"path": "/path/to/Draft-Or-EAGLE-Model", "compute": "cuda:0", "store": "vram", "num-draft-tokens": 4}
SERVER = {"host": "127.0.0.1", "port": 8080, "server-api": "openai", "api-keys": ["sk-..."]}
FP8_ATTENTION = {"compute-quantization": "fp8"}
LAYERS = 48


def on_cpu(value, kv: bool = False):
    if isinstance(value, dict):
        out = {k: on_cpu(v, kv or k == "kv-cache") for k, v in value.items()}
        if isinstance(out.get("compute"), str) and out["compute"].startswith("cuda:"):
            out["compute"] = "cpu"
        if "store" in out:
            out["store"] = {"vram": "ram", "gpu": "ram"}.get(out["store"], out["store"]) if kv else \
                {"vram": "ram", "gpu": "ram", "ram": "mmap"}.get(out["store"], out["store"])
        return out
    if isinstance(value, list):
        return [on_cpu(v, kv) for v in value]
    return value


@pytest.fixture(scope="module")
def moe48(tmp_path_factory):
    """A tiny Qwen 3.5 MoE with the guide's 48 layers (its ranges split 0-24 / 24-48)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kinds = (["linear_attention"] * 3 + ["full_attention"]) * (LAYERS // 4)
    return module.make("qwen3_5_moe", tmp_path_factory.mktemp("moe48"), num_hidden_layers=LAYERS,
                       layer_types=kinds, max_position_embeddings=262144)


def greedy(engine) -> list[int]:
    return list(engine.generate_tokens([5, 6, 7, 8], 6, SamplingParams(temperature=0.0)))


def everything_in_ram(path, context) -> dict:
    return {"model": {"path": str(path), "compute": "cpu", "store": "ram",
                      "hidden-layers": {"kv-cache": {"context-size": context}}}}


def test_the_model_snippet_with_its_sampling_defaults_means_what_the_guide_says():
    config = load_config({"model": {**MODEL, "other-parameters": SAMPLING}})
    assert config.placement("input-layer") == Placement("cuda:0", "ram")
    assert config.placement("output-layer") == Placement("cuda:0", "vram")
    assert config.placement("layer", 3) == Placement("cuda:0", "vram")  # "default tier for dense weights"
    assert config.placement("attention", 3) == Placement("cuda:0", "vram")
    assert config.sampling_defaults() == {"temperature": 1.0, "top_p": 0.95, "top_k": 50, "min_p": 0.05}


def test_the_hidden_layers_snippet_means_what_the_guide_says():
    config = load_config({"model": {"path": "m", "compute": "cuda:0", "hidden-layers": HIDDEN}})
    assert config.placement("layer", 0) == config.placement("layer", 23) == Placement("cuda:0", "vram")
    assert config.placement("layer", 24) == config.placement("layer", 47) == Placement("cpu", "ram")
    assert config.placement("experts", 0) == config.placement("experts", 47) == Placement("cpu", "ram")
    kv = config.kv_cache()
    assert (kv.context_size, kv.store, kv.type_k, kv.type_v) == (262144, "vram", "f16", "f16")


def test_the_hidden_layers_snippet_runs_on_the_cpu_as_everything_in_ram_does(moe48):
    raw = on_cpu({"model": {"path": str(moe48), "compute": "cuda:0", "store": "vram", "hidden-layers": HIDDEN}})
    theirs = lumen.load(raw, progress=False)
    ours = lumen.load(everything_in_ram(moe48, 262144), progress=False)
    stores = {e.component: e.store for e in theirs.plan.entries if e.kind == "weights"}
    assert stores["layers.0"] == "ram" and stores["layers.24"] == "mmap" and stores["layers.47.experts"] == "mmap"
    assert greedy(theirs) == greedy(ours)


def test_the_model_snippet_runs_on_the_cpu_with_the_mixers_apart(moe48):
    """On the CPU the guide's model block keeps attention (vram -> ram) apart from layers in the slower tier."""
    model = on_cpu({**MODEL, "path": str(moe48), "store": "ram", "other-parameters": SAMPLING,
                    "hidden-layers": {"kv-cache": {"context-size": 4096}}})
    theirs = lumen.load({"model": model}, progress=False)
    stores = {e.component: e.store for e in theirs.plan.entries if e.kind == "weights"}
    assert stores["layers.5.attention"] == "ram" and stores["layers.5"] == "mmap"
    assert greedy(theirs) == greedy(lumen.load(everything_in_ram(moe48, 4096), progress=False))


def test_the_model_and_hidden_layers_snippets_together(moe48, numpy_gpu):
    """The guide's model block over its hidden-layers block: the attention of every layer on cuda:0 in VRAM, also for
    layers 24-47 that the ranges compute on the CPU (their MLP there, their token mixers and KV caches on the GPU).
    Run with a numpy stand-in for cuda:0 (tests/test_attention_placement.py), at a 4096-token context: the same
    tokens as everything on the CPU with the same f16 KV cache."""
    config = load_config({"model": {**MODEL, "hidden-layers": HIDDEN}})
    assert config.placement("layer", 30) == Placement("cpu", "ram")
    assert config.placement("attention", 30) == Placement("cuda:0", "vram")
    assert config.placement("experts", 30) == Placement("cpu", "ram")
    hidden = copy.deepcopy(HIDDEN)
    hidden["kv-cache"]["context-size"] = 4096
    engine = lumen.load({"model": {**MODEL, "path": str(moe48), "hidden-layers": hidden}}, progress=False)
    devices = {e.component: e.device for e in engine.plan.entries}
    assert devices["layers.30"] == "cpu" and devices["layers.30.attention"] == "cuda:0"
    assert devices["cache.layers.30"] == "cuda:0" and "layers.3.attention" not in devices  # 0-23: with the layer
    ref = everything_in_ram(moe48, 4096)
    ref["model"]["hidden-layers"]["kv-cache"].update({"type-k": "f16", "type-v": "f16"})
    assert greedy(engine) == greedy(lumen.load(ref, progress=False))


def test_the_recipes():
    # "35B MoE that won't fit in VRAM": stream experts, KV in fp8
    recipe = {"model": {**MODEL, "hidden-layers": {"store": "ram",
                                                   "kv-cache": {"type-k": "fp8", "type-v": "fp8"}}}}
    config = load_config(recipe)
    assert config.placement("experts", 0) == Placement("cuda:0", "ram")
    assert config.placement("attention", 0) == Placement("cuda:0", "vram")
    # "Trade PCIe for CPU compute"
    config = load_config({"model": {**MODEL, "hidden-layers": {"experts": {"compute": "cpu", "store": "ram"}}}})
    assert config.placement("experts", 0) == Placement("cpu", "ram")
    # "Max long-context speed": fp8 attention needs the fp8 cache; then the plan refuses it naming the backend that
    # computes the attention (the cpu backend has no FP8 attention; cuda has)
    kv = {"kv-cache": {"type-k": "fp8", "type-v": "fp8"}}
    load_config({"model": {**MODEL, "attention": {**MODEL["attention"], **FP8_ATTENTION}, "hidden-layers": kv}})
    err = refusal({"model": {**MODEL, "attention": FP8_ATTENTION}})
    assert err.path == "model.attention.compute-quantization" and "fp8 KV cache" in err.message


def test_fp8_attention_is_refused_naming_the_backend(moe48):
    raw = on_cpu({"model": {**MODEL, "path": str(moe48), "attention": FP8_ATTENTION,
                            "hidden-layers": {"kv-cache": {"context-size": 256, "type-k": "fp8", "type-v": "fp8"}}}})
    with pytest.raises(ConfigError) as info:
        lumen.load(raw, progress=False)
    err = info.value
    assert err.path == "model.attention.compute-quantization"
    assert "not implemented by backend 'cpu'" in err.message and '"default"' in err.fix


@pytest.mark.parametrize("block, value, path, words", [
    ("audio", VISION, "audio", "audio tower"),
])
def test_the_audio_snippet_is_refused_by_name(block, value, path, words):
    config = load_config({"model": copy.deepcopy(MODEL), block: value})
    with pytest.raises(Exception) as info:
        check_features(config)
    assert f"config {path}:" in str(info.value) and words in str(info.value)
    assert "unknown key" not in str(info.value)


def test_the_draft_snippet_reads_as_a_draft_model_with_its_placement():
    """Speculative decoding is planned (issue 20): the guide's flat draft is a draft model on cuda:0 in VRAM,
    proposing 4 tokens a step, no longer a refused feature."""
    config = load_config({"model": copy.deepcopy(MODEL), "draft": DRAFT})
    check_features(config)
    spec = config.draft()
    assert (spec.tokens, spec.mtp) == (4, False)
    assert spec.config.placement("layer", 0) == Placement("cuda:0", "vram")
    assert str(spec.config.model_path) == DRAFT["path"]


def test_the_vision_snippet_places_the_tower_and_a_text_only_checkpoint_refuses_it(moe48):
    config = load_config({"model": copy.deepcopy(MODEL), "vision": VISION})
    assert config.placement("vision") == Placement("cuda:0", "vram") and config.requested_features() == []
    with pytest.raises(ConfigError) as info:
        lumen.load(on_cpu({"model": {"path": str(moe48)}, "vision": VISION}), progress=False)
    assert info.value.path == "vision" and "without a vision tower" in info.value.message


def test_the_server_snippet():
    config = load_config({"model": {"path": "m"}, "server-parameters": SERVER})
    params = config.server_parameters()
    assert params["host"] == "127.0.0.1" and params["port"] == 8080 and params["server_api"] == "openai"
    assert params["api_keys"] == ["sk-..."]
