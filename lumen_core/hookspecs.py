"""The plugin contract: every backend, op, architecture and format registers through these hooks.

Each hook receives a ``register`` callback, so the core owns name clashes, priorities and error messages.
"""

import pluggy

hookspec = pluggy.HookspecMarker("lumen")
hookimpl = pluggy.HookimplMarker("lumen")


@hookspec
def register_backends(register):
    """Register backend classes: ``register(name, "module:Class")`` (imported lazily)."""


@hookspec
def register_ops(register):
    """Register op implementations: ``register(op, backend, fn, variant=None, priority=0)``."""


@hookspec
def register_architectures(register):
    """Register architectures: ``register(model_type, "module:Class")`` (imported lazily)."""


@hookspec
def register_checkpoint_formats(register):
    """Register checkpoint readers: ``register(name, detect, "module:open_fn")``."""


@hookspec
def register_quant_formats(register):
    """Register weight formats: ``register(name, bytes_per_value, description)``."""


@hookspec
def register_chat_formats(register):
    """Register chat formats: ``register(model_type, format=lumen_core.chat.ChatFormat(...))``.

    (``register(model_type, reasoning=..., tool_calls=..., thinking_kwarg=...)`` also works: the keywords
    become a `ChatFormat`.) Model types without one get a plain format: no reasoning, no tool calls.
    """


@hookspec
def register_commands(cli):
    """Add commands to the ``lumen`` typer app."""
