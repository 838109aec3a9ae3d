"""Per-group precision plans for a hybrid cluster (QSync's planner): lose as little precision
as possible while the iteration keeps pace.

In synchronous data parallelism the iteration takes as long as the slowest device group (the
*straggler*): the others wait at the gradient reduction. Lowering the precision of some ops on
the straggler shortens its local time (faster kernels, minus the casts they add) until the
group is no longer the slowest, or the iteration meets a **target time**. The default target
is what the all-high-precision plan takes on the fastest group alone: the same workload on a
cluster of only the fastest group's GPUs (its device, node link and network).

**Lost precision.** A change puts op ``o`` of group ``g`` into dtype ``d`` (every layer, and
its backward matmuls, as a one-group plan does). Its cost is ``share(g) · s(o, d)``, where
``share(g)`` is the group's fraction of the ranks (of the global batch, in data parallelism:
its gradients' weight in the average) and ``s(o, d)`` the op's sensitivity to ``d``:

- from a **sensitivity file** the user measured in their training (QSync's indicator: the
  variance that quantizing the op adds to the gradient), JSON
  ``{"ops": {"fc1": {"int8": 0.02, "fp16": 0.001}, "fc2": 0.5}}``: per op either a score per
  dtype, or one number that scales the dtype's rounding error ``s = score · RISK[d]``;
  an op the file does not name, or a dtype its entry lacks, cannot be lowered;
- without one, the **proxy** ``s(o, d) = RISK[d] - RISK[base]``: the increase of the relative
  rounding error of a typical value (:data:`stg.explore.precision_search.RISK`), the same for
  every op.

**Greedy** (as QSync's): starting from every op in the workload's dtype on every group, each
step considers every single change on the current straggler group (one op, or together the
ops that read one saved input: ``SHARED_INPUT_GROUPS``), to a lower-precision dtype in
``dtypes`` that runs natively there (fp8/int8 need a registered kernel for the group's
device), keeping every group's predicted peak memory within its capacity (or the budget); it
applies the one with the largest predicted iteration-time saving per unit of added lost
precision, and stops when the target is met or no change saves time. While some group does
not fit its memory, the best change is the one that saves the most memory on such a group per
unit of lost precision. Ties break by group, op and dtype, so the search is deterministic.

**Exact** (``exact=True``, for small op counts): every assignment of a dtype (the workload's or
a lower native one the sensitivities allow) to every op of every group but the fastest (the
group with the shortest local time under the all-high plan; lowering it cannot shorten the
iteration while another group is slower) is predicted; the answer is the plan of least lost
precision among those that fit every group's memory and meet the target (ties: the faster),
or, when none meets it, the fastest plan that fits (ties: the least lost precision). Greedy
is not optimal: a change with the best gain per lost precision can leave the target just out
of reach, so that a second change is needed where two others would have cost less
(tests/test_hybrid.py shows such a case).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from stg.core.options import GenerateOptions
from stg.core.precision import PrecisionPlan
from stg.errors import UserError
from stg.explore.precision_search import RISK, SHARED_INPUT_GROUPS, plan_ops
from stg.host.registry import Registry
from stg.perf.hybrid import HybridSystem, placed
from stg.perf.kernels import kernel_table
from stg.perf.system import normalize_dtype

Sensitivity = Mapping[str, Mapping[str, float]]
"""op -> dtype -> lost precision of running that op in that dtype (on every rank)."""


def load_sensitivity(path: str | Path) -> dict[str, Any]:
    """Read a sensitivity file (see the module docstring); one-line errors."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"--sensitivity {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"--sensitivity {path}: not readable JSON ({exc})") from None
    expected = (
        f'--sensitivity {path}: expected {{"ops": {{"<op>": <score> or '
        f'{{"<dtype>": <score>}}}}}} with scores >= 0'
    )
    if not isinstance(data, dict) or not isinstance(data.get("ops"), dict):
        raise UserError(expected)
    for op, entry in data["ops"].items():
        scores = entry.values() if isinstance(entry, dict) else [entry]
        for score in scores:
            if isinstance(score, bool) or not isinstance(score, int | float) or score < 0:
                raise UserError(f"{expected}; op {op!r} has {entry!r}")
        if isinstance(entry, dict):
            for dtype in entry:
                normalize_dtype(dtype)
    return data["ops"]


