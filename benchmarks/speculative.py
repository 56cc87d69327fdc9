"""Speculative decoding on the GPU: the mechanism's ceiling at 100% acceptance, against plain decoding in the same run.

    python benchmarks/speculative.py [--models 9b-bf16,9b-fp8,35b-a3b-bf16 --layers 32 --moe-layers 8 --ks 1,2,3,4,5,6
                                      --prompt 128 --decode 96 --workdir /tmp/lumen-bench --json out.json]

Random weights accept almost no draft, so the drafts are an oracle's: the plain greedy run's own continuation
(acceptance ~100%, measured and printed). The draft cost is still paid in full: a real draft model runs every
draft step — the main model's shape cut to its first layer (embedding, one decoder layer, the full lm_head: what an
MTP head reads per step) through its own captured CUDA graph — and its tokens are then replaced by the oracle's.
So the tok/s are what a draft of that cost that is always right gives.

Per row and k: decode tok/s (plain: the captured one-token graph with on-device greedy; speculative: drafts + the
verify graph of k + 1 tokens + rewind), the speedup, tokens per verify, and the cost of one verify replay relative
to one plain step replay (both timed alone, 20 replays each). Then k = 4 once more with the fallback on (the
default ``draft.fallback``: plain rounds where they are measured faster), after one untimed generation in which the
engine's policy learns: its tok/s and how many tokens it decoded plainly. Shapes: benchmarks/cuda_models.py
(``--layers`` for the 9B, ``--moe-layers`` for the 35B-A3B: the whole 40 layers do not fit the machine's disk).
Dev tool: cupy, torch, transformers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_models import build, bytes_per_token, quantized, read_bandwidth  # noqa: E402

from lumen_core.speculative import Drafter, DraftModel  # noqa: E402

VOCAB = 248320


class OracleDrafter(Drafter):
    """Pays ``inner``'s drafting cost, then proposes the known continuation ``tokens`` (of ``prompt_len`` + ...)."""

    def __init__(self, inner: Drafter, tokens: list[int], prompt_len: int):
        self.inner, self.tokens, self.prompt_len = inner, tokens, prompt_len
        self.needs_hidden = inner.needs_hidden

    def start(self, prompt_ids, computed, rows):
        self.inner.start(prompt_ids, computed, rows)

    def propose(self, last, k, params, seen, rng):
        self.inner.propose(last, k, params, seen, rng)
        g = len(seen) - self.prompt_len  # tokens generated so far (last included)
        drafts = (self.tokens[g:g + k] + [0] * k)[:k]
        return drafts, None

    def accept(self, fed, keep, rows):
        self.inner.accept(fed, keep, rows)


class SkippingOracle(OracleDrafter):
    """An OracleDrafter the engine may skip (``Drafter.skip``): the fallback to plain rounds is on for it."""

    def skip(self, fed, rows):
        self.inner.skip(fed, rows)


def load(path: Path, context: int):
    import lumen_core as lumen

    model = {"path": str(path), "compute": "cuda:0", "store": "vram",
             "hidden-layers": {"kv-cache": {"context-size": context}}}
    return lumen.load({"model": model}, progress=False)


def replay_ms(fn, reps: int = 20) -> float:
    import cupy as cp

    fn()
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def step_costs(engine, ks, prompt) -> dict:
    """ms per replay: the one-token step and the verify of k + 1 tokens (both on the runner's cache)."""
    runner = engine.decode_runner()
    out = {}
    runner.reset()
    engine.model.forward(prompt, runner.cache)
    base = runner.cache.pos

    def plain():
        runner.step(5)
        runner.cache.pos = base

    out["plain"] = replay_ms(plain)
    for k in ks:
        graph = runner.verify_graph(k + 1)  # captured before: this finds it
        runner.reset()
        engine.model.forward(prompt, runner.cache)

        def verify(graph=graph):
            graph.run([5] * graph.T)
            runner.cache.pos = base

        out[k] = replay_ms(verify) if graph is not None else float("nan")
    runner.reset()
    return out


