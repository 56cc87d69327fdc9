"""Where a cuda step's time goes, op by op: CUDA events around every op call (no synchronisation in between), for
one prefill and one op-by-op decode step, then the captured decode graph replayed alone (GPU time per step) against
the engine's decode loop (wall time per token: graph + sampling + the host round trip).

    python benchmarks/cuda_profile.py CHECKPOINT_DIR [--prompt 512 --steps 64]

Prints, per phase, the ops sorted by total time with their call counts, and the time no op accounts for (the
architecture's own tensor arithmetic between ops: residual adds, reshapes that copy). With ``--trace`` (needs torch,
whose profiler reads CUPTI for every kernel in the process, CuPy's and graph nodes included) it also prints, per
kernel name, the GPU time per decode step inside the replayed graph and per prefill, and the idle time between
kernels (launch gaps). Dev tool: needs cupy.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict


def instrument(backend, records: list):
    """Replace every op the model will call on ``backend`` by one that records (name, start, end) events."""
    import cupy as cp

    from lumen_core.ops import CONTRACT, OPTIONAL

    for name in (*CONTRACT, *OPTIONAL):
        bound = getattr(backend.ops, name)

        def timed(*args, _bound=bound, _name=name, **kwargs):
            label = _name
            T = args[0].shape[0] if args and getattr(args[0], "ndim", 0) > 1 else 1
            if _name == "linear":
                w = args[1]
                label = f"linear {w.format} {w.shape[0]}x{w.shape[1]} T={T}"
            elif _name == "linear_group":
                ws = args[1]
                label = f"linear_group {ws[0].format} {'+'.join(str(w.shape[0]) for w in ws)}x{ws[0].shape[1]} T={T}"
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            out = _bound(*args, **kwargs)
            e1.record()
            records.append((label, e0, e1))
            return out

        setattr(backend.ops, name, timed)


def report(title: str, records: list, e_start, e_end) -> None:
    import cupy as cp

    e_end.synchronize()
    total = cp.cuda.get_elapsed_time(e_start, e_end)
    by = defaultdict(lambda: [0, 0.0])
    for label, e0, e1 in records:
        by[label][0] += 1
        by[label][1] += cp.cuda.get_elapsed_time(e0, e1)
    ops = sum(t for _, t in by.values())
    print(f"\n## {title}: {total:.3f} ms on the GPU clock; ops {ops:.3f} ms; between ops {total - ops:.3f} ms\n")
    print("| op | calls | ms | % |\n|---|---:|---:|---:|")
    for label, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"| {label} | {n} | {t:.3f} | {t / total:.1%} |")


def kernel_trace(title: str, run, per: int) -> None:
    """Kernel-level timeline of ``run()`` through torch's profiler: per kernel name the calls and GPU time per
    ``per`` repetitions, and the GPU's idle time between the first kernel's start and the last one's end."""
    import cupy as cp
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    cp.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        cp.cuda.Device().synchronize()
    spans = []
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start:
            if "memcpy" in e.name.lower() or "memset" in e.name.lower() or e.name.startswith("cuda"):
                continue
            spans.append((e.time_range.start, e.time_range.end, e.name))
    if not spans:
        print(f"\n## {title}: the profiler saw no kernels (CUPTI unavailable?)")
        return
    spans.sort()
    busy, cur0, cur1 = 0.0, spans[0][0], spans[0][1]
    for a, b, _ in spans[1:]:
        if a > cur1:
            busy += cur1 - cur0
            cur0, cur1 = a, b
        else:
            cur1 = max(cur1, b)
    busy += cur1 - cur0
    span = spans[-1][1] - spans[0][0]
    by = defaultdict(lambda: [0, 0.0])
    for a, b, name in spans:
        by[name[:70]][0] += 1
        by[name[:70]][1] += b - a
    print(f"\n## {title} (kernel trace): per repetition {span / per:.1f} us span, {busy / per:.1f} us with a "
          f"kernel running, {(span - busy) / per:.1f} us idle; {len(spans) / per:.1f} kernels\n")
    print("| kernel | calls | us | % of span |\n|---|---:|---:|---:|")
    for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:40]:
        print(f"| {name} | {n / per:g} | {t / per:.1f} | {t / span:.1%} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--trace", action="store_true", help="kernel-level trace through torch's profiler")
    p.add_argument("--cuda-compute", default="none", choices=("none", "bf16"),
                   help="the config's cuda.compute-quantization (bf16: prefill products on bf16 activations)")
    args = p.parse_args(argv)
    import cupy as cp
    import numpy as np

    import lumen_core as lumen
    from lumen_core.sampling import SamplingParams

    ctx = args.prompt + args.steps + 16
    config = {"model": {"path": args.checkpoint, "compute": "cuda:0", "store": "vram",
                        "hidden-layers": {"kv-cache": {"context-size": ctx, "type-k": "bf16", "type-v": "bf16"}}}}
    if args.cuda_compute != "none":
        config["cuda"] = {"compute-quantization": args.cuda_compute}
    engine = lumen.load(config, progress=False)
    ids = np.random.RandomState(0).randint(0, engine.model.vocab_size, args.prompt).tolist()
    greedy = SamplingParams(temperature=0.0)
    list(engine.generate_tokens(ids, 4, greedy))  # capture, compile, warm the pools
    list(engine.generate_tokens(ids, args.steps + 1, greedy))
    wall = engine.stats.decode_seconds / (engine.stats.generated_tokens - 1)
    prefill_wall = engine.stats.prefill_seconds
    runner = engine.decode_runner()

    # the graph alone
    if runner:
        stream = runner.stream
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        with stream:
            e0.record(stream)
            for _ in range(args.steps):
                runner.graph.launch(stream)
            e1.record(stream)
        e1.synchronize()
        graph_ms = cp.cuda.get_elapsed_time(e0, e1) / args.steps
        print(f"decode: engine {wall * 1e3:.3f} ms/token wall; graph replay alone {graph_ms:.3f} ms/step on the "
              f"GPU; prefill {args.prompt} tokens {prefill_wall * 1e3:.1f} ms wall")
    else:
        print(f"decode: engine {wall * 1e3:.3f} ms/token wall (no graph); prefill {prefill_wall * 1e3:.1f} ms wall")
    if args.trace:
        if runner:
            def replay(n=16):
                with runner.stream:
                    for _ in range(n):
                        runner.graph.launch(runner.stream)

            kernel_trace("decode graph replay", replay, 16)
        tcache = engine.model.new_cache(ctx)
        kernel_trace(f"prefill {args.prompt}", lambda: engine.model.forward(ids, tcache, host=False), 1)

    backend = next(iter({id(b): b for b in engine.backends.values()}.values()))
    records: list = []
    instrument(backend, records)
    model = engine.model
    cache = model.new_cache(ctx)
    for title, run in (("prefill", lambda: model.forward(ids, cache, host=False)),
                       ("decode step (op by op)", lambda: model.forward([ids[0]], cache, host=False))):
        records.clear()
        cp.cuda.Device().synchronize()
        s0, s1 = cp.cuda.Event(), cp.cuda.Event()
        t = time.perf_counter()
        s0.record()
        run()
        s1.record()
        s1.synchronize()
        print(f"\n{title}: {(time.perf_counter() - t) * 1e3:.1f} ms wall with per-op events")
        report(title, records, s0, s1)


if __name__ == "__main__":
    main()
