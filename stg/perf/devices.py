"""System presets of the GPUs that hybrid clusters mix: V100, T4, A10, L4, L40S and A100 40GB.

Each preset is a one-node system in the JSON form of :mod:`stg.perf.system` (a GPU, its
node's link as the first network dimension, and the network between nodes as the second),
usable alone (``--system t4-16g``) or as the device of a group in a hybrid system file
(:mod:`stg.perf.hybrid`). Figures from the vendors' data sheets, dense (not 2:4 sparse):

- V100 SXM2 32GB: NVIDIA Tesla V100 data sheet (2020) and Volta whitepaper: 80 SMs at
  1530 MHz boost; 15.7 TFLOP/s fp32, 125 fp16 tensor; 32 GB HBM2 at 900 GB/s; NVLink 2, six
  links of 25 GB/s per direction (300 GB/s bidirectional total). DGX-1: 8 GPUs, 4 EDR
  InfiniBand NICs (100 Gb/s each, so 6.25 GB/s per GPU).
- T4: NVIDIA T4 data sheet (2019) and Turing whitepaper: 40 SMs at 1590 MHz boost; 8.1
  TFLOP/s fp32, 65 fp16 tensor, 130 TOPS int8; 16 GB GDDR6 at 320 GB/s; PCIe 3.0 x16
  (~16 GB/s per direction), no NVLink.
- A10: NVIDIA A10 data sheet (2021): 72 SMs at 1695 MHz boost; 31.2 fp32, 62.5 tf32, 125
  bf16/fp16, 250 TOPS int8; 24 GB GDDR6 at 600 GB/s; PCIe 4.0 x16 (~32 GB/s per direction).
- L4: NVIDIA L4 data sheet (2023): 58 SMs at 2040 MHz boost; 30.3 fp32, 60 tf32, 121
  bf16/fp16, 242 fp8, 242 TOPS int8; 24 GB GDDR6 at 300 GB/s; PCIe 4.0 x16.
- L40S: NVIDIA L40S data sheet (2023): 568 fourth-generation tensor cores (142 SMs, four each)
  and 18,176 CUDA cores; 91.6 TFLOP/s fp32, 183 tf32, 362.05 bf16/fp16, 733 fp8, 733 TOPS
  int8 (dense; the data sheet's "with sparsity" figures are twice these); 48 GB GDDR6 at
  864 GB/s; PCIe 4.0 x16 (64 GB/s bidirectional); 350 W. The peaks are 142 SMs x 1,024
  dense 16-bit tensor FLOP per SM per clock (Ada's fourth-generation tensor core, NVIDIA
  Ada Lovelace architecture whitepaper) at 2.49 GHz. Servers hold 8 (NVIDIA L40S OVX).
- A100 SXM4 40GB: NVIDIA A100 data sheet: as the 80GB (108 SMs at 1410 MHz, 312 bf16, 624
  int8) with 40 GB HBM2 at 1555 GB/s.

A dtype without hardware support lists the rate its kernels actually run at (as the presets of
:mod:`stg.perf.system` do): bf16 and tf32 on Volta and Turing run on the CUDA cores at the
fp32 rate (no bf16/tf32 tensor cores); fp8 where there are no fp8 tensor cores at the
fp16 rate (a framework dequantizes); int8 on V100 (no int8 tensor cores) at the DP4A rate,
4x fp32 (four 8-bit multiply-adds per 32-bit lane and clock), which is half its fp16 tensor
rate: int8 there is allowed but slower than fp16.

Efficiencies and the kernel overhead are the A100 preset's earlier estimates (GEMMs 0.8,
attention 0.6, other 0.8, streaming 0.8 of the memory bandwidth, 2 us per kernel; the
a100-80g preset now streams at a measured 0.87): no kernel measurement of these GPUs is at
hand. No sustained-clock measurement either, so ``sustained_clock_ghz`` is
the boost clock; the 70-72 W T4 and L4 do throttle below it under sustained tensor load, so
their predictions are optimistic.

Links: each dimension names its kind (``nvlink``, ``pcie``, ``network``), so collectives are
priced by NCCL's algorithm and protocol model (:mod:`stg.perf.comm_time`) and the MoE
dispatchers see NVLink inside a node and RDMA between nodes, as on the other presets. NVLink
collectives reach 0.75 of the per-direction bandwidth, as for the A100 preset; NCCL over PCIe
through the host bridge reaches ~0.75 of the PCIe rate (estimate). Per-step latencies are
NCCL's own per link kind (src/graph/tuning.cc, ``hwLat``, Simple ring: NVLink 3.4 us, PCI
5.7 us, NET 9.6 us). Between nodes the presets assume 100 Gb/s Ethernet or InfiniBand per node
(12.5 GB/s) shared by the node's GPUs.
"""

