"""``stg inspect``: look inside things stg makes (``stg inspect trace``, ``stg inspect model``,
``stg inspect system``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from stg.cli._shared import (
    COMM_GROUP_FILE_HELP,
    DEPS_HELP,
    FORMAT_HELP,
    JOBS_HELP,
    WINDOW_HELP,
    check_comm_group_file,
    check_common,
    check_jobs,
    check_writable_file,
    fit_lines,
    run_analysis,
    terminal_width,
)
from stg.trace.feeder import DEFAULT_WINDOW

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Inspect traces, models and systems."
)


TRACE_HELP = (
    "Per-rank node counts, FLOPs, bytes per collective, send/recv bytes and critical path; "
    "with --dot, one rank's graph as Graphviz DOT.\n\n"
    "Exit 0 when every trace feeds, 1 when one reads but cannot be fed, 2 when a file is not "
    "a readable trace or a comm-group file that the trace names is missing or does not parse."
)


@app.command("trace", help=TRACE_HELP)
def trace(
    path: Path = typer.Argument(  # noqa: B008
        ..., help="A rank file, a directory of rank files, or a prefix (out/workload)."
    ),
    rank: int | None = typer.Option(None, "--rank", help="Only this rank."),
    dot: Path | None = typer.Option(  # noqa: B008
        None, "--dot", metavar="FILE", help="Write the rank's graph as Graphviz DOT (one rank)."
    ),
    deps: str = typer.Option("data+ctrl", "--deps", help=DEPS_HELP),
    window: int = typer.Option(DEFAULT_WINDOW, "--window", help=WINDOW_HELP),
    format: str | None = typer.Option(None, "--format", help=FORMAT_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report."),
    jobs: int = typer.Option(0, "--jobs", "-j", help=JOBS_HELP),
    comm_group_file: Path | None = typer.Option(  # noqa: B008
        None,
        "--comm_group_file",
        "--comm-group-file",
        help=COMM_GROUP_FILE_HELP + " Checked, never read as a rank file.",
        metavar="PATH",
    ),
) -> None:
    """Statistics of trace files (see TRACE_HELP)."""
    from stg.errors import UserError
    from stg.trace.stats import (
        analyze,
        check_comm_groups,
        exit_code,
        find_trace_files,
        inspect_report,
        render_inspect,
        select_rank,
        write_dot,
    )

    if dot is None:
        results = run_analysis(path, rank, deps, window, format, jobs, comm_group_file)
    else:
        check_common(deps, window, format)
        check_jobs(jobs)
        check_comm_group_file(comm_group_file)
        found = find_trace_files(path)
        check_comm_groups(path, found, comm_group_file)
        files = select_rank(found, rank)
        if len(files) != 1:
            names = ", ".join(f"{f.name}.{f.rank}" for f in files[:6])
            more = ", ..." if len(files) > 6 else ""
            raise UserError(
                f"--dot writes one rank's graph; choose one with --rank ({names}{more})"
            )
        # an unreadable rank exits 2 with nothing written: read it before touching --dot's folder
        stats = analyze(files[0], deps=deps, window=window, format=format)  # type: ignore[arg-type]
        if not stats.unreadable:
            check_writable_file("--dot", dot)
            try:
                stats = write_dot(files[0], dot, deps=deps, window=window, format=format)  # type: ignore[arg-type]
            except OSError as exc:
                raise UserError(f"--dot {dot}: cannot write: {exc.strerror or exc}") from None
        if stats.error is not None:
            typer.echo(f"error: {stats.error}", err=True)
        results = [stats]
    code = exit_code(results)
    if code == 2:  # the unreadable files have had their error line
        raise typer.Exit(2)
    if as_json:
        typer.echo(json.dumps(inspect_report(results), indent=2, ensure_ascii=False))
    else:
        text = _no_zero_runtime(render_inspect(results))
        typer.echo(fit_lines(text, terminal_width()), nl=False)
    if code:
        raise typer.Exit(code)


NO_RUNTIME = " nodes, 0 us of runtime\n"


def _no_zero_runtime(text: str) -> str:
    """A critical path of 0 us means that the trace records no durations: say so."""
    return text.replace(NO_RUNTIME, " nodes (the trace records no durations)\n")


MODEL_HELP = (
    "Parameters (all, and active: what one token uses, kexperts of the experts), forward and "
    "backward FLOPs and activation bytes saved for the backward, per part (embedding, one "
    "block, head), as symbolic expressions and as numbers for the given dimensions (one "
    "device, no parallelism); totals for --num_stacks blocks. NAME is a model or a named "
    "preset (its dimensions; options given win); without NAME, the models and presets. With "
    "--dot, the block's forward and backward graph as Graphviz DOT."
)


def _dim(option: str, what: str) -> Any:
    """A dimension option: unset means the preset's value, else GenerateOptions' default."""
    from stg.core.options import GenerateOptions

    field = option.lstrip("-").replace("-", "_")
    default = GenerateOptions.__dataclass_fields__[field].default
    shown = "dmodel/head" if default is None else default
    names = [option] + ([option.replace("_", "-")] if "_" in option else [])
    return typer.Option(
        None, *names, help=f"{what} (default: the preset's, else {shown}).", show_default=False
    )


@app.command("model", help=MODEL_HELP)
def model(
    name: str | None = typer.Argument(
        None,
        help="A registered model or preset (none: list the models and presets) - {allowed:models}.",
    ),
    dvocal: int | None = _dim("--dvocal", "Vocabulary size"),
    dmodel: int | None = _dim("--dmodel", "Hidden size"),
    dff: int | None = _dim("--dff", "FFN hidden size"),
    seq: int | None = _dim("--seq", "Sequence length"),
    head: int | None = _dim("--head", "Attention heads"),
    kvhead: int | None = _dim("--kvhead", "Key/value heads"),
    dhead: int | None = _dim("--dhead", "Size of one attention head"),
    num_stacks: int | None = _dim("--num_stacks", "Layers"),
    micro_batch: int = typer.Option(1, "--micro_batch", "--micro-batch", help="Samples."),
    experts: int | None = _dim("--experts", "Experts per MoE layer"),
    kexperts: int | None = _dim("--kexperts", "Experts per token"),
    dtype: str = typer.Option("bf16", "--dtype", help="Dtype: {allowed:dtypes}."),
    dot: Path | None = typer.Option(  # noqa: B008
        None, "--dot", metavar="FILE", help="Write the block's graph as Graphviz DOT."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report."),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Also print the source each preset's values come from."
    ),
) -> None:
    """Closed forms of a model (see MODEL_HELP)."""
    from rich.console import Console
    from rich.table import Table

    from stg.cli import get_registry
    from stg.cli._shared import print_table
    from stg.core.modelinfo import build_unsharded, describe_model, part_dot
    from stg.core.options import GenerateOptions, resolve_model
    from stg.core.pipeline import symbol_values
    from stg.core.plan import make_plan
    from stg.errors import UserError
    from stg.trace.writer import write_file_atomically

    registry = get_registry()
    if name is None:
        if dot is not None:
            raise UserError("--dot writes the graph of one model; name it (stg inspect model NAME)")
        _list_models(registry, as_json, verbose)
        return
    sizes = dict(dvocal=dvocal, dmodel=dmodel, dff=dff, seq=seq, head=head, kvhead=kvhead,
                 dhead=dhead, num_stacks=num_stacks, experts=experts,
                 kexperts=kexperts)  # fmt: skip
    given = {key: value for key, value in sizes.items() if value is not None}
    values, preset = resolve_model({"model": name, **given}, registry)
    options = GenerateOptions(**values, batch=micro_batch, micro_batch=micro_batch, dtype=dtype)
    make_plan(options)
    record = registry.models.get(options.model)
    report = describe_model(record, options, symbol_values(options))
    if preset is not None:
        item = registry.presets.get(preset.qualified)
        report["preset"] = {**preset.as_dict(), **_published(item)}
    if dot is not None:
        part = "block" if record.block is not None else "embedding"  # no layer stack: the body
        text = part_dot(build_unsharded(record, part, options))
        write_file_atomically(dot, lambda f: f.write(text.encode()))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    console = Console(highlight=False)
    if preset is not None:
        console.print(_preset_line(report, verbose), markup=False)
        if verbose:
            _print_sources(console, preset.name, preset.source)
    title = f"{options.model}: per part (micro_batch={micro_batch}, one device)"
    table = Table(title=title, title_justify="left")
    for column in ("part", "figure", "expression", "value"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for part, figures in report["parts"].items():
        for figure, entry in figures.items():
            table.add_row(part, figure, entry["expression"], f"{entry['value']:,}")
    stack = " + ".join(f"{n}·{kind}" for kind, n in report["layers"].items())
    for figure, value in report["totals"].items():
        parts = f"embedding + {stack} + head" if stack else "embedding + head"
        table.add_row("total", figure, parts, f"{value:,}")
    print_table(console, table)


def _published(preset: Any) -> dict[str, Any]:
    """A preset record's published figures, JSON-ready."""
    return {
        "model": preset.model,
        "dims": dict(preset.dims),
        "description": preset.description,
        "published_parameters": preset.published_parameters,
        "published_active_parameters": preset.published_active_parameters,
        "tied_embeddings": preset.tied_embeddings,
    }


