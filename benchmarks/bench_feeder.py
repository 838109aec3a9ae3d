"""Throughput and memory of the ETFeeder on a large synthetic v0.0.4 trace.

    python benchmarks/bench_feeder.py [--nodes 1000000] [--window 4096] [--keep DIR]

Writes a trace of ``--nodes`` nodes (blocks of 8: a head that depends on the previous block's
sink, six nodes fanning out of the head, a sink joining them; every 64th node a collective),
then, each in a fresh process so peak RSS is its own:

* ``read``:  stream the file with :func:`stg.trace.reader.iter_nodes` (the reader alone);
* ``feed``:  drain it through :class:`stg.trace.feeder.ETFeeder` with a bounded window (reader
  included), issuing every ready node, then freeing and removing them;
* ``feed-memory``: drain an in-memory list of a tenth of the nodes (the feeder alone).

Reports nodes/s and peak RSS (``resource.getrusage``) per phase.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stg.trace.writer import varint

BLOCK = 8


def write_trace(path: Path, nodes: int) -> None:
    """Write the synthetic trace with varint framing, streaming (constant memory)."""
    from stg.trace.proto import chakra_v004_pb2 as pb4

    with open(path, "wb") as out:
        meta = pb4.GlobalMetadata(version="0.0.4")
        meta.attr.add(name="generator", string_val="bench_feeder")
        data = meta.SerializeToString()
        out.write(varint(len(data)) + data)
        for i in range(nodes):
            head = i - i % BLOCK
            pos = i % BLOCK
            if pos == 0:
                deps = [head - 1] if head else []
            elif pos < BLOCK - 1:
                deps = [head]
            else:
                deps = list(range(head + 1, head + BLOCK - 1))
            msg = pb4.Node(id=i, name=f"n{i}", data_deps=deps)
            msg.attr.add(name="is_cpu_op", bool_val=False)
            if i % 64 == 63:
                msg.type = pb4.COMM_COLL_NODE
                msg.attr.add(name="comm_type", int64_val=0)
                msg.attr.add(name="comm_size", int64_val=1 << 20)
                msg.attr.add(name="pg_name", string_val="1")
            else:
                msg.type = pb4.COMP_NODE
                msg.attr.add(name="num_ops", int64_val=2 * 4096**3)
                msg.attr.add(name="tensor_size", uint64_val=3 * 2 * 4096**2)
            msg.duration_micros = 10
            data = msg.SerializeToString()
            out.write(varint(len(data)) + data)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _drain(feeder: object) -> int:
    count = 0
    get = feeder.get_next_issuable_node  # type: ignore[attr-defined]
    free = feeder.free_children_nodes  # type: ignore[attr-defined]
    remove = feeder.remove_node  # type: ignore[attr-defined]
    while feeder.has_nodes_to_issue():  # type: ignore[attr-defined]
        wave = []
        node = get()
        while node is not None:
            wave.append(node.id)
            node = get()
        for nid in wave:
            free(nid)
        for nid in wave:
            remove(nid)
        count += len(wave)
    return count


def phase(name: str, path: Path, window: int, total: int) -> dict[str, float]:
    """Run one phase in this process and return its figures."""
    from stg.trace.feeder import ETFeeder
    from stg.trace.reader import iter_nodes

    if name == "read":
        start, cpu_start = time.perf_counter(), time.process_time()
        count = sum(1 for _ in iter_nodes(path))
    elif name == "feed":
        start, cpu_start = time.perf_counter(), time.process_time()
        feeder = ETFeeder(path, deps="data+ctrl", window=window)
        count = _drain(feeder)
    elif name == "feed-memory":
        nodes = []
        for node in iter_nodes(path):
            nodes.append(node)
            if len(nodes) * 10 >= total:
                break
        start, cpu_start = time.perf_counter(), time.process_time()
        count = _drain(ETFeeder(nodes, window=window))
    else:
        raise SystemExit(f"unknown phase {name}")
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    return {"nodes": count, "seconds": seconds, "nodes_per_s": count / seconds,
            "cpu_seconds": cpu, "nodes_per_cpu_s": count / cpu,
            "peak_rss_mib": _peak_rss_mib()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1_000_000)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--keep", type=Path, help="write the trace here and keep it")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--trace", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, args.trace, args.window, args.nodes)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"bench.{args.nodes}.et"
        start = time.perf_counter()
        write_trace(path, args.nodes)
        print(
            f"wrote {args.nodes:,} nodes ({path.stat().st_size / 2**20:.1f} MiB) "
            f"in {time.perf_counter() - start:.1f} s"
        )
        for name in ("read", "feed", "feed-memory"):
            result = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--phase",
                    name,
                    "--trace",
                    str(path),
                    "--window",
                    str(args.window),
                    "--nodes",
                    str(args.nodes),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            r = json.loads(result.stdout)
            print(
                f"{name:<12} {r['nodes']:>9,} nodes  {r['seconds']:6.2f} s  "
                f"{r['nodes_per_s']:>9,.0f} nodes/s (CPU {r['cpu_seconds']:.2f} s, "
                f"{r['nodes_per_cpu_s']:,.0f} nodes/CPU-s)  peak RSS {r['peak_rss_mib']:.0f} MiB"
            )


if __name__ == "__main__":
    main()
