"""Collective benchmarks over N local processes, as PARAM's comms benchmark and nccl-tests.

``N`` processes are spawned on this machine and joined with ``torch.distributed`` through a
TCP store on 127.0.0.1 (gloo on CPU, its sockets bound to the loopback interface; NCCL with
one GPU per process). For each collective and message size every rank runs ``warmup`` then
``iterations`` calls, each after a barrier (PARAM's blocking mode) and timed on its own
(``perf_counter``, with a device synchronisation around the call on a GPU). A rank's time is
the median of its calls; the table's time is the median over ranks (PARAM reports p50 across
ranks), with the slowest rank beside it.

Sizes and bandwidths follow nccl-tests (doc/PERFORMANCE.md): the size is the whole buffer of
all-reduce, the gathered output of all-gather, the input of reduce-scatter, the per-rank
buffer of all-to-all and the message of send/recv (each rank sends to the next and receives
from the previous); ``algBW = size / time`` and ``busBW = algBW · factor``, factor
``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather, reduce-scatter and all-to-all, 1 for
send/recv.

The fit: stg's time predictor prices a collective over ``n`` ranks of one network dimension
as ``steps·latency + factor·size/bandwidth`` (steps ``2(n-1)`` for all-reduce, ``n-1`` for
all-gather and reduce-scatter, 1 for all-to-all and a send), so busBW tends to the dimension's
bandwidth. Latency and bandwidth are fitted per collective and jointly over all of them
(least squares on relative error): the joint fit is the ``network`` dimension written for a
``--system`` file.
"""

from __future__ import annotations

import datetime as _dt
import os
import queue as _queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from stg.bench import require
from stg.errors import UserError
from stg.perf.calibration import COMMS_FORMAT, fit_relative

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
BACKENDS = ("gloo", "nccl")
DTYPES = {"float": 4, "bfloat16": 2, "float16": 2, "double": 8}
"""Element dtypes (PARAM's names) and their widths in bytes."""


def bus_factor(collective: str, n: int) -> float:
    """busBW / algBW of nccl-tests (doc/PERFORMANCE.md)."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def latency_steps(collective: str, n: int) -> int:
    """Latency terms of one collective on a plain alpha-beta link in stg's communication model
    (:mod:`stg.perf.comm_time`): ``2(n-1)`` ring steps for all-reduce, ``n-1`` for all-gather
    and reduce-scatter, one for all-to-all (concurrent sends to every peer) and a send."""
    if collective == "all_reduce":
        return 2 * (n - 1)
    if collective in ("all_gather", "reduce_scatter"):
        return n - 1
    return 1


def size_sweep(begin: int, end: int, factor: float) -> list[int]:
    """``begin``, ``begin·factor``, ... up to ``end`` (nccl-tests' ``-b -e -f``)."""
    if end < begin:
        raise UserError(f"--end-size {end} is smaller than --begin-size {begin}")
    if factor <= 1:
        raise UserError(f"--factor {factor} must be > 1")
    sizes = []
    size = float(begin)
    while size <= end * (1 + 1e-9):
        sizes.append(round(size))
        size *= factor
    return sorted(set(sizes))


@dataclass(frozen=True)
class CommsOptions:
    """What to measure: processes, backend, device, collectives, sizes, iterations.

    Defaults: 5 warm-up and 20 measured calls per size, nccl-tests' (src/common.cu
    ``warmup_iters``, ``iters``); sizes 1 KiB to 1 MiB, small enough that gloo on a CPU
    sweeps all five collectives in seconds; ``timeout`` bounds the whole run (a limit, not a
    measurement)."""

    nprocs: int = 2
    backend: str = "gloo"
    device: str = "cpu"
    collectives: tuple[str, ...] = COLLECTIVES
    sizes: tuple[int, ...] = (1024, 16384, 262144, 1048576)
    warmup: int = 5
    iterations: int = 20
    dtype: str = "float"
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.nprocs < 2:
            raise UserError(f"--nprocs {self.nprocs}: collectives need at least 2 processes")
        if self.backend not in BACKENDS:
            raise UserError(f"--backend {self.backend!r}; allowed: {', '.join(BACKENDS)}")
        if self.device not in ("cpu", "cuda"):
            raise UserError(f"--device {self.device!r}; allowed: cpu, cuda")
        if self.backend == "nccl" and self.device != "cuda":
            raise UserError("--backend nccl needs --device cuda")
        bad = [c for c in self.collectives if c not in COLLECTIVES]
        if bad or not self.collectives:
            raise UserError(
                f"--collectives: {bad[0] if bad else 'none given'!r} is not known; "
                f"allowed: {', '.join(COLLECTIVES)}"
            )
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype {self.dtype!r}; allowed: {', '.join(DTYPES)}")
        if self.iterations < 1 or self.warmup < 0:
            raise UserError("--iterations must be >= 1 and --warmup >= 0")
        if not self.timeout > 0:
            raise UserError("--timeout must be > 0 seconds")


@dataclass
class Row:
    """One (collective, size) of the table; times in seconds, bandwidths in bytes/s."""

    collective: str
    size: int
    count: int
    time: float
    time_max: float
    time_min: float
    algbw: float
    busbw: float


@dataclass
class CommsResult:
    rows: list[Row]
    options: CommsOptions
    fits: dict[str, dict[str, float | None]] = field(default_factory=dict)
    network: dict[str, Any] | None = None
    device_name: str = "cpu"

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": COMMS_FORMAT,
            "network": [self.network] if self.network else [],
            "fits": self.fits,
            "device": self.device_name,
            "options": {**asdict(self.options), "collectives": list(self.options.collectives)},
            "rows": [asdict(r) for r in self.rows],
        }


