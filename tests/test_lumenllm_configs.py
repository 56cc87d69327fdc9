"""LumenLLM's own published configs (tests/data/lumenllm/, copied verbatim) load as written with the same meaning, or
are refused naming the key and the reason; never as an unknown key (issue 16, part 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lumen_core.config import Placement, load_config
from lumen_core.errors import ConfigError
from lumen_core.plan import check_placement

DATA = Path(__file__).parent / "data" / "lumenllm"


def original(name: str) -> dict:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


# ------------------------------------------------------------------ store: gpu, store: mmap under a GPU


def test_store_gpu_is_vram_everywhere_a_store_is_taken():
    raw = {"model": {"path": "m", "compute": "cuda:0", "store": "gpu",
                     "input-layer": {"store": "gpu"}, "output-layer": {"store": "ram"},
                     "hidden-layers": {"store": "ram", "experts": {"store": "gpu"},
                                       "kv-cache": {"store": "gpu"},
                                       "ranges": [{"start": 0, "end": 2, "store": "gpu",
                                                   "experts": {"store": "gpu"}}]}},
           "vision": {"store": "gpu"}}
    config = load_config(raw)
    assert config.placement("input-layer") == Placement("cuda:0", "vram")
    assert config.placement("output-layer") == Placement("cuda:0", "ram")
    assert config.placement("layer", 0) == Placement("cuda:0", "vram")
    assert config.placement("layer", 2) == Placement("cuda:0", "ram")
    assert config.placement("experts", 0) == Placement("cuda:0", "vram")
    assert config.placement("experts", 2) == Placement("cuda:0", "vram")
    assert config.placement("vision") == Placement("cuda:0", "vram")
    assert config.kv_cache().store == "vram"
    assert "gpu" not in json.dumps(config.raw)


def test_store_gpu_on_the_cpu_is_refused_as_vram_is():
    with pytest.raises(ConfigError) as info:
        load_config({"model": {"path": "m", "compute": "cpu", "hidden-layers": {"store": "gpu"}}})
    assert info.value.path == "model.hidden-layers.store" and "needs a GPU compute device" in info.value.message


class _FakeGPU:
    """A backend like cuda's (stores vram and ram, no mmap), so the plan's reading of mmap runs without a GPU."""

    name = "cuda"
    stores = ("vram", "ram")
    expert_stores = ("ram",)
    kv_stores = ("vram",)
    kv_types = ("f32", "f16", "bf16", "fp8")

    @classmethod
    def device_info(cls, device):
        return None


class _FakeRegistry:
    def backend_class(self, name):
        assert name == "cuda"
        return _FakeGPU

    def ops_of(self, name):
        return set()


class _FakeArch:
    def required_ops(self, comp):
        return set()


def test_store_mmap_under_a_gpu_is_read_as_ram_with_a_note():
    config = load_config({"model": {"path": "m", "compute": "cuda:0", "store": "mmap",
                                    "output-layer": {"store": "vram"},
                                    "hidden-layers": {"ranges": [{"start": 1, "end": 2, "store": "mmap"}]}}})
    comps = [("input-layer", None), ("layer", 0), ("layer", 1), ("experts", 1), ("output-layer", None)]
    notes: list[str] = []
    placements = check_placement(config, _FakeArch(), _FakeRegistry(), comps, notes)
    assert placements[("input-layer", None)] == Placement("cuda:0", "ram")
    assert placements[("layer", 0)] == Placement("cuda:0", "ram")
    assert placements[("layer", 1)] == Placement("cuda:0", "ram")
    assert placements[("experts", 1)] == Placement("cuda:0", "ram")
    assert placements[("output-layer", None)] == Placement("cuda:0", "vram")
    assert len(notes) == 2, notes
    assert notes[0].startswith("model: store mmap under a GPU compute device is read as ram, as in LumenLLM")
    assert "input-layer" in notes[0] and "layers.0" in notes[0]
    assert notes[1].startswith("model.hidden-layers.ranges[0]: store mmap")
    # without a notes list nothing changes in what is resolved
    assert check_placement(config, _FakeArch(), _FakeRegistry(), comps) == placements


# ------------------------------------------------------------------ the published examples


def on_cpu(value):
    """The example with every GPU device swapped for the CPU (cuda:N -> cpu, and the GPU stores vram/gpu -> ram,
    which a CPU computes from): what is left is LumenLLM's layout and meaning, runnable here."""
    if isinstance(value, dict):
        out = {k: on_cpu(v) for k, v in value.items()}
        if isinstance(out.get("compute"), str) and out["compute"].startswith("cuda:"):
            out["compute"] = "cpu"
        if out.get("store") in ("vram", "gpu"):
            out["store"] = "ram"
        return out
    if isinstance(value, list):
        return [on_cpu(v) for v in value]
    return value


