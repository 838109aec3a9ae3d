"""``stg plugins``: what is installed, who registered what, and which plugins failed."""

from __future__ import annotations

import json
from typing import Any

import typer

from stg.cli import get_registry

app = typer.Typer(help="Inspect the loaded plugins.", no_args_is_help=True, add_completion=False)

_KIND_LABELS = {
    "models": "models",
    "schedules": "schedules",
    "kernels": "kernels",
    "emitters": "emitters",
    "predictors": "predictors",
    "commands": "commands",
    "bench_ops": "bench operators",
    "presets": "presets",
}


def plugins_report() -> dict[str, Any]:
    """The plugin listing as JSON-ready data: loaded plugins, then failures, in load order."""
    registry = get_registry()
    registry.load_unlisted()  # the presets' names are known once their files are read
    return {
        "plugins": [
            {
                "name": info.name,
                "dist": info.dist,
                "version": info.version,
                "source": info.source,
                "registers": {kind: list(names) for kind, names in info.registered.items()},
            }
            for info in registry.plugins
        ],
        "failures": [
            {
                "name": failure.name,
                "dist": failure.dist,
                "version": failure.version,
                "source": failure.source,
                "error": failure.error,
            }
            for failure in registry.failures
        ],
    }


@app.command("list")
def list_plugins(
    as_json: bool = typer.Option(False, "--json", help="Print JSON to stdout instead of a table."),
) -> None:
    """List plugins with their version, source and what they register; failed ones too."""
    report = plugins_report()
    if as_json:
        typer.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="stg plugins", title_justify="left")
    for column in ("plugin", "version", "source", "registers"):
        table.add_column(column, overflow="fold")
    for plugin in report["plugins"]:
        registers = "; ".join(
            f"{_KIND_LABELS.get(kind, kind)}: {', '.join(names)}"
            for kind, names in plugin["registers"].items()
        )
        table.add_row(_who(plugin), plugin["version"] or "-", plugin["source"], registers or "-")
    for failure in report["failures"]:
        table.add_row(
            _who(failure),
            failure["version"] or "-",
            failure["source"],
            f"[red]failed:[/red] {_escape(failure['error'])}",
        )
    Console(soft_wrap=False).print(table)


def _who(entry: dict[str, Any]) -> str:
    name = _escape(entry["name"])
    dist = entry.get("dist")
    if dist and entry.get("source") != "builtin" and dist != entry["name"]:
        return f"{name} ({_escape(dist)})"
    return name


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
