"""GPU benchmark, end to end: Lumen's cuda backend vs transformers (bf16) on a Qwen3.5-9B-shaped random model.

    python benchmarks/cuda_qwen.py [--layers 32 --prompt 512 --decode 32 --workdir /tmp/bench]

Builds a random bf16 checkpoint of the Qwen3.5-9B shape (hidden 4096, intermediate 12288, 16 heads / 4 kv,
head_dim 256, 3 linear : 1 full; vocab 248320) with ``--layers`` layers (fewer layers = a faster run; the
per-token bound scales with the bytes actually read), then times, in one process on one GPU: prefill of
``--prompt`` tokens and ``--decode`` greedy steps, for Lumen (all on cuda:0, bf16 weights in VRAM) and
transformers (bf16, eager). Prints tok/s, the ratio, and the fraction of the bandwidth bound: bytes of weights
read per decoded token / the read bandwidth measured in the same run. Dev tool: needs cupy, torch, transformers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--workdir", default="/tmp/lumen-bench")
    p.add_argument("--json")
    return p.parse_args(argv)


def build(args) -> Path:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    out = Path(args.workdir) / f"qwen3_5-9b-shape-l{args.layers}-v{args.vocab}"
    if (out / "config.json").exists():
        return out
    cfg = Qwen3_5TextConfig(vocab_size=args.vocab, hidden_size=4096, intermediate_size=12288,
                            num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                            linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                             "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def read_bandwidth() -> float:
    import cupy as cp

    a = cp.ones(1 << 29, cp.float32)  # 2 GiB
    a.sum()
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(5):
        a.sum()
    cp.cuda.Device().synchronize()
    return 5 * a.nbytes / (time.perf_counter() - t)


def weight_bytes_per_token(path: Path) -> int:
    """Everything a decode step reads: every weight except the input embedding table (one row is read)."""
    from lumen_core.checkpoint.hf import HFCheckpoint

    ck = HFCheckpoint(path)
    return sum(i.nbytes for n, i in ck.tensors.items() if "embed_tokens" not in n)


def time_lumen(path: Path, ids, steps: int):
    import cupy as cp

    import lumen_core as lumen

    engine = lumen.load({"model": {"path": str(path), "compute": "cuda:0", "store": "vram",
                                   "hidden-layers": {"kv-cache": {"context-size": len(ids) + steps + 8}}}},
                        progress=False)
    model = engine.model

    def run():
        cache = model.new_cache(len(ids) + steps + 8)
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        tok = int(model.forward(ids, cache)[-1].argmax())
        t1 = time.perf_counter()
        toks = [tok]
        for _ in range(steps):
            toks.append(int(model.forward([toks[-1]], cache)[-1].argmax()))
        return t1 - t0, time.perf_counter() - t1, toks

    run()  # warm-up: kernel compilation, allocator
    return run()


def time_hf(path: Path, ids, steps: int):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
    x = torch.tensor([ids], device="cuda")

    def run():
        with torch.inference_mode():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=x, use_cache=True, logits_to_keep=1)
            toks = [int(out.logits[0, -1].argmax())]
            t1 = time.perf_counter()
            cache = out.past_key_values
            for _ in range(steps):
                out = model(input_ids=torch.tensor([[toks[-1]]], device="cuda"), past_key_values=cache,
                            use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                toks.append(int(out.logits[0, -1].argmax()))
            torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t1, toks

    run()
    return run()  # the model is freed when this frame goes; main() then empties the CUDA cache


def main(argv=None):
    args = parse_args(argv)
    import numpy as np

    t = time.perf_counter()
    path = build(args)
    print(f"checkpoint {path} ready in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    ids = np.random.RandomState(0).randint(0, args.vocab, args.prompt).tolist()
    bw = read_bandwidth()
    per_token = weight_bytes_per_token(path)
    rows = {}
    for name, fn in (("transformers", time_hf), ("Lumen", time_lumen)):
        pre, dec, toks = fn(path, ids, args.decode)
        rows[name] = {"prefill_tok_s": args.prompt / pre, "decode_tok_s": args.decode / dec, "tokens": toks}
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
        print(f"{name} done", file=sys.stderr)
    bound = bw / per_token
    print(f"\nQwen3.5-9B shape, {args.layers} layers, vocab {args.vocab}, bf16; {per_token / 2**30:.2f} GiB read per "
          f"token; read bandwidth {bw / 1e9:.0f} GB/s -> bound {bound:.0f} tok/s\n")
    print("| metric | Lumen | transformers | ratio |\n|---|---:|---:|---:|")
    L, H = rows["Lumen"], rows["transformers"]
    print(f"| prefill tok/s ({args.prompt}) | {L['prefill_tok_s']:.0f} | {H['prefill_tok_s']:.0f} | "
          f"{L['prefill_tok_s'] / H['prefill_tok_s']:.2f}x |")
    print(f"| decode tok/s | {L['decode_tok_s']:.1f} | {H['decode_tok_s']:.1f} | "
          f"{L['decode_tok_s'] / H['decode_tok_s']:.2f}x |")
    print(f"| decode, fraction of the bandwidth bound | {L['decode_tok_s'] / bound:.1%} | "
          f"{H['decode_tok_s'] / bound:.1%} | |")
    same = sum(1 for a, b in zip(L["tokens"], H["tokens"], strict=True) if a == b)
    print(f"\ngreedy tokens equal at {same} of {len(L['tokens'])} positions (bf16 on both sides)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "bandwidth": bw, "bytes_per_token": per_token,
                                               **rows}, indent=2))


if __name__ == "__main__":
    main()
