"""Token-dropping MoE routing (``--moe_routing capacity``) whose capacity the token-holding ranks
do not divide: Megatron-LM's capacity is per source rank (megatron/core/transformer/moe/
moe_utils.py, ``get_capacity``, called with a rank's local tokens), so an expert's slots are the
n ranks that split them times ``ceil(cf·k·(T/n)/E)``, the global ``ceil(cf·k·T/E)`` rounded up
to a multiple of n. Before, stg refused such plans (``--capacity_factor 1.1 --tp 2 --dp 2`` on
a small MoE: ``dp·tp=4 must divide capacity=141``); plans it generated are unchanged."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner
from workload_checks import flops_by_root, trace_digest

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload, symbol_values
from stg.core.routing import expert_capacity, expert_groups, token_ranks
from stg.core.symbolic import Capacity
from stg.host.registry import load_registry

SMALL = dict(
    model="moe", dvocal=512, dmodel=64, dff=128, head=8, kvhead=4, num_stacks=2, seq=64,
    batch=8, micro_batch=8, experts=8, kexperts=2,
)  # fmt: skip
TOKENS = 8 * 64  # micro_batch · seq
EXPERT_GEMMS = ("expert_gate", "expert_up", "expert_down")

REFUSED = [
    dict(tp=2, dp=2),  # dp·tp=4 must divide capacity=141
    dict(tp=2, ep=2, sp=2),  # ep·sp·tp=8
    dict(tp=2, dp=2, ep=2, micro_batch=4, pp=2),  # capacity=71 over dp·ep·tp=8
    dict(tp=2, dp=4, ep=2, etp=1),  # ep_layout fold: dp·tp=8
    dict(tp=2, ep=2, dp=2, tpsp=False),  # tokens not split over tp: dp·ep=4
    dict(dp=4, ep=2),  # tp 1: dp·ep=8 must divide capacity=141
]
"""Plans refused before at capacity factor 1.1 (the global capacity is 141 slots, 71 at
micro-batch 4)."""

DIVIDING = [
    dict(dp=2, ep=2, capacity_factor=1.25),
    dict(tp=2, ep=2, capacity_factor=1.25),
    dict(tp=4, ep=2, capacity_factor=1.0),
    dict(tp=2, dp=2, sp=2, capacity_factor=1.0),
    dict(tp=2, dp=2, ep=2, micro_batch=4, pp=2, capacity_factor=1.0),
    dict(tp=2, dp=2, ep=2, etp=2, sp=2, capacity_factor=1.0),
    dict(tp=2, ep=2, tpsp=False, capacity_factor=1.0),
    dict(tp=2, ep=2, phase="prefill", capacity_factor=1.0),
    # serving runs tp without sequence parallelism: 141 slots over dp·sp = 1 rank
    dict(tp=2, ep=2, etp=1, phase="prefill", capacity_factor=1.1),
]
"""Plans that generated before: the capacity already divides over their token ranks."""


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def options(**kw: object) -> GenerateOptions:
    return GenerateOptions(**{**SMALL, "moe_routing": "capacity", "capacity_factor": 1.1, **kw})


def source_ranks(o: GenerateOptions) -> int:
    """Ranks that route different tokens: the batch's (dp·ep, or dp folded), the sequence's
    (sp, and tp under sequence parallelism)."""
    replicas = o.dp if o.ep_folded else o.dp * o.ep
    return replicas * o.sp * (o.tp if o.tpsp else 1)


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Megatron-LM's ``get_capacity`` (moe_utils.py, core_v0.14.0), no minimum."""
    return math.ceil((num_tokens / num_experts) * capacity_factor)


