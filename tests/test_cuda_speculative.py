"""Speculative decoding on CUDA: greedy output equals plain greedy decoding (the captured decode graph) token for
token, for Qwen 3.5 dense and MoE (the verify replayed as a CUDA graph per size, lumen_cuda.verify) and Gemma 3/4
(where the verify is not captured it runs op by op, said on stderr), with drafts that are always right (the same
checkpoint loaded again), partly right (a perturbed copy) and almost never right (another random model), the
draft model itself decoding through its own graph. The verify graph's logits equal the op-by-op verify's."""

from __future__ import annotations

import numpy as np
import pytest

import lumen_core as lumen
from lumen_core.sampling import SamplingParams
from lumen_core.speculative import DraftModel, recording

pytest.importorskip("lumen_cuda")

from test_speculative import MOE, PROMPT, perturbed  # noqa: E402

CONTEXT = 256
KINDS = {"qwen3_5": ("qwen3_5", {}), "qwen3_5_moe": ("qwen3_5_moe", {}), "gemma3": ("gemma3", {}),
         "gemma4-moe": ("gemma4", MOE)}


def load(path):
    model = {"path": str(path), "compute": "cuda:0", "store": "vram",
             "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}}
    return lumen.load({"model": model}, progress=False)


@pytest.fixture(scope="module")
def cuda_engines(tiny_checkpoint, tmp_path_factory, cp):
    cache = {}

    def get(name):
        if name not in cache:
            kind, overrides = KINDS[name]
            path = tiny_checkpoint(kind, **overrides)
            near = perturbed(path, tmp_path_factory.mktemp(name) / "near", 0.03)
            cache[name] = (load(path), {"self": load(path), "near": load(near),
                                        "other": load(tiny_checkpoint(kind, seed=1, **overrides))})
        return cache[name]

    return get


def drafting(engine, draft, k):
    engine.draft_tokens = k
    engine.drafter_factory = lambda context: DraftModel(draft.model, context, draft.decode_runner() or None)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(KINDS))
def test_cuda_greedy_speculative_equals_plain(cuda_engines, name):
    main, drafts = cuda_engines(name)
    ids = main.encode(PROMPT)
    main.drafter_factory = None
    want = list(main.generate_tokens(ids, 40))
    assert main.decode_runner(), "the plain decode runs through the captured graph"
    rates = {}
    for dname, draft in drafts.items():
        for k in (1, 4):
            drafting(main, draft, k)
            got = list(main.generate_tokens(ids, 40))
            assert got == want, f"{name}, draft {dname}, k={k}"
            rates[dname, k] = main.stats.speculative.acceptance
    main.drafter_factory = None
    assert rates["self", 4] == 1.0 and rates["near", 4] < 1.0 and rates["other", 4] < 0.5, rates
    if name.startswith("qwen"):  # Qwen's verify is captured (Gemma's may run op by op)
        from lumen_cuda.verify import VerifyGraph

        assert isinstance(main.decode_runner().verify_graph(5), VerifyGraph), main.decode_runner().verify_note(5)


