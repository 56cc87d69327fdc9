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
