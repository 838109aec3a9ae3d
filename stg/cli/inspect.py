"""``stg inspect``: look inside things stg makes (``stg inspect trace``)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from stg.cli.feed import DEPS_HELP, FORMAT_HELP, WINDOW_HELP, check_common, run_analysis
from stg.feeder import DEFAULT_WINDOW

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Inspect traces and models.")


TRACE_HELP = (
    "Per-rank node counts, FLOPs, bytes per collective, send/recv bytes and critical path; "
    "with --dot, one rank's graph as Graphviz DOT.\n\n"
    "Exit 0 when every trace is valid, 1 when one is not."
)


@app.command("trace", help=TRACE_HELP)
def trace(
    path: Path = typer.Argument(  # noqa: B008
        ..., help="A rank file, a directory of rank files, or a prefix (out/workload)."
    ),
    rank: int | None = typer.Option(None, "--rank", help="Only this rank."),
    dot: Path | None = typer.Option(  # noqa: B008
        None, "--dot", metavar="FILE", help="Write the rank's graph as Graphviz DOT (one rank)."
    ),
    deps: str = typer.Option("data+ctrl", "--deps", help=DEPS_HELP),
    window: int = typer.Option(DEFAULT_WINDOW, "--window", help=WINDOW_HELP),
    format: str | None = typer.Option(None, "--format", help=FORMAT_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report."),
) -> None:
    """Statistics of trace files (see TRACE_HELP)."""
    from stg.errors import UserError
    from stg.tracestats import (
        find_trace_files,
        inspect_report,
        render_inspect,
        select_rank,
        write_dot,
    )

    if dot is None:
        results = run_analysis(path, rank, deps, window, format)
    else:
        check_common(deps, window, format)
        files = select_rank(find_trace_files(path), rank)
        if len(files) != 1:
            names = ", ".join(f"{f.name}.{f.rank}" for f in files[:6])
            more = ", ..." if len(files) > 6 else ""
            raise UserError(
                f"--dot writes one rank's graph; choose one with --rank ({names}{more})"
            )
        stats = write_dot(files[0], dot, deps=deps, window=window, format=format)  # type: ignore[arg-type]
        if stats.error is not None:
            typer.echo(f"error: {stats.error}", err=True)
        results = [stats]
    if as_json:
        typer.echo(json.dumps(inspect_report(results), indent=2, ensure_ascii=False))
    else:
        typer.echo(render_inspect(results), nl=False)
    if any(s.error is not None for s in results):
        raise typer.Exit(1)
