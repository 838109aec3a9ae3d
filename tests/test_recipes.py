"""Training recipes as real runs do them (issue 24, item 2).

- Context parallelism: Megatron-LM cuts the sequence into 2·cp chunks and gives rank i chunks
  i and 2cp-1-i, so every rank computes 1/cp of the causal attention, its diagonal blocks
  included. Doubling the context together with cp doubles a rank's attention, not 4x.
- FSDP2 under pipeline parallelism (torchtitan): ``reshard_after_forward=False`` and PyTorch's
  pipelining reduce the accumulated gradients once after the last micro-batch: one all-gather
  and one reduce-scatter per FSDP unit per step, and the stage's unsharded weights and
  gradients held for the step.
- Transformer Engine's delayed scaling under context parallelism: the amax all-reduce runs
  over Megatron's amax reduction group, tensor x data x context parallel ranks
  (``get_amax_reduction_group(with_context_parallel=True)``), synchronously, at every exit of
  a chunk's fp8 autocast and at the end of its backward: per micro-batch and chunk.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
from workload_checks import check_runs_to_completion

from stg.core.fp8 import ALL_REDUCE
from stg.core.options import GenerateOptions, OptionError
from stg.core.pipeline import build_workload, validate_options
from stg.core.workload import CollectiveType, NodeType
from stg.host.registry import load_registry
from stg.perf.costs import compute_time
from stg.perf.kernel_time import ATTENTION_BLOCK_ROWS
from stg.perf.system import load_system
from stg.predictors.memory import predict_memory
from stg.predictors.time import predict_time
from stg.trace.validate import validate_workload

# --- context parallelism: load-balanced causal attention ------------------------------------

GPT = dict(model="gpt", dvocal=1024, dmodel=1024, dff=4096, head=16, kvhead=16, num_stacks=2)
LLAMA = dict(model="llama", dvocal=1024, dmodel=1024, dff=2816, head=16, kvhead=4, num_stacks=2)
B = 2


@functools.cache
def attention_nodes(
    model: str, seq: int, cp: int, comm_type: str = "all_gather"
) -> dict[tuple[int, str], Any]:
    """Layer 0's fused attention nodes (forward, backward; under ``p2p`` the ring's steps)
    of every rank class; ``all_gather`` (cp > 1) runs each pass as one kernel."""
    dims = GPT if model == "gpt" else LLAMA
    o = GenerateOptions(
        **dims, seq=seq, batch=B, micro_batch=B, sp=cp, causal=True,
        cp_comm_type=comm_type if cp > 1 else "p2p",
    )  # fmt: skip
    w = build_workload(o, load_registry(autoload=False))
    nodes = {}
    for rank in range(w.world_size):
        for n in w.ranks[rank].nodes():
            if n.name.startswith("mb0/layer0/") and "attention" in n.attrs:
                nodes[(rank, n.name.rsplit("/", 1)[-1])] = n
    return nodes


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("cp", [2, 4])
def test_causal_attention_flops_are_total_over_cp_per_rank(model: str, cp: int) -> None:
    """The causal attention core of one layer (fwd + bwd; VALIDATION.md's 12·B·s²·h/2 plus
    the softmax) summed over the cp ranks is the one-rank total; each rank holds 1/cp of it."""
    s = 2048
    whole = attention_nodes(model, s, 1)
    total = whole[(0, "core_attention")].num_ops + whole[(0, "core_attention.grad")].num_ops
    nodes = attention_nodes(model, s, cp)
    per_rank = [
        nodes[(r, "core_attention")].num_ops + nodes[(r, "core_attention.grad")].num_ops
        for r in range(cp)
    ]
    assert per_rank == [total // cp] * cp
    assert total % cp == 0
    # the ring (p2p) runs the same work in cp kernels per pass: the step on the rank's own
    # keys (1/cp of it; first forward, last backward), then one per other chunk, alike
    ring = attention_nodes(model, s, cp, "p2p")
    for r in range(cp):
        steps = {name: n.num_ops for (rank, name), n in ring.items() if rank == r}
        assert sum(steps.values()) == per_rank[r] and len(steps) == 2 * cp
        assert steps["core_attention.step0"] == nodes[(r, "core_attention")].num_ops // cp
        own = nodes[(r, "core_attention.grad")].num_ops // cp
        assert steps[f"core_attention.grad.step{cp - 1}"] == own
        others = [steps[f"core_attention.step{i}"] for i in range(1, cp)]
        assert max(others) - min(others) <= 1


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("backward", [False, True])
def test_doubling_context_with_cp_doubles_attention_time(model: str, backward: bool) -> None:
    """cp 2 at 2s costs a rank about twice the attention time of cp 1 at s (the work is
    (2s)²/2/2 = s² against s²/2), not four times (full key blocks for the rank's queries)."""
    system = load_system("h100-80g")
    name = "core_attention.grad" if backward else "core_attention"
    one = compute_time(attention_nodes(model, 4096, 1)[(0, name)], system)
    for rank in range(2):
        two = compute_time(attention_nodes(model, 8192, 2)[(rank, name)], system)
        # about 2x (less by the per-block overheads, which do not grow); 4x before
        assert 1.7 < two / one < 2.1


def test_load_balanced_share_prices_blocks_up_to_the_diagonal() -> None:
    """A rank's share is q_blocks·(kv_blocks + 1)/2 blocks of work: 1/cp of the whole causal
    triangle n(n + 1)/2 with its diagonal, so cp ranks together do what one rank does."""
    system = load_system("h100-80g")
    s, cp = 8192, 4
    n = s // ATTENTION_BLOCK_ROWS
    one = attention_nodes("gpt", s, 1)[(0, "core_attention")]
    share = attention_nodes("gpt", s, cp)[(0, "core_attention")]
    assert share.attrs["causal_split"] == cp
    assert "causal_split" not in one.attrs
    blocks_share = (n // cp) * (n + 1) / 2
    assert blocks_share * cp == n * (n + 1) / 2
    overhead = system.kernel_overhead
    ratio = (compute_time(share, system) - overhead) / (compute_time(one, system) - overhead)
    # equal work per block; only the per-wave overheads and wave rounding differ
    assert ratio == pytest.approx(1 / cp, rel=0.03)
    assert math.isclose(ratio * cp, 1.0, rel_tol=0.03)


# --- FSDP2 under pipeline parallelism -------------------------------------------------------

FSDP = dict(
    model="llama", dvocal=256, dmodel=256, dff=96, head=8, kvhead=8, seq=8, num_stacks=4,
    dp=2, weight_sharded=True, mixed_precision=True,
)  # fmt: skip


@functools.cache
def fsdp_workload(pp: int, micro_batches: int, reshard: str = "default", recompute: str = "none"):
    o = GenerateOptions(
        **FSDP,
        pp=pp,
        batch=2 * micro_batches,
        micro_batch=2,
        reshard_after_forward=reshard,
        activation_recompute=recompute,
    )
    return build_workload(o, load_registry(autoload=False))


def fsdp_collectives(rank_class, kind: CollectiveType) -> list:
    """The collectives of ``kind`` over the FSDP group (dp) of a rank class."""
    return [
        n
        for n in rank_class.nodes
        if n.type is NodeType.COMM_COLL and n.comm_type is kind and n.group_axes == ("dp",)
    ]


def units(rank_class) -> int:
    """FSDP units (flat buffers) a rank class holds: its layers, embedding and head."""
    f = rank_class.facts
    return f["layers"] + f["has_embedding"] + f["has_head"]


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("micro_batches", [2, 4, 8])
def test_fsdp_under_pp_gathers_and_reduces_each_unit_once_per_step(
    micro_batches: int, recompute: str
) -> None:
    w = fsdp_workload(2, micro_batches, recompute=recompute)
    e_w, e_g = 2, 4  # bf16 weights, fp32 gradients (mixed precision)
    for rc in w.rank_classes:
        gathers = fsdp_collectives(rc, CollectiveType.ALL_GATHER)
        reduces = fsdp_collectives(rc, CollectiveType.REDUCE_SCATTER)
        assert len(gathers) == units(rc) == len(reduces)
        shard = rc.facts["shard_parameters"]  # this rank's padded shard of the stage
        assert sum(n.comm_size for n in gathers) == e_w * shard
        assert sum(n.comm_size for n in reduces) == e_g * 2 * shard  # the padded buffer
        # the gradients are reduced during the last micro-batch's backward, not before
        last = f"mb{micro_batches - 1}/"
        start = min(n.id for n in rc.nodes if n.name.startswith(last) and "/bwd/" in n.name)
        assert all(n.id > start and n.name.startswith(last) for n in reduces)
    assert validate_workload(w).ok
    assert check_runs_to_completion(w) == sum(len(g) for g in w.ranks)


def test_fsdp_always_resharding_under_pp_still_reduces_once() -> None:
    """``--reshard_after_forward always`` frees the weights after each forward (gathered
    again before the backward, unless the previous backward left them gathered), but the
    pipeline still reduces the gradients once."""
    for m in (2, 4):
        w = fsdp_workload(2, m, "always")
        for rc in w.rank_classes:
            assert len(fsdp_collectives(rc, CollectiveType.REDUCE_SCATTER)) == units(rc)
            gathers = len(fsdp_collectives(rc, CollectiveType.ALL_GATHER))
            assert units(rc) * (m + 1) <= gathers <= units(rc) * 2 * m
        assert check_runs_to_completion(w) == sum(len(g) for g in w.ranks)


@pytest.mark.parametrize("reshard, gathers_per_micro_batch", [("default", 2), ("never", 1)])
def test_fsdp_without_pp_keeps_its_per_micro_batch_collectives(
    reshard: str, gathers_per_micro_batch: int
) -> None:
    m = 4
    (rc,) = fsdp_workload(1, m, reshard).rank_classes
    gathers = fsdp_collectives(rc, CollectiveType.ALL_GATHER)
    assert len(gathers) == gathers_per_micro_batch * m * units(rc)
    assert len(fsdp_collectives(rc, CollectiveType.REDUCE_SCATTER)) == m * units(rc)


def test_fsdp_under_pp_holds_the_unsharded_stage_for_the_step() -> None:
    """Memory: the stage's gathered weights (e_w·Ψ_stage) and accumulated unsharded gradients
    (e_g·Ψ_stage) beside the ZeRO-3 shards; no two-layer gather buffer on top (the last
    stage's only buffer is Megatron's cross entropy: 16-bit logits beside its fp32 copy)."""
    e_w, e_g = 2, 4
    logits = FSDP["seq"] * 1 * FSDP["dvocal"]  # one sample per replica and micro-batch
    kept = predict_memory(fsdp_workload(2, 4), "h100-80g")["classes"]
    freed = predict_memory(fsdp_workload(2, 4, "always"), "h100-80g")["classes"]
    classes = fsdp_workload(2, 4).rank_classes
    for stage, (rc, k, f) in enumerate(zip(classes, kept, freed, strict=True)):
        replica, shard = rc.facts["replica_parameters"], rc.facts["shard_parameters"]
        assert k["weights"] == e_w * (shard + replica)
        assert k["gradients"] == f["gradients"] == e_g * (shard + replica)
        assert f["weights"] == e_w * shard
        assert f["buffers"] > k["buffers"] == (2 * logits if stage == 1 else 0)


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(weight_sharded=True, reshard_after_forward="sometimes"),
         r"reshard_after_forward='sometimes' must be one of default, always, never"),
        (dict(reshard_after_forward="never"), r"needs weight_sharded=true"),
    ],
)  # fmt: skip
def test_reshard_after_forward_is_checked(given: dict, message: str) -> None:
    o = GenerateOptions(**{**FSDP, **given, "weight_sharded": given.get("weight_sharded", False)})
    with pytest.raises(OptionError, match=message):
        validate_options(o, load_registry(autoload=False))


