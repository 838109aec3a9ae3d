"""``stg bench``: PARAM-compatible compute and communication benchmarks that calibrate stg.

- ``stg bench compute CONFIG.json``: run a PARAM compute config (PyTorch), write PARAM's
  JSON-lines results with FLOPs, bytes, achieved TFLOP/s and GB/s, median and IQR;
- ``stg bench replay TRACE``: the aten operators of a PyTorch execution trace as a PARAM
  config, run with made-up tensors of the recorded shapes (PARAM's et_replay);
- ``stg bench model [generation options]``: the PARAM config of the unique GEMM, attention
  and memory-bound kernels of a workload;
- ``stg bench calibrate RESULTS.jsonl...``: a calibration table for ``stg predict
  --calibration``;
- ``stg bench comms``: collectives over N local processes (gloo on CPU, NCCL on GPUs), the
  nccl-tests table and a fitted network section for a ``--system`` file.

The library is :mod:`stg.bench`; PyTorch and matplotlib come with the ``bench`` extra.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

from stg.cli import err_console, get_registry
from stg.cli._shared import (
    check_writable_file,
    option_parameters,
    options_from_cli,
    print_table,
    progress_bar,
)
from stg.errors import UserError

app = typer.Typer(
    help="PARAM-compatible benchmarks of this machine, and calibration of the predictors.",
    no_args_is_help=True,
    add_completion=False,
)

OUTPUT_FIELDS = frozenset({"format", "output_dir", "output_name", "chakra_schema_version"})


def _echo_error(line: str) -> None:
    typer.echo(f"error: {line}", err=True)


def _say(line: str) -> None:
    """A closing line on stderr, wrapped to the terminal's width."""
    err_console().print(line, markup=False)


def _check_plot(plot: str | None) -> None:
    """``--plot`` names a PNG and matplotlib is there (nothing written: see _check_targets)."""
    if plot is None:
        return
    if not plot.lower().endswith(".png"):
        raise UserError(f"--plot {plot}: give a .png file name")
    from stg.bench import require

    require("matplotlib", "--plot")


def _check_targets(out: Path, plot: str | None) -> None:
    """The output files can be written: probed last, once every input is known good (a probe
    touches the directory)."""
    check_writable_file("--out", out)
    if plot is not None:
        check_writable_file("--plot", Path(plot))


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


# -- compute ----------------------------------------------------------------------------------


