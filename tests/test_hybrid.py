"""Hybrid clusters (QSync's setting): device groups, per-group precision plans, the
per-group time and memory prediction, and the per-group planner."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import stg_int8_kernels
from workload_checks import check_runs_to_completion

from stg.cli import main
from stg.core.options import GenerateOptions, OptionError
from stg.core.pipeline import build_workload
from stg.core.precision import dump_plan, load_plan, plan_for_group
from stg.core.workload import NodeType
from stg.errors import UserError
from stg.explore.hybrid_search import exact_hybrid_precision, search_hybrid_precision
from stg.host.registry import load_registry
from stg.perf.hybrid import HybridSystem, hybrid_from_dict
from stg.perf.kernels import KernelTable, is_cast
from stg.perf.system import load_system
from stg.predictors.time import compute_time
from stg.trace.validate import validate_workload

V100_T4 = {
    "name": "v100+t4",
    "groups": [
        {"name": "v100", "device": "v100-32g", "gpus_per_node": 4},
        {"name": "t4", "device": "t4-16g", "gpus_per_node": 4},
    ],
    "network": {"name": "infiniband", "bandwidth_gbps": 25, "latency_us": 3, "efficiency": 0.9},
}
# big matmuls, few layers: int8 GEMMs on the T4 save more than their casts cost
WIDE = dict(
    model="gpt", dmodel=4096, dff=16384, head=32, kvhead=32, num_stacks=2, seq=512,
    batch=32, dvocal=32000, dtype="fp16", dp=8,
)  # fmt: skip
WIDE_ARGS = [a for k, v in WIDE.items() for a in (f"--{k}", str(v))]
SMALL = dict(
    model="gpt", dmodel=512, dff=2048, head=8, kvhead=8, num_stacks=2, seq=256, batch=8,
    dvocal=8000, dtype="fp16", dp=2,
)  # fmt: skip
SMALL_ARGS = [a for k, v in SMALL.items() for a in (f"--{k}", str(v))]


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


@pytest.fixture(scope="module")
def int8_registry():
    return load_registry(autoload=False, plugins=[stg_int8_kernels])


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


# -- presets ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fp32", "fp16", "int8", "gbps", "gib", "sms", "arch"),
    [
        ("v100-32g", 15.7, 125, 62.8, 900, 32, 80, "volta"),
        ("t4-16g", 8.1, 65, 130, 320, 16, 40, "turing"),
        ("a10-24g", 31.2, 125, 250, 600, 24, 72, "ampere"),
        ("l4-24g", 30.3, 121, 242, 300, 24, 58, "ada"),
        ("a100-40g", 19.5, 312, 624, 1555, 40, 108, "ampere"),
    ],
)
def test_device_presets_carry_their_data_sheets(name, fp32, fp16, int8, gbps, gib, sms, arch):
    system = load_system(name)
    assert system.peak("fp32") == pytest.approx(fp32 * 1e12)
    assert system.peak("fp16") == pytest.approx(fp16 * 1e12)
    assert system.peak("int8") == pytest.approx(int8 * 1e12)
    assert system.hbm_bandwidth == gbps * 1e9 and system.hbm_capacity == gib * 2**30
    assert system.sm_count == sms and system.arch == arch
    # the tensor-core peak is SMs x FLOP per SM and clock x the clock it is stated at
    per_sm_clock = system.peak("fp16") / (system.sm_count * system.peak_clock_ghz * 1e9)
    # Volta/Turing: 8 tensor cores x 64 FMA; GA102/AD104: 4 x 128; GA100: 4 x 256 (x 2 FLOP)
    assert per_sm_clock == pytest.approx(2048 if name == "a100-40g" else 1024, rel=0.02)
    if arch in ("volta", "turing"):  # no bf16/tf32 tensor cores: the CUDA-core rate
        assert system.peak("bf16") == system.peak("tf32") == system.peak("fp32")


def test_attention_on_volta_and_turing_is_priced_unfused(registry):
    """No FlashAttention-2 / cuDNN fused kernel before sm_80: the unfused model applies."""
    from stg.perf.kernel_time import attention_time

    for name in ("v100-32g", "t4-16g"):
        gpu = load_system(name).gpu
        fused = attention_time(gpu, "flash2", 4, 8, 512, 512, 64, dtype="fp16")
        unfused = attention_time(gpu, "unfused", 4, 8, 512, 512, 64, dtype="fp16")
        assert fused == unfused > 0
    ampere = load_system("a10-24g").gpu
    assert attention_time(ampere, "flash2", 4, 8, 512, 512, 64, dtype="fp16") < attention_time(
        ampere, "unfused", 4, 8, 512, 512, 64, dtype="fp16"
    )


# -- system files -------------------------------------------------------------------------------


def test_groups_placement_and_nodes() -> None:
    system = hybrid_from_dict(V100_T4, "h.json")
    assert isinstance(system, HybridSystem) and system.capacity == 8
    assert [system.group_of(r).name for r in range(8)] == ["v100"] * 4 + ["t4"] * 4
    assert system.group_of(5).device.name == "t4-16g"
    assert system.group_of(0).link.name == "nvlink"  # the device preset's node link
    assert system.group_of(4).link.name == "pcie"
    assert system.placement_runs(8) == (("v100", 4), ("t4", 4))
    assert system.placement_runs(6) == (("v100", 4), ("t4", 2))
    explicit = hybrid_from_dict(
        {**V100_T4, "placement": ["t4", "v100"] * 4,
         "groups": [{**g, "gpus_per_node": 2, "nodes": 2} for g in V100_T4["groups"]]},
        "h.json",
    )  # fmt: skip
    assert explicit.placement_runs(4) == (("t4", 1), ("v100", 1), ("t4", 1), ("v100", 1))
    # a group's ranks fill its nodes in rank order: ranks 1, 3 on v100's node 0; 5, 7 node 1
    assert [explicit.node_of[r] for r in (1, 3, 5, 7)] == [0, 0, 1, 1]
    assert [explicit.node_of[r] for r in (0, 2, 4, 6)] == [2, 2, 3, 3]
    assert hybrid_from_dict(explicit.as_dict(), "again").as_dict() == explicit.as_dict()


def test_collectives_across_groups_closed_form() -> None:
    """Within each node over its link (the slowest node sets the pace), then between nodes on
    the largest shard: all-reduce of S over 4 V100 + 4 T4 = max(nvlink, pcie) ring steps + a
    2-node ring over the network on S/4."""
    from stg.core.workload import CollectiveType

    system = hybrid_from_dict(V100_T4, "h.json")
    size = 64 * 2**20
    pcie = 16e9 * 0.75
    nvlink = 150e9 * 0.75
    net = 25e9 * 0.9
    ring = 2 * 3 / 4 * size  # bytes each GPU moves in a 4-GPU ring all-reduce
    intra = max(ring / pcie + 2 * 3 * 5.7e-6, ring / nvlink + 2 * 3 * 3.4e-6)
    inter = 2 * 1 / 2 * (size / 4) / net + 2 * 1 * 3e-6
    got = system.collective_time(CollectiveType.ALL_REDUCE, size, tuple(range(8)))
    assert got == pytest.approx(intra + inter)
    assert system.send_time(size, 0, 1) == pytest.approx(size / nvlink + 3.4e-6)
    assert system.send_time(size, 0, 4) == pytest.approx(size / net + 3e-6)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(colour="red"), "unknown key 'colour' in a hybrid system"),
        (lambda d: d.update(groups=[]), "groups must be a non-empty list"),
        (lambda d: d["groups"][1].update(device="t5-16g"), "unknown device 't5-16g'; allowed:"),
        (lambda d: d["groups"][1].update(name="v100"), "is used by another group"),
        (lambda d: d["groups"][0].update(nodes=0), "groups[0].nodes must be an integer > 0"),
        (lambda d: d["groups"][0].pop("name"), "groups[0]: missing key 'name'"),
        (lambda d: d["network"].pop("latency_us"), "network: missing key 'latency_us'"),
        (lambda d: d.update(placement=["v100"] * 8), "puts 8 ranks on group 'v100'"),
        (lambda d: d.update(placement=["v100"] * 4 + ["a10"] * 4), "unknown group 'a10'"),
        (lambda d: d["groups"][0].update(node_link={"bandwidth_gbps": -1, "latency_us": 1}),
         "node_link.bandwidth_gbps must be > 0"),
    ],
)  # fmt: skip
def test_bad_hybrid_files_are_one_line(capsys, tmp_path, mutate, message) -> None:
    data = json.loads(json.dumps(V100_T4))
    mutate(data)
    path = write(tmp_path / "bad.json", data)
    code, out, err = run(capsys, "inspect", "system", path)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and str(path) in err


def test_inspect_system_shows_groups_and_placement(capsys, tmp_path) -> None:
    path = write(tmp_path / "h.json", V100_T4)
    code, out, _ = run(capsys, "inspect", "system", path)
    assert code == 0
    assert "v100-32g" in out and "t4-16g" in out and "ranks 0-3: v100; ranks 4-7: t4" in out
    code, out, _ = run(capsys, "inspect", "system", path, "--json", "--world-size", "6")
    assert json.loads(out)["placement_runs"] == [["v100", 4], ["t4", 2]]


# -- generation ---------------------------------------------------------------------------------


def test_per_group_plan_files(tmp_path) -> None:
    data = {"ops": {"logits": "fp32"}, "groups": {"t4": {"fc*": "int8"}}}
    path = write(tmp_path / "p.json", data)
    plan = load_plan(path)
    assert plan == (("logits", "fp32"), ("t4:fc*", "int8"))
    assert plan_for_group(plan, "t4") == (("logits", "fp32"), ("fc*", "int8"))
    assert plan_for_group(plan, "v100") == (("logits", "fp32"),)
    assert load_plan(write(tmp_path / "q.json", json.loads(dump_plan(plan)))) == plan
    with pytest.raises(UserError, match="unknown key 'group'"):
        load_plan(write(tmp_path / "r.json", {"ops": {}, "group": {}}))


def test_groups_run_their_plans_with_the_same_gradient_collectives(registry) -> None:
    options = GenerateOptions(
        **{**SMALL, "dp": 4},
        precision=(("t4:fc1", "int8"), ("t4:q", "int8")),
        placement=(("v100", 2), ("t4", 2)),
    )
    workload = build_workload(options, registry)
    v100, t4 = workload.rank_classes
    assert v100.facts["device_groups"] == ["v100"] and t4.facts["device_groups"] == ["t4"]
    assert [g.rank_class.index for g in workload.ranks] == [0, 0, 1, 1]
    casts = [n.name for n in t4.nodes if is_cast(n.name)]
    assert casts and not any(is_cast(n.name) for n in v100.nodes)
    assert {n.dtype for n in t4.nodes if n.name.endswith("/fwd/fc1")} == {"int8"}
    assert {n.dtype for n in v100.nodes if n.name.endswith("/fwd/fc1")} == {"fp16"}

    def collectives(cls):
        return [
            (n.comm_type, n.comm_size, n.group_axes)
            for n in cls.nodes
            if n.type is NodeType.COMM_COLL
        ]

    assert collectives(v100) == collectives(t4)  # one gradient dtype, one bucket layout
    assert check_runs_to_completion(workload) > 0
    assert validate_workload(workload).ok


def test_generation_errors(registry) -> None:
    with pytest.raises(OptionError, match=r"names device groups \(t4\) but the run has none"):
        build_workload(GenerateOptions(**SMALL, precision=(("t4:fc1", "int8"),)), registry)
    with pytest.raises(OptionError, match="names device group 'a10', which holds no rank"):
        build_workload(
            GenerateOptions(
                **SMALL, precision=(("a10:fc1", "int8"),), placement=(("v100", 1), ("t4", 1))
            ),
            registry,
        )
    with pytest.raises(OptionError, match="places 3 ranks, but the run has 2"):
        build_workload(GenerateOptions(**SMALL, placement=(("v100", 2), ("t4", 1))), registry)
    with pytest.raises(OptionError, match=r"tp group of ranks 0\.\.3 spans device groups t4 and"):
        build_workload(
            GenerateOptions(**{**SMALL, "dp": 1, "tp": 4}, placement=(("v100", 2), ("t4", 2))),
            registry,
        )


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_groups_that_join_dp_and_tp_span_device_groups(registry, dtype: str) -> None:
    """Sequence parallelism's dp x tp all-reduce of norm gradients, and fp8's tp x dp amax
    group, join the device groups by design: only a pure tp (sp, ep) group must not."""
    sizes = {**SMALL, "dp": 2, "tp": 2, "tpsp": True, "batch": 4, "dtype": dtype}
    options = GenerateOptions(
        **sizes, mixed_precision=True, placement=(("v100", 2), ("t4", 2))
    )  # fmt: skip
    workload = build_workload(options, registry)
    assert validate_workload(workload).ok
    check_runs_to_completion(workload)
    # a group joins both device groups, and each tp group sits in one of them
    assert any({0, 2} <= set(m) for m in workload.comm_groups.values())
    assert {tuple(workload.layout.members(r, ("tp",))) for r in range(4)} == {(0, 1), (2, 3)}


def test_single_group_generation_is_unchanged(registry) -> None:
    """A placement with one plan for every group builds the same nodes as no placement."""
    plain = build_workload(GenerateOptions(**SMALL), registry)
    placed = build_workload(GenerateOptions(**SMALL, placement=(("v100", 1), ("t4", 1))), registry)
    assert [n for n in plain.rank_classes[0].nodes] == [n for n in placed.rank_classes[0].nodes]


# -- prediction ---------------------------------------------------------------------------------


def test_one_fast_one_slow_gpu_take_the_slow_ones_time(capsys, tmp_path) -> None:
    """dp = 2 over one A100 and one T4: the A100 waits at every gradient reduction, so the
    iteration is the T4's compute plus its exposed synchronisation, exactly the time of two
    T4s; the A100's waits add up to the difference of the two local times."""
    network = {"bandwidth_gbps": 10, "latency_us": 5}
    duo = write(tmp_path / "duo.json", {
        "groups": [{"name": "fast", "device": "a100-40g", "gpus_per_node": 1},
                   {"name": "slow", "device": "t4-16g", "gpus_per_node": 1}],
        "network": network})  # fmt: skip
    slow2 = write(tmp_path / "slow2.json", {
        "groups": [{"name": "slow", "device": "t4-16g", "gpus_per_node": 1, "nodes": 2}],
        "network": network})  # fmt: skip
    code, out, err = run(capsys, "predict", "--system", duo, *SMALL_ARGS, "--json", "--explain")
    assert code == 0, err
    hybrid = json.loads(out)["time"]
    code, out, err = run(capsys, "predict", "--system", slow2, *SMALL_ARGS, "--json")
    assert code == 0, err
    alone = json.loads(out)["time"]
    fast, slow = hybrid["groups"]["fast"], hybrid["groups"]["slow"]
    assert hybrid["straggler"] == "slow" and slow["device"] == "t4-16g"
    assert hybrid["placement"] == [["fast", 1], ["slow", 1]]
    assert hybrid["iteration_time_s"] == pytest.approx(alone["iteration_time_s"], rel=1e-12)
    assert hybrid["iteration_time_s"] == pytest.approx(
        slow["compute_s"] + slow["exposed_communication_s"], rel=1e-9
    )
    assert slow["sync_wait_s"] == 0 and fast["compute_s"] < slow["compute_s"]
    assert [p["type"] for p in fast["sync_points"]] == ["all_reduce"] * len(fast["sync_points"])
    assert fast["sync_wait_s"] == pytest.approx(sum(p["wait_s"] for p in fast["sync_points"]))
    assert hybrid["explain"]["straggler"] == "slow"
    # every compute node of the slow rank priced on the T4 alone, as the replay did
    registry = load_registry(autoload=False)
    workload = build_workload(GenerateOptions(**SMALL), registry)
    t4 = load_system("t4-16g")
    total = sum(
        compute_time(n, t4, "fp16") for n in workload.ranks[1].nodes() if n.type is NodeType.COMP
    )
    assert slow["compute_s"] == pytest.approx(total, rel=1e-9)


