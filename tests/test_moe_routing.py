"""``--moe_routing``: token dropping at a capacity factor, or dropless routing whose experts are
shaped for the expected most loaded expert (balls into bins, Raab and Steger 1998)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner
from workload_checks import comm_bytes, flops_by_root

from stg.cli import app
from stg.core.options import GenerateOptions, OptionError
from stg.core.pipeline import build_workload, symbol_values
from stg.core.routing import expected_max_load, expert_capacity
from stg.core.symbolic import Capacity
from stg.host.registry import load_registry
from stg.predictors.memory import activation_bytes_per_layer
from stg.predictors.time import predict_time

SMALL = dict(
    model="moe", dvocal=512, dmodel=64, dff=128, head=8, kvhead=4, num_stacks=2, seq=64,
    batch=8, micro_batch=8, experts=8, kexperts=2,
)  # fmt: skip
EXPERT_GEMMS = ("expert_gate", "expert_up", "expert_down")


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def options(**kw: object) -> GenerateOptions:
    return GenerateOptions(**{**SMALL, **kw})


def expert_flops(workload) -> int:
    flops = flops_by_root(workload)
    return sum(flops[name] for name in EXPERT_GEMMS)


def test_expected_max_load_is_the_balls_into_bins_closed_form() -> None:
    # m/n + sqrt(2·(m/n)·ln n) with mean m/n = 4096 slots over n = 128 experts
    assert expected_max_load(4096, 128) == pytest.approx(4096 + math.sqrt(2 * 4096 * math.log(128)))
    assert expected_max_load(100, 1) == 100  # one bin holds every ball


def test_capacity_routing_caps_each_expert_at_the_capacity_factor() -> None:
    tokens = 8 * 64
    o = options(capacity_factor=1.25)
    assert expert_capacity(o, tokens) == math.ceil(1.25 * 2 * tokens / 8) == 160
    assert symbol_values(o)[Capacity] == 160


def test_dropless_shapes_every_expert_for_the_expected_fullest_one() -> None:
    tokens, dp, ep = 8 * 64, 2, 2
    o = options(moe_routing="dropless", dp=dp, ep=ep)
    bins = 8 * dp  # E experts in each of the dp groups
    fullest = 2 * tokens / bins + math.sqrt(2 * (2 * tokens / bins) * math.log(bins))
    assert symbol_values(o)[Capacity] == math.ceil(fullest / ep) * ep * dp == 168
    assert symbol_values(o)[Capacity] > symbol_values(options(dp=dp, ep=ep))[Capacity] == 128


def test_dropless_load_never_exceeds_the_tokens_of_a_group() -> None:
    # one token per group of 8 experts, top-8: every expert gets that token, never more
    o = options(moe_routing="dropless", batch=1, micro_batch=1, seq=1, kexperts=8)
    assert expert_capacity(o, 1) == 1


def test_dropless_expert_gemms_and_all_to_alls_are_the_fullest_experts(registry) -> None:
    balanced = build_workload(options(ep=2), registry)
    dropless = build_workload(options(ep=2, moe_routing="dropless"), registry)
    ratio = symbol_values(options(moe_routing="dropless"))[Capacity] / 128
    assert ratio > 1
    assert expert_flops(dropless) == pytest.approx(expert_flops(balanced) * ratio)
    to_all = ("ALL_TO_ALL", ("ep",))
    assert comm_bytes(dropless, 0)[to_all] == pytest.approx(comm_bytes(balanced, 0)[to_all] * ratio)
    # ops over the token slots (dispatch, SwiGLU, combine) grow too; nothing else changes
    slotted = (*EXPERT_GEMMS, "swiglu", "combine", "dispatch")
    others = [
        {k: v for k, v in flops_by_root(w).items() if not k.startswith(slotted)}
        for w in (dropless, balanced)
    ]
    assert others[0] == others[1]


def test_dropless_totals_do_not_change_with_ep(registry) -> None:
    totals = {
        ep: expert_flops(build_workload(options(ep=ep, moe_routing="dropless"), registry))
        for ep in (1, 2, 4)
    }
    assert len(set(totals.values())) == 1, totals


def test_dropless_predicts_slower_and_heavier_than_balanced(registry) -> None:
    balanced, dropless = options(ep=2), options(ep=2, moe_routing="dropless")
    times = [
        predict_time(build_workload(o, registry), "h100-80g")["iteration_time_s"]
        for o in (balanced, dropless)
    ]
    assert times[1] > times[0]
    assert activation_bytes_per_layer(dropless) > activation_bytes_per_layer(balanced)


def test_default_routing_is_left_out_of_trace_metadata() -> None:
    assert "moe_routing" not in options().recorded()
    assert options(moe_routing="dropless").recorded()["moe_routing"] == "dropless"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(moe_routing="topk"), "moe_routing='topk' must be one of capacity, dropless"),
        (dict(moe_routing="dropless", capacity_factor=1.5), "allowed: capacity_factor=1"),
    ],
)
def test_bad_routing_is_rejected(registry, kw: dict, message: str) -> None:
    with pytest.raises(OptionError, match=message):
        build_workload(options(**kw), registry)


def test_cli_rejects_an_unknown_routing_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["generate", "--model", "moe", "--moe_routing", "none", "--output_dir", str(out)]
    )
    assert result.exit_code == 2
    assert "moe_routing='none' must be one of capacity, dropless" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()
