"""The presets of 2025-26 (Blackwell HGX and NVL72, AMD Instinct MI300X/MI325X/MI355X, H20,
L40S): their figures against the data sheets, predictions on them, the attention kernel of
each architecture, and rack-scale NVLink domains (placement, all-to-all, search)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import CollectiveType
from stg.errors import UnknownNameError, UserError
from stg.host.registry import load_registry
from stg.perf import comm_time
from stg.perf.costs import attention_impl, collective_time, group_shape
from stg.perf.kernel_time import FUSED_ATTENTION, attention_kernel_for, attention_time
from stg.perf.system import PRESETS, load_system, system_from_dict

runner = CliRunner()
REGISTRY = load_registry(autoload=False)

# Figures as the cited data sheets print them (see each preset's ``sources``), per GPU, dense:
# NVIDIA's tables give 2:4-sparse rates for a baseboard or a rack, halved and divided here.
# (peaks in TFLOP/s, HBM GB/s and GB, SMs or CUs, TDP W, arch, scale-up domain size, NVLink or
# Infinity Fabric GB/s per direction, NIC GB/s per GPU)
HGX_B200 = 8  # GPUs per HGX baseboard
NVL72 = 72
DATA_SHEETS = {
    "b200-180g": dict(
        peaks=dict(fp4=144e3 / HGX_B200 / 2, fp6=72e3 / 16, fp8=72e3 / 16, int8=72e3 / 16,
                   bf16=36e3 / 16, fp16=36e3 / 16, tf32=18e3 / 16, fp32=600 / 8),
        hbm=(64e3 / 8, 1440 / 8), sms=148, tdp=1000, arch="blackwell",
        domain=(8, 1800 / 2), nic=400 / 8,
    ),
    "b300-288g": dict(
        peaks=dict(fp4=105e3 / 8, fp6=72e3 / 16, fp8=72e3 / 16, int8=150, bf16=36e3 / 16,
                   fp16=36e3 / 16, tf32=18e3 / 16, fp32=600 / 8),
        hbm=(8000, 288), sms=160, tdp=1100, arch="blackwell", domain=(8, 900), nic=800 / 8,
    ),
    "gb200-nvl72": dict(
        peaks=dict(fp4=1440e3 / NVL72 / 2, fp6=720e3 / 144, fp8=720e3 / 144, int8=720e3 / 144,
                   bf16=360e3 / 144, fp16=360e3 / 144, tf32=180e3 / 144, fp32=5760 / 72),
        hbm=(576e3 / 72, 186), sms=148, tdp=1200, arch="blackwell", domain=(72, 900),
        nic=400 / 8,
    ),
    "gb300-nvl72": dict(
        peaks=dict(fp4=1080e3 / 72, fp6=720e3 / 144, fp8=720e3 / 144, int8=160,
                   bf16=360e3 / 144, fp16=360e3 / 144, tf32=180e3 / 144, fp32=80),
        hbm=(576e3 / 72, 288), sms=160, tdp=1400, arch="blackwell", domain=(72, 900),
        nic=800 / 8,
    ),
    "mi300x-192g": dict(
        peaks=dict(fp8=2614.9, int8=2614.9, bf16=1307.4, fp16=1307.4, tf32=653.7, fp32=163.4),
        hbm=(5300, 192), sms=304, tdp=750, arch="cdna3", domain=(8, 896 / 2), nic=400 / 8,
    ),
    "mi325x-256g": dict(
        peaks=dict(fp8=2614.9, int8=2614.9, bf16=1307.4, fp16=1307.4, tf32=653.7, fp32=163.4),
        hbm=(6000, 256), sms=304, tdp=1000, arch="cdna3", domain=(8, 896 / 2), nic=400 / 8,
    ),
    "mi355x-288g": dict(
        peaks=dict(fp4=10066.3, fp6=10066.3, fp8=5033.2, int8=5033.2, bf16=2516.6,
                   fp16=2516.6, tf32=157.3, fp32=157.3),
        hbm=(8000, 288), sms=256, tdp=1400, arch="cdna4", domain=(8, 1075.2 / 2), nic=400 / 8,
    ),
    "h20-96g": dict(
        peaks=dict(fp8=296, int8=296, bf16=148, fp16=148, tf32=74, fp32=44),
        hbm=(4000, 96), sms=78, tdp=400, arch="hopper", domain=(8, 900 / 2), nic=400 / 8,
    ),
    "l40s-48g": dict(
        peaks=dict(fp8=733, int8=733, bf16=362.05, fp16=362.05, tf32=183, fp32=91.6),
        hbm=(864, 48), sms=568 // 4, tdp=350, arch="ada", domain=(8, 64 / 2), nic=None,
    ),
}  # fmt: skip
NEW = sorted(DATA_SHEETS)
SOURCED = ("peak_tflops", "hbm", "sm_count", "peak_clock_ghz", "sustained_clock_ghz", "tdp_w",
           "network")  # fmt: skip


@pytest.mark.parametrize("name", NEW)
def test_preset_matches_its_data_sheet(name: str) -> None:
    sheet = DATA_SHEETS[name]
    system = load_system(name)
    peaks = {d: system.peak_flops[d] / 1e12 for d in system.peak_flops}
    assert peaks == pytest.approx(sheet["peaks"], rel=1e-9)  # fp4/fp6 only where the GPU has them
    assert (system.hbm_bandwidth / 1e9, system.hbm_capacity / 2**30) == sheet["hbm"]
    assert (system.sm_count, system.tdp_w) == (sheet["sms"], sheet["tdp"])
    assert system.arch == sheet["arch"]
    domain = system.network[0]
    assert (domain.size, domain.bandwidth / 1e9) == pytest.approx(sheet["domain"])
    if sheet["nic"] is not None:
        assert system.network[-1].bandwidth / 1e9 == sheet["nic"]
        assert (system.network[-1].size, system.network[-1].link) == (0, "network")
    # every figure names its source; an unmeasured sustained clock says so and is the clock
    # of the data sheet's peaks
    assert all(system.sources.get(key, "").strip() for key in SOURCED), system.sources
    if "no measurement" in system.sources["sustained_clock_ghz"]:
        assert system.sustained_clock_ghz == system.peak_clock_ghz
    shown = runner.invoke(app, ["inspect", "system", name, "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["sources"] == dict(system.sources)


@pytest.mark.parametrize(
    ("name", "flop_per_unit_clock"),
    [("b200-180g", 8192), ("b300-288g", 8192), ("gb200-nvl72", 8192), ("gb300-nvl72", 8192),
     ("mi300x-192g", 2048), ("mi325x-256g", 2048), ("mi355x-288g", 4096), ("l40s-48g", 1024)],
)  # fmt: skip
def test_peak_clock_is_the_clock_of_the_peaks(name: str, flop_per_unit_clock: int) -> None:
    """The 16-bit peak is SMs (CUs) x dense FLOP per SM per clock x ``peak_clock_ghz``: AMD's
    data sheets give the clock, NVIDIA's the peak (the clock is derived)."""
    system = load_system(name)
    rate = system.sm_count * flop_per_unit_clock * system.peak_clock_ghz * 1e9
    assert rate == pytest.approx(system.peak("bf16"), rel=1e-3)