@pytest.mark.gpu
def test_cuda_sampled_speculative_runs_and_is_seeded(cuda_engines):
    main, drafts = cuda_engines("qwen3_5")
    ids = main.encode(PROMPT)
    drafting(main, drafts["near"], 3)
    params = SamplingParams(temperature=0.8, top_k=20, seed=7)
    a = list(main.generate_tokens(ids, 24, params))
    b = list(main.generate_tokens(ids, 24, SamplingParams(temperature=0.8, top_k=20, seed=7)))
    main.drafter_factory = None
    assert a == b and len(a) == 24 and main.stats.speculative.verifies > 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_verify_graph_equals_the_op_by_op_verify(cuda_engines, name):
    """Replaying the captured verify of 5 tokens gives the logits and the per-token states of the same forward run
    op by op on a fresh cache (within 1e-4: the op-by-op attention over several tokens is another kernel)."""
    from lumen_cuda.graph import _zero

    main, _ = cuda_engines(name)
    model, runner = main.model, main.decode_runner()
    ids = main.encode(PROMPT)
    graph = runner.verify_graph(5)
    runner.reset()
    model.forward(ids, runner.cache)
    logits, _, trail = graph.run([7, 8, 9, 10, 11])
    got = logits.get()
    got_states = {k: [[a.get() for a in copies] for copies in v] for k, v in trail.items()}
    cache = model.new_cache(CONTEXT)
    _zero(cache.layers)
    model.forward(ids, cache)
    with recording() as want_trail:
        want = model.forward([7, 8, 9, 10, 11], cache, all_logits=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))
    assert len(got_states) == len(want_trail) > 0
    for g, w in zip(got_states.values(), want_trail.values(), strict=True):
        assert len(g) == len(w) == 5
        for ga, wa in zip(g, w, strict=True):
            for x, y in zip(ga, wa, strict=True):
                np.testing.assert_allclose(x, y.get(), rtol=1e-4, atol=1e-4)
    runner.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_cuda_mtp_drafts(tiny_checkpoint, cp, kind):
    """draft.mtp on cuda:0: the verify graph captured with the hidden rows the head reads; plain greedy's tokens,
    every draft of a head built to agree kept."""
    for mtp in ("random", "equal"):
        path = tiny_checkpoint(kind, mtp=mtp)
        plain = load(path)
        want = list(plain.generate_tokens(plain.encode(PROMPT), 32))
        model = {"path": str(path), "compute": "cuda:0", "store": "vram",
                 "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}}
        engine = lumen.load({"model": model, "draft": {"mtp": True, "num-draft-tokens": 3}}, progress=False)
        got = list(engine.generate_tokens(engine.encode(PROMPT), 32))
        assert got == want, (kind, mtp)
        rate = engine.stats.speculative.acceptance
        assert rate == 1.0 if mtp == "equal" else rate < 1.0, (kind, mtp, rate)
        assert engine.decode_runner().verify_graph(4, True) is not None, engine.decode_runner().verify_note(4, True)
        engine.close()
        plain.close()


@pytest.mark.gpu
def test_kept_kernels_equal_token_by_token_steps(cp):
    """decode.gated_delta_rule_kept / causal_conv1d_kept (T tokens in one launch) give bit for bit the outputs and
    states of T one-token steps (gated_delta_step / causal_conv1d_step), the state after every token kept."""
    from lumen_cuda import decode
    from lumen_cuda.delta import ConvState, DeltaState

    rng = np.random.default_rng(5)
    T, Hk, Hv, Dk, Dv, C, K = 5, 2, 4, 64, 32, 200, 4

    def f(*shape):
        return cp.asarray(rng.standard_normal(shape).astype(np.float32))

    q, k, v = f(T, Hk, Dk), f(T, Hk, Dk), f(T, Hv, Dv)
    g, beta = -cp.abs(f(T, Hv)), cp.abs(f(T, Hv)) / 4
    s0 = f(Hv, Dk, Dv)
    a, b = DeltaState(s0.copy()), DeltaState(s0.copy())
    out, states = decode.gated_delta_rule_kept(q, k, v, g, beta, a)
    for t in range(T):
        o = decode.gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], b)
        np.testing.assert_array_equal(out[t:t + 1].get(), o.get())
        np.testing.assert_array_equal(states[t][0].get(), b.s.get())
    np.testing.assert_array_equal(a.s.get(), b.s.get())
    x, w, x0 = f(T, C), f(C, K), f(K - 1, C)
    ca, cb = ConvState(x0.copy()), ConvState(x0.copy())
    y, states = decode.causal_conv1d_kept(x, w, ca)
    for t in range(T):
        np.testing.assert_array_equal(y[t:t + 1].get(), decode.causal_conv1d_step(x[t:t + 1], w, cb).get())
        np.testing.assert_array_equal(states[t][0].get(), cb.x.get())


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["f32", "bf16", "f16", "fp8"])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 30.0)])
def test_attention_verify_equals_token_by_token_decode(cp, kv, window, softcap):
    """decode.attention_verify (the T rows written first, then every token attending up to its own position in
    one launch) gives bit for bit the outputs and cache of T attention_decode calls in order, on a full cache of
    each type, with GQA (8 query heads over 2 kv heads), a window and a softcap; positions past 32 so that
    several splits are combined. A ring cache is refused (the caller then goes token by token)."""
    from lumen_cuda import decode
    from lumen_cuda.attention import kv_cache, sliding_kv_cache

    rng = np.random.default_rng(7)
    T, Hq, Hkv, D, ctx, start = 5, 8, 2, 64, 96, 41

    def f(*shape):
        return cp.asarray(rng.standard_normal(shape).astype(np.float32))

    q, k, v = f(T, Hq, D), f(T, Hkv, D), f(T, Hkv, D)
    past_k, past_v = f(start, Hkv, D), f(start, Hkv, D)
    caches = [kv_cache(ctx, Hkv, D, kv), kv_cache(ctx, Hkv, D, kv)]
    for c in caches:  # the same past in both, through the one-token kernel
        for p in range(start):
            decode.attention_decode(q[:1], past_k[p:p + 1], past_v[p:p + 1], c, cp.asarray([p], cp.int32), 0.125)
    pos = cp.arange(start, start + T, dtype=cp.int32)
    got = decode.attention_verify(q, k, v, caches[0], pos, 0.125, window, softcap, chunk=32)
    want = cp.concatenate([decode.attention_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], caches[1], pos[t:t + 1],
                                                   0.125, window, softcap, chunk=32) for t in range(T)])
    np.testing.assert_array_equal(got.get(), want.get())
    np.testing.assert_array_equal(caches[0].k.get(), caches[1].k.get())
    np.testing.assert_array_equal(caches[0].v.get(), caches[1].v.get())
    with pytest.raises(ValueError, match="full KVCache"):
        decode.attention_verify(q, k, v, sliding_kv_cache(8, Hkv, D, kv), pos, 0.125, 8)


@pytest.mark.gpu
def test_greedy_chain_equals_stepwise_argmax(cuda_engines):
    """GraphRunner.greedy_chain (each argmax fed to the next replay on the device, one read at the end) gives the
    tokens of replaying step by step and taking each argmax on the host, from a token and from a logits row, and
    advances the cache and calls ``after`` once per replay."""
    main, _ = cuda_engines("qwen3_5")
    ids = main.encode(PROMPT)
    r = main.decode_runner()
    assert r, "the tiny Qwen decodes through the captured graph"
    k = 6

    def fed_prompt():
        r.reset()
        for t in ids[:-1]:
            r.step(t)

    fed_prompt()
    want, tok = [], ids[-1]
    for _ in range(k):
        tok = int(r.step(tok).reshape(-1).argmax())
        want.append(tok)
    fed_prompt()
    calls = []
    got = r.greedy_chain(k, token=ids[-1], after=lambda: calls.append(r.cache.pos))
    assert got == want
    assert r.cache.pos == len(ids) - 1 + k and calls == list(range(len(ids), len(ids) + k))
    fed_prompt()
    row = r.step(ids[-1])
    calls.clear()
    got = r.greedy_chain(k, logits=row, after=lambda: calls.append(r.cache.pos))
    assert got == want
    assert r.cache.pos == len(ids) - 1 + k and len(calls) == k - 1
    r.reset()
