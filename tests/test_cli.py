"""The ``lumen`` command: stdout carries only results, errors exit 2 with a message and no traceback."""

from __future__ import annotations

import json
import re
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


def test_perplexity_prints_its_timing_line_like_generate(capsys, ckpt, tmp_path):
    f = tmp_path / "essay.txt"
    f.write_text("Light from the sun scatters off the molecules of the air.")
    code, out, err = run(capsys, "perplexity", "-c", str(ckpt), "--text-file", str(f))
    assert code == 0 and out.startswith("tokens ") and "tok/s" not in out
    assert re.search(r"^\[scored \d+ tok in [\d.]+ s, [\d.]+ tok/s\]$", err, re.M), err
    _, _, quiet = run(capsys, "perplexity", "-c", str(ckpt), "--text-file", str(f), "-q")
    assert quiet == ""


def test_each_load_phase_reports_one_line_with_its_time_when_not_a_terminal(capsys, ckpt):
    """stderr is not a terminal here: no bars, one line per phase (tokenizer, weights, the CPU kernels' warm-up)
    before the text's timing line; --quiet prints none of it."""
    code, _, err = run(capsys, "generate", "-c", str(ckpt), "--prompt", "The sky is", "-n", "2")
    assert code == 0
    phases = re.findall(r"^lumen: (tokenizer|weights|warm-up): [\d.]+ s", err, re.M)
    assert phases == ["tokenizer", "weights", "warm-up"], err
    assert "\r" not in err and "\x1b" not in err
    _, _, quiet = run(capsys, "generate", "-c", str(ckpt), "--prompt", "The sky is", "-n", "2", "-q")
    assert quiet == ""


def test_on_a_terminal_a_long_phase_shows_a_live_line_then_its_result():
    import io
    import time

    from lumen_core.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    with Progress(True, term).phase("tokenizer") as phase:
        time.sleep(1.6)
        phase.note = "cache built"
    text = term.getvalue()
    assert "\rlumen: tokenizer … 1 s" in text or "\x1b[2Klumen: tokenizer … 1 s" in text, repr(text)
    assert text.endswith("\r\x1b[2Klumen: tokenizer: 1.6 s (cache built)\n"), repr(text)


def test_unknown_flags_and_commands_are_usage_errors(capsys):
    """click's usage errors: its message, exit 2, no traceback (typer vendors click: they are not `click`'s)."""
    for argv, needle in ((["generate", "--bogus"], "No such option: --bogus"), (["bogus"], "No such command"),
                         (["generate", "-c", "x.json", "-n", "0"], "Invalid value for '--max-tokens'")):
        code, out, err = run(capsys, *argv)
        assert code == 2 and needle in err and "Usage: lumen" in err and "Traceback" not in err, (argv, err)


