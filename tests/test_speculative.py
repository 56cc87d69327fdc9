"""Speculative decoding (lumen_core.speculative) on the CPU backend: greedy output equals plain greedy decoding token
for token for every architecture, with drafts that are always right (the model drafting for itself), partly right
(a perturbed copy of the main model) and almost never right (another random model); a cache rewound after a verify
holds what plain decoding would have put there; the sampling rule is checked statistically (chi-square) against
the exact distribution, and a deliberately wrong rule fails the same test."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lumen_core.engine import load
from lumen_core.sampling import SamplingParams
from lumen_core.speculative import (
    Checkpoint,
    DraftModel,
    accept_sampled,
    draw,
    record_states,
    recording,
)

PROMPT = "the quick brown fox jumps over the lazy dog"
E2B = {"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True}
MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16}


def perturbed(src, dst, scale: float, seed: int = 0):
    """A copy of checkpoint ``src`` whose matrices carry relative noise of ``scale``: a draft that agrees with the
    main model on some tokens and not on others."""
    shutil.copytree(src, dst)
    rng = np.random.default_rng(seed)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(path)
        for name, t in tensors.items():
            if t.ndim == 2 and t.dtype == np.float32:
                tensors[name] = (t + scale * t.std() * rng.standard_normal(t.shape)).astype(np.float32)
        save_file(tensors, path, metadata={"format": "pt"})
    return dst


def drafting(engine, draft_model, k: int):
    engine.draft_tokens = k
    engine.drafter_factory = lambda context: DraftModel(draft_model, context)


def plain(engine):
    engine.draft_tokens, engine.drafter_factory = 0, None


CASES = {
    "qwen3_5": ("qwen3_5", {}),
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    "gemma3": ("gemma3", {}),
    "gemma4": ("gemma4", {}),
}


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    """kind -> (main engine, {draft name: draft model}): the main model itself, a perturbed copy, another seed."""
    cache = {}

    def get(kind):
        if kind not in cache:
            base, overrides = CASES[kind]
            main_path = tiny_checkpoint(base, **overrides)
            main = load(str(main_path), progress=False)
            near = perturbed(main_path, tmp_path_factory.mktemp(kind) / "near", 0.03)
            drafts = {"self": main.model, "near": load(str(near), progress=False).model,
                      "other": load(str(tiny_checkpoint(base, seed=1, **overrides)), progress=False).model}
            cache[kind] = (main, drafts)
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", list(CASES))
def test_greedy_equals_plain_decoding(engines, kind):
    main, drafts = engines(kind)
    ids = main.encode(PROMPT)
    plain(main)
    want = list(main.generate_tokens(ids, 40))
    rates = {}
    for name, model in drafts.items():
        for k in (1, 4):
            drafting(main, model, k)
            got = list(main.generate_tokens(ids, 40))
            spec = main.stats.speculative
            assert got == want, f"{kind}, draft {name}, k={k}: speculative output differs from plain greedy"
            assert spec.verifies > 0 and spec.drafted > 0
            rates[name, k] = spec.acceptance
    plain(main)
    assert rates["self", 1] == rates["self", 4] == 1.0  # the model drafting for itself is always right
    assert rates["near", 4] > 0.05 and rates["near", 1] < 1.0, rates  # partial acceptance exercises the rewinds
    assert rates["other", 4] < 0.5, rates


def test_gemma4_moe_with_an_e2b_shaped_draft(tiny_checkpoint):
    """Gemma 4 26B's pairing in small: an MoE main model drafted by an E2B-shaped one (per-layer inputs, KV
    sharing) of the same tokenizer."""
    main = load(str(tiny_checkpoint("gemma4", **MOE)), progress=False)
    draft = load(str(tiny_checkpoint("gemma4", **E2B)), progress=False)
    ids = main.encode(PROMPT)
    want = list(main.generate_tokens(ids, 32))
    drafting(main, draft.model, 3)
    assert list(main.generate_tokens(ids, 32)) == want
    assert main.stats.speculative.verifies > 0


def test_max_tokens_and_stop_are_honoured(engines):
    main, drafts = engines("qwen3_5")
    ids = main.encode(PROMPT)
    plain(main)
    want = list(main.generate_tokens(ids, 7))
    drafting(main, drafts["self"], 4)
    got = list(main.generate_tokens(ids, 7))
    assert got == want and len(got) == 7 and main.stats.finish_reason == "length"
    plain(main)


def test_snapshot_and_rerun_rollback_gives_the_same_tokens(engines, monkeypatch):
    """A model that keeps no per-token state is rolled back by a snapshot and a second forward of the kept tokens:
    slower, and the same tokens."""
    main, drafts = engines("qwen3_5")
    ids = main.encode(PROMPT)
    plain(main)
    want = list(main.generate_tokens(ids, 30))
    monkeypatch.setattr(type(main.model), "records_states", False)
    for name in ("near", "other"):
        drafting(main, drafts[name], 3)
        assert list(main.generate_tokens(ids, 30)) == want, name
    plain(main)


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3"])
def test_a_rewound_cache_holds_what_plain_decoding_wrote(engines, kind):
    """Feed 6 tokens in one recorded forward, keep 2: every recurrent state, ring and K/V row equals a cache that
    was fed just those 2 tokens one at a time."""
    main, _ = engines(kind)
    model = main.model
    ids = main.encode(PROMPT)
    extra = [5, 9, 11, 13, 17, 19]
    a = model.new_cache(64)
    b = model.new_cache(64)
    model.forward(ids, a)
    model.forward(ids, b)
    checkpoint = Checkpoint(a, len(extra), getattr(model, "records_states", False))
    with recording() as trail:
        model.forward(extra, a, all_logits=True)
    assert checkpoint.rewind(2, trail) == 0
    for t in extra[:2]:
        model.forward([t], b)
    assert a.pos == b.pos == len(ids) + 2
    rings = [r for r, *_ in checkpoint.rings]
    if kind == "gemma3":
        assert rings, "the tiny Gemma 3 has sliding layers with a window below 64: they keep rings"
    n = a.pos
    for sa, sb in zip(_leaves(a.layers), _leaves(b.layers), strict=True):
        if sa.ndim == 3 and sa.shape[1] == 64:  # a full K/V cache: its first n rows
            sa, sb = sa[:, :n], sb[:, :n]
        np.testing.assert_allclose(np.asarray(sa, np.float32), np.asarray(sb, np.float32), rtol=1e-5, atol=1e-5)
    # and the next token's logits agree
    la = model.forward([23], a)
    lb = model.forward([23], b)
    np.testing.assert_allclose(la, lb, rtol=1e-4, atol=1e-4)


def test_record_states_records_what_a_recording_forward_keeps(engines):
    """record_states (for replayed steps that record nothing themselves) keeps, per recurrent state, the same arrays
    a one-token forward under recording() keeps."""
    main, _ = engines("qwen3_5")
    model = main.model
    cache = model.new_cache(64)
    model.forward(main.encode(PROMPT), cache)
    with recording() as during:
        model.forward([7], cache)
    after: dict = {}
    record_states(after, cache)
    assert list(after) == list(during) and len(after) > 0
    for got, want in zip(after.values(), during.values(), strict=True):
        assert len(got) == len(want) == 1
        for a, b in zip(got[0], want[0], strict=True):
            np.testing.assert_array_equal(a, b)


def _leaves(obj):
    import dataclasses

    if isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _leaves(o)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            if f.name != "recent":
                yield from _leaves(getattr(obj, f.name))
    elif isinstance(obj, np.ndarray):
        yield obj


# -- the sampling rule, statistically -------------------------------------------------------------------------------
V = 4  # a tiny vocabulary
K = 2  # drafts per verify


def _markov(seed: int):
    """Row ``t``: the next-token distribution after token ``t`` (a Markov chain over V tokens)."""
    rows = np.random.default_rng(seed).dirichlet(np.ones(V) * 0.8, size=V)
    return rows / rows.sum(axis=1, keepdims=True)


P, Q = _markov(1), _markov(2)  # the main model and a draft that disagrees with it


def _wrong_rule(p_rows, q_rows, drafts, rng):
    """A plausible mistake: on a rejection, draw from the target p instead of the residual max(p - q, 0)."""
    for i, d in enumerate(drafts):
        p, q = p_rows(i), q_rows[i]
        if rng.random() * q[d] < p[d]:
            continue
        return i, draw(p, rng)
    return len(drafts), draw(p_rows(len(drafts)), rng)


def _first_two(rule, seed: int, start: int = 0) -> tuple[int, int]:
    """One verify of K drafts after ``start`` and, if it emitted one token only, a second verify: the first two tokens
    the speculative loop emits."""
    rng = np.random.default_rng(seed)
    out, last = [], start
    while len(out) < 2:
        drafts, dists, prev = [], [], last
        for _ in range(K):
            q = Q[prev]
            prev = draw(q, rng)
            drafts.append(prev)
            dists.append(q)
        context = [last] + drafts
        a, nxt = rule(lambda i, context=context: P[context[i]], dists, drafts, rng)
        out += drafts[:a] + [nxt]
        last = out[-1]
    return out[0], out[1]


def _chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """Upper-tail p-value of Pearson's statistic (Wilson-Hilferty approximation of the chi-square distribution)."""
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("rule, passes", [(accept_sampled, True), (_wrong_rule, False)])
def test_rejection_rule_gives_the_target_distribution(rule, passes):
    """The first two tokens after token 0 must follow P (P[0][x] * P[x][y]) whatever Q drafted: chi-square over 16
    cells and 20000 seeds. The correct rule passes (p > 1e-3); the wrong one is caught (p < 1e-6)."""
    n = 20000
    counts = np.zeros((V, V))
    for seed in range(n):
        x, y = _first_two(rule, seed)
        counts[x, y] += 1
    expected = n * P[0][:, None] * P
    p = _chi_square_p(counts.ravel(), expected.ravel())
    assert (p > 1e-3) if passes else (p < 1e-6), p


