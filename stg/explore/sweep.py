"""Running a sweep: evaluate configurations on a process pool or a Dask cluster, keep every
finished row on disk, and write the results table.

A task carries options (a chunk of ``(id, index, options, system name)``) and the run's
context (predictor, system descriptions, plugins, simulator); a worker needs only stg and
its plugins. Each finished row is appended to ``OUT/rows.jsonl`` as it arrives, so an
interrupted sweep loses nothing and a rerun skips the ids already there; the table
(``results.csv``, and ``results.parquet`` with pyarrow) is rewritten from them at the end,
in configuration order, so the same sweep gives the same bytes on any engine.
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stg.errors import UserError, write_replacing

EXPLORE_EXTRA = "pip install 'symbolic-tensor-graph[explore]'"
ROWS_FILE = "rows.jsonl"
CSV_FILE = "results.csv"
PARQUET_FILE = "results.parquet"
RESULT_COLUMNS = (
    "status",
    "error",
    "world_size",
    "iteration_time_s",
    "mfu",
    "hfu",
    "tokens_per_s",
    "peak_memory_bytes",
    "fits",
)


def need(module: str, feature: str) -> Any:
    """Import an optional dependency of the explore extra, or one clear error line."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{feature} needs {module}: {EXPLORE_EXTRA}") from None


# -- the run's context and one task -------------------------------------------------------


ASTRA_SIM = "astra-sim"
"""``--simulate astra-sim``: stg's own simulate path (:func:`_simulate_astra_sim`)"""
ASTRA_SIM_FORMAT = "chakra-v0.0.4"
"""the trace format ASTRA-sim reads"""


@dataclass(frozen=True)
class Simulation:
    """``--simulate``: a command template (or :data:`ASTRA_SIM` with the ASTRA-sim binary),
    metrics to capture, a timeout, where to keep."""

    command: str
    metrics: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 600.0
    keep_dir: str | None = None
    binary: str | None = None


@dataclass(frozen=True)
class Context:
    """What every task of one sweep shares (picklable, small)."""

    predictor: str
    systems: Mapping[str, Mapping[str, Any]]
    """system name as given -> its description (System.as_dict())"""
    plugins: tuple[str, ...] = ()
    simulation: Simulation | None = None
    explain: bool = True
    calibration: Any = None
    """A :class:`stg.perf.calibration.Calibration` the predictor prices kernels with first."""


