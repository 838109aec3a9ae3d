"""Hybrid clusters: groups of different GPUs training one model synchronously (QSync's setting).

A hybrid system file is a JSON object with ``groups``::

    {
      "name": "v100+t4",
      "groups": [
        {"name": "v100", "device": "v100-32g", "gpus_per_node": 4, "nodes": 1},
        {"name": "t4", "device": "t4-16g", "gpus_per_node": 4, "nodes": 1,
         "node_link": {"name": "pcie", "bandwidth_gbps": 16, "latency_us": 5,
                       "efficiency": 0.75}}
      ],
      "network": {"name": "ethernet", "bandwidth_gbps": 3.125, "latency_us": 5,
                  "efficiency": 0.9},
      "placement": ["v100", "v100", "v100", "v100", "t4", "t4", "t4", "t4"]
    }

- ``groups`` (non-empty): ``name`` (unique), ``device`` (a preset name of
  :mod:`stg.perf.system`, e.g. ``t4-16g``, or an inline device: a system object whose
  ``network`` may be left out), ``gpus_per_node`` (default: the device preset's first network
  dimension's size), ``nodes`` (default 1), ``node_link`` (the link between the GPUs of one
  node: ``bandwidth_gbps`` per GPU per direction, ``latency_us``, optional ``efficiency`` and
  ``name``; default: the device's first network dimension, e.g. NVLink for V100, PCIe for T4).
- ``network``: the network between nodes, within a group and between groups, per GPU per
  direction (default: the first group's device's outermost network dimension).
- ``placement``: the group of each rank, one name per GPU (default: rank order, the first
  group's GPUs first). A group's ranks fill its nodes in rank order.

Each group on its own is a plain :class:`System` (its device, its node link, the network):
``HybridSystem.group_system``. The hybrid system is a :class:`System` too, whose device
fields are the first group's; the time predictor asks :func:`device_of` for the device of
each rank, and prices collectives and sends across nodes and groups with
:meth:`HybridSystem.collective_time` and :meth:`HybridSystem.send_time`: a collective runs
hierarchically, within each node over that node's link (the slowest node sets the pace), then
between nodes over ``network`` on the largest per-GPU shard.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stg.core.workload import CollectiveType
from stg.errors import UserError
from stg.perf.system import (
    PRESETS,
    NetworkDim,
    System,
    SystemDescriptionError,
    _fraction,
    _mapping,
    _num,
    _positive,
    check_capacity,
    system_from_dict,
)

HYBRID_KEYS = frozenset({"name", "description", "groups", "network", "placement"})
GROUP_KEYS = frozenset({"name", "device", "gpus_per_node", "nodes", "node_link"})
LINK_KEYS = frozenset({"name", "bandwidth_gbps", "latency_us", "efficiency"})


@dataclass(frozen=True)
class DeviceGroup:
    """GPUs of one kind: ``nodes`` nodes of ``gpus_per_node`` ``device`` GPUs joined by
    ``link``. ``device`` is the group as a plain system (its network: link, then between
    nodes)."""

    name: str
    device: System
    gpus_per_node: int
    nodes: int
    link: NetworkDim

    @property
    def size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class HybridSystem(System):
    """A cluster of device groups; its own device fields are the first group's."""

    groups: tuple[DeviceGroup, ...] = ()
    between_nodes: NetworkDim | None = None
    placement: tuple[int, ...] = ()
    """group index of each rank"""
    node_of: tuple[int, ...] = ()
    """global node index of each rank"""
    local_of: tuple[int, ...] = ()
    """index of each rank within its node"""
    explicit_placement: bool = False
    node_group: tuple[int, ...] = field(default=())
    """group index of each node"""

    @property
    def capacity(self) -> int:
        return len(self.placement)

    def coordinates(self, rank: int) -> tuple[int, ...]:
        return (self.local_of[rank], self.node_of[rank])

    def group_of(self, rank: int) -> DeviceGroup:
        return self.groups[self.placement[rank]]

    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    def group_index(self, name: str) -> int:
        for i, group in enumerate(self.groups):
            if group.name == name:
                return i
        raise SystemDescriptionError(
            f"unknown device group {name!r}; allowed: {', '.join(self.group_names())}"
        )

    def placement_runs(self, world_size: int) -> tuple[tuple[str, int], ...]:
        """The group of ranks 0..world_size-1 as runs (name, count) in rank order."""
        runs: list[list[Any]] = []
        for rank in range(world_size):
            name = self.groups[self.placement[rank]].name
            if runs and runs[-1][0] == name:
                runs[-1][1] += 1
            else:
                runs.append([name, 1])
        return tuple((name, count) for name, count in runs)

    def _node_link(self, node: int) -> NetworkDim:
        return self.groups[self.node_group[node]].link

    def collective_time(self, kind: CollectiveType, size: int, members: Sequence[int]) -> float:
        """Alpha-beta time of one collective over ``members`` (sizes as
        :func:`stg.predictors.time.collective_time` takes them): within each node over its
        link, the slowest node setting the pace; then between nodes on the largest per-GPU
        shard; an all-reduce takes a ring or a tree per level, whichever is faster."""
        count = len(members)
        if count <= 1:
            return 0.0
        per_node: dict[int, int] = {}
        for rank in members:
            node = self.node_of[rank]
            per_node[node] = per_node.get(node, 0) + 1
        between = self.between_nodes
        assert between is not None
        if kind is CollectiveType.BARRIER:
            inner = max(2 * (k - 1) * self._node_link(n).latency for n, k in per_node.items())
            return inner + 2 * (len(per_node) - 1) * between.latency
        buffer = float(size) * count if kind in _GATHERS else float(size)
        inner = max(
            _level_time(kind, size, buffer, k, self._node_link(n)) for n, k in per_node.items()
        )
        smallest = min(per_node.values())
        outer = _level_time(kind, size, buffer / smallest, len(per_node), between)
        return inner + outer

    def send_time(self, size: int, src: int, dst: int) -> float:
        """A point-to-point send: over the node's link within a node, else the network."""
        if src == dst:
            return 0.0
        if self.node_of[src] == self.node_of[dst]:
            link = self.group_of(src).link
        else:
            assert self.between_nodes is not None
            link = self.between_nodes
        return size / link.effective_bandwidth + link.latency

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (the inverse of :func:`hybrid_from_dict`)."""
        assert self.between_nodes is not None
        data: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "groups": [
                {
                    "name": g.name,
                    "device": {k: v for k, v in g.device.as_dict().items() if k != "network"},
                    "gpus_per_node": g.gpus_per_node,
                    "nodes": g.nodes,
                    "node_link": _link_dict(g.link),
                }
                for g in self.groups
            ],
            "network": _link_dict(self.between_nodes),
        }
        if self.explicit_placement:
            data["placement"] = [self.groups[i].name for i in self.placement]
        return data


_GATHERS = frozenset({CollectiveType.ALL_GATHER, CollectiveType.GATHER})


def _level_time(kind: CollectiveType, size: int, buffer: float, n: int, link: NetworkDim) -> float:
    if n <= 1:
        return 0.0
    bandwidth = link.effective_bandwidth
    if kind is CollectiveType.ALL_TO_ALL:
        return (n - 1) / n * size / bandwidth + (n - 1) * link.latency
    if kind in (CollectiveType.BROADCAST, CollectiveType.REDUCE):
        return buffer / bandwidth + (n - 1) * link.latency
    step = (n - 1) / n * buffer / bandwidth + (n - 1) * link.latency
    if kind is CollectiveType.ALL_REDUCE:
        tree = 2 * buffer / bandwidth + 2 * math.ceil(math.log2(n)) * link.latency
        return min(2 * step, tree)
    return step


def _link_dict(link: NetworkDim) -> dict[str, Any]:
    return {
        "name": link.name,
        "bandwidth_gbps": _num(link.bandwidth / 1e9),
        "latency_us": _num(link.latency * 1e6),
        "efficiency": link.efficiency,
    }


def _link(where: str, raw: object) -> NetworkDim:
    raw = _mapping(where, raw)
    # a device preset's NCCL topology keys (stg.perf.comm_time) describe its own fabric; the
    # hybrid model prices its links as alpha-beta links
    topology = {"size", "link", "oversubscription", "sharp_efficiency"}
    unknown = sorted(set(raw) - LINK_KEYS - topology)
    if unknown:
        raise SystemDescriptionError(
            f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(LINK_KEYS))}"
        )
    for key in ("bandwidth_gbps", "latency_us"):
        if key not in raw:
            raise SystemDescriptionError(f"{where}: missing key {key!r}")
    return NetworkDim(
        name=str(raw.get("name", "link")),
        size=0,
        bandwidth=_positive(f"{where}.bandwidth_gbps", raw["bandwidth_gbps"]) * 1e9,
        latency=_positive(f"{where}.latency_us", raw["latency_us"], allow_zero=True) * 1e-6,
        efficiency=_fraction(f"{where}.efficiency", raw.get("efficiency", 1.0)),
    )


def _device_dict(where: str, device: object) -> dict[str, Any]:
    if isinstance(device, str):
        if device not in PRESETS:
            raise SystemDescriptionError(
                f"{where}: unknown device {device!r}; allowed: {', '.join(sorted(PRESETS))} "
                "or an inline device object"
            )
        return dict(PRESETS[device])
    if isinstance(device, Mapping):
        return dict(device)
    raise SystemDescriptionError(
        f"{where} must be a device preset name or an inline device object, got {device!r}"
    )


def _count(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SystemDescriptionError(f"{where} must be an integer > 0, got {value!r}")
    return value


def hybrid_from_dict(data: object, source: str = "system") -> HybridSystem:
    """Check and convert the JSON form of the module docstring; a mistake raises a one-line
    :class:`SystemDescriptionError` naming the file and the key."""
    data = _mapping(source, data)
    unknown = sorted(set(data) - HYBRID_KEYS)
    if unknown:
        raise SystemDescriptionError(
            f"{source}: unknown key {unknown[0]!r} in a hybrid system (one with 'groups'); "
            f"allowed: {', '.join(sorted(HYBRID_KEYS))}"
        )
    raw_groups = data["groups"]
    if not isinstance(raw_groups, list) or not raw_groups:
        raise SystemDescriptionError(f"{source}: groups must be a non-empty list of groups")
    devices: list[dict[str, Any]] = []
    parsed: list[tuple[str, int, int, NetworkDim]] = []
    for i, raw in enumerate(raw_groups):
        where = f"{source}: groups[{i}]"
        raw = _mapping(where, raw)
        unknown = sorted(set(raw) - GROUP_KEYS)
        if unknown:
            raise SystemDescriptionError(
                f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(GROUP_KEYS))}"
            )
        for key in ("name", "device"):
            if key not in raw:
                raise SystemDescriptionError(f"{where}: missing key {key!r}")
        name = raw["name"]
        if not isinstance(name, str) or not name or ":" in name:
            raise SystemDescriptionError(
                f"{where}.name must be a non-empty string without ':', got {name!r}"
            )
        if any(name == p[0] for p in parsed):
            raise SystemDescriptionError(f"{where}.name {name!r} is used by another group")
        device = _device_dict(f"{where}.device", raw["device"])
        network = device.get("network")
        first = network[0] if isinstance(network, list) and network else None
        if "gpus_per_node" in raw:
            per_node = _count(f"{where}.gpus_per_node", raw["gpus_per_node"])
        elif isinstance(first, Mapping) and isinstance(first.get("size"), int) and first["size"]:
            per_node = int(first["size"])
        else:
            raise SystemDescriptionError(f"{where}: missing key 'gpus_per_node'")
        nodes = _count(f"{where}.nodes", raw.get("nodes", 1))
        if "node_link" in raw:
            link = _link(f"{where}.node_link", raw["node_link"])
        elif first is not None:
            link = _link(f"{where}.device.network[0]", first)
        else:
            raise SystemDescriptionError(f"{where}: missing key 'node_link'")
        devices.append(device)
        parsed.append((name, per_node, nodes, link))
    if "network" in data:
        between = _link(f"{source}: network", data["network"])
    else:
        network = devices[0].get("network")
        if not isinstance(network, list) or not network:
            raise SystemDescriptionError(f"{source}: missing key 'network'")
        between = _link(f"{source}: groups[0].device.network[-1]", network[-1])
    groups = []
    for i, (device, (name, per_node, nodes, link)) in enumerate(zip(devices, parsed, strict=True)):
        own = {**device, "network": [_dim(link, per_node), _dim(between, 0)]}
        own.setdefault("name", name)
        system = system_from_dict(own, f"{source}: groups[{i}].device")
        groups.append(DeviceGroup(name, system, per_node, nodes, link))
    names = [g.name for g in groups]
    total = sum(g.size for g in groups)
    if "placement" in data:
        raw_placement = data["placement"]
        if not isinstance(raw_placement, list) or any(
            not isinstance(x, str) for x in raw_placement
        ):
            raise SystemDescriptionError(
                f"{source}: placement must be a list of group names, one per GPU"
            )
        bad = [x for x in raw_placement if x not in names]
        if bad:
            raise SystemDescriptionError(
                f"{source}: placement names unknown group {bad[0]!r}; allowed: {', '.join(names)}"
            )
        placement = tuple(names.index(x) for x in raw_placement)
        for i, group in enumerate(groups):
            if placement.count(i) != group.size:
                raise SystemDescriptionError(
                    f"{source}: placement puts {placement.count(i)} ranks on group "
                    f"{group.name!r}, which has {group.size} GPUs "
                    f"({group.nodes} x {group.gpus_per_node}); the placement needs {total} "
                    "entries, one per GPU"
                )
    else:
        placement = tuple(i for i, g in enumerate(groups) for _ in range(g.size))
    first_node = []
    node_group = []
    for i, g in enumerate(groups):
        first_node.append(len(node_group))
        node_group.extend([i] * g.nodes)
    seen = [0] * len(groups)
    node_of = []
    local_of = []
    for g in placement:
        j = seen[g]
        seen[g] += 1
        node_of.append(first_node[g] + j // groups[g].gpus_per_node)
        local_of.append(j % groups[g].gpus_per_node)
    lead = groups[0].device
    widest = max(g.gpus_per_node for g in groups)
    slowest_link = min(groups, key=lambda g: g.link.effective_bandwidth).link
    return HybridSystem(
        name=str(data.get("name", source)),
        description=str(data.get("description", "")),
        peak_flops=lead.peak_flops,
        hbm_bandwidth=lead.hbm_bandwidth,
        hbm_capacity=min(g.device.hbm_capacity for g in groups),
        network=(_dim_of(slowest_link, widest), _dim_of(between, 0)),
        compute_efficiency=lead.compute_efficiency,
        memory_efficiency=lead.memory_efficiency,
        kernel_overhead=lead.kernel_overhead,
        sm_count=lead.sm_count,
        peak_clock_ghz=lead.peak_clock_ghz,
        sustained_clock_ghz=lead.sustained_clock_ghz,
        arch=lead.arch,
        tdp_w=lead.tdp_w,
        power_limit_w=lead.power_limit_w,
        groups=tuple(groups),
        between_nodes=between,
        placement=placement,
        node_of=tuple(node_of),
        local_of=tuple(local_of),
        explicit_placement="placement" in data,
        node_group=tuple(node_group),
    )


def _dim(link: NetworkDim, size: int) -> dict[str, Any]:
    return {**_link_dict(link), "size": size}


def _dim_of(link: NetworkDim, size: int) -> NetworkDim:
    return NetworkDim(link.name, size, link.bandwidth, link.latency, link.efficiency)


# -- what predictors ask of any system -------------------------------------------------------


def is_hybrid(system: System) -> bool:
    """Whether ``system`` has device groups."""
    return isinstance(system, HybridSystem)


def device_of(system: System, rank: int) -> System:
    """The system that prices rank ``rank``'s kernels: its group's device (hybrid), else the
    system itself."""
    if isinstance(system, HybridSystem):
        return system.group_of(rank).device
    return system


def group_of_rank(system: System, rank: int) -> str | None:
    """The name of rank ``rank``'s device group (None for a plain system)."""
    if isinstance(system, HybridSystem):
        return system.group_of(rank).name
    return None


