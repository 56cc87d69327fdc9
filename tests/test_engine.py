"""The Python API: generate (greedy = transformers), sampling, stops, EOS, perplexity, input errors."""

from __future__ import annotations

import math

import pytest
import torch

import lumen_core as lumen
from lumen_core.errors import InputError

PROMPT = "The quick brown fox jumps over the lazy dog and"


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="module")
def engine(ckpt):
    return lumen.load({"model": {"path": str(ckpt), "hidden-layers": {"kv-cache": {"context-size": 128}}}},
                      progress=False)


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(ckpt)


def hf_greedy(hf, text: str, n: int) -> list[int]:
    model, tok = hf
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_text_equals_transformers(engine, hf, monkeypatch):
    monkeypatch.setattr(engine, "_eos", set)  # transformers runs without EOS here too
    expected = hf_greedy(hf, PROMPT, 24)
    assert engine.encode(PROMPT) == hf[1](PROMPT).input_ids
    assert list(engine.generate_tokens(engine.encode(PROMPT), max_tokens=24)) == expected
    text = "".join(engine.generate(PROMPT, max_tokens=24, temperature=0))
    assert text == hf[1].decode(expected, skip_special_tokens=True)


def test_streamed_pieces_are_only_new_text(engine):
    pieces = list(engine.generate(PROMPT, max_tokens=16, temperature=0))
    assert len(pieces) > 1
    assert not "".join(pieces).startswith(PROMPT)


def test_max_tokens_is_respected(engine):
    ids = list(engine.generate_tokens(engine.encode(PROMPT), max_tokens=5))
    assert len(ids) == 5 and engine.stats.finish_reason == "length"


def test_same_seed_same_text_and_other_seed_differs(engine):
    def run(seed):
        return "".join(engine.generate(PROMPT, max_tokens=24, temperature=1.0, seed=seed))

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sampling_filters_are_accepted(engine):
    text = "".join(engine.generate(PROMPT, max_tokens=8, temperature=0.7, top_k=20, top_p=0.95, min_p=0.05,
                                   seed=1))
    assert isinstance(text, str) and engine.stats.generated_tokens == 8


def test_eos_stops_generation(engine, monkeypatch):
    first = next(iter(engine.generate_tokens(engine.encode(PROMPT), max_tokens=1)))
    monkeypatch.setattr(engine, "_eos", lambda: {first})
    assert list(engine.generate_tokens(engine.encode(PROMPT), max_tokens=10)) == []
    assert engine.stats.finish_reason == "stop"


def test_stop_string_cuts_the_text(engine):
    full = "".join(engine.generate(PROMPT, max_tokens=24, temperature=0))
    stop = full[5:8]
    assert stop and stop in full
    cut = "".join(engine.generate(PROMPT, max_tokens=24, temperature=0, stop=[stop]))
    assert cut == full[: full.index(stop)]
    assert engine.stats.finish_reason == "stop"


def test_perplexity_equals_transformers(engine, hf):
    text = "A short essay about the colour of the sky, and why it is blue at noon but red at dusk."
    model, tok = hf
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    result = engine.perplexity(text)
    assert result["tokens"] == ids.shape[1] - 1
    assert abs(result["nll"] - loss) <= 1e-5
    assert math.isclose(result["perplexity"], math.exp(result["nll"]))


def test_oversized_prompt_names_the_sizes(engine):
    with pytest.raises(InputError, match=r"has \d+ tokens but the context size is 128.*context-size"):
        list(engine.generate("word " * 200, max_tokens=2))


def test_generation_stops_when_the_context_is_full(engine):
    prompt = engine.encode("word " * 60)[:120]
    out = list(engine.generate_tokens(prompt, max_tokens=50))
    assert len(prompt) + len(out) <= 128 + 1
    assert engine.stats.finish_reason == "length"


@pytest.mark.parametrize(("option", "value", "pattern"), [
    ("temperature", -1.0, "temperature"), ("top_p", 0.0, "top_p"), ("top_k", -3, "top_k"),
    ("min_p", 2.0, "min_p"), ("typo_option", 1, "unknown sampling option"),
])
def test_bad_sampling_values_are_refused(engine, option, value, pattern):
    with pytest.raises(InputError, match=pattern):
        list(engine.generate(PROMPT, max_tokens=2, **{option: value}))


@pytest.mark.parametrize("value", [0, -2, 1.5])
def test_bad_max_tokens_is_refused(engine, value):
    with pytest.raises(InputError, match="max_tokens"):
        list(engine.generate(PROMPT, max_tokens=value))


def test_chat_prompt_uses_the_template(engine):
    prompt = engine.chat_prompt([{"role": "user", "content": "Hello"}])
    assert prompt.startswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")


def test_load_accepts_a_checkpoint_directory(ckpt):
    engine = lumen.load(str(ckpt), progress=False)
    assert engine.plan.entries[0].device == "cpu"


