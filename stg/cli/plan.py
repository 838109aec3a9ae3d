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
        system_parameter("System preset (a100-80g, h100-80g, h200-141g) or a system JSON file."),
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
        return tuple(dict.fromkeys(normalize_dtype(d) for d in names))
    except UserError as exc:
        raise UserError(f"--dtypes: {exc}") from None


def precision(**values: Any) -> None:
    """Find the fastest per-op precision plan whose predicted peak memory fits the budget."""
    from stg.core import pipeline as gen
    from stg.core.precision import dump_plan
    from stg.explore.precision_search import parse_size, search_precision
    from stg.perf.system import load_system
    from stg.trace.writer import write_file_atomically

    budget_text = values.pop("memory_budget")
    system_spec = values.pop("system")
    dtypes = _parse_dtypes(values.pop("dtypes"))
    out = values.pop("out")
    as_json = values.pop("as_json")
    if not out:
        raise UserError("--out must name a file")
    system = load_system(system_spec)
    budget = float(system.hbm_capacity) if budget_text is None else parse_size(budget_text)
    registry = get_registry()
    options = options_from_cli(values)
    gen.validate_options(options, registry)
    console = err_console()
    hint = kernel_hint(registry, system.name, dtypes)
    try:
        with progress_bar(console) as progress:
            result = search_precision(
                options, registry, system, budget=budget, dtypes=dtypes, progress=progress
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
        f"int8 on a100, h100, t4, a10 and l4 presets, fp8 on h100-80g and l4-24g), or any plugin registering "
        f"stg_register_kernels for {wanted}"
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
