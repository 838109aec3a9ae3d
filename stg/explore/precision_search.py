"""Greedy search for the fastest per-op precision plan that fits a memory budget (QSync style).

One decision per op name (``fc1``, ``q``, ...; it applies to every layer and to the op's
backward matmuls). Starting from the workload's dtype for every op, each step evaluates every
single change "op -> lower precision" (the workload is regenerated with the changed plan and
both predictors run on it) and applies the best one:

- a candidate dtype must be in ``dtypes``, carry more accuracy risk than the op's current
  dtype (so each op only ever moves down, and the search ends), and run natively for the op's
  class: int8 needs a registered kernel (:mod:`stg.perf.kernels`), and so does fp8 except for
  matmuls on a GPU with fp8 tensor cores (Hopper, as Transformer Engine runs them); a move
  changes one op,
  or together the ops that read one saved input (:data:`SHARED_INPUT_GROUPS`, e.g. q, k, v),
  with the sum of their risks;
- while the plan does not fit the budget, the best change is the one that saves the most
  predicted peak memory per unit of added risk;
- once it fits, the best change is the one with the largest predicted time saving per unit of
  added risk among those that still fit; the search stops when no change makes the iteration
  faster.

Accuracy risk of a dtype is the relative rounding error of a typical value stored in it
(:data:`RISK`): the unit roundoff ``2^-(mantissa bits + 1)`` for floating formats (fp8 is
e4m3), and for int8 with per-tensor absmax scaling half a step of ``absmax/127`` where the
absmax of LLM activations is ~32x their typical magnitude (outliers): ``32/254 ~ 2^-3``.
A change's added risk is the difference of its new and old dtype's risk; ties break by op
name, then dtype, so the search is deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from stg.core.options import GenerateOptions
from stg.core.precision import PrecisionPlan
from stg.errors import UserError
from stg.host.registry import Registry
from stg.perf.calibration import Calibration
from stg.perf.costs import native_fp8
from stg.perf.kernels import KernelTable, is_cast, kernel_table
from stg.perf.system import System, normalize_dtype, op_class

RISK: Mapping[str, float] = {
    "fp32": 2.0**-24,
    "tf32": 2.0**-11,
    "fp16": 2.0**-11,
    "bf16": 2.0**-8,
    "fp8": 2.0**-4,
    "int8": 2.0**-3,
}
"""Relative rounding error of a typical value in each dtype (see the module docstring)."""

SHARED_INPUT_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q", "k", "v"),
    ("gate", "up"),
    ("expert_gate", "expert_up"),
)
"""Matmuls that read one saved input: lowering them together is also a move (lowering one
alone stores a second copy of the input, so no single step would save memory)."""


@dataclass(frozen=True)
class Evaluation:
    """Predicted iteration time and peak memory per GPU of one plan."""

    plan: PrecisionPlan
    time_s: float
    peak_bytes: float


@dataclass(frozen=True)
class Step:
    """One applied change and what it predicted."""

    op: str
    dtype: str
    previous: str
    time_s: float
    peak_bytes: float
    score: float


@dataclass(frozen=True)
class SearchResult:
    """The plan found, its baseline, and the changes in the order they were applied."""

    baseline: Evaluation
    best: Evaluation
    budget: float
    steps: tuple[Step, ...]
    candidates: tuple[tuple[str, str], ...]
    evaluations: int

    @property
    def speedup(self) -> float:
        return self.baseline.time_s / self.best.time_s if self.best.time_s > 0 else 1.0

    def as_dict(self) -> dict[str, Any]:
        """The JSON form of the result (``stg plan precision --json``)."""
        return {
            "plan": {"ops": dict(self.best.plan)},
            "budget_bytes": self.budget,
            "baseline": {
                "iteration_time_s": self.baseline.time_s,
                "peak_bytes": self.baseline.peak_bytes,
                "fits": self.baseline.peak_bytes <= self.budget,
            },
            "best": {
                "iteration_time_s": self.best.time_s,
                "peak_bytes": self.best.peak_bytes,
                "fits": self.best.peak_bytes <= self.budget,
            },
            "speedup": self.speedup,
            "steps": [
                {
                    "op": s.op,
                    "dtype": s.dtype,
                    "from": s.previous,
                    "iteration_time_s": s.time_s,
                    "peak_bytes": s.peak_bytes,
                    "score": s.score,
                }
                for s in self.steps
            ],
            "candidates": [list(c) for c in self.candidates],
            "evaluations": self.evaluations,
        }


def plan_ops(workload: Any) -> dict[str, str]:
    """Op names of the matmuls in a workload with their op class (``gemm``/``attention``):
    forward compute nodes (``mb<i>/layer<j>/fwd/<op>``, ``mb<i>/head/fwd/<op>`` and the
    embedding's ``mb<i>/embedding/<op>``, where a convolutional network has its body) that
    are neither casts nor elementwise."""
    ops: dict[str, str] = {}
    for rank_class in workload.rank_classes:
        for node in rank_class.nodes:
            path = node.name.split("/")
            forward = "/fwd/" in node.name or (len(path) == 3 and path[1] == "embedding")
            if node.type.name != "COMP" or node.num_ops <= 0 or not forward:
                continue
            if is_cast(node.name):
                continue
            kind = op_class(node.name, node.num_ops, node.tensor_size)
            if kind != "other":
                ops.setdefault(node.name.rsplit("/", 1)[-1], kind)
    return dict(sorted(ops.items()))


def _canonical(plan: Mapping[str, str]) -> PrecisionPlan:
    return tuple(sorted(plan.items()))


def search_precision(
    options: GenerateOptions,
    registry: Registry,
    system: System,
    *,
    budget: float,
    dtypes: Sequence[str] = ("bf16", "fp8", "int8"),
    kernels: KernelTable | Iterable[Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    calibration: Calibration | None = None,
) -> SearchResult:
    """The greedy search of the module docstring; raises :class:`UserError` when no plan fits.

    ``kernels`` default to the registry's; ``options.precision`` must be empty (the search
    starts from the workload's dtype). With ``calibration`` (measured kernels of the device)
    plans are timed with its measurements first, and an op may also be lowered to a dtype
    whose kernels of its class the table measured.
    """
    from stg.core.pipeline import build_workload

    predict_time = registry.predictors.get("time").predict
    predict_memory = registry.predictors.get("memory").predict
    if options.precision:
        raise UserError("stg plan precision starts from --dtype; do not give --precision_plan")
    table = kernel_table(kernels if kernels is not None else list(registry.kernels), system.name)
    allowed = [normalize_dtype(d) for d in dtypes]
    base_dtype = normalize_dtype(options.dtype)
    cache: dict[PrecisionPlan, Evaluation] = {}

    def evaluate(plan: PrecisionPlan) -> Evaluation:
        if plan not in cache:
            workload = build_workload(replace(options, precision=plan), registry)
            time_s = predict_time(workload, system, kernels=table, calibration=calibration)[
                "iteration_time_s"
            ]
            peak = predict_memory(workload, system, kernels=table)["peak_bytes"]
            cache[plan] = Evaluation(plan, float(time_s), float(peak))
            if progress:
                progress("plans evaluated", len(cache), 0)
        return cache[plan]

    baseline_workload = build_workload(replace(options, precision=()), registry)
    ops = plan_ops(baseline_workload)
    del baseline_workload
    candidates = tuple(
        (op, dtype)
        for op, kind in ops.items()
        for dtype in allowed
        if RISK[dtype] > RISK[base_dtype]
        and (
            table.native(kind, dtype)
            or native_fp8(system, kind, dtype)
            or (calibration is not None and calibration.covers(kind, dtype))
        )
    )
    moves = [((op,), dtype) for op, dtype in candidates]
    for group in SHARED_INPUT_GROUPS:
        for dtype in allowed:
            if all((op, dtype) in candidates for op in group):
                moves.append((group, dtype))
    baseline = evaluate(())
    current: dict[str, str] = {}
    best = baseline
    steps: list[Step] = []
    while True:
        fits = best.peak_bytes <= budget
        choice: tuple[float, tuple[str, ...], str, Evaluation] | None = None
        for group, dtype in moves:
            if any(RISK[dtype] <= RISK[current.get(op, base_dtype)] for op in group):
                continue
            risk = sum(RISK[dtype] - RISK[current.get(op, base_dtype)] for op in group)
            trial = evaluate(_canonical({**current, **dict.fromkeys(group, dtype)}))
            if fits:
                gain = best.time_s - trial.time_s
                if trial.peak_bytes > budget or gain <= 0:
                    continue
            else:
                gain = best.peak_bytes - trial.peak_bytes
                if gain <= 0:
                    continue
            score = gain / risk
            if choice is None or score > choice[0]:
                choice = (score, group, dtype, trial)
        if choice is None:
            break
        score, group, dtype, trial = choice
        previous = "/".join(sorted({current.get(op, base_dtype) for op in group}))
        steps.append(Step("+".join(group), dtype, previous, trial.time_s, trial.peak_bytes, score))
        current.update(dict.fromkeys(group, dtype))
        best = trial
    if best.peak_bytes > budget:
        raise UserError(
            f"--memory-budget {format_bytes(budget)}: no plan fits; the smallest predicted "
            f"peak is {format_bytes(best.peak_bytes)} per GPU"
            + (f" (plan {dict(best.plan)})" if best.plan else "")
        )
    return SearchResult(baseline, best, budget, tuple(steps), candidates, len(cache))


def format_bytes(value: float) -> str:
    """``38.21 GiB`` (``12.50 MiB`` or ``1 B`` where GiB would print 0.00)."""
    if value >= 2**30 / 100:
        return f"{value / 2**30:.2f} GiB"
    if value >= 2**20 / 100:
        return f"{value / 2**20:.2f} MiB"
    return f"{value:,.0f} B"


__all__ = [
    "RISK",
    "Evaluation",
    "SearchResult",
    "Step",
    "format_bytes",
    "plan_ops",
    "search_precision",
]