@app.command("compute")
def compute(
    config: str = typer.Argument(
        ..., help="A PARAM compute-benchmark config (JSON).", metavar="CONFIG"
    ),
    device: str = typer.Option("cpu", "--device", "-d", help="cpu, cuda or cuda:N."),
    warmup: int = typer.Option(3, "--warmup", "-w", help="Warm-up iterations per case."),
    iterations: int = typer.Option(
        10, "--iterations", "--iteration", "-i", help="Measured iterations per case."
    ),
    backward: bool = typer.Option(False, "--backward", "-b", help="Time the backward pass too."),
    out: str = typer.Option(
        "bench_compute.jsonl",
        "--out",
        "-o",
        help="Result file (PARAM's JSON lines).",
        metavar="FILE",
    ),
    threads: int = typer.Option(1, "--threads", help="CPU threads (PARAM uses 1)."),
    plot: Optional[str] = typer.Option(  # noqa: UP045 (typer needs a runtime type object)
        None,
        "--plot",
        help="Write a roofline plot (achieved TFLOP/s against arithmetic intensity).",
        metavar="PNG",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result lines as a JSON list."),
    resume_id: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--resume-id",
        "-r",
        help="Skip the cases before this one (<op>|<id>, as PARAM names them; it runs).",
        metavar="OP|ID",
    ),
    stop_id: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--stop-id",
        "--stop_id",
        "-s",
        help="Stop at this case (<op>|<id>; it does not run), as PARAM's --stop_id.",
        metavar="OP|ID",
    ),
    cuda_l2_cache: str = typer.Option(
        "on",
        "--cuda-l2-cache",
        help="on: keep the GPU's L2 cache between calls; off: flush it before each call by "
        "writing a buffer the size of the L2 (PARAM's option; CUDA devices only).",
    ),
    profile: bool = typer.Option(
        False,
        "--profile",
        "-p",
        help="Write a torch.profiler Chrome trace of each case beside --out "
        "(<out>_trace_<n>.json) and PARAM's trace_file lines.",
    ),
    nvtx: bool = typer.Option(
        False, "--nvtx", help="Mark each call with PARAM's NVTX ranges (for ncu and nsys)."
    ),
    ncu: bool = typer.Option(
        False, "--ncu", help="Profile the cases again in batches under NSight Compute (PARAM)."
    ),
    ncu_bin: Optional[str] = typer.Option(None, "--ncu-bin", help="ncu (default: on PATH)."),  # noqa: UP045
    ncu_args_file: Optional[str] = typer.Option(  # noqa: UP045
        None, "--ncu-args-file", help="A file of extra ncu options (metrics...).", metavar="FILE"
    ),
    ncu_warmup: Optional[int] = typer.Option(None, "--ncu-warmup", help="Default 5."),  # noqa: UP045
    ncu_iteration: Optional[int] = typer.Option(None, "--ncu-iteration", help="Default 1."),  # noqa: UP045
    nsys: bool = typer.Option(
        False, "--nsys", help="Profile the cases again in batches under NSight Systems (PARAM)."
    ),
    nsys_bin: Optional[str] = typer.Option(None, "--nsys-bin", help="nsys (default: on PATH)."),  # noqa: UP045
    nsys_args_file: Optional[str] = typer.Option(  # noqa: UP045
        None, "--nsys-args-file", help="A file of extra nsys options.", metavar="FILE"
    ),
    nsys_warmup: Optional[int] = typer.Option(None, "--nsys-warmup", help="Default 5."),  # noqa: UP045
    nsys_iteration: Optional[int] = typer.Option(None, "--nsys-iteration", help="Default 10."),  # noqa: UP045
    run_batch_size: int = typer.Option(
        50, "--run-batch-size", help="Cases per ncu/nsys launch (PARAM's default 50)."
    ),
    batch_cuda_device: int = typer.Option(
        1,
        "--batch-cuda-device",
        help="CUDA_VISIBLE_DEVICES of the ncu/nsys launches (PARAM's default 1).",
    ),
) -> None:
    """Run a PARAM compute config and write PARAM's results, with FLOPs, bytes and rates."""
    from stg.bench.config import expand, load_config
    from stg.bench.nsight import BatchRun, nsight_tool, run_batches
    from stg.bench.results import ResultWriter
    from stg.bench.runner import Runner, RunOptions, op_table, run_cases, select_cases

    if cuda_l2_cache not in ("on", "off"):
        raise UserError(f"--cuda-l2-cache {cuda_l2_cache}: allowed: on, off")
    options = RunOptions(
        device,
        warmup,
        iterations,
        backward,
        threads,
        cuda_l2_cache=cuda_l2_cache == "on",
        nvtx=nvtx,
    )
    tools = []
    if ncu and not device.startswith("cuda"):
        raise UserError(
            f"--ncu profiles CUDA kernels (NSight Compute); it does not apply to --device {device}"
        )
    if ncu:
        tools.append(nsight_tool("ncu", ncu_bin, ncu_args_file, ncu_warmup, ncu_iteration))
    if nsys:
        tools.append(nsight_tool("nsys", nsys_bin, nsys_args_file, nsys_warmup, nsys_iteration))
    if run_batch_size < 1:
        raise UserError(f"--run-batch-size {run_batch_size}: must be >= 1")
    expansion = expand(load_config(config))
    if not expansion.cases:
        why = (
            f": every entry ({', '.join(expansion.skipped)}) lacks an input_data_generator, "
            "which PARAM needs to run an operator"
            if expansion.skipped
            else ""
        )
        raise UserError(f"config {config!r} has no operator to run{why}")
    chosen = select_cases(expansion.cases, resume_id, stop_id)
    target = Path(out)
    _check_plot(plot)
    ops = op_table(get_registry().bench_ops)
    runner = Runner(options, ops)
    _check_targets(target, plot)
    for warning in expansion.warnings:
        typer.echo(f"warning: {warning}", err=True)
    console = err_console()
    total = len(chosen)

    def report(record: dict[str, Any]) -> None:
        if "error" in record:
            _echo_error(f"{record['op_name']}|{record['id']}: {record['error']}")
        elif console.is_terminal:
            console.print(f"{record['op_name']}|{record['id']}", style="dim")

    writer = ResultWriter(target)
    produced: list[Path] = []  # traces and profiler files: removed if the run fails
    try:
        records = run_cases(
            runner,
            chosen,
            writer,
            argv=sys.argv,
            on_result=report,
            traces=produced if profile else None,
        )
        measured = [c for c, r in zip(chosen, records, strict=True) if "error" not in r]
        batch_run = BatchRun(config, device, backward, threads, batch_cuda_device)
        for tool in tools:
            lines = run_batches(
                batch_run, tool, measured, expansion.cases, run_batch_size, target, produced
            )
            for line in lines:
                writer.write(line)
    except BaseException:
        writer.abort()
        for path in produced:
            path.unlink(missing_ok=True)
        raise

    def draw() -> None:
        from stg.bench.plot import roofline_plot

        roofline_plot(records, str(plot), title=f"{config} on {device}")

    writer.commit(then=None if plot is None else draw)  # both files, or neither
    failed = sum(1 for r in records if "error" in r)
    if as_json:
        typer.echo(json.dumps(records, indent=2))
    else:
        _print_compute(records)
    _say(
        f"{total - failed} of {total} cases measured, {failed} failed; results in {out}"
        + (f", plot in {plot}" if plot else "")
        + (f", {len(produced)} trace and profiler files beside it" if produced else "")
    )
    if failed:
        raise typer.Exit(1)


