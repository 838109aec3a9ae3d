"""Capacity planning for serving: the fewest GPUs that serve a request stream within SLOs.

For every replica shape (tensor-parallel and pipeline degrees, for an MoE model the experts
split over ``ep`` GPUs, folded over the ``tp`` GPUs or multiplying the replica with
data-parallel attention (:func:`stg.explore.serve_cost.expert_parallel`), KV-cache dtype,
token budget per iteration) the search simulates the stream
(:func:`stg.explore.serve.simulate`) on a growing number of
replicas, aggregated or split into prefill and decode pools, and keeps the smallest count
whose latency percentiles meet the limits (e.g. p99 TTFT under 2 s and p90 TPOT under
50 ms). More replicas never lengthen the queues a stream meets, so the count is found by
doubling and then bisection; a disaggregated layout of ``n`` replicas tries every split of
``n`` into prefill and decode replicas. A shape whose weights leave no KV-cache block, or
that the pricer refuses, is skipped with its reason. Plans come back cheapest first (GPUs,
then the constrained percentiles). A replica of ``pp`` stages runs as vLLM V0 runs a
pipeline: ``pp`` virtual engines, each with its own scheduler and ``1/pp`` of the KV blocks
(:func:`stg.explore.serve_cost.pipeline_pricer`); so does a replica of ``ep`` data-parallel
attention ranks (``ep`` virtual engines); both are planned aggregated only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from stg.core.options import GenerateOptions
from stg.errors import UserError
from stg.explore.serve import EngineConfig, Simulation, request_table, simulate
from stg.explore.serve_cost import (
    EP_LAYOUTS,
    expert_parallel,
    kv_transfer,
    pipeline_pricer,
    replica_blocks,
)
from stg.explore.serve_requests import Stream
from stg.explore.serving_search import uses_experts


@dataclass(frozen=True)
class Limits:
    """Latency limits: percentile (0-100) and seconds, for TTFT and TPOT (None: no limit)."""

    ttft: tuple[float, float] | None = None
    tpot: tuple[float, float] | None = None

    def measure(self, sim: Simulation) -> dict[str, float]:
        table = request_table(sim)
        out = {}
        for name, limit, column in (("ttft", self.ttft, "ttft_s"), ("tpot", self.tpot, "tpot_s")):
            if limit is not None:
                values = table[column][~np.isnan(table[column])]
                out[name] = float(np.percentile(values, limit[0])) if len(values) else 0.0
        return out

    def met(self, measured: dict[str, float]) -> bool:
        return all(
            measured[name] <= limit[1]
            for name, limit in (("ttft", self.ttft), ("tpot", self.tpot))
            if limit is not None
        )


@dataclass
class CapacityPlan:
    """The smallest layout of one replica shape that meets the limits."""

    tp: int
    kv_dtype: str
    max_num_batched_tokens: int
    replicas: int
    prefill_replicas: int
    measured: dict[str, float]
    pp: int = 1
    ep: int = 1
    """GPUs the experts split over (see ``ep_layout``)"""
    ep_layout: str = "fold"
    """fold: ep of the tp GPUs (a replica of tp · pp GPUs); multiply: ep data-parallel
    attention ranks of tp GPUs (tp · pp · ep GPUs)"""

    @property
    def attention_ranks(self) -> int:
        return self.ep if self.ep_layout == "multiply" else 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.attention_ranks * (self.replicas + self.prefill_replicas)

    def as_dict(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "ep_layout": self.ep_layout,
            "kv_dtype": self.kv_dtype,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "layout": "disaggregated" if self.prefill_replicas else "aggregated",
            "replicas": self.replicas,
            "prefill_replicas": self.prefill_replicas,
            **{f"{k}_s": v for k, v in self.measured.items()},
        }


@dataclass
class CapacityResult:
    plans: list[CapacityPlan]
    skipped: dict[str, str] = field(default_factory=dict)
    """replica shapes left out, with the reason"""
    simulations: int = 0


def _smallest(most: int, ok: Callable[[int], bool]) -> int | None:
    """The smallest n in [1, most] with ``ok(n)``, for ``ok`` false below some n and true from
    it (None if none): doubling, then bisection; each n is tried once."""
    seen: dict[int, bool] = {}

    def tried(n: int) -> bool:
        if n not in seen:
            seen[n] = ok(n)
        return seen[n]

    high = 1
    while high < most and not tried(high):
        high *= 2
    high = min(high, most)
    if not tried(high):
        return None
    low = high // 2 + 1 if high > 1 else 1
    while low < high:
        mid = (low + high) // 2
        if tried(mid):
            high = mid
        else:
            low = mid + 1
    return high


@dataclass(frozen=True)
class _Planning:
    """What every replica shape of one search shares (picklable): where a worker finds the
    registry and the system (this process's own under ``token``, else loaded again)."""

    token: str
    plugins: tuple[str, ...]
    system_name: str
    system_data: dict[str, Any]
    stream: Stream
    base: GenerateOptions
    limits: Limits
    max_gpus: int
    layouts: tuple[str, ...]
    engine: EngineConfig
    memory_fraction: float


_PLANNINGS: dict[str, tuple[Any, Any]] = {}
"""token -> (registry, system) of the searches this process (or its parent, forked) runs."""


def _resolve(work: _Planning) -> tuple[Any, Any]:
    if work.token not in _PLANNINGS:  # a Dask worker: load the registry and system
        from stg.explore.sweep import _registry, _system

        _PLANNINGS[work.token] = (
            _registry(work.plugins),
            _system(work.system_name, work.system_data),
        )
    return _PLANNINGS[work.token]


@dataclass
class _ShapeResult:
    plans: list[CapacityPlan]
    skipped: str | None
    simulations: int


def _plan_shapes(
    work: _Planning, shapes: Sequence[tuple[int, int, int, str, str | None, int]]
) -> list[_ShapeResult]:
    return [_plan_shape(work, *shape) for shape in shapes]


def _plan_shape(
    work: _Planning, tp: int, pp: int, ep: int, layout: str, kv: str | None, budget: int
) -> _ShapeResult:
    """The fewest replicas of one shape, aggregated and disaggregated, within the limits."""
    registry, system = _resolve(work)
    base, limits = work.base, work.limits
    out = _ShapeResult([], None, 0)
    ranks = ep if layout == "multiply" else 1  # data-parallel attention ranks
    if tp * pp * ranks > work.max_gpus:
        out.skipped = f"more GPUs per replica than {work.max_gpus}"
        return out
    try:
        options = expert_parallel(replace(base, tp=tp, pp=pp, kv_dtype=kv), ep, registry, layout)
        pricer = pipeline_pricer(options, system, registry)
        blocks = replica_blocks(
            pricer,
            options,
            registry,
            tokens=budget,
            block_size=work.engine.block_size,
            memory_fraction=work.memory_fraction,
        )
    except UserError as exc:
        out.skipped = str(exc)
        return out
    if blocks // pp < 1:
        out.skipped = "the weights and activations leave no KV-cache block"
        return out
    # pp virtual engines per replica, each with 1/pp of the blocks (vLLM V0's Scheduler),
    # and one per data-parallel attention rank
    engines = pp * ranks
    config = replace(work.engine, blocks=blocks // pp, max_num_batched_tokens=budget)
    most = work.max_gpus // (tp * pp * ranks)

    def attempt(replicas: int, prefill: int) -> dict | None:
        """The percentiles of one layout if it meets the limits (None otherwise)."""
        out.simulations += 1
        try:
            sim = simulate(
                work.stream,
                pricer,
                replace(config, replicas=replicas * engines, prefill_replicas=prefill),
                transfer_time=kv_transfer(pricer),
            )
        except UserError:
            return None  # a request that never fits this replica's cache
        measured = limits.measure(sim)
        return measured if limits.met(measured) else None

    kv_name = kv or base.dtype
    if "aggregated" in work.layouts:
        found: dict[int, dict] = {}

        def aggregated(n: int) -> bool:
            measured = attempt(n, 0)
            if measured is not None:
                found[n] = measured
            return measured is not None

        n = _smallest(most, aggregated)
        if n is not None:
            out.plans.append(CapacityPlan(tp, kv_name, budget, n, 0, found[n], pp, ep, layout))
    if "disaggregated" in work.layouts and most >= 2 and engines == 1:
        split: dict[int, tuple[int, dict]] = {}

        def disaggregated(n: int) -> bool:
            for prefill in range(1, n):
                measured = attempt(n - prefill, prefill)
                if measured is not None:
                    split[n] = (prefill, measured)
                    return True
            return False

        n = _smallest(most, lambda n: n >= 2 and disaggregated(n))
        if n is not None:
            prefill, measured = split[n]
            out.plans.append(
                CapacityPlan(
                    tp, kv_name, budget, n - prefill, prefill, measured, ep=ep, ep_layout=layout
                )
            )
    return out


def serving_capacity(
    stream: Stream,
    base: GenerateOptions,
    system: Any,
    registry: Any,
    limits: Limits,
    *,
    max_gpus: int,
    tps: Sequence[int] = (1, 2, 4, 8),
    pps: Sequence[int] = (1,),
    eps: Sequence[int] = (1,),
    ep_layouts: Sequence[str] = ("fold",),
    kv_dtypes: Sequence[str | None] = (None,),
    budgets: Sequence[int] = (2048,),
    layouts: Sequence[str] = ("aggregated", "disaggregated"),
    engine: EngineConfig | None = None,
    memory_fraction: float = 0.9,
    progress: Callable[[str, int, int], None] | None = None,
    runner: Any = None,
    plugins: Sequence[str] = (),
) -> CapacityResult:
    """The cheapest layouts of each replica shape that serve ``stream`` within ``limits``
    on at most ``max_gpus`` GPUs (see the module docstring). ``eps``: expert-parallel
    degrees of an MoE model, each tried in every layout of ``ep_layouts``
    (:func:`stg.explore.serve_cost.expert_parallel`; folded, with every ``tp`` it divides).
    The shapes are planned on
    ``runner`` (an :class:`stg.explore.sweep.Engine`: a process pool or a Dask cluster whose
    workers load ``plugins``, those of ``registry``), or in this process; the result is the
    same."""
    import uuid

    from stg.explore.sweep import Engine

    if limits.ttft is None and limits.tpot is None:
        raise UserError("capacity planning needs a latency limit (TTFT or TPOT)")
    if max_gpus < 1:
        raise UserError(f"--gpus {max_gpus}: must be a positive integer")
    unknown = sorted(set(layouts) - {"aggregated", "disaggregated"})
    if unknown:
        raise UserError(f"layouts {unknown}: allowed values are aggregated, disaggregated")
    work = _Planning(
        uuid.uuid4().hex,
        tuple(plugins),
        system.name,
        system.as_dict(),
        stream,
        base,
        limits,
        max_gpus,
        tuple(layouts),
        engine or EngineConfig(),
        memory_fraction,
    )
    if max(eps) > 1 and not uses_experts(base, registry):
        raise UserError(f"--ep {max(eps)}: model {base.model!r} has no experts to split")
    bad = sorted(set(ep_layouts) - set(EP_LAYOUTS))
    if bad:
        raise UserError(f"--ep_layout {bad}: allowed values are {', '.join(EP_LAYOUTS)}")
    placements = sorted({(ep, layout if ep > 1 else "fold") for ep in eps for layout in ep_layouts})
    shapes = [
        (tp, pp, ep, layout, kv, budget)
        for tp in tps
        for pp in pps
        for ep, layout in placements
        if layout == "multiply" or tp % ep == 0
        for kv in kv_dtypes
        for budget in budgets
    ]
    if not shapes:
        raise UserError(
            f"--ep {','.join(map(str, eps))}: folded, the experts split over a replica's tp "
            f"GPUs; allowed: divisors of a --tp value ({','.join(map(str, tps))}), or "
            "--ep_layout multiply"
        )
    report = None if progress is None else (lambda d, t: progress("replica shapes", d, t))
    _PLANNINGS[work.token] = (registry, system)
    own = runner is None
    runner = Engine(1) if own else runner
    try:
        results = runner.map(_plan_shapes, work, shapes, report)
    finally:
        del _PLANNINGS[work.token]
        if own:
            runner.close()
    result = CapacityResult([])
    for (tp, pp, ep, layout, kv, budget), shape in zip(shapes, results, strict=True):
        result.simulations += shape.simulations
        result.plans.extend(shape.plans)
        if shape.skipped is not None:
            experts = f", ep {ep}" + (" multiply" if layout == "multiply" else "")
            stages = (experts if ep > 1 else "") + (f", pp {pp}" if pp > 1 else "")
            name = f"tp {tp}{stages}, KV {kv or base.dtype}, budget {budget}"
            result.skipped[name] = shape.skipped
    result.plans.sort(
        key=lambda p: (
            p.gpus,
            tuple(p.measured.values()),
            p.tp,
            p.pp,
            p.ep,
            p.ep_layout,
            p.max_num_batched_tokens,
        )
    )
    return result


__all__ = ["CapacityPlan", "CapacityResult", "Limits", "serving_capacity"]
