"""GPU benchmark, end to end: Lumen's cuda backend vs transformers on Qwen 3.5 / Gemma 4 shapes, random weights.

    python benchmarks/cuda_models.py [--models 9b-bf16,9b-fp8,35b-a3b-fp8,g4-26b-a4b-bf16 --layers 32
                                      --moe-layers 8 --prompts 512,4096 --decode 64 --workdir /tmp/lumen-bench
                                      --placements vram,stream,stream-cache64,cpu-experts --json out.json]
    python benchmarks/cuda_models.py --full-depth --no-hf [--models 9b-bf16,9b-fp8,35b-a3b-fp8,g4-26b-a4b-bf16]
        # issue 21's table: every row at its real depth, per-layer and outside-the-layers time, llama.cpp beside,
        # then each row against its goals
    python benchmarks/cuda_models.py --table a.json,b.json   # that table from earlier runs' --json files

Rows (random checkpoints built by transformers in bf16 and saved; fp8 copies written by ``lumen quantize``):

- ``9b-bf16`` / ``9b-fp8``: the Qwen3.5-9B shape (hidden 4096, intermediate 12288, 16 heads / 4 kv of 256,
  32 value heads of 128 in the Gated-DeltaNet layers, 3 linear : 1 full, vocab 248320), ``--layers`` layers.
- ``35b-a3b-bf16`` / ``35b-a3b-fp8``: the Qwen3.5-35B-A3B shape (hidden 2048, 256 experts of 512, 8 routed + a
  shared expert of 512, 16 heads / 2 kv of 256, 32 value heads of 128), ``--moe-layers`` layers (the checkpoint of
  all 40 would not fit the machine's disk; the bound below counts the bytes of the layers actually built).
- ``g4-26b-a4b-bf16``: the Gemma-4-26B-A4B shape (hidden 2816, 16 heads / 8 kv of 256, full layers' head dim 512,
  5 sliding (window 1024) : 1 full, a dense MLP of 2112 beside 128 experts of 704, top 8, vocab 262144, tied
  embeddings), ``--moe-layers`` layers.

Per row, in one process: Lumen (everything on cuda:0, weights in VRAM, decode through the captured CUDA graph
and the on-device sampler, greedy) and transformers (bf16, its default attention; for fp8 rows transformers runs
the bf16 source checkpoint). Prefill tok/s at each ``--prompts`` length (Lumen: the median of 3 timed runs after a
warm-up), decode tok/s at batch 1 after the first prompt, the fraction of the bandwidth bound (bytes a decode step
reads / the read bandwidth measured in the same run; a MoE step reads the routed experts it picks, counted as top-k
of E) and of the tensor-core bound for prefill (2 x active parameters x tokens / the bf16 dense peak, 989 TFLOP/s on
the H200). Dev tool: cupy, torch, transformers.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

BF16_PEAK = 989e12  # H200 dense bf16 tensor-core FLOP/s (datasheet)
SHAPES = {
    "9b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4,
               head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128),
    "35b-a3b": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                    linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512),
    "g4-26b-a4b": dict(hidden_size=2816, intermediate_size=2112, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=256, global_head_dim=512, sliding_window=1024, enable_moe_block=True,
                       num_experts=128, top_k_experts=8, moe_intermediate_size=704, hidden_size_per_layer_input=0,
                       tie_word_embeddings=True),
}
MOE_SHAPES = ("35b-a3b", "g4-26b-a4b")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="9b-bf16,9b-fp8,35b-a3b-fp8,g4-26b-a4b-bf16")
    p.add_argument("--layers", type=int, default=32, help="layers of the 9B shape")
    p.add_argument("--moe-layers", type=int, default=8, help="layers of the 35B-A3B shape")
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--prompts", default="512,4096", help="prefill lengths (comma-separated)")
    p.add_argument("--decode", type=int, default=64, help="greedy decode steps timed")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--placements", default="vram",
                   help="for MoE rows, comma-separated: vram (all on cuda:0), stream (routed experts in pinned host "
                        "RAM, read over PCIe or from the VRAM expert cache), stream-cacheN (a cache of N experts; "
                        "default 32), "
                        "cpu-experts (routed experts computed by the CPU backend), cpu-experts-int8 (the same with "
                        "cpu.compute-quantization int8: 8-bit activations for NVFP4 experts' decode), "
                        "cpu-experts-bf16 (the same with bf16: NVFP4 and fp8 experts' several-token products in AMX "
                        "bf16 tiles); rows other than vram prefill only the first --prompts length")
    p.add_argument("--moe-rows", default="",
                   help="rows per warp of the MoE expert kernels for this run, e.g. gate_up=4,down_t1=2 (keys gate_up, "
                        "down (T > 1), down_t1; values 1, 2 or 4, the compiled ones): a tuning sweep, for every format")
    p.add_argument("--workdir", default="/tmp/lumen-bench")
    p.add_argument("--json")
    p.add_argument("--full-depth", action="store_true",
                   help="issue 21's table instead: every --models row at its real depth (9B 32 layers, 35B-A3B 40, "
                        "Gemma-4-26B-A4B 30) and at one period of its layer kinds (4 / 4 / 6 layers), both "
                        "checkpoints written directly in their format (benchmarks/full_depth.py), decode and prefill "
                        "split into time per layer and time outside the layers, beside llama.cpp's figures")
    p.add_argument("--keep", action="store_true", help="--full-depth: keep the checkpoints (default: each row's "
                   "are deleted after it, so that the next fits the disk)")
    p.add_argument("--repeat", type=int, default=1,
                   help="decode timed this many times per row, the median reported (every run in --json)")
    p.add_argument("--table", default="",
                   help="print the --full-depth table from these --json files of earlier runs (comma-separated: "
                        "rows run in separate calls, one placement) and their goals, and measure nothing")
    p.add_argument("--cuda-compute", default="none", choices=("none", "bf16"),
                   help="the config's cuda.compute-quantization: bf16 rounds the activations of every several-token "
                        "product to bf16 (one tensor-core product where exact runs two or three); --full-depth rows "
                        "are then named MODEL bf16-act")
    p.add_argument("--depths", default="",
                   help="--full-depth: SHORT,DEEP layer counts instead of each shape's period and real depth (the "
                        "row then also gives the real depth's decode and prefill from the per-layer and outside "
                        "times)")
    return p.parse_args(argv)


# issue 21's llama.cpp figures (its sm_90 build on the same machine type, same shapes; Q8_0 for fp8): decode tok/s,
# prefill tok/s at 512 and 4096 (None: not measured)
LLAMA_CPP = {"9b-bf16": (181.5, {512: 16800, 4096: 19100}), "9b-fp8": (216.0, {512: 8800, 4096: 9400}),
             "35b-a3b-fp8": (205.0, {512: 5000, 4096: None})}
FULL_DEPTH = {"9b": (32, 4), "35b-a3b": (40, 4), "g4-26b-a4b": (30, 6)}  # (real layers, one period of layer kinds)
# issue 22's llama.cpp figures with the routed experts on the CPU (`-ot exps=CPU`, the H200 host's 16 cores): decode
# tok/s and prefill tok/s at 512, for the --full-depth --placements cpu-experts rows
LLAMA_CPP_CPU_EXPERTS = {"35b-a3b-fp8": (37.1, {512: 116}), "35b-a3b-nvfp4": (37.1, {512: 116})}
# issue 21's goals, all in VRAM: decode as a fraction of its bytes' bound (MoE: the active weights'), prefill tok/s
# (1.3x llama.cpp's, or the issue's own figure where it names one); with the experts on the CPU, issue 22's: 1.5x
# llama.cpp's `-ot exps=CPU` decode and prefill
DECODE_GOALS = {"9b-bf16": 0.85, "9b-fp8": 0.75, "9b-nvfp4": 0.75, "35b-a3b-fp8": 0.60, "35b-a3b-nvfp4": 0.60,
                "g4-26b-a4b-bf16": 0.60}
PREFILL_GOALS = {"9b-bf16": {512: 21840, 4096: 25000}, "9b-fp8": {512: 11440, 4096: 12000},
                 "35b-a3b-fp8": {512: 6500}, "g4-26b-a4b-bf16": {512: 15000}}
CPU_EXPERTS_GOAL = 1.5


def full_depth_rows(args, prompts, bw: float) -> dict:
    """Each model at its real depth and at one period, both timed; per-layer time = the difference over the layers
    between them, non-layer time = the rest (embedding, lm_head, sampling, launch and host time per step)."""
    import shutil

    from full_depth import write_checkpoint

    rows = {}
    placement = args.placements if args.placements != "vram" else None
    if placement and "," in placement:
        raise SystemExit("--full-depth takes one --placements entry (vram or cpu-experts, ...)")
    host_bw = None
    if placement and placement.startswith("cpu-experts"):  # the bound of the experts' reads: the host's DRAM
        from _timing import read_bandwidth as host_read_bandwidth

        host_bw = host_read_bandwidth()
    for name in args.models.split(","):
        shape, fmt = name.rsplit("-", 1)
        real, short = FULL_DEPTH[shape]
        deep = real
        if args.depths:
            short, deep = (int(v) for v in args.depths.split(","))
        experts = experts_block(placement) if placement and shape != "9b" else None
        timed = {}
        for layers in (short, deep):
            t = time.perf_counter()
            path = write_checkpoint(shape, layers, fmt, Path(args.workdir), args.vocab)
            print(f"{name} ({layers} layers): checkpoint ready in {time.perf_counter() - t:.0f}s", file=sys.stderr)
            per_token, params, expert_bytes = bytes_per_token(path)
            lumen = time_lumen(path, prompts, args.decode, experts, args.repeat, cpu_block(placement),
                               args.cuda_compute)
            timed[layers] = {"lumen": lumen, "bytes": per_token, "params": params, "experts": expert_bytes}
            if not args.keep:
                shutil.rmtree(path)
            gc.collect()
        a, b = timed[short], timed[deep]
        step = {n: 1 / r["lumen"]["decode"] for n, r in timed.items()}
        layer_s = (step[deep] - step[short]) / (deep - short)
        outside_s = step[deep] - deep * layer_s
        row = {"layers": deep, "real_layers": real, "placement": placement or "vram", "bytes_per_token": b["bytes"],
               "active_params": b["params"], "decode": b["lumen"]["decode"], "decode_layer_us": 1e6 * layer_s,
               "decode_outside_us": 1e6 * outside_s, "decode_at_real": 1 / (outside_s + real * layer_s),
               "layer_bytes": (b["bytes"] - a["bytes"]) / (deep - short), "prefill": {}, "graph": b["lumen"]["graph"],
               "expert_bytes_per_token": b["experts"], "host_read_bandwidth": host_bw, "read_bandwidth": bw}
        for n in prompts:
            ts = {k: n / r["lumen"]["prefill"][n] for k, r in timed.items()}
            per = (ts[deep] - ts[short]) / (deep - short)
            row["prefill"][n] = {"tok_s": b["lumen"]["prefill"][n], "layer_ms": 1e3 * per,
                                 "outside_ms": 1e3 * (ts[deep] - deep * per),
                                 "at_real": n / (ts[deep] - deep * per + real * per)}
        row["cuda_compute"] = args.cuda_compute
        rows[name if args.cuda_compute == "none" else f"{name} {args.cuda_compute}-act"] = row
        print(f"{name}: {json.dumps(row, default=str)[:400]}", file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "bandwidth": bw, "full_depth": rows},
                                                  indent=2, default=str))
    print(full_depth_report(rows, prompts))
    return rows


def full_depth_report(rows: dict, prompts) -> str:
    """Issue 21's table (issue 22's with the experts on the CPU) for full-depth rows, each measured against the read
    bandwidth of its own run (``read_bandwidth``, ``host_read_bandwidth``), then each row against its goals."""
    out = []
    placements = {r["placement"] for r in rows.values()}
    if len(placements) > 1:
        raise SystemExit(f"one table holds one placement; these rows have {sorted(placements)}")
    placement = None if placements <= {"vram"} else placements.pop()
    bws = sorted({round(r["read_bandwidth"] / 1e9) for r in rows.values()})
    host_bw = next((r["host_read_bandwidth"] for r in rows.values() if r.get("host_read_bandwidth")), None)
    out.append(f"\nread bandwidth measured: {', '.join(map(str, bws))} GB/s; bf16 tensor-core peak "
               f"{BF16_PEAK / 1e12:.0f} TFLOP/s; llama.cpp: issue 21's figures\n")
    if host_bw:
        out.append(f"routed experts: {placement}; llama.cpp: issue 22's `-ot exps=CPU` figures; % of bound: the "
                   f"routed experts' bytes a token read per second against the host's read bandwidth measured in "
                   f"this run ({host_bw / 1e9:.1f} GB/s, a parallel numba sum with numba's default threads)\n")
    elif placement:
        out.append(f"routed experts: {placement}; llama.cpp: issue 22's `-ot exps=CPU` figures; % of bound: -, the "
                   "GPU's bandwidth does not bound a step that reads experts from host RAM\n")
    per_prompt = " prefill {} tok/s | per layer ms | outside ms | % TC | llama.cpp | ratio |"
    out.append("| model | layers | decode tok/s | % of bound | per layer µs (% of its bytes' bound) | "
               "outside layers µs | llama.cpp | Lumen / llama.cpp |" + "".join(per_prompt.format(n) for n in prompts))
    out.append("|" + "---|" * (8 + 6 * len(prompts)))
    fits = []
    for name, r in rows.items():
        bw = r["read_bandwidth"]
        bound = bw / r["bytes_per_token"]
        layer_bound_us = 1e6 * r["layer_bytes"] / bw
        ref = (LLAMA_CPP_CPU_EXPERTS if placement else LLAMA_CPP).get(model_of(name))
        fitted = r["layers"] != r["real_layers"]  # ratios against llama.cpp's real depth: the fit's figure
        dec = r["decode_at_real"] if fitted else r["decode"]
        ratio = f"{dec / ref[0]:.2f}x" if ref else "-"
        frac = "-" if placement else f"{r['decode'] / bound:.1%}"
        if host_bw:
            got = r["expert_bytes_per_token"] * r["decode"]
            frac = f"{got / 1e9:.1f} GB/s = {got / host_bw:.0%} of host"
        line = (f"| {name}{'' if r['graph'] else ' (no graph)'} | {r['layers']} | {r['decode']:.1f} | {frac} | "
                f"{r['decode_layer_us']:.1f} ({layer_bound_us / r['decode_layer_us']:.0%})"
                f" | {r['decode_outside_us']:.0f} | {ref[0] if ref else '-'} | {ratio} |")
        for n in prompts:
            p = r["prefill"].get(n)
            if p is None:
                line += " - | - | - | - | - | - |"
                continue
            tc = p["tok_s"] * 2 * r["active_params"] / BF16_PEAK
            lref = ref[1].get(n) if ref else None
            ratio = f"{(p['at_real'] if fitted else p['tok_s']) / lref:.2f}x" if lref else "-"
            line += (f" {p['tok_s']:.0f} | {p['layer_ms']:.2f} | {p['outside_ms']:.1f} | {tc:.1%} | "
                     f"{lref or '-'} | {ratio} |")
        out.append(line)
        if fitted:
            pre = ", ".join(f"prefill {n} {p['at_real']:.0f} tok/s" for n, p in r["prefill"].items())
            fits.append(f"{name} at its real {r['real_layers']} layers (outside + {r['real_layers']} x per layer): "
                        f"decode {dec:.1f} tok/s, {pre}")
    if fits:
        out.append("\nRatios of rows measured at fewer layers are those of the real depth's figures:\n"
                   + "\n".join(fits))
    out.append("\nAgainst the goals (issue 21 all in VRAM, issue 22 with the experts on the CPU):")
    out += [goal_line(name, r, placement) for name, r in rows.items()]
    return "\n".join(out)


def model_of(name: str) -> str:
    """A row's model (its goals' and llama.cpp's key): the name without a "bf16-act" tag (--cuda-compute)."""
    return name.split(" ")[0]


