"""Hand-built workloads for the format tests (emitters, reader, validator, converter)."""

from __future__ import annotations

from stg.core.layout import Layout
from stg.core.workload import (
    CollectiveType,
    NodeTemplate,
    NodeType,
    RankClass,
    RankGraph,
    Workload,
)

AR = CollectiveType.ALL_REDUCE


def workload_from_classes(
    layout: Layout, classes: list[RankClass], metadata: dict | None = None
) -> Workload:
    """A workload whose rank r runs class ``classes[layout.stage(r)]``."""
    ranks = tuple(
        RankGraph(rank=r, rank_class=classes[layout.stage(r)], layout=layout)
        for r in range(layout.world_size)
    )
    used = {
        layout.group_id(r, t.group_axes)
        for r in range(layout.world_size)
        for t in classes[layout.stage(r)].nodes
        if t.type is NodeType.COMM_COLL
    }
    groups = {gid: m for gid, m in layout.comm_groups.items() if gid in used}
    return Workload(ranks=ranks, comm_groups=groups, layout=layout, metadata=metadata or {})


def pipeline_workload(tp: int = 2, pp: int = 2, dp: int = 1) -> Workload:
    """tp x pp (x dp) ranks: per stage a forward GEMM, a TP all-reduce, an activation
    send/recv between stages, a backward GEMM and a DP/TP gradient all-reduce."""
    layout = Layout({"tp": tp, "pp": pp, "dp": dp}, group_axes=(("tp",), ("dp", "tp")))
    classes = []
    for stage in range(pp):
        nodes: list[NodeTemplate] = []

        def add(nodes: list[NodeTemplate] = nodes, **kw: object) -> int:
            nodes.append(NodeTemplate(id=len(nodes), **kw))  # type: ignore[arg-type]
            return len(nodes) - 1

        prev: tuple[int, ...] = ()
        if stage > 0:
            prev = (add(name="recv_act", type=NodeType.COMM_RECV, comm_size=4096,
                        peer_stage=stage - 1, comm_tag=100 + stage),)
        f = add(name="fwd_gemm", type=NodeType.COMP, data_deps=prev,
                num_ops=2_000_000 * (stage + 1), tensor_size=8192, dtype="bf16")
        ar = add(name="fwd_allreduce", type=NodeType.COMM_COLL, data_deps=(f,), comm_type=AR,
                 comm_size=4096, group_axes=("tp",))
        last = ar
        if stage < pp - 1:
            last = add(name="send_act", type=NodeType.COMM_SEND, data_deps=(ar,), comm_size=4096,
                       peer_stage=stage + 1, comm_tag=101 + stage)
        b = add(name="bwd_gemm", type=NodeType.COMP, data_deps=(ar,),
                ctrl_deps=(last,) if last != ar else (),
                num_ops=4_000_000, tensor_size=16384, dtype="bf16")
        add(name="grad_allreduce", type=NodeType.COMM_COLL, data_deps=(b,),
            comm_type=CollectiveType.ALL_REDUCE, comm_size=1 << 20, group_axes=("dp", "tp"))
        classes.append(RankClass(index=stage, stage=stage, nodes=tuple(nodes)))
    return workload_from_classes(layout, classes, {"model": "toy", "degrees": {"tp": tp, "pp": pp}})