def _billions(value: float) -> str:
    return f"{value / 1e9:,.2f}B"


def _published_billions(value: float) -> str:
    """A published figure as its source writes it: 46.7B, 175B."""
    return f"{value / 1e9:g}B"


def _preset_line(report: dict[str, Any], verbose: bool) -> str:
    """One paragraph: the preset, its values, and its published counts beside the template's;
    ``verbose``: and its source."""
    preset = report["preset"]
    values = ", ".join(f"{k} {v}" for k, v in preset["values"].items())
    text = f"preset {preset['name']}: {values}"
    if preset["overridden"]:
        given = ", ".join(
            f"{k} {v['given']} (preset: {v['preset']})" for k, v in preset["overridden"].items()
        )
        text += f"; given instead: {given}"
    totals = report["totals"]
    counts = []
    if preset["published_parameters"]:
        tied = " (its LM head has its own weight; the published model's is the embedding)"
        counts.append(
            f"published {_published_billions(preset['published_parameters'])} parameters, "
            f"this template "
            f"{_billions(totals['parameters'])}"
            + (
                tied
                if preset["tied_embeddings"] and not preset["dims"].get("tie_embeddings")
                else ""
            )
        )
    if preset["published_active_parameters"]:
        counts.append(
            f"published {_published_billions(preset['published_active_parameters'])} active, "
            f"this template {_billions(totals['active_parameters'])}"
        )
    if counts:
        text += "; " + "; ".join(counts)
    if verbose:
        return f"{text}."
    return f"{text} (its sources: --verbose)."