def test_sampled_speculative_generation_matches_plain_sampling(engines):
    """End to end on the tiny Qwen 3.5 with top-k 3: the second generated token's distribution over 300 seeds is
    the same with and without a (partly right) draft model (chi-square on the 2 x cells contingency table)."""
    main, drafts = engines("qwen3_5")
    ids = main.encode(PROMPT)
    params = dict(temperature=1.0, top_k=3)
    hist = []
    for factory in (None, drafts["near"]):
        if factory is None:
            plain(main)
        else:
            drafting(main, factory, 3)
        counts: dict[int, int] = {}
        for seed in range(300):
            toks = list(main.generate_tokens(ids, 2, SamplingParams(seed=seed, **params)))
            counts[toks[1]] = counts.get(toks[1], 0) + 1
        hist.append(counts)
    plain(main)
    cells = sorted(set(hist[0]) | set(hist[1]))
    table = np.array([[h.get(c, 0) for c in cells] for h in hist], dtype=np.float64)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    keep = expected.min(axis=0) >= 5
    table, expected = table[:, keep], expected[:, keep]
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    assert df >= 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    assert 0.5 * math.erfc(z / math.sqrt(2)) > 1e-3, (hist, stat)


# -- through the config: a draft block, and the MTP head ------------------------------------------------------------
def test_a_config_draft_block_generates_the_plain_greedy_text(tiny_checkpoint, tmp_path):
    main_path = tiny_checkpoint("qwen3_5")
    near = perturbed(main_path, tmp_path / "near", 0.03)
    plain_engine = load(str(main_path), progress=False)
    want = list(plain_engine.generate(PROMPT, max_tokens=24, temperature=0))
    engine = load({"model": {"path": str(main_path), "compute": "cpu", "store": "ram"},
                   "draft": {"path": str(near), "num-draft-tokens": 3}}, progress=False)
    assert engine.draft_tokens == 3 and engine.draft_engine is not None
    assert list(engine.generate(PROMPT, max_tokens=24, temperature=0)) == want
    spec = engine.stats.speculative
    assert spec.verifies > 0 and 0 < spec.acceptance <= 1
    assert "speculative:" in engine.stats.summary()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_mtp_drafts_are_lossless_and_an_agreeing_head_is_always_accepted(tiny_checkpoint, kind):
    """draft.mtp: with a random head the output is plain greedy's (few drafts kept); with a head built to equal the
    next-token model (make_tiny_checkpoint mtp="equal") every draft is kept."""
    for mtp, check in (("random", lambda a: a < 1.0), ("equal", lambda a: a == 1.0)):
        path = tiny_checkpoint(kind, mtp=mtp)
        want = list(load(str(path), progress=False).generate_tokens(
            load(str(path), progress=False).encode(PROMPT), 32))
        engine = load({"model": {"path": str(path), "compute": "cpu", "store": "ram"},
                       "draft": {"mtp": True, "num-draft-tokens": 4}}, progress=False)
        assert engine.model.mtp is not None
        got = list(engine.generate_tokens(engine.encode(PROMPT), 32))
        assert got == want, (kind, mtp)
        assert check(engine.stats.speculative.acceptance), (kind, mtp, engine.stats.speculative)


