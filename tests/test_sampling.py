"""Sampling filters against hand-computed cases and transformers' logits warpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lumen_core.errors import InputError
from lumen_core.sampling import (
    MAX_PENALTY,
    MIN_TEMPERATURE,
    SamplingError,
    SamplingParams,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    filtered_logits,
    make_sampler,
    softmax,
)

NEG = -np.inf


def kept(logits: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(logits)).tolist())


# --- params --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", float("inf")), ("temperature", float("nan")),
    ("temperature", 1e-310), ("temperature", 5e-6), ("temperature", 10**400), ("temperature", True),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True), ("top_k", "3"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("top_p", float("-inf")),
    ("min_p", -0.1), ("min_p", 1.1), ("min_p", float("nan")), ("min_p", float("inf")),
    ("repetition_penalty", 0.0), ("repetition_penalty", 1e-320), ("repetition_penalty", 1e6),
    ("repetition_penalty", float("inf")), ("repetition_penalty", float("nan")),
    ("seed", -3), ("seed", 1.5), ("seed", True),
])
def test_validate_names_the_field_the_rule_and_the_value(field, value):
    """The message names the option neutrally (its API name, no CLI flag or config key), the rule and the value:
    `lumen validate` (config other-parameters), `generate` and the server all show it."""
    with pytest.raises(SamplingError, match=rf"^{field} must be .*, got ") as info:
        SamplingParams(**{field: value}).validate()
    assert info.value.field == field and isinstance(info.value, InputError)
    assert "--" not in str(info.value) and "sampling" not in str(info.value)


def test_defaults_are_valid():
    SamplingParams().validate()
    SamplingParams(temperature=0, top_k=5, top_p=1.0, min_p=1.0, seed=np.int64(3)).validate()
    SamplingParams(top_k=10**30, seed=10**30).validate()  # huge but meaningful: top_k off, a big seed


EXTREME = np.array([3.4e38, -3.4e38, 3.4e38, 1.0, -1.0, 0.0], dtype=np.float32)  # float32's own extremes


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=MIN_TEMPERATURE, seed=1),
    SamplingParams(temperature=1e300, seed=1),
    SamplingParams(temperature=MIN_TEMPERATURE, repetition_penalty=1 / MAX_PENALTY, seed=1),
    SamplingParams(temperature=MIN_TEMPERATURE, repetition_penalty=MAX_PENALTY, top_p=5e-324, seed=1),
    SamplingParams(temperature=1.0, repetition_penalty=MAX_PENALTY, min_p=1.0, seed=1),
    SamplingParams(temperature=0, repetition_penalty=1 / MAX_PENALTY),
])
def test_every_accepted_value_samples_a_real_token_even_from_extreme_logits(params):
    """The bounds of validate are what keeps the chain finite: at them, with float32's largest logits and every
    token seen (the penalty applies to all), a draw is a real token, never an IndexError or NaN."""
    sample = make_sampler(params)
    for previous in ([], list(range(EXTREME.size))):
        tok = sample(EXTREME, previous)
        assert 0 <= tok < EXTREME.size
    # the tokens at the top (0 and 2, tied) are the only ones a near-zero temperature can pick
    if params.temperature == MIN_TEMPERATURE and params.repetition_penalty == 1.0:
        assert {make_sampler(SamplingParams(temperature=MIN_TEMPERATURE, seed=s))(EXTREME, []) for s in range(20)} \
            == {0, 2}


def test_past_the_bounds_the_chain_would_break():
    """Why the bounds: a temperature of 1e-310 (accepted before) overflows the scaled logits to inf, and the
    softmax of inf - inf is NaN; validate now refuses it before the sampler is built."""
    with np.errstate(all="ignore"):
        probs = softmax(EXTREME.astype(np.float64) / 1e-310)
    assert np.isnan(probs).any()
    with pytest.raises(SamplingError, match="temperature"):
        make_sampler(SamplingParams(temperature=1e-310))


# --- filters, by hand ----------------------------------------------------------------------------------


def test_argmax_and_lowest_index_on_ties():
    sample = make_sampler(SamplingParams(temperature=0))
    assert sample(np.array([0.1, 3.0, -1.0, 3.0], dtype=np.float32), []) == 1


def test_top_k_by_hand():
    logits = np.array([1.0, 4.0, 3.0, 2.0, 3.0])
    assert kept(apply_top_k(logits, 2)) == {1, 2, 4}  # ties with the 2nd largest survive
    assert kept(apply_top_k(logits, 1)) == {1}
    assert kept(apply_top_k(logits, 0)) == kept(apply_top_k(logits, 99)) == set(range(5))


def test_top_p_by_hand():
    logits = np.log(np.array([0.1, 0.5, 0.25, 0.15]))
    assert kept(apply_top_p(logits, 0.5)) == {1}  # the top token alone reaches 0.5
    assert kept(apply_top_p(logits, 0.6)) == {1, 2}  # 0.5 < 0.6 <= 0.75
    assert kept(apply_top_p(logits, 0.8)) == {1, 2, 3}
    assert kept(apply_top_p(logits, 0.01)) == {1}  # never empty
    assert kept(apply_top_p(logits, 1.0)) == set(range(4))


def test_min_p_by_hand():
    logits = np.log(np.array([0.1, 0.5, 0.25, 0.15]))
    assert kept(apply_min_p(logits, 0.5)) == {1, 2}  # threshold 0.25
    assert kept(apply_min_p(logits, 0.3)) == {1, 2, 3}  # threshold 0.15
    assert kept(apply_min_p(logits, 1.0)) == {1}
    assert kept(apply_min_p(logits, 0.0)) == set(range(4))


def test_repetition_penalty_by_hand():
    logits = np.array([2.0, -2.0, 1.0, -1.0])
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    np.testing.assert_array_equal(out, [1.0, -4.0, 1.0, -1.0])
    np.testing.assert_array_equal(logits, [2.0, -2.0, 1.0, -1.0])  # pure: input untouched


def test_filters_apply_in_order_top_k_top_p_min_p():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.06, 0.04]))
    # top_k=3 renormalises to [.444, .333, .222]; top_p=0.7 keeps the top two; min_p=0.8 drops the second.
    assert kept(filtered_logits(logits, SamplingParams(top_k=3, top_p=0.7))) == {0, 1}
    assert kept(filtered_logits(logits, SamplingParams(top_k=3, top_p=0.7, min_p=0.8))) == {0}


# --- filters vs transformers ---------------------------------------------------------------------------


def _hf(warper, logits: np.ndarray) -> np.ndarray:
    scores = torch.from_numpy(logits[None, :].astype(np.float32))
    return warper(torch.zeros((1, 1), dtype=torch.long), scores)[0].numpy()


@pytest.mark.parametrize("seed", range(8))
def test_masks_match_transformers_warpers(seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(500) * rng.uniform(0.5, 4)).astype(np.float32)
    for k in (1, 5, 50, 499):
        assert kept(apply_top_k(logits, k)) == kept(_hf(TopKLogitsWarper(k), logits))
    for p in (0.05, 0.3, 0.9, 0.99):
        assert kept(apply_top_p(logits, p)) == kept(_hf(TopPLogitsWarper(p), logits))
    for p in (0.01, 0.1, 0.5, 0.9):
        assert kept(apply_min_p(logits, p)) == kept(_hf(MinPLogitsWarper(p), logits))


def test_repetition_penalty_matches_transformers():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32)
    prev = [3, 7, 7, 11, 49]
    hf = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prev]), torch.from_numpy(logits[None].copy()))
    np.testing.assert_allclose(apply_repetition_penalty(logits, prev, 1.3), hf[0].numpy(), rtol=1e-6)


# --- the sampler ---------------------------------------------------------------------------------------


def _sequence(params: SamplingParams, n: int = 200) -> list[int]:
    rng = np.random.default_rng(123)
    sample = make_sampler(params)
    prev: list[int] = []
    for _ in range(n):
        prev.append(sample(rng.standard_normal(64).astype(np.float32), prev))
    return prev


def test_same_seed_same_tokens():
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=42, repetition_penalty=1.1)
    assert _sequence(params) == _sequence(params)
    assert _sequence(params) != _sequence(SamplingParams(**{**params.__dict__, "seed": 43}))


def test_no_seed_gives_fresh_entropy():
    params = SamplingParams(temperature=1.0)
    assert _sequence(params) != _sequence(params)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.3, top_k=6, seed=2),
    SamplingParams(temperature=1.0, top_p=0.8, seed=3),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.9, min_p=0.1, seed=4),
])
def test_distribution_matches_filtered_softmax(params):
    logits = np.random.default_rng(7).standard_normal(12).astype(np.float32) * 1.5
    expected = softmax(filtered_logits(logits.astype(np.float64) / params.temperature, params))
    sample, n = make_sampler(params), 20_000
    counts = np.bincount([sample(logits, []) for _ in range(n)], minlength=logits.size)
    assert not counts[expected == 0].any(), "a filtered-out token was drawn"
    # Pearson chi-square over the kept tokens; 40 is far past the 99.9% point for <= 11 degrees of freedom.
    live = expected > 0
    chi2 = (((counts[live] - n * expected[live]) ** 2) / (n * expected[live])).sum()
    assert chi2 < 40, (chi2, counts, np.round(n * expected))