# --- Transformer Engine's amax reduction under context parallelism --------------------------


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_amax_reduction_group_spans_tp_dp_cp_per_micro_batch(micro_batches: int) -> None:
    o = GenerateOptions(
        **GPT, seq=64, dp=2, tp=2, sp=2, pp=2, dtype="fp8", causal=True,
        batch=4 * micro_batches, micro_batch=4,
    )  # fmt: skip
    w = build_workload(o, load_registry(autoload=False))
    for graph in w.ranks:
        reductions = [n for n in graph.nodes() if n.name.endswith(ALL_REDUCE)]
        # once after each micro-batch's forward of the rank's chunk, once after its backward
        assert len(reductions) == 2 * micro_batches
        for n in reductions:
            members = w.comm_groups[n.comm_group]
            assert members == w.layout.members(graph.rank, ("dp", "sp", "tp"))
            assert len(members) == 8
            stage = {w.layout.coords(r)["pp"] for r in members}
            assert stage == {graph.rank_class.stage}  # never across pipeline stages


# --- context parallelism: how keys and values travel (--cp_comm_type) -----------------------


def _layer0(comm_type: str, cp: int = 2) -> dict[str, Any]:
    o = GenerateOptions(**LLAMA, seq=2048, batch=B, micro_batch=B, sp=cp, causal=True,
                        cp_comm_type=comm_type)  # fmt: skip
    w = build_workload(o, load_registry(autoload=False))
    sp_group = w.layout.group_id(0, ("sp",))
    return {
        n.name: n
        for n in w.ranks[0].nodes()
        if n.name.startswith("mb0/layer0/") and n.comm_group in (None, sp_group)
    }


