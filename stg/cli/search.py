"""``stg search``: the best parallel plans for a model on a number of GPUs of a system.

Plans are pruned with closed forms (divisibility, memory, a lower bound on time), priced by
the analytical predictor, and the best re-priced by the DAG predictor (see
:mod:`stg.explore.search` and docs/exploration.md).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from typing import Any, Optional

import typer

from stg.cli import err_console, get_registry
from stg.cli._shared import (
    calibration_parameter,
    format_seconds,
    load_calibration_option,
    option_parameters,
    options_from_cli,
    print_table,
    progress_bar,
    system_parameter,
)
from stg.core.options import GenerateOptions
from stg.core.quantities import parse_duration
from stg.errors import UserError
from stg.explore.search import PIPELINE_SPLITS, PLAN_FIELDS

app = typer.Typer(add_completion=False)
_ENGINE = "Engine (training search)"

SEARCHED = frozenset(
    {*PLAN_FIELDS, "format", "output_dir", "output_name", "chakra_schema_version", "kv_dtype"}
)
"""Options the search chooses (or that do not apply to it): not options of the model."""

TRAINING_AXES = {
    "micro_batch_values": "--micro-batch",
    "recompute_values": "--recompute",
    "zero_values": "--zero",
    "schedule_values": "--schedule",
    "virtual_values": "--virtual-stages",
    "cp_values": "--cp",
    "ep_layout_values": "--ep_layout",
    "recompute_layer_values": "--recompute-layers",
    "split_values": "--pipeline-split",
    "last_stage_values": "--last-stage-layers",
}
SERVING_AXES = {
    "replica_batch_values": "--replica-batch",
    "kv_dtype_values": "--kv_dtype",
    "max_tpot": "--max-tpot",
    "max_ttft": "--max-ttft",
}
_CAPACITY = "Capacity planning (--phase serve)"
CAPACITY_OPTIONS = {
    "rate": "--rate",
    "duration": "--duration",
    "arrival": "--arrival",
    "prompt": "--prompt",
    "output": "--output",
    "seed": "--seed",
    "budget_values": "--max-num-batched-tokens",
    "layout_values": "--layouts",
    "routing": "--routing",
}
"""Options of ``--phase serve`` only: the request stream and the searched replica shapes."""
PHASES = (*GenerateOptions.PHASES, "serve")
"""The phases a search plans: training, a serving step, or capacity (``serve``)."""
DEFAULT_PERCENTILES = {"--max-ttft": 99.0, "--max-tpot": 90.0}
"""The percentile a serving limit applies to when it names none (``2s`` = ``p99:2s``)."""


def _model_parameters() -> list[inspect.Parameter]:
    return [p for p in option_parameters() if p.name not in SEARCHED]


def _axis(
    name: str,
    flag: str,
    help: str,
    *more: str,
    metavar: str = "VALUES",
    panel: str = "Search space",
) -> inspect.Parameter:
    return inspect.Parameter(
        name,
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(None, flag, *more, help=help, metavar=metavar, rich_help_panel=panel),
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
        calibration_parameter(
            "A calibration table of the system's device (stg bench calibrate): the refined "
            "plans (--refine, the DAG predictor) are timed with its measured kernels first."
        ),
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
        inspect.Parameter(
            "engine",
            kw,
            default=typer.Option(
                "local",
                "--engine",
                help="Where plans are priced: local (a process pool of --jobs workers) or dask "
                "(--scheduler); the result is the same.",
                metavar="local|dask",
                rich_help_panel=_ENGINE,
            ),
            annotation=str,
        ),
        inspect.Parameter(
            "jobs",
            kw,
            default=typer.Option(
                None,
                "--jobs",
                "-j",
                help="Local worker processes (default 0: every core; 1: this process).",
                show_default=False,
                rich_help_panel=_ENGINE,
            ),
            annotation=Optional[int],  # noqa: UP045 (typer needs a runtime type object)
        ),
        inspect.Parameter(
            "scheduler",
            kw,
            default=typer.Option(
                None,
                "--scheduler",
                help="Dask scheduler: tcp://HOST:PORT, or local:N to start a LocalCluster of N "
                "workers.",
                metavar="ADDRESS",
                rich_help_panel=_ENGINE,
            ),
            annotation=Optional[str],  # noqa: UP045
        ),
        _axis(
            "tp_values",
            "--tp",
            "Tensor-parallel degrees (default: powers of two up to 8, or up to the system's "
            "NVLink domain where larger: 64 on an NVL72).",
        ),
        _axis("pp_values", "--pp", "Pipeline degrees (default: divisors of the GPU count)."),
        _axis("cp_values", "--cp", "Context-parallel degrees (default: 1)."),
        _axis(
            "ep_values",
            "--ep",
            "Expert-parallel degrees (default: 1; MoE: divisors; --phase serve: 1, the experts "
            "split over ep GPUs as --ep_layout places them, fold by default).",
        ),
        _axis(
            "micro_batch_values",
            "--micro-batch",
            "Samples per replica per micro-batch (default: powers of two).",
        ),
        _axis(
            "ep_layout_values",
            "--ep_layout",
            "Expert-parallel layouts: multiply, fold (Megatron's MoE parallel folding: ep·etp "
            "divides dp·tp·cp; default: multiply, or fold where --etp is given; --phase serve: "
            "fold, the experts over each replica's tp GPUs, multiply, data-parallel attention "
            "ranks).",
            "--ep-layout",
        ),
        _axis("recompute_values", "--recompute", "none, selective, full (default: all)."),
        _axis(
            "recompute_layer_values",
            "--recompute-layers",
            "Layer counts of full recompute's block method to try too: the first N layers of "
            "each model chunk recomputed, the others keeping their activations (default: "
            "none).",
        ),
        _axis(
            "split_values",
            "--pipeline-split",
            "How stages split the layers where pp > 1: even (as even as possible), embedding, "
            "loss, both (those counted as a layer, Megatron's --account-for-*-in-pipeline-split;"
            " default: even).",
        ),
        _axis(
            "last_stage_values",
            "--last-stage-layers",
            "Layer counts of the last pipeline stage to try too where pp > 1, the other stages "
            "splitting the rest evenly (Megatron's --decoder-last-pipeline-num-layers; fewer "
            "layers beside a heavy output layer; default: none).",
        ),
        _axis("zero_values", "--zero", "0, 1, 2, fsdp (default: all)."),
        _axis(
            "schedule_values", "--schedule", "1f1b, gpipe, interleaved (default: 1f1b,interleaved)."
        ),
        _axis(
            "virtual_values",
            "--virtual-stages",
            "Chunks per stage for interleaved (default: 2,3,4).",
        ),
        _axis(
            "replica_batch_values",
            "--replica-batch",
            "Serving: sequences one replica (tp·pp·ep GPUs) serves at once (default: powers "
            "of two up to 1024; --batch fixes the total instead).",
            panel="Serving search",
        ),
        _axis(
            "kv_dtype_values",
            "--kv_dtype",
            "Serving: KV-cache dtypes to try, e.g. bf16,fp8 (default: --dtype).",
            "--kv-dtype",
            panel="Serving search",
        ),
        _axis(
            "max_tpot",
            "--max-tpot",
            "Serving (decode, mixed, serve): limit on the time per output token, e.g. 50ms; "
            "serve: of a percentile, p90:50ms (default p90).",
            metavar="TIME",
            panel="Serving search",
        ),
        _axis(
            "max_ttft",
            "--max-ttft",
            "Serving (prefill, serve): limit on the time to first token, e.g. 500ms or 2s; "
            "serve: of a percentile, p99:2s (default p99).",
            metavar="TIME",
            panel="Serving search",
        ),
        _axis(
            "rate", "--rate", "Requests per second (default 1).", metavar="RATE", panel=_CAPACITY
        ),
        _axis(
            "duration",
            "--duration",
            "Seconds of arrivals simulated (default 60).",
            metavar="SECONDS",
            panel=_CAPACITY,
        ),
        _axis(
            "arrival",
            "--arrival",
            "poisson (default), gamma or bursty.",
            metavar="KIND",
            panel=_CAPACITY,
        ),
        _axis(
            "prompt",
            "--prompt",
            "Prompt lengths: fixed:N, uniform:LO:HI, lognormal:MEAN:SIGMA or file:PATH[:FIELD] "
            "(default fixed:1024).",
            metavar="LENGTHS",
            panel=_CAPACITY,
        ),
        _axis(
            "output",
            "--output",
            "Output lengths, as --prompt (default fixed:256).",
            metavar="LENGTHS",
            panel=_CAPACITY,
        ),
        _axis(
            "seed",
            "--seed",
            "Seed of the request stream (default 0).",
            metavar="N",
            panel=_CAPACITY,
        ),
        _axis(
            "budget_values",
            "--max-num-batched-tokens",
            "Token budgets (prefill chunk sizes) per iteration to try (default 2048, vLLM's).",
            panel=_CAPACITY,
        ),
        _axis(
            "layout_values",
            "--layouts",
            "aggregated, disaggregated (default: both).",
            panel=_CAPACITY,
        ),
        _axis(
            "routing",
            "--routing",
            "round-robin (default), least-outstanding or kv-aware, as stg serve.",
            metavar="POLICY",
            panel=_CAPACITY,
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


def _positive(text: str | None, flag: str, *group: str) -> list[int] | None:
    """``_ints`` of ``flag``, every value a positive integer (``group``: the options the error
    line names together, ``flag`` alone by default)."""
    values = _ints(text)
    if values is not None and min(values) < 1:
        if group:
            raise UserError(f"{flag} {text}: {' and '.join(group)} take positive integers")
        which = "must be" if len(values) == 1 else "every value must be"
        raise UserError(f"{flag} {text}: {which} a positive integer")
    return values


def _words(text: str | None, allowed: tuple[str, ...], option: str) -> list[str] | None:
    if text is None:
        return None
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    bad = [w for w in words if w not in allowed]
    if bad or not words:
        raise UserError(f"{option} {text!r} is not allowed; allowed: {', '.join(allowed)}")
    return words


def search(**values: Any) -> None:
    """Find the fastest parallel plans that fit in memory (serving: the plans of most
    tokens per second within a latency limit)."""
    from typer._click.globals import get_current_context

    from stg.cli import _plugins_of
    from stg.explore.search import SearchSpace
    from stg.explore.search import search as run_search
    from stg.explore.sweep import check_engine
    from stg.perf.system import load_system
    from stg.trace.parallel import resolve_jobs

    gpus = values.pop("gpus")
    system = load_system(values.pop("system"))
    calibration_file = values.pop("calibration")
    calibration = load_calibration_option(calibration_file, system)
    top = values.pop("top")
    refine = values.pop("refine")
    as_json = values.pop("as_json")
    if top < 1:
        raise UserError(f"--top {top}: must be a positive integer")
    if refine < 0:
        raise UserError(f"--refine {refine}: must be 0 or more")
    engine, jobs, scheduler = values.pop("engine"), values.pop("jobs"), values.pop("scheduler")
    phase = (values.get("phase") or "training").strip().lower()
    if phase not in PHASES:
        raise UserError(f"--phase {values['phase']!r} is not allowed; allowed: {', '.join(PHASES)}")
    if values.get("phase") is not None:
        values["phase"] = phase
    if phase == "serve":
        _capacity(values, gpus, system, top, as_json, engine, jobs, scheduler)
        return
    for name, flag in CAPACITY_OPTIONS.items():
        if values.pop(name) is not None:
            raise UserError(f"{flag} is an option of capacity planning; give --phase serve")
    if phase != "training":
        if calibration is not None:
            raise UserError(
                f"--calibration prices a training search's refined plans; a serving search "
                f"(phase={phase}) prices plans with the serving predictor: leave it out"
            )
        if engine != "local" or jobs is not None or scheduler is not None:
            raise UserError(
                "--engine, --jobs and --scheduler spread a training search; a serving search "
                f"(phase={phase}) runs in this process: leave them out"
            )
        _serving(values, gpus, system, top, as_json)
        return
    check_engine(engine, scheduler)
    jobs = resolve_jobs(0 if jobs is None else jobs)
    for name, flag in SERVING_AXES.items():
        if values.pop(name) is not None:
            raise UserError(
                f"{flag} is a serving option; give --phase prefill, decode or mixed with it"
            )
    default = SearchSpace()
    space = SearchSpace(
        tp=_positive(values.pop("tp_values"), "--tp"),
        pp=_positive(values.pop("pp_values"), "--pp"),
        sp=_positive(values.pop("cp_values"), "--cp") or default.sp,
        ep=_positive(values.pop("ep_values"), "--ep"),
        micro_batch_per_replica=_positive(values.pop("micro_batch_values"), "--micro-batch"),
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
        virtual_stages=_positive(values.pop("virtual_values"), "--virtual-stages")
        or default.virtual_stages,
        ep_layouts=_words(
            values.pop("ep_layout_values"), GenerateOptions.EP_LAYOUTS, "--ep_layout"
        ),
        recompute_layers=_positive(values.pop("recompute_layer_values"), "--recompute-layers")
        or (),
        pipeline_splits=_words(
            values.pop("split_values"), tuple(PIPELINE_SPLITS), "--pipeline-split"
        )
        or default.pipeline_splits,
        last_stage_layers=_positive(values.pop("last_stage_values"), "--last-stage-layers") or (),
    )
    base = options_from_cli(values)
    registry = get_registry()
    console = err_console()
    with progress_bar(console) as progress:
        result = run_search(
            base,
            gpus,
            system,
            registry,
            space=space,
            top=top,
            refine=refine,
            progress=progress,
            engine=engine,
            jobs=jobs,
            scheduler=scheduler,
            plugins=_plugins_of(get_current_context()),
            calibration=calibration,
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
        if not result.best:  # the text's exit status: no plan fits
            raise typer.Exit(1)
        return
    _print(base, gpus, system, result)


def _print_pruned(out: Any, pruned: Mapping[str, int]) -> None:
    """One line per reason the search pruned plans for, the most frequent first."""
    for reason, count in sorted(pruned.items(), key=lambda kv: -kv[1]):
        out.print(f"  pruned {count:,}: {reason}")


def _print(base: Any, gpus: int, system: Any, result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console(highlight=False)
    pruned = sum(result.pruned.values())
    out.print(
        f"{base.model} on {gpus} GPU{'' if gpus == 1 else 's'} of {system.name}, "
        f"batch {base.batch}: "
        f"{result.enumerated:,} plans, {pruned:,} pruned by closed forms, "
        f"{result.priced:,} priced analytically, {result.refined} by the DAG predictor"
    )
    _print_pruned(out, result.pruned)
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
        recompute = p["recompute"]
        if p.get("recompute_method"):
            recompute += f" {p['recompute_method']} {p['recompute_num_layers']}"
        table.add_row(
            str(i),
            str(p["dp"]),
            str(p["tp"]),
            str(p["pp"])
            + (f" {p['pipeline_split']}" if "pipeline_split" in p else "")
            + (f" last {p['last_stage_layers']}" if "last_stage_layers" in p else ""),
            str(p["ep"]) + (" fold" if "ep_layout" in p else ""),
            str(p["cp"]),
            str(p["micro_batch"]),
            str(p["micro_batches"]),
            recompute,
            "fsdp" if p["zero"] == 3 else str(p["zero"]),
            schedule,
            format_seconds(c.dag["iteration_time_s"]) if c.dag else "-",
            format_seconds(c.analytical["iteration_time_s"]) if c.analytical else "-",
            f"{100 * mfu:.1f} %",
            f"{(c.memory.get('peak_bytes') or 0) / 2**30:.1f}",
        )
    print_table(out, table)
    for i, c in enumerate(result.best, start=1):
        # the DAG predictor's critical path where it replayed every node, else the
        # analytical model's breakdown, scaled to the plan's time
        report = c.dag if c.dag and c.dag.get("explain") else c.analytical or c.dag or {}
        parts = (report.get("explain") or {}).get("breakdown_s") or {}
        total = report.get("iteration_time_s") or 1.0
        text = ", ".join(
            f"{k} {100 * v / total:.0f} %"
            for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
            if v / total >= 0.005
        )
        out.print(f"#{i}: {text}")


def _limit(text: str | None, flag: str) -> tuple[float, float] | None:
    """``p99:2s`` (or ``2s``, at the flag's default percentile) as (percentile, seconds)."""
    if text is None:
        return None
    percentile = DEFAULT_PERCENTILES[flag]
    limit = text.strip()
    if limit.lower().startswith("p") and ":" in limit:
        head, limit = limit.split(":", 1)
        try:
            percentile = float(head[1:])
        except ValueError:
            percentile = -1.0
        if not 0 < percentile <= 100:
            raise UserError(f"{flag} {text!r}: the percentile is pNN with 0 < NN <= 100")
    return percentile, parse_duration(limit, flag, unit_required=True)


def _number(text: str | None, flag: str, default: float, kind: type = float) -> Any:
    if text is None:
        return kind(default)
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise UserError(f"{flag} {text!r}: expected {what}") from None


def _capacity(
    values: dict[str, Any],
    gpus: int,
    system: Any,
    top: int,
    as_json: bool,
    engine: str,
    jobs: int | None,
    scheduler: str | None,
) -> None:
    """``stg search --phase serve``: the fewest GPUs that serve a request stream within
    latency limits (:func:`stg.explore.serve_search.serving_capacity`)."""
    from typer._click.globals import get_current_context

    from stg.cli import _plugins_of
    from stg.core.precision import DTYPE_BYTES
    from stg.explore.serve import EngineConfig
    from stg.explore.serve_cost import EP_LAYOUTS
    from stg.explore.serve_defaults import DEFAULT_BUDGET, TOKENIZE_TOKENS_PER_S
    from stg.explore.serve_requests import generate
    from stg.explore.serve_search import Limits, serving_capacity
    from stg.explore.sweep import open_engine
    from stg.trace.parallel import resolve_jobs

    ep_layouts = _words(values.pop("ep_layout_values"), EP_LAYOUTS, "--ep_layout") or ["fold"]
    for name, flag in {**TRAINING_AXES, "replica_batch_values": "--replica-batch"}.items():
        if name != "ep_layout_values" and values.pop(name) is not None:
            raise UserError(f"{flag} is not searched by capacity planning (phase=serve)")
    pps = _positive(values.pop("pp_values"), "--pp", "--pp", "--ep") or [1]
    eps = _positive(values.pop("ep_values"), "--ep", "--pp", "--ep") or [1]
    limits = Limits(
        ttft=_limit(values.pop("max_ttft"), "--max-ttft"),
        tpot=_limit(values.pop("max_tpot"), "--max-tpot"),
    )
    kv_text = values.pop("kv_dtype_values")
    kv: list[str | None] = [None]
    if kv_text is not None:
        kv = [w.strip() for w in kv_text.split(",") if w.strip()]
        bad = [d for d in kv if d not in DTYPE_BYTES]
        if bad or not kv:
            raise UserError(
                f"--kv_dtype {kv_text!r} is not allowed; allowed: {', '.join(DTYPE_BYTES)}"
            )
    group = ("--tp", "--max-num-batched-tokens")
    tps = _positive(values.pop("tp_values"), "--tp", *group) or [1, 2, 4, 8]
    budgets = _positive(values.pop("budget_values"), group[1], *group) or [DEFAULT_BUDGET]
    layouts = _words(values.pop("layout_values"), ("aggregated", "disaggregated"), "--layouts") or [
        "aggregated",
        "disaggregated",
    ]
    stream = generate(
        arrival=(values.pop("arrival") or "poisson").strip().lower(),
        rate=_number(values.pop("rate"), "--rate", 1.0),
        duration=_number(values.pop("duration"), "--duration", 60.0),
        prompt=values.pop("prompt") or "fixed:1024",
        output=values.pop("output") or "fixed:256",
        seed=_number(values.pop("seed"), "--seed", 0, int),
    )
    engine_config = EngineConfig(
        routing=(values.pop("routing") or "round-robin").strip(),
        tokenize_rate=TOKENIZE_TOKENS_PER_S,
    )
    engine_config.check(with_blocks=False)
    model_name = values.get("model")
    if values.get("causal") is None:
        values["causal"] = True  # serving models mask causally (as stg serve)
    values.update(phase="decode", batch=1, steps=1)
    base = options_from_cli(values)
    registry = get_registry()
    with (
        open_engine(
            engine,
            resolve_jobs(1 if jobs is None else jobs),
            scheduler,
            _plugins_of(get_current_context()),
        ) as runner,
        progress_bar(err_console()) as progress,
    ):
        result = serving_capacity(
            stream,
            base,
            system,
            registry,
            limits,
            max_gpus=gpus,
            tps=tps,
            pps=pps,
            eps=eps,
            ep_layouts=ep_layouts,
            kv_dtypes=kv,
            budgets=budgets,
            layouts=layouts,
            engine=engine_config,
            progress=progress,
            runner=runner,
            plugins=_plugins_of(get_current_context()),
        )
    limits_text = ", ".join(
        f"{name} p{pct:g} within {format_seconds(sec)}"
        for name, limit in (("TTFT", limits.ttft), ("TPOT", limits.tpot))
        if limit is not None
        for pct, sec in (limit,)
    )
    if as_json:
        data = {
            "model": model_name,
            "phase": "serve",
            "routing": engine_config.routing,
            "max_gpus": gpus,
            "system": system.name,
            "requests": len(stream),
            "limits": {
                name: {"percentile": limit[0], "seconds": limit[1]}
                for name, limit in (("ttft", limits.ttft), ("tpot", limits.tpot))
                if limit is not None
            },
            "simulations": result.simulations,
            "skipped": dict(sorted(result.skipped.items())),
            "best": [p.as_dict() for p in result.plans[:top]],
        }
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
        if not result.plans:  # the text's exit status: no layout meets the limits
            raise typer.Exit(1)
        return
    from rich.console import Console
    from rich.table import Table

    out = Console(highlight=False)
    out.print(
        f"{model_name} serving {len(stream):,} requests on at most {gpus} GPUs of "
        f"{system.name}, {limits_text}, {engine_config.routing} routing: "
        f"{result.simulations:,} simulations"
    )
    for shape, why in sorted(result.skipped.items()):
        out.print(f"  skipped {shape}: {why}")
    if not result.plans:
        out.print("no layout meets the limits; raise them or allow more GPUs (--gpus)")
        raise typer.Exit(1)
    table = Table(title="cheapest layouts", title_justify="left")
    columns = ("#", "GPUs", "tp", "pp", "ep", "kv", "budget", "layout", "replicas", "TTFT", "TPOT")
    for column in columns:
        table.add_column(column, justify="right")
    for i, plan in enumerate(result.plans[:top], start=1):
        replicas = (
            f"{plan.prefill_replicas} prefill + {plan.replicas} decode"
            if plan.prefill_replicas
            else str(plan.replicas)
        )
        table.add_row(
            str(i),
            str(plan.gpus),
            str(plan.tp),
            str(plan.pp),
            f"{plan.ep} multiply" if plan.ep_layout == "multiply" else str(plan.ep),
            plan.kv_dtype,
            str(plan.max_num_batched_tokens),
            "disaggregated" if plan.prefill_replicas else "aggregated",
            replicas,
            *(
                format_seconds(plan.measured[k]) if k in plan.measured else "-"
                for k in ("ttft", "tpot")
            ),
        )
    print_table(out, table)


def _serving(values: dict[str, Any], gpus: int, system: Any, top: int, as_json: bool) -> None:
    """``stg search --phase prefill|decode|mixed`` (:mod:`stg.explore.serving_search`)."""
    from stg.explore.serving_search import ServingSpace, serving_search

    for name, flag in TRAINING_AXES.items():
        if values.pop(name) is not None:
            raise UserError(
                f"{flag} is a training axis; a serving search has no "
                f"{flag.lstrip('-')} (phase={values['phase']})"
            )
    max_tpot, max_ttft = values.pop("max_tpot"), values.pop("max_ttft")
    phase = values["phase"].strip().lower()
    if max_tpot is not None and phase == "prefill":
        raise UserError(
            "--max-tpot limits the time per output token of decode and mixed; "
            "prefill has none, limit its time to first token with --max-ttft"
        )
    if max_ttft is not None and phase != "prefill":
        raise UserError(
            f"--max-ttft limits a prefill's time to first token; phase={phase} "
            "is limited by its time per output token, --max-tpot"
        )
    kv_dtypes = values.pop("kv_dtype_values")
    batch = values.get("batch")
    replica = _positive(values.pop("replica_batch_values"), "--replica-batch")
    if batch is not None and replica is not None:
        raise UserError("give --batch (the total, fixed) or --replica-batch (searched), not both")
    tps, pps, eps = (_positive(values.pop(f"{k}_values"), f"--{k}") for k in ("tp", "pp", "ep"))
    base = options_from_cli(values)
    kv = [None] if kv_dtypes is None else [w.strip() for w in kv_dtypes.split(",") if w.strip()]
    from stg.core.precision import DTYPE_BYTES

    bad = [d for d in kv if d is not None and d not in DTYPE_BYTES]
    if bad or not kv:
        raise UserError(
            f"--kv_dtype {kv_dtypes!r} is not allowed; allowed: {', '.join(DTYPE_BYTES)}"
        )
    registry = get_registry()
    space = ServingSpace(
        tp=tps,
        pp=pps,
        ep=eps,
        replica_batch=replica,
        batch=batch,
        kv_dtype=tuple(kv),
    )
    limit = max_ttft if phase == "prefill" else max_tpot
    flag = "--max-ttft" if phase == "prefill" else "--max-tpot"
    seconds = parse_duration(limit, flag, unit_required=True) if limit else None
    with progress_bar(err_console()) as progress:
        result = serving_search(
            base,
            gpus,
            system,
            registry,
            space=space,
            max_tpot=seconds if phase != "prefill" else None,
            max_ttft=seconds if phase == "prefill" else None,
            top=top,
            progress=progress,
        )
    if as_json:
        data = {
            "model": base.model,
            "phase": phase,
            "gpus": gpus,
            "system": system.name,
            "limit_s": seconds,
            "objective": "tokens_per_s (all replicas)",
            "enumerated": result.enumerated,
            "pruned": dict(sorted(result.pruned.items())),
            "priced": result.priced,
            "fastest_bound_s": result.fastest_bound_s,
            "best": [c.as_dict(gpus) for c in result.best],
        }
        typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
        if not result.best:  # the text's exit status: no plan fits or meets the limit
            raise typer.Exit(1)
        return
    _print_serving(base, gpus, system, result, seconds)


def _print_serving(base: Any, gpus: int, system: Any, result: Any, limit: float | None) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console(highlight=False)
    prefill = base.phase == "prefill"
    latency = "TTFT" if prefill else "TPOT"
    within = f", {latency} within {format_seconds(limit)}" if limit else ""
    lengths = f"prompt {base.seq}" if prefill else f"context {base.context or base.seq}"
    pruned = sum(result.pruned.values())
    out.print(
        f"{base.model} {base.phase} on {gpus} GPU{'' if gpus == 1 else 's'} of {system.name}, "
        f"{lengths}{within}: "
        f"{result.enumerated:,} plans, {pruned:,} pruned, "
        f"{result.priced:,} priced by the serving predictor"
    )
    _print_pruned(out, result.pruned)
    if not result.best:
        if limit and result.fastest_bound_s is not None:
            out.print(
                f"no plan meets {latency} {format_seconds(limit)}: the fastest plan that fits "
                f"is bounded below by {format_seconds(result.fastest_bound_s)} (memory "
                "bandwidth); raise the limit or add GPUs"
            )
        else:
            out.print("no plan fits; try more GPUs, a shorter context or --kv_dtype fp8")
        raise typer.Exit(1)
    table = Table(title="best plans (most tokens/s)", title_justify="left")
    for column in (
        "#",
        "dp",
        "tp",
        "pp",
        "ep",
        "m",
        "kv",
        "batch",
        "per replica",
        "TTFT" if prefill else "TPOT",
        "bound",
        "tokens/s",
        "per GPU",
        "memory GiB",
        "KV GiB",
    ):
        table.add_column(column, justify="right")
    for i, c in enumerate(result.best, start=1):
        p = c.plan()
        d = c.as_dict(gpus)
        table.add_row(
            str(i),
            str(p["dp"]),
            str(p["tp"]),
            str(p["pp"]),
            str(p["ep"]),
            str(p["micro_batches"]),
            str(p["kv_dtype"]),
            str(p["batch"]),
            str(p["replica_batch"]),
            format_seconds(c.latency_s),
            format_seconds(c.bound_s),
            f"{c.tokens_per_s:,.0f}",
            f"{d['tokens_per_s_per_gpu']:,.0f}",
            f"{(d['peak_memory_bytes'] or 0) / 2**30:.1f}",
            f"{d['kv_cache_bytes'] / 2**30:.1f}",
        )
    print_table(out, table)
    for i, c in enumerate(result.best, start=1):
        parts = (c.report.get("explain") or {}).get("per_step_s") or {}
        total = sum(parts.values()) or 1.0
        text = ", ".join(
            f"{k.removesuffix('_s').replace('_', ' ')} {100 * v / total:.0f} %"
            for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
            if v / total >= 0.005
        )
        out.print(f"#{i}: {text}")


search.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    _own_parameters() + _model_parameters(), return_annotation=None
)
search.__annotations__ = {p.name: p.annotation for p in _own_parameters() + _model_parameters()} | {
    "return": None
}
app.command("search")(search)
