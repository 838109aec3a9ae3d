"""``stg predict``: iteration time and memory of a workload on a system.

The workload is either generated in memory from the options of ``stg generate`` (same names,
same defaults) or read from a trace on disk (``stg predict out/``). ``--system`` names a
preset (``a100-80g``, ``h100-80g``) or a JSON system file (see :mod:`stg.perf.system`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import typer

from stg.cli import err_console, get_registry
from stg.cli._shared import (
    check_writable_file,
    option_parameters,
    options_from_cli,
    print_reports,
    progress_bar,
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
    from stg.trace.reader import iter_nodes, read_metadata
    from stg.trace.validate import find_rank_files, read_comm_groups

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
    given = {k: v for k, v in values.items() if v is not None}
    registry = get_registry()
    system = load_system(system_spec)
    names = _check_predictor_name(predictor, registry)
    if timeline is not None:
        check_writable_file("--timeline", Path(timeline))
    console = err_console()
    if path is not None:
        if given:
            raise UserError(
                "give either a trace PATH or generation options "
                f"(got both: {', '.join('--' + k for k in sorted(given))})"
            )
        with _os_errors():
            reports = run_predictors(
                names, registry, system, trace=_trace_input(path), timeline=timeline
            )
        source = path
    else:
        from stg.core import pipeline as gen

        options = options_from_cli(values)
        gen.validate_options(options, registry)
        with progress_bar(console) as progress:
            workload = gen.build_workload(options, registry, progress=progress)
        with _os_errors():
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