def test_qwen35_9b_as_written_loads_with_its_meaning():
    config = load_config(DATA / "parameters.qwen35-9b.json")
    assert config.placement("input-layer") == Placement("cuda:0", "ram")
    assert config.placement("output-layer") == Placement("cuda:0", "vram")
    assert config.placement("layer", 0) == Placement("cuda:0", "vram")
    kv = config.kv_cache()
    assert (kv.context_size, kv.store, kv.type_k, kv.type_v) == (4096, "vram", "f16", "f16")
    assert config.sampling_defaults() == {"temperature": 1.0, "top_p": 0.95, "top_k": 50, "min_p": 0.05}
    assert config.requested_features() == []


@pytest.mark.parametrize("name", ["parameters.qwen36-35b.json", "parameters.gemma4-26b-vision-draft.json"])
def test_attention_in_vram_with_layers_in_ram_places_the_token_mixers_apart(name):
    """LumenLLM's hidden-layers.store ram with attention.store vram: every layer's token mixer in VRAM, the rest of
    the layer (and its routed experts) in host RAM, streamed (tests/test_attention_placement.py runs it)."""
    config = load_config(DATA / name)
    assert config.placement("attention", 0) == Placement("cuda:0", "vram")
    assert config.placement("layer", 0) == Placement("cuda:0", "ram")
    assert config.placement("experts", 0) == Placement("cuda:0", "ram")
    assert config.placement_path("attention", 0) == "model.attention"


def _greedy(engine, n: int = 8) -> list[int]:
    from lumen_core.sampling import SamplingParams

    return list(engine.generate_tokens([1, 2, 3, 4], n, SamplingParams(temperature=0.0)))


@pytest.mark.parametrize("name, kind, context", [("parameters.qwen35-9b.json", "qwen3_5", 4096),
                                                  ("parameters.qwen36-35b.json", "qwen3_5_moe", 8192)])
def test_example_on_cpu_generates_what_the_native_config_does(tiny_checkpoint, name, kind, context):
    import lumen_core as lumen

    path = str(tiny_checkpoint(kind, max_position_embeddings=context))
    raw = on_cpu(original(name))
    raw["model"]["path"] = path
    native = {"model": {"path": path, "compute": "cpu", "store": "ram",
                        "hidden-layers": {"kv-cache": {"context-size": context, "store": "ram",
                                                       "type-k": "f16", "type-v": "f16"}},
                        "other-parameters": {"temperature": 1.0, "top-p": 0.95, "top-k": 50, "min-p": 0.05}}}
    theirs, ours = lumen.load(raw, progress=False), lumen.load(native, progress=False)
    assert [(e.component, e.device, e.store, e.nbytes) for e in theirs.plan.entries] == \
        [(e.component, e.device, e.store, e.nbytes) for e in ours.plan.entries]
    assert theirs.config.sampling_defaults() == ours.config.sampling_defaults()
    tokens = _greedy(theirs)
    assert len(tokens) == 8 and tokens == _greedy(ours)