def test_cli_generate_with_a_draft_model_and_with_mtp(capsys, tiny_checkpoint):
    """`lumen generate --draft-model PATH` / `--mtp`: the text of plain greedy generation, and the speculative
    statistics on stderr."""
    from lumen_core.cli import main

    def run(*argv):
        try:
            main(list(argv))
        except SystemExit as exc:
            assert not exc.code, capsys.readouterr().err
        return capsys.readouterr()

    ckpt = str(tiny_checkpoint("qwen3_5", mtp="equal"))
    base = ("generate", "-c", ckpt, "--prompt", PROMPT, "-n", "16", "--temperature", "0")
    plain_out = run(*base).out
    for extra in (("--draft-model", ckpt, "--draft-tokens", "3"), ("--mtp",)):
        got = run(*base, *extra)
        assert got.out == plain_out, extra
        assert "speculative:" in got.err and "acceptance 100.0%" in got.err, got.err


def test_server_metrics_count_speculative_steps(tiny_checkpoint):
    from lumen_core.server.service import Metrics

    m = Metrics()
    m.spec_verifies, m.spec_drafted, m.spec_accepted = 3, 12, 9
    text = m.prometheus(0)
    assert "lumen_speculative_verifies_total 3" in text and "lumen_speculative_accepted_tokens_total 9" in text