# -- the worker -------------------------------------------------------------------------------


def _buffers(torch: Any, collective: str, size: int, n: int, width: int, dtype: Any, device: Any):
    """(element count of the row, the call) for one collective and size (nccl-tests' sizes)."""
    dist = torch.distributed
    if collective == "all_reduce":
        count = max(1, size // width)
        x = torch.ones(count, dtype=dtype, device=device)
        return count, lambda: dist.all_reduce(x)
    if collective == "all_gather":
        per_rank = max(1, size // (width * n))
        x = torch.ones(per_rank, dtype=dtype, device=device)
        out = torch.empty(per_rank * n, dtype=dtype, device=device)
        return per_rank * n, lambda: dist.all_gather_into_tensor(out, x)
    if collective == "reduce_scatter":
        per_rank = max(1, size // (width * n))
        x = torch.ones(per_rank * n, dtype=dtype, device=device)
        out = torch.empty(per_rank, dtype=dtype, device=device)
        return per_rank * n, lambda: dist.reduce_scatter_tensor(out, x)
    if collective == "all_to_all":
        per_peer = max(1, size // (width * n))
        x = torch.ones(per_peer * n, dtype=dtype, device=device)
        out = torch.empty(per_peer * n, dtype=dtype, device=device)
        return per_peer * n, lambda: dist.all_to_all_single(out, x)
    count = max(1, size // width)
    x = torch.ones(count, dtype=dtype, device=device)
    out = torch.empty(count, dtype=dtype, device=device)
    rank = dist.get_rank()

    def send_recv() -> None:
        requests = [dist.isend(x, (rank + 1) % n), dist.irecv(out, (rank - 1) % n)]
        for request in requests:
            request.wait()

    return count, send_recv


def _worker(rank: int, port: int, options: CommsOptions, results: Any) -> None:
    """One process of the benchmark; rank 0 puts the rows (or any rank its error) in
    ``results``."""
    try:
        import warnings

        warnings.filterwarnings("ignore")
        if options.backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch
        import torch.distributed as dist

        n = options.nprocs
        device = torch.device("cpu")
        if options.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = torch.device("cuda", rank % torch.cuda.device_count())
        dist.init_process_group(
            options.backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=n,
            timeout=_dt.timedelta(seconds=options.timeout),
        )
        dtype = getattr(
            torch, {"float": "float32", "double": "float64"}.get(options.dtype, options.dtype)
        )
        width = DTYPES[options.dtype]
        sync: Callable[[], None] = (
            (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        )
        rows = []
        for collective in options.collectives:
            for size in options.sizes:
                count, call = _buffers(torch, collective, size, n, width, dtype, device)
                for _ in range(options.warmup):
                    dist.barrier()
                    call()
                sync()
                times = []
                for _ in range(options.iterations):
                    dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    call()
                    sync()
                    times.append(time.perf_counter() - t0)
                times.sort()
                mid = len(times) // 2
                mine = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
                gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(n)]
                mine_t = torch.tensor([mine], dtype=torch.float64)
                if device.type == "cuda":
                    gathered = [g.to(device) for g in gathered]
                    mine_t = mine_t.to(device)
                dist.all_gather(gathered, mine_t)
                per_rank = sorted(float(g.item()) for g in gathered)
                m = len(per_rank) // 2
                p50 = per_rank[m] if n % 2 else (per_rank[m - 1] + per_rank[m]) / 2
                nbytes = count * width
                algbw = nbytes / p50 if p50 > 0 else 0.0
                rows.append(
                    Row(
                        collective,
                        nbytes,
                        count,
                        p50,
                        per_rank[-1],
                        per_rank[0],
                        algbw,
                        algbw * bus_factor(collective, n),
                    )
                )
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            results.put(("rows", rows, name))
        else:
            results.put(("done", rank, None))
    except BaseException as exc:  # reported to the parent as one line
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        message = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        results.put(("error", rank, message + "\n" + traceback.format_exc(limit=3)))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_comms(options: CommsOptions) -> CommsResult:
    """Spawn the processes, gather the table, fit latency and bandwidth."""
    torch = require("torch", "stg bench comms")
    if not torch.distributed.is_available():
        raise UserError("this PyTorch has no torch.distributed")
    if options.backend == "gloo" and not torch.distributed.is_gloo_available():
        raise UserError("this PyTorch has no gloo backend")
    if options.backend == "nccl":
        if not torch.cuda.is_available():
            raise UserError("--backend nccl: no CUDA device is available")
        if not torch.distributed.is_nccl_available():
            raise UserError("this PyTorch has no NCCL backend")
        if options.nprocs > torch.cuda.device_count():
            raise UserError(
                f"--nprocs {options.nprocs}: NCCL needs one GPU per process; "
                f"{torch.cuda.device_count()} visible"
            )
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    procs = [
        context.Process(target=_worker, args=(rank, port, options, results), daemon=True)
        for rank in range(options.nprocs)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + options.timeout
    rows: list[Row] | None = None
    name = options.device
    done = 0
    try:
        while done < options.nprocs:
            left = deadline - time.monotonic()
            if left <= 0:
                raise UserError(
                    f"stg bench comms timed out after {options.timeout:g} s (--timeout)"
                )
            try:
                kind, payload, extra = results.get(timeout=min(left, 1.0))
            except _queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise UserError(
                        f"a benchmark process exited with code {dead[0].exitcode}"
                    ) from None
                continue
            if kind == "error":
                raise UserError(f"rank {payload}: {str(extra).splitlines()[0]}")
            if kind == "rows":
                rows, name = payload, str(extra)
            done += 1
    finally:
        for proc in procs:
            proc.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
    assert rows is not None
    result = CommsResult(rows, options, device_name=name)
    fit_network(result)
    return result


def fit_network(result: CommsResult) -> None:
    """Latency and bandwidth per collective and jointly (see the module docstring)."""
    n = result.options.nprocs
    joint_rows: list[list[float]] = []
    joint_times: list[float] = []
    for collective in result.options.collectives:
        rows = [r for r in result.rows if r.collective == collective and r.time > 0]
        if not rows:
            continue
        steps = latency_steps(collective, n)
        factor = bus_factor(collective, n)
        features = [[float(steps), factor * r.size] for r in rows]
        times = [r.time for r in rows]
        joint_rows += features
        joint_times += times
        if len(rows) >= 2:
            coef = fit_relative(features, times)
            if coef is not None:
                result.fits[collective] = _fit_entry(coef)
    if len(joint_rows) >= 2:
        coef = fit_relative(joint_rows, joint_times)
        if coef is not None:
            fit = _fit_entry(coef)
            result.fits["joint"] = fit
            if fit["bandwidth_gbps"] is None:  # sizes too small to show a bandwidth
                return
            result.network = {
                "name": f"local-{result.options.backend}",
                "size": n,
                "bandwidth_gbps": fit["bandwidth_gbps"],
                "latency_us": fit["latency_us"],
                "efficiency": 1.0,
            }


def _fit_entry(coef: Sequence[float]) -> dict[str, float | None]:
    """Latency (µs) and bandwidth (GB/s; None when the fit found no size-dependent term)."""
    latency, per_byte = coef
    return {
        "latency_us": latency * 1e6,
        "bandwidth_gbps": 1 / per_byte / 1e9 if per_byte > 0 else None,
    }


__all__ = [
    "BACKENDS",
    "COLLECTIVES",
    "CommsOptions",
    "CommsResult",
    "Row",
    "bus_factor",
    "fit_network",
    "latency_steps",
    "run_comms",
    "size_sweep",
]
