"""A serving step reads only the weights of the routed experts its tokens reach: the share of
experts that receive at least one of T tokens routed to k distinct experts of E uniformly is
1 - (1 - k/E)^T (docs/inference.md)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.routing import ACTIVE_EXPERTS_ATTR, EXPERT_WEIGHT_BYTES_ATTR, active_expert_share
from stg.host.registry import load_registry
from stg.predictors.serving import predict_serving
from stg.trace.reader import read_nodes
from stg.trace.writer import write_workload

E, K, H, F, L = 8, 2, 64, 256, 2
SMALL = dict(
    model="moe", dvocal=512, dmodel=H, dff=F, seq=32, head=8, kvhead=4, num_stacks=L,
    experts=E, kexperts=K,
)  # fmt: skip


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def expert_gemms(workload) -> list:
    return [n for n in workload.rank_classes[0].nodes if ACTIVE_EXPERTS_ATTR in n.attrs]


def decode(registry, batch: int, **kw):
    options = GenerateOptions(**{**SMALL, "batch": batch, "phase": "decode", "context": 64, **kw})
    return build_workload(options, registry)


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_a_decode_step_reads_the_experts_its_tokens_reach(registry, batch) -> None:
    workload = decode(registry, batch)
    nodes = expert_gemms(workload)
    assert len(nodes) == 3 * L  # gate, up and down of every layer
    share = 1 - (1 - K / E) ** batch
    for node in nodes:
        held = 2 * E * H * F  # the layer's w1, w3 or w2 in bf16, every expert
        assert node.attrs[EXPERT_WEIGHT_BYTES_ATTR] == held
        assert node.attrs[ACTIVE_EXPERTS_ATTR] == pytest.approx(E * share)
    unread = sum(round(2 * E * H * F * (1 - share)) for _ in nodes)
    facts = workload.rank_classes[0].facts
    assert facts["weight_bytes"] - facts["weight_read_bytes"] == unread


def test_the_unread_bytes_are_what_every_expert_would_add(registry) -> None:
    """A node's bytes plus its unread expert weights are the bytes of the same GEMM over all
    experts: those of a prefill of as many tokens less its larger activations are not at
    hand, so compare two decode batches whose activations differ by a known amount."""
    one, two = (expert_gemms(decode(registry, b)) for b in (1, 2))
    for a, b in zip(one, two, strict=True):
        full_a = a.tensor_size + round(
            a.attrs[EXPERT_WEIGHT_BYTES_ATTR] * (1 - a.attrs[ACTIVE_EXPERTS_ATTR] / E)
        )
        full_b = b.tensor_size + round(
            b.attrs[EXPERT_WEIGHT_BYTES_ATTR] * (1 - b.attrs[ACTIVE_EXPERTS_ATTR] / E)
        )
        batch, m, n, k = a.attrs["gemm"]
        batch_b, m_b, _, _ = b.attrs["gemm"]
        # the activations in and out: one slot per expert more per extra routed row
        assert full_b - full_a == 2 * batch * (m_b - m) * (n + k)
        assert full_a - 2 * batch * m * (n + k) == a.attrs[EXPERT_WEIGHT_BYTES_ATTR]
        assert batch_b == batch


def test_a_long_prefill_reads_every_expert(registry) -> None:
    options = GenerateOptions(**{**SMALL, "batch": 4, "phase": "prefill"})
    workload = build_workload(options, registry)
    assert active_expert_share(options, 4 * 32) == pytest.approx(1.0)
    facts = workload.rank_classes[0].facts
    assert facts["weight_read_bytes"] == facts["weight_bytes"]


def test_expert_parallel_ranks_share_the_tokens_of_their_group(registry) -> None:
    """Under ep 2 (data-parallel attention) the tokens of both attention ranks meet each
    rank's 4 experts: a batch of 2 (one sequence per rank) reaches 1 - (3/4)^2 of them."""
    workload = decode(registry, 2, ep=2)
    for node in expert_gemms(workload):
        assert node.attrs["gemm"][0] == E // 2
        assert node.attrs[ACTIVE_EXPERTS_ATTR] == pytest.approx(E // 2 * (1 - (1 - K / E) ** 2))


def test_fewer_experts_read_make_a_faster_and_bounded_decode_step(registry) -> None:
    """The step's time and its memory-bandwidth bound grow with the experts read; the bound
    stays below the time."""
    reports = [predict_serving(decode(registry, b), "h100-80g") for b in (1, 4, 32)]
    times = [r["time_per_output_token_s"] for r in reports]
    bounds = [r["memory_bandwidth_bound_s"] for r in reports]
    assert times[0] < times[1] < times[2]
    assert bounds[0] < bounds[1] < bounds[2]
    assert all(b < t for b, t in zip(bounds, times, strict=True))


def test_a_written_moe_decode_trace_keeps_its_active_experts(registry, tmp_path) -> None:
    """The attributes travel through the Chakra files: the trace read back predicts the
    generated workload's step."""
    workload = decode(registry, 1)
    emitter = registry.emitters.get("chakra-v0.0.4")
    write_workload(workload, emitter, tmp_path, "workload.%d.et")
    back = read_nodes(tmp_path / "workload.0.et")
    read = [n for n in back if ACTIVE_EXPERTS_ATTR in n.attrs]
    made = expert_gemms(workload)
    assert [(n.tensor_size, n.attrs[ACTIVE_EXPERTS_ATTR]) for n in read] == [
        (n.tensor_size, n.attrs[ACTIVE_EXPERTS_ATTR]) for n in made
    ]


def test_the_cli_reports_the_smaller_bound(tmp_path) -> None:
    args = ["--model", "mixtral-8x7b", "--num_stacks", "2", "--phase", "decode", "--batch", "1"]
    result = CliRunner().invoke(app, ["predict", *args, "--predictor", "serving", "--json"])
    assert result.exit_code == 0, result.output
    serving = json.loads(result.stdout)["serving"]
    # 2 of 8 experts per layer: well under half of the 46.7B-parameter model's bytes
    bound = serving["memory_bandwidth_bound_s"] * serving["bandwidth"]["hbm_bandwidth"]
    assert bound < 0.5 * serving["bandwidth"]["weight_bytes_per_rank"]


def test_training_marks_no_active_experts(registry) -> None:
    options = GenerateOptions(**{**SMALL, "batch": 2})
    assert not expert_gemms(build_workload(replace(options, seq=8), registry))
