"""``lumen validate``: schema + semantic checks and the plan, without loading a weight."""

from __future__ import annotations

import typer

from . import ConfigOpt


def validate(config: ConfigOpt):
    """Check a config: JSON Schema, placement rules, sampling values, devices, backends, op coverage, context size,
    memory fit and the chat template file.

    Reads only the checkpoint's headers. Exits 0 and prints a one-line summary when the config can run (and its
    notes on stderr); otherwise prints the JSON path of the problem and how to fix it, and exits 2. It runs the
    checks `generate` runs before loading weights, so what it passes, `generate` does not refuse for the config.
    """
    plan = check(config)
    for note in plan.notes:
        typer.echo(f"lumen: note: {note}", err=True)
    pools = ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(plan.pools().items()))
    typer.echo(f"ok: {config} is valid; {len(plan.entries)} plan entries; {pools}")


def check(config_arg: str):
    """What `Engine.load` checks before the tokenizer and the weights, by the same functions: the config and the
    plan (`prepare`), then the chat template it would use (a `model.chat-template` file must read and compile)."""
    from ...chat import format_for
    from ...engine import choose_chat_template, prepare
    from ...plugins import get_registry

    config, ckpt, arch, plan, _ = prepare(config_arg)
    fmt = format_for(get_registry(), arch.model_type or arch.config.get("model_type"))
    choose_chat_template(ckpt, fmt, config.chat_template_path, "model.chat-template")
    return plan


def _fmt(n: int) -> str:
    from ...plan import gib

    return gib(n)


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
