"""A plugin module loaded with ``stg -p fake_cli_plugin`` (no distribution: a bare module).

It registers a real emitter (one JSON list of node names per rank) and a predictor that counts
FLOPs, and a command that raises a UserError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

import stg
from stg.api import Emitter, NodeType, Predictor, Workload
from stg.errors import UserError


def write_names(workload: Workload, directory: Path, output_name: str) -> list[Path]:
    from stg.api import output_paths

    paths = []
    names = output_paths(output_name, workload.world_size, ".names.json")
    for graph, name in zip(workload.ranks, names, strict=True):
        path = Path(directory) / name
        path.write_text(json.dumps([node.name for node in graph.nodes()]) + "\n")
        paths.append(path)
    return paths


def predict_flops(workload: Workload, system: Any = None) -> dict[str, Any]:
    flops = [
        sum(n.num_ops for n in graph.rank_class.nodes if n.type is NodeType.COMP)
        for graph in workload.ranks
    ]
    return {"flops_per_rank": flops, "total_flops": sum(flops)}


@stg.hookimpl
def stg_register_emitters(register):
    register(Emitter(name="names", write=write_names, extension=".names.json"))


@stg.hookimpl
def stg_register_predictors(register):
    register(Predictor(name="flops-count", predict=predict_flops))


@stg.hookimpl
def stg_register_commands(app: typer.Typer) -> None:
    @app.command("fake-fail")
    def fake_fail(value: int = 3) -> None:
        """Reject every value (tests the one-line error of a UserError)."""
        raise UserError(f"value={value} is not allowed; allowed: none")
