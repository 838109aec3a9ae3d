"""Lowering lays out each run of a part's ops from a plan made once per distinct run
(``stg.core.lowering._Nodes.run``): the workloads must be node for node (ids, names, deps,
attributes and their order) those of adding each op in turn, as lowering did before, over
the schedules and features whose runs differ (1F1B, interleaved, GPipe, recompute, MoE and
its overlapped steps, CPU offload, FSDP, fp8 amax reductions, context parallelism, serving)."""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping
from typing import Any

import pytest

from stg.core import lowering
from stg.core.layout import PIPELINE_ENDS
from stg.core.lowering import BoundOp, Env, op_role
from stg.core.options import GenerateOptions, OptionError
from stg.core.pipeline import build_workload
from stg.core.workload import OP_ATTR, ROLE_ATTR, CollectiveType, NodeType, Workload
from stg.host.registry import load_registry

REGISTRY = load_registry(autoload=False)
GPT = dict(model="gpt", dmodel=256, dff=1024, head=8, kvhead=8, seq=128, dvocal=1024, num_stacks=8)
LLAMA = dict(
    model="llama", dmodel=256, dff=512, head=8, kvhead=4, seq=128, dvocal=1024, num_stacks=4,
    causal=True,
)  # fmt: skip
MOE = dict(model="moe", seq=256, dmodel=256, dff=512, head=8, kvhead=8, dvocal=1024, num_stacks=4)
FP8 = tuple((op, "fp8") for op in ("q", "k", "v", "attn_out", "fc1", "fc2"))
INTERLEAVED = dict(pipeline_schedule="interleaved", virtual_stages=2)

CASES: dict[str, tuple[dict[str, Any], int | None]] = {
    "1f1b": (dict(GPT, dp=2, tp=2, pp=4, batch=32, micro_batch=2), None),
    "1f1b lowered": (dict(GPT, dp=2, tp=2, pp=4, batch=32, micro_batch=2), 6),
    "gpipe": (dict(GPT, pp=4, batch=16, micro_batch=2, pipeline_schedule="gpipe"), None),
    "interleaved": (dict(GPT, pp=2, batch=16, micro_batch=2, **INTERLEAVED), None),
    "recompute full": (dict(GPT, pp=2, batch=8, micro_batch=2, activation_recompute="full"), None),
    "recompute uniform": (
        dict(
            GPT,
            pp=2,
            batch=8,
            micro_batch=2,
            activation_recompute="full",
            recompute_method="uniform",
            recompute_num_layers=2,
        ),
        None,
    ),
    "recompute selective": (
        dict(GPT, pp=2, batch=8, micro_batch=2, activation_recompute="selective"),
        None,
    ),
    "moe": (dict(MOE, dp=2, ep=2, pp=2, batch=16, micro_batch=4), None),
    "moe overlap": (
        dict(MOE, ep=2, pp=2, batch=16, micro_batch=2, overlap_moe_ep_comm=True, **INTERLEAVED),
        None,
    ),
    "offload": (
        dict(GPT, attention="unfused", batch=8, micro_batch=4, cpu_offloading_num_layers=5),
        None,
    ),
    "fsdp": (dict(GPT, dp=2, pp=2, batch=16, micro_batch=2, weight_sharded=True), None),
    "fp8 recompute": (
        dict(
            GPT,
            dp=2,
            tp=2,
            pp=2,
            batch=16,
            micro_batch=4,
            precision=FP8,
            activation_recompute="full",
        ),
        None,
    ),
    "context parallel": (dict(LLAMA, sp=2, tp=2, pp=2, batch=8, micro_batch=2), None),
    "mtp": (  # the head's embedding of the shifted tokens waits for the micro-batch (start)
        dict(
            model="deepseek",
            dvocal=64,
            dmodel=32,
            dff=16,
            head=4,
            kvhead=4,
            dhead=8,
            seq=16,
            num_stacks=3,
            experts=4,
            kexperts=2,
            shared_experts=1,
            dense_layers=1,
            dense_dff=48,
            q_lora_rank=12,
            kv_lora_rank=16,
            drope=4,
            mtp_depth=1,
            pp=2,
            batch=8,
            micro_batch=2,
        ),
        None,
    ),
    "decode": (dict(LLAMA, phase="decode", context=256, steps=3, tp=2, batch=4), None),
}


