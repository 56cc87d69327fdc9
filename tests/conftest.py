"""Shared fixtures: tiny random checkpoints made by transformers and saved with save_pretrained."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Triton (which transformers imports) carries its own LLVM; loading it after lavapipe (Mesa's Vulkan CPU driver, which
# links the system's LLVM) crashes the process. Any test may start lavapipe (the wgpu tests, `lumen plugins` listing
# devices), so Triton is loaded first. Users never load both: torch and transformers are test-only.
try:
    import triton  # noqa: F401
except ImportError:
    pass


def _load_script():
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", ROOT / "scripts" / "make_tiny_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def make_tiny():
    return _load_script()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, make_tiny):
    """``tiny_checkpoint(kind, **overrides) -> Path``; each distinct checkpoint is built once a session."""
    built: dict[str, Path] = {}

    def get(kind: str, **overrides) -> Path:
        key = kind + json.dumps(overrides, sort_keys=True)
        if key not in built:
            out = tmp_path_factory.mktemp(kind)
            built[key] = make_tiny.make(kind, out, **overrides)
        return built[key]

    return get


@pytest.fixture
def write_config(tmp_path):
    """``write_config(dict) -> path`` of a config file in a fresh directory."""

    def write(data: dict, name: str = "config.json") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(data))
        return path

    return write


@pytest.fixture(scope="session")
def cp():
    """CuPy, for tests marked ``gpu``; skips where CuPy or a CUDA device is missing."""
    cupy = pytest.importorskip("cupy")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # CuPy without a driver or device
        n = 0
    if n == 0:
        pytest.skip("no CUDA device")
    return cupy


GIB = 1 << 30


@pytest.fixture
def numpy_gpu(monkeypatch):
    """A stand-in ``cuda`` backend that computes with the CPU's numpy ops (its ops resolve by the name ``cpu``): a
    plan can then put a layer's token mixer on cuda:0 and the rest of the layer on cpu, two backend instances that
    hand the hidden state over through ``Backend.call``, on a machine without a GPU. Counts its ``take`` calls."""
    from lumen_cpu.backend import CPUBackend

    from lumen_core.backend import DeviceInfo
    from lumen_core.plugins import get_registry

    class NumpyGPU(CPUBackend):
        stores = ("vram", "ram")
        kv_stores = ("vram",)
        takes = 0

        @classmethod
        def devices(cls):
            return [DeviceInfo("cuda:0", 8 * GIB, 8 * GIB, "stand-in: numpy")]

        def weight(self, array, fmt, store, scale=None, shape=None):
            return super().weight(array, fmt, "ram" if store == "vram" else store, scale, shape)

        def take(self, x):
            NumpyGPU.takes += 1
            return super().take(x)

    registry = get_registry()
    real_class, real_ops = registry.backend_class, registry.ops_of
    monkeypatch.setattr(registry, "backend_class", lambda name: NumpyGPU if name == "cuda" else real_class(name))
    monkeypatch.setattr(registry, "ops_of", lambda name: real_ops("cpu" if name == "cuda" else name))
    return NumpyGPU


@pytest.fixture(scope="session")
def wgpu_pair():
    """``(wgpu backend on wgpu:0, cpu backend)`` for tests marked ``wgpu``. Skips where lumen-wgpu, wgpu-py or an
    adapter is missing, unless ``LUMEN_REQUIRE_WGPU=1`` (CI, which installs lavapipe; the H200's GPU suite): then a
    missing adapter fails the test instead of hiding it."""
    import os

    required = os.environ.get("LUMEN_REQUIRE_WGPU") == "1"
    try:
        import lumen_wgpu  # noqa: F401
        from lumen_wgpu.device import adapters, adapters_error
    except ImportError as exc:
        if required:
            pytest.fail(f"LUMEN_REQUIRE_WGPU=1 but lumen-wgpu does not import: {exc}")
        pytest.skip("lumen-wgpu is not installed")
    if not adapters():
        if required:
            why = adapters_error()
            pytest.fail("LUMEN_REQUIRE_WGPU=1 but wgpu finds no Vulkan/Metal/DX12 adapter (install "
                        f"mesa-vulkan-drivers for lavapipe){'; wgpu-py failed: ' + why if why else ''}")
        pytest.skip("no wgpu adapter (install mesa-vulkan-drivers for lavapipe)")
    from lumen_core.plugins import get_registry

    registry = get_registry()
    wgpu = registry.backend_class("wgpu")("wgpu:0", registry)
    cpu = registry.backend_class("cpu")("cpu", registry)
    return wgpu, cpu
