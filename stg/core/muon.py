"""Muon (``--optimizer muon``): the weight matrices it orthogonalizes and the work it does.

Megatron-Core's Muon (``--optimizer muon`` / ``dist_muon``, ``emerging_optimizers``'
``OrthogonalizedOptimizer`` and ``newton_schulz``, read at NVIDIA/Megatron-LM d98e8a6
``megatron/core/optimizer/emerging_optimizers.py`` and NVIDIA-NeMo/Emerging-Optimizers fd77292
``orthogonalized_optimizers/muon_utils.py``):

- every 2-D weight is a matrix it orthogonalizes (the layers', and those of a head beside its
  output layer: DeepSeek's multi-token prediction modules); embeddings, output layers (a
  weight with a vocabulary dimension) and parameters that are not matrices (norms, biases)
  take the scalar optimizer, Adam (``_is_nonlinear_or_embedding``). A weight here is a
  matrix where an einsum reads it with dimensions it contracts (its inputs) and dimensions it
  writes (its outputs); dimensions
  that the einsum's other operand and its output share too (a mixture's experts) count
  separate matrices, as Transformer Engine's grouped linear keeps one weight per expert;
  projections that the stack fuses into one linear layer (SwiGLU's gate and up in one
  ``fc1``, latent attention's up-projections) are one matrix where the model declares them
  so (``GraphBuilder.weight``'s ``linear``);
- the momentum (one fp32 state, where Adam has two) is updated, normalised, cast to bf16
  (``muon_fp32_matmul_prec = "medium"``) and put through ``muon_num_ns_steps`` (5) Newton-Schulz
  iterations, transposed so that the matrix is ``m x n`` with ``m <= n``: ``A = X X^T``
  (``m x m x n``), ``B = bA + cA A`` (``m x m x m``), ``X = aX + B X`` (``m x n x m``), one
  GEMM each: ``4 m^2 n + 2 m^3`` FLOPs per iteration;
- a matrix split over tensor parallelism is orthogonalized whole (``muon_tp_mode =
  "duplicated"``, the default): its momentum is all-gathered over the group that splits it
  and every member runs the whole iteration;
- the layer-wise distributed optimizer (``dist_muon``, stg's ``--zero`` 1 or 2) gives each
  data-parallel rank whole matrices, bin-packed by their Newton-Schulz cost
  (``layer_wise_optimizer.py``: exact for uniform blocks whose matrices divide evenly), and
  all-gathers the updated parameters: stg gives each rank its even share of every shape's
  iterations (:data:`SHARE_ATTR`).

Each shape's iterations are written as three GEMM nodes that launch one kernel per matrix
and iteration (:data:`LAUNCHES_ATTR`) and one memory-bound node for the normalisation and the
casts (:data:`NORMALIZE_BYTES_PER_ELEMENT`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stg.core.lowering import Binder
    from stg.core.options import GenerateOptions
    from stg.core.symbolic import Op, Part, Tensor
    from stg.host.registry import Registry

VOCABULARY_DIM = "dvocal"
"""The dimension that marks a weight as an embedding or an output layer (Adam's under Muon)."""

OPTIMIZERS = ("adam", "muon")
"""The optimizers stg writes: Adam (fused, Megatron's and apex's; ``foreach`` AdamW under the
eager profiles) and Muon."""

LAUNCHES_ATTR = "launches"
"""Node attribute: the kernels a batched GEMM node runs one after another (one per matrix and
iteration), each priced alone and paying its launch."""

SHARE_ATTR = "share"
"""Node attribute: the fraction of a node's kernels that this rank runs (the layer-wise
distributed optimizer's even share of a stage's Newton-Schulz iterations over data
parallelism); its ``num_ops`` and ``tensor_size`` are that fraction already."""

NORMALIZE_BYTES_PER_ELEMENT = 24
"""Bytes the Newton-Schulz setup and teardown move per matrix element besides the GEMMs:
``F.normalize`` reads the fp32 momentum twice (norm, then division) and writes it (12), the
cast to bf16 reads it and writes 2 bytes (6), the result's cast back to fp32 reads 2 and
writes 4 (6) (``newton_schulz``, Emerging-Optimizers fd77292)."""

NORMALIZE_KERNELS = 4
"""Kernels of that setup and teardown per matrix: the norm, the division, the two casts."""

MUON_STATE_BYTES = 4
"""Bytes of Muon's state per parameter: one fp32 momentum buffer (Adam keeps two moments)."""


@dataclass(frozen=True)
class MuonMatrices:
    """``count`` weight matrices of ``m x n`` (``m <= n``) that one rank holds, shared for
    their Newton-Schulz iterations over ``degree`` data-parallel ranks (1: not shared; the
    layer-wise distributed optimizer), each split ``local`` elements a rank over the axes
    ``gather_axes`` (all-gathered before the iterations)."""

    m: int
    n: int
    count: int
    degree: int = 1
    gather_axes: tuple[str, ...] = ()
    local: int = 0

    @property
    def share(self) -> float:
        """This rank's fraction of the matrices' Newton-Schulz work."""
        return 1 / self.degree

    @property
    def gather_bytes(self) -> int:
        """fp32 momentum bytes this rank contributes to the all-gather over ``gather_axes``
        (its share of the matrices, rounded up to whole ones)."""
        if not self.gather_axes:
            return 0
        return -(-self.count // self.degree) * self.local * MUON_STATE_BYTES


def _reader(part: Part, weight: Tensor) -> tuple[Op, int] | None:
    """The first forward einsum of ``part`` that reads ``weight``, and its operand index."""
    for op in part.forward:
        if op.kind != "einsum" or not op.spec:
            continue
        for i, t in enumerate(op.inputs):
            if t is weight:
                return op, i
    return None


def matrix_dims(part: Part, weight: Tensor) -> tuple[list[int], list[int], list[int]] | None:
    """Indices of ``weight``'s dimensions that its einsum contracts, writes, and shares with
    its other operand and output (separate matrices), or None where no einsum reads it or it
    is not a matrix (no contracted or no written dimension)."""
    if any(d.name == VOCABULARY_DIM for d in weight.dims):
        return None  # an embedding or an output layer (an LM head, tied or not): Adam's
    found = _reader(part, weight)
    if found is None:
        return None
    op, index = found
    operands, output = op.spec.split("->")
    letters = operands.split(",")
    own = letters[index]
    others = "".join(x for j, x in enumerate(letters) if j != index)
    if len(own) != len(weight.dims):
        return None
    inputs, outputs, batch = [], [], []
    for i, letter in enumerate(own):
        if letter in output and letter in others:
            batch.append(i)
        elif letter in output:
            outputs.append(i)
        else:
            inputs.append(i)
    if not inputs or not outputs:
        return None
    return inputs, outputs, batch


def part_matrices(
    part: Part, binder: Binder, shard_degree: int, shard_axes: frozenset[str]
) -> tuple[MuonMatrices, ...]:
    """The Muon matrices of ``part``'s weights on one rank, by shape; ``shard_degree`` > 1:
    the layer-wise distributed optimizer shares them over the data-parallel axes
    ``shard_axes`` (a routed expert's over ``edp``). Weights of one fused linear layer
    (``Part.linears``) are one matrix, their rows stacked."""
    from stg.core.symbolic import is_routed_expert

    expert_dp = binder.mesh_axes("edp")
    layer_of = {id(w): name for name, ws in part.linears.items() for w in ws}
    shapes: dict[str, tuple[int, int, int, frozenset[str], int]] = {}
    order: list[str] = []
    for index, w in enumerate(part.weights):
        dims = matrix_dims(part, w)
        if dims is None:
            continue
        inputs, outputs, batch = dims
        rows = prod(binder.size(w.dims[i]) for i in outputs)
        cols = prod(binder.size(w.dims[i]) for i in inputs)
        count = prod(binder.local_dim(w.dims[i], w.sharding.dims[i]) for i in batch)
        split = frozenset().union(*(w.sharding.dims[i] for i in inputs + outputs))
        degree = 1
        if shard_degree > 1:
            over = expert_dp if is_routed_expert(w.dims, w.sharding) else shard_axes
            taken = frozenset().union(*w.sharding.dims)
            degree = prod(binder.degrees[a] for a in over - taken) if shard_axes else shard_degree
        key = layer_of.get(id(w), f"#{index}")
        if key in shapes:  # another block of a fused layer's matrix: its rows stacked
            r, c, n, axes, d = shapes[key]
            if (c, n, d) != (cols, count, degree):
                raise ValueError(f"linear {key!r}: its weights differ in inputs or count")
            shapes[key] = (r + rows, c, n, axes | split, d)
        else:
            shapes[key] = (rows, cols, count, split, degree)
            order.append(key)
    out = []
    for key in order:
        rows, cols, count, split, degree = shapes[key]
        gather = tuple(sorted(a for a in split if binder.degrees.get(a, 1) > 1))
        m, n = sorted((rows, cols))
        local = m * n // prod(binder.degrees[a] for a in gather)
        out.append(MuonMatrices(m, n, count, degree, gather, local))
    return merge(out)


def merge(matrices: Iterable[MuonMatrices]) -> tuple[MuonMatrices, ...]:
    """One entry per shape, sharing and gather group (several parts' matrices summed), in a
    fixed order."""
    counts: dict[tuple[int, int, int, tuple[str, ...], int], int] = {}
    for x in matrices:
        key = (x.m, x.n, x.degree, x.gather_axes, x.local)
        counts[key] = counts.get(key, 0) + x.count
    return tuple(
        MuonMatrices(m, n, c, d, g, loc) for (m, n, d, g, loc), c in sorted(counts.items())
    )


def node_count(matrices: Iterable[MuonMatrices]) -> int:
    """Nodes that :func:`stg.core.lowering._newton_schulz` writes for a stage's ``matrices``:
    four per shape group (:func:`merge`), one all-gather per group of splitting axes."""
    merged = merge(matrices)
    return 4 * len(merged) + len({x.gather_axes for x in merged if x.gather_axes})


def held_and_shared(matrices: Iterable[MuonMatrices]) -> tuple[int, float]:
    """Matrix elements of ``matrices`` that one rank holds, and its share of them under the
    layer-wise distributed optimizer (the elements whose state it keeps)."""
    items = list(matrices)
    return sum(x.count * x.local for x in items), sum(x.count * x.local * x.share for x in items)


def part_parameters(options: GenerateOptions, registry: Registry) -> dict[str, tuple[int, float]]:
    """Per part of ``options``' model (``embedding``, ``head`` and each block kind), the Muon
    matrix elements one rank holds and its share of them (:func:`held_and_shared`): what the
    memory predictor needs from options alone, from the bound parts, not the workload."""
    from stg.core.pipeline import build_parts, validate_options

    plan = validate_options(options, registry)
    parts = build_parts(registry.models.get(options.model), plan)
    out = {"embedding": held_and_shared(parts.embedding.muon)}
    out["head"] = held_and_shared(parts.head.muon)
    for kind, bp in parts.blocks.items():
        out[kind] = held_and_shared(bp.muon)
    return out
