"""Serving workloads: prefill, decode and mixed (continuously batched) iterations.

The same model templates as training, built forward only. What changes is in the core:

- **KV cache.** A builder of a serving phase carries a :class:`KVCache`. An einsum that pairs
  two different sequence letters (attention scores ``q · k``: ``bsak,btak->bast``) reads its
  second operand from the cache: the new keys are appended (a ``kv_append`` op, fused into
  the attention kernel as ``flash_attn_with_kvcache`` does) and the einsum sees a key/value
  length ``seq_kv`` (:data:`KVSeq`) instead of the query length ``seq``. The einsum that
  contracts ``seq_kv`` with a tensor of ``seq`` rows (``probs · v``) reads the values from
  the cache the same way. Under causal masking (``--causal true``) the attention einsums
  compute the exact fraction of (query, key) pairs a chunk of ``s`` new tokens after
  ``kv - s`` cached ones sees: ``(kv - (s-1)/2) / kv`` (1 for a decode step).
- **Positions.** A weight with a ``seq`` dimension (learned position embeddings) is stored
  for every position of the longest sequence (:data:`Positions`) and read at the current
  positions only: a mixed iteration reads the rows at the distinct positions of both groups'
  new tokens once (:func:`read_once_bytes`).
- **Lengths.** Each step binds the same symbolic graph to its own lengths: the query length
  (``seq``: the prompt, a prefill chunk, or 1), the key/value length, and a batch. A mixed
  iteration binds it twice (the prefilling requests and the decoding ones) and merges the
  two op by op (:func:`merge_bound`): one GEMM over the tokens of both, one collective, one
  attention kernel per group.
- **Head.** The LM head (and the model's last op, which stands for sampling) runs on the last
  position of each sequence only, as serving engines do.
- **Schedule.** Forward only: per step, each micro-batch runs embedding, layers and head;
  pipeline stages pass activations forward and the last stage sends the sampled tokens back
  to the first for the next decode step. No backward, gradient collective or optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import sympy

from stg.core.layout import Layout
from stg.core.lowering import (
    Binder,
    BoundOp,
    BoundPart,
    LayerKinds,
    ModelParts,
    _count_kinds,
    _Nodes,
    bind_part,
    key,
    node_place,
    stage_parts,
)
from stg.core.options import GenerateOptions, OptionError, ReadOptions, check_options_read
from stg.core.plan import MAX_TAG, ParallelPlan
from stg.core.precision import normalize_plan
from stg.core.routing import ACTIVE_EXPERTS_ATTR, EXPERT_WEIGHT_BYTES_ATTR, active_expert_share
from stg.core.sharding import Sharding
from stg.core.symbolic import (
    STANDARD_DIMS,
    AttentionSpan,
    Capacity,
    Dim,
    GraphBuilder,
    Op,
    Part,
    Seq,
    Tensor,
)
from stg.core.workload import OP_ATTR, NodeType, Phase, RankClass, RankGraph, Workload
from stg.errors import UserError
from stg.host.records import Model

KVSeq = sympy.Symbol("seq_kv", integer=True, positive=True)
"""Keys and values an attention step reads: cached tokens plus the new ones."""
Positions = sympy.Symbol("positions", integer=True, positive=True)
"""Positions a position-indexed weight holds: the longest sequence of the run."""

KV_DIM = Dim("seq_kv", KVSeq)
POSITIONS_DIM = Dim("positions", Positions)
TOKEN_ID_BYTES = 4
"""Bytes of one token id sent back to the first pipeline stage (int32, as tokens are read)."""

EXPERTS = STANDARD_DIMS["experts"]
"""The dimension a mixture's routed experts are split by."""


