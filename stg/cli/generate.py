"""``stg generate``: build a workload from the original STG options and write it as traces.

Every field of :class:`stg.options.GenerateOptions` is an option, spelled with underscores as
in the original STG (``--micro_batch``) and with dashes (``--micro-batch``). Booleans take a
value (``--tpsp false``). Options left out keep the defaults of GenerateOptions.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from stg.cli import err_console, get_registry
from stg.options import GenerateOptions, OptionError

if TYPE_CHECKING:
    from stg.workload import Workload

app = typer.Typer(add_completion=False)

TRUE_WORDS = ("true", "t", "yes", "y", "1")
FALSE_WORDS = ("false", "f", "no", "n", "0")
RECOMPUTE_VALUES = ("none", "selective", "full")
SCHEMA_FORMATS = {"v0.0.4": "chakra-v0.0.4", "v0.0.1": "chakra-v0.0.1", "json": "json"}


def parse_bool(value: str) -> bool:
    """``true/t/yes/y/1`` or ``false/f/no/n/0`` (any case), as the original STG's flags."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise typer.BadParameter(f"{value!r} is not a boolean; allowed: true, false, 1, 0")


def parse_recompute(value: str) -> str:
    """``none|selective|full``; ``true`` means full and ``false`` none (the original flag)."""
    word = value.strip().lower()
    if word in RECOMPUTE_VALUES:
        return word
    if word in TRUE_WORDS:
        return "full"
    if word in FALSE_WORDS:
        return "none"
    raise typer.BadParameter(
        f"{value!r} is not allowed; allowed: {', '.join(RECOMPUTE_VALUES)} (or true/false)"
    )


def parse_precision_plan(value: str) -> tuple[tuple[str, str], ...]:
    """A precision plan file (see :mod:`stg.precision`) as ``GenerateOptions.precision``."""
    from stg.errors import UserError
    from stg.precision import load_plan

    try:
        return load_plan(value)
    except UserError as exc:
        raise typer.BadParameter(str(exc)) from None


@dataclass(frozen=True)
class _Spec:
    help: str
    aliases: tuple[str, ...] = ()
    parser: Callable[[str], Any] | None = None
    metavar: str | None = None


_MODEL = "Model"
_PARALLEL = "Parallelism"
_TRAINING = "Training"
_OUTPUT = "Output"
_PREDICT = "Prediction"

# help text and extra spellings per GenerateOptions field (panel, spec)
SPECS: dict[str, tuple[str, _Spec]] = {
    "model": (
        _MODEL,
        _Spec(
            "Model template (a registered model name or alias, or dist:name).",
            ("--model_type", "--model-type"),
            metavar="NAME",
        ),
    ),
    "dvocal": (_MODEL, _Spec("Vocabulary size V.")),
    "dmodel": (_MODEL, _Spec("Hidden size h.")),
    "dff": (_MODEL, _Spec("FFN hidden size F.")),
    "batch": (_MODEL, _Spec("Global batch: samples per iteration.")),
    "micro_batch": (_MODEL, _Spec("Global micro-batch; unset means the whole batch.")),
    "seq": (_MODEL, _Spec("Sequence length s.")),
    "head": (_MODEL, _Spec("Attention heads a.")),
    "kvhead": (_MODEL, _Spec("Key/value heads (GQA).")),
    "num_stacks": (_MODEL, _Spec("Transformer layers L.")),
    "experts": (_MODEL, _Spec("Experts per MoE layer.")),
    "kexperts": (_MODEL, _Spec("Experts each token is routed to (top-k).")),
    "capacity_factor": (_MODEL, _Spec("MoE capacity factor.")),
    "dp": (_PARALLEL, _Spec("Data-parallel degree.")),
    "tp": (_PARALLEL, _Spec("Tensor-parallel degree.")),
    "sp": (_PARALLEL, _Spec("Sequence/context-parallel degree.", ("--cp",))),
    "pp": (_PARALLEL, _Spec("Pipeline-parallel degree.")),
    "ep": (_PARALLEL, _Spec("Expert-parallel degree.")),
    "tpsp": (
        _PARALLEL,
        _Spec("Megatron sequence parallelism inside TP.", parser=parse_bool, metavar="BOOL"),
    ),
    "weight_sharded": (
        _PARALLEL,
        _Spec("Shard weights over dp (FSDP / ZeRO-3).", parser=parse_bool, metavar="BOOL"),
    ),
    "zero": (_PARALLEL, _Spec("ZeRO stage 0-3.")),
    "rank_order": (_PARALLEL, _Spec("Mesh axes, fastest-varying first.", metavar="AXES")),
    "pipeline_schedule": (
        _PARALLEL,
        _Spec("Pipeline schedule (a registered name).", metavar="NAME"),
    ),
    "virtual_stages": (_PARALLEL, _Spec("Model chunks per pipeline stage (interleaving).")),
    "activation_recompute": (
        _TRAINING,
        _Spec(
            "Activation recomputation: none, selective, full (true = full, false = none).",
            parser=parse_recompute,
            metavar="MODE",
        ),
    ),
    "mixed_precision": (
        _TRAINING,
        _Spec("fp32 master weights and optimizer states.", parser=parse_bool, metavar="BOOL"),
    ),
    "dtype": (_TRAINING, _Spec("Compute and activation dtype.", metavar="DTYPE")),
    "grad_reduce_dtype": (
        _TRAINING,
        _Spec("Dtype of gradient reduction; unset means --dtype.", metavar="DTYPE"),
    ),
    "causal": (
        _TRAINING,
        _Spec("Count only the causal half of attention scores.", parser=parse_bool, metavar="BOOL"),
    ),
    "precision": (
        _TRAINING,
        _Spec(
            'Per-op precision plan: a JSON file {"ops": {"fc1": "int8", ...}} '
            "(as stg plan precision writes; default: every op in --dtype).",
            parser=parse_precision_plan,
            metavar="FILE",
        ),
    ),
    "format": (
        _OUTPUT,
        _Spec("Output format (a registered emitter name or alias).", metavar="NAME"),
    ),
    "output_dir": (_OUTPUT, _Spec("Directory to write into.", metavar="DIR")),
    "output_name": (
        _OUTPUT,
        _Spec(
            "Rank file name; %d is the rank (default: workload.%d plus the format's extension).",
            metavar="NAME",
        ),
    ),
}