def test_casts_are_counted_on_their_group(int8_registry) -> None:
    system = hybrid_from_dict(V100_T4, "h.json")
    options = GenerateOptions(
        **{**SMALL, "dp": 8}, precision=(("t4:fc1", "int8"),), placement=(("v100", 4), ("t4", 4))
    )
    workload = build_workload(options, int8_registry)
    report = int8_registry.predictors.get("time").predict(
        workload, system, kernels=list(int8_registry.kernels)
    )
    kernel = KernelTable.build(list(int8_registry.kernels), "t4-16g").get("gemm", "int8")
    t4_class = workload.ranks[4].rank_class
    expected = sum(
        kernel.cast_alpha * n.num_ops + kernel.cast_beta
        for n in t4_class.nodes
        if is_cast(n.name) and n.dtype == "int8"
    ) + sum(
        compute_time(n, system.group_of(4).device, "fp16")
        for n in t4_class.nodes
        if is_cast(n.name) and n.dtype != "int8"
    )
    assert report["groups"]["t4"]["casts_s"] == pytest.approx(expected, rel=1e-9)
    assert report["groups"]["v100"]["casts_s"] == 0
    assert report["kernels"] == ["int8-gemm-t4"]  # V100 has no int8 tensor cores


def test_v100_t4_acceptance(capsys, tmp_path) -> None:
    """4 x V100 + 4 x T4, dp 8: generates, validates, runs in the feeder; the T4 group is the
    straggler with the fp16 plan, and int8 on its linear layers narrows the gap."""
    system = write(tmp_path / "h.json", V100_T4)
    out_dir = tmp_path / "trace"
    code, _, err = run(capsys, "generate", "--system", system, *WIDE_ARGS, "--output_dir", out_dir)
    assert code == 0, err
    code, out, err = run(capsys, "validate", out_dir)
    assert code == 0, err + out
    code, out, err = run(capsys, "feed", out_dir)
    assert code == 0, err + out
    gaps = {}
    for name, plan in (
        ("fp16", None),
        ("int8", {"groups": {"t4": {"fc1": "int8", "fc2": "int8", "logits": "int8"}}}),
    ):
        extra = [] if plan is None else ["--precision_plan", write(tmp_path / "p.json", plan)]
        code, out, err = run(
            capsys, "-p", "stg_int8_kernels", "predict", "--system", system, *WIDE_ARGS, *extra,
            "--json",
        )  # fmt: skip
        assert code == 0, err
        report = json.loads(out)
        time = report["time"]
        assert time["straggler"] == "t4"
        local = {g: e["compute_s"] + e["casts_s"] for g, e in time["groups"].items()}
        gaps[name] = local["t4"] - local["v100"]
        memory = report["memory"]["groups"]
        assert memory["t4"]["capacity_bytes"] == 16 * 2**30 and memory["t4"]["fits"]
        assert memory["v100"]["capacity_bytes"] == 32 * 2**30
    assert 0 < gaps["int8"] < gaps["fp16"]