def _sp_collectives(
    nodes: dict[str, Any], phase: str, kind: CollectiveType = CollectiveType.ALL_GATHER
) -> list[Any]:
    """Layer 0's collectives of ``kind`` over the context-parallel group in ``phase``."""
    return [
        n
        for name, n in nodes.items()
        if f"/{phase}/" in name and n.type is NodeType.COMM_COLL and n.comm_type is kind
    ]


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_keys_and_values_travel_again_for_the_backward(comm_type: str) -> None:
    """Transformer Engine saves only the rank's own K and V chunks (the ring: the last one it
    received): the all-gather variant gathers them again before the backward, the ring
    passes them round again; either moves the bytes of the forward's gathers."""
    nodes = _layer0(comm_type)
    forward, backward = _sp_collectives(nodes, "fwd"), _sp_collectives(nodes, "bwd")
    assert forward and backward
    assert sum(n.comm_size for n in forward) == sum(n.comm_size for n in backward)
    grads = [n for n in nodes.values() if "attention" in n.attrs and n.attrs["attention"][6]]
    gathered = {n.id for n in backward}
    assert any(gathered & set(n.data_deps) for n in grads)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_ring_moves_what_the_all_gather_variant_moves(cp: int) -> None:
    """Per pass and kind the ring's transfers over the cp group add up to the all-gather
    variant's collectives (K and V gathered; their gradients reduce-scattered), in one
    transfer per step that forwards a chunk (the backward's: cp - 1 of each)."""
    ring, gather = _layer0("p2p", cp), _layer0("all_gather", cp)
    for phase in ("fwd", "bwd"):
        for kind in (CollectiveType.ALL_GATHER, CollectiveType.REDUCE_SCATTER):
            moved = [n.comm_size for n in _sp_collectives(ring, phase, kind)]
            whole = [n.comm_size for n in _sp_collectives(gather, phase, kind)]
            assert sum(moved) == sum(whole)
            if whole:
                assert len(moved) == cp - 1 and max(moved) - min(moved) <= 1