def _list_models(registry: Any, as_json: bool, verbose: bool) -> None:
    """The registered models and presets (``stg inspect model`` without NAME); ``verbose``:
    with each preset's source."""
    from rich.console import Console
    from rich.table import Table

    from stg.cli._shared import print_table

    models = [
        {
            "name": entry.name,
            "qualified": entry.qualified,
            "aliases": list(entry.aliases),
            "description": entry.item.description,
        }
        for entry in registry.models
    ]
    presets = [
        {
            "name": entry.name,
            "qualified": entry.qualified,
            "aliases": list(entry.aliases),
            "source": entry.item.source,
            **_published(entry.item),
        }
        for entry in registry.presets
    ]
    if as_json:
        typer.echo(json.dumps({"models": models, "presets": presets}, indent=2))
        return
    console = Console(highlight=False)
    table = Table(title="models", title_justify="left")
    for column in ("model", "aliases", "description"):
        table.add_column(column)
    for m in models:
        table.add_row(m["name"], ", ".join(m["aliases"]), m["description"])
    print_table(console, table)
    table = Table(title="presets (--model NAME)", title_justify="left")
    for column in PRESET_COLUMNS:
        table.add_column(column, justify="left" if column in ("preset", "model") else "right")
    for p in presets:
        name = p["name"] + "".join(f"\n({alias})" for alias in p["aliases"])
        table.add_row(name, p["model"], *_preset_cells(p))
    print_table(console, table)
    if verbose:
        for p in presets:
            _print_sources(console, p["name"], p["source"])
    else:
        console.print(
            "Every dimension of a preset: stg inspect model NAME; the sources of its values: "
            "stg inspect model [NAME] --verbose."
        )


def _print_sources(console: Any, name: str, source: str) -> None:
    """``name``'s sources: each value's citation on its own indented line (a single
    citation on one)."""
    import textwrap

    from stg.host.presetfile import source_parts

    console.print(f"sources of {name}:", markup=False)
    for value, citation in source_parts(source):
        text = citation if value is None else f"{value}: {citation}"
        lines = textwrap.fill(text, console.width, initial_indent="  ", subsequent_indent="  ",
                              break_on_hyphens=False)  # fmt: skip
        console.print(lines, markup=False, soft_wrap=True)


