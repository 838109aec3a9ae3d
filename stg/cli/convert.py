"""``stg convert``: convert traces between Chakra v0.0.4, v0.0.1 and feeder JSON."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(add_completion=False)


@app.command("convert")
def convert(
    source: Path = typer.Argument(  # noqa: B008
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
        None, "--from", help="Source format: v0.0.4, v0.0.1 or json (default: detected)."
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
    if source_format is not None and source_format not in FORMATS:
        raise UserError(f"--from {source_format}: not known; allowed: {', '.join(FORMATS)}")
    if not source.exists() and "%d" not in source.name and not source.parent.is_dir():
        raise UserError(f"{source} does not exist")
    notes: list[str] = []
    paths = convert_trace(
        source,
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


def register(parent: typer.Typer) -> None:
    """Add ``convert`` to another Typer app."""
    parent.command("convert")(convert)
