"""``lumen validate``: schema + semantic checks and the plan, without loading a weight."""

from __future__ import annotations

import typer

from . import ConfigOpt, DraftModelOpt, DraftTokensOpt, MtpOpt, with_draft_options


def validate(config: ConfigOpt, draft_model: DraftModelOpt = None, draft_tokens: DraftTokensOpt = None,
             mtp: MtpOpt = False):
    """Check a config: JSON Schema, placement rules, sampling values, devices, backends, op coverage, context size,
    memory fit, the chat template file and a draft model's tokenizer (the main model's vocabulary and EOS ids).

    Reads only the checkpoint's headers. Exits 0 and prints a one-line summary when the config can run (and its
    notes on stderr); otherwise prints the JSON path of the problem and how to fix it, and exits 2. It runs the
    checks `generate` runs before loading weights, so what it passes, `generate` does not refuse for the config.
    """
    plan = check(with_draft_options(config, draft_model, draft_tokens, mtp))
    for note in plan.notes:
        typer.echo(f"lumen: note: {note}", err=True)
    pools = ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(plan.pools().items()))
    typer.echo(f"ok: {config} is valid; {len(plan.entries)} plan entries; {pools}")


def check(config_arg):
    """What `Engine.load` checks before the tokenizer and the weights, by the same functions: the config and the
    plan (`prepare`), then the chat template it would use (a `model.chat-template` file must read and compile)."""
    from ...chat import format_for
    from ...engine import choose_chat_template, prepare
    from ...plugins import get_registry

    config, ckpt, arch, plan, resolved = prepare(config_arg)
    fmt = format_for(get_registry(), arch.model_type or arch.config.get("model_type"))
    choose_chat_template(ckpt, fmt, config.chat_template_path, "model.chat-template")
    if resolved.get("draft_config") is not None:  # what Engine.load refuses of a draft model, before its weights
        _check_draft_tokenizer(config, ckpt, resolved["draft_config"])
    return plan


def _check_draft_tokenizer(config, ckpt, draft_config) -> None:
    """The draft model's tokenizer against the main model's (``check_draft_tokenizer``): the same vocabulary and EOS
    ids. Reads the two tokenizers, no weight."""
    from ...checkpoint import open_checkpoint
    from ...draft import check_draft_tokenizer
    from ...plugins import get_registry

    draft_ckpt = open_checkpoint(draft_config.model_path, get_registry())
    check_draft_tokenizer(ckpt.load_tokenizer(), draft_ckpt.load_tokenizer(), config.model_path,
                          draft_config.model_path)


def _fmt(n: int) -> str:
    from ...plan import gib

    return gib(n)


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
