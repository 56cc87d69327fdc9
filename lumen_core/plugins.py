"""The plugin manager and the registry it fills.

Built-in backends and models register through the same entry-point group (``lumen``) as third-party ones.
``LUMEN_LOAD_PLUGINS`` (comma-separated entry-point names) restricts which entry points load.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .errors import PluginError

GROUP = "lumen"

# Architectures that ship in this project's own distributions: named in the error for an unknown model_type.
KNOWN_ARCHITECTURE_PLUGINS = {
    "qwen3_5": "lumen-models-qwen",
    "qwen3_5_text": "lumen-models-qwen",
    "qwen3_5_moe": "lumen-models-qwen",
    "qwen3_5_moe_text": "lumen-models-qwen",
    "gemma4": "lumen-models-gemma",
    "gemma4_text": "lumen-models-gemma",
    "gemma3": "lumen-models-gemma",
    "gemma3_text": "lumen-models-gemma",
}
KNOWN_BACKEND_PLUGINS = {"cpu": "lumen-cpu", "cuda": "lumen-cuda", "wgpu": "lumen-wgpu"}
# The optional dependencies a backend's distribution needs to see a device: (the one to name, its alternative)
BACKEND_EXTRAS = {"cuda": ("cuda13", "cuda12")}
# This project's distributions and their folders in the Lumen source tree. None is on PyPI yet, so every install
# hint (install_hint) names the editable install from a checkout first, then the distribution.
SOURCE_PATHS = {
    "lumen-core": ".",
    "lumen-cpu": "plugins/lumen-cpu",
    "lumen-cuda": "plugins/lumen-cuda",
    "lumen-wgpu": "plugins/lumen-wgpu",
    "lumen-models-qwen": "plugins/models-qwen",
    "lumen-models-gemma": "plugins/models-gemma",
}


def install_hint(dist: str, extra: str | None = None, alternative: str | None = None) -> str:
    """The command that installs ``dist`` (with the optional dependencies ``[extra]``, or ``[alternative]``):
    ``pip install -e plugins/models-gemma`` from a source checkout, then the distribution's own name for when it is
    published. A distribution outside this source tree gets ``pip install <dist>`` and says so."""
    path = SOURCE_PATHS.get(dist)
    if path is None:
        return f"pip install {dist} (not part of the Lumen source tree; install it from where it is published)"
    tail = f"[{extra}]" if extra else ""
    local, published = _quoted(path + tail), _quoted(dist + tail)
    alt = f" (or [{alternative}])" if alternative else ""
    return (f"pip install -e {local}{alt} from the root of a Lumen source checkout ({dist} is not on PyPI yet; "
            f"once it is: pip install {published})")


def _quoted(target: str) -> str:
    """``[extra]`` quoted, so that zsh does not glob it."""
    return f"'{target}'" if "[" in target else target


def import_object(spec: str) -> Any:
    """Import ``"module:attr"`` lazily, with an error that names the spec."""
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"cannot import {spec!r}: {exc}") from exc
    return obj


@dataclass
class Entry:
    """One registration: what it is, and which distribution registered it."""

    kind: str
    name: str
    value: Any
    source: str
    priority: int = 0
    extra: dict = field(default_factory=dict)


class Registry:
    """Everything the plugins registered, keyed by kind and name."""

    def __init__(self):
        self.backends: dict[str, Entry] = {}
        self.architectures: dict[str, Entry] = {}
        self.checkpoint_formats: dict[str, Entry] = {}
        self.quant_formats: dict[str, Entry] = {}
        self.chat_formats: dict[str, Entry] = {}
        self.ops: dict[tuple[str, str, str | None], list[Entry]] = {}
        self._source = "?"

    # -- registration callbacks, one per hook -------------------------------------------------------------
    def _add_unique(self, table: dict, kind: str, name: str, value: Any, **extra) -> None:
        if name in table:
            old = table[name]
            raise PluginError(
                f"{kind} {name!r} is registered twice: by {old.source} and by {self._source}; "
                f"uninstall one, or restrict plugins with LUMEN_LOAD_PLUGINS"
            )
        table[name] = Entry(kind, name, value, self._source, extra=extra)

    def add_backend(self, name: str, spec: str) -> None:
        self._add_unique(self.backends, "backend", name, spec)

    def add_architecture(self, model_type: str, spec: str) -> None:
        self._add_unique(self.architectures, "architecture", model_type, spec)

    def add_checkpoint_format(self, name: str, detect: Callable, opener: str) -> None:
        self._add_unique(self.checkpoint_formats, "checkpoint format", name, opener, detect=detect)

    def add_quant_format(self, name: str, bytes_per_value: float, description: str = "") -> None:
        self._add_unique(
            self.quant_formats, "quant format", name, bytes_per_value, description=description
        )

    def add_chat_format(self, model_type: str, **parsers) -> None:
        self._add_unique(self.chat_formats, "chat format", model_type, parsers)

    def add_op(self, op: str, backend: str, fn: Callable, variant: str | None = None, priority: int = 0):
        entries = self.ops.setdefault((op, backend, variant), [])
        for e in entries:
            if e.priority == priority:
                raise PluginError(
                    f"op {op!r} on backend {backend!r} (variant {variant}) is registered twice at priority "
                    f"{priority}: by {e.source} and by {self._source}; give the override a higher priority"
                )
        entries.append(Entry("op", op, fn, self._source, priority, {"backend": backend, "variant": variant}))
        entries.sort(key=lambda e: -e.priority)

    # -- lookups -----------------------------------------------------------------------------------------
    def op(self, op: str, backend: str, variant: str | None = None) -> Callable | None:
        """The highest-priority implementation of ``op`` on ``backend``; a variant falls back to None."""
        for key in ((op, backend, variant), (op, backend, None)):
            if key in self.ops:
                return self.ops[key][0].value
        return None

    def ops_of(self, backend: str) -> set[str]:
        return {op for (op, b, _v) in self.ops if b == backend}

    def backend_class(self, name: str):
        if name not in self.backends:
            hint = KNOWN_BACKEND_PLUGINS.get(name)
            installed = ", ".join(sorted(self.backends)) or "none"
            fix = install_hint(hint, *BACKEND_EXTRAS.get(name, ())) if hint else "install a plugin that provides it"
            raise PluginError(f"backend {name!r} is not installed (installed: {installed}); fix: {fix}")
        return import_object(self.backends[name].value)

    def architecture_class(self, model_type: str):
        if model_type not in self.architectures:
            installed = ", ".join(sorted(self.architectures)) or "none"
            hint = KNOWN_ARCHITECTURE_PLUGINS.get(model_type)
            fix = install_hint(hint) if hint else "no known plugin provides it"
            raise PluginError(
                f"unknown architecture (model_type) {model_type!r}; installed: {installed}; fix: {fix}"
            )
        return import_object(self.architectures[model_type].value)

    def all_entries(self) -> list[Entry]:
        out = [
            *self.backends.values(),
            *self.architectures.values(),
            *self.checkpoint_formats.values(),
            *self.quant_formats.values(),
            *self.chat_formats.values(),
        ]
        for entries in self.ops.values():
            out.extend(entries)
        return out


def _allowed() -> set[str] | None:
    raw = os.environ.get("LUMEN_LOAD_PLUGINS")
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def make_plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    pm = pluggy.PluginManager("lumen")
    pm.add_hookspecs(hookspecs)
    if not load_entry_points:
        return pm
    allowed = _allowed()
    for ep in importlib.metadata.entry_points(group=GROUP):
        if allowed is not None and ep.name not in allowed:
            continue
        try:
            module = ep.load()
        except Exception as exc:  # a broken plugin must not take the whole CLI down silently
            raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to import: {exc}") from exc
        dist = ep.dist.name if ep.dist is not None else ep.name
        if pm.get_plugin(dist) is None:
            pm.register(module, name=dist)
    _check_pending(pm)
    return pm


def _check_pending(pm: pluggy.PluginManager) -> None:
    """A misspelt hook name fails loudly instead of being silently ignored."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {exc.plugin!r} has an unknown hook: {exc}") from None


