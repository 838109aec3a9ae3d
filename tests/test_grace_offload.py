"""CPU activation offload on GB200/GB300 NVL72: each Grace-Blackwell superchip's two GPUs reach
the Grace's LPDDR5X over one NVLink-C2C, 900 GB/s both ways (450 per direction), shared by
the two (stg.perf.accelerators, "Host memory (Grace)"). The presets' host link, a system
file's ``host_link_gbps``, and the time predictor's copies, in closed form."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_cluster_runs import run_options
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.perf.costs import host_copy_time
from stg.perf.system import (
    HOST_LINK_BYTES_PER_S,
    SystemDescriptionError,
    host_link_bandwidth,
    load_system,
    system_from_dict,
)
from stg.predictors.memory import predict_memory
from stg.predictors.time import predict_time

BLACKWELL_RUNS = Path(__file__).parent / "data" / "runs" / "blackwell_runs.json"

C2C_BIDIRECTIONAL = 900e9  # NVIDIA GB200 NVL72 specifications: NVLink-C2C 900 GB/s
GPUS_PER_GRACE = 2  # one Grace CPU, two Blackwell GPUs per superchip


@pytest.mark.parametrize("preset", ["gb200-nvl72", "gb300-nvl72"])
def test_nvl72_copies_to_grace_at_its_half_of_the_c2c_link(preset: str) -> None:
    system = load_system(preset)
    per_gpu = C2C_BIDIRECTIONAL / 2 / GPUS_PER_GRACE
    assert host_link_bandwidth(system) == per_gpu == 225e9
    assert host_copy_time(450 * 10**6, system) == pytest.approx(2e-3)  # 450 MB at 225 GB/s
    assert "NVLink-C2C" in system.sources["host_link_gbps"]


def test_a_system_file_gives_its_host_link() -> None:
    data = load_system("h100-80g").as_dict()
    assert "host_link_gbps" not in data  # a PCIe host: the architecture's figure
    assert host_link_bandwidth(system_from_dict(data)) == HOST_LINK_BYTES_PER_S["hopper"]
    own = system_from_dict({**data, "host_link_gbps": 100})
    assert host_link_bandwidth(own) == 100e9
    assert system_from_dict(own.as_dict()) == own
    with pytest.raises(SystemDescriptionError, match="host_link_gbps"):
        system_from_dict({**data, "host_link_gbps": -1})


def test_time_predictor_prices_offload_over_the_c2c_link() -> None:
    """Every offloaded layer's saved bytes go to the Grace and back once per micro-batch:
    the replay's host-copy time is those bytes over the C2C share, and halving the link
    doubles it."""
    o = GenerateOptions(
        model="gpt", dvocal=1024, dmodel=256, dff=1024, head=8, kvhead=8, seq=128, batch=8,
        micro_batch=4, attention="unfused", num_stacks=4, cpu_offloading_num_layers=2,
    )  # fmt: skip
    b, s, h, f, a = o.micro_batch, o.seq, o.dmodel, o.dff, o.head
    saved = 2 * (8 * s * b * h + a * s * s * b + 2 * s * b * f)  # tests/test_cpu_offload.py
    registry = load_registry()
    workload = build_workload(o, registry)
    kernels = list(registry.kernels)
    system = load_system("gb200-nvl72")
    copies = o.micro_batches * o.cpu_offloading_num_layers * 2  # out and back
    rank = predict_time(workload, system, kernels=kernels)["ranks"][0]
    assert rank["host_copy_s"] == pytest.approx(copies * saved / 225e9)
    halved = dataclasses.replace(system, host_link=112.5e9)
    slower = predict_time(workload, halved, kernels=kernels)["ranks"][0]
    assert slower["host_copy_s"] == pytest.approx(2 * rank["host_copy_s"])


def test_blackwell_offload_runs_fit_their_hbm() -> None:
    """Megatron-Bridge's Llama 3 70B FSDP runs on GB200/GB300 NVL72 ran, offloading 40 and 20
    of their 80 layers' activations to the Grace (tests/data/runs/blackwell_runs.json): the
    memory predictor finds each within its GPU's HBM."""
    rows = json.loads(BLACKWELL_RUNS.read_text())
    offloading = [e for e in rows["entries"] if e["options"].get("cpu_offloading_num_layers")]
    assert {e["system"] for e in offloading} == {"gb200-nvl72", "gb300-nvl72"}
    registry = load_registry(autoload=False)
    for entry in offloading:
        o = run_options(entry, registry)
        report = predict_memory(build_workload(o, registry), entry["system"])
        assert report["fits"], (entry["id"], report["peak_bytes"] / 2**30)


def test_serving_swaps_to_the_grace_at_the_c2c_share() -> None:
    """vLLM's swap preemption on a GB200 NVL72 copies over the same link: without
    --swap-bandwidth its copies take 64/225 of what they take at a PCIe Gen5 64 GB/s."""
    args = ["serve", "--model", "llama3-8b", "--system", "gb200-nvl72", "--rate", "20"]
    args += ["--duration", "2", "--prompt", "fixed:2000", "--output", "fixed:1000"]
    args += ["--preemption", "swap", "--gpu-memory-utilization", "0.1", "--json"]
    default = CliRunner().invoke(app, args)
    assert default.exit_code == 0, default.output
    pcie = CliRunner().invoke(app, [*args, "--swap-bandwidth", "64"])
    swapped, over_pcie = json.loads(default.stdout), json.loads(pcie.stdout)
    assert swapped["swapped_blocks"] == over_pcie["swapped_blocks"] > 0
    assert swapped["swap_s"] == pytest.approx(over_pcie["swap_s"] * 64 / 225)
