"""CPU benchmark: Lumen vs transformers (eager, float32) on one medium random Qwen 3.5 checkpoint.

    python benchmarks/cpu_qwen.py [--hidden 1024 --layers 8 --prompt 128 --decode 32 --runs 3 --json OUT]

Both engines run in this one process on the same checkpoint, the same token ids and the same thread
count, and do exactly the same work: prefill N prompt tokens into a fresh cache (logits for the last token
only: transformers gets ``logits_to_keep=1``), then M single-token greedy decode steps, each engine feeding
back its own argmax. Every timed measurement is warmed up once, then repeated ``--runs`` times, and the
median is reported. The greedy tokens and logits of both engines are compared so that a fast result can
be trusted to have computed the same thing.

The checkpoint is built with transformers (``Qwen3_5TextConfig`` -> ``Qwen3_5ForCausalLM``, its own random
init, float32, ``save_pretrained``) into ``--workdir`` and reused when present. No tokenizer: token ids.
Dev tool: needs torch + transformers. threadpoolctl is optional (used to pin/report numpy's BLAS threads).

On a shared machine every measurement also reads /proc/stat: when other processes kept more than
``--max-foreign`` of the cores busy meanwhile, it is measured again (up to ``--tries`` times). ``--profile``
appends a cProfile of Lumen's prefill and decode. See benchmarks/README.md for results.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _timing import Probe, limit_threads, machine, measured


# -- arguments and threads ----------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("checkpoint shape")
    m.add_argument("--hidden", type=int, default=1024)
    m.add_argument("--layers", type=int, default=8, help="3 linear-attention : 1 full-attention pattern")
    m.add_argument("--intermediate", type=int, default=3584)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--head-dim", type=int, default=256, help="full-attention head dim (real Qwen 3.5: 256)")
    m.add_argument("--linear-key-heads", type=int, default=8)
    m.add_argument("--linear-value-heads", type=int, default=16)
    m.add_argument("--linear-head-dim", type=int, default=128, help="linear key and value head dim")
    m.add_argument("--vocab", type=int, default=32000, help="real Qwen 3.5: 248320")
    m.add_argument("--seed", type=int, default=0, help="init seed; also picks the prompt ids")
    r = p.add_argument_group("run")
    r.add_argument("--prompt", type=int, default=128, help="prompt length before the decode steps")
    r.add_argument("--prefill", type=int, nargs="+", default=None,
                   help="prompt lengths timed for prefill (default: --prompt and 512)")
    r.add_argument("--decode", type=int, default=32, help="single-token decode steps after --prompt")
    r.add_argument("--runs", type=int, default=3, help="timed repeats after one warm-up; median reported")
    r.add_argument("--threads", type=int, default=2, help="torch threads and numpy BLAS threads")
    r.add_argument("--max-foreign", type=float, default=0.05,
                   help="re-measure when other processes used more than this share of the cores meanwhile")
    r.add_argument("--tries", type=int, default=5, help="at most this many attempts per measurement")
    r.add_argument("--backoff", type=float, default=3.0, help="seconds to wait before a re-measurement")
    r.add_argument("--context", type=int, default=2048, help="Lumen KV-cache context size")
    r.add_argument("--attn", default="eager", help="transformers attn_implementation (eager | sdpa)")
    r.add_argument("--workdir", default=".cache/bench", help="where the checkpoint is built and reused")
    r.add_argument("--json", metavar="OUT", help="also write every measurement to this JSON file")
    r.add_argument("--profile", action="store_true",
                   help="afterwards, cProfile one Lumen prefill (longest --prefill) and the decode loop")
    r.add_argument("--profile-top", type=int, default=20)
    args = p.parse_args(argv)
    if args.prefill is None:
        args.prefill = sorted({args.prompt, 512})
    if args.prompt + args.decode > args.context or max(args.prefill) > args.context:
        p.error("prompt + decode and every --prefill length must fit in --context")
    return args


def thread_report(n: int) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(n)
    info = {"torch_threads": torch.get_num_threads(), "env": {v: os.environ.get(v) for v in (
        "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}}
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:
        info["threadpools"] = "threadpoolctl not installed: numpy BLAS threads pinned only through the env above"
        return info
    threadpool_limits(n, user_api="blas")  # numpy's BLAS; torch's own pools are set above
    np.zeros(1) @ np.zeros(1)
    info["threadpools"] = [
        {k: d.get(k) for k in ("internal_api", "prefix", "version", "num_threads", "threading_layer")}
        for d in threadpool_info()
    ]
    return info


# -- checkpoint ---------------------------------------------------------------------------------------------
def mrope_section(rotary_dim: int) -> list[int]:
    """Split rotary_dim/2 frequencies over (temporal, height, width) like Qwen's [11, 11, 10] for 32."""
    half = rotary_dim // 2
    base, rem = divmod(half, 3)
    return [base + (rem > 0), base + (rem > 1), base]


