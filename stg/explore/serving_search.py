"""``stg search --phase prefill|decode|mixed``: the serving plans of most tokens per second.

A serving plan is a model replica of ``tp · pp · ep`` GPUs, ``dp`` independent replicas
(``dp · tp · pp · ep`` = the GPU count), the sequences each replica serves at once (its
batch), the micro-batches that fill its pipeline (1 or ``pp``) and, where asked, the KV
cache's dtype. There is no recompute, ZeRO or schedule to choose: serving has no backward.

The objective is the tokens per second of all replicas together (every plan uses all the
GPUs, so per GPU it ranks the same), subject to a limit on the time per output token
(``max_tpot``: decode and mixed) or the time to first token (``max_ttft``: prefill), and to
memory (weights, KV cache and activations within the GPU). The search:

1. drops the structures (tp, pp, ep, micro-batches) the divisibility rules reject
   (:func:`stg.core.pipeline.validate_options`), building each once at its smallest batch
   (the probe);
2. caps each structure's batch at the largest that fits (the memory predictor: weights plus
   KV cache and activations per sequence, read again near that batch);
3. bounds a step from below in closed form, the memory-bandwidth bound of the serving
   predictor: every weight once per micro-batch and the KV cache once, at HBM bandwidth,
   ``max(max_stage(m·W_s + KV_s), Σ_s (W_s + KV_s / m)) / HBM``, with the KV bytes per
   sequence read off the probe (exact: the cache is linear in the sequences). A structure
   whose bound breaks the latency limit at its smallest batch is dropped unpriced, and the
   bound caps its batch further;
4. prices the structures with the ``serving`` predictor in decreasing order of their tokens/s
   ceiling (``tokens / bound`` at the capped batch; it grows with the batch) and stops once
   the ceiling falls below the k-th best tokens/s found. A step's time grows with the batch
   only up to dips at kernel boundaries (the kernel model tiles a GEMM's rows by 64 to 256,
   and the decode attention splits the keys over the SMs), so no bisection on the batch is
   exact. A replica without an expert split or micro-batches (a pipeline of one micro-batch
   included) in a prefill or decode step is priced at every batch up to its cap (at most
   :data:`SCAN_UNITS`) by :class:`stg.explore.serve_cost.IterationPricer`, the replay's own
   sum of node times without building a workload; the batch of most tokens/s within the
   limit is then priced by the serving predictor, which must agree. Other structures (an
   expert split, pp micro-batches, a mixed step, a larger cap) keep the largest batch
   within the limit, bisected when
   the capped batch is over it (and the :data:`RESCAN_UNITS` batch steps above the bisected
   one priced too), or a smaller one on a 64-sequence tile where that gives more tokens/s.

With explicit batches (``ServingSpace.batch`` or ``replica_batch``) every such plan is a
candidate of its own, pruned by memory and the bound and priced in the same order.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from stg.core.options import GenerateOptions
from stg.core.plan import check_sizes
from stg.errors import UserError
from stg.explore.search import divisors, powers_of_two_upto

SERVING_PHASES = ("prefill", "decode", "mixed")
# Sequences per rank and micro-batch on whose multiples the batch is also tried: GEMM kernels
# tile their rows by 64 to 256 (stg.perf.kernel_time), so a step's time jumps past each.
TILE_TOKENS = 64
# Batch steps above the bisected largest batch that are priced as well, where the affine
# pricer cannot scan every batch (see serving_search)
RESCAN_UNITS = 64
# The most batches of one structure the affine pricer scans (about 2 ms each)
SCAN_UNITS = 1024


@dataclass(frozen=True)
class ServingSpace:
    """The values each serving axis may take (``None``: derived from the model and GPUs).

    ``batch``: the global batch (total concurrency, all replicas), fixed; otherwise the batch
    of one replica takes the values of ``replica_batch``.
    """

    tp: Sequence[int] | None = None
    pp: Sequence[int] | None = None
    ep: Sequence[int] | None = None
    replica_batch: Sequence[int] | None = None
    batch: int | None = None
    kv_dtype: Sequence[str | None] = (None,)


@dataclass
class ServingCandidate:
    options: GenerateOptions
    bound_s: float
    report: dict[str, Any] | None = None
    memory: dict[str, Any] = field(default_factory=dict)

    @property
    def latency_s(self) -> float:
        """The constrained latency: time to first token (prefill), per output token else."""
        report = self.report or {}
        key = "ttft_s" if self.options.phase == "prefill" else "time_per_output_token_s"
        return float(report.get(key, float("inf")))

    @property
    def tokens_per_s(self) -> float:
        return float((self.report or {}).get("tokens_per_s", 0.0))

    def ceiling(self) -> float:
        """Tokens/s no faster than the memory-bandwidth bound allows."""
        return _tokens(self.options) / self.bound_s if self.bound_s > 0 else float("inf")

    def plan(self) -> dict[str, Any]:
        o = self.options
        return {
            "dp": o.dp,
            "tp": o.tp,
            "pp": o.pp,
            "ep": o.ep,
            "batch": o.batch,
            "replica_batch": o.batch // o.dp,
            "micro_batches": o.micro_batches,
            "kv_dtype": o.kv_dtype or o.dtype,
        }

    def as_dict(self, gpus: int) -> dict[str, Any]:
        report = self.report or {}
        out: dict[str, Any] = {
            "plan": self.plan(),
            "memory_bandwidth_bound_s": self.bound_s,
            "tokens_per_s": report.get("tokens_per_s"),
            "tokens_per_s_per_gpu": (report.get("tokens_per_s") or 0.0) / gpus,
            "peak_memory_bytes": self.memory.get("peak_bytes"),
            "kv_cache_bytes": max(
                (c["kv_cache"] for c in self.memory.get("classes", [])), default=0
            ),
            "max_batch": self.memory.get("max_batch"),
        }
        for key in (
            "ttft_s",
            "time_per_output_token_s",
            "prefill_tokens_per_s",
            "output_tokens_per_s",
        ):
            if key in report:
                out[key] = report[key]
        out["explain"] = (report.get("explain") or {}).get("per_step_s")
        return out


@dataclass
class ServingResult:
    best: list[ServingCandidate]
    enumerated: int
    pruned: Counter[str]
    priced: int
    fastest_bound_s: float | None  # the lowest latency bound among plans that fit


def _tokens(o: GenerateOptions) -> int:
    """Tokens one step (run) of the plan produces: the tokens/s numerator."""
    if o.phase == "prefill":
        return o.batch * o.seq
    if o.phase == "mixed":
        return o.prefill_batch * (o.chunk or o.seq) + o.batch
    return o.batch


def uses_experts(base: GenerateOptions, registry: Any) -> bool:
    """Whether ep splits the model's weights (a MoE model), asked of the model itself: the
    weights per rank of one replica with ep 2 against ep 1 (a dense model's are the same)."""
    from stg.core.pipeline import build_workload

    if base.experts < 2 or base.experts % 2:
        return False
    mixed = base.phase == "mixed"
    probe = replace(
        base,
        dp=1,
        tp=1,
        pp=1,
        sp=1,
        ep=1,
        batch=2,
        micro_batch=None,
        prefill_batch=2 if mixed else 0,
    )
    try:
        one, two = (
            build_workload(replace(probe, ep=ep), registry).rank_classes[0].facts["weight_bytes"]
            for ep in (1, 2)
        )
    except UserError:
        return False
    return two < one


def structures(
    base: GenerateOptions, gpus: int, space: ServingSpace, moe: bool
) -> list[tuple[int, int, int, int, str | None]]:
    """(dp, tp, pp, ep, kv_dtype) whose degrees multiply to ``gpus`` (unchecked); ep only for
    a MoE model (for a dense one it would be dp under another name)."""
    tps = space.tp or powers_of_two_upto(min(gpus, 8))
    pps = space.pp or [p for p in divisors(gpus) if p <= base.num_stacks]
    eps = space.ep or ([e for e in divisors(gpus) if base.experts % e == 0] if moe else [1])
    out = []
    for kv in space.kv_dtype:
        for tp in tps:
            for pp in pps:
                for ep in eps:
                    if gpus % (tp * pp * ep):
                        continue
                    out.append((gpus // (tp * pp * ep), tp, pp, ep, kv))
    return out


def _batches(dp: int, ep: int, m: int, space: ServingSpace) -> list[int]:
    """Global batches of a structure given explicitly (``batch``, ``replica_batch``): the
    sequences split over dp replicas, ep attention ranks and m micro-batches."""
    unit = dp * ep * m
    if space.batch is not None:
        return [space.batch] if space.batch % unit == 0 else []
    assert space.replica_batch is not None
    return [b * dp for b in space.replica_batch if (b * dp) % unit == 0]


def _bound(
    facts: list[tuple[int, int, int]], sequences_probe: int, sequences: int, hbm: float
) -> float:
    """Memory-bandwidth bound of one step at ``sequences``, from the probe's per-class
    (micro-batches, weight bytes, first step's KV bytes) at ``sequences_probe``."""
    scale = sequences / sequences_probe
    stage = max((m * w + kv * scale) / hbm for m, w, kv in facts)
    one_pass = sum((w + kv * scale / m) / hbm for m, w, kv in facts)
    return max(stage, one_pass)


def _micro(batch: int, m: int) -> int | None:
    """The global micro-batch of m micro-batches (None: the whole batch)."""
    return None if m == 1 else batch // m


def _keep(best: list[ServingCandidate], candidate: ServingCandidate, top: int) -> None:
    best.append(candidate)
    best.sort(key=lambda c: (-c.tokens_per_s, c.latency_s))
    del best[top:]


def _largest(low: int, high: int, ok: Callable[[int], bool]) -> int:
    """The largest k in [low, high] with ``ok(k)``, for ``ok`` true up to some k and false
    above (``low - 1`` if none)."""
    found = low - 1
    while low <= high:
        mid = (low + high) // 2
        if ok(mid):
            found, low = mid, mid + 1
        else:
            high = mid - 1
    return found


@dataclass
class _Shape:
    """One structure (dp, tp, pp, ep, kv dtype, micro-batches), built once at its probe."""

    probe: GenerateOptions
    unit: int  # the batch moves in steps of dp·ep·m sequences
    fit: int  # the largest global batch that fits (the probe's memory report)
    facts: list[tuple[int, int, int]]
    extra: int  # sequences beside the batch (mixed: the prefilling ones)

    def bound(self, batch: int, hbm: float) -> float:
        return _bound(self.facts, self.probe.batch + self.extra, batch + self.extra, hbm)

    def at(self, batch: int, hbm: float) -> ServingCandidate:
        m = self.probe.micro_batches
        options = replace(self.probe, batch=batch, micro_batch=_micro(batch, m))
        return ServingCandidate(options, self.bound(batch, hbm))


def serving_search(
    base: GenerateOptions,
    gpus: int,
    system: Any,
    registry: Any,
    *,
    space: ServingSpace | None = None,
    max_tpot: float | None = None,
    max_ttft: float | None = None,
    top: int = 5,
    progress: Callable[[str, int, int], None] | None = None,
) -> ServingResult:
    """The ``top`` plans of most tokens/s within the limits (see the module docstring)."""
    from stg.core.pipeline import build_workload, validate_options
    from stg.core.sizes import WorkloadTooLarge
    from stg.explore.search import _call
    from stg.explore.space import normalize_reason
    from stg.explore.sweep import build_within_memory

    if base.phase not in SERVING_PHASES:
        raise UserError(f"serving search needs --phase {'|'.join(SERVING_PHASES)}")
    if gpus < 1:
        raise UserError(f"--gpus {gpus}: must be a positive integer")
    if system.capacity and gpus > system.capacity:
        raise UserError(f"--gpus {gpus} exceeds the {system.capacity} GPUs of {system.name}")
    check_sizes(base)
    limit = max_ttft if base.phase == "prefill" else max_tpot
    space = space or ServingSpace()
    explicit = space.batch is not None or space.replica_batch is not None
    hbm = system.hbm_bandwidth
    kernels = list(registry.kernels)
    serving = registry.predictors.get("serving")
    memory = registry.predictors.get("memory")
    pruned: Counter[str] = Counter()
    enumerated = 0
    fastest: float | None = None
    priced = 0

    def price(candidate: ServingCandidate, count: bool) -> bool:
        """Price one plan; whether it fits and meets the limit (``count``: a rejected plan
        counts as pruned; a bisection's trials do not)."""
        nonlocal priced
        tally: Counter[str] = pruned if count else Counter()
        try:
            validate_options(candidate.options, registry)
            workload = build_within_memory(candidate.options, registry)
        except WorkloadTooLarge:
            tally["size: its workload does not fit in this machine's memory"] += 1
            return False
        except UserError as exc:
            tally[f"divisibility: {normalize_reason(str(exc))}"] += 1
            return False
        candidate.memory = _call(memory.predict, workload, system, kernels=kernels)
        if not candidate.memory.get("fits"):
            tally["memory: weights + KV cache + activations above the GPU"] += 1
            return False
        candidate.report = _call(
            serving.predict, workload, system, registry=registry, kernels=kernels, explain=True
        )
        priced += 1
        if limit is not None and candidate.latency_s > limit:
            tally["latency: predicted above the limit"] += 1
            return False
        return True

    shapes: list[_Shape] = []
    layouts = structures(base, gpus, space, uses_experts(base, registry))
    extra = base.prefill_batch if base.phase == "mixed" else 0
    for i, (dp, tp, pp, ep, kv) in enumerate(layouts):
        if progress is not None:
            progress("closed forms", i, len(layouts))
        # a mixed iteration runs all its requests at once: no micro-batches
        for m in [1] if base.phase == "mixed" else sorted({1, pp}):
            unit = dp * ep * m
            first = _batches(dp, ep, m, space)[:1] if explicit else [unit]
            if not first:
                continue
            probe = replace(
                base,
                dp=dp,
                tp=tp,
                pp=pp,
                ep=ep,
                kv_dtype=kv,
                batch=first[0],
                micro_batch=_micro(first[0], m),
            )
            try:
                validate_options(probe, registry)
                workload = build_workload(probe, registry)
            except UserError as exc:
                enumerated += 1
                pruned[f"divisibility: {normalize_reason(str(exc))}"] += 1
                continue
            mem = _call(memory.predict, workload, system, kernels=kernels)
            facts = [
                (
                    int(rc.facts["micro_batches"]),
                    int(rc.facts["weight_bytes"]),
                    int(rc.facts["kv_cache_bytes_per_step"][0]),
                )
                for rc in workload.rank_classes
            ]
            fit = int(mem.get("max_batch") or 0) if mem.get("fits") else 0
            for _ in range(3):  # the activations per sequence of a small probe overstate
                near = fit // unit * unit  # them: read the largest batch again near it
                if near <= probe.batch:
                    break
                wider = replace(probe, batch=near, micro_batch=_micro(near, m))
                try:
                    validate_options(wider, registry)
                    again = _call(
                        memory.predict, build_workload(wider, registry), system, kernels=kernels
                    )
                except UserError:
                    break
                if int(again.get("max_batch") or 0) == fit:
                    break
                fit = int(again.get("max_batch") or 0)
            shapes.append(_Shape(probe, unit, fit, facts, extra))

    entries: list[tuple[_Shape, ServingCandidate]] = []
    if explicit:
        for shape in shapes:
            o = shape.probe
            for batch in _batches(o.dp, o.ep, o.micro_batches, space):
                enumerated += 1
                if batch > shape.fit:
                    pruned["memory: weights + KV cache + activations above the GPU"] += 1
                    continue
                candidate = shape.at(batch, hbm)
                fastest = candidate.bound_s if fastest is None else min(fastest, candidate.bound_s)
                if limit is not None and candidate.bound_s > limit:
                    pruned["latency: memory-bandwidth bound above the limit"] += 1
                    continue
                entries.append((shape, candidate))
    else:
        # one candidate per structure: its batch capped by memory and the bound (step 2-3)
        for shape in shapes:
            enumerated += 1
            k = shape.fit // shape.unit
            if k < 1:
                pruned["memory: weights + KV cache + activations above the GPU"] += 1
                continue
            low = shape.bound(shape.unit, hbm)
            fastest = low if fastest is None else min(fastest, low)
            if limit is not None:
                if low > limit:
                    pruned["latency: memory-bandwidth bound above the limit"] += 1
                    continue
                k = _largest(1, k, lambda k, s=shape, t=limit: s.bound(k * s.unit, hbm) <= t)
            entries.append((shape, shape.at(k * shape.unit, hbm)))

    pricers: dict[tuple[int, int, str | None], Any] = {}

    def affine(shape: _Shape) -> Callable[[int], float] | None:
        """The step latency of ``shape`` at a replica batch, by the affine pricer (None
        where it does not apply: an expert split, micro-batches, a mixed step, or a replica
        the pricer refuses). A pipeline of one micro-batch passes its stages in turn
        (:func:`stg.explore.serve_cost.pipeline_pricer`)."""
        from stg.explore.serve_cost import Batch, pipeline_pricer

        o = shape.probe
        if o.phase == "mixed" or o.ep > 1 or shape.unit != o.dp or o.micro_batches != 1:
            return None
        key = (o.tp, o.pp, o.kv_dtype)
        if key not in pricers:
            one = replace(o, dp=1, batch=1, micro_batch=None, steps=1, context=None, phase="decode")
            try:
                pricers[key] = pipeline_pricer(one, system, registry)
            except UserError:
                pricers[key] = None
        pricer = pricers[key]
        if pricer is None:
            return None
        if o.phase == "prefill":
            return lambda b: pricer.price(Batch(((o.seq, o.seq),) * b, ()))
        context = o.context or o.seq
        steps = o.steps or 1
        return lambda b: (
            sum(pricer.price(Batch((), (context + 1 + i,) * b)) for i in range(steps)) / steps
        )

    def scanned(shape: _Shape, cap: int) -> ServingCandidate | None:
        """The plan of most tokens/s within the limit over every batch up to ``cap`` units,
        priced affinely and confirmed by the serving predictor; None where the pricer does
        not apply or the predictor disagrees (then the bisection decides)."""
        latency = affine(shape) if cap <= SCAN_UNITS else None
        if latency is None:
            return None
        best_k, best_rate, best_s = 0, -1.0, math.inf
        for k in range(1, cap + 1):
            seconds = latency(k)
            if limit is not None and seconds > limit:
                continue
            rate = _tokens(shape.at(k * shape.unit, hbm).options) / seconds
            if rate >= best_rate:
                best_k, best_rate, best_s = k, rate, seconds
        if not best_k:
            return ServingCandidate(shape.probe, math.inf)  # none within the limit
        trial = shape.at(best_k * shape.unit, hbm)
        if price(trial, count=False) and math.isclose(trial.latency_s, best_s, rel_tol=1e-6):
            return trial
        return None

    entries.sort(key=lambda e: (-e[1].ceiling(), e[1].bound_s))
    best: list[ServingCandidate] = []
    for n, (shape, candidate) in enumerate(entries):
        if progress is not None:
            progress("serving predictor", n, len(entries))
        if len(best) >= top and candidate.ceiling() < best[top - 1].tokens_per_s:
            pruned["tokens/s ceiling below the best found"] += len(entries) - n
            break
        if explicit:
            if price(candidate, count=True):
                _keep(best, candidate, top)
            continue
        # the largest batch of this structure that fits and meets the limit: the capped
        # batch if it does, else bisected (a step's time grows with the batch)
        found: dict[int, ServingCandidate] = {}

        def within(k: int, shape: _Shape = shape, found: dict = found) -> bool:
            trial = shape.at(k * shape.unit, hbm)
            if price(trial, count=False):
                found[k] = trial
                return True
            return False

        cap = candidate.options.batch // shape.unit
        exact = scanned(shape, cap)
        if exact is not None:
            if exact.report is None:
                pruned["latency: predicted above the limit at every batch"] += 1
            else:
                _keep(best, exact, top)
            continue
        most = cap
        if price(candidate, count=False):
            found[most] = candidate
        else:
            most = _largest(1, most - 1, within)
            # a step's time is not monotone in the batch everywhere (kernel tiles, the
            # decode attention's split of the keys over the SMs): a batch above the bisected
            # one may meet the limit again; the next RESCAN_UNITS of them are priced too
            for k in range(most + 1, min(cap, most + RESCAN_UNITS + 1)):
                within(k)
            most = max(found, default=most)
        if most not in found:
            pruned["latency: predicted above the limit at every batch"] += 1
            continue
        # tokens/s is not monotone in the batch: kernels tile the tokens, and a step just
        # past a tile boundary costs a tile more; try the batches on 64-token tiles below
        choice = found[most]
        tile = TILE_TOKENS * shape.unit
        for batch in range(most * shape.unit // tile * tile, 0, -tile):
            trial = shape.at(batch, hbm)
            if trial.ceiling() <= choice.tokens_per_s:
                if shape.probe.phase != "mixed":
                    break  # the ceiling falls with the batch: no smaller batch does better
                continue
            if batch == most * shape.unit:
                continue
            if price(trial, count=False) and trial.tokens_per_s > choice.tokens_per_s:
                choice = trial
        _keep(best, choice, top)
    return ServingResult(best, enumerated, pruned, priced, fastest)


__all__ = [
    "SERVING_PHASES",
    "ServingCandidate",
    "ServingResult",
    "ServingSpace",
    "serving_search",
    "structures",
]
