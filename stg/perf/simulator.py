"""Running ASTRA-sim on a trace set and reading what it reports (``stg simulate``, ``stg
sweep --simulate astra-sim``).

ASTRA-sim's analytical frontends (``AstraSim_Analytical_Congestion_Unaware`` and ``..._Aware``)
take the workload prefix, the comm-group file and the system, network and remote-memory
configurations as ``--name=value`` options (``CmdLineParser.cc``) and log, for every NPU whose
graph ran to its end, one line (``Workload::report`` in ``astra-sim/workload/Workload.cc``,
astra-sim 518bd513ae110428cd62eb60efc0f3993fd53c70)::

    [2026-11-26 00:26:15.097] [workload] [info] sys[3] finished, 1234 cycles, exposed
    communication 56 cycles.

(one line, through spdlog's asynchronous logger)

where the exposed communication is the finish tick less the ticks of the NPU's compute
(``tics_gpu_ops``): communication, waits for peers and pipeline bubbles not hidden by
compute. ASTRA-sim 2.2.0 printed only ``sys[3] finished, 1234 cycles`` (exposed communication
came with astra-sim f2fe537, 2024-11-03); both are read. A cycle of the analytical backends is
one nanosecond (their bandwidths are bytes per ns, ``bw_GBps_to_Bpns``).

An NPU blocked forever (a receive nobody sends, a collective some member never joins) never
logs that line, and the simulator still exits 0 once its event queue is empty: a run is
complete only when every rank reported. A simulator that crashes after every rank reported
(astra-sim 518bd51 frees a sub-group's collective implementations twice while it tears down,
see docs/simulate.md) gave complete figures: they are kept, with a note. Its asynchronous
logger may lose the last lines when it aborts; then the run is a crash.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stg.errors import UserError

BINARY_ENV = "ASTRA_SIM_BIN"
"""the environment variable naming the ASTRA-sim binary when ``--astra-sim`` is not given"""

DEFAULT_TIMEOUT_S = 600.0
"""seconds a run may take before it is stopped (``--timeout``)"""

CYCLES_PER_S = 1e9
"""cycles of ASTRA-sim's analytical network backends per second (a cycle is a nanosecond)"""

INPUT_OPTIONS: Mapping[str, str] = {
    "workload": "workload-configuration",
    "comm_group": "comm-group-configuration",
    "system": "system-configuration",
    "network": "network-configuration",
    "memory": "remote-memory-configuration",
}
"""ASTRA-sim's command-line option for each input (analytical ``CmdLineParser.cc``)"""

