"""ASTRA-sim's inputs for a stg system: its system JSON, its analytical network YAML and its
remote-memory JSON (``stg generate --system SYSTEM --astra_sim_configs``).

Every key is one ASTRA-sim's parsers read, with the value type they read it as (astra-sim
518bd51: ``astra-sim/system/Sys.cc`` ``Sys::initialize_sys`` and
``astra-sim/system/astraccl/CollectiveImplLookup.cc``; astra-network-analytical 599a047:
``common/network-parser/NetworkParser.cpp``; astra-memory-analytical 641cce8:
``AnalyticalRemoteMemory.cc``):

- network: one dimension per stg :class:`~stg.perf.system.NetworkDim` that the ranks span
  (innermost first, as ASTRA-sim numbers NPUs: NPU ``r`` sits at ``r % n0`` of the first
  dimension, as in stg), each a ``Switch`` (NVSwitch in a node, the leaf and spine switches
  between nodes) of the ranks it holds, with the bandwidth stg's collective model uses
  (``bandwidth · efficiency / oversubscription``, in ASTRA-sim's GB/s of 2^30 B) and the
  per-step latency split over the two hops ASTRA-sim counts through a switch (in ns);
- system: ``roofline-enabled`` 0, so that ASTRA-sim replays the kernel times the trace
  carries (``duration_micros``) instead of its roofline; ``peak-perf`` (TFLOP/s of the
  workload's dtype) and ``local-mem-bw`` (HBM, 10^9 B/s) describe the GPU; ring all-reduce,
  all-gather and reduce-scatter (NCCL's bandwidth-optimal algorithm, which stg's model picks
  for large buffers) and direct all-to-all (pairwise exchange) on every dimension; scheduling
  as ASTRA-sim's HGX-H100-validated configuration
  (``examples/system/native_collectives/HGX-H100-validated.json``), but a collective in one
  chunk with one chunk active per dimension (:data:`ONE_CHUNK`);
- remote memory: ``NO_MEMORY_EXPANSION``, unless the traces copy activations to and from
  host memory (CPU activation offload: MEM_STORE and MEM_LOAD nodes, which ASTRA-sim sends to
  its remote memory, ``Workload::issue_remote_mem``, and which ``NO_MEMORY_EXPANSION`` refuses
  by exiting): then ``PER_NPU_MEMORY_EXPANSION``, a memory of each NPU's own that takes
  ``remote-mem-latency + tensor_size / remote-mem-bw`` ns per node (``remote-mem-bw`` in
  bytes per ns: the GPU's host link, :func:`stg.perf.system.host_link_bandwidth`; no
  latency, as stg's replay). ASTRA-sim runs such a node in the slot of the rank's
  communication (``HardwareResource``): unlike stg's replay, a copy and a collective do not
  overlap there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from stg.errors import UserError
from stg.perf.hybrid import is_hybrid
from stg.perf.system import NetworkDim, System, host_link_bandwidth

SWITCH_HOPS = 2
"""hops ASTRA-sim's analytical Switch counts for any send (``Switch::compute_hops_count``)"""

GIB = 2**30
"""ASTRA-sim's analytical network reads bandwidth in GB/s of 2^30 B (``bw_GBps_to_Bpns``)"""

VALIDATED_SYSTEM: Mapping[str, Any] = {
    "scheduling-policy": "LIFO",
    "endpoint-delay": 10,
    "collective-optimization": "localBWAware",
}
"""the scheduling keys of ASTRA-sim's HGX-H100-validated system configuration"""

ONE_CHUNK: Mapping[str, int] = {
    "active-chunks-per-dimension": 1,
    "preferred-dataset-splits": 1,
}
"""Each collective in one chunk, one chunk in flight per dimension. The congestion-unaware
analytical backend prices every message as ``hops · latency + size / bandwidth`` whatever else
is in flight (``BasicTopology::compute_communication_delay``, astra-network-analytical
599a047), so the HGX-H100-validated example's 2 active chunks of 4 ran a collective at twice
the link's bandwidth, and paid its per-step latencies once per chunk: a ring all-gather of
2 GiB over 8 H100s took 2.59 ms in ASTRA-sim against the 5.1 ms that 7/8 · 2 GiB at the link's
bandwidth takes, a 64 KiB all-reduce 96 µs against 48 µs (``Sys::determine_chunk_size`` and
``Sys::concurrent_streams`` in astra-sim 518bd51). With one chunk ASTRA-sim's ring is the
ring of stg's collective model: a latency per step and the bytes at the link's bandwidth."""

FILE_SUFFIXES: Mapping[str, str] = {
    "system": ".system.json",
    "network": ".network.yml",
    "memory": ".memory.json",
}
"""the three files, named ``<stem><suffix>`` beside the traces (stem: the comm-group file's)"""