def parse_metrics(specs: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``NAME=REGEX`` pairs; a bad one is one error line."""
    out = []
    for spec in specs:
        name, sep, pattern = spec.partition("=")
        if not sep or not name.strip() or not pattern:
            raise UserError(f"--metric {spec!r}: expected NAME=REGEX")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name.strip()):
            raise UserError(f"--metric {spec!r}: NAME must be letters, digits and _")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise UserError(f"--metric {spec!r}: bad regular expression ({exc})") from None
        out.append((name.strip(), pattern))
    return tuple(out)


_WORKER: dict[str, Any] = {}


def _registry(plugins: Sequence[str]) -> Any:
    """This process's registry of ``plugins`` (loaded once per plugin list and autoload
    setting: STG_DISABLE_PLUGIN_AUTOLOAD may differ between runs of one process)."""
    from stg.host.registry import autoload_enabled, load_registry

    key = ("registry", tuple(plugins), autoload_enabled())
    if key not in _WORKER:
        _WORKER[key] = load_registry(list(plugins))
    return _WORKER[key]


def _system(name: str, data: Mapping[str, Any]) -> Any:
    key = ("system", name)
    if key not in _WORKER:
        from stg.perf.system import system_from_dict

        if "groups" in data:  # a hybrid cluster (device groups)
            from stg.perf.hybrid import hybrid_from_dict

            _WORKER[key] = hybrid_from_dict(dict(data), name)
        else:
            _WORKER[key] = system_from_dict(dict(data), name)
    return _WORKER[key]


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(*args, **kwargs)
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


def build_within_memory(options: Any, registry: Any) -> Any:
    """The workload of ``options``, refused with one line (a UserError) when its estimated
    size would not fit in the memory left (:mod:`stg.core.sizes`), before it is built."""
    from stg.core.pipeline import build_workload
    from stg.core.sizes import check_size, estimate_size

    check_size(estimate_size(options, registry), option=None)
    return build_workload(options, registry)


def evaluate(context: Context, task: tuple[str, int, Any, str]) -> dict[str, Any]:
    """One row: the predictions (and the simulator's figures) of one configuration. Errors
    of the configuration become the row's ``status``/``error``, never an exception."""
    ident, index, options, system_name = task
    row: dict[str, Any] = {"id": ident, "config": index}
    registry = _registry(context.plugins)
    system = _system(system_name, context.systems[system_name])
    kernels = list(registry.kernels)
    workload = None
    extra = {} if context.calibration is None else {"calibration": context.calibration}
    try:
        record = registry.predictors.get(context.predictor)
        if record.predict_options is not None:
            report = _call(
                record.predict_options,
                options,
                system,
                registry=registry,
                kernels=kernels,
                explain=context.explain,
                **extra,
            )
        else:
            workload = build_within_memory(options, registry)
            report = _call(
                record.predict,
                workload,
                system,
                registry=registry,
                kernels=kernels,
                explain=context.explain,
                **extra,
            )
        memory = registry.predictors.get("memory")
        mem = None
        if memory.predict_options is not None:
            try:
                # Muon's memory needs the model's weight matrices (its bound parts)
                muon = {"registry": registry} if getattr(options, "optimizer", "") == "muon" else {}
                mem = _call(memory.predict_options, options, system, kernels=kernels, **muon)
            except UserError:
                mem = None  # not from options alone (a serving phase): from the workload
        if mem is None:
            workload = workload or build_within_memory(options, registry)
            mem = _call(memory.predict, workload, system, kernels=kernels)
        row.update(
            status="ok",
            error="",
            world_size=options.world_size,
            iteration_time_s=report.get("iteration_time_s"),
            mfu=report.get("mfu"),
            hfu=report.get("hfu"),
            tokens_per_s=report.get("tokens_per_s"),
            peak_memory_bytes=mem.get("peak_bytes"),
            fits=mem.get("fits"),
        )
        for part, seconds in ((report.get("explain") or {}).get("breakdown_s") or {}).items():
            row[f"explain: {part}"] = seconds
        for key, value in sorted(report.items()):  # a predictor's own figures
            if key not in row and isinstance(value, int | float | str) and key != "predictor":
                row[f"{context.predictor}: {key}"] = value
    except UserError as exc:
        row.update(status="error", error=str(exc), world_size=options.world_size)
    except Exception as exc:  # a plugin's bug must not end the sweep
        row.update(status="error", error=f"{type(exc).__name__}: {exc}")
    if context.simulation is not None:
        sim = context.simulation
        if sim.command == ASTRA_SIM:
            iteration = row.get("iteration_time_s")
            row.update(
                _simulate_astra_sim(sim, ident, options, registry, workload, system, iteration)
            )
        else:
            row.update(_simulate(sim, ident, options, registry, workload))
    return row


def evaluate_chunk(context: Context, tasks: Sequence[tuple[str, int, Any, str]]) -> list[dict]:
    """Rows of a chunk of tasks (the unit of work an engine ships)."""
    return [evaluate(context, task) for task in tasks]


def _trace_directory(sim: Simulation, ident: str) -> Path:
    """Where a configuration's traces go: under ``keep_dir``, else a new temporary folder."""
    if sim.keep_dir is not None:
        directory = Path(sim.keep_dir) / ident
        directory.mkdir(parents=True, exist_ok=True)
        return directory
    return Path(tempfile.mkdtemp(prefix=f"stg-sweep-{ident}-"))


def _capture(sim: Simulation, output: str) -> dict[str, Any]:
    """Each ``--metric`` of ``sim`` in ``output``: the regex's first group (or its match) as
    ``metric_NAME``, a number where it reads as one; None where it does not match."""
    out: dict[str, Any] = {}
    for metric, pattern in sim.metrics:
        match = re.search(pattern, output, re.MULTILINE)
        value: Any = None
        if match is not None:
            value = match.group(1) if match.groups() else match.group(0)
            try:
                value = float(value)
            except ValueError:
                pass
        out[f"metric_{metric}"] = value
    return out


def _simulate_astra_sim(
    sim: Simulation,
    ident: str,
    options: Any,
    registry: Any,
    workload: Any,
    system: Any,
    iteration_s: float | None,
) -> dict[str, Any]:
    """``--simulate astra-sim``: write the configuration's traces with kernel times for its
    system and ASTRA-sim's inputs beside them (as ``stg generate --system S
    --astra_sim_configs``), run ``sim.binary`` on them (:func:`stg.perf.simulator.run_astra_sim`)
    and record when the last rank finished, its exposed communication and the ratio to the
    row's predicted iteration time. ``sim_status``: ``ok``, ``failed`` (a crash or non-zero
    exit), ``incomplete`` (ranks never finished), ``timeout`` or ``error`` (inputs refused)."""
    from dataclasses import replace

    from stg.perf.astra_sim import FILE_SUFFIXES, astra_sim_inputs
    from stg.perf.durations import with_durations
    from stg.perf.simulator import CYCLES_PER_S, SimulationFailed, SimulatorInputs, run_astra_sim
    from stg.trace.writer import comm_group_path, write_workload

    out: dict[str, Any] = {
        "sim_status": "",
        "sim_finish_s": None,
        "sim_exposed_communication_s": None,
        "sim_ratio": None,
    }
    out.update({f"metric_{name}": None for name, _ in sim.metrics})
    directory = _trace_directory(sim, ident)
    try:
        emitter = registry.emitters.get(options.format)
        if emitter.name != ASTRA_SIM_FORMAT:
            raise UserError(f"ASTRA-sim reads {ASTRA_SIM_FORMAT} traces, not {emitter.name}")
        options = replace(options, output_name="workload.%d.et")
        texts = astra_sim_inputs(
            system, options.world_size, options.dtype, bool(options.cpu_offloading_num_layers)
        )
        workload = workload or build_within_memory(options, registry)
        workload = with_durations(workload, system, kernels=registry.kernels)
        write_workload(workload, emitter, directory, options.output_name)
        stem = directory / comm_group_path(options.output_name).removesuffix(".json")
        paths = {kind: Path(f"{stem}{FILE_SUFFIXES[kind]}") for kind in texts}
        for kind, text in texts.items():
            paths[kind].write_text(text, encoding="utf-8")
        inputs = SimulatorInputs(
            workload=str(directory / "workload"),
            comm_group=str(directory / comm_group_path(options.output_name)),
            system=str(paths["system"]),
            network=str(paths["network"]),
            memory=str(paths["memory"]),
            world_size=options.world_size,
        )
        assert sim.binary is not None
        try:
            run = run_astra_sim(sim.binary, inputs, sim.timeout_s)
        except SimulationFailed as exc:
            out.update(sim_status=exc.reason, sim_error=str(exc), **_capture(sim, exc.output))
        else:
            last = max(run.ranks, key=lambda r: r.finish_cycles)
            finish = last.finish_cycles / CYCLES_PER_S
            exposed = last.exposed_communication_cycles
            out.update(
                sim_status="ok",
                sim_finish_s=finish,
                sim_exposed_communication_s=None if exposed is None else exposed / CYCLES_PER_S,
                sim_ratio=finish / iteration_s if iteration_s else None,
                **_capture(sim, run.output),
            )
    except UserError as exc:
        out.update(sim_status="error", sim_error=str(exc))
    except OSError as exc:
        out.update(sim_status="error", sim_error=f"{exc.strerror or exc}")
    finally:
        if sim.keep_dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    return out


def _simulate(
    sim: Simulation, ident: str, options: Any, registry: Any, workload: Any
) -> dict[str, Any]:
    """Generate the configuration's traces, run the simulator command on them, capture."""
    from dataclasses import replace

    from stg.trace.writer import comm_group_path, rank_pattern, write_workload

    out: dict[str, Any] = {"sim_status": "", "sim_exit_code": None}
    out.update({f"metric_{name}": None for name, _ in sim.metrics})
    directory = _trace_directory(sim, ident)
    try:
        emitter = registry.emitters.get(options.format)
        name = options.output_name
        if not name.endswith(emitter.extension):
            options = replace(options, output_name=f"workload.%d{emitter.extension}")
            name = options.output_name
        workload = workload or build_within_memory(options, registry)
        write_workload(workload, emitter, directory, name)
        pattern = rank_pattern(name, emitter.extension)
        prefix = str(directory / pattern.split(".%d", 1)[0])
        groups = str(directory / comm_group_path(name))
        command = sim.command.format(
            prefix=shlex.quote(prefix),
            ranks=options.world_size,
            comm_group=shlex.quote(groups),
            dir=shlex.quote(str(directory)),
        )
        process = subprocess.Popen(
            command,
            shell=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        try:
            output, _ = process.communicate(timeout=sim.timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            out.update(sim_status="timeout", sim_exit_code=None)
        else:
            code = process.returncode
            out.update(sim_status="ok" if code == 0 else "failed", sim_exit_code=code)
        out.update(_capture(sim, output or ""))
    except UserError as exc:
        out.update(sim_status="error", sim_error=str(exc))
    except OSError as exc:
        out.update(sim_status="error", sim_error=f"{exc.strerror or exc}")
    finally:
        if sim.keep_dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    return out


# -- engines ----------------------------------------------------------------------------------


def chunked(items: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


Work = Callable[[Any, Any], Any]
"""A unit of work an engine ships: ``fn(context, part)``, both picklable."""


class Engine:
    """Runs ``fn(context, part)`` for parts of work: in this process (``jobs`` 1), on a
    process pool of ``jobs`` workers kept open between runs, or on a Dask ``client``."""

    def __init__(self, jobs: int = 1, client: Any = None) -> None:
        self.jobs = jobs
        self.client = client
        self._pool: Any = None

    @property
    def workers(self) -> int:
        """How many workers run the parts at once."""
        if self.client is not None:
            return max(1, len(self.client.scheduler_info().get("workers", {})))
        return max(1, self.jobs)

    def run(self, fn: Work, context: Any, parts: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        """``(index of the part, its result)`` of every part, as they finish."""
        if self.client is not None:
            yield from self._run_dask(fn, context, parts)
        elif self.jobs <= 1 or len(parts) <= 1:
            for index, part in enumerate(parts):
                yield index, fn(context, part)
        else:
            yield from self._run_pool(fn, context, parts)

    def map(
        self,
        fn: Work,
        context: Any,
        items: Sequence[Any],
        progress: Callable[[int, int], None] | None = None,
    ) -> list[Any]:
        """``fn(context, chunk)`` over chunks of ``items``, each returning one result per item:
        the results in the order of ``items`` (the same on any engine)."""
        chunk = max(1, min(64, len(items) // (self.workers * 8) or 1))
        parts = chunked(items, chunk)
        results: list[list[Any]] = [[] for _ in parts]
        done = 0
        for index, result in self.run(fn, context, parts):
            results[index] = result
            done += len(parts[index])
            if progress is not None:
                progress(done, len(items))
        return [r for part in results for r in part]

    def _run_pool(self, fn: Work, context: Any, parts: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        import multiprocessing
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.jobs, mp_context=multiprocessing.get_context("fork")
            )
        pending: dict[Any, int] = {}
        queue = iter(enumerate(parts))
        for index, part in itertools.islice(queue, 2 * self.jobs):
            pending[self._pool.submit(fn, context, part)] = index
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                yield pending.pop(future), future.result()
                nxt = next(queue, None)
                if nxt is not None:
                    pending[self._pool.submit(fn, context, nxt[1])] = nxt[0]

    def _run_dask(self, fn: Work, context: Any, parts: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        """A part lost with its worker is run again."""
        distributed = need("distributed", "--engine dask")
        if not parts:
            return
        [shared] = self.client.scatter([context], broadcast=True)
        futures = self.client.map(fn, [shared] * len(parts), parts, retries=3, pure=False)
        index = {future.key: i for i, future in enumerate(futures)}
        for future in distributed.as_completed(futures):
            yield index[future.key], future.result()

    def close(self) -> None:
        """Stop the process pool, if one was started."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def check_engine(engine: str, scheduler: str | None) -> None:
    """Reject a bad ``--engine``/``--scheduler`` pair with one line (exit 2)."""
    if engine not in ("local", "dask"):
        raise UserError(f"--engine {engine!r} is not allowed; allowed: local, dask")
    if engine == "dask":
        need("distributed", "--engine dask")
        if scheduler is None:
            raise UserError("--engine dask needs --scheduler tcp://HOST:PORT or local:N")
    elif scheduler is not None:
        raise UserError("--scheduler needs --engine dask")


@contextlib.contextmanager
def open_engine(
    engine: str = "local", jobs: int = 1, scheduler: str | None = None, plugins: Sequence[str] = ()
) -> Iterator[Engine]:
    """The :class:`Engine` of ``--engine local --jobs N`` or ``--engine dask --scheduler
    ADDRESS`` (whose workers must run this stg with the same ``plugins``)."""
    check_engine(engine, scheduler)
    if engine == "dask":
        assert scheduler is not None
        with dask_client(scheduler) as client:
            check_workers(client, plugins)
            yield Engine(client=client)
        return
    runner = Engine(jobs)
    try:
        yield runner
    finally:
        runner.close()


def run_local(
    context: Context, tasks: Sequence[Any], jobs: int, chunk: int
) -> Iterator[list[dict[str, Any]]]:
    """Rows by chunk from a process pool of ``jobs`` workers (1: in this process)."""
    runner = Engine(jobs)
    try:
        for _, rows in runner.run(evaluate_chunk, context, chunked(tasks, chunk)):
            yield rows
    finally:
        runner.close()


def fingerprint(plugins: Sequence[str] = ()) -> dict[str, Any]:
    """stg's version and the plugins a worker loads (distribution and version of each)."""
    import stg

    registry = _registry(plugins)
    dists = set()
    for name in ("models", "schedules", "kernels", "emitters", "predictors"):
        for entry in registry.catalog(name):
            if entry.dist:
                dists.add((entry.dist, entry.version or ""))
    return {"stg": stg.__version__, "plugins": sorted(dists)}


@contextlib.contextmanager
def dask_client(scheduler: str) -> Iterator[Any]:
    """A Dask client: ``local:N`` starts a LocalCluster of N worker processes
    (``local-threads:N``: N workers in this process), otherwise ``tcp://HOST:PORT``."""
    distributed = need("distributed", "--engine dask")
    match = re.fullmatch(r"local(-threads)?:(\d+)", scheduler)
    if match is not None:
        workers = int(match.group(2))
        if workers < 1:
            raise UserError(f"--scheduler {scheduler}: needs at least one worker")
        cluster = distributed.LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=match.group(1) is None,
            dashboard_address=None,
        )
        try:
            with distributed.Client(cluster) as client:
                yield client
        finally:
            cluster.close()
        return
    if not re.fullmatch(r"(tcp|tls|ucx|inproc)://\S+", scheduler):
        raise UserError(
            f"--scheduler {scheduler!r} is not allowed; allowed: tcp://HOST:PORT, local:N, "
            "local-threads:N"
        )
    try:
        client = distributed.Client(scheduler, timeout="20s")
    except OSError as exc:
        raise UserError(f"--scheduler {scheduler}: cannot connect ({exc})") from None
    try:
        yield client
    finally:
        client.close()


def check_workers(client: Any, plugins: Sequence[str]) -> int:
    """Every worker runs this stg with the same plugins (versions), or one error line."""
    mine = fingerprint(plugins)
    try:
        theirs = client.run(fingerprint, plugins)
    except Exception as exc:
        raise UserError(
            f"the Dask workers cannot run stg ({type(exc).__name__}: {exc}); install "
            "symbolic-tensor-graph and the same plugins on every worker"
        ) from None
    if not theirs:
        raise UserError("the Dask scheduler has no workers; start some (docs/exploration.md)")
    for worker, found in sorted(theirs.items()):
        if found != mine:
            raise UserError(
                f"worker {worker} differs from this machine: it has stg {found['stg']} with "
                f"plugins {found['plugins']}, this machine stg {mine['stg']} with "
                f"{mine['plugins']}; install the same versions on every worker"
            )
    return len(theirs)


def run_dask(
    context: Context, tasks: Sequence[Any], client: Any, chunk: int
) -> Iterator[list[dict[str, Any]]]:
    """Rows by chunk from a Dask cluster; a chunk lost with its worker is run again."""
    for _, rows in Engine(client=client).run(evaluate_chunk, context, chunked(tasks, chunk)):
        yield rows


# -- results ----------------------------------------------------------------------------------


def read_rows(path: Path) -> dict[str, dict[str, Any]]:
    """Finished rows by id; a torn last line (an interrupted write) is ignored."""
    rows: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return rows
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "id" in row:
                rows[row["id"]] = row
    return rows


def columns_of(rows: Sequence[Mapping[str, Any]], first: Sequence[str]) -> list[str]:
    """``first``, then result columns, explain parts, simulator columns: stable order."""
    seen = dict.fromkeys(first)
    seen.update(dict.fromkeys(c for c in RESULT_COLUMNS))
    rest = sorted({k for r in rows for k in r} - set(seen) - {"config", "id"})
    explain = [c for c in rest if c.startswith("explain: ")]
    other = [c for c in rest if not c.startswith("explain: ")]
    return ["config", "id", *seen, *explain, *other]


def write_table(
    out: Path, rows: Sequence[Mapping[str, Any]], first: Sequence[str], parquet: bool
) -> list[Path]:
    """``results.csv`` (and ``results.parquet``) of the rows, written atomically."""
    columns = columns_of(rows, first)
    written = []

    def write_csv(tmp: Path) -> None:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_cell(row.get(c)) for c in columns])
        tmp.write_text(buffer.getvalue(), encoding="utf-8")

    write_replacing(out / CSV_FILE, write_csv)
    written.append(out / CSV_FILE)
    if parquet:
        pa = need("pyarrow", "the Parquet table")
        import pyarrow.parquet as pq

        data = {c: [_parquet_cell(r.get(c)) for r in rows] for c in columns}
        table = pa.table(data)

        def write_parquet(tmp: Path) -> None:
            pq.write_table(table, tmp)

        write_replacing(out / PARQUET_FILE, write_parquet)
        written.append(out / PARQUET_FILE)
    return written


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _parquet_cell(value: Any) -> Any:
    if isinstance(value, list | tuple | dict):
        return json.dumps(value)
    return value


@dataclass
class SweepResult:
    rows: list[dict[str, Any]]
    evaluated: int
    resumed: int
    files: list[Path] = field(default_factory=list)
    workers: int = 0
    seconds: float = 0.0


def _rewrite_in_order(path: Path, finished: Mapping[str, Any], order: Sequence[str]) -> None:
    """The journal rewritten once the sweep is done: the tasks' rows in task order, then any
    other rows it held, so the same sweep leaves the same bytes with any number of jobs."""
    first = [ident for ident in order if ident in finished]
    seen = set(first)
    rest = [ident for ident in finished if ident not in seen]

    def write(tmp: Path) -> None:
        with tmp.open("w", encoding="utf-8") as handle:
            for ident in (*first, *rest):
                handle.write(json.dumps(finished[ident], sort_keys=True) + "\n")

    write_replacing(path, write)


def run_sweep(
    tasks: Sequence[tuple[str, int, Any, str]],
    options_rows: Mapping[str, Mapping[str, Any]],
    context: Context,
    out: Path,
    *,
    engine: str = "local",
    jobs: int = 1,
    scheduler: str | None = None,
    first_columns: Sequence[str] = (),
    parquet: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> SweepResult:
    """Evaluate the tasks not finished in ``out`` yet, appending rows as they finish, then
    write the table of every task's row and the rows' journal (both in task order)."""
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / ROWS_FILE
    finished = read_rows(rows_path)
    wanted = {t[0] for t in tasks}
    todo = [t for t in tasks if t[0] not in finished]
    resumed = len(wanted) - len(todo)
    started = time.perf_counter()
    per_worker = max(1, jobs)
    chunk = max(1, min(64, len(todo) // (per_worker * 8) or 1))
    workers = per_worker
    done = resumed
    if progress is not None:
        progress(done, len(tasks))
    # a torn last line (killed mid-write) must not swallow the next row
    if rows_path.is_file() and rows_path.stat().st_size:
        with rows_path.open("rb") as handle:
            handle.seek(-1, os.SEEK_END)
            torn = handle.read(1) != b"\n"
        if torn:
            with rows_path.open("a", encoding="utf-8") as handle:
                handle.write("\n")
    with rows_path.open("a", encoding="utf-8") as sink:

        def consume(stream: Iterable[list[dict[str, Any]]]) -> None:
            nonlocal done
            for rows in stream:
                for row in rows:
                    sink.write(json.dumps(row, sort_keys=True) + "\n")
                    finished[row["id"]] = row
                sink.flush()
                done += len(rows)
                if progress is not None:
                    progress(done, len(tasks))

        if engine == "local":
            consume(run_local(context, todo, jobs, chunk))
        elif engine == "dask":
            if scheduler is None:
                raise UserError("--engine dask needs --scheduler tcp://HOST:PORT or local:N")
            with dask_client(scheduler) as client:
                workers = check_workers(client, context.plugins)
                chunk = max(1, min(64, len(todo) // (workers * 8) or 1))
                consume(run_dask(context, todo, client, chunk))
        else:
            raise UserError(f"--engine {engine!r} is not allowed; allowed: local, dask")
    _rewrite_in_order(rows_path, finished, [t[0] for t in tasks])
    rows = []
    for ident, index, _options, system in tasks:
        row = dict(options_rows[ident])
        row.update(finished[ident])
        row["config"] = index
        row["system"] = system
        rows.append(row)
    files = write_table(out, rows, first_columns, parquet)
    return SweepResult(rows, len(todo), resumed, files, workers, time.perf_counter() - started)


__all__ = [
    "Context",
    "Simulation",
    "SweepResult",
    "check_workers",
    "evaluate",
    "evaluate_chunk",
    "fingerprint",
    "parse_metrics",
    "read_rows",
    "run_sweep",
    "write_table",
]
