"""The FastAPI application: the gate in front of the routes (body size, API keys, counting), errors in each API's
own shape, health, metrics, models and the names a request's ``model`` may give (others are a 404); the OpenAI
routes (``openai_api.py``) and the Anthropic routes (``anthropic_api.py``) are mounted here."""

from __future__ import annotations

import hmac
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .service import ClientGone, Job, QueueFull, Service
from .settings import API_ROUTES, SERVER_APIS, Limits, ServerAPI, api_key_problem

ANTHROPIC_PREFIX = "/v1/messages"


class APIError(Exception):
    """An error to return as JSON in the calling API's shape: ``status``, a message, an OpenAI/Anthropic type,
    OpenAI's ``param`` and ``code``; ``anthropic_message`` replaces the message in Anthropic's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, anthropic_message: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.code, self.anthropic_message, self.headers = code, anthropic_message, headers


def error_response(request: Request, status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   anthropic_message: str | None = None, headers: dict | None = None) -> JSONResponse:
    """OpenAI: {"error": {message, type, param, code}}; Anthropic (its routes, or a request from its SDK, which
    sends ``anthropic-version``): {"type": "error", "error": {type, message}}. A message that quotes the request
    (a name, a value) may hold a lone surrogate, which UTF-8 cannot write: it is escaped, never a failed reply."""
    return shaped_error(_error_shape(request), status, message, kind, param, code, anthropic_message, headers)


def shaped_error(shape: str, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, anthropic_message: str | None = None,
                 headers: dict | None = None) -> JSONResponse:
    """An error in one API's JSON shape: ``shape`` ``openai`` or ``anthropic`` (see ``error_response``)."""
    message, param = _printable(message), _printable(param)
    if shape == "anthropic":
        anthropic_kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                          429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}.get(status, kind)
        body = {"type": "error", "error": {"type": anthropic_kind,
                                           "message": _printable(anthropic_message) or message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _error_shape(request: Request) -> str:
    """Serving both APIs: Anthropic's shape on its routes or for its SDK (``anthropic-version``), else OpenAI's.
    Serving one (``server-api``): each API's own routes in its shape (an OpenAI route that is off answers as OpenAI
    does), any other path in the served API's shape."""
    path = request.url.path
    state = getattr(request.scope.get("app"), "state", None)
    only = getattr(getattr(state, "server_api", None), "only", None)
    if only is not None:
        if path in API_ROUTES["openai"]:
            return "openai"
        return "anthropic" if path.startswith(ANTHROPIC_PREFIX) else only
    return "anthropic" if path.startswith(ANTHROPIC_PREFIX) or request.headers.get("anthropic-version") else "openai"


def _printable(text: str | None) -> str | None:
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


class JobStream(StreamingResponse):
    """A streamed (server-sent events) reply over a queued job, which is cancelled however the response ends:
    finished, failed, or its client gone before the first byte (when the body never starts)."""

    def __init__(self, body, job: Job):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


async def client_gone(request: Request) -> None:
    """Return once the client has disconnected. Call it after the body was read: the server's next message is
    then ``http.disconnect``, sent when the connection closes (or when the response is complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def submit(request: Request, run, usage) -> Job:
    """Queue a generation for this request: the app's Service, a 429 with Retry-After when the queue is full."""
    try:
        return request.app.state.service.submit(run, usage)
    except QueueFull as exc:
        raise APIError(429, str(exc), "rate_limit_exceeded", code="queue_full",
                       headers={"Retry-After": str(exc.retry_after)}) from exc


def model_names(engine, model_name: str | None) -> tuple[str, ...]:
    """The names a request's ``model`` may give, the served id first: ``model_name`` (``--model-name``, else the
    checkpoint's directory or file name), the checkpoint's name, and the model path as the config writes it (a
    Hugging Face id such as ``google/gemma-3-270m``, or a path)."""
    path = str(engine.config.model_path).rstrip("/")
    written = str(((getattr(engine.config, "raw", None) or {}).get("model") or {}).get("path") or "").rstrip("/")
    checkpoint = path.split("/")[-1]
    names = [model_name or checkpoint, checkpoint, written]
    return tuple(dict.fromkeys(n for n in names if n))


def check_model(app: FastAPI, name: str | None) -> None:
    """A request's ``model``: left out (OpenAI routes) or one of ``app.state.model_names``; any other name is a
    404 as OpenAI words it (``model_not_found``), or Anthropic's ``not_found_error``."""
    if name is None or name in app.state.model_names:
        return
    raise APIError(404, f"The model `{name}` does not exist or you do not have access to it.",
                   param="model", code="model_not_found",
                   anthropic_message=f"model: {name} is not served here; this server serves "
                                     f"{app.state.model_name}")


def check_api_keys(keys: list[str] | None) -> list[str]:
    """The keys, or a ValueError for one that cannot work (an empty key must not switch authentication off)."""
    for i, key in enumerate(keys or []):
        problem = api_key_problem(key)
        if problem:
            raise ValueError(f"api_keys[{i}]: {problem}")
    return list(keys or [])


def create_app(engine, api_keys: list[str] | None = None, model_name: str | None = None,
               limits: Limits | None = None, server_api: ServerAPI | str | None = None) -> FastAPI:
    """The app over a loaded Engine. ``api_keys``: when non-empty, every route but /health needs one of them as
    ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (401 otherwise); an empty or blank key is a ValueError.
    ``limits``: queue, time, body and max_tokens limits (``settings.Limits``; its defaults when None).
    ``server_api``: ``openai`` or ``anthropic`` serves only that API (``settings.ServerAPI``; a string is read as
    ``server-parameters.server-api``); None, both."""
    keys = check_api_keys(api_keys)
    limits = limits or Limits()
    api = server_api if isinstance(server_api, ServerAPI) else ServerAPI(server_api)
    app = FastAPI(title="Lumen", description="OpenAI- and Anthropic-compatible API over one local model.")
    service = Service(engine, limits)
    app.state.service = service
    app.state.engine = engine
    app.state.limits = limits
    app.state.model_names = model_names(engine, model_name)
    app.state.model_name = app.state.model_names[0]  # the served id: what /v1/models lists and replies report
    app.state.server_api = api
    app.add_middleware(Gate, service=service, keys=keys, max_body_bytes=limits.max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(request, exc.status, exc.message, exc.kind, exc.param, exc.code,
                              exc.anthropic_message, exc.headers)

    @app.exception_handler(ClientGone)
    async def client_left(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request": for /metrics, nobody reads it

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            msg = str(err.get("msg")).removeprefix("Value error, ")  # a validator's own sentence
            parts.append(f"{loc}: {msg}" if loc else msg)
        return error_response(request, 400, "invalid request: " + "; ".join(parts))

    @app.exception_handler(json.JSONDecodeError)
    async def bad_json(request: Request, exc: json.JSONDecodeError):
        return error_response(request, 400, f"the body is not valid JSON: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(request, exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # never a bare 500 page
        return error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}", "api_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": app.state.model_name, "queue_depth": service.queue_depth}

    @app.head("/health", include_in_schema=False)  # load balancers' probes; the server sends no body
    async def health_head():
        return await health()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.metrics.prometheus(service.queue_depth),
                                 media_type="text/plain; version=0.0.4")

    def model_card(request: Request) -> dict:
        # the anthropic SDK's shape: serving only Anthropic, or for a request that carries its anthropic-version
        if api.only == "anthropic" or (api.only is None and request.headers.get("anthropic-version")):
            return {"type": "model", "id": app.state.model_name, "display_name": app.state.model_name,
                    "created_at": "1970-01-01T00:00:00Z"}
        return {"id": app.state.model_name, "object": "model", "created": 0, "owned_by": "lumen"}

    @app.get("/v1/models")
    async def models(request: Request):
        card = model_card(request)
        if "type" in card:
            return {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        check_model(app, model_id)  # the served id or an alias; the card names the served id
        return model_card(request)

    from . import anthropic_api, openai_api

    for name, module in (("openai", openai_api), ("anthropic", anthropic_api)):
        if api.serves(name):
            module.mount(app)
    for name in SERVER_APIS:
        if not api.serves(name):
            for path in API_ROUTES[name]:
                app.add_api_route(path, _route_off(api, name, path), include_in_schema=False,
                                  methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    service.routes = {getattr(r, "path", None) for r in app.routes} - {None}
    return app


def _route_off(api: ServerAPI, name: str, path: str):
    """The endpoint of a route of the API ``name`` that the server does not serve: a 404 in that API's own error
    shape (its SDK reads it), saying that ``server-api`` turned it off and how to serve both APIs."""
    async def off():
        return shaped_error(name, 404, api.off_message(path), "invalid_request_error", code="api_not_served")

    return off


def _count(service: Service, path: str, status: int) -> None:
    """Requests by route and status; paths that are no route count as "other" (bounded label values)."""
    if path not in service.routes:
        path = "other"
    key = (path, status)
    service.metrics.requests[key] = service.metrics.requests.get(key, 0) + 1


DRAIN_LIMIT = 64 * 1024 * 1024  # an oversized body is read (and dropped) up to this, so its client sees the 413


class Gate:
    """Pure ASGI middleware in front of every route: the body-size limit, API keys, requests counted by route and
    status. It reads the body itself (a larger one than ``max_body_bytes`` is a 413 before anything parses it) and
    hands the routes a ``receive`` that replays it and then passes the client's own messages through, so a route
    learns of a disconnect (``client_gone``); Starlette's BaseHTTPMiddleware would sit in between."""

    def __init__(self, app, service: Service, keys: list[str], max_body_bytes: int):
        self.app, self.service, self.max_body_bytes = app, service, max_body_bytes
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # unless a response starts: an exception escaped to the server-error handler

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if not await self._serve(scope, receive, counted):
                status = 499  # the client left while sending its body (nginx's "client closed request")
        finally:
            _count(self.service, scope["path"], status)

    async def _serve(self, scope, receive, send) -> bool:
        """Answer the request (False: the client left before its body was read)."""
        request = Request(scope)
        refusal = self._refusal(request)
        body = await _read_body(receive, self.max_body_bytes, request.headers.get("content-length"))
        if body is _GONE:
            return False
        if body is None and refusal is None:
            refusal = error_response(request, 413, f"the request body is larger than this server's limit of "
                                     f"{self.max_body_bytes} bytes", code="request_too_large")
        if refusal is not None:
            await refusal(scope, receive, send)
        else:
            await self.app(scope, _replay(body, receive), send)
        return True

    def _refusal(self, request: Request) -> JSONResponse | None:
        """A 401 for a request without an accepted key (every route but /health needs one when keys are set)."""
        if not self.keys or request.url.path == "/health":
            return None
        given = request.headers.get("x-api-key") or ""
        bearer = request.headers.get("authorization", "")
        if bearer.lower().startswith("bearer "):
            given = given or bearer[7:].strip()
        if any(hmac.compare_digest(given.encode(), k) for k in self.keys):
            return None
        return error_response(request, 401, "invalid or missing API key (Authorization: Bearer KEY or "
                              "x-api-key: KEY)", "authentication_error")


_GONE = object()  # what _read_body returns when the client left mid-body


async def _read_body(receive, limit: int, declared: str | None):
    """The request body; None when it is larger than ``limit`` bytes (declared so, or found so while reading),
    after reading and dropping the rest up to DRAIN_LIMIT, so that a client still sending gets the 413 rather than
    a reset connection; ``_GONE`` when the client left."""
    too_big = declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit
    if too_big and int(declared) > DRAIN_LIMIT:
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return _GONE
        size += len(message.get("body", b""))
        too_big = too_big or size > limit
        if not too_big:
            chunks.append(message.get("body", b""))
        if not message.get("more_body", False) or size > DRAIN_LIMIT:
            break
    return None if too_big else b"".join(chunks)


def _replay(body: bytes, receive):
    """A ``receive`` that gives the body read by the gate once, then the client's own messages (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed
