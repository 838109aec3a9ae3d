"""``stg simulate``: run ASTRA-sim on a trace set and print its figures beside ``stg predict``.

The binary is ``--astra-sim PATH`` or ``$ASTRA_SIM_BIN``; its inputs are the rank files, the
comm-group file and the system, network and remote-memory configurations that ``stg generate
--system S --astra_sim_configs`` wrote beside them (or the ones given). A missing binary or
input is one ``error:`` line and exit 2; a simulator that crashes, stops before every rank
finished, or runs past ``--timeout`` is one ``error:`` line and exit 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer

from stg.cli import err_console, get_registry
from stg.cli._shared import format_seconds, print_table, read_trace_input, run_predictors
from stg.errors import UserError

app = typer.Typer(add_completion=False)

ASTRA_SIM_FORMAT = "v0.0.4"
"""the rank-file format ASTRA-sim reads (``<prefix>.<rank>.et``)"""


@app.command("simulate")
def simulate(
    path: str = typer.Argument(
        ...,
        help="The trace: a directory, prefix (out/workload) or pattern (out/workload.%d.et) "
        "of Chakra v0.0.4 rank files.",
        metavar="DIR",
    ),
    astra_sim: str | None = typer.Option(
        None,
        "--astra-sim",
        help="The ASTRA-sim binary (an analytical build's AstraSim_Analytical_Congestion_"
        "Unaware or _Aware; default: $ASTRA_SIM_BIN).",
        metavar="PATH",
        show_default=False,
    ),
    system: str | None = typer.Option(
        None,
        "--system",
        "-s",
        help="System stg predicts for ({allowed:systems} or a JSON file; default: the one "
        "the trace's kernel times were written for).",
        metavar="NAME|FILE",
        show_default=False,
    ),
    system_config: Path | None = typer.Option(  # noqa: B008
        None,
        "--system-config",
        help="ASTRA-sim's system JSON (default: <name>.system.json beside the rank files).",
        metavar="FILE",
        show_default=False,
    ),
    network_config: Path | None = typer.Option(  # noqa: B008
        None,
        "--network-config",
        help="ASTRA-sim's network YAML (default: <name>.network.yml beside the rank files).",
        metavar="FILE",
        show_default=False,
    ),
    memory_config: Path | None = typer.Option(  # noqa: B008
        None,
        "--memory-config",
        help="ASTRA-sim's remote-memory JSON (default: <name>.memory.json beside the rank files).",
        metavar="FILE",
        show_default=False,
    ),
    comm_group_file: str | None = typer.Option(
        None,
        "--comm_group_file",
        "--comm-group-file",
        help="The trace's comm-group file (default: the one its metadata names, else "
        "<name>.json beside the rank files).",
        metavar="PATH",
        show_default=False,
    ),
    calibration: str | None = typer.Option(
        None,
        "--calibration",
        help="The calibration table (stg bench calibrate) the trace's kernel times were "
        "written with, for stg predict's side.",
        metavar="FILE",
        show_default=False,
    ),
    timeout: float = typer.Option(
        600.0,
        "--timeout",
        help="Seconds ASTRA-sim may run before it is stopped (exit 1).",
        metavar="SECONDS",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
) -> None:
    """Run ASTRA-sim on a trace and print each rank's finish time and exposed communication
    beside stg predict's for the same trace and system."""
    from stg.perf.simulator import (
        SimulationFailed,
        resolve_binary,
        run_astra_sim,
        side_by_side,
    )
    from stg.perf.system import load_system

    if not 0 < timeout < math.inf:
        raise UserError(f"--timeout {timeout:g}: must be a positive number of seconds")
    binary = resolve_binary(astra_sim)
    inputs, recorded = _simulator_inputs(
        path, system_config, network_config, memory_config, comm_group_file, system is not None
    )
    machine = load_system(system or recorded)
    table = None
    if calibration is not None:
        from stg.perf.calibration import load_calibration

        table = load_calibration(calibration)
    if recorded is None:
        typer.echo(
            f"note: {path} carries no kernel times; ASTRA-sim prices its compute by its system "
            "configuration alone (its roofline, or 1 ns a node without)",
            err=True,
        )
    elif system is not None and machine.name != recorded:
        typer.echo(
            f"note: the trace's kernel times are for {recorded}; stg predicts for {machine.name}",
            err=True,
        )
    try:
        run = run_astra_sim(binary, inputs, timeout)
    except SimulationFailed as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        trace = read_trace_input(path, 0, comm_group_file)
        reports = run_predictors(["time"], get_registry(), machine, trace=trace, calibration=table)
    except OSError as exc:
        where = exc.filename if exc.filename is not None else "a file"
        raise UserError(f"cannot access {where}: {exc.strerror or exc}") from None
    if run.exit_note is not None:
        typer.echo(f"warning: {run.exit_note}; its figures are complete", err=True)
    comparison = side_by_side(run, reports["time"])
    if as_json:
        typer.echo(json.dumps({**comparison, "prediction": reports["time"]}, indent=2))
        return
    _print_comparison(comparison, path)
    err_console().print(
        f"ASTRA-sim: {run.binary} ran {len(run.ranks)} ranks in {run.wall_s:.1f} s",
        markup=False,
    )


