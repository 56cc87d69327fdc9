"""The ``lumen`` command. One command a file in ``commands/``; plugins add theirs via ``register_commands``.

Errors a user can act on (``LumenError``) print one clear message and exit 2, never a traceback.
"""

from __future__ import annotations

import sys

import typer

from ..errors import LumenError

app = typer.Typer(
    name="lumen",
    help="Lumen: run LLMs with every component placed by hand (see `lumen COMMAND --help`).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


_registered = False


def _register_commands() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from .commands import chat, generate, perplexity, plugins, quantize, serve, show_plan, validate

    for module in (plugins, validate, show_plan, generate, chat, serve, perplexity, quantize):
        module.register(app)
    from ..plugins import get_plugin_manager

    get_plugin_manager().hook.register_commands(cli=app)


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"lumen: error: {message}", err=True)
    raise typer.Exit(code)


def main(argv: list[str] | None = None) -> None:
    try:
        _register_commands()
        app(args=argv, prog_name="lumen", standalone_mode=False)
    except LumenError as exc:
        typer.echo(f"lumen: error: {exc}", err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo("lumen: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # click's usage errors and aborts
        _exit_for_click(exc)
        raise


def _exit_for_click(exc: Exception) -> None:
    """Exit as click's standalone mode would for its own exceptions (a usage error: its message, status 2).
    Typer may vendor click (``typer._click``), so they are known by shape, not by the ``click`` module."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "ClickException" in names:
        exc.show()
        sys.exit(exc.exit_code)
    if "Abort" in names:
        typer.echo("Aborted!", err=True)
        sys.exit(1)
