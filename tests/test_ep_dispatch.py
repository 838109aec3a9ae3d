"""Expert dispatch through DeepEP or HybridEP (``--moe_dispatcher``), stg.perf.ep_dispatch.

The measured kernels come from NVIDIA-NeMo/Automodel docs/deepep_vs_hybridep_benchmark.md at
18007663a8 (H100 SXM, CX7 400 Gb/s): 4096 tokens per rank, top-8, mock (uniform random)
routing, rates in DeepEP's tests' accounting. The model must give back those kernels' times
on their own shapes, deduplicate a token's copies per rank and per node as the routing puts
them, and reach every predictor and trace consumer through typed node attributes.
"""

from __future__ import annotations

import itertools
from math import comb
from pathlib import Path

import pytest
from consumers import assert_trace_checks_out_and_predicts_as_options
from test_cluster_runs import RUNS, published_iteration_time, run_options, run_system
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions, resolve_model
from stg.core.pipeline import build_workload
from stg.core.routing import (
    DISPATCHER_ATTR,
    EP_EXPERTS_ATTR,
    EP_GATE_ATTR,
    EP_HIDDEN_ATTR,
    EP_KEXPERTS_ATTR,
    EP_ROUTE_ATTR,
)
from stg.core.workload import CollectiveType, NodeType
from stg.errors import TraceError
from stg.host.registry import load_registry
from stg.perf.costs import collective_time, expert_dispatch_time
from stg.perf.ep_dispatch import (
    KERNEL_RATES,
    consecutive_holders,
    dispatch_phases,
    distinct_holders,
    kernel_rate,
    routed,
)
from stg.perf.system import load_system
from stg.predictors.analytical import predict_options as predict_analytical_options
from stg.predictors.time import predict_time, predict_time_options

H100 = load_system("h100-80g")
TOKENS, HIDDEN, TOPK, QWEN_EXPERTS = 4096, 2048, 8, 128


def route(library: str, direction: str, experts: int = QWEN_EXPERTS, hidden: int = HIDDEN,
          gate: str = "random", sms: int = 24) -> tuple:  # fmt: skip
    return (library, direction, TOPK, experts, hidden, gate, sms)


def nccl_buffer(tokens: int = TOKENS, hidden: int = HIDDEN) -> int:
    """NCCL's all-to-all buffer of a rank: every routed copy, bf16."""
    return tokens * TOPK * hidden * 2


