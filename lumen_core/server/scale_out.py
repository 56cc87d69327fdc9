"""``lumen serve --replicas N``: N Lumen engines behind one endpoint, on Ray Serve (issue 23; docs/scale-out.md).

Two deployments in one Ray Serve application:

* ``Replica`` (N of them): one engine each, loaded from the config with its own placement, and the very app of
  ``lumen serve`` (``create_app``: routes, API keys, limits, errors, queue) that it runs in process over ASGI.
  Ray gives each replica the GPUs and CPUs its placement names (``replica_resources``); the config's ``cuda:N``
  indices are renumbered within the GPUs Ray hands it (``renumbered``), so ``cuda:0`` in every replica is its own
  GPU.
* ``Proxy`` (the HTTP ingress): reads a request's body, takes a routing key from the conversation's start
  (``routing_key``: the system prompt and first message of a chat, the head of a completion's prompt) and passes
  the request (method, path, headers, body) to a replica through a handle whose router (``PrefixAffinityRouter``)
  sends equal keys to the same replica, whose prefix cache then holds the conversation's earlier turns. The
  replica's reply comes back as a stream (status and headers, then the body as the app writes it), so streaming,
  a client's disconnect (Serve cancels the call, the replica's app sees ``http.disconnect`` and stops the
  generation) and every status and error shape are the replica app's own.

Not its own router: Ray Serve places replicas (locally or over a cluster, KubeRay on Kubernetes), restarts one that
dies, queues requests in front of busy replicas and refuses past ``max_queued_requests``. This module only says
where a request goes and how a reply comes back.

Ray is imported only here (the ``ray[serve]`` extra: ``pip install -e ".[scale-out]"``).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import re
from collections.abc import AsyncIterator

from ..errors import ConfigError, LumenError
from .service import ON_START

APP_NAME = "lumen"
REPLICA_HEADER = "x-lumen-replica"  # each reply names the replica that answered (tests, logs, load balancers)
KEY_CHARS = 256  # a completion prompt's head that keys its routing
SPILL_QUEUE = 4  # the preferred replica is passed over when it holds this many more requests than the least busy
STARTED = {"started": True}  # call_asgi's item: the request's generation is running
_CUDA = re.compile(r"^cuda:([0-9]+)$")


class ScaleOutError(LumenError):
    """Ray is missing, or the cluster cannot hold the replicas."""


# -- what a replica asks Ray for --------------------------------------------------------------------------------
def _compute_blocks(node):
    """Every dict of the config (any block, any depth) that writes a ``compute`` string."""
    if isinstance(node, dict):
        if isinstance(node.get("compute"), str):
            yield node
        for value in node.values():
            yield from _compute_blocks(value)
    elif isinstance(node, list):
        for value in node:
            yield from _compute_blocks(value)


def compute_devices(raw: dict) -> set[str]:
    """Every ``compute`` value the config writes, and ``cpu`` (the default)."""
    return {"cpu"} | {block["compute"] for block in _compute_blocks(raw)}


def replica_resources(raw: dict) -> dict:
    """``ray_actor_options`` of one replica: a GPU per distinct ``cuda:N`` of the placement, and the CPU threads
    (``cpu.threads``; else one CPU: Ray's default for a task). wgpu devices ask for nothing (Ray has no Vulkan
    resource): a wgpu replica shares the machine's GPUs as it is."""
    gpus = {d for d in compute_devices(raw) if _CUDA.match(d)}
    threads = (raw.get("cpu") or {}).get("threads")
    return {"num_gpus": len(gpus), "num_cpus": float(threads) if threads else 1.0}


def renumbered(raw: dict) -> dict:
    """The config with its ``cuda:N`` renumbered 0, 1, ... in order of N: Ray makes a replica's GPUs visible as
    devices 0..k-1 (CUDA_VISIBLE_DEVICES), whichever they are on the machine."""
    order = sorted({int(_CUDA.match(d).group(1)) for d in compute_devices(raw) if _CUDA.match(d)})
    index = {f"cuda:{n}": f"cuda:{i}" for i, n in enumerate(order)}
    out = copy.deepcopy(raw)
    for block in _compute_blocks(out):
        block["compute"] = index.get(block["compute"], block["compute"])
    return out


