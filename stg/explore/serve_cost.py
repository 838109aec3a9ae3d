"""The time of one serving iteration of any batch, priced by stg's serving model.

An iteration of a continuously batched server runs prefill chunks and decode tokens of many
requests at once, each at its own context length. stg's serving workloads
(:mod:`stg.core.inference`) merge such groups op by op: every GEMM, norm, activation and
collective runs once over the tokens of all groups (its FLOPs, bytes and message grow with
the tokens, weights are read once), the attention core runs once per group, and the LM head
runs on the last position of each sequence. On one replica (no pipeline) the replay of such
a step is one chain of kernels and collectives, so its time is the sum of its nodes' times.

:class:`IterationPricer` prices an iteration from that structure without building it:

- **Tokens and sequences.** Every node outside the attention core is linear in the tokens
  of the iteration (the head's in its sequences), or also in the distinct positions the
  iteration reads (a learned position table) and in the slots of its fullest expert (an MoE
  layer, :func:`stg.core.routing.expert_capacity` of all its tokens): its FLOPs, bytes,
  message size and GEMM shape are read off decode workloads of 1, 2 and 3 sequences and
  prefills of two lengths, and must reproduce every one of them exactly. A grouped expert
  GEMM's bytes are linear once the weights of the experts no token reaches are added back
  (:func:`stg.core.routing.active_expert_share` of the tokens decides them).
- **Attention.** An attention node of ``b`` sequences, ``q`` new tokens each, attending to
  ``kv`` tokens has batch ``∝ b``, query rows ``∝ q``, key/value length ``kv``, bytes
  ``b·(a + c·q + d·kv)`` (FLOPs scaled with ``b·q·kv``: the kernel model prices the shape), read off
  four small workloads (decode at two contexts, two batches, prefill at two lengths).
- **Pricing.** Nodes are priced by the same functions the replay uses
  (:func:`stg.perf.costs.compute_time`, :func:`stg.perf.costs.collective_time`) and summed,
  cached by tokens, by sequences and by attention group.

The pricer checks itself when built: a prefill of two prompts and a decode step of three
sequences (workloads it did not read) must cost what the replay of their workloads costs,
to 1e-9; a model or plan where that fails (a pipeline; DeepSeek, whose decode runs other
operations than its prefill) is refused with one line. A batch of one group (one prompt, or
decoding sequences of one context) is exactly the step predictor's prefill or decode step.

Decoding sequences of different contexts run in one attention kernel in serving engines
(vLLM's paged attention, FlashAttention's varlen kernel); stg's kernel model prices a batch
of one key/value length, so an iteration's decoding sequences are priced as one kernel at
their mean context (rounded up): exact when their contexts are equal, and the same bytes of
KV cache read otherwise.

A mixed workload of stg (``--phase mixed``) of one prefill group and one decode context is
exactly such an iteration: every weight read once, the attention core once per group.

An MoE model's experts may be split over ``ep`` GPUs (:func:`expert_parallel`): folded over
the replica's ``tp`` GPUs, a replica is priced as above; with data-parallel attention
(``multiply``) the pricer prices one attention rank's iteration as the step in which every
one of the ``ep`` ranks runs that batch (its references built at ``ep`` times their
sequences, the fullest expert's slots over all their tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from stg.core.inference import Group, group_values
from stg.core.options import GenerateOptions
from stg.core.routing import ACTIVE_EXPERTS_ATTR, EXPERT_WEIGHT_BYTES_ATTR, active_expert_share
from stg.core.symbolic import Capacity
from stg.core.workload import (
    LAYER_ATTR,
    MICRO_BATCH_ATTR,
    OP_ATTR,
    STEP_ATTR,
    Node,
    NodeType,
    Workload,
    node_part,
)
from stg.errors import UserError
from stg.perf.costs import collective_time, compute_time, group_shape, send_time
from stg.perf.kernels import KernelTable
from stg.perf.system import System

PLACE_ATTRS = (LAYER_ATTR, MICRO_BATCH_ATTR, STEP_ATTR)
"""Attributes that place a node (which layer, micro-batch, step) without changing its cost."""
CHECK_TOLERANCE = 1e-9
"""Relative difference allowed between a priced iteration and the replay of its workload."""
# reference lengths of the workloads read (any small values do; the check uses others)
CONTEXTS = (32, 96)
PROMPTS = (16, 48)
CHUNK_CONTEXT = 24
TOKENS_COLUMN, POSITIONS_COLUMN, SLOTS_COLUMN, SHARE_COLUMN = 1, 2, 3, 4
"""Regressors of a body node: (1, tokens, distinct positions, slots of the fullest expert), and
beside them the share of the routed experts the tokens reach (which no field is linear in: a
grouped expert GEMM's unread weights follow from it, :func:`_unread`)."""


@dataclass(frozen=True)
class Batch:
    """What one iteration runs: ``prefills`` as (new tokens, key/value length) per prefilling
    sequence, the key/value lengths of the decoding sequences (one new token each), and those
    of the sequences whose ``verify_tokens`` speculative tokens the model verifies (the last
    sampled token and the draft's; their logits at every one of them)."""

    prefills: tuple[tuple[int, int], ...]
    decodes: tuple[int, ...]
    verify: tuple[int, ...] = ()
    verify_tokens: int = 0

    @property
    def tokens(self) -> int:
        return (
            sum(q for q, _ in self.prefills)
            + len(self.decodes)
            + len(self.verify) * self.verify_tokens
        )

    @property
    def sequences(self) -> int:
        return len(self.prefills) + len(self.decodes) + len(self.verify)

    def positions(self) -> int:
        """Distinct positions the iteration's new tokens sit at (a chunk of ``q`` tokens
        ending at key/value length ``kv`` sits at ``kv - q .. kv - 1``): the rows of a learned
        position table it reads."""
        spans = sorted(
            {(kv - q, kv) for q, kv in self.prefills}
            | {(kv - 1, kv) for kv in self.decodes}
            | {(kv - self.verify_tokens, kv) for kv in self.verify}
        )
        rows, reached = 0, 0
        for start, end in spans:
            start = max(start, reached)
            if end > start:
                rows += end - start
                reached = end
        return rows

    @property
    def logits(self) -> int:
        """Rows of the LM head: one per sequence, one per verified token."""
        return len(self.prefills) + len(self.decodes) + len(self.verify) * self.verify_tokens


FIELDS = ("num_ops", "tensor_size", "comm_size")


@dataclass
class _Linear:
    """A node whose numeric fields (and GEMM shape) are linear in a few regressors: ``(1, n)``
    for a count ``n`` (tokens or sequences), or ``(1, tokens, positions, expert slots)`` for
    the body of a model with learned positions or experts; a serving step's grouped expert
    GEMM's bytes are, once its unread expert weights are added back (:func:`_unread`)."""

    node: Node
    count: int
    columns: tuple[int, ...]  # the regressors it depends on
    coefficients: Any  # (columns, fields + GEMM dimensions): numpy array
    gemm: bool
    shape: tuple[int, ...] | None  # a collective's group shape
    active: bool = False  # a serving step's grouped expert GEMM: its active experts

    @staticmethod
    def fit(
        node: Node,
        shape: tuple[int, ...] | None,
        points: Any,
        seen: Sequence[Node],
        columns: tuple[int, ...],
    ) -> _Linear:
        """The coefficients on ``columns`` of the regressors that reproduce every node of
        ``seen`` (one per row of ``points``) exactly; :class:`_NotAffine` if none do."""

        gemm = node.attrs.get("gemm") is not None
        active = node.attrs.get(ACTIVE_EXPERTS_ATTR) is not None
        rows = [
            [getattr(n, f) for f in FIELDS] + (list(n.attrs["gemm"]) if gemm else []) for n in seen
        ]
        if active:  # the bytes of every expert's weights: linear in the tokens
            for row, x in zip(rows, points, strict=True):
                row[FIELDS.index("tensor_size")] += _unread(node, x[SHARE_COLUMN])
        values = np.array(rows, dtype=float)
        design = np.asarray(points, dtype=float)[:, list(columns)]
        coefficients, *_ = np.linalg.lstsq(design, values, rcond=None)
        entry = _Linear(node, 1, columns, coefficients, gemm, shape, active)
        for x, want in zip(np.asarray(points, dtype=float), seen, strict=True):
            made = entry.at(x)
            if (
                tuple(getattr(made, f) for f in FIELDS),
                made.attrs.get("gemm"),
            ) != (tuple(getattr(want, f) for f in FIELDS), want.attrs.get("gemm")):
                raise _NotAffine(f"node {node.name} is not linear in the tokens")
            if made.attrs.get(ACTIVE_EXPERTS_ATTR) != want.attrs.get(ACTIVE_EXPERTS_ATTR):
                raise _NotAffine(f"node {node.name}'s active experts are not stg's routing's")
        return entry

    def at(self, x: Any) -> Node:
        values = [_exact(v) for v in x[list(self.columns)] @ self.coefficients]
        fields = dict(zip(FIELDS, values[: len(FIELDS)], strict=True))
        attrs = dict(self.node.attrs)
        if self.gemm:
            attrs["gemm"] = tuple(values[len(FIELDS) :])
        if self.active:
            share = float(x[SHARE_COLUMN])
            attrs[ACTIVE_EXPERTS_ATTR] = attrs["gemm"][0] * share
            fields["tensor_size"] -= _unread(self.node, share)
        return replace(self.node, attrs=attrs, **fields)


@dataclass
class _Form:
    """One form of an attention node (decode: one new token; prefill: a chunk) as a function
    of (sequences ``b``, new tokens ``q``, key/value length ``kv``): batch ``∝ b``, query rows
    ``∝ q``, bytes ``b·(a + c·q + d·kv)``."""

    shape: tuple[Any, ...]  # the attention attribute at b = 1, q = 1 (rows per token)
    bytes_abc: tuple[float, float, float]
    flops: float  # FLOPs per (sequence, query, key) of the reference: the kernel model prices
    # the shape and the bytes; FLOPs only mark the node as work

    def at(self, node: Node, b: int, q: int, kv: int) -> Node:
        batch, heads, rows, _, dim, *rest = self.shape
        attrs = dict(node.attrs)
        attrs["attention"] = (batch * b, heads, rows * q, kv, dim, *rest)
        a, per_q, per_kv = self.bytes_abc
        nbytes = _exact(b * (a + per_q * q + per_kv * kv))
        return replace(
            node, attrs=attrs, tensor_size=nbytes, num_ops=round(self.flops * b * q * kv)
        )


@dataclass
class _Attention:
    """An attention node: its decode form (``q = 1``) and its prefill form (``q > 1``)."""

    node: Node
    count: int
    decode: _Form
    prefill: _Form

    def at(self, b: int, q: int, kv: int) -> Node:
        return (self.decode if q == 1 else self.prefill).at(self.node, b, q, kv)


def _unread(node: Node, share: float) -> int:
    """Bytes of a grouped expert GEMM's weights that no token reaches when ``share`` of the
    experts receive tokens, as :func:`stg.core.inference.skip_idle_experts` leaves them out."""
    return round(int(node.attrs[EXPERT_WEIGHT_BYTES_ATTR]) * (1.0 - share))


def _exact(value: float) -> int:
    rounded = round(value)
    if abs(value - rounded) > 1e-6 * max(1.0, abs(value)):
        raise _NotAffine(f"a node field interpolates to {value}, not an integer")
    return int(rounded)


class _NotAffine(Exception):
    pass


def _signature(node: Node, shape: tuple[int, ...] | None) -> tuple[Any, ...]:
    attrs = tuple(
        (k, v) for k, v in sorted(node.attrs.items()) if k not in PLACE_ATTRS and k != "gemm"
    )
    return (node.type, node.comm_type, shape, node.dtype, node.name.rsplit("/", 1)[-1], attrs)


def _rank_nodes(workload: Workload, system: System) -> list[tuple[Node, tuple[int, ...] | None]]:
    graph = workload.ranks[0]
    out = []
    for template in graph.rank_class.nodes:
        node = graph.resolve(template)
        shape = None
        if node.type is NodeType.COMM_COLL:
            assert node.comm_group is not None
            shape = group_shape(workload.comm_groups[node.comm_group], system)
        out.append((node, shape))
    return out


class IterationPricer:
    """Seconds of one iteration of any :class:`Batch` on one replica (see the module
    docstring). ``base``: the serving options of the replica (model, tp, experts placed by
    :func:`expert_parallel`, dtypes); ``build``
    turns options into a workload; ``replay_time`` gives the step predictor's time of one."""

    def __init__(
        self,
        base: GenerateOptions,
        system: System,
        kernels: KernelTable,
        build: Any,
        replay_time: Any,
    ) -> None:
        if base.pp != 1 or base.sp != 1 or base.dp != 1:
            raise UserError(
                f"a serving replica is priced on tensor and expert parallelism (--tp, --ep); "
                f"got pp={base.pp} sp={base.sp} dp={base.dp} (allowed: 1 each; replicas are "
                "--replicas)"
            )
        self.attention_ranks = base.data_replicas
        """ranks that run attention on batches of their own (``ep`` with the experts
        multiplying the replica, else 1): every one priced as running this one's batch"""
        ranks = self.attention_ranks
        self.system = system
        self.kernels = kernels
        self.dtype = base.dtype
        self.profile = base.profile
        self._build = build
        decode = replace(base, phase="decode", steps=1, micro_batch=None, prefill_batch=0)
        prefill = replace(base, phase="prefill", micro_batch=None, prefill_batch=0)
        c0, c1 = CONTEXTS
        p0, p1 = PROMPTS
        self._decode = decode
        one = build(replace(decode, batch=ranks, context=c0))
        two = build(replace(decode, batch=2 * ranks, context=c0))
        three = build(replace(decode, batch=3 * ranks, context=c0))
        far = build(replace(decode, batch=ranks, context=c1))
        short = build(replace(prefill, batch=ranks, seq=p0))
        long = build(replace(prefill, batch=ranks, seq=p1))
        chunked = build(
            replace(
                base,
                phase="mixed",
                batch=ranks,
                context=c0,
                prefill_batch=ranks,
                chunk=p0,
                prefill_context=CHUNK_CONTEXT,
                micro_batch=None,
                steps=1,
            )
        )
        facts = one.rank_classes[0].facts
        self.kv_bytes_per_token = int(facts["kv_cache_bytes_per_step"][0]) // (c0 + 1)
        self.weight_bytes = int(facts["weight_bytes"])
        try:
            nodes = [_rank_nodes(w, system) for w in (one, two, three, far, short, long)]
            after = [n for n, _ in _rank_nodes(chunked, system) if "attention" in n.attrs]
            self._fit(nodes, after[::2])
        except _NotAffine as exc:
            raise self._refusal(base, str(exc)) from None
        self._body: dict[tuple[int, int], float] = {}
        self.stage_sends: tuple[int, int, int, int] | None = None
        """a pipeline's sends per iteration: (count, bytes, bytes per token, dimension)"""
        self._head: dict[int, float] = {}
        self._attention: dict[tuple[int, int, int], float] = {}
        self._check(base, replay_time)

    # -- reading the reference workloads -----------------------------------------------------

    def _fit(
        self,
        ranks: Sequence[list[tuple[Node, tuple[int, ...] | None]]],
        chunked: Sequence[Node],
    ) -> None:
        """Read the affine forms off the reference workloads: decode at 1 and 2 sequences
        and a longer context, prefill of two lengths, and a chunk after cached tokens
        (``chunked``: its prefill group's attention nodes, in order)."""
        one, two, three, far, short, long = ranks
        if len({len(r) for r in ranks}) != 1:
            raise _NotAffine("its workloads differ in their nodes between batches")
        for (d, _), (p, _) in zip(one, short, strict=True):
            if d.attrs.get(OP_ATTR) != p.attrs.get(OP_ATTR):
                raise _NotAffine(
                    f"its decode step runs {d.attrs.get(OP_ATTR)} where its prefill runs "
                    f"{p.attrs.get(OP_ATTR)}: one iteration cannot hold both"
                )
        body: dict[tuple[Any, ...], _Linear] = {}
        head: dict[tuple[Any, ...], _Linear] = {}
        attention: dict[tuple[Any, ...], _Attention] = {}
        c0, c1 = CONTEXTS
        p0, p1 = PROMPTS
        kv0 = c0 + 1
        seen_attention = 0
        for i, (n1, shape) in enumerate(one):
            n2, n3, nf, ns, nl = two[i][0], three[i][0], far[i][0], short[i][0], long[i][0]
            if n1.type not in (NodeType.COMP, NodeType.COMM_COLL):
                raise _NotAffine(f"it has {n1.type.name} nodes (a pipeline)")
            key = _signature(n1, shape)
            att = n1.attrs.get("attention")
            if att is not None:
                if seen_attention >= len(chunked):
                    raise _NotAffine("its chunked prefill has fewer attention nodes")
                nc = chunked[seen_attention]
                seen_attention += 1
                if key in attention:
                    attention[key].count += 1
                    continue
                per_kv = (nf.tensor_size - n1.tensor_size) / (c1 - c0)
                dec = _Form(
                    tuple(att),
                    (n1.tensor_size - per_kv * kv0, 0.0, per_kv),
                    n1.num_ops / kv0,
                )
                pre_shape = tuple(ns.attrs["attention"])
                rows = pre_shape[2] // p0
                pre_kv = (nc.tensor_size - ns.tensor_size) / CHUNK_CONTEXT
                slope = (nl.tensor_size - ns.tensor_size) / (p1 - p0)
                pre = _Form(
                    (pre_shape[0], pre_shape[1], rows, 0, *pre_shape[4:]),
                    (ns.tensor_size - slope * p0, slope - pre_kv, pre_kv),
                    ns.num_ops / (p0 * p0),
                )
                entry = _Attention(n1, 1, dec, pre)
                attention[key] = entry
                for b, q, kv, ref in (
                    (2, 1, kv0, n2),
                    (1, 1, c1 + 1, nf),
                    (1, p1, p1, nl),
                    (1, p0, p0 + CHUNK_CONTEXT, nc),
                ):
                    made = entry.at(b, q, kv)
                    if (made.attrs["attention"], made.tensor_size) != (
                        tuple(ref.attrs["attention"]),
                        ref.tensor_size,
                    ):
                        raise _NotAffine(f"its attention node {n1.name} is not affine")
                continue
            if (n1.num_ops, n1.tensor_size, n1.comm_size) != (
                nf.num_ops,
                nf.tensor_size,
                nf.comm_size,
            ):
                raise _NotAffine(f"node {n1.name} depends on the context outside attention")
            if node_part(n1) == "head":
                if key in head:
                    head[key].count += 1
                else:
                    head[key] = _Linear.fit(n1, shape, [(1, 1), (1, 2)], (n1, n2), (0, 1))
                continue
            if key in body:
                body[key].count += 1
                continue
            body[key] = self._fit_body(n1, shape, (n1, n2, n3, ns, nl))
        self._body_nodes = list(body.values())
        used = {c for e in self._body_nodes for c in e.columns}
        self.uses_positions = POSITIONS_COLUMN in used
        self._uses_slots = SLOTS_COLUMN in used
        self._uses_share = any(e.active for e in self._body_nodes)
        self._head_nodes = list(head.values())
        self._attention_nodes = list(attention.values())

    def expert_slots(self, tokens: int) -> int:
        """Slots of the fullest expert for one batch of ``tokens`` tokens on every attention
        rank (stg's routing model, :func:`stg.core.routing.expert_capacity`): what an MoE
        layer's kernels are shaped by."""
        group = Group("iteration", self.attention_ranks, tokens, tokens)
        return int(group_values(self._decode, group)[Capacity])

    def active_share(self, tokens: int) -> float:
        """Share of the routed experts that a batch of ``tokens`` tokens on every attention
        rank reaches (:func:`stg.core.routing.active_expert_share`): a serving step reads
        only their weights."""
        return active_expert_share(self._decode, tokens * self.attention_ranks)

    def _regressors(self, tokens: int, positions: int) -> Any:
        slots = self.expert_slots(tokens) if self._uses_slots else 0
        share = self.active_share(tokens) if self._uses_share else 1.0
        return np.array((1.0, tokens, positions, slots, share))

    def _fit_body(self, node: Node, shape: tuple[int, ...] | None, seen: Sequence[Node]) -> _Linear:
        """A node outside attention and the head, read at decode of 1, 2, 3 sequences and
        prompts of two lengths: linear in the tokens, else also in the positions read (a
        learned position table) or the slots of the fullest expert (an MoE layer)."""
        p0, p1 = PROMPTS
        counts = [(1, 1), (2, 1), (3, 1), (p0, p0), (p1, p1)]
        points = [
            (1, tokens, positions, self.expert_slots(tokens), self.active_share(tokens))
            for tokens, positions in counts
        ]
        why = ""
        for columns in (
            (0, TOKENS_COLUMN),
            (0, TOKENS_COLUMN, POSITIONS_COLUMN),
            (0, TOKENS_COLUMN, SLOTS_COLUMN),
            (0, TOKENS_COLUMN, POSITIONS_COLUMN, SLOTS_COLUMN),
        ):
            try:
                return _Linear.fit(node, shape, points, seen, columns)
            except _NotAffine as exc:
                why = str(exc)
        raise _NotAffine(why)

    def _refusal(self, base: GenerateOptions, why: str) -> UserError:
        return UserError(
            f"model {base.model!r}: its serving step cannot be priced per iteration ({why}); "
            "stg predict prices its steps one at a time"
        )

    def _check(self, base: GenerateOptions, replay_time: Any) -> None:
        """Two steps it did not read, priced both ways: a prefill of two prompts and a
        decode step of three sequences."""
        prompt, context = PROMPTS[1] - 5, CONTEXTS[1] + 7
        ranks = self.attention_ranks
        cases = (
            (
                replace(base, phase="prefill", batch=2 * ranks, seq=prompt),
                Batch(((prompt, prompt),) * 2, ()),
            ),
            (
                replace(base, phase="decode", batch=3 * ranks, context=context, steps=1),
                Batch((), (context + 1,) * 3),
            ),
        )
        for options, batch in cases:
            want = replay_time(self._build(replace(options, micro_batch=None, prefill_batch=0)))
            got = self.price(batch)
            if abs(got - want) > CHECK_TOLERANCE * want:
                raise self._refusal(
                    base,
                    f"a {options.phase} step prices at {got:.9g} s, its replay at {want:.9g} s",
                )

    # -- pricing -----------------------------------------------------------------------------

    def _node_time(self, node: Node, shape: tuple[int, ...] | None) -> float:
        if node.type is NodeType.COMM_COLL:
            assert node.comm_type is not None and shape is not None
            return collective_time(node.comm_type, node.comm_size, shape, self.system)
        return compute_time(node, self.system, self.dtype, self.kernels, self.profile, None)

    def body_time(self, tokens: int, positions: int = 1) -> float:
        """Seconds of everything but attention and the head for ``tokens`` new tokens at
        ``positions`` distinct positions (read only by a model with learned positions)."""
        key = (tokens, positions if self.uses_positions else 0)
        t = self._body.get(key)
        if t is None:
            x = self._regressors(*key)
            t = sum(e.count * self._node_time(e.at(x), e.shape) for e in self._body_nodes)
            if self.stage_sends is not None:
                count, fixed, per_token, dimension = self.stage_sends
                t += count * send_time(fixed + per_token * tokens, dimension, self.system)
            self._body[key] = t
        return t

    def head_time(self, sequences: int) -> float:
        """Seconds of the LM head (and sampling) over ``sequences`` sequences."""
        t = self._head.get(sequences)
        if t is None:
            x = np.array((1.0, sequences))
            t = self._head[sequences] = sum(
                e.count * self._node_time(e.at(x), e.shape) for e in self._head_nodes
            )
        return t

    def attention_time(self, sequences: int, new: int, kv: int) -> float:
        """Seconds of the attention kernels of all layers for one group."""
        key = (sequences, new, kv)
        t = self._attention.get(key)
        if t is None:
            t = self._attention[key] = sum(
                e.count * self._node_time(e.at(sequences, new, kv), None)
                for e in self._attention_nodes
            )
        return t

    def decode_time(self, sequences: int, mean_kv: int, positions: int = 1) -> float:
        """One iteration of ``sequences`` decoding sequences only, at mean length ``mean_kv``
        (``positions``: their distinct contexts)."""
        return (
            self.body_time(sequences, positions)
            + self.head_time(sequences)
            + self.attention_time(sequences, 1, mean_kv)
        )

    def price(self, batch: Batch) -> float:
        """Seconds of one iteration running ``batch``."""
        if batch.sequences == 0:
            return 0.0
        positions = batch.positions() if self.uses_positions else 0
        seconds = self.body_time(batch.tokens, positions) + self.head_time(batch.logits)
        groups: dict[tuple[int, int], int] = {}
        for q, kv in batch.prefills:
            groups[(q, kv)] = groups.get((q, kv), 0) + 1
        for (q, kv), b in sorted(groups.items()):
            seconds += self.attention_time(b, q, kv)
        if batch.decodes:
            mean = math.ceil(sum(batch.decodes) / len(batch.decodes))
            seconds += self.attention_time(len(batch.decodes), 1, mean)
        if batch.verify:
            mean = math.ceil(sum(batch.verify) / len(batch.verify))
            seconds += self.attention_time(len(batch.verify), batch.verify_tokens, mean)
        return seconds


EP_LAYOUTS = ("fold", "multiply")
"""How ``--ep`` places a serving replica's experts (see :func:`expert_parallel`)."""


def expert_parallel(
    options: GenerateOptions, ep: int, registry: Any, layout: str = "fold"
) -> GenerateOptions:
    """``options`` with an MoE model's experts split over ``ep`` GPUs; ``ep`` 1 leaves them
    as they are.

    ``fold`` (default): over ``ep`` of the replica's ``tp`` GPUs, as vLLM's
    ``--enable-expert-parallel`` splits them over its tensor-parallel group: attention and
    the dense layers stay tensor-parallel over all ``tp``, each GPU holds ``experts / ep``
    experts, each expert's FFN split over ``tp / ep`` of them (stg's ``ep_layout=fold`` with
    ``etp = tp/ep``; every GPU holds every token, so the experts' outputs are gathered over
    the ep GPUs). ``multiply``: a replica of ``tp · ep`` GPUs whose attention is
    data-parallel over ``ep`` ranks of ``tp`` GPUs, each with its own batch and KV cache,
    the experts split over the ``ep`` ranks and their tokens moved by all-to-all (vLLM's
    ``--data-parallel-size`` with expert parallelism, SGLang's DP attention; stg's
    ``ep_layout=multiply``)."""
    if layout not in EP_LAYOUTS:
        raise UserError(f"--ep_layout {layout!r}: allowed values are {', '.join(EP_LAYOUTS)}")
    if ep == 1:
        return options
    if ep < 1:
        raise UserError(f"--ep {ep}: must be a positive integer")
    if layout == "fold" and options.tp % ep:
        raise UserError(
            f"--ep {ep}: the experts split over the replica's tensor-parallel GPUs; allowed: "
            f"a positive divisor of --tp {options.tp} (or --ep_layout multiply)"
        )
    from stg.explore.serving_search import uses_experts

    if not uses_experts(replace(options, phase="decode"), registry):
        raise UserError(f"--ep {ep}: model {options.model!r} has no experts to split")
    if options.experts % ep:
        raise UserError(
            f"--ep {ep}: must divide the {options.experts} experts of {options.model!r}"
        )
    if layout == "multiply":
        return replace(options, ep=ep, ep_layout="multiply", etp=None)
    return replace(options, ep=ep, ep_layout="fold", etp=options.tp // ep)


def kv_blocks(
    capacity_bytes: int,
    weight_bytes: int,
    activation_bytes: int,
    kv_bytes_per_token: int,
    block_size: int,
    memory_fraction: float,
) -> int:
    """KV-cache blocks of ``block_size`` tokens one GPU holds: what ``memory_fraction`` of its
    memory leaves after the weights and the activations of the largest iteration (vLLM's
    profiling run: ``gpu_memory_utilization · total - weights - peak activations``)."""
    free = memory_fraction * capacity_bytes - weight_bytes - activation_bytes
    return max(0, int(free // (kv_bytes_per_token * block_size)))


def kv_transfer(pricer: IterationPricer) -> Any:
    """Seconds to move a request's KV cache of ``tokens`` tokens from a prefill replica to a
    decode replica: every GPU of the prefill replica sends its share of the cache
    (``kv_bytes_per_token · tokens``) to its peer at once, over the outermost network
    dimension (the two replicas on different nodes), as one point-to-point transfer priced
    by :func:`stg.perf.costs.send_time` (alpha-beta on that dimension)."""
    system = pricer.system
    outer = len(system.network) - 1
    per_token = pricer.kv_bytes_per_token

    def seconds(tokens: int) -> float:
        return send_time(per_token * tokens, outer, system)

    return seconds


def replica_pricer(base: GenerateOptions, system: System, registry: Any) -> IterationPricer:
    """The pricer of one replica of ``base`` (model, tp, dtypes) on ``system``, with the
    registry's kernels, checked against its ``serving`` predictor."""
    from stg.core.pipeline import build_workload, validate_options
    from stg.perf.kernels import kernel_table

    table = kernel_table(list(registry.kernels), system.name)
    serving = registry.predictors.get("serving")

    def build(options: GenerateOptions) -> Workload:
        validate_options(options, registry)
        return build_workload(options, registry)

    def replay_time(workload: Workload) -> float:
        return float(serving.predict(workload, system, kernels=table)["time_s"])

    return IterationPricer(base, system, table, build, replay_time)


def pipeline_pricer(base: GenerateOptions, system: System, registry: Any) -> IterationPricer:
    """The pricer of a replica of ``base.pp`` pipeline stages run as vLLM V0 runs them: a
    sequence's iteration passes every stage in turn, so it costs the whole model's kernels at
    ``tp`` (each stage runs its share of the layers) plus the ``pp - 1`` sends of its
    activations between stages, read off the pipeline's own workload (their bytes linear in
    the tokens, priced by :func:`stg.perf.costs.send_time` on the dimension the replay uses).
    Checked like the tensor-parallel pricer: a prefill and a decode step of the pipeline,
    one micro-batch each, against the replay of their workloads."""
    from stg.core.pipeline import build_workload, validate_options
    from stg.perf.costs import link_dimension
    from stg.perf.kernels import kernel_table

    pricer = replica_pricer(replace(base, pp=1), system, registry)
    if base.pp == 1:
        return pricer
    table = kernel_table(list(registry.kernels), system.name)
    serving = registry.predictors.get("serving")

    def build(options: GenerateOptions) -> Workload:
        validate_options(options, registry)
        return build_workload(options, registry)

    ranks = pricer.attention_ranks

    def sends(batch: int) -> list[Node]:
        workload = build(
            replace(base, phase="decode", batch=batch * ranks, context=CONTEXTS[0], steps=1,
                    micro_batch=None, prefill_batch=0)
        )  # fmt: skip
        first = workload.rank_classes[0]
        return [n for n in first.nodes if n.type is NodeType.COMM_SEND]

    one, two = sends(1), sends(2)
    if not one or len(one) != len(two):
        raise UserError(f"pp {base.pp}: the pipeline's stages send nothing stg can price")
    per_token = two[0].comm_size - one[0].comm_size
    fixed = one[0].comm_size - per_token
    peer = base.world_size // base.pp  # the next stage's first rank
    dimension = link_dimension(0, peer, system)
    pricer.stage_sends = (base.pp - 1, fixed, per_token, dimension)
    pricer._body.clear()  # the tensor-parallel check cached bodies without the sends
    prompt, context = PROMPTS[1] - 3, CONTEXTS[1] + 5
    for options, batch in (
        (
            replace(base, phase="prefill", batch=2 * ranks, seq=prompt),
            Batch(((prompt, prompt),) * 2, ()),
        ),
        (
            replace(base, phase="decode", batch=3 * ranks, context=context, steps=1),
            Batch((), (context + 1,) * 3),
        ),
    ):
        workload = build(replace(options, micro_batch=None, prefill_batch=0))
        want = float(serving.predict(workload, system, kernels=table)["time_s"])
        got = pricer.price(batch)
        if abs(got - want) > CHECK_TOLERANCE * want:
            raise UserError(
                f"pp {base.pp}: a {options.phase} step of the pipeline prices at {got:.9g} s, "
                f"its replay at {want:.9g} s; stg predict prices its steps one at a time"
            )
    return pricer


def replica_blocks(
    pricer: IterationPricer,
    base: GenerateOptions,
    registry: Any,
    *,
    tokens: int,
    block_size: int,
    memory_fraction: float,
    draft: IterationPricer | None = None,
) -> int:
    """KV-cache blocks per GPU of a replica whose largest iteration runs ``tokens`` tokens:
    the weights and activations come from the ``memory`` predictor's report of a prefill of
    that many tokens. A ``draft`` model of speculative decoding shares the GPUs: its weights
    are held beside the target's and every block holds its keys and values too. A pipeline
    (``base.pp > 1``): every stage holds its own layers' weights and cache; the stage with
    the fewest blocks decides, as the GPU with the most weights does where ``--ep`` gives
    the GPUs different experts."""
    if not 0 < memory_fraction <= 1:
        raise UserError(f"--gpu-memory-utilization {memory_fraction}: must be in (0, 1]")
    if block_size < 1:
        raise UserError(f"--block-size {block_size}: must be a positive integer")
    memory = registry.predictors.get("memory")
    largest = pricer._build(
        replace(base, phase="prefill", batch=pricer.attention_ranks, seq=tokens, context=None)
    )
    classes = memory.predict(largest, pricer.system)["classes"]
    if base.pp > 1:
        if draft is not None:
            raise UserError("--speculative: a draft model beside a pipeline is not modelled")
        # every stage holds its own layers' weights and cache: the fullest GPU decides
        return min(
            kv_blocks(
                pricer.system.hbm_capacity,
                int(c["weights"]),
                int(c["activations"]),
                int(c["kv_cache"]) // tokens,
                block_size,
                memory_fraction,
            )
            for c in classes
        )
    # with the experts split (--ep) the GPUs hold different experts: the fullest one decides
    extra = draft.weight_bytes if draft is not None else 0
    per_token = pricer.kv_bytes_per_token + (draft.kv_bytes_per_token if draft else 0)
    return min(
        kv_blocks(
            pricer.system.hbm_capacity,
            int(c["weights"]) + extra,
            int(c["activations"]),
            per_token,
            block_size,
            memory_fraction,
        )
        for c in classes
    )


__all__ = [
    "EP_LAYOUTS",
    "Batch",
    "IterationPricer",
    "expert_parallel",
    "kv_blocks",
    "kv_transfer",
    "pipeline_pricer",
    "replica_blocks",
    "replica_pricer",
]
