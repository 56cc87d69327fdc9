"""Where a wgpu decode step's time goes: host encoding of the replayed step vs the device's execution.

    python benchmarks/wgpu_step_profile.py --model PATH|9b:LAYERS|35b-a3b:LAYERS [--prompt 64 --steps 20]

(``9b:8``: benchmarks/cuda_models.py's random Qwen 3.5 9B shape with 8 layers, built in /tmp/lumen-bench.)

Loads the checkpoint on wgpu:0, generates to get a trusted capture, then times ``steps`` replays three ways:
encoding only (Context.replay, nothing submitted until the end), encoding + submit + wait per step, and the same
captured step as one command buffer submitted without re-encoding cost counted (the device alone). Prints the
dispatch count of a step and the time per dispatch. Dev tool.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill", type=int, default=0, help="also break a prefill of this many tokens down by op "
                    "(each op waited for: device time per op, launch gaps included)")
    args = ap.parse_args(argv)
    import lumen_core as lumen

    if ":" in args.model and not args.model.startswith("/"):
        import importlib.util
        from pathlib import Path

        spec = importlib.util.spec_from_file_location("cuda_models", Path(__file__).with_name("cuda_models.py"))
        cm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cm)
        shape, layers = args.model.split(":")
        args.model = str(cm.build(shape, int(layers), 248320, Path("/tmp/lumen-bench")))
    engine = lumen.load({"model": {"path": args.model, "compute": "wgpu:0", "store": "vram",
                                   "hidden-layers": {"kv-cache": {"context-size": args.prompt + 4 * args.steps + 16}}}},
                        progress=False)
    engine._eos = set
    ids = np.random.RandomState(0).randint(0, engine.model.vocab_size, args.prompt).tolist()
    list(engine.generate_tokens(ids, 8))
    runner = engine.decode_runner()
    assert runner.trusted, runner.failed
    ctx = engine.backends[("output-layer", None)].ctx
    cap = runner._cap[0]
    n = cap.dispatches
    inputs = runner._inputs(5, runner.cache.pos)
    ctx.finish()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        ctx.replay(cap, inputs, 0)
        ctx._end_pass()
    t_enc = (time.perf_counter() - t0) / args.steps
    ctx.finish()
    t_all = time.perf_counter() - t0
    print(f"{n} dispatches a step; encoding {t_enc * 1e3:.2f} ms ({t_enc / n * 1e6:.1f} us a dispatch); "
          f"{args.steps} encoded steps then run: {t_all / args.steps * 1e3:.2f} ms a step")
    for chunk in (0, 32, 64, 128, 256):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            ctx.replay(cap, inputs, chunk)
            ctx.finish()
        t_step = (time.perf_counter() - t0) / args.steps
        print(f"  encode + submit every {chunk or 'step'} dispatches + wait: {t_step * 1e3:.2f} ms a step")
    kinds: dict[str, int] = {}
    for rec in cap.records:
        if rec[0] == "dispatch":
            kinds[rec[1].name] = kinds.get(rec[1].name, 0) + 1
    print("dispatches by kernel:", ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
    if args.prefill:
        prefill_breakdown(engine, ctx, args.prefill)


def prefill_breakdown(engine, ctx, n: int) -> None:
    """Seconds per op name over one prefill of ``n`` tokens, each op waited for (ctx.finish) so its device time is
    its own; the total beside an unwaited prefill's."""
    from lumen_core.ops import CONTRACT, OPTIONAL

    ids = np.random.RandomState(1).randint(0, engine.model.vocab_size, n).tolist()
    cache = engine.model.new_cache(n + 8)
    engine.model.forward(ids, cache, host=True)  # warm: kernels compiled
    cache = engine.model.new_cache(n + 8)
    t0 = time.perf_counter()
    engine.model.forward(ids, cache, host=True)
    plain = time.perf_counter() - t0
    spent: dict[str, float] = {}
    backend = engine.backends[("output-layer", None)]
    ops = backend.ops
    for name in list(CONTRACT) + list(OPTIONAL):
        fn = getattr(ops, name)

        def timed(*a, _fn=fn, _name=name, **k):
            ctx.finish()
            t = time.perf_counter()
            out = _fn(*a, **k)
            ctx.finish()
            spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - t
            return out

        setattr(ops, name, timed)
    cache = engine.model.new_cache(n + 8)
    t0 = time.perf_counter()
    engine.model.forward(ids, cache, host=True)
    waited = time.perf_counter() - t0
    print(f"prefill {n}: {plain * 1e3:.0f} ms ({n / plain:.0f} tok/s); with every op waited for {waited * 1e3:.0f} ms, "
          "of which: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])
                                   if v > 1e-4))


if __name__ == "__main__":
    main()
