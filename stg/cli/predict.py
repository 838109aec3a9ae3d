"""``stg predict``: iteration time and memory of a workload on a system.

The workload is either generated in memory from the options of ``stg generate`` (same names,
same defaults) or read from a trace on disk (``stg predict out/``). ``--system`` names a
preset (``a100-80g``, ``h100-80g``) or a JSON system file (see :mod:`stg.system`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import typer

from stg.cli import err_console, get_registry
from stg.errors import UserError

app = typer.Typer(add_completion=False)

OUTPUT_FIELDS = frozenset({"format", "output_dir", "output_name", "chakra_schema_version"})
BUILTIN_ALL = ("time", "memory")


def _generation_parameters() -> list[inspect.Parameter]:
    from stg.cli.generate import option_parameters

    return [p for p in option_parameters() if p.name not in OUTPUT_FIELDS]


def _own_parameters() -> list[inspect.Parameter]:
    from stg.cli.generate import system_parameter

    kw = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter(
            "path",
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=typer.Argument(
                None,
                help="A trace to read (directory, prefix or rank file); omit it to generate "
                "the workload from the options below.",
                show_default=False,
                metavar="[PATH]",
            ),
            annotation=Optional[str],  # noqa: UP045 (typer needs a runtime type object)
        ),
        system_parameter("System preset (a100-80g, h100-80g) or a system JSON file."),
        inspect.Parameter(
            "predictor",
            kw,
            default=typer.Option(
                "all",
                "--predictor",
                help="A registered predictor (time, memory, ...) or all (time and memory).",
                metavar="NAME",
            ),
            annotation=str,
        ),
        inspect.Parameter(
            "as_json",
            kw,
            default=typer.Option(False, "--json", help="Print the report as JSON."),
            annotation=bool,
        ),
        inspect.Parameter(
            "timeline",
            kw,
            default=typer.Option(
                None,
                "--timeline",
                help="Write a Chrome/Perfetto trace of the simulated timeline to this file.",
                metavar="FILE",
            ),
            annotation=Optional[str],  # noqa: UP045
        ),
    ]


# -- inputs -----------------------------------------------------------------------------------


def _trace_input(path: str) -> tuple[dict[int, list[Any]], dict[int, tuple[int, ...]], dict]:
    """Nodes per rank, comm groups and (if recorded) the generation options of a trace."""
    from stg.reader import iter_nodes, read_metadata
    from stg.validate import find_rank_files, read_comm_groups

    files, group_path = find_rank_files(path)
    missing = [r for r, f in enumerate(files) if f is None]
    if missing:
        raise UserError(f"trace {path!r} lacks the rank files of ranks {missing[:8]}")
    groups: dict[int, tuple[int, ...]] = {}
    if group_path is not None and group_path.is_file():
        groups = read_comm_groups(group_path)
    nodes = {rank: list(iter_nodes(file)) for rank, file in enumerate(files) if file}
    options: dict[str, Any] = {}
    attrs = read_metadata(files[0]).get("attrs") or {}  # type: ignore[arg-type]
    raw = attrs.get("options")
    if isinstance(raw, str):
        try:
            decoded = json.loads(raw)
        except json.JSONDecodeError:
            decoded = None
        if isinstance(decoded, dict):
            options = decoded
    elif isinstance(raw, Mapping):
        options = dict(raw)
    return nodes, groups, options


def _check_predictor_name(name: str, registry: Any) -> list[str]:
    if name == "all":
        return [n for n in BUILTIN_ALL if n in registry.predictors]
    registry.predictors.get(name)  # raises UnknownNameError listing the names
    return [name]


def _accepts(fn: Any, keyword: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _accepts_explicitly(fn: Any, keyword: str) -> bool:
    """Whether ``fn`` names the keyword parameter ``keyword`` (not just ``**kwargs``)."""
    try:
        return keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def run_predictors(
    names: list[str],
    registry: Any,
    system: Any,
    *,
    workload: Any = None,
    trace: tuple[dict[int, list[Any]], dict[int, tuple[int, ...]], dict] | None = None,
    timeline: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Run each named predictor on a generated workload or a trace; reports by name."""
    from stg.predictors import memory as memory_predictor
    from stg.predictors import time as time_predictor

    reports: dict[str, dict[str, Any]] = {}
    for name in names:
        predictor = registry.predictors.get(name)
        if workload is not None:
            kwargs: dict[str, Any] = {}
            if timeline is not None and _accepts(predictor.predict, "timeline"):
                kwargs["timeline"] = timeline
            if _accepts_explicitly(predictor.predict, "kernels"):
                kwargs["kernels"] = list(registry.kernels)
            reports[name] = predictor.predict(workload, system, **kwargs)
            continue
        assert trace is not None
        nodes, groups, options = trace
        if predictor.predict is time_predictor.predict_time:
            tokens = None
            if options.get("batch") and options.get("seq"):
                tokens = int(options["batch"]) * int(options["seq"])
            problem = time_predictor.problem_from_nodes(nodes, groups)
            reports[name] = time_predictor.predict_problem(
                problem,
                system,
                dtype=str(options.get("dtype") or "bf16"),
                tokens=tokens,
                timeline=timeline,
                kernels=list(registry.kernels),
            )
            reports[name]["simulated_ranks"] = len(problem.units)
        elif predictor.predict is memory_predictor.predict_memory:
            if not options:
                raise UserError(
                    "the memory predictor needs generation options; this trace does not record "
                    "them (give the options of stg generate instead of a trace)"
                )
            reports[name] = memory_predictor.predict_analytic(
                options, system, kernels=list(registry.kernels)
            )
        else:
            raise UserError(
                f"predictor {name!r} needs a generated workload; give the options of "
                "stg generate instead of a trace"
            )
    return reports