def row(name: str, main_path: Path, draft_path: Path, ks, prompt_len: int, steps: int, bound: float) -> list[dict]:
    main, draft = load(main_path, 2048), load(draft_path, 2048)
    import numpy as np

    prompt = np.random.RandomState(0).randint(3, VOCAB - 1, prompt_len).tolist()
    main.drafter_factory = None
    list(main.generate_tokens(prompt, 8))  # warm: the decode graph
    oracle = list(main.generate_tokens(prompt, steps))
    plain_tps = (main.stats.generated_tokens - 1) / main.stats.decode_seconds
    nbytes, _, _ = bytes_per_token(main_path)
    for k in ks:  # capture every verify size first (capturing resets the runner's cache)
        main.decode_runner().verify_graph(k + 1)
    main.draft_tokens = ks[0]  # warm: the drafting path's own kernels compile here, not in the first timed k
    main.drafter_factory = lambda context: DraftModel(draft.model, context, draft.decode_runner())
    list(main.generate_tokens(prompt, 8))
    costs = step_costs(main, ks, prompt)
    runner_d = draft.decode_runner()
    draft_ms = replay_ms(lambda: (runner_d.step(5), setattr(runner_d.cache, "pos", 0)))
    out = [{"model": name, "k": 0, "decode_tok_s": plain_tps, "bound_fraction": plain_tps * nbytes / bound,
            "plain_step_ms": costs["plain"], "draft_step_ms": draft_ms}]
    print(f"{name}: plain {plain_tps:.1f} tok/s ({100 * plain_tps * nbytes / bound:.1f}% of the bound), step "
          f"{costs['plain']:.2f} ms, draft step {draft_ms:.2f} ms", flush=True)
    for k in ks:
        main.draft_tokens = k
        main.drafter_factory = lambda context: OracleDrafter(
            DraftModel(draft.model, context, runner_d), oracle, prompt_len)
        got = list(main.generate_tokens(prompt, steps))
        st = main.stats
        tps = (st.generated_tokens - 1) / st.decode_seconds
        spec = st.speculative
        r = {"model": name, "k": k, "decode_tok_s": tps, "speedup": tps / plain_tps,
             "acceptance": spec.acceptance, "tokens_per_verify": spec.tokens_per_verify,
             "verify_ms": costs[k], "verify_over_step": costs[k] / costs["plain"], "same_tokens": got == oracle}
        out.append(r)
        print(f"  k={k}: {tps:.1f} tok/s = {tps / plain_tps:.2f}x plain; acceptance {100 * spec.acceptance:.1f}%, "
              f"{spec.tokens_per_verify:.2f} tok/verify; verify {costs[k]:.2f} ms = "
              f"{costs[k] / costs['plain']:.2f} plain steps; same tokens: {got == oracle}", flush=True)
    k = 4 if 4 in ks else ks[-1]  # the same k with the fallback on (draft.fallback, the default)
    main.draft_tokens = k
    main.drafter_factory = lambda context: SkippingOracle(DraftModel(draft.model, context, runner_d), oracle,
                                                          prompt_len)
    list(main.generate_tokens(prompt, steps))  # the policy's memory (per engine) learns here; the next run is timed
    got = list(main.generate_tokens(prompt, steps))
    st = main.stats
    tps = (st.generated_tokens - 1) / st.decode_seconds
    out.append({"model": name, "k": k, "fallback": True, "decode_tok_s": tps, "speedup": tps / plain_tps,
                "plain_rounds": st.speculative.plain_rounds, "verifies": st.speculative.verifies,
                "same_tokens": got == oracle})
    print(f"  k={k} with the fallback: {tps:.1f} tok/s = {tps / plain_tps:.2f}x plain; {st.speculative.verifies} "
          f"verifies, {st.speculative.plain_rounds} tokens decoded plainly; same tokens: {got == oracle}", flush=True)
    main.drafter_factory = None
    main.close()
    draft.close()
    return out


def profile(main_path: Path, k: int) -> None:
    """Kernel-level trace (benchmarks/cuda_profile.py) of 4 plain step replays and 4 verify replays of k + 1 tokens."""
    import numpy as np
    from cuda_profile import kernel_trace

    engine = load(main_path, 2048)
    runner = engine.decode_runner()
    graph = runner.verify_graph(k + 1)
    prompt = np.random.RandomState(0).randint(3, VOCAB - 1, 128).tolist()
    runner.reset()
    engine.model.forward(prompt, runner.cache)
    base = runner.cache.pos

    def steps():
        for _ in range(4):
            runner.step(5)
            runner.cache.pos = base

    def verifies():
        for _ in range(4):
            graph.run([5] * (k + 1))
            runner.cache.pos = base

    steps(), verifies()
    kernel_trace("plain step", steps, 4)
    kernel_trace(f"verify of {k + 1} tokens", verifies, 4)
    engine.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="9b-bf16,9b-fp8,35b-a3b-bf16")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--moe-layers", type=int, default=8)
    p.add_argument("--ks", default="1,2,3,4,5,6")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--decode", type=int, default=96)
    p.add_argument("--workdir", default="/tmp/lumen-bench")
    p.add_argument("--json")
    p.add_argument("--profile", type=int, metavar="K", help="only a kernel trace of a step and a verify of K + 1 "
                   "tokens on the first model")
    a = p.parse_args(argv)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ks = [int(k) for k in a.ks.split(",")]
    bound = read_bandwidth()
    print(f"read bandwidth {bound / 1e9:.0f} GB/s", flush=True)
    rows = []
    if a.profile:
        shape, fmt = a.models.split(",")[0].rsplit("-", 1)
        path = build(shape, a.moe_layers if shape.startswith("35b") else a.layers, VOCAB, work)
        return profile(path if fmt == "bf16" else quantized(path, fmt), a.profile)
    for spec in a.models.split(","):
        shape, fmt = spec.rsplit("-", 1)
        layers = a.moe_layers if shape.startswith("35b") else a.layers
        main_path, draft_path = build(shape, layers, VOCAB, work), build(shape, 1, VOCAB, work)
        if fmt != "bf16":
            main_path, draft_path = quantized(main_path, fmt), quantized(draft_path, fmt)
        rows += row(f"{spec} ({layers} layers)", main_path, draft_path, ks, a.prompt, a.decode, bound)
    if a.json:
        Path(a.json).write_text(json.dumps({"bandwidth": bound, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
