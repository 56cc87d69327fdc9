"""Speculative decoding on the CPU backend: plain greedy decoding against drafted decoding of the same tokens, in
one run.

    python benchmarks/speculative_cpu.py [--hidden 2048 --layers 16 --draft-hidden 512 --draft-layers 2
                                          --ks 1,2,4,6 --prompt 64 --decode 32 --threads 2 --workdir /tmp/lumen-bench]

Random bf16 Qwen 3.5 checkpoints (built by transformers, saved, loaded by Lumen from disk; the vocabulary is the
real 248320 ids): a main model and a small draft model (the same vocabulary: the lm_head is most of its cost).
Random weights agree on almost nothing, so the drafts are an oracle's (the plain run's own continuation), while
the draft model still runs every draft step: acceptance is ~100% and the draft's full cost is paid — the
mechanism's ceiling at this draft cost. Prints decode tok/s per k, the speedup over plain decoding, acceptance,
and the seconds of one verify of k + 1 tokens against one plain step. Dev tool: torch, transformers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import limit_threads  # noqa: E402

VOCAB = 248320


def build(out: Path, hidden: int, layers: int, intermediate: int) -> Path:
    import torch
    import transformers as tf

    if (out / "config.json").exists():
        return out
    heads = max(1, hidden // 256)
    cfg = tf.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads * 2, num_key_value_heads=max(1, heads // 2), head_dim=256,
        linear_num_key_heads=heads * 2, linear_num_value_heads=heads * 4, linear_key_head_dim=128,
        linear_value_head_dim=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    torch.manual_seed(0)
    model = tf.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


def load(path: Path, context: int):
    import lumen_core as lumen

    return lumen.load({"model": {"path": str(path), "compute": "cpu", "store": "ram",
                                 "hidden-layers": {"kv-cache": {"context-size": context}}}}, progress=False)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=6144)
    p.add_argument("--draft-hidden", type=int, default=512)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--ks", default="1,2,4,6")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", default="/tmp/lumen-bench")
    p.add_argument("--json")
    a = p.parse_args(argv)
    limit_threads(a.threads)
    import importlib

    import numpy as np

    from lumen_core.speculative import DraftModel

    OracleDrafter = importlib.import_module("speculative").OracleDrafter  # benchmarks/speculative.py

    work = Path(a.workdir)
    main_path = build(work / f"cpu-main-h{a.hidden}-l{a.layers}", a.hidden, a.layers, a.intermediate)
    draft_path = build(work / f"cpu-draft-h{a.draft_hidden}-l{a.draft_layers}", a.draft_hidden, a.draft_layers,
                       a.draft_hidden * 3)
    context = a.prompt + a.decode + 16
    main, draft = load(main_path, context), load(draft_path, context)
    prompt = np.random.RandomState(0).randint(3, VOCAB - 1, a.prompt).tolist()
    list(main.generate_tokens(prompt, 2))  # warm
    oracle = list(main.generate_tokens(prompt, a.decode))
    plain = (main.stats.generated_tokens - 1) / main.stats.decode_seconds
    cache = main.model.new_cache(context)
    main.model.forward(prompt, cache)
    base = cache.pos

    def timed(ids, reps=3):
        t = time.perf_counter()
        for _ in range(reps):
            main.model.forward(ids, cache, all_logits=True)
            cache.pos = base
        return (time.perf_counter() - t) / reps

    step = timed([5])
    dcache = draft.model.new_cache(context)
    draft.model.forward(prompt, dcache)
    t = time.perf_counter()
    for _ in range(3):
        draft.model.forward([5], dcache)
        dcache.pos -= 1
    draft_step = (time.perf_counter() - t) / 3
    print(f"main h{a.hidden} x {a.layers} layers, draft h{a.draft_hidden} x {a.draft_layers}, {a.threads} threads: "
          f"plain {plain:.2f} tok/s, step {1e3 * step:.0f} ms, draft step {1e3 * draft_step:.0f} ms", flush=True)
    rows = [{"k": 0, "decode_tok_s": plain, "step_s": step, "draft_step_s": draft_step}]
    for k in [int(x) for x in a.ks.split(",")]:
        main.draft_tokens = k
        main.drafter_factory = lambda ctx: OracleDrafter(DraftModel(draft.model, ctx), oracle, len(prompt))
        got = list(main.generate_tokens(prompt, a.decode))
        st = main.stats
        tps = (st.generated_tokens - 1) / st.decode_seconds
        verify = timed([5] * (k + 1))
        r = {"k": k, "decode_tok_s": tps, "speedup": tps / plain, "acceptance": st.speculative.acceptance,
             "verify_s": verify, "verify_over_step": verify / step, "same_tokens": got == oracle}
        rows.append(r)
        print(f"  k={k}: {tps:.2f} tok/s = {tps / plain:.2f}x plain; acceptance {100 * r['acceptance']:.1f}%; "
              f"verify {1e3 * verify:.0f} ms = {verify / step:.2f} plain steps; same tokens: {got == oracle}",
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
