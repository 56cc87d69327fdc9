"""The plugin system: registrations and their sources, overrides by priority, clashes, allow-list."""

from __future__ import annotations

import types

import numpy as np
import pytest

import lumen_core as lumen
from lumen_core import hookimpl, plugins
from lumen_core.errors import PluginError


@pytest.fixture
def fake_plugin():
    """Register a module-like object as a plugin for one test, and always unregister it."""
    names = []

    def register(name: str, **hooks):
        module = types.SimpleNamespace(**{k: hookimpl(v) for k, v in hooks.items()})
        names.append(name)
        plugins.register_plugin(module, name)
        return module

    yield register
    for name in names:
        plugins.unregister_plugin(name)
    plugins.reset()


def test_registry_lists_builtins_with_their_distribution():
    reg = plugins.get_registry()
    assert reg.backends["cpu"].source == "lumen-cpu"
    assert reg.architectures["qwen3_5"].source == "lumen-models-qwen"
    assert reg.checkpoint_formats["hf-safetensors"].source == "lumen-core"
    assert {"linear", "attention", "gated_delta_rule"} <= reg.ops_of("cpu")


def test_higher_priority_op_overrides_one_op_on_one_backend(fake_plugin, tiny_checkpoint):
    from lumen_cpu.ops import silu_mul

    calls = []

    def counting_silu_mul(gate, up):
        calls.append(gate.shape)
        return silu_mul(gate, up)

    def register_ops(register):
        register("silu_mul", "cpu", counting_silu_mul, priority=10)

    fake_plugin("faster-silu", register_ops=register_ops)
    engine = lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5"))}}, progress=False)
    engine.model.forward([1, 2, 3], engine.model.new_cache(8))
    assert len(calls) == engine.arch.num_layers


def test_same_priority_op_clash_is_an_error(fake_plugin):
    fake_plugin("dup-op", register_ops=lambda register: register("silu_mul", "cpu", np.negative))
    with pytest.raises(PluginError, match="registered twice.*lumen-cpu.*dup-op"):
        plugins.get_registry()


def test_backend_name_clash_names_both_plugins(fake_plugin):
    fake_plugin("other-cpu", register_backends=lambda register: register("cpu", "x:Y"))
    with pytest.raises(PluginError, match="backend 'cpu' is registered twice: by lumen-cpu and by other-cpu"):
        plugins.get_registry()


def test_misspelt_hook_fails_loudly():
    bad = types.SimpleNamespace(register_backend=hookimpl(lambda register: None))
    with pytest.raises(PluginError, match="register_backend"):
        plugins.register_plugin(bad, "typo-plugin")
    assert plugins.get_plugin_manager().get_plugin("typo-plugin") is None


def test_allow_list_restricts_entry_points(monkeypatch, tiny_checkpoint):
    monkeypatch.setenv("LUMEN_LOAD_PLUGINS", "core,cpu")
    plugins.reset()
    try:
        reg = plugins.get_registry()
        assert "cpu" in reg.backends and not reg.architectures
        with pytest.raises(PluginError, match="qwen3_5_text.*pip install lumen-models-qwen"):
            lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5"))}}, progress=False)
    finally:
        monkeypatch.delenv("LUMEN_LOAD_PLUGINS")
        plugins.reset()


def test_missing_backend_names_the_distribution_to_install():
    with pytest.raises(PluginError, match="backend 'wgpu' is not installed.*pip install lumen-wgpu"):
        plugins.get_registry().backend_class("wgpu")
