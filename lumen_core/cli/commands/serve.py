"""``lumen serve``: the OpenAI- and Anthropic-compatible HTTP server over one loaded model."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from . import ChatTemplateOpt, ConfigOpt, DraftModelOpt, DraftTokensOpt, MtpOpt, NoDraftFallbackOpt, ThreadsOpt

Opt = typer.Option


class APIChoice(StrEnum):
    openai = "openai"
    anthropic = "anthropic"
    both = "both"


def serve(
    config: ConfigOpt,
    host: Annotated[str | None, Opt(help="Address to bind (default: server-parameters.host, else 127.0.0.1).")] = None,
    port: Annotated[int | None, Opt(min=1, max=65535,
                                    help="Port (default: server-parameters.port, else 8000).")] = None,
    api_key: Annotated[list[str] | None, Opt("--api-key", help="Accepted API key (repeatable; default: "
                                             "server-parameters.api-keys; none = no authentication).")] = None,
    model_name: Annotated[str | None, Opt("--model-name", help="Model id the API reports (default: the "
                                          "checkpoint's directory or file name).")] = None,
    max_queue: Annotated[int | None, Opt(min=0, help="Requests that may wait behind the running one; past it a "
                                         "429 with Retry-After (default: server-parameters.max-queue, else 64).")
                         ] = None,
    request_timeout: Annotated[float | None, Opt(min=0, help="Seconds one generation may run before it is cut "
                                                 "short as if max_tokens were reached; 0 = no limit (default: "
                                                 "server-parameters.request-timeout, else 600).")] = None,
    max_body_bytes: Annotated[int | None, Opt(min=1024, help="Largest request body; a larger one is a 413 "
                                              "(default: server-parameters.max-body-bytes, else 4194304).")
                              ] = None,
    max_tokens_limit: Annotated[int | None, Opt(min=1, help="Most tokens one request may ask for (default: "
                                                "server-parameters.max-tokens-limit, else only the context left "
                                                "after the prompt).")] = None,
    fetch_timeout: Annotated[float | None, Opt(min=0.001, help="Seconds one image URL's fetch may take, all of "
                                               "it; past it a 400 (default: server-parameters.fetch-timeout, else "
                                               "10).")] = None,
    max_images: Annotated[int | None, Opt(min=0, help="Images in one request; more is a 400 (default: "
                                          "server-parameters.max-images, else 32).")] = None,
    fetch_image_urls: Annotated[bool | None, Opt("--fetch-image-urls/--no-fetch-image-urls",
                                                 help="Fetch http(s) image URLs of requests; --no-fetch-image-urls: "
                                                      "images inline only, the server opens no connection (default: "
                                                      "server-parameters.fetch-image-urls, else fetch).")] = None,
    server_api: Annotated[APIChoice | None, Opt("--server-api", help="Serve only this API (both: both, whatever "
                                                "the config says); the other API's routes answer 404 saying why "
                                                "(default: server-parameters.server-api, else both).")] = None,
    sequences: Annotated[int | None, Opt(min=1, max=4096, help="Generations run at once, batched in shared decode "
                                         "steps (continuous batching), each with its own cache of the context size; "
                                         "the plan counts them all (default: model.hidden-layers.kv-cache.sequences, "
                                         "else 1: one at a time, through the CUDA decode graph on a GPU).")] = None,
    prefix_cache_mb: Annotated[float | None, Opt(min=0, help="Host RAM (MB) for the prefix cache: a prompt that "
                                                 "starts with an earlier one's tokens (the next chat turn, a shared "
                                                 "system prompt) resumes from its snapshot; 0 = off (default: "
                                                 "model.hidden-layers.kv-cache.prefix-cache-mb, else off).")] = None,
    chat_template: ChatTemplateOpt = None,
    draft_model: DraftModelOpt = None,
    draft_tokens: DraftTokensOpt = None,
    mtp: MtpOpt = False,
    no_draft_fallback: NoDraftFallbackOpt = False,
    threads: ThreadsOpt = None,
    replicas: Annotated[int | None, Opt(min=1, max=1024, help=(
        "Serve through Ray Serve with this many engines (replicas), each with the config's placement and the GPUs / "
        "CPUs it names, behind one endpoint; a conversation's requests go to the replica holding its prefix "
        "(default: server-parameters.scale-out.replicas, else one engine in this process; needs pip install "
        "'ray[serve]'; docs/scale-out.md)."))] = None,
    ray_address: Annotated[str | None, Opt("--ray-address", help="With --replicas: the Ray cluster to join "
                                           "(ray://HOST:10001 or HOST:6379; default: "
                                           "server-parameters.scale-out.ray-address, else a local cluster).")
                           ] = None,
):
    """Serve the model over HTTP: OpenAI (/v1/chat/completions, /v1/completions, /v1/models) and Anthropic
    (/v1/messages, /v1/messages/count_tokens) APIs, /health and /metrics (Prometheus). With --server-api (or
    server-parameters.server-api) openai or anthropic, only that API's routes are served.

    Requests share the loaded model through a queue, each with its own cache: one generation at a time, or with
    --sequences N up to N batched together (requests join and leave the batch between decode steps; more wait).
    --prefix-cache-mb keeps snapshots of earlier prompts so a chat's next turn prefills only its new tokens.
    --draft-model PATH or --mtp turn on speculative decoding (as the config's draft block does); it falls back
    to plain decoding while that is measured faster, unless --no-draft-fallback.
    --replicas N serves N engines through Ray Serve behind the same routes (docs/scale-out.md).
    With API keys configured every route but /health needs `Authorization: Bearer KEY` or `x-api-key: KEY`.
    """
    import uvicorn

    from ...config import config_from_path_or_model
    from ...engine import load
    from ...errors import InputError
    from ...server.app import create_app
    from ...server.settings import Limits, ServerAPI, api_key_problem

    for key in api_key or []:  # before anything loads: an empty key must not switch authentication off
        problem = api_key_problem(key)
        if problem:
            raise InputError(f"--api-key: {problem}; give the key itself, or leave --api-key out for no "
                             "authentication")
    cfg = config_from_path_or_model(config).with_draft(draft_model, draft_tokens, mtp,
                                                       False if no_draft_fallback else None).with_threads(threads)
    kv = cfg.raw["model"].setdefault("hidden-layers", {}).setdefault("kv-cache", {})
    if sequences is not None:
        kv["sequences"] = sequences
    if prefix_cache_mb is not None:
        kv["prefix-cache-mb"] = prefix_cache_mb
    params = cfg.server_parameters()  # a bad api-keys entry is a ConfigError naming it, before the weights
    limits = Limits.from_parameters(params, max_queue=max_queue, request_timeout=request_timeout,
                                    max_body_bytes=max_body_bytes, max_tokens=max_tokens_limit,
                                    fetch_timeout=fetch_timeout, max_images=max_images,
                                    fetch_urls=fetch_image_urls)
    api = ServerAPI.from_parameters(params, server_api.value if server_api else None)
    keys = api_key if api_key else params.get("api_keys", [])
    host = host or params.get("host", "127.0.0.1")
    port = port or params.get("port", 8000)
    scale = params.get("scale_out") or {}
    replicas = replicas if replicas is not None else scale.get("replicas")
    if ray_address is not None and replicas is None:
        raise InputError("--ray-address needs --replicas N (or server-parameters.scale-out.replicas): one engine "
                         "in this process uses no Ray cluster")
    if replicas is not None:
        _scale_out(cfg, replicas, ray_address or scale.get("ray-address"), host, port, keys, model_name, limits,
                   api, chat_template, scale.get("routing", "prefix-affinity"))
        return
    engine = load(cfg, progress=True, chat_template=chat_template)
    app = create_app(engine, keys, model_name, limits, api)
    kv = engine.config.kv_cache()
    typer.echo(f"lumen serve: {app.state.model_name} on http://{host}:{port} "
               f"({api.describe()}; {'API keys required' if keys else 'no authentication'}; "
               f"queue {limits.max_queue}, timeout "
               f"{f'{limits.request_timeout:g} s' if limits.request_timeout else 'none'}, body "
               f"{limits.max_body_bytes} bytes; {kv.sequences} sequence(s) at once, prefix cache "
               f"{f'{kv.prefix_cache_mb:g} MB' if engine.prefix_cache is not None else 'off'})", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def _scale_out(cfg, replicas, address, host, port, keys, model_name, limits, api, chat_template, routing) -> None:
    from ...server.scale_out import replica_options, serve_replicas

    options = replica_options(cfg, keys, model_name, limits, api, chat_template)
    serve_replicas(cfg, replicas, address, host, port, options, echo=lambda line: typer.echo(line, err=True),
                   routing=routing)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
