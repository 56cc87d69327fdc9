"""``lumen show-plan``: every component's backend, device, store, format and bytes; totals per pool."""

from __future__ import annotations

from typing import Annotated

import typer

from . import ConfigOpt


def build_plan(config_arg: str):
    from ...engine import prepare

    return prepare(config_arg)[3]


def show_plan(
    config: ConfigOpt,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
):
    """Print the plan: where each component computes, where its weights live, and the bytes it needs.

    Cache rows are the KV cache (full attention) or recurrent state (Gated-DeltaNet) of each layer at the
    configured context size. Totals are per memory pool and compared with what is available; a plan that
    does not fit is refused here, before any weight is loaded.
    """
    from ...plan import format_plan

    plan = build_plan(config)
    typer.echo(plan.to_json() if as_json else format_plan(plan))


def register(app: typer.Typer) -> None:
    app.command("show-plan")(show_plan)
