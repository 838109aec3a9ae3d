"""System presets of the accelerators of 2025-26: NVIDIA Blackwell (HGX B200 and B300, the
rack-scale GB200 and GB300 NVL72) and AMD Instinct MI300X, MI325X and MI355X.

Each preset is a system in the JSON form of :mod:`stg.perf.system`, its figures from the
vendors' data sheets, dense (not 2:4 sparse: NVIDIA's tables print sparse rates, halved
here), each with its source in the preset's ``sources`` (``stg inspect system NAME --json``).

**Sustained clock (Blackwell).** As the H100 and H200 measured here, a B200 under sustained
tensor load runs at its power cap, below the clock of the data sheet's peaks: 1.58 GHz at
1,000 W (against a 1.965 GHz boost) under back-to-back bf16 attention (flashinfer-ai/flashinfer
pull request #2899; tests/data/kernels/blackwell-published.jsonl). The other Blackwell boards
have no published clock under load; theirs follows from the B200's by the power model of
:mod:`stg.perf.power` (power ~ SMs x f^3 at the same voltage-frequency curve): a GB200's B200
at 1,200 W, a B300 (160 SMs) at 1,100 W and a GB300 at 1,400 W. AMD's presets keep the clock of
the MI300X and MI325X run dense GEMMs at 1,207 and 1,447 MHz (the median clock of AMD's
max-achievable-FLOPs runs of hipBLASLt, bf16: AMD ROCm blog 'Measuring Max-Achievable FLOPs -
Part 2', 2025-02, Table 1; tests/data/kernels/cdna-published.jsonl) against a 2,100 MHz peak
engine clock. The MI355X keeps the clock of its data sheet's peaks (no measurement under load at
hand: optimistic by the throttling).

**Scale-up domains.** The first network dimension is the GPUs one NVLink (Infinity Fabric)
domain joins: 8 on an HGX or AMD baseboard, 72 in a GB200/GB300 NVL72 rack, whose NVLink
switch trays connect every GPU to every other at the full NVLink 5 rate (900 GB/s per
direction) and reduce in the switch (NVLink SHARP, NVLS). Ranks fill the domain first, so the
innermost parallel groups (``--rank_order``, tensor, context and expert parallelism by
default) stay inside it as long as their product divides into it: an expert-parallel group of
64 on an NVL72 runs its all-to-all over NVLink. A system file may give the domain any size
(GB200 NVL36 racks: 36; a 144-GPU domain: 144). The second dimension is the scale-out fabric,
one NIC per GPU, non-blocking (one dimension: the scalable-unit structure is left out).

Collective efficiencies of NVLink 5: NCCL's own model of a Blackwell NVLink is 40.1 GB/s of
bus bandwidth per link, 18 links (NVIDIA/nccl v2.27 ``src/graph/topo.h``, ``SM100_NVLINK_BW``,
as quoted in NVIDIA/nccl issue #1807): 721.8 of 900 GB/s, efficiency 0.80 (the same model gives
the h100-80g preset's 0.82). NVLS: 8 B200s reach 830 GB/s of all-reduce bus bandwidth
(NVIDIA/nccl issue #1807), an algorithm bandwidth of 830 / (2 · 7/8) = 474 GB/s, 0.53 of
900; a whole GB200 NVL72 rack (72 ranks) 835-847 GB/s at 4-8 GiB, 423-429 GB/s algorithm
bandwidth, 0.47 of 900 (coreweave/nccl-tests pull request #43). Infinity Fabric: RCCL's own
model of a gfx94x xGMI link is 48 of its 64 GB/s per direction after protocol and CRC overheads
(ROCm/rccl issue #1210, ``ncclTopoXGMISpeed``), 0.75 of the link rate; RCCL inherits NCCL's
tuning model and treats xGMI as NVLink, hence ``link: nvlink``, without NVLS (AMD's GPUs
connect point to point, no switch). Against AMD's published rccl-tests all-reduce of 8 MI300X
(RCCL 2.22.3; tests/test_rccl_curves.py) this is 15 % slow at 1-256 KiB, within 6 % from 64 MiB
up and up to 86 % slow between 512 KiB and 32 MiB. Scale-out NICs reach 0.9 of their line rate and
latencies are NCCL's (``hwLat``), as for the h100-80g preset.

**Host memory (Grace).** A GB200 or GB300 NVL72 rack is 36 Grace-Blackwell superchips: one
Grace CPU and two GPUs each, the GPUs reaching the Grace's LPDDR5X (not HBM: 480 GB at up to
512 GB/s per Grace) over NVLink-C2C, 900 GB/s both ways, 450 GB/s per direction, which the two
GPUs share. A copy to or from host memory (CPU activation offload, ``host_link_gbps``) runs
while the other GPU of the superchip makes the same copy (every rank runs the same schedule),
so each GPU gets 225 GB/s per direction; two GPUs writing (or reading) at once move 450 GB/s,
within the LPDDR5X's 512, so the link bounds the copy, not the memory. stg prices the copies;
it does not check that the offloaded activations fit the Grace's 480 GB (240 GB per GPU).

GEMMs with a shape run at 0.81 of the clock-scaled peak on Blackwell, not Hopper's 0.88
(:data:`stg.perf.kernel_time.BLACKWELL_GEMM_PIPE_EFFICIENCY`: published B200 cuBLAS rates; the
B200's clock above was measured under attention, which draws less power than a GEMM).
Compute efficiencies of unshaped nodes: the h100-80g preset's for Blackwell (the same
Transformer Engine software lineage), the a100-80g preset's for AMD (as :mod:`stg.perf.devices`
does for GPUs without a measurement); AMD's streaming at 0.79 of HBM bandwidth, the 4.2 of
5.3 TB/s ROCm's roofline benchmark reaches on an MI300X (ROCm/legacy-rocm-build issue #5070).
Streaming: a B200 adds 2^28 fp16 elements at 6.72 TB/s,
0.84 of its 8 TB/s (NVIDIA/cccl pull request #7391), for every Blackwell preset (the same HBM3e
generation).
"""

