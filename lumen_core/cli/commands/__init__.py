"""One CLI command per module; each exposes ``register(app)``."""

from typing import Annotated

import typer

ConfigOpt = Annotated[
    str,
    typer.Option("--config", "-c", help="Config JSON file, or an HF checkpoint directory (placed on CPU/RAM)."),
]