def test_predict_table_names_the_straggler(capsys, tmp_path) -> None:
    system = write(tmp_path / "h.json", V100_T4)
    args = [*SMALL_ARGS[:-2], "--dp", "8"]
    code, out, err = run(capsys, "predict", "--system", system, *args, "--explain")
    assert code == 0, err
    assert "per device group (ranks in order: v100 x 4, t4 x 4; straggler: t4)" in out
    assert "wait at each synchronisation point" in out
    code, out, err = run(capsys, "predict", "--system", system, *SMALL_ARGS[:-2], "--dp", "16")
    assert code == 2 and err.count("\n") == 1 and "16 ranks" in err and "8 GPUs" in err


# -- planner ------------------------------------------------------------------------------------


def test_planner_meets_a_reachable_target_with_least_lost_precision(int8_registry) -> None:
    system = hybrid_from_dict(V100_T4, "h.json")
    options = GenerateOptions(**WIDE)
    free = search_hybrid_precision(options, int8_registry, system, dtypes=("fp16", "int8"))
    assert not free.met  # the V100s alone are far faster than any T4 plan
    assert free.best.time_s < free.baseline.time_s and free.steps
    assert all(s.group == "t4" for s in free.steps)  # only the straggler is lowered
    # a target between the baseline and the best reachable: met after the first change(s),
    # with no more lost precision than the free search's at that point
    first = free.steps[0].time_s
    target = search_hybrid_precision(
        options, int8_registry, system, dtypes=("fp16", "int8"), target_s=first
    )
    assert target.met and target.best.time_s <= first
    assert len(target.steps) == 1 and target.lost == pytest.approx(free.steps[0].lost)
    # the proxy: a group's share of the batch times the rise in rounding error
    assert target.lost == pytest.approx(0.5 * (2**-3 - 2**-11))


