"""``stg feed``: drain rank files through the ETFeeder and report how they issue."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from stg.feeder import DEFAULT_WINDOW, DEPS_MODES
from stg.tracestats import (
    TraceStats,
    analyze,
    feed_report,
    find_trace_files,
    render_feed,
    select_rank,
)

app = typer.Typer(add_completion=False)

DEPS_HELP = (
    "Dependencies that order the nodes: data+ctrl (what ASTRA-sim honours) or data "
    "(Chakra's feeder; for traces with unusable ctrl deps)."
)
WINDOW_HELP = "Most nodes the feeder holds in memory (it reads on past forward references)."
FORMAT_HELP = "Trace format: v0.0.4, v0.0.1 or json (default: detected)."


def check_common(deps: str, window: int, format: str | None) -> None:
    """Reject bad --deps/--window/--format values with one line (exit 2)."""
    from stg.errors import UserError
    from stg.reader import FORMATS

    if deps not in DEPS_MODES:
        raise UserError(f"--deps {deps}: not known; allowed: {', '.join(DEPS_MODES)}")
    if window < 1:
        raise UserError(f"--window {window}: must be a positive integer")
    if format is not None and format not in FORMATS:
        raise UserError(f"--format {format}: not known; allowed: {', '.join(FORMATS)}")


def run_analysis(
    path: Path,
    rank: int | None,
    deps: str,
    window: int,
    format: str | None,
) -> list[TraceStats]:
    """Analyze the selected rank files, with a progress bar on a terminal."""
    from stg.cli import err_console

    check_common(deps, window, format)
    files = select_rank(find_trace_files(path), rank)
    console = err_console()
    results: list[TraceStats] = []
    if console.is_terminal and len(files) > 1:
        from rich.progress import Progress

        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("reading traces", total=len(files))
            for trace in files:
                results.append(analyze(trace, deps=deps, window=window, format=format))  # type: ignore[arg-type]
                progress.advance(task)
    else:
        for trace in files:
            results.append(analyze(trace, deps=deps, window=window, format=format))  # type: ignore[arg-type]
    for stats in results:
        if stats.error is not None:
            typer.echo(f"error: {stats.error}", err=True)
    return results


FEED_HELP = (
    "Feed traces in dependency order and report issue statistics per rank.\n\n"
    "Each rank is drained in rounds: a round issues every ready node (smallest id first) "
    "and completes them all. Exit 0 when every trace is valid, 1 when one is not."
)


@app.command("feed", help=FEED_HELP)
def feed(
    path: Path = typer.Argument(  # noqa: B008
        ..., help="A rank file, a directory of rank files, or a prefix (out/workload)."
    ),
    rank: int | None = typer.Option(None, "--rank", help="Feed only this rank."),
    deps: str = typer.Option("data+ctrl", "--deps", help=DEPS_HELP),
    window: int = typer.Option(DEFAULT_WINDOW, "--window", help=WINDOW_HELP),
    format: str | None = typer.Option(None, "--format", help=FORMAT_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report."),
) -> None:
    """Feed traces in dependency order and report issue statistics per rank."""
    results = run_analysis(path, rank, deps, window, format)
    if as_json:
        typer.echo(json.dumps(feed_report(results, window), indent=2, ensure_ascii=False))
    else:
        typer.echo(render_feed(results), nl=False)
    if any(s.error is not None for s in results):
        raise typer.Exit(1)