from __future__ import annotations

from typing import Any

from stg.perf.power import clock_under_power_limit

HGX_PAGE = "NVIDIA HGX platform page (nvidia.com/en-us/data-center/hgx), specifications table"
GB200_PAGE = "NVIDIA GB200 NVL72 page (nvidia.com/en-us/data-center/gb200-nvl72), specifications"
GB300_PAGE = "NVIDIA GB300 NVL72 page (nvidia.com/en-us/data-center/gb300-nvl72), specifications"
ULTRA_BLOG = (
    "NVIDIA technical blog 'Inside NVIDIA Blackwell Ultra: The Chip Powering the AI Factory Era' "
    "(developer.nvidia.com/blog, 2025-08)"
)
AMD_PAGE = "AMD Instinct {0} data sheet (amd.com/en/products/accelerators/instinct), peak table"

# NVLink-C2C per Grace-Blackwell superchip: 900 GB/s bidirectional, 450 per direction, shared
# by its 2 GPUs (NVIDIA GB200 NVL72 page, specifications: GB200 Grace Blackwell Superchip,
# 1 Grace CPU : 2 Blackwell GPUs, NVLink-C2C 900 GB/s; LPDDR5X up to 480 GB at up to 512 GB/s)
GRACE_C2C_GBPS_PER_GPU = 900 / 2 / 2
GRACE_SOURCE = (
    "225 GB/s per GPU per direction: NVLink-C2C 900 GB/s bidirectional per superchip (450 per "
    "direction) shared by its two GPUs, which copy at once; the Grace's LPDDR5X (up to 480 GB at "
    "up to 512 GB/s) carries both GPUs' 450 GB/s"
)

