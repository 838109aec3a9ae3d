"""``stg search``: the best parallel plans for a model, a GPU count, a global batch and a system.

Like Calculon's llm-optimal-execution, the search enumerates the plans (dp, tp, pp, ep, cp,
micro-batch, recompute, ZeRO / FSDP, schedule and virtual stages) whose degrees multiply to
the GPU count, then:

1. bounds the time of each from below in closed form: no plan runs faster than its FLOPs at
   the GPU's peak, stretched by the pipeline's fill and drain,
   ``T ≥ W / (N · peak) · (1 + (p - 1) / (m · v))`` (W: the FLOPs of one iteration, the same
   for every plan of a recompute: the model's, and the forwards full or selective recompute
   adds; N GPUs; p stages, m micro-batches, v chunks);
2. in increasing order of that bound, drops the plans the divisibility rules reject
   (:func:`stg.core.pipeline.validate_options`) and those whose peak memory (the memory
   predictor's closed forms) exceeds the GPU, and prices the rest by the analytical
   predictor; it stops when the bound exceeds the k-th best time found (the plans after it
   are neither checked nor priced: none of them can be among the k best);
3. prices the best candidates again with the full DAG predictor (``time``) and ranks them by
   that.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from stg.core.options import GenerateOptions
from stg.core.plan import check_sizes
from stg.errors import UserError

PLAN_FIELDS = (
    "dp",
    "tp",
    "pp",
    "ep",
    "sp",
    "micro_batch",
    "activation_recompute",
    "zero",
    "weight_sharded",
    "pipeline_schedule",
    "virtual_stages",
    "ep_layout",
    "recompute_method",
    "recompute_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "decoder_last_pipeline_num_layers",
)
PIPELINE_SPLITS = {
    "even": (False, False),
    "embedding": (True, False),
    "loss": (False, True),
    "both": (True, True),
}
"""How a plan may split layers over its stages: as evenly as possible, or with the embedding,
the loss or both counted as a layer (Megatron's ``--account-for-embedding/loss-in-pipeline-
split``): ``(account_for_embedding, account_for_loss)``."""


@dataclass(frozen=True)
class SearchSpace:
    """The values each plan axis may take (``None``: derived from the model and GPU count)."""

    tp: Sequence[int] | None = None
    pp: Sequence[int] | None = None
    sp: Sequence[int] = (1,)
    ep: Sequence[int] | None = None
    micro_batch_per_replica: Sequence[int] | None = None
    recompute: Sequence[str] = ("none", "selective", "full")
    sharding: Sequence[str] = ("0", "1", "2", "fsdp")
    schedules: Sequence[str] = ("1f1b", "interleaved")
    virtual_stages: Sequence[int] = (2, 3, 4)
    ep_layouts: Sequence[str] | None = None
    """``multiply`` and / or ``fold`` (None: the base options' layout)"""
    recompute_layers: Sequence[int] = ()
    """layer counts of full recompute's ``block`` method to try too (the first N layers of
    each model chunk recomputed; none: every layer or none)"""
    pipeline_splits: Sequence[str] = ("even",)
    """keys of :data:`PIPELINE_SPLITS` (an uneven split is tried where pp > 1)"""
    last_stage_layers: Sequence[int] = ()
    """layer counts of the last pipeline stage to try too (Megatron's
    ``--decoder-last-pipeline-num-layers``: the other stages split the rest evenly), where
    pp > 1; a heavy output layer is balanced by giving its stage fewer layers"""


@dataclass
class Candidate:
    options: GenerateOptions
    bound_s: float
    analytical: dict[str, Any] | None = None
    dag: dict[str, Any] | None = None
    memory: dict[str, Any] = field(default_factory=dict)

    @property
    def time_s(self) -> float:
        report = self.dag or self.analytical or {}
        return float(report.get("iteration_time_s", float("inf")))

    def plan(self) -> dict[str, Any]:
        """The plan's choices; the keys of the newer layouts only where they are used."""
        o = self.options
        out: dict[str, Any] = {
            "dp": o.dp,
            "tp": o.tp,
            "pp": o.pp,
            "ep": o.ep,
            "cp": o.sp,
            "micro_batch": o.micro_batch or o.batch,
            "micro_batches": o.micro_batches,
            "recompute": o.activation_recompute,
            "zero": 3 if o.weight_sharded else o.zero,
            "schedule": o.pipeline_schedule,
            "virtual_stages": o.virtual_stages,
        }
        if o.recompute_method:
            out["recompute_method"] = o.recompute_method
            out["recompute_num_layers"] = o.recompute_num_layers
        if o.ep_folded:
            out["ep_layout"] = "fold"
        split = (o.account_for_embedding_in_pipeline_split, o.account_for_loss_in_pipeline_split)
        if any(split):
            out["pipeline_split"] = next(k for k, v in PIPELINE_SPLITS.items() if v == split)
        if o.decoder_last_pipeline_num_layers is not None:
            out["last_stage_layers"] = o.decoder_last_pipeline_num_layers
        return out

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"plan": self.plan(), "lower_bound_s": self.bound_s}
        out["peak_memory_bytes"] = self.memory.get("peak_bytes")
        if self.analytical is not None:
            out["analytical"] = {
                k: self.analytical.get(k)
                for k in ("iteration_time_s", "mfu", "tokens_per_s", "explain")
            }
        if self.dag is not None:
            out["time"] = {
                k: self.dag.get(k) for k in ("iteration_time_s", "mfu", "tokens_per_s", "explain")
            }
        return out


