"""``stg generate``: build a workload from the original STG options and write it as traces.

Every field of :class:`stg.core.options.GenerateOptions` is an option, spelled with underscores as
in the original STG (``--micro_batch``) and with dashes (``--micro-batch``). The original STG's
booleans take a value (``--tpsp false``); stg's own flags do not (``--json``, ``--predict``).
Options left out keep the defaults of GenerateOptions. The original STG's command lines run
unchanged, ``--comm_group_file NAME`` (the comm-group file's name in ``--output_dir``) included.

The summary (stderr) ends with the ASTRA-sim arguments that run the trace; ``--json`` prints
the summary as one JSON object on stdout instead.
"""

from __future__ import annotations

import inspect
import json
import shlex
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from stg.cli import err_console, get_registry
from stg.cli._shared import (
    BOOL,
    check_workload_size,
    format_bytes,
    format_seconds,
    load_calibration_option,
    max_nodes_parameter,
    option_parameters,
    options_and_preset_from_cli,
    parse_bool,
    print_reports,
    print_table,
    progress_bar,
    run_predictors,
    system_parameter,
)
from stg.errors import UserError

if TYPE_CHECKING:
    from stg.core.options import GenerateOptions, PresetUse
    from stg.core.workload import Workload
    from stg.host.records import Emitter
    from stg.perf.system import System

app = typer.Typer(add_completion=False)

_PREDICT = "Prediction"
_OUTPUT = "Output"
ASTRA_SIM_FORMAT = "chakra-v0.0.4"
"""The format ASTRA-sim reads; it opens ``<--workload-configuration>.<rank>.et``."""


def default_output_name(extension: str) -> str:
    """``workload.%d<extension>``: the default name follows the format (``.et``, ``.json``)."""
    return f"workload.%d{extension}"


def _command_parameters() -> list[inspect.Parameter]:
    """Options of ``stg generate`` itself (not GenerateOptions): predictions of what it writes."""
    kw = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter(
            "comm_group_file",
            kw,
            default=typer.Option(
                None,
                "--comm_group_file",
                "--comm-group-file",
                help="Name of the comm-group JSON file in --output_dir, as the original STG's "
                "option (default: the output name without its rank part, plus .json).",
                metavar="NAME",
                show_default=False,
                rich_help_panel=_OUTPUT,
            ),
            annotation=Optional[str],  # noqa: UP045 (typer needs a runtime type object)
        ),
        inspect.Parameter(
            "as_json",
            kw,
            default=typer.Option(
                False,
                "--json",
                help="Print the summary as JSON on stdout (and nothing else there).",
                rich_help_panel=_OUTPUT,
            ),
            annotation=bool,
        ),
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
                metavar=BOOL,
                show_default=False,
                rich_help_panel=_PREDICT,
            ),
            annotation=Optional[str],  # noqa: UP045 (parsed by parse_bool)
        ),
        max_nodes_parameter(rich_help_panel=_OUTPUT),
        system_parameter(
            "System the traces are timed for: a preset ({allowed:systems}) or a system JSON "
            "file. Given, every COMP node gets its kernel time (duration_micros, whole "
            "microseconds) from the models of stg predict, and --predict and "
            "--print_gpu_vram use it (default for those: a100-80g); a hybrid one (with device "
            "groups) also places the ranks on its groups, which run their precision plan "
            "entries.",
            default=None,
            rich_help_panel=_PREDICT,
        ),
        inspect.Parameter(
            "calibration",
            kw,
            default=typer.Option(
                None,
                "--calibration",
                help="With --system or --predict: a calibration table (stg bench calibrate) "
                "whose measured kernel times, then fitted models, come before the analytical "
                "model in the durations and the predicted time.",
                metavar="FILE",
                rich_help_panel=_PREDICT,
            ),
            annotation=Optional[str],  # noqa: UP045
        ),
        inspect.Parameter(
            "astra_sim_configs",
            kw,
            default=typer.Option(
                False,
                "--astra_sim_configs",
                "--astra-sim-configs",
                help="With --system: also write ASTRA-sim's system JSON, analytical network "
                "YAML and remote-memory JSON for it beside the traces (<name>.system.json, "
                "<name>.network.yml, <name>.memory.json).",
                rich_help_panel=_OUTPUT,
            ),
            annotation=bool,
        ),
    ]


