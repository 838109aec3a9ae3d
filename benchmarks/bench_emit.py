"""Time and peak memory of writing a large synthetic workload with each built-in emitter.

Run: ``python benchmarks/bench_emit.py [--ranks 128] [--classes 4] [--nodes 10000]
[--emitter chakra-v0.0.4]``. Builds NodeTemplates directly (no model, no lowering): per class
a chain of COMP nodes with every tenth node a TP all-reduce, every hundredth a DP all-reduce
and a send/recv pair per class boundary, over a tp x dp x pp mesh with pp = classes.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

from stg.core.layout import Layout
from stg.core.workload import CollectiveType, NodeTemplate, NodeType, RankClass, RankGraph, Workload
from stg.trace.writer import write_workload


def build(ranks: int, classes: int, nodes: int) -> Workload:
    """A synthetic workload of ``ranks`` ranks in ``classes`` pipeline stages."""
    tp = 8 if ranks // classes >= 8 else 1
    dp = ranks // classes // tp
    layout = Layout({"tp": tp, "dp": dp, "pp": classes}, group_axes=(("tp",), ("dp",)))
    rank_classes = []
    for stage in range(classes):
        templates: list[NodeTemplate] = []
        for i in range(nodes):
            deps = (i - 1,) if i else ()
            if i == 0 and stage > 0:
                t = NodeTemplate(
                    id=i,
                    name=f"recv_{i}",
                    type=NodeType.COMM_RECV,
                    comm_size=1 << 20,
                    peer_stage=stage - 1,
                    comm_tag=1000 + stage,
                )
            elif i == nodes - 1 and stage < classes - 1:
                t = NodeTemplate(
                    id=i,
                    name=f"send_{i}",
                    type=NodeType.COMM_SEND,
                    data_deps=deps,
                    comm_size=1 << 20,
                    peer_stage=stage + 1,
                    comm_tag=1001 + stage,
                )
            elif i % 100 == 50:
                t = NodeTemplate(
                    id=i,
                    name=f"dp_ar_{i}",
                    type=NodeType.COMM_COLL,
                    data_deps=deps,
                    comm_type=CollectiveType.ALL_REDUCE,
                    comm_size=1 << 24,
                    group_axes=("dp",),
                )
            elif i % 10 == 5:
                t = NodeTemplate(
                    id=i,
                    name=f"tp_ar_{i}",
                    type=NodeType.COMM_COLL,
                    data_deps=deps,
                    comm_type=CollectiveType.ALL_REDUCE,
                    comm_size=1 << 22,
                    group_axes=("tp",),
                )
            else:
                t = NodeTemplate(
                    id=i,
                    name=f"layer{i // 100}.gemm_{i}",
                    type=NodeType.COMP,
                    data_deps=deps,
                    num_ops=2 * 4096 * 4096 * (i % 7 + 1),
                    tensor_size=3 * 4096 * 4096 * 2,
                    dtype="bf16",
                )
            templates.append(t)
        rank_classes.append(RankClass(index=stage, stage=stage, nodes=tuple(templates)))
    graphs = tuple(
        RankGraph(rank=r, rank_class=rank_classes[layout.stage(r)], layout=layout)
        for r in range(layout.world_size)
    )
    return Workload(
        ranks=graphs, comm_groups=layout.comm_groups, layout=layout, metadata={"model": "synthetic"}
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=128)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument(
        "--emitter", default="chakra-v0.0.4", choices=["chakra-v0.0.4", "chakra-v0.0.1", "json"]
    )
    args = parser.parse_args(argv)
    from stg.emitters import chakra_v001, chakra_v004, json_trace

    emitter = {
        "chakra-v0.0.4": chakra_v004.EMITTER,
        "chakra-v0.0.1": chakra_v001.EMITTER,
        "json": json_trace.EMITTER,
    }[args.emitter]
    t0 = time.perf_counter()
    workload = build(args.ranks, args.classes, args.nodes)
    t1 = time.perf_counter()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_workload(workload, emitter, Path(tmp) / "out", "workload")
        t2 = time.perf_counter()
        size = sum(p.stat().st_size for p in paths)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    total = args.ranks * args.nodes
    print(
        f"emitter={args.emitter} ranks={workload.world_size} nodes/rank={args.nodes} "
        f"total nodes={total:,}"
    )
    print(
        f"build {t1 - t0:.2f} s; write {t2 - t1:.2f} s ({total / (t2 - t1):,.0f} nodes/s); "
        f"{len(paths)} files, {size / 1e6:.1f} MB"
    )
    print(f"peak RSS {peak / 1024:.0f} MiB (before writing {rss_before / 1024:.0f} MiB)")


if __name__ == "__main__":
    sys.exit(main())
