"""The analytical predictor's memos inside a run (predictors/analytical.py): each part's
prices and schedule per distinct pricing, group shapes per system, and stages alike composed
once. Plans that share reduced workloads but not their prices (other data-parallel groups,
ZeRO shards, kernels), priced one after another on one system as a search prices them, get
the report each gets alone on a system of its own (whose memos start empty)."""

from __future__ import annotations

from typing import Any

import pytest

from stg.api import GenerateOptions, Kernel
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.perf.system import load_system
from stg.predictors.analytical import predict_options

SMALL = dict(model="gpt", dvocal=1024, dmodel=512, dff=2048, head=8, kvhead=8, seq=256)

# one after another: the same one-layer workloads priced with dp 2, 4 and 8 (other groups),
# ZeRO over 2 and 4 ranks (other shards), FSDP, uneven and interleaved pipelines (stages
# alike and not), and recompute of some layers
PLANS: list[dict[str, Any]] = [
    dict(num_stacks=8, batch=64, micro_batch=16, dp=2, tp=2, pp=2),
    dict(num_stacks=8, batch=64, micro_batch=32, dp=4, tp=2, pp=2),
    dict(num_stacks=8, batch=64, micro_batch=64, dp=8, tp=2, pp=2),
    dict(num_stacks=8, batch=64, micro_batch=16, dp=2, tp=2, pp=2, zero=1),
    dict(num_stacks=8, batch=64, micro_batch=32, dp=4, tp=2, pp=2, zero=1),
    dict(num_stacks=8, batch=64, micro_batch=32, dp=4, tp=2, pp=2, zero=2),
    dict(num_stacks=8, batch=64, micro_batch=32, dp=4, tp=2, weight_sharded=True,
         tie_embeddings=False),
    dict(num_stacks=8, batch=64, micro_batch=64, dp=8, tp=2, weight_sharded=True,
         tie_embeddings=False),
    dict(num_stacks=12, batch=64, micro_batch=16, dp=2, tp=2, pp=4),
    dict(num_stacks=15, batch=64, micro_batch=16, dp=2, tp=2, pp=4,
         decoder_last_pipeline_num_layers=3),
    dict(num_stacks=12, batch=64, micro_batch=8, dp=2, tp=2, pp=4,
         pipeline_schedule="interleaved", virtual_stages=3),
    dict(num_stacks=12, batch=64, micro_batch=16, dp=2, tp=2, pp=4,
         activation_recompute="full", recompute_method="block", recompute_num_layers=1),
]  # fmt: skip


@pytest.mark.parametrize("kernels", ["registry", "none"])
def test_plans_priced_in_turn_get_the_report_each_gets_alone(kernels: str) -> None:
    registry = load_registry()
    table = list(registry.kernels) if kernels == "registry" else None
    shared = load_system("a100-80g")
    for values in PLANS:
        options = GenerateOptions(**SMALL, **values)
        in_turn = predict_options(options, shared, registry=registry, kernels=table, explain=True)
        alone = predict_options(
            options, load_system("a100-80g"), registry=registry, kernels=table, explain=True
        )
        assert in_turn == alone, values


def test_the_same_parts_under_other_kernels_are_priced_again() -> None:
    """The kernels price the compute: one system, one workload, two kernel tables (the
    roofline's, and a GEMM kernel twice as fast)."""
    registry = load_registry()
    shared = load_system("a100-80g")
    options = GenerateOptions(**SMALL, **PLANS[0])
    faster = [Kernel(name="gemm-twice-as-fast", op_class="gemm", dtype="bf16", speedup=2.0)]
    plain = predict_options(options, shared, registry=registry, kernels=None)
    fast = predict_options(options, shared, registry=registry, kernels=faster)
    assert fast["iteration_time_s"] < plain["iteration_time_s"]
    assert plain == predict_options(options, load_system("a100-80g"), registry=registry)
    assert fast == predict_options(
        options, load_system("a100-80g"), registry=registry, kernels=faster
    )


def test_kernels_that_share_a_name_are_priced_by_their_values() -> None:
    """Two tables whose kernels have the same name and differ in speed, one system object: the
    second is priced with its own kernel, not the first's prices (they were keyed by the
    kernels' names)."""
    registry = load_registry()
    shared = load_system("a100-80g")
    options = GenerateOptions(**SMALL, **PLANS[0])
    plain, fast = (
        [Kernel(name="my-gemm", op_class="gemm", dtype="bf16", speedup=speedup)]
        for speedup in (1.0, 2.0)
    )
    predict_options(options, shared, registry=registry, kernels=plain)
    in_turn = predict_options(options, shared, registry=registry, kernels=fast)
    alone = predict_options(options, load_system("a100-80g"), registry=registry, kernels=fast)
    assert in_turn == alone


def test_a_refused_build_is_refused_again_without_building(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The core refuses FSDP with tied embeddings: a second plan that needs the same reduced
    workload gets the same error without building it again."""
    import stg.api
    from stg.predictors import analytical

    monkeypatch.setattr(analytical, "_REFUSED", {})
    real = stg.api.build_workload
    builds: list[GenerateOptions] = []

    def counting(options: GenerateOptions, *args: Any, **kwargs: Any) -> Any:
        builds.append(options)
        return real(options, *args, **kwargs)

    monkeypatch.setattr(stg.api, "build_workload", counting)
    registry = load_registry()
    tied_fsdp = dict(num_stacks=8, batch=128, tp=2, weight_sharded=True, tie_embeddings=True)
    errors = []
    for dp in (4, 8):  # 16 samples per replica and micro-batch: the same reduced workload
        options = GenerateOptions(**SMALL, **tied_fsdp, dp=dp, micro_batch=16 * dp)
        with pytest.raises(UserError) as refused:
            predict_options(options, "a100-80g", registry=registry)
        errors.append(refused.value)
    assert all(type(e) is UserError for e in errors)
    assert str(errors[0]) == str(errors[1]) and "tie_embeddings" in str(errors[0])
    assert len(builds) == 1
