"""CPU seconds of lowering (``build_workload``) and of ``stg generate``, each in its own process.

Run: ``python benchmarks/lowering_speed.py [--repeat N] [--tree DIR ...]``.

Rows:

- ``predict``: ``build_workload(options, registry, lowered_micro_batches=N)`` of GPT-3 175B
  on 1,024 A100s (tensor parallelism 8, pipeline parallelism 16 with 1F1B, data parallelism
  8, 192 micro-batches of 8 samples: Brown et al.'s batch of 1,536), what ``stg predict``
  builds for its periodic replay: ``N`` is the first count that
  ``predictors/time.py``'s ``lowered_micro_batches`` tries (18 at c3b3e91: 16 stages,
  106,942 nodes).
- ``refine``: the same for a plan that ``stg search --refine 5`` prices with the replay:
  tensor parallelism 4, pipeline parallelism 8 interleaved over 4 model chunks per stage,
  data parallelism 32, 48 micro-batches of 32 samples (32 lowered at c3b3e91: 8 stages,
  192,050 nodes).
- ``generate``: ``build_workload`` of GPT-3 175B at tensor parallelism 8, pipeline
  parallelism 16 and 32 micro-batches of one sample (128 ranks, 1.5 million nodes over the
  ranks, 190,000 in the 16 rank classes).
- ``stg generate``: that plan written by ``stg generate`` (129 files, 235 MiB): the whole
  process, imports and writing included.

A ``build_workload`` row is the median and the least of ``--repeat`` builds (default 5) in one
child process after a first build (imports, sympy's caches), timed with ``time.process_time``
(user + system CPU of the process; the garbage collector as the caller leaves it, on for
``generate`` as in ``stg generate``, off for ``predict`` as ``predict_time_options`` turns it);
the ``stg generate`` row is the best of ``--repeat`` processes (``os.wait4``'s user + system
time). ``--tree DIR`` times the ``stg`` package of another checkout too, e.g. the commit
before a change, ``git archive 76eeb38 | tar -x -C /tmp/old``: its children get DIR first on
``PYTHONPATH`` (the installed plugin packages, such as the models, stay this checkout's;
each row names the lowering module it timed).
Every tree's rows run in the same invocation, so that they share the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GPT3_175B = dict(
    model="gpt", dmodel=12288, dff=49152, head=96, kvhead=96, num_stacks=96, seq=2048,
    dvocal=51200, tp=8,
)  # fmt: skip
PREDICT = dict(GPT3_175B, pp=16, dp=8, micro_batch=8, batch=1536)
REFINE = dict(
    GPT3_175B, tp=4, pp=8, dp=32, micro_batch=32, batch=1536, pipeline_schedule="interleaved",
    virtual_stages=4,
)  # fmt: skip
GENERATE = dict(GPT3_175B, pp=16, dp=1, micro_batch=1, batch=32)
PREDICTED = "predicted"
"""``lowered``: the micro-batches ``stg predict`` lowers for the run (its first try)"""

BUILD = """
import gc, json, statistics, sys, time
import stg.core.lowering
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
options, lowered, repeat, collect = json.loads(sys.argv[1])
options = GenerateOptions(**options)
if lowered == "predicted":
    from stg.api import load_system
    from stg.predictors.time import lowered_micro_batches
    lowered = lowered_micro_batches(options, load_system("a100-80g"))[0][0]
registry = load_registry(autoload=False)
if not collect:
    gc.disable()
workload = build_workload(options, registry, lowered_micro_batches=lowered)
nodes = sum(len(c.nodes) for c in workload.rank_classes)
del workload
times = []
for _ in range(repeat):
    start = time.process_time()
    workload = build_workload(options, registry, lowered_micro_batches=lowered)
    times.append(time.process_time() - start)
    del workload
print(json.dumps({
    "median_s": statistics.median(times), "best_s": min(times), "nodes": nodes,
    "lowered": lowered, "module": stg.core.lowering.__file__,
}))
"""


CHECKOUT = str(Path(__file__).resolve().parents[1])


def child_env(tree: str) -> dict[str, str]:
    """The environment of a child that imports ``stg`` from ``tree``: first on its path (the
    children run in the temporary directory, so that no working directory comes first)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    return env


def build_row(
    options: dict[str, object], lowered: int | str | None, repeat: int, collect: bool, tree: str
) -> dict[str, object]:
    """One child process timing ``build_workload``: its median and least CPU seconds, node
    count and micro-batches lowered."""
    args = json.dumps([options, lowered, repeat, collect])
    done = subprocess.run(
        [sys.executable, "-c", BUILD, args],
        env=child_env(tree),
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def generate_row(options: dict[str, object], repeat: int, tree: str) -> float:
    """The least user + system CPU seconds of ``repeat`` ``stg generate`` processes."""
    flags = [f"--{k}={v}" for k, v in options.items()]
    best = float("inf")
    for _ in range(repeat):
        out = tempfile.mkdtemp(prefix="stg-lowering-")
        try:
            trace = os.path.join(out, "trace")
            command = [sys.executable, "-m", "stg", "generate", *flags, "--output_dir", trace]
            proc = subprocess.Popen(
                command,
                env=child_env(tree),
                cwd=out,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            _, status, usage = os.wait4(proc.pid, 0)
            if os.waitstatus_to_exitcode(status):
                error = proc.stderr.read().decode() if proc.stderr else ""
                raise SystemExit(f"failed: {' '.join(command)}\n{error}")
            best = min(best, usage.ru_utime + usage.ru_stime)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5, help="builds or processes per row")
    parser.add_argument(
        "--tree", action="append", default=[], help="another checkout to time (repeatable)"
    )
    ns = parser.parse_args()
    for tree in [CHECKOUT, *ns.tree]:
        label = "this checkout" if tree == CHECKOUT else tree
        for name, options, what in (
            ("predict ", PREDICT, "175B 1F1B, 192 micro-batches"),
            ("refine  ", REFINE, "175B interleaved, 48 micro-batches"),
        ):
            got = build_row(options, PREDICTED, ns.repeat, False, tree)
            print(
                f"{label}: {name} build_workload, {what}, {got['lowered']} lowered: "
                f"median {got['median_s']:.3f} CPU s, best {got['best_s']:.3f} "
                f"({got['nodes']:,} nodes; {got['module']})",
                flush=True,
            )
        generate = build_row(GENERATE, None, ns.repeat, True, tree)
        print(
            f"{label}: generate build_workload, 175B tp8 pp16, 32 micro-batches: "
            f"median {generate['median_s']:.3f} CPU s, best {generate['best_s']:.3f} "
            f"({generate['nodes']:,} nodes)",
            flush=True,
        )
        cpu = generate_row(GENERATE, ns.repeat, tree)
        print(f"{label}: stg generate, 175B tp8 pp16, 32 micro-batches: {cpu:.2f} CPU s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