# -- the command ------------------------------------------------------------------------------


def predict(**values: Any) -> None:
    """Predict iteration time (and MFU, exposed communication, bubble) and peak memory."""
    from stg.cli.generate import options_from_cli, progress_bar
    from stg.system import load_system

    path = values.pop("path")
    system_spec = values.pop("system")
    predictor = values.pop("predictor")
    as_json = values.pop("as_json")
    timeline = values.pop("timeline")
    given = {k: v for k, v in values.items() if v is not None}
    registry = get_registry()
    system = load_system(system_spec)
    names = _check_predictor_name(predictor, registry)
    if timeline is not None:
        target = Path(timeline)
        if not target.parent.is_dir():
            raise UserError(f"--timeline {timeline}: directory {str(target.parent)!r} is missing")
    console = err_console()
    if path is not None:
        if given:
            raise UserError(
                "give either a trace PATH or generation options "
                f"(got both: {', '.join('--' + k for k in sorted(given))})"
            )
        reports = run_predictors(
            names, registry, system, trace=_trace_input(path), timeline=timeline
        )
        source = path
    else:
        from stg import generate as gen

        options = options_from_cli(values)
        gen.validate_options(options, registry)
        with progress_bar(console) as progress:
            workload = gen.build_workload(options, registry, progress=progress)
        reports = run_predictors(names, registry, system, workload=workload, timeline=timeline)
        source = f"{options.model} (generated)"
    if as_json:
        typer.echo(json.dumps(reports, indent=2, sort_keys=True))
        return
    print_reports(reports, source)


predict.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    _own_parameters() + _generation_parameters(), return_annotation=None
)
predict.__annotations__ = {
    p.name: p.annotation for p in _own_parameters() + _generation_parameters()
} | {"return": None}
app.command("predict")(predict)


def register(target: typer.Typer) -> None:
    """Add ``predict`` to another Typer app."""
    target.command("predict")(predict)


# -- rich report --------------------------------------------------------------------------------


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def print_reports(reports: Mapping[str, Mapping[str, Any]], source: str) -> None:
    """Rich tables of the time and memory reports (others as JSON) on stdout."""
    from rich.console import Console
    from rich.table import Table

    from stg.cli.generate import format_seconds as _seconds

    console = Console(highlight=False)
    for name, report in reports.items():
        kind = report.get("predictor")
        if kind == "time":
            summary = Table(
                title=f"time: {source} on {report['system']}",
                title_justify="left",
                show_header=False,
            )
            summary.add_column("what")
            summary.add_column("value", justify="right")
            summary.add_row("iteration time", _seconds(report["iteration_time_s"]))
            summary.add_row("MFU (model FLOPs)", f"{100 * report['mfu']:.1f} %")
            summary.add_row("HFU (with recompute)", f"{100 * report['hfu']:.1f} %")
            if "tokens_per_s" in report:
                summary.add_row("tokens per second", f"{report['tokens_per_s']:,.0f}")
            summary.add_row(
                "ranks (simulated)",
                f"{report['world_size']:,} ({report.get('simulated_ranks', '?')})",
            )
            console.print(summary)
            ranks = Table(
                title="per rank (each row stands for identical ranks)", title_justify="left"
            )
            for column in (
                "rank",
                "ranks",
                "stage",
                "compute",
                "exposed comm",
                "comm wait",
                "bubble",
            ):
                ranks.add_column(column, justify="right")
            for row in report["ranks"]:
                ranks.add_row(
                    str(row["rank"]),
                    str(row["ranks"]),
                    "-" if row["stage"] is None else str(row["stage"]),
                    _seconds(row["compute_s"]),
                    _seconds(row["exposed_communication_s"]),
                    _seconds(row["collective_wait_s"]),
                    _seconds(row["bubble_s"]),
                )
            console.print(ranks)
            path = report["critical_path"]
            totals: dict[str, float] = {}
            for run in path:
                totals[run["kind"]] = totals.get(run["kind"], 0.0) + run["end_s"] - run["start_s"]
            parts = ", ".join(f"{k} {_seconds(v)}" for k, v in sorted(totals.items()))
            console.print(f"critical path: {len(path)} runs of nodes; {parts}")
            if "timeline" in report:
                console.print(f"timeline written to {report['timeline']}")
        elif kind == "memory":
            table = Table(
                title=f"memory per rank in GiB on {report['system']} "
                f"(capacity {_gib(report['capacity_bytes'])} GiB)",
                title_justify="left",
            )
            for column in (
                "stage",
                "ranks",
                "weights",
                "gradients",
                "optimizer",
                "activations",
                "buffers",
                "peak",
                "fits",
            ):
                table.add_column(column, justify="right")
            for row in report["classes"]:
                table.add_row(
                    str(row["stage"]),
                    str(row["ranks"]),
                    _gib(row["weights"]),
                    _gib(row["gradients"]),
                    _gib(row["optimizer"]),
                    _gib(row["activations"]),
                    _gib(row["buffers"]),
                    _gib(row["peak"]),
                    "yes" if row["fits"] else "NO",
                )
            console.print(table)
        else:
            console.print(f"[bold]{name}[/bold]")
            console.print_json(json.dumps(report, sort_keys=True, default=str))
