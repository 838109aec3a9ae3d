"""``stg feed``: drain rank files through the ETFeeder and report how they issue."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from stg.cli._shared import (
    COMM_GROUP_FILE_HELP,
    DEPS_HELP,
    FORMAT_HELP,
    JOBS_HELP,
    WINDOW_HELP,
    fit_lines,
    run_analysis,
    terminal_width,
)
from stg.trace.feeder import DEFAULT_WINDOW
from stg.trace.stats import exit_code, feed_report, render_feed

app = typer.Typer(add_completion=False)


FEED_HELP = (
    "Feed traces in dependency order and report issue statistics per rank.\n\n"
    "Each rank is drained in rounds: a round issues every ready node (smallest id first) "
    "and completes them all. Exit 0 when every trace feeds, 1 when one reads but cannot be "
    "fed (a cycle, a dangling or duplicate id), 2 when a file is not a readable trace or a "
    "comm-group file that the trace names is missing or does not parse."
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
    jobs: int = typer.Option(0, "--jobs", "-j", help=JOBS_HELP),
    comm_group_file: Path | None = typer.Option(  # noqa: B008
        None,
        "--comm_group_file",
        "--comm-group-file",
        help=COMM_GROUP_FILE_HELP + " Checked, never fed as a rank file.",
        metavar="PATH",
    ),
) -> None:
    """Feed traces in dependency order and report issue statistics per rank."""
    results = run_analysis(path, rank, deps, window, format, jobs, comm_group_file)
    code = exit_code(results)
    if code == 2:  # the unreadable files have had their error line
        raise typer.Exit(2)
    if as_json:
        typer.echo(json.dumps(feed_report(results, window), indent=2, ensure_ascii=False))
    else:
        typer.echo(fit_lines(render_feed(results), terminal_width()), nl=False)
    if code:
        raise typer.Exit(code)
