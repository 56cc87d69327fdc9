"""Lumen: an LLM inference engine where you place every component by hand.

    import lumen_core as lumen
    engine = lumen.load("my.json")
    for piece in engine.generate("Explain Rayleigh scattering.", max_tokens=200, temperature=0):
        print(piece, end="")
"""

from .errors import CheckpointError, ConfigError, InputError, LumenError, PlanError, PluginError
from .hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = [
    "hookimpl", "load", "Engine", "LumenError", "ConfigError", "PlanError", "CheckpointError",
    "PluginError", "InputError", "__version__",
]


def load(source, progress=None):
    """Validate, plan and load a config into an :class:`Engine` (or raise a clear ``LumenError``)."""
    from .engine import load as _load

    return _load(source, progress)


def __getattr__(name):
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(name)
