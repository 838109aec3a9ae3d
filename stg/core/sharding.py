"""Shardings of tensors over mesh axes, and the collectives that change one into another.

A :class:`Sharding` says, per tensor dimension, which mesh axes split it, and which axes hold
partial sums (the "hidden" factor of the original STG: after a row-parallel matmul every TP
rank holds a partial sum, written ``partial={"tp"}``). :func:`plan_reshard` turns a change of
sharding into the collectives that perform it; nothing else in stg decides on collectives.

A sharding may also split a tensor *flat*: ``flat={"dp"}`` means the local tensor (after its
per-dimension splits) is flattened, padded to a multiple of the flat degree and cut into equal
pieces, one per rank. This is how FSDP / ZeRO-3 store weights and how ZeRO shards gradients and
optimizer states (DeepSpeed, Megatron's distributed optimizer, PyTorch FSDP): it works for any
data-parallel size, where a split of a dimension would need the size to divide it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from stg.core.workload import CollectiveType

Axes = frozenset[str]
NO_AXES: Axes = frozenset()

OWN_BUCKET = "own_bucket"
"""The tag of the once-per-iteration collectives of a weight that Megatron-LM's distributed
optimizer keeps in a bucket of its own (``_does_param_require_new_bucket`` in
``megatron/core/distributed/param_and_grad_buffer.py``, core_v0.15.0: a shared embedding),
so that the first and the last pipeline stage shard it alike: lowering fuses them with no
other collective."""


TP_REPLICATED_GRAD = "tp_replicated_grad"
"""The tag of the tensor-parallel all-reduce of a gradient that is partial over the
tensor-parallel group although its weight is not split over it (sequence parallelism's layer
norms, biases and routers: Megatron-LM's ``sequence_parallel`` parameters). Megatron-LM
reduces these gradients over the data-parallel ranks in their buckets like any other, then,
after ``finish_grad_sync``, all-reduces all of them over the tensor-parallel group in one
coalesced all-reduce per iteration (``_allreduce_non_tensor_model_parallel_grads`` in
``megatron/core/distributed/finalize_model_grads.py``, core_v0.15.0): lowering fuses the tagged
all-reduces of a stage's parts into that one collective before the optimizer step."""


@dataclass(frozen=True, slots=True)
class Sharding:
    """Per-dimension mesh axes plus the axes over which the values are partial sums, and the
    axes that split the flattened, padded local tensor (``flat``; storage only: ops read
    tensors without a flat split, so a flat split is always gathered first)."""

    dims: tuple[Axes, ...]
    partial: Axes = NO_AXES
    flat: Axes = NO_AXES

    @classmethod
    def replicated(cls, rank: int) -> Sharding:
        return cls(tuple(NO_AXES for _ in range(rank)))

    def axes(self) -> Axes:
        """Every axis that splits some dimension, or the flattened tensor."""
        out: set[str] = set(self.flat)
        for axes in self.dims:
            out |= axes
        return frozenset(out)

    def dim_of(self, axis: str) -> int | None:
        """The dimension that ``axis`` splits, if any."""
        for i, axes in enumerate(self.dims):
            if axis in axes:
                return i
        return None

    def with_dim(self, index: int, axes: Iterable[str]) -> Sharding:
        dims = list(self.dims)
        dims[index] = frozenset(axes)
        return Sharding(tuple(dims), self.partial, self.flat)

    def with_partial(self, partial: Iterable[str]) -> Sharding:
        return Sharding(self.dims, frozenset(partial), self.flat)

    def with_flat(self, axes: Iterable[str]) -> Sharding:
        """This sharding with ``axes`` (also) splitting the flattened, padded local tensor:
        how FSDP and ZeRO store a weight, its gradient or its optimizer state."""
        return Sharding(self.dims, self.partial, self.flat | frozenset(axes))

    def describe(self, names: Iterable[str]) -> str:
        parts = []
        for name, axes in zip(names, self.dims, strict=True):
            parts.append(f"{name}/{'·'.join(sorted(axes))}" if axes else name)
        text = "[" + ", ".join(parts) + "]"
        if self.flat:
            text += " flat(" + ",".join(sorted(self.flat)) + ")"
        if self.partial:
            text += " partial(" + ",".join(sorted(self.partial)) + ")"
        return text


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One collective of a reshard: ``kind`` over ``axes``; ``dim`` is the dimension split or
    gathered (``dst_dim`` the one that becomes split, for all-to-all). The sharding after the
    step is ``after``."""

    kind: CollectiveType
    axes: Axes
    dim: int | None
    dst_dim: int | None
    after: Sharding


def plan_reshard(
    src: Sharding, dst: Sharding, pieces: Mapping[str, tuple[str, str]] | None = None
) -> list[ReshardStep]:
    """The collectives that turn a tensor sharded as ``src`` into ``dst``.

    Rules, in order: a partial axis that ``dst`` splits a dimension by becomes a
    reduce-scatter on that dimension; the remaining partial axes not partial in ``dst`` are
    all-reduced together. An axis that splits a dimension in ``src`` but not in ``dst`` moves
    by all-to-all when ``dst`` splits another dimension by it, and is all-gathered otherwise.
    ``pieces`` (a folded expert mesh, :func:`stg.core.layout.fold_mesh`) maps a mesh axis
    to the dense and the expert axis it is a piece of: the pieces of one dense axis that
    reduce-scatter onto one dimension do it in one reduce-scatter (a tensor-parallel group
    cut in two), the pieces of one expert axis that move between the same two dimensions in
    one all-to-all (an expert-parallel group over tensor- and data-parallel ranks); without
    it every axis moves on its own.
    Axes that ``dst`` adds (a split of a replicated dimension, or a partial mark) cost
    nothing: each rank keeps its slice.

    Flat splits (``Sharding.flat``): the partial axes that ``dst`` adds as a flat split become
    one reduce-scatter of the flattened, padded buffer over all of them (``dim`` None), before
    the rules above; a flat split that ``dst`` does not keep is all-gathered (``dim`` None)
    after the reductions and before any dimension changes, so that dimensions are only ever
    resharded on unflattened tensors. A flat split that ``dst`` adds costs nothing.
    """
    steps: list[ReshardStep] = []
    cur = src
    flat_reduce = (cur.partial - dst.partial) & (dst.flat - cur.flat)
    if flat_reduce and not cur.flat and cur.dims == dst.dims:
        cur = Sharding(cur.dims, cur.partial - flat_reduce, flat_reduce)
        steps.append(ReshardStep(CollectiveType.REDUCE_SCATTER, flat_reduce, None, None, cur))
    reduce_all: set[str] = set()
    scatters: dict[tuple[int, str], set[str]] = {}
    for axis in sorted(cur.partial - dst.partial):
        target = dst.dim_of(axis)
        if target is not None and cur.dim_of(axis) is None and not cur.flat:
            dense = pieces[axis][0] if pieces and axis in pieces else axis
            scatters.setdefault((target, dense), set()).add(axis)
        else:
            reduce_all.add(axis)
    for (target, _), scattered in scatters.items():
        cur = Sharding(
            tuple(a | scattered if i == target else a for i, a in enumerate(cur.dims)),
            cur.partial - scattered,
        )
        steps.append(
            ReshardStep(CollectiveType.REDUCE_SCATTER, frozenset(scattered), target, None, cur)
        )
    if reduce_all:
        cur = cur.with_partial(cur.partial - reduce_all)
        steps.append(ReshardStep(CollectiveType.ALL_REDUCE, frozenset(reduce_all), None, None, cur))
    if cur.flat and (not cur.flat <= dst.flat or cur.dims != dst.dims):
        gathered = cur.flat
        cur = Sharding(cur.dims, cur.partial)
        steps.append(ReshardStep(CollectiveType.ALL_GATHER, gathered, None, None, cur))
    for index in range(len(cur.dims)):
        extra = cur.dims[index] - dst.dims[index]
        gather: set[str] = set()
        moves: dict[tuple[int, str], set[str]] = {}
        for axis in sorted(extra):
            target = dst.dim_of(axis)
            if target is not None and axis not in cur.dims[target]:
                expert = pieces[axis][1] if pieces and axis in pieces else axis
                moves.setdefault((target, expert), set()).add(axis)
            else:
                gather.add(axis)
        for (target, _), moved in moves.items():
            cur = Sharding(
                tuple(
                    a - moved if i == index else (a | moved if i == target else a)
                    for i, a in enumerate(cur.dims)
                ),
                cur.partial,
            )
            steps.append(
                ReshardStep(CollectiveType.ALL_TO_ALL, frozenset(moved), index, target, cur)
            )
        if gather:
            cur = cur.with_dim(index, cur.dims[index] - gather)
            steps.append(
                ReshardStep(CollectiveType.ALL_GATHER, frozenset(gather), index, None, cur)
            )
    return steps