def test_existing_presets_are_unchanged() -> None:
    h100 = load_system("h100-80g")
    assert (h100.peak("bf16"), h100.hbm_bandwidth, h100.arch) == (989.4e12, 3350e9, "hopper")
    assert not h100.sources and "fp4" not in h100.peak_flops
    assert "sources" not in h100.as_dict() and set(h100.as_dict()["peak_tflops"]) == {
        "fp32", "tf32", "bf16", "fp16", "fp8", "int8"
    }  # fmt: skip


def test_fp4_and_fp6_peaks_only_where_the_gpu_has_them() -> None:
    assert load_system("b200-180g").peak("fp4") == 9000e12
    assert load_system("mi355x-288g").peak("FP6") == pytest.approx(10066.3e12)
    with pytest.raises(UnknownNameError, match="'h100-80g' has no fp4 tensor cores"):
        load_system("h100-80g").peak("fp4")
    data = json.loads(json.dumps(PRESETS["b200-180g"]))
    data["peak_tflops"]["fp3"] = 1
    with pytest.raises(UserError, match=r"and fp6 and fp4 where the GPU has them.*unknown fp3"):
        system_from_dict(data)
    data = json.loads(json.dumps(PRESETS["b200-180g"]))
    data["sources"]["hbm"] = 8
    with pytest.raises(UserError, match=r"sources\.hbm must be text"):
        system_from_dict(data)