def goal_line(name: str, r: dict, placement: str | None) -> str:
    """One row against its goals: decode as a fraction of its bound, prefill in tok/s (issue 21), or both as
    multiples of llama.cpp's with the experts on the CPU (issue 22); the real depth's figures where it was fitted."""
    fitted = r["layers"] != r["real_layers"]
    model = model_of(name)
    dec = r["decode_at_real"] if fitted else r["decode"]
    parts = []
    if placement:
        ref = LLAMA_CPP_CPU_EXPERTS.get(model)
        if ref is None:
            return f"- {name}: no goal with {placement}"
        parts.append(_verdict(f"decode {dec:.1f} tok/s = {dec / ref[0]:.2f}x llama.cpp", dec / ref[0],
                              CPU_EXPERTS_GOAL, f"{CPU_EXPERTS_GOAL}x"))
        for n, p in r["prefill"].items():
            tok = p["at_real"] if fitted else p["tok_s"]
            if ref[1].get(n):
                parts.append(_verdict(f"prefill {n} {tok:.0f} tok/s = {tok / ref[1][n]:.2f}x", tok / ref[1][n],
                                      CPU_EXPERTS_GOAL, f"{CPU_EXPERTS_GOAL}x"))
        return f"- {name}: " + "; ".join(parts)
    step_bytes = r["bytes_per_token"] + (r["real_layers"] - r["layers"]) * r["layer_bytes"]  # at the real depth
    frac = dec * step_bytes / r["read_bandwidth"]
    if model in DECODE_GOALS:
        parts.append(_verdict(f"decode {frac:.1%} of the bound", frac, DECODE_GOALS[model],
                              f"{DECODE_GOALS[model]:.0%}"))
    for n, p in r["prefill"].items():
        goal = PREFILL_GOALS.get(model, {}).get(n)
        if goal:
            tok = p["at_real"] if fitted else p["tok_s"]
            parts.append(_verdict(f"prefill {n} {tok:.0f} tok/s", tok, goal, f"{goal}"))
    return f"- {name}: " + ("; ".join(parts) if parts else "no goal")


