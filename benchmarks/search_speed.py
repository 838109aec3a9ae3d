"""Plans per CPU second of ``stg search`` for GPT-3 175B on 1,024 A100s (batch 1,536).

Run: ``python benchmarks/search_speed.py [--refine N ...] [--tree DIR] [--repeat R] [--plans K]``
(default ``--refine 5 0``). Each search runs in a fresh process (``--jobs 1``: the pricing in
that process), so that its CPU time (user + system of the child, from
``resource.getrusage(RUSAGE_CHILDREN)``) is its own; the figure is the plans the search
enumerated over that CPU time, as the issue counts them. ``--tree DIR`` also runs another
checkout of stg (e.g. ``git archive REV | tar -x -C DIR``) in turn with this one, so that
both share the machine's load: its own ``stg`` and built-in plugins (``models/``,
``emitters/``, ``predictors/``, which the editable install would otherwise take from this
checkout; the installed plugin distributions stay this checkout's); ``--repeat`` runs each
search that many times. ``--plans K`` then prices the K best plans of the analytical pass
with the DAG predictor one at a time (in a fresh process, as ``--refine K`` does), each with
its CPU seconds, its replay (periodic: the micro-batches lowered and replayed) and both
prices, then the CPU seconds of replaying every micro-batch instead (``exact``, run second):
where a refinement's CPU time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

PLUGIN_PACKAGES = ("models", "emitters", "predictors")
"""The built-in plugin packages, ``stg.<name>`` from the checkout's ``<name>/`` folder."""

COMMAND = [
    "search", "--model", "gpt3-175b", "--gpus", "1024", "--batch", "1536",
    "--system", "a100-80g", "--jobs", "1", "--json",
]  # fmt: skip


def use_tree_packages(tree: str) -> None:
    """Import the built-in plugin packages of the checkout ``tree`` (whose ``stg`` is the one
    imported) from its folders: the editable install maps ``stg.predictors`` and the others to
    this checkout's folders, which a ``PYTHONPATH`` before it does not change."""
    import importlib.util

    import stg

    for name in PLUGIN_PACKAGES:
        folder = os.path.join(tree, name)
        spec = importlib.util.spec_from_file_location(
            f"stg.{name}", os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )
        if spec is None or spec.loader is None:
            raise SystemExit(f"error: {tree!r} has no {name}/ package")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        setattr(stg, name, module)


def stg_command(args: list[str], tree: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``stg args`` from the checkout ``tree``
    (its ``stg`` and built-in plugins), else from the installed stg."""
    env = dict(os.environ)
    if tree is None:
        return [sys.executable, "-m", "stg", *args], env
    tree = os.path.abspath(tree)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    here = os.path.dirname(os.path.abspath(__file__))
    boot = (
        f"import sys; sys.path.insert(1, {here!r}); import search_speed; "
        f"search_speed.use_tree_packages({tree!r}); from stg.cli import main; main(sys.argv[1:])"
    )
    return [sys.executable, "-c", boot, *args], env


def measure(refine: int, tree: str | None = None) -> dict[str, float | int | str | None]:
    """One search in a child process (of the checkout ``tree``, else the installed stg): CPU
    seconds, plans enumerated and the best plan."""
    args, env = stg_command([*COMMAND, "--refine", str(refine)], tree)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(args, capture_output=True, text=True, check=True, env=env, cwd=tree)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = json.loads(done.stdout)
    best = result["best"][0]
    return {
        "tree": tree or "installed",
        "refine": refine,
        "cpu_s": round(cpu, 2),
        "enumerated": result["enumerated"],
        "plans_per_cpu_s": round(result["enumerated"] / cpu, 1),
        "refined": result["refined"],
        "best": json.dumps(best["plan"], sort_keys=True),
        "best_time_s": (best.get("time") or best.get("analytical") or {}).get("iteration_time_s"),
    }


def refine_each(plans: int) -> None:
    """The CPU seconds of refining each of the ``plans`` best plans of the analytical pass
    (one JSON line each), in this process: run by :func:`main` in a fresh one."""
    import time

    from stg.cli._shared import options_from_cli
    from stg.explore.search import search
    from stg.host.registry import load_registry
    from stg.perf.system import load_system

    flags = dict(zip(COMMAND[1::2], COMMAND[2::2], strict=False))
    registry = load_registry()
    system = load_system(flags["--system"])
    base = options_from_cli({"model": flags["--model"], "batch": int(flags["--batch"])})
    gpus = int(flags["--gpus"])
    result = search(base, gpus, system, registry, top=plans, refine=0, jobs=1)
    predictor = registry.predictors.get("time")
    kernels = list(registry.kernels)
    for rank, candidate in enumerate(result.best, start=1):
        before = time.process_time()
        report = predictor.predict_options(
            candidate.options, system, registry=registry, kernels=kernels
        )
        cpu = time.process_time() - before
        before = time.process_time()
        predictor.predict_options(
            candidate.options, system, registry=registry, kernels=kernels, exact=True
        )
        exact = time.process_time() - before
        replay = report.get("replay", {})
        print(
            json.dumps(
                {
                    "rank": rank,
                    "plan": json.dumps(candidate.plan(), sort_keys=True),
                    "refine_cpu_s": round(cpu, 2),
                    "full_replay_cpu_s": round(exact, 2),
                    "replay": replay.get("kind"),
                    "lowered_micro_batches": replay.get("lowered_micro_batches"),
                    "replayed_micro_batches": replay.get("replayed_micro_batches"),
                    "analytical_s": round(candidate.time_s, 4),
                    "dag_s": round(report["iteration_time_s"], 4),
                }
            ),
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--refine", type=int, nargs="*", default=[5, 0])
    parser.add_argument("--tree", help="another stg checkout to measure in turn with this one")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--plans", type=int, default=0, help="refine each of the K best alone")
    parser.add_argument("--refine-each", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.refine_each:
        refine_each(args.refine_each)
        return
    trees = [None] if args.tree is None else [args.tree, None]
    for _ in range(args.repeat):
        for refine in args.refine:
            for tree in trees:
                print(json.dumps(measure(refine, tree)), flush=True)
    if args.plans:
        child = [sys.executable, __file__, "--refine", "--refine-each", str(args.plans)]
        subprocess.run(child, check=True)


if __name__ == "__main__":
    main()
