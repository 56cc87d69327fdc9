"""The on-device sampler (lumen_cuda.sampler) against the CPU sampler (lumen_core.sampling.make_sampler): with
the same seed both give the same token sequence, over random logits with ties and -inf entries and every
filter alone and combined. Needs CuPy and a CUDA device (the ``gpu`` marker); skipped cleanly without them.
"""

from __future__ import annotations

import numpy as np
import pytest

from lumen_core.errors import InputError
from lumen_core.sampling import SamplingParams, make_sampler

pytest.importorskip("lumen_cuda")

pytestmark = pytest.mark.gpu

DRAWS = 50
VOCABS = [1000, 50000]
KINDS = ["normal", "ties", "neg_inf", "ties_neg_inf", "peaked"]
PARAMS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=20),
    "top_p": dict(top_p=0.9),
    "min_p": dict(min_p=0.05),
    "combined": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    "penalty": dict(repetition_penalty=1.3),
    "penalty_greedy": dict(temperature=0.0, repetition_penalty=1.3),
    "penalty_combined": dict(temperature=1.2, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.3),
}


# -- fixtures and helpers --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sampler(cp):
    from lumen_cuda import sampler

    return sampler


def make_logits(kind: str, vocab: int, seed: int) -> np.ndarray:
    """f32 logits (vocab,): normal(0, 3); "ties" rounded to halves with the maximum shared by three ids; "neg_inf"
    with ~30% of entries at -inf; "peaked" with one token far above the rest."""
    rng = np.random.default_rng(seed)
    x = rng.normal(scale=3.0, size=vocab)
    if "ties" in kind:
        x = np.round(x * 2) / 2
        x[rng.choice(vocab, size=3, replace=False)] = x.max() + 0.5
    if "neg_inf" in kind:
        x[rng.random(vocab) < 0.3] = -np.inf
        x[rng.integers(vocab)] = 5.0  # at least one finite entry
    if kind == "peaked":
        x[rng.integers(vocab)] += 25.0
    return x.astype(np.float32)


# -- token for token against the CPU sampler -----------------------------------------------------------------
@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_same_tokens_as_cpu_sampler(cp, sampler, vocab, kind, name):
    seed = 1000 * VOCABS.index(vocab) + 100 * KINDS.index(kind) + list(PARAMS).index(name)
    host = make_logits(kind, vocab, seed)
    dev = cp.asarray(host)
    params = PARAMS[name]
    want_sampler = make_sampler(SamplingParams(seed=seed, **params))
    got_sampler = sampler.DeviceSampler(SamplingParams(seed=seed, **params))
    top = int(np.argmax(host))
    # Seen ids with duplicates (the top token twice, so the penalty matters), then every drawn token appended.
    previous = [top, 3, top, 3, vocab - 1, int(np.argsort(host)[-2])]
    want, got = [], []
    for _ in range(DRAWS):
        want.append(want_sampler(host, previous))
        got.append(got_sampler(dev, previous))
        previous.append(want[-1])
    assert got == want
    assert all(np.isfinite(host[t]) for t in got)  # never a masked (-inf) token
    np.testing.assert_array_equal(cp.asnumpy(dev), host)  # the input logits are left as they were


def test_seeds_replay_and_differ(cp, sampler):
    host = make_logits("normal", 1000, 7)
    dev = cp.asarray(host)
    runs = []
    for seed in (1, 1, 2):
        s = sampler.DeviceSampler(SamplingParams(seed=seed, temperature=1.0))
        runs.append([s(dev) for _ in range(DRAWS)])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# -- greedy ----------------------------------------------------------------------------------------------------
def test_greedy_takes_the_lowest_index_on_ties(cp, sampler):
    host = np.zeros(50000, dtype=np.float32)
    host[[40000, 123, 4567]] = 2.5
    dev = cp.asarray(host)
    assert sampler.sample_greedy(dev) == 123
    greedy = sampler.DeviceSampler(SamplingParams(temperature=0.0, seed=3))
    assert greedy(dev) == 123
    # A penalty on 123 (positive: divided) leaves 4567 the lowest of the remaining maxima.
    assert sampler.DeviceSampler(SamplingParams(temperature=0.0, repetition_penalty=1.3))(dev, [123, 123]) == 4567


def test_greedy_does_not_advance_the_rng(cp, sampler):
    dev = cp.asarray(make_logits("normal", 1000, 11))
    greedy = sampler.DeviceSampler(SamplingParams(temperature=0.0, seed=9))
    before = greedy._rng.bit_generator.state
    for _ in range(5):
        greedy(dev)
    assert greedy._rng.bit_generator.state == before


def test_sample_greedy_matches_numpy(cp, sampler):
    for i, kind in enumerate(KINDS):
        host = make_logits(kind, 50000, 50 + i)
        assert sampler.sample_greedy(cp.asarray(host)) == int(np.argmax(host))


# -- params and inputs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.1), ("temperature", "hot"), ("top_k", -1), ("top_p", 0.0), ("min_p", 1.1),
    ("repetition_penalty", 0.0), ("seed", -3),
])
def test_bad_params_raise_input_error(cp, sampler, field, value):
    with pytest.raises(InputError, match=field):
        sampler.DeviceSampler(SamplingParams(**{field: value}))


def test_out_of_range_previous_id_raises_like_the_cpu_sampler(cp, sampler):
    host = make_logits("normal", 1000, 13)
    params = SamplingParams(repetition_penalty=1.3, seed=0)
    with pytest.raises(IndexError):
        make_sampler(params)(host, [1000])
    with pytest.raises(IndexError):
        sampler.DeviceSampler(params)(cp.asarray(host), [1000])
