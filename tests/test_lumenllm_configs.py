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
                                       "ranges": [{"start": 0, "end": 1, "store": "gpu",
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
                                    "hidden-layers": {"ranges": [{"start": 1, "end": 1, "store": "mmap"}]}}})
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