def generate(**values: Any) -> None:
    """Generate the workload of one training iteration (or, with --phase, of serving:
    prefill, decode or a mixed batch) and write it as trace files."""
    from stg.core import pipeline as gen
    from stg.trace.writer import comm_group_path, write_workload

    predict = values.pop("predict", False)
    print_vram = bool(values.pop("print_gpu_vram", None))
    system_spec = values.pop("system", None)
    calibration_file = values.pop("calibration", None)
    astra_configs = bool(values.pop("astra_sim_configs", False))
    comm_group_file = values.pop("comm_group_file", None)
    as_json = bool(values.pop("as_json", False))
    max_nodes = values.pop("max_nodes", None)
    from stg.core.options import OptionError
    from stg.perf.system import load_system

    needs_system = (
        ("--calibration", calibration_file and not predict),
        ("--astra_sim_configs", astra_configs),
    )
    for flag, given in needs_system:
        if given and system_spec is None:
            raise OptionError(
                f"{flag} applies to the system the traces are timed for; give --system "
                "(a preset or a system JSON file)"
                + (" or --predict" if flag == "--calibration" else "")
            )
    # a hybrid --system places ranks on its device groups (their precision plans) even
    # without --predict; a preset is loaded only where predictions need it
    system = load_system(system_spec or "a100-80g")
    timing_system = system if system_spec is not None else None
    calibration = load_calibration_option(calibration_file, system)
    if calibration is not None and calibration.comms and not (
        calibration.entries or calibration.models
    ):
        raise UserError(
            f"--calibration {calibration_file} holds measured collectives only; stg generate "
            "writes compute durations (give it to stg predict --calibration)"
        )
    options, preset = options_and_preset_from_cli(values)
    from stg.perf.hybrid import placed

    options = placed(options, system)
    if not (predict or print_vram):
        system = None
    registry = get_registry()
    emitter = registry.emitters.get(options.format)
    if values.get("output_name") is None:
        options = replace(options, output_name=default_output_name(emitter.extension))
    gen.validate_options(options, registry)
    inputs: dict[str, tuple[str, str]] = {}
    if astra_configs:
        assert timing_system is not None
        inputs = astra_sim_input_files(timing_system, options, emitter, comm_group_file)
    if comm_group_file is not None:
        check_comm_group_file(comm_group_file, options.output_name, options.world_size, emitter)
        emitter = _with_comm_group_file(emitter, options.output_name, comm_group_file)
    if inputs:
        emitter = _with_extra_files(emitter, dict(inputs.values()))
    check_workload_size(options, registry, max_nodes)
    console = err_console()
    with progress_bar(console) as progress:
        workload = gen.build_workload(options, registry, progress=progress)
        if timing_system is not None:
            from stg.perf.durations import with_durations

            workload = with_durations(
                workload, timing_system, kernels=registry.kernels, calibration=calibration
            )
    # predicted before anything is written: a plan the system refuses writes no files
    reports: dict[str, dict[str, Any]] = {}
    if system is not None:
        names = (["time"] if predict else []) + ["memory"]
        if predict and options.inference:
            names.append("serving")
        reports = run_predictors(
            names, registry, system, workload=workload, calibration=calibration
        )
    with progress_bar(console) as progress:
        files = write_workload(
            workload, emitter, Path(options.output_dir), options.output_name, progress=progress
        )
    summary = workload_summary(workload)
    directory = Path(options.output_dir).absolute()
    groups = directory / (comm_group_file or comm_group_path(options.output_name))
    configs = {kind: directory / name for kind, (name, _) in inputs.items()}
    astra = astra_sim_arguments(directory, options.output_name, emitter, groups, configs)
    summary["durations"] = None if timing_system is None else timing_system.name
    if as_json:
        data = json_summary(summary, files, groups, astra, configs.values())
        data["preset"] = None if preset is None else preset.as_dict()
        if reports:
            data["predictions"] = reports if predict else {"memory": reports["memory"]}
        typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
        return
    _print_summary(console, summary, files, reports if predict else None, preset)
    _print_astra_sim(console, astra, options.output_name, emitter)
    if print_vram:
        print_reports({"memory": reports["memory"]}, f"{options.model} (generated)")


# -- comm-group file name and ASTRA-sim arguments -----------------------------------------------


def check_comm_group_file(name: str, output_name: str, world_size: int, emitter: Emitter) -> None:
    """Refuse a ``--comm_group_file`` that is not a plain file name or names a rank file."""
    from stg.core.options import OptionError
    from stg.trace.writer import output_paths

    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise OptionError(
            f"comm_group_file={name!r} is not allowed; allowed: a file name without "
            "directories (it is written into output_dir)"
        )
    if name in output_paths(output_name, world_size, emitter.extension):
        raise OptionError(
            f"comm_group_file={name!r} is the name of a rank file; allowed: any other file name"
        )


def _with_comm_group_file(emitter: Emitter, output_name: str, name: str) -> Emitter:
    """``emitter`` writing its comm-group file under ``name``."""
    from dataclasses import replace as replace_record

    from stg.trace.writer import comm_group_path

    default = comm_group_path(output_name)
    write = emitter.write

    def write_renamed(workload: Any, directory: Path, output_name: str) -> list[Path]:
        named = replace_record(workload, metadata={**workload.metadata, "comm_group_file": name})
        paths = [Path(p) for p in write(named, directory, output_name)]
        source, target = Path(directory) / default, Path(directory) / name
        if source == target or source not in paths:
            return paths
        source.rename(target)
        return [target if p == source else p for p in paths]

    return replace_record(emitter, write=write_renamed)