def _print_compute(records: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="stg bench compute (times in ms)", title_justify="left")
    for name in (
        "op",
        "id",
        "dtype",
        "fwd median",
        "IQR",
        "TFLOP/s",
        "GB/s",
        "bwd median",
        "bwd TFLOP/s",
    ):
        table.add_column(name, justify="left" if name in ("op", "id", "dtype") else "right")
    for r in records:
        if "error" in r:
            continue
        e = r.get("extra") or {}
        table.add_row(
            r["op_name"],
            r["id"],
            str(e.get("dtype")),
            _fmt(e.get("median_ms")),
            _fmt(e.get("iqr_ms"), 2),
            _fmt(e.get("tflops")),
            _fmt(e.get("gbps")),
            _fmt(e.get("median_bwd_ms")),
            _fmt(e.get("tflops_bwd")),
        )
    print_table(Console(highlight=False), table)


# -- replay -------------------------------------------------------------------------------------


@app.command("replay")
def replay(
    trace: str = typer.Argument(
        ...,
        help="A PyTorch host execution trace (ExecutionTraceObserver JSON).",
        metavar="TRACE",
    ),
    config_out: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--config",
        "-c",
        help="Write the PARAM compute config of the trace's distinct operators here.",
        metavar="FILE",
    ),
    out: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--out",
        "-o",
        help="Run the operators and write PARAM's result lines here (for stg bench calibrate).",
        metavar="FILE",
    ),
    device: str = typer.Option("cpu", "--device", "-d", help="cpu, cuda or cuda:N."),
    warmup: int = typer.Option(3, "--warmup", "-w", help="Warm-up calls per operator."),
    iterations: int = typer.Option(
        10, "--iterations", "--iteration", "-i", help="Measured calls per operator."
    ),
    threads: int = typer.Option(1, "--threads", help="CPU threads (PARAM uses 1)."),
) -> None:
    """Replay a PyTorch execution trace's operators, as PARAM's et_replay: made-up tensors of
    the recorded shapes and dtypes, each distinct operator measured once."""
    from stg.bench.config import expand
    from stg.bench.et_replay import replay_config, skipped_summary
    from stg.bench.results import ResultWriter
    from stg.bench.runner import Runner, RunOptions, op_table, run_cases

    if config_out is None and out is None:
        raise UserError("give --config FILE (the PARAM config), --out FILE (run it), or both")
    options = RunOptions(device, warmup, iterations, False, threads)
    made = replay_config(trace)
    if not made.config:
        raise UserError(f"{trace} has no operator that moves data to replay")
    for line in skipped_summary(made.skipped):
        typer.echo(f"warning: skipped {line}", err=True)
    runner = None
    if out is not None:
        runner = Runner(options, op_table(get_registry().bench_ops))
        check_writable_file("--out", Path(out))
    if config_out is not None:
        check_writable_file("--config", Path(config_out))
    records: list[dict[str, Any]] = []

    def run() -> None:
        if runner is None or out is None:
            return
        writer = ResultWriter(Path(out))
        try:
            records.extend(run_cases(runner, expand(made.config).cases, writer, argv=sys.argv))
        except BaseException:
            writer.abort()
            raise
        writer.commit()

    if config_out is not None:
        _write_json(Path(config_out), made.config, then=run)  # both files, or neither
    else:
        run()
    failed = [f"{r['op_name']}|{r['id']}: {r['error']}" for r in records if "error" in r]
    for line in failed:
        _echo_error(line)
    if records:
        _print_compute(records)
    written = [f"config in {config_out}"] if config_out else []
    if out is not None:
        written.append(f"{len(records) - len(failed)} measured, {len(failed)} failed, in {out}")
    _say(
        f"{made.operators} operators of {trace}, {made.cases} distinct"
        + (f" ({sum(made.skipped.values())} skipped)" if made.skipped else "")
        + "; "
        + "; ".join(written)
    )
    if failed:
        raise typer.Exit(1)