@dataclass
class SearchResult:
    best: list[Candidate]
    enumerated: int
    pruned: Counter[str]
    priced: int
    refined: int


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def powers_of_two_upto(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``."""
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def plans(
    base: GenerateOptions, gpus: int, space: SearchSpace, scale_up: int = 8
) -> list[GenerateOptions]:
    """Every combination of the space whose degrees multiply to ``gpus`` (unchecked). Tensor
    parallelism defaults to powers of two up to 8, or up to ``scale_up`` (the GPUs of the
    system's NVLink domain) where that is larger: an NVL72 rack holds tp 16 to 64 on NVLink.
    Where expert parallelism folds (``ep_layout=fold``) the world is dp·tp·cp·pp and ep·etp
    must divide dp·tp·cp; the block recompute counts and uneven splits of the space are
    tried beside the plans without them."""
    tps = space.tp or [t for t in powers_of_two_upto(min(gpus, max(8, scale_up)))]
    pps = space.pp or [p for p in divisors(gpus) if p <= base.num_stacks]
    name = base.model.lower()
    moe = name.startswith("moe") or name == "deepseek"  # models with routed experts
    eps = space.ep or ([e for e in divisors(gpus) if base.experts % e == 0] if moe else [1])
    base_layout = "fold" if base.ep_folded else "multiply"
    layouts = list(space.ep_layouts or (base_layout,))
    recomputes: list[tuple[str, int | None]] = [(r, None) for r in space.recompute]
    recomputes += [("full", n) for n in space.recompute_layers]
    # every plan is ``replace(base, ...)``: the base's fields read once, not per plan
    values = {f.name: getattr(base, f.name) for f in fields(base)}
    out = []
    for layout, (tp, pp, sp, ep) in itertools.product(
        layouts, itertools.product(tps, pps, space.sp, eps)
    ):
        fold = layout == "fold"
        if fold and ep == 1 and "multiply" in layouts:
            continue  # the same plan as multiply's
        dense = tp * pp * sp * (1 if fold else ep)
        if gpus % dense:
            continue
        dp = gpus // dense
        if fold and (dp * tp * sp) % (ep * (base.etp or tp)):
            continue
        replicas = dp if fold else dp * ep
        if base.batch % replicas:
            continue
        per_replica = base.batch // replicas
        sizes = space.micro_batch_per_replica or powers_of_two_upto(per_replica)
        splits: list[tuple[bool, bool, int | None]] = [
            (*PIPELINE_SPLITS[k], None) for k in space.pipeline_splits if k == "even" or pp > 1
        ]
        if pp > 1:
            even_last = base.num_stacks // pp  # the even split gives the last stage no extra
            splits += [(False, False, n) for n in space.last_stage_layers if n != even_last]
        for b in sizes:
            if per_replica % b:
                continue
            micro = b * replicas
            m = base.batch // micro
            schedules: list[tuple[str, int]] = []
            for name in space.schedules:
                if name == "interleaved":
                    schedules.extend(("interleaved", v) for v in space.virtual_stages if pp > 1)
                else:
                    schedules.append((name, 1))
            for (schedule, v), (recompute, block), sharding, split in itertools.product(
                schedules, recomputes, space.sharding, splits
            ):
                if schedule == "interleaved" and m % pp:
                    continue
                if block is not None and block >= -(-base.num_stacks // (pp * v)):
                    continue  # every layer of a chunk: full recompute, already there
                zero, sharded = (0, True) if sharding == "fsdp" else (int(sharding), False)
                if (zero or sharded) and dp * sp == 1:
                    continue  # nothing to shard over
                embedding, loss, last = split
                modules = base.recompute_modules
                changes = dict(
                    dp=dp,
                    tp=tp,
                    pp=pp,
                    sp=sp,
                    ep=ep,
                    micro_batch=micro,
                    activation_recompute=recompute,
                    zero=zero,
                    weight_sharded=sharded,
                    pipeline_schedule=schedule,
                    virtual_stages=v,
                    ep_layout=base.ep_layout if layout == base_layout else layout,
                    recompute_method=None if block is None else "block",
                    recompute_modules=modules if recompute == "selective" else (),
                    recompute_num_layers=block,
                    account_for_embedding_in_pipeline_split=embedding,
                    account_for_loss_in_pipeline_split=loss,
                    decoder_last_pipeline_num_layers=last,
                )
                out.append(type(base)(**{**values, **changes}))
    return out


def scale_up_size(system: Any) -> int:
    """The GPUs of the system's scale-up domain (its first network dimension: 8 on an HGX
    node, 72 on an NVL72 rack); 8 for a system without one (a hybrid cluster)."""
    network = getattr(system, "network", None)
    return network[0].size if network and network[0].size else 8


_PARAMETERS: dict[Callable[..., Any], frozenset[str] | None] = {}
"""Per predictor function: the keywords it takes (None: any)."""


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` without the keywords ``fn`` does not take (as
    :func:`stg.explore.sweep._call`), its signature read once per function: a search calls
    the same few predictors for thousands of plans."""
    if fn not in _PARAMETERS:
        import inspect

        params = inspect.signature(fn).parameters
        any_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
        _PARAMETERS[fn] = None if any_keyword else frozenset(params)
    taken = _PARAMETERS[fn]
    if taken is None:
        return fn(*args, **kwargs)
    return fn(*args, **{k: v for k, v in kwargs.items() if k in taken})


# -- the work an engine runs: each plan priced where the engine puts it ------------------------


@dataclass(frozen=True)
class _Work:
    """What every part of one search's work shares (picklable, small): where a worker finds
    the registry and the system (this process's own under ``token``, else loaded again)."""

    token: str
    plugins: tuple[str, ...]
    system_name: str
    system_data: Mapping[str, Any]
    fast: str
    full: str
    calibration: Any = None
    """A :class:`stg.perf.calibration.Calibration` for the full predictor (or None)."""


_SEARCHES: dict[str, tuple[Any, Any]] = {}
"""token -> (registry, system) of the searches this process (or its parent, forked) runs."""


def _resolve(work: _Work) -> tuple[Any, Any]:
    if work.token not in _SEARCHES:  # a Dask worker: load the registry and system
        from stg.explore.sweep import _registry, _system

        _SEARCHES[work.token] = (
            _registry(work.plugins),
            _system(work.system_name, work.system_data),
        )
    return _SEARCHES[work.token]


@dataclass(frozen=True)
class _Pricing:
    """What the analytical pass of one search prices every plan with, looked up once."""

    registry: Any
    system: Any
    kernels: list[Any]
    memory: Any
    """the memory predictor's record"""
    fast: Any
    """the fast predictor's record"""


_PRICINGS: dict[str, _Pricing] = {}
"""token -> the :class:`_Pricing` of that search in this process (a worker keeps those of
its last :data:`_PRICED_SEARCHES` searches)."""


def _pricing(work: _Work) -> _Pricing:
    pricing = _PRICINGS.get(work.token)
    if pricing is None:
        for token in list(_PRICINGS)[: 1 - _PRICED_SEARCHES]:
            _PRICINGS.pop(token, None)
        registry, system = _resolve(work)
        pricing = _PRICINGS[work.token] = _Pricing(
            registry,
            system,
            list(registry.kernels),
            registry.predictors.get("memory"),
            registry.predictors.get(work.fast),
        )
    return pricing


TWIN_PREDICTORS = frozenset({"analytical", "time"})
"""Predictors whose reports are functions of a plan's lowered workload and of options other
than which of ZeRO-1 and ZeRO-2 it runs (the analytical one reads only whether a plan shards
its optimizer states): plans that differ only in that are priced, and replayed, once."""


def twin_key(options: GenerateOptions, predictor: str) -> GenerateOptions:
    """The plan whose report of ``predictor`` ``options`` shares: itself, but ZeRO-2 as
    ZeRO-1 for :data:`TWIN_PREDICTORS` where the two lower alike (:func:`zero_stages_alike`).
    They then differ only in the memory they keep: Megatron's distributed optimizer
    reduce-scatters the gradients and all-gathers the weights in both, and only the memory
    predictor reads which (tests/test_search_exact.py checks that their workloads and both
    predictors' reports are the same)."""
    if predictor in TWIN_PREDICTORS and options.zero == 2 and zero_stages_alike(options):
        return replace(options, zero=1)
    return options


def zero_stages_alike(options: GenerateOptions) -> bool:
    """Whether ZeRO-1 and ZeRO-2 lower ``options`` alike: not where a gradient is all-reduced
    after its data-parallel reduce-scatter, which ZeRO-1 does on the whole buffer and ZeRO-2 on
    its shard (stg.core.autodiff.build_grad_reduction): the tensor-parallel all-reduce of
    sequence parallelism's replicated weights, and a tied embedding's over the first and last
    pipeline stage."""
    sequence_parallel = options.tp > 1 and options.tpsp
    tied_across_stages = bool(options.tie_embeddings) and options.pp > 1
    return not (sequence_parallel or tied_across_stages)


_PRICED: dict[str, dict[GenerateOptions, Any]] = {}
"""token -> the fast reports this process gave in that search, by :func:`twin_key` (a
worker keeps those of its last :data:`_PRICED_SEARCHES` searches)."""
_PRICED_SEARCHES = 4


def _fast_report(work: _Work, o: GenerateOptions, registry: Any, system: Any) -> Any:
    """The fast predictor's report of ``o`` with its breakdown (that of its twin where this
    process priced it already)."""
    if work.token not in _PRICED:
        for token in list(_PRICED)[: 1 - _PRICED_SEARCHES]:
            _PRICED.pop(token, None)
    reports = _PRICED.setdefault(work.token, {})
    key = twin_key(o, work.fast)
    if key not in reports:
        pricing = _pricing(work)
        reports[key] = _call(
            pricing.fast.predict_options,
            o,
            system,
            registry=registry,
            kernels=list(pricing.kernels),
            explain=True,
        )
    return reports[key]


def _evaluate_plans(work: _Work, options: Sequence[GenerateOptions]) -> list[tuple[str, Any, Any]]:
    """Each plan's closed forms, then its fast price: ``("", memory report, report)``, or
    ``(why it is pruned, None, None)`` (divisibility, memory, or the fast predictor's
    refusal)."""
    from stg.core.validation import validate_options
    from stg.explore.space import normalize_reason

    pricing = _pricing(work)
    registry, system = pricing.registry, pricing.system
    kernels = list(pricing.kernels)
    out: list[tuple[str, Any, Any]] = []
    for o in options:
        try:
            validate_options(o, registry)
        except UserError as exc:
            out.append((f"divisibility: {normalize_reason(str(exc))}", None, None))
            continue
        # the registry: Muon's weight matrices (its bound parts), and the workload of a model
        # whose memory no closed form describes
        try:
            mem = _call(
                pricing.memory.predict_options, o, system, kernels=kernels, registry=registry
            )
        except UserError as exc:  # a workload too large to build here for its memory
            out.append((f"memory: {normalize_reason(str(exc))}", None, None))
            continue
        if not mem.get("fits"):
            out.append(("memory: peak above the GPU's capacity", None, None))
            continue
        try:
            report = _fast_report(work, o, registry, system)
        except UserError as exc:
            out.append((f"analytical: {normalize_reason(str(exc))}", None, None))
            continue
        out.append(("", mem, report))
    return out


def _refine_plans(work: _Work, options: Sequence[GenerateOptions]) -> list[Any]:
    """The full predictor's report of each plan (None where its workload would not fit in
    this worker's memory: the plan keeps its fast price). A predictor that answers from
    options (the time predictor) lowers only what its replay needs (the fill, two periods
    and the drain of a periodic pipeline); no ``explain``, which would replay every node:
    the breakdown shown is the analytical one's."""
    from stg.core.sizes import WorkloadTooLarge
    from stg.explore.sweep import build_within_memory

    registry, system = _resolve(work)
    record = registry.predictors.get(work.full)
    extra = {} if work.calibration is None else {"calibration": work.calibration}
    out = []
    for o in options:
        if record.needs == "options" and record.predict_options is not None:
            try:
                out.append(
                    _call(
                        record.predict_options,
                        o,
                        system,
                        kernels=list(registry.kernels),
                        registry=registry,
                        **extra,
                    )
                )
            except WorkloadTooLarge:
                out.append(None)
            continue
        try:
            workload = build_within_memory(o, registry)
        except WorkloadTooLarge:
            out.append(None)
            continue
        out.append(
            _call(
                record.predict,
                workload,
                system,
                kernels=list(registry.kernels),
                explain=True,
                registry=registry,
                **extra,
            )
        )
    return out


def search(
    base: GenerateOptions,
    gpus: int,
    system: Any,
    registry: Any,
    *,
    space: SearchSpace | None = None,
    top: int = 5,
    refine: int = 5,
    fast: str = "analytical",
    full: str = "time",
    progress: Callable[[str, int, int], None] | None = None,
    engine: str = "local",
    jobs: int = 1,
    scheduler: str | None = None,
    plugins: Sequence[str] = (),
    calibration: Any = None,
) -> SearchResult:
    """The ``top`` best plans (see the module docstring), priced on ``engine``: ``local``, a
    process pool of ``jobs`` workers (1: this process), or ``dask`` (``scheduler``, whose
    workers load ``plugins``, those of ``registry``). The result is the same on any engine.
    ``calibration`` (measured kernels) prices the refined plans: the ``full`` predictor must
    take one."""
    import uuid

    from stg.explore.sweep import open_engine

    if gpus < 1:
        raise UserError(f"--gpus {gpus}: must be a positive integer")
    if system.capacity and gpus > system.capacity:
        raise UserError(f"--gpus {gpus} exceeds the {system.capacity} GPUs of {system.name}")
    check_sizes(base)  # what no plan makes valid; a plan's own divisibility prunes it
    space = space or SearchSpace()
    fast_record = registry.predictors.get(fast)
    if fast_record.predict_options is None:
        raise UserError(f"predictor {fast!r} cannot predict from options; use analytical")
    if refine > 0 and full:
        registry.predictors.get(full)
    if calibration is not None:
        import inspect

        if refine < 1 or not full:
            raise UserError("--calibration prices the refined plans; give --refine 1 or more")
        if "calibration" not in inspect.signature(registry.predictors.get(full).predict).parameters:
            raise UserError(f"--calibration: predictor {full!r} does not take a calibration table")
    work = _Work(
        uuid.uuid4().hex, tuple(plugins), system.name, system.as_dict(), fast, full, calibration
    )
    _SEARCHES[work.token] = (registry, system)
    try:
        with open_engine(engine, jobs, scheduler, plugins) as runner:
            return _search(base, gpus, system, registry, space, top, refine, progress, runner, work)
    finally:
        del _SEARCHES[work.token]
        _PRICED.pop(work.token, None)
        _PRICINGS.pop(work.token, None)


def _reference(base: GenerateOptions) -> GenerateOptions:
    """``base`` on one GPU, one micro-batch, without recompute, sharding or pipeline: its
    model FLOPs are every plan's (a plan's extra FLOPs, recompute's, only add to them)."""
    return replace(
        base,
        dp=1,
        tp=1,
        pp=1,
        sp=1,
        ep=1,
        micro_batch=base.batch,
        activation_recompute="none",
        recompute_method=None,
        recompute_num_layers=None,
        recompute_modules=(),
        zero=0,
        weight_sharded=False,
        pipeline_schedule="1f1b",
        virtual_stages=1,
        ep_layout=None,
        etp=None,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
        decoder_last_pipeline_num_layers=None,
    )


def _work_flops(base: GenerateOptions, system: Any, registry: Any, fast: str) -> dict[str, float]:
    """W of the bound, by recompute: the FLOPs of one iteration on one GPU (tp = pp = 1: no
    padding of the vocabulary to tp), without recompute (``none``: the model FLOPs, the
    same for every plan) and with full and selective recompute of every layer, which add
    their forwards (the fast predictor's hardware FLOPs; a plan that recomputes only some
    layers, the block method, is bounded by ``none``'s). Where the fast predictor gives no
    hardware FLOPs or refuses a recompute, that recompute is bounded by ``none``'s; where it
    refuses the reference itself, every plan is bounded by 0 (and priced)."""
    record = registry.predictors.get(fast)
    kernels = list(registry.kernels)
    reference = _reference(base)
    try:
        model = _call(record.predict_options, reference, system, registry=registry, kernels=kernels)
    except UserError:
        return {"none": 0.0}
    out = {"none": float(model["model_flops"])}
    for recompute, modules in (("full", ()), ("selective", base.recompute_modules)):
        plan = replace(reference, activation_recompute=recompute, recompute_modules=modules)
        try:
            report = _call(record.predict_options, plan, system, registry=registry, kernels=kernels)
        except UserError:
            report = {}
        out[recompute] = max(out["none"], float(report.get("hardware_flops") or 0.0))
    return out


def _search(
    base: GenerateOptions,
    gpus: int,
    system: Any,
    registry: Any,
    space: SearchSpace,
    top: int,
    refine: int,
    progress: Callable[[str, int, int], None] | None,
    runner: Any,
    work: _Work,
) -> SearchResult:
    def report(stage: str) -> Callable[[int, int], None] | None:
        if progress is None:
            return None
        return lambda done, total: progress(stage, done, total)

    everything = plans(base, gpus, space, scale_up=scale_up_size(system))
    pruned: Counter[str] = Counter()
    work_flops = _work_flops(base, system, registry, work.fast)
    peak = system.peak(base.dtype)
    candidates = []
    for o in everything:
        fill = 1 + (o.pp - 1) / (o.micro_batches * o.virtual_stages)
        recompute = o.activation_recompute if o.recompute_method is None else "none"
        flops = work_flops.get(recompute, work_flops["none"])
        candidates.append(Candidate(o, flops / (gpus * peak) * fill))
    candidates.sort(key=lambda c: c.bound_s)
    keep = max(top, refine)
    best: list[Candidate] = []
    priced = 0
    # in order of the bound, a batch at a time (one plan where the work runs here): each plan
    # checked by the closed forms, then priced; the plans of a batch past the stop are
    # evaluated in vain, never counted: the same result on any engine
    batch = 1 if runner.workers == 1 and runner.client is None else 64 * runner.workers
    n = 0
    stopped = False
    while n < len(candidates) and not stopped:
        if progress is not None:
            progress("analytical", n, len(candidates))
        group = candidates[n : n + batch]
        if len(best) >= keep and group[0].bound_s > best[keep - 1].time_s:
            break
        evaluated = runner.map(_evaluate_plans, work, [c.options for c in group])
        for candidate, (reason, memory, analytical) in zip(group, evaluated, strict=True):
            if len(best) >= keep and candidate.bound_s > best[keep - 1].time_s:
                stopped = True
                break
            n += 1
            if reason:
                pruned[reason] += 1
                continue
            candidate.memory = memory
            candidate.analytical = analytical
            priced += 1
            best.append(candidate)
            best.sort(key=lambda c: c.time_s)
            del best[keep:]
    if n < len(candidates):
        pruned["lower bound above the best times"] += len(candidates) - n
    if progress is not None:
        progress("analytical", len(candidates), len(candidates))
    refined = 0
    if refine > 0 and work.full:
        chosen = best[:refine]
        # plans the DAG predictor cannot tell apart are replayed once
        keys = [twin_key(c.options, work.full) for c in chosen]
        firsts = {k: c.options for k, c in reversed(list(zip(keys, chosen, strict=True)))}
        distinct = list(dict.fromkeys(keys))
        reports = runner.map(
            _refine_plans, work, [firsts[k] for k in distinct], report("DAG predictor")
        )
        replayed = dict(zip(distinct, reports, strict=True))
        for candidate, key in zip(chosen, keys, strict=True):
            dag = replayed[key]
            if dag is not None:
                candidate.dag = dict(dag)
                refined += 1
        best[:refine] = sorted(chosen, key=lambda c: c.time_s)
    return SearchResult(best[:top], len(everything), pruned, priced, refined)


def plan_label(plan: Mapping[str, Any]) -> str:
    return f"dp {plan['dp']} tp {plan['tp']} pp {plan['pp']} ep {plan['ep']} cp {plan['cp']}"


__all__ = ["Candidate", "SearchResult", "SearchSpace", "plans", "search"]
