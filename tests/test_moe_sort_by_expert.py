"""``--moe_sort_by_expert``: Megatron-core's alltoall token dispatcher copies the routed rows an
expert-parallel all-to-all brings into local-expert order, and back before the return
all-to-all, forward and backward (megatron/core/transformer/moe/token_dispatcher.py at
core_v0.14.0, ``MoEAlltoAllTokenDispatcher.dispatch_postprocess`` and ``combine_preprocess``)."""

from __future__ import annotations

import pytest

from stg.core.modelinfo import build_unsharded, saved_activations
from stg.core.options import GenerateOptions, OptionError
from stg.core.pipeline import build_workload
from stg.core.workload import NodeType, node_op
from stg.host.registry import load_registry
from stg.perf.costs import compute_time, moe_sort_time
from stg.perf.kernel_time import memory_bound_time
from stg.perf.system import load_system
from stg.predictors.time import predict_time

SMALL = dict(
    model="moe", dvocal=512, dmodel=64, dff=128, head=8, kvhead=4, num_stacks=2, seq=64,
    batch=8, micro_batch=8, experts=8, kexperts=2, dp=2, ep=2, ep_layout="fold",
)  # fmt: skip
SORTS = ("expert_sort", "expert_unsort")
BF16 = 2


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def options(**kw: object) -> GenerateOptions:
    return GenerateOptions(**{**SMALL, **kw})


def sort_nodes(workload) -> list:
    return [
        n
        for n in workload.rank_classes[0].nodes
        if n.type is NodeType.COMP and (node_op(n) or "").partition(".grad_")[0] in SORTS
    ]


def routed_row_bytes(o: GenerateOptions) -> int:
    """Bytes of one rank's routed rows of one micro-batch: its tokens times k rows of dmodel
    (balanced routing at capacity factor 1, so every rank sends and receives as many)."""
    tokens = o.micro_batch // (o.dp * o.sp) * o.seq
    return tokens * o.kexperts * o.dmodel * BF16


def test_off_by_default_the_routed_rows_are_permuted_once_each_way(registry) -> None:
    assert sort_nodes(build_workload(options(), registry)) == []


def test_each_moe_layer_copies_its_routed_rows_twice_forward_and_twice_backward(registry) -> None:
    o = options(moe_sort_by_expert=True)
    nodes = sort_nodes(build_workload(o, registry))
    rows = routed_row_bytes(o)
    forward = [n for n in nodes if ".grad_" not in n.name]
    backward = [n for n in nodes if ".grad_" in n.name]
    layers, micro_batches = o.num_stacks, 1
    assert len(forward) == len(backward) == 2 * layers * micro_batches
    assert {node_op(n) for n in forward} == set(SORTS)
    # a copy reads and writes the rows
    assert all(n.tensor_size == 2 * rows for n in forward)
    # the generic backward node counts the output gradient, the forward input and the result
    assert all(n.tensor_size == 3 * rows for n in backward)


def test_a_sort_and_its_gradient_are_each_one_copy_of_the_rows(registry) -> None:
    o = options(moe_sort_by_expert=True)
    system = load_system("h100-80g")
    copy = memory_bound_time(system.gpu, 2 * routed_row_bytes(o), "stream", "bf16")
    for node in sort_nodes(build_workload(o, registry)):
        assert moe_sort_time(node, system) == pytest.approx(copy)
        seconds = compute_time(node, system, o.dtype, profile="megatron")
        assert seconds == pytest.approx(copy + system.kernel_overhead)


def test_other_nodes_are_not_sorts(registry) -> None:
    system = load_system("h100-80g")
    workload = build_workload(options(moe_sort_by_expert=True), registry)
    others = [n for n in workload.rank_classes[0].nodes if n.type is NodeType.COMP]
    assert any(node_op(n) == "dispatch" for n in others)
    assert all(
        moe_sort_time(n, system) is None
        for n in others
        if (node_op(n) or "").partition(".grad_")[0] not in SORTS
    )


def test_one_expert_per_rank_has_nothing_to_sort(registry) -> None:
    # Megatron sorts only with num_local_experts > 1: 8 experts over ep 8 leave one a rank
    o = options(moe_sort_by_expert=True, dp=8, ep=8, batch=16, micro_batch=16)
    assert sort_nodes(build_workload(o, registry)) == []


def test_the_copies_lengthen_the_predicted_step(registry) -> None:
    def seconds(**kw: object) -> float:
        workload = build_workload(options(**kw), registry)
        return predict_time(workload, "h100-80g")["iteration_time_s"]

    assert seconds(moe_sort_by_expert=True) > seconds()


@pytest.mark.parametrize(
    ("kw", "allowed"),
    [
        (dict(ep=1, ep_layout=None), "allowed: ep > 1"),
        (dict(profile="eager"), "allowed: profile=megatron"),
    ],
)
def test_refused_where_megatron_has_no_such_sort(registry, kw, allowed) -> None:
    with pytest.raises(OptionError, match=allowed):
        build_workload(options(moe_sort_by_expert=True, **kw), registry)


def test_refused_on_a_model_without_experts(registry) -> None:
    with pytest.raises(OptionError, match="does not apply to model 'llama'"):
        build_workload(options(moe_sort_by_expert=True, model="llama"), registry)


def test_the_copies_keep_no_more_activations(registry) -> None:
    # Megatron's sort leaves nothing for autograd (a copy's gradient is a copy back): the
    # experts keep the sorted rows instead of the unsorted ones, as many bytes
    saved = {}
    for sort in (False, True):
        part = build_unsharded(
            registry.models.get("moe"), "block", options(moe_sort_by_expert=sort)
        )
        saved[sort] = {t.name: t for t in saved_activations(part)}
    # the experts read the sorted rows, the combine the unsorted output: same shapes
    swapped = {"dispatch": "expert_sort", "expert_down": "expert_unsort"}
    assert set(saved[True]) == {swapped.get(name, name) for name in saved[False]}
    for before, after in swapped.items():
        assert saved[True][after].dims == saved[False][before].dims
