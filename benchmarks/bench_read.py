"""Reading traces back: decoder throughput, and nodes/s and peak memory of the reading commands.

    python benchmarks/bench_read.py [--dir DIR] [--jobs N] [--big] [--feeder-nodes 5000000]
        [--skip-reference] [--shared ../shared/data/chakra]

Writes (once, into ``--dir``, default ``/tmp/stg-bench-read``) the 128-rank trace of
``stg generate --dp 8 --tp 4 --pp 4 --batch 64 --micro_batch 8`` (1.39 M nodes) and its
v0.0.1 and JSON conversions; with ``--big`` also the 1,024-rank trace of dp16 tp8 pp8 with 8
micro-batches (5.07 M nodes); with ``--feeder-nodes`` a one-rank file of that many nodes (the
synthetic blocks of bench_feeder.py). Then prints:

* ``decode``: one core decoding one rank file (rank 0 of each format, and
  ../shared/data/chakra/chakra.0.et when present), nodes/s of wall and of CPU time, best of
  5: whole ``Node`` objects
  (``stg.trace.reader.iter_nodes``), the columns that ``stg validate`` decodes, and the
  pure-Python reference decoder;
* ``per-rank work``: the same files through the compiled per-rank entry points of ``stg feed``
  (the drain, with data+ctrl and with data deps only), ``stg validate`` (rank summary) and
  ``stg predict`` (communication summary), or ``reference`` where the file goes to the
  reference decoder (it breaks a rule that the command reports);
* ``validate``, ``feed``, ``inspect``, ``predict`` (the time predictor): each command in a
  fresh process on each trace (``--jobs`` worker processes, default all cores): wall time,
  nodes/s, and peak RSS (the largest process, and the sum over the command's processes
  sampled every 20 ms);
* ``feeder``: the windowed ETFeeder (window 65,536) draining the one-rank file, in a fresh
  process: nodes/s and peak RSS.

It also runs against an older stg (``PYTHONPATH=old/tree python benchmarks/bench_read.py``):
what that tree lacks is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# ../shared/data/chakra of the project root (of the main checkout, for a git worktree beside it)
SHARED_CANDIDATES = [HERE.parent.parent / "shared" / "data" / "chakra",
                     HERE.parent.parent.parent / "shared" / "data" / "chakra"]  # fmt: skip
TRACE_128 = ["--dp", "8", "--tp", "4", "--pp", "4", "--batch", "64", "--micro_batch", "8"]
TRACE_1024 = ["--dp", "16", "--tp", "8", "--pp", "8", "--batch", "128", "--micro_batch", "16"]


def stg_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "stg", *args]


def _tree_rss(pid: int) -> tuple[int, int]:
    """Resident bytes of ``pid`` and its descendants (Linux /proc): in all, and the largest."""
    total = largest = 0
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ppid, pages = int(fields[1]), int(fields[21])
        children.setdefault(ppid, []).append(int(entry))
        rss[int(entry)] = pages * os.sysconf("SC_PAGE_SIZE")
    stack = [pid]
    while stack:
        p = stack.pop()
        total += rss.get(p, 0)
        largest = max(largest, rss.get(p, 0))
        stack.extend(children.get(p, ()))
    return total, largest


def run(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd``; wall seconds, CPU seconds (the command and the worker processes it waited
    for), peak RSS of its largest process and of its process tree (sampled every 20 ms)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0, 0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            total, largest = _tree_rss(proc.pid)
            peak[0] = max(peak[0], total)
            peak[1] = max(peak[1], largest)
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    done.set()
    sampler.join()
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}")
    return {
        "seconds": seconds,
        "cpu_seconds": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
        "largest_mib": peak[1] / 2**20,
        "tree_mib": peak[0] / 2**20,
        "stdout": out,  # type: ignore[dict-item]
    }


def ensure_traces(folder: Path, big: bool) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    traces = {"v0.0.4": folder / "t128"}
    if not (traces["v0.0.4"] / "workload.json").exists():
        subprocess.run(stg_cmd("generate", *TRACE_128, "--output_dir", str(traces["v0.0.4"])),
                       check=True, capture_output=True)  # fmt: skip
    for fmt in ("v0.0.1", "json"):
        target = folder / f"t128-{fmt}"
        if not (target / "workload.json").exists():
            subprocess.run(stg_cmd("convert", str(traces["v0.0.4"]), str(target), "--to", fmt),
                           check=True, capture_output=True)  # fmt: skip
        traces[fmt] = target
    if big:
        traces["v0.0.4 1024 ranks"] = folder / "t1024"
        if not (folder / "t1024" / "workload.json").exists():
            subprocess.run(stg_cmd("generate", *TRACE_1024, "--output_dir", str(folder / "t1024")),
                           check=True, capture_output=True)  # fmt: skip
    return traces


def count_nodes(trace: Path) -> int:
    """Nodes of every rank file of ``trace`` (counted from the framing or the JSON list)."""
    from stg.trace import reader

    total = 0
    for path in sorted(trace.iterdir()):
        if path.name == "workload.json" or not path.name.startswith("workload."):
            continue
        if path.suffix == ".json":
            total += len(json.loads(path.read_text())["workload_graph"])
            continue
        with reader._open_binary(path) as stream:
            count = sum(1 for _ in reader.iter_records(stream, path))
        total += count - (reader.detect_format(path) == "v0.0.4")
    return total


def decode_rates(files: dict[str, Path], skip_reference: bool) -> None:
    """One core, one rank file per format: nodes per second of wall time and of CPU time
    (``time.process_time``: what the core gave this process), each the best of 5 runs of at
    least 0.2 s (small files are read repeatedly)."""
    from stg.trace import reader

    try:
        from stg.trace import decode
    except ImportError:  # an stg without the shared decoder
        decode = None  # type: ignore[assignment]
    fields = ("id", "flags", "num_ops", "comm_type", "data")

    def best(fn: object, n: int) -> str:
        """``wall rate / CPU rate`` of ``n`` nodes in nodes per second."""
        walls, cpus = [], []
        for _ in range(5):
            reps = 0
            start, cpu = time.perf_counter(), time.process_time()
            while True:
                fn()  # type: ignore[operator]
                reps += 1
                if time.perf_counter() - start >= 0.2:
                    break
            walls.append((time.perf_counter() - start) / reps)
            cpus.append((time.process_time() - cpu) / reps)
        return f"{n / min(walls) / 1e3:,.0f}k / {n / min(cpus) / 1e3:,.0f}k"

    print("nodes/s of one core: wall / CPU (thousands)")
    print(f"{'decode (1 core)':<34} {'nodes':>9}  {'Node objects':>16}  {'columns':>16}  "
          f"{'reference':>16}")  # fmt: skip
    for label, path in files.items():
        fmt = reader.detect_format(path)
        n = sum(1 for _ in reader.iter_nodes(path, format=fmt))
        nodes = best(lambda: sum(1 for _ in reader.iter_nodes(path, format=fmt)), n)  # noqa: B023
        cols = ref = "-"
        if decode is not None and decode.enabled():
            cols = best(lambda: len(decode.columns(path, fmt, fields)["type"]), n)  # noqa: B023
            if not skip_reference:
                ref = best(
                    lambda: sum(1 for _ in reader.iter_nodes_reference(path, fmt)),  # noqa: B023
                    n,
                )
        print(f"{label:<34} {n:>9,}  {nodes:>16}  {cols:>16}  {ref:>16}", flush=True)
    if decode is None or not decode.enabled() or not hasattr(decode, "drain"):
        return
    print(f"\n{'per-rank work (1 core)':<34} {'feed: drain':>16}  {'--deps data':>16}  "
          f"{'validate':>16}  {'predict':>16}")  # fmt: skip
    for label, path in files.items():
        fmt = reader.detect_format(path)
        n = sum(1 for _ in reader.iter_nodes(path, format=fmt))
        work = {
            "drain": lambda: decode.drain(path, fmt, 65536, True),  # noqa: B023
            "data": lambda: decode.drain(path, fmt, 65536, False),  # noqa: B023
            "validate": lambda: decode.rank_summary(path, fmt, None, None, False),  # noqa: B023
            "predict": lambda: decode.comm_summary(path, fmt),  # noqa: B023
        }
        # None: the file goes to the reference decoder (it breaks a rule the command reports)
        cells = [best(fn, n) if fn() is not None else "reference" for fn in work.values()]
        print(f"{label:<34} " + "  ".join(f"{c:>16}" for c in cells), flush=True)


def write_feeder_file(path: Path, nodes: int) -> None:
    if path.exists():
        return
    sys.path.insert(0, str(HERE))
    from bench_feeder import write_trace  # type: ignore[import-not-found]

    write_trace(path, nodes)


FEEDER_PHASE = """
import json, resource, sys, time
from stg.trace.feeder import ETFeeder
f = ETFeeder(sys.argv[1], window=65536)
start, cpu = time.perf_counter(), time.process_time()
count = 0
while f.has_nodes_to_issue():
    wave = []
    node = f.get_next_issuable_node()
    while node is not None:
        wave.append(node.id)
        node = f.get_next_issuable_node()
    for i in wave:
        f.free_children_nodes(i)
    for i in wave:
        f.remove_node(i)
    count += len(wave)