B200_STREAM_EFFICIENCY = 6.721 / 8.0
"""2^28 fp16 elements added (6 bytes each) at 6.721 TB/s on a B200 (NVIDIA/cccl pull request
#7391, benchmark table 'add', F16 row), over the data sheet's 8 TB/s."""

BLACKWELL_EFFICIENCY: dict[str, Any] = {
    "compute_efficiency": {"gemm": 0.75, "attention": 0.55, "other": 0.8},
    "memory_efficiency": round(B200_STREAM_EFFICIENCY, 3),
    "kernel_overhead_us": 2,
}
MI300X_STREAM_EFFICIENCY = 4.2 / 5.3
"""ROCm's roofline benchmark reaches 4.2 TB/s of an MI300X's 5.3 (ROCm/legacy-rocm-build issue
#5070)."""

CDNA_EFFICIENCY: dict[str, Any] = {
    "compute_efficiency": {"gemm": 0.8, "attention": 0.6, "other": 0.8},
    "memory_efficiency": round(MI300X_STREAM_EFFICIENCY, 3),
    "kernel_overhead_us": 2,
}

B200_SUSTAINED_CLOCK_GHZ = 1.58
"""SM clock of a B200 under back-to-back bf16 tensor-core kernels at its 1,000 W cap
(flashinfer-ai/flashinfer pull request #2899: 'SM clocks drop from 1965 MHz to ~1580 MHz',
'Power spikes to ~1000W')."""
B200_TDP_W = 1000  # HGX platform page: 1,000 W per B200
B200_SMS = 148


def blackwell_sustained_clock(tdp_w: float, sm_count: int) -> float:
    """The sustained SM clock (GHz) of a Blackwell board whose ``sm_count`` SMs share a
    ``tdp_w`` cap: the B200's measured clock moved along :mod:`stg.perf.power`'s ``f^3`` law
    by the power per SM (the same process, the same voltage-frequency curve)."""
    per_sm = tdp_w / sm_count
    clock = clock_under_power_limit(B200_SUSTAINED_CLOCK_GHZ, B200_TDP_W / B200_SMS, per_sm)
    return round(clock, 3)


B200_CLOCK_SOURCE = (
    "measured: 1.58 GHz under back-to-back bf16 attention at ~1,000 W, against a 1,965 MHz "
    "boost (flashinfer-ai/flashinfer pull request #2899)"
)


def scaled_clock_source(tdp_w: int, sm_count: int) -> str:
    """The source line of a clock derived from the B200's by the power model."""
    return (
        f"derived: the B200's measured 1.58 GHz at 1,000 W / 148 SMs (flashinfer-ai/flashinfer "
        f"pull request #2899) moved to {tdp_w:,} W / {sm_count} SMs by the f^3 power law "
        "(stg.perf.power); this board's own clock under load is unpublished"
    )


MAF_BLOG = (
    "AMD ROCm blog 'Measuring Max-Achievable FLOPs - Part 2' (rocm.blogs.amd.com, 2025-02-28), "
    "Table 1"
)
MI300X_SUSTAINED_CLOCK_GHZ = 1.207  # MAF_BLOG: MI300X BF16 708 TFLOPs at a median 1,207 MHz
MI325X_SUSTAINED_CLOCK_GHZ = 1.447  # MAF_BLOG: MI325X BF16 843 TFLOPs at a median 1,447 MHz

BLACKWELL_STREAM_SOURCE = (
    "0.84: a B200 adds 2^28 fp16 elements at 6.721 of its 8 TB/s (NVIDIA/cccl pull request "
    "#7391, benchmark table 'add'); the same HBM3e generation on every Blackwell board"
)
CDNA_STREAM_SOURCE = (
    "0.79: ROCm's roofline benchmark reaches 4.2 of an MI300X's 5.3 TB/s "
    "(ROCm/legacy-rocm-build issue #5070); the same fraction on the other Instinct boards"
)

