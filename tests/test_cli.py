"""The ``lumen`` command: stdout carries only results, errors exit 2 with a message and no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lumen_core.cli import main


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5")


def test_generate_streams_text_to_stdout_and_timing_to_stderr(capsys, ckpt):
    code, out, err = run(capsys, "generate", "-c", str(ckpt), "--prompt", "The sky is", "-n", "8")
    assert code == 0
    assert out.endswith("\n") and "tok/s" not in out
    assert "generated" in err and "tok/s" in err


def test_generate_chat_with_sampling_options(capsys, ckpt):
    code, out, err = run(capsys, "generate", "-c", str(ckpt), "--prompt", "Hi", "--chat", "--temperature", "0.7",
                         "--top-k", "20", "--top-p", "0.95", "--min-p", "0.05", "--seed", "1", "-n", "6")
    assert code == 0, err
    code2, out2, err2 = run(capsys, "generate", "-c", str(ckpt), "--prompt", "Hi", "--chat", "--temperature", "0.7",
                            "--top-k", "20", "--top-p", "0.95", "--min-p", "0.05", "--seed", "1", "-n", "6")
    # the same seed, the same reply: answer (stdout) and reasoning (stderr, before the timing line)
    assert (out, err.splitlines()[:-1]) == (out2, err2.splitlines()[:-1])


def test_generate_chat_parses_the_reply(capsys, ckpt):
    """--chat --think: the Qwen template opens <think>, so the reply starts as reasoning, which goes to stderr;
    no tag reaches stdout."""
    code, out, err = run(capsys, "generate", "-c", str(ckpt), "--prompt", "Hi", "--chat", "--think", "-n", "12")
    assert code == 0, err
    assert "[thinking] " in err
    assert "<think>" not in out and "</think>" not in out and "<tool_call>" not in out


def test_generate_reads_prompt_from_file_and_stdin(capsys, ckpt, tmp_path, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("The sky is")
    _, from_file, _ = run(capsys, "generate", "-c", str(ckpt), "--prompt-file", str(f), "-n", "5", "-q")
    monkeypatch.setattr(sys, "stdin", open(f))
    _, from_stdin, _ = run(capsys, "generate", "-c", str(ckpt), "--prompt", "-", "-n", "5", "-q")
    _, direct, _ = run(capsys, "generate", "-c", str(ckpt), "--prompt", "The sky is", "-n", "5", "-q")
    assert from_file == from_stdin == direct


def test_perplexity_json(capsys, ckpt, tmp_path):
    f = tmp_path / "essay.txt"
    f.write_text("Light from the sun scatters off the molecules of the air.")
    code, out, _ = run(capsys, "perplexity", "-c", str(ckpt), "--text-file", str(f), "--json")
    result = json.loads(out)
    assert code == 0 and set(result) == {"tokens", "nll", "perplexity"} and result["tokens"] > 5


def test_show_plan_table_and_json(capsys, ckpt):
    code, out, _ = run(capsys, "show-plan", "-c", str(ckpt))
    assert code == 0 and "layers.3" in out and "total host RAM" in out
    code, out, _ = run(capsys, "show-plan", "-c", str(ckpt), "--json")
    plan = json.loads(out)
    assert {e["component"] for e in plan["entries"]} >= {"input-layer", "layers.0", "cache.layers.3", "output-layer"}


def test_validate_ok(capsys, write_config, ckpt):
    code, out, _ = run(capsys, "validate", "-c", str(write_config({"model": {"path": str(ckpt)}})))
    assert code == 0 and out.startswith("ok:")


@pytest.mark.parametrize(("config", "needle"), [
    ({"model": {"path": "x", "stor": "ram"}}, "model.stor"),
    ({"model": {"path": "x", "compute": "cpu", "store": "vram"}}, "model.store"),
    ({"model": {"path": "x", "compute": "wgpu:0"}}, "backend 'wgpu' is not installed"),
    ({"model": {"path": "/nonexistent/ckpt"}}, "checkpoint not found"),
    ({"model": {"path": "x"}, "vision": {"compute": "cpu"}}, "vision"),
])
def test_bad_configs_exit_2_without_traceback(capsys, write_config, tiny_checkpoint, config, needle):
    if config["model"]["path"] == "x":
        config["model"]["path"] = str(tiny_checkpoint("qwen3_5"))
    code, out, err = run(capsys, "validate", "-c", str(write_config(config)))
    assert code == 2 and out == ""
    assert needle in err and "Traceback" not in err


def test_missing_prompt_is_a_clear_error(capsys, ckpt):
    code, _, err = run(capsys, "generate", "-c", str(ckpt))
    assert code == 2 and "no prompt" in err


def test_plugins_lists_distributions(capsys):
    code, out, _ = run(capsys, "plugins")
    assert code == 0 and "lumen-cpu" in out and "lumen-models-qwen" in out and "qwen3_5_moe" in out


def test_console_script_is_installed(ckpt):
    lumen = shutil.which("lumen") or str(Path(sys.executable).with_name("lumen"))
    proc = subprocess.run([lumen, "generate", "-c", str(ckpt), "-p", "Hello", "-n", "3", "-q"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def test_think_flag_needs_a_template_with_a_thinking_switch(capsys, ckpt, tmp_path):
    code, _, err = run(capsys, "generate", "-c", str(ckpt), "-p", "Hi", "--chat", "--no-think", "-n", "2", "-q")
    assert code == 0, err  # the Qwen 3.5 template has enable_thinking
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in ckpt.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    (plain / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    code, _, err = run(capsys, "generate", "-c", str(plain), "-p", "Hi", "--chat", "--think", "-n", "2")
    assert code == 2 and "no thinking switch" in err
