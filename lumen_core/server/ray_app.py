"""The Ray Serve application of ``lumen serve --replicas N`` (see ``scale_out``, which holds the parts that need no
Ray): ``Replica`` (an engine and ``lumen serve``'s app), ``Proxy`` (the HTTP ingress) and ``PrefixAffinityRouter``
(the replica deployment's request router). Importing this module imports Ray."""

import asyncio
import json
import random
import time

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from . import scale_out
from .app import shaped_error
from .scale_out import REPLICA_HEADER, SPILL_QUEUE, call_asgi, metrics_by_replica, rendezvous, routing_key


class PrefixAffinityRouter(RequestRouter):
    """Equal routing keys go to one replica (rendezvous hashing over the replicas there are), unless it holds
    ``SPILL_QUEUE`` more requests than the least busy one, or is full; requests without a key go to the less busy of
    two random replicas (power of two choices)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        key = kwargs.get("lumen_key")
        if key is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        order = [by_id[i] for i in rendezvous(key, list(by_id))]
        queued = [self.replica_queue_len_cache.get(r.replica_id) for r in order]
        known = [q for q in queued if q is not None]
        if queued[0] is not None and known and queued[0] - min(known) >= SPILL_QUEUE:
            return [order[1:], order[:1]]  # the preferred one is far busier: the others first
        return [order[:1], order[1:]]  # a full preferred replica declines: the next rank takes it


@ray.remote(num_cpus=0)
class Board:
    """What each replica last reported (its Prometheus text and queue depth), stamped on arrival: the proxy's
    /health and /metrics read it. A replica reports every ``REPORT_S`` seconds; one silent for ``STALE_S`` (dead,
    restarting) is left out."""

    def __init__(self):
        self.entries: dict = {}

    def put(self, replica: str, text: str, depth: int) -> None:
        self.entries[replica] = (time.monotonic(), text, depth)

    def get(self) -> dict:
        now = time.monotonic()
        return {r: (text, depth) for r, (t, text, depth) in self.entries.items() if now - t < STALE_S}


REPORT_S, STALE_S = 0.5, 3.0


def board(app_name: str):
    return Board.options(name=f"lumen-board-{app_name}", namespace="lumen", get_if_exists=True,
                         lifetime="detached").remote()


class Replica:
    """One engine and the app of ``lumen serve`` over it (``create_app``), called in process."""

    async def __init__(self, raw: dict, base_dir: str, options: dict):
        from ..config import load_config
        from ..engine import load
        from .app import create_app
        from .settings import Limits, ServerAPI

        cfg = load_config(scale_out.renumbered(raw), base_dir)
        self.engine = load(cfg, progress=False, chat_template=options.get("chat_template"))
        keys = list(options.get("api_keys") or []) + scale_out.keys_from_env(options.get("api_keys_env"))
        self.app = create_app(self.engine, keys, options.get("model_name"),
                              Limits(**options.get("limits", {})), ServerAPI(options.get("server_api")))
        context = serve.get_replica_context()
        self.id = context.replica_id.unique_id
        self.board = board(context.app_name)
        self.reporter = asyncio.get_running_loop().create_task(self._report())

    async def _report(self):
        service = self.app.state.service
        while True:
            try:
                await self.board.put.remote(self.id, service.metrics.prometheus(service.queue_depth),
                                            service.queue_depth)
            except Exception:  # noqa: BLE001  the board restarting: the next report makes up for it
                pass
            await asyncio.sleep(REPORT_S)

    async def http(self, method: str, path: str, query: bytes, headers: list, body: bytes, lumen_key=None):
        async for item in call_asgi(self.app, method, path, query, headers, body, [(REPLICA_HEADER, self.id)]):
            yield item

    def check_health(self):  # Ray Serve's periodic probe: a replica whose engine is gone is restarted
        if getattr(self.engine, "model", None) is None:
            raise RuntimeError("the engine of this replica is closed")


proxy_app = FastAPI(title="Lumen (Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None)
STRIP = {"content-length", "transfer-encoding", "connection"}  # this server frames the body itself
ATTEMPTS = 3  # replicas a request may be sent to when the ones before died before running it
ATTEMPTS_HEADER = "x-lumen-attempts"  # each reply says how many replicas it took (1 unless one died)


# Ray Serve serializes the ingress class with the module globals it sees when the class is decorated: what its
# methods call is defined above it.
def _shape(request: Request) -> str:
    anthropic = request.url.path.startswith("/v1/messages") or request.headers.get("anthropic-version")
    return "anthropic" if anthropic else "openai"


def _cancel(gen) -> None:
    """Cancel a replica call; a call that never got a replica raises its refusal here too: it is answered already."""
    if gen is not None:
        try:
            gen.cancel()
        except Exception:  # noqa: BLE001
            pass


def _failure(shape: str, exc: BaseException) -> Response:
    name = type(exc).__name__
    if name == "BackPressureError":
        return shaped_error(shape, 429, "the server is busy: every replica's queue is full; retry in 1 s",
                            "rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"})
    return shaped_error(shape, 503, f"the replica serving this request failed before answering ({name}: {exc}); "
                        "retry: Ray Serve restarts it and routes new requests to the others", "api_error",
                        code="replica_failed")


def _stream_error(shape: str, exc: BaseException) -> bytes:
    message = f"the replica serving this request failed mid-reply ({type(exc).__name__}); retry the request"
    if shape == "anthropic":
        data = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    data = {"error": {"message": message, "type": "api_error", "param": None, "code": "replica_failed"}}
    return f"data: {json.dumps(data)}\n\n".encode()


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(proxy_app)
class Proxy:
    """The HTTP ingress: every route goes to a replica (by ``routing_key``); /health and /metrics read what the
    replicas report (``Board``)."""

    def __init__(self, replicas, model_name: str):
        self.stream = replicas.options(stream=True)
        self.model_name = model_name
        self.board = board(serve.get_replica_context().app_name)

    @proxy_app.get("/health")
    async def health(self):
        reports = await self.board.get.remote()
        body = {"status": "ok" if reports else "unavailable", "model": self.model_name,
                "queue_depth": sum(depth for _, depth in reports.values()), "replicas": len(reports),
                "replica_ids": sorted(reports)}
        return JSONResponse(body, status_code=200 if reports else 503)

    @proxy_app.head("/health", include_in_schema=False)
    async def health_head(self):
        return await self.health()

    @proxy_app.get("/metrics")
    async def metrics(self):
        reports = await self.board.get.remote()
        return PlainTextResponse(metrics_by_replica({r: text for r, (text, _) in reports.items()}),
                                 media_type="text/plain; version=0.0.4")

    @proxy_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def forward(self, request: Request, path: str):
        """The request to a replica; its reply back as the replica's app wrote it. The client's answer starts once
        the reply has begun (the generation started, or a body came): a replica that dies before its generation
        started (the request waited in its queue) has the request sent again, to a live replica (``ATTEMPTS`` in
        all); one that dies after it fails the request cleanly (a 503, or an error event in a stream)."""
        body = await request.body()
        url, shape = request.url.path, _shape(request)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in STRIP]
        key = routing_key(url, body)
        for attempt in range(1, ATTEMPTS + 1):
            gen, head, started, early, ended = None, None, False, [], False
            try:
                gen = self.stream.http.remote(request.method, url, request.scope.get("query_string", b""),
                                              headers, body, lumen_key=key)  # refused here when the queue is full
                while head is None or not (started or early):
                    try:
                        item = await gen.__anext__()
                    except StopAsyncIteration:
                        ended = True
                        break
                    if isinstance(item, bytes):
                        early.append(item)
                    elif "started" in item:
                        started = True
                    else:
                        head = item
            except Exception as exc:  # noqa: BLE001  the replica failed before the answer began: never a hang
                _cancel(gen)
                if isinstance(exc, ray.exceptions.RayActorError) and not started and attempt < ATTEMPTS:
                    continue  # it died before running the request: a live replica takes it
                return _failure(shape, exc)
            break
        if head is None:  # the app ended without an answer (cannot happen with a Starlette app): say so
            _cancel(gen)
            return _failure(shape, RuntimeError("the replica's app sent no response"))
        reply = [(k, v) for k, v in head["headers"] if k.lower() not in STRIP] + [(ATTEMPTS_HEADER, str(attempt))]
        streamed = any(k.lower() == "content-type" and "event-stream" in v for k, v in reply)

        async def rest():
            try:
                for chunk in early:
                    yield chunk
                if ended:
                    return
                async for item in gen:
                    if isinstance(item, bytes):
                        yield item
            except Exception as exc:  # noqa: BLE001  the replica died mid-reply: say so in the reply's own terms
                if streamed:
                    yield _stream_error(shape, exc)
            finally:
                _cancel(gen)

        response = StreamingResponse(rest(), status_code=head["status"])
        response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply]
        return response


def application(cfg, options: dict, replicas: int, routing: str = "prefix-affinity"):
    """The bound application: ``replicas`` Replica deployments behind one Proxy. A replica holds what its engine
    would hold alone: ``sequences`` running generations and ``max_queue`` waiting in its app's own queue (past it
    the app's own 429; both from ``cfg`` and ``options``, scale_out.replica_options), plus two calls for the light
    routes (models, token counts). Requests wait inside the replicas, not in front of them: Ray Serve's router
    probes full replicas in a loop (on 2 cores it took ~40% of one); a replica that dies loses nothing that waited
    in it (the proxy sends it again). Requests being routed count as queued in front of the replicas: ``max_queue``
    of them (a burst), past which a 429 from the proxy."""
    from .settings import Limits

    raw, sequences = cfg.raw, max(1, cfg.kv_cache().sequences)
    max_queue = Limits(**options.get("limits", {})).max_queue
    resources = scale_out.replica_resources(raw)
    replica = serve.deployment(Replica, name="Replica").options(
        num_replicas=replicas, ray_actor_options=resources, max_ongoing_requests=sequences + max_queue + 2,
        max_queued_requests=max(1, max_queue, replicas), health_check_period_s=5, health_check_timeout_s=30,
        **({"request_router_config": {"request_router_class": PrefixAffinityRouter}}
           if routing == "prefix-affinity" else {}))  # least-busy: Serve's own power of two choices
    return Proxy.bind(replica.bind(raw, str(cfg.base_dir), options),
                      options.get("name") or scale_out.default_model_name(cfg))


BUILD_ARGS = {"config": "the config file (JSON) every replica loads, a path on every node",
              "replicas": "engines to run (default: server-parameters.scale-out.replicas, else 1)",
              "model-name": "the model id the API reports (default: the checkpoint's name)",
              "api-keys-env": "an environment variable holding API keys, comma-separated (a Kubernetes Secret), "
                              "added to server-parameters.api-keys"}


def build(args: dict):
    """The application for Ray Serve's own deployment tools (``serve run lumen_core.server.ray_app:build
    config=...``, ``serve deploy``, KubeRay's ``RayService``: ``import_path: lumen_core.server.ray_app:build``):
    ``lumen serve --replicas N`` without the CLI. ``args`` (``BUILD_ARGS``) name the config; its
    ``server-parameters`` give the limits, keys and API as they do to ``lumen serve`` (host and port are Serve's
    ``http_options``)."""
    from ..config import config_from_path_or_model
    from .settings import Limits, ServerAPI

    args = dict(args or {})
    unknown = sorted(set(args) - set(BUILD_ARGS))
    if unknown:
        raise scale_out.ScaleOutError(f"lumen_core.server.ray_app:build: unknown argument(s) {', '.join(unknown)}; "
                                      "it takes " + "; ".join(f"{k}: {v}" for k, v in BUILD_ARGS.items()))
    if not isinstance(args.get("config"), str) or not args["config"]:
        raise scale_out.ScaleOutError("lumen_core.server.ray_app:build needs args.config: the path of the Lumen "
                                      "config (JSON) on the nodes, e.g. /etc/lumen/config.json")
    cfg = config_from_path_or_model(args["config"])
    params = cfg.server_parameters()
    replicas = args.get("replicas", (params.get("scale_out") or {}).get("replicas", 1))
    if isinstance(replicas, str) and replicas.isdigit():  # serve run's KEY=VALUE arguments are strings
        replicas = int(replicas)
    replicas = scale_out.check_replicas(replicas, "args.replicas")
    limits = Limits.from_parameters(params)
    api = ServerAPI.from_parameters(params, None)
    options = scale_out.replica_options(cfg, params.get("api_keys", []), args.get("model-name"), limits, api, None,
                                        args.get("api-keys-env"))
    return application(cfg, options, replicas, (params.get("scale_out") or {}).get("routing", "prefix-affinity"))
