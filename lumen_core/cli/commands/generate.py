"""``lumen generate``: stream new text to stdout; progress and timing go to stderr."""

from __future__ import annotations

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

Opt = typer.Option
ImageOpt = Annotated[list[str] | None, Opt("--image", metavar="PATH",
                                           help="An image for the vision tower (repeatable; needs the config's "
                                                "vision block). Without --chat the prompt holds one placeholder "
                                                "per image (Qwen: <|vision_start|><|image_pad|><|vision_end|>); "
                                                "with --chat the images go before the text of the message.")]


def read_images(paths: list[str] | None) -> list:
    """The --image files, decoded and checked before the model loads (a bad one is refused naming it)."""
    if not paths:
        return []
    from ...images import images_from

    return images_from(list(paths))


def image_message(text: str, images: list) -> dict:
    """A user message: the images first, then the text (as the chat templates render image parts)."""
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image", "image": im} for im in images]
            + [{"type": "text", "text": text}]}


def generate(
    config: ConfigOpt,
    prompt: Annotated[str | None, Opt("--prompt", "-p", help="Prompt text; '-' reads stdin.")] = None,
    prompt_file: Annotated[str | None, Opt("--prompt-file", help="Read the prompt from a file.")] = None,
    max_tokens: Annotated[int | None, Opt("--max-tokens", "-n", min=1,
                                          help="Most new tokens (default: config, else 256).")] = None,
    chat: Annotated[bool, Opt("--chat", help="Wrap the prompt as a user turn with the chat template; the reply "
                                           "is parsed (reasoning to stderr, the answer to stdout).")] = False,
    system: Annotated[str | None, Opt("--system", help="System message (with --chat).")] = None,
    think: Annotated[bool | None, Opt("--think/--no-think",
                                      help="Chat templates with a thinking switch: turn it on/off.")] = None,
    temperature: Annotated[float | None, Opt("--temperature", "--temp",
                                             help="0 = greedy (default: config, else 0).")] = None,
    top_k: Annotated[int | None, Opt("--top-k", help="Keep the k most likely tokens (0 = off).")] = None,
    top_p: Annotated[float | None, Opt("--top-p", help="Nucleus sampling mass (1 = off).")] = None,
    min_p: Annotated[float | None, Opt("--min-p", help="Drop tokens below min-p × top probability.")] = None,
    seed: Annotated[int | None, Opt(help="Random seed: the same seed gives the same text.")] = None,
    stop: Annotated[list[str] | None, Opt("--stop", help="Stop string (repeatable).")] = None,
    chat_template: ChatTemplateOpt = None,
    draft_model: DraftModelOpt = None,
    draft_tokens: DraftTokensOpt = None,
    mtp: MtpOpt = False,
    no_draft_fallback: NoDraftFallbackOpt = False,
    image: ImageOpt = None,
    threads: ThreadsOpt = None,
    quiet: Annotated[bool, Opt("--quiet", "-q", help="No progress lines or timing summary on stderr.")] = False,
):
    """Generate text from a prompt with the model and placement the config describes.

    Only the new text goes to stdout, streamed as it is produced; the loading progress (each phase and its
    time) and a timing summary go to stderr. Sampling options override the config's other-parameters. With
    --chat, a model that cannot chat (no template) or a --think its template lacks is refused before loading.
    --draft-model PATH or --mtp turn on speculative decoding (as the config's draft block does); it falls back
    to plain decoding while that is measured faster, unless --no-draft-fallback.
    """
    from ...engine import load
    from ...errors import InputError

    text = _read_prompt(prompt, prompt_file)
    images = read_images(image)
    if (system is not None or think is not None) and not chat:
        raise InputError(f"{'--system' if system is not None else '--think/--no-think'} needs --chat")
    config = with_threads(with_draft_options(config, draft_model, draft_tokens, mtp, no_draft_fallback), threads)
    engine = load(config, progress=not quiet, chat_template=chat_template, chat=chat, think=think)
    if temperature is None and "temperature" not in engine.config.sampling_defaults():
        temperature = 0.0
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [image_message(text, images)]
        _chat(engine, messages, think, max_tokens, stop, sampling)
    else:
        for piece in engine.generate(text, max_tokens=max_tokens, stop=stop, images=images or None, **sampling):
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()  # the text ends before the timing line on a shared terminal
    if not quiet:
        typer.echo(f"[{engine.stats.summary()}]", err=True)


def _chat(engine, messages, think, max_tokens, stop, sampling) -> None:
    """The reply through the model's chat format: the answer to stdout; reasoning to stderr (so a pipe gets only
    the answer); tool calls as one JSON line each on stdout."""
    import json

    from ...chat import Content, Reasoning, ToolCall

    thinking = False
    for event in engine.chat(messages, think=think, max_tokens=max_tokens, stop=stop, **sampling):
        if isinstance(event, Reasoning):
            if not thinking:
                sys.stderr.write("[thinking] ")
                thinking = True
            sys.stderr.write(event.text)
            sys.stderr.flush()
            continue
        if thinking:
            sys.stderr.write("\n")
            thinking = False
        if isinstance(event, Content):
            sys.stdout.write(event.text)
        elif isinstance(event, ToolCall):
            sys.stdout.write(json.dumps({"tool_call": {"name": event.name, "arguments": event.arguments}},
                                        ensure_ascii=False) + "\n")
        sys.stdout.flush()
    if thinking:
        sys.stderr.write("\n")


def _read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    from ...errors import InputError

    if prompt is not None and prompt_file is not None:
        raise InputError("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        try:
            return open(prompt_file, encoding="utf-8").read()
        except OSError as exc:
            raise InputError(f"cannot read --prompt-file {prompt_file}: {exc.strerror}") from None
    if prompt == "-":
        return sys.stdin.read()
    if prompt is None:
        raise InputError("no prompt: pass --prompt TEXT, --prompt - (stdin) or --prompt-file FILE")
    return prompt


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