PRESET_COLUMNS = ("preset", "model", "layers", "dmodel", "heads", "experts", "published")
"""The listing's columns: one line per preset (its aliases below it) in 80 columns."""


def _preset_cells(preset: dict[str, Any]) -> tuple[str, ...]:
    """Layers, dmodel, heads (query/key-value), experts (per token/routed, +shared) and the
    published counts (total / active) of a preset; ``-`` where it sets none."""
    dims = preset["dims"]
    head, kvhead = dims.get("head"), dims.get("kvhead")
    heads = "-" if head is None else str(head) if kvhead in (None, head) else f"{head}/{kvhead}"
    experts = "-"
    if "experts" in dims:
        experts = f"{dims.get('kexperts', '?')}/{dims['experts']}"
        if dims.get("shared_experts"):
            experts += f"+{dims['shared_experts']}"
    counts = (preset["published_parameters"], preset["published_active_parameters"])
    published = " / ".join(_published_billions(x) for x in counts if x) or "-"
    return (
        str(dims.get("num_stacks", "-")),
        str(dims.get("dmodel", "-")),
        heads,
        experts,
        published,
    )


@app.command("system")
def system(
    spec: str = typer.Argument(
        ..., help="A system preset ({allowed:systems}) or a system JSON file."
    ),
    world_size: int | None = typer.Option(
        None, "--world-size", "--world_size", min=1, help="Show the placement of this many ranks."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the system as JSON."),
) -> None:
    """A system's GPUs and network; for a hybrid cluster its device groups and which ranks
    each group holds (the placement, in rank order)."""
    from rich.console import Console
    from rich.table import Table

    from stg.cli._shared import print_table
    from stg.errors import UserError
    from stg.perf.hybrid import is_hybrid
    from stg.perf.system import load_system

    loaded = load_system(spec)
    world = world_size or loaded.capacity or None
    if world is not None and loaded.capacity and world > loaded.capacity:
        raise UserError(
            f"--world-size {world}: system {loaded.name!r} holds {loaded.capacity} "
            f"GPU{'' if loaded.capacity == 1 else 's'}"
        )
    data: dict[str, Any] = loaded.as_dict()
    if is_hybrid(loaded) and world is not None:
        data["placement_runs"] = [list(r) for r in loaded.placement_runs(world)]  # type: ignore[attr-defined]
    if as_json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    console = Console(highlight=False)
    if not is_hybrid(loaded):
        console.print(f"{loaded.name}: {loaded.description}")
        peaks = " / ".join(f"{dtype} {rate}" for dtype, rate in data["peak_tflops"].items())
        console.print(
            f"{peaks} TFLOP/s (dense), {data['hbm_gbps']} GB/s, {data['hbm_gib']} GiB, "
            f"{loaded.sm_count} SMs, {loaded.arch}"
            + (
                ""
                if loaded.compute_capability is None
                else f" (compute capability {loaded.compute_capability})"
            )
        )
        for key, source in loaded.sources.items():
            console.print(f"source of {key}: {source}")
        return
    groups = Table(title=f"device groups of {loaded.name}", title_justify="left")
    for column in ("group", "device", "nodes x GPUs", "node link", "fp16 TFLOP/s", "memory"):
        groups.add_column(column, justify="right")
    for g in loaded.groups:  # type: ignore[attr-defined]
        groups.add_row(
            g.name,
            g.device.name,
            f"{g.nodes} x {g.gpus_per_node}",
            f"{g.link.name} {g.link.bandwidth / 1e9:g} GB/s",
            f"{g.device.peak('fp16') / 1e12:g}",
            f"{g.device.hbm_capacity / 2**30:g} GiB",
        )
    print_table(console, groups)
    between = loaded.between_nodes  # type: ignore[attr-defined]
    console.print(
        f"between nodes: {between.name} {between.bandwidth / 1e9:g} GB/s per GPU, "
        f"{between.latency * 1e6:g} us"
    )
    start = 0
    parts = []
    for name, count in loaded.placement_runs(world):  # type: ignore[attr-defined]
        ranks = f"rank {start}" if count == 1 else f"ranks {start}-{start + count - 1}"
        parts.append(f"{ranks}: {name}")
        start += count
    console.print("placement: " + "; ".join(parts))
