"""PyTorch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``)
as torchtitan runs it, written on the nodes of a causal attention pass.

Read at pytorch/pytorch 1963fc8 (2024-12-23; the torch of torchtitan's 2024-12 benchmark,
``benchmarks/llama3_h100_202412_torchtitan.md`` at torchtitan 820504e), file
``torch/distributed/tensor/experimental/_attention.py``, with torchtitan 9dec370:

- torchtitan's Llama hands SDPA its keys and values after ``repeat_kv``, one per query head
  (``torchtitan/models/llama/model.py``, ``Attention.forward``), so every K/V tensor below
  has the queries' heads;
- ``_ContextParallelOptions``: ``convert_to_f32 = True``, ``enable_load_balance = True``,
  ``rotate_method = ALL_GATHER`` (torchtitan's ``--experimental.context_parallel_rotate_method``
  defaults to ``allgather``, ``config_manager.py``); a rank holds the sequence chunks ``r``
  and ``2·cp-1-r`` of ``2·cp`` (``_RoundRobinLoadBalancer``);
- forward (``_templated_ring_attention``): ``cp`` SDPA calls. Before the first, K and V go
  into one buffer (``torch.cat``) whose all-gather is issued (``_AllGatherRotater``,
  asynchronous); call 0 attends causally to the rank's own keys, and call 1 is the first to
  wait for the gather. Call ``i >= 1`` is non-causal over half of the rank's scores (its
  queries against the first chunk of the peer's keys, or its second chunk of queries against
  both), then ``_SDPAMerger.step`` casts its output to fp32 and merges it and its log-sum-exp
  into the running ones (``out - sigmoid(lse_i - lse)·(out - out_i)``,
  ``lse - logsigmoid(lse - lse_i)``); the first output is cast to fp32, the merged one back
  to the output dtype at the end;
- backward (``_templated_ring_attention_backward``): K and V all-gathered again (the
  ``kv_rotater``), ``cp`` SDPA backward calls in the same order and shapes; the K/V gradients
  accumulate in fp32 (``accum_dtype``) and travel a ring (``dkv_rotater``, ``ALL_TO_ALL``:
  ``ft_c.permute_tensor``, an all-to-all whose whole buffer goes to the next rank): after
  call ``i`` the rank adds its share to the buffer it received after call ``i - 1`` and
  sends the sum on; the buffer sent after the last call is waited for after the loop and cast
  back to the K/V dtype, as the fp32 query gradient is.

The SDPA calls are extern kernels, so what runs between two of them is at least one kernel
however ``torch.compile`` fuses the pointwise ops: stg writes each merge and each
accumulation as one memory-bound kernel that reads its inputs and writes its outputs once
(attributes :data:`~stg.core.torchtitan.EAGER_KERNELS_ATTR` and
:data:`~stg.core.torchtitan.EAGER_KERNEL_BYTES_ATTR`, priced by
:func:`stg.perf.costs.eager_kernels_time`). Every call ``i >= 1`` is written in the shape of
the calls with ``i <= rank`` (all the queries, half the keys); the others do the same work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from stg.core.precision import DTYPE_BYTES
from stg.core.torchtitan import Kernel, with_kernels
from stg.core.workload import CollectiveType, NodeType

if TYPE_CHECKING:
    from stg.core.lowering import BoundOp

TORCH_ALL_GATHER = "torch_all_gather"
"""The internal ``cp_comm_type`` of :func:`stg.core.lowering.context_parallel_attention` for
PyTorch's context parallelism with its all-gather rotation (torchtitan's default)."""

TORCH_CP_PROFILES = frozenset({"compiled", "torchtitan"})
"""The profiles that are torchtitan (``GenerateOptions.profile``), whose context parallelism
is torch's."""


def lowered_cp_comm_type(profile: str, cp_comm_type: str) -> str:
    """How lowering writes context parallelism for ``cp_comm_type`` under ``profile``: torch's
    all-gather rotation (:data:`TORCH_ALL_GATHER`) for torchtitan's profiles and
    ``all_gather``; otherwise ``cp_comm_type`` itself (Megatron's variants, and ``p2p``, whose
    TE ring stg keeps for every profile)."""
    if profile in TORCH_CP_PROFILES and cp_comm_type == "all_gather":
        return TORCH_ALL_GATHER
    return cp_comm_type


ACCUMULATE_BYTES = DTYPE_BYTES["fp32"]
"""``convert_to_f32``: outputs, log-sum-exps and K/V/Q gradients accumulate in fp32."""


StepsFn = Callable[["BoundOp", int, bool], list["BoundOp"]]
KeyFn = Callable[[int], int]


def splits_like_torch(op: BoundOp, cp: int) -> bool:
    """Whether torch runs the attention ``op`` as its load-balanced ring: causal over the
    rank's two chunks (``causal_split`` ``cp``, an even number of queries) and no other mask
    (torch's CP raises for a non-causal pass under load balancing)."""
    attrs = dict(op.attrs)
    if any(attrs.get(mask) for mask in ("attention_window", "attention_chunk", "attention_topk")):
        return False
    causal, s_q = attrs["attention"][5], attrs["attention"][2]
    return bool(causal) and attrs.get("causal_split", 1) == cp and s_q % 2 == 0


