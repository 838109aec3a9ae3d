"""``--optimizer muon``: Megatron-Core's Muon in the trace, in time and in memory.

Muon orthogonalizes each weight matrix of the layers by Newton-Schulz iterations (``4 m^2 n +
2 m^3`` FLOPs each for an ``m x n`` matrix, ``m <= n``), keeps one fp32 momentum where Adam
keeps two moments, gathers a tensor-parallel matrix whole first, and under ``--zero`` 1 or 2
shares the iterations over data parallelism (:mod:`stg.core.muon`).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from consumers import assert_trace_checks_out_and_predicts_as_options
from typer.testing import CliRunner

from stg.cli import app
from stg.core.lowering import _newton_schulz
from stg.core.muon import MuonMatrices
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import CollectiveType, NodeType
from stg.host.registry import load_registry
from stg.perf.costs import compute_time
from stg.perf.system import load_system
from stg.predictors.analytical import predict_options as predict_analytical_options
from stg.predictors.memory import predict_memory, predict_memory_options
from stg.predictors.time import predict_time_options

KERNELS = Path(__file__).parent / "data" / "kernels"

D, F, HEADS, KV_HEADS, LAYERS = 1024, 2816, 8, 2, 4
LLAMA = dict(
    model="llama", dmodel=D, dff=F, head=HEADS, kvhead=KV_HEADS, num_stacks=LAYERS, seq=512,
    dvocal=1000, batch=8, micro_batch=4, mixed_precision=True, dtype="bf16", causal=True,
)  # fmt: skip
STEPS = 5
DEEPSEEK = dict(
    model="deepseek", dvocal=64, dmodel=32, dff=16, head=4, kvhead=4, dhead=8, seq=16,
    num_stacks=3, experts=4, kexperts=2, shared_experts=1, dense_layers=1, dense_dff=48,
    q_lora_rank=12, kv_lora_rank=16, drope=4, batch=4, optimizer="muon",
)  # fmt: skip


def ns_flops(m: int, n: int) -> int:
    m, n = sorted((m, n))
    return STEPS * (4 * m * m * n + 2 * m**3)


KV = D // HEADS * KV_HEADS
LAYER_NS_FLOPS = (
    2 * ns_flops(D, D)  # query and output projections
    + 2 * ns_flops(KV, D)  # key and value (Megatron's muon_split_qkv)
    + ns_flops(2 * F, D)  # fc1: gate and up, one matrix
    + ns_flops(F, D)  # down
)
LAYER_MATRIX_ELEMENTS = 2 * D * D + 2 * KV * D + 3 * D * F


def _workload(**kw: object):  # type: ignore[no-untyped-def]
    return build_workload(GenerateOptions(**{**LLAMA, **kw}), load_registry(autoload=False))


def _muon_nodes(rank_class):  # type: ignore[no-untyped-def]
    return [n for n in rank_class.nodes if n.name.startswith("muon_")]


def test_newton_schulz_flops_match_the_closed_form() -> None:
    workload = _workload(optimizer="muon")
    (rank,) = workload.rank_classes
    flops = sum(n.num_ops for n in _muon_nodes(rank) if n.type is NodeType.COMP)
    normalize = 3 * LAYER_MATRIX_ELEMENTS * LAYERS
    assert flops == LAYERS * LAYER_NS_FLOPS + normalize
    # Adam's trace has none of them, and Muon's step moves 8 bytes less per matrix element
    adam = _workload().rank_classes[0]
    assert not _muon_nodes(adam)
    adam_step = next(n for n in adam.nodes if n.name == "optimizer_step")
    muon_step = next(n for n in rank.nodes if n.name == "optimizer_step")
    saved = adam_step.tensor_size - muon_step.tensor_size
    assert saved == 8 * LAYERS * LAYER_MATRIX_ELEMENTS


def test_more_iterations_cost_proportionally_more() -> None:
    def ns(steps: int) -> int:
        rank = _workload(optimizer="muon", muon_ns_steps=steps).rank_classes[0]
        return sum(n.num_ops for n in _muon_nodes(rank) if "normalize" not in n.name)

    assert ns(10) == 2 * ns(5) == 2 * LAYERS * LAYER_NS_FLOPS


def test_tensor_parallel_matrices_are_gathered_and_orthogonalized_whole() -> None:
    rank = _workload(optimizer="muon", tp=2).rank_classes[0]
    nodes = _muon_nodes(rank)
    (gather,) = [n for n in nodes if n.type is NodeType.COMM_COLL]
    assert gather.comm_type is CollectiveType.ALL_GATHER
    assert gather.group_axes == ("tp",)
    # every matrix is split over tp: each rank sends its half of every fp32 momentum
    assert gather.comm_size == 4 * LAYERS * LAYER_MATRIX_ELEMENTS // 2
    flops = sum(n.num_ops for n in nodes if n.type is NodeType.COMP and "normalize" not in n.name)
    assert flops == LAYERS * LAYER_NS_FLOPS  # whole matrices on every member ("duplicated")


def test_layer_wise_distributed_muon_shares_the_iterations() -> None:
    whole = _workload(optimizer="muon", dp=2, batch=8).rank_classes[0]
    shared = _workload(optimizer="muon", dp=2, batch=8, zero=1).rank_classes[0]

    def gemm_flops(rank) -> int:  # type: ignore[no-untyped-def]
        return sum(n.num_ops for n in _muon_nodes(rank) if n.attrs.get("gemm"))

    assert gemm_flops(whole) == LAYERS * LAYER_NS_FLOPS
    assert gemm_flops(shared) == LAYERS * LAYER_NS_FLOPS // 2
    assert all(n.attrs.get("share") == 0.5 for n in _muon_nodes(shared))
    system = load_system("h100-80g")
    seconds = [sum(compute_time(n, system) for n in _muon_nodes(r)) for r in (whole, shared)]
    assert seconds[1] == pytest.approx(seconds[0] / 2, rel=0.01)


def test_trace_is_read_by_the_consumers_and_predicts_as_the_options(tmp_path: Path) -> None:
    options = {**LLAMA, "tp": 2, "pp": 2, "dp": 2, "zero": 1, "optimizer": "muon"}
    flags = [a for k, v in options.items() for a in (f"--{k}", str(v).lower())]
    result = CliRunner().invoke(app, ["generate", *flags, "--output_dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert_trace_checks_out_and_predicts_as_options(tmp_path, options)


def test_predictors_agree_and_muon_costs_time() -> None:
    registry = load_registry(autoload=False)
    base = {**LLAMA, "tp": 2, "pp": 2, "dp": 2, "batch": 16, "micro_batch": 4}
    times = {}
    for opt in ("adam", "muon"):
        for zero in (0, 1):
            o = GenerateOptions(**base, optimizer=opt, zero=zero)
            replay = predict_time_options(o, "h100-80g", registry=registry)["iteration_time_s"]
            analytic = predict_analytical_options(o, "h100-80g", registry=registry)
            assert analytic["iteration_time_s"] == pytest.approx(replay, rel=0.02)
            times[opt, zero] = replay
    assert times["muon", 0] > times["muon", 1] > times["adam", 1]


@pytest.mark.parametrize("mixed", [True, False])
def test_one_state_where_adam_keeps_two(mixed: bool) -> None:
    """Muon keeps one moment per matrix element where Adam keeps two (4 bytes less with fp32
    state under mixed precision, one bf16 moment's 2 without); norms keep Adam's."""
    saved_per_element = 4 if mixed else 2
    for zero in (0, 1):
        base = {**LLAMA, "mixed_precision": mixed, "zero": zero, "dp": 2}
        adam = predict_memory_options(GenerateOptions(**base), "h100-80g")
        registry = load_registry(autoload=False)
        muon_o = GenerateOptions(**base, optimizer="muon")
        muon = predict_memory_options(muon_o, "h100-80g", registry=registry)
        saved = adam["classes"][0]["optimizer"] - muon["classes"][0]["optimizer"]
        elements = LAYERS * LAYER_MATRIX_ELEMENTS / (2 if zero else 1)
        assert saved == pytest.approx(saved_per_element * elements, rel=1e-6)
        # the same from the built workload's facts
        built = predict_memory(_workload(**base, optimizer="muon"), "h100-80g")
        assert built["peak_bytes"] == muon["peak_bytes"]
        # and the optimizer step reads and writes one moment less per matrix element
        steps = [
            next(n for n in _workload(**base, optimizer=opt).rank_classes[0].nodes
                 if n.name == "optimizer_step").tensor_size
            for opt in ("adam", "muon")
        ]  # fmt: skip
        assert steps[0] - steps[1] == 2 * saved_per_element * elements


def test_experts_share_over_expert_data_parallelism() -> None:
    """With ep folded over dp, a routed expert's matrices are shared over edp, the dense ones
    over dp; the memory predictor from options and from the workload agree."""
    moe = dict(
        model="moe", dmodel=256, dff=512, head=4, kvhead=4, num_stacks=2, seq=128, dvocal=1000,
        experts=4, kexperts=2, batch=8, mixed_precision=True, optimizer="muon", zero=1,
    )  # fmt: skip
    for ep, dp in ((2, 4), (4, 4)):
        o = GenerateOptions(**moe, ep=ep, dp=dp, ep_layout="fold")
        workload = build_workload(o, load_registry(autoload=False))
        rank = workload.rank_classes[0]
        shares = {n.attrs["gemm"][1:]: n.attrs.get("share", 1.0) for n in _muon_nodes(rank)
                  if n.attrs.get("op") == "muon_gram"}  # fmt: skip
        assert shares[(256, 256, 256)] == pytest.approx(1 / dp)  # attention projections
        # an expert's fc1 (2·512 x 256) and down (512 x 256): shared over edp = dp / ep
        assert shares[(256, 256, 1024)] == pytest.approx(ep / dp)
        assert shares[(256, 256, 512)] == pytest.approx(ep / dp)
        options = predict_memory_options(o, "h100-80g", registry=load_registry(autoload=False))
        assert predict_memory(workload, "h100-80g")["peak_bytes"] == options["peak_bytes"]


def test_multi_token_prediction_layers_are_orthogonalized() -> None:
    """DeepSeek's MTP modules sit in the head part: their matrices are Muon's too (the LM
    head, a weight with a vocabulary dimension, stays Adam's)."""
    counts = []
    for depth in (0, 1):
        o = GenerateOptions(**DEEPSEEK, mtp_depth=depth)
        rank = build_workload(o, load_registry(autoload=False)).rank_classes[0]
        counts.append(sum(n.attrs["gemm"][0] for n in _muon_nodes(rank)
                          if n.attrs.get("op") == "muon_gram"))  # fmt: skip
    assert counts[1] > counts[0]


def test_explain_and_mfu_count_muon_as_optimizer_work() -> None:
    registry = load_registry(autoload=False)
    o = GenerateOptions(**LLAMA, optimizer="muon", tp=2)
    report = predict_time_options(o, "h100-80g", registry=registry, explain=True)
    adam = predict_time_options(
        GenerateOptions(**LLAMA, tp=2), "h100-80g", registry=registry, explain=True
    )
    assert report["model_flops"] == adam["model_flops"]
    assert report["hardware_flops"] > adam["hardware_flops"]
    parts, adam_parts = report["explain"]["breakdown_s"], adam["explain"]["breakdown_s"]
    assert parts["compute: optimizer"] > 10 * adam_parts["compute: optimizer"]
    assert "communication: muon momentum all_gather (2 ranks)" in parts


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--optimizer", "sgd"], "optimizer=sgd; allowed: adam, muon"),
        (["--optimizer", "muon", "--zero", "3"], "weight_sharded=true (zero=3) is not allowed"),
        (["--optimizer", "muon", "--muon_ns_steps", "0"], "muon_ns_steps=0 must be at least 1"),
        (["--optimizer", "muon", "--profile", "eager"], "allowed: profile=megatron"),
        (["--muon_ns_steps", "7"], "muon_ns_steps=7 is Muon's: optimizer=adam is not allowed"),
        (
            ["--optimizer", "muon", "--phase", "decode", "--mixed_precision", "false"],
            "optimizer=muon is a training option",
        ),
    ],
)
def test_bad_input_is_one_line(flags: list[str], message: str) -> None:
    base = [a for k, v in LLAMA.items() for a in (f"--{k}", str(v).lower())]
    result = CliRunner().invoke(app, ["predict", *base, *flags])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_adam_traces_do_not_record_the_optimizer() -> None:
    assert "optimizer" not in GenerateOptions(**LLAMA).recorded()
    assert "muon_ns_steps" not in GenerateOptions(**LLAMA).recorded()
    recorded = GenerateOptions(**LLAMA, optimizer="muon").recorded()
    assert recorded["optimizer"] == "muon" and recorded["muon_ns_steps"] == STEPS