def _verdict(what: str, got: float, goal: float, shown: str) -> str:
    return f"{what} (goal {shown}: {'met' if got >= goal else f'{got / goal:.0%} of it'})"


def hf_config(shape: str, layers: int, vocab: int, dims: dict | None = None):
    """(transformers config, model class) of a shape at ``layers`` layers; ``dims`` overrides its sizes (the
    full-depth writer's tiny template: benchmarks/full_depth.py)."""
    import transformers as tf

    dims = {**SHAPES[shape], **(dims or {})}
    if shape.startswith("g4"):
        kinds = ["sliding_attention"] * 5 + ["full_attention"]
        g4_vocab = 262144 if vocab == 248320 else vocab  # Gemma 4's own vocabulary at the default
        cfg = tf.Gemma4TextConfig(vocab_size=g4_vocab, vocab_size_per_layer_input=g4_vocab, num_hidden_layers=layers,
                                  layer_types=[kinds[i % 6] for i in range(layers - 1)] + ["full_attention"], **dims)
        return cfg, tf.Gemma4ForCausalLM
    moe = shape in MOE_SHAPES
    cfg_cls, model_cls = (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM) if moe else (
        tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM)
    cfg = cfg_cls(vocab_size=vocab, num_hidden_layers=layers, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                   "mrope_section": [11, 11, 10], "mrope_interleaved": True}, **dims)
    return cfg, model_cls