def test_planner_follows_the_sensitivity_file(int8_registry) -> None:
    system = hybrid_from_dict(V100_T4, "h.json")
    options = GenerateOptions(**WIDE)
    free = search_hybrid_precision(options, int8_registry, system, dtypes=("fp16", "int8"))
    first = free.steps[0]
    # the first op chosen becomes very sensitive; everything else costs what the proxy says
    scores = {op: 1.0 for op in ("q", "k", "v", "attn_out", "fc1", "fc2", "logits")}
    scores[first.op] = 1e6
    result = search_hybrid_precision(
        options, int8_registry, system, dtypes=("fp16", "int8"), sensitivity=scores
    )
    assert result.steps and result.steps[0].op != first.op


def test_planner_respects_every_groups_memory(int8_registry) -> None:
    """A batch whose all-fp16 activations overflow the 16 GiB T4s but not the 32 GiB V100s:
    the planner first lowers T4 ops (1-byte saved inputs) until the T4s fit; a budget that no
    plan meets is one error. (Batch 440: at 464 the last stage's cross-entropy transient,
    Megatron's 16-bit logits beside its fp32 copy, leaves no plan that fits the T4s.)"""
    system = hybrid_from_dict(V100_T4, "h.json")
    options = GenerateOptions(**{**WIDE, "batch": 440})
    result = search_hybrid_precision(options, int8_registry, system, dtypes=("fp16", "int8"))
    baseline, best = result.baseline, result.best
    assert baseline.peak_bytes["t4"] > 16 * 2**30 and baseline.peak_bytes["v100"] < 32 * 2**30
    assert best.peak_bytes["t4"] <= 16 * 2**30 and best.peak_bytes["v100"] <= 32 * 2**30
    assert result.steps and {s.group for s in result.steps} == {"t4"}
    with pytest.raises(UserError, match="no plan fits the memory of group 'v100'"):
        search_hybrid_precision(
            GenerateOptions(**WIDE), int8_registry, system, dtypes=("fp16", "int8"), budget=2**30
        )