def build_registry(pm: pluggy.PluginManager) -> Registry:
    """Call every registration hook, recording which plugin registered what."""
    reg = Registry()
    hooks = [
        ("register_backends", reg.add_backend),
        ("register_ops", reg.add_op),
        ("register_architectures", reg.add_architecture),
        ("register_checkpoint_formats", reg.add_checkpoint_format),
        ("register_quant_formats", reg.add_quant_format),
        ("register_chat_formats", reg.add_chat_format),
    ]
    for name, plugin in pm.list_name_plugin():
        for hook_name, callback in hooks:
            impl = getattr(plugin, hook_name, None)
            if impl is None:
                continue
            reg._source = name
            impl(register=callback)
    return reg


_pm: pluggy.PluginManager | None = None
_registry: Registry | None = None


def get_plugin_manager() -> pluggy.PluginManager:
    global _pm
    if _pm is None:
        _pm = make_plugin_manager()
    return _pm


def get_registry() -> Registry:
    """The registry of all loaded plugins, built once and reused."""
    global _registry
    if _registry is None:
        _registry = build_registry(get_plugin_manager())
    return _registry


def reset() -> None:
    """Forget the plugin manager and registry (tests register fake plugins, then reset)."""
    global _pm, _registry
    _pm, _registry = None, None


def register_plugin(module: Any, name: str) -> None:
    """Register a plugin object directly on the manager (tests, embedding applications)."""
    pm = get_plugin_manager()
    try:
        pm.register(module, name=name)
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {name!r} is invalid: {exc}") from None
    try:
        _check_pending(pm)
    except PluginError:
        pm.unregister(module)
        raise
    global _registry
    _registry = None


def unregister_plugin(name: str) -> None:
    pm = get_plugin_manager()
    plugin = pm.get_plugin(name)
    if plugin is not None:
        pm.unregister(plugin)
    global _registry
    _registry = None