def _priced_orthogonalization(m: int, n: int, system: str = "h100-80g") -> float:
    """stg's seconds for one ``m x n`` matrix's whole orthogonalization on ``system``."""

    class Out:
        def __init__(self) -> None:
            self.nodes: list[dict] = []

        def add(self, fields: dict, deps: object) -> int:
            self.nodes.append(fields)
            return len(self.nodes) - 1

    out = Out()
    _newton_schulz(out, [MuonMatrices(m, n, 1)], STEPS, [])
    return sum(compute_time(SimpleNamespace(**f), load_system(system)) for f in out.nodes)


def test_fused_linear_layers_are_one_matrix() -> None:
    """DeepSeek's matrices as Megatron-Core holds them: the query up-projection with its RoPE
    part, the key and value up-projections, and every SwiGLU's gate and up, each one matrix;
    the routed experts one matrix each."""
    workload = build_workload(GenerateOptions(**DEEPSEEK), load_registry(autoload=False))
    (rank,) = workload.rank_classes
    shapes = {}
    for n in _muon_nodes(rank):
        if n.attrs.get("op") == "muon_gram":
            runs, m, _, k = n.attrs["gemm"]
            shapes[m, k] = runs // STEPS
    heads, dhead, drope = 4, 8, 4
    assert shapes[12, heads * (dhead + drope)] == 3  # linear_q_up_proj, a layer each
    assert shapes[16, heads * 2 * dhead] == 3  # linear_kv_up_proj
    assert shapes[32, 2 * 48] == 1  # the dense layer's fc1
    # 32 x 32: two MoE layers' 4 routed experts' fc1 (2·16 x 32) each alone and the shared
    # expert's, and the three layers' output projections (4·8 x 32)
    assert shapes[32, 2 * 16] == 2 * (4 + 1) + 3
    assert shapes[16, 32] == 2 * (4 + 1)  # the experts' down projections


