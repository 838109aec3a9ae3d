"""``stg plan precision``: search the fastest per-op precision plan that fits a memory budget.

Takes the generation options of ``stg generate`` (same names and defaults), predicts the
workload with each candidate plan (see :mod:`stg.explore.precision_search` for the greedy
rule), prints the predicted iteration time and peak memory per GPU before and after, and writes
the plan as the JSON file that ``--precision_plan`` reads.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Optional

import typer

from stg.cli import err_console, get_registry
from stg.cli._shared import (
    calibration_parameter,
    load_calibration_option,
    option_parameters,
    options_from_cli,
    print_table,
    progress_bar,
    system_parameter,
)
from stg.errors import UserError

app = typer.Typer(
    add_completion=False,
    help="Search plans: stg plan precision finds a per-op precision plan.",
    no_args_is_help=True,
)

EXCLUDED = frozenset({"format", "output_dir", "output_name", "chakra_schema_version", "precision"})
DEFAULT_OUT = "precision_plan.json"
KERNEL_PLUGIN = "plugins/stg-int8-kernels"
"""The example kernel distribution in this repository (int8 on the a100, h100, t4, a10 and l4
presets, fp8 on h100-80g and l4-24g)."""


def _generation_parameters() -> list[inspect.Parameter]:
    return [p for p in option_parameters() if p.name not in EXCLUDED]


def _own_parameters() -> list[inspect.Parameter]:
    kw = inspect.Parameter.KEYWORD_ONLY
    text = Optional[str]  # noqa: UP045 (typer needs a runtime type object)
    return [
        inspect.Parameter(
            "memory_budget",
            kw,
            default=typer.Option(
                None,
                "--memory-budget",
                "--memory_budget",
                help="Peak memory per GPU the plan must fit, e.g. 40GiB, 40GB or 4e10 (bytes) "
                "(default: the system's HBM capacity).",
                metavar="SIZE",
                show_default=False,
            ),
            annotation=text,
        ),
        system_parameter(
            "System preset ({allowed:systems}) or a system "
            "JSON file; a hybrid one (device groups) places the ranks on its groups."
        ),
        inspect.Parameter(
            "dtypes",
            kw,
            default=typer.Option(
                "bf16,fp8,int8",
                "--dtypes",
                help="Precisions an op may be lowered to (fp8 and int8 need a registered "
                "kernel for the op's class on the system).",
                metavar="LIST",
            ),
            annotation=str,
        ),
        inspect.Parameter(
            "target_time",
            kw,
            default=typer.Option(
                None,
                "--target-time",
                "--target_time",
                help="Hybrid --system: the iteration time the plan should reach, e.g. 150ms or "
                "0.15 (seconds) (default: the all---dtype plan's time on the fastest device group "
                "alone).",
                metavar="TIME",
                show_default=False,
            ),
            annotation=text,
        ),
        inspect.Parameter(
            "sensitivity",
            kw,
            default=typer.Option(
                None,
                "--sensitivity",
                help='Hybrid --system: per-op sensitivity scores, JSON {"ops": {"fc1": '
                '{"int8": 0.02}, "fc2": 0.5}} (e.g. QSync\'s variance indicator measured in '
                "your training; default: the dtype's rounding error, the same for every op).",
                metavar="FILE",
                show_default=False,
            ),
            annotation=text,
        ),
        inspect.Parameter(
            "exact",
            kw,
            default=typer.Option(
                False,
                "--exact",
                help="Hybrid --system: predict every per-group plan (small op counts; at most "
                "4096 plans) instead of the greedy search.",
            ),
            annotation=bool,
        ),
        calibration_parameter(
            "A calibration table of the system's device (stg bench calibrate): plans are "
            "timed with its measured kernels first, and an op may be lowered to a dtype "
            "(fp8, int8) whose kernels the table measured. Not for a hybrid --system."
        ),
        inspect.Parameter(
            "out",
            kw,
            default=typer.Option(
                DEFAULT_OUT, "--out", "-o", help="Write the plan to this file.", metavar="FILE"
            ),
            annotation=str,
        ),
        inspect.Parameter(
            "as_json",
            kw,
            default=typer.Option(False, "--json", help="Print the result as JSON."),
            annotation=bool,
        ),
    ]


def _parse_dtypes(text: str) -> tuple[str, ...]:
    from stg.perf.system import DTYPES, normalize_dtype

    names = [d.strip() for d in text.split(",") if d.strip()]
    if not names:
        raise UserError(f"--dtypes must list precisions; allowed: {', '.join(DTYPES)}")
    try:
        dtypes = tuple(dict.fromkeys(normalize_dtype(d) for d in names))
    except UserError as exc:
        raise UserError(f"--dtypes: {exc}") from None
    unplanned = [d for d in dtypes if d not in DTYPES]
    if unplanned:  # fp4, fp6: what serving weight formats compute in, not plan entries
        raise UserError(
            f"--dtypes: {unplanned[0]} is not a plan dtype; allowed: {', '.join(DTYPES)}"
        )
    return dtypes


def precision(**values: Any) -> None:
    """Find the fastest per-op precision plan whose predicted peak memory fits the budget."""
    from stg.core import pipeline as gen
    from stg.core.precision import dump_plan
    from stg.core.quantities import parse_size
    from stg.explore.precision_search import search_precision
    from stg.perf.system import load_system
    from stg.trace.writer import write_file_atomically

    budget_text = values.pop("memory_budget")
    target_text = values.pop("target_time")
    sensitivity_file = values.pop("sensitivity")
    exact = values.pop("exact")
    system_spec = values.pop("system")
    dtypes = _parse_dtypes(values.pop("dtypes"))
    out = values.pop("out")
    as_json = values.pop("as_json")
    if not out:
        raise UserError("--out must name a file")
    system = load_system(system_spec)
    calibration = load_calibration_option(values.pop("calibration"), system)
    registry = get_registry()
    from stg.perf.hybrid import is_hybrid

    if is_hybrid(system):
        result = _hybrid(
            system, registry, values, budget_text, target_text, sensitivity_file, dtypes, exact
        )
        _write_and_report(result, system.name, out, as_json)
        return
    if target_text is not None or sensitivity_file is not None or exact:
        option = (
            "--target-time"
            if target_text is not None
            else "--sensitivity"
            if sensitivity_file is not None
            else "--exact"
        )
        raise UserError(
            f"{option} applies to a hybrid --system (a system file with device groups); "
            f"{system.name!r} has one device kind"
        )
    budget = (
        float(system.hbm_capacity)
        if budget_text is None
        else parse_size(budget_text, "--memory-budget")
    )
    options = options_from_cli(values)
    gen.validate_options(options, registry)
    console = err_console()
    hint = kernel_hint(registry, system.name, dtypes)
    try:
        with progress_bar(console) as progress:
            result = search_precision(
                options,
                registry,
                system,
                budget=budget,
                dtypes=dtypes,
                progress=progress,
                calibration=calibration,
            )
    except UserError as exc:
        if hint is None:
            raise
        raise UserError(f"{exc}; {hint}") from None
    text = dump_plan(result.best.plan)
    path = write_file_atomically(out, lambda stream: stream.write(text.encode()))
    if as_json:
        data = result.as_dict()
        data["system"] = system.name
        data["out"] = str(out)
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        print_result(result, system.name)
    if hint is not None:
        typer.echo(f"hint: {hint}", err=True)
    console.print(f"plan written to {path}")


def _hybrid(
    system: Any,
    registry: Any,
    values: dict[str, Any],
    budget_text: str | None,
    target_text: str | None,
    sensitivity_file: str | None,
    dtypes: tuple[str, ...],
    exact: bool,
) -> Any:
    """The hybrid search (:mod:`stg.explore.hybrid_search`) for these command-line values."""
    from stg.core import pipeline as gen
    from stg.core.quantities import parse_duration, parse_size
    from stg.explore.hybrid_search import (
        exact_hybrid_precision,
        load_sensitivity,
        search_hybrid_precision,
    )

    budget = None if budget_text is None else parse_size(budget_text, "--memory-budget")
    target = None if target_text is None else parse_duration(target_text, "--target-time")
    sensitivity = None if sensitivity_file is None else load_sensitivity(sensitivity_file)
    from stg.perf.hybrid import placed

    options = placed(options_from_cli(values), system)
    gen.validate_options(options, registry)
    console = err_console()
    with progress_bar(console) as progress:
        search = exact_hybrid_precision if exact else search_hybrid_precision
        result = search(
            options,
            registry,
            system,
            target_s=target,
            dtypes=dtypes,
            sensitivity=sensitivity,
            budget=budget,
            progress=progress,
        )
    return result


def _write_and_report(result: Any, system: str, out: str, as_json: bool) -> None:
    from stg.core.precision import dump_plan
    from stg.trace.writer import write_file_atomically

    text = dump_plan(result.best.plan)
    path = write_file_atomically(out, lambda stream: stream.write(text.encode()))
    if as_json:
        data = result.as_dict()
        data["plan"] = json.loads(text)
        data["system"] = system
        data["out"] = str(out)
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        print_hybrid_result(result, system)
    err_console().print(f"plan written to {path}")


def print_hybrid_result(result: Any, system: str) -> None:
    """Rich tables: per group before / after, and the changes in the order applied."""
    from rich.console import Console
    from rich.table import Table

    from stg.explore.precision_search import format_bytes

    def seconds(value: float) -> str:
        return f"{value:.4g} s" if value >= 1 else f"{value * 1e3:.4g} ms"

    console = Console(highlight=False)
    table = Table(title=f"per-group precision plan on {system}", title_justify="left")
    for column in ("plan", "iteration time", "straggler", "group", "local time", "peak", "fits"):
        table.add_column(column, justify="right")
    for label, ev in (("default", result.baseline), ("found", result.best)):
        for k, group in enumerate(result.capacity):
            fits = "yes" if ev.peak_bytes[group] <= result.capacity[group] else "NO"
            table.add_row(
                label if k == 0 else "",
                seconds(ev.time_s) if k == 0 else "",
                ev.straggler if k == 0 else "",
                group,
                seconds(ev.local_s[group]),
                f"{format_bytes(ev.peak_bytes[group])} of {format_bytes(result.capacity[group])}",
                fits,
            )
    print_table(console, table)
    met = "met" if result.met else "NOT met (no further change saves time)"
    measure = "proxy: dtype rounding error" if result.proxy else "sensitivity file"
    console.print(
        f"target {seconds(result.target_s)} ({result.target_source}): {met}; lost precision "
        f"{result.lost:.4g} ({measure}); "
        f"{len(result.steps)} change(s), {result.evaluations} plans evaluated"
    )
    if result.steps:
        steps = Table(title="changes, in the order applied", title_justify="left")
        for column in ("group", "op", "precision", "iteration time", "lost precision"):
            steps.add_column(column, justify="right")
        for step in result.steps:
            steps.add_row(
                step.group,
                step.op,
                f"{step.previous} -> {step.dtype}",
                seconds(step.time_s),
                f"{step.lost:.4g}",
            )
        print_table(console, steps)


def kernel_hint(registry: Any, system: str, dtypes: tuple[str, ...]) -> str | None:
    """Which plugin would help, when no registered kernel runs any of the requested fp8/int8
    dtypes on ``system`` (without one an op is never lowered to them); else None."""
    from stg.perf.kernels import QUANTIZED_DTYPES, kernel_table

    table = kernel_table(list(registry.kernels), system)
    native = {dtype for _, dtype in table.kernels}
    missing = [d for d in dtypes if d in QUANTIZED_DTYPES]
    if not missing or native & set(missing):
        return None
    wanted = "/".join(missing)
    return (
        f"no kernel plugin runs {wanted} on {system}, so no op is lowered to {wanted}; install "
        f"one: the example distribution {KERNEL_PLUGIN} (pip install -e {KERNEL_PLUGIN}; "
        f"int8 on the a100, h100, t4, a10 and l4 presets, fp8 on h100-80g and l4-24g), or any "
        f"plugin registering stg_register_kernels for {wanted}"
    )


precision.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    _own_parameters() + _generation_parameters(), return_annotation=None
)
precision.__annotations__ = {
    p.name: p.annotation for p in _own_parameters() + _generation_parameters()
} | {"return": None}
app.command("precision")(precision)


def print_result(result: Any, system: str) -> None:
    """Rich tables on stdout: before / after, and the changes in the order applied."""
    from rich.console import Console
    from rich.table import Table

    from stg.explore.precision_search import format_bytes

    def seconds(value: float) -> str:
        return f"{value:.4g} s" if value >= 1 else f"{value * 1e3:.4g} ms"

    console = Console(highlight=False)
    table = Table(
        title=f"precision plan on {system} (budget {format_bytes(result.budget)} per GPU)",
        title_justify="left",
    )
    for column in ("plan", "iteration time", "peak memory", "fits"):
        table.add_column(column, justify="right")
    for label, ev in (("default", result.baseline), ("found", result.best)):
        fits = "yes" if ev.peak_bytes <= result.budget else "NO"
        table.add_row(label, seconds(ev.time_s), format_bytes(ev.peak_bytes), fits)
    print_table(console, table)
    console.print(
        f"predicted speedup {result.speedup:.3f}x; "
        f"{len(result.steps)} change(s), {result.evaluations} plans evaluated"
    )
    if result.steps:
        steps = Table(title="changes, in the order applied", title_justify="left")
        for column in ("op", "precision", "iteration time", "peak memory"):
            steps.add_column(column, justify="right")
        for step in result.steps:
            steps.add_row(
                step.op,
                f"{step.previous} -> {step.dtype}",
                seconds(step.time_s),
                format_bytes(step.peak_bytes),
            )
        print_table(console, steps)
    elif not result.candidates:
        console.print("no candidate changes: no registered kernel runs these ops in --dtypes")