@pytest.mark.parametrize("holders,experts,k", [(2, 8, 2), (4, 16, 4), (4, 12, 3), (8, 16, 8)])
def test_distinct_holders_is_the_mean_over_every_routing(holders: int, experts: int, k: int):
    per_holder = experts // holders
    total = sum(
        len({e // per_holder for e in chosen})
        for chosen in itertools.combinations(range(experts), k)
    )
    assert distinct_holders(holders, experts, k) == pytest.approx(total / comb(experts, k))


def test_consecutive_experts_reach_the_ranks_their_blocks_cover() -> None:
    # token t takes experts 8t .. 8t+7 (AutoModel's FakeBalancedGate): 16 experts a rank
    # (EP 8 of 128) or 8 (EP 16) hold a token's 8 whole; 4 a rank (EP 64 of 256) split it in 2
    assert consecutive_holders(8, 128, 8) == 1
    assert consecutive_holders(16, 128, 8) == 1
    assert consecutive_holders(64, 256, 8) == 2
    # 3 experts a token over blocks of 4: starts 0, 3, 6, 9 (mod 12) touch 1, 2, 2, 1 blocks
    assert consecutive_holders(3, 12, 3) == pytest.approx(6 / 4)


def test_rates_are_the_measured_points_and_lie_between_them() -> None:
    for (library, link, direction, dtype), shapes in KERNEL_RATES.items():
        for hidden, by_sms in shapes.items():
            for sms, rate in by_sms.items():
                assert kernel_rate(library, link, direction, dtype, hidden, sms) == rate
    # DeepEP's NVLink dispatch at hidden 2048: 139 GB/s on 8 SMs, 302 on 24: 20 SMs between
    between = kernel_rate("deepep", "nvlink", "dispatch", "bf16", 2048, 20)
    assert between == pytest.approx(139e9 + (302e9 - 139e9) * 12 / 16)
    # beyond the measured SMs and hidden sizes: held, not extrapolated
    assert kernel_rate("deepep", "nvlink", "dispatch", "bf16", 1024, 64) == 302e9
    halfway = kernel_rate("deepep", "rdma", "combine", "bf16", (2048 + 7168) // 2, 24)
    assert halfway == pytest.approx((59.1e9 + 68.2e9) / 2)
    # a combine always moves bf16 (the report: FP8 dispatch, BF16 combine)
    assert kernel_rate("deepep", "nvlink", "combine", "fp8", 2048, 24) == 287e9


@pytest.mark.parametrize(
    "library,direction,rate",
    [("deepep", "dispatch", 302e9), ("deepep", "combine", 287e9),
     ("hybridep", "dispatch", 325e9), ("hybridep", "combine", 304e9)],
)  # fmt: skip
def test_an_ep8_dispatch_takes_the_measured_kernels_time(
    library: str, direction: str, rate: float
) -> None:
    # the report's Qwen3-30B shape on one node: the rows a rank receives, deduplicated per
    # rank, at the kernel's rate (24 SMs)
    phases = dispatch_phases(route(library, direction), nccl_buffer(), "bf16", (8, 1, 1), H100)
    received = TOKENS * distinct_holders(8, QWEN_EXPERTS, TOPK) * HIDDEN * 2
    assert phases == (("nvlink", 0.0, pytest.approx(received / rate)),)


def test_an_ep16_dispatch_over_two_nodes_takes_the_rdma_kernels_time() -> None:
    phases = dispatch_phases(route("deepep", "dispatch"), nccl_buffer(), "bf16", (8, 2, 1), H100)
    pairs = TOKENS * distinct_holders(2, QWEN_EXPERTS, TOPK) * HIDDEN * 2  # (token, node)
    assert phases == (("nic", 0.0, pytest.approx(pairs / 58.9e9)),)
    # FP8 dispatch: its own (slower per byte) rate on the fp8 buffer
    fp8 = dispatch_phases(route("deepep", "dispatch"), nccl_buffer() // 2, "fp8", (8, 2, 1), H100)
    assert fp8[0][2] == pytest.approx(pairs / 2 / 36.2e9)


def test_deduplication_against_nccls_all_to_all() -> None:
    # NCCL sends all 8 copies: over two nodes about half of them cross the NIC; DeepEP sends a
    # token once per node (about 2 pairs a token, one of them local)
    nccl = collective_time(CollectiveType.ALL_TO_ALL, nccl_buffer(), (8, 2, 1), H100)
    deepep = dispatch_phases(route("deepep", "dispatch"), nccl_buffer(), "bf16", (8, 2, 1), H100)
    assert deepep[0][2] < nccl / 2
    consecutive = route("deepep", "dispatch", gate="consecutive")
    once = dispatch_phases(consecutive, nccl_buffer(), "bf16", (8, 2, 1), H100)
    assert once[0][2] == pytest.approx(deepep[0][2] / distinct_holders(2, QWEN_EXPERTS, TOPK))


def test_the_device_presets_name_their_links_for_the_dispatchers() -> None:
    """The DGX A100 40GB preset has the 80GB's fabric (NVLink 3 at 300 GB/s, one 25 GB/s NIC
    per GPU): DeepEP's dispatch over two of its nodes takes what it takes on the 80GB preset,
    on an NVLink inside a node as on the NIC across."""
    a100 = load_system("a100-80g")
    small = load_system("a100-40g")
    deepep = route("deepep", "dispatch")
    for shape, port in (((8, 1), "nvlink"), ((8, 2), "nic")):
        ((got_port, _, got),) = dispatch_phases(deepep, nccl_buffer(), "bf16", shape, small)
        ((_, _, want),) = dispatch_phases(deepep, nccl_buffer(), "bf16", (*shape, 1), a100)
        assert (got_port, got) == (port, pytest.approx(want))
    assert [d.link for d in small.network] == ["nvlink", "network"]
    assert [d.link for d in load_system("t4-16g").network] == ["pcie", "network"]


def test_rates_scale_with_the_links_of_another_system() -> None:
    h800 = load_system("h800-80g")  # NVLink 200 GB/s per direction against the H100's 450
    h100 = dispatch_phases(route("deepep", "dispatch"), nccl_buffer(), "bf16", (8, 1, 1), H100)
    slower = dispatch_phases(route("deepep", "dispatch"), nccl_buffer(), "bf16", (8, 1, 1), h800)
    ratio = H100.network[0].bandwidth / h800.network[0].bandwidth
    assert slower[0][2] == pytest.approx(h100[0][2] * ratio)


QWEN = dict(
    model="moe", dmodel=HIDDEN, dff=768, head=32, kvhead=4, dhead=128, experts=QWEN_EXPERTS,
    kexperts=TOPK, num_stacks=2, seq=512, dvocal=1024, dp=16, ep=16, ep_layout="fold",
    batch=32, micro_batch=16, mixed_precision=True, dtype="bf16", causal=True,
)  # fmt: skip


def _all_to_alls(options: GenerateOptions) -> list:
    workload = build_workload(options, load_registry(autoload=False))
    return [
        n
        for n in workload.ranks[0].nodes()
        if n.type is NodeType.COMM_COLL and n.comm_type is CollectiveType.ALL_TO_ALL
    ]


def test_the_dispatch_all_to_alls_carry_their_routing() -> None:
    plain = _all_to_alls(GenerateOptions(**QWEN))
    assert plain and all(DISPATCHER_ATTR not in n.attrs for n in plain)
    marked = _all_to_alls(
        GenerateOptions(**QWEN, moe_dispatcher="hybridep", moe_gate="consecutive")
    )
    assert [n.comm_size for n in marked] == [n.comm_size for n in plain]
    routes = {}
    for n in marked:
        attrs = n.attrs
        assert attrs[DISPATCHER_ATTR] == "hybridep"
        assert (attrs[EP_KEXPERTS_ATTR], attrs[EP_EXPERTS_ATTR]) == (TOPK, QWEN_EXPERTS)
        assert (attrs[EP_HIDDEN_ATTR], attrs[EP_GATE_ATTR]) == (HIDDEN, "consecutive")
        routes.setdefault((n.attrs["phase"], attrs[EP_ROUTE_ATTR]), 0)
        routes[(n.attrs["phase"], attrs[EP_ROUTE_ATTR])] += 1
    # each layer: dispatch and combine forward, and backward the combine's gradient goes to
    # the experts (a dispatch) and the dispatch's comes back (a combine)
    layers = QWEN["num_stacks"] * QWEN["batch"] // QWEN["micro_batch"]  # of every micro-batch
    assert routes == {(1, "dispatch"): layers, (1, "combine"): layers,
                      (2, "dispatch"): layers, (2, "combine"): layers}  # fmt: skip


def test_every_predictor_and_the_written_trace_price_the_dispatcher(tmp_path: Path) -> None:
    options = GenerateOptions(**QWEN, moe_dispatcher="deepep")
    registry = load_registry(autoload=False)
    system = load_system("h100-80g")
    timed = predict_time_options(options, system, registry=registry)["iteration_time_s"]
    nccl = predict_time_options(GenerateOptions(**QWEN), system, registry=registry)
    assert timed < nccl["iteration_time_s"]
    whole = predict_time(build_workload(options, registry), system, exact=True)
    assert whole["iteration_time_s"] == pytest.approx(timed, rel=1e-9)
    analytical = predict_analytical_options(options, system, registry=registry)
    plain = predict_analytical_options(GenerateOptions(**QWEN), system, registry=registry)
    assert analytical["iteration_time_s"] < plain["iteration_time_s"]
    out = tmp_path / "trace"
    runner = CliRunner()
    flags = [f"--{k}={v}" for k, v in {**QWEN, "moe_dispatcher": "deepep"}.items()]
    result = runner.invoke(app, ["generate", *flags, "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    assert_trace_checks_out_and_predicts_as_options(out, {**QWEN, "moe_dispatcher": "deepep"})


def test_the_node_attributes_name_the_route() -> None:
    (node, *_) = _all_to_alls(GenerateOptions(**QWEN, moe_dispatcher="deepep"))
    assert routed(node.attrs) == ("deepep", "dispatch", TOPK, QWEN_EXPERTS, HIDDEN, "random", 20)
    assert expert_dispatch_time(node.attrs, node.comm_size, "bf16", (8, 2, 1), H100) > 0
    assert routed({"op": "all_to_all"}) is None
    assert expert_dispatch_time({}, node.comm_size, "bf16", (8, 2, 1), H100) is None


@pytest.mark.parametrize(
    "args,message",
    [
        (["--moe_dispatcher", "nccl"],
         "moe_dispatcher='nccl' must be one of alltoall, deepep, hybridep"),
        (["--moe_dispatcher", "deepep", "--ep", "1"],
         "moe_dispatcher=deepep runs the expert-parallel all-to-alls: ep=1 is not allowed; "
         "allowed: ep > 1 (or moe_dispatcher=alltoall)"),
        (["--moe_gate", "consecutive"],
         "moe_gate=consecutive decides where DeepEP and HybridEP send a token: "
         "moe_dispatcher=alltoall is not allowed with it; allowed: deepep, hybridep"),
        (["--moe_gate", "round"], "moe_gate='round' must be one of random, consecutive"),
        (["--moe_dispatcher", "deepep", "--moe_gate", "consecutive", "--moe_routing", "dropless"],
         "moe_gate=consecutive loads every expert equally: moe_routing=dropless is not allowed "
         "with it; allowed: capacity"),
        (["--moe_dispatcher_sms", "8"],
         "moe_dispatcher_sms=8 is the SM budget of DeepEP's or HybridEP's kernels: "
         "moe_dispatcher=alltoall is not allowed with it; allowed: moe_dispatcher deepep or "
         "hybridep"),
        (["--moe_dispatcher", "deepep", "--moe_dispatcher_sms", "0"],
         "moe_dispatcher_sms=0 must be a positive number of SMs"),
        (["--moe_dispatcher", "deepep", "--moe_sort_by_expert", "true"],
         "moe_sort_by_expert=true is Megatron-core's alltoall token dispatcher: "
         "moe_dispatcher=deepep (whose kernels permute the tokens themselves) is not allowed "
         "with it; allowed: moe_dispatcher=alltoall"),
        (["--moe_dispatcher", "deepep", "--system", "a10-24g"],
         "moe_dispatcher=deepep moves tokens over NVLink inside a node and RDMA between nodes: "
         "system 'a10-24g' joins its GPUs over 'pcie' (a pcie link); allowed there: "
         "moe_dispatcher=alltoall"),
        (["--moe_dispatcher", "deepep", "--system", "v100-32g"],
         "moe_dispatcher=deepep runs on ampere, hopper, blackwell, cdna3, cdna4 GPUs: system "
         "'v100-32g' has volta GPUs; allowed there: moe_dispatcher=alltoall"),
        (["--moe_dispatcher", "hybridep", "--system", "a100-80g"],
         "moe_dispatcher=hybridep runs on hopper, blackwell GPUs: system 'a100-80g' has ampere "
         "GPUs; allowed there: moe_dispatcher=alltoall"),
        (["--moe_dispatcher", "deepep", "--phase", "decode", "--context", "64"],
         "moe_dispatcher=deepep is a training option; phase=decode has no backward, gradients "
         "or optimizer (leave it unset)"),
    ],
)  # fmt: skip
def test_refused_plans_get_one_line(args: list[str], message: str) -> None:
    base = [
        "--model", "moe", "--num_stacks", "2", "--dmodel", "256", "--dff", "512", "--head", "4",
        "--kvhead", "4", "--seq", "64", "--dvocal", "512", "--experts", "8", "--kexperts", "2",
        "--dp", "4", "--ep", "4", "--ep_layout", "fold", "--batch", "8",
    ]  # fmt: skip
    result = CliRunner().invoke(app, ["predict", "--json", *base, *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: {message}"


@pytest.mark.parametrize("predictor", ["memory", "analytical"])
def test_a_predictor_that_prices_no_dispatch_refuses_it_as_well(predictor: str) -> None:
    """The memory predictor prices no all-to-all, and answered for DeepEP on V100s that the
    time predictor refuses; every predictor refuses it alike now."""
    base = [
        "--model", "moe", "--num_stacks", "2", "--dmodel", "256", "--dff", "512", "--head", "4",
        "--kvhead", "4", "--seq", "64", "--dvocal", "512", "--experts", "8", "--kexperts", "2",
        "--dp", "4", "--ep", "4", "--ep_layout", "fold", "--batch", "8",
        "--moe_dispatcher", "deepep", "--system", "v100-32g", "--predictor", predictor,
    ]  # fmt: skip
    result = CliRunner().invoke(app, ["predict", "--json", *base])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "error: moe_dispatcher=deepep runs on ampere, hopper, blackwell, cdna3, cdna4 GPUs: "
        "system 'v100-32g' has volta GPUs; allowed there: moe_dispatcher=alltoall"
    )


def test_a_trace_with_broken_routing_gets_one_line() -> None:
    with pytest.raises(TraceError, match="lacks valid routing attributes"):
        routed({DISPATCHER_ATTR: "deepep", EP_ROUTE_ATTR: "dispatch"})
    with pytest.raises(TraceError, match="lacks valid routing attributes"):
        routed({DISPATCHER_ATTR: "nccl2", EP_ROUTE_ATTR: "dispatch", EP_KEXPERTS_ATTR: 8,
                EP_EXPERTS_ATTR: 128, EP_HIDDEN_ATTR: 2048})  # fmt: skip


def test_the_periodic_replay_prices_the_dispatcher_as_the_whole_one() -> None:
    # 32 micro-batches: the steady state is replayed once and extrapolated
    options = GenerateOptions(**{**QWEN, "batch": 512}, moe_dispatcher="deepep")
    registry = load_registry(autoload=False)
    report = predict_time_options(options, H100, registry=registry)
    assert report["replay"]["kind"] == "periodic"
    whole = predict_time(build_workload(options, registry), H100, exact=True)
    assert report["iteration_time_s"] == pytest.approx(whole["iteration_time_s"], rel=1e-9)


def test_a_model_without_experts_refuses_the_dispatcher() -> None:
    result = CliRunner().invoke(
        app,
        ["predict", "--model", "llama3-8b", "--dp", "8", "--ep", "2", "--ep_layout", "fold",
         "--batch", "16", "--moe_dispatcher", "deepep"],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "does not apply to model 'llama'" in result.stderr


def _run(run_id: str) -> dict:
    return next(e for e in RUNS if e["id"] == run_id)


def test_deduplicated_dispatch_decides_a_two_node_run() -> None:
    """AutoModel's Qwen3-30B over 2 nodes (EP 16, DeepEP, fake balanced gate): each token's
    8 experts sit on one rank, so DeepEP sends it once; NCCL's all-to-all of 8 copies, half
    over InfiniBand, would nearly double the step. The published step settles it."""
    registry = load_registry(autoload=False)
    entry = _run("am2607-qwen3-30b-a3b-16h100-ep16-deepep")
    options = run_options(entry, registry)
    published = published_iteration_time(entry, options)
    system = run_system(entry)
    deepep = predict_time_options(options, system, registry=registry)["iteration_time_s"]
    values, _ = resolve_model(
        {"model": entry["model"], **entry["options"], "moe_dispatcher": "alltoall",
         "moe_gate": "random"},
        registry,
    )  # fmt: skip
    nccl = predict_time_options(GenerateOptions(**values), system, registry=registry)
    assert abs(deepep / published - 1) < 0.1
    assert nccl["iteration_time_s"] / published > 1.5


def test_overlapped_all_to_alls_keep_the_dispatcher() -> None:
    """Under ``overlap_moe_ep_comm`` (the all-to-alls laid out beside the other micro-batch's
    compute) the dispatch and combine stay marked and priced as the dispatcher's."""
    registry = load_registry(autoload=False)
    options = {**QWEN, "overlap_moe_ep_comm": True}
    marked = _all_to_alls(GenerateOptions(**options, moe_dispatcher="deepep"))
    assert marked and all(routed(n.attrs) is not None for n in marked)
    times = [
        predict_time_options(GenerateOptions(**options, moe_dispatcher=d), "h100-80g",
                             registry=registry)["iteration_time_s"]
        for d in ("alltoall", "deepep")
    ]  # fmt: skip
    assert times[1] < times[0]