def megatron_capacity(o: GenerateOptions, tokens: int) -> int:
    """Slots of an expert over all source ranks: each pads to its own capacity."""
    n = source_ranks(o)
    assert tokens % n == 0
    return n * get_capacity(tokens // n * o.kexperts, o.experts, o.capacity_factor)


def old_capacity(o: GenerateOptions, tokens: int) -> int:
    """The capacity before: the global ``ceil(cf·k·tokens/E)``, whatever the ranks."""
    return -(-int(tokens * o.kexperts * o.capacity_factor) // o.experts)


def plan_id(kw: dict[str, object]) -> str:
    return ",".join(f"{k}{v}" for k, v in kw.items())


@pytest.mark.parametrize("kw", REFUSED, ids=plan_id)
def test_capacity_is_megatrons_per_source_rank_capacity_and_builds(registry, kw) -> None:
    o = options(**kw)
    tokens = (o.micro_batch or o.batch) * o.seq
    capacity = expert_capacity(o, tokens)
    n = source_ranks(o)
    assert token_ranks(o) == n
    assert capacity == megatron_capacity(o, tokens)
    # the global capacity rounded up to a multiple of n, which it did not divide
    before = old_capacity(o, tokens)
    assert before % n != 0
    assert capacity % n == 0 and before < capacity < before + n
    assert symbol_values(o)[Capacity] == capacity
    build_workload(o, registry)


def test_the_refused_plan_gets_megatrons_144_slots() -> None:
    # 512 tokens over dp·tp = 4 ranks: 128 each route 256 copies, capped at
    # ceil(256/8 · 1.1) = 36 per expert; 4 · 36 = 144 (the global ceil(1126/8) = 141 rounded up)
    assert expert_capacity(options(tp=2, dp=2), TOKENS) == 144 == 4 * get_capacity(256, 8, 1.1)
    # Kimi K2's 384 experts, top 8, 8192 tokens over ep 2: ceil(8·8192/384) = 171 -> 2 · 86
    kimi = GenerateOptions(**{**SMALL, "experts": 384, "kexperts": 8, "ep": 2, "seq": 1024})
    assert expert_capacity(kimi, 8192) == 172 == 2 * get_capacity(4096 * 8, 384, 1.0)


def test_token_ranks_are_the_dropless_groups_and_shards_in_training() -> None:
    for kw in REFUSED:
        groups, shards = expert_groups(options(**kw))
        assert token_ranks(options(**kw)) == groups * shards


def test_expert_gemm_flops_are_the_closed_form_at_the_rounded_capacity(registry) -> None:
    o = options(tp=2, dp=2)
    h, f, e, layers = o.dmodel, o.dff, o.experts, o.num_stacks
    flops = flops_by_root(build_workload(o, registry))
    # three GEMMs of 2·E·C·h·F FLOPs each, forward, and twice that backward, per layer
    assert sum(flops[name] for name in EXPERT_GEMMS) == 18 * e * 144 * h * f * layers


@pytest.mark.parametrize("kw", DIVIDING, ids=plan_id)
def test_plans_that_generated_before_are_unchanged(registry, kw, tmp_path, monkeypatch) -> None:
    o = options(**kw)
    tokens = (o.micro_batch or o.batch) * o.seq
    assert expert_capacity(o, tokens) == old_capacity(o, tokens)
    after = trace_digest(o, registry, tmp_path / "after")
    monkeypatch.setattr("stg.core.pipeline.expert_capacity", old_capacity)
    assert trace_digest(o, registry, tmp_path / "before") == after


def test_tp_does_not_change_a_capacity_that_divides() -> None:
    # test_moe_routing's closed form: ceil(1.25·2·512/8) = 160 over ep·tp up to 8 ranks
    for tp in (1, 2, 4):
        o = options(tp=tp, ep=2, capacity_factor=1.25)
        assert expert_capacity(o, TOKENS) == math.ceil(1.25 * 2 * TOKENS / 8) == 160


def cli_args(plan: dict[str, object]) -> list[str]:
    return [a for key, value in plan.items() for a in (f"--{key}", str(value))]


@pytest.mark.parametrize(
    "kw",
    [
        dict(tp=2, dp=2),
        dict(tp=2, ep=2, sp=2),
        dict(tp=2, dp=2, ep=2, micro_batch=4, pp=2),
    ],
    ids=plan_id,
)
def test_generates_validates_and_predicts(tmp_path: Path, kw) -> None:
    plan = {**SMALL, "moe_routing": "capacity", "capacity_factor": 1.1, **kw}
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(app, ["generate", *cli_args(plan), "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["validate", str(out)])
    assert result.exit_code == 0, result.output
    # from options (no trace) and from the trace: the same iteration
    result = runner.invoke(app, ["predict", *cli_args(plan), "--json"])
    assert result.exit_code == 0, result.output
    from_options = json.loads(result.stdout)
    assert from_options["time"]["world_size"] == source_ranks(options(**kw)) * kw.get("pp", 1)
    assert from_options["time"]["iteration_time_s"] > 0
    result = runner.invoke(app, ["predict", str(out), "--json"])
    assert result.exit_code == 0, result.output
    from_trace = json.loads(result.stdout)
    assert from_trace["time"]["iteration_time_s"] == pytest.approx(
        from_options["time"]["iteration_time_s"]
    )