def astra_sim_prefix(output_name: str, emitter: Emitter) -> str | None:
    """The rank-file pattern without ``.%d.et`` (ASTRA-sim's workload prefix), or None where
    ASTRA-sim cannot read the files: not Chakra v0.0.4, or a name not ending in ``.%d.et``.

    ASTRA-sim opens ``<workload-configuration>.<rank>.et`` (Workload.cc appends
    ``"." + rank + ".et"``) and reads Chakra v0.0.4 only."""
    from stg.trace.writer import rank_pattern

    if emitter.name != ASTRA_SIM_FORMAT:
        return None
    pattern = rank_pattern(output_name, emitter.extension).replace("%%", "\0")
    suffix = ".%d.et"
    if not pattern.endswith(suffix) or "%d" in pattern[: -len(suffix)]:
        return None
    return pattern[: -len(suffix)].replace("\0", "%")


def astra_sim_arguments(
    directory: Path,
    output_name: str,
    emitter: Emitter,
    comm_groups: Path,
    configs: Mapping[str, Path] | None = None,
) -> dict[str, Any] | None:
    """ASTRA-sim's ``--workload-configuration`` and ``--comm-group-configuration`` for the
    written files, and ``--system-configuration``, ``--network-configuration`` and
    ``--remote-memory-configuration`` for the ``configs`` written (by kind: ``system``,
    ``network``, ``memory``), or None where ASTRA-sim cannot read them."""
    from stg.perf.simulator import INPUT_OPTIONS

    prefix = astra_sim_prefix(output_name, emitter)
    if prefix is None:
        return None
    workload = str(directory / prefix)
    arguments = {
        "workload_configuration": workload,
        "comm_group_configuration": str(comm_groups),
    }
    for kind, path in (configs or {}).items():
        arguments[INPUT_OPTIONS[kind].replace("-", "_")] = str(path)
    return {
        **arguments,
        "arguments": [f"--{key.replace('_', '-')}={value}" for key, value in arguments.items()],
    }


def astra_sim_input_files(
    system: System, options: GenerateOptions, emitter: Emitter, comm_group_file: str | None
) -> dict[str, tuple[str, str]]:
    """ASTRA-sim's input files for ``system`` (:mod:`stg.perf.astra_sim`) by kind: (file name,
    text). The names are the comm-group file's default stem plus ``.system.json``,
    ``.network.yml``, ``.memory.json``. Refused (one line) where ASTRA-sim cannot read the
    traces or the system has no analytical network of ``options.world_size`` NPUs."""
    from stg.core.options import OptionError
    from stg.perf.astra_sim import FILE_SUFFIXES, astra_sim_inputs
    from stg.trace.writer import comm_group_path, output_paths

    if emitter.name != ASTRA_SIM_FORMAT:
        raise OptionError(
            f"--astra_sim_configs: ASTRA-sim reads {ASTRA_SIM_FORMAT} traces, not "
            f"{emitter.name}; allowed: --format {ASTRA_SIM_FORMAT}"
        )
    if astra_sim_prefix(options.output_name, emitter) is None:
        raise OptionError(
            f"--astra_sim_configs: ASTRA-sim opens <prefix>.<rank>.et, and "
            f"output_name={options.output_name!r} does not end in .%d.et; allowed: a name "
            "that does (or one without %d)"
        )
    texts = astra_sim_inputs(
        system, options.world_size, options.dtype, bool(options.cpu_offloading_num_layers)
    )
    stem = comm_group_path(options.output_name).removesuffix(".json")
    names = {kind: stem + FILE_SUFFIXES[kind] for kind in texts}
    taken = set(output_paths(options.output_name, options.world_size, emitter.extension))
    taken.add(comm_group_file or comm_group_path(options.output_name))
    for name in names.values():
        if name in taken:
            raise OptionError(
                f"--astra_sim_configs: {name} is also the name of a trace file; allowed: "
                "another --comm_group_file"
            )
    return {kind: (names[kind], texts[kind]) for kind in texts}


def _with_extra_files(emitter: Emitter, texts: Mapping[str, str]) -> Emitter:
    """``emitter`` also writing ``texts`` (file name -> text) into the directory it writes, so
    that they are moved into place atomically with the traces."""
    from dataclasses import replace as replace_record

    write = emitter.write

    def write_with_files(workload: Any, directory: Path, output_name: str) -> list[Path]:
        paths = [Path(p) for p in write(workload, directory, output_name)]
        for name, text in texts.items():
            path = Path(directory) / name
            path.write_text(text, encoding="utf-8")
            paths.append(path)
        return paths

    return replace_record(emitter, write=write_with_files)