def text_config(args) -> dict:
    rotary = int(args.head_dim * 0.25)
    return dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, linear_num_key_heads=args.linear_key_heads,
        linear_num_value_heads=args.linear_value_heads, linear_key_head_dim=args.linear_head_dim,
        linear_value_head_dim=args.linear_head_dim, linear_conv_kernel_dim=4,
        layer_types=None,  # the config's default: every 4th layer full attention, the rest linear
        rope_parameters={
            "rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
            "mrope_section": mrope_section(rotary), "mrope_interleaved": True,
        },
        max_position_embeddings=max(4096, args.context), tie_word_embeddings=False, rms_norm_eps=1e-6,
        hidden_act="silu", eos_token_id=None, pad_token_id=None, bos_token_id=None,
    )


def checkpoint_dir(args) -> Path:
    a = args
    name = (f"qwen3_5-h{a.hidden}-l{a.layers}-i{a.intermediate}-a{a.heads}x{a.head_dim}kv{a.kv_heads}"
            f"-lin{a.linear_key_heads}k{a.linear_value_heads}v{a.linear_head_dim}-v{a.vocab}-s{a.seed}")
    return Path(a.workdir) / name


def ensure_checkpoint(args) -> tuple[Path, bool]:
    """Build the random checkpoint once (into a temp dir, renamed when complete); reuse it afterwards."""
    out = checkpoint_dir(args)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out, False
    import torch
    import transformers

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    torch.manual_seed(args.seed)
    config = transformers.Qwen3_5TextConfig(**text_config(args))
    model = transformers.Qwen3_5ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(tmp)
    del model
    if out.exists():  # a partial leftover from an interrupted build
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out, True


# -- the two engines ----------------------------------------------------------------------------------------
class LumenRunner:
    name = "Lumen"

    def __init__(self, path: Path, context: int):
        self.path, self.context = path, context

    def load(self):
        import lumen_core as lumen

        self.engine = lumen.load({"model": {
            "path": str(self.path), "compute": "cpu", "store": "ram",
            "hidden-layers": {"kv-cache": {"context-size": self.context}},
        }}, progress=False)
        self.model = self.engine.model

    def unload(self):
        self.engine = self.model = None

    def prefill(self, ids):
        cache = self.model.new_cache(self.context)
        logits = self.model.forward(ids, cache)
        return logits[-1], cache

    def step(self, token: int, cache):
        return self.model.forward([token], cache)[-1]

    @staticmethod
    def as_numpy(logits):
        return logits


class HFRunner:
    name = "transformers"

    def __init__(self, path: Path, attn: str):
        self.path, self.attn = path, attn

    def load(self):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            self.path, dtype=torch.float32, attn_implementation=self.attn).eval()

    def unload(self):
        self.model = None

    def prefill(self, ids):
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        return out.logits[0, -1], out.past_key_values

    def step(self, token: int, cache):
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
        return out.logits[0, -1]

    @staticmethod
    def as_numpy(logits):
        return logits.float().numpy()


def argmax(logits) -> int:
    return int(logits.argmax())


def timed_load(runner):
    runner.unload()
    gc.collect()
    with Probe() as p:
        runner.load()
    return p, None


def timed_prefill(runner, ids):
    with Probe() as p:
        runner.prefill(ids)
    return p, None


