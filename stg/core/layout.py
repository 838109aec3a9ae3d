"""Placement of the parallel mesh on global ranks, and communicator ids.

The mesh has the axes ``dp, tp, sp, pp, ep``. ``rank_order`` lists them fastest-varying first;
the default ``tp,sp,ep,dp,pp`` keeps a TP group on adjacent ranks (the innermost, fastest
network dimension).

With expert parallelism folded over the dense axes (:func:`fold_mesh`, Megatron-LM's MoE
parallel folding) the mesh axes are finer: the pieces that the dense axes ``tp, sp, dp`` and
the expert axes ``etp, ep, edp`` cut each other into, so that every group of either kind is
a product of mesh axes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from math import prod

from stg.errors import UserError

AXES: tuple[str, ...] = ("dp", "tp", "sp", "pp", "ep")
DEFAULT_RANK_ORDER: tuple[str, ...] = ("tp", "sp", "ep", "dp", "pp")
DENSE_AXES: tuple[str, ...] = ("tp", "sp", "dp")
"""The axes that expert parallelism folds over (``pp`` stays apart, as in Megatron-LM)."""
EXPERT_AXES: tuple[str, ...] = ("etp", "ep", "edp")
"""The expert mesh of a stage, fastest-varying first: expert tensor, expert and expert data
parallelism (Megatron-LM's ``expert_decoder_rank_generator``: its ``tp``, ``ep`` and ``dp``)."""
UNFOLDED_AXIS_PARTS: Mapping[str, tuple[str, ...]] = {"etp": ("tp",), "edp": ("dp", "sp")}
"""Named axes that are not mesh axes of an unfolded mesh: experts split their FFN (``etp``)
over ``tp`` and hold the same shards on the ``dp·sp`` ranks (``edp``). A folded mesh
(:func:`fold_mesh`) maps every named axis."""
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
class FoldedMesh:
    """A mesh whose expert axes fold over its dense ones.

    ``degrees`` and ``rank_order`` are those of the finer mesh axes (named
    ``dense.expert``, e.g. ``dp.ep``: the part of ``dp`` that is also part of ``ep``) and
    ``pp``; ``axes`` maps every name (``tp``, ``sp``, ``dp``, ``etp``, ``ep``, ``edp``,
    ``pp``) to the mesh axes it is made of."""

    degrees: dict[str, int]
    rank_order: tuple[str, ...]
    axes: dict[str, frozenset[str]]


def fold_mesh(
    degrees: Mapping[str, int], rank_order: Iterable[str], etp: int, ep: int
) -> FoldedMesh:
    """The mesh on which ``etp·ep·edp`` number the ranks of a pipeline stage as the
    dense ``tp, sp, dp`` do, Megatron-LM's MoE parallel folding (``initialize_model_parallel``:
    one RankGenerator for the dense and one for the expert axes, with the same order string):
    both in ``rank_order``, fastest first, the expert axes where ``tp``, ``ep`` and ``dp``
    stand in it (the default ``tp,sp,ep,dp,pp``: etp, ep, edp).

    Each of the six axes is an interval of the stage's local rank number; their ends
    (products of degrees) cut that range into pieces, and each piece is a mesh axis. This
    needs the ends to divide one another (powers of two always do); otherwise, or where
    ``ep·etp`` does not divide ``dp·tp·sp``, a :class:`LayoutError` names the degrees."""
    order = [a for a in rank_order if a != "ep"]
    dense = [a for a in order if a in DENSE_AXES]
    local = prod(int(degrees.get(a, 1)) for a in dense)
    if local % (ep * etp):
        raise LayoutError(
            f"ep·etp={ep * etp} must divide dp·tp·sp={local} (ep_layout=fold: the experts "
            "fold over the ranks of a pipeline stage)"
        )
    given = list(rank_order)
    expert_degrees = {"etp": etp, "ep": ep, "edp": local // (ep * etp)}
    place = {"etp": "tp", "ep": "ep", "edp": "dp"}
    expert = sorted(expert_degrees.items(), key=lambda item: given.index(place[item[0]]))

    def ends(axes: Iterable[tuple[str, int]]) -> list[tuple[int, int, str]]:
        out, start = [], 1
        for name, degree in axes:
            out.append((start, start * degree, name))
            start *= degree
        return out

    dense_ends = ends((a, int(degrees.get(a, 1))) for a in dense)
    expert_ends = ends(expert)
    cuts = sorted({1, *(e for _, e, _ in dense_ends), *(e for _, e, _ in expert_ends)})
    for low, high in pairwise(cuts):
        if high % low:
            shown = ", ".join(f"{a}={int(degrees.get(a, 1))}" for a in dense)
            raise LayoutError(
                f"etp={etp}, ep={ep} do not fold over {shown} in rank_order "
                f"{','.join(order)}: every product of the leading degrees of either kind "
                "must divide the next (powers of two do)"
            )
    mesh: dict[str, int] = {}
    mesh_order: list[str] = []
    parts: dict[str, set[str]] = {name: set() for name in (*DENSE_AXES, *EXPERT_AXES)}
    for axis in order:
        if axis not in DENSE_AXES:
            mesh[axis] = int(degrees.get(axis, 1))
            mesh_order.append(axis)
            parts.setdefault(axis, set()).add(axis)
            continue
        low, high = next((lo, hi) for lo, hi, name in dense_ends if name == axis)
        for start, stop in pairwise(cuts):
            if start < low or stop > high:
                continue
            owner = next(name for lo, hi, name in expert_ends if lo <= start and stop <= hi)
            name = f"{axis}.{owner}"
            mesh[name] = stop // start
            mesh_order.append(name)
            parts[axis].add(name)
            parts[owner].add(name)
    return FoldedMesh(mesh, tuple(mesh_order), {k: frozenset(v) for k, v in parts.items()})


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
        for axis in self.axes:
            if self.degrees.get(axis, 1) < 1:
                raise LayoutError(f"{axis}={self.degrees[axis]} must be a positive integer")
        unknown = set(self.degrees) - set(self.axes)
        if unknown:
            raise LayoutError(
                f"unknown mesh axes {sorted(unknown)}; allowed: {', '.join(self.axes)}"
            )
        if self.world_size > MAX_WORLD_SIZE:
            product = "·".join(f"{a}={self.degree(a)}" for a in self.axes if self.degree(a) > 1)
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

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes: those of ``rank_order`` (``AXES``, or a folded mesh's)."""
        return self.rank_order

    def degree(self, axis: str) -> int:
        return int(self.degrees.get(axis, 1))

    @property
    def world_size(self) -> int:
        return prod(self.degree(a) for a in self.axes)

    def _canonical(self, axes: Iterable[str]) -> tuple[str, ...]:
        wanted = set(axes)
        return tuple(a for a in self.axes if a in wanted and self.degree(a) > 1)

    def coords(self, rank: int) -> dict[str, int]:
        """The mesh coordinate of a global rank."""
        return {a: (rank // self._strides[a]) % self.degree(a) for a in self.axes}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The global rank at a mesh coordinate."""
        return sum(coords.get(a, 0) * self._strides[a] for a in self.axes)

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
