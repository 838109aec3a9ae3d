"""A fake installed plugin (distribution stg-fake-good 1.0) used by the tests.

It registers a JSON-lines emitter, a kernel and a command, through the entry point
``fake_good`` of group ``stg`` declared in ``stg_fake_good-1.0.dist-info``.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

import stg
from stg.api import Emitter, Kernel, Workload


def write_lines(workload: Workload, directory: Path, output_name: str) -> list[Path]:
    """One line of JSON per node: id, name, type and deps."""
    from stg.api import output_paths, write_comm_groups

    paths = []
    for graph, name in zip(
        workload.ranks, output_paths(output_name, workload.world_size, ".jsonl"), strict=True
    ):
        path = Path(directory) / name
        with path.open("w", encoding="utf-8") as out:
            for node in graph.nodes():
                record = {"id": node.id, "name": node.name, "type": node.type.name,
                          "data_deps": list(node.data_deps), "ctrl_deps": list(node.ctrl_deps)}
                out.write(json.dumps(record, sort_keys=True) + "\n")
        paths.append(path)
    paths.append(write_comm_groups(workload, Path(directory), output_name))
    return paths


@stg.hookimpl
def stg_register_emitters(register):
    register(Emitter(name="fake-lines", write=write_lines, extension=".jsonl",
                     description="JSON lines, one node per line", aliases=("lines",)))


@stg.hookimpl
def stg_register_kernels(register):
    register(Kernel(name="fake-int8-gemm", op_class="einsum", dtype="int8", speedup=2.0))


@stg.hookimpl
def stg_register_commands(app: typer.Typer) -> None:
    @app.command("fake-hello")
    def fake_hello(name: str = "world") -> None:
        """Say hello (a command added by a plugin)."""
        typer.echo(f"hello {name}")
