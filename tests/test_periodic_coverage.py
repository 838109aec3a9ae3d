"""Plans of today's recipes take the periodic replay, not the fallback to every micro-batch.

A plan whose periodic check fails is replayed whole: exact, but linear in micro-batches (a
Llama 3.1 405B plan with FP8 and context parallelism on 256 GPUs, 384 micro-batches, took 332
CPU s and 14 GB). Two causes made common plans fail it:

- quantize kernels that waited for nothing: a weight's cast (its source has no producer) and,
  under context parallelism, the cast of an output gradient that the ring attention's
  backward produces under other keys; such a node runs wherever its stream is free, in no
  micro-batch's order;
- the reduced problems' drain: a reduced problem keeps the waits its last micro-batches have
  in the longer schedule (a send ordered after the amax update of delayed scaling, a ring
  step of context parallelism), not those of the schedule of as many micro-batches; this
  holds for the fewest micro-batches, whose shorter problem is read off the longer replay's
  states, as for the longer tries;
- the reduced problems' order: a gradient reduction that the longer schedule issues among its
  last micro-batch's nodes stayed there in the shorter problem, after nodes that the schedule
  of as many micro-batches issues after it on the same communicator;
- a transient that outlasts the fill (one stage running ahead of the others for a while): the
  lowered workload of the fill and two periods was the only one tried.

Each plan here must take the periodic path and give the full replay's report (within 1e-9).
"""

from __future__ import annotations

from typing import Any

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.recipes import QUANTIZE_KERNEL_ATTR
from stg.host.registry import load_registry
from stg.perf.system import load_system
from stg.predictors.time import predict_time, predict_time_options

REGISTRY = load_registry(autoload=False)
RELATIVE = 1e-9
BASE = {
    "model": "llama", "dmodel": 512, "dff": 2048, "head": 8, "kvhead": 8, "seq": 1024,
    "dvocal": 1024, "num_stacks": 8, "pp": 4, "tp": 2, "mixed_precision": True, "causal": True,
}  # fmt: skip

PLANS: dict[str, dict[str, Any]] = {
    "fp8-delayed": dict(dp=2, micro_batch=2, batch=48, dtype="fp8", low_precision_recipe="delayed"),
    "fp8-tensorwise": dict(
        dp=2, micro_batch=2, batch=48, dtype="fp8", low_precision_recipe="tensorwise"
    ),
    "cp2-bf16": dict(sp=2, dp=1, micro_batch=1, batch=24, dtype="bf16"),
    # stage 0 runs ahead for longer than the fill: the check holds at twice the keep
    "cp2-fp8-tensorwise": dict(
        sp=2, dp=1, micro_batch=1, batch=96, dtype="fp8", low_precision_recipe="tensorwise"
    ),
    # the smallest keep's last micro-batches wait as the schedule's last ones do (a send after
    # the amax update of delayed scaling): the state check holds with the drain's waits
    "fp8-delayed-interleaved": dict(
        dp=2, micro_batch=2, batch=64, dtype="fp8", low_precision_recipe="delayed",
        pipeline_schedule="interleaved", virtual_stages=2,
    ),
    # the distributed optimizer's gradient reduce-scatter of a chunk is issued as the last
    # micro-batch's backward leaves it, among that micro-batch's amax reductions on the same
    # communicator: the shorter problem takes it from the queue where its schedule issues it
    "zero1-fp8-interleaved": dict(
        tp=1, dp=2, micro_batch=2, batch=64, dtype="fp8", pipeline_schedule="interleaved",
        virtual_stages=2, zero=1, grad_reduce_dtype="bf16",
    ),
    # its steady state is proven from 24 lowered micro-batches: 80 in all, so that lowering
    # them costs less than the whole replay (predictors/time.py lowered_micro_batches)
    "cp2-fp8-interleaved": dict(
        sp=2, dp=1, micro_batch=1, batch=80, dtype="fp8", low_precision_recipe="tensorwise",
        pipeline_schedule="interleaved", virtual_stages=2,
    ),
}  # fmt: skip


@pytest.mark.parametrize("plan", list(PLANS.values()), ids=list(PLANS))
def test_recipe_plans_replay_periodically_and_exactly(plan: dict[str, Any]) -> None:
    options = GenerateOptions(**(BASE | plan))
    system = load_system("h100-80g")
    fast = predict_time_options(options, system, registry=REGISTRY)
    assert fast["replay"]["kind"] == "periodic"
    exact = predict_time(build_workload(options, REGISTRY), system, exact=True)
    assert exact["replay"] == {"kind": "full"}
    scale = exact["iteration_time_s"]
    assert fast["iteration_time_s"] == pytest.approx(scale, rel=RELATIVE)
    for a, b in zip(fast["ranks"], exact["ranks"], strict=True):
        for key, value in b.items():
            if isinstance(value, float):
                assert a[key] == pytest.approx(value, rel=RELATIVE, abs=RELATIVE * scale), key


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_no_quantize_kernel_waits_for_nothing(recipe: str) -> None:
    """Every quantize node of a context-parallel fp8 plan waits for a node of its rank (its
    source's producer, or what the GEMM it feeds reads)."""
    options = GenerateOptions(
        **BASE, **PLANS["cp2-fp8-tensorwise"] | {"low_precision_recipe": recipe}
    )
    workload = build_workload(options, REGISTRY)
    checked = 0
    for rank_class in workload.rank_classes:
        for node in rank_class.nodes:
            if (node.attrs or {}).get(QUANTIZE_KERNEL_ATTR) is None:
                continue
            checked += 1
            assert node.data_deps or node.ctrl_deps, node.name
    assert checked or recipe == "delayed"


def test_a_keep_found_not_periodic_is_not_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each lowered workload tries only shorter replays longer than those an earlier one of
    the same period found not periodic (a workload lowered for twice the micro-batches holds
    the earlier keep too), and the whole workload then only longer ones: every (period, keep,
    drain) is checked once. Forced to fail here, so that every try is made."""
    import stg.perf.periodic as periodic

    tried: list[tuple[int, int, bool]] = []

    def refuse(problem: Any, args: Any, options: Any, indexed: Any, per_unit: Any, built: int,
               total: int, keep: int, period: int, *rest: Any, **_: Any) -> None:  # fmt: skip
        tried.extend((period, keep, tail) for tail in rest[-1])  # each drain tried (tails)
        raise periodic._NotPeriodic

    monkeypatch.setattr(periodic, "_try_keep", refuse)
    options = GenerateOptions(
        model="llama", dmodel=256, dff=1024, head=8, kvhead=4, seq=256, dvocal=1024,
        num_stacks=4, pp=2, tp=1, dp=1, micro_batch=1, batch=64,
        pipeline_schedule="interleaved", virtual_stages=2,
    )  # fmt: skip
    report = predict_time_options(options, load_system("h100-80g"), registry=REGISTRY)
    assert report["replay"]["kind"] == "full"
    assert len(tried) >= 3
    assert len(tried) == len(set(tried)), tried