from __future__ import annotations

from typing import Any

# NCCL's per-step latency of its Simple ring per link kind (NVIDIA/nccl src/graph/tuning.cc,
# hwLat: NVLink 3.4 us, PCI 5.7 us, NET 9.6 us), as the presets of stg.perf.system use.
NVLINK_STEP_US = 3.4
PCIE_STEP_US = 5.7
NETWORK_STEP_US = 9.6
_NCCL_STEPS = (
    "per-step latencies NCCL's Simple-ring hwLat per link kind (NVIDIA/nccl src/graph/tuning.cc:"
    " NVLink 3.4 us, PCI 5.7 us, NET 9.6 us)"
)

_EFFICIENCY = {
    "compute_efficiency": {"gemm": 0.8, "attention": 0.6, "other": 0.8},
    "memory_efficiency": 0.8,
    "kernel_overhead_us": 2,
}


def _pcie(gbps: float) -> dict[str, Any]:
    return {
        "name": "pcie",
        "bandwidth_gbps": gbps,
        "latency_us": PCIE_STEP_US,
        "efficiency": 0.75,
        "link": "pcie",
    }


def _between_nodes(gpus_per_node: int, gbps_per_node: float = 12.5) -> dict[str, Any]:
    return {
        "name": "network",
        "size": 0,
        "bandwidth_gbps": gbps_per_node / gpus_per_node,
        "latency_us": NETWORK_STEP_US,
        "efficiency": 0.9,
        "link": "network",
    }


