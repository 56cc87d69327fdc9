"""Scale-out benchmark: ``lumen serve --replicas N`` (Ray Serve) against one ``lumen serve``, on the CPU.

    python benchmarks/serve_replicas.py [--config examples/gemma3-270m-cpu.json --clients 8 --requests 2
                                         --tokens 32 --turns 3 --json out.json]

Every server is the real CLI in a subprocess (``lumen serve``, then ``lumen serve --replicas N``, a local Ray
cluster each time) over the same model and prefix cache (``--prefix-cache-mb``); the cores are shared out:
one engine gets ``cpu.threads`` = all of them, each of N replicas 1/N. Rows:

- **one engine** (the baseline): no Ray, the plain server;
- **ray, 1 replica** and **ray, 2 replicas** (prefix-affinity routing, the default) and **ray, 2 replicas,
  least-busy** (Ray Serve's power of two choices).

Per server:

- **aggregate tok/s**: ``--clients`` clients at once, each sending ``--requests`` completions one after another
  (distinct prompts, greedy, ``--tokens`` at most): completion tokens (from ``usage``) / wall time;
- **added latency**: the median time of ``GET /v1/models`` (a route a replica's app answers at once), 30 times one
  after another, and its difference to the baseline's: what the proxy, Ray's HTTP proxy and the handle call add;
- **conversations**: ``--clients`` chats at once, ``--turns`` turns each (each turn resends the history): the
  share of turn 2+'s prompt tokens served from a prefix cache (``usage.prompt_tokens_details.cached_tokens``;
  a shared system prompt counts too), the share of turns that resumed from their previous turn's snapshot
  (cached >= the previous prompt), the share served by the previous turn's replica (``x-lumen-replica``) and
  the mean time of those turns; the routing decides whether a turn meets its cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "examples" / "gemma3-270m-cpu.json"))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=2, help="completions per client, one after another")
    p.add_argument("--tokens", type=int, default=32, help="max_tokens of each completion and chat turn")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prefix-cache-mb", type=float, default=1024, help="each engine's prefix cache")
    p.add_argument("--cores", type=int, default=os.cpu_count(), help="CPU threads shared out among the engines")
    p.add_argument("--rows", default="one,ray1,ray2,ray2-least")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.ray_port = free_port()
    return args


ROWS = {  # name: (label, replicas or None, routing)
    "one": ("one engine (baseline)", None, None),
    "ray1": ("ray, 1 replica", 1, "prefix-affinity"),
    "ray2": ("ray, 2 replicas", 2, "prefix-affinity"),
    "ray2-least": ("ray, 2 replicas, least-busy", 2, "least-busy"),
    # more replicas than cores (a joined cluster that claims 8 CPUs): their tok/s says little, where each turn
    # lands says how the routing scales
    "ray4": ("ray, 4 replicas (joined cluster)", 4, "prefix-affinity"),
    "ray4-least": ("ray, 4 replicas, least-busy (joined)", 4, "least-busy"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_for(path: str, replicas: int | None, routing: str | None, args, workdir: Path) -> Path:
    raw = json.loads(Path(path).read_text())
    model = Path(os.path.expanduser(raw["model"]["path"]))
    raw["model"]["path"] = str(model if model.is_absolute() else (Path(path).parent / model).resolve())
    kv = raw["model"].setdefault("hidden-layers", {}).setdefault("kv-cache", {})
    kv["prefix-cache-mb"] = args.prefix_cache_mb
    raw.setdefault("cpu", {})["threads"] = max(1, args.cores // (replicas or 1))
    if replicas:
        raw.setdefault("server-parameters", {})["scale-out"] = {"replicas": replicas, "routing": routing}
        if replicas > args.cores:  # lumen serve --ray-address: join a cluster started here with `ray start`
            raw["server-parameters"]["scale-out"]["ray-address"] = f"127.0.0.1:{args.ray_port}"
    out = workdir / f"config-{replicas or 0}-{routing}.json"
    out.write_text(json.dumps(raw))
    return out


class Server:
    def __init__(self, config: Path, replicas: int | None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.replicas = replicas
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen([str(Path(sys.executable).parent / "lumen"), "serve", "--config", str(config),
                                      "--port", str(self.port), "--model-name", "bench"],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 300) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {Path(self.log.name).read_text()}")
            try:
                health = httpx.get(self.url + "/health", timeout=2)
                if health.status_code == 200 and health.json().get("replicas", 1) == (self.replicas or 1):
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not come up in {timeout} s: {Path(self.log.name).read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # lumen serve --replicas deletes its application on ^C
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.replicas:  # the Ray cluster: the local one the server started, or the one it joined
            subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True)


async def throughput(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(c: int) -> int:
            tokens = 0
            for r in range(args.requests):
                reply = await client.post("/v1/completions", json={
                    "prompt": f"Client {c}, request {r}: write a short story about a lighthouse keeper number {c}.",
                    "max_tokens": args.tokens, "temperature": 0})
                reply.raise_for_status()
                tokens += reply.json()["usage"]["completion_tokens"]
            return tokens

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*[one(c) for c in range(args.clients)]))
        wall = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": wall, "tok_s": tokens / wall}


def latency(url: str, n: int = 30) -> float:
    with httpx.Client(base_url=url, timeout=60) as client:
        client.get("/v1/models").raise_for_status()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            client.get("/v1/models").raise_for_status()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def conversations(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def chat(c: int) -> list[tuple[int, int, float, str]]:
            messages = [{"role": "system", "content": "You are a helpful assistant who answers in a few sentences."},
                        {"role": "user", "content": f"Conversation {c}: tell me about the history of harbour "
                                                    f"number {c} and the ships that used it."}]
            turns = []
            for _ in range(args.turns):
                t0 = time.perf_counter()
                reply = await client.post("/v1/chat/completions", json={
                    "messages": messages, "max_tokens": args.tokens, "temperature": 0})
                reply.raise_for_status()
                body = reply.json()
                usage = body["usage"]
                turns.append((usage["prompt_tokens"], usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                              time.perf_counter() - t0, reply.headers.get("x-lumen-replica", "one")))
                messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"] or "..."},
                             {"role": "user", "content": "Go on, and tell me more."}]
            return turns

        chats = await asyncio.gather(*[chat(c) for c in range(args.clients)])
    later = [t for turns in chats for t in turns[1:]]
    pairs = [(a, b) for turns in chats for a, b in zip(turns, turns[1:], strict=False)]
    return {"cached_share": sum(t[1] for t in later) / max(1, sum(t[0] for t in later)),
            "resumed": sum(b[1] >= a[0] for a, b in pairs) / len(pairs),  # from its previous turn's snapshot
            "same_replica": sum(a[3] == b[3] for a, b in pairs) / len(pairs),
            "later_turn_s": statistics.mean(t[2] for t in later)}


def ray(*argv: str) -> None:
    subprocess.run([str(Path(sys.executable).parent / "ray"), *argv], capture_output=True, check=True)


def measure(name: str, args, workdir: Path) -> dict:
    label, replicas, routing = ROWS[name]
    if replicas and replicas > args.cores:  # token authentication on, for the cluster and the server alike
        os.environ["RAY_AUTH_MODE"] = "token"
        ray("get-auth-token", "--generate")
        ray("start", "--head", "--port", str(args.ray_port), "--num-cpus", str(2 * replicas),
            "--include-dashboard=false")
    else:
        os.environ.pop("RAY_AUTH_MODE", None)
    server = Server(config_for(args.config, replicas, routing, args, workdir), replicas)
    try:
        start = server.wait()
        latency(server.url, 3)  # warm: the first requests compile and fill caches
        asyncio.run(throughput(server.url, argparse.Namespace(**{**vars(args), "requests": 1})))
        row = {"label": label, "start_s": start, **asyncio.run(throughput(server.url, args)),
               "models_s": latency(server.url), **asyncio.run(conversations(server.url, args))}
    finally:
        server.stop()
    print(f"{label:30s} {row['tok_s']:7.1f} tok/s  /v1/models {row['models_s'] * 1e3:6.1f} ms  "
          f"turns 2+: {row['cached_share']:5.1%} cached, {row['resumed']:5.1%} resumed their chat, "
          f"{row['same_replica']:5.1%} on its replica, {row['later_turn_s']:.2f} s  (up in {start:.0f} s)",
          flush=True)
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"{args.clients} clients x {args.requests} completions of <= {args.tokens} tokens; {args.clients} chats x "
          f"{args.turns} turns; {args.cores} cores shared out; config {args.config}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: measure(name, args, Path(tmp)) for name in args.rows.split(",")}
    base = rows.get("one")
    if base:
        print("\n| row | tok/s | x baseline | /v1/models | added by the proxy | turns 2+: tokens cached | resumed "
              "their chat's snapshot | on their chat's replica | mean time of turns 2+ |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for row in rows.values():
            print(f"| {row['label']} | {row['tok_s']:.1f} | {row['tok_s'] / base['tok_s']:.2f}x | "
                  f"{row['models_s'] * 1e3:.1f} ms | {(row['models_s'] - base['models_s']) * 1e3:+.1f} ms | "
                  f"{row['cached_share']:.1%} | {row['resumed']:.1%} | {row['same_replica']:.1%} | "
                  f"{row['later_turn_s']:.2f} s |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
