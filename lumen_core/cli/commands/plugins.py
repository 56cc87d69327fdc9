"""``lumen plugins``: what each installed distribution registered, and the devices each backend finds, grouped so
that it fits on a screen.

The default listing has a section per distribution and a line per kind (ops: a line per backend, their
weight-format variants and priority overrides beside them), wrapped at the terminal's width. ``--all`` prints the
full table (one row per registration, every op × backend × variant); ``--json`` the same rows as JSON.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from typing import Annotated

import typer

# Kinds in the order a section lists them, with their plural
KINDS = {
    "backend": "backends",
    "architecture": "architectures",
    "chat format": "chat formats",
    "checkpoint format": "checkpoint formats",
    "quant format": "quant formats",
}
CORE = "lumen-core"


def plugins(
    as_json: Annotated[bool, typer.Option("--json", help="Print every registration as JSON rows.")] = False,
    show_all: Annotated[
        bool, typer.Option("--all", "-a", help="Print the full table: one row per registration.")
    ] = False,
):
    """List backends, ops, architectures, checkpoint/quant/chat formats, grouped by the plugin that registered them.

    Each backend's line "devices of ..." lists the devices it finds here (cuda:N with the GPU model, wgpu:N with the
    adapter's driver, API and limits), or none. Ops are listed per backend with their weight-format variants and
    priority overrides. --all: one row each.
    """
    from ...plugins import get_registry

    entries = get_registry().all_entries()
    if as_json:
        typer.echo(json.dumps(rows(entries), indent=2))
    elif show_all:
        typer.echo(table(rows(entries)))
    else:
        typer.echo(grouped(entries, _width()))


def rows(entries) -> list[dict]:
    """One ``{"kind", "name", "plugin"}`` a registration (``--json``, ``--all``); an op's name carries its backend,
    variant and priority: ``linear [cpu/fp8] priority 10``."""
    out = []
    for e in entries:
        name = e.name
        if e.kind == "op":
            variant = e.extra["variant"]
            name = f"{e.name} [{e.extra['backend']}{'/' + variant if variant else ''}]"
            if e.priority:
                name += f" priority {e.priority}"
        out.append({"kind": e.kind, "name": name, "plugin": e.source})
    return out


def table(rows: list[dict]) -> str:
    width = max((len(r["kind"]) for r in rows), default=4)
    nwidth = max((len(r["name"]) for r in rows), default=4)
    lines = [f"{'kind'.ljust(width)}  {'name'.ljust(nwidth)}  plugin"]
    lines += [f"{r['kind'].ljust(width)}  {r['name'].ljust(nwidth)}  {r['plugin']}" for r in rows]
    return "\n".join(lines)


def grouped(entries, width: int = 100) -> str:
    """A section per distribution (lumen-core first, then by name), a wrapped line per kind inside it."""
    by_source: dict[str, list] = {}
    for e in entries:
        by_source.setdefault(e.source, []).append(e)
    sources = sorted(by_source, key=lambda s: (s != CORE, s))
    formats = {e.name: i for i, e in enumerate(e for e in entries if e.kind == "quant format")}
    sections = [_section(source, by_source[source], formats) for source in sources]
    label_width = max((len(label) for _, lines in sections for label, _ in lines), default=0) + 2
    out = []
    for (header, lines) in sections:
        out.append(header)
        for label, text in lines:
            out.append(textwrap.fill(text, width=max(width, label_width + 30), initial_indent="  "
                                     + f"{label}:".ljust(label_width), subsequent_indent=" " * (label_width + 2),
                                     break_on_hyphens=False))
    n = len(entries)
    out.append("")
    out.append(textwrap.fill(f"{n} registrations from {len(sections)} distributions; lumen plugins --all lists "
                             "one row each, --json the same as JSON", width=max(width, 40)))
    return "\n".join(out)


def _section(source: str, entries, formats: dict[str, int]) -> tuple[str, list[tuple[str, str]]]:
    """(header, [(label, text)]) of one distribution; ``formats`` orders weight-format variants."""
    lines = []
    for kind, plural in KINDS.items():
        names = [e.name for e in entries if e.kind == kind]
        if names:
            lines.append((plural if len(names) > 1 else kind, ", ".join(names)))
    for e in entries:
        if e.kind == "backend":
            lines.append((f"devices of {e.name}", _devices(e.name)))
    ops = [e for e in entries if e.kind == "op"]
    backends = list(dict.fromkeys(e.extra["backend"] for e in ops))
    for backend in backends:
        lines.extend(_op_lines(backend, [e for e in ops if e.extra["backend"] == backend], formats))
    return f"{source} ({len(entries)} registration{'s' if len(entries) != 1 else ''})", lines


def _op_lines(backend: str, ops, formats: dict[str, int]) -> list[tuple[str, str]]:
    """The ops on one backend: their names; the weight formats they have variants for (in the order of the quant
    formats' registration); the implementations registered above the default, per priority."""
    ops = sorted(ops, key=lambda e: formats.get(e.extra["variant"], -1 if e.extra["variant"] is None else len(formats)))
    names = sorted({e.name for e in ops})
    lines = [(f"ops on {backend}", ", ".join(names))]
    variants: dict[str, list[str]] = {}
    for e in ops:
        if e.extra["variant"] is not None:
            formats = variants.setdefault(e.name, [])
            if e.extra["variant"] not in formats:
                formats.append(e.extra["variant"])
    if variants:
        text = "; ".join(f"{op} ({', '.join(formats)})" for op, formats in sorted(variants.items()))
        lines.append((f"variants on {backend}", text))
    for priority in sorted({e.priority for e in ops if e.priority}, reverse=True):
        over: dict[str, list[str]] = {}
        for e in ops:
            if e.priority == priority:
                over.setdefault(e.name, []).append(e.extra["variant"])
        text = "; ".join(op if formats == [None] else f"{op} ({', '.join(v or 'any' for v in formats)})"
                         for op, formats in sorted(over.items()))
        lines.append((f"priority {priority} on {backend}", text))
    return lines


def _devices(backend: str) -> str:
    """What the backend finds on this machine: each device's name and what it says of itself (a GPU's model, a wgpu
    adapter's driver, API and limits), or why there is none."""
    from ...plugins import get_registry

    try:
        found = get_registry().backend_class(backend).devices()
    except Exception as exc:  # a plugin that cannot even list devices: say so, keep listing the rest
        return f"none ({type(exc).__name__}: {exc})"
    if not found:
        return "none on this machine"
    return "; ".join(f"{d.name} {d.description}".strip() for d in found)


def _width() -> int:
    return shutil.get_terminal_size((100, 24)).columns


def register(app: typer.Typer) -> None:
    app.command("plugins")(plugins)