DEVICE_PRESETS: dict[str, dict[str, Any]] = {
    "v100-32g": {
        "name": "v100-32g",
        "description": "NVIDIA V100 SXM2 32GB: 8 GPUs per node (NVLink 2, 150 GB/s per "
        "direction), 4 EDR 100 Gb/s InfiniBand NICs per node",
        "peak_tflops": {
            "fp32": 15.7,
            "tf32": 15.7,
            "bf16": 15.7,
            "fp16": 125,
            "fp8": 125,
            "int8": 62.8,
        },
        "hbm_gbps": 900,
        "hbm_gib": 32,
        "sm_count": 80,
        "peak_clock_ghz": 1.53,
        "sustained_clock_ghz": 1.53,
        "tdp_w": 300,  # V100 SXM2 data sheet: 300 W
        "arch": "volta",
        **_EFFICIENCY,
        "network": [
            {
                "name": "nvlink",
                "size": 8,
                "bandwidth_gbps": 150,
                "latency_us": NVLINK_STEP_US,
                "efficiency": 0.75,
                "link": "nvlink",
            },
            _between_nodes(8, 50),
        ],
        "sources": {
            "peak_tflops": (
                "NVIDIA Tesla V100 data sheet (2020): 15.7 TFLOPS FP32, 125 FP16 tensor; no bf16,"
                " tf32, fp8 or int8 tensor cores (their kernels run at the FP32, FP16 or DP4A "
                "rate: stg.perf.devices)"
            ),
            "hbm": "NVIDIA Tesla V100 data sheet: 32 GB HBM2 at 900 GB/s",
            "sm_count": "NVIDIA Volta architecture whitepaper: 80 SMs at 1530 MHz boost",
            "sustained_clock_ghz": "no measurement: the boost clock",
            "tdp_w": "NVIDIA Tesla V100 data sheet: 300 W (SXM2)",
            "network": (
                "Volta whitepaper: NVLink 2, six links of 25 GB/s per direction; DGX-1: 4 EDR 100"
                " Gb/s InfiniBand NICs per 8 GPUs; " + _NCCL_STEPS
            ),
        },
    },
    "t4-16g": {
        "name": "t4-16g",
        "description": "NVIDIA T4 16GB: 4 GPUs per node on PCIe 3.0 x16, 100 Gb/s per node",
        "peak_tflops": {
            "fp32": 8.1,
            "tf32": 8.1,
            "bf16": 8.1,
            "fp16": 65,
            "fp8": 65,
            "int8": 130,
        },
        "hbm_gbps": 320,
        "hbm_gib": 16,
        "sm_count": 40,
        "peak_clock_ghz": 1.59,
        "sustained_clock_ghz": 1.59,
        "tdp_w": 70,  # T4 data sheet: 70 W
        "arch": "turing",
        **_EFFICIENCY,
        "network": [{**_pcie(16), "size": 4}, _between_nodes(4)],
        "sources": {
            "peak_tflops": (
                "NVIDIA T4 data sheet (2019): 8.1 TFLOPS FP32, 65 FP16 tensor, 130 TOPS INT8"
            ),
            "hbm": "NVIDIA T4 data sheet: 16 GB GDDR6 at 320 GB/s",
            "sm_count": "NVIDIA Turing architecture whitepaper: 40 SMs at 1590 MHz boost",
            "sustained_clock_ghz": (
                "no measurement: the boost clock (a 70 W T4 throttles below it under sustained "
                "tensor load)"
            ),
            "tdp_w": "NVIDIA T4 data sheet: 70 W",
            "network": (
                "NVIDIA T4 data sheet: PCIe Gen3 x16, no NVLink; 100 Gb/s per node assumed "
                "between nodes; " + _NCCL_STEPS
            ),
        },
    },
    "a10-24g": {
        "name": "a10-24g",
        "description": "NVIDIA A10 24GB: 4 GPUs per node on PCIe 4.0 x16, 100 Gb/s per node",
        "peak_tflops": {
            "fp32": 31.2,
            "tf32": 62.5,
            "bf16": 125,
            "fp16": 125,
            "fp8": 125,
            "int8": 250,
        },
        "hbm_gbps": 600,
        "hbm_gib": 24,
        "sm_count": 72,
        "peak_clock_ghz": 1.695,
        "sustained_clock_ghz": 1.695,
        "tdp_w": 150,  # A10 data sheet: 150 W
        "arch": "ampere",
        **_EFFICIENCY,
        "network": [{**_pcie(32), "size": 4}, _between_nodes(4)],
        "sources": {
            "peak_tflops": (
                "NVIDIA A10 data sheet (2021): 31.2 TFLOPS FP32, 62.5 TF32, 125 BF16/FP16, 250 "
                "TOPS INT8 (dense)"
            ),
            "hbm": "NVIDIA A10 data sheet: 24 GB GDDR6 at 600 GB/s",
            "sm_count": "NVIDIA A10 data sheet: 72 SMs at 1695 MHz boost",
            "sustained_clock_ghz": "no measurement: the boost clock",
            "tdp_w": "NVIDIA A10 data sheet: 150 W",
            "network": (
                "NVIDIA A10 data sheet: PCIe Gen4 x16, no NVLink; 100 Gb/s per node assumed "
                "between nodes; " + _NCCL_STEPS
            ),
        },
    },
    "l4-24g": {
        "name": "l4-24g",
        "description": "NVIDIA L4 24GB: 4 GPUs per node on PCIe 4.0 x16, 100 Gb/s per node",
        "peak_tflops": {
            "fp32": 30.3,
            "tf32": 60,
            "bf16": 121,
            "fp16": 121,
            "fp8": 242,
            "int8": 242,
        },
        "hbm_gbps": 300,
        "hbm_gib": 24,
        "sm_count": 58,
        "peak_clock_ghz": 2.04,
        "sustained_clock_ghz": 2.04,
        "tdp_w": 72,  # L4 data sheet: 72 W
        "arch": "ada",
        **_EFFICIENCY,
        "network": [{**_pcie(32), "size": 4}, _between_nodes(4)],
        "sources": {
            "peak_tflops": (
                "NVIDIA L4 data sheet (2023): 30.3 TFLOPS FP32, 60 TF32, 121 BF16/FP16, 242 FP8, "
                "242 TOPS INT8 (dense)"
            ),
            "hbm": "NVIDIA L4 data sheet: 24 GB GDDR6 at 300 GB/s",
            "sm_count": "NVIDIA L4 data sheet: 58 SMs at 2040 MHz boost",
            "sustained_clock_ghz": (
                "no measurement: the boost clock (a 72 W L4 throttles below it under sustained "
                "tensor load)"
            ),
            "tdp_w": "NVIDIA L4 data sheet: 72 W",
            "network": (
                "NVIDIA L4 data sheet: PCIe Gen4 x16, no NVLink; 100 Gb/s per node assumed "
                "between nodes; " + _NCCL_STEPS
            ),
        },
    },
    "l40s-48g": {
        "name": "l40s-48g",
        "description": "NVIDIA L40S 48GB: 8 GPUs per node on PCIe 4.0 x16, 100 Gb/s per node",
        "peak_tflops": {
            "fp32": 91.6,
            "tf32": 183,
            "bf16": 362.05,
            "fp16": 362.05,
            "fp8": 733,
            "int8": 733,
        },
        "hbm_gbps": 864,
        "hbm_gib": 48,
        "sm_count": 142,
        "peak_clock_ghz": 2.49,
        "sustained_clock_ghz": 2.49,
        "tdp_w": 350,  # L40S data sheet: 350 W
        "arch": "ada",
        **_EFFICIENCY,
        "network": [{**_pcie(32), "size": 8}, _between_nodes(8)],
        "sources": {
            "peak_tflops": "NVIDIA L40S data sheet (2023): FP32 91.6, TF32 183, BF16/FP16 "
            "362.05, FP8 733 TFLOPS, INT8 733 TOPS (dense)",
            "hbm": "NVIDIA L40S data sheet: 48 GB GDDR6 at 864 GB/s",
            "sm_count": "NVIDIA L40S data sheet: 568 tensor cores, four per SM",
            "peak_clock_ghz": "362.05 TFLOP/s / (142 SMs x 1,024 dense 16-bit FLOP per SM "
            "per clock, Ada Lovelace architecture whitepaper)",
            "sustained_clock_ghz": "no measurement: the clock of the data sheet's peaks (data "
            "sheet only)",
            "tdp_w": "NVIDIA L40S data sheet: 350 W",
            "network": (
                "NVIDIA L40S data sheet: PCIe Gen4 x16, 64 GB/s bidirectional; no NVLink; "
                + _NCCL_STEPS
            ),
        },
    },
    "a100-40g": {
        "name": "a100-40g",
        "description": "NVIDIA DGX A100 40GB: 8 GPUs per node (NVLink 3, 300 GB/s per "
        "direction), one HDR 200 Gb/s InfiniBand NIC per GPU",
        "peak_tflops": {
            "fp32": 19.5,
            "tf32": 156,
            "bf16": 312,
            "fp16": 312,
            "fp8": 312,
            "int8": 624,
        },
        "hbm_gbps": 1555,
        "hbm_gib": 40,
        "sm_count": 108,
        "peak_clock_ghz": 1.41,
        "sustained_clock_ghz": 1.41,
        "tdp_w": 400,  # A100 SXM4 data sheet: 400 W
        "arch": "ampere",
        **_EFFICIENCY,
        "network": [
            {
                "name": "nvlink",
                "size": 8,
                "bandwidth_gbps": 300,
                "latency_us": NVLINK_STEP_US,
                "efficiency": 0.75,
                "link": "nvlink",
            },
            {
                "name": "infiniband",
                "size": 0,
                "bandwidth_gbps": 25,
                "latency_us": NETWORK_STEP_US,
                "efficiency": 0.9,
                "link": "network",
            },
        ],
        "sources": {
            "peak_tflops": (
                "NVIDIA A100 data sheet: 19.5 TFLOPS FP32, 156 TF32, 312 BF16/FP16, 624 TOPS INT8"
                " (dense); no fp8 tensor cores (fp8 at the 16-bit rate)"
            ),
            "hbm": "NVIDIA A100 data sheet: 40 GB HBM2 at 1555 GB/s (SXM4)",
            "sm_count": (
                "NVIDIA A100 Tensor Core GPU architecture whitepaper: 108 SMs at 1410 MHz boost"
            ),
            "sustained_clock_ghz": "no measurement: the boost clock",
            "tdp_w": "NVIDIA A100 data sheet: 400 W (SXM4)",
            "network": (
                "A100 whitepaper: NVLink 3, 12 links of 25 GB/s per direction; DGX A100: one HDR "
                "200 Gb/s InfiniBand NIC per GPU; " + _NCCL_STEPS
            ),
        },
    },
}
"""The presets of this module, by name (merged into :data:`stg.perf.system.PRESETS`)."""

INT8_WITHOUT_TENSOR_CORES = frozenset({"volta"})
"""Architectures whose int8 rate is the CUDA cores' (DP4A), not a tensor core's."""
