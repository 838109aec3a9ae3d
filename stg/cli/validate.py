"""``stg validate``: check a trace on disk against what simulators need (see stg.trace.validate)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(add_completion=False)

SHOWN = 50


@app.command("validate")
def validate(
    path: Path = typer.Argument(  # noqa: B008
        ...,
        help="A directory of rank files, a prefix (out/workload), a pattern "
        "(out/workload.%d.et) or one rank file.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON."),
    consumer: str = typer.Option(
        "astra-sim",
        "--consumer",
        help="Whose consumption rules to enforce. astra-sim (default): ASTRA-sim's rules are "
        "errors: num_ops > 0 on every COMP node with tensor_size > 0 (roofline), attribute "
        "value types of TRACES.md, pg_name a decimal string, is_cpu_op false on comm nodes, "
        "only ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER and ALL_TO_ALL collectives. chakra: any "
        "other reader of the Chakra schema; those rules become warnings.",
    ),
    jobs: int = typer.Option(
        0,
        "--jobs",
        "-j",
        help="Worker processes checking rank files (default 0: every core); the report is "
        "the same.",
    ),
    comm_group_file: Path | None = typer.Option(  # noqa: B008
        None,
        "--comm_group_file",
        "--comm-group-file",
        help="The trace's comm-group file (default: the one its metadata names, else "
        "<name>.json beside the rank files or, when that is absent, the only other comm-group "
        "JSON file there).",
        metavar="PATH",
    ),
) -> int:
    """Check every rank file of a trace: ids, deps, cycles, attribute types, send/recv pairs,
    collective sequences, the comm-group file and, by default, ASTRA-sim's consumption rules
    (--consumer). Exit 1 on any violation, 2 on unusable input (a file that is not a
    readable trace, a partial rank set, a --comm_group_file that is missing or not a
    comm-group file)."""
    from stg.cli import err_console
    from stg.cli._shared import check_comm_group_file, progress_bar
    from stg.errors import UserError
    from stg.trace.parallel import resolve_jobs
    from stg.trace.validate import validate_trace

    resolve_jobs(jobs)
    check_comm_group_file(comm_group_file)  # given explicitly, it is input, not the trace
    console = err_console()
    options = {"consumer": consumer, "jobs": jobs, "comm_group_file": comm_group_file}
    with progress_bar(console) as progress:
        report = validate_trace(path, progress, **options)  # type: ignore[arg-type]
    unreadable = [v.message for v in report.errors if v.check == "file"]
    if unreadable:
        more = len(unreadable) - 1
        others = f" (and {more} more unreadable rank {'file' if more == 1 else 'files'})"
        raise UserError(unreadable[0] + (others if more else ""))
    for note in report.notes:
        typer.echo(note, err=True)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _render(report)
    return 0 if report.ok else 1


def _render(report: object) -> None:
    from rich.console import Console
    from rich.table import Table

    from stg.trace.validate import ValidationReport

    assert isinstance(report, ValidationReport)
    console = Console(highlight=False)
    status = "[green]valid[/]" if report.ok else "[red]INVALID[/]"
    counts = (
        (report.ranks, "rank"),
        (report.nodes, "node"),
        (len(report.errors), "violation"),
        (len(report.warnings), "warning"),
    )
    console.print(f"{status}: " + ", ".join(f"{n:,} {w}{'' if n == 1 else 's'}" for n, w in counts))
    if report.comm_group_file:
        console.print(f"comm groups: {report.comm_group_file}")
    if report.counts():
        console.print(
            "by check: " + ", ".join(f"{check} {n}" for check, n in report.counts().items())
        )
    if not report.violations:
        return
    table = Table(show_edge=False, pad_edge=False)
    for column in ("severity", "check", "rank", "node", "message"):
        table.add_column(column, overflow="fold")
    ordered = report.errors + report.warnings
    for v in ordered[:SHOWN]:
        table.add_row(
            v.severity,
            v.check,
            "" if v.rank is None else str(v.rank),
            "" if v.node is None else str(v.node),
            v.message,
        )
    console.print(table)
    if len(ordered) > SHOWN:
        console.print(f"... and {len(ordered) - SHOWN} more (use --json for all)")


def register(parent: typer.Typer) -> None:
    """Add ``validate`` to another Typer app."""
    parent.command("validate")(validate)