NO_CLOCK_MEASUREMENT = (
    "no measurement: the clock at which the data sheet's peaks are stated (data sheet only)"
)
NVLINK5_SOURCES = (
    "NVLink 5: 18 links, 1.8 TB/s per GPU (900 GB/s per direction); efficiency 0.80 from NCCL "
    "v2.27 src/graph/topo.h SM100_NVLINK_BW 40.1 GB/s x 18 (NVIDIA/nccl issue #1807)"
)


def nvlink5(size: int, sharp_efficiency: float) -> dict[str, Any]:
    """An NVLink 5 domain of ``size`` GPUs behind NVLink switches (NVLS available)."""
    return {
        "name": "nvlink",
        "size": size,
        "bandwidth_gbps": 900,
        "latency_us": 3.4,
        "efficiency": 0.80,
        "link": "nvlink",
        "sharp_efficiency": sharp_efficiency,
    }


def infinity_fabric(gbps_per_direction: float) -> dict[str, Any]:
    """8 AMD GPUs joined point to point by 7 Infinity Fabric links each (no switch, no NVLS)."""
    return {
        "name": "xgmi",
        "size": 8,
        "bandwidth_gbps": gbps_per_direction,
        "latency_us": 3.4,
        "efficiency": 0.75,  # RCCL's 48 of 64 GB/s per xGMI link (ROCm/rccl issue #1210)
        "link": "nvlink",
    }


def scale_out(gbps_per_gpu: float) -> dict[str, Any]:
    """The network between scale-up domains: one NIC per GPU, non-blocking."""
    return {
        "name": "network",
        "size": 0,
        "bandwidth_gbps": gbps_per_gpu,
        "latency_us": 9.6,
        "efficiency": 0.9,
        "link": "network",
    }


# NVLS efficiencies: algorithm bandwidth over 900 GB/s (module docstring)
CUDA_GPUS_PAGE = "https://developer.nvidia.com/cuda-gpus"
CAPABILITY_SOURCE = {
    "10.0": f"{CUDA_GPUS_PAGE}: compute capability 10.0 (B200, GB200)",
    "10.3": f"{CUDA_GPUS_PAGE}: compute capability 10.3 (B300, GB300)",
}
NVLS_HGX_B200 = 0.53  # 830 GB/s bus bandwidth on 8 B200s (NVIDIA/nccl issue #1807)
NVLS_NVL72 = 0.47  # 423-429 GB/s algbw, 72 ranks (coreweave/nccl-tests pull request #43)