SCHEMA_OPTION = "chakra_schema_version"


OPTION_SPELLINGS = {"precision": "precision_plan"}
"""Fields whose option is spelled otherwise first (``--precision_plan FILE``; the field name
``--precision`` works too)."""

COMMAND_OPTIONS = frozenset({"predict", "print_gpu_vram", "system"})
"""Options of ``stg generate`` that are not GenerateOptions fields."""


def system_parameter(help: str, **extra: Any) -> inspect.Parameter:
    """The ``--system/-s NAME|FILE`` option shared by generate, predict and plan."""
    return inspect.Parameter(
        "system",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option("a100-80g", "--system", "-s", help=help, metavar="NAME|FILE", **extra),
        annotation=str,
    )


def option_names(field_name: str) -> list[str]:
    """All spellings of a field's option: underscored, dashed, then aliases."""
    names: list[str] = []
    for spelled in dict.fromkeys((OPTION_SPELLINGS.get(field_name, field_name), field_name)):
        names.append(f"--{spelled}")
        if "_" in spelled:
            names.append(f"--{spelled.replace('_', '-')}")
    names.extend(SPECS[field_name][1].aliases)
    return names


_TYPES: dict[str, Any] = {
    "int": Optional[int],  # noqa: UP045 (typer needs a runtime type object)
    "int | None": Optional[int],  # noqa: UP045
    "float": Optional[float],  # noqa: UP045
    "str": Optional[str],  # noqa: UP045
    "str | None": Optional[str],  # noqa: UP045
    "bool": Optional[str],  # noqa: UP045 (parsed by parse_bool)
}


def option_parameters() -> list[inspect.Parameter]:
    """The typer parameters of every GenerateOptions field (other commands reuse them)."""
    params = []
    for f in fields(GenerateOptions):
        if f.name not in SPECS:
            raise RuntimeError(f"stg generate has no option for GenerateOptions.{f.name}")
        panel, spec = SPECS[f.name]
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        annotation = _TYPES.get(type_name, Optional[str])  # noqa: UP045
        default = f.default if f.default is not MISSING else None
        text = spec.help if "default" in spec.help else f"{spec.help} (default: {_show(default)})"
        option = typer.Option(
            None,
            *option_names(f.name),
            help=text,
            show_default=False,
            parser=spec.parser,
            metavar=spec.metavar,
            rich_help_panel=panel,
        )
        params.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation
            )
        )
    schema = typer.Option(
        None,
        f"--{SCHEMA_OPTION}",
        f"--{SCHEMA_OPTION.replace('_', '-')}",
        help="Original STG spelling of --format: v0.0.4, v0.0.1 or json.",
        show_default=False,
        metavar="VERSION",
        rich_help_panel=_OUTPUT,
    )
    params.append(
        inspect.Parameter(
            SCHEMA_OPTION,
            inspect.Parameter.KEYWORD_ONLY,
            default=schema,
            annotation=Optional[str],  # noqa: UP045
        )
    )
    return params


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "unset" if value is None else str(value)


