"""Kernel durations in generated traces: what ``stg generate --system`` writes into each COMP
node's Chakra ``duration_micros``.

Each compute node is priced by :func:`stg.perf.costs.compute_time`, the kernel models
``stg predict`` uses, with the workload's dtype and execution profile (its metadata's
``options``), the registry's kernels and an optional calibration table, on the device of the
rank's group (:func:`stg.perf.hybrid.device_of`: every rank's own GPU on a hybrid system).

ASTRA-sim reads ``duration_micros`` as a whole number of microseconds and replays a COMP node
for ``duration_micros * 1000`` ns, or for 1 ns where it is 0 (``Workload::issue_replay``,
astra-sim 518bd51). So a duration is rounded to the nearest microsecond, half up, and a node
that does work (FLOPs or bytes) gets at least 1 µs: a 0 would run it in 1 ns. A node without
work keeps 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from stg.core.workload import (
    SYSTEM_METADATA,
    NodeTemplate,
    NodeType,
    RankClass,
    RankGraph,
    Workload,
)
from stg.errors import UserError
from stg.perf.calibration import Calibration
from stg.perf.costs import compute_time
from stg.perf.hybrid import device_of, is_hybrid
from stg.perf.kernels import KernelTable, kernel_table
from stg.perf.system import System


def has_work(node: Any) -> bool:
    """Whether a compute node does work (FLOPs or bytes), so that it must take time."""
    return node.num_ops > 0 or node.tensor_size > 0


def duration_micros(seconds: float, work: bool) -> int:
    """``seconds`` as ASTRA-sim reads a duration: whole microseconds, rounded half up; at
    least 1 for a node that does work (``work``)."""
    micros = math.floor(seconds * 1e6 + 0.5)
    return max(micros, 1) if work else max(micros, 0)


def with_durations(
    workload: Workload,
    system: System,
    *,
    kernels: Iterable[Any] = (),
    calibration: Calibration | None = None,
) -> Workload:
    """``workload`` with every COMP node's ``runtime`` (µs) from the kernel models on
    ``system`` and ``system``'s name in its metadata (:data:`stg.core.workload.SYSTEM_METADATA`).

    Ranks of one class on different devices (a hybrid system) get a class each."""
    if calibration is not None and is_hybrid(system):
        raise UserError(
            "--calibration holds one device's measured kernels; on a hybrid system give "
            "it with one group's device preset (--system t4-16g) instead"
        )
    options = dict(workload.metadata.get("options") or {})
    dtype = str(options.get("dtype") or "bf16")
    profile = str(options.get("profile") or "megatron")
    items = list(kernels)
    tables: dict[str, KernelTable] = {}
    devices = [device_of(system, graph.rank) for graph in workload.ranks]
    keys = [(g.rank_class.index, d.name) for g, d in zip(workload.ranks, devices, strict=True)]
    split = len(set(keys)) > len({index for index, _ in keys})  # a class on several devices
    classes: dict[tuple[int, str], RankClass] = {}
    ranks: list[RankGraph] = []
    for graph, device, key in zip(workload.ranks, devices, keys, strict=True):
        rank_class = classes.get(key)
        if rank_class is None:
            table = tables.get(device.name)
            if table is None:
                table = tables[device.name] = kernel_table(items, device.name)
            nodes = tuple(
                _timed(t, device, dtype, table, profile, calibration)
                for t in graph.rank_class.nodes
            )
            index = len(classes) if split else graph.rank_class.index
            rank_class = classes[key] = replace(graph.rank_class, index=index, nodes=nodes)
        ranks.append(replace(graph, rank_class=rank_class))
    metadata = {**workload.metadata, SYSTEM_METADATA: system.name}
    return replace(workload, ranks=tuple(ranks), metadata=metadata)


def _timed(
    template: NodeTemplate,
    device: System,
    dtype: str,
    table: KernelTable,
    profile: str,
    calibration: Calibration | None,
) -> NodeTemplate:
    if template.type is not NodeType.COMP:
        return template
    seconds = compute_time(template, device, dtype, table, profile, calibration)
    return replace(template, runtime=duration_micros(seconds, has_work(template)))