def build(shape: str, layers: int, vocab: int, workdir: Path) -> Path:
    import torch

    out = workdir / f"{shape}-l{layers}-bf16"
    if (out / "config.json").exists():
        return out
    cfg, model_cls = hf_config(shape, layers, vocab)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_cls(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def quantized(src: Path, fmt: str) -> Path:
    from lumen_core.quantize import quantize_checkpoint

    out = src.with_name(src.name.replace("-bf16", f"-{fmt}"))
    if not (out / "config.json").exists():
        quantize_checkpoint(src, out, fmt, progress=False)
    return out


def read_bandwidth() -> float:
    import cupy as cp

    a = cp.ones(1 << 29, cp.float32)  # 2 GiB, read once per sum
    a.sum()
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(5):
        a.sum()
    cp.cuda.Device().synchronize()
    return 5 * a.nbytes / (time.perf_counter() - t)


def bytes_per_token(path: Path) -> tuple[int, int]:
    """(bytes a decode step reads, active parameters): every tensor but the embedding table (unless tied: then
    it is the lm_head); of the routed experts only the top-k of E a token picks."""
    from lumen_core.checkpoint.hf import HFCheckpoint

    ck = HFCheckpoint(path)
    cfg = ck.config.get("text_config", ck.config)
    top = cfg.get("num_experts_per_tok") or cfg.get("top_k_experts") or 1
    frac = top / cfg["num_experts"] if cfg.get("num_experts") else 1.0
    tied = cfg.get("tie_word_embeddings", ck.config.get("tie_word_embeddings", False))
    total = params = experts = 0
    for name, info in ck.tensors.items():
        if "embed_tokens" in name and not (tied and name.endswith("embed_tokens.weight")):
            continue
        f = frac if ".experts." in name else 1.0
        total += info.nbytes * f
        experts += info.nbytes * f if ".experts." in name else 0
        if not name.endswith(("_scale_inv", "_scale", "_scale_2")):
            n = 1
            for d in info.shape:
                n *= d
            params += n * f * (2 if info.dtype in ("U8",) else 1)  # nvfp4 packs two values a byte
    return int(total), int(params), int(experts)


def experts_block(placement: str) -> dict | None:
    """The hidden-layers.experts block of a --placements entry (None: all in VRAM)."""
    if placement == "vram":
        return None
    if placement.startswith("stream"):
        cache = placement.removeprefix("stream").removeprefix("-cache")
        return {"compute": "cuda:0", "store": "ram", **({"cache": int(cache)} if cache else {})}
    if placement in ("cpu-experts", "cpu-experts-int8", "cpu-experts-bf16"):
        return {"compute": "cpu", "store": "ram"}
    raise SystemExit(f"unknown placement {placement!r}: vram, stream, stream-cacheN, cpu-experts, cpu-experts-int8, "
                     "cpu-experts-bf16")


def cpu_block(placement: str | None) -> dict | None:
    """The config's cpu block of a --placements entry: cpu-experts-int8 = cpu-experts with 8-bit activations
    (cpu.compute-quantization int8: NVFP4 experts' decode rows take x quantized per 16 values), cpu-experts-bf16 =
    with bf16 (NVFP4 and fp8 experts' several-token products in AMX bf16 tiles, where the CPU has them)."""
    quant = {"cpu-experts-int8": "int8", "cpu-experts-bf16": "bf16"}.get(placement or "")
    return {"compute-quantization": quant} if quant else None


def pinned_bandwidth() -> float:
    """Host-to-device bytes per second from page-locked memory (1 GiB copies)."""
    import cupy as cp

    n = 1 << 30
    host = cp.cuda.alloc_pinned_memory(n)
    dev = cp.empty(n, cp.uint8)
    dev.data.copy_from_host_async(host.ptr, n)
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(3):
        dev.data.copy_from_host_async(host.ptr, n)
    cp.cuda.Device().synchronize()
    return 3 * n / (time.perf_counter() - t)


PREFILL_RUNS = 3  # timed prefills per prompt length after the warm-up; the median is reported (every run in --json)


def time_lumen(path: Path, prompts, steps: int, experts: dict | None = None, repeat: int = 1,
               cpu: dict | None = None, cuda_compute: str = "none") -> dict:
    import cupy as cp
    import numpy as np

    import lumen_core as lumen
    from lumen_core.sampling import SamplingParams

    ctx = max(prompts) + steps + 8
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    free0 = cp.cuda.runtime.memGetInfo()[0]
    hidden = {"kv-cache": {"context-size": ctx, "type-k": "bf16", "type-v": "bf16"}}
    if experts:
        hidden["experts"] = experts
    t = time.perf_counter()
    config = {"model": {"path": str(path), "compute": "cuda:0", "store": "vram", "hidden-layers": hidden}}
    if cpu:
        config["cpu"] = cpu
    if cuda_compute != "none":
        config["cuda"] = {"compute-quantization": cuda_compute}
    engine = lumen.load(config, progress=False)
    load_s = time.perf_counter() - t
    vocab = engine.model.vocab_size
    greedy = SamplingParams(temperature=0.0)
    out = {"load_s": load_s, "prefill": {}, "prefill_runs": {}}
    for n in prompts:
        ids = np.random.RandomState(n).randint(0, vocab, n).tolist()
        toks = list(engine.generate_tokens(ids, 2, greedy))  # warm-up: capture on the first call, kernel compiles
        runs = []
        for _ in range(PREFILL_RUNS):  # the median of several: one run's noise moved the per-layer slope by ~50%
            toks = list(engine.generate_tokens(ids, 2, greedy))
            runs.append(n / engine.stats.prefill_seconds)
        out["prefill_runs"][n] = runs
        out["prefill"][n] = statistics.median(runs)
    ids = np.random.RandomState(0).randint(0, vocab, prompts[0]).tolist()
    c0 = _copied_bytes(engine)
    list(engine.generate_tokens(ids, 1, greedy))  # the prefill's copies alone (streamed experts)
    c1 = _copied_bytes(engine)
    toks = list(engine.generate_tokens(ids, steps + 1, greedy))
    out["decode_runs"] = [(engine.stats.generated_tokens - 1) / engine.stats.decode_seconds]
    # host -> device bytes per decoded token when experts stream: this call's copies less a prefill's
    decoded = max(1, engine.stats.generated_tokens - 1)
    out["h2d_bytes_per_token"] = max(0, (_copied_bytes(engine) - c1) - (c1 - c0)) / decoded
    for _ in range(repeat - 1):  # --repeat: the median of several decodes (the CPU-experts runs vary run to run)
        list(engine.generate_tokens(ids, steps + 1, greedy))
        out["decode_runs"].append((engine.stats.generated_tokens - 1) / engine.stats.decode_seconds)
    out["decode"] = statistics.median(out["decode_runs"])
    out["graph"] = bool(engine.decode_runner())
    out["tokens"] = toks
    out["vram_bytes"] = free0 - cp.cuda.runtime.memGetInfo()[0]  # this engine's VRAM, CuPy's cached blocks included
    del engine
    gc.collect()
    return out


def _copied_bytes(engine) -> int:
    """Bytes that crossed PCIe host -> device for the engine's streamed experts so far: copies into each GPU's
    expert cache plus the decode kernels' reads of host memory (0 when nothing streams)."""
    total = 0
    for backend in {id(b): b for b in engine.backends.values()}.values():
        stats = backend.expert_stats() if hasattr(backend, "expert_stats") else None
        if stats:
            total += stats["copied_bytes"] + stats["host_read_bytes"]
    return total


def time_hf(path: Path, prompts, steps: int) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    vocab = model.config.vocab_size

    def run(ids, nsteps):
        x = torch.tensor([ids], device="cuda")
        with torch.inference_mode():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o = model(input_ids=x, use_cache=True, logits_to_keep=1)
            toks = [int(o.logits[0, -1].argmax())]
            t1 = time.perf_counter()
            cache = o.past_key_values
            for _ in range(nsteps):
                o = model(input_ids=torch.tensor([[toks[-1]]], device="cuda"), past_key_values=cache,
                          use_cache=True, logits_to_keep=1)
                cache = o.past_key_values
                toks.append(int(o.logits[0, -1].argmax()))
            torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t1, toks

    out = {"prefill": {}}
    for n in prompts:
        ids = np.random.RandomState(n).randint(0, vocab, n).tolist()
        run(ids, 1)
        out["prefill"][n] = n / run(ids, 0)[0]
    ids = np.random.RandomState(0).randint(0, vocab, prompts[0]).tolist()
    run(ids, 2)
    _, dec, toks = run(ids, steps)
    out["decode"], out["tokens"] = steps / dec, toks
    return out  # the model is freed with this frame; main() empties the CUDA cache


def set_moe_rows(spec: str) -> None:
    """Apply --moe-rows to lumen_cuda.moe's tables (every format)."""
    items = [item.partition("=") for item in filter(None, spec.split(","))]
    for key, _, value in items:
        if key not in ("gate_up", "down", "down_t1") or value not in ("1", "2", "4"):
            raise SystemExit(f"--moe-rows: {key}={value} is not KEY=N with KEY gate_up, down or down_t1 and N 1, 2 "
                             "or 4")
    if not items:
        return
    from lumen_cuda import moe

    for key, _, value in items:
        if key == "down_t1":
            moe.ROWS_DOWN_T1 = int(value)
        else:
            table = moe.ROWS_GATE_UP if key == "gate_up" else moe.ROWS_DOWN
            table.update(dict.fromkeys(table, int(value)))
    print(f"moe rows: gate_up {moe.ROWS_GATE_UP}, down {moe.ROWS_DOWN}, down_t1 {moe.ROWS_DOWN_T1}", file=sys.stderr)


def table_from(paths: str) -> str:
    """``full_depth_report`` for the rows of earlier ``--full-depth --json`` files (a row's read bandwidth: its own,
    else its file's); a later file's row replaces an earlier one of the same name."""
    rows, prompts = {}, []
    for path in paths.split(","):
        try:
            data = json.loads(Path(path).read_text())
            found = data["full_depth"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"--table {path}: not a --full-depth --json file ({e})") from None
        for name, r in found.items():
            r = {**r, "prefill": {int(n): p for n, p in r["prefill"].items()}}
            r.setdefault("read_bandwidth", data.get("bandwidth"))
            rows[name] = r
            prompts += [n for n in r["prefill"] if n not in prompts]
    return full_depth_report(rows, sorted(prompts))


def main(argv=None):
    args = parse_args(argv)
    if args.table:
        print(table_from(args.table))
        return
    set_moe_rows(args.moe_rows)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    prompts = [int(p) for p in args.prompts.split(",")]
    bw = read_bandwidth()
    if args.full_depth:
        full_depth_rows(args, prompts, bw)
        return
    pcie = pinned_bandwidth()
    results, hf_cache, placed = {}, {}, {}
    for name in args.models.split(","):
        shape, fmt = name.rsplit("-", 1)
        layers = args.moe_layers if shape in MOE_SHAPES else args.layers
        t = time.perf_counter()
        src = build(shape, layers, args.vocab, workdir)
        path = src if fmt == "bf16" else quantized(src, fmt)
        print(f"{name}: checkpoint ready in {time.perf_counter() - t:.0f}s", file=sys.stderr)
        per_token, params, expert_bytes = bytes_per_token(path)
        for placement in args.placements.split(",") if shape in MOE_SHAPES else ():
            if placement == "vram":
                continue
            t = time.perf_counter()
            r = time_lumen(path, prompts[:1], args.decode, experts_block(placement), args.repeat, cpu_block(placement))
            placed[f"{name} {placement}"] = {"expert_bytes_per_token": expert_bytes, "lumen": r, "layers": layers}
            print(f"{name} {placement}: {r['decode']:.1f} tok/s decode ({time.perf_counter() - t:.0f}s)",
                  file=sys.stderr)
            gc.collect()
        if "vram" not in args.placements.split(",") and shape in MOE_SHAPES:
            continue
        row = {"layers": layers, "bytes_per_token": per_token, "active_params": params,
               "lumen": time_lumen(path, prompts, args.decode, repeat=args.repeat)}
        print(f"{name}: lumen {row['lumen']['decode']:.1f} tok/s decode", file=sys.stderr)
        if shape in MOE_SHAPES and "vram" in args.placements.split(","):
            placed[f"{name} vram"] = {"expert_bytes_per_token": expert_bytes, "lumen": row["lumen"], "layers": layers}
        if not args.no_hf:
            if src not in hf_cache:
                hf_cache[src] = time_hf(src, prompts, args.decode)
            row["transformers"] = hf_cache[src]
            import torch

            gc.collect()
            torch.cuda.empty_cache()
        results[name] = row
        if args.json:  # after every row: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps({"args": vars(args), "bandwidth": bw, "pcie": pcie,
                                                   "results": results, "placements": placed},
                                                  indent=2, default=str))
        print(f"{name}: {json.dumps({k: v for k, v in row.items()}, default=str)[:600]}", file=sys.stderr)
    print(f"\nread bandwidth measured: {bw / 1e9:.0f} GB/s; bf16 tensor-core peak {BF16_PEAK / 1e12:.0f} TFLOP/s\n")
    head = "| model | layers | GB/token | bound tok/s | Lumen decode | % of bound | transformers decode | ratio |"
    print(head + "".join(f" prefill {n} Lumen | % TC | transformers | ratio |" for n in prompts))
    print("|" + "---|" * (8 + 4 * len(prompts)))
    for name, r in results.items():
        L, H = r["lumen"], r.get("transformers")
        bound = bw / r["bytes_per_token"]
        line = (f"| {name}{'' if L['graph'] else ' (no graph)'} | {r['layers']} | {r['bytes_per_token'] / 1e9:.2f} | "
                f"{bound:.0f} | {L['decode']:.1f} | {L['decode'] / bound:.1%} | "
                f"{H['decode'] if H else float('nan'):.1f} | {L['decode'] / H['decode'] if H else float('nan'):.2f}x |")
        for n in prompts:
            lp = L["prefill"][n]
            tc = lp * 2 * r["active_params"] / BF16_PEAK
            hp = H["prefill"][n] if H else float("nan")
            line += f" {lp:.0f} | {tc:.1%} | {hp:.0f} | {lp / hp:.2f}x |"
        print(line)
    if placed:
        print(f"\nplacements (MoE rows; pinned host-to-device bandwidth measured: {pcie / 1e9:.1f} GB/s; PCIe "
              "bound = that / the routed experts' bytes a token reads, before any caching)\n")
        print(f"| model | placement | decode tok/s | PCIe bound tok/s | % of it | H2D GB/token | achieved GB/s | "
              f"prefill {prompts[0]} tok/s | VRAM GB | graph |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
        order = [f"{m} {pl}" for m in args.models.split(",") for pl in args.placements.split(",")]
        for key in [k for k in order if k in placed]:
            r = placed[key]
            L = r["lumen"]
            name, placement = key.rsplit(" ", 1)
            h2d = L.get("h2d_bytes_per_token", 0)
            bound = pcie / r["expert_bytes_per_token"] if r["expert_bytes_per_token"] else float("nan")
            stream = placement.startswith("stream")
            pcie_cols = (f"{L['decode'] / bound:.1%} | {h2d / 1e9:.3f} | {h2d * L['decode'] / 1e9:.1f}" if stream
                         else "- | - | -")
            print(f"| {name} | {placement} | {L['decode']:.1f} | {bound:.1f} | {pcie_cols} | "
                  f"{L['prefill'][prompts[0]]:.0f} | {L['vram_bytes'] / 1e9:.2f} | {'yes' if L['graph'] else 'no'} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "bandwidth": bw, "pcie": pcie, "results": results,
                                               "placements": placed}, indent=2, default=str))


if __name__ == "__main__":
    main()
