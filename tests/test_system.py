"""System descriptions: presets, JSON files, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stg.errors import UnknownNameError, UserError
from stg.perf.devices import DEVICE_PRESETS
from stg.perf.system import (
    DTYPES,
    PRESETS,
    load_system,
    normalize_dtype,
    op_class,
    system_from_dict,
)


def test_presets_follow_the_hardware_profiles() -> None:
    a100 = load_system("a100-80g")
    assert a100.peak("bf16") == 312e12
    assert a100.peak("fp32") == 19.5e12
    assert a100.peak("int8") == 624e12
    assert a100.hbm_bandwidth == 2039e9
    assert a100.hbm_capacity == 80 * 2**30
    # DGX A100 SuperPOD: 8 GPUs per node, rail-optimised scalable units of 20 nodes, spine
    assert [d.size for d in a100.network] == [8, 20, 0]
    assert [d.link for d in a100.network] == ["nvlink", "network", "network"]
    assert a100.network[0].bandwidth == 300e9
    assert a100.network[1].bandwidth == a100.network[2].bandwidth == 25e9  # HDR 200 Gb/s
    assert a100.network[0].sharp_efficiency == 0  # no NVLink SHARP before NVSwitch 3
    h100 = load_system("h100-80g")
    assert h100.peak("bf16") == pytest.approx(989.4e12)
    assert h100.peak("fp8") == pytest.approx(1978.9e12)
    assert h100.hbm_bandwidth == 3350e9
    assert [d.size for d in h100.network] == [8, 32, 0]
    assert h100.network[0].bandwidth == 450e9
    assert h100.network[0].sharp_efficiency > 0  # NVLink SHARP (NVLS)
    assert h100.network[1].bandwidth == h100.network[2].bandwidth == 50e9  # NDR 400 Gb/s
    # H800 SXM: the H100's compute and memory, NVLink 400 GB/s bidirectional (data sheet)
    h800 = load_system("h800-80g")
    assert h800.gpu == h100.gpu and h800.peak("bf16") == h100.peak("bf16")
    assert (h800.hbm_bandwidth, h800.hbm_capacity) == (h100.hbm_bandwidth, h100.hbm_capacity)
    assert [d.bandwidth for d in h800.network] == [200e9, 50e9, 50e9]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_round_trip_through_json(name: str, tmp_path: Path) -> None:
    system = load_system(name)
    path = tmp_path / "system.json"
    path.write_text(json.dumps(system.as_dict()))
    assert load_system(str(path)) == system


def test_coordinates_innermost_first() -> None:
    system = load_system("a100-80g")
    assert system.coordinates(0) == (0, 0, 0)
    assert system.coordinates(13) == (5, 1, 0)
    assert system.coordinates(8 * 20 * 3 + 8 + 2) == (2, 1, 3)  # 3rd scalable unit of 20 nodes
    assert system.capacity == 0  # unbounded


def test_unknown_name_lists_presets() -> None:
    with pytest.raises(UnknownNameError, match="allowed: a10-24g, a100-40g, a100-80g, b200-180g"):
        load_system("tpu-v9")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("hbm_gbps"), "missing key 'hbm_gbps'"),
        (lambda d: d["peak_tflops"].pop("fp8"), "missing fp8"),
        (lambda d: d.update(hbm_gbps=-1), "hbm_gbps must be > 0"),
        (lambda d: d.update(colour="red"), "unknown key 'colour'"),
        (lambda d: d["network"][0].update(size=0), "only for the last dimension"),
        (lambda d: d["network"][1].update(efficiency=1.5), r"efficiency must be in \(0, 1\]"),
        (lambda d: d.update(compute_efficiency={"conv": 0.5}), "unknown op class 'conv'"),
        (lambda d: d.update(network=[]), "non-empty list"),
    ],
)
def test_malformed_descriptions(mutate, message: str) -> None:
    data = json.loads(json.dumps(PRESETS["a100-80g"]))
    mutate(data)
    with pytest.raises(UserError, match=message):
        system_from_dict(data)


def test_malformed_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(UserError) as info:
        load_system(str(path))
    assert "not valid JSON" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="does not exist"):
        load_system(str(tmp_path / "missing.json"))


def test_dtype_names() -> None:
    assert normalize_dtype("bfloat16") == "bf16"
    assert set(DTYPES) == {"fp32", "tf32", "bf16", "fp16", "fp8", "int8"}
    # fp4 (E2M1) names what a serving weight format's GEMM computes in (docs/inference.md)
    assert normalize_dtype("fp4") == normalize_dtype("e2m1") == "fp4"
    with pytest.raises(UnknownNameError, match="allowed: fp32"):
        normalize_dtype("fp3")


def test_op_classes() -> None:
    assert op_class("mb0/layer3/fwd/scores", 10**12, 10**9) == "attention"
    assert op_class("mb0/layer3/bwd/context.grad_softmax", 10**12, 10**9) == "attention"
    assert op_class("mb0/layer3/fwd/attn_out", 10**12, 10**9) == "gemm"
    assert op_class("mb0/layer3/fwd/residual1", 10**6, 10**9) == "other"


@pytest.mark.parametrize("name", sorted(DEVICE_PRESETS))
def test_every_hybrid_device_preset_names_its_sources_and_link_kinds(name: str) -> None:
    """The presets of the GPUs that hybrid clusters mix say where each figure comes from (as
    ``stg inspect system NAME --json`` shows it) and what kind of link each network dimension
    is, so NCCL's algorithm and protocol model prices them as it prices the other presets."""
    system = load_system(name)
    assert {"peak_tflops", "hbm", "sm_count", "sustained_clock_ghz", "tdp_w", "network"} <= set(
        system.sources
    )
    assert [d.link for d in system.network][1:] == ["network"]
    assert system.network[0].link in ("nvlink", "pcie")