def test_ring_overlaps_each_step_with_the_next_transfer() -> None:
    """p2p, forward (TE's ``AttnFuncWithCPAndKVP2P.forward``): step 0 attends to the rank's
    own keys; the transfer of chunk i forwards chunk i - 1, issued before step i - 1's
    kernel; step i waits for it and for step i - 1. all_gather: the one kernel waits for
    the gathers."""
    cp = 4
    ring = _layer0("p2p", cp)
    steps = [ring[f"mb0/layer0/fwd/core_attention.step{i}"] for i in range(cp)]
    sends = [ring[f"mb0/layer0/fwd/core_attention.send_kv{i}"] for i in range(1, cp)]
    assert {n.id for n in sends}.isdisjoint(steps[0].data_deps)
    for i in range(1, cp):
        send = sends[i - 1]
        assert send.id < steps[i - 1].id and send.id in steps[i].data_deps
        assert steps[i - 1].id in steps[i].data_deps
        assert i == 1 or sends[i - 2].id in send.data_deps
    assert steps[0].attrs["attention"][2:4] == (512, 512)  # causal over the own two chunks
    for step in steps[1:]:
        assert step.attrs["attention"][2:6] == (512, 256, 64, 0)  # two full chunk blocks
    gather = _layer0("all_gather", cp)
    whole = gather["mb0/layer0/fwd/core_attention"]
    assert {n.id for n in _sp_collectives(gather, "fwd")} <= set(whole.data_deps)


