"""The ``time`` predictor: roofline compute and alpha-beta collectives replayed over the DAG.

Cost of one node on a :class:`stg.perf.system.System`:

- COMP (and MEM_LOAD/STORE): ``max(num_ops / (peak(dtype)·eff(op class)),
  tensor_size / (hbm·memory_efficiency)) + kernel_overhead``; a node with neither FLOPs nor
  bytes but a recorded ``runtime`` (a trace of a real run) takes that runtime. Registered
  kernels (:mod:`stg.perf.kernels`) divide the FLOP term by their ``speedup``, price casts
  (nodes whose op, :func:`stg.api.kernel_name`, is a ``.cast_``) as
  ``cast_alpha·elements + cast_beta``, and decide whether an fp8/int8 op runs natively or,
  without a kernel, in the workload's dtype.
- Collectives over a group of n ranks, per network dimension i that the group spans with n_i
  ranks (bandwidth B_i = per-GPU bandwidth·efficiency, latency alpha_i), applied hierarchically:
  reduce-scatter and all-gather ``(n_i-1)/n_i · S_i/B_i + (n_i-1)·alpha_i`` with S_0 the full
  buffer and S_{i+1} = S_i/n_i (reduce-scatter inner to outer, all-gather outer to inner);
  all-reduce twice that (``2(n-1)/n·S/B + 2(n-1)alpha`` on one dimension); all-to-all
  ``(n_i-1)/n_i · S/B_i + (n_i-1)·alpha_i`` per dimension. Which dimensions a group spans follows
  from its member ranks: rank r sits at ``r % size_0`` of the first dimension, and so on.
- Send: ``S/B + alpha`` on the outermost dimension where the two ranks differ.

The replay (streams, bandwidth sharing, overlap options, units of identical ranks) is the
engine :mod:`stg.perf.replay` (``stg.api.replay_engine``); this plugin builds its problem from
a workload or trace files, runs it and writes the report (iteration time, per-rank breakdown,
MFU, critical path, timeline, per device group on hybrid systems).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import stg
from stg.api import (
    EAGER_OP_HOST_S,
    Calibration,
    GenerateOptions,
    KernelTable,
    Predictor,
    Problem,
    Replay,
    System,
    Workload,
    attention_impl,
    build_workload,
    check_capacity,
    check_size,
    collective_phases,
    collective_time,
    compute_time,
    default_cast_model,
    estimate_size,
    first_keep,
    group_shape,
    is_cast,
    is_hybrid,
    kernel_name,
    kernel_table,
    load_system,
    name_in_micro_batch,
    problem_from_nodes,
    problem_from_trace,
    problem_from_workload,
    replay,
    replay_periodic,
    send_time,
    state_keep,
    tree_all_reduce_time,
)
from stg.api import replay_engine as engine
from stg.api import unit_flops as engine_unit_flops
from stg.errors import TraceError, UserError, write_replacing
from stg.predictors import _workload_cache as workload_cache

COMPUTE, COLL, SEND, RECV = engine.COMPUTE, engine.COLL, engine.SEND, engine.RECV

# the replay's models and analyses moved to the engine; their names stay importable from here
NCCL_CHANNELS = engine.NCCL_CHANNELS
HBM_BYTES_PER_WIRE_BYTE = engine.HBM_BYTES_PER_WIRE_BYTE
TP_OVERLAP_PIPELINE_SPLITS = engine.TP_OVERLAP_PIPELINE_SPLITS
USERBUFFERS_SMS = engine.USERBUFFERS_SMS
USERBUFFERS_HBM_BYTES_PER_WIRE_BYTE = engine.USERBUFFERS_HBM_BYTES_PER_WIRE_BYTE
Unit = engine.Unit
UnitResult = engine.UnitResult
chunked_overlap_time = engine.chunked_overlap_time
contended_system = engine.contended_system
contended_systems = engine.contended_systems
critical_path = engine.critical_path
explain = engine.explain
unit_breakdown = engine.unit_breakdown


def predict_trace(
    trace: Any,
    comm_groups: Mapping[int, Sequence[int]],
    system: System | str = "a100-80g",
    **kwargs: Any,
) -> dict[str, Any]:
    """:func:`predict_problem` for a trace read from files: ``trace`` maps each rank to its
    nodes, or summarises the rank files (see :func:`problem_from_trace`), in which case one
    rank per unit of identical ranks is replayed. Where that does not apply, or the replay of
    the units fails, every rank is replayed (so errors name the rank as before). ``kwargs`` go
    to :func:`predict_problem`; the report adds ``simulated_ranks``."""
    system = load_system(system)
    check_capacity(system, getattr(trace, "world_size", None) or len(trace), "ranks of the trace")
    problem = problem_from_trace(trace, comm_groups, system)
    if problem is not None:
        try:
            report = predict_problem(problem, system, **kwargs)
        except TraceError:
            problem = None
        else:
            report["simulated_ranks"] = len(problem.units)
            return report
    problem = problem_from_nodes(trace, comm_groups)
    report = predict_problem(problem, system, **kwargs)
    report["simulated_ranks"] = len(problem.units)
    return report


def timeline_events(replay_: Replay) -> dict[str, Any]:
    """A Chrome / Perfetto trace (JSON object format): one process per simulated rank, one
    thread for the compute stream and one for the communication stream."""
    events: list[dict[str, Any]] = []
    for res in replay_.units:
        unit = res.unit
        pid = unit.rank
        label = f"rank {unit.rank}"
        if len(unit.ranks) > 1:
            label += f" (stands for {len(unit.ranks)} ranks)"
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": label}})
        events.append(
            {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}}
        )
        for tid, name in ((0, "compute"), (1, "communication")):
            events.append(
                {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
            )
        for i, k in enumerate(res.kind):
            node = unit.nodes[i]
            if k == COMPUTE:
                tid, begin = 0, res.start[i]
            elif k == COLL or k == SEND:
                tid, begin = 1, res.transfer_start[i]
            else:
                continue
            args: dict[str, Any] = {"id": node.id}
            if node.num_ops:
                args["num_ops"] = node.num_ops
            if node.tensor_size:
                args["tensor_size"] = node.tensor_size
            if node.comm_size:
                args["comm_size"] = node.comm_size
            if k == COLL:
                args["comm_group"] = node.comm_group
                args["wait_us"] = round((begin - res.start[i]) * 1e6, 3)
            events.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "name": node.name,
                    "cat": engine.KIND_NAMES[k],
                    "ts": round(begin * 1e6, 3),
                    "dur": round((res.end[i] - begin) * 1e6, 3),
                    "args": args,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON to ``path`` through a temporary file in the same directory."""
    path = Path(path)
    if path.parent and not path.parent.is_dir():
        raise UserError(f"cannot write {str(path)!r}: directory {str(path.parent)!r} is missing")
    if path.is_dir():
        raise UserError(f"cannot write {str(path)!r}: it is a directory")
    text = json.dumps(data, separators=(",", ":")) + "\n"
    write_replacing(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def summarize(
    replay_: Replay,
    system: System,
    *,
    dtype: str = "bf16",
    tokens: int | None = None,
    world_size: int | None = None,
) -> dict[str, Any]:
    """The report of the ``time`` predictor for one replay."""
    iteration = replay_.iteration_time
    return report_of(
        [res.unit for res in replay_.units],
        iteration,
        [unit_breakdown(res, iteration) for res in replay_.units],
        critical_path(replay_),
        system,
        dtype=dtype,
        tokens=tokens,
        world_size=world_size,
    )


def report_of(
    units: Sequence[Unit],
    iteration: float,
    breakdowns: Sequence[Mapping[str, float]],
    path: list[dict[str, Any]],
    system: System,
    *,
    dtype: str = "bf16",
    tokens: int | None = None,
    world_size: int | None = None,
    flops: Sequence[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """The report of the ``time`` predictor: the units replayed, the iteration time, each
    unit's breakdown (:func:`unit_breakdown`) and the critical path (:func:`critical_path`);
    ``flops``: each unit's (hardware, model) FLOPs per rank where its nodes are not the
    whole iteration's (a periodic replay's extrapolation), else counted from its nodes."""
    hardware_flops = 0
    model_flops = 0
    world = 0
    entries = []
    for index, (unit, breakdown) in enumerate(zip(units, breakdowns, strict=True)):
        weight = len(unit.ranks)
        world += weight
        unit_flops, unit_model = engine_unit_flops(unit) if flops is None else flops[index]
        hardware_flops += weight * unit_flops
        model_flops += weight * unit_model
        entry: dict[str, Any] = {
            "rank": unit.rank,
            "ranks": weight,
            "class": unit.rank_class,
            "stage": unit.stage,
            "flops": unit_flops,
        }
        entry.update(breakdown)
        entries.append(entry)
    world = world_size or world
    peak = system.peak(dtype)
    report: dict[str, Any] = {
        "predictor": "time",
        "system": system.name,
        "world_size": world,
        "iteration_time_s": iteration,
        "model_flops": model_flops,
        "hardware_flops": hardware_flops,
        "mfu": model_flops / (iteration * world * peak) if iteration > 0 else 0.0,
        "hfu": hardware_flops / (iteration * world * peak) if iteration > 0 else 0.0,
        "peak_flops_per_gpu": peak,
        "ranks": entries,
        "critical_path": path,
    }
    if tokens is not None and iteration > 0:
        report["tokens_per_s"] = tokens / iteration
    return report


def predict_problem(
    problem: Problem,
    system: System | str = "a100-80g",
    *,
    dtype: str = "bf16",
    tokens: int | None = None,
    timeline: str | Path | None = None,
    kernels: KernelTable | Iterable[Any] | None = None,
    profile: str = "megatron",
    explain_path: bool = False,
    calibration: Calibration | None = None,
    overlap_param_gather: bool = False,
    tp_comm_overlap: bool = False,
    exact: bool = True,
    micro_batches: int | None = None,
    period: int | None = None,
    checked: Mapping[int, int] | None = None,
    chunks: int = 1,
    extra_warmup: int = 0,
) -> dict[str, Any]:
    """Replay ``problem`` and report; ``timeline`` writes a Chrome trace JSON there;
    ``explain_path`` adds the critical path's breakdown (:func:`explain`) as ``explain``.

    ``exact`` False: where the problem is a pipeline whose steady state repeats, replay the
    fill, one period and the drain (:func:`stg.perf.periodic.replay_periodic`: checked, not
    assumed) and extrapolate the rest; the report's ``replay`` says which was done. A
    timeline or ``explain_path`` needs every node's times: the whole problem is replayed.

    ``micro_batches``: the iteration's, where ``problem`` is lowered for only its first
    ones (``build_workload``'s ``lowered_micro_batches``): the periodic replay extrapolates
    to them, and where it cannot, this raises :class:`NotPeriodic` (the caller builds the
    whole workload).

    ``chunks``: model chunks per stage (an interleaved schedule's virtual stages), whose fill
    and drain span more micro-batches (:func:`stg.perf.periodic.drain_micro_batches`), as do
    ``extra_warmup`` forward chunks beyond the schedule's warm-up (``overlap_moe_ep_comm``).

    ``kernels``: Kernel records (or registry entries, or a :class:`KernelTable`) that price
    ops by precision; none (the default) means the plain roofline."""
    system = load_system(system)
    table = kernel_table(kernels, system.name)
    check_capacity(system, problem.world_size)
    tables: KernelTable | dict[str, KernelTable] = table
    if is_hybrid(system):
        tables = hybrid_kernel_tables(kernels, system)
        if calibration is not None:
            raise UserError(
                "--calibration holds one device's measured kernels; on a hybrid system give "
                "it with one group's device preset (--system t4-16g) instead"
            )
    options: dict[str, Any] = {
        "overlap_param_gather": overlap_param_gather,
        "tp_comm_overlap": tp_comm_overlap,
    }
    args = (system, dtype, tables, profile, calibration)
    if not exact and timeline is None and not explain_path and not is_hybrid(system):
        extend: dict[str, Any] = {
            "checked": checked,
            "chunks": chunks,
            "extra_warmup": extra_warmup,
        }
        if micro_batches is not None:
            extend = {
                "micro_batches": micro_batches,
                "only_period": period,
                "name_at": name_in_micro_batch,
                "only_if_cheaper": False,
                "chunks": chunks,
                "extra_warmup": extra_warmup,
                "checked": checked,
            }
        periodic = replay_periodic(problem, *args, **options, **extend)
        if periodic is None and micro_batches is not None:
            raise NotPeriodic(f"the steady state of {micro_batches} micro-batches did not repeat")
        if periodic is not None:
            report = report_of(
                problem.units,
                periodic.iteration_time,
                periodic.breakdowns,
                periodic.critical_path,
                system,
                dtype=dtype,
                tokens=tokens,
                world_size=problem.world_size,
                flops=periodic.flops,
            )
            report["replay"] = {
                "kind": "periodic",
                "micro_batches": periodic.micro_batches,
                "replayed_micro_batches": periodic.replayed_micro_batches,
                "period_micro_batches": periodic.period,
                "period_s": periodic.period_time,
            }
            if table:
                report["kernels"] = table.names()
            return report
    if micro_batches is not None:
        raise NotPeriodic("a partly lowered workload replays only periodically")
    result = replay(problem, *args, **options)
    report = summarize(result, system, dtype=dtype, tokens=tokens, world_size=problem.world_size)
    report["replay"] = {"kind": "full"}
    if isinstance(tables, dict):
        names = sorted({n for t in tables.values() for n in t.names()})
        if names:
            report["kernels"] = names
    elif table:
        report["kernels"] = table.names()
    if is_hybrid(system):
        report.update(hybrid_report(result, system, problem, dtype))
        scale = system.peak(dtype) / report["peak_flops_per_gpu"]  # MFU against each GPU's peak
        report["mfu"] *= scale
        report["hfu"] *= scale
    if explain_path:
        report["explain"] = explain(result, problem.comm_groups, system)
        if "groups" in report:
            report["explain"]["groups"] = report["groups"]
            report["explain"]["straggler"] = report["straggler"]
    if timeline is not None:
        write_json_atomic(timeline, timeline_events(result))
        report["timeline"] = str(timeline)
    return report


def predict_time(
    workload: Workload,
    system: System | str = "a100-80g",
    *,
    timeline: str | Path | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    kernels: KernelTable | Iterable[Any] | None = None,
    explain: bool = False,
    calibration: Calibration | None = None,
    exact: bool = False,
    micro_batches: int | None = None,
    period: int | None = None,
    checked: Mapping[int, int] | None = None,
    **_: Any,
) -> dict[str, Any]:
    """Iteration time, per-rank breakdown, MFU and critical path of a workload (``explain``:
    and the critical path split into compute by class, communication and waits).

    ``micro_batches`` and ``period``: the workload is lowered for only the first micro-batches
    of an iteration of ``micro_batches`` (:func:`predict_time_options`); its periodic replay
    with that period is extrapolated, or :class:`NotPeriodic` raised. ``checked``: per period,
    the shorter replays already found not periodic (see
    :func:`stg.perf.periodic.replay_periodic`).

    The steady state of a pipeline is replayed once and extrapolated where a check proves
    it periodic (:func:`stg.perf.periodic.replay_periodic`); ``exact`` replays every
    micro-batch (as a ``timeline`` and ``explain`` always do, and a workload of several
    pipeline schedules in turn, ``pipeline_flushes``).

    A pure function of (workload, system, kernels): ``kernels`` are Kernel records (or
    registry entries, or a :class:`stg.perf.kernels.KernelTable`); without them ops get the
    plain roofline."""
    system = load_system(system)
    options = dict(workload.metadata.get("options") or {}) if workload.metadata else {}
    dtype = str(options.get("dtype") or "bf16")
    profile = str(options.get("profile") or "megatron")
    if int(options.get("pipeline_flushes") or 1) > 1:
        exact = True  # schedules in turn: no one steady state to extrapolate
    tokens = None
    stackless = any(c.facts.get("stackless") for c in workload.rank_classes)
    if options.get("batch") and options.get("seq") and not stackless:
        tokens = int(options["batch"]) * int(options["seq"])
    if workload.metadata.get("tokens"):  # a serving run: the new tokens it processes
        tokens = int(workload.metadata["tokens"])
    check_capacity(system, len(workload.ranks))
    if progress:
        progress("symmetry", 0, 1)
    problem = problem_from_workload(workload, system)
    if progress:
        progress("symmetry", 1, 1)
    report = predict_problem(
        problem,
        system,
        dtype=dtype,
        tokens=tokens,
        timeline=timeline,
        kernels=kernels,
        profile=profile,
        explain_path=explain,
        calibration=calibration,
        exact=exact,
        micro_batches=micro_batches,
        period=period,
        checked=checked,
        chunks=int(options.get("virtual_stages") or 1),
        extra_warmup=int(bool(options.get("overlap_moe_ep_comm"))),
        **overlap_options(options),
    )
    report["simulated_ranks"] = len(problem.units)
    if stackless and options.get("batch") and report["iteration_time_s"] > 0:
        # a model without a sequence (images): samples, not tokens
        report["samples_per_s"] = int(options["batch"]) / report["iteration_time_s"]
    return report


class NotPeriodic(Exception):
    """A partly lowered workload's steady state was not checked to repeat."""


def lowered_micro_batches(options: GenerateOptions, system: System) -> list[tuple[int, int]]:
    """(micro-batches to lower, period) for each periodic replay worth trying on a workload
    lowered for its fill, two periods and its drain instead of the whole workload, in order:
    the period of one micro-batch (unless the stages hold several model chunks), then that
    of one micro-batch per stage; for each, first the fewest micro-batches whose steady state
    the state check proves (:func:`stg.perf.periodic.state_keep`: not with overlapped
    tensor-parallel communication, whose dependencies the check does not compare), then
    those the two replays matched micro-batch by micro-batch need
    (:func:`stg.perf.periodic.first_keep`), each where it lowers at most half of the
    micro-batches (the lowered build, its replay and the check then cost less than the whole
    build and replay); after every period's, the state check's
    one, two, four periods later and those the matched replays need twice and four times as
    many and so on, fewest first, while their replays together cost at most half the whole
    one (a transient that outlasts the fill, as where one stage runs ahead of the others for a
    while: a stage whose last model chunk holds only the loss). None for a run that is not
    one training pipeline schedule of one device kind."""
    if options.inference or is_hybrid(system) or options.pipeline_flushes > 1:
        return []
    stages, total = options.pp, options.micro_batches
    chunks = options.virtual_stages
    extra = int(options.overlap_moe_ep_comm)  # Megatron-core's one more warm-up forward
    read_off = not options.tp_comm_overlap
    periods = [stages] if chunks > 1 else list(dict.fromkeys((1, stages)))
    out, later = [], []
    for period in periods:
        keeps = [first_keep(stages, period, chunks, extra)]
        if read_off:
            keeps.insert(0, state_keep(stages, period, chunks, extra))
            # the state check a whole number of periods later (1, 2, 4, ...), one replay each
            # of a workload lowered for them, while those cost at most half the whole one
            settle, spent = 1, 0
            while True:
                lowered = keeps[0] + (settle + 1) * period
                spent += lowered
                if 2 * spent > total:
                    break
                later.append((lowered, period))
                settle *= 2
        # where a transient outlasts the fill: doubled while the replays of all those (two
        # each) cost at most half the whole one's
        longer, spent = 2 * keeps[-1], 0
        while 2 * (spent + 2 * (longer + period)) <= total:
            later.append((longer + period, period))
            spent += 2 * (longer + period)
            longer *= 2
        for keep in keeps:
            # the lowered workload's replay with its state check costs about what the
            # whole workload's replay costs for twice its micro-batches (benchmarks/
            # search_speed.py --plans: 32 lowered of 48 took 1.6 CPU s, all 48 1.4)
            if total % period or 2 * (keep + period) > total:
                continue
            out.append((keep + period, period))
    return list(dict.fromkeys(out + sorted(t for t in later if not total % t[1] and t[0] < total)))


def predict_time_options(
    options: GenerateOptions,
    system: System | str = "a100-80g",
    *,
    registry: Any = None,
    kernels: KernelTable | Iterable[Any] | None = None,
    calibration: Calibration | None = None,
    exact: bool = False,
    explain: bool = False,
    timeline: str | Path | None = None,
    workload: Workload | None = None,
    max_nodes: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """:func:`predict_time` of the workload of ``options``, lowering only what its replay
    needs: where :func:`lowered_micro_batches` says so (and no ``exact``, ``timeline`` or
    ``explain`` asks for every node), the workload of the fill, two periods and the drain is
    built, its steady state checked to repeat and extrapolated to every micro-batch
    (:func:`stg.perf.periodic.replay_periodic`); the same figures as the whole workload's.
    Where that does not apply or the check fails, the whole workload is replayed: ``workload``
    where given (built from ``options``), else built once its estimated size passes
    ``check_size`` (``max_nodes``: at most that many nodes), as the lowered one's must."""
    if registry is None:
        raise UserError("the time predictor needs the registry (the model to build)")
    # millions of nodes, none in a reference cycle: the cyclic collector would only scan them
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _predict_time_options(
            options, load_system(system), registry, kernels, calibration, exact, explain,
            timeline, workload, max_nodes, progress,
        )  # fmt: skip
    finally:
        if enabled:
            gc.enable()


def _predict_time_options(
    options: GenerateOptions,
    system: System,
    registry: Any,
    kernels: KernelTable | Iterable[Any] | None,
    calibration: Calibration | None,
    exact: bool,
    explain: bool,
    timeline: str | Path | None,
    workload: Workload | None,
    max_nodes: int | None,
    progress: Callable[[str, int, int], None] | None,
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "timeline": timeline,
        "kernels": kernels,
        "calibration": calibration,
        "explain": explain,
        "exact": exact,
        "progress": progress,
    }
    tries = []
    if not exact and timeline is None and not explain:
        tries = lowered_micro_batches(options, system)
    checked: dict[int, int] = {}
    size_option = "--max-nodes" if max_nodes is not None else None  # the CLI's, when given
    parts = _bound_parts(options, registry) if workload is None else None
    for built, period in tries:
        # the lowered workload's size is that of the run with ``built`` micro-batches
        per_micro_batch = options.micro_batch or options.batch
        check_size(
            estimate_size(replace(options, batch=built * per_micro_batch), registry, parts),
            max_nodes,
            option=size_option,
        )
        try:
            lowered = build_workload(
                options, registry, progress, lowered_micro_batches=built, parts=parts
            )
        except ValueError:  # a schedule whose shorter orders are not its prefixes
            break
        try:
            report = predict_time(
                lowered,
                system,
                micro_batches=options.micro_batches,
                period=period,
                checked=checked,
                **kwargs,
            )
        except NotPeriodic:
            checked[period] = built - period
            continue
        report["replay"]["lowered_micro_batches"] = built
        return report
    if workload is None:
        check_size(estimate_size(options, registry, parts), max_nodes, option=size_option)
        workload = build_workload(options, registry, progress, parts=parts)
    return predict_time(workload, system, checked=checked, **kwargs)


def _bound_parts(options: GenerateOptions, registry: Any) -> Any:
    """:func:`stg.api.detached_parts` of ``options``, kept on disk beside the analytical
    predictor's workloads (``predictors/_workload_cache.py``: an entry is used only while every
    module file that built it is unchanged): a process that finds them lowers the workload
    without the symbolic core (sympy's import alone is a fifth of a prediction's time)."""
    key = workload_cache.entry_key(
        ("bound parts", options), workload_cache.registry_plugins(registry)
    )
    parts = workload_cache.load(key)
    if parts is None:
        parts = stg.api.detached_parts(options, registry)
        if parts is not None:
            workload_cache.store(key, parts)
            workload_cache.store_layer_kinds(options, registry)  # the memory predictor's
    return parts


def overlap_options(options: Mapping[str, Any]) -> dict[str, bool]:
    """The overlap options a workload was generated with (its metadata's ``options``; a trace
    records them only when on)."""
    return {
        "overlap_param_gather": bool(options.get("overlap_param_gather")),
        "tp_comm_overlap": bool(options.get("tp_comm_overlap")),
    }


# ---------------------------------------------------------------------------------------------
# Hybrid clusters (device groups, stg.perf.hybrid): per-group report


def hybrid_kernel_tables(
    kernels: KernelTable | Iterable[Any] | None, system: System
) -> dict[str, KernelTable]:
    """One kernel table per device of a hybrid system (kernels apply by device name, e.g.
    ``t4-16g``); a ready-made table applies to every device."""
    items = kernels if isinstance(kernels, KernelTable) else list(kernels or ())
    return {
        g.device.name: kernel_table(items, g.device.name)
        for g in system.groups  # type: ignore[attr-defined]
    }


def hybrid_report(replay_: Replay, system: System, problem: Problem, dtype: str) -> dict[str, Any]:
    """Per device group: its device and ranks, compute (without casts), casts, the wait at
    each synchronisation point that joins it to other groups (collectives spanning several
    groups: from its issue to the last member's; receives from another group: from ready to
    the data's arrival), bubble; the straggler is the group with the longest
    local time (compute + casts), the one the others wait for. Figures are the group's
    slowest simulated rank's. MFU is recomputed against the sum of every rank's own peak."""
    groups = system.groups  # type: ignore[attr-defined]
    group_of = system.group_of  # type: ignore[attr-defined]
    spans: dict[int, int] = {}
    for gid, members in problem.comm_groups.items():
        spans[gid] = len({group_of(m).name for m in members})
    per_group: dict[str, dict[str, Any]] = {}
    peak_sum = 0.0
    for res in replay_.units:
        unit = res.unit
        group = group_of(unit.rank)
        weight = len(unit.ranks)
        peak_sum += weight * group.device.peak(dtype)
        compute = casts = 0.0
        points: list[dict[str, Any]] = []
        for i, k in enumerate(res.kind):
            node = unit.nodes[i]
            if k == COMPUTE:
                if is_cast(kernel_name(node)):
                    casts += res.duration[i]
                else:
                    compute += res.duration[i]
            elif k == COLL and spans.get(node.comm_group, 1) > 1:
                points.append(
                    {
                        "name": node.name,
                        "type": node.comm_type.name.lower(),
                        "ranks": len(problem.comm_groups[node.comm_group]),
                        "wait_s": res.transfer_start[i] - res.start[i],
                    }
                )
            elif k == RECV and group_of(node.comm_src).name != group.name:
                # a send never waits for its receiver here: the receiver waits for the data
                points.append(
                    {
                        "name": node.name,
                        "type": "recv",
                        "ranks": 2,
                        "wait_s": res.end[i] - res.start[i],
                    }
                )
        breakdown = unit_breakdown(res, replay_.iteration_time)
        entry = per_group.get(group.name)
        if entry is not None:
            entry["ranks"] += weight
            if compute + casts <= entry["compute_s"] + entry["casts_s"]:
                continue
        else:
            entry = per_group[group.name] = {"ranks": weight}
        entry.update(
            {
                "device": group.device.name,
                "rank": unit.rank,
                "compute_s": compute,
                "casts_s": casts,
                "sync_wait_s": sum(p["wait_s"] for p in points),
                "sync_points": points,
                "exposed_communication_s": breakdown["exposed_communication_s"],
                "bubble_s": breakdown["bubble_s"],
                "capacity_bytes": group.device.hbm_capacity,
                "cast_model": default_cast_model(group.device).as_dict(),
            }
        )
    ordered = {g.name: per_group[g.name] for g in groups if g.name in per_group}
    straggler = max(ordered, key=lambda n: ordered[n]["compute_s"] + ordered[n]["casts_s"])
    iteration = replay_.iteration_time
    out: dict[str, Any] = {"groups": ordered, "straggler": straggler}
    out["placement"] = [
        list(run)
        for run in system.placement_runs(problem.world_size)  # type: ignore[attr-defined]
    ]
    out["peak_flops_per_gpu"] = system.peak(dtype)
    if iteration > 0 and peak_sum > 0:
        out["peak_flops_per_gpu"] = peak_sum / max(1, problem.world_size)
    return out


@stg.hookimpl
def stg_register_predictors(register: Any) -> None:
    register(
        Predictor(
            name="time",
            predict=predict_time,
            predict_options=predict_time_options,
            needs="options",
            description="roofline compute and alpha-beta collectives replayed over the "
            "multi-rank graph: iteration time, exposed communication, bubble, MFU",
        )
    )


# the cost models (stg.perf.costs) and the replay engine (stg.perf.replay) are shared; their names
# stay importable from here
__all__ = [
    "EAGER_OP_HOST_S",
    "HBM_BYTES_PER_WIRE_BYTE",
    "NCCL_CHANNELS",
    "TP_OVERLAP_PIPELINE_SPLITS",
    "USERBUFFERS_HBM_BYTES_PER_WIRE_BYTE",
    "USERBUFFERS_SMS",
    "Problem",
    "Replay",
    "Unit",
    "UnitResult",
    "attention_impl",
    "chunked_overlap_time",
    "collective_phases",
    "collective_time",
    "compute_time",
    "contended_system",
    "contended_systems",
    "critical_path",
    "explain",
    "group_shape",
    "overlap_options",
    "predict_problem",
    "predict_time",
    "predict_time_options",
    "predict_trace",
    "problem_from_nodes",
    "problem_from_trace",
    "problem_from_workload",
    "replay",
    "report_of",
    "send_time",
    "summarize",
    "timeline_events",
    "tree_all_reduce_time",
    "unit_breakdown",
]
