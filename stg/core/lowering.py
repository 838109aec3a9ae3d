"""Lowering: bind a built model to integers once, then lay out each pipeline stage's nodes.

:func:`bind_part` turns the symbolic ops of a part into :class:`BoundOp` records with integer
FLOPs and bytes for one rank (sympy is evaluated here, once per run, never per rank or per
micro-batch). :func:`lower_stage` instantiates the bound parts for every step of the stage's
pipeline schedule and returns a :class:`~stg.core.workload.RankClass`: node ids in execution
order, data deps for data flow, ctrl deps for the schedule and collective issue order.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from fractions import Fraction
from math import prod
from typing import TYPE_CHECKING, Any, NamedTuple, overload

from stg.core.extensions import load_extension
from stg.core.fp8 import (
    ALL_REDUCE,
    AMAX_AXES,
    AMAX_BYTES,
    AUTOCAST_BYTES,
    AUTOCAST_DTYPE,
    CONCAT,
    QUANTIZE_ATTR,
    UPDATE,
    Fp8Module,
    QuantizeSite,
    amax_buffer_elements,
    concat_bytes,
    native_fp8_gemms,
    quantize_elements,
    quantize_sites,
    te_modules,
    update_bytes,
    update_ops,
)
from stg.core.layout import UNFOLDED_AXIS_PARTS
from stg.core.muon import (
    LAUNCHES_ATTR,
    NORMALIZE_BYTES_PER_ELEMENT,
    NORMALIZE_KERNELS,
    SHARE_ATTR,
    MuonMatrices,
    held_and_shared,
    merge,
    part_matrices,
)
from stg.core.offload import offload_finished_before, reload_started_before
from stg.core.options import OptionError
from stg.core.plan import ParallelPlan, recompute_tags
from stg.core.precision import DTYPE_BYTES
from stg.core.quantization import DTYPE_BITS
from stg.core.recipes import (
    DEFAULT_RECIPE,
    FP8_ATTENTION_SCALING,
    HADAMARD_FLOPS_ATTR,
    QUANTIZE_COLS_ATTR,
    QUANTIZE_KERNEL_ATTR,
    QUANTIZE_OPERAND_ATTR,
    RECIPE_ATTR,
    RECIPES,
    Recipe,
    gathered_weight_bytes,
    quantize_kernels,
    weight_copy_bytes,
)
from stg.core.routing import (
    DISPATCHER_ATTR,
    EP_EXPERTS_ATTR,
    EP_GATE_ATTR,
    EP_HIDDEN_ATTR,
    EP_KEXPERTS_ATTR,
    EP_ROUTE_ATTR,
    EP_SMS_ATTR,
    NCCL_DISPATCHER,
    RANDOM_GATE,
)
from stg.core.schedules import ep_overlap_groups
from stg.core.sharding import OWN_BUCKET, TP_REPLICATED_GRAD
from stg.core.torch_context_parallel import (
    TORCH_ALL_GATHER,
    splits_like_torch,
    torch_backward,
    torch_forward,
)
from stg.core.workload import (
    CHUNK_ATTR,
    LAYER_ATTR,
    MICRO_BATCH_ATTR,
    OP_ATTR,
    PHASE_ATTR,
    ROLE_ATTR,
    STEP_ATTR,
    CollectiveType,
    NodeTemplate,
    NodeType,
    Phase,
    RankClass,
    Role,
    part_attrs,
)

if TYPE_CHECKING:
    import sympy

    from stg.core.symbolic import Dim, Op, Part, Tensor

DIM_OPTION = {
    "batch": "micro_batch",
    "qgroup": "head/kvhead",
    "dhead": "dmodel/head",
    "qlora": "q_lora_rank",
    "kvlora": "kv_lora_rank",
    "kvcache": "kv_lora_rank+drope",
    "dff_dense": "dense_dff",
    "shared": "shared_experts",
}
OPTIMIZER_FLOPS_PER_PARAM = 12  # Adam: two moment updates, bias correction, update


def key(t: Tensor) -> int:
    """Identity of a tensor's storage (free slices and views share their source's)."""
    t = t.storage or t
    return id(t.base or t)


class Binder:
    """Evaluates symbolic sizes for one run: global dims to ints, local (per rank) sizes."""

    def __init__(
        self,
        values: Mapping[sympy.Symbol, int],
        degrees: Mapping[str, int],
        axis_parts: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        self.values = dict(values)
        self.degrees = dict(degrees)
        parts = axis_parts or UNFOLDED_AXIS_PARTS
        self.axis_parts = {k: frozenset(v) for k, v in parts.items()}
        self._dims: dict[sympy.Expr, int] = {}
        self._fractions: dict[sympy.Expr | int, Fraction] = {}
        self._local: dict[tuple[sympy.Expr | int, frozenset[str]], int] = {}

    def mesh_axes(self, name: str) -> frozenset[str]:
        """The active mesh axes of a named axis (``tp``; on a folded mesh its pieces)."""
        parts = self.axis_parts.get(name, frozenset({name}))
        return frozenset(a for a in parts if self.degrees.get(a, 1) > 1)

    def size(self, d: Dim) -> int:
        cached = self._dims.get(d.size)
        if cached is None:
            import sympy  # binding runs the symbolic core; lowering bound parts does not

            value = sympy.sympify(sympy.sympify(d.size).xreplace(self.values))
            if not value.is_Integer:
                raise OptionError(
                    f"{DIM_OPTION.get(d.name, d.name)}={value} must be a whole number"
                )
            cached = self._dims[d.size] = int(value)
        return cached

    def local_dim(self, d: Dim, axes: Iterable[str]) -> int:
        # a tensor's axes are a frozenset: its sizes, a few distinct ones, are kept
        key = (d.size, axes) if type(axes) is frozenset else None
        cached = None if key is None else self._local.get(key)
        if cached is not None:
            return cached
        axes = sorted(axes)
        split = prod(self.degrees[a] for a in axes)
        size = self.size(d)
        if size % split:
            who = "·".join(axes)
            raise OptionError(f"{who}={split} must divide {DIM_OPTION.get(d.name, d.name)}={size}")
        if key is not None:
            self._local[key] = size // split
        return size // split

    def fraction(self, expr: sympy.Expr | int) -> Fraction:
        """A scale (an einsum's computed fraction) as an exact number for this run."""
        cached = self._fractions.get(expr)
        if cached is None:  # a few distinct scales, each asked for by many ops
            import sympy

            value = sympy.sympify(expr).xreplace(self.values)
            cached = self._fractions[expr] = Fraction(str(sympy.nsimplify(value)))
        return cached

    def flat_degree(self, t: Tensor) -> int:
        """How many pieces a flat split (``Sharding.flat``) cuts ``t`` into (1: none)."""
        return prod(self.degrees[a] for a in t.sharding.flat)

    def unflat_numel(self, t: Tensor) -> int:
        """Elements of ``t`` on one rank before its flat split (if any)."""
        return prod(self.local_dim(d, a) for d, a in zip(t.dims, t.sharding.dims, strict=True))

    def numel(self, t: Tensor) -> int:
        """Elements of ``t`` on one rank; a flat split keeps ``ceil(n / degree)`` of the ``n``
        elements (the flat buffer is padded to a multiple of the degree)."""
        return -(-self.unflat_numel(t) // self.flat_degree(t))

    def nbytes(self, t: Tensor) -> int:
        """Bytes of ``t`` on one rank: its elements, and the scales of a quantized tensor."""
        elements = self.numel(t)
        data = -(-elements * DTYPE_BITS[t.dtype] // 8)
        if t.scaling is None:
            return data
        row = prod(self.local_dim(t.dims[i], t.sharding.dims[i]) for i in t.scaled_dims)
        return data + t.scaling.nbytes(elements, row)


@dataclass(frozen=True, slots=True)
class BoundOp:
    """An op of one rank with integer costs; ``inputs``/``output`` are tensor keys."""

    name: str
    type: NodeType
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    num_ops: int = 0
    tensor_size: int = 0
    comm_type: CollectiveType | None = None
    comm_size: int = 0
    group_axes: tuple[str, ...] = ()
    tags: frozenset[str] = frozenset()
    dtype: str | None = None
    flat: int = 1
    """a collective of a flat (padded) buffer: the flat degree (see :func:`flat_comm_size`)"""
    flat_elements: int = 0
    """... and the unpadded elements of this rank's tensor(s) before the flat split"""
    tensor_parallel: bool = False
    """a collective over the tensor-parallel group alone"""
    attrs: tuple[tuple[str, Any], ...] = ()
    """further node attributes: the kernel shape (``gemm``, ``attention``) for predictors"""


def flat_comm_size(kind: CollectiveType | None, elements: int, degree: int, dtype: str) -> int:
    """``comm_size`` (TRACES.md) of a collective of a flat buffer of ``elements`` elements
    padded to a multiple of ``degree``: an all-gather sends this rank's shard
    ``ceil(elements / degree)``, a reduce-scatter reduces the whole padded buffer
    ``degree · ceil(elements / degree)``, an all-reduce reduces a shard."""
    shard = -(-elements // degree)
    size = degree * shard if kind is CollectiveType.REDUCE_SCATTER else shard
    return int(size * DTYPE_BYTES[dtype])


def _flops(op: Op, binder: Binder) -> int:
    if op.kind == "einsum":
        lhs, _ = op.spec.split("->")
        sizes: dict[str, int] = {}
        for letters, t in zip(lhs.split(","), op.inputs, strict=True):
            for letter, d, axes in zip(letters, t.dims, t.sharding.dims, strict=True):
                sizes.setdefault(letter, binder.local_dim(d, axes))
        return int(2 * prod(sizes.values()) * binder.fraction(op.scale))
    if op.kind == "kv_append":  # one op per element written into the cache
        return binder.numel(op.inputs[0])
    # a cost per element may depend on the sizes (a scan's work per element of its input)
    if op.kind in {"elementwise", "custom"}:
        return int(binder.fraction(op.flops_per_element) * binder.numel(op.inputs[0]))
    if op.kind == "add":
        return int(binder.fraction(op.flops_per_element) * binder.numel(op.output))
    # gather (an embedding lookup), concat: data movement, one op per element moved (written)
    return binder.numel(op.output)


def bind_ops(ops: Iterable[Op | BoundOp], binder: Binder) -> list[BoundOp]:
    """Integer costs for every op of one phase of a part."""
    bound = []
    for op in ops:
        if isinstance(op, BoundOp):  # already bound (a fused attention kernel)
            bound.append(op)
            continue
        if op.kind == "view":
            continue
        inputs = tuple(key(t) for t in op.inputs)
        if op.kind == "collective":
            assert op.collective is not None
            bound.append(
                BoundOp(
                    op.name,
                    NodeType.COMM_COLL,
                    inputs,
                    (key(op.output),),
                    comm_type=op.collective,
                    comm_size=binder.nbytes(op.inputs[0]),
                    group_axes=tuple(sorted(op.axes)),
                    tags=op.tags,
                    dtype=op.inputs[0].dtype,
                    tensor_parallel=bool(op.axes) and op.axes == binder.mesh_axes("tp"),
                )
            )
        else:
            moved = sum(_moved(t, binder) for t in op.inputs if t.kind != "index")
            moved += _moved(op.output, binder)
            if op.mask is not None:  # a dropout also writes its 1-byte mask
                moved += binder.nbytes(op.mask)
            moved += sum(binder.numel(t) * 4 for t in op.inputs if t.kind == "index")
            if op.kind == "kv_append":  # the new keys/values read, then written into the cache
                moved = kv_append_bytes(op, binder)
            num_ops = _flops(op, binder)
            attrs: tuple[tuple[str, Any], ...] = ()
            if op.kind == "elementwise" and op.reduce_dims and "softmax" in op.name:
                # the row a softmax reduces (keys per query): it decides the kernel that runs
                # it (Megatron's fused scale-mask-softmax takes rows of at most 4096)
                x = op.inputs[0]
                row = prod(binder.local_dim(x.dims[i], x.sharding.dims[i]) for i in op.reduce_dims)
                attrs = (("row", row),)
            if op.kind == "einsum":
                attrs = (("gemm", gemm_shape(op, binder)),)
                if any(t.footprint is not None for t in (*op.inputs, op.output)):
                    # a convolution as implicit GEMM: its bytes are tensor_size, not the
                    # m·k of the window matrix that its GEMM shape implies
                    attrs += (("implicit_gemm", 1),)
                stored = [t.dtype for t in op.inputs if t.kind == "weight" and t.scaling]
                if stored:  # a serving weight format: read at this width, scales with it
                    attrs += (("weight_dtype", stored[0]),)
            elif op.kind == "elementwise" and op.output.scaling is not None:
                attrs = (("quantize", op.output.dtype),)  # a format's per-step quantization
            if num_ops <= 0 < moved:
                # ASTRA-sim's roofline times a node as num_ops / min(peak, bw·num_ops/bytes):
                # zero ops with bytes > 0 is 0/0 and the rank never finishes. A node declared
                # free (a plugin's zero-cost op, a fraction rounded down) still moves its
                # output: one op per element written (TRACES.md, docs/generation.md).
                num_ops = max(1, binder.numel(op.output))
            bound.append(
                BoundOp(
                    op.name,
                    NodeType.COMP,
                    inputs,
                    (key(op.output),) + ((key(op.mask),) if op.mask is not None else ()),
                    num_ops=num_ops,
                    tensor_size=moved,
                    tags=op.tags,
                    dtype=_einsum_dtype(op) if op.kind == "einsum" else op.output.dtype,
                    attrs=attrs,
                )
            )
    return bound


def _einsum_dtype(op: Op) -> str:
    """The dtype a matmul computes in: its first operand's, or where that is a weight stored
    in a weight format (whose GEMM dequantizes it where the format is weight-only), the other
    operand's."""
    first = op.inputs[0]
    if first.scaling is not None and first.kind == "weight" and len(op.inputs) > 1:
        return op.inputs[1].dtype
    return first.dtype


def _moved(t: Tensor, binder: Binder) -> int:
    """Bytes an op moves reading or writing ``t``: a window view (or its gradient) moves its
    smaller footprint's (:meth:`~stg.core.symbolic.GraphBuilder.windows`)."""
    if t.footprint is not None:
        return min(binder.nbytes(t), binder.nbytes(t.footprint))
    return binder.nbytes(t)


def _einsum_letters(op: Op, binder: Binder) -> tuple[str, str, str, dict[str, int]]:
    lhs, out = op.spec.split("->")
    a, b = lhs.split(",")
    sizes: dict[str, int] = {}
    for letters, t in zip((a, b), op.inputs, strict=True):
        for letter, d, axes in zip(letters, t.dims, t.sharding.dims, strict=True):
            sizes.setdefault(letter, binder.local_dim(d, axes))
    return a, b, out, sizes


def gemm_shape(op: Op, binder: Binder) -> tuple[int, int, int, int]:
    """``(batch, m, n, k)`` of a two-operand einsum on one rank, as a batched GEMM
    ``[m, k] x [k, n]``: batch letters are in both operands and the output, m letters in the
    first operand and the output, n letters in the second and the output, k letters in both
    operands only. A letter of one operand alone (summed over) counts into k."""
    if len(op.inputs) != 2:
        return (1, binder.numel(op.output), 1, 1)
    a, b, out, sizes = _einsum_letters(op, binder)
    batch = m = n = k = 1
    for letter, size in sizes.items():
        if letter in a and letter in b:
            if letter in out:
                batch *= size
            else:
                k *= size
        elif letter in out:
            if letter in a:
                m *= size
            else:
                n *= size
        else:
            k *= size
    return (batch, m, n, k)


def attention_shape(scores: Op, binder: Binder) -> tuple[int, int, int, int, int, int]:
    """``(batch, heads, s_q, s_kv, head_dim, causal)`` of the attention core whose score einsum
    (``q · k``) is ``scores``: heads are the batch letters not named ``batch`` (query heads,
    kv heads x query groups for GQA); causal when the einsum computes half the scores."""
    a, b, out, sizes = _einsum_letters(scores, binder)
    batch = heads = 1
    names = {
        letter: d.name
        for letters, t in zip((a, b), scores.inputs, strict=True)
        for letter, d in zip(letters, t.dims, strict=True)
    }
    _, s_q, s_kv, head_dim = gemm_shape(scores, binder)
    for letter in sizes:
        if letter in a and letter in b and letter in out:
            if names[letter] == "batch":
                batch *= sizes[letter]
            else:
                heads *= sizes[letter]
    causal = binder.fraction(scores.scale) != 1
    if causal and scores.span is not None and scores.span.topk and s_q != s_kv:
        causal = False  # new tokens against a cache, each on its picked keys: no mask
    query_only = [x for x in sizes if x in a and x in out and x not in b]
    if causal and any(names[x] == "seq" for x in query_only):
        # grouped-query heads (Llama's qgroup) are heads of their own to a causal kernel: each
        # masks its own s x s triangle, so they are not rows of one taller score matrix
        for letter in query_only:
            if names[letter] != "seq":
                heads *= sizes[letter]
                s_q //= sizes[letter]
    return (batch, heads, s_q, s_kv, head_dim, int(causal))


def causal_split(scores: Op, binder: Binder) -> int:
    """How many context-parallel ranks share the causal attention whose score einsum is
    ``scores`` with load balancing (1: none). Under context parallelism (``sp``) each rank
    holds ``s/cp`` queries against all ``s`` keys; Megatron-LM cuts the sequence into
    ``2·cp`` chunks and gives rank ``i`` chunks ``i`` and ``2·cp-1-i``
    (``get_batch_on_this_cp_rank``), so that every rank computes the same share, ``1/cp``,
    of the causal work, its diagonal blocks included."""
    cp_axes = binder.mesh_axes("sp")
    if binder.fraction(scores.scale) == 1 or not cp_axes:
        return 1
    a, b, out, sizes = _einsum_letters(scores, binder)
    q, k = scores.inputs

    def seq_axes(letters: str, t: Tensor, other: str) -> tuple[str, frozenset[str]] | None:
        for letter, d, axes in zip(letters, t.dims, t.sharding.dims, strict=True):
            if d.name == "seq" and letter in out and letter not in other:
                return letter, axes
        return None

    query, keys = seq_axes(a, q, b), seq_axes(b, k, a)
    if query is None or keys is None or not cp_axes <= query[1] or cp_axes & keys[1]:
        return 1
    cp = prod(binder.degrees[a] for a in cp_axes)
    return cp if sizes[query[0]] * cp == sizes[keys[0]] else 1


# How context parallelism moves keys and values (Megatron-LM's ``--cp-comm-type``, run by
# Transformer Engine 2.x, ``attention/dot_product_attention/context_parallel.py``, read at
# NVIDIA/TransformerEngine d0067d0):
#
# - ``p2p`` (Megatron's default; ``AttnFuncWithCPAndKVP2P``): the ranks pass their K and V
#   chunks (one buffer, ``torch.cat((k, v))``) around a ring; attention runs in ``cp`` steps.
#   Forward step ``i`` first waits for the chunk sent at step ``i - 1``, then sends it on to
#   the next rank (``flash_attn_p2p_communicate``) and attends to it while it travels; step 0
#   attends to the rank's own keys. The backward saves only the last chunk and passes K and V
#   round again in the other direction, the steps reversed (the diagonal, the rank's own
#   keys, last); from step 1 on each transfer also carries the K/V gradient accumulated so
#   far for the chunk of the step before (the last carries only that), and after each step
#   the rank adds its own share to the gradient received beside it.
# - ``all_gather`` (``AttnFuncWithCPAndKVAllGather``): K and V are all-gathered before the
#   attention, again before its backward, and their gradients reduce-scattered after it.
#
# stg writes each ring transfer as a collective over the cp group that moves one chunk per
# rank, as the ring's send and receive do: an all-gather of 1/(cp-1) of the all-gather
# variant's K/V (ring all-gather: each rank receives ``cp - 1`` shards), and for the gradients
# a reduce-scatter of 1/(cp-1) of its buffer, so the ring moves the variant's bytes in all.

RING_KEY_STRIDE = 1 << 64
"""The ring's intermediate buffers have keys ``key + n * RING_KEY_STRIDE`` (``n >= 1``, ``key``
a key of the attention op): tensor keys are addresses, and every key derived from one is
within 16 of an address or its negation, so these are no other key."""


def context_parallel_attention(
    forward: list[BoundOp], backward: list[BoundOp], comm_type: str, cp: int
) -> tuple[list[BoundOp], list[BoundOp]]:
    """The fused attention of a part under context parallelism (``sp``) as ``comm_type``
    (``GenerateOptions.CP_COMM_TYPES``; see the comment above) runs it: ``all_gather``
    gathers K and V again before the backward; ``p2p`` runs each pass as the ring's steps and
    transfers (:func:`_ring_forward`, :func:`_ring_backward`), its transfers replacing the
    gathers and the gradients' reduce-scatters; ``torch_all_gather`` (torchtitan's profiles'
    ``all_gather``) is PyTorch's own, :mod:`stg.core.torch_context_parallel`."""
    gathered = {
        op.outputs[0]: op.inputs[0]
        for op in forward
        if op.type is NodeType.COMM_COLL
        and op.comm_type is CollectiveType.ALL_GATHER
        and op.group_axes == ("sp",)
    }
    if not gathered:
        return forward, backward
    gathers = {op.outputs[0]: op for op in forward if op.outputs and op.outputs[0] in gathered}

    def attends_gathered(op: BoundOp) -> bool:
        attrs = dict(op.attrs)
        return "attention" in attrs and any(k in gathered for k in op.inputs)

    torch_cp = comm_type == TORCH_ALL_GATHER
    ring = {
        op.name
        for op in [*forward, *backward]
        if attends_gathered(op)
        and (
            (comm_type == "p2p" and _ring_splits(op, cp))
            or (torch_cp and splits_like_torch(op, cp))
        )
    }
    consumers = {k for op in [*forward, *backward] if op.name not in ring for k in op.inputs}
    # gathers only the ring attends to are its transfers; so are its gradients' reductions
    ringed = {k for k in gathered if k not in consumers}
    reductions = {
        op.inputs[0]: op
        for op in backward
        if op.type is NodeType.COMM_COLL
        and op.comm_type is CollectiveType.REDUCE_SCATTER
        and op.group_axes == ("sp",)
    }
    ring_grads = {
        k
        for op in backward
        if op.name in ring and all(g in ringed for g in op.inputs if g in gathered)
        for k in op.outputs
        if k in reductions
    }

    out_forward: list[BoundOp] = []
    for op in forward:
        if op.outputs and op.outputs[0] in ringed and gathers[op.outputs[0]] is op:
            continue
        if op.name in ring and all(k in ringed for k in op.inputs if k in gathered):
            kv = [gathers[k] for k in op.inputs if k in gathered]
            out_forward.extend(
                torch_forward(op, kv, cp, _ring_steps, _keys_of(op))
                if torch_cp
                else _ring_forward(op, kv, cp)
            )
        else:
            out_forward.append(op)
    out_backward: list[BoundOp] = []
    for op in backward:
        if op.inputs and op.inputs[0] in ring_grads and reductions[op.inputs[0]] is op:
            continue
        if not attends_gathered(op):
            out_backward.append(op)
            continue
        if any(k in ring_grads for k in op.outputs):
            kv = [gathers[k] for k in op.inputs if k in gathered]
            dkv = [reductions[k] for k in op.outputs if k in ring_grads]
            out_backward.extend(
                torch_backward(op, kv, dkv, cp, _ring_steps, _keys_of(op))
                if torch_cp
                else _ring_backward(op, kv, dkv, cp)
            )
            continue
        # only the local chunks are saved: K and V are gathered again
        again = {k: -k for k in op.inputs if k in gathered}  # keys no tensor has (ids > 0)
        out_backward.extend(replace(gathers[k], outputs=(again[k],)) for k in again)
        out_backward.append(replace(op, inputs=tuple(again.get(k, k) for k in op.inputs)))
    return out_forward, out_backward


def _ring_splits(op: BoundOp, cp: int) -> bool:
    """Whether the attention ``op`` splits into the ring's steps: unmasked, or causal under
    Megatron's load balancing (:func:`causal_split`) with an even number of queries; not
    under a sliding window, chunked or top-k mask, which Transformer Engine's ring does not run
    (``attn_forward_func_with_cp`` asserts ``a2a`` or ``all_gather`` for a window), so K and
    V are gathered as under ``all_gather``."""
    attrs = dict(op.attrs)
    if any(attrs.get(mask) for mask in ("attention_window", "attention_chunk", "attention_topk")):
        return False
    causal, s_q = attrs["attention"][5], attrs["attention"][2]
    return not causal or (attrs.get("causal_split", 1) == cp and s_q % 2 == 0)


def _shares(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal integer shares (the larger first) that sum to it."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _ring_steps(op: BoundOp, cp: int, local_first: bool) -> list[BoundOp]:
    """The attention pass ``op`` as the ring's ``cp`` kernels in order, without their
    inputs and outputs: the step on the rank's own keys (first, or last with
    ``local_first`` false: the backward) and one per other chunk. Under load-balanced causal
    masking a rank holds chunks ``i`` and ``2·cp-1-i``: its own step is causal over those
    two (2 of the rank's ``2·cp`` chunk blocks), every other step computes two full blocks
    (TE: both query chunks against the peer's first, or the second against both), a
    non-causal ``s_q x s_q/2`` attention. Without masking every step is ``s_q x s_kv/cp``.
    FLOPs and bytes split in the same shares."""
    attrs = dict(op.attrs)
    batch, heads, s_q, s_kv, head_dim, causal, backward = attrs["attention"]
    local_kv = s_q if causal else s_kv // cp
    remote_kv = s_q // 2 if causal else s_kv // cp
    rest = tuple((k, v) for k, v in attrs.items() if k not in ("attention", "causal_split"))
    own_ops, own_bytes = op.num_ops // cp, op.tensor_size // cp
    own = replace(
        op,
        num_ops=own_ops,
        tensor_size=own_bytes,
        attrs=(*rest, ("attention", (batch, heads, s_q, local_kv, head_dim, causal, backward))),
    )
    remote_shape = ("attention", (batch, heads, s_q, remote_kv, head_dim, 0, backward))
    others = [
        replace(op, num_ops=flops, tensor_size=nbytes, attrs=(*rest, remote_shape))
        for flops, nbytes in zip(
            _shares(op.num_ops - own_ops, cp - 1),
            _shares(op.tensor_size - own_bytes, cp - 1),
            strict=True,
        )
    ]
    return [own, *others] if local_first else [*others, own]


def _ring_transfers(
    sources: list[BoundOp], name: str, inputs: list[tuple[int, ...]], outputs: list[int]
) -> list[list[BoundOp]]:
    """Per ring transfer (``inputs[i]`` to ``outputs[i]``), the collectives that move one
    share of the collectives ``sources`` (one per dtype: the ring sends one buffer) as
    ``name`` with the transfer's number."""
    by_dtype: dict[str | None, list[BoundOp]] = {}
    for op in sources:
        by_dtype.setdefault(op.dtype, []).append(op)
    steps = len(outputs)
    shares = {
        dtype: _shares(sum(op.comm_size for op in ops), steps) for dtype, ops in by_dtype.items()
    }
    return [
        [
            replace(
                ops[0],
                name=f"{name}{n + 1}" + (f".{dtype}" if len(by_dtype) > 1 else ""),
                inputs=inputs[n],
                outputs=(outputs[n],),
                comm_size=shares[dtype][n],
            )
            for dtype, ops in by_dtype.items()
        ]
        for n in range(steps)
    ]


def _ring_forward(op: BoundOp, gathers: list[BoundOp], cp: int) -> list[BoundOp]:
    """The forward attention ``op`` as the p2p ring runs it, from the all-gathers of K and V
    it read (``gathers``): step 0 on the rank's own keys; the transfer of chunk ``i``
    (``i >= 1``) forwards chunk ``i - 1`` and runs beside step ``i - 1``; step ``i`` waits
    for it and for step ``i - 1`` (its partial output, corrected with the softmax
    statistics)."""
    gathered = {g.outputs[0]: g.inputs[0] for g in gathers}
    queries = tuple(k for k in op.inputs if k not in gathered)
    base = op.outputs[0]
    chunk = [_ring_key(base, 2 * i + 1) for i in range(cp)]  # chunk[i]: step i's keys
    partial = [_ring_key(base, 2 * i + 2) for i in range(cp - 1)] + [base]
    transfers = _ring_transfers(
        gathers,
        f"{op.name}.send_kv",
        [tuple(g.inputs[0] for g in gathers), *((chunk[i],) for i in range(1, cp - 1))],
        chunk[1:],
    )
    out: list[BoundOp] = []
    for i, step in enumerate(_ring_steps(op, cp, local_first=True)):
        if i + 1 < cp:  # sent on before the step's kernel starts
            out.extend(transfers[i])
        keys = tuple(gathered.values()) if i == 0 else (chunk[i], partial[i - 1])
        outputs = op.outputs if i == cp - 1 else (partial[i],)
        out.append(
            replace(step, name=f"{op.name}.step{i}", inputs=(*queries, *keys), outputs=outputs)
        )
    return out


def _ring_backward(
    op: BoundOp, gathers: list[BoundOp], reductions: list[BoundOp], cp: int
) -> list[BoundOp]:
    """The attention backward ``op`` as the p2p ring runs it, from the all-gathers of K and
    V it read (``gathers``) and the reduce-scatters of their gradients (``reductions``):
    step ``i`` attends to the chunk the transfer of step ``i - 1`` brought (step 0: the
    chunk saved in the forward; the rank's own chunk last) while transfer ``i`` sends it
    on, with the gradient of step ``i - 1``'s chunk (received beside step ``i - 1`` plus
    that step's share); the last transfer carries only that gradient, and the rank's K/V
    gradient is the one it brings plus the last step's share, an add that stg, as for
    every step's, does not price (a node of no cost)."""
    gathered = {g.outputs[0] for g in gathers}
    grads = {r.inputs[0] for r in reductions}
    queries = tuple(k for k in op.inputs if k not in gathered)
    base = op.outputs[0]
    chunk = [_ring_key(base, 3 * i + 1) for i in range(cp)]  # chunk[i]: step i's keys
    grad = [_ring_key(base, 3 * i + 2) for i in range(cp)]  # grad[i]: received beside step i
    partial = [_ring_key(base, 3 * i + 3) for i in range(cp)]  # step i's output
    saved = tuple(g.inputs[0] for g in gathers)
    # a transfer is one buffer, K and V with the gradient, sent once the step before is done
    sends = _ring_transfers(
        gathers,
        f"{op.name}.send_kv",
        [saved, *((chunk[i], partial[i - 1]) for i in range(1, cp - 1))],
        chunk[1:],
    )
    returns = _ring_transfers(
        reductions,
        f"{op.name}.send_dkv",
        [(partial[0],), *((grad[i], partial[i]) for i in range(1, cp - 1))],
        grad[1:],
    )
    kept = tuple(k for k in op.outputs if k not in grads)  # the queries' gradients
    out: list[BoundOp] = []
    for i, step in enumerate(_ring_steps(op, cp, local_first=False)):
        if i + 1 < cp:
            out.extend(sends[i])
        if i > 0:
            out.extend(returns[i - 1])
        keys = saved if i == 0 else (chunk[i], partial[i - 1])
        outputs = (*kept, partial[i]) if i == cp - 1 else (partial[i],)
        out.append(
            replace(step, name=f"{op.name}.step{i}", inputs=(*queries, *keys), outputs=outputs)
        )
    out.append(
        BoundOp(
            f"{op.name}.dkv",
            NodeType.COMP,
            (partial[-1], grad[-1]),
            tuple(r.outputs[0] for r in reductions),
        )
    )
    return out


def _keys_of(op: BoundOp) -> Callable[[int], int]:
    """The intermediate keys of ``op``'s ring (:func:`_ring_key` of its first output)."""
    return lambda n: _ring_key(op.outputs[0], n)


def _ring_key(key: int, n: int) -> int:
    """The ``n``-th (``n >= 1``) intermediate key of the ring of the op with key ``key``."""
    return key + n * RING_KEY_STRIDE


def kv_append_bytes(op: Op, binder: Binder) -> int:
    """Bytes of writing new keys or values into the KV cache (``kv_append``, serving phases):
    the new elements read in their dtype and written in the cache's."""
    new = op.inputs[0]
    return binder.nbytes(new) + int(binder.numel(new) * DTYPE_BYTES[op.output.dtype])


def fuse_attention(
    ops: list[Op], binder: Binder, shapes: dict[str, tuple[int, ...]]
) -> list[Op | BoundOp]:
    """``ops`` with each run of attention-core compute ops replaced by one fused kernel, as
    FlashAttention computes it: the same FLOPs, but only Q, K, V, the output and the softmax
    statistics (4 bytes per query row and head) cross memory; the backward also reads the
    output gradient and writes dQ, dK and dV. Forward core ops are those tagged
    ``core_attention``; ``shapes`` maps their names to the attention shape (filled when the
    forward is fused), and backward ops ``<forward op>.grad_*`` of those are fused too.
    Collectives met inside a run go before the fused node when they need nothing it produces,
    after it otherwise; one that gathers what a ``kv_append`` of the run wrote into the KV cache
    (serving under context parallelism) goes before it, after that append on its own."""
    out: list[Op | BoundOp] = []
    run: list[Op] = []
    after: list[Op] = []

    def is_core(op: Op) -> bool:
        if op.kind in ("collective", "view"):
            return False
        return "core_attention" in op.tags or op.name.split(".grad_", 1)[0] in shapes

    def flush() -> None:
        if run:
            out.append(_fused_attention(run, binder, shapes))
            out.extend(after)
        run.clear()
        after.clear()

    for op in ops:
        if is_core(op):
            run.append(op)
        elif run and op.kind in ("collective", "view"):
            produced = {id(o.output) for o in run}
            needed = {id(t) for t in op.inputs}
            appends = [o for o in run if o.kind == "kv_append" and id(o.output) in needed]
            if appends and not needed & produced - {id(o.output) for o in appends}:
                # a cache split over sp is gathered before attention reads it (serving):
                # its append runs first, on its own, then the gather, then the kernel
                for append in appends:
                    run.remove(append)
                out.extend([*appends, op])
            else:
                (after if needed & produced else out).append(op)
        else:
            flush()
            out.append(op)
    flush()
    return out


def _fused_attention(run: list[Op], binder: Binder, shapes: dict[str, tuple[int, ...]]) -> BoundOp:
    backward = any(".grad_" in op.name for op in run)
    produced = {id(op.output) for op in run}
    external = list(dict.fromkeys(t for op in run for t in op.inputs if id(t) not in produced))
    tokens = [t for t in external if _is_token_tensor(t)]  # Q, K, V (and dO backward)
    moved = sum(binder.nbytes(t) for t in tokens)
    if backward:
        # O is read again (rowsum(dO * O)); dQ, dK, dV are written
        moved += binder.nbytes(run[0].inputs[0])
        moved += sum(binder.nbytes(op.output) for op in run if _is_token_tensor(op.output))
        forward = (op.name.split(".grad_", 1)[0] for op in run)
        shape = next((shapes[name] for name in forward if name in shapes), ())
    else:
        moved += binder.nbytes(run[-1].output)
        # serving: the whole KV cache is read, and the new keys and values written into it
        for op in run:
            if op.kind == "kv_append":
                moved += binder.nbytes(op.output) + kv_append_bytes(op, binder)
                moved -= binder.nbytes(op.inputs[0])  # already counted as read above
        scores = next((op for op in run if op.kind == "einsum"), None)
        shape = attention_shape(scores, binder) if scores is not None else ()
        picked = next((op.span.topk for op in run if op.span is not None and op.span.topk), 0)
        if picked and shape:  # sparse attention reads only the cached rows its queries picked
            for t in tokens:
                rows = next((d for d in t.dims if d.name == "seq_kv"), None)
                if t.kind == "cache" and rows is not None:
                    cached = binder.size(rows)
                    read = min(cached, shape[2] * picked)  # each new token's picked rows
                    moved -= binder.nbytes(t) * (cached - read) // cached
        if shape:
            shape = _mean_head_dim(shape, run, binder, scores)  # type: ignore[arg-type]
            split = causal_split(scores, binder)  # type: ignore[arg-type]
            if split > 1:
                shape = (*shape, split)
        for op in run:
            shapes[op.name] = shape
    attrs: tuple[tuple[str, Any], ...] = ()
    if shape:
        batch, heads, s_q = shape[:3]
        moved += 4 * batch * heads * s_q  # the softmax statistics (fp32 log-sum-exp per row)
        attrs = (("attention", (*shape[:6], int(backward))),)
        if len(shape) > 6:  # a load-balanced share of a causal sequence (causal_split)
            attrs += (("causal_split", shape[6]),)
    einsums = [op for op in run if op.kind == "einsum"]
    span = next((op.span for op in einsums if op.span is not None), None)
    if shape and span is not None:  # the kernel's mask: keys per query beyond causal's
        attrs += (("attention_window", span.window),) if span.window else ()
        attrs += (("attention_chunk", span.chunk),) if span.chunk else ()
        attrs += (("attention_topk", span.topk),) if span.topk else ()
    if einsums and einsums[0].inputs[0].scaling is not None:  # serving fp8 attention
        attrs += (("attention_dtype", einsums[0].inputs[0].dtype),)
    return BoundOp(
        "core_attention.grad" if backward else "core_attention",
        NodeType.COMP,
        tuple(key(t) for t in external),
        # a dropout of the probabilities runs inside the kernel (FlashAttention regenerates
        # its mask from the RNG state backward): its mask is a key, never bytes
        tuple(key(t) for op in run for t in (op.output, op.mask) if t is not None),
        num_ops=sum(_flops(op, binder) for op in run),
        tensor_size=moved,
        tags=frozenset().union(*(op.tags for op in run)) | {"core_attention"},
        dtype=einsums[0].inputs[0].dtype if einsums else run[0].output.dtype,
        attrs=attrs,
    )


def fp8_attention_ops(ops: list[BoundOp], scaling: str) -> list[BoundOp]:
    """``ops`` with each fused attention node run in fp8 (``fp8_attention``): dtype ``fp8``,
    ``attention_dtype`` ``fp8``, ``attention_scaling`` its scaling (``fp8`` per-tensor or
    ``mxfp8``) and ``attention_casts`` the bytes its casts move
    (:data:`stg.core.recipes.FP8_ATTENTION_CAST_KERNELS` kernels): 3 bytes per element cast
    (2 read and 1 written in, 1 read and 2 written out). Forward those are the elements of Q,
    K, V and the output, the node's bytes (at its dtype's width) less its softmax statistics
    (4 bytes per query row and head); backward those of the output gradient and dQ, dK, dV,
    half of that (the kernel also reads Q, K, V and the output, whose fp8 copies the forward
    kept)."""
    out = []
    for op in ops:
        shape = next((v for k, v in op.attrs if k == "attention"), None)
        if op.type is not NodeType.COMP or shape is None:
            out.append(op)
            continue
        batch, heads, s_q = shape[:3]
        elements = (
            max(0, op.tensor_size - 4 * batch * heads * s_q) // DTYPE_BYTES[op.dtype or "bf16"]
        )
        cast = elements // 2 if shape[6] else elements
        attrs = (
            ("attention_dtype", "fp8"),
            ("attention_scaling", scaling),
            ("attention_casts", 3 * cast),
        )
        out.append(replace(op, dtype="fp8", attrs=op.attrs + attrs))
    return out


def _mean_head_dim(
    shape: tuple[int, int, int, int, int, int], run: list[Op], binder: Binder, scores: Op
) -> tuple[int, int, int, int, int, int]:
    """``shape`` with the head size that the run's matmul FLOPs give, ``flops / (4·batch·
    heads·s_q·s_kv·scale)``: the head size itself when q·k and p·v contract the same size,
    their mean otherwise (multi-head latent attention: (128 + 64 + 128) / 2 = 160), so that a
    kernel model pricing ``4·…·head_dim`` prices the FLOPs the trace counts."""
    batch, heads, s_q, s_kv, head_dim, causal = shape
    flops = sum(_flops(op, binder) for op in run if op.kind == "einsum")
    per_dim = 4 * batch * heads * s_q * s_kv * binder.fraction(scores.scale)
    mean = Fraction(flops) / per_dim if per_dim else Fraction(head_dim)
    if mean.denominator != 1 or mean == head_dim:
        return shape
    return (batch, heads, s_q, s_kv, int(mean), causal)


def _is_token_tensor(t: Tensor) -> bool:
    """A tensor with one row per token (Q, K, V, O and their gradients), not a score matrix
    (which has two sequence dimensions)."""
    return sum(1 for d in t.dims if d.name.startswith("seq")) <= 1


def fuse(ops: list[BoundOp], group_of: Callable[[BoundOp], object | None]) -> list[BoundOp]:
    """Merge ops that ``group_of`` puts in the same group into one node (bucketing), e.g. the
    weight all-gathers of a layer under FSDP, or a layer's gradient reductions. A group whose
    inputs all come from outside ``ops`` is placed where its first member was, any other group
    where its last member was, so the order stays topological."""
    produced = {k for op in ops for k in op.outputs}
    groups: dict[object, list[BoundOp]] = {}
    for op in ops:
        g = group_of(op)
        if g is not None:
            groups.setdefault(g, []).append(op)
    place: dict[int, list[BoundOp]] = {}
    for members in groups.values():
        external = all(k not in produced for op in members for k in op.inputs)
        anchor = members[0] if external else members[-1]
        place[id(anchor)] = members
    grouped = {id(op) for members in groups.values() for op in members}
    out: list[BoundOp] = []
    for op in ops:
        if id(op) in place:
            members = place[id(op)]
            if len(members) == 1:
                out.append(members[0])
                continue
            first = members[0]
            outputs = tuple(k for m in members for k in m.outputs)
            inputs = tuple(dict.fromkeys(k for m in members for k in m.inputs if k not in outputs))
            axes = "_".join(first.group_axes)
            kind = first.comm_type.name.lower() if first.comm_type is not None else first.name
            out.append(
                BoundOp(
                    f"{kind}_{axes}:{len(members)}_tensors"
                    if first.comm_type is not None
                    else first.name,
                    first.type,
                    inputs,
                    outputs,
                    num_ops=sum(m.num_ops for m in members),
                    tensor_size=sum(m.tensor_size for m in members),
                    comm_type=first.comm_type,
                    comm_size=_fused_comm_size(members),
                    group_axes=first.group_axes,
                    tags=first.tags,
                    dtype=first.dtype,
                    flat=first.flat,
                    flat_elements=sum(m.flat_elements for m in members),
                    tensor_parallel=first.tensor_parallel,
                )
            )
        elif id(op) not in grouped:
            out.append(op)
    return out


def _fused_comm_size(members: list[BoundOp]) -> int:
    """``comm_size`` of fused collectives. Flat ones form one flat buffer per (degree, dtype),
    padded once as a whole to a multiple of the degree (FSDP's and ZeRO's per-unit flat
    buffer), not tensor by tensor."""
    size = sum(m.comm_size for m in members if m.flat == 1)
    buffers: dict[tuple[int, str | None], int] = {}
    for m in members:
        if m.flat > 1:
            buffers[(m.flat, m.dtype)] = buffers.get((m.flat, m.dtype), 0) + m.flat_elements
    for (degree, dtype), elements in sorted(buffers.items(), key=str):
        size += flat_comm_size(members[0].comm_type, elements, degree, dtype or "fp32")
    return size


def _mark_flat(bound: list[BoundOp], ops: Iterable[Op], binder: Binder) -> list[BoundOp]:
    """Mark the collectives of ``bound`` (bound from ``ops``) that gather, reduce-scatter or
    reduce a flat split (``Sharding.flat``) with their flat degree and unpadded element count,
    and give them the ``comm_size`` of their padded flat buffer (:func:`flat_comm_size`)."""
    collectives = {key(op.output): op for op in ops if op.kind == "collective"}
    out = []
    for b in bound:
        op = collectives.get(b.outputs[0]) if b.type is NodeType.COMM_COLL else None
        if op is None:
            out.append(b)
            continue
        src = op.inputs[0]
        degree = max(binder.flat_degree(src), binder.flat_degree(op.output))
        if degree == 1:
            out.append(b)
            continue
        elements = binder.unflat_numel(src)
        out.append(
            replace(
                b,
                flat=degree,
                flat_elements=elements,
                comm_size=flat_comm_size(b.comm_type, elements, degree, src.dtype),
            )
        )
    return out


def _experts_index(t: Tensor) -> int | None:
    return next((i for i, d in enumerate(t.dims) if d.name == "experts"), None)


def _mark_expert_routes(
    bound: list[BoundOp],
    ops: Iterable[Op],
    binder: Binder,
    dispatcher: str,
    kexperts: int,
    gate: str = RANDOM_GATE,
    sms: int | None = None,
) -> list[BoundOp]:
    """Mark the expert-parallel all-to-alls of ``bound`` (bound from ``ops``: those moving a
    tensor with an ``experts`` dimension) as ``dispatcher`` runs them
    (:data:`stg.core.routing.DISPATCHER_ATTR` and the routing it needs: direction, ``k``,
    experts, row elements, ``gate`` where not ``random`` and ``sms`` where given); a
    ``dispatch`` splits the experts dimension over more ranks than its input has it (tokens
    travel to their experts), a ``combine`` over fewer; an all-to-all that leaves the experts
    where they are is neither and stays unmarked."""
    if dispatcher == NCCL_DISPATCHER:
        return bound
    collectives = {
        key(op.output): op
        for op in ops
        if op.kind == "collective" and op.collective is CollectiveType.ALL_TO_ALL
    }
    out = []
    for b in bound:
        op = collectives.get(b.outputs[0]) if b.type is NodeType.COMM_COLL else None
        src = op.inputs[0] if op is not None else None
        at = _experts_index(src) if src is not None else None
        if op is None or src is None or at is None:
            out.append(b)
            continue
        before = prod(binder.degrees.get(a, 1) for a in src.sharding.dims[at])
        after = prod(binder.degrees.get(a, 1) for a in op.output.sharding.dims[at])
        if before == after:  # the experts stay where they are: not a dispatch or a combine
            out.append(b)
            continue
        route = "dispatch" if after > before else "combine"
        row = binder.local_dim(src.dims[-1], src.sharding.dims[-1])
        attrs = (
            (DISPATCHER_ATTR, dispatcher),
            (EP_ROUTE_ATTR, route),
            (EP_KEXPERTS_ATTR, kexperts),
            (EP_EXPERTS_ATTR, binder.size(src.dims[at])),
            (EP_HIDDEN_ATTR, row),
        )
        if gate != RANDOM_GATE:
            attrs += ((EP_GATE_ATTR, gate),)
        if sms is not None:
            attrs += ((EP_SMS_ATTR, sms),)
        out.append(replace(b, attrs=(*b.attrs, *attrs)))
    return out


WEIGHT_COLLECTIVE_TAGS = frozenset({"weight_gather", "weight_grad_reduce"})


def _weight_collective(op: BoundOp) -> object | None:
    """One group per kind of FSDP collective of a part: its weights form one flat buffer."""
    tags = op.tags & WEIGHT_COLLECTIVE_TAGS
    if op.type is NodeType.COMM_COLL and tags:
        return (op.comm_type, op.group_axes, tuple(sorted(tags)))
    return None


def _any_collective(op: BoundOp) -> object | None:
    """One group per kind of collective of a part, less those of a bucket of their own."""
    if op.type is not NodeType.COMM_COLL:
        return None
    return (op.comm_type, op.group_axes, OWN_BUCKET in op.tags)


@dataclass
class BoundPart:
    """A part bound to integers: forward, backward and once-per-iteration reduce ops."""

    part: Part | None
    """the symbolic part bound (None once detached: :func:`stg.core.pipeline.detached_parts`;
    lowering reads only the fields below)"""
    forward: list[BoundOp]
    backward: list[BoundOp]
    reduce: list[BoundOp]
    update: list[BoundOp]
    input_key: int | None
    output_key: int | None
    seed_key: int | None
    grad_input_key: int | None
    grad_keys: tuple[int, ...]
    parameters: int
    """weight elements this rank stores (FSDP: its padded shard of the part's flat buffer)"""
    boundary_bytes: int
    optimizer_parameters: int
    """parameters this rank updates (ZeRO / FSDP: its padded shard of the flat buffer)"""
    replica_parameters: int = 0
    """weight elements of this rank's model replica (before any ZeRO / FSDP split)"""
    fp8_modules: tuple[Fp8Module, ...] = ()
    """Transformer Engine modules with fp8 GEMMs, in forward order (:mod:`stg.core.fp8`)"""
    weight_copy_bytes: int = 0
    """bytes of a low-precision recipe's quantized weight copies and their scales, which the
    rank keeps across the micro-batches (:func:`stg.core.recipes.weight_copy_bytes`)"""
    tied_keys: tuple[int, ...] = ()
    """keys of the gradients of tied weights (``Part.tied``) and of the copies of them that
    the part does not hold (``Part.copy_grads``): on one stage, the gradient reduction of the
    holder waits for the copies' (a tied LM head's gradient adds to the embedding's)"""
    tp_replicated_reduce: list[BoundOp] = field(default_factory=list)
    """the tensor-parallel all-reduce of the gradients of weights replicated over it
    (:data:`stg.core.autodiff.TP_REPLICATED_GRAD`), which lowering fuses over the stage"""
    muon: tuple[MuonMatrices, ...] = ()
    """the weight matrices Muon orthogonalizes on this rank (``--optimizer muon``; none for
    Adam, the embedding and the head: :mod:`stg.core.muon`)"""
    weight_scale_bytes: int = 0
    """the scales among :attr:`weight_copy_bytes` (``Recipe.scale_bytes`` of each weight):
    what a GPU whose one quantized tensor serves both usages keeps whole"""

    @property
    def fp8_gemms(self) -> int:
        """fp8 GEMMs whose amaxes this part keeps (``num_gemms`` summed over its modules)."""
        return sum(m.gemms for m in self.fp8_modules)

    def fp8_module_ends(self) -> list[int]:
        """Indices into :attr:`backward` of the last compute op of each fp8 module's backward
        (sorted, distinct): where the module's backward ends."""
        ends = set()
        for module in self.fp8_modules:
            last = None
            for i, op in enumerate(self.backward):
                if op.type is NodeType.COMP and op.name.split(".", 1)[0] in module.ops:
                    last = i
            if last is not None:
                ends.add(last)
        return sorted(ends)

    def without_weight_gathers(self, ops: Sequence[BoundOp], held: Iterable[int]) -> list[BoundOp]:
        """``ops`` less the FSDP all-gathers of this part's weights, and their copy-outs,
        whose outputs ``held`` already has (a prefetched gather leaves its copy-out to run)."""
        done = set(held)
        return [
            op
            for op in ops
            if "weight_gather" not in op.tags or not all(k in done for k in op.outputs)
        ]

    def repeated_before_backward(
        self, recompute: str, modules: frozenset[str] = frozenset({"core_attention"})
    ) -> list[BoundOp]:
        """Forward ops run again before this part's backward: FSDP weight gathers, plus the
        ops tagged ``modules`` (selective recompute; by default the attention core), the ops
        torchtitan's op-level selective checkpointing recomputes (``selective_op``:
        :func:`op_checkpoint_recomputes`) or everything (full recompute)."""
        if recompute == "full":
            return self.forward
        if recompute == "selective_op":
            return op_checkpoint_recomputes(self.forward)
        tags = {"weight_gather", *modules} if recompute == "selective" else {"weight_gather"}
        return [op for op in self.forward if op.tags & tags]


def op_checkpoint_recomputes(forward: list[BoundOp]) -> list[BoundOp]:
    """The ops of one checkpointed part's forward that torchtitan's selective activation
    checkpointing with ``selective_ac_option = "op"`` runs again before its backward: every
    compute op except the attention core and the odd-numbered matmuls in forward order (its
    policy saves the outputs of ``aten.mm`` and the SDPA kernels, "except every second mm",
    counting the part's matmuls from 1 in each checkpointed forward: pytorch/torchtitan
    004b3148a (August 2024), ``torchtitan/parallelisms/parallelize_llama.py``,
    ``_save_list`` and ``_custom_policy``), plus the FSDP gathers of the part's weights and
    the sequence-parallel all-gathers of its activations over tensor parallelism: the list
    saves ``_c10d_functional.reduce_scatter_tensor``'s outputs but not
    ``all_gather_into_tensor``'s (the same commit, and 820504e of torchtitan's 2025-06
    benchmarks), so the gathered inputs of the column-parallel GEMMs, which their weight
    gradients read, are gathered again before the backward."""
    repeated: list[BoundOp] = []
    matmuls = 0
    for op in forward:
        if "weight_gather" in op.tags or (
            sequence_parallel_collective(op) and op.comm_type is CollectiveType.ALL_GATHER
        ):
            repeated.append(op)
            continue
        if op.type is not NodeType.COMP or "core_attention" in op.tags:
            continue
        if any(k == "attention" for k, _ in op.attrs):
            continue
        if any(k == "gemm" for k, _ in op.attrs):
            matmuls += 1
            if matmuls % 2 == 1:
                continue
        repeated.append(op)
    return repeated


def sequence_parallel_collective(op: BoundOp) -> bool:
    """Whether ``op`` all-gathers or reduce-scatters activations over the tensor-parallel group
    (sequence parallelism's gather before the column-parallel GEMMs and reduce-scatter after
    the row-parallel ones), not a weight's gather or gradient reduction."""
    return (
        op.type is NodeType.COMM_COLL
        and op.tensor_parallel
        and op.comm_type in (CollectiveType.ALL_GATHER, CollectiveType.REDUCE_SCATTER)
        and "weight_gather" not in op.tags
        and "weight_grad_reduce" not in op.tags
    )


def _flat_shard(weights: Iterable[Tensor], binder: Binder, degree: int) -> int:
    """Elements of one rank's shard of the flat buffer of ``weights`` split ``degree`` ways:
    one buffer per part (FSDP's unit, ZeRO's bucket), padded as a whole."""
    return -(-sum(binder.unflat_numel(w) for w in weights) // degree)


def _zero_shard(
    weights: Iterable[Tensor], binder: Binder, degree: int, axes: frozenset[str]
) -> int:
    """Elements of one rank's ZeRO / FSDP shards of ``weights``: one flat buffer per degree
    (``degree``, or over ``axes`` less those that split a weight's dimensions; a routed
    expert's, split over ``ep``, over ``edp``: :meth:`GraphBuilder._zero_axes_of`)."""
    from stg.core.symbolic import is_routed_expert

    by_degree: dict[int, list[Tensor]] = {}
    expert_dp = binder.mesh_axes("edp")
    for w in weights:
        split = frozenset().union(*w.sharding.dims)
        over = expert_dp if is_routed_expert(w.dims, w.sharding) else axes
        own = prod(binder.degrees[a] for a in over - split)
        by_degree.setdefault(own if axes else degree, []).append(w)
    return sum(_flat_shard(ws, binder, d) for d, ws in sorted(by_degree.items()))


def bind_part(
    part: Part,
    binder: Binder,
    seed: Tensor | None,
    shard_degree: int = 1,
    fused_attention: bool = False,
    gradient_buckets: bool = False,
    shard_axes: frozenset[str] = frozenset(),
    cp_comm_type: str = "p2p",
    recipe: Recipe = RECIPES[DEFAULT_RECIPE],
    param_gather: bool = False,
    fp8_dispatch: bool = False,
    fp8_attention: bool = False,
    fsdp2_copies: bool = True,
    moe_dispatcher: str = NCCL_DISPATCHER,
    kexperts: int = 1,
    moe_gate: str = RANDOM_GATE,
    moe_dispatcher_sms: int | None = None,
    muon: bool = False,
) -> BoundPart:
    """Bind ``part``; ``muon``: its weight matrices are Muon's (:mod:`stg.core.muon`);
    ``shard_degree`` is the degree over which ZeRO or FSDP shards its
    gradients and optimizer states (1: not sharded), over the mesh axes ``shard_axes`` where
    given (a weight split over some of them, a folded expert, is sharded over the others);
    ``fused_attention`` runs the attention core as one fused kernel forward and one backward
    (:func:`fuse_attention`);
    ``gradient_buckets`` reduces the part's gradients in buckets as PyTorch DDP does
    (:func:`ddp_buckets`) instead of one collective per kind; ``cp_comm_type`` is how
    context parallelism moves keys and values (:func:`context_parallel_attention`);
    ``recipe`` is the low-precision recipe of a training part computing in fp8
    (:mod:`stg.core.recipes`), whose FSDP weight gathers move bf16, or with ``param_gather``
    the recipe's fp8 copies (:func:`stg.core.recipes.gathered_weight_bytes`), and whose MoE
    dispatch moves bf16 tokens, or with ``fp8_dispatch`` their quantized copies, and whose
    fused attention runs in fp8 with ``fp8_attention`` (:func:`fp8_attention_ops`);
    ``fsdp2_copies``: FSDP's weight collectives come with FSDP2's copy kernels
    (:func:`fsdp_copies`; Megatron-FSDP has none); ``moe_dispatcher`` other than ``alltoall``
    marks the expert-parallel all-to-alls as DeepEP or HybridEP runs them, for tokens routed
    to ``kexperts`` experts each, where ``moe_gate`` puts them, on ``moe_dispatcher_sms`` SMs
    (:func:`_mark_expert_routes`)."""
    shapes: dict[str, tuple[int, ...]] = {}
    grads = tuple(key(g) for g in part.weight_grads.values())
    input_tensor = next((t for t in part.inputs if t.kind == "input"), None)
    boundary = part.output if part.output is not None else input_tensor
    flat_stored = [w for w in part.weights if w.sharding.flat]
    stored = sum(binder.numel(w) for w in part.weights if not w.sharding.flat)
    for degree in sorted({binder.flat_degree(w) for w in flat_stored}):
        stored += _flat_shard(
            (w for w in flat_stored if binder.flat_degree(w) == degree), binder, degree
        )

    def bound(ops: list[Op], group_of: Callable[[BoundOp], object | None]) -> list[BoundOp]:
        fused = fuse_attention(ops, binder, shapes) if fused_attention else ops
        marked = _mark_flat(bind_ops(fused, binder), ops, binder)
        marked = _mark_expert_routes(
            marked, ops, binder, moe_dispatcher, kexperts, moe_gate, moe_dispatcher_sms
        )
        return fuse(marked, group_of)

    # sequence parallelism's replicated weights: their tensor-parallel all-reduce, once per
    # stage (lower_stage); their data-parallel reduction stays in the buckets
    own_reduce = [op for op in part.reduce if TP_REPLICATED_GRAD not in op.tags]
    tp_replicated = [op for op in part.reduce if TP_REPLICATED_GRAD in op.tags]
    if gradient_buckets:
        reduce = ddp_buckets(_mark_flat(bind_ops(own_reduce, binder), own_reduce, binder))
    else:
        reduce = bound(own_reduce, _any_collective)
    modules = te_modules(part.forward, binder.local_dim)
    quantized: dict[str, int] = {}
    sites: list[QuantizeSite] = []
    # tensors that TE gathers over tensor parallelism after quantizing them (delayed scaling)
    gathered_fp8: frozenset[int] = frozenset()
    output_layer: frozenset[str] = frozenset()
    # training computing in fp8 throughout (not a precision plan's casts): TE's recipe
    te_recipe = bool(part.backward) and any(
        op.output.dtype == "fp8" and ".cast_" not in op.name for op in part.forward
    )
    if te_recipe and part.name == "head":
        output_layer = native_fp8_gemms([*part.forward, *part.backward])
    elif te_recipe and recipe.name == DEFAULT_RECIPE:
        for module in modules:
            quantized.update(quantize_elements(module, part.forward, part.backward, binder.numel))
            gathered_fp8 |= {
                key(site.tensor)
                for site in quantize_sites(
                    module,
                    part.forward,
                    part.backward,
                    binder.numel,
                    lambda op: gemm_shape(op, binder),
                )
                if site.operand != "weight"
            }
    elif te_recipe:
        for module in modules:
            sites += quantize_sites(
                module,
                part.forward,
                part.backward,
                binder.numel,
                lambda op: gemm_shape(op, binder),
                recipe.gathers_quantized,
                recipe.keeps_bf16_input and recipe.axiswise_casts,
            )
    forward = bound(part.forward, _weight_collective)
    backward = bound(part.backward, _weight_collective)
    if fused_attention and part.backward and binder.degrees.get("sp", 1) > 1:  # training
        forward, backward = context_parallel_attention(
            forward, backward, cp_comm_type, binder.degrees["sp"]
        )
    if te_recipe:
        forward = _te_fp8_recipe(forward, quantized, output_layer)
        backward = _te_fp8_recipe(backward, quantized, output_layer)
    if sites:
        forward = _recipe_quantization(forward, sites, recipe, fp8_dispatch)
        backward = _recipe_quantization(backward, sites, recipe, fp8_dispatch)
    if te_recipe and fp8_attention and fused_attention:
        scaling = FP8_ATTENTION_SCALING[recipe.name]
        forward = fp8_attention_ops(forward, scaling)
        backward = fp8_attention_ops(backward, scaling)

    weight_sites = [site for site in sites if site.operand == "weight"]
    update = bound(part.update, _any_collective)
    if te_recipe:
        # the output layer and the embedding are no TE modules: their weights stay bf16
        fp8_params = param_gather and bool(sites)
        forward = _recipe_collectives(forward, recipe, fp8_params, gathered_fp8)
        backward = _recipe_collectives(backward, recipe, fp8_params, gathered_fp8)
        # gradients and the distributed optimizer's parameters are never fp8
        reduce = _recipe_collectives(reduce, recipe, False)
        update = _recipe_collectives(update, recipe, False)
    if fsdp2_copies:
        forward, backward = fsdp_copies(forward, backward)
    return BoundPart(
        part,
        forward,
        backward,
        reduce,
        update,
        key(input_tensor) if input_tensor is not None else None,
        key(part.output) if part.output is not None else None,
        key(seed) if seed is not None else None,
        key(part.grad_input) if part.grad_input is not None else None,
        grads,
        stored,
        _boundary_bytes(boundary, binder, te_recipe) if boundary is not None else 0,
        _zero_shard(part.weights, binder, shard_degree, shard_axes) if shard_degree > 1 else stored,
        sum(binder.unflat_numel(w) for w in part.weights),
        modules,
        sum(
            weight_copy_bytes(recipe, site.rows, site.cols, param=param_gather)
            for site in weight_sites
        ),
        tuple(key(part.weight_grads[w]) for w in part.tied if w in part.weight_grads)
        + tuple(key(g) for g in part.copy_grads),
        [op for op in bound(tp_replicated, _any_collective) if op.type is NodeType.COMM_COLL],
        part_matrices(part, binder, shard_degree, shard_axes) if muon else (),
        sum(recipe.scale_bytes("weight", site.rows, site.cols) for site in weight_sites),
    )


def _te_fp8_recipe(
    ops: list[BoundOp], quantized: Mapping[str, int], output_layer: frozenset[str]
) -> list[BoundOp]:
    """``ops`` of a training part computing in fp8 as Transformer Engine's recipe runs them
    (:mod:`stg.core.fp8`): the quantization before a GEMM recorded on it
    (``QUANTIZE_ATTR``, :func:`stg.core.fp8.quantize_elements`); every other fp8 kernel but
    the attention core moving its activations in the autocast dtype, bf16 (twice the bytes
    counted in fp8); and the output layer's GEMMs (``output_layer``) in bf16. Its collectives
    are :func:`_recipe_collectives`'."""
    widen = AUTOCAST_BYTES // DTYPE_BYTES["fp8"]
    out = []
    for op in ops:
        if op.type is not NodeType.COMP or op.dtype != "fp8":
            out.append(op)
        elif op.name in output_layer:
            out.append(replace(op, dtype=AUTOCAST_DTYPE, tensor_size=op.tensor_size * widen))
        elif op.name in quantized:
            out.append(replace(op, attrs=(*op.attrs, (QUANTIZE_ATTR, quantized[op.name]))))
        elif not any(k in ("gemm", "attention") for k, _ in op.attrs):
            out.append(replace(op, tensor_size=op.tensor_size * widen))
        else:
            out.append(op)
    return out


def _recipe_quantization(
    ops: list[BoundOp], sites: list[QuantizeSite], recipe: Recipe, fp8_dispatch: bool = False
) -> list[BoundOp]:
    """``ops`` with a recipe's quantize kernels (:func:`stg.core.recipes.quantize_kernels`)
    as nodes of their own before the op each ``site`` names, or before the collective that
    moves its quantized copy; the GEMMs that read a site's copies wait for its cast, and run in
    the recipe's dtype. A sequence-parallel all-gather of a quantized tensor, and with
    ``fp8_dispatch`` the MoE all-to-all that dispatches one (DeepSeek-V3, section 3.3.3: the
    tokens before the up-projections and the gradients before the down-projection's backward
    travel in fp8, the combines in bf16), waits for the cast too and moves the rowwise copy
    with its block scales (:meth:`stg.core.recipes.Recipe.gathered_bytes`)."""
    tags = {op.name: op.tags for op in ops}
    placed = [s for s in sites if s.before in tags]
    gemms = {name for s in sites for name in s.consumers}
    anchor: dict[int, list[tuple[int, QuantizeSite]]] = {}
    cast_of: dict[str, list[int]] = {}

    def sequence_parallel_gather(op: BoundOp) -> bool:
        return op.comm_type is CollectiveType.ALL_GATHER and op.tensor_parallel

    def moves_quantized(op: BoundOp) -> bool:
        dispatch = fp8_dispatch and op.comm_type is CollectiveType.ALL_TO_ALL
        return (recipe.gathers_quantized and sequence_parallel_gather(op)) or dispatch

    for i, site in enumerate(placed):
        source = key(site.tensor)
        at = next(
            j
            for j, op in enumerate(ops)
            if op.name == site.before
            or (op.type is NodeType.COMM_COLL and moves_quantized(op) and source in op.inputs)
        )
        anchor.setdefault(at, []).append((i, site))

    out: list[BoundOp] = []
    quantized: dict[int, tuple[int, QuantizeSite]] = {}
    made = {k for op in ops for k in op.outputs}
    for j, op in enumerate(ops):
        for i, site in anchor.get(j, []):
            source = key(site.tensor)
            # keys of no tensor: ids are multiples of 16, so -id - 3 ... -id - 14 are neither
            # ids nor negated ids (context_parallel_attention takes -id and keys above 2**64)
            done = -source - 3 - 3 * (i % 4)
            reads: tuple[int, ...] = (source,)
            if source not in made:
                # a weight (TE casts it inside the linear's forward, after its input is there),
                # or a tensor that context parallelism's attention produces under other keys:
                # the cast waits for what the op it precedes reads, not floating free
                reads += tuple(k for k in op.inputs if k != source)
            kernels = quantize_kernels(
                recipe, site.operand, site.rows, site.cols, site.rescaled, site.copies
            )
            for kernel in kernels:
                # one stream: each kernel waits for the one before; the last one is the copies'
                produced = done if kernel is kernels[-1] else done - 1
                flops = kernel.hadamard_flops
                transform = ((HADAMARD_FLOPS_ATTR, flops),) if flops else ()
                if kernel.cols:
                    transform += ((QUANTIZE_COLS_ATTR, kernel.cols),)
                if (
                    kernel.kind == "cast"
                    and recipe.tp_amax_reduction
                    and sequence_parallel_gather(op)
                ):
                    out.append(
                        BoundOp(
                            f"{site.before.split('.grad_', 1)[0]}.amax_all_reduce_{site.operand}",
                            NodeType.COMM_COLL,
                            reads,
                            (done - 2,),
                            comm_type=CollectiveType.ALL_REDUCE,
                            comm_size=AMAX_BYTES,
                            group_axes=op.group_axes,
                            tags=tags[site.before],
                            dtype="fp32",
                            attrs=((ROLE_ATTR, int(Role.FP8_AMAX)), (RECIPE_ATTR, recipe.name)),
                        )
                    )
                    reads = (source, done - 2)
                out.append(
                    BoundOp(
                        f"{site.before.split('.grad_', 1)[0]}.{kernel.kind}_{site.operand}",
                        NodeType.COMP,
                        reads,
                        (produced,),
                        num_ops=kernel.num_ops,
                        tensor_size=kernel.tensor_size,
                        tags=tags[site.before],
                        dtype=recipe.dtype,
                        attrs=(
                            (QUANTIZE_KERNEL_ATTR, kernel.kind),
                            (QUANTIZE_OPERAND_ATTR, site.operand),
                            (RECIPE_ATTR, recipe.name),
                            *transform,
                        ),
                    )
                )
                reads = (source, produced)
            for name in site.consumers:
                cast_of.setdefault(name, []).append(done)
            quantized[source] = (done, site)
        gathered = [quantized[k] for k in op.inputs if k in quantized]
        if op.type is NodeType.COMM_COLL and moves_quantized(op) and gathered:
            done, site = gathered[0]
            size = recipe.gathered_bytes(site.operand, site.rows, site.cols)
            attrs = (*op.attrs, (RECIPE_ATTR, recipe.name))
            inputs = (*op.inputs, done)
            op = replace(op, inputs=inputs, comm_size=size, dtype=recipe.dtype, attrs=attrs)
        gemm = any(k == "gemm" for k, _ in op.attrs)
        if gemm and op.name.split(".", 1)[0] in gemms and op.dtype == "fp8":
            extra = tuple(k for k in cast_of.get(op.name, ()) if k not in op.inputs)
            attrs = (*op.attrs, (RECIPE_ATTR, recipe.name))
            # both operands in the recipe's width (the graph counted 1-byte fp8 ones)
            batch, m, n, k = dict(op.attrs)["gemm"]
            narrower = -(-batch * (m * k + k * n) * (8 - recipe.element_bits) // 8)
            op = replace(
                op,
                inputs=(*op.inputs, *extra),
                dtype=recipe.dtype,
                attrs=attrs,
                tensor_size=op.tensor_size - narrower,
            )
        out.append(op)
    return out


def _boundary_bytes(boundary: Tensor, binder: Binder, te_recipe: bool) -> int:
    """Bytes of the hidden states a pipeline stage sends on (or the gradient it sends back):
    in a training part computing in fp8, the autocast dtype, bf16, as Megatron-LM's
    pipeline communicates them (core_v0.15.0, ``megatron/training/arguments.py``:
    ``pipeline_dtype = args.params_dtype``; ``pipeline_parallel/p2p_communication.py``: the
    receive buffers are ``torch.empty(..., dtype=config.pipeline_dtype)``)."""
    if te_recipe and boundary.dtype == "fp8":
        return binder.numel(boundary) * AUTOCAST_BYTES
    return binder.nbytes(boundary)


FSDP_COPY_OUT = "fsdp_copy_out"
"""FSDP2's copy-out after a weight all-gather: ``foreach_all_gather_copy_out`` splits the
gathered buffer into the unsharded parameters (``torch.split_with_sizes_copy``), on the compute
stream (``FSDPParamGroup.wait_for_unshard``; torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py and _fsdp_param_group.py, PyTorch 2.4-2.13)."""

FSDP_COPY_IN = "fsdp_copy_in"
"""FSDP2's reduce-scatter copy-in: ``foreach_reduce`` concatenates the unsharded gradients,
cast to the reduce dtype, into the reduce-scatter's input buffer (``torch._chunk_cat``) on the
compute stream before the reduce-scatter stream waits for it (``foreach_reduce``,
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, PyTorch 2.4-2.13)."""


def fsdp_copies(
    forward: list[BoundOp], backward: list[BoundOp]
) -> tuple[list[BoundOp], list[BoundOp]]:
    """``forward`` and ``backward`` with FSDP2's memory-bound copy kernels around its weight
    collectives (:data:`FSDP_COPY_OUT`, :data:`FSDP_COPY_IN`), one op per element written. A
    copy-out reads the gathered buffer and writes the parameters: twice the gathered bytes
    (the all-gather's shard times its flat degree); the ops that read a gathered weight wait
    for it. A copy-in reads the
    unsharded gradients, which have the parameters' dtype (MixedPrecisionPolicy's
    ``param_dtype``: the gathered dtype, bf16 under a float8 all-gather, whose gradients
    torchao keeps in the high precision), and writes the reduce-scatter's whole padded buffer
    in the reduce dtype. Both carry the tag of their collective, so they are repeated,
    dropped or held back with it."""
    copied: dict[int, int] = {}
    param_bytes: int | None = None
    for op in forward:
        if op.type is NodeType.COMM_COLL and "weight_gather" in op.tags and op.outputs:
            for k in op.outputs:
                copied[k] = -op.outputs[0] - 15  # no tensor's key (see _recipe_quantization)
            if param_bytes is None:
                param_bytes = max(DTYPE_BYTES[op.dtype or "bf16"], DTYPE_BYTES["bf16"])

    def with_copies(ops: list[BoundOp]) -> list[BoundOp]:
        out: list[BoundOp] = []
        for op in ops:
            if op.type is NodeType.COMM_COLL and "weight_grad_reduce" in op.tags and op.inputs:
                elements = op.comm_size // DTYPE_BYTES[op.dtype or "fp32"]
                width = param_bytes or DTYPE_BYTES[op.dtype or "fp32"]
                done = -op.inputs[0] - 15
                out.append(
                    BoundOp(
                        FSDP_COPY_IN,
                        NodeType.COMP,
                        op.inputs,
                        (done,),
                        num_ops=elements,  # one op per element written (the cast)
                        tensor_size=op.comm_size + elements * width,
                        tags=op.tags,
                        dtype=op.dtype,
                    )
                )
                op = replace(op, inputs=(*op.inputs, done))
            waits = tuple(dict.fromkeys(copied[k] for k in op.inputs if k in copied))
            if waits and op.type is not NodeType.COMM_COLL:
                op = replace(op, inputs=(*op.inputs, *(w for w in waits if w not in op.inputs)))
            out.append(op)
            if op.type is NodeType.COMM_COLL and "weight_gather" in op.tags and op.outputs:
                out.append(
                    BoundOp(
                        FSDP_COPY_OUT,
                        NodeType.COMP,
                        op.outputs,
                        (copied[op.outputs[0]],),
                        num_ops=op.comm_size * op.flat // DTYPE_BYTES[op.dtype or "bf16"],
                        tensor_size=2 * op.comm_size * op.flat,
                        tags=op.tags,
                        dtype=op.dtype,
                    )
                )
        return out

    return with_copies(forward), with_copies(backward)


def _recipe_collectives(
    ops: list[BoundOp],
    recipe: Recipe,
    fp8_params: bool,
    gathered_fp8: frozenset[int] = frozenset(),
) -> list[BoundOp]:
    """``ops`` of a training part computing in fp8 (built in fp8, 1 byte per element) with
    every collective that moves no quantized tensor in bf16, the autocast dtype, as
    Transformer Engine and Megatron-LM run them outside the GEMMs:

    - a row-parallel GEMM's output, reduce-scattered (sequence parallelism) or all-reduced,
      and a column-parallel GEMM's input gradient, likewise: TE's GEMMs write
      ``out_dtype=activation_dtype`` before the collective (TransformerEngine v2.9,
      ``transformer_engine/pytorch/module/linear.py``, ``_Linear.forward``:
      ``reduce_scatter_along_first_dim(out, ...)`` / ``allreduce(out, ...)``; the backward's
      ``dgrad`` likewise); so do the embedding and the output layer, no TE modules;
    - the MoE all-to-alls: the expert-parallel dispatch and combine (and their gradients)
      move the permuted hidden states, which TE's ``GroupedLinear`` quantizes only after
      they arrive (Megatron-LM core_v0.15.0, ``megatron/core/transformer/moe/
      token_dispatcher.py``, ``MoEAlltoAllTokenDispatcher.token_dispatch``: ``all_to_all``
      of the permuted ``hidden_states``; ``experts.py``, ``TEGroupedMLP.forward``), unless
      the recipe dispatches quantized copies (``fp8_dispatch``, marked by
      :func:`_recipe_quantization`);
    - context parallelism's keys and values, gathered or passed round the ring, and their
      gradients: they feed the attention core, which runs in bf16 (DotProductAttention
      without ``fp8_dpa``; TransformerEngine v2.9, ``transformer_engine/pytorch/attention/
      dot_product_attention/context_parallel.py``);
    - FSDP's weight all-gathers: the weights are bf16 parameters, or with ``fp8_params``
      (Megatron's ``--fp8-param-gather``) the fp8 rowwise copy and its block scales;
    - the gradient reductions and the distributed optimizer's parameter all-gathers: Megatron
      keeps them in the parameters' dtype, bf16 (or fp32 gradients with
      ``--accumulate-allreduce-grads-in-fp32``, stg's ``--mixed_precision``), unless the
      parameters are fp8 (core_v0.15.0, ``megatron/core/distributed/
      distributed_data_parallel.py``: ``param_dtype = param.dtype``, ``torch.uint8`` for a
      ``Float8Tensor``; ``grad_dtype = torch.float if grad_reduce_in_fp32 else param.dtype``).

    A quantized tensor is one :func:`_recipe_quantization` marked with the recipe, or under
    delayed scaling a tensor-parallel all-gather reading one of ``gathered_fp8``: TE
    quantizes a sequence-parallel GEMM input (and a row-parallel GEMM's output gradient)
    before gathering it (``_Linear.forward``: ``gather_along_first_dim(inputmat, tp_group,
    quantizer=quantizer)``), 1 byte per element."""
    out = []
    for op in ops:
        quantized = any(k == RECIPE_ATTR for k, _ in op.attrs) or (
            op.comm_type is CollectiveType.ALL_GATHER
            and op.tensor_parallel
            and any(k in gathered_fp8 for k in op.inputs)
        )
        if op.type is NodeType.COMM_COLL and op.dtype == "fp8" and not quantized:
            elements = op.comm_size // DTYPE_BYTES["fp8"]
            if fp8_params and "weight_gather" in op.tags:
                op = replace(op, comm_size=gathered_weight_bytes(recipe, elements))
            else:
                op = replace(op, comm_size=elements * AUTOCAST_BYTES, dtype=AUTOCAST_DTYPE)
        out.append(op)
    return out


DDP_BUCKET_BYTES = 25 * 2**20
"""PyTorch DDP's ``bucket_cap_mb`` default, 25 MiB (torch/nn/parallel/distributed.py)."""
DDP_FIRST_BUCKET_BYTES = 2**20
"""... and its first bucket, 1 MiB (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), so
that the first reduction starts early."""


def ddp_buckets(reduce: list[BoundOp]) -> list[BoundOp]:
    """The gradient reductions of a part in PyTorch DDP's buckets: in the reverse order of
    the weights (the order their gradients become ready in the backward), a bucket closing
    once it holds ``DDP_FIRST_BUCKET_BYTES`` (the first) or ``DDP_BUCKET_BYTES``; each bucket
    is one collective that waits only for its own gradients, so it overlaps the rest of the
    backward. For a part that is a whole network (a model without a layer stack), where one
    collective per part would start only after the whole backward."""
    bucket, filled, cap = 0, 0, DDP_FIRST_BUCKET_BYTES
    index: dict[int, object] = {}
    ordered = list(reversed(reduce))
    for op in ordered:
        if op.type is not NodeType.COMM_COLL:
            continue
        index[id(op)] = (op.comm_type, op.group_axes, bucket)
        filled += op.comm_size
        if filled >= cap:
            bucket, filled, cap = bucket + 1, 0, DDP_BUCKET_BYTES
    return fuse(ordered, lambda op: index.get(id(op)))


class LayerKinds(Sequence[str]):
    """The kind of every layer of a stack, held as runs ``(kind, count)``: a stack of 10^9
    layers costs no more memory than one of ten."""

    def __init__(self, runs: Iterable[tuple[str, int]]) -> None:
        self._kinds: list[str] = []
        self._ends: list[int] = []
        for kind, count in runs:
            if count > 0:
                self._kinds.append(kind)
                self._ends.append(count + (self._ends[-1] if self._ends else 0))

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...
    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"layer {index} of a stack of {len(self)}")
        return self._kinds[bisect.bisect_right(self._ends, index)]

    def runs(self) -> tuple[tuple[str, int], ...]:
        """``(kind, count)`` of each run of layers of one kind, in layer order."""
        starts = [0, *self._ends][:-1]  # none for a model without a layer stack
        return tuple((k, e - s) for k, s, e in zip(self._kinds, starts, self._ends, strict=True))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LayerKinds):
            return self.runs() == other.runs()
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LayerKinds({list(self.runs())!r})"


@dataclass
class ModelParts:
    """The bound parts of a model for one run: embedding, head, and one block per kind of
    layer (``blocks``; ``layer_kinds`` names the kind of every layer). ``block`` is the
    first layer's (every layer's, for a model of one block kind)."""

    embedding: BoundPart
    block: BoundPart
    head: BoundPart
    optimizer_bytes_per_param: int = 16
    optimizer_dtype: str = "fp32"
    facts: dict[str, object] = field(default_factory=dict)
    blocks: dict[str, BoundPart] = field(default_factory=dict)
    layer_kinds: Sequence[str] = ()
    saved_layer_bytes: dict[str, int] = field(default_factory=dict)
    """per block kind, the bytes one layer saves for its backward (one rank, one
    micro-batch): what CPU activation offload copies (filled only when it is on)"""

    def layer(self, index: int) -> BoundPart:
        """The bound block of layer ``index``."""
        return self.blocks[self.layer_kinds[index]] if self.layer_kinds else self.block


Env = dict[int, tuple[int, ...]]


class _RunOp(NamedTuple):
    """What :meth:`_Nodes.run` lays out for one op of a run, less where the run starts:
    the node's fields (its name less the run's prefix, its attributes less its place), the
    input keys that earlier ops of the run do not produce (looked up in the run's ``env``)
    and the earlier ops of the run that produce the others (offsets from the run's first
    node, sorted, distinct)."""

    name: str
    type: NodeType
    num_ops: int
    tensor_size: int
    comm_type: CollectiveType | None
    comm_size: int
    group_axes: tuple[str, ...]
    dtype: str | None
    attrs: dict[str, Any]
    role: int | None
    shape: int
    """how the deps are found: :data:`_AFTER_ONE_BEFORE_ONE`, :data:`_AFTER_ONE` or 0 (any
    other inputs)"""
    only_outside: int | None
    """the one input key from before the run, where there is exactly one"""
    only_inside: int
    """the one earlier op of the run it depends on, where there is exactly one"""
    outside: tuple[int, ...]
    inside: tuple[int, ...]
    outputs: tuple[int, ...]


_AFTER_ONE_BEFORE_ONE = 1
"""a run op's inputs: one key from before the run and the output of one earlier op of it"""
_AFTER_ONE = 2
"""a run op's inputs: the output of one earlier op of the run, nothing from before it"""

LOWERING_ABI_VERSION = 2
"""The version of stg/core/_lowering.c that :meth:`_Nodes.run` drives."""


def _load_lay_out() -> tuple[Any, str]:
    """The compiled loop of :meth:`_Nodes.run` (:mod:`stg.core._lowering`) and
    ``"compiled"``, or None and why the Python loop runs (``STG_LOWERING=python`` turns it
    off; so does a NodeTemplate whose fields it does not fill)."""
    module, status = load_extension("stg.core._lowering", LOWERING_ABI_VERSION, "STG_LOWERING")
    if module is None:
        return None, status
    try:
        module.setup(NodeTemplate, NodeType.COMP, NodeType.COMM_COLL, ROLE_ATTR)
    except TypeError as exc:
        return None, f"stg.core._lowering does not fit NodeTemplate: {exc}"
    return module.lay_out, status


_compiled_lay_out, _lowering_status = _load_lay_out()


def lowering_status() -> str:
    """``"compiled"``, or why lowering lays out its runs in Python."""
    if _compiled_lay_out is not None:
        return "compiled"
    return "python (turned off)" if _lowering_status == "compiled" else _lowering_status


@contextmanager
def python_lowering() -> Iterator[None]:
    """Within the block lowering lays out its runs in Python only (what the compiled loop is
    tested against)."""
    global _compiled_lay_out
    saved = _compiled_lay_out
    _compiled_lay_out = None
    try:
        yield
    finally:
        _compiled_lay_out = saved


def _run_ops(ops: Sequence[BoundOp], op_prefix: str) -> tuple[_RunOp, ...]:
    """The :class:`_RunOp` of each of ``ops``, laid out as one run."""
    producer: dict[int, int] = {}
    planned = []
    for i, op in enumerate(ops):
        attrs = dict(op.attrs)
        attrs[OP_ATTR] = op_prefix + op.name
        role = op_role(op) if op.group_axes else None
        outside = tuple(k for k in op.inputs if k not in producer)
        inside = tuple(sorted({producer[k] for k in op.inputs if k in producer}))
        shape = 0
        if len(inside) == 1 and len(outside) <= 1:
            shape = _AFTER_ONE_BEFORE_ONE if outside else _AFTER_ONE
        planned.append(
            _RunOp(
                op.name,
                op.type,
                op.num_ops,
                op.tensor_size,
                op.comm_type,
                op.comm_size,
                op.group_axes,
                op.dtype,
                attrs,
                None if role is None else int(role),
                shape,
                outside[0] if len(outside) == 1 else None,
                inside[0] if len(inside) == 1 else -1,
                outside,
                inside,
                op.outputs,
            )
        )
        for k in op.outputs:
            producer[k] = i
    return tuple(planned)


class _RunPlan(NamedTuple):
    """One run of ops laid out once: the ops (kept, so that no id of theirs is reused), each
    op's :class:`_RunOp`, and the group axes its ops name (those the nodes will carry)."""

    ops: Sequence[BoundOp]
    ops_laid_out: tuple[_RunOp, ...]
    group_axes: frozenset[tuple[str, ...]]


RunPlans = dict[tuple[tuple[int, ...], str], _RunPlan]
"""each run's :class:`_RunPlan`, by the ids of its ops and ``op_prefix``"""


@dataclass
class _Nodes:
    """Accumulates the node templates of one stage in execution order."""

    nodes: list[NodeTemplate] = field(default_factory=list)
    last_comp: int | None = None
    step_pending: int | None = None
    last_coll: dict[tuple[str, ...], int] = field(default_factory=dict)
    planned: RunPlans = field(default_factory=dict)
    """each run's ops laid out once (:func:`_run_ops`); several stages may share it"""
    group_axes: set[tuple[str, ...]] = field(default_factory=set)
    """the (non-empty) group axes of the nodes so far"""
    tuple_plans: dict[tuple[int, str], tuple[tuple[BoundOp, ...], _RunPlan]] = field(
        default_factory=dict
    )
    """the plan of each tuple of ops run so far, by the tuple's id (kept, so that the id is
    not reused) and ``op_prefix``: a tuple's ops cannot change, so they need not be looked
    up one by one"""

    def start_step(self) -> None:
        self.step_pending = self.last_comp

    def add(
        self, template_fields: dict, data_deps: Iterable[int], ctrl_deps: Iterable[int] = ()
    ) -> int:
        nid = len(self.nodes)
        deps = tuple(sorted(set(data_deps)))
        ctrl: list[int] = (
            [c for c in dict.fromkeys(ctrl_deps) if c not in deps] if ctrl_deps else []
        )
        if self.step_pending is not None:
            if self.step_pending not in deps and self.step_pending not in ctrl:
                ctrl.append(self.step_pending)
            self.step_pending = None
        node_type = template_fields["type"]
        if template_fields.get("group_axes"):
            self.group_axes.add(template_fields["group_axes"])
        if node_type is NodeType.COMM_COLL:
            axes = template_fields["group_axes"]
            previous = self.last_coll.get(axes)
            if previous is not None and previous not in deps and previous not in ctrl:
                ctrl.append(previous)
            self.last_coll[axes] = nid
        self.nodes.append(
            NodeTemplate(id=nid, data_deps=deps, ctrl_deps=tuple(ctrl), **template_fields)
        )
        if node_type is NodeType.COMP:
            self.last_comp = nid
        return nid

    def transfer(
        self,
        name: str,
        kind: NodeType,
        comm_size: int,
        peer_stage: int,
        comm_tag: int,
        attrs: dict[str, Any],
        data_deps: Iterable[int],
    ) -> int:
        """:meth:`add` of a send or receive (no group, no ctrl deps of its own, no dtype),
        without the dict of its fields."""
        nid = len(self.nodes)
        deps = tuple(sorted(set(data_deps)))
        ctrl: tuple[int, ...] = ()
        if self.step_pending is not None:
            if self.step_pending not in deps:
                ctrl = (self.step_pending,)
            self.step_pending = None
        self.nodes.append(
            NodeTemplate(  # positional, in its field order: keywords cost more
                nid,
                name,
                kind,
                deps,
                ctrl,
                0,
                0,
                None,
                comm_size,
                (),
                peer_stage,
                comm_tag,
                None,
                0,
                attrs,
            )
        )
        return nid

    def _plan(self, ops: Sequence[BoundOp], op_prefix: str) -> _RunPlan:
        """The plan of a run of ``ops``, laid out the first time they are run."""
        cache_key = (tuple(map(id, ops)), op_prefix)
        cached = self.planned.get(cache_key)
        if cached is None:
            axes = frozenset(op.group_axes for op in ops if op.group_axes)
            cached = self.planned[cache_key] = _RunPlan(ops, _run_ops(ops, op_prefix), axes)
        return cached

    def run(
        self,
        ops: Iterable[BoundOp],
        env: Env,
        prefix: str,
        after: int | None = None,
        where: Mapping[str, Any] | None = None,
        op_prefix: str = "",
        start: int | None = None,
    ) -> None:
        """Append ``ops``; ``after``: ops that depend on nothing appended here wait for that
        node (a recompute starts when the layer's gradient arrives, not during the forward);
        ``start``: so do the compute ops among them that depend on nothing at all (a part's
        work that needs no activation runs when its micro-batch reaches it; its weight
        gathers may still run ahead).
        ``where``: the typed attributes of their place (:func:`node_place`); ``op_prefix``:
        what ``prefix`` adds to the op names after the last ``/``.

        The same as :meth:`add` of each op in turn, its data deps the nodes ``env`` maps its
        inputs to (``env`` then maps its outputs to it) and ``after`` its ctrl dep, but each
        run of the same ops is planned once (:func:`_run_ops`): a node's deps on earlier
        nodes of its run are offsets, and every node ``env`` names precedes the run."""
        if type(ops) is tuple:
            known = self.tuple_plans.get((id(ops), op_prefix))
            if known is not None and known[0] is ops:
                cached = known[1]
            else:
                cached = self._plan(ops, op_prefix)
                self.tuple_plans[(id(ops), op_prefix)] = (ops, cached)
        else:
            cached = self._plan(ops if isinstance(ops, list) else tuple(ops), op_prefix)
        if cached.group_axes:
            self.group_axes |= cached.group_axes
        if not where:
            where = {}
        elif type(where) is not dict:
            where = dict(where)
        nodes = self.nodes
        first = len(nodes)
        if _compiled_lay_out is not None and type(env) is dict and type(prefix) is str:
            self.step_pending, self.last_comp = _compiled_lay_out(
                cached.ops_laid_out, env, prefix, after, start, where, first, nodes,
                self.step_pending, self.last_coll, self.last_comp,
            )  # fmt: skip
            return
        append = nodes.append
        pending = self.step_pending
        last_coll = self.last_coll
        last_comp = self.last_comp
        env_get = env.get
        new = object.__new__
        comm_coll, comp = NodeType.COMM_COLL, NodeType.COMP
        nid = first
        made: list[tuple[int]] = []  # each node of the run as its dependents name it
        made_append = made.append
        after_one_before_one, after_one = _AFTER_ONE_BEFORE_ONE, _AFTER_ONE
        for (
            name, node_type, num_ops, tensor_size, comm_type, comm_size, group_axes, dtype,
            attrs, role, shape, only_outside, only_inside, outside, inside, outputs,
        ) in cached.ops_laid_out:  # fmt: skip
            if shape == after_one_before_one:  # most ops
                found = env_get(only_outside)
                if found is None:
                    deps = made[only_inside]
                elif len(found) == 1 and type(found) is tuple:
                    deps = found + made[only_inside]
                else:
                    deps = tuple(sorted(set(found))) + made[only_inside]
                ctrl = ()
            elif shape == after_one:
                deps = made[only_inside]
                ctrl = ()
            else:
                if only_outside is not None:
                    deps = env_get(only_outside, ())
                    if len(deps) > 1 or type(deps) is not tuple:
                        deps = tuple(sorted(set(deps)))
                elif outside:
                    deps = ()
                    for k in outside:
                        found = env_get(k)
                        if found:
                            deps += found if type(found) is tuple else tuple(found)
                    # sorted and distinct: most often already (one node, or two in order)
                    if len(deps) > 2 or (len(deps) == 2 and deps[0] >= deps[1]):
                        deps = tuple(sorted(set(deps)))
                else:
                    deps = ()
                if only_inside >= 0:  # after every node before the run
                    deps += made[only_inside]
                    ctrl = ()
                elif inside:
                    deps += tuple(map(first.__add__, inside))
                    ctrl = ()
                elif after is not None and after not in deps:
                    ctrl = (after,)
                elif start is not None and not deps and node_type is comp:
                    ctrl = (start,)
                else:
                    ctrl = ()
            if pending is not None:
                if pending not in deps and pending not in ctrl:
                    ctrl += (pending,)
                pending = None
            if node_type is comm_coll:
                previous = last_coll.get(group_axes)
                if previous is not None and previous not in deps and previous not in ctrl:
                    ctrl += (previous,)
                last_coll[group_axes] = nid
            elif node_type is comp:
                last_comp = nid
            node_attrs = attrs | where
            if role is not None:
                node_attrs[ROLE_ATTR] = role
            # every field set in turn: half the time of calling the dataclass, whose
            # __init__ does nothing else (a field left out fails the equality with add's)
            node = new(NodeTemplate)
            node.id = nid
            node.name = prefix + name
            node.type = node_type
            node.data_deps = deps
            node.ctrl_deps = ctrl
            node.num_ops = num_ops
            node.tensor_size = tensor_size
            node.comm_type = comm_type
            node.comm_size = comm_size
            node.group_axes = group_axes
            node.peer_stage = None
            node.comm_tag = None
            node.dtype = dtype
            node.runtime = 0
            node.attrs = node_attrs
            append(node)
            own = (nid,)
            made_append(own)
            for k in outputs:
                env[k] = own
            nid += 1
        self.step_pending = pending
        self.last_comp = last_comp


def node_place(
    phase: Phase,
    micro_batch: int | None = None,
    part: str | int | None = None,
    step: int | None = None,
    chunk: int | None = None,
) -> dict[str, Any]:
    """The typed attributes of a node's place in the iteration (:data:`NODE_SEMANTICS`);
    ``part``: a layer index, ``layerN``, ``embedding`` or ``head``; ``step``: the serving
    step, in a run of several; ``chunk``: the model chunk of a chunk's fp8 amax reduction."""
    where: dict[str, Any] = {PHASE_ATTR: int(phase)}
    if micro_batch is not None:
        where[MICRO_BATCH_ATTR] = micro_batch
    if type(part) is int:  # a layer (part_attrs' own, without the call)
        where[LAYER_ATTR] = part
    elif part is not None:
        where.update(part_attrs(part))
    if step is not None:
        where[STEP_ATTR] = step
    if chunk is not None:
        where[CHUNK_ATTR] = chunk
    return where


def op_role(op: BoundOp) -> Role | None:
    """The role of a collective that sequence parallelism inserts: an all-gather or
    reduce-scatter over the tensor-parallel group alone."""
    if op.tensor_parallel:
        if op.comm_type is CollectiveType.ALL_GATHER:
            return Role.TP_ALL_GATHER
        if op.comm_type is CollectiveType.REDUCE_SCATTER:
            return Role.TP_REDUCE_SCATTER
    return None


def mark_param_gathers(nodes: list[NodeTemplate], first: int, step: int) -> None:
    """Give the distributed optimizer's parameter all-gathers among ``nodes[first:]`` (those
    that gather what optimizer step ``step`` updated) their role."""
    for i in range(first, len(nodes)):
        t = nodes[i]
        if t.comm_type is CollectiveType.ALL_GATHER and step in t.data_deps:
            nodes[i] = replace(t, attrs={**t.attrs, ROLE_ATTR: int(Role.PARAM_ALL_GATHER)})


def send_tag(direction: str, micro_batch: int, boundary: int, chunks: int) -> int:
    """Deterministic tag of the transfer across the boundary after chunk ``boundary``."""
    return 1 + (micro_batch * 2 + (direction == "B")) * chunks + boundary


def lower_stage(
    stage: int,
    plan: ParallelPlan,
    parts: ModelParts,
    order: list[tuple[str, int, int]],
    progress: Callable[[], None] | None = None,
    amax_axes: tuple[str, ...] = AMAX_AXES,
    run_plans: RunPlans | None = None,
    group_axes: set[tuple[str, ...]] | None = None,
) -> RankClass:
    """All node templates of one pipeline stage for one iteration; ``amax_axes``: the mesh
    axes of the fp8 amax reduction group (:mod:`stg.core.fp8`); ``run_plans``: the runs laid
    out so far, shared by the stages of one build (most run the same parts' ops);
    ``group_axes``, where given, gets the (non-empty) group axes of the stage's nodes."""
    out = _Nodes() if run_plans is None else _Nodes(planned=run_plans)
    chunks = plan.chunks
    block, emb, head = parts.block, parts.embedding, parts.head
    # per block kind and recompute mode: ops re-run before its backward
    repeats: dict[tuple[int, str], tuple[BoundOp, ...]] = {}
    saved: dict[tuple[str | int, int], Env] = {}  # (layer or part name, micro-batch) -> env
    grads: dict[str | int, dict[int, list[int]]] = {}  # layer or part name -> grad nodes
    copy_grads: list[int] = []  # nodes of a tied LM head's gradient on the embedding's stage
    final_nodes: list[int] = []
    tp_replicated: list[BoundOp] = []  # each reduced part instance's TP_REPLICATED_GRAD ops
    # backwards of each chunk left in its schedule: the last one reduces the gradients (once
    # per schedule under pipeline_flushes, as PyTorch's pipelining runs FSDP's post-backward
    # or DDP's all-reduce at the end of every schedule step)
    backwards_left: dict[int, int] = {}
    for direction, _mb, chunk in order:
        if direction == "B":
            backwards_left[chunk] = backwards_left.get(chunk, 0) + 1
    flushes = plan.options.pipeline_flushes
    per_schedule = {chunk: n // flushes for chunk, n in backwards_left.items()}
    backwards_left = dict(per_schedule)
    held = stage_parts(stage, plan, parts)
    modules = recompute_tags(plan.options)
    # the layers of each model chunk on this stage, and each layer's bound part, recompute
    # mode and recompute group: looked up once, read by every micro-batch's steps
    chunk_layers = {
        gchunk: plan.chunk_layers(gchunk)
        for gchunk in range(stage, plan.chunks_per_stage * plan.stages, plan.stages)
    }
    stage_layers = [layer for layers in chunk_layers.values() for layer in layers]
    layer_part = {layer: parts.layer(layer) for layer in stage_layers}
    layer_recompute = {layer: plan.layer_recompute(layer) for layer in stage_layers}
    recompute_group = {layer: plan.recompute_group(layer) for layer in stage_layers}
    # Transformer Engine's delayed scaling: every amax of the rank's fp8 modules (all its
    # chunks) is reduced and every history rolled at each reduction
    # (the Megatron / TE profile; eager PyTorch has no TE modules)
    fp8_gemms = sum(bp.fp8_gemms for _, bp in held) if plan.options.te_delayed_scaling else 0
    amax_group = tuple(sorted(a for a in plan.mesh_axes(amax_axes) if plan.degrees[a] > 1))
    # FSDP2 (fully_shard): the part instances whose weights are gathered now, and the nodes
    # that gathered them. Under pipeline parallelism PyTorch's pipelining keeps the weights
    # gathered after each backward and reduces the accumulated gradients once, after the
    # last one of a schedule (PipelineStage.backward_maybe_with_nosync / _post_backward),
    # then reshards: the next schedule (pipeline_flushes) gathers them again.
    gathered: dict[str | int, Env] = {}
    reshard_after_forward = plan.options.reshards_after_forward
    pipelined = plan.stages > 1
    # CPU activation offload (stg.core.offload): the copy nodes of each (layer, micro-batch)
    offloaded = plan.options.cpu_offloading_num_layers
    stack = sum(plan.layers_per_chunk)
    offloads: dict[tuple[int, int], int] = {}
    # the all-to-alls a combined step interleaves at (overlap_moe_ep_comm)
    split_at_all_to_alls = plan.options.overlap_moe_ep_comm
    # only run_combined reads what the steps and parts yield, and combined steps exist only
    # under overlap_moe_ep_comm: otherwise they run through without pausing
    pausing = split_at_all_to_alls
    # amax reductions held back to the end of a combined step (overlap_moe_ep_comm)
    deferred_amax: list[tuple[str, bool, dict[str, Any]]] | None = None
    reloads: dict[tuple[int, int], int] = {}

    def gathers_for(
        owner: str | int, bp: BoundPart, ops: Sequence[BoundOp], env: Env
    ) -> Sequence[BoundOp]:
        """``ops`` to run for ``owner``: without its weight all-gathers while its weights are
        still gathered (``env`` then gets the nodes that gathered them)."""
        held = gathered.get(owner)
        if held is None:
            return ops
        env.update(held)
        return bp.without_weight_gathers(ops, held)

    # per part (by id; ``parts`` holds them all): whether its forward gathers weights (FSDP)
    # and its weight all-gathers that a backward prefetches, each found once
    gathers: dict[int, bool] = {}
    gather_collectives: dict[int, tuple[BoundOp, ...]] = {}
    # per part (by id): its backward less the gradient reductions a micro-batch before the
    # last leaves out (it accumulates its weight gradients unsharded)
    accumulating: dict[int, tuple[BoundOp, ...]] = {}
    # each part's op lists as tuples, made once: a run finds the plan of a tuple by its id
    # (like the recompute lists above, the ops a part has when first run: nothing changes
    # a bound part's lists)
    as_tuples: dict[int, tuple[list[BoundOp], tuple[BoundOp, ...]]] = {}

    def ops_tuple(ops: list[BoundOp]) -> tuple[BoundOp, ...]:
        known = as_tuples.get(id(ops))
        if known is None:  # the list is kept, so that its id is not reused
            known = as_tuples[id(ops)] = (ops, tuple(ops))
        return known[1]

    def note_gathered(owner: str | int, bp: BoundPart, ops: Sequence[BoundOp], env: Env) -> None:
        """Keep the nodes that gathered ``owner``'s weights in ``ops`` (some of its forward)."""
        if owner in gathered:
            return
        found = gathers.get(id(bp))
        if found is None:
            found = gathers[id(bp)] = any("weight_gather" in op.tags for op in bp.forward)
        if not found:
            return
        keys = [k for op in ops if "weight_gather" in op.tags for k in op.outputs]
        if keys:
            gathered[owner] = {k: env[k] for k in keys}

    def amax_reduction(prefix: str, backward: bool, where: dict[str, Any]) -> None:
        """One reduction of the forward or backward amaxes after the kernels issued so far:
        concatenation, MAX all-reduce (none on a one-rank group), fused history and scale
        update; the compute stream waits for it (TE's all-reduce is synchronous). ``where``:
        the typed attributes of its place (:func:`node_place`). Inside a combined step it
        waits for the step's end (``deferred_amax``)."""
        if deferred_amax is not None:
            deferred_amax.append((prefix, backward, where))
            return
        elements = amax_buffer_elements(fp8_gemms, backward)
        history = plan.options.amax_history

        def attrs(op: str) -> dict[str, Any]:
            return {OP_ATTR: op, **where, ROLE_ATTR: int(Role.FP8_AMAX)}

        last = out.add(
            {
                "name": prefix + CONCAT,
                "type": NodeType.COMP,
                "num_ops": elements,
                "tensor_size": concat_bytes(elements),
                "dtype": "fp32",
                "attrs": attrs(CONCAT),
            },
            () if out.last_comp is None else (out.last_comp,),
        )
        if amax_group:
            last = out.add(
                {
                    "name": prefix + ALL_REDUCE,
                    "type": NodeType.COMM_COLL,
                    "comm_type": CollectiveType.ALL_REDUCE,
                    "comm_size": AMAX_BYTES * elements,
                    "group_axes": amax_group,
                    "dtype": "fp32",
                    "attrs": attrs(ALL_REDUCE),
                },
                (last,),
            )
        out.add(
            {
                "name": prefix + UPDATE,
                "type": NodeType.COMP,
                "num_ops": update_ops(elements, history),
                "tensor_size": update_bytes(elements, history),
                "dtype": "fp32",
                "attrs": attrs(UPDATE),
            },
            (last,),
        )
        out.start_step()

    def fp8_owners(gchunk: int) -> list[str | int]:
        """The part instances of a model chunk that hold fp8 GEMMs, in forward order."""
        owners: list[tuple[str | int, BoundPart]] = [
            (layer, layer_part[layer]) for layer in chunk_layers[gchunk]
        ]
        if gchunk == 0:
            owners.insert(0, ("embedding", emb))
        if gchunk == chunks - 1:
            owners.append(("head", head))
        return [owner for owner, bp in owners if bp.fp8_gemms]

    def forward(
        owner: str | int,
        bp: BoundPart,
        env: Env,
        prefix: str,
        where: dict[str, Any],
        after: int | None = None,
        start: int | None = None,
    ) -> Iterator[str]:
        """Forward of one part instance; its weights are gathered unless they still are.
        ``where``: the typed attributes of its place (:func:`node_place`); ``after``: a node
        it waits for (an offload that frees memory for it); ``start``: the node its compute
        that needs no input waits for (:meth:`run`). Under ``overlap_moe_ep_comm`` it pauses
        after each all-to-all (:func:`all_to_all_segments`)."""
        ops = gathers_for(owner, bp, ops_tuple(bp.forward), env)
        for segment in all_to_all_segments(ops, split_at_all_to_alls):
            out.run(segment, env, prefix, after=after, where=where, start=start)
            if pausing:
                yield PAUSE
        note_gathered(owner, bp, ops, env)
        if reshard_after_forward:
            gathered.pop(owner, None)

    def p2p(
        kind: NodeType, what: str, mb: int, boundary: int, peer: int, deps: tuple[int, ...]
    ) -> int:
        """A send or receive of the activation (F) or gradient (B) across ``boundary``."""
        direction = "F" if what == "activation" else "B"
        verb = "send" if kind is NodeType.COMM_SEND else "recv"
        phase = Phase.FORWARD if direction == "F" else Phase.BACKWARD
        op = f"{verb}_{what}_c{boundary}"
        return out.transfer(
            f"mb{mb}/{op}",
            kind,
            block.boundary_bytes,
            plan.chunk_stage(peer),
            send_tag(direction, mb, boundary, chunks),
            {OP_ATTR: op, PHASE_ATTR: int(phase), MICRO_BATCH_ATTR: mb},  # node_place's
            deps,
        )

    def host_copy(kind: NodeType, layer: int, mb: int, deps: tuple[int, ...], ctrl: int) -> int:
        """The device-to-host (MEM_STORE, after the layer's forward) or host-to-device
        (MEM_LOAD, before its backward) copy of one layer's saved activations, after the
        compute node ``ctrl``."""
        offload = kind is NodeType.MEM_STORE
        op = "activation_offload" if offload else "activation_reload"
        phase = Phase.FORWARD if offload else Phase.BACKWARD
        return out.add(
            {
                "name": f"mb{mb}/layer{layer}/{'fwd' if offload else 'bwd'}/{op}",
                "type": kind,
                "tensor_size": parts.saved_layer_bytes[parts.layer_kinds[layer]]
                if parts.layer_kinds
                else next(iter(parts.saved_layer_bytes.values())),
                "dtype": None,
                "attrs": {OP_ATTR: op, **node_place(phase, mb, layer)},
            },
            deps,
            (ctrl,),
        )

    def rerun(
        owner: str | int,
        bp: BoundPart,
        env: Env,
        prefix: str,
        repeated: Sequence[BoundOp],
        dy: int | None,
        mb: int,
    ) -> None:
        """The forward ops of one part instance run again before its backward (of
        micro-batch ``mb``), once the gradient ``dy`` has arrived (a recompute starts then,
        not during the forward)."""
        repeated = gathers_for(owner, bp, repeated, env)
        if not repeated:  # nothing recomputed (gathered weights are still handed over)
            return
        out.run(
            repeated,
            env,
            f"{prefix}recompute/",
            after=dy if dy is not None else out.last_comp,
            where=node_place(Phase.RECOMPUTE, mb, owner),
        )
        note_gathered(owner, bp, repeated, env)

    def prefetch(owner: str | int, bp: BoundPart, mb: int, after: int | None) -> None:
        """The FSDP weight gathers of the part whose backward comes next, issued from the
        pre-backward of the part before it (after ``after``), so that on the data-parallel
        communicator they come ahead of that part's gradient reduce-scatter: FSDP2's default
        backward prefetch (``FSDPParamGroup.pre_backward`` calls ``_backward_prefetch``, which
        unshards the next group in reverse post-forward order: PyTorch v2.4.0,
        torch/distributed/_composable/fsdp/_fsdp_param_group.py). Nothing where its weights
        are still gathered."""
        if owner in gathered or (owner, mb) not in saved:
            return
        ops = gather_collectives.get(id(bp))
        if ops is None:
            ops = gather_collectives[id(bp)] = tuple(
                op
                for op in bp.forward
                if "weight_gather" in op.tags and op.type is NodeType.COMM_COLL
            )
        if not ops:
            return
        env = saved[(owner, mb)]
        where = node_place(Phase.RECOMPUTE, mb, owner)
        name = f"layer{owner}" if isinstance(owner, int) else owner
        out.run(ops, env, f"mb{mb}/{name}/recompute/", after=after, where=where)
        note_gathered(owner, bp, ops, env)

    def backward(
        owner: str | int,
        bp: BoundPart,
        mb: int,
        prefix: str,
        dy: int | None,
        repeated: Sequence[BoundOp],
        reduce_now: bool,
        amax_after: str | None = None,
        ahead: bool = False,
        following: tuple[str | int, BoundPart] | None = None,
        gchunk: int = 0,
    ) -> Generator[str, None, int | None]:
        """Backward of one part instance; returns the node of the gradient it passes on.
        ``amax_after``: the name prefix of the backward amax reduction that follows it;
        ``ahead``: its forward was recomputed already, with the rest of its recompute group
        (``repeated`` then holds no forward op); ``following``: the part whose backward comes
        next, whose weight gathers it prefetches (:func:`prefetch`); ``gchunk``: the model
        chunk it belongs to. Under ``overlap_moe_ep_comm`` it pauses after each all-to-all."""
        env = saved.pop((owner, mb))
        load = reloads.pop((owner, mb), None) if isinstance(owner, int) else None
        if load is not None:  # the backward reads the reloaded copies of its saved tensors
            made = [k for op in bp.forward if "weight_gather" not in op.tags for k in op.outputs]
            env.update((k, (load,)) for k in (bp.input_key, *made) if k in env)
        part = owner
        back = node_place(Phase.BACKWARD, mb, part)
        rerun(owner, bp, env, prefix, repeated, dy, mb)
        if following is not None:
            prefetch(*following, mb, dy if dy is not None else out.last_comp)
        # a micro-batch before the last accumulates its weight gradients unsharded
        accumulate = pipelined and not reduce_now

        def ops(run: Sequence[BoundOp]) -> Sequence[BoundOp]:
            if not accumulate:
                return run
            if run is not bp.backward:
                return [op for op in run if "weight_grad_reduce" not in op.tags]
            kept = accumulating.get(id(bp))
            if kept is None:
                kept = accumulating[id(bp)] = tuple(
                    op for op in run if "weight_grad_reduce" not in op.tags
                )
            return kept

        recomputed = fp8_gemms > 0 and isinstance(owner, int)
        recomputed = recomputed and layer_recompute[owner] == "full"  # type: ignore[index]
        if recomputed and not ahead:  # the recompute forward's autocast exits: a reduction
            amax_reduction(f"{prefix}recompute/", False, node_place(Phase.RECOMPUTE, mb, part))
        if dy is not None:
            env[bp.seed_key] = (dy,)  # type: ignore[index]
        if recomputed:  # each recomputed fp8 module reduces after its backward
            start = 0
            for end in bp.fp8_module_ends():
                out.run(ops(bp.backward[start : end + 1]), env, f"{prefix}bwd/", where=back)
                amax_reduction(f"{prefix}bwd/", True, back)
                start = end + 1
            out.run(ops(bp.backward[start:]), env, f"{prefix}bwd/", where=back)
        else:
            whole = ops(bp.backward) if accumulate else ops_tuple(bp.backward)
            for segment in all_to_all_segments(whole, split_at_all_to_alls):
                out.run(segment, env, f"{prefix}bwd/", where=back)
                if pausing:
                    yield PAUSE
        if reduce_now or not pipelined:  # resharded after its backward
            gathered.pop(owner, None)
        if amax_after is not None:  # the first fp8 module of the chunk's autocast
            amax_reduction(amax_after, True, node_place(Phase.BACKWARD, mb, chunk=gchunk))
        store = grads.get(owner)
        if store is None:
            store = grads[owner] = {k: [] for k in bp.grad_keys}
        for k in bp.grad_keys:
            found = env.get(k)
            if found:
                store[k].extend(found)
        if owner == "head":
            copy_grads.extend(n for k in bp.tied_keys for n in env.get(k, ()))
        if reduce_now:
            tp_replicated.extend(bp.tp_replicated_reduce)
            reduce_env: Env = {k: tuple(v) for k, v in grads.pop(owner).items()}
            if owner == "embedding" and copy_grads:  # the tied head's gradient adds first
                for k in bp.tied_keys:
                    reduce_env[k] = (*reduce_env.get(k, ()), *copy_grads)
            if bp.reduce:
                name = prefix.split("/", 1)[1]
                out.run(
                    bp.reduce,
                    reduce_env,
                    f"{name}grad_",
                    where=node_place(Phase.BACKWARD, part=part),
                    op_prefix="grad_",
                )
                final_nodes.extend(reduce_env[op.outputs[0]][0] for op in bp.reduce)
            else:
                final_nodes.extend(n for nodes in reduce_env.values() for n in nodes)
        return env[bp.grad_input_key][0] if bp.grad_input_key is not None else None

    def schedule_step(direction: str, mb: int, chunk: int) -> Iterator[str]:
        """The nodes of one schedule step, one part at a time: it yields ``PART_END`` after
        the step's prelude (the embedding or head part, or the receive) and after each layer,
        ``PAUSE`` after each all-to-all of a layer (under ``overlap_moe_ep_comm``), then runs
        to its end (the other end part, or the send)."""
        gchunk = chunk * plan.stages + stage
        first, last = gchunk == 0, gchunk == chunks - 1
        out.start_step()
        owners = fp8_owners(gchunk) if fp8_gemms else []
        region = f"mb{mb}/chunk{gchunk}/"
        if direction == "F":
            # the chunk's autocast exits after its last fp8 module: the forward reduction
            region_end = owners[-1] if owners else None
            region_place = node_place(Phase.FORWARD, mb, chunk=gchunk)
            if first:
                env: Env = {}
                yield from forward(
                    "embedding",
                    emb,
                    env,
                    f"mb{mb}/embedding/",
                    node_place(Phase.FORWARD, mb, "embedding"),
                )
                saved[("embedding", mb)] = env
                x = env[emb.output_key][0]  # type: ignore[index]
                if region_end == "embedding":
                    amax_reduction(f"{region}fwd/", False, region_place)
            else:
                x = p2p(NodeType.COMM_RECV, "activation", mb, gchunk - 1, gchunk - 1, ())
            if pausing:
                yield PART_END
            for layer in chunk_layers[gchunk]:
                bp = layer_part[layer]
                env = {bp.input_key: (x,)}  # type: ignore[dict-item]
                freed = offload_finished_before(layer, stack, offloaded) if offloaded else None
                yield from forward(
                    layer,
                    bp,
                    env,
                    f"mb{mb}/layer{layer}/fwd/",
                    node_place(Phase.FORWARD, mb, layer),
                    None if freed is None else offloads[(freed, mb)],
                )
                saved[(layer, mb)] = env
                if layer < offloaded:
                    assert out.last_comp is not None
                    offloads[(layer, mb)] = host_copy(
                        NodeType.MEM_STORE, layer, mb, (out.last_comp,), out.last_comp
                    )
                x = env[bp.output_key][0]  # type: ignore[index]
                if region_end == layer:
                    amax_reduction(f"{region}fwd/", False, region_place)
                if pausing:
                    yield PART_END
            if last:
                env = {head.input_key: (x,)}  # type: ignore[dict-item]
                # what needs no activation (the multi-token prediction's embedding of the
                # shifted tokens) still runs once the micro-batch reaches the head
                yield from forward(
                    "head",
                    head,
                    env,
                    f"mb{mb}/head/fwd/",
                    node_place(Phase.FORWARD, mb, "head"),
                    start=x,  # type: ignore[arg-type]
                )
                saved[("head", mb)] = env
                if region_end == "head":
                    amax_reduction(f"{region}fwd/", False, region_place)
            else:
                p2p(NodeType.COMM_SEND, "activation", mb, gchunk, gchunk + 1, (x,))
        else:
            backwards_left[chunk] -= 1
            reduce_now = backwards_left[chunk] == 0  # the chunk's last micro-batch of a schedule
            if reduce_now:
                backwards_left[chunk] = per_schedule[chunk]
            # the backward of the chunk's first fp8 module ends with the backward reduction
            # (under full recompute each recomputed module reduces itself instead)
            first_fp8 = owners[0] if owners else None
            if isinstance(first_fp8, int) and layer_recompute[first_fp8] == "full":
                first_fp8 = None
            bwd_region = f"{region}bwd/"

            # the parts in backward order, each prefetching the gathers of the next
            backward_order: list[tuple[str | int, BoundPart]] = [
                (layer, layer_part[layer]) for layer in reversed(chunk_layers[gchunk])
            ]
            if first:
                backward_order.append(("embedding", emb))
            if last:
                dy = yield from backward(
                    "head",
                    head,
                    mb,
                    f"mb{mb}/head/",
                    None,
                    head.repeated_before_backward("none"),
                    reduce_now,
                    bwd_region if first_fp8 == "head" else None,
                    following=backward_order[0] if backward_order else None,
                    gchunk=gchunk,
                )
            else:
                dy = p2p(NodeType.COMM_RECV, "gradient", mb, gchunk, gchunk + 1, ())
            if pausing:
                yield PART_END
            ahead: set[int] = set()  # layers whose recompute group ran already
            for index, layer in enumerate(reversed(chunk_layers[gchunk])):
                bp = layer_part[layer]
                back = reload_started_before(layer, stack, offloaded) if offloaded else None
                if back is not None:  # after the compute issued so far
                    assert out.last_comp is not None
                    reloads[(back, mb)] = host_copy(
                        NodeType.MEM_LOAD, back, mb, (offloads.pop((back, mb)),), out.last_comp
                    )
                mode = "none" if layer in ahead else layer_recompute[layer]
                if (id(bp), mode) not in repeats:
                    repeats[(id(bp), mode)] = tuple(bp.repeated_before_backward(mode, modules))
                group = recompute_group[layer]
                if len(group) > 1 and layer == group[-1]:
                    # Megatron's uniform method: the group's forward runs again from its
                    # checkpointed input before the backward of its last layer
                    x = None
                    for earlier in group[:-1]:
                        ebp = layer_part[earlier]
                        env = saved[(earlier, mb)]
                        if x is not None:
                            env[ebp.input_key] = (x,)  # type: ignore[index]
                        rerun(
                            earlier,
                            ebp,
                            env,
                            f"mb{mb}/layer{earlier}/",
                            ops_tuple(ebp.repeated_before_backward("full")),
                            dy,
                            mb,
                        )
                        x = env[ebp.output_key][0]  # type: ignore[index]
                        ahead.add(earlier)
                    saved[(layer, mb)][bp.input_key] = (x,)  # type: ignore[index]
                dy = yield from backward(
                    layer,
                    bp,
                    mb,
                    f"mb{mb}/layer{layer}/",
                    dy,
                    repeats[(id(bp), mode)],
                    reduce_now,
                    bwd_region if first_fp8 == layer else None,
                    ahead=layer in ahead,
                    following=(
                        backward_order[index + 1] if index + 1 < len(backward_order) else None
                    ),
                    gchunk=gchunk,
                )
                if pausing:
                    yield PART_END
            if first:
                yield from backward(
                    "embedding",
                    emb,
                    mb,
                    f"mb{mb}/embedding/",
                    dy,
                    emb.repeated_before_backward("none"),
                    reduce_now,
                    bwd_region if first_fp8 == "embedding" else None,
                    gchunk=gchunk,
                )
            else:
                assert dy is not None
                p2p(NodeType.COMM_SEND, "gradient", mb, gchunk - 1, gchunk - 1, (dy,))
        if progress is not None:
            progress()

    if plan.options.overlap_moe_ep_comm:
        groups = ep_overlap_groups(order)
    else:
        groups = [(one,) for one in order]
    for group in groups:
        if len(group) == 1:
            for _ in schedule_step(*group[0]):
                pass
        else:
            # Megatron-core wraps a combined step in one fp8 autocast under delayed scaling
            # (combined_forward_backward_step, combined_1f1b.py): its amax reductions follow
            # the whole step, so neither micro-batch's compute waits for the other's
            fwd, bwd = group
            deferred_amax = []
            run_combined(
                schedule_step(*fwd),
                schedule_step(*bwd),
                len(chunk_layers[fwd[2] * plan.stages + stage]),
                len(chunk_layers[bwd[2] * plan.stages + stage]),
            )
            held_back, deferred_amax = deferred_amax, None
            for args in held_back:
                amax_reduction(*args)

    by_group: dict[tuple[object, ...], list[BoundOp]] = {}
    for op in tp_replicated:
        by_group.setdefault((op.comm_type, op.group_axes), []).append(op)
    reduced = list(final_nodes)
    for members in by_group.values():
        final_nodes.append(out.add(_tp_replicated_all_reduce(members), reduced))
    updated = sum(bp.optimizer_parameters for _, bp in held)
    # num_ops and tensor_size are both proportional to ``updated``: a stage with nothing to
    # update gets a free node (tensor_size 0), never 0 ops over > 0 bytes (ASTRA-sim's roofline)
    out.start_step()
    muon = merge(m for _, bp in held for m in bp.muon)
    orthogonalized = _newton_schulz(out, muon, plan.options.muon_ns_steps, final_nodes)
    muon_held, muon_shared = held_and_shared(muon)
    # Muon's parameters keep one state where Adam keeps two: a read and a write less
    muon_updated = min(updated, round(muon_shared))
    step_bytes = updated * parts.optimizer_bytes_per_param
    step_bytes -= muon_updated * 2 * DTYPE_BYTES[parts.optimizer_dtype]
    step = out.add(
        {
            "name": "optimizer_step",
            "type": NodeType.COMP,
            "num_ops": OPTIMIZER_FLOPS_PER_PARAM * updated,
            "tensor_size": step_bytes,
            "dtype": parts.optimizer_dtype,
            "attrs": {
                OP_ATTR: "optimizer_step",
                **node_place(Phase.OPTIMIZER),
                ROLE_ATTR: int(Role.OPTIMIZER_STEP),
            },
        },
        [*final_nodes, *orthogonalized],
    )
    for prefix, bp in held:
        if bp.update:
            first_update = len(out.nodes)
            out.run(
                bp.update,
                {k: (step,) for op in bp.update for k in op.inputs},
                prefix,
                where=node_place(Phase.OPTIMIZER, part=prefix.rstrip("/")),
            )
            mark_param_gathers(out.nodes, first_update, step)
    if group_axes is not None:
        group_axes.update(out.group_axes)
    return RankClass(
        index=stage,
        stage=stage,
        nodes=tuple(out.nodes),
        facts={
            "parameters": sum(bp.parameters for _, bp in held),
            # ZeRO / FSDP: the replica's parameters and this rank's padded flat shard of them
            # (its optimizer states; also its gradients with ZeRO-2 and weights with ZeRO-3)
            "replica_parameters": sum(bp.replica_parameters for _, bp in held),
            # the matrix elements Muon updates (--optimizer muon): held, and this rank's share
            # under the layer-wise distributed optimizer
            "muon_parameters": muon_held,
            "muon_shard_parameters": round(muon_shared),
            "shard_parameters": updated,
            "layers": sum(1 for prefix, _ in held if prefix.startswith("layer")),
            # layers of each block kind on this stage (one kind, "block", for most models)
            "layer_kinds": _count_kinds(stage, plan, parts),
            "has_embedding": any(bp is emb for _, bp in held),
            "has_head": any(bp is head for _, bp in held),
            "micro_batches": plan.micro_batches,
            **_weight_copy_fact(held),
            **parts.facts,
        },
    )


def _newton_schulz(
    out: Any, muon: Sequence[MuonMatrices], steps: int, deps: Sequence[int]
) -> list[int]:
    """Muon's orthogonalization of a stage's matrices (:mod:`stg.core.muon`), after its
    gradient reductions (``deps``): per group of axes that split matrices, one all-gather of
    their fp32 momentum; per shape, the normalisation and casts and the three GEMMs of its
    Newton-Schulz iterations, each a kernel per matrix and iteration, this rank's share of
    them. The ids of the last node of each shape (what the optimizer step waits for)."""
    place = node_place(Phase.OPTIMIZER)
    gathered: dict[tuple[str, ...], int] = {}
    for axes in sorted({x.gather_axes for x in muon if x.gather_axes}):
        size = sum(x.gather_bytes for x in muon if x.gather_axes == axes)
        gathered[axes] = out.add(
            {
                "name": f"muon_momentum_all_gather_{'_'.join(axes)}",
                "type": NodeType.COMM_COLL,
                "comm_type": CollectiveType.ALL_GATHER,
                "comm_size": size,
                "group_axes": axes,
                "dtype": "fp32",
                "attrs": {
                    OP_ATTR: "muon_momentum_all_gather",
                    ROLE_ATTR: int(Role.ORTHOGONALIZE),
                    **place,
                },
            },
            deps,
        )
    last = []
    for x in muon:
        runs = x.count * steps
        extra = {SHARE_ATTR: x.share} if x.degree > 1 else {}
        elements = x.count * x.m * x.n
        prev = out.add(
            {
                "name": f"muon_normalize_{x.m}x{x.n}",
                "type": NodeType.COMP,
                "num_ops": round(3 * elements * x.share),
                "tensor_size": round(NORMALIZE_BYTES_PER_ELEMENT * elements * x.share),
                "dtype": "fp32",
                "attrs": {
                    OP_ATTR: "muon_normalize",
                    ROLE_ATTR: int(Role.ORTHOGONALIZE),
                    LAUNCHES_ATTR: NORMALIZE_KERNELS * x.count,
                    **extra,
                    **place,
                },
            },
            [gathered[x.gather_axes]] if x.gather_axes else deps,
        )
        gemms = (("gram", x.m, x.m, x.n), ("square", x.m, x.m, x.m), ("update", x.m, x.n, x.m))
        for role, m, n, k in gemms:
            prev = out.add(
                {
                    "name": f"muon_{role}_{x.m}x{x.n}",
                    "type": NodeType.COMP,
                    "num_ops": round(2 * runs * m * n * k * x.share),
                    "tensor_size": round(runs * 2 * (m * k + k * n + m * n) * x.share),
                    "dtype": "bf16",
                    "attrs": {
                        OP_ATTR: f"muon_{role}",
                        ROLE_ATTR: int(Role.ORTHOGONALIZE),
                        "gemm": (runs, m, n, k),
                        LAUNCHES_ATTR: runs,
                        **extra,
                        **place,
                    },
                },
                [prev],
            )
        last.append(prev)
    return last


def _tp_replicated_all_reduce(members: list[BoundOp]) -> dict[str, Any]:
    """The node fields of a stage's one all-reduce over the tensor-parallel group of the
    gradients of the weights replicated over it (``members``: each part instance's, all of one
    kind and group), after
    every data-parallel reduction of the stage and before its optimizer step, as
    Megatron-LM's ``finalize_model_grads`` runs ``_allreduce_non_tensor_model_parallel_grads``
    after ``finish_grad_sync`` (core_v0.15.0): one coalesced buffer of all of them."""
    first = members[0]
    op = f"grad_all_reduce_{'_'.join(first.group_axes)}_replicated"  # its name: no op written
    return {
        "name": op,
        "type": NodeType.COMM_COLL,
        "comm_type": first.comm_type,
        "comm_size": _fused_comm_size(members),
        "group_axes": first.group_axes,
        "dtype": first.dtype,
        "attrs": {OP_ATTR: op, **node_place(Phase.BACKWARD)},
    }


PAUSE = "pause"
"""What a schedule step's generator yields after an all-to-all (and after each part)."""
PART_END = "part"
"""What a schedule step's generator yields after its prelude and after each layer."""


def all_to_all_segments(ops: Sequence[BoundOp], split: bool) -> list[Sequence[BoundOp]]:
    """``ops`` cut after each all-to-all (the MoE dispatch and combine) where ``split``, so
    that a combined step can lay out the other micro-batch's work between them; else whole."""
    if not split:
        return [ops]
    segments: list[list[BoundOp]] = [[]]
    for op in ops:
        segments[-1].append(op)
        if op.comm_type is CollectiveType.ALL_TO_ALL:
            segments.append([])
    return [segment for segment in segments if segment]


def run_combined(
    forward: Iterator[str], backward: Iterator[str], forward_layers: int, backward_layers: int
) -> None:
    """Lay out a forward step and a backward step of other micro-batches as one combined step
    (Megatron-core's ``TransformerModelChunkSchedulePlan.run`` and
    ``TransformerLayerSchedulePlan.run``, the schedule of ``--overlap-moe-expert-parallel-comm``):
    both preludes, then forward layer ``i`` beside backward layer ``L - 1 - i``, the unpaired
    layers, and both ends. Within a pair the two alternate at each all-to-all, backward first,
    as Megatron issues them: the backward's combine, the forward's compute up to its dispatch,
    the backward's expert MLP and dispatch, the forward's expert MLP and combine, then the
    rest of each. On the expert-parallel communicator that is Megatron's order (combine
    backward, dispatch forward, dispatch backward, combine forward), and each micro-batch's
    compute runs while the other's all-to-all moves (data deps only, no step barrier).
    ``forward`` and ``backward`` yield ``PAUSE`` after each all-to-all and ``PART_END`` after
    their prelude and after each layer."""

    def to_part_end(step: Iterator[str]) -> None:
        while next(step) != PART_END:
            pass

    to_part_end(forward)
    to_part_end(backward)
    paired = min(forward_layers, backward_layers)
    for _ in range(paired):
        forward_done = backward_done = False
        while not (forward_done and backward_done):
            if not backward_done:
                backward_done = next(backward) == PART_END
            if not forward_done:
                forward_done = next(forward) == PART_END
    for _ in range(backward_layers - paired):
        to_part_end(backward)
    for _ in range(forward_layers - paired):
        to_part_end(forward)
    for _ in forward:
        pass
    for _ in backward:
        pass


def _weight_copy_fact(held: list[tuple[str, BoundPart]]) -> dict[str, int]:
    """``low_precision_weight_bytes``: the quantized weight copies of a recipe that a rank of
    the stage keeps (none under the default recipe, whose traces keep their bytes), and
    ``low_precision_weight_scale_bytes``: their scales (kept whole where one copy serves both
    usages, ``stg.predictors.memory.stated_weight_copy_bytes``)."""
    copies = sum(bp.weight_copy_bytes for _, bp in held)
    if not copies:
        return {}
    scales = sum(bp.weight_scale_bytes for _, bp in held)
    return {"low_precision_weight_bytes": copies, "low_precision_weight_scale_bytes": scales}


def stage_parts(stage: int, plan: ParallelPlan, parts: ModelParts) -> list[tuple[str, BoundPart]]:
    """(name prefix, part) of every part instance a rank of ``stage`` holds, in model order."""
    out: list[tuple[str, BoundPart]] = []
    if stage == 0:
        out.append(("embedding/", parts.embedding))
    for chunk in range(plan.chunks_per_stage):
        out.extend(
            (f"layer{layer}/", parts.layer(layer))
            for layer in plan.chunk_layers(chunk * plan.stages + stage)
        )
    if plan.chunk_stage(plan.chunks - 1) == stage:
        out.append(("head/", parts.head))
    return out


def _count_kinds(stage: int, plan: ParallelPlan, parts: ModelParts) -> dict[str, int]:
    counts: dict[str, int] = {}
    for chunk in range(plan.chunks_per_stage):
        for layer in plan.chunk_layers(chunk * plan.stages + stage):
            kind = parts.layer_kinds[layer] if parts.layer_kinds else "block"
            counts[kind] = counts.get(kind, 0) + 1
    return counts
