"""``lumen validate``: schema + semantic checks and the plan, without loading a weight."""

from __future__ import annotations

import typer

from . import ConfigOpt


def validate(config: ConfigOpt):
    """Check a config: JSON Schema, placement rules, devices, backends, op coverage and memory fit.

    Reads only the checkpoint's headers. Exits 0 and prints a one-line summary when the config can run;
    otherwise prints the JSON path of the problem and how to fix it, and exits 2.
    """
    from .show_plan import build_plan

    plan = build_plan(config)
    pools = ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(plan.pools().items()))
    typer.echo(f"ok: {config} is valid; {len(plan.entries)} plan entries; {pools}")


def _fmt(n: int) -> str:
    from ...plan import gib

    return gib(n)


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
