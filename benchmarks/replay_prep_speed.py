"""CPU time of the time predictor outside the replay's event loop, GPT-3 175B on 1,024 A100s.

Run: ``python benchmarks/replay_prep_speed.py [--runs N] [--rounds R] [--tree DIR]``.

The plan of ``benchmarks/predict_speed.py`` (tensor parallelism 8, pipeline parallelism 16,
data parallelism 8, batch 1,536: 192 micro-batches), lowered as ``stg predict`` lowers it for
its periodic replay (the fill and two periods: 18 micro-batches), is predicted ``--runs``
times (default 5) with ``predict_time``: each run's CPU time (``time.process_time``) in all
and outside the engine's event loop (``_Sim.run``, timed on its own): the units
(``problem_from_workload``), the engine's preparation of every node, the periodic replay's
check and extrapolation, freeing what they made. A row gives the medians and a digest of the
report (the same digest: the same report). Each measurement runs in a fresh process;
``--tree DIR`` also measures another checkout of stg (e.g. ``git archive REV | tar -x -C
DIR``) in turn with this one, ``--rounds`` times (default 1), so both share the machine's load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

PLAN = dict(
    model="gpt", dmodel=12288, dff=49152, head=96, kvhead=96, num_stacks=96, seq=2048,
    dvocal=51200, tp=8, pp=16, dp=8, micro_batch=8, batch=1536,
)  # fmt: skip


def measure(runs: int) -> dict[str, object]:
    """The medians of ``runs`` predictions of the lowered plan, in this process."""
    import gc

    from stg.core.options import GenerateOptions
    from stg.core.pipeline import build_workload
    from stg.host.registry import load_registry
    from stg.perf import replay as engine
    from stg.perf.system import load_system
    from stg.predictors.time import lowered_micro_batches, predict_time

    options = GenerateOptions(**PLAN)  # type: ignore[arg-type]
    system = load_system("a100-80g")
    built, period = lowered_micro_batches(options, system)[0]
    gc.disable()  # as predict_time_options runs it
    lowered = build_workload(options, load_registry(), lowered_micro_batches=built)
    in_loop = [0.0]
    run = engine._Sim.run

    def timed_run(self: object, *args: object, **kwargs: object) -> object:
        start = time.process_time()
        try:
            return run(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            in_loop[0] += time.process_time() - start

    engine._Sim.run = timed_run  # type: ignore[method-assign]
    totals, outside = [], []
    report: dict[str, object] = {}
    for _ in range(runs):
        in_loop[0] = 0.0
        start = time.process_time()
        report = predict_time(lowered, system, micro_batches=options.micro_batches, period=period)
        totals.append(time.process_time() - start)
        outside.append(totals[-1] - in_loop[0])
    digest = hashlib.sha256(json.dumps(report, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "lowered_micro_batches": built,
        "total_cpu_s": round(statistics.median(totals), 4),
        "outside_event_loop_cpu_s": round(statistics.median(outside), 4),
        "report_digest": digest,
    }


def measure_in_child(runs: int, tree: str | None) -> dict[str, object]:
    """:func:`measure` in a fresh process, of the checkout ``tree`` (else the installed stg)."""
    env = dict(os.environ)
    command = [sys.executable, os.path.abspath(__file__), "--child", "--runs", str(runs)]
    if tree is not None:
        tree = os.path.abspath(tree)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
        command += ["--tree", tree]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env, cwd=tree)
    return {"tree": tree or "installed", **json.loads(done.stdout)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="predictions per measurement")
    parser.add_argument("--rounds", type=int, default=1, help="measurements per checkout")
    parser.add_argument("--tree", help="another stg checkout to measure in turn with this one")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.rounds < 1:
        print("error: --runs and --rounds take a whole number, at least 1", file=sys.stderr)
        return 2
    if args.child:
        if args.tree is not None:  # its own built-in predictors, as search_speed.py does
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from search_speed import use_tree_packages

            use_tree_packages(args.tree)
        print(json.dumps(measure(args.runs)))
        return 0
    trees = [None] if args.tree is None else [args.tree, None]
    for _ in range(args.rounds):
        for tree in trees:
            print(json.dumps(measure_in_child(args.runs, tree)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