def sensitivity_table(
    ops: Iterable[str], dtypes: Sequence[str], base: str, scores: Mapping[str, Any] | None
) -> dict[str, dict[str, float]]:
    """``s(op, dtype)`` for every op and lower-precision dtype that may be chosen."""
    table: dict[str, dict[str, float]] = {}
    for op in ops:
        row: dict[str, float] = {}
        for dtype in dtypes:
            if RISK[dtype] <= RISK[base]:
                continue
            if scores is None:
                row[dtype] = RISK[dtype] - RISK[base]
                continue
            entry = scores.get(op)
            if isinstance(entry, Mapping):
                named = {normalize_dtype(k): float(v) for k, v in entry.items()}
                if dtype in named:
                    row[dtype] = named[dtype]
            elif entry is not None:
                row[dtype] = float(entry) * RISK[dtype]
        table[op] = row
    return table


@dataclass(frozen=True)
class HybridEvaluation:
    """Predicted iteration time, per-group local time and peak memory of one plan."""

    plan: PrecisionPlan
    time_s: float
    local_s: Mapping[str, float]
    """compute + casts of each group's slowest rank"""
    peak_bytes: Mapping[str, float]
    straggler: str

    def fits(self, capacity: Mapping[str, float]) -> bool:
        return all(self.peak_bytes[g] <= capacity[g] for g in capacity)


@dataclass(frozen=True)
class HybridStep:
    group: str
    op: str
    dtype: str
    previous: str
    time_s: float
    lost: float


@dataclass(frozen=True)
class HybridResult:
    baseline: HybridEvaluation
    best: HybridEvaluation
    target_s: float
    target_source: str
    capacity: Mapping[str, float]
    steps: tuple[HybridStep, ...]
    lost: float
    evaluations: int
    shares: Mapping[str, float]
    proxy: bool

    @property
    def met(self) -> bool:
        return self.best.time_s <= self.target_s

    def as_dict(self) -> dict[str, Any]:
        def ev(e: HybridEvaluation) -> dict[str, Any]:
            return {
                "iteration_time_s": e.time_s,
                "straggler": e.straggler,
                "groups": {
                    g: {
                        "local_time_s": e.local_s[g],
                        "peak_bytes": e.peak_bytes[g],
                        "capacity_bytes": self.capacity[g],
                        "fits": e.peak_bytes[g] <= self.capacity[g],
                    }
                    for g in self.capacity
                },
            }

        return {
            "target_s": self.target_s,
            "target": self.target_source,
            "target_met": self.met,
            "lost_precision": self.lost,
            "lost_precision_measure": "proxy (RISK)" if self.proxy else "sensitivity file",
            "group_shares": dict(self.shares),
            "baseline": ev(self.baseline),
            "best": ev(self.best),
            "steps": [
                {
                    "group": s.group,
                    "op": s.op,
                    "dtype": s.dtype,
                    "from": s.previous,
                    "iteration_time_s": s.time_s,
                    "lost_precision": s.lost,
                }
                for s in self.steps
            ],
            "evaluations": self.evaluations,
        }


def _qualified(plans: Mapping[str, Mapping[str, str]]) -> PrecisionPlan:
    return tuple(
        sorted((f"{g}:{op}", dtype) for g, ops in plans.items() for op, dtype in ops.items())
    )


