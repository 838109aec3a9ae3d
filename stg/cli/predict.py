"""``stg predict``: iteration time and memory of a workload on a system.

The workload is either generated in memory from the options of ``stg generate`` (same names,
same defaults) or read from a trace on disk (``stg predict out/``). ``--system`` names a
preset (``a100-80g``, ``h100-80g``, ``h200-141g``) or a JSON system file (see
:mod:`stg.perf.system`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import typer

from stg.cli import err_console, get_registry
from stg.cli._shared import (
    check_workload_size,
    check_writable_file,
    max_nodes_parameter,
    option_parameters,
    options_from_cli,
    plan_warnings,
    print_reports,
    progress_bar,
    read_trace_input,
    run_predictors,
    system_parameter,
)
from stg.errors import UserError

app = typer.Typer(add_completion=False)

OUTPUT_FIELDS = frozenset({"format", "output_dir", "output_name", "chakra_schema_version"})
BUILTIN_ALL = ("time", "memory")


def _generation_parameters() -> list[inspect.Parameter]:
    return [p for p in option_parameters() if p.name not in OUTPUT_FIELDS]


def _own_parameters() -> list[inspect.Parameter]:
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
        system_parameter(
            "System preset ({allowed:systems}) or a system "
            "JSON file; a hybrid one (device groups) places the ranks on its groups."
        ),
        inspect.Parameter(
            "predictor",
            kw,
            default=typer.Option(
                "all",
                "--predictor",
                help="A registered predictor ({allowed:predictors}) or all (time and memory).",
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
        inspect.Parameter(
            "explain",
            kw,
            default=typer.Option(
                False,
                "--explain",
                help="Split the iteration time along its critical path: compute by kernel "
                "class, communication by collective and group size, waits.",
            ),
            annotation=bool,
        ),
        inspect.Parameter(
            "exact",
            kw,
            default=typer.Option(
                False,
                "--exact",
                help="Replay every micro-batch. By default a pipeline whose steady state is "
                "checked to repeat is replayed for its fill, one period and its drain, and the "
                "other periods are added (the same figures, faster); a trace PATH, --timeline "
                "and --explain always replay every micro-batch.",
            ),
            annotation=bool,
        ),
        inspect.Parameter(
            "jobs",
            kw,
            default=typer.Option(
                0,
                "--jobs",
                "-j",
                help="With a trace PATH: worker processes reading its rank files (default 0: "
                "every core); the prediction is the same.",
            ),
            annotation=int,
        ),
        inspect.Parameter(
            "comm_group_file",
            kw,
            default=typer.Option(
                None,
                "--comm_group_file",
                "--comm-group-file",
                help="With a trace PATH: its comm-group file (default: the one its metadata "
                "names, else <name>.json beside the rank files or, when that is absent, the only "
                "other comm-group JSON file there).",
                metavar="PATH",
            ),
            annotation=Optional[str],  # noqa: UP045
        ),
        max_nodes_parameter(),
        inspect.Parameter(
            "calibration",
            kw,
            default=typer.Option(
                None,
                "--calibration",
                help="A calibration table (stg bench calibrate): measured kernel times, then "
                "its fitted models, before the analytical model; or a stg bench comms result: "
                "its measured collectives replace the modelled ones of the same group size.",
                metavar="FILE",
            ),
            annotation=Optional[str],  # noqa: UP045
        ),
    ]


# -- inputs -----------------------------------------------------------------------------------


def _check_predictor_name(name: str, registry: Any) -> list[str]:
    if name == "all":
        return [n for n in BUILTIN_ALL if n in registry.predictors]
    registry.predictors.get(name)  # raises UnknownNameError listing the names
    return [name]


@contextmanager
def _os_errors() -> Iterator[None]:
    """A file that cannot be read or written is one ``error:`` line, not a traceback."""
    try:
        yield
    except OSError as exc:
        where = exc.filename if exc.filename is not None else "a file"
        raise UserError(f"cannot access {where}: {exc.strerror or exc}") from None


# -- the command ------------------------------------------------------------------------------


def predict(**values: Any) -> None:
    """Predict iteration time (and MFU, exposed communication, bubble) and peak memory."""
    from stg.perf.system import load_system

    path = values.pop("path")
    system_spec = values.pop("system")
    predictor = values.pop("predictor")
    as_json = values.pop("as_json")
    timeline = values.pop("timeline")
    calibration_file = values.pop("calibration")
    explain = values.pop("explain")
    exact = values.pop("exact")
    jobs = values.pop("jobs")
    comm_group_file = values.pop("comm_group_file")
    max_nodes = values.pop("max_nodes")
    if jobs:  # 0 (every core) needs no check, nor the worker pool's imports
        from stg.trace.parallel import resolve_jobs

        resolve_jobs(jobs)
    given = {k: v for k, v in values.items() if v is not None}
    registry = get_registry()
    system = load_system(system_spec)
    calibration = None
    if calibration_file is not None:
        from stg.perf.calibration import load_calibration, with_measured_comms

        calibration = load_calibration(calibration_file)
        system = with_measured_comms(system, calibration)
    names = _check_predictor_name(predictor, registry)
    if timeline is not None:
        check_writable_file("--timeline", Path(timeline))
    if path is not None:
        if given:
            raise UserError(
                "give either a trace PATH or generation options "
                f"(got both: {', '.join('--' + k for k in sorted(given))})"
            )
        if max_nodes is not None:
            raise UserError("--max-nodes limits a generated workload; a trace PATH is read as is")
        with _os_errors():
            trace = read_trace_input(path, jobs, comm_group_file)
            phase = trace[2].get("phase", "training")
            if phase != "training" and predictor == "all":
                # memory and serving figures need the per-rank facts of a generated workload
                typer.echo(
                    f"note: a phase={phase} trace gets the time report; give its generation "
                    "options instead of PATH for the serving and memory reports",
                    err=True,
                )
                names = ["time"]
            # the memory predictor builds the workload of the options a trace records where
            # the closed forms do not describe it: its plan warnings are warning: lines too
            with plan_warnings():
                reports = run_predictors(
                    names,
                    registry,
                    system,
                    trace=trace,
                    timeline=timeline,
                    calibration=calibration,
                    explain=explain,
                )
        source = path
        nodes = [] if calibration is None else [n for ns in trace[0].values() for n in ns]
        dtype = str(trace[2].get("dtype") or "bf16")
    else:
        if comm_group_file is not None:
            raise UserError("--comm_group_file names the comm-group file of a trace PATH")
        from stg.core.validation import validate_options
        from stg.perf.hybrid import placed

        options = placed(options_from_cli(values), system)
        validate_options(options, registry)
        if options.inference and predictor == "all" and "serving" in registry.predictors:
            names = [*names, "serving"]  # TTFT, time per output token, tokens/s
        workload = None
        # a calibration's coverage is counted over the workload's nodes: built for it too
        needed = any(registry.predictors.get(n).needs != "options" for n in names)
        # the predictors that take the options build their own workloads: their precision
        # plan warnings are printed as generate prints them, once each
        with plan_warnings():
            if needed or calibration is not None:
                check_workload_size(options, registry, max_nodes)
                from stg.core.pipeline import build_workload

                with progress_bar(err_console()) as progress:
                    workload = build_workload(options, registry, progress=progress)
            elif options.precision:  # the closed forms take a plan's patterns on trust
                from stg.core.pipeline import check_precision_plan  # (it imports sympy)

                check_precision_plan(options, registry)
            with _os_errors():
                reports = run_predictors(
                    names,
                    registry,
                    system,
                    options=options,
                    workload=workload,
                    timeline=timeline,
                    calibration=calibration,
                    explain=explain,
                    exact=exact,
                    max_nodes=max_nodes,
                )
        source = f"{options.model} (generated)"
        nodes = [] if workload is None else [n for rc in workload.rank_classes for n in rc.nodes]
        dtype = options.dtype
    if calibration is not None and "time" in reports:
        reports["time"]["calibration"] = _coverage(calibration, nodes, dtype)
    if as_json:
        typer.echo(json.dumps(reports, indent=2, sort_keys=True))
        return
    print_reports(reports, source)
    if calibration is not None and "time" in reports:
        c = reports["time"]["calibration"]
        share = c["flops_share"]
        typer.echo(
            f"calibration {calibration_file} ({c['device']}): of {c['nodes']} compute nodes, "
            f"{c['measured']} measured ({share['measured']:.0%} of FLOPs), {c['fitted']} "
            f"fitted ({share['fitted']:.0%}), {c['analytical']} analytical "
            f"({share['analytical']:.0%})"
        )


def _coverage(calibration: Any, nodes: list[Any], dtype: str) -> dict[str, Any]:
    """Which compute nodes the calibration table priced (see stg.perf.calibration.coverage)."""
    from stg.core.workload import NodeType
    from stg.perf.calibration import coverage

    compute = [n for n in nodes if n.type is NodeType.COMP]
    return coverage(calibration, compute, dtype)


_PARAMETERS = _own_parameters() + _generation_parameters()
predict.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    _PARAMETERS, return_annotation=None
)
predict.__annotations__ = {p.name: p.annotation for p in _PARAMETERS} | {"return": None}
app.command("predict")(predict)


def register(target: typer.Typer) -> None:
    """Add ``predict`` to another Typer app."""
    target.command("predict")(predict)
