"""Placement of the parallel mesh on global ranks, and communicator ids.

The mesh has the axes ``dp, tp, sp, pp, ep``. ``rank_order`` lists them fastest-varying first;
the default ``tp,sp,ep,dp,pp`` keeps a TP group on adjacent ranks (the innermost, fastest
network dimension).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from math import prod

from stg.errors import UserError

AXES: tuple[str, ...] = ("dp", "tp", "sp", "pp", "ep")
DEFAULT_RANK_ORDER: tuple[str, ...] = ("tp", "sp", "ep", "dp", "pp")
MAX_WORLD_SIZE = 2**24
"""The most ranks a layout numbers (16,777,216): every rank gets a file and per-rank tables,
so a larger world is refused with one error line instead of running out of memory."""


class LayoutError(UserError):
    """An impossible mesh (bad degrees or rank order)."""


def parse_rank_order(text: str) -> tuple[str, ...]:
    """Parse ``"tp,sp,ep,dp,pp"``; every axis exactly once."""
    order = tuple(part.strip() for part in text.split(",") if part.strip())
    if sorted(order) != sorted(AXES):
        raise LayoutError(f"rank_order={text!r} must list each of {','.join(AXES)} exactly once")
    return order


@dataclass(frozen=True)
class Layout:
    """Maps mesh coordinates to global ranks and numbers the communicators.

    ``group_axes`` lists the axis combinations that collectives use; each combination splits
    the world into groups, numbered from 1 in that order (then by lowest member rank).
    Combinations whose groups have one member get no id.
    """

    degrees: Mapping[str, int]
    rank_order: tuple[str, ...] = DEFAULT_RANK_ORDER
    group_axes: tuple[tuple[str, ...], ...] = ()
    _strides: dict[str, int] = field(init=False, repr=False, compare=False)
    _group_ids: dict[tuple[str, ...], tuple[int, ...]] = field(
        init=False, repr=False, compare=False
    )
    _groups: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for axis in AXES:
            if self.degrees.get(axis, 1) < 1:
                raise LayoutError(f"{axis}={self.degrees[axis]} must be a positive integer")
        unknown = set(self.degrees) - set(AXES)
        if unknown:
            raise LayoutError(f"unknown mesh axes {sorted(unknown)}; allowed: {', '.join(AXES)}")
        if self.world_size > MAX_WORLD_SIZE:
            product = "·".join(f"{a}={self.degree(a)}" for a in AXES if self.degree(a) > 1)
            raise LayoutError(
                f"{product} makes {self.world_size:,} ranks; at most {MAX_WORLD_SIZE:,} are "
                "supported"
            )
        strides: dict[str, int] = {}
        stride = 1
        for axis in self.rank_order:
            strides[axis] = stride
            stride *= self.degree(axis)
        object.__setattr__(self, "_strides", strides)
        group_ids: dict[tuple[str, ...], tuple[int, ...]] = {}
        groups: dict[int, tuple[int, ...]] = {}
        next_id = 1
        for axes in self.group_axes:
            key = self._canonical(axes)
            if key in group_ids or prod(self.degree(a) for a in key) <= 1:
                continue
            ids = [0] * self.world_size
            for rank in range(self.world_size):
                if ids[rank]:
                    continue
                members = self.members(rank, key)
                for member in members:
                    ids[member] = next_id
                groups[next_id] = members
                next_id += 1
            group_ids[key] = tuple(ids)
        object.__setattr__(self, "_group_ids", group_ids)
        object.__setattr__(self, "_groups", groups)

    def degree(self, axis: str) -> int:
        return int(self.degrees.get(axis, 1))

    @property
    def world_size(self) -> int:
        return prod(self.degree(a) for a in AXES)

    def _canonical(self, axes: Iterable[str]) -> tuple[str, ...]:
        return tuple(a for a in AXES if a in set(axes) and self.degree(a) > 1)

    def coords(self, rank: int) -> dict[str, int]:
        """The mesh coordinate of a global rank."""
        return {a: (rank // self._strides[a]) % self.degree(a) for a in AXES}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The global rank at a mesh coordinate."""
        return sum(coords.get(a, 0) * self._strides[a] for a in AXES)

    def stage(self, rank: int) -> int:
        return (rank // self._strides["pp"]) % self.degree("pp")

    def members(self, rank: int, axes: Iterable[str]) -> tuple[int, ...]:
        """Sorted ranks that differ from ``rank`` only along ``axes``."""
        members = [rank]
        for axis in self._canonical(axes):
            base = rank - ((rank // self._strides[axis]) % self.degree(axis)) * self._strides[axis]
            members = [
                m - (rank - base) + i * self._strides[axis]
                for m in members
                for i in range(self.degree(axis))
            ]
        return tuple(sorted(members))

    def group_id(self, rank: int, axes: tuple[str, ...]) -> int:
        """Communicator id of the group of ``rank`` along ``axes`` (registered in group_axes)."""
        return self._group_ids[self._canonical(axes)][rank]

    def peer(self, rank: int, stage: int | None) -> int:
        """The rank with the same coordinates as ``rank`` but pipeline stage ``stage``."""
        assert stage is not None
        return rank + (stage - self.stage(rank)) * self._strides["pp"]

    @property
    def comm_groups(self) -> dict[int, tuple[int, ...]]:
        """Every numbered communicator: id -> sorted member ranks."""
        return dict(self._groups)