def _elements(op: BoundOp) -> tuple[int, int]:
    """(elements of the rank's queries, output or one K/V tensor at the queries' heads;
    elements of its log-sum-exp)."""
    batch, heads, s_q, _s_kv, head_dim = dict(op.attrs)["attention"][:5]
    return batch * heads * s_q * head_dim, batch * heads * s_q


def _memory_node(
    like: BoundOp, name: str, inputs: tuple[int, ...], output: int, kernels: list[Kernel]
) -> BoundOp:
    """A compute node of memory-bound kernels run in turn; one op per element written (a
    node that moves bytes needs ops, ASTRA-sim's roofline rule)."""
    node = replace(
        like,
        name=name,
        type=NodeType.COMP,
        inputs=inputs,
        outputs=(output,),
        num_ops=sum(k.written for k in kernels),
        comm_type=None,
        comm_size=0,
        group_axes=(),
        dtype="fp32",
        attrs=(),
    )
    return with_kernels(node, kernels)


def _kernel(aten: str, kind: str, nbytes: int, written: int) -> Kernel:
    """A memory-bound kernel of the fp32 accumulation (``kind`` its memory class)."""
    return Kernel(aten, nbytes, "fp32", kind, written)


def kv_gather_bytes(op: BoundOp, width: float) -> int:
    """Bytes this rank puts into the all-gather of its K and V buffer (``torch.cat`` of both
    at the queries' heads, ``width`` bytes per element)."""
    elements, _ = _elements(op)
    return int(2 * elements * width)


def merge_kernels(op: BoundOp, cp: int, width: float) -> list[list[Kernel]]:
    """The forward's memory-bound kernels after SDPA calls ``1 .. cp-1``: each merge reads the
    running fp32 output and log-sum-exp and the call's output (``width`` bytes per element)
    and log-sum-exp, and writes the new running pair; the first also casts call 0's output
    to fp32, the last the merged output back to ``width``."""
    out, lse = _elements(op)
    f32 = ACCUMULATE_BYTES
    merge = _kernel("merge", "stream", int(out * (2 * f32 + width) + lse * 3 * f32), out + lse)
    to_fp32 = _kernel("_to_copy", "convert", int(out * (width + f32)), out)
    to_out = _kernel("_to_copy", "convert", int(out * (f32 + width)), out)
    kernels = [[merge] for _ in range(cp - 1)]
    kernels[0].insert(0, to_fp32)
    kernels[-1].append(to_out)
    return kernels


