"""GPU benchmark, end to end: Lumen's wgpu backend (Vulkan) beside Lumen's cuda backend, same random checkpoints.

    python benchmarks/wgpu_models.py [--models 9b-bf16,35b-a3b-bf16 --layers 32 --moe-layers 8 --prompt 512
                                      --decode 64 --workdir /tmp/lumen-bench --backends wgpu,cuda --json out.json]

The checkpoints are benchmarks/cuda_models.py's (built by transformers in bf16: the Qwen3.5-9B shape at --layers
layers, the Qwen3.5-35B-A3B shape at --moe-layers layers). Per row and backend, in one process: greedy decode tok/s
at batch 1 after a --prompt-token prompt (wgpu: its captured step replayed, the argmax on the device; cuda: its CUDA
graph), prefill tok/s, and the fraction of the bandwidth bound: bytes a decode step reads (a MoE step: top-k of E
experts) / the read bandwidth measured in the same run (CuPy's sum over 2 GiB: the same bound cuda_models.py uses).
The named baseline is the cuda backend on the same checkpoint. Dev tools: torch, transformers, cupy.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import time
from pathlib import Path

import numpy as np


def _cuda_models():
    spec = importlib.util.spec_from_file_location("cuda_models", Path(__file__).with_name("cuda_models.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_backend(path: Path, compute: str, prompt: int, steps: int) -> dict:
    import lumen_core as lumen
    from lumen_core.sampling import SamplingParams

    ctx = prompt + steps + 8
    t = time.perf_counter()
    engine = lumen.load({"model": {"path": str(path), "compute": compute, "store": "vram",
                                   "hidden-layers": {"kv-cache": {"context-size": ctx}}}}, progress=False)
    out = {"load_s": time.perf_counter() - t}
    greedy = SamplingParams(temperature=0.0)
    ids = np.random.RandomState(0).randint(0, engine.model.vocab_size, prompt).tolist()
    for _ in range(2):  # warm-up: kernel compiles, the first capture
        list(engine.generate_tokens(ids, 4, greedy))
    out["prefill"] = prompt / engine.stats.prefill_seconds
    toks = list(engine.generate_tokens(ids, steps + 1, greedy))
    out["decode"] = (engine.stats.generated_tokens - 1) / engine.stats.decode_seconds
    out["tokens"] = toks
    runner = engine.decode_runner()
    out["replayed"] = getattr(runner, "replayed", None)
    out["replay_failed"] = getattr(runner, "failed", None)
    engine.close()
    del engine
    gc.collect()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="9b-bf16,35b-a3b-bf16")
    p.add_argument("--layers", type=int, default=32, help="layers of the 9B shape")
    p.add_argument("--moe-layers", type=int, default=8, help="layers of the 35B-A3B shape")
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--backends", default="wgpu,cuda")
    p.add_argument("--workdir", default="/tmp/lumen-bench")
    p.add_argument("--json")
    args = p.parse_args(argv)
    cm = _cuda_models()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    bandwidth = cm.read_bandwidth()
    print(f"read bandwidth (CuPy sum over 2 GiB): {bandwidth / 1e9:.0f} GB/s")
    results = []
    for row in args.models.split(","):
        shape, fmt = row.rsplit("-", 1)
        if fmt != "bf16":
            raise SystemExit(f"{row}: this benchmark runs bf16 checkpoints")
        layers = args.moe_layers if shape in cm.MOE_SHAPES else args.layers
        path = cm.build(shape, layers, args.vocab, workdir)
        nbytes, params, _ = cm.bytes_per_token(path)
        bound = bandwidth / nbytes
        res = {"row": row, "layers": layers, "bytes_per_token": nbytes, "bound_tok_s": bound}
        for backend in args.backends.split(","):
            r = time_backend(path, f"{backend}:0", args.prompt, args.decode)
            r["fraction"] = r["decode"] / bound
            res[backend] = r
            print(f"{row} ({layers} layers) {backend:>5}: decode {r['decode']:7.1f} tok/s = "
                  f"{100 * r['fraction']:5.1f}% "
                  f"of the bound ({bound:.0f} tok/s); prefill {args.prompt}: {r['prefill']:8.1f} tok/s; replayed "
                  f"{r['replayed']} {r['replay_failed'] or ''}")
        if "wgpu" in res and "cuda" in res:
            res["wgpu_over_cuda"] = res["wgpu"]["decode"] / res["cuda"]["decode"]
            same = res["wgpu"]["tokens"] == res["cuda"]["tokens"]
            print(f"{row}: wgpu / cuda decode = {res['wgpu_over_cuda']:.2f}; greedy tokens equal: {same}")
        results.append(res)
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth": bandwidth, "rows": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