class _RunAheadRunner:
    """A DecodeRunner on the CPU model that offers greedy_tokens the way the CUDA one does: it computes up to two
    steps ahead of what was consumed, so the engine's loop is exercised against a runner that runs ahead."""

    def __init__(self, model, context):
        self.model, self.cache, self.ahead = model, model.new_cache(context), []

    def reset(self):
        self.cache = self.model.new_cache(self.cache.capacity if hasattr(self.cache, "capacity") else 128)

    def step(self, token):
        return self.model.forward([token], self.cache)

    def sampler(self, params):
        from lumen_core.sampling import make_sampler

        return make_sampler(params)

    def greedy_tokens(self, token):
        import numpy as np

        queue = []

        def launch(tok):
            if self.cache.pos < 128:
                queue.append(int(np.argmax(self.model.forward([tok], self.cache)[-1])))

        launch(token)
        if queue:
            launch(queue[-1])
        while queue:
            tok = queue.pop(0)
            if queue:
                launch(queue[-1])
            self.ahead.append(self.cache.pos)
            yield tok


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 200])
def test_pipelined_greedy_runner_gives_the_same_tokens(engine, monkeypatch, max_tokens):
    """The engine's greedy loop over DecodeRunner.greedy_tokens (a runner that computes ahead) yields what the
    step-by-step loop yields, and stops at max_tokens, EOS and a full context the same way."""
    prompts = [engine.encode(PROMPT), engine.encode("word " * 60)[:120]]

    def run():
        outs, reasons = [], []
        for p in prompts:
            outs.append(list(engine.generate_tokens(p, max_tokens=max_tokens)))
            reasons.append((engine.stats.finish_reason, engine.stats.generated_tokens))
        return outs, reasons

    want, want_reasons = run()
    runner = _RunAheadRunner(engine.model, 128)
    monkeypatch.setattr(engine, "decode_runner", lambda: runner)
    got, got_reasons = run()
    assert got == want and got_reasons == want_reasons
    if max_tokens > 1:
        assert runner.ahead, "the engine did not use greedy_tokens"
    monkeypatch.setattr(engine, "_eos", lambda: {want[0][min(3, len(want[0]) - 1)]})
    stopped = list(engine.generate_tokens(prompts[0], max_tokens=max_tokens))
    assert stopped == want[0][:min(3, len(want[0]) - 1)]


def test_the_decode_runner_is_asked_only_when_the_other_backends_host_experts_it_can_embed():
    """Engine.decode_runner asks the output layer's backend for a replayable step when every component is on it,
    or when the only others are routed experts on a backend it names in ``graph_guests`` (CPU experts under a GPU
    model: host nodes of the CUDA graph); a layer on another backend means op by op."""
    from lumen_core.engine import Engine

    class Main:
        name, device, graph_guests = "gpu", "gpu:0", ("cpu",)

        def decode_runner(self, model, context_size):
            return "runner"

    class Guest:
        name = "cpu"

    main, guest = Main(), Guest()

    def runner(backends):
        engine = Engine.__new__(Engine)
        engine.model, engine.context_size, engine._runner, engine.backends = None, 8, None, backends
        return engine.decode_runner()

    alone = {("output-layer", None): main, ("layer", 0): main, ("experts", 0): main}
    assert runner(alone) == "runner"
    assert runner({**alone, ("experts", 0): guest}) == "runner"
    assert runner({**alone, ("experts", 0): guest, ("layer", 1): guest}) is False
    Main.graph_guests = ()
    assert runner({**alone, ("experts", 0): guest}) is False


def test_backend_call_brings_the_arguments_over_and_the_result_back():
    """Backend.call(target, fn, *args): fn runs on target's arrays and its result comes back (the default every
    backend without a captured step keeps); on the same backend it is a plain call."""
    import numpy as np

    from lumen_core.backend import Backend

    class Boxed:  # another device's array
        def __init__(self, a):
            self.a = a

    class Other:
        def take(self, x):
            return x if isinstance(x, Boxed) else Boxed(np.asarray(x))

    class Here:
        def take(self, x):
            return x.a * 1 if isinstance(x, Boxed) else x

    here, other = Here(), Other()
    seen = []

    def fn(x, y):
        seen.append((type(x), type(y)))
        return Boxed(x.a + y.a)

    out = Backend.call(here, other, fn, np.ones(3), np.arange(3.0))
    assert isinstance(out, np.ndarray) and out.tolist() == [1.0, 2.0, 3.0] and seen == [(Boxed, Boxed)]
    assert Backend.call(here, here, lambda x: x * 2, np.ones(2)).tolist() == [2.0, 2.0]


@pytest.mark.parametrize("context", [1, 2, 3])
def test_the_load_warm_up_fits_any_context(ckpt, context, monkeypatch):
    """The CPU backend compiles its kernels on first use: the load runs one short forward on a throwaway cache of
    at most 16 tokens, which must fit even a 1-token context; the engine's own cache starts empty."""
    calls = []
    real = lumen.Engine.warm_up
    monkeypatch.setattr(lumen.Engine, "warm_up", lambda self: calls.append(1) or real(self))
    small = lumen.load({"model": {"path": str(ckpt), "hidden-layers": {"kv-cache": {"context-size": context}}}},
                       progress=False)
    assert calls == [1]
    assert len(list(small.generate_tokens([5], max_tokens=4))) <= context
