"""Transformer Engine's delayed-scaling bookkeeping in generated fp8 training workloads: the
amax concatenation, MAX all-reduce over the amax group and fused history/scale update at the
times TE runs them (stg.core.fp8), checked on every rank, across ranks, with the official
Chakra reader and by the time predictor; workloads without fp8 are untouched."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
from workload_checks import check_runs_to_completion

from stg.cli import main
from stg.core.fp8 import ALL_REDUCE, CONCAT, NODE_NAMES, UPDATE, update_bytes
from stg.core.options import GenerateOptions, OptionError
from stg.core.pipeline import build_workload
from stg.core.workload import CollectiveType, NodeType, RankClass, RankGraph, Workload
from stg.emitters.chakra_v004 import EMITTER
from stg.host.registry import load_registry
from stg.perf.costs import collective_time, compute_time, group_shape
from stg.perf.system import load_system
from stg.predictors.analytical import analyse
from stg.predictors.time import predict_time
from stg.trace.validate import validate_trace, validate_workload
from stg.trace.writer import write_workload

GPT_FP8 = tuple((op, "fp8") for op in ("q", "k", "v", "attn_out", "fc1", "fc2"))
GPT_MODULES = 4  # Megatron's TE layer: fused QKV, projection, FC1, FC2 (one GEMM each)
SMALL = dict(
    model="gpt", dmodel=256, dff=1024, head=4, kvhead=4, seq=64, dvocal=512, num_stacks=4
)
H100 = load_system("h100-80g")


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def amax_nodes(cls: RankClass) -> list:
    return [n for n in cls.nodes if n.name.rsplit("/", 1)[-1] in NODE_NAMES]


def events(cls: RankClass, kind: str = ALL_REDUCE) -> Counter[str]:
    """Reductions by where they run: ``chunk0/fwd``, ``layer3/recompute``, ..."""
    return Counter(
        "/".join(n.name.split("/")[1:3]) for n in amax_nodes(cls) if n.name.endswith(kind)
    )


def test_schedule_size_and_group_on_every_rank(registry) -> None:
    m = 4
    options = GenerateOptions(
        **SMALL, dp=2, tp=2, pp=2, batch=4 * m, micro_batch=4, precision=GPT_FP8
    )
    w = build_workload(options, registry)
    layers_per_stage = options.num_stacks // options.pp
    gemms = GPT_MODULES * layers_per_stage
    for graph in w.ranks:
        cls = graph.rank_class
        chunk = f"chunk{cls.stage}"
        # once per micro-batch after the chunk's forward and once after its backward
        assert events(cls) == {f"{chunk}/fwd": m, f"{chunk}/bwd": m}
        assert events(cls, CONCAT) == events(cls) == events(cls, UPDATE)
        nodes = list(graph.nodes())
        for n in nodes:
            if n.name.endswith(ALL_REDUCE):
                assert n.comm_type is CollectiveType.ALL_REDUCE and n.dtype == "fp32"
                per_gemm = 3 if "/fwd/" in n.name else 2  # (input, weight, output) / (dY, dX)
                assert n.comm_size == 4 * per_gemm * gemms
                # Megatron's amax reduction group: tensor x data parallel ranks of the stage
                assert w.comm_groups[n.comm_group] == w.layout.members(graph.rank, ("dp", "tp"))
            if n.name.endswith(UPDATE):
                tensors = (3 if "/fwd/" in n.name else 2) * gemms
                assert n.tensor_size == update_bytes(tensors, 1024) == 4 * tensors * 2049
        # the forward reduction follows the last layer of the chunk, the next node waits
        by_id = {n.id: n for n in nodes}
        last_layer = f"layer{layers_per_stage * (cls.stage + 1) - 1}/fwd/"
        for n in nodes:
            if n.name.endswith(f"fwd/{CONCAT}"):
                assert last_layer in by_id[n.data_deps[0]].name
            if n.name.endswith(UPDATE) and n.id + 1 < len(nodes):
                after = nodes[n.id + 1]
                assert n.id in after.data_deps + after.ctrl_deps
    assert validate_workload(w).ok
    check_runs_to_completion(w)


def test_interleaved_chunks_reduce_the_whole_rank_buffer(registry) -> None:
    options = GenerateOptions(
        **SMALL, pp=2, virtual_stages=2, pipeline_schedule="interleaved", dp=2,
        batch=8, micro_batch=4, precision=GPT_FP8,
    )  # fmt: skip
    w = build_workload(options, registry)
    cls = w.rank_classes[0]
    # each chunk's autocast reduces every amax of the rank: both chunks' layers
    assert events(cls) == {"chunk0/fwd": 2, "chunk0/bwd": 2, "chunk2/fwd": 2, "chunk2/bwd": 2}
    sizes = {n.comm_size for n in amax_nodes(cls) if n.name.endswith(f"fwd/{ALL_REDUCE}")}
    assert sizes == {4 * 3 * GPT_MODULES * 2}
    assert validate_workload(w).ok


def test_full_recompute_reduces_per_segment_and_module(registry) -> None:
    options = GenerateOptions(
        **SMALL, tp=2, batch=2, micro_batch=1, precision=GPT_FP8, activation_recompute="full"
    )
    cls = build_workload(options, registry).rank_classes[0]
    counts = events(cls)
    assert counts["chunk0/fwd"] == 2 and "chunk0/bwd" not in counts
    for layer in range(options.num_stacks):
        # the recompute forward's own autocast, then each recomputed module's backward
        assert counts[f"layer{layer}/recompute"] == 2
        assert counts[f"layer{layer}/bwd"] == 2 * GPT_MODULES


def test_one_rank_group_has_no_all_reduce(registry) -> None:
    options = GenerateOptions(**SMALL, pp=2, batch=2, micro_batch=1, precision=GPT_FP8)
    w = build_workload(options, registry)
    for cls in w.rank_classes:
        assert not events(cls) and sum(events(cls, UPDATE).values()) == 4
    assert validate_workload(w).ok


def test_te_modules_of_llama_and_moe(registry) -> None:
    llama = GenerateOptions(
        model="llama", dmodel=256, dff=512, head=4, kvhead=2, seq=64, dvocal=512,
        num_stacks=1, batch=2, precision=(("*", "fp8"),),
    )  # fmt: skip
    cls = build_workload(llama, registry).rank_classes[0]
    # fused QKV, attention core (DotProductAttention: 3 GEMMs), output projection, fused
    # gate/up, down, and the LM head
    gemms = 1 + 3 + 1 + 1 + 1 + 1
    concat = [n for n in amax_nodes(cls) if n.name.endswith(f"fwd/{CONCAT}")]
    assert [n.num_ops for n in concat] == [3 * gemms]  # one amax per fp8 tensor
    assert concat[0].name.startswith("mb0/chunk0/")  # after the head, its last fp8 GEMM
    moe = GenerateOptions(
        model="moe", dmodel=256, dff=512, head=4, kvhead=4, seq=64, dvocal=512, num_stacks=1,
        experts=4, kexperts=2, ep=2, batch=4, precision=(("expert_*", "fp8"),),
    )  # fmt: skip
    w = build_workload(moe, registry)
    cls = w.rank_classes[0]
    # gate and up: one grouped linear, down another: each one GEMM per local expert (4 / ep)
    reduce = [n for n in amax_nodes(cls) if n.name.endswith(f"fwd/{ALL_REDUCE}")]
    assert reduce and all(n.comm_size == 4 * 3 * 2 * 2 for n in reduce)
    assert reduce[0].group_axes == ("ep",)
    assert validate_workload(w).ok


def test_hybrid_groups_with_different_fp8_reduce_within_tensor_parallelism(registry) -> None:
    options = GenerateOptions(
        **SMALL, dp=2, tp=2, tpsp=False, batch=4, micro_batch=2,
        precision=(("a:fc1", "fp8"), ("a:fc2", "fp8")), placement=(("a", 2), ("b", 2)),
    )  # fmt: skip
    w = build_workload(options, registry)
    by_group = {c.facts["device_groups"][0]: c for c in w.rank_classes}
    assert not amax_nodes(by_group["b"])
    assert {n.group_axes for n in amax_nodes(by_group["a"]) if n.group_axes} == {("tp",)}
    assert validate_workload(w).ok


def test_official_reader_and_stg_validate(tmp_path: Path, registry) -> None:
    et_def = pytest.importorskip("chakra.schema.protobuf.et_def_pb2")
    protolib = pytest.importorskip("chakra.src.third_party.utils.protolib")
    options = GenerateOptions(**SMALL, dp=2, tp=2, batch=4, micro_batch=2, precision=GPT_FP8)
    w = build_workload(options, registry)
    paths = write_workload(w, EMITTER, tmp_path / "out", "workload")
    report = validate_trace(tmp_path / "out")
    assert report.ok, report.violations
    groups = json.loads(paths[-1].read_text())
    for rank, path in enumerate(paths[:-1]):
        handle = protolib.openFileRd(str(path))
        assert protolib.decodeMessage(handle, et_def.GlobalMetadata())
        found = []
        while True:
            node = et_def.Node()
            if not protolib.decodeMessage(handle, node):
                break
            if node.name.rsplit("/", 1)[-1] in NODE_NAMES:
                found.append(node)
        handle.close()
        reduces = [n for n in found if n.name.endswith(ALL_REDUCE)]
        assert len(found) == 3 * len(reduces) == 3 * 2 * options.micro_batches
        for node in reduces:
            attrs = {a.name: a for a in node.attr}
            assert node.type == et_def.COMM_COLL_NODE
            assert attrs["comm_type"].int64_val == et_def.ALL_REDUCE
            assert attrs["comm_size"].int64_val in (4 * 3 * 16, 4 * 2 * 16)
            assert groups[attrs["pg_name"].string_val] == list(
                w.layout.members(rank, ("dp", "tp"))
            )
        for node in found:
            if node.type == et_def.COMP_NODE:
                attrs = {a.name: a for a in node.attr}
                assert attrs["num_ops"].int64_val > 0 and attrs["tensor_size"].uint64_val > 0
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(tmp_path / "out")])
    assert exit_info.value.code == 0


def without_amax(w: Workload) -> Workload:
    """``w`` with the amax nodes taken out (their dependents inherit their dependencies)."""
    classes = {}
    for cls in w.rank_classes:
        keep: list = []
        new_id: dict[int, int] = {}
        inherited: dict[int, tuple[int, ...]] = {}

        def remap(ids: tuple[int, ...]) -> tuple[int, ...]:
            out: list[int] = []
            for d in ids:
                out.extend(inherited[d] if d in inherited else (new_id[d],))  # noqa: B023
            return tuple(dict.fromkeys(out))

        for n in cls.nodes:
            if n.name.rsplit("/", 1)[-1] in NODE_NAMES:
                inherited[n.id] = remap(n.data_deps + n.ctrl_deps)
                continue
            new_id[n.id] = len(keep)
            data = remap(n.data_deps)
            ctrl = tuple(c for c in remap(n.ctrl_deps) if c not in data)
            keep.append(dataclasses.replace(n, id=len(keep), data_deps=data, ctrl_deps=ctrl))
        classes[cls.index] = dataclasses.replace(cls, nodes=tuple(keep))
    ranks = tuple(RankGraph(g.rank, classes[g.rank_class.index], g.layout) for g in w.ranks)
    return Workload(ranks, w.comm_groups, w.layout, w.metadata)


def test_time_predictor_prices_it_per_micro_batch(registry, report_table) -> None:
    base = GenerateOptions(
        model="gpt", dmodel=1024, dff=4096, head=16, kvhead=16, seq=1024, dvocal=32000,
        num_stacks=4, tp=2, dp=4, micro_batch=8, mixed_precision=True, precision=GPT_FP8,
    )  # fmt: skip
    rows, added, priced = [], {}, {}
    for m in (2, 4):
        w = build_workload(dataclasses.replace(base, batch=8 * m), registry)
        cost = 0.0
        for n in w.ranks[0].nodes():
            if n.name.rsplit("/", 1)[-1] not in NODE_NAMES:
                continue
            if n.type is NodeType.COMM_COLL:
                shape = group_shape(w.comm_groups[n.comm_group], H100)
                seconds = collective_time(n.comm_type, n.comm_size, shape, H100)
                assert seconds < 50e-6  # a few hundred bytes: latency-bound
            else:
                seconds = compute_time(n, H100, "bf16")
                assert seconds < 10e-6  # a small memory-bound kernel
            cost += seconds
        full = predict_time(w, H100)["iteration_time_s"]
        bare = predict_time(without_amax(w), H100)["iteration_time_s"]
        added[m], priced[m] = full - bare, cost
        assert 0 < full - bare <= cost and cost < 0.02 * full
        rows.append(f"m={m}: nodes {cost * 1e6:7.1f} us, replay adds {added[m] * 1e6:7.1f} us "
                    f"of {full * 1e3:.2f} ms")  # fmt: skip
    # TE reduces once per micro-batch forward and backward: the extra micro-batches add their
    # reductions, most of it exposed (the synchronous all-reduce stalls the compute stream);
    # some of it runs while the compute stream waits on a tensor-parallel collective anyway
    # (with nccl-tests' mid-size ramp those take longer than the amax reductions' latency)
    extra_added, extra_priced = added[4] - added[2], priced[4] - priced[2]
    assert 0.5 * extra_priced <= extra_added <= extra_priced * (1 + 1e-9)
    report_table("fp8 amax bookkeeping, gpt 1024x4 tp2 dp4 on h100-80g (rank 0)", rows)


def test_analytical_prices_the_chunk_reductions(registry) -> None:
    options = GenerateOptions(
        **SMALL, tp=2, dp=2, batch=4, micro_batch=2, precision=GPT_FP8, mixed_precision=True
    )
    parts = analyse(options, H100, None, registry)
    assert parts.chunk_fwd.time > 0 and parts.chunk_bwd.time > 0
    plain = analyse(dataclasses.replace(options, precision=()), H100, None, registry)
    assert plain.chunk_fwd.time == plain.chunk_bwd.time == 0


def test_workloads_without_fp8_are_untouched(registry) -> None:
    for precision in ((), (("fc1", "int8"),)):
        options = GenerateOptions(**SMALL, tp=2, dp=2, batch=4, micro_batch=2, precision=precision)
        w = build_workload(options, registry)
        assert not any(amax_nodes(c) for c in w.rank_classes)
        assert "amax_history" not in w.metadata["options"]
    # eager PyTorch runs no Transformer Engine modules
    eager = GenerateOptions(**SMALL, batch=2, precision=GPT_FP8, profile="eager")
    w = build_workload(eager, registry)
    assert not amax_nodes(w.rank_classes[0]) and "amax_history" not in w.metadata["options"]
    fp8 = GenerateOptions(**SMALL, batch=2, precision=GPT_FP8, amax_history=16)
    w = build_workload(fp8, registry)
    assert w.metadata["options"]["amax_history"] == 16
    update = next(n for n in amax_nodes(w.rank_classes[0]) if n.name.endswith(UPDATE))
    assert update.tensor_size == update_bytes(3 * GPT_MODULES * 4, 16)


@pytest.mark.parametrize("value", [0, -3, True])
def test_bad_amax_history(registry, value: object) -> None:
    with pytest.raises(OptionError, match=r"amax_history=.* must be a positive integer"):
        build_workload(GenerateOptions(**SMALL, batch=2, amax_history=value), registry)


def test_cli_amax_history(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"ops": dict(GPT_FP8)}))
    args = ["generate", "--model", "gpt", "--num_stacks", "2", "--dmodel", "256", "--dff",
            "1024", "--head", "4", "--kvhead", "4", "--seq", "64", "--dvocal", "512",
            "--batch", "2", "--precision_plan", str(plan)]  # fmt: skip
    for value, message in (("0", "amax_history=0 must be a positive integer"),
                           ("x", "--amax_history")):  # fmt: skip
        out = tmp_path / f"bad{value}"
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--amax_history", value, "--output_dir", str(out)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
        assert not out.exists()
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--phase", "prefill", "--amax_history", "8", "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "amax_history=8 is a training option" in capsys.readouterr().err
