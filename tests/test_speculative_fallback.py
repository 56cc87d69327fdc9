"""Falling back from speculative to plain decoding where plain is faster (lumen_core.speculative.Fallback, the
engine's plain rounds, the drafters' ``skip``), on the CPU backend with tiny checkpoints.

The round timer is the engine's ``spec_clock``: most tests give it a fake clock that advances one unit per reading
and a drafter wrapper that adds a chosen cost to it in ``propose``, so which kind of round is faster (and when it
changes) is decided by the test, not by this machine's timing. Every generation is compared with plain greedy
decoding token for token; a drafter that skipped rounds and drafts again must still be right as often as before
(the self-draft and the agreeing MTP head: every draft kept), which fails if ``skip`` fed it the wrong tokens or
hidden rows."""

from __future__ import annotations

import itertools
import time

import pytest
from test_speculative import PROMPT, perturbed

from lumen_core.config import _nested_draft, load_config
from lumen_core.engine import load
from lumen_core.errors import ConfigError, InputError
from lumen_core.sampling import SamplingParams
from lumen_core.speculative import Drafter, DraftModel, Fallback, MTPDrafter


class FakeClock:
    """One unit per reading; ``t`` may be advanced by hand (a drafter's cost)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


class Costly(Drafter):
    """``inner`` with ``cost`` added to each proposal (with ``healed``: only until the first skip, 0 after) and
    ``skip_cost`` to each skip (a plain round's): ``clock.t`` advanced (a FakeClock) or a real ``time.sleep`` (clock
    None). ``log`` keeps the calls the engine made, in order."""

    def __init__(self, inner: Drafter, cost: float, healed: bool = False, clock: FakeClock | None = None,
                 skip_cost: float = 0.0):
        self.inner, self.cost, self.healed, self.clock, self.skip_cost = inner, cost, healed, clock, skip_cost
        self.needs_hidden = inner.needs_hidden
        self.log: list[str] = []

    def start(self, prompt_ids, computed, rows):
        self.inner.start(prompt_ids, computed, rows)

    def propose(self, last, k, params, seen, rng):
        cost = 0.0 if self.healed and "skip" in self.log else self.cost
        self.log.append("propose")
        if self.clock is not None:
            self.clock.t += cost
        elif cost:
            time.sleep(cost)
        return self.inner.propose(last, k, params, seen, rng)

    def accept(self, fed, keep, rows):
        self.inner.accept(fed, keep, rows)

    def skip(self, fed, rows):
        self.log.append("skip")
        if self.clock is not None:
            self.clock.t += self.skip_cost
        self.inner.skip(fed, rows)


@pytest.fixture(scope="module")
def qwen(tiny_checkpoint):
    """(main engine, the plain greedy reply of 90 tokens to PROMPT, the prompt's ids)."""
    engine = load(str(tiny_checkpoint("qwen3_5")), progress=False)
    ids = engine.encode(PROMPT)
    return engine, list(engine.generate_tokens(ids, 90)), ids


def drafting(engine, make, k: int = 4, fallback: bool = True, clock=None) -> list:
    """Draft with ``make(context) -> Drafter`` (a new one per generation); the drafters made, in a list."""
    made: list = []

    def factory(context):
        made.append(make(context))
        return made[-1]

    engine.draft_tokens, engine.drafter_factory, engine.draft_fallback = k, factory, fallback
    engine.spec_clock = clock or time.perf_counter
    return made


def plain(engine):
    engine.draft_tokens, engine.drafter_factory = 0, None
    engine.draft_fallback, engine.spec_clock = True, time.perf_counter


def test_a_slow_drafter_is_switched_off_and_the_next_generation_starts_plain(qwen):
    """Drafting costs 10 units a round (5 tokens) against 1 unit a plain token: after the first probe every round
    is plain but the probes of speculation; the same tokens; the next generation starts plain (remembered)."""
    engine, want, ids = qwen
    clock = FakeClock()
    made = drafting(engine, lambda c: Costly(DraftModel(engine.model, c), cost=10, clock=clock), clock=clock)
    try:
        assert list(engine.generate_tokens(ids, 90)) == want
        spec = engine.stats.speculative
        log = made[0].log
        first_skip = log.index("skip")
        assert spec.plain_rounds == log.count("skip") >= 40, (spec, log)
        assert spec.verifies == log.count("propose") and spec.acceptance == 1.0
        # after the switch, speculation runs only as probes: far fewer proposals than plain rounds
        assert log[first_skip:].count("propose") * 4 < log[first_skip:].count("skip"), log
        assert "tokens decoded plainly (fallback)" in engine.stats.summary()
        assert f"{spec.plain_rounds} tokens decoded plainly" in engine.stats.summary()
        # the next generation starts from what this one measured: plain from its first round
        assert list(engine.generate_tokens(ids, 10)) == want[:10]
        assert made[1].log == ["skip"] * 8 and engine.stats.speculative.verifies == 0  # 9th: the limit's own round
        assert engine.stats.speculative.plain_rounds == 8
    finally:
        plain(engine)


def test_a_really_slow_drafter_is_switched_off_on_the_wall_clock(qwen):
    """The same with the real clock: a proposal sleeps 0.1 s (20 ms a token) while a tiny plain step takes a few
    ms. Only the choice is asserted, not a speed."""
    engine, want, ids = qwen
    made = drafting(engine, lambda c: Costly(DraftModel(engine.model, c), cost=0.1))
    try:
        assert list(engine.generate_tokens(ids, 40)) == want[:40]
        assert engine.stats.speculative.plain_rounds >= 16, made[0].log
    finally:
        plain(engine)


def test_a_seeded_sampled_generation_keeps_to_speculation_and_reproduces(qwen, monkeypatch):
    """Sampled with an explicit seed, the slow drafter is not switched off (plain and speculative rounds draw
    differently, and the switch depends on timings): the same seed gives the same tokens twice, every round
    drafts. Without a seed the same drafter is switched off. EOS is off (the unseeded draw could end the
    generation before the switch: 19 tokens once)."""
    engine, _, ids = qwen
    monkeypatch.setattr(engine, "_eos", lambda: set())
    clock = FakeClock()
    made = drafting(engine, lambda c: Costly(DraftModel(engine.model, c), cost=10, clock=clock), clock=clock)
    try:
        runs = [list(engine.generate_tokens(ids, 40, SamplingParams(temperature=0.8, top_k=20, seed=11)))
                for _ in range(2)]
        assert runs[0] == runs[1] and len(runs[0]) == 40
        assert engine.stats.speculative.plain_rounds == 0 and "skip" not in made[0].log + made[1].log
        assert len(list(engine.generate_tokens(ids, 60, SamplingParams(temperature=0.8, top_k=20)))) == 60
        assert engine.stats.speculative.plain_rounds > 0 and "skip" in made[2].log
    finally:
        plain(engine)


def test_with_fallback_off_every_round_drafts(qwen):
    engine, want, ids = qwen
    clock = FakeClock()
    made = drafting(engine, lambda c: Costly(DraftModel(engine.model, c), cost=10, clock=clock), fallback=False,
                    clock=clock)
    try:
        assert list(engine.generate_tokens(ids, 90)) == want
        spec = engine.stats.speculative
        assert spec.plain_rounds == 0 and "skip" not in made[0].log and spec.verifies == made[0].log.count("propose")
        assert spec.accepted + spec.verifies >= 88  # every token but the prefill's and the last came from a verify
    finally:
        plain(engine)


def test_a_drafter_without_skip_is_never_skipped(qwen):
    """A Drafter class that does not override ``skip`` (a third party's, a benchmark's oracle) keeps drafting however
    slow it is: the engine cannot tell it about plain rounds."""

    class NoSkip(Costly):
        skip = Drafter.skip

    engine, want, ids = qwen
    clock = FakeClock()
    made = drafting(engine, lambda c: NoSkip(DraftModel(engine.model, c), cost=10, clock=clock), clock=clock)
    try:
        assert list(engine.generate_tokens(ids, 60)) == want[:60]
        assert engine.stats.speculative.plain_rounds == 0 and "skip" not in made[0].log
    finally:
        plain(engine)


@pytest.mark.parametrize("draft", ["self", "near", "mtp-equal", "mtp-random"])
def test_a_drafter_that_skipped_rounds_and_resumes_gives_plain_greedy(qwen, tiny_checkpoint, tmp_path, monkeypatch,
                                                                     draft):
    """Slow until the first plain round (21 units a round: over 4 a token), then free (1 unit a round), against 3
    units a plain token: the policy switches to plain rounds and, at its next probe, back to speculation (DECAY 0: the
    last round's pace decides, whatever the acceptance). The same tokens as plain greedy; the self-draft and the
    agreeing MTP head keep every draft after the skipped stretch too (skip fed them the right context)."""
    monkeypatch.setattr(Fallback, "DECAY", 0.0)
    if draft.startswith("mtp"):
        engine = load({"model": {"path": str(tiny_checkpoint("qwen3_5", mtp=draft[4:])), "compute": "cpu",
                                 "store": "ram"}, "draft": {"mtp": True}}, progress=False)
        model = engine.model

        def inner(c):
            return MTPDrafter(model, c)
        want = list(load(str(tiny_checkpoint("qwen3_5", mtp=draft[4:])), progress=False).generate_tokens(
            engine.encode(PROMPT), 90))
    else:
        engine, want, _ = qwen
        other = engine.model if draft == "self" else load(str(perturbed(tiny_checkpoint("qwen3_5"),
                                                                        tmp_path / "near", 0.03)), progress=False).model

        def inner(c):
            return DraftModel(other, c)
    clock = FakeClock()
    made = drafting(engine, lambda c: Costly(inner(c), cost=20, healed=True, clock=clock, skip_cost=2), clock=clock)
    try:
        assert list(engine.generate_tokens(engine.encode(PROMPT), 90)) == want
        log, spec = made[0].log, engine.stats.speculative
        assert spec.plain_rounds == log.count("skip") >= Fallback.FIRST_PROBE, log
        after = "".join("p" if c == "propose" else "s" for c in log[log.index("skip"):])
        # drafting again for longer than a probe (its untimed first round and PROBE_ROUNDS timed ones)
        assert "p" * (Fallback.PROBE_ROUNDS + 2) in after, after
        if draft in ("self", "mtp-equal"):
            assert spec.acceptance == 1.0, spec
    finally:
        plain(engine)


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3"])
@pytest.mark.parametrize("draft", ["self", "near"])
def test_any_pattern_of_plain_and_speculative_rounds_gives_plain_greedy(tiny_checkpoint, tmp_path, monkeypatch,
                                                                        kind, draft):
    """The policy replaced by a fixed pattern (plain stretches of 1 to 3 rounds between speculative ones): a
    recurrent model (Qwen) and one with sliding-window rings (Gemma 3), drafted by itself (every draft kept,
    before and after each skip) and by a perturbed copy (rewinds after the catch-ups)."""
    path = tiny_checkpoint(kind)
    engine = load(str(path), progress=False)
    ids = engine.encode(PROMPT)
    want = list(engine.generate_tokens(ids, 60))
    other = engine.model if draft == "self" else load(str(perturbed(path, tmp_path / "near", 0.03)),
                                                      progress=False).model
    pattern = itertools.cycle([True, False, True, True, False, False, False, True, False, False])
    monkeypatch.setattr(Fallback, "speculate", lambda self: next(pattern))
    drafting(engine, lambda c: DraftModel(other, c), k=3)
    assert list(engine.generate_tokens(ids, 60)) == want
    spec = engine.stats.speculative
    assert spec.plain_rounds > 10 and spec.verifies > 5
    if draft == "self":
        assert spec.acceptance == 1.0, spec


def test_an_mtp_head_skipping_from_the_first_round_catches_up_on_the_prompt_and_the_skipped_tokens(
        tiny_checkpoint, monkeypatch):
    """Plain rounds from the start: the head's first catch-up covers the prompt and every skipped token with the
    main model's hidden rows of each; every draft of the agreeing head is kept."""
    path = tiny_checkpoint("qwen3_5", mtp="equal")
    engine = load({"model": {"path": str(path), "compute": "cpu", "store": "ram"}, "draft": {"mtp": True}},
                  progress=False)
    want = list(load(str(path), progress=False).generate_tokens(engine.encode(PROMPT), 40))
    pattern = itertools.chain([False] * 7, itertools.cycle([True, False, False]))
    monkeypatch.setattr(Fallback, "speculate", lambda self: next(pattern))
    assert list(engine.generate_tokens(engine.encode(PROMPT), 40)) == want
    spec = engine.stats.speculative
    assert spec.plain_rounds >= 7 and spec.verifies > 0 and spec.acceptance == 1.0, spec


def test_skip_queues_without_running_a_model(tiny_checkpoint):
    """``skip`` is bookkeeping: a DraftModel adds the token to what its next proposal feeds; the MTP head adds the
    token and the main model's row (a copy: a replayed graph's buffer is overwritten by the next replay)."""
    path = tiny_checkpoint("qwen3_5", mtp="equal")
    engine = load({"model": {"path": str(path), "compute": "cpu", "store": "ram"}, "draft": {"mtp": True}},
                  progress=False)
    ids = engine.encode(PROMPT)
    d = DraftModel(engine.model, 128)
    d.start(ids, len(ids), None)
    d.skip([7], None)
    assert d.pending == ids + [7] and d.cache.pos == 0
    m = MTPDrafter(engine.model, 128)
    cache = engine.model.new_cache(128)
    _, rows = engine.model.forward(ids, cache, hidden=True)
    m.start(ids, len(ids), rows)
    _, row = engine.model.forward([7], cache, hidden=True)
    m.skip([7], row)
    assert m.ids == ids[1:] + [7] and m.rows.shape == (len(ids) + 1, rows.shape[1]) and m.cache.pos == 0
    row[:] = 0
    assert m.rows[-1].any()  # its own copy


def test_an_mtp_head_told_by_skips_drafts_as_one_that_started_with_those_tokens(tiny_checkpoint):
    """A random head (it reads the hidden rows) after 5 skips, each with the main model's row of a one-token step,
    proposes the same distributions as a head started on the prompt and those 5 tokens (rows of one prefill)."""
    import numpy as np

    path = tiny_checkpoint("qwen3_5", mtp="random")
    engine = load({"model": {"path": str(path), "compute": "cpu", "store": "ram"}, "draft": {"mtp": True}},
                  progress=False)
    model, ids, more = engine.model, engine.encode(PROMPT), [11, 5, 29, 3, 17]
    told, fresh = MTPDrafter(model, 128), MTPDrafter(model, 128)
    cache = model.new_cache(128)
    _, rows = model.forward(ids, cache, hidden=True)
    told.start(ids, len(ids), rows)
    for t in more:
        _, row = model.forward([t], cache, hidden=True)
        told.skip([t], row)
    _, rows = model.forward(ids + more, model.new_cache(128), hidden=True)
    fresh.start(ids + more, len(ids + more), rows)
    params = SamplingParams(temperature=1.0)
    a = told.propose(23, 3, params, ids + more, np.random.default_rng(0))
    b = fresh.propose(23, 3, params, ids + more, np.random.default_rng(0))
    assert a[0] == b[0]
    for p, q in zip(a[1], b[1], strict=True):
        np.testing.assert_allclose(p, q, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- the policy alone


def test_the_policy_switches_only_past_its_margin_and_remembers():
    memory: dict = {}
    f = Fallback(memory)
    assert f.speculate()
    f.record(True, 5, 100.0)  # the first speculative round (a catch-up) is not timed
    assert f.paces[True].rounds == 0
    for _ in range(3):  # 20 tokens with the first round's: past the first probe's 16
        assert f.speculate()
        f.record(True, 5, 1.0)
    for _ in range(Fallback.PROBE_ROUNDS):
        assert not f.speculate()
        f.record(False, 1, 0.19)  # 5% faster than 0.2 s a token: inside the margin
    assert f.speculate() and f.drafting and f.interval == 2 * Fallback.FIRST_PROBE  # kept; probes less often
    for _ in range(7):
        f.record(True, 5, 1.0)
    assert not f.speculate()
    for _ in range(Fallback.PROBE_ROUNDS):
        f.record(False, 1, 0.05)  # 4x faster
    assert not f.speculate() and not f.drafting and f.interval == Fallback.FIRST_PROBE
    again = Fallback(memory)  # a later generation of the same engine and drafter starts plain
    assert not again.drafting and not again.speculate()


def test_a_disabled_policy_always_speculates():
    f = Fallback({}, enabled=False)
    for _ in range(100):
        assert f.speculate()
        f.record(True, 1, 10.0)
    assert f.paces[True].rounds == 0


# ---------------------------------------------------------------- config, CLI, metrics


def test_draft_fallback_in_the_three_forms_and_refused_when_not_a_boolean(tmp_path):
    model = {"path": "m", "compute": "cpu", "store": "mmap"}
    for form in ({"path": "d"}, {"model": {"path": "d"}}, {"mtp": True}):
        assert load_config({"model": model, "draft": form}).draft().fallback is True
        spec = load_config({"model": model, "draft": {**form, "fallback": False}}).draft()
        assert spec.fallback is False
        for bad in ("no", 0, None):
            with pytest.raises(ConfigError) as info:
                load_config({"model": model, "draft": {**form, "fallback": bad}})
            assert "draft.fallback" in str(info.value)
            with pytest.raises(ConfigError) as info:  # normalisation refuses it too (a dict that skipped the schema)
                _nested_draft({**form, "fallback": bad}, model)
            assert "draft.fallback" in str(info.value) and "boolean" in str(info.value)
    base = load_config({"model": model, "draft": {"mtp": True, "fallback": False}})
    assert base.with_draft(tokens=2).draft().fallback is False  # kept under other options
    assert base.with_draft(path=str(tmp_path)).draft().fallback is False
    assert load_config({"model": model, "draft": {"mtp": True}}).with_draft(fallback=False).draft().fallback is False
    with pytest.raises(InputError, match="--no-draft-fallback needs a draft"):
        load_config({"model": model}).with_draft(fallback=False)


def test_a_config_with_fallback_false_loads_an_engine_that_always_drafts(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5", mtp="equal")
    engine = load({"model": {"path": str(path), "compute": "cpu", "store": "ram"},
                   "draft": {"mtp": True, "fallback": False}}, progress=False)
    assert engine.draft_fallback is False


def test_cli_no_draft_fallback(capsys, tiny_checkpoint):
    from lumen_core.cli import main

    def run(*argv):
        try:
            main(list(argv))
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
        return code, capsys.readouterr()

    code, got = run("generate", "--help")
    assert code == 0 and "--no-draft-fallback" in got.out
    ckpt = str(tiny_checkpoint("qwen3_5", mtp="equal"))
    base = ("generate", "-c", ckpt, "--prompt", PROMPT, "-n", "12", "--temperature", "0")
    code, plain_out = run(*base)
    code, got = run(*base, "--mtp", "--no-draft-fallback")
    assert code == 0 and got.out == plain_out.out
    assert "0 tokens decoded plainly (fallback)" in got.err, got.err
    code, got = run(*base, "--no-draft-fallback")
    assert code != 0 and "--no-draft-fallback needs a draft" in got.err


def test_server_metrics_count_plain_rounds():
    from lumen_core.server.service import Metrics

    m = Metrics()
    m.spec_plain = 7  # a server whose generations all decoded plainly still shows the speculative counters
    text = m.prometheus(0)
    assert "lumen_speculative_plain_rounds_total 7" in text and "lumen_speculative_verifies_total 0" in text


# ---------------------------------------------------------------- on CUDA (skipped without a device)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("draft", ["model", "mtp"])
def test_cuda_plain_rounds_between_verifies_give_plain_greedy(tiny_checkpoint, cp, monkeypatch, kind, draft):
    """On cuda:0 a plain round replays the decode step (a draft model) or a captured verify of one token with the
    hidden row (MTP); between verify graphs, in a fixed pattern: plain greedy's tokens, every draft of the same
    checkpoint (a draft model of itself, the agreeing head) kept after the skipped stretches."""
    pytest.importorskip("lumen_cuda")
    path = tiny_checkpoint(kind, mtp="equal")
    model = {"path": str(path), "compute": "cuda:0", "store": "vram",
             "hidden-layers": {"kv-cache": {"context-size": 256}}}
    block = {"mtp": True} if draft == "mtp" else {"path": str(path)}
    engine = load({"model": model, "draft": {**block, "num-draft-tokens": 3}}, progress=False)
    plain_engine = load({"model": model}, progress=False)
    try:
        ids = engine.encode(PROMPT)
        want = list(plain_engine.generate_tokens(ids, 60))
        pattern = itertools.cycle([True, False, True, True, False, False, False, True, False, False])
        monkeypatch.setattr(Fallback, "speculate", lambda self: next(pattern))
        assert list(engine.generate_tokens(ids, 60)) == want
        spec = engine.stats.speculative
        assert spec.plain_rounds > 10 and spec.verifies > 5 and spec.acceptance == 1.0, spec
        runner = engine.decode_runner()
        assert runner and runner.verify_graph(4, draft == "mtp") is not None
        if draft == "mtp":
            assert runner.verify_graph(1, True) is not None, runner.verify_note(1, True)
        for params in (SamplingParams(temperature=0.0, repetition_penalty=1.3), SamplingParams(temperature=0.8,
                                                                                                 seed=3)):
            got = list(engine.generate_tokens(ids, 30, params))  # the rows read on the host
            assert len(got) == 30 or engine.stats.finish_reason == "stop"
            if params.temperature == 0:
                assert got == list(plain_engine.generate_tokens(ids, 30, params))
    finally:
        engine.close()
        plain_engine.close()