def network_dimensions(system: System, world_size: int) -> list[tuple[NetworkDim, int]]:
    """The dimensions of ``system`` that ``world_size`` ranks span, each with the ranks it
    holds (more than 1): their product is ``world_size``, as ASTRA-sim requires."""
    if is_hybrid(system):
        raise UserError(
            f"--astra_sim_configs: system {system.name!r} has device groups, and ASTRA-sim's "
            "analytical network has one bandwidth and latency per dimension for every NPU; "
            "allowed: a system without groups (the traces' durations still follow the groups)"
        )
    if world_size < 2:
        raise UserError(
            "--astra_sim_configs: ASTRA-sim's analytical network needs at least 2 NPUs per "
            f"dimension; this workload has {world_size} rank"
        )
    dims: list[tuple[NetworkDim, int]] = []
    remaining = world_size
    for dim in system.network:
        if remaining == 1:
            break
        size = dim.size or remaining
        if remaining <= size:
            count = remaining
        elif remaining % size:
            raise UserError(
                f"--astra_sim_configs: {world_size} ranks do not fill whole groups of {size} "
                f"on {system.name}'s {dim.name} dimension, and ASTRA-sim's network holds a "
                "product of dimension sizes; allowed: a world size that does"
            )
        else:
            count = size
        remaining //= count
        if count > 1:
            dims.append((dim, count))
    if remaining > 1:
        raise UserError(
            f"--astra_sim_configs: {world_size} ranks do not fit system {system.name!r} "
            f"({system.capacity} GPUs)"
        )
    return dims


def network_config(system: System, world_size: int) -> dict[str, list[Any]]:
    """The analytical network's configuration: ``topology``, ``npus_count``, ``bandwidth``
    (GB/s of 2^30 B) and ``latency`` (ns per hop), one entry per dimension."""
    dims = network_dimensions(system, world_size)
    return {
        "topology": ["Switch" for _ in dims],
        "npus_count": [count for _, count in dims],
        "bandwidth": [
            _decimal(dim.bandwidth * dim.efficiency / dim.oversubscription / GIB) for dim, _ in dims
        ],
        "latency": [_decimal(dim.latency * 1e9 / SWITCH_HOPS) for dim, _ in dims],
    }


def system_config(system: System, world_size: int, dtype: str = "bf16") -> dict[str, Any]:
    """ASTRA-sim's system configuration (see module doc): one collective implementation per
    network dimension."""
    count = len(network_dimensions(system, world_size))
    return {
        **VALIDATED_SYSTEM,
        **ONE_CHUNK,
        "all-reduce-implementation": ["ring"] * count,
        "all-gather-implementation": ["ring"] * count,
        "reduce-scatter-implementation": ["ring"] * count,
        "all-to-all-implementation": ["direct"] * count,
        "roofline-enabled": 0,
        "peak-perf": _decimal(system.peak(dtype) / 1e12),
        "local-mem-bw": _decimal(system.hbm_bandwidth / 1e9),
    }


def memory_config(host_link: float | None = None) -> dict[str, Any]:
    """ASTRA-sim's remote-memory configuration: no memory expansion, or with ``host_link``
    (bytes/s) each NPU's host memory behind a link of that bandwidth (see module doc)."""
    if host_link is None:
        return {"memory-type": "NO_MEMORY_EXPANSION"}
    return {"memory-type": "PER_NPU_MEMORY_EXPANSION", "remote-mem-bw": _decimal(host_link / 1e9)}


def format_network_yaml(config: Mapping[str, list[Any]]) -> str:
    """The network configuration as YAML in the flow-list form of ASTRA-sim's examples
    (``topology: [ Switch, Switch ]``): plain words and numbers, nothing that needs quoting."""
    lines = []
    for key, values in config.items():
        items = ", ".join(str(v) for v in values)
        lines.append(f"{key}: [ {items} ]")
    return "\n".join(lines) + "\n"


def astra_sim_inputs(
    system: System, world_size: int, dtype: str = "bf16", host_copies: bool = False
) -> dict[str, str]:
    """The text of the three files by kind (``system``, ``network``, ``memory``);
    ``host_copies``: the traces copy to and from host memory (CPU activation offload)."""
    host_link = host_link_bandwidth(system) if host_copies else None
    return {
        "system": _json_text(system_config(system, world_size, dtype)),
        "network": format_network_yaml(network_config(system, world_size)),
        "memory": _json_text(memory_config(host_link)),
    }


def _json_text(data: Mapping[str, Any]) -> str:
    return json.dumps(data, indent=2) + "\n"


def _decimal(value: float) -> float | int:
    """A number as short as it stays exact to 1e-6 (an integer where it is one)."""
    rounded = round(value, 6)
    return int(rounded) if rounded == int(rounded) else rounded