@pytest.mark.parametrize(("prefix", "system"), [("h100", "h100-80g"), ("h200", "h200-141g")])
def test_orthogonalization_price_against_measurements(prefix: str, system: str) -> None:
    """benchmarks/measure_newton_schulz.py on an H100 and an H200 (tests/data/kernels): the
    whole orthogonalization (normalisation, casts, 5 iterations) of weight matrices of the
    models in tests/data/runs. Matrices of 1536 rows and more are within 12 %; the skinny Gram
    GEMMs of smaller ones (``m x m`` over a long ``n``) run slower than the tile model prices
    them."""
    data = KERNELS / f"{prefix}-newton-schulz.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()[1:]]
    assert len(rows) >= 15
    for row in rows:
        ratio = _priced_orthogonalization(row["m"], row["n"], system) * 1e3 / row["whole_ms"]
        if row["m"] >= 1536:
            assert 0.88 <= ratio <= 1.12, (row, ratio)
        else:
            assert 0.5 <= ratio <= 1.0, (row, ratio)


def test_options_and_trace_predict_the_same_iteration_under_muon(tmp_path) -> None:
    # Newton-Schulz normalize nodes of two shapes with equal bytes differ in their launches:
    # the engine's cost key holds them (it once priced both as the first one met)
    import json

    from typer.testing import CliRunner

    from stg.cli import app

    args = ["--model", "llama", "--dmodel", "256", "--head", "4", "--kvhead", "4", "--dff",
            "1024", "--num_stacks", "1", "--seq", "64", "--dvocal", "1024", "--batch", "2",
            "--optimizer", "muon", "--system", "h100-80g"]  # fmt: skip
    runner = CliRunner()
    out = tmp_path / "trace"
    assert runner.invoke(app, ["generate", *args, "--output_dir", str(out)]).exit_code == 0
    times = []
    for given in (args, [str(out), "--system", "h100-80g"]):
        result = runner.invoke(app, ["predict", *given, "--predictor", "time", "--json"])
        assert result.exit_code == 0, result.output
        times.append(json.loads(result.output)["time"]["iteration_time_s"])
    assert times[0] == pytest.approx(times[1], rel=1e-9)
