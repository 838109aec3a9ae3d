"""Units of one rank class whose nodes are alike (stg.perf.replay.alike_units) share the
replay's per-unit preparation and the periodic check's reduction and index: the same
reports, bit for bit, as working each unit out on its own."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.perf import replay as replay_module
from stg.perf.replay import alike_units, problem_from_workload
from stg.perf.system import load_system
from stg.predictors.time import predict_time, predict_time_options

TINY = {"dmodel": 64, "dff": 256, "head": 4, "kvhead": 4, "seq": 32, "dvocal": 128}
H100 = load_system("h100-80g")
# 12 ranks on nodes of 8: stage 0 is ranks 0-5, stage 1 ranks 6-11, so some of stage 1's
# data-parallel group and some pipeline sends cross a node and others do not
PLAN = GenerateOptions(
    model="gpt", **TINY, num_stacks=4, pp=2, dp=6, batch=192, micro_batch=6,
    overlap_param_gather=True, zero=1,
)  # fmt: skip


def _without_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    def none_alike(problem: Any, system: Any = None) -> list[None]:
        return [None] * len(problem.units)

    monkeypatch.setattr(replay_module, "alike_units", none_alike)
    monkeypatch.setattr("stg.perf.periodic.alike_units", none_alike)


def test_units_of_one_class_split_by_placement_are_found_alike() -> None:
    workload = build_workload(PLAN, load_registry())
    problem = problem_from_workload(workload, H100)
    classes = {u.rank_class for u in problem.units}
    assert len(problem.units) > len(classes) == 2
    alike = alike_units(problem, H100)
    for u, like in enumerate(alike):
        unit = problem.units[u]
        first = min(k for k, v in enumerate(problem.units) if v.rank_class == unit.rank_class)
        assert like == (None if u == first else first)


def test_a_unit_whose_nodes_differ_is_not_alike() -> None:
    workload = build_workload(PLAN, load_registry())
    problem = problem_from_workload(workload, H100)
    u = next(u for u, like in enumerate(alike_units(problem)) if like is not None)
    nodes = list(problem.units[u].nodes)
    k = next(i for i, n in enumerate(nodes) if n.num_ops)
    nodes[k] = replace(nodes[k], num_ops=nodes[k].num_ops + 1)
    problem.units[u] = replace(problem.units[u], nodes=nodes)
    problem.alike = None
    assert alike_units(problem)[u] is None


@pytest.mark.parametrize(
    "options",
    [PLAN, replace(PLAN, tp=2, dp=3, tpsp=True, tp_comm_overlap=True, dtype="bf16")],
    ids=["param-gather", "tp-overlap"],
)
def test_shared_preparation_gives_the_same_report(
    monkeypatch: pytest.MonkeyPatch, options: GenerateOptions
) -> None:
    registry = load_registry()
    workload = build_workload(options, registry)
    shared = predict_time(workload, H100, exact=True)
    periodic = predict_time_options(options, H100, registry=registry)
    _without_alike(monkeypatch)
    assert predict_time(workload, H100, exact=True) == shared
    assert predict_time_options(options, H100, registry=registry) == periodic