def run_op_by_op(
    self: lowering._Nodes,
    ops: Iterable[BoundOp],
    env: Env,
    prefix: str,
    after: int | None = None,
    where: Mapping[str, Any] | None = None,
    op_prefix: str = "",
    start: int | None = None,
) -> None:
    """``_Nodes.run`` as it was before runs were planned: each op added on its own."""
    first = len(self.nodes)
    for op in ops:
        deps = [d for k in op.inputs for d in env.get(k, ())]
        extra = () if after is None or any(d >= first for d in deps) else (after,)
        if after is None and start is not None and not deps and op.type is NodeType.COMP:
            extra = (start,)
        attrs = dict(op.attrs)
        attrs[OP_ATTR] = op_prefix + op.name
        if where:
            attrs.update(where)
        role = op_role(op) if op.group_axes else None
        if role is not None:
            attrs[ROLE_ATTR] = int(role)
        fields = {
            "name": f"{prefix}{op.name}",
            "type": op.type,
            "num_ops": op.num_ops,
            "tensor_size": op.tensor_size,
            "comm_type": op.comm_type,
            "comm_size": op.comm_size,
            "group_axes": op.group_axes,
            "dtype": op.dtype,
            "attrs": attrs,
        }
        nid = self.add(fields, deps, extra)
        for k in op.outputs:
            env[k] = (nid,)