def test_inspect_system_names_the_sources_and_every_peak() -> None:
    result = runner.invoke(app, ["inspect", "system", "b200-180g"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "fp8 4500 / int8 4500 / fp6 4500 / fp4 9000 TFLOP/s (dense)" in result.stdout
    assert "source of sustained_clock_ghz: measured: 1.58 GHz" in result.stdout
    result = runner.invoke(app, ["inspect", "system", "mi355x-288g"], env={"COLUMNS": "300"})
    assert "source of sustained_clock_ghz: no measurement" in result.stdout


SMALL = ["--num_stacks", "2", "--seq", "512"]


@pytest.mark.parametrize("name", NEW)
def test_predicts_training_and_decode(name: str) -> None:
    train = ["predict", "--model", "llama3-8b", "--tp", "2", "--batch", "2", "--micro_batch",
             "2", *SMALL, "--system", name, "--json"]  # fmt: skip
    result = runner.invoke(app, train)
    assert result.exit_code == 0, result.output
    time = json.loads(result.stdout)["time"]
    system = load_system(name)
    assert time["peak_flops_per_gpu"] == system.peak("bf16")  # MFU against the bf16 peak
    assert time["mfu"] == pytest.approx(
        time["model_flops"] / (time["iteration_time_s"] * 2 * system.peak("bf16"))
    )
    assert 0 < time["mfu"] < 1
    decode = ["predict", "--model", "llama3-8b", "--phase", "decode", "--tp", "2", "--batch",
              "8", "--context", "1024", *SMALL, "--system", name, "--json"]  # fmt: skip
    result = runner.invoke(app, decode)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["serving"]["time_per_output_token_s"] > 0


def test_mfu_of_an_fp8_plan_is_against_the_fp8_peak() -> None:
    args = ["predict", "--model", "llama3-8b", "--tp", "2", "--batch", "2", "--micro_batch",
            "2", *SMALL, "--dtype", "fp8", "--system", "b200-180g", "--json"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["time"]["peak_flops_per_gpu"] == 4500e12


# -- the attention kernel of each architecture -------------------------------------------------


@pytest.mark.parametrize(
    ("name", "megatron", "eager"),
    [("h100-80g", "cudnn", "cudnn"), ("a100-80g", "flash2", "flash2"),
     ("l40s-48g", "flash2", "flash2"), ("b200-180g", "cudnn", "cudnn"),
     ("gb300-nvl72", "cudnn", "flash2"), ("mi300x-192g", "aiter", "ck"),
     ("mi355x-288g", "aiter", "ck"), ("t4-16g", "flash2", "flash2")],
)  # fmt: skip
def test_attention_kernel_follows_the_architecture(name: str, megatron: str, eager: str) -> None:
    system = load_system(name)
    assert attention_impl("megatron", system) == megatron
    assert attention_impl("eager", system) == eager
    gpu = system.gpu
    shape = dict(batch=1, heads=32, s_q=8192, s_kv=8192, head_dim=128)
    fused = attention_time(gpu, megatron, **shape)
    unfused = attention_time(gpu, "unfused", **shape)
    if system.arch == "turing":  # no fused kernel: priced unfused
        assert fused == unfused
        return
    kernel = FUSED_ATTENTION[system.arch][megatron]
    assert kernel.name == megatron
    # saturated: 64 x 32 query blocks of 128 rows over the SMs, each attending to (64 + 1) / 2
    # key blocks on average (causal), at the kernel's fraction of the clock-scaled peak
    work = 4.0 * 128 * 128 * (64 + 1) / 2 * 128
    per_sm = system.peak("bf16") * gpu.clock_scale * kernel.efficiency_for(128, False)
    per_sm /= system.sm_count
    waves = math.ceil(64 * 32 / system.sm_count)
    assert fused == pytest.approx(waves * (work / per_sm + kernel.block_overhead_s[0]))
    assert fused < unfused


def test_blackwell_attention_from_its_published_rates() -> None:
    """FlashAttention-4 at 1,237 TFLOP/s (d 128, bf16, a B200 throttled to 1.58 GHz) is 1.3x
    cuDNN 9.13; cuDNN's d 64 runs 1,150 of FA4's 1,605 / 1.3 at d 128; FA2's sm_80 code runs
    2.86x slower than cuDNN's on sm_100 (kernel_time's sources)."""
    kernels = FUSED_ATTENTION["blackwell"]
    peak_at_sustained = 148 * 8192 * 1.58e9 / 1e12
    cudnn = kernels["cudnn"]
    assert cudnn.efficiency_for(128, False) * peak_at_sustained * 1.3 == pytest.approx(1237)
    assert cudnn.efficiency_for(64, False) / cudnn.efficiency_for(128, False) == pytest.approx(
        1150 / (1605 / 1.3)
    )
    assert cudnn.efficiency_for(64, False) / kernels["flash2"].efficiency_for(
        64, False
    ) == pytest.approx(2.86)
    assert attention_kernel_for("volta", "megatron") == "flash2"  # absent there: unfused


# -- rack-scale NVLink domains ------------------------------------------------------------------


def _moe(**plan: int) -> GenerateOptions:
    """A mixture of 64 experts whose all-to-all moves 8 MiB per rank at ep 64 (1,024 tokens,
    2 experts each, dmodel 2,048 in bf16): bandwidth-bound, as training dispatches are."""
    return GenerateOptions(
        model="moe", dvocal=256, dmodel=2048, dff=1024, head=16, kvhead=4, seq=1024,
        num_stacks=1, experts=64, kexperts=2, **plan,
    )  # fmt: skip


def test_nvl72_prices_an_expert_all_to_all_of_64_on_nvlink() -> None:
    """ep 64 fills 64 of an NVL72 rack's 72 GPUs: its all-to-all never reaches a NIC, where on
    HGX B200 nodes of 8 it crosses 8 nodes over the scale-out network."""
    o = _moe(ep=64, batch=64, micro_batch=64)
    workload = build_workload(o, REGISTRY)
    a2a = [n for n in workload.ranks[0].nodes() if n.comm_type is CollectiveType.ALL_TO_ALL]
    assert a2a
    rack, hgx = load_system("gb200-nvl72"), load_system("b200-180g")
    for node in a2a:
        members = workload.comm_groups[node.comm_group]
        assert len(members) == 64 and node.comm_size == 1024 * 2 * 2048 * 2
        assert group_shape(members, rack) == (64, 1)
        assert group_shape(members, hgx) == (8, 8)
        on_nvlink = comm_time.level_time(
            comm_time.Kind.ALL_TO_ALL, node.comm_size, 64, comm_time.Level.of(rack.network[0])
        )
        shape = group_shape(members, rack)
        assert collective_time(node.comm_type, node.comm_size, shape, rack) == on_nvlink
        assert collective_time(node.comm_type, node.comm_size, shape, rack) < collective_time(
            node.comm_type, node.comm_size, group_shape(members, hgx), hgx
        )


def test_tp_cp_and_ep_are_placed_inside_the_domain(tmp_path: Path) -> None:
    """The default rank order (tp, cp, ep innermost) keeps tp x cp x ep = 64 inside a 72-GPU
    domain, and 128 inside a 144-GPU one (a system file of that size)."""
    from stg.predictors.analytical import group_members

    o = _moe(tp=2, sp=2, ep=16, dp=2, batch=64, micro_batch=32)
    rack = load_system("gb200-nvl72")
    for axes in (("tp",), ("sp",), ("ep",), ("tp", "sp", "ep")):
        shape = group_shape(group_members(axes, o), rack)
        assert shape[1] == 1, (axes, shape)
    wide = json.loads(json.dumps(PRESETS["gb200-nvl72"]))
    wide["name"] = "nvl144"
    wide["network"][0]["size"] = 144
    path = tmp_path / "nvl144.json"
    path.write_text(json.dumps(wide))
    domain144 = load_system(str(path))
    o = _moe(tp=2, sp=4, ep=16, dp=2, batch=64, micro_batch=32)
    assert group_shape(group_members(("tp", "sp", "ep"), o), domain144) == (128, 1)


def test_search_on_nvl72_considers_and_prices_ep_64(capsys: pytest.CaptureFixture[str]) -> None:
    """A mixture of 64 large experts on 64 GPUs: on a GB200 NVL72 rack the expert-parallel
    all-to-all of 64 stays on NVLink, and ep 64 prices within a few per cent of the best plan;
    on HGX B200 nodes of 8 the same plan crosses the network and is far behind."""
    model = ["--model", "moe", "--dvocal", "32000", "--dmodel", "4096", "--dff", "8192",
             "--head", "32", "--kvhead", "8", "--seq", "4096", "--num_stacks", "48",
             "--experts", "64", "--kexperts", "8", "--batch", "64"]  # fmt: skip
    space = ["--gpus", "64", "--tp", "1", "--pp", "1", "--cp", "1", "--zero", "0",
             "--schedule", "1f1b", "--recompute", "full", "--refine", "0",
             "--top", "20"]  # fmt: skip
    behind = {}
    for name in ("gb200-nvl72", "b200-180g"):
        result = runner.invoke(app, ["search", *model, *space, "-s", name, "--json"])
        assert result.exit_code == 0, result.output
        best = json.loads(result.stdout)["best"]
        times = {b["plan"]["ep"]: b["analytical"]["iteration_time_s"] for b in best}
        assert 64 in times
        behind[name] = times[64] / min(times.values())
    assert behind["gb200-nvl72"] < 1.05
    assert behind["b200-180g"] > 1.2


def test_search_enumerates_expert_parallelism_for_deepseek() -> None:
    from stg.explore.search import SearchSpace, plans

    base = GenerateOptions(model="deepseek", experts=64, num_stacks=4, batch=64)
    eps = {o.ep for o in plans(base, 64, SearchSpace(tp=[1], pp=[1]))}
    assert 64 in eps and 1 in eps


def test_search_widens_tensor_parallelism_to_the_nvlink_domain() -> None:
    from stg.explore.search import SearchSpace, plans, scale_up_size

    assert scale_up_size(load_system("gb200-nvl72")) == 72
    assert scale_up_size(load_system("h100-80g")) == 8
    assert scale_up_size(load_system("t4-16g")) == 4
    base = GenerateOptions(model="llama", num_stacks=4, batch=64)
    space = SearchSpace(pp=[1], recompute=["none"], sharding=["0"])
    assert {o.tp for o in plans(base, 64, space, scale_up=72)} == {1, 2, 4, 8, 16, 32, 64}
    assert {o.tp for o in plans(base, 64, space, scale_up=8)} == {1, 2, 4, 8}
    assert {o.tp for o in plans(base, 64, space, scale_up=4)} == {1, 2, 4, 8}  # as before
