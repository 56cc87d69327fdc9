"""One CLI command per module; each exposes ``register(app)``."""

from typing import Annotated

import typer

ConfigOpt = Annotated[
    str,
    typer.Option("--config", "-c", help="Config JSON file, or a checkpoint run on CPU/RAM: an HF directory, a .gguf "
                 "file, or a Hugging Face model id (Org/Name) found in the local HF cache."),
]

ChatTemplateOpt = Annotated[
    str | None,
    typer.Option("--chat-template", help="Jinja chat template file to chat with (default: the config's "
                 "model.chat-template, else the checkpoint's template, else the model family's)."),
]

# Speculative decoding (issue 20): the options that set the config's draft block, on generate, chat, serve, show-plan.
DraftModelOpt = Annotated[
    str | None,
    typer.Option("--draft-model", metavar="PATH",
                 help="Speculative decoding with this draft model (LumenLLM's option): an HF checkpoint directory, "
                 ".gguf file or Hugging Face model id sharing the model's tokenizer. It proposes tokens the model "
                 "verifies in one step; it computes and stores like the config's model (compute/store). Replaces "
                 "the config's draft block."),
]
DraftTokensOpt = Annotated[
    int | None,
    typer.Option("--draft-tokens", metavar="N", min=1,
                 help="Tokens the draft model (or MTP head) proposes per verification step (the config's "
                 "draft.num-draft-tokens; default: the config's, else 4). Needs a draft: --draft-model, --mtp or "
                 "the config's draft block."),
]
MtpOpt = Annotated[
    bool,
    typer.Option("--mtp", help="Speculative decoding with the checkpoint's own multi-token-prediction head (Qwen "
                 "3.5's mtp.* tensors; draft.mtp: true) instead of a draft model; refused for a checkpoint without "
                 "one. Replaces the config's draft block."),
]
NoDraftFallbackOpt = Annotated[
    bool,
    typer.Option("--no-draft-fallback",
                 help="Speculate on every round (draft.fallback: false). By default the engine times its rounds and "
                 "decodes without drafts while that is faster (an MoE model, a draft that is rarely right), "
                 "trying speculation again now and then; the output is the same either way. Needs a draft: "
                 "--draft-model, --mtp or the config's draft block."),
]


ThreadsOpt = Annotated[
    int | None,
    typer.Option("--threads", metavar="N", min=1,
                 help="Threads of the CPU backend's compute pool (the config's cpu.threads): every component computed "
                 "on the CPU uses them. Default: the config's, else one per core (NUMBA_NUM_THREADS where set)."),
]


def with_threads(config, threads: int | None):
    """The --config argument (or a Config) with --threads N applied as cpu.threads; unchanged when not given."""
    if threads is None:
        return config
    from ...config import Config, config_from_path_or_model

    cfg = config if isinstance(config, Config) else config_from_path_or_model(config)
    return cfg.with_threads(threads)


def with_draft_options(config_arg: str, draft_model: str | None, draft_tokens: int | None, mtp: bool,
                       no_fallback: bool = False):
    """The --config argument with --draft-model / --draft-tokens / --mtp / --no-draft-fallback applied: a Config
    checked as a config file is (``Config.with_draft``; a relative --draft-model is relative to the working
    directory); the argument itself when none is given (the engine reads it then)."""
    if draft_model is None and draft_tokens is None and not mtp and not no_fallback:
        return config_arg
    from ...config import config_from_path_or_model

    return config_from_path_or_model(config_arg).with_draft(draft_model, draft_tokens, mtp,
                                                            False if no_fallback else None)
