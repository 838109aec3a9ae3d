"""``stg convert``: convert traces between Chakra v0.0.4, v0.0.1 and feeder JSON, and PyTorch
execution traces (with their Kineto traces) into Chakra v0.0.4 through mlc-chakra's
chakra_trace_link and chakra_converter (:mod:`stg.trace.pytorch_et`)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(add_completion=False)


@app.command("convert")
def convert(
    source: str = typer.Argument(
        ...,
        help="A rank file, or a directory / prefix (out/workload) / pattern "
        "(out/workload.%d.et) of rank files.",
    ),
    destination: str = typer.Argument(
        ...,
        help="For one file: the output file. For a directory: the output directory (created "
        "if missing). For a prefix or pattern: an output directory (existing, or ending in "
        "'/'), or dir/name (name as --output_name: workload, workload.%d.json).",
    ),
    to: str = typer.Option(..., "--to", help="Target format: v0.0.4, v0.0.1 or json."),
    source_format: str | None = typer.Option(
        None,
        "--from",
        help="Source format: v0.0.4, v0.0.1, json, or pytorch (a PyTorch host execution "
        "trace, or a pattern trace.%d.json of one per rank; default: detected).",
    ),
    kineto: str | None = typer.Option(
        None,
        "--kineto",
        help="With a PyTorch trace: its Kineto trace (a pattern with %d for several ranks), "
        "linked by mlc-chakra's chakra_trace_link before chakra_converter.",
        metavar="FILE",
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Replace files that differ (a different trace of the same name, extra ranks); "
        "without it such a conversion is refused and nothing is written.",
    ),
    comm_group_file: Path | None = typer.Option(  # noqa: B008
        None,
        "--comm_group_file",
        "--comm-group-file",
        help="The source's comm-group file (default: the one its metadata names, else "
        "<name>.json beside the rank files or, when that is absent, the only other comm-group "
        "JSON file there); it must parse as one, and is written beside the output under the "
        "output's default name.",
        metavar="PATH",
    ),
) -> None:
    """Convert a trace (every rank file, plus the comm-group file) to another format.
    v0.0.4 <-> json is lossless; v0.0.1 drops what that schema cannot hold. Never overwrites
    a different trace without --force (re-running the same conversion is fine)."""
    from stg.errors import UserError
    from stg.trace.convert import convert_trace, target_format
    from stg.trace.reader import FORMATS

    target_format(to)
    for what, text in (("source", source), ("destination", destination), ("--kineto", kineto)):
        if text is not None and not text:
            raise UserError(f"{what} '': an empty path; give a file, a directory or a prefix")
    _check_pattern("source", source)
    if kineto is not None:
        _check_pattern("--kineto", kineto)
    path = Path(source)
    if source_format == "pytorch" or (source_format is None and _is_pytorch_source(path)):
        _convert_pytorch(path, destination, to, kineto, force, comm_group_file)
        return
    if kineto is not None:
        raise UserError("--kineto goes with a PyTorch host execution trace (--from pytorch)")
    if source_format is not None and source_format not in FORMATS:
        raise UserError(
            f"--from {source_format}: not known; allowed: {', '.join(FORMATS)}, pytorch"
        )
    if not path.exists() and "%d" not in path.name and not path.parent.is_dir():
        raise UserError(f"{source} does not exist")
    notes: list[str] = []
    paths = convert_trace(
        path,
        destination,
        to,
        source_format=source_format,
        force=force,
        comm_group_file=comm_group_file,
        notes=notes,
    )
    for note in notes:
        typer.echo(note, err=True)
    files = "file" if len(paths) == 1 else "files"
    typer.echo(f"wrote {len(paths)} {files} to {paths[0].parent}", err=True)
    for path in paths:
        typer.echo(str(path))


def _check_pattern(what: str, text: str) -> None:
    """Refuse a path with more than one ``%d`` (the rank); another ``%`` is literal."""
    if text.count("%d") > 1:
        from stg.errors import UserError

        raise UserError(
            f"{what} {text!r} may contain '%d' once (the rank, e.g. out/workload.%d.et)"
        )


def _rank_file(pattern: str, rank: int) -> Path:
    """The file of ``rank`` in a ``%d`` pattern."""
    return Path(pattern.replace("%d", str(rank), 1))


def _rank_paths(source: str, what: str) -> list[Path]:
    """The files of a ``%d`` pattern for ranks 0, 1, ... (until one is missing), or the one
    file."""
    if "%d" not in source:
        return [Path(source)]
    paths = []
    while _rank_file(source, len(paths)).is_file():
        paths.append(_rank_file(source, len(paths)))
    if not paths:
        from stg.errors import UserError

        raise UserError(f"{what} {source}: no file for rank 0 ({_rank_file(source, 0)})")
    return paths


def _is_pytorch_source(source: Path) -> bool:
    from stg.trace.pytorch_et import sniff_host_trace

    first = _rank_file(str(source), 0) if "%d" in source.name else source
    return first.is_file() and sniff_host_trace(first)


def _convert_pytorch(
    source: Path,
    destination: str,
    to: str,
    kineto: str | None,
    force: bool,
    comm_group_file: Path | None,
) -> None:
    """PyTorch host execution traces (one per rank) -> Chakra v0.0.4 rank files and their
    comm-group file, through mlc-chakra's trace link and converter."""
    from stg.errors import UserError
    from stg.trace.convert import target_format
    from stg.trace.pytorch_et import import_pytorch_trace

    if target_format(to) != "v0.0.4":
        raise UserError(
            f"--to {to}: a PyTorch trace converts to v0.0.4 (mlc-chakra's converter writes "
            "it); convert that further with stg convert"
        )
    if comm_group_file is not None:
        raise UserError("--comm_group_file: a PyTorch trace records its process groups itself")
    hosts = _rank_paths(str(source), "source")
    kinetos = None if kineto is None else _rank_paths(kineto, "--kineto")
    target = Path(destination)
    if str(destination).endswith(("/", "\\")) or target.is_dir():
        stem = hosts[0].name.split(".", 1)[0]
        output_dir, output_name = target, stem
    else:
        output_dir, output_name = target.parent, target.name
    paths = import_pytorch_trace(hosts, output_dir, output_name, kinetos, force=force)
    files = "file" if len(paths) == 1 else "files"
    typer.echo(
        f"wrote {len(paths)} {files} to {paths[0].parent} (mlc-chakra's converter, then typed "
        "by stg)",
        err=True,
    )
    for path in paths:
        typer.echo(str(path))


def register(parent: typer.Typer) -> None:
    """Add ``convert`` to another Typer app."""
    parent.command("convert")(convert)
