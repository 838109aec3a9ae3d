"""Gradients of weights replicated over tensor parallelism under sequence parallelism (layer
norms, row-parallel biases: Megatron-LM's ``sequence_parallel`` parameters) are partial over the
tensor-parallel group as well as over the data-parallel one. Megatron-LM (core_v0.15.0, the same
at core_v0.19.0) reduces them over dp in the buckets like every other gradient
(``finish_grad_sync``), then all-reduces all of them over tp in ONE coalesced all-reduce per
iteration (``_allreduce_non_tensor_model_parallel_grads`` in
megatron/core/distributed/finalize_model_grads.py: ``_flatten_dense_tensors`` of every model
chunk's ``main_grad``, the whole gradients also under the distributed optimizer; Megatron-FSDP:
``grad._local_tensor``, this rank's shard), before the optimizer step.

Per GPT layer (LayerNorm with bias) they are ``input_layernorm`` and ``pre_mlp_layernorm``
(weight and bias: ``fused_layer_norm.py`` marks both) and the biases of the attention
projection and of the second MLP matrix (``RowParallelLinear``, tensor_parallel/layers.py):
6·h elements; the last stage adds ``final_layernorm`` (2·h)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from consumers import assert_trace_checks_out_and_predicts_as_options
from typer.testing import CliRunner

from stg.api import collective_time, group_shape, load_system, node_micro_batch
from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import CollectiveType, NodeType
from stg.host.registry import load_registry
from stg.predictors.analytical import group_members, predict_options
from stg.predictors.time import predict_time
from stg.trace.reader import read_nodes

H, F, LAYERS, PP, DP = 64, 128, 4, 2, 2
GPT = dict(
    model="gpt", dvocal=256, dmodel=H, dff=F, head=4, kvhead=4, seq=64, num_stacks=LAYERS,
    batch=16, micro_batch=4, dp=DP, pp=PP,
)  # fmt: skip
GRAD_BYTES = 2  # bf16 gradients
PER_LAYER = 6 * H  # two layer norms (weight, bias), two row-parallel biases
FINAL_NORM = 2 * H


def layer_elements(tp: int) -> int:
    """One layer's weight elements on a rank: the column- and row-parallel matrices and
    biases split over tp, the replicated ones whole."""
    split = (4 * H * H + 2 * H * F + 3 * H + F) // tp
    return split + PER_LAYER


def generate(out: Path, **kw: object) -> None:
    args = ["generate", "--output_dir", str(out)]
    args += [a for k, v in {**GPT, **kw}.items() for a in (f"--{k}", str(v).lower())]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output


def iteration_collectives(nodes: list) -> list:  # type: ignore[type-arg]
    """The once-per-iteration gradient collectives (outside the micro-batches), before the
    optimizer step."""
    step = next(n.id for n in nodes if n.name == "optimizer_step")
    return [
        n
        for n in nodes
        if n.type is NodeType.COMM_COLL and n.id < step and node_micro_batch(n) is None
    ]


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("tp", [2, 4])
def test_one_tp_all_reduce_per_stage_after_the_dp_reduction(
    tmp_path: Path, tp: int, zero: int
) -> None:
    """On every rank: one data-parallel collective per part (an all-reduce, ZeRO-1/2 a
    reduce-scatter) that holds the replicated weights' gradients with the others, then ONE
    all-reduce over the tensor-parallel group of 6·h per layer of the stage (+ 2·h on the last
    stage) gradient elements (ZeRO-2: the dp-th shard), after every dp collective, and the
    optimizer step after it. None of them is inside the backward's tp stream per layer."""
    out = tmp_path / "out"
    generate(out, tp=tp, zero=zero)
    groups = {int(k): v for k, v in json.loads((out / "workload.json").read_text()).items()}
    per_stage = tp * DP
    dp_kind = CollectiveType.ALL_REDUCE if zero == 0 else CollectiveType.REDUCE_SCATTER
    for rank in range(per_stage * PP):
        nodes = list(read_nodes(out / f"workload.{rank}.et"))
        stage = rank // per_stage
        colls = iteration_collectives(nodes)
        # tp is the fastest axis of the rank order, then dp
        tp_group = [rank - rank % tp + i for i in range(tp)]
        dp_group = [stage * per_stage + rank % tp + i * tp for i in range(DP)]
        dp_colls = [n for n in colls if groups[n.comm_group] == dp_group]
        tp_colls = [n for n in colls if groups[n.comm_group] == tp_group]
        assert len(dp_colls) + len(tp_colls) == len(colls), rank
        (tp_all_reduce,) = tp_colls
        assert {n.comm_type for n in dp_colls} == {dp_kind}
        elements = PER_LAYER * LAYERS // PP + (FINAL_NORM if stage == PP - 1 else 0)
        if zero == 2:
            assert elements % DP == 0  # no padding: Megatron-FSDP's shard is exact
            elements //= DP
        assert tp_all_reduce.comm_type is CollectiveType.ALL_REDUCE
        assert tp_all_reduce.comm_size == elements * GRAD_BYTES
        assert {n.id for n in dp_colls} <= set(tp_all_reduce.data_deps)
        assert all(n.id < tp_all_reduce.id for n in dp_colls)
        step = next(n for n in nodes if n.name == "optimizer_step")
        assert tp_all_reduce.id in step.data_deps
        # each layer's dp collective carries its replicated weights' gradients too
        layer_bytes = layer_elements(tp) * GRAD_BYTES
        layers = [n for n in dp_colls if n.name.startswith("layer")]
        assert len(layers) == LAYERS // PP
        assert all(n.comm_size == layer_bytes for n in layers)


