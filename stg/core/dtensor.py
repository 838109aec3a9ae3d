"""The copies around PyTorch-native sequence parallelism's collectives (DTensor), which
Megatron-LM's layout does not need.

torchtitan's tensor parallelism (``apply_tp``, pytorch/torchtitan 820504e
``torchtitan/models/llama3/parallelize_llama.py``) shards the activations between the
tensor-parallel regions along the sequence, ``Shard(1)`` of its batch-first ``[batch, seq,
hidden]`` tensors (``SequenceParallel`` on the norms, ``PrepareModuleInput(input_layouts=
Shard(1), desired_input_layouts=Replicate())`` before the column-parallel projections,
``RowwiseParallel(output_layouts=Shard(1))`` after the row-parallel ones). DTensor runs the
redistributions through PyTorch's functional collectives (``Shard._to_replicate_tensor``:
``funcol.all_gather_tensor(..., gather_dim=self.dim)``; the reduction to ``Shard(1)``:
``funcol.reduce_scatter_tensor(..., scatter_dim=self.dim)``), and NCCL gathers and scatters
along dimension 0 only. So ``all_gather_tensor`` with ``gather_dim != 0`` gathers the shards
stacked along dimension 0 and then rearranges them, ``torch.cat(torch.chunk(res, group_size,
dim=0), dim=gather_dim)``, and ``reduce_scatter_tensor`` with ``scatter_dim != 0`` first
rearranges its input, ``torch.cat(torch.chunk(self, group_size, dim=scatter_dim))``
(``torch/distributed/_functional_collectives.py``, pytorch/pytorch fff02e67; the same code in
the 2025 releases that torchtitan's benchmarks ran, and later versions replace the copy by a
view only where every dimension before ``gather_dim`` has size 1). With more than one sequence
per rank the rearrangement is a copy of the whole gathered (or to-be-scattered) tensor:
each of these collectives comes with a memory-bound kernel that reads and writes it, on the
compute stream, between the collective and the GEMM that reads its result (or the producer
and the reduce-scatter). Megatron-LM keeps ``[seq, batch, hidden]`` and gathers and scatters
along dimension 0: no copy (``megatron/core/tensor_parallel/mappings.py``,
``_gather_along_first_dim``).
"""

from __future__ import annotations

from dataclasses import replace
from math import prod

from stg.core.lowering import Binder, BoundOp, BoundPart, sequence_parallel_collective
from stg.core.quantization import DTYPE_BITS
from stg.core.workload import CollectiveType, NodeType

DTENSOR_PROFILES = frozenset({"eager", "compiled", "torchtitan"})
"""Execution profiles of PyTorch-native training, whose tensor parallelism is DTensor's on
batch-first activations (torchtitan's ``apply_tp``; the ``megatron`` profile is Megatron-LM's
sequence-first layout)."""

GATHER_COPY = "sp_gather_copy"
"""The rearrangement after a sequence-parallel all-gather (``torch.cat`` of the gathered
shards along the sequence)."""

SCATTER_COPY = "sp_scatter_copy"
"""The rearrangement before a sequence-parallel reduce-scatter (``torch.cat`` of the input's
sequence chunks along dimension 0)."""

COPY_KEY_BASE = -(1 << 70)
"""The copy of tensor key ``k`` writes key ``COPY_KEY_BASE - k``: tensor keys are addresses
(below 2**48), their derived keys within 16 of one or of its negation, or context
parallelism's ring keys a few 2**64 above one, so these are no other key."""


def with_sequence_parallel_copies(bp: BoundPart, binder: Binder) -> BoundPart:
    """``bp`` with DTensor's rearranging copy beside each of its sequence-parallel collectives
    (see the module docstring), forward and backward: after an all-gather, a copy of the
    gathered tensor (its shard times the group), which every op reading the gathered tensor
    waits for; before a reduce-scatter, a copy of its whole input, which the reduce-scatter
    waits for. Each reads and writes its tensor once (one op per element written) and carries
    its collective's tags, so a recomputed gather is recomputed with its copy. For a local
    micro-batch of more than one sequence: with one, ``[1, s, h]`` split along ``s`` is
    contiguous per rank and PyTorch needs no copy."""
    gathered: dict[int, int] = {}
    for op in bp.forward:
        if sequence_parallel_collective(op) and op.comm_type is CollectiveType.ALL_GATHER:
            for k in op.outputs:
                gathered[k] = COPY_KEY_BASE - op.outputs[0]

    def with_copies(ops: list[BoundOp]) -> list[BoundOp]:
        out: list[BoundOp] = []
        local: dict[int, int] = {}
        for op in ops:
            waits = tuple(
                dict.fromkeys(
                    w
                    for k in op.inputs
                    for w in (local.get(k), gathered.get(k))
                    if w is not None and w not in op.inputs
                )
            )
            if not sequence_parallel_collective(op):
                out.append(replace(op, inputs=(*op.inputs, *waits)) if waits else op)
                continue
            bits = DTYPE_BITS[op.dtype or "bf16"]  # nvfp4 gathers 4-bit elements
            group = prod(binder.degrees.get(a, 1) for a in op.group_axes)
            if op.comm_type is CollectiveType.REDUCE_SCATTER:
                done = COPY_KEY_BASE - op.inputs[0]
                out.append(_copy(SCATTER_COPY, op, op.inputs, done, op.comm_size, bits))
                out.append(replace(op, inputs=(*op.inputs, done)))
                continue
            out.append(op)
            done = COPY_KEY_BASE - op.outputs[0]
            for k in op.outputs:
                local[k] = done
            out.append(_copy(GATHER_COPY, op, op.outputs, done, op.comm_size * group, bits))
        return out

    return replace(bp, forward=with_copies(bp.forward), backward=with_copies(bp.backward))


