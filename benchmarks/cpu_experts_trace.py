"""Where a CPU-experts decode step's time goes, per LUMEN_HOSTCALL mode: the 35B-A3B shape at full depth (random
weights written by full_depth.py), routed experts on the CPU (``experts: {compute: cpu, store: ram}``), the rest on
cuda:0, decode in one captured graph.

    python benchmarks/cpu_experts_trace.py [--modes python,node,native] [--format nvfp4] [--layers 40]
                                          [--cpu-quantization int8|bf16] [--decode 32] [--runs 4]

Each mode runs in a fresh process (the servers and thread pools of one never meet the next's). Prints prefill 512
tok/s, each decode run's tok/s and their median; baseline: ``python`` (a Python host node a crossing). For the
modes served by the native expert server (``node``, ``native``) it also prints, from the server's trace
(``lumen_cpu.hostjob.Server.trace``) of the last decode run, per crossing: the time the server took (seen to
answered), the leader thread's own part of it, how long the leader waited for the other threads, and the gap
between one crossing's answer and the next one's arrival within a step (the GPU's part of the layer plus the
crossing's latency). Needs a GPU; the checkpoint goes to --workdir (reused when present).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def quantiles(a) -> str:
    return (f"p10 {np.percentile(a, 10):.0f}  p50 {np.median(a):.0f}  p90 {np.percentile(a, 90):.0f}  "
            f"max {a.max():.0f}  mean {a.mean():.0f}")


def one_mode(args) -> dict:
    """This process: LUMEN_HOSTCALL is already set."""
    import lumen_core as lumen
    from lumen_core.sampling import SamplingParams

    sys.path.insert(0, str(Path(__file__).parent))
    from full_depth import write_checkpoint

    path = write_checkpoint("35b-a3b", args.layers, args.format, Path(args.workdir), progress=False)
    hidden = {"kv-cache": {"context-size": 512 + args.decode + 8, "type-k": "bf16", "type-v": "bf16"},
              "experts": {"compute": "cpu", "store": "ram"}}
    config = {"model": {"path": str(path), "compute": "cuda:0", "store": "vram", "hidden-layers": hidden}}
    if args.cpu_quantization:
        config["cpu"] = {"compute-quantization": args.cpu_quantization}
    engine = lumen.load(config, progress=False)
    greedy = SamplingParams(temperature=0.0)
    ids = np.random.RandomState(512).randint(0, engine.model.vocab_size, 512).tolist()
    for _ in range(2):  # warm-up: kernels compiled, the step captured
        list(engine.generate_tokens(ids, 2, greedy))
    out = {"prefill": 512 / engine.stats.prefill_seconds, "decode_runs": []}
    for _ in range(args.runs):
        list(engine.generate_tokens(ids, args.decode + 1, greedy))
        out["decode_runs"].append((engine.stats.generated_tokens - 1) / engine.stats.decode_seconds)
    out["decode"] = float(np.median(out["decode_runs"]))
    for backend in {id(b): b for b in engine.backends.values()}.values():
        for box in list(backend.__dict__.get("_mailboxes", {}).values()):  # lumen_cuda.hostcall's servers
            trace = box.server.trace(args.decode * args.layers)
            rows = trace["rows"]
            if not len(rows):
                continue
            same_step = np.diff(rows[:, 0]) > 0  # job numbers rise within a step
            out["server"] = {
                "threads": box.server.threads, "served": trace["served"], "cooled": trace["cooled"],
                "serve_us": (rows[:, 4] - rows[:, 1]) / 1e3, "leader_us": (rows[:, 2] - rows[:, 1]) / 1e3,
                "wait_us": (rows[:, 3] - rows[:, 2]) / 1e3,
                "gap_us": ((rows[1:, 1] - rows[:-1, 4]) / 1e3)[same_step]}
    engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="python,node,native", help="LUMEN_HOSTCALL values, comma-separated")
    p.add_argument("--format", default="nvfp4", choices=["fp8", "nvfp4"])
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--cpu-quantization", choices=["int8", "bf16"], help="the config's cpu.compute-quantization")
    p.add_argument("--decode", type=int, default=32, help="tokens a decode run")
    p.add_argument("--runs", type=int, default=4, help="decode runs (the median is reported)")
    p.add_argument("--workdir", default="/tmp/lumen-bench")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:  # one mode, in this process; the result as JSON on the last line
        res = one_mode(args)
        res.get("server", {}).update({k: v.tolist() for k, v in res.get("server", {}).items()
                                      if isinstance(v, np.ndarray)})
        print("RESULT " + json.dumps(res))
        return
    results = {}
    for mode in args.modes.split(","):
        t = time.perf_counter()
        argv = ["--format", args.format, "--layers", str(args.layers), "--decode", str(args.decode), "--runs",
                str(args.runs), "--workdir", args.workdir, "--child", mode]
        if args.cpu_quantization:
            argv += ["--cpu-quantization", args.cpu_quantization]
        proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True,
                              env={**os.environ, "LUMEN_HOSTCALL": mode})
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            print(f"{mode}: failed (rc {proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        results[mode] = json.loads(line[len("RESULT "):])
        print(f"{mode}: done in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    base = results.get("python", {}).get("decode")
    quant = f", cpu.compute-quantization {args.cpu_quantization}" if args.cpu_quantization else ""
    print(f"\n35B-A3B shape, {args.layers} layers, {args.format} experts on the CPU{quant}; baseline: python\n")
    print("| LUMEN_HOSTCALL | prefill 512 tok/s | decode runs tok/s | median | vs python |")
    print("|---|---:|---|---:|---:|")
    for mode, r in results.items():
        runs = ", ".join(f"{v:.1f}" for v in r["decode_runs"])
        ratio = f"{r['decode'] / base:.2f}x" if base else "-"
        print(f"| {mode} | {r['prefill']:.1f} | {runs} | {r['decode']:.1f} | {ratio} |")
    for mode, r in results.items():
        s = r.get("server")
        if not s:
            continue
        print(f"\n{mode}: expert server of {s['threads']} threads, {s['served']} jobs served, cooled with jobs armed "
              f"{s['cooled']} time(s); last run's crossings (µs):")
        for key, what in (("serve_us", "served (seen -> answered)"), ("leader_us", "leader's own part"),
                          ("wait_us", "leader waiting for the others"), ("gap_us", "gap to the next crossing")):
            print(f"  {what:32s} {quantiles(np.asarray(s[key]))}")


if __name__ == "__main__":
    main()
