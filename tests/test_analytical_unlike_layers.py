"""The analytical predictor on stacks whose layers differ: DeepSeek's dense then MoE layers,
a hybrid Mamba-2 / attention / MLP pattern, and sliding-window attention on all but every
k-th layer. Each stage's layers are priced as they are, so the closed form stays within a
few per cent of the DAG replay, pipeline, interleaving and block recompute included (before,
every layer was priced as the first: DeepSeek 43 % fast, and a hybrid pattern longer than
two layers did not predict at all)."""

from __future__ import annotations

import pytest

from stg.api import GenerateOptions, build_workload
from stg.host.registry import load_registry
from stg.predictors.analytical import predict_options, unlike_layers
from stg.predictors.time import predict_time

PLAN = dict(tp=2, pp=2, dp=2, batch=16, micro_batch=4, seq=1024)
DEEPSEEK = dict(
    model="deepseek", dvocal=8192, dmodel=1024, dff=512, head=8, kvhead=8, dhead=128,
    num_stacks=6, experts=8, kexperts=2, shared_experts=1, dense_layers=2, dense_dff=4096,
    q_lora_rank=384, kv_lora_rank=256, drope=32, ep=2,
)  # fmt: skip
HYBRID = dict(
    model="hybrid", dvocal=8192, dmodel=1024, dff=4096, head=8, kvhead=2, num_stacks=6,
    layer_pattern="M*-", ssm_chunk=128, ssm_head_dim=64, ssm_state=64, ssm_groups=2,
    causal=True,
)  # fmt: skip
WINDOWED = dict(
    model="llama", dvocal=8192, dmodel=1024, dff=4096, head=8, kvhead=2, num_stacks=8,
    attention_window=128, full_attention_every=2, causal=True, seq=4096,
)  # fmt: skip
CASES = {
    "deepseek dense+moe": DEEPSEEK,
    "deepseek interleaved": {**DEEPSEEK, "num_stacks": 8, "pipeline_schedule": "interleaved",
                             "virtual_stages": 2, "batch": 32},
    "hybrid M*-": HYBRID,
    "hybrid block recompute": {**HYBRID, "activation_recompute": "full",
                               "recompute_method": "block", "recompute_num_layers": 1},
    "window every 2nd": WINDOWED,
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_analytical_prices_each_layer_as_it_is(name: str) -> None:
    registry = load_registry()
    kernels = list(registry.kernels)
    options = GenerateOptions(**{**PLAN, **CASES[name]})  # type: ignore[arg-type]
    assert unlike_layers(options, registry)
    dag = predict_time(build_workload(options, registry), "h100-80g", kernels=kernels)
    fast = predict_options(options, "h100-80g", registry=registry, kernels=kernels)
    error = fast["iteration_time_s"] / dag["iteration_time_s"] - 1
    assert abs(error) < 0.05, f"{name}: analytical {error:+.1%} against the DAG replay"
    assert fast["model_flops"] == pytest.approx(dag["model_flops"], rel=0.02)


def test_like_layers_keep_the_one_layer_workloads() -> None:
    registry = load_registry()
    assert not unlike_layers(GenerateOptions(model="gpt", num_stacks=8), registry)
    every_layer = GenerateOptions(**{**WINDOWED, "full_attention_every": None})  # type: ignore[arg-type]
    assert not unlike_layers(every_layer, registry)