def timed_greedy(runner, ids, steps: int):
    """Prefill (untimed), then `steps` greedy decode steps (timed). Result: (tokens, per-step numpy logits)."""
    logits, cache = runner.prefill(ids)
    tokens, all_logits = [argmax(logits)], [runner.as_numpy(logits)]
    with Probe() as p:
        for _ in range(steps):
            logits = runner.step(tokens[-1], cache)
            tokens.append(argmax(logits))
            all_logits.append(runner.as_numpy(logits))
    return p, (tokens, all_logits)


# -- the benchmark ------------------------------------------------------------------------------------------
def bench(args, path: Path) -> dict:
    import numpy as np

    runners = [LumenRunner(path, args.context), HFRunner(path, args.attn)]
    rng = np.random.RandomState(args.seed)
    prompts = {n: rng.randint(0, args.vocab, n).tolist() for n in sorted(set(args.prefill) | {args.prompt})}
    keys = ["load_s", *(f"prefill{n}_s" for n in args.prefill), "decode_s"]
    times = {r.name: {k: [] for k in keys} for r in runners}
    attempts = {r.name: {k: [] for k in keys} for r in runners}

    def record(r, key, result):
        dt, out, tries = result
        times[r.name][key].append(dt)
        attempts[r.name][key].append(tries)
        return out

    # load: one warm-up (fills the page cache), then --runs timed loads; the last one stays loaded
    for r in runners:
        r.load()
    for _ in range(args.runs):
        for r in runners:
            record(r, "load_s", measured(lambda r=r: timed_load(r), args, f"{r.name} load"))
    print("loads done", file=sys.stderr)

    # warm-up: every prefill length and one decode loop per engine
    for r in runners:
        for n in args.prefill:
            r.prefill(prompts[n])
        timed_greedy(r, prompts[args.prompt], args.decode)
    print("compute warm-up done", file=sys.stderr)

    results = {}
    for i in range(args.runs):  # interleaved, so slow drift of the machine hits both engines alike
        for r in runners:
            for n in args.prefill:
                record(r, f"prefill{n}_s", measured(lambda r=r, n=n: timed_prefill(r, prompts[n]), args,
                                                    f"{r.name} prefill {n}"))
            results[r.name] = record(r, "decode_s", measured(
                lambda r=r: timed_greedy(r, prompts[args.prompt], args.decode), args, f"{r.name} decode"))
        print(f"run {i + 1}/{args.runs} done", file=sys.stderr)

    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    foreign = [a["foreign"] for per in attempts.values() for runs in per.values() for tries in runs
               for a in tries[-1:] if a["foreign"] is not None]
    retried = sum(len(tries) - 1 for per in attempts.values() for runs in per.values() for tries in runs)
    return {"times": times, "attempts": attempts, "median": med, "prompts": prompts,
            "agreement": agreement(results, runners),
            "noise": {"max_foreign_kept": max(foreign, default=None), "retried": retried}}


def agreement(results: dict, runners) -> dict:
    import numpy as np

    (ta, la), (tb, lb) = (results[r.name] for r in runners)
    same = 0
    for x, y in zip(ta, tb, strict=True):
        if x != y:
            break
        same += 1
    # logits are comparable only while both fed back the same tokens
    diffs = [float(np.abs(x - y).max()) for x, y in zip(la[:same + 1], lb[:same + 1], strict=True)]
    return {"tokens_compared": len(ta), "leading_tokens_equal": same, "lumen_tokens": ta,
            "transformers_tokens": tb, "max_abs_logit_diff_prefill": diffs[0],
            "max_abs_logit_diff_all": max(diffs)}


def table(args, med: dict) -> str:
    L, H = med["Lumen"], med["transformers"]
    rows = [("load (s, warm page cache)", L["load_s"], H["load_s"], H["load_s"] / L["load_s"], "{:.2f}")]
    for n in args.prefill:
        k = f"prefill{n}_s"
        rows.append((f"prefill tok/s (prompt {n})", n / L[k], n / H[k], H[k] / L[k], "{:.1f}"))
    d = args.decode
    rows.append((f"decode tok/s ({d} steps after {args.prompt})", d / L["decode_s"], d / H["decode_s"],
                 H["decode_s"] / L["decode_s"], "{:.2f}"))
    rows.append(("decode ms/token", 1e3 * L["decode_s"] / d, 1e3 * H["decode_s"] / d,
                 H["decode_s"] / L["decode_s"], "{:.1f}"))
    out = ["| metric | Lumen | transformers | ratio (Lumen/transformers, >1 = Lumen faster) |",
           "|---|---:|---:|---:|"]
    for name, lv, hv, ratio, fmt in rows:
        out.append(f"| {name} | {fmt.format(lv)} | {fmt.format(hv)} | {ratio:.2f}x |")
    return "\n".join(out)


