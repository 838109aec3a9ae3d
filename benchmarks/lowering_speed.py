"""CPU seconds of lowering (``build_workload``) and of ``stg generate``, each in its own process.

Run: ``python benchmarks/lowering_speed.py [--repeat N] [--tree DIR ...]``.

Rows:

- ``predict``: ``build_workload(options, registry, lowered_micro_batches=34)`` of GPT-3 175B
  on 1,024 A100s (tensor parallelism 8, pipeline parallelism 16 with 1F1B, data parallelism
  8, 192 micro-batches of 8 samples: Brown et al.'s batch of 1,536), what ``stg predict``
  builds for its periodic replay (``predictors/time.py``): 16 stages, 201,967 nodes.
- ``generate``: ``build_workload`` of GPT-3 175B at tensor parallelism 8, pipeline
  parallelism 16 and 32 micro-batches of one sample (128 ranks, 1.5 million nodes over the
  ranks, 190,000 in the 16 rank classes).
- ``stg generate``: that plan written by ``stg generate`` (129 files, 235 MiB): the whole
  process, imports and writing included.

A ``build_workload`` row is the best of ``--repeat`` builds (default 3) in one child process
after a first build (imports, the bound parts' caches), timed with ``time.process_time``
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
GENERATE = dict(GPT3_175B, pp=16, dp=1, micro_batch=1, batch=32)
PREDICT_LOWERED = 34  # what predictors/time.py lowers for this run: fill, two periods, drain

BUILD = """
import gc, json, sys, time
import stg.core.lowering
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
options, lowered, repeat, collect = json.loads(sys.argv[1])
options = GenerateOptions(**options)
registry = load_registry(autoload=False)
if not collect:
    gc.disable()
workload = build_workload(options, registry, lowered_micro_batches=lowered)
nodes = sum(len(c.nodes) for c in workload.rank_classes)
del workload
best = float("inf")
for _ in range(repeat):
    start = time.process_time()
    workload = build_workload(options, registry, lowered_micro_batches=lowered)
    best = min(best, time.process_time() - start)
    del workload
print(json.dumps({"cpu_s": best, "nodes": nodes, "module": stg.core.lowering.__file__}))
"""


CHECKOUT = str(Path(__file__).resolve().parents[1])


def child_env(tree: str) -> dict[str, str]:
    """The environment of a child that imports ``stg`` from ``tree``: first on its path (the
    children run in the temporary directory, so that no working directory comes first)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    return env


def build_row(
    options: dict[str, object], lowered: int | None, repeat: int, collect: bool, tree: str
) -> dict[str, object]:
    """One child process timing ``build_workload``: its best CPU seconds and node count."""
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
    parser.add_argument("--repeat", type=int, default=3, help="builds or processes per row")
    parser.add_argument(
        "--tree", action="append", default=[], help="another checkout to time (repeatable)"
    )
    ns = parser.parse_args()
    for tree in [CHECKOUT, *ns.tree]:
        label = "this checkout" if tree == CHECKOUT else tree
        predict = build_row(PREDICT, PREDICT_LOWERED, ns.repeat, False, tree)
        print(
            f"{label}: predict  build_workload, 175B, {PREDICT_LOWERED} lowered micro-batches: "
            f"{predict['cpu_s']:.3f} CPU s ({predict['nodes']:,} nodes; {predict['module']})",
            flush=True,
        )
        generate = build_row(GENERATE, None, ns.repeat, True, tree)
        print(
            f"{label}: generate build_workload, 175B tp8 pp16, 32 micro-batches: "
            f"{generate['cpu_s']:.3f} CPU s ({generate['nodes']:,} nodes)",
            flush=True,
        )
        cpu = generate_row(GENERATE, ns.repeat, tree)
        print(f"{label}: stg generate, 175B tp8 pp16, 32 micro-batches: {cpu:.2f} CPU s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
