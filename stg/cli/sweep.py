"""``stg sweep [SPEC]``: predict every configuration of a design space and tabulate them.

SPEC is a TOML or YAML file of options (a scalar is fixed, a list or a range is swept); the
same ranges can be given inline (``--dp 1,2,4,8 --tp 1..8 --pp pow2:1..16``), and win over
the file. See docs/exploration.md.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import typer

from stg.cli import err_console, get_registry
from stg.cli._shared import option_names, print_table, progress_bar
from stg.errors import UserError

app = typer.Typer(add_completion=False)


def _option_parameters() -> list[inspect.Parameter]:
    from stg.explore.space import option_fields

    params = []
    for name in option_fields():
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=typer.Option(
                    None,
                    *option_names(name),
                    help="Values: V, V1,V2,..., A..B or pow2:A..B.",
                    show_default=False,
                    metavar="VALUES",
                    rich_help_panel="Swept options (any option of stg generate)",
                ),
                annotation=Optional[str],  # noqa: UP045 (typer needs a runtime type object)
            )
        )
    return params


def _own_parameters() -> list[inspect.Parameter]:
    kw = inspect.Parameter.KEYWORD_ONLY

    def opt(name: str, default: Any, *decls: str, help: str, annotation: Any, **extra: Any):
        return inspect.Parameter(
            name,
            kw,
            default=typer.Option(default, *decls, help=help, **extra),
            annotation=annotation,
        )

    return [
        inspect.Parameter(
            "spec",
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=typer.Argument(
                None, help="A TOML or YAML file of options.", show_default=False, metavar="[SPEC]"
            ),
            annotation=Optional[str],  # noqa: UP045
        ),
        opt(
            "system",
            None,
            "--system",
            "-s",
            help="Systems: presets ({allowed:systems}) or system files, comma-separated "
            "(default: a100-80g).",
            annotation=Optional[str],  # noqa: UP045
            metavar="NAMES",
        ),
        opt(
            "predictor",
            "analytical",
            "--predictor",
            help="analytical (closed form, fast) or time (the DAG replay), or a plugin's.",
            annotation=str,
            metavar="NAME",
        ),
        opt(
            "out",
            "sweep",
            "--out",
            "-o",
            help="Directory of the results (rows.jsonl, results.csv, results.parquet).",
            annotation=str,
            metavar="DIR",
        ),
        opt(
            "engine",
            "local",
            "--engine",
            help="local (a process pool of --jobs workers) or dask (--scheduler).",
            annotation=str,
            metavar="local|dask",
        ),
        opt(
            "jobs",
            0,
            "--jobs",
            "-j",
            help="Local worker processes (0: every core).",
            annotation=int,
        ),
        opt(
            "scheduler",
            None,
            "--scheduler",
            help="Dask scheduler: tcp://HOST:PORT, or local:N to start a LocalCluster of N "
            "workers.",
            annotation=Optional[str],  # noqa: UP045
            metavar="ADDRESS",
        ),
        opt(
            "simulate",
            None,
            "--simulate",
            help="Also write each configuration's traces and run this command on them; "
            "{prefix}, {ranks}, {comm_group} and {dir} are replaced. 'astra-sim': run "
            "$ASTRA_SIM_BIN as stg simulate does (kernel times and ASTRA-sim's inputs for the "
            "row's system; columns sim_finish_s, sim_exposed_communication_s, sim_ratio).",
            annotation=Optional[str],  # noqa: UP045
            metavar="CMD",
        ),
        opt(
            "metric",
            None,
            "--metric",
            help="NAME=REGEX: a figure of the simulator's output (the first group, or the "
            "match) as column metric_NAME; repeatable.",
            annotation=Optional[list[str]],  # noqa: UP045
            metavar="NAME=REGEX",
        ),
        opt(
            "sim_timeout",
            600.0,
            "--sim-timeout",
            help="Seconds a simulator run may take.",
            annotation=float,
        ),
        opt(
            "keep",
            False,
            "--keep",
            help="Keep the traces of --simulate under DIR/traces/<id>.",
            annotation=bool,
        ),
        opt(
            "plot",
            False,
            "--plot",
            help="Write DIR/sweep.html (plotly) and DIR/sweep.png (matplotlib): time against "
            "memory with the Pareto front, MFU against each swept option.",
            annotation=bool,
        ),
        opt(
            "calibration",
            None,
            "--calibration",
            help="A calibration table of the system's device (stg bench calibrate): the "
            "predictor (one that takes it: time) uses its measured kernels first. One "
            "--system only.",
            annotation=Optional[str],  # noqa: UP045
            metavar="FILE",
        ),
        opt("as_json", False, "--json", help="Print the summary as JSON.", annotation=bool),
    ]


def _sweep_calibration(
    path: str | None, systems: Mapping[str, Any], registry: Any, predictor: str
) -> Any:
    """The table of ``--calibration`` for a sweep: one system, a predictor that takes it."""
    if path is None:
        return None
    from stg.cli._shared import load_calibration_option

    if len(systems) != 1:
        raise UserError(
            f"--calibration holds one device's measured kernels; the sweep has {len(systems)} "
            "systems: sweep one --system with it"
        )
    record = registry.predictors.get(predictor)
    takes = [
        fn
        for fn in (record.predict, record.predict_options)
        if fn is not None and "calibration" in inspect.signature(fn).parameters
    ]
    if not takes or (record.predict_options is not None and record.predict_options not in takes):
        raise UserError(
            f"--calibration: predictor {predictor!r} does not take a calibration table; "
            "allowed: --predictor time"
        )
    return load_calibration_option(path, next(iter(systems.values())))


def sweep(**values: Any) -> None:
    """Predict every configuration of a design space; write a results table."""
    from stg.explore.space import SYSTEM_KEY, config_id, enumerate_configs, load_spec, make_spec
    from stg.explore.sweep import (
        ASTRA_SIM,
        Context,
        Simulation,
        check_engine,
        need,
        parse_metrics,
        run_sweep,
    )
    from stg.perf.system import load_system
    from stg.trace.parallel import resolve_jobs

    spec_path = values.pop("spec")
    system_values = values.pop("system")
    predictor = values.pop("predictor")
    out = Path(values.pop("out"))
    engine = values.pop("engine")
    jobs = values.pop("jobs")
    scheduler = values.pop("scheduler")
    simulate = values.pop("simulate")
    metrics = parse_metrics(values.pop("metric") or [])
    sim_timeout = values.pop("sim_timeout")
    keep = values.pop("keep")
    plot = values.pop("plot")
    as_json = values.pop("as_json")
    calibration_file = values.pop("calibration")
    check_engine(engine, scheduler)
    if metrics and simulate is None:
        raise UserError("--metric needs --simulate")
    if keep and simulate is None:
        raise UserError("--keep needs --simulate")
    if sim_timeout <= 0:
        raise UserError(f"--sim-timeout {sim_timeout}: must be positive")
    binary = None
    if simulate == ASTRA_SIM:
        from stg.perf.simulator import resolve_binary

        binary = resolve_binary(None)
    elif simulate is not None:
        _check_template(simulate)
    if plot:
        need("plotly", "--plot")
        need("matplotlib", "--plot")
    need("pyarrow", "the Parquet results table")
    jobs = resolve_jobs(jobs)
    registry = get_registry()
    registry.predictors.get(predictor)
    file_values = load_spec(spec_path) if spec_path is not None else {}
    inline = {k: v for k, v in values.items() if v is not None}
    if system_values is not None:
        inline[SYSTEM_KEY] = system_values
    spec = make_spec(file_values, inline)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: not a directory")
    systems = {name: load_system(name) for name in spec.axes[SYSTEM_KEY]}
    calibration = _sweep_calibration(calibration_file, systems, registry, predictor)
    capacity = {name: s.capacity for name, s in systems.items()}
    configs, invalid = enumerate_configs(spec, registry, capacity)
    system_data = {name: s.as_dict() for name, s in systems.items()}
    run = {"predictor": predictor, "simulate": simulate, "metrics": metrics}
    if binary is not None:
        run["astra_sim"] = binary
    if calibration is not None:  # rows priced with measured kernels are other rows
        run["calibration"] = calibration.as_dict()
    tasks = []
    option_rows = {}
    for config in configs:
        ident = config_id(config, system_data[config.system], run)
        tasks.append((ident, config.index, config.options, config.system))
        option_rows[ident] = config.option_values()
    from typer._click.globals import get_current_context

    from stg.cli import _plugins_of

    context = Context(
        predictor=predictor,
        systems=system_data,
        calibration=calibration,
        plugins=_plugins_of(get_current_context()),
        simulation=None
        if simulate is None
        else Simulation(
            simulate,
            metrics,
            sim_timeout,
            str((out / "traces").absolute()) if keep else None,
            binary,
        ),
    )
    console = err_console()
    first = (
        [*spec.swept, *(k for k in option_rows[tasks[0][0]] if k not in spec.swept)]
        if tasks
        else []
    )
    first = [c for c in first if c != SYSTEM_KEY]
    first.insert(0, SYSTEM_KEY)
    with progress_bar(console) as update:
        try:
            result = run_sweep(
                tasks,
                option_rows,
                context,
                out,
                engine=engine,
                jobs=jobs,
                scheduler=scheduler,
                first_columns=first,
                progress=lambda done, total: update("configurations", done, total),
            )
        except OSError as exc:
            raise UserError(f"cannot write {exc.filename or out}: {exc.strerror or exc}") from None
    files = list(result.files)
    if plot:
        from stg.explore.plots import plot_sweep

        files.extend(plot_sweep(result.rows, spec.swept, out))
    _report(console, spec, configs, invalid, result, files, as_json)


def _check_template(command: str) -> None:
    try:
        command.format(prefix="p", ranks=1, comm_group="g", dir="d")
    except (KeyError, IndexError, ValueError) as exc:
        raise UserError(
            f"--simulate {command!r}: unknown placeholder {exc}; allowed: {{prefix}}, {{ranks}}, "
            "{comm_group}, {dir} (write {{ and }} for braces)"
        ) from None


def _report(
    console: Any,
    spec: Any,
    configs: list[Any],
    invalid: Any,
    result: Any,
    files: list[Path],
    as_json: bool,
) -> None:
    from rich.console import Console
    from rich.table import Table

    ok = [r for r in result.rows if r.get("status") == "ok" and r.get("iteration_time_s")]
    fits = [r for r in ok if r.get("fits")]
    best = min(fits or ok, key=lambda r: r["iteration_time_s"], default=None)
    summary = {
        "configurations": spec.size,
        "valid": len(configs),
        "invalid": sum(invalid.values()),
        "invalid_by_reason": dict(sorted(invalid.items(), key=lambda kv: (-kv[1], kv[0]))),
        "evaluated": result.evaluated,
        "resumed": result.resumed,
        "errors": sum(1 for r in result.rows if r.get("status") != "ok"),
        "fit_in_memory": len(fits),
        "files": [str(f) for f in files],
        "best": None
        if best is None
        else {k: best.get(k) for k in ("config", "system", *spec.swept, "iteration_time_s", "mfu")},
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2, sort_keys=True, default=str))
        return
    out = Console(highlight=False)
    out.print(
        f"{spec.size:,} configurations: {len(configs):,} valid ({result.evaluated:,} evaluated, "
        f"{result.resumed:,} already done), {summary['invalid']:,} invalid, "
        f"{summary['errors']:,} failed; {len(fits):,} fit in memory"
    )
    if invalid:
        table = Table(title="invalid configurations by reason", title_justify="left")
        table.add_column("configurations", justify="right")
        table.add_column("reason")
        for reason, count in summary["invalid_by_reason"].items():
            table.add_row(f"{count:,}", reason)
        print_table(out, table)
    if best is not None:
        keys = ("system", *(k for k in spec.swept if k != "system"))
        chosen = ", ".join(f"{k}={best.get(k)}" for k in keys if k in best)
        out.print(
            f"fastest{' that fits' if fits else ''}: {chosen}: "
            f"{best['iteration_time_s']:.4g} s, MFU {100 * (best.get('mfu') or 0):.1f} %"
        )
    for path in files:
        out.print(f"wrote {path}")


sweep.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    _own_parameters() + _option_parameters(), return_annotation=None
)
sweep.__annotations__ = {p.name: p.annotation for p in _own_parameters() + _option_parameters()} | {
    "return": None
}
app.command("sweep")(sweep)
