"""``stg generate``: build a workload from the original STG options and write it as traces.

Every field of :class:`stg.core.options.GenerateOptions` is an option, spelled with underscores as
in the original STG (``--micro_batch``) and with dashes (``--micro-batch``). Booleans take a
value (``--tpsp false``). Options left out keep the defaults of GenerateOptions.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from stg.cli import err_console, get_registry
from stg.cli._shared import (
    format_bytes,
    format_seconds,
    option_parameters,
    options_from_cli,
    parse_bool,
    print_reports,
    progress_bar,
    run_predictors,
    system_parameter,
)

if TYPE_CHECKING:
    from stg.core.workload import Workload

app = typer.Typer(add_completion=False)

_PREDICT = "Prediction"


def default_output_name(extension: str) -> str:
    """``workload.%d<extension>``: the default name follows the format (``.et``, ``.json``)."""
    return f"workload.%d{extension}"


def _command_parameters() -> list[inspect.Parameter]:
    """Options of ``stg generate`` itself (not GenerateOptions): predictions after writing."""
    kw = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter(
            "predict",
            kw,
            default=typer.Option(
                False,
                "--predict",
                help="Append the predicted iteration time and peak memory to the summary.",
                rich_help_panel=_PREDICT,
            ),
            annotation=bool,
        ),
        inspect.Parameter(
            "print_gpu_vram",
            kw,
            default=typer.Option(
                None,
                "--print_gpu_vram",
                "--print-gpu-vram",
                help="Print the memory predictor's peak memory per rank on stdout, as the "
                "original STG (default: false).",
                parser=parse_bool,
                metavar="BOOL",
                show_default=False,
                rich_help_panel=_PREDICT,
            ),
            annotation=Optional[str],  # noqa: UP045 (parsed by parse_bool)
        ),
        system_parameter(
            "System for --predict and --print_gpu_vram: a preset (a100-80g, h100-80g) or a "
            "system JSON file.",
            rich_help_panel=_PREDICT,
        ),
    ]


def generate(**values: Any) -> None:
    """Generate the workload of one training iteration and write it as trace files."""
    from stg.core import pipeline as gen
    from stg.trace.writer import write_workload

    predict = values.pop("predict", False)
    print_vram = bool(values.pop("print_gpu_vram", None))
    system_spec = values.pop("system", "a100-80g")
    system = None
    if predict or print_vram:
        from stg.perf.system import load_system

        system = load_system(system_spec)
    options = options_from_cli(values)
    registry = get_registry()
    emitter = registry.emitters.get(options.format)
    if values.get("output_name") is None:
        options = replace(options, output_name=default_output_name(emitter.extension))
    gen.validate_options(options, registry)
    console = err_console()
    with progress_bar(console) as progress:
        workload = gen.build_workload(options, registry, progress=progress)
    files = write_workload(workload, emitter, Path(options.output_dir), options.output_name)
    reports: dict[str, dict[str, Any]] = {}
    if system is not None:
        names = (["time"] if predict else []) + ["memory"]
        reports = run_predictors(names, registry, system, workload=workload)
    _print_summary(console, workload_summary(workload), files, reports if predict else None)
    if print_vram:
        print_reports({"memory": reports["memory"]}, f"{options.model} (generated)")


def _signature() -> list[inspect.Parameter]:
    return option_parameters() + _command_parameters()


generate.__signature__ = inspect.Signature(_signature(), return_annotation=None)  # type: ignore[attr-defined]
generate.__annotations__ = {p.name: p.annotation for p in _signature()} | {"return": None}
app.command("generate")(generate)


# -- summary ------------------------------------------------------------------------------


def workload_summary(workload: Workload) -> dict[str, Any]:
    """Ranks, nodes per type, FLOPs and bytes per collective type of a whole workload.

    Each rank class's templates are counted once and multiplied by the ranks that share it.
    """
    from stg.core.workload import NodeType

    ranks_per_class = Counter(graph.rank_class.index for graph in workload.ranks)
    nodes: Counter[str] = Counter()
    collective_bytes: Counter[str] = Counter()
    p2p_bytes = 0
    flops = 0
    for rank_class in workload.rank_classes:
        weight = ranks_per_class[rank_class.index]
        for template in rank_class.nodes:
            nodes[template.type.name] += weight
            if template.type is NodeType.COMP:
                flops += template.num_ops * weight
            elif template.type is NodeType.COMM_COLL and template.comm_type is not None:
                collective_bytes[template.comm_type.name] += template.comm_size * weight
            elif template.type is NodeType.COMM_SEND:
                p2p_bytes += template.comm_size * weight
    return {
        "ranks": workload.world_size,
        "rank_classes": len(ranks_per_class),
        "nodes": dict(sorted(nodes.items())),
        "flops": flops,
        "collective_bytes": dict(sorted(collective_bytes.items())),
        "send_bytes": p2p_bytes,
    }


def _print_summary(
    console: Any,
    summary: Mapping[str, Any],
    files: list[Path],
    reports: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    from rich.table import Table

    table = Table(title="stg generate", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("ranks", f"{summary['ranks']:,}")
    table.add_row("rank classes", f"{summary['rank_classes']:,}")
    for node_type, count in summary["nodes"].items():
        table.add_row(f"nodes {node_type}", f"{count:,}")
    table.add_row("FLOPs (all ranks)", f"{summary['flops']:.4g}")
    for comm_type, size in summary["collective_bytes"].items():
        table.add_row(f"bytes {comm_type}", format_bytes(size))
    if summary["send_bytes"]:
        table.add_row("bytes sent point-to-point", format_bytes(summary["send_bytes"]))
    written = sum(path.stat().st_size for path in files)
    table.add_row("files written", f"{len(files):,}")
    table.add_row("bytes written", format_bytes(written))
    if files:
        table.add_row("output", str(files[0].parent))
    if reports:
        _prediction_rows(table, reports)
    console.print(table)


def _prediction_rows(table: Any, reports: Mapping[str, Mapping[str, Any]]) -> None:
    """Rows of ``--predict``: time and MFU, then peak memory per GPU and whether it fits."""
    time_report = reports.get("time")
    if time_report:
        system = time_report["system"]
        table.add_row(
            f"predicted iteration time ({system})", format_seconds(time_report["iteration_time_s"])
        )
        table.add_row("predicted MFU", f"{100 * time_report['mfu']:.1f} %")
        if "tokens_per_s" in time_report:
            table.add_row("predicted tokens per second", f"{time_report['tokens_per_s']:,.0f}")
    memory = reports.get("memory")
    if memory:
        table.add_row("predicted peak memory per GPU", format_bytes(int(memory["peak_bytes"])))
        fits = "yes" if memory["fits"] else "NO"
        table.add_row(f"fits in {format_bytes(int(memory['capacity_bytes']))}", fits)
