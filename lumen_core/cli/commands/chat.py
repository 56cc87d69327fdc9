"""``lumen chat``: an interactive conversation in the terminal, through the model's chat template and format."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from . import (
    ChatTemplateOpt,
    ConfigOpt,
    DraftModelOpt,
    DraftTokensOpt,
    MtpOpt,
    NoDraftFallbackOpt,
    ThreadsOpt,
    with_draft_options,
    with_threads,
)
from .generate import ImageOpt, image_message, read_images

Opt = typer.Option
HELP = ("commands: /reset (forget the conversation), /think on|off (thinking, where the template has it), "
        "/image PATH (an image for your next message; needs the vision block), /exit")


def chat(
    config: ConfigOpt,
    system: Annotated[str | None, Opt("--system", help="System message at the start of the conversation.")] = None,
    think: Annotated[bool | None, Opt("--think/--no-think",
                                      help="Thinking on/off (templates with a switch; /think toggles it).")] = None,
    max_tokens: Annotated[int | None, Opt("--max-tokens", "-n", min=1,
                                          help="Most new tokens per reply (default: config, else 256).")] = None,
    temperature: Annotated[float | None, Opt("--temperature", "--temp",
                                             help="0 = greedy (default: config, else 0).")] = None,
    top_k: Annotated[int | None, Opt("--top-k", help="Keep the k most likely tokens (0 = off).")] = None,
    top_p: Annotated[float | None, Opt("--top-p", help="Nucleus sampling mass (1 = off).")] = None,
    min_p: Annotated[float | None, Opt("--min-p", help="Drop tokens below min-p × top probability.")] = None,
    seed: Annotated[int | None, Opt(help="Random seed for sampling.")] = None,
    chat_template: ChatTemplateOpt = None,
    draft_model: DraftModelOpt = None,
    draft_tokens: DraftTokensOpt = None,
    mtp: MtpOpt = False,
    no_draft_fallback: NoDraftFallbackOpt = False,
    image: ImageOpt = None,
    threads: ThreadsOpt = None,
):
    """Chat with the model in the terminal: type a message, Enter; the reply streams back.

    Reasoning is shown apart from the answer (dimmed on a terminal), tool calls the model writes are printed
    as JSON (nothing is executed). Commands: /reset, /think on|off, /image PATH, /exit (or Ctrl-D). The conversation is
    kept until /reset or the end of the context. A checkpoint without a chat template chats with its model
    family's (a note says so) or --chat-template FILE; a model that cannot chat is refused before loading.
    --draft-model PATH or --mtp turn on speculative decoding (as the config's draft block does); it falls back
    to plain decoding while that is measured faster, unless --no-draft-fallback.
    """
    from ...engine import load
    from ...errors import InputError

    pending = read_images(image)  # go with the first message
    config = with_threads(with_draft_options(config, draft_model, draft_tokens, mtp, no_draft_fallback), threads)
    engine = load(config, progress=True, chat_template=chat_template, chat=True, think=think)
    fmt = engine.chat_format()
    if temperature is None and "temperature" not in engine.config.sampling_defaults():
        temperature = 0.0
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "seed": seed}
    tty = sys.stdin.isatty()
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    typer.echo(f"lumen chat: {engine.config.model_path} ({fmt.name} format). {HELP}", err=True)
    while True:
        try:
            line = input("you> " if tty else "")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history, pending = list(start), []
            typer.echo("[conversation reset]", err=True)
            continue
        if text.startswith("/think"):
            think = _toggle(text, think, fmt, str(engine.tokenizer.chat_template))
            continue
        if text.startswith("/image"):
            try:
                pending += read_images([text[len("/image"):].strip()])
                typer.echo(f"[{len(pending)} image(s) go with your next message]", err=True)
            except InputError as exc:
                typer.echo(f"lumen: error: {exc}", err=True)
            continue
        if text.startswith("/"):
            typer.echo(f"[unknown command {text.split()[0]}; {HELP}]", err=True)
            continue
        history.append(image_message(text, pending))
        pending = []
        try:
            reply = _answer(engine, history, think, max_tokens, sampling, tty)
        except InputError as exc:  # e.g. the conversation outgrew the context
            history.pop()
            typer.echo(f"lumen: error: {exc}", err=True)
            continue
        history.append(reply)
        typer.echo(f"[{engine.stats.summary()}]", err=True)


def _toggle(text: str, think: bool | None, fmt, template: str) -> bool | None:
    if not fmt.thinking_kwarg or fmt.thinking_kwarg not in template:
        typer.echo("[this model's chat template has no thinking switch]", err=True)
        return think
    arg = text[len("/think"):].strip().lower()
    if arg not in ("", "on", "off"):
        typer.echo("[usage: /think on|off]", err=True)
        return think
    current = fmt.thinking_default if think is None else think
    think = (not current) if arg == "" else arg == "on"
    typer.echo(f"[thinking {'on' if think else 'off'}]", err=True)
    return think


def _answer(engine, history, think, max_tokens, sampling, tty) -> dict:
    """Stream one reply to stdout; the assistant message to keep in the history."""
    from ...chat import Reasoning, ToolCall, collect

    dim, reset = ("\x1b[2m", "\x1b[0m") if tty else ("", "")
    events, thinking = [], False
    for event in engine.chat(history, think=think, max_tokens=max_tokens, **sampling):
        events.append(event)
        if isinstance(event, Reasoning):
            sys.stdout.write(("" if thinking else f"{dim}[thinking] ") + event.text)
            thinking = True
            continue
        if thinking:
            sys.stdout.write(f"{reset}\n")
            thinking = False
        if isinstance(event, ToolCall):
            sys.stdout.write(f"\n[tool call] {event.name}({json.dumps(event.arguments, ensure_ascii=False)})\n")
        else:
            sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write(f"{reset}\n" if thinking else "\n")
    sys.stdout.flush()
    content, reasoning, calls = collect(events)
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
