"""One CLI command per module; each exposes ``register(app)``."""

from typing import Annotated

import typer

ConfigOpt = Annotated[
    str,
    typer.Option("--config", "-c", help="Config JSON file, or a checkpoint (HF dir or .gguf file) run on CPU/RAM."),
]

ChatTemplateOpt = Annotated[
    str | None,
    typer.Option("--chat-template", help="Jinja chat template file to chat with (default: the config's "
                 "model.chat-template, else the checkpoint's template, else the model family's)."),
]
