"""``model.attention.compute-quantization: fp8`` from config to backend (CPU only): the plan accepts it where every
backend computing the attention declares it (``Backend.attention_quantizations``: the cuda backend) and refuses it
naming the others; the engine hands it to those backends before the model makes its KV caches; the cuda backend's
KV cache ops are bound to it so that the caches carry the flag. The kernel itself: tests/test_cuda_flash.py."""

from __future__ import annotations

import types

import pytest

from lumen_core.config import Placement, load_config
from lumen_core.errors import ConfigError
from lumen_core.plan import check_fp8_attention

FP8 = {"model": {"path": "m", "attention": {"compute-quantization": "fp8"},
                 "hidden-layers": {"kv-cache": {"type-k": "fp8", "type-v": "fp8"}}}}


class Registry:
    def __init__(self, **classes):
        self.classes = classes
        self.backends = dict.fromkeys(classes)

    def backend_class(self, name):
        return self.classes[name]


class WithFp8:
    attention_quantizations = ("fp8",)


class Without:
    attention_quantizations = ()


def test_accepted_where_every_token_mixer_backend_has_it_and_refused_naming_the_others():
    config = load_config(FP8)
    registry = Registry(cuda=WithFp8, cpu=Without)
    on_gpu = {("layer", 0): Placement("cuda:0", "vram"), ("layer", 1): Placement("cuda:0", "vram"),
              ("experts", 1): Placement("cpu", "ram")}  # experts on the CPU compute no attention
    check_fp8_attention(config, on_gpu, registry)
    mixed = {**on_gpu, ("layer", 0): Placement("cpu", "ram")}
    with pytest.raises(ConfigError) as info:
        check_fp8_attention(config, mixed, registry)
    err = info.value
    assert err.path == "model.attention.compute-quantization"
    assert "not implemented by backend 'cpu'" in err.message and "'cuda'" not in err.message
    assert "compute the attention on cuda" in err.fix and '"default"' in err.fix
    with pytest.raises(ConfigError) as info:  # nothing installed has it: the fix names no backend
        check_fp8_attention(config, mixed, Registry(cuda=Without, cpu=Without))
    assert "compute the attention on" not in info.value.fix
    check_fp8_attention(load_config({"model": {"path": "m"}}), mixed, registry)  # not asked for: nothing to check
    # LumenLLM's layout: the layer on the CPU, its token mixer (attention) and KV cache on the GPU
    split = {("layer", 0): Placement("cpu", "ram"), ("attention", 0): Placement("cuda:0", "vram"),
             ("layer", 1): Placement("cuda:0", "vram")}
    check_fp8_attention(config, split, registry)
    with pytest.raises(ConfigError, match="backend 'cpu'"):
        check_fp8_attention(config, {**split, ("attention", 0): Placement("cpu", "ram")}, registry)


def test_config_reads_the_setting():
    assert load_config(FP8).attention_compute_quantization() == "fp8"
    for value in ("none", "default", "bf16"):
        raw = {"model": {"path": "m", "attention": {"compute-quantization": value}}}
        assert load_config(raw).attention_compute_quantization() == "none"
    assert load_config({"model": {"path": "m"}}).attention_compute_quantization() == "none"


def test_the_engine_configures_each_attention_backend_once():
    from lumen_core.engine import _configure_attention

    class Backend:
        def __init__(self):
            self.got = []

        def configure_attention_quantization(self, quantization):
            self.got.append(quantization)

    gpu, cpu = Backend(), Backend()
    backends = {("layer", 0): gpu, ("attention", 0): gpu, ("layer", 1): gpu, ("experts", 1): cpu}
    _configure_attention(load_config(FP8), backends)
    assert gpu.got == ["fp8"] and cpu.got == []
    gpu.got.clear()  # a layer on the CPU whose token mixer is on the GPU: only the mixer's backend is asked
    _configure_attention(load_config(FP8), {("layer", 0): cpu, ("attention", 0): gpu, ("layer", 1): gpu})
    assert gpu.got == ["fp8"] and cpu.got == []
    _configure_attention(load_config({"model": {"path": "m"}}), backends)
    assert gpu.got == ["fp8"]


def test_cuda_backend_declares_it_and_binds_its_kv_cache_ops():
    """Importable without CuPy: the class declares fp8, its setter takes none and names a bad value, and the
    KV cache ops are among those bound to the backend instance (lumen_cuda.ops.kv_cache reads its flag)."""
    import lumen_cuda
    from lumen_cuda.backend import CUDABackend

    from lumen_core.backend import Backend

    assert "fp8" in CUDABackend.attention_quantizations and Backend.attention_quantizations == ()
    fake = types.SimpleNamespace(fp8_attention=True)  # "fp8" itself checks the kernel on the GPU: test_cuda_flash.py
    CUDABackend.configure_attention_quantization(fake, "none")
    assert fake.fp8_attention is False
    with pytest.raises(ValueError, match="'int8'.*none or fp8"):
        CUDABackend.configure_attention_quantization(fake, "int8")
    assert {"kv_cache", "sliding_kv_cache"} <= set(lumen_cuda.BACKEND_OPS)
    assert hasattr(lumen_cuda._lazy("kv_cache"), "bind")
    with pytest.raises(NotImplementedError, match="no attention compute quantization"):
        Backend.configure_attention_quantization(types.SimpleNamespace(name="x"), "fp8")