def layout(workload: Workload) -> list[object]:
    """Everything a workload's rank classes hold, attribute order included."""
    return [
        (cls.index, cls.stage, dict(cls.facts), [(n, list(n.attrs.items())) for n in cls.nodes])
        for cls in workload.rank_classes
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_planned_runs_lay_out_the_nodes_of_op_by_op_runs(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    given, lowered = CASES[case]
    options = GenerateOptions(**given)
    planned = build_workload(options, REGISTRY, lowered_micro_batches=lowered)
    monkeypatch.setattr(lowering._Nodes, "run", run_op_by_op)
    op_by_op = build_workload(options, REGISTRY, lowered_micro_batches=lowered)
    assert layout(planned) == layout(op_by_op)
    assert [g.rank_class.index for g in planned.ranks] == [
        g.rank_class.index for g in op_by_op.ranks
    ]
    assert planned.comm_groups == op_by_op.comm_groups


@pytest.mark.parametrize("container", [list, tuple])
def test_a_run_reads_its_inputs_from_before_it_and_from_itself(container: type) -> None:
    """Deps on nodes before a run (sorted, distinct, from lists too), on earlier ops of the
    run, ``after`` only for ops with no dep inside the run, the step's pending ctrl dep once,
    and each collective after the previous one on its axes; the ops in a list or in a tuple
    (whose plan a second run finds by its id)."""

    def op(name: str, inputs: tuple[int, ...], output: int, coll: bool = False) -> BoundOp:
        if coll:
            return BoundOp(
                name, NodeType.COMM_COLL, inputs, (output,),
                comm_type=CollectiveType.ALL_REDUCE, comm_size=8, group_axes=("dp",),
            )  # fmt: skip
        return BoundOp(name, NodeType.COMP, inputs, (output,), num_ops=1, tensor_size=4)

    ops = container(
        [
            op("a", (100, 101), 200),
            op("b", (200, 102), 201, coll=True),
            op("c", (103,), 202),
            op("d", (201, 202, 100), 203, coll=True),
        ]
    )
    results = []
    for run in (lowering._Nodes.run, run_op_by_op):
        out = lowering._Nodes()
        for i in range(5):
            out.add({"name": f"n{i}", "type": NodeType.COMP}, ())
        out.add({"name": "c0", "type": NodeType.COMM_COLL, "group_axes": ("dp",), "attrs": {}}, ())
        out.start_step()
        for repeat in range(2):  # the second run reuses the first's plan
            env: Env = {100: (3, 1, 3), 101: (2,), 102: [4, 0], 103: ()}  # type: ignore[dict-item]
            run(out, ops, env, f"r{repeat}/", after=5, where={"micro_batch": repeat})
        results.append(out.nodes)
        if run is lowering._Nodes.run:
            laid_out = out
    planned, op_by_op = results
    # the plan of a tuple is found by the tuple's id too, that of a list by its ops' only
    assert list(laid_out.tuple_plans) == ([(id(ops), "")] if container is tuple else [])
    assert len(laid_out.planned) == 1
    assert [(n, list(n.attrs.items())) for n in planned] == [
        (n, list(n.attrs.items())) for n in op_by_op
    ]
    # the step's pending dep (4) and ``after`` (5), after the deps from before the run
    assert (planned[6].data_deps, planned[6].ctrl_deps) == ((1, 2, 3), (5, 4))
    # a collective after the one before the run on its axes, then after the first run's
    assert (planned[7].data_deps, planned[7].ctrl_deps) == ((0, 4, 6), (5,))
    assert (planned[11].data_deps, planned[11].ctrl_deps) == ((0, 4, 10), (9,))
    assert (planned[8].data_deps, planned[8].ctrl_deps) == ((), (5,))
    assert (planned[9].data_deps, planned[9].ctrl_deps) == ((1, 3, 7, 8), ())
    assert planned[13].data_deps == (1, 3, 11, 12)
    assert [n.name for n in planned[6:10]] == ["r0/a", "r0/b", "r0/c", "r0/d"]
    assert planned[13].attrs == {OP_ATTR: "d", "micro_batch": 1}


@pytest.mark.parametrize("enabled", [True, False])
def test_build_workload_leaves_the_collector_as_it_found_it(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        build_workload(GenerateOptions(**GPT, pp=2, batch=4, micro_batch=2), REGISTRY)
        assert gc.isenabled() is enabled
        refused = GenerateOptions(**GPT, pp=2, virtual_stages=2, batch=4, micro_batch=2)
        with pytest.raises(OptionError, match="virtual_stages=2 needs"):
            build_workload(refused, REGISTRY)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_resolve_many_is_resolve_of_each_template() -> None:
    """``RankGraph.resolve_many`` (communicators and peers looked up once per call) gives
    what ``resolve`` gives node by node, on every rank: collectives, sends and receives."""
    options = GenerateOptions(
        model="gpt", dmodel=64, dff=256, head=4, kvhead=4, num_stacks=4, seq=32, dvocal=64,
        tp=2, pp=2, dp=2, batch=8, micro_batch=2,
    )  # fmt: skip
    workload = build_workload(options, load_registry(autoload=False))
    kinds = set()
    for graph in workload.ranks:
        templates = list(graph.rank_class.nodes)
        assert graph.resolve_many(templates) == [graph.resolve(t) for t in templates]
        kinds.update(t.type for t in templates)
    assert {NodeType.COMM_COLL, NodeType.COMM_SEND, NodeType.COMM_RECV} <= kinds


GROUPED: dict[str, dict[str, Any]] = {
    "1f1b": dict(GPT, dp=2, tp=2, pp=4, batch=32, micro_batch=2),
    "tied embedding over the pipeline ends, zero 2": dict(
        LLAMA, dp=2, pp=4, batch=16, micro_batch=2, zero=2, tie_embeddings=True
    ),
    "fp8 amax over dp and tp": dict(
        GPT, dp=2, tp=2, pp=2, batch=16, micro_batch=4, precision=FP8, activation_recompute="full"
    ),
}
GROUPED["device groups"] = dict(
    GPT, dp=2, tp=2, pp=2, tpsp=False, batch=8, micro_batch=2,
    precision=(("a:fc1", "fp8"), ("a:fc2", "fp8")), placement=(("a", 4), ("b", 4)),
)  # fmt: skip


@pytest.mark.parametrize("case", list(GROUPED))
def test_the_communicators_are_those_of_every_rank_and_node(case: str) -> None:
    """``build_workload`` numbers the group axes of the nodes (each class's, in class order)
    and keeps each rank's group along each axes of its stage's nodes, though it collects the
    axes while lowering and looks a rank up only when no group found so far holds it."""
    workload = build_workload(GenerateOptions(**GROUPED[case]), REGISTRY)
    classes = workload.rank_classes
    node_axes = [{n.group_axes for n in cls.nodes if n.group_axes} for cls in classes]
    numbered: list[tuple[str, ...]] = []
    for axes_here in node_axes:
        numbered.extend(a for a in sorted(axes_here) if a not in numbered)
    assert workload.layout.group_axes == tuple(numbered)
    layout = workload.layout
    expected: dict[int, tuple[int, ...]] = {}
    for graph in workload.ranks:
        for axes in node_axes[graph.rank_class.stage]:
            gid = layout.group_id(graph.rank, axes)
            expected.setdefault(gid, layout.members(graph.rank, axes))
    assert workload.comm_groups == dict(sorted(expected.items()))
    if "pipeline ends" in case:  # ranks off the ends are in no group along them
        assert any(PIPELINE_ENDS in axes for axes_here in node_axes for axes in axes_here)
