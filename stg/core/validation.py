"""Checks of a run's options against the registry and the model, before anything is built.

Light (no sympy): a prediction from options checks them here and builds (or reads back from
a cache) only what it prices. A deferred built-in model is not imported to be checked.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from stg.core.offload import check_offload
from stg.core.options import GenerateOptions, OptionError
from stg.core.plan import ParallelPlan, make_plan

if TYPE_CHECKING:
    from stg.host.registry import Registry


def has_layer_stack(name: str, registry: Registry) -> bool:
    """Whether model ``name`` has a repeated layer stack (a ``block`` or a ``stack``). Every
    deferred built-in model has one (:mod:`stg.host.deferred`), so one not imported yet stays
    so; another is looked up."""
    if registry.models.pending(name):
        return True
    model = registry.models.get(name)
    return model.block is not None or model.stack is not None


def validate_options(options: GenerateOptions, registry: Registry) -> ParallelPlan:
    """Check every option (names against the registry, degrees against the model) and return
    the plan. Raises :class:`~stg.core.options.OptionError` (or UnknownNameError) on bad input."""
    stacked = has_layer_stack(options.model, registry)
    schedule = registry.schedules.get(options.pipeline_schedule)
    plan = make_plan(options)
    if not stacked:  # no stages, no layers
        model = registry.models.get(options.model)
        if options.inference:
            raise OptionError(
                f"model {model.name!r} has no layer stack to serve token by token: "
                f"phase={options.phase} is not allowed; allowed: phase=training"
            )
        if options.pp > 1 or options.virtual_stages > 1:
            raise OptionError(
                f"model {model.name!r} has no layer stack to split into pipeline stages: "
                f"pp={options.pp}, virtual_stages={options.virtual_stages} are not allowed; "
                "allowed: pp=1, virtual_stages=1"
            )
        if plan.recompute != "none":
            raise OptionError(
                f"model {model.name!r} has no layer stack to recompute: "
                f"activation_recompute={options.activation_recompute} is not allowed; "
                "allowed: none"
            )
        plan = replace(plan, layers_per_chunk=(0,))
    if options.virtual_stages > 1 and not schedule.supports_chunks:
        raise OptionError(
            f"pipeline_schedule={options.pipeline_schedule} does not support virtual_stages > 1"
        )
    if options.cpu_offloading_num_layers:
        order = schedule.order(0, plan.stages, plan.micro_batches, plan.chunks_per_stage)
        check_offload(options, sum(plan.layers_per_chunk), plan.recompute, order)
    return plan
