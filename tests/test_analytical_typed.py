"""The analytical predictor reads what a node is for from its typed attributes (phase,
micro-batch, layer or part, role, op, chunk), never from its name."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import RankClass, RankGraph, Workload
from stg.host.registry import load_registry
from stg.predictors import analytical

TINY = {"dmodel": 64, "dff": 256, "head": 4, "kvhead": 4, "seq": 32, "dvocal": 128}
GPT_FP8 = tuple((op, "fp8") for op in ("q", "k", "v", "attn_out", "fc1", "fc2"))
CASES = {
    # fp8 amax reductions per chunk, full recompute, ZeRO-1's gathers after the optimizer
    "fp8 recompute zero1": {
        **{"num_stacks": 4, "pp": 2, "tp": 2, "dp": 2, "batch": 8, "micro_batch": 2},
        **{"zero": 1, "activation_recompute": "full", "precision": GPT_FP8},
    },
    # two chunks per stage: only chunk 0's amax reductions stand for one chunk's
    "fp8 interleaved": {
        **{"num_stacks": 8, "pp": 2, "tp": 2, "dp": 1, "batch": 4, "micro_batch": 1},
        **{"virtual_stages": 2, "pipeline_schedule": "interleaved", "precision": GPT_FP8},
    },
}


def _renamed(workload: Workload) -> Workload:
    """``workload`` with every node renamed after its id."""
    classes: dict[int, RankClass] = {}
    for rc in workload.rank_classes:
        nodes = tuple(dataclasses.replace(t, name=f"n{t.id}") for t in rc.nodes)
        classes[rc.index] = dataclasses.replace(rc, nodes=nodes)
    ranks = tuple(RankGraph(g.rank, classes[g.rank_class.index], g.layout) for g in workload.ranks)
    return dataclasses.replace(workload, ranks=ranks)


@pytest.mark.parametrize("case", CASES)
def test_renaming_every_node_of_a_workload_leaves_its_prediction(case: str) -> None:
    registry = load_registry(autoload=False)
    workload = build_workload(GenerateOptions(model="gpt", **TINY, **CASES[case]), registry)
    before = analytical.predict_analytical(workload, "h100-80g", explain=True)
    after = analytical.predict_analytical(_renamed(workload), "h100-80g", explain=True)
    assert after == before
    assert before["explain"]["breakdown_s"]["compute: optimizer"] > 0


@pytest.mark.parametrize("case", CASES)
def test_renaming_every_node_of_the_reduced_workloads_leaves_the_prediction(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = load_registry(autoload=False)
    options = GenerateOptions(model="gpt", **TINY, **CASES[case])
    before = analytical.predict_options(options, "h100-80g", registry=registry, explain=True)
    build = analytical._build

    def renamed_build(o: GenerateOptions, r: Any) -> Workload:
        return _renamed(build(o, r))

    monkeypatch.setattr(analytical, "_build", renamed_build)
    after = analytical.predict_options(options, "h100-80g", registry=registry, explain=True)
    assert after == before
    breakdown = before["explain"]["breakdown_s"]
    assert breakdown["compute: recompute" if "recompute" in case else "compute: gemm"] > 0