def placed(options: Any, system: System) -> Any:
    """``options`` (a :class:`~stg.core.options.GenerateOptions`) with the placement of a
    hybrid ``system`` (its ranks in rank order); unchanged for a plain system. Raises
    :class:`UserError` where the ranks exceed its GPUs, or where ``options`` place them
    otherwise (``--placement``): the system file places the ranks."""
    from dataclasses import replace

    if not is_hybrid(system):
        return options
    check_capacity(
        system,
        options.world_size,
        f"ranks (dp x tp x sp x pp{'' if options.ep_folded else ' x ep'})",
    )
    runs = system.placement_runs(options.world_size)
    given = [name for name, count in options.placement for _ in range(count)]
    if given and given != [name for name, count in runs for _ in range(count)]:
        text = ",".join(f"{n}:{c}" for n, c in options.placement)
        theirs = ",".join(f"{n}:{c}" for n, c in runs)
        raise UserError(
            f"placement={text} differs from where system {system.name!r} places the "
            f"{options.world_size} ranks ({theirs}): leave --placement out with a hybrid "
            "system file, or give its placement"
        )
    return replace(options, placement=runs)


__all__ = [
    "DeviceGroup",
    "HybridSystem",
    "device_of",
    "group_of_rank",
    "hybrid_from_dict",
    "is_hybrid",
    "placed",
]