class KVCache:
    """The serving hook of a :class:`GraphBuilder` (see the module docstring)."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self._cache: dict[int, Tensor] = {}
        self.declared = False
        """the part declared its cached state (:meth:`GraphBuilder.cached`): no generic rule"""

    def attend(
        self,
        b: GraphBuilder,
        in_letters: Sequence[str],
        operands: tuple[Tensor, ...],
        scale: sympy.Expr | int,
        span: AttentionSpan | None = None,
    ) -> tuple[tuple[Tensor, ...], sympy.Expr | int]:
        bound = [
            dict(zip(letters, t.dims, strict=False))
            for letters, t in zip(in_letters, operands, strict=True)
        ]
        kv_letters = {ltr for m in bound for ltr, d in m.items() if d.name == KV_DIM.name}
        if not kv_letters:  # scores: a sequence letter of a later operand not in the first
            query = {ltr for ltr, d in bound[0].items() if d.name == "seq"}
            if not query:
                return operands, scale
            kv_letters = {
                ltr
                for m in bound[1:]
                for ltr, d in m.items()
                if d.name == "seq" and ltr not in query
            }
        if not kv_letters:
            return operands, scale
        if self.declared:  # the model wrote its attention on the cache it declared
            resolved = operands
        else:
            resolved = tuple(
                self._from_cache(b, t, span=span)
                if any(m.get(ltr, KV_DIM).name == "seq" for ltr in kv_letters)
                else t
                for m, t in zip(bound, operands, strict=True)
            )
        if span is not None:  # the pairs the new tokens see, of the keys the layer keeps
            seen = span.seen(KVSeq) - span.seen(KVSeq - Seq)
            scale = seen / (Seq * span.keys(KVSeq, Seq))
        elif sympy.sympify(scale) != 1:  # causal: the pairs a chunk of new tokens sees
            scale = (KVSeq - (Seq - 1) / sympy.Integer(2)) / KVSeq
        return resolved, scale

    def state(self, b: GraphBuilder, t: Tensor, name: str) -> Tensor:
        """``t`` declared the cached state of attention (:meth:`GraphBuilder.cached`): its new
        rows appended to the cache; the cache, ``seq_kv`` long."""
        if sum(d.name == "seq" for d in t.dims) != 1:
            raise UserError(
                f"cached({name}): a cached tensor has one row per token (one 'seq' "
                f"dimension); {t!r} has dimensions {', '.join(d.name for d in t.dims)}"
            )
        self.declared = True
        return self._from_cache(b, t, name)

    def _from_cache(
        self,
        b: GraphBuilder,
        t: Tensor,
        name: str | None = None,
        span: AttentionSpan | None = None,
    ) -> Tensor:
        """``t`` (new keys or values) appended to the cache: the cache, ``seq_kv`` long, or
        as long as the keys a ``span`` lets the new tokens see (all that layer keeps)."""
        cached = self._cache.get(id(t.base or t))
        if cached is not None:
            return cached
        name = name or t.name
        new = b.unpartial(t)
        kv = KV_DIM if span is None else Dim(KV_DIM.name, span.keys(KVSeq, Seq))
        dims = tuple(kv if d.name == "seq" else d for d in new.dims)
        cache = Tensor(f"{name}_cache", dims, new.sharding, self.dtype, kind="cache")
        b._emit(Op("kv_append", f"{name}.cache_append", (new,), cache))
        self._cache[id(t.base or t)] = cache
        return cache

    def position_weight(
        self,
        b: GraphBuilder,
        name: str,
        dims: tuple[Dim, ...],
        shard: Mapping[str, Iterable[str] | str],
    ) -> Tensor:
        stored_dims = tuple(POSITIONS_DIM if d.name == "seq" else d for d in dims)
        sharding = Sharding(tuple(b._axes(shard.get(d.name)) for d in dims))
        stored = Tensor(b._unique(name), stored_dims, sharding, b.weight_dtype, kind="weight")
        b.part.weights.append(stored)
        return b.reinterpret(stored, dims, sharding, f"{name}.positions")


# ---------------------------------------------------------------------------------------------
# Lengths of a run


@dataclass(frozen=True)
class Group:
    """Sequences of one step that share their lengths: ``batch`` sequences (global, per
    micro-batch) of ``query`` new tokens each, attending to ``kv`` tokens."""

    name: str
    batch: int
    query: int
    kv: int


def context_of(o: GenerateOptions) -> int:
    """Tokens cached before a decode step (``--context``, default ``--seq``)."""
    return o.context if o.context is not None else o.seq


def chunk_of(o: GenerateOptions) -> int:
    """New prompt tokens of each prefilling request of a mixed iteration."""
    return o.chunk if o.chunk is not None else o.seq


def step_groups(o: GenerateOptions) -> list[list[Group]]:
    """The groups of each step of a serving run (one micro-batch's sequences)."""
    micro = o.micro_batch or o.batch
    if o.phase == "prefill":
        return [[Group("prefill", micro, o.seq, o.seq)]]
    if o.phase == "decode":
        return [[Group("decode", micro, 1, context_of(o) + i)] for i in range(1, o.steps + 1)]
    chunk = chunk_of(o)
    return [
        [
            Group("prefill", o.prefill_batch, chunk, o.prefill_context + chunk),
            Group("decode", o.batch, 1, context_of(o) + 1),
        ]
    ]


def max_positions(o: GenerateOptions) -> int:
    """The longest sequence of the run: what position-indexed weights hold."""
    return max(g.kv for step in step_groups(o) for g in step)


def new_tokens(o: GenerateOptions) -> int:
    """Tokens the whole run processes (all replicas): prompt tokens, or one per decoding
    sequence and step."""
    return sum(g.batch * g.query for step in step_groups(o) for g in step) * (
        o.batch // (o.micro_batch or o.batch) if o.phase != "mixed" else 1
    )


def group_values(o: GenerateOptions, group: Group, head: bool = False) -> dict[Any, int]:
    """Symbol values of one group; ``head``: the LM head's, on the last position of each
    sequence (per context-parallel rank: ``sp`` positions)."""
    from stg.core.pipeline import symbol_values

    query = o.sp if head else group.query
    sized = replace(o, batch=group.batch, micro_batch=None, seq=query)
    values = symbol_values(sized)
    # a few decoding tokens give an expert fewer slots than ranks that hold tokens: each of
    # them dispatches at least one slot per expert (capacity rounded up to a multiple)
    token_ranks = o.data_replicas * o.sp
    values[Capacity] = -(-values[Capacity] // token_ranks) * token_ranks
    values[KVSeq] = group.kv
    values[Positions] = max_positions(o)
    return values


# ---------------------------------------------------------------------------------------------
# Build and bind


def build_forward(
    model: Model,
    name: str,
    plan: ParallelPlan,
    function: Callable[..., Any] | None = None,
    options: ReadOptions | None = None,
) -> tuple[GraphBuilder, Tensor]:
    """One part of ``model`` built forward only with a KV cache; returns the builder and the
    part's result (the head's: the model's last op, standing for sampling). ``function``
    builds a kind of layer of the model's stack named ``name`` (default: the part ``name``);
    ``options``: the mapping the model reads (default: the plan's options)."""
    o = plan.options
    b = GraphBuilder(
        name,
        active_axes=plan.active_axes,
        data_axes=plan.data_axes,
        seq_axes=plan.seq_axes,
        dtype=o.dtype,
        precision=normalize_plan(o.precision),
        options=options if options is not None else o.as_dict(),
        kv_cache=KVCache(o.kv_dtype or o.dtype),
        axis_parts=plan.axis_parts or None,
    )
    x = None if name == "embedding" else b.residual_input()
    # every layer's ops carry the tag "block", and their kind's name where it differs
    tags = (name,) if name in ("embedding", "head", "block") else ("block", name)
    with b.tag(*tags):
        result = (function or getattr(model, name))(b, x)
    if not isinstance(result, Tensor):
        part = name if name in ("embedding", "head", "block") else f"the {name!r} block"
        raise UserError(f"model {model.name!r}: {part}() must return a Tensor, got {result!r}")
    if name != "head" and b.part.output is None:
        b.output(result)
    return b, result


@dataclass
class StepParts:
    """The bound parts of one step (merged over its groups) and what predictors need."""

    parts: ModelParts
    groups: list[Group]
    cache_bytes: dict[str, int]
    """KV cache bytes of one layer of each kind on one rank for one micro-batch after this
    step"""
    activation_bytes: int
    """the largest working set of one op of one micro-batch on one rank (bytes)"""
    weight_bytes: dict[str, int]
    """bytes one rank stores of the weights of each part (embedding, head, each kind of
    layer): at their stored width, with the scales of a weight format"""
    weight_read_bytes: dict[str, int]
    """... of those, the bytes one micro-batch's step reads: all but the weights of routed
    experts that no token of the step reaches (:func:`skip_idle_experts`)"""


def _bind(part: Part, binder: Binder, fused: bool) -> BoundPart:
    return bind_part(part, binder, None, fused_attention=fused)


def position_rows(groups: Sequence[Group]) -> int:
    """Distinct positions the new tokens of ``groups`` sit at (a group's ``query`` tokens
    ending at key/value length ``kv`` sit at ``kv - query .. kv - 1``): the rows of a
    position-indexed weight they read."""
    rows, reached = 0, 0
    for start, end in sorted((g.kv - g.query, g.kv) for g in groups):
        start = max(start, reached)
        if end > start:
            rows += end - start
            reached = end
    return rows


def read_once_bytes(
    op: BoundOp,
    weights: Mapping[int, Tensor],
    binder: Binder,
    earlier: Sequence[Group],
    group: Group,
) -> int:
    """Bytes of ``op``'s weights (``weights`` by key, bound by ``binder``) that ``group``
    reads and the ``earlier`` groups read already: what a merged op reads once. A whole
    weight; of a position-indexed weight (stored for :data:`Positions` positions, read at the
    positions of each group's new tokens), the rows at positions both read."""
    shared = 0
    for k in op.inputs:
        w = weights.get(k)
        if w is None:
            continue
        held = binder.nbytes(w)
        if any(d.name == POSITIONS_DIM.name for d in w.dims):
            both = position_rows(earlier) + group.query - position_rows([*earlier, group])
            held = held * both // binder.values[Positions]
        shared += held
    return shared


def merge_bound(a: BoundPart, b: BoundPart, weight_bytes: Callable[[BoundOp], int]) -> BoundPart:
    """Two bindings of the same part (two groups of a mixed iteration) as one: each op runs
    once over the tokens of both (FLOPs, bytes and collective sizes add, every op's weights
    (a GEMM's, a norm's, the embedding table) are read once, a GEMM's m grows), except the
    attention core, which runs once per group (the second kernel after the first).
    ``weight_bytes``: the bytes of an op's weights that both bindings read
    (:func:`read_once_bytes`: a position table's rows at the positions both read)."""
    merged: list[BoundOp] = []
    for x, y in zip(a.forward, b.forward, strict=True):
        attrs = dict(x.attrs)
        if "attention" in attrs:
            merged.append(x)
            merged.append(replace(y, name=f"{y.name}.decode", inputs=y.inputs + x.outputs[:1]))
            continue
        gx, gy = attrs.get("gemm"), dict(y.attrs).get("gemm")
        if gx is not None and gy is not None:
            if (gx[0], gx[2], gx[3]) == (gy[0], gy[2], gy[3]):
                attrs["gemm"] = (gx[0], gx[1] + gy[1], gx[2], gx[3])
            elif gy[1] * gy[2] > gx[1] * gx[2]:
                attrs["gemm"] = gy
        merged.append(
            replace(
                x,
                num_ops=x.num_ops + y.num_ops,
                tensor_size=x.tensor_size + y.tensor_size - weight_bytes(x),
                comm_size=x.comm_size + y.comm_size,
                attrs=tuple(attrs.items()),
            )
        )
    return replace(a, forward=merged, boundary_bytes=a.boundary_bytes + b.boundary_bytes)


def skip_idle_experts(
    part: Part,
    bound: BoundPart,
    weight_bytes: Callable[[BoundOp], int],
    o: GenerateOptions,
    tokens: int,
) -> tuple[BoundPart, int]:
    """``bound`` with each grouped expert GEMM (an einsum whose every operand carries the
    experts dimension, so its weights are experts') reading only the weights (``weight_bytes``
    of it) of the experts that ``tokens`` tokens of a step reach
    (:func:`stg.core.routing.active_expert_share`), marked with how many of the rank's experts
    that is (:data:`~stg.core.routing.ACTIVE_EXPERTS_ATTR`); and the weight bytes left unread."""
    grouped = {
        op.name
        for op in part.forward
        if op.kind == "einsum" and all(EXPERTS in t.dims for t in op.inputs)
    }
    if not grouped:
        return bound, 0
    share = active_expert_share(o, tokens)
    ops: list[BoundOp] = []
    unread = 0
    for op in bound.forward:
        attrs = dict(op.attrs)
        if op.name not in grouped or "gemm" not in attrs:
            ops.append(op)
            continue
        held_bytes = weight_bytes(op)
        idle = round(held_bytes * (1.0 - share))
        unread += idle
        attrs[ACTIVE_EXPERTS_ATTR] = attrs["gemm"][0] * share
        attrs[EXPERT_WEIGHT_BYTES_ATTR] = held_bytes
        ops.append(replace(op, tensor_size=op.tensor_size - idle, attrs=tuple(attrs.items())))
    return replace(bound, forward=ops), unread


def _op_working_set(op: Op, binder: Binder, fused: bool) -> int:
    """Activation bytes one op holds at once: its activation inputs and output (a fused
    attention core never holds its score matrix)."""
    if op.kind in ("view", "collective"):
        return 0
    tensors = [t for t in (*op.inputs, op.output) if t.kind not in ("weight", "cache")]
    if fused and "core_attention" in op.tags:
        tensors = [t for t in tensors if sum(d.name.startswith("seq") for d in t.dims) <= 1]
    return sum(binder.nbytes(t) for t in tensors)


def build_steps(model: Model, plan: ParallelPlan) -> list[StepParts]:
    """Build the model once and bind it for every step of the run."""
    o = plan.options
    fused = o.attention == "fused"
    read = ReadOptions(o.as_dict())
    runs = model.layer_runs(read)
    functions: dict[str, Callable[..., Any] | None] = {"embedding": None}
    functions.update((kind, function) for kind, function, _ in runs)
    functions["head"] = None
    built = {
        name: build_forward(model, name, plan, f, read)[0].part for name, f in functions.items()
    }
    check_options_read(read, model.name)
    layer_kinds = LayerKinds((kind, count) for kind, _, count in runs)
    steps: list[StepParts] = []
    for groups in step_groups(o):
        bound: dict[str, BoundPart] = {}
        cache: dict[str, int] = {}
        stored: dict[str, int] = {}
        read: dict[str, int] = {}
        activations = 0
        for name, part in built.items():
            per_group: list[tuple[BoundPart, Binder]] = []
            for group in groups:
                binder = Binder(
                    group_values(o, group, head=name == "head"), plan.degrees, plan.axis_parts
                )
                per_group.append((_bind(part, binder, fused), binder))
                if name not in ("embedding", "head"):
                    cache[name] = cache.get(name, 0) + sum(
                        binder.nbytes(op.output) for op in part.forward if op.kind == "kv_append"
                    )
                    # recurrent states (GraphBuilder.recurrent_state): constant size
                    cache[name] += sum(binder.nbytes(t) for t in part.states)
                live = binder.nbytes(part.inputs[0]) if part.inputs else 0
                activations = max(
                    activations,
                    live
                    + max((_op_working_set(op, binder, fused) for op in part.forward), default=0),
                )
            result, first_binder = per_group[0]
            weights = {key(w): w for w in part.weights}
            stored[name] = sum(first_binder.nbytes(w) for w in part.weights)

            def weight_bytes(
                op: BoundOp, binder: Binder = first_binder, weights: dict = weights
            ) -> int:
                return sum(binder.nbytes(weights[k]) for k in op.inputs if k in weights)

            for i, (other, _) in enumerate(per_group[1:], 1):
                shared = partial(
                    read_once_bytes,
                    weights=weights,
                    binder=first_binder,
                    earlier=groups[:i],
                    group=groups[i],
                )
                result = merge_bound(result, other, shared)
            tokens = sum(g.batch * g.query for g in groups)
            bound[name], idle = skip_idle_experts(part, result, weight_bytes, o, tokens)
            read[name] = stored[name] - idle
        parts = ModelParts(
            bound["embedding"],
            bound[layer_kinds[0]],
            bound["head"],
            blocks={kind: bound[kind] for kind, _, _ in runs},
            layer_kinds=layer_kinds,
            optimizer_bytes_per_param=0,
            optimizer_dtype=o.dtype,
            facts={"weight_dtype": o.dtype, "kv_dtype": o.kv_dtype or o.dtype, "phase": o.phase},
        )
        steps.append(StepParts(parts, groups, cache, activations, stored, read))
    return steps


# ---------------------------------------------------------------------------------------------
# Lowering


def token_tag(
    step: int, micro_batch: int, micro_batches: int, boundary: int, chunks: int, back: bool
) -> int:
    """Deterministic tag of a pipeline transfer of one step: activations forward across the
    boundary after chunk ``boundary``, or (``back``) the sampled tokens to the first stage."""
    return 1 + ((step * micro_batches + micro_batch) * 2 + back) * chunks + boundary


def _p2p(
    out: _Nodes,
    kind: NodeType,
    what: str,
    *,
    prefix: str,
    step: int,
    mb: int,
    micro_batches: int,
    chunks: int,
    peer: int,
    boundary: int,
    back: bool,
    size: int,
    serving_step: int | None,
    deps: tuple[int, ...] = (),
) -> int:
    """A pipeline transfer of one step; the tokens received come from the step before.
    ``serving_step``: ``step`` in a run of several steps, else None (its typed attribute)."""
    verb = "send" if kind is NodeType.COMM_SEND else "recv"
    sent_in = step - 1 if back and kind is NodeType.COMM_RECV else step
    return out.add(
        {
            "name": f"{prefix}{verb}_{what}_c{boundary}",
            "type": kind,
            "comm_size": size,
            "peer_stage": peer,
            "comm_tag": token_tag(sent_in, mb, micro_batches, boundary, chunks, back),
            "dtype": None,
            "attrs": {
                OP_ATTR: f"{verb}_{what}_c{boundary}",
                **node_place(Phase.FORWARD, mb, step=serving_step),
            },
        },
        deps,
    )


def lower_inference_stage(
    stage: int,
    plan: ParallelPlan,
    steps: list[StepParts],
    progress: Callable[[], None] | None = None,
) -> RankClass:
    """All node templates of one pipeline stage for a serving run."""
    o = plan.options
    out = _Nodes()
    chunks = plan.chunks
    m = plan.micro_batches
    first, last = stage == 0, stage == chunks - 1
    replicas = o.data_replicas
    for step, sp in enumerate(steps):
        parts = sp.parts
        emb, head = parts.embedding, parts.head
        sequences = sum(g.batch for g in sp.groups) // replicas
        for mb in range(m):
            prefix = f"mb{mb}/" if len(steps) == 1 else f"step{step}/mb{mb}/"
            serving_step = None if len(steps) == 1 else step
            out.start_step()

            tokens_bytes = sequences * TOKEN_ID_BYTES
            where: dict[str, Any] = {
                "prefix": prefix,
                "step": step,
                "mb": mb,
                "micro_batches": m,
                "chunks": chunks,
                "serving_step": serving_step,
            }
            if first:
                after = None
                if step > 0 and chunks > 1:
                    after = _p2p(
                        out,
                        NodeType.COMM_RECV,
                        "tokens",
                        **where,
                        peer=chunks - 1,
                        boundary=0,
                        back=True,
                        size=tokens_bytes,
                    )
                env: dict[int, tuple[int, ...]] = {}
                out.run(
                    emb.forward,
                    env,
                    f"{prefix}embedding/",
                    after=after,
                    where=node_place(Phase.FORWARD, mb, "embedding", serving_step),
                )
                x = env[emb.output_key][0]  # type: ignore[index]
            else:
                x = _p2p(
                    out,
                    NodeType.COMM_RECV,
                    "activation",
                    **where,
                    peer=stage - 1,
                    boundary=stage - 1,
                    back=False,
                    size=parts.block.boundary_bytes,
                )
            for layer in plan.chunk_layers(stage):
                block = parts.layer(layer)
                env = {block.input_key: (x,)}  # type: ignore[dict-item]
                out.run(
                    block.forward,
                    env,
                    f"{prefix}layer{layer}/fwd/",
                    where=node_place(Phase.FORWARD, mb, f"layer{layer}", serving_step),
                )
                x = env[block.output_key][0]  # type: ignore[index]
            if last:
                env = {head.input_key: (x,)}  # type: ignore[dict-item]
                out.run(
                    head.forward,
                    env,
                    f"{prefix}head/fwd/",
                    where=node_place(Phase.FORWARD, mb, "head", serving_step),
                )
                if step + 1 < len(steps) and chunks > 1:
                    sampled = out.last_comp
                    _p2p(
                        out,
                        NodeType.COMM_SEND,
                        "tokens",
                        **where,
                        peer=0,
                        boundary=0,
                        back=True,
                        size=tokens_bytes,
                        deps=(sampled,) if sampled is not None else (),
                    )
            else:
                _p2p(
                    out,
                    NodeType.COMM_SEND,
                    "activation",
                    **where,
                    peer=stage + 1,
                    boundary=stage,
                    back=False,
                    size=parts.block.boundary_bytes,
                    deps=(x,),
                )
            if progress is not None:
                progress()
    held = stage_parts(stage, plan, steps[0].parts)
    kinds = _count_kinds(stage, plan, steps[0].parts)
    stored = steps[0].weight_bytes
    weight_bytes = (
        (stored["embedding"] if first else 0)
        + sum(stored[kind] * count for kind, count in kinds.items())
        + (stored["head"] if last else 0)
    )
    read = steps[0].weight_read_bytes
    weight_read_bytes = (
        (read["embedding"] if first else 0)
        + sum(read[kind] * count for kind, count in kinds.items())
        + (read["head"] if last else 0)
    )
    kv_per_step = [
        sum(sp.cache_bytes[kind] * count for kind, count in kinds.items()) * m for sp in steps
    ]
    return RankClass(
        index=stage,
        stage=stage,
        nodes=tuple(out.nodes),
        facts={
            "parameters": sum(bp.parameters for _, bp in held),
            "replica_parameters": sum(bp.replica_parameters for _, bp in held),
            "layers": sum(kinds.values()),
            "layer_kinds": kinds,
            "has_embedding": first,
            "has_head": last,
            "micro_batches": m,
            "weight_bytes": weight_bytes,
            # what one micro-batch's step reads of them: routed experts no token reaches idle
            "weight_read_bytes": weight_read_bytes,
            # the cache of every sequence this rank serves, after each step (it grows by one
            # token per decode step): what each step reads, and its largest size is held
            "kv_cache_bytes_per_step": kv_per_step,
            "kv_cache_bytes": max(kv_per_step),
            "activation_bytes": max(sp.activation_bytes for sp in steps),
            **steps[0].parts.facts,
        },
    )


def build_inference_workload(
    options: GenerateOptions,
    plan: ParallelPlan,
    model: Model,
    progress: Callable[[str, int, int], None] | None = None,
) -> Workload:
    """The workload of a serving run (prefill, decode steps or one mixed iteration)."""
    steps = build_steps(model, plan)
    chunks = plan.chunks
    if (
        token_tag(len(steps), plan.micro_batches, plan.micro_batches, chunks, chunks, True)
        >= MAX_TAG
    ):
        raise OptionError(
            f"too many steps·micro-batches ({len(steps)}·{plan.micro_batches}) for send/recv "
            f"tags below {MAX_TAG}"
        )
    total = plan.stages * len(steps) * plan.micro_batches
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress("lowering", done, total)

    classes = [lower_inference_stage(s, plan, steps, tick) for s in range(plan.stages)]
    used_axes: list[tuple[str, ...]] = []
    stage_axes: list[set[tuple[str, ...]]] = []
    for cls in classes:
        here = {n.group_axes for n in cls.nodes if n.group_axes}
        stage_axes.append(here)
        used_axes.extend(a for a in sorted(here) if a not in used_axes)
    layout = Layout(plan.degrees, plan.rank_order, tuple(used_axes))
    ranks = tuple(RankGraph(r, classes[layout.stage(r)], layout) for r in range(layout.world_size))
    groups: dict[int, tuple[int, ...]] = {}
    for graph in ranks:
        for axes in stage_axes[graph.rank_class.stage]:
            gid = layout.group_id(graph.rank, axes)
            if gid not in groups:
                groups[gid] = layout.members(graph.rank, axes)
    metadata = {
        "generator": "stg",
        "options": options.recorded(),
        "micro_batches": plan.micro_batches,
        "layers_per_chunk": list(plan.layers_per_chunk),
        "tokens": new_tokens(options),
    }
    return Workload(ranks, dict(sorted(groups.items())), layout, metadata)
