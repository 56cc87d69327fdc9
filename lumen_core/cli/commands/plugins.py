"""``lumen plugins``: every registration and the distribution it came from."""

from __future__ import annotations

import json
from typing import Annotated

import typer


def plugins(as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False):
    """List backends, ops, architectures, checkpoint/quant/chat formats, and which plugin registered each."""
    from ...plugins import get_registry

    rows = []
    for e in get_registry().all_entries():
        name = e.name
        if e.kind == "op":
            variant = e.extra["variant"]
            name = f"{e.name} [{e.extra['backend']}{'/' + variant if variant else ''}]"
            if e.priority:
                name += f" priority {e.priority}"
        rows.append({"kind": e.kind, "name": name, "plugin": e.source})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    width = max((len(r["kind"]) for r in rows), default=4)
    nwidth = max((len(r["name"]) for r in rows), default=4)
    typer.echo(f"{'kind'.ljust(width)}  {'name'.ljust(nwidth)}  plugin")
    for r in rows:
        typer.echo(f"{r['kind'].ljust(width)}  {r['name'].ljust(nwidth)}  {r['plugin']}")


def register(app: typer.Typer) -> None:
    app.command("plugins")(plugins)