def search_hybrid_precision(
    options: GenerateOptions,
    registry: Registry,
    system: HybridSystem,
    *,
    target_s: float | None = None,
    dtypes: Sequence[str] = ("fp16", "bf16", "fp8", "int8"),
    sensitivity: Mapping[str, Any] | None = None,
    budget: float | None = None,
    kernels: Iterable[Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> HybridResult:
    """The greedy search of the module docstring. ``options`` must carry no precision plan;
    their placement is the system's (rank order) unless given. ``budget`` caps every group's
    memory below its capacity."""
    search = _setup(
        options,
        registry,
        system,
        target_s=target_s,
        dtypes=dtypes,
        sensitivity=sensitivity,
        budget=budget,
        kernels=kernels,
        progress=progress,
    )
    base, scores, capacity, shares = search.base, search.scores, search.capacity, search.shares
    moves: list[tuple[str, tuple[str, ...], str]] = []
    for g in search.groups:
        native = search.native[g.name]
        for op, dtype in sorted(native):
            moves.append((g.name, (op,), dtype))
        for shared in SHARED_INPUT_GROUPS:
            for dtype in search.allowed:
                if all((op, dtype) in native for op in shared):
                    moves.append((g.name, shared, dtype))
    plans: dict[str, dict[str, str]] = {g.name: {} for g in search.groups}
    best = search.baseline
    lost = 0.0
    steps: list[HybridStep] = []
    while best.time_s > search.target_s or not best.fits(capacity):
        fits = best.fits(capacity)
        over = [g for g in capacity if best.peak_bytes[g] > capacity[g]]
        choice: tuple[float, str, tuple[str, ...], str, HybridEvaluation, float] | None = None
        for group, members, dtype in moves:
            if fits and group != best.straggler:
                continue  # only the straggler's local time sets the pace
            if not fits and group not in over:
                continue
            current = plans[group]
            if any(RISK[dtype] <= RISK[current.get(op, base)] for op in members):
                continue
            added = shares[group] * sum(
                scores[op][dtype] - scores[op].get(current.get(op, base), 0.0) for op in members
            )
            changed = {**current, **dict.fromkeys(members, dtype)}
            trial = search.evaluate(_qualified({**plans, group: changed}))
            if fits:
                gain = best.time_s - trial.time_s
                if gain <= 0 or not trial.fits(capacity):
                    continue
            else:
                gain = best.peak_bytes[group] - trial.peak_bytes[group]
                if gain <= 0:
                    continue
            score = gain / added if added > 0 else math.inf
            if choice is None or score > choice[0]:
                choice = (score, group, members, dtype, trial, added)
        if choice is None:
            break
        _, group, members, dtype, trial, added = choice
        previous = "/".join(sorted({plans[group].get(op, base) for op in members}))
        plans[group].update(dict.fromkeys(members, dtype))
        lost += added
        best = trial
        steps.append(HybridStep(group, "+".join(members), dtype, previous, trial.time_s, lost))
    if not best.fits(capacity):
        over = [g for g in capacity if best.peak_bytes[g] > capacity[g]]
        raise UserError(
            f"no plan fits the memory of group {over[0]!r}: the smallest predicted peak is "
            f"{best.peak_bytes[over[0]] / 2**30:.2f} GiB per GPU, capacity "
            f"{capacity[over[0]] / 2**30:.2f} GiB"
        )
    return search.result(best, steps, lost, sensitivity is None)


def _setup(
    options: GenerateOptions,
    registry: Registry,
    system: HybridSystem,
    *,
    target_s: float | None,
    dtypes: Sequence[str],
    sensitivity: Mapping[str, Any] | None,
    budget: float | None,
    kernels: Iterable[Any] | None,
    progress: Callable[[str, int, int], None] | None,
) -> _Search:
    from stg.core.pipeline import build_workload

    if options.precision:
        raise UserError("stg plan precision starts from --dtype; do not give --precision_plan")
    options = placed(options, system)
    search = _Search(options, registry, system, budget, kernels, progress)
    base = normalize_dtype(options.dtype)
    allowed = [normalize_dtype(d) for d in dtypes]
    search.baseline = search.evaluate(())
    search.target_source = "given"
    if target_s is None:
        fastest = search.fastest()
        alone = build_workload(replace(options, placement=()), registry)
        predict_time = registry.predictors.get("time").predict
        target_s = float(
            predict_time(alone, fastest.device, kernels=search.records)["iteration_time_s"]
        )
        search.target_source = (
            f"all-{base} plan on {len(alone.ranks)} x {fastest.device.name} ({fastest.name} alone)"
        )
        del alone
    search.target_s = target_s
    ops = plan_ops(build_workload(replace(options, placement=()), registry))
    search.ops = ops
    search.scores = sensitivity_table(ops, allowed, base, sensitivity)
    for g in search.groups:
        table = kernel_table(search.records, g.device.name)
        search.native[g.name] = {
            (op, d) for op, kind in ops.items() for d in search.scores[op] if table.native(kind, d)
        }
    search.allowed = allowed
    search.base = base
    return search


class _Search:
    """What both searches share: the evaluations (cached), groups, shares and capacities."""

    def __init__(
        self,
        options: GenerateOptions,
        registry: Registry,
        system: HybridSystem,
        budget: float | None,
        kernels: Iterable[Any] | None,
        progress: Callable[[str, int, int], None] | None,
    ) -> None:
        self.options = options
        self.registry = registry
        self.system = system
        self.progress = progress
        self.records = list(kernels if kernels is not None else registry.kernels)
        ranks: dict[str, int] = {}
        for name, count in options.placement:
            ranks[name] = ranks.get(name, 0) + count
        self.groups = [g for g in system.groups if g.name in ranks]
        self.shares = {g.name: ranks[g.name] / options.world_size for g in self.groups}
        self.capacity = {
            g.name: float(
                g.device.hbm_capacity if budget is None else min(budget, g.device.hbm_capacity)
            )
            for g in self.groups
        }
        self.cache: dict[PrecisionPlan, HybridEvaluation] = {}
        self.native: dict[str, set[tuple[str, str]]] = {}
        self.baseline: HybridEvaluation
        self.target_s = 0.0
        self.target_source = ""
        self.ops: dict[str, str] = {}
        self.scores: dict[str, dict[str, float]] = {}
        self.allowed: list[str] = []
        self.base = ""

    def evaluate(self, plan: PrecisionPlan) -> HybridEvaluation:
        from stg.core.pipeline import build_workload

        if plan not in self.cache:
            registry = self.registry
            workload = build_workload(replace(self.options, precision=plan), registry)
            time = registry.predictors.get("time").predict(
                workload, self.system, kernels=self.records
            )
            memory = registry.predictors.get("memory").predict(
                workload, self.system, kernels=self.records
            )
            local = {g: e["compute_s"] + e["casts_s"] for g, e in time["groups"].items()}
            peaks = {g: float(e["peak_bytes"]) for g, e in memory["groups"].items()}
            self.cache[plan] = HybridEvaluation(
                plan, float(time["iteration_time_s"]), local, peaks, time["straggler"]
            )
            if self.progress:
                self.progress("plans evaluated", len(self.cache), 0)
        return self.cache[plan]

    def fastest(self) -> Any:
        return min(self.groups, key=lambda g: (self.baseline.local_s[g.name], g.name))

    def lost(self, plans: Mapping[str, Mapping[str, str]]) -> float:
        return sum(
            self.shares[g] * self.scores[op][dtype]
            for g, ops in plans.items()
            for op, dtype in ops.items()
        )

    def result(
        self, best: HybridEvaluation, steps: Sequence[HybridStep], lost: float, proxy: bool
    ) -> HybridResult:
        return HybridResult(
            self.baseline,
            best,
            self.target_s,
            self.target_source,
            self.capacity,
            tuple(steps),
            lost,
            len(self.cache),
            self.shares,
            proxy,
        )


EXACT_LIMIT = 4096
"""Most plans the exact search predicts; beyond it the command asks for the greedy one."""


def exact_hybrid_precision(
    options: GenerateOptions,
    registry: Registry,
    system: HybridSystem,
    *,
    target_s: float | None = None,
    dtypes: Sequence[str] = ("fp16", "bf16", "fp8", "int8"),
    sensitivity: Mapping[str, Any] | None = None,
    budget: float | None = None,
    kernels: Iterable[Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    limit: int = EXACT_LIMIT,
) -> HybridResult:
    """The exact search of the module docstring (raises :class:`UserError` beyond ``limit``
    plans or when no plan fits every group's memory)."""
    import itertools

    search = _setup(
        options,
        registry,
        system,
        target_s=target_s,
        dtypes=dtypes,
        sensitivity=sensitivity,
        budget=budget,
        kernels=kernels,
        progress=progress,
    )
    fastest = search.fastest().name
    slots = [
        (g.name, op, [None, *sorted(d for o, d in search.native[g.name] if o == op)])
        for g in search.groups
        if g.name != fastest
        for op in sorted(search.ops)
    ]
    slots = [slot for slot in slots if len(slot[2]) > 1]
    count = math.prod(len(choices) for _, _, choices in slots)
    if count > limit:
        raise UserError(
            f"--exact would predict {count} plans (more than {limit}); narrow --dtypes or the "
            "sensitivity file's ops, or use the greedy search (without --exact)"
        )
    best_key: tuple[Any, ...] | None = None
    best: tuple[HybridEvaluation, dict[str, dict[str, str]], float] | None = None
    for choice in itertools.product(*(choices for _, _, choices in slots)):
        plans: dict[str, dict[str, str]] = {}
        for (group, op, _), dtype in zip(slots, choice, strict=True):
            if dtype is not None:
                plans.setdefault(group, {})[op] = dtype
        trial = search.evaluate(_qualified(plans))
        if not trial.fits(search.capacity):
            continue
        lost = search.lost(plans)
        met = trial.time_s <= search.target_s
        key = (0, lost, trial.time_s) if met else (1, trial.time_s, lost)
        if best_key is None or key < best_key:
            best_key, best = key, (trial, plans, lost)
    if best is None:
        raise UserError("no plan fits every group's memory")
    trial, plans, lost = best
    steps = [
        HybridStep(group, op, dtype, search.base, trial.time_s, lost)
        for group, ops in sorted(plans.items())
        for op, dtype in sorted(ops.items())
    ]
    return search.result(trial, steps, lost, sensitivity is None)


__all__ = [
    "EXACT_LIMIT",
    "HybridEvaluation",
    "HybridResult",
    "HybridStep",
    "exact_hybrid_precision",
    "load_sensitivity",
    "search_hybrid_precision",
    "sensitivity_table",
]
