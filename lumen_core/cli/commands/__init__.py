"""One CLI command per module; each exposes ``register(app)``."""

from typing import Annotated

import typer

ConfigOpt = Annotated[
    str,
    typer.Option("--config", "-c", help="Config JSON file, or a checkpoint (HF dir or .gguf file) run on CPU/RAM."),
]
