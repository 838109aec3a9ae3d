"""Dropless MoE routing with tensor parallelism: the router's input is split over tp along the
sequence (sequence parallelism, which Megatron-LM requires for MoE with tp in training), so
each token group's slots of an expert start split over its ep·tp ranks, and the dropless
capacity is rounded up to a multiple of them (a fuzz of valid plans found ``--model
mixtral-8x7b --tp 2 --ep 4 --dp 2 --moe_routing dropless`` refused with ``dp·ep·tp=16 must
divide capacity=66392``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner
from workload_checks import flops_by_root

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload, symbol_values
from stg.core.routing import expected_max_load, expert_capacity, expert_groups
from stg.core.symbolic import Capacity
from stg.host.registry import load_registry

SMALL = dict(
    model="moe", dvocal=512, dmodel=64, dff=128, head=8, kvhead=4, num_stacks=2, seq=64,
    batch=8, micro_batch=8, experts=8, kexperts=2,
)  # fmt: skip
TOKENS = 8 * 64  # micro_batch · seq
EXPERT_GEMMS = ("expert_gate", "expert_up", "expert_down")
FUZZ_PLAN = dict(
    model="mixtral-8x7b", tp=2, ep=4, dp=2, moe_routing="dropless", batch=8, micro_batch=8,
    num_stacks=2,
)  # fmt: skip
"""The plan the fuzz found refused (two of Mixtral's 32 layers, to keep it quick)."""

PLANS = [
    dict(tp=2, dp=2),  # was refused: dp·tp=4 must divide capacity=166
    dict(tp=2, ep=2, dp=2),
    dict(tp=4, ep=2),
    dict(tp=2, ep=2, sp=2),
    dict(tp=2, ep=2, dp=2, micro_batch=4, pp=2),  # was refused: dp·ep·tp=8, capacity=92
    dict(tp=2, ep=2, dp=2, tpsp=False),  # tokens not split over tp: ep rounding only
    dict(tp=2, dp=4, ep=2, etp=1),  # ep_layout fold
    dict(tp=2, dp=2, ep=2, etp=2, sp=2),  # ep_layout fold
]


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def options(**kw: object) -> GenerateOptions:
    return GenerateOptions(**{**SMALL, "moe_routing": "dropless", **kw})


def token_ranks(o: GenerateOptions) -> int:
    """Ranks that split the ``capacity`` dimension: the token axes of the router's input."""
    return o.data_replicas * o.sp * (o.tp if o.tpsp else 1)


def fullest_group_load(o: GenerateOptions) -> float:
    """The expected most loaded expert's slots in one token group, unrounded."""
    groups, _ = expert_groups(o)
    bins = o.experts * groups
    return min(expected_max_load(TOKENS * o.kexperts / bins, bins), TOKENS / groups)


def expert_flops(workload) -> int:
    flops = flops_by_root(workload)
    return sum(flops[name] for name in EXPERT_GEMMS)


@pytest.mark.parametrize("kw", PLANS, ids=lambda kw: ",".join(f"{k}{v}" for k, v in kw.items()))
def test_dropless_capacity_splits_over_the_token_ranks_and_builds(registry, kw) -> None:
    o = options(**kw)
    capacity = expert_capacity(o, TOKENS)
    assert capacity % token_ranks(o) == 0
    # the least such rounding: fewer than `shards` slots over the fullest load of each group
    groups, shards = expert_groups(o)
    fullest = fullest_group_load(o)
    assert capacity == math.ceil(fullest / shards) * shards * groups
    assert fullest * groups <= capacity < (fullest + shards) * groups
    build_workload(o, registry)


def test_shards_are_ep_times_tp_under_sequence_parallelism() -> None:
    assert expert_groups(options(tp=2, ep=4, dp=2)) == (2, 8)
    assert expert_groups(options(tp=2, ep=4, dp=2, sp=2)) == (4, 8)
    assert expert_groups(options(tp=2, ep=4, dp=2, tpsp=False)) == (2, 4)
    assert expert_groups(options(ep=4, dp=2)) == (2, 4)
    # folded: edp = dp·tp·sp / (ep·etp) groups, each over ep·etp ranks
    assert expert_groups(options(tp=2, dp=4, ep=2, etp=1)) == (4, 2)


def test_tp1_and_capacity_routing_are_unchanged() -> None:
    # tp 1: a multiple of ep, as before (test_moe_routing's closed form)
    o = options(dp=2, ep=2)
    assert expert_capacity(o, TOKENS) == math.ceil(fullest_group_load(o) / 2) * 2 * 2 == 168
    # token dropping: ceil(cf·k·tokens/E), which ep·tp (up to 8) divides here
    for tp in (1, 2, 4):
        capped = options(tp=tp, ep=2, moe_routing="capacity", capacity_factor=1.25)
        assert expert_capacity(capped, TOKENS) == math.ceil(1.25 * 2 * TOKENS / 8) == 160


@pytest.mark.parametrize("kw", [dict(tp=2, dp=2), dict(tp=2, ep=2, dp=2, sp=2)])
def test_expert_gemm_flops_are_the_closed_form_within_the_rounding(registry, kw) -> None:
    o = options(**kw)
    capacity = symbol_values(o)[Capacity]
    h, f, e, k, layers = o.dmodel, o.dff, o.experts, o.kexperts, o.num_stacks
    # three GEMMs of 2·E·C·h·F FLOPs each, forward, and twice that backward, per layer
    flops = expert_flops(build_workload(o, registry))
    assert flops == 18 * e * capacity * h * f * layers
    # = 18·h·F·layers·tokens·k times the dropless factor E·groups·fullest / (k·tokens), and the
    # rounding adds under `shards` slots per group of E experts
    groups, shards = expert_groups(o)
    closed = 18 * h * f * layers * TOKENS * k * (e * groups * fullest_group_load(o) / (k * TOKENS))
    assert closed <= flops < closed + 18 * h * f * layers * e * groups * shards
    # tp only rounds: the same plan without tensor parallelism is within that of it
    untp = expert_flops(build_workload(options(**{**kw, "tp": 1}), registry))
    assert untp <= flops < untp + 18 * h * f * layers * e * groups * shards


def cli_args(plan: dict[str, object]) -> list[str]:
    return [a for key, value in plan.items() for a in (f"--{key}", str(value))]


def test_the_fuzz_plan_generates_validates_and_predicts(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(app, ["generate", *cli_args(FUZZ_PLAN), "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["validate", str(out)])
    assert result.exit_code == 0, result.output
    # from options (no trace) and from the trace: the same iteration
    result = runner.invoke(app, ["predict", *cli_args(FUZZ_PLAN), "--json"])
    assert result.exit_code == 0, result.output
    from_options = json.loads(result.stdout)
    assert from_options["time"]["world_size"] == 16
    assert from_options["time"]["iteration_time_s"] > 0
    result = runner.invoke(app, ["predict", str(out), "--json"])
    assert result.exit_code == 0, result.output
    from_trace = json.loads(result.stdout)
    assert from_trace["time"]["iteration_time_s"] == pytest.approx(
        from_options["time"]["iteration_time_s"]
    )
    o = GenerateOptions(**{**FUZZ_PLAN, "model": "moe", "dmodel": 4096, "dff": 14336})
    assert expert_capacity(o, 8 * 32768) % 16 == 0  # dp·ep·tp divides it now