# -- model --------------------------------------------------------------------------------------


def _generation_parameters() -> list[inspect.Parameter]:
    return [p for p in option_parameters() if p.name not in OUTPUT_FIELDS]


def _model_parameters() -> list[inspect.Parameter]:
    kw = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter(
            "out",
            kw,
            default=typer.Option(
                "bench_model.json",
                "--out",
                "-o",
                help="The PARAM config to write.",
                metavar="FILE",
            ),
            annotation=str,
        ),
        inspect.Parameter(
            "as_json",
            kw,
            default=typer.Option(False, "--json", help="Print the kernels as JSON."),
            annotation=bool,
        ),
    ]


def model(**values: Any) -> None:
    """Write the PARAM config of a workload's unique GEMM, attention and memory-bound kernels."""
    from stg.bench.model import model_config
    from stg.core import pipeline as gen

    out = values.pop("out")
    as_json = values.pop("as_json")
    target = Path(out)
    registry = get_registry()
    options = options_from_cli(values)
    gen.validate_options(options, registry)
    with progress_bar(err_console()) as progress:
        workload = gen.build_workload(options, registry, progress=progress)
    check_writable_file("--out", target)
    made = model_config(workload, dict(workload.metadata.get("options") or {}))
    _write_json(target, made.config)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "config": out,
                    "cases": made.cases,
                    "rank_classes": made.rank_classes,
                    "skipped": made.skipped,
                },
                indent=2,
            )
        )
    else:
        _print_model(made)
    skipped = "".join(f"; left out {n} {why} nodes" for why, n in sorted(made.skipped.items()))
    _say(
        f"{len(made.cases)} kernels written to {out}{skipped}; measure them with: "
        f"stg bench compute {out} -b"
    )


def _print_model(made: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="unique kernels per rank class", title_justify="left")
    for name in (
        "rank class",
        "stage",
        "compute nodes",
        "gemm",
        "attention",
        "stream",
        "norm",
        "softmax",
    ):
        table.add_column(name, justify="right")
    for row in made.rank_classes:
        table.add_row(
            *(
                str(row[k])
                for k in (
                    "rank_class",
                    "stage",
                    "nodes",
                    "gemm",
                    "attention",
                    "stream",
                    "norm",
                    "softmax",
                )
            )
        )
    print_table(Console(highlight=False), table)


def _write_json(target: Path, data: Any, then: Callable[[], object] | None = None) -> None:
    from stg.bench.results import write_json_atomic

    write_json_atomic(target, data, then)


model.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    _model_parameters() + _generation_parameters(), return_annotation=None
)
model.__annotations__ = {
    p.name: p.annotation for p in _model_parameters() + _generation_parameters()
} | {"return": None}
app.command("model")(model)


# -- calibrate ----------------------------------------------------------------------------------