def options_from_cli(values: Mapping[str, Any]) -> GenerateOptions:
    """GenerateOptions from parsed option values (``None`` = not given, keep the default)."""
    given = {
        k: v
        for k, v in values.items()
        if v is not None and k != SCHEMA_OPTION and k not in COMMAND_OPTIONS
    }
    schema = values.get(SCHEMA_OPTION)
    if schema is not None:
        if schema not in SCHEMA_FORMATS:
            raise OptionError(
                f"chakra_schema_version={schema!r} is not allowed; allowed: "
                f"{', '.join(SCHEMA_FORMATS)}"
            )
        fmt = SCHEMA_FORMATS[schema]
        if "format" in given and given["format"] != fmt:
            raise OptionError(
                f"chakra_schema_version={schema} means format={fmt}, "
                f"but format={given['format']} was given; give one of them"
            )
        given["format"] = fmt
    return GenerateOptions(**given)


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
    from stg import generate as gen
    from stg.output import write_workload

    predict = values.pop("predict", False)
    print_vram = bool(values.pop("print_gpu_vram", None))
    system_spec = values.pop("system", "a100-80g")
    system = None
    if predict or print_vram:
        from stg.system import load_system

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
        from stg.cli.predict import run_predictors

        names = (["time"] if predict else []) + ["memory"]
        reports = run_predictors(names, registry, system, workload=workload)
    _print_summary(console, workload_summary(workload), files, reports if predict else None)
    if print_vram:
        from stg.cli.predict import print_reports

        print_reports({"memory": reports["memory"]}, f"{options.model} (generated)")


def _signature() -> list[inspect.Parameter]:
    return option_parameters() + _command_parameters()


generate.__signature__ = inspect.Signature(_signature(), return_annotation=None)  # type: ignore[attr-defined]
generate.__annotations__ = {p.name: p.annotation for p in _signature()} | {"return": None}
app.command("generate")(generate)


# -- progress and summary -----------------------------------------------------------------


@contextmanager
def progress_bar(console: Any) -> Iterator[Callable[[str, int, int], None] | None]:
    """A rich progress bar on a terminal; no callback (quiet) otherwise."""
    if not console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    tasks: dict[str, Any] = {}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=console,
        transient=True,
    ) as bar:

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total or None)
            bar.update(tasks[stage], completed=done, total=total or None)

        yield update


def workload_summary(workload: Workload) -> dict[str, Any]:
    """Ranks, nodes per type, FLOPs and bytes per collective type of a whole workload.

    Each rank class's templates are counted once and multiplied by the ranks that share it.
    """
    from stg.workload import NodeType

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
        table.add_row(f"bytes {comm_type}", _bytes(size))
    if summary["send_bytes"]:
        table.add_row("bytes sent point-to-point", _bytes(summary["send_bytes"]))
    written = sum(path.stat().st_size for path in files)
    table.add_row("files written", f"{len(files):,}")
    table.add_row("bytes written", _bytes(written))
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
        table.add_row("predicted peak memory per GPU", _bytes(int(memory["peak_bytes"])))
        fits = "yes" if memory["fits"] else "NO"
        table.add_row(f"fits in {_bytes(int(memory['capacity_bytes']))}", fits)


def format_seconds(value: float) -> str:
    """A duration with a unit that keeps three significant decimals."""
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3f} ms"
    return f"{value * 1e6:.1f} µs"


def _bytes(size: int) -> str:
    """``1,234 B`` or ``1.21 KiB (1,234 B)``: exact bytes, and binary units when large."""
    if size < 1024:
        return f"{size:,} B"
    value = float(size)
    units = ("KiB", "MiB", "GiB", "TiB", "PiB")
    index = 0
    value /= 1024
    while value >= 1024 and index < len(units) - 1:
        value /= 1024
        index += 1
    return f"{value:.2f} {units[index]} ({size:,} B)"