def test_gemma4_vision_draft_on_cpu_plans_its_draft_at_the_main_context(tiny_checkpoint):
    """The example's flat draft (issue 20): planned beside the main model, its rows labelled draft.*, at the main
    model's context of 262144 tokens; the draft's Config as planned is what the engine loads the draft from."""
    from lumen_core.engine import prepare

    path = str(tiny_checkpoint("gemma4_mm", max_position_embeddings=262144))
    raw = on_cpu(original("parameters.gemma4-26b-vision-draft.json"))
    raw["model"]["path"] = raw["draft"]["path"] = path
    config = load_config(raw)  # LumenLLM's flat draft is read as Lumen's draft.model
    assert config.raw["draft"] == {"model": {"path": path, "compute": "cpu", "store": "ram"}, "num-draft-tokens": 4}
    assert config.placement("vision") == Placement("cpu", "ram")  # the vision block places the tower (issue 17)
    _, _, _, plan, resolved = prepare(config)
    labels = [e.component for e in plan.entries]
    assert {"vision", "draft.input-layer", "draft.layers.0", "draft.cache.layers.0",
            "draft.output-layer"} <= set(labels)
    assert not any(label.startswith("draft.vision") for label in labels)  # the draft has no vision block
    draft = resolved["draft_config"]
    assert draft.kv_cache().context_size == plan.context_size == 262144
    assert draft.placement("layer", 0) == Placement("cpu", "ram") and str(draft.model_path) == path


# ------------------------------------------------------------------ every key of LumenLLM's guide


