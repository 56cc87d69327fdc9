"""``lumen serve``: the OpenAI- and Anthropic-compatible HTTP server over one loaded model."""

from __future__ import annotations

from typing import Annotated

import typer

from . import ChatTemplateOpt, ConfigOpt

Opt = typer.Option


def serve(
    config: ConfigOpt,
    host: Annotated[str | None, Opt(help="Address to bind (default: server-parameters.host, else 127.0.0.1).")] = None,
    port: Annotated[int | None, Opt(min=1, max=65535,
                                    help="Port (default: server-parameters.port, else 8000).")] = None,
    api_key: Annotated[list[str] | None, Opt("--api-key", help="Accepted API key (repeatable; default: "
                                             "server-parameters.api-keys; none = no authentication).")] = None,
    model_name: Annotated[str | None, Opt("--model-name", help="Model id the API reports (default: the "
                                          "checkpoint's directory or file name).")] = None,
    chat_template: ChatTemplateOpt = None,
):
    """Serve the model over HTTP: OpenAI (/v1/chat/completions, /v1/completions, /v1/models) and Anthropic
    (/v1/messages, /v1/messages/count_tokens) APIs, /health and /metrics (Prometheus).

    Requests share the loaded model through a queue, one generation at a time, each with its own cache.
    With API keys configured every route but /health needs `Authorization: Bearer KEY` or `x-api-key: KEY`.
    """
    import uvicorn

    from ...engine import load
    from ...server.app import create_app

    engine = load(config, progress=True, chat_template=chat_template)
    params = engine.config.server_parameters()
    keys = api_key if api_key else params.get("api_keys", [])
    host = host or params.get("host", "127.0.0.1")
    port = port or params.get("port", 8000)
    app = create_app(engine, keys, model_name)
    typer.echo(f"lumen serve: {app.state.model_name} on http://{host}:{port} "
               f"({'API keys required' if keys else 'no authentication'})", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