def test_console_script_usage_error_exits_2():
    lumen = shutil.which("lumen") or str(Path(sys.executable).with_name("lumen"))
    proc = subprocess.run([lumen, "generate", "--bogus"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "No such option" in proc.stderr and "Traceback" not in proc.stderr


def test_a_missing_gguf_file_is_reported_as_a_missing_file(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "-c", str(tmp_path / "model.gguf"), "-p", "hi")
    assert code == 2 and "GGUF file not found" in err and "HF checkpoint directory" not in err


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
    ({"model": {"path": "x", "compute": "wgpu:7"}}, "wgpu:7"),  # no such adapter (or lumen-wgpu not installed)
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


# ---------------------------------------------------------------- issue 15: validate and generate agree


def _validate_and_generate(capsys, path) -> tuple[tuple[int, str], tuple[int, str]]:
    """(code, stderr) of `lumen validate` and of `lumen generate` on one config; an exception escaping main (a
    traceback) fails the test."""
    v_code, _, v_err = run(capsys, "validate", "-c", str(path))
    g_code, _, g_err = run(capsys, "generate", "-c", str(path), "-p", "Hi", "-n", "2", "-q")
    return (v_code, v_err), (g_code, g_err)


@pytest.mark.parametrize(("model", "where", "needle"), [
    ({"hidden-layers": {"kv-cache": {"context-size": 4096.0}}}, "model.hidden-layers.kv-cache.context-size",
     "expected integer, got number 4096.0"),
    ({"other-parameters": {"seed": -1}}, "model.other-parameters.seed", "must be >= 0, got -1"),
    ({"other-parameters": {"top-k": 5.0}}, "model.other-parameters.top-k", "expected integer, got number 5.0"),
    ({"other-parameters": {"max-tokens": 5.0}}, "model.other-parameters.max-tokens", "expected integer"),
    ({"other-parameters": {"temperature": "1e999"}}, "model.other-parameters.temperature", "not a finite number"),
    ({"compute": "cpu\n"}, "model.compute", "is not a compute device"),
    ({"hidden-layers": {"kv-cache": {"context-size": 1000000}}}, "model.hidden-layers.kv-cache.context-size",
     "context-size 1000000 is beyond the model's trained context of 4096 tokens"),
    ({"chat-template": "missing.jinja"}, "", "cannot read the chat template file"),
])
def test_what_generate_refuses_validate_refuses_with_the_same_message(capsys, tmp_path, ckpt, model, where, needle):
    """Issue 15: each of these passed `validate` and then failed (or crashed, for 4096.0) in `generate`."""
    text = json.dumps({"model": {"path": str(ckpt), **model}}).replace('"1e999"', "1e999")
    path = tmp_path / "c.json"
    path.write_text(text)
    (v_code, v_err), (g_code, g_err) = _validate_and_generate(capsys, path)
    assert v_code == g_code == 2, (v_err, g_err)
    assert v_err == g_err and v_err.startswith("lumen: error: ") and needle in v_err, (v_err, g_err)
    assert f"config {where}:" in v_err if where else True


def test_allowed_context_beyond_training_runs_with_a_note_in_both(capsys, write_config, ckpt):
    path = write_config({"model": {"path": str(ckpt), "hidden-layers": {
        "kv-cache": {"context-size": 4100, "allow-beyond-trained-context": True}}}})
    (v_code, v_err), (g_code, g_err) = _validate_and_generate(capsys, path)
    assert v_code == g_code == 0, (v_err, g_err)
    for err in (v_err, g_err):
        assert "lumen: note: config model.hidden-layers.kv-cache.context-size: 4100 tokens is beyond" in err


def test_a_config_nested_5000_deep_exits_2(capsys, tmp_path, ckpt):
    deep_object = '{"a": ' * 5000 + "1" + "}" * 5000
    for text in ("[" * 5000 + "]" * 5000, json.dumps({"model": {"path": str(ckpt), "x": 0}}).replace("0}}", deep_object
                                                                                                       + "}}")):
        path = tmp_path / "deep.json"
        path.write_text(text)
        (v_code, v_err), (g_code, g_err) = _validate_and_generate(capsys, path)
        assert v_code == g_code == 2 and v_err == g_err and "nested" in v_err, v_err


def test_a_checkpoint_config_json_nested_5000_deep_exits_2(capsys, tmp_path, ckpt):
    deep = tmp_path / "deep-ckpt"
    shutil.copytree(ckpt, deep)
    config = json.loads((deep / "config.json").read_text())
    (deep / "config.json").write_text(json.dumps(config)[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}")
    code, _, err = run(capsys, "validate", "-c", str(deep))
    assert code == 2 and "config.json" in err


def test_a_gguf_with_metadata_arrays_nested_5000_deep_exits_2(capsys, tmp_path):
    import struct

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    path = tmp_path / "deep.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + string("general.architecture")
                     + struct.pack("<I", 8) + string("llama") + string("x") + struct.pack("<I", 9)
                     + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 0, 0))
    code, _, err = run(capsys, "validate", "-c", str(path))
    assert code == 2 and "deep.gguf" in err


def test_a_model_path_too_long_for_the_system_exits_2(capsys, write_config):
    code, _, err = run(capsys, "validate", "-c", str(write_config({"model": {"path": "m" * 5000}})))
    assert code == 2 and "too long" in err


def test_a_temperature_the_sampler_refuses_is_refused_by_validate_too(capsys, write_config, ckpt):
    """1e-320 passes the schema (>= 0) but overflowed the sampler (logits / 1e-320 -> inf -> NaN -> IndexError in
    generate); SamplingParams.validate() refuses it, and validate runs that check on the config."""
    path = write_config({"model": {"path": str(ckpt), "other-parameters": {"temperature": 1e-320}}})
    (v_code, v_err), (g_code, g_err) = _validate_and_generate(capsys, path)
    assert v_code == g_code == 2 and v_err == g_err, (v_err, g_err)
    assert "config model.other-parameters.temperature: " in v_err and "1e-320" in v_err
