"""``stg inspect``: look inside things stg makes (``stg inspect trace``, ``stg inspect model``)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from stg.cli._shared import (
    DEPS_HELP,
    FORMAT_HELP,
    WINDOW_HELP,
    check_common,
    check_writable_file,
    run_analysis,
)
from stg.trace.feeder import DEFAULT_WINDOW

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
    from stg.trace.stats import (
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
        check_writable_file("--dot", dot)
        try:
            stats = write_dot(files[0], dot, deps=deps, window=window, format=format)  # type: ignore[arg-type]
        except OSError as exc:
            raise UserError(f"--dot {dot}: cannot write: {exc.strerror or exc}") from None
        if stats.error is not None:
            typer.echo(f"error: {stats.error}", err=True)
        results = [stats]
    if as_json:
        typer.echo(json.dumps(inspect_report(results), indent=2, ensure_ascii=False))
    else:
        typer.echo(_no_zero_runtime(render_inspect(results)), nl=False)
    if any(s.error is not None for s in results):
        raise typer.Exit(1)


NO_RUNTIME = " nodes, 0 us of runtime\n"


def _no_zero_runtime(text: str) -> str:
    """A critical path of 0 us means that the trace records no durations: say so."""
    return text.replace(NO_RUNTIME, " nodes (the trace records no durations)\n")


MODEL_HELP = (
    "Parameters, forward and backward FLOPs and activation bytes saved for the backward, per "
    "part (embedding, one block, head), as symbolic expressions and as numbers for the given "
    "dimensions (one device, no parallelism); totals for --num_stacks blocks. With --dot, the "
    "block's forward and backward graph as Graphviz DOT."
)


@app.command("model", help=MODEL_HELP)
def model(
    name: str = typer.Argument(..., help="A registered model (see `stg plugins list`)."),
    dvocal: int = typer.Option(32000, "--dvocal"),
    dmodel: int = typer.Option(8192, "--dmodel"),
    dff: int = typer.Option(28672, "--dff"),
    seq: int = typer.Option(1024, "--seq"),
    head: int = typer.Option(64, "--head"),
    kvhead: int = typer.Option(8, "--kvhead"),
    num_stacks: int = typer.Option(80, "--num_stacks", "--num-stacks"),
    micro_batch: int = typer.Option(1, "--micro_batch", "--micro-batch", help="Samples."),
    experts: int = typer.Option(8, "--experts"),
    kexperts: int = typer.Option(2, "--kexperts"),
    dtype: str = typer.Option("bf16", "--dtype"),
    dot: Path | None = typer.Option(  # noqa: B008
        None, "--dot", metavar="FILE", help="Write the block's graph as Graphviz DOT."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report."),
) -> None:
    """Closed forms of a model (see MODEL_HELP)."""
    from rich.console import Console
    from rich.table import Table

    from stg.cli import get_registry
    from stg.core.modelinfo import build_unsharded, describe_model, part_dot
    from stg.core.options import GenerateOptions
    from stg.core.pipeline import symbol_values
    from stg.core.plan import make_plan
    from stg.trace.writer import write_file_atomically

    options = GenerateOptions(
        model=name, dvocal=dvocal, dmodel=dmodel, dff=dff, seq=seq, head=head, kvhead=kvhead,
        num_stacks=num_stacks, batch=micro_batch, micro_batch=micro_batch, experts=experts,
        kexperts=kexperts, dtype=dtype,
    )  # fmt: skip
    make_plan(options)
    record = get_registry().models.get(name)
    report = describe_model(record, options, symbol_values(options))
    if dot is not None:
        text = part_dot(build_unsharded(record, "block", options))
        write_file_atomically(dot, lambda f: f.write(text.encode()))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    table = Table(title=f"{name}: per part (micro_batch={micro_batch}, one device)")
    for column in ("part", "figure", "expression", "value"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for part, figures in report["parts"].items():
        for figure, entry in figures.items():
            table.add_row(part, figure, entry["expression"], f"{entry['value']:,}")
    for figure, value in report["totals"].items():
        table.add_row("total", figure, f"embedding + {num_stacks}·block + head", f"{value:,}")
    Console(width=160).print(table)