ACCELERATOR_PRESETS: dict[str, dict[str, Any]] = {
    "b200-180g": {
        "name": "b200-180g",
        "description": "NVIDIA HGX B200 180GB: 8 GPUs per node (NVLink 5, 900 GB/s per "
        "direction), one 400 Gb/s NIC per GPU",
        "peak_tflops": {
            "fp32": 75,
            "tf32": 1125,
            "bf16": 2250,
            "fp16": 2250,
            "fp8": 4500,
            "int8": 4500,
            "fp6": 4500,
            "fp4": 9000,
        },
        "hbm_gbps": 8000,
        "hbm_gib": 180,
        "sm_count": 148,
        "peak_clock_ghz": 1.856,
        "sustained_clock_ghz": B200_SUSTAINED_CLOCK_GHZ,
        "arch": "blackwell",
        "compute_capability": "10.0",
        "tdp_w": 1000,
        **BLACKWELL_EFFICIENCY,
        "network": [nvlink5(8, NVLS_HGX_B200), scale_out(50)],
        "sources": {
            "memory_efficiency": BLACKWELL_STREAM_SOURCE,
            "peak_tflops": f"{HGX_PAGE}, HGX B200 (8 GPUs, sparse except FP32): FP4 144, "
            "FP8/FP6 72, INT8 72 POPS, FP16/BF16 36, TF32 18 PFLOPS, FP32 600 TFLOPS; "
            "halved (dense) and divided by 8",
            "hbm": "NVIDIA DGX B200 data sheet: 1,440 GB of HBM3e at 64 TB/s for 8 GPUs",
            "sm_count": "148 SMs as CUDA reports them on a B200 (multiProcessorCount; "
            "tile-ai/TileFoundry pull request #76)",
            "peak_clock_ghz": "2,250 TFLOP/s / (148 SMs x 8,192 dense 16-bit FLOP per SM "
            "per clock, twice Hopper's 4,096)",
            "sustained_clock_ghz": B200_CLOCK_SOURCE,
            "compute_capability": CAPABILITY_SOURCE["10.0"],
            "tdp_w": f"{HGX_PAGE}: 1,000 W per B200 GPU",
            "network": f"{NVLINK5_SOURCES}; NVLS 0.53: 830 GB/s all-reduce bus bandwidth on "
            "8 B200s (NVIDIA/nccl issue #1807); DGX B200 data sheet: 8 ConnectX-7 400 Gb/s",
        },
    },
    "b300-288g": {
        "name": "b300-288g",
        "description": "NVIDIA HGX B300 288GB: 8 GPUs per node (NVLink 5, 900 GB/s per "
        "direction), one 800 Gb/s NIC per GPU",
        "peak_tflops": {
            "fp32": 75,
            "tf32": 1125,
            "bf16": 2250,
            "fp16": 2250,
            "fp8": 4500,
            "int8": 150,
            "fp6": 4500,
            "fp4": 13125,
        },
        "hbm_gbps": 8000,
        "hbm_gib": 288,
        "sm_count": 160,
        "peak_clock_ghz": 1.717,
        "sustained_clock_ghz": blackwell_sustained_clock(1100, 160),
        "arch": "blackwell",
        "compute_capability": "10.3",
        "tdp_w": 1100,
        **BLACKWELL_EFFICIENCY,
        "network": [nvlink5(8, NVLS_HGX_B200), scale_out(100)],
        "sources": {
            "memory_efficiency": BLACKWELL_STREAM_SOURCE,
            "peak_tflops": f"{HGX_PAGE}, HGX B300 (8 GPUs): FP4 144 sparse / 105 dense, "
            "FP8/FP6 72, FP16/BF16 36, TF32 18 PFLOPS sparse, FP32 600 TFLOPS; per GPU dense; "
            "INT8 0.15 POPS dense (Verda, 'NVIDIA GB300 NVL72: GPU Architecture & "
            "Performance', per-GPU table: Blackwell Ultra cuts INT8)",
            "hbm": f"{ULTRA_BLOG}: 288 GB HBM3e, 8 TB/s",
            "sm_count": f"{ULTRA_BLOG}: 160 SMs",
            "peak_clock_ghz": "2,250 TFLOP/s / (160 SMs x 8,192 dense 16-bit FLOP per SM "
            "per clock)",
            "sustained_clock_ghz": scaled_clock_source(1100, 160),
            "compute_capability": CAPABILITY_SOURCE["10.3"],
            "tdp_w": "HGX B300: 1,100 W per GPU (Verda's per-GPU table)",
            "network": f"{NVLINK5_SOURCES}; NVLS as measured on HGX B200 (the same NVLink 5 "
            "switches; no B300 measurement); HGX B300: 8 ConnectX-8 800 Gb/s SuperNICs",
        },
    },
    "gb200-nvl72": {
        "name": "gb200-nvl72",
        "description": "NVIDIA GB200 NVL72: 72-GPU NVLink 5 domain per rack (900 GB/s per "
        "direction, NVLink switch trays), one 400 Gb/s NIC per GPU between racks",
        "peak_tflops": {
            "fp32": 80,
            "tf32": 1250,
            "bf16": 2500,
            "fp16": 2500,
            "fp8": 5000,
            "int8": 5000,
            "fp6": 5000,
            "fp4": 10000,
        },
        "hbm_gbps": 8000,
        "hbm_gib": 186,
        "sm_count": 148,
        "peak_clock_ghz": 2.062,
        "sustained_clock_ghz": blackwell_sustained_clock(1200, 148),
        "arch": "blackwell",
        "compute_capability": "10.0",
        "tdp_w": 1200,
        **BLACKWELL_EFFICIENCY,
        "host_link_gbps": GRACE_C2C_GBPS_PER_GPU,
        "network": [nvlink5(72, NVLS_NVL72), scale_out(50)],
        "sources": {
            "memory_efficiency": BLACKWELL_STREAM_SOURCE,
            "peak_tflops": f"{GB200_PAGE}, GB200 NVL72 (72 GPUs, sparse except FP32): FP4 "
            "1,440, FP8/FP6 720, INT8 720 POPS, FP16/BF16 360, TF32 180 PFLOPS, FP32 5,760 "
            "TFLOPS; halved (dense) and divided by 72",
            "hbm": f"{GB200_PAGE}: up to 13.4 TB HBM3e at 576 TB/s for 72 GPUs",
            "sm_count": "the B200's 148 SMs (the same die)",
            "peak_clock_ghz": "2,500 TFLOP/s / (148 SMs x 8,192 dense 16-bit FLOP per SM "
            "per clock)",
            "sustained_clock_ghz": scaled_clock_source(1200, 148),
            "compute_capability": CAPABILITY_SOURCE["10.0"],
            "tdp_w": "GB200's B200 configured to 1,200 W (glennklockwood.com/garden/processors/"
            "B200, from NVIDIA's Blackwell datasheet)",
            "host_link_gbps": f"{GB200_PAGE}: " + GRACE_SOURCE,
            "network": f"{NVLINK5_SOURCES}; {GB200_PAGE}: 72 GPUs, 130 TB/s NVLink; NVLS "
            "0.47: 423-429 GB/s all-reduce algorithm bandwidth over 72 ranks at 4-8 GiB "
            "(coreweave/nccl-tests pull request #43); NVIDIA DGX SuperPOD GB200 reference "
            "architecture: four ConnectX-7 400 Gb/s per 4-GPU compute tray",
        },
    },
    "gb300-nvl72": {
        "name": "gb300-nvl72",
        "description": "NVIDIA GB300 NVL72: 72-GPU NVLink 5 domain per rack (900 GB/s per "
        "direction, NVLink switch trays), one 800 Gb/s NIC per GPU between racks",
        "peak_tflops": {
            "fp32": 80,
            "tf32": 1250,
            "bf16": 2500,
            "fp16": 2500,
            "fp8": 5000,
            "int8": 160,
            "fp6": 5000,
            "fp4": 15000,
        },
        "hbm_gbps": 8000,
        "hbm_gib": 288,
        "sm_count": 160,
        "peak_clock_ghz": 1.907,
        "sustained_clock_ghz": blackwell_sustained_clock(1400, 160),
        "arch": "blackwell",
        "compute_capability": "10.3",
        "tdp_w": 1400,
        **BLACKWELL_EFFICIENCY,
        "host_link_gbps": GRACE_C2C_GBPS_PER_GPU,
        "network": [nvlink5(72, NVLS_NVL72), scale_out(100)],
        "sources": {
            "memory_efficiency": BLACKWELL_STREAM_SOURCE,
            "peak_tflops": f"{GB300_PAGE}, GB300 NVL72 (72 GPUs): FP4 1,440 sparse / 1,080 "
            "dense, FP8/FP6 720, FP16/BF16 360, TF32 180 PFLOPS sparse, INT8 23 POPS sparse; "
            "per GPU dense; FP32 80 TFLOPS per GPU (Verda's per-GPU table)",
            "hbm": f"{ULTRA_BLOG}: 288 GB HBM3e, 8 TB/s; {GB300_PAGE}: 576 TB/s for 72 GPUs",
            "sm_count": f"{ULTRA_BLOG}: 160 SMs",
            "peak_clock_ghz": "2,500 TFLOP/s / (160 SMs x 8,192 dense 16-bit FLOP per SM "
            "per clock)",
            "sustained_clock_ghz": scaled_clock_source(1400, 160),
            "compute_capability": CAPABILITY_SOURCE["10.3"],
            "tdp_w": "GB300: 1,400 W per GPU (Verda's per-GPU table)",
            "host_link_gbps": f"{GB300_PAGE}: 36 Grace CPUs, 72 GPUs, the GB200's Grace and "
            f"NVLink-C2C ({GB200_PAGE}): " + GRACE_SOURCE,
            "network": f"{NVLINK5_SOURCES}; NVLS as measured on a GB200 NVL72 rack (the same "
            "switch trays; no GB300 measurement); {GB300_PAGE}: 72 ConnectX-8 SuperNICs, "
            "800 Gb/s",
        },
    },
    "mi300x-192g": {
        "name": "mi300x-192g",
        "description": "AMD Instinct MI300X 192GB: 8 GPUs per node (Infinity Fabric, 7 links "
        "of 64 GB/s per direction), one 400 Gb/s NIC per GPU",
        "peak_tflops": {
            "fp32": 163.4,
            "tf32": 653.7,
            "bf16": 1307.4,
            "fp16": 1307.4,
            "fp8": 2614.9,
            "int8": 2614.9,
        },
        "hbm_gbps": 5300,
        "hbm_gib": 192,
        "sm_count": 304,
        "peak_clock_ghz": 2.1,
        "sustained_clock_ghz": MI300X_SUSTAINED_CLOCK_GHZ,
        "arch": "cdna3",
        "tdp_w": 750,
        **CDNA_EFFICIENCY,
        "network": [infinity_fabric(448), scale_out(50)],
        "sources": {
            "memory_efficiency": CDNA_STREAM_SOURCE,
            "peak_tflops": AMD_PAGE.format("MI300X")
            + ": FP32 vector 163.4, TF32 matrix 653.7, FP16/BF16 1,307.4, FP8 2,614.9 "
            "TFLOPS, INT8 2,614.9 TOPS (dense)",
            "hbm": AMD_PAGE.format("MI300X") + ": 192 GB HBM3, 5.3 TB/s",
            "sm_count": AMD_PAGE.format("MI300X") + ": 304 compute units",
            "peak_clock_ghz": AMD_PAGE.format("MI300X") + ": peak engine clock 2,100 MHz",
            "sustained_clock_ghz": f"measured: {MAF_BLOG}: the median clock, 1,207 MHz, of "
            "hipBLASLt bf16 GEMMs at 708 TFLOP/s (4096 x 4864 x 32896, randomised inputs, warm); "
            "fp8 GEMMs at 0.90 of twice the bf16 rate (the same table's fp8, 1,273 TFLOP/s: "
            "stg.perf.kernel_time.CDNA3_FP8_GEMM_SPEED)",
            "tdp_w": AMD_PAGE.format("MI300X") + ": 750 W total board power",
            "network": AMD_PAGE.format("MI300X") + ": 7 Infinity Fabric links, 896 GB/s "
            "aggregate (bidirectional): 448 GB/s per direction; one 400 Gb/s NIC per GPU "
            "(the MI300X platform's scale-out, e.g. Azure ND MI300X v5)",
        },
    },
    "mi325x-256g": {
        "name": "mi325x-256g",
        "description": "AMD Instinct MI325X 256GB: 8 GPUs per node (Infinity Fabric, 7 links "
        "of 64 GB/s per direction), one 400 Gb/s NIC per GPU",
        "peak_tflops": {
            "fp32": 163.4,
            "tf32": 653.7,
            "bf16": 1307.4,
            "fp16": 1307.4,
            "fp8": 2614.9,
            "int8": 2614.9,
        },
        "hbm_gbps": 6000,
        "hbm_gib": 256,
        "sm_count": 304,
        "peak_clock_ghz": 2.1,
        "sustained_clock_ghz": MI325X_SUSTAINED_CLOCK_GHZ,
        "arch": "cdna3",
        "tdp_w": 1000,
        **CDNA_EFFICIENCY,
        "network": [infinity_fabric(448), scale_out(50)],
        "sources": {
            "memory_efficiency": CDNA_STREAM_SOURCE,
            "peak_tflops": AMD_PAGE.format("MI325X") + ": the MI300X's CDNA 3 compute "
            "(304 CUs at 2,100 MHz): FP32 vector 163.4, TF32 653.7, FP16/BF16 1,307.4, FP8 "
            "2,614.9 TFLOPS, INT8 2,614.9 TOPS (dense)",
            "hbm": AMD_PAGE.format("MI325X") + ": 256 GB HBM3E, 6 TB/s",
            "sm_count": AMD_PAGE.format("MI325X") + ": 304 compute units",
            "peak_clock_ghz": AMD_PAGE.format("MI325X") + ": peak engine clock 2,100 MHz",
            "sustained_clock_ghz": f"measured: {MAF_BLOG}: the median clock, 1,447 MHz, of "
            "hipBLASLt bf16 GEMMs at 843 TFLOP/s; fp8 GEMMs at 0.90 of twice the bf16 rate (the "
            "same table's fp8, 1,519 TFLOP/s: stg.perf.kernel_time.CDNA3_FP8_GEMM_SPEED)",
            "tdp_w": AMD_PAGE.format("MI325X") + ": 1,000 W total board power",
            "network": AMD_PAGE.format("MI325X") + ": 7 Infinity Fabric links, 896 GB/s "
            "aggregate; one 400 Gb/s NIC per GPU",
        },
    },
    "mi355x-288g": {
        "name": "mi355x-288g",
        "description": "AMD Instinct MI355X 288GB: 8 GPUs per node (Infinity Fabric, 7 links "
        "of 76.8 GB/s per direction), one 400 Gb/s NIC per GPU",
        "peak_tflops": {
            "fp32": 157.3,
            "tf32": 157.3,
            "bf16": 2516.6,
            "fp16": 2516.6,
            "fp8": 5033.2,
            "int8": 5033.2,
            "fp6": 10066.3,
            "fp4": 10066.3,
        },
        "hbm_gbps": 8000,
        "hbm_gib": 288,
        "sm_count": 256,
        "peak_clock_ghz": 2.4,
        "sustained_clock_ghz": 2.4,
        "arch": "cdna4",
        "tdp_w": 1400,
        **CDNA_EFFICIENCY,
        "network": [infinity_fabric(537.6), scale_out(50)],
        "sources": {
            "memory_efficiency": CDNA_STREAM_SOURCE,
            "peak_tflops": AMD_PAGE.format("MI355X") + ": FP32 157.3, FP16/BF16 2,516.6 "
            "(2.5 PF), FP8 5,033.2, MXFP6 and MXFP4 10,066.3 TFLOPS, INT8 5,033.2 TOPS "
            "(dense); no TF32 matrix rate in CDNA 4: fp32",
            "hbm": AMD_PAGE.format("MI355X") + ": 288 GB HBM3E, 8 TB/s",
            "sm_count": AMD_PAGE.format("MI355X") + ": 256 compute units",
            "peak_clock_ghz": AMD_PAGE.format("MI355X") + ": peak engine clock 2,400 MHz",
            "sustained_clock_ghz": NO_CLOCK_MEASUREMENT,
            "tdp_w": AMD_PAGE.format("MI355X") + ": 1,400 W total board power",
            "network": AMD_PAGE.format("MI355X") + ": 7 Infinity Fabric links, 1,075 GB/s "
            "aggregate (bidirectional): 537.6 GB/s per direction; one 400 Gb/s NIC per GPU "
            "(AMD Pensando Pollara 400)",
        },
    },
}
"""The presets of this module, by name (merged into :data:`stg.perf.system.PRESETS`)."""