def refusal(raw: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert "unknown key" not in str(info.value)
    return info.value


@pytest.mark.parametrize("mechanism", ["standard", "aegis-varlen", "reference"])
def test_attention_mechanisms_are_accepted_on_the_cpu(mechanism):
    assert load_config({"model": {"path": "m", "attention": {"mechanism": mechanism}}}).requested_features() == []


def test_reference_attention_on_a_gpu_layer_is_refused_by_name():
    raw = {"model": {"path": "m", "compute": "cuda:0", "attention": {"mechanism": "reference"},
                     "hidden-layers": {"ranges": [{"start": 2, "end": 4, "compute": "cpu"}]}}}
    err = refusal(raw)
    assert err.path == "model.attention.mechanism" and "reference attention on cuda:0" in err.message
    raw["model"]["compute"] = "cpu"
    raw["model"]["hidden-layers"]["ranges"][0]["compute"] = "cuda:1"
    err = refusal(raw)
    assert err.path == "model.attention.mechanism" and "model.hidden-layers.ranges[0]" in err.message


@pytest.mark.parametrize("value", ["none", "default", "bf16"])
def test_attention_not_in_fp8_is_no_requested_feature(value):
    raw = {"model": {"path": "m", "attention": {"compute-quantization": value}}}
    assert load_config(raw).requested_features() == []


def test_fp8_attention_is_still_a_requested_feature_and_needs_an_fp8_cache():
    kv = {"kv-cache": {"type-k": "fp8", "type-v": "fp8"}}
    raw = {"model": {"path": "m", "attention": {"compute-quantization": "fp8"}, "hidden-layers": kv}}
    assert load_config(raw).requested_features() == [("model.attention.compute-quantization", "fp8 attention")]
    del raw["model"]["hidden-layers"]
    assert refusal(raw).path == "model.attention.compute-quantization"


def test_attention_placed_with_its_layer_or_apart_from_it():
    layers = {"compute": "cuda:0", "store": "vram"}
    raw = {"model": {"path": "m", "attention": {"compute": "cuda:0", "store": "gpu"}, "hidden-layers": layers}}
    assert load_config(raw).placement("layer", 0) == Placement("cuda:0", "vram")
    raw["model"]["hidden-layers"]["ranges"] = [{"start": 1, "end": 3, "compute": "cuda:1"}]
    config = load_config(raw)  # the attention of layers 1-2 on cuda:0, the rest of them on cuda:1
    assert config.placement("layer", 1) == Placement("cuda:1", "vram")
    assert config.placement("attention", 1) == Placement("cuda:0", "vram")


def test_a_cuda_block_is_accepted_empty_and_each_knob_refused_by_name():
    assert load_config({"model": {"path": "m"}, "cuda": {}}).requested_features() == []
    err = refusal({"model": {"path": "m"}, "cuda": {"graphs": True}})
    assert err.path == "cuda.graphs" and "CUDA runtime knobs are not supported" in err.message


def test_cuda_compute_quantization_is_lumens_own_key_in_the_cuda_block():
    assert load_config({"model": {"path": "m"}}).cuda_compute_quantization() == "none"
    config = load_config({"model": {"path": "m"}, "cuda": {"compute-quantization": "bf16"}})
    assert config.cuda_compute_quantization() == "bf16" and config.requested_features() == []
    err = refusal({"model": {"path": "m"}, "cuda": {"compute-quantization": "int8"}})
    assert err.path == "cuda.compute-quantization" and "int8" in err.message
    err = refusal({"model": {"path": "m"}, "cuda": {"compute-quantization": "bf16", "graphs": True}})
    assert err.path == "cuda.graphs"


def test_draft_flat_form_inherits_placement_from_model_and_nested_form_still_works():
    flat = {"model": {"path": "m", "compute": "cuda:0", "store": "vram"}, "draft": {"path": "d"}}
    config = load_config(flat)
    assert config.raw["draft"] == {"model": {"path": "d", "compute": "cuda:0", "store": "vram"},
                                   "num-draft-tokens": 4}
    assert config.requested_features() == []  # speculative decoding is planned (issue 20)
    nested = {"model": {"path": "m"}, "draft": {"model": {"path": "d"}, "num-draft-tokens": 2}}
    assert load_config(nested).raw["draft"] == {"model": {"path": "d"}, "num-draft-tokens": 2}


def test_draft_in_both_forms_or_without_a_checkpoint_is_refused_by_name():
    err = refusal({"model": {"path": "m"}, "draft": {"model": {"path": "d"}, "path": "d"}})
    assert err.path == "draft.path" and "given twice" in err.message
    err = refusal({"model": {"path": "m"}, "draft": {"compute": "cpu"}})
    assert err.path == "draft.path" and "missing the draft checkpoint" in err.message
    err = refusal({"model": {"path": "m"}, "draft": {"path": "d", "compute": "cpu", "store": "gpu"}})
    assert err.path == "draft.store" and "needs a GPU compute device" in err.message  # the key as written
    err = refusal({"model": {"path": "m"}, "draft": {"model": {"path": "d", "store": "gpu"}}})
    assert err.path == "draft.model.store"


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_server_api_is_accepted(api):
    config = load_config({"model": {"path": "m"}, "server-parameters": {"server-api": api, "port": 8080}})
    assert config.server_parameters() == {"server_api": api, "port": 8080}
    with pytest.raises(ConfigError) as info:
        load_config({"model": {"path": "m"}, "server-parameters": {"server-api": "grpc"}})
    assert info.value.path == "server-parameters.server-api" and "openai, anthropic" in info.value.message


def test_vision_places_the_tower_and_is_no_unsupported_feature():
    config = load_config({"model": {"path": "m", "compute": "cuda:0"}, "vision": {"store": "gpu"}})
    assert config.placement("vision") == Placement("cuda:0", "vram")
    assert config.requested_features() == []


# ------------------------------------------------------------------ LumenLLM's command-line options


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    from lumen_core.cli import main

    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def test_temp_is_temperature_on_generate(capsys, tiny_checkpoint):
    ckpt = str(tiny_checkpoint("qwen3_5"))
    base = ("generate", "-c", ckpt, "--prompt", "The sky is", "-n", "8", "-q", "--seed", "7")
    long_form = run_cli(capsys, *base, "--temperature", "0.9")
    short_form = run_cli(capsys, *base, "--temp", "0.9")
    greedy = run_cli(capsys, *base, "--temp", "0")
    assert long_form[0] == short_form[0] == greedy[0] == 0
    assert short_form[1] == long_form[1] and short_form[1].strip()
    assert greedy[1] == run_cli(capsys, *base, "--temperature", "0")[1]
    code, _, err = run_cli(capsys, *base, "--temp", "-1")
    assert code == 2 and "temperature" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("option, words", [
    ("--image", "no-such-image.png")])  # a missing image file: named, before the config is read
def test_a_bad_image_is_refused_by_name_before_loading(capsys, tmp_path, command, option, words):
    # A config that does not exist: the option is refused before anything is read. --temp parses on both commands.
    # (--draft-model is no longer refused: tests/test_draft_config.py.)
    argv = [command, "-c", str(tmp_path / "missing.json"), "--temp", "0", option, str(tmp_path / "no-such-image.png")]
    if command == "generate":
        argv += ["--prompt", "hi"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and words in err and out == "" and "Traceback" not in err
    assert "No such option" not in err and "missing.json" not in err