def _print_astra_sim(
    console: Any, astra: Mapping[str, Any] | None, output_name: str, emitter: Emitter
) -> None:
    """The last lines of the summary: ASTRA-sim's arguments, ready to paste (or why not)."""
    if astra is not None:
        console.print("ASTRA-sim arguments:", markup=False)
        line = " ".join(shlex.quote(arg) for arg in astra["arguments"])
        console.print(line, markup=False, soft_wrap=True)
    elif emitter.name != ASTRA_SIM_FORMAT:
        console.print(
            f"ASTRA-sim reads {ASTRA_SIM_FORMAT} traces, not {emitter.name}: write them with "
            "--format chakra-v0.0.4 (or convert them with stg convert) to simulate them",
            markup=False,
        )
    else:
        console.print(
            f"ASTRA-sim opens <prefix>.<rank>.et; output_name={output_name!r} does not end "
            "in .%d.et, so give one that does to simulate these files",
            markup=False,
        )


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


def json_summary(
    summary: Mapping[str, Any],
    files: list[Path],
    comm_groups: Path,
    astra: Mapping[str, Any] | None,
    configs: Iterable[Path] = (),
) -> dict[str, Any]:
    """The summary of ``stg generate --json``: :func:`workload_summary` plus the files
    written (``configs``: ASTRA-sim's input files among them) and ASTRA-sim's arguments (None
    where ASTRA-sim cannot read the files)."""
    others = {comm_groups, *configs}
    return {
        **summary,
        "output_dir": str(comm_groups.parent),
        "files": [str(path) for path in files],
        "rank_files": [str(path) for path in files if path not in others],
        "comm_group_file": str(comm_groups),
        "bytes_written": sum(path.stat().st_size for path in files),
        "astra_sim": None if astra is None else dict(astra),
    }


def _print_summary(
    console: Any,
    summary: Mapping[str, Any],
    files: list[Path],
    reports: Mapping[str, Mapping[str, Any]] | None = None,
    preset: PresetUse | None = None,
) -> None:
    from rich.table import Table

    table = Table(title="stg generate", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    if preset is not None:
        _preset_rows(table, preset)
    table.add_row("ranks", f"{summary['ranks']:,}")
    table.add_row("rank classes", f"{summary['rank_classes']:,}")
    for node_type, count in summary["nodes"].items():
        table.add_row(f"nodes {node_type}", f"{count:,}")
    table.add_row("FLOPs (all ranks)", f"{summary['flops']:.4g}")
    if summary.get("durations"):
        table.add_row("COMP durations", f"kernel models on {summary['durations']}")
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
    print_table(console, table)


def _preset_rows(table: Any, preset: PresetUse) -> None:
    """Rows naming the preset, the values taken from it and those given instead."""
    table.add_row("preset", preset.name)
    taken = ", ".join(f"{key} {value}" for key, value in preset.values.items())
    table.add_row("from the preset", taken)
    if preset.overridden:
        given = ", ".join(
            f"{key} {now} (preset: {was})" for key, (was, now) in preset.overridden.items()
        )
        table.add_row("given instead", given)
    for key, (published, padded, multiple) in preset.padded.items():
        table.add_row(
            "padded",
            f"{key} {published} -> {padded} (a multiple of {multiple}: Megatron-LM's "
            "make-vocab-size-divisible-by times tp)",
        )


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
    serving = reports.get("serving")
    if serving:
        if "ttft_s" in serving:
            table.add_row("predicted time to first token", format_seconds(serving["ttft_s"]))
        if "time_per_output_token_s" in serving:
            table.add_row(
                "predicted time per output token",
                format_seconds(serving["time_per_output_token_s"]),
            )
        table.add_row(
            "memory-bandwidth bound per step", format_seconds(serving["memory_bandwidth_bound_s"])
        )
    memory = reports.get("memory")
    if memory:
        table.add_row("predicted peak memory per GPU", format_bytes(int(memory["peak_bytes"])))
        fits = "yes" if memory["fits"] else "NO"
        if "groups" in memory:  # a hybrid cluster: each group against its own memory
            for name, group in memory["groups"].items():
                table.add_row(
                    f"group {name}: peak, fits in {format_bytes(int(group['capacity_bytes']))}",
                    f"{format_bytes(int(group['peak_bytes']))}, "
                    + ("yes" if group["fits"] else "NO"),
                )
        else:
            table.add_row(f"fits in {format_bytes(int(memory['capacity_bytes']))}", fits)
        if "groups" in (time_report or {}):
            table.add_row("straggler (device group)", time_report["straggler"])