def accumulate_kernels(op: BoundOp, cp: int, width: float) -> list[list[Kernel]]:
    """The backward's memory-bound kernels after SDPA backward calls ``0 .. cp-1``: call 0's
    dQ, dK, dV added to fp32 zeros; each later call's dK and dV (half the keys: ``width``
    bytes per element) added into the fp32 K/V gradient received from the ring, which is
    written as the buffer sent on, and its dQ into the fp32 dQ; the last also casts dQ back
    to ``width`` (the K/V gradient is cast after the ring's last transfer,
    :func:`final_kv_grad_kernels`)."""
    elements, _ = _elements(op)
    f32 = ACCUMULATE_BYTES
    first = _kernel("add", "stream", int(3 * elements * (width + f32)), 3 * elements)
    kv = 2 * (2 * f32 * elements + width * elements // 2)
    later = _kernel("add", "stream", int(kv + elements * (2 * f32 + width)), 3 * elements)
    kernels = [[first], *([later] for _ in range(cp - 1))]
    kernels[-1].append(_kernel("_to_copy", "convert", int(elements * (f32 + width)), elements))
    return kernels


def final_kv_grad_kernels(op: BoundOp, width: float) -> list[Kernel]:
    """The cast of the K/V gradient buffer the ring's last transfer brings (fp32) to
    ``width``."""
    elements, _ = _elements(op)
    nbytes = int(2 * elements * (ACCUMULATE_BYTES + width))
    return [_kernel("_to_copy", "convert", nbytes, 2 * elements)]


def dkv_transfer_size(op: BoundOp, cp: int) -> int:
    """``comm_size`` of one ring transfer of the fp32 K/V gradients: torch's all-to-all sends
    its whole buffer to one peer, where an all-to-all's ``comm_size`` (TRACES.md) is split
    evenly over the ``cp`` ranks, ``(cp-1)/cp`` of it leaving the rank; so the buffer
    times ``cp/(cp-1)``, rounded up."""
    elements, _ = _elements(op)
    buffer = 2 * elements * ACCUMULATE_BYTES
    return -(-buffer * cp // (cp - 1))


def torch_forward(
    op: BoundOp, gathers: list[BoundOp], cp: int, steps: StepsFn, key: KeyFn
) -> list[BoundOp]:
    """The forward attention ``op`` as torch's context parallelism runs it, from the
    all-gathers of K and V it read (``gathers``): the one all-gather of the K/V buffer, SDPA
    call 0 on the rank's own keys beside it, calls ``1 .. cp-1`` on the gathered buffer,
    each followed by its merge."""
    queries, own, width, buffer, gather = _gathered_buffer(op, gathers, key)
    out: list[BoundOp] = [gather]
    merges = merge_kernels(op, cp, width)
    running = key(2)  # call 0's output, then each merge's
    for i, step in enumerate(steps(op, cp, True)):
        keys = own if i == 0 else (buffer,)
        result = running if i == 0 else key(2 * i + 1)
        out.append(
            replace(step, name=f"{op.name}.step{i}", inputs=(*queries, *keys), outputs=(result,))
        )
        if i == 0:
            continue
        merged = key(2 * i + 2)
        merge = _memory_node(step, f"{op.name}.merge{i}", (running, result), merged, merges[i - 1])
        out.append(merge if i < cp - 1 else replace(merge, outputs=op.outputs))
        running = merged
    return out


def _gathered_buffer(
    op: BoundOp, gathers: list[BoundOp], key: KeyFn
) -> tuple[tuple[int, ...], tuple[int, ...], int, int, BoundOp]:
    """What the attention ``op`` reads besides K and V (the queries), the rank's own K and V
    (the inputs of ``gathers``), their width in bytes, the K/V buffer's key and the one
    all-gather that fills it."""
    gathered = {g.outputs[0]: g.inputs[0] for g in gathers}
    queries = tuple(k for k in op.inputs if k not in gathered)
    own = tuple(gathered.values())
    width = DTYPE_BYTES[gathers[0].dtype or "bf16"]
    buffer = key(1)
    gather = replace(
        gathers[0],
        name=f"{op.name}.all_gather_kv",
        inputs=own,
        outputs=(buffer,),
        comm_size=kv_gather_bytes(op, width),
    )
    return queries, own, width, buffer, gather


def torch_backward(
    op: BoundOp,
    gathers: list[BoundOp],
    reductions: list[BoundOp],
    cp: int,
    steps: StepsFn,
    key: KeyFn,
) -> list[BoundOp]:
    """The attention backward ``op`` as torch's context parallelism runs it, from the
    all-gathers of K and V it read (``gathers``) and the reduce-scatters of their gradients
    that it replaces (``reductions``): the K/V buffer gathered again, SDPA backward calls
    ``0 .. cp-1`` (call 0 on the rank's own keys beside the gather), after each the
    accumulation and the fp32 K/V gradient's transfer to the next rank, which the next
    accumulation waits for; the last transfer's buffer, cast, is the rank's K/V gradient."""
    grads = {r.inputs[0] for r in reductions}
    queries, own, width, buffer, gather = _gathered_buffer(op, gathers, key)
    kept = tuple(k for k in op.outputs if k not in grads)  # the queries' gradients
    out: list[BoundOp] = [gather]
    accumulations = accumulate_kernels(op, cp, width)
    transfer = replace(
        reductions[0],
        comm_type=CollectiveType.ALL_TO_ALL,
        comm_size=dkv_transfer_size(op, cp),
        dtype="fp32",
    )
    received = accumulated = key(2)  # after call i: its accumulation, then the ring's transfer
    for i, step in enumerate(steps(op, cp, True)):
        keys = own if i == 0 else (buffer,)
        result = key(4 * i + 3)
        out.append(
            replace(step, name=f"{op.name}.step{i}", inputs=(*queries, *keys), outputs=(result,))
        )
        sources = (result,) if i == 0 else (result, accumulated, received)
        accumulated = key(4 * i + 4)
        accumulate = _memory_node(
            step, f"{op.name}.accumulate{i}", sources, accumulated, accumulations[i]
        )
        if i == cp - 1:  # the last accumulation also casts the queries' gradient
            accumulate = replace(accumulate, outputs=(accumulated, *kept))
        out.append(accumulate)
        received = key(4 * i + 5)
        out.append(
            replace(
                transfer,
                name=f"{op.name}.send_dkv{i + 1}",
                inputs=(accumulated,),
                outputs=(received,),
            )
        )
    cast = _memory_node(
        out[-2],
        f"{op.name}.dkv",
        (received,),
        reductions[0].outputs[0],
        final_kv_grad_kernels(op, width),
    )
    out.append(replace(cast, outputs=tuple(r.outputs[0] for r in reductions)))
    return out


__all__ = [
    "TORCH_ALL_GATHER",
    "TORCH_CP_PROFILES",
    "Kernel",
    "accumulate_kernels",
    "dkv_transfer_size",
    "final_kv_grad_kernels",
    "kv_gather_bytes",
    "lowered_cp_comm_type",
    "merge_kernels",
    "splits_like_torch",
    "torch_backward",
    "torch_forward",
]