def test_plan_precision_cli_on_a_hybrid_system(capsys, tmp_path) -> None:
    system = write(tmp_path / "h.json", V100_T4)
    plan = tmp_path / "plan.json"
    code, out, err = run(
        capsys, "-p", "stg_int8_kernels", "plan", "precision", "--system", system, *WIDE_ARGS,
        "--dtypes", "fp16,int8", "--out", plan, "--json",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert result["best"]["straggler"] == "t4" and result["steps"]
    written = json.loads(plan.read_text())
    assert set(written["groups"]) == {"t4"} and written["ops"] == {}
    code, out, err = run(
        capsys, "-p", "stg_int8_kernels", "predict", "--system", system, *WIDE_ARGS,
        "--precision_plan", plan, "--json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["time"]["iteration_time_s"] == pytest.approx(
        result["best"]["iteration_time_s"]
    )
    for extra, message in [
        (["--target-time", "fast"], "--target-time 'fast' is not a positive duration"),
        (["--sensitivity", tmp_path / "none.json"], "no such file"),
    ]:
        code, out, err = run(
            capsys, "plan", "precision", "--system", system, *SMALL_ARGS, *extra, "--out", plan
        )
        assert code == 2 and err.count("\n") == 1 and message in err
    code, out, err = run(
        capsys, "plan", "precision", *SMALL_ARGS, "--target-time", "1s", "--out", plan
    )
    assert code == 2 and "--target-time applies to a hybrid --system" in err
    code, out, err = run(capsys, "plan", "precision", *SMALL_ARGS, "--exact", "--out", plan)
    assert code == 2 and "--exact applies to a hybrid --system" in err
    scores = write(tmp_path / "s.json", {"ops": {"fc1": 1, "fc2": 1}})
    code, out, err = run(
        capsys, "-p", "stg_int8_kernels", "plan", "precision", "--system", system, *WIDE_ARGS,
        "--dtypes", "fp16,int8", "--sensitivity", scores, "--exact", "--out", plan, "--json",
    )  # fmt: skip
    assert code == 0, err
    exact = json.loads(out)
    assert exact["evaluations"] == 4 and exact["lost_precision_measure"] == "sensitivity file"


def test_casts_cost_alpha_plus_beta_bytes_per_device(registry) -> None:
    """Without a kernel plugin a cast costs the device's default alpha + beta·bytes (launch,
    streaming rate); a calibration table's measured streaming model replaces it."""
    from stg.perf.calibration import calibration_from_dict
    from stg.perf.casts import default_cast_model

    options = GenerateOptions(
        **SMALL, precision=(("t4:fc1", "fp32"), ("v100:fc1", "fp32")),
        placement=(("v100", 1), ("t4", 1)),
    )  # fmt: skip
    workload = build_workload(options, registry)
    casts = [n for n in workload.rank_classes[0].nodes if is_cast(n.name)]
    forward = [n for n in casts if "/fwd/" in n.name]
    assert forward and all(n.tensor_size == n.num_ops * (2 + 4) for n in forward)  # fp16->fp32
    for name in ("t4-16g", "v100-32g"):
        device = load_system(name)
        model = default_cast_model(device)
        assert model.alpha == 2e-6 and model.beta == 1 / (device.hbm_bandwidth * 0.8)
        for node in casts:
            assert compute_time(node, device, "fp16") == pytest.approx(
                model.alpha + model.beta * node.tensor_size, rel=1e-9
            )
        assert model.time(1000, "fp16", "fp32") == pytest.approx(2e-6 + 6000 * model.beta)
    measured = calibration_from_dict(
        {"format": "stg-calibration", "version": 1, "device": "Tesla T4", "entries": [],
         "models": [{"op_class": "stream", "dtype": "fp32", "latency_us": 7.0, "gbps": 200.0,
                     "bytes_range": [1, 1e12]}]}
    )  # fmt: skip
    node = forward[0]
    t4 = load_system("t4-16g")
    assert compute_time(node, t4, "fp16", calibration=measured) == pytest.approx(
        7e-6 + node.tensor_size / 200e9
    )


# -- docs/hybrid.md -----------------------------------------------------------------------------

HYBRID_DOC = Path(__file__).resolve().parents[1] / "docs" / "hybrid.md"


def test_hybrid_doc_commands_run(tmp_path, monkeypatch) -> None:
    import re
    import shlex

    from typer.testing import CliRunner

    from stg.cli import app

    text = HYBRID_DOC.read_text(encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STG_DISABLE_PLUGIN_AUTOLOAD", "1")
    files = dict(re.findall(r"^```json ([\w.-]+)\n(.*?)^```", text, re.S | re.M))
    assert set(files) == {"v100-t4.json", "t4-int8.json", "sensitivity.json"}
    for name, body in files.items():
        (tmp_path / name).write_text(body, encoding="utf-8")
    commands = [
        line[2:]
        for body in re.findall(r"^```console\n(.*?)^```", text, re.S | re.M)
        for line in body.splitlines()
        if line.startswith("$ stg ")
    ]
    assert len(commands) >= 8
    for command in commands:
        result = CliRunner().invoke(app, shlex.split(command)[1:], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
    assert "groups" in json.loads((tmp_path / "plan.json").read_text())
    bad = json.loads(files["v100-t4.json"])
    bad["placement"] = ["v100"] * 8
    (tmp_path / "v100-t4.json").write_text(json.dumps(bad), encoding="utf-8")
    result = CliRunner().invoke(app, ["inspect", "system", "v100-t4.json"])
    line = result.stderr.strip()
    assert result.exit_code == 2 and line.startswith("error: v100-t4.json: placement puts 8")
    assert f"`{line}`" in " ".join(text.split())


def test_greedy_is_not_optimal_and_the_exact_search_is(int8_registry) -> None:
    """Three T4 ops may go to int8: logits saves the most time, fc1 and fc2 less each but more
    together. Target: the time with fc1 and fc2 in int8, which logits alone misses. With
    sensitivities fc1 = fc2 = 1 and logits = L, 1 < L < gain(logits)/gain(fc1), greedy takes
    logits first (best gain per lost precision) and then needs fc1 too: lost 0.5·(L + 1);
    the optimum, by hand over the 8 subsets, is {fc1, fc2}: lost 0.5·2 = 1 < 0.5·(L + 1)."""
    system = hybrid_from_dict(V100_T4, "h.json")
    options = GenerateOptions(**WIDE, placement=(("v100", 4), ("t4", 4)))
    registry = int8_registry

    def time_of(*ops: str) -> float:
        workload = build_workload(
            replace(options, precision=tuple((f"t4:{op}", "int8") for op in ops)), registry
        )
        return registry.predictors.get("time").predict(
            workload, system, kernels=list(registry.kernels)
        )["iteration_time_s"]

    base = time_of()
    gain = {op: base - time_of(op) for op in ("logits", "fc1", "fc2")}
    target = time_of("fc1", "fc2")
    # the instance's premises, from the predictions
    assert gain["logits"] > gain["fc1"] > gain["fc2"] > 0
    assert base - gain["logits"] > target >= time_of("logits", "fc1")
    scale = (1 + gain["logits"] / gain["fc1"]) / 2  # strictly between 1 and the gain ratio
    scores = {"logits": {"int8": scale}, "fc1": {"int8": 1}, "fc2": {"int8": 1}}
    kwargs = dict(dtypes=("fp16", "int8"), sensitivity=scores, target_s=target)
    greedy = search_hybrid_precision(options, registry, system, **kwargs)
    exact = exact_hybrid_precision(options, registry, system, **kwargs)
    assert [(s.op, s.dtype) for s in greedy.steps] == [("logits", "int8"), ("fc1", "int8")]
    assert greedy.met and greedy.lost == pytest.approx(0.5 * (scale + 1))
    assert exact.met and exact.lost == pytest.approx(1.0) and exact.lost < greedy.lost
    assert dict(exact.best.plan) == {"t4:fc1": "int8", "t4:fc2": "int8"}
    assert exact.evaluations == 8  # every subset of the three ops on the T4s


def test_exact_search_refuses_too_many_plans(int8_registry) -> None:
    system = hybrid_from_dict(V100_T4, "h.json")
    with pytest.raises(UserError, match=r"--exact would predict 128 plans \(more than 100\)"):
        exact_hybrid_precision(
            GenerateOptions(**WIDE), int8_registry, system, dtypes=("fp16", "int8"), limit=100
        )


def test_pipeline_boundaries_between_groups_are_sync_points(registry) -> None:
    """pp 2 with stage 0 on the V100s and stage 1 on the T4s: the V100s wait at the
    receives of the gradients from the slower T4 stage."""
    system = hybrid_from_dict(V100_T4, "h.json")
    options = GenerateOptions(
        **{**SMALL, "dp": 4, "batch": 16, "num_stacks": 4}, pp=2, micro_batch=4,
        placement=(("v100", 4), ("t4", 4)),
    )  # fmt: skip
    report = registry.predictors.get("time").predict(build_workload(options, registry), system)
    v100, t4 = report["groups"]["v100"], report["groups"]["t4"]
    assert report["straggler"] == "t4"
    assert {p["type"] for p in v100["sync_points"]} == {"recv"}
    assert {p["name"].split("/")[-1].rsplit("_", 1)[0] for p in v100["sync_points"]} == {
        "recv_gradient"
    }
    assert v100["sync_wait_s"] > t4["sync_wait_s"] >= 0


def test_a_trace_larger_than_the_cluster_and_a_foreign_placement_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``stg predict DIR`` of a 16-rank trace on the 8-GPU cluster crashed (an index past the
    placement); ``--placement`` other than the system file's was neither checked nor used."""
    system = tmp_path / "v100-t4.json"
    system.write_text(json.dumps(V100_T4), encoding="utf-8")
    wide = [*SMALL_ARGS, "--dp", "16", "--batch", "16"]
    assert run(capsys, "generate", *wide, "--output_dir", str(tmp_path / "t16"))[0] == 0
    line = (
        "error: 16 ranks of the trace do not fit system 'v100+t4' (8 GPUs in groups v100: 4, t4: 4)"
    )
    for predictor in ("time", "memory"):
        code, out, err = run(
            capsys,
            "predict",
            str(tmp_path / "t16"),
            "--system",
            str(system),
            "--predictor",
            predictor,
        )
        assert (code, out, err.strip()) == (2, "", line)
    code, _, err = run(capsys, "predict", *SMALL_ARGS, "--dp", "8", "--batch", "8",
                       "--system", str(system), "--placement", "v100:8")  # fmt: skip
    assert code == 2 and err.strip() == (
        "error: placement=v100:8 differs from where system 'v100+t4' places the 8 ranks "
        "(v100:4,t4:4): leave --placement out with a hybrid system file, or give its placement"
    )
    eight = [*SMALL_ARGS, "--dp", "8", "--batch", "8", "--system", str(system), "--json"]
    plain = json.loads(run(capsys, "predict", *eight)[1])
    same = json.loads(run(capsys, "predict", *eight, "--placement", "v100:4,t4:4")[1])
    assert same == plain
    split = json.loads(run(capsys, "predict", *eight, "--placement", "v100:2,v100:2,t4:4")[1])
    assert split == plain


def test_memory_from_a_trace_on_a_cluster_is_per_group(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The memory report of a trace on a hybrid cluster was one device's (closed forms against
    the first group's capacity); it is the same per-group report as from the options."""
    system = tmp_path / "v100-t4.json"
    system.write_text(json.dumps(V100_T4), encoding="utf-8")
    eight = [*SMALL_ARGS, "--dp", "8", "--batch", "8"]
    assert run(capsys, "generate", *eight, "--output_dir", str(tmp_path / "t8"))[0] == 0
    flags = ["--system", str(system), "--predictor", "memory", "--json"]
    from_trace = json.loads(run(capsys, "predict", str(tmp_path / "t8"), *flags)[1])["memory"]
    from_options = json.loads(run(capsys, "predict", *eight, *flags)[1])["memory"]
    assert from_trace == from_options
    assert {c["group"] for c in from_trace["classes"]} == {"v100", "t4"}


def test_a_trace_generated_on_one_cluster_predicts_on_another(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, registry
) -> None:
    """The trace records the placement it was generated with; on a cluster that places its
    groups the other way round, the memory predictor refused it as a --placement nobody gave,
    where the time predictor answered. Both answer, with this cluster's placement. A workload
    larger than the cluster is one line from the API too (it was an IndexError)."""
    first = tmp_path / "v100-first.json"
    first.write_text(json.dumps(V100_T4), encoding="utf-8")
    second = tmp_path / "t4-first.json"
    second.write_text(json.dumps({**V100_T4, "groups": V100_T4["groups"][::-1]}), encoding="utf-8")
    eight = [*SMALL_ARGS, "--dp", "8", "--batch", "8"]
    trace = tmp_path / "t8"
    assert run(capsys, "generate", *eight, "--system", first, "--output_dir", trace)[0] == 0
    for predictor in ("time", "memory"):
        code, _, err = run(capsys, "predict", trace, "--system", second, "--predictor", predictor)
        assert code == 0, err
    from stg.predictors.memory import predict_memory

    wide = GenerateOptions(**{**SMALL, "dp": 16, "batch": 16})
    with pytest.raises(UserError, match="16 ranks do not fit system 'v100\\+t4' \\(8 GPUs"):
        predict_memory(build_workload(wide, registry), load_system(str(first)))