@app.command("calibrate")
def calibrate(
    results: list[str] = typer.Argument(  # noqa: B008 (typer's declaration style)
        ...,
        help="Result files (PARAM's JSON lines: stg bench compute's or PARAM's own).",
        metavar="RESULTS...",
    ),
    out: str = typer.Option(
        "calibration.json", "--out", "-o", help="The calibration table to write.", metavar="FILE"
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the table's models as JSON."),
) -> None:
    """Turn benchmark results into a calibration table for stg predict --calibration."""
    from stg.bench.calibrate import calibrate as make_table
    from stg.bench.results import read_results
    from stg.bench.runner import op_table
    from stg.perf.calibration import write_calibration

    target = Path(out)
    files = [read_results(path) for path in results]
    table, report = make_table(files, op_table(get_registry().bench_ops))
    for warning in report.warnings:
        typer.echo(f"warning: {warning}", err=True)
    if not table.entries:
        reasons = ", ".join(f"{n} {why}" for why, n in report.skipped.most_common()) or "none"
        raise UserError(
            f"no case of {', '.join(results)} calibrates a GEMM, attention or memory-bound "
            f"kernel (skipped: {reasons})"
        )
    table.path = out
    check_writable_file("--out", target)
    write_calibration(table, target)
    if as_json:
        typer.echo(json.dumps(table.as_dict()["models"], indent=2))
    else:
        _print_calibration(table)
    skipped = ", ".join(f"{n} {why}" for why, n in report.skipped.most_common())
    _say(
        f"{len(table.entries)} kernels and {len(table.models)} fitted models of "
        f"{table.device} written to {out} (from {report.used} of {report.cases} cases"
        + (f"; skipped: {skipped}" if skipped else "")
        + ")"
    )


def _print_calibration(table: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    counts: dict[tuple[str, str, str], int] = {}
    for k in table.entries:
        counts[k[:3]] = counts.get(k[:3], 0) + 1
    view = Table(title=f"calibration: {table.device}", title_justify="left")
    for name in (
        "class",
        "dtype",
        "pass",
        "kernels",
        "latency µs",
        "TFLOP/s",
        "GB/s",
        "fit error",
        "range",
    ):
        view.add_column(name, justify="left" if name in ("class", "dtype", "pass") else "right")
    for key in sorted(set(counts) | set(table.models)):
        fitted = table.models.get(key)
        row = [*key, str(counts.get(key, 0))]
        if fitted is None:
            row += ["-", "-", "-", "-", "too few for a fit"]
        else:
            d = fitted.as_dict()
            low, high = d[f"{fitted.variable}_range"]
            row += [
                _fmt(d["latency_us"], 3),
                _fmt(d["tflops"], 4),
                _fmt(d["gbps"], 4),
                f"{d['median_rel_error'] * 100:.0f}%",
                f"{low:.3g}-{high:.3g} {'B' if fitted.variable == 'bytes' else 'FLOP'}",
            ]
        view.add_row(*row)
    print_table(Console(highlight=False), view)


# -- comms --------------------------------------------------------------------------------------


@app.command("comms")
def comms(
    nprocs: int = typer.Option(2, "--nprocs", "-n", help="Local processes (ranks)."),
    device: str = typer.Option("cpu", "--device", "-d", help="cpu (gloo) or cuda (NCCL)."),
    backend: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--backend",
        help="gloo or nccl (default: gloo on cpu, nccl on cuda).",
    ),
    collectives: str = typer.Option(
        ",".join(("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")),
        "--collectives",
        "-c",
        help="Comma-separated: all_reduce, all_gather, reduce_scatter, all_to_all, send_recv.",
    ),
    begin_size: str = typer.Option("1KiB", "--begin-size", "-b", help="Smallest message."),
    end_size: str = typer.Option("1MiB", "--end-size", "-e", help="Largest message."),
    factor: float = typer.Option(4.0, "--factor", "-f", help="Size multiplier per step."),
    warmup: int = typer.Option(5, "--warmup", "-w", help="Warm-up calls per size."),
    iterations: int = typer.Option(20, "--iterations", "-i", help="Measured calls per size."),
    dtype: str = typer.Option("float", "--dtype", help="float, bfloat16, float16 or double."),
    timeout: float = typer.Option(300.0, "--timeout", help="Give up after this many seconds."),
    out: str = typer.Option(
        "bench_comms.json", "--out", "-o", help="Network section and fits (JSON).", metavar="FILE"
    ),
    system: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--system",
        "-s",
        help="Write a whole system file instead: this preset ({allowed:systems}) or file with "
        "its first network dimension's bandwidth and latency measured.",
        metavar="NAME|FILE",
    ),
    plot: Optional[str] = typer.Option(  # noqa: UP045
        None, "--plot", help="Write busBW against message size.", metavar="PNG"
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Time collectives over local processes; print size/time/algBW/busBW, fit the network."""
    from stg.bench.comms import CommsOptions, run_comms, size_sweep
    from stg.core.quantities import parse_size

    sizes = size_sweep(
        parse_size(begin_size, "--begin-size", whole=True),
        parse_size(end_size, "--end-size", whole=True),
        factor,
    )
    chosen = tuple(c.strip() for c in collectives.split(",") if c.strip())
    options = CommsOptions(
        nprocs=nprocs,
        backend=backend or ("nccl" if device == "cuda" else "gloo"),
        device=device,
        collectives=chosen,
        sizes=tuple(sizes),
        warmup=warmup,
        iterations=iterations,
        dtype=dtype,
        timeout=timeout,
    )
    base = None
    if system is not None:
        from stg.perf.system import load_system

        base = load_system(system)
    target = Path(out)
    _check_plot(plot)
    _check_targets(target, plot)
    result = run_comms(options)
    data = result.as_dict()
    if base is not None:
        if result.network is None:
            raise UserError("the sizes were too small to fit a bandwidth; raise --end-size")
        whole = base.as_dict()
        first = dict(whole["network"][0])
        # a measured alpha-beta link replaces NCCL's protocol model of the preset's link
        for key in ("link", "sharp_efficiency"):
            first.pop(key, None)
        first.update(
            bandwidth_gbps=result.network["bandwidth_gbps"],
            latency_us=result.network["latency_us"],
            efficiency=1.0,
        )
        # the measured curves themselves replace the fit for their collective and group size
        from stg.perf.calibration import comms_calibration

        first["measured"] = [c.as_dict() for c in comms_calibration(data, out).comms]
        whole["network"] = [first, *whole["network"][1:]]
        whole["description"] = (
            f"{whole.get('description', '')} (first network dimension measured by stg bench "
            f"comms: {options.nprocs} {options.backend} processes on {result.device_name})"
        ).strip()
        data = whole

    def draw() -> None:
        from stg.bench.plot import busbw_plot

        title = f"{options.backend}, {options.nprocs} processes"
        busbw_plot(result.rows, str(plot), title=title)

    _write_json(target, data, then=None if plot is None else draw)  # both files, or neither
    if as_json:
        typer.echo(json.dumps(result.as_dict(), indent=2))
    else:
        _print_comms(result)
    what = "system file" if base is not None else "network section"
    _say(f"{what} written to {out}" + (f", plot in {plot}" if plot else ""))


def _print_comms(result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    o = result.options
    table = Table(
        title=f"stg bench comms: {o.nprocs} {o.backend} processes on {result.device_name}, "
        f"{o.dtype}",
        title_justify="left",
    )
    for name in (
        "collective",
        "size (B)",
        "count",
        "time (us)",
        "max (us)",
        "algBW (GB/s)",
        "busBW (GB/s)",
    ):
        table.add_column(name, justify="left" if name == "collective" else "right")
    for r in result.rows:
        table.add_row(
            r.collective,
            str(r.size),
            str(r.count),
            f"{r.time * 1e6:.2f}",
            f"{r.time_max * 1e6:.2f}",
            f"{r.algbw / 1e9:.3f}",
            f"{r.busbw / 1e9:.3f}",
        )
    console = Console(highlight=False)
    print_table(console, table)
    fits = Table(title="fitted: time = steps·latency + factor·size/bandwidth", title_justify="left")
    for name in ("collective", "latency (us)", "bandwidth (GB/s)"):
        fits.add_column(name, justify="left" if name == "collective" else "right")
    for name, fit in result.fits.items():
        bandwidth = fit["bandwidth_gbps"]
        fits.add_row(
            name, f"{fit['latency_us']:.2f}", "-" if bandwidth is None else f"{bandwidth:.3f}"
        )
    print_table(console, fits)
