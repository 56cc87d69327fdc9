"""``lumen perplexity``: score a text; how users and tests compare numerics across backends and formats."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from . import ConfigOpt, ThreadsOpt, with_threads


def perplexity(
    config: ConfigOpt,
    text_file: Annotated[str, typer.Option("--text-file", "-f", help="UTF-8 text to score.")],
    as_json: Annotated[bool, typer.Option("--json", help='Print {"tokens", "nll", "perplexity"}.')] = False,
    threads: ThreadsOpt = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress lines or timing summary on stderr.")]
    = False,
):
    """Mean negative log-likelihood (nats) per predicted token, and its exp (perplexity).

    The text is tokenized as the checkpoint's tokenizer config says (BOS added when it asks for one);
    every token after the first is predicted from the ones before it. The text must fit the context size.
    The result goes to stdout; the loading progress and a timing summary go to stderr.
    """
    from ...engine import load
    from ...errors import InputError

    try:
        text = open(text_file, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read --text-file {text_file}: {exc}") from None
    engine = load(with_threads(config, threads), progress=not quiet)
    result = engine.perplexity(text)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(f"tokens {result['tokens']}  nll {result['nll']:.6f} nats  perplexity {result['perplexity']:.4f}")
    if not quiet:
        typer.echo(f"[{engine.stats.summary()}]", err=True)


def register(app: typer.Typer) -> None:
    app.command("perplexity")(perplexity)
