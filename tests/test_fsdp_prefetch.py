"""FSDP2's backward prefetch: the weight gather of the next layer in backward order is issued
from the pre-backward of the layer before it, ahead of that layer's gradient reduce-scatter
on the data-parallel communicator (PyTorch's ``FSDPParamGroup._backward_prefetch``)."""

from __future__ import annotations

import itertools

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import CollectiveType, NodeType, Phase, node_part, node_phase
from stg.host.registry import load_registry

SMALL = dict(
    model="llama", dvocal=1000, dmodel=256, dff=512, head=4, kvhead=4, seq=128, batch=4,
    micro_batch=4, num_stacks=3, dp=4, weight_sharded=True,
)  # fmt: skip


def data_parallel_collectives(**kw: object) -> list[tuple[str, str | int | None, str]]:
    """(phase, part, kind) of rank 0's weight collectives, in the order the trace issues them."""
    options = GenerateOptions(**{**SMALL, **kw})  # type: ignore[arg-type]
    workload = build_workload(options, load_registry(autoload=False))
    out = []
    for node in workload.ranks[0].nodes():
        if node.type is not NodeType.COMM_COLL:
            continue
        kind = node.comm_type
        if kind not in (CollectiveType.ALL_GATHER, CollectiveType.REDUCE_SCATTER):
            continue
        phase = node_phase(node)
        out.append((phase.name.lower() if phase else "", node_part(node), kind.name.lower()))
    return out


def test_the_next_layers_gather_is_issued_before_this_layers_reduce_scatter() -> None:
    issued = data_parallel_collectives()
    backward = issued[issued.index(("recompute", "head", "all_gather")) :]
    gathers = [part for phase, part, kind in backward if kind == "all_gather"]
    reduces = [part for phase, part, kind in backward if kind == "reduce_scatter"]
    order = ["head", "layer2", "layer1", "layer0", "embedding"]
    assert gathers == order
    assert reduces == order
    for later, earlier in itertools.pairwise(order[1:]):
        gather = backward.index(("recompute", earlier, "all_gather"))
        reduce = backward.index(("backward", later, "reduce_scatter"))
        assert gather < reduce, (earlier, later)


def test_weights_kept_after_forward_are_not_gathered_again() -> None:
    issued = data_parallel_collectives(reshard_after_forward="never")
    assert not [x for x in issued if x[0] == Phase.RECOMPUTE.name.lower()]
