"""The GPU recipes of examples/ planned against the real Qwen3.5-35B-A3B-FP8 layout (every tensor's name, shape
and dtype as ``lumen quantize`` writes them; the data a sparse hole: scripts/shape_checkpoint.py) on stand-in GPUs
of a given size: the plan is computed before any weight is read, so this checks what each recipe promises — the
35B MoE with streamed or CPU experts fits a 16 GB card, all in VRAM it does not (and the refusal says to stream
the experts), split over two GPUs it fits two 24 GB cards. Host RAM is set to 64 GiB (such a machine)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lumen_core import plan as plan_mod
from lumen_core.backend import DeviceInfo
from lumen_core.errors import ConfigError, PlanError

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def _shape_checkpoint(tmp_path_factory, fmt: str) -> Path:
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("shape_checkpoint", ROOT / "scripts" / "shape_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write(tmp_path_factory.mktemp(f"shape35-{fmt}"), "qwen3.5-35b-a3b", None, fmt)


@pytest.fixture(scope="module")
def fp8_35b(tmp_path_factory):
    return _shape_checkpoint(tmp_path_factory, "fp8")


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n, gib): n stand-in CUDA devices of that size (a little of it in use), 64 GiB of host RAM."""
    cuda_backend = pytest.importorskip("lumen_cuda.backend")

    def make(n: int, gib: int):
        devices = [DeviceInfo(f"cuda:{i}", gib * GIB, gib * GIB - GIB // 2, f"stand-in {gib} GB") for i in range(n)]
        monkeypatch.setattr(cuda_backend.CUDABackend, "devices", classmethod(lambda cls: devices))
        monkeypatch.setattr(plan_mod, "host_available_bytes", lambda: 64 * GIB)

    return make


def plan_of(name: str, path: Path, **hidden):
    from lumen_core.engine import prepare

    raw = json.loads((ROOT / "examples" / name).read_text())
    raw["model"]["path"] = str(path)
    for key, value in hidden.items():
        if value is None:
            raw["model"]["hidden-layers"].pop(key, None)
        else:
            raw["model"]["hidden-layers"][key] = value
    return prepare(raw)[3]


def test_the_checkpoint_is_the_real_size(fp8_35b):
    size = (fp8_35b / "model.safetensors").stat().st_size
    assert 33 * GIB < size < 34 * GIB  # Qwen3.5-35B-A3B-FP8 without its MTP head: ~33.3 GiB
    assert json.loads((fp8_35b / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b-gpu-streamed-experts.json",
                                  "qwen3.5-35b-a3b-gpu-cpu-experts.json"])
def test_the_35b_moe_fits_a_16_gb_card_with_its_experts_in_host_memory(name, fp8_35b, gpus):
    gpus(1, 16)
    plan = plan_of(name, fp8_35b)
    pools = plan.pools()
    experts = sum(e.nbytes for e in plan.entries if e.component.endswith(".experts"))
    assert experts > 25 * GIB  # the routed experts are most of the model...
    assert pools["cuda:0 VRAM"] < 15.5 * GIB  # ...and off the card
    print(f"{name}: VRAM {pools['cuda:0 VRAM'] / GIB:.2f} GiB, experts {experts / GIB:.2f} GiB, {pools}")


def test_lumenllm_layout_keeps_only_the_token_mixers_in_vram(fp8_35b, gpus):
    """LumenLLM's layout (hidden-layers.store ram + attention.store vram): every layer's attention / Gated-DeltaNet
    weights in VRAM, the rest of each layer (norms, router, shared expert) and its routed experts in host RAM: less
    VRAM than streaming the experts alone, the same bytes in all."""
    gpus(1, 16)
    plan = plan_of("qwen3.5-35b-a3b-gpu-attention-in-vram.json", fp8_35b)
    streamed = plan_of("qwen3.5-35b-a3b-gpu-streamed-experts.json", fp8_35b)
    place = {e.component: (e.device, e.store) for e in plan.entries}
    assert all(place[f"layers.{i}.attention"] == ("cuda:0", "vram") for i in range(40))
    assert all(place[f"layers.{i}"] == place[f"layers.{i}.experts"] == ("cuda:0", "ram") for i in range(40))
    assert place["layers.0.attention"] and place["cache.layers.3"] == ("cuda:0", "vram")
    weights = [sum(e.nbytes for e in p.entries if e.kind == "weights") for p in (plan, streamed)]
    assert weights[0] == weights[1]
    vram, vram_streamed = plan.pools()["cuda:0 VRAM"], streamed.pools()["cuda:0 VRAM"]
    assert vram < vram_streamed < 15.5 * GIB
    print(f"attention in VRAM: VRAM {vram / GIB:.2f} GiB (streamed experts alone: {vram_streamed / GIB:.2f} GiB)")


def test_all_in_vram_it_does_not_fit_and_the_refusal_says_to_stream_the_experts(fp8_35b, gpus):
    gpus(1, 16)
    with pytest.raises(PlanError, match=r"cuda:0 VRAM needs .* stream them with hidden-layers.experts"):
        plan_of("qwen3.5-35b-a3b-gpu-streamed-experts.json", fp8_35b, experts=None)


def test_split_over_two_gpus_it_fits_two_24_gb_cards(fp8_35b, gpus):
    gpus(2, 24)
    plan = plan_of("qwen3.5-35b-a3b-two-gpus.json", fp8_35b)
    pools = plan.pools()
    assert 0 < pools["cuda:0 VRAM"] < 23.5 * GIB and 0 < pools["cuda:1 VRAM"] < 23.5 * GIB
    # {"start": 20, "end": 40}: end is exclusive (LumenLLM's meaning), so layers 20-39 of the 40, the last included
    device = {e.component: e.device for e in plan.entries}
    assert [device[f"layers.{i}"] for i in (0, 19, 20, 39)] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert not any("no range" in n for n in plan.notes)
    print(f"two GPUs: {pools}")
    gpus(1, 24)  # on a one-GPU machine the second range is refused, naming it
    with pytest.raises(ConfigError, match=r"ranges\[0\].*device 'cuda:1' does not exist"):
        plan_of("qwen3.5-35b-a3b-two-gpus.json", fp8_35b)


def test_the_nvfp4_35b_with_streamed_experts_fits_a_16_gb_card(tmp_path_factory, gpus):
    """The same recipe on the NVFP4 layout (as ``lumen quantize --format nvfp4`` writes it): half the expert bytes
    in host RAM, less VRAM still."""
    path = _shape_checkpoint(tmp_path_factory, "nvfp4")
    gpus(1, 16)
    plan = plan_of("qwen3.5-35b-a3b-gpu-streamed-experts.json", path)
    pools = plan.pools()
    assert pools["cuda:0 VRAM"] < 15.5 * GIB and 14 * GIB < pools["host RAM"] < 18 * GIB
    print(f"nvfp4 streamed: {pools}")


def test_the_full_262k_context_fits_an_8_gb_card_with_an_fp8_kv_cache(fp8_35b, gpus):
    """examples/qwen3.5-35b-a3b-gpu-long-context-fp8-kv.json: streamed experts and the model's whole 262144-token
    context. With an fp8 KV cache (1 byte an element) it fits an 8 GB card; with bf16 the same plan is refused, and
    the refusal names the fp8 cache as a fix."""
    name = "qwen3.5-35b-a3b-gpu-long-context-fp8-kv.json"
    gpus(1, 8)
    plan = plan_of(name, fp8_35b)
    kv = sum(e.nbytes for e in plan.entries if e.component.startswith("cache."))
    assert plan.context_size == 262144 and plan.pools()["cuda:0 VRAM"] < 7.5 * GIB
    bf16 = {"context-size": 262144, "type-k": "bf16", "type-v": "bf16"}
    with pytest.raises(PlanError, match=r"cuda:0 VRAM needs .*make the KV cache \(.* here\) fp8"):
        plan_of(name, fp8_35b, **{"kv-cache": bf16})
    gpus(1, 16)
    wide = sum(e.nbytes for e in plan_of(name, fp8_35b, **{"kv-cache": bf16}).entries
               if e.component.startswith("cache."))
    full_attention = 10 * 2 * 2 * 256 * 262144  # 10 full-attention layers, K and V, 2 KV heads of 256, 1 byte each
    assert kv - full_attention == (wide - 2 * full_attention)  # only the attention caches shrink (not DeltaNet's)
    print(f"262k context: VRAM {plan.pools()['cuda:0 VRAM'] / GIB:.2f} GiB, KV fp8 {kv / GIB:.2f} GiB, "
          f"bf16 {wide / GIB:.2f} GiB")


def test_fp8_attention_plans_on_cuda_with_a_note_and_is_refused_where_the_cpu_computes_a_layer(fp8_35b, gpus):
    """The long-context example with attention.compute-quantization fp8: the plan takes it (the attention computes
    on cuda; the experts' placement does not matter) and says what it does; with layers 0-3 on the CPU it is
    refused naming the cpu backend."""
    from lumen_core.engine import prepare

    gpus(1, 8)
    raw = json.loads((ROOT / "examples" / "qwen3.5-35b-a3b-gpu-long-context-fp8-kv.json").read_text())
    raw["model"]["path"] = str(fp8_35b)
    raw["model"]["attention"] = {"compute-quantization": "fp8"}
    plan = prepare(raw)[3]
    assert any("FP8 (e4m3) MMA" in note for note in plan.notes)
    raw["model"]["hidden-layers"]["ranges"] = [{"start": 0, "end": 3, "compute": "cpu", "store": "ram"}]
    with pytest.raises(ConfigError, match="not implemented by backend 'cpu'") as info:
        prepare(raw)
    assert "compute the attention on cuda" in info.value.fix


def test_gpu_layers_whose_weights_stay_in_host_ram_keep_their_kv_caches_in_vram(fp8_35b, gpus):
    """``compute: cuda:0, store: ram`` for the whole model (lumen_cuda.hostweights): every weight in host RAM,
    page-locked, and the caches, which follow their layer's memory unless kv-cache.store says otherwise, in VRAM
    (where the backend keeps them)."""
    from lumen_core.engine import prepare

    pytest.importorskip("lumen_cuda.backend")
    gpus(1, 8)
    raw = json.loads((ROOT / "examples" / "qwen3.5-35b-a3b-gpu-streamed-experts.json").read_text())
    raw["model"].update(path=str(fp8_35b), store="ram")
    plan = prepare(raw)[3]
    caches = [e for e in plan.entries if e.component.startswith("cache.")]
    weights = [e for e in plan.entries if e.kind == "weights"]
    assert caches and {e.store for e in caches} == {"vram"} and {e.store for e in weights} == {"ram"}
    pools = plan.pools()
    assert pools["cuda:0 VRAM"] < 2 * GIB and plan.pinned() == pools["host RAM"] > 33 * GIB
    print(f"all weights in host RAM: {pools}")


def test_a_gpu_layer_mapped_from_the_file_is_read_as_ram_with_a_note(fp8_35b, gpus):
    """``store: mmap`` under a GPU means ``ram``, as in LumenLLM (a GPU cannot compute from a file mapping): the
    plan puts those layers in pinned host RAM, exactly as ``store: ram`` would, and a note names the block."""
    from lumen_core.engine import prepare

    gpus(1, 16)
    raw = json.loads((ROOT / "examples" / "qwen3.5-35b-a3b-gpu-streamed-experts.json").read_text())
    raw["model"].update(path=str(fp8_35b))
    plans = {}
    for store in ("mmap", "ram"):
        raw["model"]["hidden-layers"]["ranges"] = [{"start": 0, "end": 4, "store": store}]
        plans[store] = prepare(raw)[3]
    assert plans["mmap"].pools() == plans["ram"].pools()
    notes = " ".join(plans["mmap"].notes)
    assert "mmap" in notes and "ranges" in notes and "ram" in notes, notes