_FINISHED = re.compile(
    r"sys\[(\d+)\] finished, (\d+) cycles(?:, exposed communication (\d+) cycles)?"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DIAGNOSTIC = re.compile(r"\[(?:C|E|critical|error)\]|error|abort|terminate|fault|what\(\)", re.I)


class SimulationFailed(Exception):
    """The simulator ran but gave no complete result. The message is one line (the CLI exits
    1); ``reason`` is ``failed`` (a crash or a non-zero exit), ``incomplete`` (it exited before
    every rank finished) or ``timeout``; ``output`` is what it printed."""

    def __init__(self, message: str, reason: str, output: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.output = output


@dataclass(frozen=True)
class RankResult:
    """One NPU's figures as ASTRA-sim reported them, in cycles (ns)."""

    rank: int
    finish_cycles: int
    exposed_communication_cycles: int | None

    @property
    def compute_cycles(self) -> int | None:
        """The NPU's compute ticks: its finish less its exposed communication."""
        if self.exposed_communication_cycles is None:
            return None
        return self.finish_cycles - self.exposed_communication_cycles


@dataclass(frozen=True)
class SimulatorRun:
    """A complete run: every rank's result, the simulator's output and its wall time."""

    binary: str
    ranks: tuple[RankResult, ...]
    output: str
    wall_s: float
    exit_note: str | None = None
    """how the simulator ended where that was not a clean exit after every rank finished"""

    @property
    def finish_cycles(self) -> int:
        """When the last rank finished: the simulated iteration."""
        return max(r.finish_cycles for r in self.ranks)


@dataclass(frozen=True)
class SimulatorInputs:
    """The files ASTRA-sim reads for one trace set: the workload prefix (it opens
    ``<workload>.<rank>.et``), the comm-group file (None: none) and its three configurations."""

    workload: str
    comm_group: str | None
    system: str
    network: str
    memory: str
    world_size: int

    def arguments(self) -> list[str]:
        """The options that name these files, as ASTRA-sim takes them."""
        values = {
            "workload": self.workload,
            "comm_group": self.comm_group,
            "system": self.system,
            "network": self.network,
            "memory": self.memory,
        }
        return [f"--{INPUT_OPTIONS[k]}={v}" for k, v in values.items() if v is not None]


def resolve_binary(path: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The ASTRA-sim binary: ``path`` (``--astra-sim``), else ``$ASTRA_SIM_BIN``; a bare name
    is looked up on PATH. A missing or non-executable binary is one :class:`UserError` line."""
    environ = os.environ if environ is None else environ
    source = "--astra-sim"
    if not path:
        path = environ.get(BINARY_ENV) or None
        source = BINARY_ENV
    if not path:
        raise UserError(
            f"no ASTRA-sim binary: give --astra-sim PATH or set {BINARY_ENV} (an analytical "
            "build's bin/AstraSim_Analytical_Congestion_Unaware; see docs/simulate.md)"
        )
    candidate = Path(path).expanduser()
    if os.sep not in path and not candidate.exists():
        found = shutil.which(path)
        if found is None:
            raise UserError(f"ASTRA-sim binary {path!r} ({source}) is not on PATH")
        candidate = Path(found)
    if not candidate.is_file():
        what = "is a directory" if candidate.is_dir() else "does not exist"
        raise UserError(f"ASTRA-sim binary {str(candidate)!r} ({source}) {what}")
    if not os.access(candidate, os.X_OK):
        raise UserError(f"ASTRA-sim binary {str(candidate)!r} ({source}) is not executable")
    return str(candidate.absolute())


def parse_finished(output: str) -> dict[int, RankResult]:
    """Every ``sys[N] finished, T cycles[, exposed communication E cycles]`` line of
    ``output``, by rank (colour codes of a terminal sink removed)."""
    found: dict[int, RankResult] = {}
    for match in _FINISHED.finditer(_ANSI.sub("", output)):
        rank, finish, exposed = match.groups()
        found[int(rank)] = RankResult(
            int(rank), int(finish), None if exposed is None else int(exposed)
        )
    return found


def run_astra_sim(
    binary: str,
    inputs: SimulatorInputs,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    extra_arguments: Sequence[str] = (),
) -> SimulatorRun:
    """Run ``binary`` on ``inputs`` in a scratch directory (its log folder goes there and is
    removed) and read every rank's result. Raises :class:`SimulationFailed` on a crash, a
    run that ends before every rank finished or one that passes ``timeout_s`` (its process
    group is killed), and :class:`UserError` when the binary cannot be started."""
    with tempfile.TemporaryDirectory(prefix="stg-astra-sim-") as scratch:
        command = [
            binary,
            *inputs.arguments(),
            f"--logging-folder={Path(scratch) / 'log'}",
            *extra_arguments,
        ]
        start = time.monotonic()
        try:
            process = subprocess.Popen(
                command,
                cwd=scratch,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                text=True,
                errors="replace",
            )
        except OSError as exc:
            raise UserError(f"cannot run ASTRA-sim {binary}: {exc.strerror or exc}") from None
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            output, _ = process.communicate()
            raise SimulationFailed(
                f"ASTRA-sim ran longer than {timeout_s:g} s and was stopped; allowed: a larger "
                "--timeout",
                "timeout",
                output or "",
            ) from None
        except BaseException:  # Ctrl-C: leave no simulator behind
            _kill_group(process)
            process.communicate()
            raise
        wall = time.monotonic() - start
    code = process.returncode
    found = parse_finished(output)
    missing = [r for r in range(inputs.world_size) if r not in found]
    if code != 0 and missing:
        raise SimulationFailed(
            f"ASTRA-sim {_exit_reason(code)}{_last_words(output)}", "failed", output
        )
    if missing:
        done = inputs.world_size - len(missing)
        raise SimulationFailed(
            f"ASTRA-sim exited with {done} of {inputs.world_size} ranks finished (ranks "
            f"{_ranges(missing)} never did: a deadlock, such as a receive without its send or "
            f"a collective a member never joins){_last_words(output)}",
            "incomplete",
            output,
        )
    ranks = tuple(found[r] for r in range(inputs.world_size))
    note = None
    if code != 0:
        note = f"ASTRA-sim {_exit_reason(code)} after every rank finished{_last_words(output)}"
    return SimulatorRun(binary=binary, ranks=ranks, output=output, wall_s=wall, exit_note=note)


def side_by_side(run: SimulatorRun, time_report: Mapping[str, Any]) -> dict[str, Any]:
    """ASTRA-sim's figures beside ``stg predict``'s time report for the same trace and system.

    Per rank row of the report (a representative of identical ranks): compute, exposed time
    and finish from each. stg's exposed time is the iteration less the rank's compute
    (exposed communication, waits and bubble), as ASTRA-sim counts its exposed communication;
    stg's finish is the iteration time."""
    iteration = float(time_report["iteration_time_s"])
    simulated = run.finish_cycles / CYCLES_PER_S
    rows = []
    for entry in time_report.get("ranks", []):
        result = run.ranks[entry["rank"]] if entry["rank"] < len(run.ranks) else None
        compute = float(entry["compute_s"])
        rows.append(
            {
                "rank": entry["rank"],
                "ranks": entry["ranks"],
                "stg": {
                    "compute_s": compute,
                    "exposed_s": iteration - compute,
                    "exposed_communication_s": entry.get("exposed_communication_s"),
                    "finish_s": iteration,
                },
                "astra_sim": None if result is None else _seconds(result),
            }
        )
    return {
        "system": time_report.get("system"),
        "world_size": len(run.ranks),
        "iteration_time_s": {
            "stg": iteration,
            "astra_sim": simulated,
            "ratio": simulated / iteration if iteration > 0 else None,
        },
        "ranks": rows,
        "astra_sim": {
            "binary": run.binary,
            "ranks": [_seconds(r) for r in run.ranks],
        },
    }


def _seconds(result: RankResult) -> dict[str, Any]:
    exposed = result.exposed_communication_cycles
    compute = result.compute_cycles
    return {
        "rank": result.rank,
        "finish_s": result.finish_cycles / CYCLES_PER_S,
        "exposed_communication_s": None if exposed is None else exposed / CYCLES_PER_S,
        "compute_s": None if compute is None else compute / CYCLES_PER_S,
    }


def _kill_group(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"crashed ({name})"
    return f"failed with exit code {code}"


def _last_words(output: str) -> str:
    """``: <the last diagnostic line>`` of the simulator's output (else its last line)."""
    lines = [line.strip() for line in _ANSI.sub("", output).splitlines() if line.strip()]
    if not lines:
        return ""
    said = [line for line in lines if _DIAGNOSTIC.search(line)]
    line = (said or lines)[-1]
    if len(line) > 300:
        line = line[:297] + "..."
    return f": {line}"


def _ranges(ranks: Sequence[int], shown: int = 8) -> str:
    """``[3, 8, 9, 10]`` -> ``3, 8..10`` (the first ``shown`` runs, then ``...``)."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [str(run[0]) if len(run) == 1 else f"{run[0]}..{run[-1]}" for run in runs[:shown]]
    return ", ".join(parts) + (", ..." if len(runs) > shown else "")
