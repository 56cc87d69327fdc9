"""``lumen show-plan``: every component's backend, device, store, format and bytes; totals per pool."""

from __future__ import annotations

from typing import Annotated

import typer

from . import ConfigOpt


def build_plan(config_arg: str):
    from ...checkpoint import open_checkpoint
    from ...config import config_from_path_or_model
    from ...plan import make_plan
    from ...plugins import get_registry

    config = config_from_path_or_model(config_arg)
    registry = get_registry()
    ckpt = open_checkpoint(config.model_path, registry)
    arch = registry.architecture_class(ckpt.config.get("model_type", "<missing>"))(ckpt.config)
    plan, _ = make_plan(config, arch, ckpt, registry)
    return plan


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