def _copy(
    name: str, op: BoundOp, reads: tuple[int, ...], done: int, nbytes: int, bits: int
) -> BoundOp:
    """The copy kernel of ``nbytes`` bytes of ``bits``-bit elements beside collective ``op``."""
    return BoundOp(
        name,
        NodeType.COMP,
        reads,
        (done,),
        num_ops=nbytes * 8 // bits,
        tensor_size=2 * nbytes,
        tags=op.tags,
        dtype=op.dtype,
    )


REDUCED_KEY_BASE = -(1 << 71)
"""The tensor-parallel reduction of gradient key ``k`` writes key ``REDUCED_KEY_BASE - k`` (see
:data:`COPY_KEY_BASE`)."""


def with_replicated_grads_reduced_first(bp: BoundPart, binder: Binder) -> BoundPart:
    """``bp`` with the tensor-parallel all-reduce of the gradients of weights replicated over
    tensor parallelism (sequence parallelism's norm weights) moved before FSDP2's reduce-scatter
    of them, on the whole gradients: the gradient of such a DTensor weight is ``Partial`` over
    the tensor-parallel group, and FSDP2 redistributes it to the weight's ``Replicate``
    placement before it copies the gradients into its reduce-scatter
    (``FSDPParam._get_grad_inner_tensor``: ``grad.redistribute(placements=...)``, read by
    ``foreach_reduce``; torch/distributed/fsdp/_fully_shard/_fsdp_param.py, PyTorch 2.4-2.13).
    The copy-in and the reduce-scatter wait for it; it goes with them (its tags), and it no
    longer waits for the reduce-scatter nor holds the tensor-parallel communicator meanwhile."""
    sharded_from: dict[int, int] = {}
    for op in bp.backward:
        if (
            op.type is NodeType.COMM_COLL
            and "weight_grad_reduce" in op.tags
            and op.comm_type is CollectiveType.REDUCE_SCATTER
        ):
            sharded_from.update(zip(op.outputs, op.inputs, strict=False))
    moved: list[BoundOp] = []
    kept: list[BoundOp] = []
    for op in bp.reduce:
        replicated = (
            op.type is NodeType.COMM_COLL
            and op.tensor_parallel
            and op.comm_type is CollectiveType.ALL_REDUCE
            and bool(op.inputs)
            and all(k in sharded_from for k in op.inputs)
        )
        (moved if replicated else kept).append(op)
    if not moved:
        return bp
    reduced: dict[int, int] = {}
    before: list[BoundOp] = []
    for op in moved:
        grads = tuple(sharded_from[k] for k in op.inputs)
        outputs = tuple(REDUCED_KEY_BASE - k for k in grads)
        reduced.update(zip(grads, outputs, strict=True))
        degree = max(
            (
                prod(binder.degrees.get(a, 1) for a in o.group_axes)
                for o in bp.backward
                if o.type is NodeType.COMM_COLL
                and "weight_grad_reduce" in o.tags
                and set(grads) & set(o.inputs)
            ),
            default=1,
        )
        before.append(
            replace(
                op,
                inputs=grads,
                outputs=outputs,
                comm_size=op.comm_size * degree,
                tags=op.tags | {"weight_grad_reduce"},
            )
        )
    backward: list[BoundOp] = []
    for op in bp.backward:
        if "weight_grad_reduce" in op.tags and before:
            backward.extend(before)
            before = []
        waits = tuple(reduced[k] for k in op.inputs if k in reduced)
        if waits and "weight_grad_reduce" in op.tags:
            op = replace(op, inputs=(*op.inputs, *waits))
        backward.append(op)
    backward.extend(before)
    return replace(bp, backward=backward, reduce=kept)
