"""``lumen show-plan``: every component's backend, device, store, format and bytes; totals per pool."""

from __future__ import annotations

from typing import Annotated

import typer

from . import ConfigOpt, DraftModelOpt, DraftTokensOpt, MtpOpt, with_draft_options


def build_plan(config_arg: str, draft_model: str | None = None, draft_tokens: int | None = None, mtp: bool = False):
    from ...engine import prepare

    return prepare(with_draft_options(config_arg, draft_model, draft_tokens, mtp))[3]


def show_plan(
    config: ConfigOpt,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    draft_model: DraftModelOpt = None,
    draft_tokens: DraftTokensOpt = None,
    mtp: MtpOpt = False,
):
    """Print the plan: where each component computes, where its weights live, and the bytes it needs.

    Cache rows are the KV cache (full attention) or recurrent state (Gated-DeltaNet) of each layer at the
    configured context size. Totals are per memory pool and compared with what is available; a plan that
    does not fit is refused here, before any weight is loaded. With a draft model (the config's draft block or
    --draft-model) its rows follow, labelled draft.*, planned at the model's context size and counted in the same
    totals; with --mtp (draft.mtp) the MTP head is the row mtp and its cache cache.mtp.
    """
    from ...plan import format_plan

    plan = build_plan(config, draft_model, draft_tokens, mtp)
    typer.echo(plan.to_json() if as_json else format_plan(plan))


def register(app: typer.Typer) -> None:
    app.command("show-plan")(show_plan)
