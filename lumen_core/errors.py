"""Errors a user can act on. The CLI prints them without a traceback."""


class LumenError(Exception):
    """Base class: the message says what is wrong and how to fix it."""


class ConfigError(LumenError):
    """A config that cannot run, with the JSON path of the offending value."""

    def __init__(self, path: str, message: str, fix: str | None = None):
        self.path, self.message, self.fix = path, message, fix
        text = f"config {path or '(root)'}: {message}"
        super().__init__(text + (f"\n  fix: {fix}" if fix else ""))


class PlanError(LumenError):
    """A plan that does not fit or cannot be placed; raised before any weight is loaded."""


class CheckpointError(LumenError):
    """A missing, corrupt or unsupported checkpoint."""


class PluginError(LumenError):
    """A plugin clash, a missing plugin, or a misspelt hook."""


class InputError(LumenError):
    """Bad input at run time: an oversized prompt, a bad sampling value."""