# -- routing ----------------------------------------------------------------------------------------------------
def routing_key(path: str, body: bytes) -> str | None:
    """What every turn of one conversation starts with, hashed: a chat's system messages and its first other
    message (OpenAI ``messages``; Anthropic ``system`` + ``messages[0]``), a completion's first ``KEY_CHARS``
    characters (or 64 token ids). None (no affinity: the least busy replica) for other routes and bodies that are
    not such JSON: the replica's app answers those as it would alone."""
    if path not in ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/completions"):
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if path == "/v1/completions":
        prompt = data.get("prompt")
        head = prompt[:KEY_CHARS] if isinstance(prompt, str) else prompt[:64] if isinstance(prompt, list) else None
    else:
        messages = data.get("messages")
        if not isinstance(messages, list):
            return None
        lead = 0
        while lead < len(messages) and isinstance(messages[lead], dict) and \
                messages[lead].get("role") in ("system", "developer"):
            lead += 1
        head = [data.get("system"), messages[:lead + 1]]
    if head is None:
        return None
    text = json.dumps(head, sort_keys=True, ensure_ascii=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def rendezvous(key: str, ids: list[str]) -> list[str]:
    """``ids`` ordered by preference for ``key`` (highest random weight first): the same key keeps its replica
    while the set of replicas stays, and a replica that leaves moves only its own keys."""
    return sorted(ids, key=lambda i: hashlib.blake2b(f"{key}\0{i}".encode(), digest_size=8).digest(), reverse=True)


def metrics_by_replica(texts: dict[str, str]) -> str:
    """Prometheus text of several replicas as one: each metric family once (its HELP and TYPE, then every
    replica's samples, which gain a ``replica`` label), as the exposition format wants a family's lines together."""
    families: dict[str, tuple[list, list]] = {}  # name -> (HELP/TYPE lines, samples), in first-seen order
    for replica, text in sorted(texts.items()):
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                head = families.setdefault(family, ([], []))[0]
                if line not in head:
                    head.append(line)
            elif line.strip() and not line.startswith("#"):
                name, _, rest = line.partition(" ")
                base, brace, labels = name.partition("{")
                labelled = f'{base}{{replica="{replica}"{"," + labels if brace else "}"}'
                families.setdefault(family or base, ([], []))[1].append(f"{labelled} {rest}")
    out = ["# HELP lumen_replicas Engines serving this endpoint (Ray Serve replicas that answered).",
           "# TYPE lumen_replicas gauge", f"lumen_replicas {len(texts)}"]
    for head, samples in families.values():
        out += head + samples
    return "\n".join(out) + "\n"


# -- the ASGI call inside a replica ----------------------------------------------------------------------------
async def call_asgi(app, method: str, path: str, query: bytes, headers: list, body: bytes,
                    extra: list | None = None) -> AsyncIterator:
    """Run one HTTP request through the ASGI ``app`` in this process: yields ``{"status", "headers"}`` (once), the
    body's chunks (bytes) as the app sends them, and ``STARTED`` when an engine worker takes the request's
    generation (service.ON_START; before the head or after it, as the reply's kind has it). Closing the iteration
    early (the client left: Serve cancels the call) tells the app ``http.disconnect``, as a server would, and waits
    for it to finish."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await out.put(message)

    async def run():
        ON_START.set(lambda: out.put_nowait(STARTED))  # this task's context: the app's handlers see it
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)

    task = asyncio.ensure_future(run())
    try:
        while True:
            message = await out.get()
            if message is None:
                break
            if message is STARTED:
                yield STARTED
            elif message["type"] == "http.response.start":
                head = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield {"status": message["status"], "headers": head + list(extra or [])}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=30)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()


def replica_options(cfg, keys, model_name, limits, api, chat_template, keys_env: str | None = None) -> dict:
    """What every replica needs beyond the config to build ``lumen serve``'s app: plain data (Ray pickles it).
    ``keys_env`` names an environment variable that holds more API keys (comma-separated), read by each replica
    where it runs (a Kubernetes Secret), so they never pass through Ray's state."""
    import dataclasses

    return {"api_keys": list(keys), "api_keys_env": keys_env, "model_name": model_name,
            "limits": dataclasses.asdict(limits), "server_api": api.only, "chat_template": chat_template,
            "name": model_name or default_model_name(cfg)}


def keys_from_env(name: str | None) -> list[str]:
    """The API keys in environment variable ``name`` (comma-separated); none when ``name`` is None."""
    import os

    from .settings import api_key_problem

    if name is None:
        return []
    value = os.environ.get(name)
    if value is None:
        raise ScaleOutError(f"api-keys-env: the environment variable {name} is not set where this replica runs; set "
                            "it on every node (a Kubernetes Secret as env), or leave api-keys-env out")
    keys = [k.strip() for k in value.split(",")]
    for key in keys:
        problem = api_key_problem(key)
        if problem:
            raise ScaleOutError(f"api-keys-env: a key in {name}: {problem}; give comma-separated keys")
    return keys


def default_model_name(cfg) -> str:
    return str(cfg.model_path).rstrip("/").split("/")[-1]


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ScaleOutError("lumen serve --replicas needs Ray Serve: pip install 'ray[serve]' (or pip install -e "
                            "'.[scale-out]' in a Lumen checkout)") from exc
    return ray, serve


def check_replicas(replicas, where: str = "--replicas") -> int:
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ConfigError(where, f"must be an integer >= 1, got {replicas!r}", "give the number of engines to run")
    return replicas


ROUTINGS = ("prefix-affinity", "least-busy")


def serve_replicas(cfg, replicas: int, address: str | None, host: str, port: int, options: dict,
                   block: bool = True, echo=print, routing: str = "prefix-affinity") -> None:
    """Start (``address`` None) or join a Ray cluster, deploy ``replicas`` engines behind one HTTP endpoint on
    ``host:port`` and, with ``block``, serve until interrupted (then the application is deleted). Refused before
    anything is deployed: Ray missing, or a cluster without the GPUs / CPUs the replicas ask for."""
    ray, serve = _ray()
    check_replicas(replicas)
    resources = replica_resources(cfg.raw)
    if not ray.is_initialized():
        _connect(ray, address)
    total = ray.cluster_resources()
    for name, key in (("num_gpus", "GPU"), ("num_cpus", "CPU")):
        need, have = resources[name] * replicas, total.get(key, 0)
        if need > have:
            raise ScaleOutError(f"{replicas} replicas need {need:g} {key}s ({resources[name]:g} each, from the "
                                f"config's placement{' and cpu.threads' if key == 'CPU' else ''}) but the Ray cluster "
                                f"has {have:g}: lower --replicas, or add machines to the cluster (docs/scale-out.md)")
    from .ray_app import application

    serve.start(http_options={"host": host, "port": port})
    model_name = options.get("name") or default_model_name(cfg)
    serve.run(application(cfg, options, replicas, routing),
              name=APP_NAME, route_prefix="/", blocking=False)
    echo(f"lumen serve: {model_name} on http://{host}:{port} through Ray Serve: {replicas} replica(s), each "
         f"{resources['num_gpus']:g} GPU(s) and {resources['num_cpus']:g} CPU(s), {routing} routing"
         f"{f', cluster {address}' if address else ', a local Ray cluster'}")
    if not block:
        return
    import signal
    import time

    def stop(signum, frame):  # SIGTERM (docker stop, systemd) as ^C: a joined cluster keeps no orphan application
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()


def reachable(address: str | None, timeout: float = 5.0) -> None:
    """A ScaleOutError at once when nothing listens at ``address`` (``HOST:PORT`` or ``ray://HOST:PORT``; ``auto``
    and None are Ray's to find): ``ray.init`` would retry for minutes before saying so."""
    import socket

    if not address or address == "auto" or address == "local":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ScaleOutError(f"--ray-address {address!r}: give HOST:PORT (the head's GCS, 6379 by default) or "
                            "ray://HOST:10001 (Ray Client)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ScaleOutError(f"could not connect to the Ray cluster at {address} ({exc}): check that `ray start "
                            "--head` runs there and that this is its GCS address (HOST:6379) or its client address "
                            "(ray://HOST:10001)") from exc


def _connect(ray, address: str | None) -> None:
    """``ray.init``: a local cluster (``address`` None) or the one at ``address``; a failure is a ScaleOutError that
    says what to check, not Ray's traceback."""
    reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    except Exception as exc:  # noqa: BLE001  ConnectionError, RuntimeError, AuthenticationError, ...
        text = f"{exc} {exc.__cause__ or ''}"
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        if "AuthToken" in text or "Authentication" in text or "authentication" in text:
            fix = ("the cluster uses token authentication: run lumen serve with RAY_AUTH_MODE=token and the cluster's "
                   "token in ~/.ray/auth_token or RAY_AUTH_TOKEN (docs/scale-out.md)")
        elif address:
            fix = (f"check that `ray start --head` runs there and that {address} is its GCS address (HOST:6379) or "
                   "its client address (ray://HOST:10001)")
        else:
            fix = "see Ray's message above; `ray stop --force` clears what a crashed local cluster left"
        raise ScaleOutError(f"could not connect to {where} ({type(exc).__name__}: {str(exc)[:300]}): {fix}") from exc


def shutdown() -> None:
    """Delete the application and its board (a detached actor)."""
    ray, serve = _ray()
    serve.delete(APP_NAME)
    try:
        ray.kill(ray.get_actor(f"lumen-board-{APP_NAME}", namespace="lumen"))
    except ValueError:  # never made
        pass
