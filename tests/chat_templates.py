"""The real chat templates the tests render, all inside this repository (tests/data/README.md names each source)."""

from __future__ import annotations

from pathlib import Path

from lumen_core.chat import package_template

DATA = Path(__file__).resolve().parent / "data" / "templates"
PACKAGES = {"qwen3_5.jinja": "lumen_models_qwen", "gemma4.jinja": "lumen_models_gemma",
            "gemma3.jinja": "lumen_models_gemma"}


def real_template(name: str) -> str:
    """A template the model plugins ship (their family's, for checkpoints without one), or one in tests/data."""
    if name in PACKAGES:
        return package_template(PACKAGES[name], name)
    return (DATA / name).read_text(encoding="utf-8")
