"""``stg search``: the best parallel plans for a model on a number of GPUs of a system.

Plans are pruned with closed forms (divisibility, memory, a lower bound on time), priced by
the analytical predictor, and the best re-priced by the DAG predictor (see
:mod:`stg.explore.search` and docs/exploration.md).
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Optional

import typer

from stg.cli import err_console, get_registry
from stg.cli._shared import (
    format_seconds,
    option_parameters,
    options_from_cli,
    print_table,
    system_parameter,
)
from stg.errors import UserError

app = typer.Typer(add_completion=False)

SEARCHED = frozenset(
    {
        "dp",
        "tp",
        "pp",
        "ep",
        "sp",
        "micro_batch",
        "activation_recompute",
        "zero",
        "weight_sharded",
        "pipeline_schedule",
        "virtual_stages",
        "format",
        "output_dir",
        "output_name",
        "chakra_schema_version",
    }
)


def _model_parameters() -> list[inspect.Parameter]:
    return [p for p in option_parameters() if p.name not in SEARCHED]


def _axis(name: str, flag: str, help: str) -> inspect.Parameter:
    return inspect.Parameter(
        name,
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(
            None, flag, help=help, metavar="VALUES", rich_help_panel="Search space"
        ),
        annotation=Optional[str],  # noqa: UP045 (typer needs a runtime type object)
    )


def _own_parameters() -> list[inspect.Parameter]:
    kw = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter(
            "gpus",
            kw,
            default=typer.Option(..., "--gpus", "-n", help="Number of GPUs (the world size)."),
            annotation=int,
        ),
        system_parameter("System preset or system JSON file."),
        inspect.Parameter(
            "top",
            kw,
            default=typer.Option(5, "--top", "-k", help="How many plans to print."),
            annotation=int,
        ),
        inspect.Parameter(
            "refine",
            kw,
            default=typer.Option(
                5, "--refine", help="How many of the best to re-price with the DAG predictor."
            ),
            annotation=int,
        ),
        inspect.Parameter(
            "as_json",
            kw,
            default=typer.Option(False, "--json", help="Print JSON."),
            annotation=bool,
        ),
        _axis("tp_values", "--tp", "Tensor-parallel degrees (default: powers of two up to 8)."),
        _axis("pp_values", "--pp", "Pipeline degrees (default: divisors of the GPU count)."),
        _axis("cp_values", "--cp", "Context-parallel degrees (default: 1)."),
        _axis("ep_values", "--ep", "Expert-parallel degrees (default: 1; MoE: divisors)."),
        _axis(
            "micro_batch_values",
            "--micro-batch",
            "Samples per replica per micro-batch (default: powers of two).",
        ),
        _axis("recompute_values", "--recompute", "none, selective, full (default: all)."),
        _axis("zero_values", "--zero", "0, 1, 2, fsdp (default: all)."),
        _axis(
            "schedule_values", "--schedule", "1f1b, gpipe, interleaved (default: 1f1b,interleaved)."
        ),
        _axis(
            "virtual_values",
            "--virtual-stages",
            "Chunks per stage for interleaved (default: 2,3,4).",
        ),
    ]


def _ints(text: str | None) -> list[int] | None:
    from stg.explore.space import expand

    if text is None:
        return None
    try:
        return [int(v) for v in expand(text)]
    except ValueError:
        raise UserError(f"{text!r}: expected integers (V1,V2,..., A..B or pow2:A..B)") from None


def _words(text: str | None, allowed: tuple[str, ...], option: str) -> list[str] | None:
    if text is None:
        return None
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    bad = [w for w in words if w not in allowed]
    if bad or not words:
        raise UserError(f"{option} {text!r} is not allowed; allowed: {', '.join(allowed)}")
    return words


def search(**values: Any) -> None:
    """Find the fastest parallel plans that fit in memory."""
    from stg.explore.search import SearchSpace
    from stg.explore.search import search as run_search
    from stg.perf.system import load_system

    gpus = values.pop("gpus")
    system = load_system(values.pop("system"))
    top = values.pop("top")
    refine = values.pop("refine")
    as_json = values.pop("as_json")
    if top < 1:
        raise UserError(f"--top {top}: must be a positive integer")
    if refine < 0:
        raise UserError(f"--refine {refine}: must be 0 or more")
    default = SearchSpace()
    space = SearchSpace(
        tp=_ints(values.pop("tp_values")),
        pp=_ints(values.pop("pp_values")),
        sp=_ints(values.pop("cp_values")) or default.sp,
        ep=_ints(values.pop("ep_values")),
        micro_batch_per_replica=_ints(values.pop("micro_batch_values")),
        recompute=_words(
            values.pop("recompute_values"), ("none", "selective", "full"), "--recompute"
        )
        or default.recompute,
        sharding=_words(values.pop("zero_values"), ("0", "1", "2", "fsdp"), "--zero")
        or default.sharding,
        schedules=_words(
            values.pop("schedule_values"), ("1f1b", "gpipe", "interleaved"), "--schedule"
        )
        or default.schedules,
        virtual_stages=_ints(values.pop("virtual_values")) or default.virtual_stages,
    )
    base = options_from_cli(values)
    registry = get_registry()
    console = err_console()
    with _bar(console) as progress:
        result = run_search(
            base, gpus, system, registry, space=space, top=top, refine=refine, progress=progress
        )
    if as_json:
        data = {
            "model": base.model,
            "gpus": gpus,
            "batch": base.batch,
            "system": system.name,
            "enumerated": result.enumerated,
            "pruned": dict(sorted(result.pruned.items())),
            "priced_analytically": result.priced,
            "refined": result.refined,
            "best": [c.as_dict() for c in result.best],
        }
        typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
        return
    _print(base, gpus, system, result)


def _print(base: Any, gpus: int, system: Any, result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console(highlight=False)
    pruned = sum(result.pruned.values())
    out.print(
        f"{base.model} on {gpus} GPUs of {system.name}, batch {base.batch}: "
        f"{result.enumerated:,} plans, {pruned:,} pruned by closed forms, "
        f"{result.priced:,} priced analytically, {result.refined} by the DAG predictor"
    )
    for reason, count in sorted(result.pruned.items(), key=lambda kv: -kv[1]):
        out.print(f"  pruned {count:,}: {reason}")
    if not result.best:
        out.print("no plan fits; try more GPUs, a smaller micro-batch, or recompute")
        raise typer.Exit(1)
    table = Table(title="best plans", title_justify="left")
    for column in (
        "#",
        "dp",
        "tp",
        "pp",
        "ep",
        "cp",
        "mb",
        "m",
        "recompute",
        "zero",
        "schedule",
        "time (DAG)",
        "time (analytical)",
        "MFU",
        "memory GiB",
    ):
        table.add_column(column, justify="right")
    for i, c in enumerate(result.best, start=1):
        p = c.plan()
        schedule = p["schedule"] + (f" v{p['virtual_stages']}" if p["virtual_stages"] > 1 else "")
        mfu = (c.dag or c.analytical or {}).get("mfu", 0.0)
        table.add_row(
            str(i),
            str(p["dp"]),
            str(p["tp"]),
            str(p["pp"]),
            str(p["ep"]),
            str(p["cp"]),
            str(p["micro_batch"]),
            str(p["micro_batches"]),
            p["recompute"],
            "fsdp" if p["zero"] == 3 else str(p["zero"]),
            schedule,
            format_seconds(c.dag["iteration_time_s"]) if c.dag else "-",
            format_seconds(c.analytical["iteration_time_s"]) if c.analytical else "-",
            f"{100 * mfu:.1f} %",
            f"{(c.memory.get('peak_bytes') or 0) / 2**30:.1f}",
        )
    print_table(out, table)
    for i, c in enumerate(result.best, start=1):
        report = c.dag or c.analytical or {}
        parts = (report.get("explain") or {}).get("breakdown_s") or {}
        total = report.get("iteration_time_s") or 1.0
        text = ", ".join(
            f"{k} {100 * v / total:.0f} %"
            for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
            if v / total >= 0.005
        )
        out.print(f"#{i}: {text}")


class _bar:
    def __init__(self, console: Any) -> None:
        self.console, self.bar, self.tasks = console, None, {}

    def __enter__(self) -> Any:
        if not self.console.is_terminal:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=self.console,
            transient=True,
        )
        self.bar.__enter__()

        def update(stage: str, done: int, total: int) -> None:
            if stage not in self.tasks:
                self.tasks[stage] = self.bar.add_task(stage, total=total)
            self.bar.update(self.tasks[stage], completed=done, total=total)

        return update

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


search.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    _own_parameters() + _model_parameters(), return_annotation=None
)
search.__annotations__ = {p.name: p.annotation for p in _own_parameters() + _model_parameters()} | {
    "return": None
}
app.command("search")(search)