@pytest.mark.parametrize("megatron_fsdp", [False, True])
def test_fsdp(megatron_fsdp: bool) -> None:
    """``--weight_sharded``: Megatron-FSDP all-reduces this rank's shard of them
    (``grad._local_tensor``) once per stage; PyTorch FSDP2 each part's shard after the part's
    reduce-scatter (one all-reduce per layer, and the head's final norm)."""
    o = GenerateOptions(
        **{**GPT, "pp": 1, "tp": 2, "weight_sharded": True, "megatron_fsdp": megatron_fsdp}
    )  # type: ignore[arg-type]
    nodes = build_workload(o, load_registry(autoload=False)).ranks[0].nodes()
    tp = [
        n
        for n in nodes
        if n.type is NodeType.COMM_COLL and node_micro_batch(n) is None and "tp" in n.name
    ]
    shard = (PER_LAYER * LAYERS + FINAL_NORM) // DP
    if megatron_fsdp:
        assert [n.comm_size for n in tp] == [shard * GRAD_BYTES]
    else:
        assert len(tp) == LAYERS + 1
        assert sum(n.comm_size for n in tp) == shard * GRAD_BYTES


def test_without_sequence_parallelism_nothing_is_reduced_over_tp(tmp_path: Path) -> None:
    """With tensor parallelism but no sequence parallelism every tp rank computes the whole
    gradient of a layer norm: no tp collective in the gradient reduction."""
    out = tmp_path / "out"
    generate(out, tp=2, zero=1, tpsp=False)
    groups = {int(k): v for k, v in json.loads((out / "workload.json").read_text()).items()}
    nodes = list(read_nodes(out / "workload.0.et"))
    assert all(groups[n.comm_group] == [0, 2] for n in iteration_collectives(nodes))


def test_written_trace_validates_decodes_and_predicts_as_the_options(tmp_path: Path) -> None:
    """The trace passes ``stg validate`` under ASTRA-sim's rules (every rank of the new
    all-reduce's group issues it, same size), decodes with the official Chakra reader, and
    ``stg predict`` gives the same time and memory from it as from the options."""
    out = tmp_path / "out"
    plan = dict(tp=2, zero=1)
    generate(out, **plan)
    assert_trace_checks_out_and_predicts_as_options(out, {**GPT, **plan})


# dp over nodes (tp = 8 fills a node): slow reduce-scatters, and eight layers per stage whose
# backwards each issue tp collectives
SLOW_DP = dict(
    model="gpt", dvocal=32768, dmodel=2048, dff=8192, head=16, kvhead=16, seq=2048,
    num_stacks=16, batch=32, micro_batch=8, dp=2, tp=8, pp=2, zero=1,
)  # fmt: skip


def test_dp_reduction_stays_off_the_critical_path() -> None:
    """The dp reduce-scatter of a layer overlaps the backward of the layers before it: on the
    critical path lies at most the tail of the last ones. Chained per layer (the layer's tp
    all-reduce after its reduce-scatter, on the stream of the backward's tp collectives) every
    layer's reduce-scatter lay on it: about eight of them here."""
    registry = load_registry()
    kernels = list(registry.kernels)
    o = GenerateOptions(**SLOW_DP)  # type: ignore[arg-type]
    report = predict_time(build_workload(o, registry), "h100-80g", kernels=kernels, explain=True)
    breakdown = report["explain"]["breakdown_s"]
    scatter = breakdown.get("communication: reduce_scatter (2 ranks)", 0.0)
    one_layer = collective_seconds(o)
    assert scatter < 2 * one_layer, (scatter, one_layer)


def collective_seconds(o: GenerateOptions) -> float:
    """Seconds of one layer's dp reduce-scatter on its own, as the replay prices it."""
    system = load_system("h100-80g")
    size = ((4 * 2048 * 2048 + 2 * 2048 * 8192 + 3 * 2048 + 8192) // 8 + 6 * 2048) * GRAD_BYTES
    shape = group_shape(group_members(("dp",), o), system)
    return collective_time(CollectiveType.REDUCE_SCATTER, size, shape, system)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_analytical_follows_the_replay(zero: int) -> None:
    """The analytical predictor agrees with the replay within 2 % where the dp reduction is
    slow and tp > 1 with sequence parallelism: the tp all-reduce of the replicated weights'
    gradients once per stage, after the dp reductions."""
    registry = load_registry()
    kernels = list(registry.kernels)
    o = GenerateOptions(**{**SLOW_DP, "zero": zero})  # type: ignore[arg-type]
    replay = predict_time(build_workload(o, registry), "h100-80g", kernels=kernels)
    closed = predict_options(o, "h100-80g", registry=registry, kernels=kernels)
    assert closed["iteration_time_s"] == pytest.approx(replay["iteration_time_s"], rel=0.02)