def profile_lumen(args, path: Path, prompts: dict) -> str:
    """cProfile of one Lumen prefill (the longest --prefill length) and of the decode steps alone."""
    import cProfile
    import io
    import pstats

    r = LumenRunner(path, args.context)
    r.load()
    n = max(args.prefill)
    r.prefill(prompts[n])  # warm-up

    def prefill(prof):
        prof.runcall(r.prefill, prompts[n])

    def decode(prof):
        logits, cache = r.prefill(prompts[args.prompt])  # not profiled
        token = argmax(logits)
        for _ in range(args.decode):
            token = argmax(prof.runcall(r.step, token, cache))

    sections = []
    for label, fn in ((f"prefill of {n} tokens", prefill),
                      (f"{args.decode} decode steps after {args.prompt}", decode)):
        gc.collect()
        prof = cProfile.Profile()
        fn(prof)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.profile_top)
        sections.append(f"## Lumen {label} (cProfile, sorted by tottime)\n{buf.getvalue()}")
    return "\n".join(sections)


def main(argv=None) -> None:
    args = parse_args(argv)
    limit_threads(args.threads)
    threads = thread_report(args.threads)

    import numpy as np
    import torch
    import transformers

    import lumen_core

    t0 = time.perf_counter()
    path, built = ensure_checkpoint(args)
    print(f"checkpoint: {path} ({'built in %.1fs' % (time.perf_counter() - t0) if built else 'reused'})",
          file=sys.stderr)
    res = bench(args, path)
    agr = res["agreement"]
    versions = {"lumen": lumen_core.__version__, "numpy": np.__version__, "torch": torch.__version__,
                "transformers": transformers.__version__}
    mach = machine()

    print(f"\nQwen 3.5 random checkpoint {path.name}: hidden {args.hidden}, {args.layers} layers "
          f"(3 linear : 1 full), intermediate {args.intermediate}, {args.heads} heads / {args.kv_heads} kv "
          f"x head_dim {args.head_dim}, linear {args.linear_key_heads} k / {args.linear_value_heads} v heads "
          f"x {args.linear_head_dim}, vocab {args.vocab}; float32")
    print(f"machine: {mach['cpu']}, {mach['cores']} cores; threads {args.threads} "
          f"(torch {threads['torch_threads']}); transformers attn={args.attn}; median of {args.runs} runs")
    print(f"versions: {', '.join(f'{k} {v}' for k, v in versions.items())}\n")
    print(table(args, res["median"]))
    ok = agr["leading_tokens_equal"] == agr["tokens_compared"]
    print(f"\ngreedy agreement: {agr['leading_tokens_equal']}/{agr['tokens_compared']} leading tokens equal "
          f"({'OK' if ok else 'MISMATCH'}); max |dlogit| prefill {agr['max_abs_logit_diff_prefill']:.2e}, "
          f"over all agreeing steps {agr['max_abs_logit_diff_all']:.2e}")
    if not ok:
        print(f"  Lumen:        {agr['lumen_tokens']}\n  transformers: {agr['transformers_tokens']}")
    noise = res["noise"]
    if noise["max_foreign_kept"] is not None:
        print(f"machine noise: other processes used at most {noise['max_foreign_kept']:.0%} of the cores during "
              f"a kept measurement; {noise['retried']} measurement(s) redone (limit {args.max_foreign:.0%})")

    if args.json:
        out = {"args": vars(args), "checkpoint": str(path), "machine": mach, "threads": threads,
               "versions": versions, "times_s": res["times"], "median_s": res["median"], "agreement": agr,
               "noise": res["noise"], "attempts": res["attempts"]}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    if args.profile:
        print("\n" + profile_lumen(args, path, res["prompts"]))


if __name__ == "__main__":
    main()