seconds = time.perf_counter() - start
cpu = time.process_time() - cpu
print(json.dumps({"nodes": count, "seconds": seconds, "cpu": cpu,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/stg-bench-read"))
    parser.add_argument("--jobs", default="0", help="--jobs of the commands (0: all cores)")
    parser.add_argument("--big", action="store_true", help="also the 1,024-rank trace")
    parser.add_argument("--feeder-nodes", type=int, default=0, help="nodes of the feeder file")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--shared", type=Path, help="the shared Chakra traces (default: found)")
    parser.add_argument("--commands", default="validate,feed,inspect,predict")
    parser.add_argument("--traces", help="only these traces (e.g. 'json,v0.0.4 1024 ranks')")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode table")
    args = parser.parse_args()
    import stg

    print(f"stg {stg.__file__}", flush=True)
    traces = ensure_traces(args.dir, args.big)
    files = {f"stg rank 0 {fmt}": next(p for p in sorted(t.iterdir()) if ".0." in p.name)
             for fmt, t in traces.items() if "1024" not in fmt}  # fmt: skip
    shared = args.shared or next((p for p in SHARED_CANDIDATES if p.is_dir()), None)
    if shared is not None:
        files["chakra.0.et (PyTorch, shared)"] = shared / "chakra.0.et"
        files["small_chakra.0.json (shared)"] = shared / "small_chakra.0.json"
    if not args.no_decode:
        decode_rates(files, args.skip_reference)
    if args.traces:
        traces = {k: v for k, v in traces.items() if k in args.traces.split(",")}
    import importlib.util

    jobs = ["--jobs", args.jobs] if importlib.util.find_spec("stg.trace.parallel") else []
    commands = {
        "validate": lambda t: stg_cmd("validate", str(t), *jobs),
        "feed": lambda t: stg_cmd("feed", str(t), *jobs),
        "inspect": lambda t: stg_cmd("inspect", "trace", str(t), *jobs),
        "predict": lambda t: stg_cmd("predict", str(t), *jobs, "--predictor", "time", "--json"),
    }
    wanted = args.commands.split(",")
    print(f"\n{'command':<10} {'trace':<20} {'nodes':>10} {'wall s':>7} {'nodes/s':>11} "
          f"{'CPU s':>6} {'nodes/CPU-s':>12} {'peak RSS: largest':>18} "
          f"{'all processes':>14}")  # fmt: skip
    for fmt, trace in traces.items():
        nodes = count_nodes(trace)
        for name in wanted:
            r = run(commands[name](trace))
            print(f"{name:<10} {fmt:<20} {nodes:>10,} {r['seconds']:>7.2f} "
                  f"{nodes / r['seconds']:>9,.0f}/s {r['cpu_seconds']:>6.2f} "
                  f"{nodes / r['cpu_seconds']:>10,.0f}/s {r['largest_mib']:>14,.0f} MiB "
                  f"{r['tree_mib']:>10,.0f} MiB", flush=True)  # fmt: skip
    if args.feeder_nodes:
        path = args.dir / f"feeder.{args.feeder_nodes}.0.et"
        write_feeder_file(path, args.feeder_nodes)
        r = run([sys.executable, "-c", FEEDER_PHASE, str(path)])
        out = json.loads(r["stdout"])  # type: ignore[arg-type]
        print(f"\nfeeder (ETFeeder, window 65,536) {out['nodes']:,} nodes: {out['seconds']:.1f} s, "
              f"{out['nodes'] / out['seconds']:,.0f} nodes/s, CPU {out['cpu']:.1f} s, "
              f"{out['nodes'] / out['cpu']:,.0f} nodes/CPU-s, peak RSS {out['rss']:,.0f} MiB",
              flush=True)  # fmt: skip
        r = run(stg_cmd("feed", str(path), *jobs))
        n = args.feeder_nodes
        print(
            f"stg feed (compiled drain)  {n:,} nodes: {r['seconds']:.1f} s, "
            f"{n / r['seconds']:,.0f} nodes/s, CPU {r['cpu_seconds']:.1f} s, "
            f"{n / r['cpu_seconds']:,.0f} nodes/CPU-s, peak RSS {r['largest_mib']:,.0f} MiB "
            f"(all processes {r['tree_mib']:,.0f} MiB)"
        )


if __name__ == "__main__":
    main()