@pytest.mark.parametrize("draft", ["model", "mtp"])
def test_speculation_with_the_prefix_cache(tiny_checkpoint, tmp_path, draft):
    """A prompt resumed from the prefix cache drafts on (the MTP head has no entries for the restored part: fewer
    drafts kept, the same tokens) and a speculative generation's cache, rewound along the way, is saved and reused."""
    path = tiny_checkpoint("qwen3_5", mtp="equal")
    model = {"path": str(path), "compute": "cpu", "store": "ram",
             "hidden-layers": {"kv-cache": {"context-size": 512, "prefix-cache-mb": 64}}}
    block = {"mtp": True} if draft == "mtp" else {"path": str(perturbed(path, tmp_path / "near", 0.03))}
    engine = load({"model": model, "draft": {**block, "num-draft-tokens": 3}}, progress=False)
    plain = load(str(path), progress=False)
    first = engine.encode(PROMPT)
    reply = list(engine.generate_tokens(first, 12))
    assert reply == list(plain.generate_tokens(first, 12))
    second = first + reply + engine.encode(" and then")
    got = list(engine.generate_tokens(second, 16))
    assert engine.stats.cached_tokens > 0 and engine.stats.speculative.verifies > 0
    assert got == list(plain.generate_tokens(second, 16))