def _simulator_inputs(
    path: str,
    system_config: Path | None,
    network_config: Path | None,
    memory_config: Path | None,
    comm_group_file: str | None,
    system_given: bool,
) -> tuple[Any, str | None]:
    """ASTRA-sim's inputs for the trace at ``path`` and the system its kernel times were
    written for (None: none, refused unless ``system_given``)."""
    from stg.core.workload import SYSTEM_METADATA
    from stg.perf.astra_sim import FILE_SUFFIXES
    from stg.perf.simulator import SimulatorInputs
    from stg.trace.reader import detect_format, read_metadata
    from stg.trace.validate import check_rank_set, find_rank_files, locate_comm_groups

    files, default_group = find_rank_files(path)
    check_rank_set(files)
    present = [f for f in files if f is not None]
    first = present[0]
    suffix = ".0.et"
    if not first.name.endswith(suffix) or detect_format(first) != ASTRA_SIM_FORMAT:
        raise UserError(
            f"{first}: ASTRA-sim reads Chakra v0.0.4 rank files named <prefix>.<rank>.et; "
            "allowed: such a trace (stg convert --to v0.0.4, or stg generate's default format)"
        )
    prefix = str(first)[: -len(suffix)]
    recorded = (read_metadata(first).get("attrs") or {}).get(SYSTEM_METADATA)
    if not isinstance(recorded, str) or not recorded:
        recorded = None
    if recorded is None and not system_given:
        raise UserError(
            f"{path}: the trace carries no kernel times (it was generated without --system), "
            "so ASTRA-sim would replay each compute node in 1 ns; generate it with --system S "
            "--astra_sim_configs, or give --system for stg predict's side"
        )
    groups, _ = locate_comm_groups(files, default_group, comm_group_file)
    if groups is not None and not groups.is_file():
        groups = None
    stem = Path(prefix)
    if groups is not None:
        stem = groups.with_suffix("")
    configs: dict[str, Path] = {}
    given = {"system": system_config, "network": network_config, "memory": memory_config}
    for kind, value in given.items():
        option = f"--{kind}-config"
        found = value if value is not None else Path(f"{stem}{FILE_SUFFIXES[kind]}")
        if not found.is_file():
            why = "no such file" if value is not None else "missing"
            raise UserError(
                f"{option} {found}: {why}; allowed: the file that stg generate --system S "
                f"--astra_sim_configs writes beside the traces, or give {option} FILE"
            )
        configs[kind] = found.absolute()
    inputs = SimulatorInputs(
        workload=str(Path(prefix).absolute()),
        comm_group=None if groups is None else str(groups.absolute()),
        system=str(configs["system"]),
        network=str(configs["network"]),
        memory=str(configs["memory"]),
        world_size=len(files),
    )
    return inputs, recorded


def _print_comparison(comparison: dict[str, Any], source: str) -> None:
    """The side-by-side tables on stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    times = comparison["iteration_time_s"]
    summary = Table(
        title=f"ASTRA-sim beside stg predict: {source} on {comparison['system']} "
        f"({comparison['world_size']} ranks)",
        title_justify="left",
    )
    for name in ("", "stg predict", "ASTRA-sim", "ASTRA-sim / stg"):
        summary.add_column(name, justify="left" if not name else "right")
    ratio = times["ratio"]
    summary.add_row(
        "iteration time",
        format_seconds(times["stg"]),
        format_seconds(times["astra_sim"]),
        "-" if ratio is None else f"{ratio:.3f}",
    )
    print_table(console, summary)
    ranks = Table(
        title="per rank (stg's rows, each standing for identical ranks; exposed: not hidden "
        "by compute)",
        title_justify="left",
    )
    for name in (
        "rank",
        "ranks",
        "compute stg",
        "compute ASTRA-sim",
        "exposed stg",
        "exposed ASTRA-sim",
        "finish stg",
        "finish ASTRA-sim",
    ):
        ranks.add_column(name, justify="right")
    for row in comparison["ranks"]:
        ours, theirs = row["stg"], row["astra_sim"] or {}
        ranks.add_row(
            str(row["rank"]),
            str(row["ranks"]),
            format_seconds(ours["compute_s"]),
            _maybe_seconds(theirs.get("compute_s")),
            format_seconds(ours["exposed_s"]),
            _maybe_seconds(theirs.get("exposed_communication_s")),
            format_seconds(ours["finish_s"]),
            _maybe_seconds(theirs.get("finish_s")),
        )
    print_table(console, ranks)
    finishes = [r["finish_s"] for r in comparison["astra_sim"]["ranks"]]
    console.print(
        f"ASTRA-sim: all {len(finishes)} ranks finished, between "
        f"{format_seconds(min(finishes))} and {format_seconds(max(finishes))}",
        markup=False,
    )


def _maybe_seconds(value: float | None) -> str:
    return "-" if value is None else format_seconds(value)


def register(parent: typer.Typer) -> None:
    """Add ``simulate`` to another Typer app."""
    parent.command("simulate")(simulate)
