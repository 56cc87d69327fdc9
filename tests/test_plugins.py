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
    calls.clear()  # loading may run a warm-up forward
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
        with pytest.raises(PluginError, match="qwen3_5_text.*pip install -e plugins/models-qwen .*lumen-models-qwen"):
            lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5"))}}, progress=False)
    finally:
        monkeypatch.delenv("LUMEN_LOAD_PLUGINS")
        plugins.reset()


def test_missing_wgpu_backend_names_its_source_folder(monkeypatch):
    monkeypatch.setenv("LUMEN_LOAD_PLUGINS", "core,cpu")
    plugins.reset()
    try:
        with pytest.raises(PluginError, match="backend 'wgpu' is not installed.*pip install -e plugins/lumen-wgpu"):
            plugins.get_registry().backend_class("wgpu")
    finally:
        monkeypatch.delenv("LUMEN_LOAD_PLUGINS")
        plugins.reset()


# -- install hints: these distributions are not on PyPI yet, so a hint names the source-tree install first ---------
def test_install_hint_names_the_source_tree_install_and_the_distribution():
    assert plugins.install_hint("lumen-models-gemma") == (
        "pip install -e plugins/models-gemma from the root of a Lumen source checkout (lumen-models-gemma is not "
        "on PyPI yet; once it is: pip install lumen-models-gemma)")
    cuda = plugins.install_hint("lumen-cuda", "cuda13", "cuda12")
    assert cuda.startswith("pip install -e 'plugins/lumen-cuda[cuda13]' (or [cuda12]) from the root of a Lumen")
    assert "pip install 'lumen-cuda[cuda13]'" in cuda
    assert plugins.install_hint("lumen-foo").startswith("pip install lumen-foo (not part of the Lumen source tree")


def test_every_source_path_is_the_distribution_it_names():
    """The table install hints are built from: each folder holds the pyproject.toml of that distribution, and every
    distribution a hint can name (known architectures and backends) is in it."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for dist, path in plugins.SOURCE_PATHS.items():
        project = tomllib.loads((root / path / "pyproject.toml").read_text())["project"]
        assert project["name"] == dist, path
    named = {*plugins.KNOWN_ARCHITECTURE_PLUGINS.values(), *plugins.KNOWN_BACKEND_PLUGINS.values()}
    assert named <= set(plugins.SOURCE_PATHS)


def test_unknown_architecture_names_the_source_tree_install(monkeypatch):
    monkeypatch.setenv("LUMEN_LOAD_PLUGINS", "core,cpu")
    plugins.reset()
    try:
        with pytest.raises(PluginError) as info:
            plugins.get_registry().architecture_class("gemma4_text")
    finally:
        monkeypatch.delenv("LUMEN_LOAD_PLUGINS")
        plugins.reset()
    assert "fix: pip install -e plugins/models-gemma from the root of a Lumen source checkout" in str(info.value)
    assert "pip install lumen-models-gemma" in str(info.value)


def test_missing_cuda_backend_names_the_install_with_cupy(monkeypatch):
    monkeypatch.setenv("LUMEN_LOAD_PLUGINS", "core,cpu")
    plugins.reset()
    try:
        with pytest.raises(PluginError) as info:
            plugins.get_registry().backend_class("cuda")
    finally:
        monkeypatch.delenv("LUMEN_LOAD_PLUGINS")
        plugins.reset()
    assert "backend 'cuda' is not installed (installed: cpu)" in str(info.value)
    assert "fix: pip install -e 'plugins/lumen-cuda[cuda13]' (or [cuda12])" in str(info.value)


# -- quant formats ---------------------------------------------------------------------------------------------
def test_nvfp4_is_a_registered_quant_format():
    """4-bit E2M1 values + one E4M3 byte per 16 values: 0.5625 bytes a value (the per-tensor global scale aside)."""
    entry = plugins.get_registry().quant_formats["nvfp4"]
    assert entry.source == "lumen-core"
    assert entry.value == pytest.approx(0.5625)
    assert "E2M1" in entry.extra["description"] and "E4M3" in entry.extra["description"]


# -- lumen plugins ---------------------------------------------------------------------------------------------
def _cli(capsys, *argv) -> tuple[int, str]:
    from lumen_core.cli import main

    try:
        main(["plugins", *argv])
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    return code, capsys.readouterr().out


def test_plugins_listing_is_grouped_per_distribution(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    code, out = _cli(capsys)
    assert code == 0
    lines = out.splitlines()
    entries = plugins.get_registry().all_entries()
    assert len(lines) < len(entries) / 3  # 177 registrations: a screen, not a scroll
    assert max(len(line) for line in lines) <= 100
    for dist in {e.source for e in entries}:  # a section per distribution
        assert any(line.startswith(dist + " (") for line in lines), dist
    start = next(i for i, line in enumerate(lines) if line.startswith("  quant formats:"))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("   "))
    quant = " ".join(lines[start:end])  # the quant-format line and its continuations
    assert "nvfp4" in quant and "q4_k" in quant and "mxfp4" in quant
    assert "ops on cpu:" in out and "ops on cuda:" in out
    assert "linear (f32, f16, bf16, fp8, nvfp4)" in out  # the cuda backend's linear variants, in format order
    assert "architectures:" in out and "qwen3_5_moe" in out and "gemma4" in out


def test_plugins_all_prints_one_row_per_registration(capsys):
    code, out = _cli(capsys, "--all")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["kind", "name", "plugin"]
    assert len(lines) == 1 + len(plugins.get_registry().all_entries())
    assert any(line.split()[-1] == "lumen-cpu" and "linear [cpu/nvfp4]" in line for line in lines)
    assert any(line.startswith("quant format") and " nvfp4 " in line for line in lines)


def test_plugins_json_keeps_its_rows(capsys):
    import json

    code, out = _cli(capsys, "--json")
    rows = json.loads(out)
    assert code == 0 and len(rows) == len(plugins.get_registry().all_entries())
    assert all(set(r) == {"kind", "name", "plugin"} for r in rows)
    assert {"kind": "backend", "name": "cpu", "plugin": "lumen-cpu"} in rows
    assert {"kind": "quant format", "name": "nvfp4", "plugin": "lumen-core"} in rows
    assert {"kind": "op", "name": "linear [cpu/fp8] priority 10", "plugin": "lumen-cpu"} in rows


def test_grouped_listing_shows_a_plugins_priority_override(fake_plugin):
    from lumen_core.cli.commands.plugins import grouped

    fake_plugin("faster-silu", register_ops=lambda register: register("silu_mul", "cpu", np.negative, priority=20))
    out = grouped(plugins.get_registry().all_entries(), width=80)
    section = out[out.index("faster-silu ("):]
    assert section.startswith("faster-silu (1 registration)\n")
    assert "ops on cpu:" in section and "priority 20 on cpu:" in section
