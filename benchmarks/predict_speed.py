"""CPU time and peak memory of ``stg predict``, each run in its own process.

Run: ``python benchmarks/predict_speed.py [SECTION ...] [--counts N ...] [--exact]
[--repeat N]``.
Sections (default ``gpt3``):

- ``gpt3``: GPT-3 175B on 1,024 A100s (tensor parallelism 8, pipeline parallelism 16 with
  1F1B, data parallelism 8; 8 samples per micro-batch over the replicas, so 192 micro-batches
  are Brown et al.'s batch of 1,536) from options, at each micro-batch count of ``--counts``
  (default 12 48 192 768), with the default predictors (time and memory), ``--predictor
  time`` and ``--predictor analytical``.
- ``deep``: GPT-3 530B at tp 8, pp 35, dp 9 (2,520 ranks, 280 micro-batches) and GPT 1T at
  tp 8, pp 64, dp 6 (Narayanan et al. 2021, Table 1 shapes; 512 micro-batches), from options
  with ``--predictor time`` and ``--max-nodes 100000000``: where the lowered workload's steady
  state does not repeat, the row says that the whole workload (hundreds of millions of
  nodes over the ranks) was refused rather than building it on a shared machine.
- ``trace``: the 315-rank pp-35 trace of issue 24 (written with ``stg generate``), predicted
  from its directory with ``--predictor time``.

Each row is one ``stg predict`` process: CPU is its user + system time and peak RSS its
``ru_maxrss`` (``os.wait4``), startup included; ``--repeat N`` runs each row N times and
keeps the run with the least CPU time (on a shared machine, the one least slowed by the
others; the runs after the first read what the first stored in ``$STG_CACHE_DIR``: the
analytical predictor's small workloads, the time predictor's bound model parts).
``--exact`` adds ``--exact`` (every micro-batch replayed) to the option rows. ``--whole``
adds, for the time predictor on GPT-3 175B, a row that builds the whole workload and
predicts from it
(``predict_time(build_workload(...))``, what ``stg predict`` did before it lowered only the
micro-batches its replay needs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import search_speed

GPT3_175B = dict(
    model="gpt", dmodel=12288, dff=49152, head=96, kvhead=96, num_stacks=96, seq=2048,
    dvocal=51200, tp=8, pp=16, dp=8, micro_batch=8,
)  # fmt: skip
GPT_530B = dict(
    model="gpt", dmodel=20480, dff=81920, head=128, kvhead=128, num_stacks=105, seq=2048,
    dvocal=51200, tp=8, pp=35, dp=9, micro_batch=9, batch=2520,
)  # fmt: skip
GPT_1T = dict(
    model="gpt", dmodel=25600, dff=102400, head=160, kvhead=160, num_stacks=128, seq=2048,
    dvocal=51200, tp=8, pp=64, dp=6, micro_batch=6, batch=3072,
)  # fmt: skip
PP35_TRACE = dict(
    model="gpt", dmodel=256, dff=1024, head=8, kvhead=8, seq=128, dvocal=1024,
    num_stacks=105, tp=1, pp=35, dp=9, batch=315, micro_batch=9, tpsp="false", dtype="fp16",
    mixed_precision="true",
)  # fmt: skip
DEFAULT_COUNTS = (12, 48, 192, 768)


def flags(options: dict[str, object]) -> list[str]:
    return [f"--{k}={v}" for k, v in options.items() if v is not None]


WHOLE = """
import json, sys
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.predictors.time import predict_time
options = GenerateOptions(**json.loads(sys.argv[1]))
report = predict_time(build_workload(options, load_registry(autoload=False)), "a100-80g")
print(json.dumps({"time": report}))
"""


def run(args: Sequence[str], code: str | None = None, tree: str | None = None) -> dict[str, object]:
    """One ``stg`` process (or one running ``code`` with ``args``; the ``stg`` of the checkout
    ``tree`` where given, :func:`search_speed.stg_command`): its CPU seconds, peak RSS in MB
    and JSON report."""
    env = None
    if code is None:
        command, env = search_speed.stg_command(list(args), tree)
    else:
        command = [sys.executable, "-c", code, *args]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, env=env, cwd=tree)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err = proc.stderr.read().decode() if proc.stderr else ""
        out.seek(0)
        report = {}
        if not proc.returncode and ("--json" in args or code):
            report = json.loads(out.read())
    return {
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "report": report,
        "error": err.strip().splitlines()[-1] if proc.returncode and err.strip() else "",
    }


def row(label: str, args: Sequence[str], code: str | None = None, repeat: int = 1) -> None:
    """Print one row: the least CPU time (and its run's peak RSS) of ``repeat`` processes."""
    result = min((run(args, code) for _ in range(repeat)), key=lambda r: r["cpu_s"])
    time = result["report"].get("time", {})  # type: ignore[union-attr]
    extra = f"; {result['error']}" if result["error"] else ""
    if time:
        replay = time.get("replay", {})
        lowered = replay.get("lowered_micro_batches")
        extra = f"; iteration {time['iteration_time_s']:.6f} s, {replay.get('kind')} replay"
        if lowered:
            extra += f" of {lowered} lowered micro-batches"
    print(
        f"{label}: {result['cpu_s']:.2f} CPU s, peak RSS {result['peak_rss_mb']:.0f} MB{extra}",
        flush=True,
    )


def main(argv: list[str]) -> int:
    exact = ["--exact"] if "--exact" in argv else []
    whole = "--whole" in argv
    repeat = 1
    if "--repeat" in argv:
        at = argv.index("--repeat")
        if at + 1 >= len(argv) or not argv[at + 1].isdigit() or int(argv[at + 1]) < 1:
            print("error: --repeat takes a whole number of runs, at least 1", file=sys.stderr)
            return 2
        repeat = int(argv[at + 1])
    counts = list(DEFAULT_COUNTS)
    if "--counts" in argv:
        at = argv.index("--counts")
        given = []
        for a in argv[at + 1 :]:
            if not a.isdigit():
                break
            given.append(int(a))
        counts = given or counts
    sections = [a for a in argv if a in ("gpt3", "deep", "trace")] or ["gpt3"]
    predict = ["predict", "--system", "a100-80g", "--json"]
    if "gpt3" in sections:
        for count in counts:
            options = flags(dict(GPT3_175B, batch=8 * count))
            for predictor in ("all", "time", "analytical"):
                extra = exact if predictor != "analytical" else []
                row(
                    f"175B {count:>3} micro-batches --predictor {predictor:<10}",
                    [*predict, "--predictor", predictor, *options, *extra],
                    repeat=repeat,
                )
            if whole:
                given = json.dumps(dict(GPT3_175B, batch=8 * count))
                row(f"175B {count:>3} micro-batches whole workload     ", [given], WHOLE, repeat)
    if "deep" in sections:
        for label, options in (("530B tp8 pp35 dp9", GPT_530B), ("1T tp8 pp64 dp6", GPT_1T)):
            limit = ["--max-nodes", "100000000"]
            row(
                label,
                [*predict, "--predictor", "time", *flags(options), *limit, *exact],
                repeat=repeat,
            )
    if "trace" in sections:
        with tempfile.TemporaryDirectory() as tmp:
            run(["generate", *flags(PP35_TRACE), "--output_dir", tmp])
            row("pp35 315-rank trace", [*predict, tmp, "--predictor", "time"], repeat=repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
