"""The memory predictor finds what does not depend on which stage a stage is once for the
stages alike (predictors/memory.py ``analytic_memory``): every stage's memory is what
:func:`stage_memory` gives that stage alone."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest

from stg.api import kernel_table
from stg.cli._shared import options_from_cli
from stg.host.registry import load_registry
from stg.perf.system import load_system
from stg.predictors.memory import analytic_memory, count_parameters, stage_memory

PLANS: list[dict[str, Any]] = [
    dict(model="gpt3-175b", batch=64, micro_batch=8, tp=8, pp=8),
    dict(model="gpt3-175b", batch=64, micro_batch=8, tp=8, pp=8,
         decoder_last_pipeline_num_layers=5),
    dict(model="gpt3-175b", batch=64, micro_batch=8, tp=8, pp=8, pipeline_schedule="gpipe"),
    dict(model="gpt3-175b", batch=64, micro_batch=8, tp=8, pp=8,
         pipeline_schedule="interleaved", virtual_stages=3),
    dict(model="gpt3-175b", batch=64, micro_batch=8, tp=8, pp=8, activation_recompute="full",
         recompute_method="block", recompute_num_layers=2),
    dict(model="gpt3-175b", batch=64, micro_batch=8, tp=8, pp=2, activation_recompute="selective",
         account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
    dict(model="deepseek-v3", num_stacks=8, dense_layers=3, batch=16, micro_batch=8, ep=8, pp=4),
    dict(model="deepseek-v3", num_stacks=8, dense_layers=3, batch=16, micro_batch=8, ep=8, pp=4,
         tp=2, activation_recompute="selective", recompute_modules="mla_up_proj"),
    dict(model="deepseek-v3", num_stacks=8, dense_layers=3, batch=16, micro_batch=8, ep=8, pp=4,
         tp=2, activation_recompute="selective", recompute_modules="mla_up_proj,mlp"),
    dict(model="gpt-1.7b", batch=32, micro_batch=8, pp=4, profile="eager"),
]  # fmt: skip


@pytest.mark.parametrize("values", PLANS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
def test_every_stage_is_what_stage_memory_gives_it_alone(values: dict[str, Any]) -> None:
    registry = load_registry()
    system = load_system("a100-80g")
    table = kernel_table(list(registry.kernels), system.name)
    o = options_from_cli(values)
    stages = analytic_memory(o, table, system)
    alone = [
        stage_memory(
            o,
            stage=p.stage,
            parameters=p.total,
            layers=p.layers,
            has_embedding=p.stage == 0,
            has_head=p.stage == o.pp - 1,
            kernels=table,
            kinds=dict(p.kinds),
            system=system,
        )
        for p in count_parameters(o)
    ]
    assert [asdict(s) for s in stages] == [asdict(s) for s in alone]
    assert len({s.activations for s in stages}) > 1  # stages alike in all but in-flight terms
