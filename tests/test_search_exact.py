"""``stg search`` is exact: the plans it prices in order of its bound, checking each by the
closed forms as it comes, are the k best of pricing every plan; the plans it prices and
replays once for two (ZeRO-1 and ZeRO-2) have the same workload and the same analytical and
DAG predictions; its best plan is that of refining every plan."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from stg.api import GenerateOptions, build_workload
from stg.core.pipeline import validate_options
from stg.errors import UserError
from stg.explore import search as search_module
from stg.explore.search import SearchSpace, plans, search, twin_key
from stg.host.registry import load_registry
from stg.perf.system import load_system

LLAMA = dict(
    model="llama", dvocal=1024, dmodel=512, dff=2048, head=8, kvhead=8, seq=256, num_stacks=8,
    batch=32,
)  # fmt: skip
WIDE = dict(
    model="llama", num_stacks=8, dmodel=4096, dff=16384, head=32, kvhead=8, seq=2048, batch=32
)
"""The model of tests/test_search_jobs.py, whose compute the bound stops in time."""
SPACE = SearchSpace(virtual_stages=(2,))
"""Every recompute and sharding, 1F1B and interleaved: 8 GPUs give a few hundred plans."""


@pytest.fixture(scope="module")
def registry() -> Any:
    return load_registry()


def _price_everything(
    base: GenerateOptions, gpus: int, system: Any, registry: Any
) -> list[tuple[float, float, GenerateOptions]]:
    """(analytical time, the search's lower bound, plan) of every plan that fits."""
    kernels = list(registry.kernels)
    memory = registry.predictors.get("memory")
    analytical = registry.predictors.get("analytical")
    work = search_module._work_flops(base, system, registry, "analytical")
    assert work["none"] < work["selective"] < work["full"]
    out = []
    for o in plans(base, gpus, SPACE):
        try:
            validate_options(o, registry)
        except UserError:
            continue
        if not memory.predict_options(o, system, kernels=kernels)["fits"]:
            continue
        report = analytical.predict_options(o, system, registry=registry, kernels=kernels)
        flops = work[o.activation_recompute] / (gpus * system.peak(base.dtype))
        bound = flops * (1 + (o.pp - 1) / (o.micro_batches * o.virtual_stages))
        out.append((report["iteration_time_s"], bound, o))
    return out


@pytest.mark.parametrize("gpus", [4, 8])
def test_the_search_keeps_the_k_best_of_pricing_every_plan(registry: Any, gpus: int) -> None:
    system = load_system("h100-80g")
    base = GenerateOptions(**WIDE)  # type: ignore[arg-type]
    everything = _price_everything(base, gpus, system, registry)
    # the stop is sound: no plan is faster than its bound, recompute's FLOPs included
    assert all(bound <= time for time, bound, _ in everything)
    assert {o.activation_recompute for _, _, o in everything} == {"none", "selective", "full"}
    top = 4
    result = search(base, gpus, system, registry, space=SPACE, top=top, refine=0)
    assert result.enumerated == len(plans(base, gpus, SPACE))
    assert result.pruned["lower bound above the best times"] > 0  # the stop was reached
    assert result.priced < len(everything)
    found = [c.time_s for c in result.best]
    assert found == sorted(t for t, _, _ in everything)[:top]
    fastest = min(everything, key=lambda row: row[0])
    assert result.best[0].options == fastest[2]


@pytest.mark.parametrize(
    "model",
    [
        dict(LLAMA, dp=2, tp=2, pp=2, micro_batch=8),
        dict(model="gpt", dvocal=1024, dmodel=256, dff=1024, head=4, kvhead=4, seq=128,
             num_stacks=4, batch=16, dp=2, pp=2, micro_batch=4, tie_embeddings=True),
    ],
    ids=["sequence-parallel", "tied-across-stages"],
)  # fmt: skip
def test_zero_1_and_2_are_not_twins_where_a_gradient_is_all_reduced_after_its_shard(
    registry: Any, model: dict[str, Any]
) -> None:
    """ZeRO-1 all-reduces the whole buffer of sequence parallelism's replicated weights (over
    tp) and of a tied embedding (over the pipeline ends), ZeRO-2 only its shard: their
    workloads differ, so neither predictor's report is shared."""
    one = GenerateOptions(**{**model, "zero": 1})  # type: ignore[arg-type]
    two = replace(one, zero=2)
    assert twin_key(two, "time") == two and twin_key(two, "analytical") == two
    first, second = build_workload(one, registry), build_workload(two, registry)
    assert any(
        a.nodes != b.nodes for a, b in zip(first.rank_classes, second.rank_classes, strict=True)
    )


@pytest.mark.parametrize(
    "model",
    [
        dict(LLAMA, dp=2, tp=2, pp=2, micro_batch=8, tpsp=False),
        dict(LLAMA, dp=4, pp=2, micro_batch=8, pipeline_schedule="interleaved", virtual_stages=2),
        dict(model="moe", batch=16, dp=4, ep=2, micro_batch=8),
    ],
    ids=["llama-tp-pp", "llama-interleaved", "moe-ep"],
)
def test_zero_1_and_2_lower_alike_and_replay_alike(registry: Any, model: dict[str, Any]) -> None:
    """What :func:`twin_key` relies on: the workloads of ZeRO-1 and ZeRO-2 differ only in
    the options they record (the memory predictor's), so the time and analytical predictors'
    reports are the same."""
    one = GenerateOptions(**{**model, "zero": 1})  # type: ignore[arg-type]
    two = replace(one, zero=2)
    assert twin_key(two, "time") == twin_key(two, "analytical") == one
    assert twin_key(two, "other") == two
    first, second = build_workload(one, registry), build_workload(two, registry)
    assert first.comm_groups == second.comm_groups and first.layout == second.layout
    assert [g.rank_class.index for g in first.ranks] == [g.rank_class.index for g in second.ranks]
    for a, b in zip(first.rank_classes, second.rank_classes, strict=True):
        assert (a.stage, a.nodes) == (b.stage, b.nodes)
        assert {**a.facts, "zero": 0} == {**b.facts, "zero": 0}
    options = ({**w.metadata["options"], "zero": 0} for w in (first, second))
    assert next(options) == next(options)
    system = load_system("h100-80g")
    time = registry.predictors.get("time")
    kernels = list(registry.kernels)
    analytical = registry.predictors.get("analytical")
    for predictor, extra in ((time, {}), (analytical, {"explain": True})):
        first_report, second_report = (
            predictor.predict_options(o, system, registry=registry, kernels=kernels, **extra)
            for o in (one, two)
        )
        assert first_report == second_report


def test_refinement_replays_a_plan_once_and_keeps_the_best_of_refining_every_plan(
    registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refining every plan (``refine`` above the plans that fit) picks the same best plan as
    the default refinement of the best five; every refined time is the time predictor's own
    for that plan, and ZeRO-1 and ZeRO-2 twins are replayed once."""
    system = load_system("h100-80g")
    base = GenerateOptions(**LLAMA)  # type: ignore[arg-type]
    space = replace(SPACE, schedules=("1f1b",), recompute=("none",))
    replayed: list[GenerateOptions] = []
    refine_plans = search_module._refine_plans

    def counting(work: Any, options: list[GenerateOptions]) -> list[Any]:
        replayed.extend(options)
        return refine_plans(work, options)

    monkeypatch.setattr(search_module, "_refine_plans", counting)
    default = search(base, 4, system, registry, space=space)
    assert len(replayed) < default.refined == 5
    replayed.clear()
    every = search(base, 4, system, registry, space=space, refine=1000, top=1000)
    assert every.refined == every.priced == len(every.best)
    assert len(replayed) == len({twin_key(o, "time") for o in replayed})
    assert every.best[0].options == default.best[0].options
    time = registry.predictors.get("time")
    kernels = list(registry.kernels)
    for candidate in every.best:
        own = time.predict_options(candidate.options, system, registry=registry, kernels=kernels)
        assert candidate.time_s == own["iteration_time_s"]


def test_the_twins_memo_is_per_search_and_bounded(registry: Any) -> None:
    """Each search's fast reports are kept apart (another system, another price) and a
    long-lived worker keeps those of its last few searches only."""
    plan = GenerateOptions(**{**LLAMA, "dp": 2, "micro_batch": 16, "zero": 2})  # type: ignore[arg-type]
    times = []
    for i, name in enumerate(["h100-80g", "a100-80g"] * 3):
        system = load_system(name)
        work = search_module._Work(f"t{i}", (), name, system.as_dict(), "analytical", "time")
        search_module._SEARCHES[work.token] = (registry, system)
        try:
            times.append(
                search_module._fast_report(work, plan, registry, system)["iteration_time_s"]
            )
        finally:
            del search_module._SEARCHES[work.token]
    assert times[0::2] == [times[0]] * 3 and times[1::2] == [times[1]] * 3
    assert times[0] < times[1]  # an H100 is faster than an A100
    assert set(search_module._PRICED) == {"t2", "t3", "t4", "t5"}  # the last four
    search(GenerateOptions(**LLAMA), 2, load_system("h100-80g"), registry, space=SPACE, refine=0)  # type: ignore[arg-type]
    assert set(search_module._PRICED) <= {"t3", "t4", "t5"}  # a search drops its own
    search_module._PRICED.clear()


def test_a_reference_the_fast_predictor_refuses_bounds_nothing(
    registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without W (the fast predictor refuses the one-GPU reference) every plan is priced:
    the same best plans, none pruned by the bound."""
    system = load_system("h100-80g")
    base = GenerateOptions(**WIDE)  # type: ignore[arg-type]
    space = replace(SPACE, recompute=("none",), schedules=("1f1b",))
    bounded = search(base, 8, system, registry, space=space, top=2, refine=0)
    assert bounded.pruned["lower bound above the best times"] > 0

    def refused(options: GenerateOptions) -> GenerateOptions:
        return replace(options, pp=16)  # more stages than the 8 layers

    monkeypatch.setattr(search_module, "_reference", refused)
    assert search_module._work_flops(base, system, registry, "analytical") == {"none": 0.0}
    unbounded = search(base, 8, system, registry, space=space, top=2, refine=0)
    assert "lower bound above the best times" not in unbounded.pruned
    assert [c.options for c in unbounded.best] == [c.options for c in bounded.best]
    assert all(c.bound_s == 0.0 for c in unbounded.best)


def test_refining_every_plan_of_the_engine_tests_case_keeps_the_default_best(
    registry: Any,
) -> None:
    """tests/test_search_jobs.py's search (8 GPUs, ZeRO 0 and 1, no or full recompute):
    replaying every plan that fits picks the plan the default refinement picks."""
    system = load_system("h100-80g")
    base = GenerateOptions(**WIDE)  # type: ignore[arg-type]
    space = SearchSpace(sharding=("0", "1"), recompute=("none", "full"))
    default = search(base, 8, system, registry, space=space, top=2, refine=2)
    every = search(base, 8, system, registry, space=space, top=1000, refine=1000)
    assert every.refined == every.priced > default.priced
    assert every.best[0].options == default.best[0].options
    assert every.best[0].time_s == default.best[0].time_s
