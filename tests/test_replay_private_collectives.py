"""A collective within one unit whose ports no other stream uses is replayed as one event at
its end (stg.perf.replay ``_Sim._private_collectives``); the replay is the same, node by node,
as running it step by step as a flow (its starts, ends, durations and causes), and so is the
prediction from a periodic replay, whose state check compares such collectives by node."""

from __future__ import annotations

from typing import Any

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.perf import replay as engine
from stg.perf.replay import problem_from_workload, replay
from stg.perf.system import load_system
from stg.predictors.time import predict_time_options

TINY = {"model": "gpt", "dmodel": 64, "dff": 256, "head": 8, "kvhead": 8, "seq": 32, "dvocal": 128}
PLANS = [
    # tensor parallelism over a whole NVLink node; pipeline sends and gradient reductions
    # cross nodes (the NIC): the tensor-parallel collectives have NVLink to themselves
    dict(TINY, num_stacks=4, tp=8, pp=2, dp=2, batch=8, micro_batch=2),
    dict(TINY, num_stacks=2, tp=8, pp=1, dp=4, batch=8, micro_batch=4),
    dict(
        TINY, num_stacks=8, tp=8, pp=2, dp=1, batch=16, micro_batch=1,
        pipeline_schedule="interleaved", virtual_stages=2,
    ),
    # tensor-parallel communication overlapped with GEMMs (fixed-time steps)
    dict(TINY, num_stacks=2, tp=8, pp=2, dp=1, batch=4, micro_batch=1, tp_comm_overlap=True),
    # tensor and data parallelism sharing a node's NVLink: step by step (none private)
    dict(TINY, num_stacks=2, tp=2, pp=2, dp=2, batch=8, micro_batch=2),
]  # fmt: skip


@pytest.fixture(scope="module")
def registry() -> Any:
    return load_registry()


def _step_by_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        engine._Sim, "_private_collectives", lambda self: [set() for _ in self.results]
    )


def _timelines(result: Any) -> list[tuple[list[Any], ...]]:
    return [(r.start, r.end, r.duration, r.transfer_start, r.cause) for r in result.units]


@pytest.mark.parametrize("plan", PLANS, ids=range(len(PLANS)))
@pytest.mark.parametrize("system", ["a100-80g", "h100-80g"])
def test_a_private_collective_replays_as_its_flow_would(
    registry: Any, plan: dict[str, Any], system: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = load_system(system)
    workload = build_workload(GenerateOptions(**plan), registry)
    problem = problem_from_workload(workload, gpu)
    found: list[int] = []
    original = engine._Sim._private_collectives

    def counted(self: Any) -> list[set[int]]:
        private = original(self)
        found.append(sum(len(p) for p in private))
        return private

    monkeypatch.setattr(engine._Sim, "_private_collectives", counted)
    options = {"tp_comm_overlap": bool(plan.get("tp_comm_overlap"))}
    fast = replay(problem, gpu, **options)
    assert found and (found[0] > 0) == (plan["tp"] == 8)  # the one-event path ran, or not
    _step_by_step(monkeypatch)
    slow = replay(problem_from_workload(workload, gpu), gpu, **options)
    assert fast.iteration_time == slow.iteration_time
    assert _timelines(fast) == _timelines(slow)


def test_a_periodic_prediction_is_the_same_either_way(
    registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPT-3 175B's layers, four stages of two, tensor parallelism over each NVLink node
    options = GenerateOptions(
        model="gpt", dmodel=12288, dff=49152, head=96, kvhead=96, seq=2048, dvocal=51200,
        num_stacks=8, tp=8, pp=4, dp=8, micro_batch=8, batch=320,
    )  # fmt: skip
    gpu = load_system("a100-80g")
    fast = predict_time_options(options, gpu, registry=registry)
    assert fast["replay"]["kind"] == "periodic"
    _step_by_step(monkeypatch)
    assert predict_time_options(options, gpu, registry=registry) == fast