def test_ring_backward_returns_the_gradients_step_by_step() -> None:
    """p2p, backward (TE's ``AttnFuncWithCPAndKVP2P.backward``): the steps reversed (the
    rank's own causal chunks last); transfer i sends on step i's chunk (none after the
    last) and, from step 1 on, the K/V gradient accumulated for step i - 1's chunk, both
    once step i - 1 is done and beside step i; no reduce-scatter after the last step: the
    rank's gradient is the last transfer's plus the last step's share."""
    cp = 4
    ring = _layer0("p2p", cp)
    name = "mb0/layer0/bwd/core_attention.grad"
    steps = [ring[f"{name}.step{i}"] for i in range(cp)]
    sends = [ring[f"{name}.send_kv{i}"] for i in range(1, cp)]
    returns = [ring[f"{name}.send_dkv{i}"] for i in range(1, cp)]
    assert all(n.comm_type is CollectiveType.REDUCE_SCATTER for n in returns)
    for i in range(1, cp):
        assert sends[i - 1].id in steps[i].data_deps
        assert steps[i - 1].id in returns[i - 1].data_deps
        assert returns[i - 1].id < steps[i].id  # runs beside step i
        assert returns[i - 1].id not in steps[i].data_deps
        if i > 1:
            assert steps[i - 2].id in sends[i - 1].data_deps
    assert steps[-1].attrs["attention"][5] == 1 and steps[0].attrs["attention"][5] == 0
    done = ring[f"{name}.dkv"]
    assert set(done.data_deps) == {steps[-1].id, returns[-1].id}
    assert (done.num_ops, done.tensor_size) == (0, 0)
    assert max(n.id for n in ring.values() if n.type is NodeType.COMM_COLL) < done.id


def test_ring_hides_a_transfer_between_nodes() -> None:
    """cp 2 across two nodes (tp 8 fills a node): the ring hides the transfer of K and V over
    the network behind step 0, which the all-gather variant waits for."""
    system = load_system("h100-80g")
    o = dict(**GPT, seq=16384, batch=B, micro_batch=B, tp=8, sp=2, causal=True)
    times = {
        c: predict_time(build_workload(GenerateOptions(**o, cp_comm_type=c),
                                       load_registry(autoload=False)), system)["iteration_time_s"]
        for c in ("p2p", "all_gather")
    }  # fmt: skip
    assert times["p2p"] < times["all_gather"]


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(sp=2, cp_comm_type="ring"), r"cp_comm_type='ring' must be one of p2p, all_gather"),
        (dict(cp_comm_type="all_gather"), r"needs sp > 1"),
    ],
)  # fmt: skip
def test_cp_comm_type_is_checked(given: dict, message: str) -> None:
    with pytest.raises(OptionError, match=message):
        validate_options(GenerateOptions(**LLAMA, **given), load_registry(autoload=False))
