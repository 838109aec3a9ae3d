"""PARAM's ``--ncu`` and ``--nsys``: the measured cases again, in batches, under NSight.

PARAM (``train/compute/python/lib/pytorch/build_executor.py`` at 1e115ff) queues the input
configs it has measured and, every ``--run-batch-size`` (default 50) of them and at the end of
an operator's build, launches a child benchmark of the queue under the profiler, with its own
warm-up and iteration counts (ncu: 5 and 1, nsys: 5 and 10) and ``CUDA_VISIBLE_DEVICES`` set to
``--batch-cuda-device`` (default 1). The command lines are PARAM's:

- ``ncu --log-file FILE --csv --app-replay-buffer file --nvtx --nvtx-include
  param_bench:measure --target-processes all [the args file] CHILD``;
- ``nsys profile -t cuda,nvtx -o FILE [the args file] CHILD``.

Each batch adds PARAM's line to the results: ``{"ncu_file" | "nsys_file", "ncu_cmd_str" |
"nsys_cmd_str", "config", "start_run_id", "end_run_id"}``. stg's child is ``stg bench compute``
on the same config, given the batch by ``--resume-id`` and ``--stop-id`` (so its run ids and
NVTX labels are the parent's), with ``--nvtx`` on a GPU; its result lines are thrown away, as
PARAM's child writes to ``/dev/null``. PARAM ships the batch through shared memory instead.
NSight Compute profiles CUDA kernels only, so ``--ncu`` needs a CUDA device; NSight Systems
also samples a CPU run.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stg.bench.config import Case
from stg.errors import UserError

PARAM_NVTX_RANGE = "param_bench:measure"
"""The NVTX range ncu is told to profile (PARAM's ``param_bench_range``)."""


@dataclass(frozen=True)
class NsightTool:
    """One profiler as PARAM runs it: which (``ncu`` or ``nsys``), its binary, the extra
    options of its argument file, and the child's warm-up and measured iterations."""

    name: str
    binary: str
    extra_args: str = ""
    warmup: int = 5
    iterations: int = 1

    def command(self, output: Path) -> list[str]:
        """The profiler's part of the command line, writing to ``output``."""
        if self.name == "ncu":
            options = [
                "--log-file",
                str(output),
                "--csv",
                "--app-replay-buffer",
                "file",
                "--nvtx",
                "--nvtx-include",
                PARAM_NVTX_RANGE,
                "--target-processes",
                "all",
            ]
        else:
            options = ["profile", "-t", "cuda,nvtx", "-o", str(output)]
        return [self.binary, *options, *shlex.split(self.extra_args)]

    def output(self, out: Path, index: int) -> Path:
        """The profiler's file of batch ``index`` of a run whose results go to ``out``."""
        suffix = "ncu.log" if self.name == "ncu" else "nsys.nsys-rep"
        return out.with_name(f"{out.stem}_{index}_{suffix}")


DEFAULT_ITERATIONS = {"ncu": (5, 1), "nsys": (5, 10)}
"""(warm-up, iterations) of the child run per tool (PARAM's get_benchmark_options)."""


def nsight_tool(
    name: str,
    binary: str | None,
    args_file: str | None,
    warmup: int | None,
    iterations: int | None,
) -> NsightTool:
    """The tool as ``--ncu``/``--nsys`` and their options give it; one line, exit 2, where
    its binary is not found or its argument file cannot be read."""
    path = binary or name
    found = shutil.which(path)
    if found is None:
        raise UserError(
            f"--{name}: {path} is not found (NSight {'Compute' if name == 'ncu' else 'Systems'} "
            f"is not installed here; give its path with --{name}-bin)"
        )
    extra = ""
    if args_file is not None:
        try:
            extra = Path(args_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(
                f"--{name}-args-file {args_file}: cannot read it: {getattr(exc, 'strerror', exc)}"
            ) from None
    default_warmup, default_iterations = DEFAULT_ITERATIONS[name]
    tool = NsightTool(
        name,
        found,
        extra,
        default_warmup if warmup is None else warmup,
        default_iterations if iterations is None else iterations,
    )
    if tool.warmup < 0 or tool.iterations < 1:
        raise UserError(
            f"--{name}-warmup must be >= 0 and --{name}-iteration >= 1 "
            f"(got {tool.warmup} and {tool.iterations})"
        )
    return tool


def batches(
    cases: Sequence[Case], every: Sequence[Case], size: int
) -> Iterator[tuple[Case, Case | None, list[Case]]]:
    """Batches of at most ``size`` cases of one operator (PARAM queues per operator build)
    that follow each other in ``every`` (all cases of the config), out of ``cases`` (those
    measured without error): (first case, the case after the batch in ``every`` or None,
    the batch)."""
    if size < 1:
        raise UserError(f"--run-batch-size {size}: must be >= 1")
    position = {id(case): i for i, case in enumerate(every)}
    batch: list[Case] = []

    def close() -> tuple[Case, Case | None, list[Case]]:
        after = position[id(batch[-1])] + 1
        return batch[0], every[after] if after < len(every) else None, list(batch)

    for case in cases:
        if case.error is not None:
            continue
        follows = bool(batch) and position[id(case)] == position[id(batch[-1])] + 1
        if batch and (len(batch) == size or case.op_name != batch[0].op_name or not follows):
            yield close()
            batch = []
        batch.append(case)
    if batch:
        yield close()


@dataclass(frozen=True)
class BatchRun:
    """What the child of one batch needs from the parent's run."""

    config: str
    device: str
    backward: bool
    threads: int | None
    cuda_device: int


def child_command(run: BatchRun, tool: NsightTool, first: Case, after: Case | None) -> list[str]:
    """``stg bench compute`` of exactly one batch, marked with NVTX ranges on a GPU."""
    command = [
        sys.executable,
        "-m",
        "stg",
        "bench",
        "compute",
        run.config,
        "--device",
        "cuda" if run.device.startswith("cuda") else run.device,
        "--warmup",
        str(tool.warmup),
        "--iterations",
        str(tool.iterations),
        "--resume-id",
        first.run_id,
    ]
    if run.device.startswith("cuda"):  # ranges mark CUDA work; a CPU run has none
        command.append("--nvtx")
    if after is not None:
        command += ["--stop-id", after.run_id]
    if run.backward:
        command.append("--backward")
    if run.threads is not None:
        command += ["--threads", str(run.threads)]
    return command


def run_batches(
    run: BatchRun,
    tool: NsightTool,
    cases: Sequence[Case],
    every: Sequence[Case],
    batch_size: int,
    out: Path,
    produced: list[Path],
) -> list[dict[str, Any]]:
    """Profile every batch (``produced`` collects the profiler's files) and return PARAM's
    lines, one per batch. A child that fails is one line naming its command."""
    lines = []
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(run.cuda_device)}
    for index, (first, after, batch) in enumerate(batches(cases, every, batch_size)):
        output = tool.output(out, index)
        with tempfile.TemporaryDirectory(prefix="stg-nsight-") as scratch:
            child = child_command(run, tool, first, after)
            child += ["--out", str(Path(scratch) / "batch.jsonl"), "--json"]
            command = tool.command(output) + child
            produced.append(output)
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()
            why = tail[-1] if tail else f"exit status {done.returncode}"
            raise UserError(f"--{tool.name}: the batch from {first.run_id} failed: {why}")
        lines.append(
            {
                f"{tool.name}_file": str(output),
                f"{tool.name}_cmd_str": " ".join(command),
                "config": {
                    "op_name": first.op_name,
                    "run_options": {
                        "device": run.device,
                        "warmup": tool.warmup,
                        "iteration": tool.iterations,
                        "batch_cuda_device": run.cuda_device,
                        "pass_type": "backward" if run.backward else "forward",
                    },
                    "cases": len(batch),
                },
                "start_run_id": first.id,
                "end_run_id": batch[-1].id,
            }
        )
    return lines


__all__ = [
    "PARAM_NVTX_RANGE",
    "BatchRun",
    "NsightTool",
    "batches",
    "child_command",
    "nsight_tool",
    "run_batches",
]
