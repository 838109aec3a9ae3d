"""The ``analytical`` predictor: the iteration time in closed form, for sweeps and searches.

It prices the same kernels and collectives as the DAG ``time`` predictor, with the same
sub-models (:func:`stg.api.compute_time`: the GEMM, fused-attention and memory-bound kernel
models of :mod:`stg.perf.kernel_time`; :func:`stg.api.collective_time` and
:func:`stg.api.send_time`: alpha-beta per network dimension), but instead of replaying every
node of every micro-batch it composes per-layer costs in closed form:

- **One layer.** A small workload (one or two layers per stage, at most two pipeline stages
  and two data-parallel replicas (all of them where ep folds over dp), same tp, sp, ep,
  micro-batch per replica, dtype, recompute and kernels) is built once per distinct layer
  shape and cached. Its forward and backward of one layer, the embedding and the head are
  list-scheduled as the DAG predictor does (compute stream, one stream per communicator,
  smallest id first), which gives each part's time with its exposed tensor-parallel (and
  FSDP) communication: ``f`` and ``b``. A stack whose layers differ (DeepSeek's dense and
  MoE layers, a hybrid pattern, windowed attention on some layers; :func:`unlike_layers`)
  is built instead with every layer on its own stages, from the same small number of
  replicas and micro-batches, and each stage's layers are priced as they are.
- **Pipeline.** Stage i of p holds L_i layers (:func:`stg.api.chunk_layer_counts`: as even
  as possible, or Megatron's uneven split): ``F_i = L_i·f (+ embedding, + head)``, likewise
  ``B_i``. With m micro-batches the GPipe pipeline takes
  ``T_pipe = Σ_i (F_i + B_i) + (m - 1)·max_i (F_i + B_i) + 2(p - 1)·t_p2p``: the first
  micro-batch crosses every stage forward and backward, the others follow at the pace of the
  slowest stage; the bubble is ``(p - 1)·(F + B)`` for equal stages. 1F1B takes the same
  for equal stages and less where an earlier stage is the slowest (:func:`one_f_one_b`).
  Interleaving with v chunks per stage divides the fill and drain by v:
  ``T_pipe = Σ_i (F_i + B_i)/v + (m - 1/v)·max_i (F_i + B_i) + 2(p·v - 1)·t_p2p``.
- **Data parallelism.** A layer's gradient reduction is issued when the layer's last
  backward ends; on its communicator's stream the k-th reduction finishes at
  ``max_j (r_j + Σ_{j..k} c)`` (r_j: when layer j's backward ends), so its exposed tail after
  the stage's last backward is ``max(0, max_j (r_j + Σ_{l ≥ j} c_l) - r_last)``. Stage i
  ends its last backward ``Σ_{j<i} (B_j + t_p2p)`` before stage 0 does (the drain of 1F1B).
  A tied embedding's all-reduce over the embedding group queues behind its part's
  data-parallel reduction. The optimizer step follows, then ZeRO-1/2's all-gather of the
  updated shards.

Ranks of a communicator are placed by ``rank_order`` (fastest axis first), so a collective
spans the network dimensions that rank 0's group spans, as in the DAG predictor.

Every collective and send is priced alone, at its links' full bandwidth: the DAG replay's
sharing of a GPU's NVLink ports and NIC between transfers in flight at once (a gradient
reduction beside the backward's collectives and the pipeline's sends) has no closed form
here; it moves the replay by at most 0.5 % on the configurations of tests/test_explore.py.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import stg
from stg.api import (
    PIPELINE_ENDS,
    SHARE_ATTR,
    CollectiveType,
    GenerateOptions,
    KernelTable,
    NodeType,
    Phase,
    Predictor,
    Role,
    System,
    chunk_layer_counts,
    collective_time,
    compute_time,
    expert_dispatch_time,
    expert_route,
    group_shape,
    is_hybrid,
    kernel_name,
    kernel_table,
    layout_of,
    link_dimension,
    load_system,
    node_chunk,
    node_micro_batch,
    node_part,
    node_phase,
    node_role,
    op_class,
    recompute_units,
    send_time,
)
from stg.errors import UserError
from stg.predictors import _workload_cache as workload_cache

AXES_ORDER_DEFAULT = "tp,sp,ep,dp,pp"
GATHERS = (CollectiveType.ALL_GATHER, CollectiveType.GATHER)


# ---------------------------------------------------------------------------------------------
# Placement


def strides(options: GenerateOptions) -> dict[str, int]:
    """Rank stride of each mesh axis (``rank_order`` lists the fastest-varying axis first)."""
    degrees = degrees_of(options)
    stride = 1
    out = {}
    for axis in (a.strip() for a in options.rank_order.split(",") if a.strip()):
        out[axis] = stride
        stride *= degrees[axis]
    return out


def degrees_of(options: GenerateOptions) -> dict[str, int]:
    return {
        "dp": options.dp,
        "tp": options.tp,
        "sp": options.sp,
        "pp": options.pp,
        "ep": options.ep,
    }


def group_members(axes: Iterable[str], options: GenerateOptions) -> list[int]:
    """The ranks of rank 0's communicator over ``axes`` (mesh axes: on a folded expert
    mesh, its pieces of the dense axes; along :data:`PIPELINE_ENDS`, its first- and
    last-stage rank)."""
    if options.ep_folded or PIPELINE_ENDS in axes:
        return list(layout_of(options).members(0, axes))
    degrees, stride = degrees_of(options), strides(options)
    members = [0]
    for axis in axes:
        members = [r + k * stride[axis] for r in members for k in range(degrees[axis])]
    return members


# ---------------------------------------------------------------------------------------------
# One part (a layer's forward, its backward, the embedding, the head) list-scheduled


@dataclasses.dataclass
class PartCost:
    """Time of one part of one micro-batch on one rank, and where it goes."""

    time: float = 0.0
    compute: dict[str, float] = dataclasses.field(default_factory=dict)
    flops: int = 0
    model_flops: int = 0

    @property
    def exposed(self) -> float:
        return max(0.0, self.time - sum(self.compute.values()))

    def __add__(self, other: PartCost) -> PartCost:
        compute = dict(self.compute)
        for k, v in other.compute.items():
            compute[k] = compute.get(k, 0.0) + v
        return PartCost(
            self.time + other.time,
            compute,
            self.flops + other.flops,
            self.model_flops + other.model_flops,
        )

    def scaled(self, factor: float) -> PartCost:
        return PartCost(
            self.time * factor,
            {k: v * factor for k, v in self.compute.items()},
            round(self.flops * factor),
            round(self.model_flops * factor),
        )


def category(node: Any) -> str:
    """The --explain class of a compute node (as the DAG predictor's explain)."""
    if node_phase(node) is Phase.RECOMPUTE:
        return "recompute"
    if node_role(node) is Role.OPTIMIZER_STEP:
        return "optimizer"
    attrs = node.attrs or {}
    name = kernel_name(node)
    if "attention" in attrs or op_class(name, node.num_ops, node.tensor_size) == "attention":
        return "attention"
    if "gemm" in attrs:
        return "gemm"
    return "memory-bound"


def schedule_part(nodes: Sequence[Any], cost: Mapping[int, float]) -> float:
    """When the compute stream of a part ends: nodes issue smallest id first on their stream
    (compute, or their communicator's) once their dependencies inside the part are done, as
    in the DAG replay; dependencies outside the part are done at 0."""
    ids = {n.id for n in nodes}
    children: dict[int, list[Any]] = {n.id: [] for n in nodes}
    pending: dict[int, int] = {}
    for n in nodes:
        deps = [d for d in (*n.data_deps, *n.ctrl_deps) if d in ids]
        pending[n.id] = len(deps)
        for d in deps:
            children[d].append(n)
    stream_of = {n.id: (n.group_axes if n.type is NodeType.COMM_COLL else ()) for n in nodes}
    free: dict[tuple[str, ...], float] = {}
    ready: dict[tuple[str, ...], list[tuple[int, float]]] = {}
    ready_at: dict[int, float] = {}
    end_compute = 0.0
    events: list[tuple[float, int]] = []
    for n in nodes:
        if pending[n.id] == 0:
            ready.setdefault(stream_of[n.id], []).append((n.id, 0.0))
            ready_at[n.id] = 0.0
    by_id = {n.id: n for n in nodes}

    def issue() -> None:
        for stream, queue in ready.items():
            while queue:
                queue.sort()
                nid, at = queue.pop(0)
                start = max(at, free.get(stream, 0.0))
                end = start + cost.get(nid, 0.0)
                free[stream] = end
                heapq.heappush(events, (end, nid))

    issue()
    while events:
        end, nid = heapq.heappop(events)
        if stream_of[nid] == () and by_id[nid].type is not NodeType.COMM_COLL:
            end_compute = max(end_compute, end)
        for child in children[nid]:
            pending[child.id] -= 1
            if pending[child.id] == 0:
                ready.setdefault(stream_of[child.id], []).append((child.id, end))
        issue()
    return end_compute


# ---------------------------------------------------------------------------------------------
# The costs of one configuration's parts, from a reduced workload


@dataclasses.dataclass
class LayerCost:
    """One layer of one micro-batch: its forward, its backward (with any recomputation) and
    its gradient reductions per communicator."""

    fwd: PartCost
    bwd: PartCost
    reductions: dict[tuple[str, ...], float]


@dataclasses.dataclass
class Parts:
    """Per-micro-batch parts and per-iteration collectives of the reduced workload."""

    layer_fwd: PartCost
    layer_bwd: PartCost
    embedding_fwd: PartCost
    embedding_bwd: PartCost
    head_fwd: PartCost
    head_bwd: PartCost
    p2p_bytes: int
    layer_reductions: dict[tuple[str, ...], float]
    """per layer, seconds of its gradient reductions on each communicator's stream"""
    serial_reductions: bool
    """whether the layers' reductions are chained into the backward's collectives"""
    embedding_reductions: dict[tuple[str, ...], float]
    head_reductions: dict[tuple[str, ...], float]
    after_optimizer: float
    """ZeRO-1/2: all-gathers of updated shards per layer (plus embedding and head below)"""
    after_optimizer_embedding: float
    after_optimizer_head: float
    optimizer_layer: PartCost
    optimizer_embedding: PartCost
    optimizer_head: PartCost
    stage_optimizer: list[PartCost] | None = None
    """from a whole workload: each stage's optimizer step as it is (instead of the above)"""
    stage_after: list[float] | None = None
    samples: bool = False
    """a model without a sequence (images): throughput in samples, not tokens"""
    chunk_fwd: PartCost = dataclasses.field(default_factory=PartCost)
    chunk_bwd: PartCost = dataclasses.field(default_factory=PartCost)
    """per model chunk and micro-batch: fp8 amax reductions (Transformer Engine's delayed
    scaling, once per chunk forward and backward; their buffer sized on the reduced
    workload's layers, a few bytes more or less on a latency-bound all-reduce)"""
    stage_tp_replicated: list[float] = dataclasses.field(default_factory=list)
    """per stage, seconds of its one tensor-parallel all-reduce of the gradients of weights
    replicated over tensor parallelism (after its data-parallel reductions; none: empty)"""
    layer_bwd_kept: PartCost | None = None
    """under ``recompute_method``: the backward of a layer that is not recomputed
    (``layer_bwd`` is then a recomputed one's)"""
    stage_layers: list[list[LayerCost]] | None = None
    """a stack of unlike layers (DeepSeek's dense and MoE layers, hybrid stacks, windowed
    attention on some layers): each stage's layers in order, each priced as it is (instead of
    ``layer_fwd``, ``layer_bwd`` and ``layer_reductions`` for every layer)"""


def reduced_dp(o: GenerateOptions) -> int:
    """The data-parallel degree of the reduced workloads: at most two replicas, or all of
    them where expert parallelism folds over dp (its groups, and their mesh axes, are then
    the full workload's)."""
    return o.dp if o.ep_folded else min(o.dp, 2)


def reduced_micro_batch(o: GenerateOptions, per_replica: int | None = None) -> int:
    """The global micro-batch of the reduced workloads: ``per_replica`` samples (default:
    ``o``'s) on each of the :func:`reduced_dp` replicas (times ep, unless ep folds over dp)."""
    dp = reduced_dp(o)
    per_replica = per_replica or (o.micro_batch or o.batch) // o.data_replicas
    return per_replica * (dp if o.ep_folded else dp * o.ep)


def reduced_options(
    o: GenerateOptions, layers_per_stage: int, parameters_only: bool = False
) -> GenerateOptions:
    """The options of the small workload that holds the parts of ``o``'s layers
    (``parameters_only``: one sample per micro-batch and no recomputation, which change no
    parameter and so no optimizer step: more configurations share that workload)."""
    pp = min(o.pp, 2)
    dp = reduced_dp(o)
    micro = reduced_micro_batch(o, 1 if parameters_only else None)
    values = o.as_dict()
    if parameters_only:
        values.update(activation_recompute="none", precision=(), recompute_modules=())
    values.update(
        recompute_method=None,
        recompute_num_layers=None,
        dp=dp,
        pp=pp,
        num_stacks=pp * layers_per_stage,
        virtual_stages=1,
        decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
        pipeline_layers=(),
        pipeline_schedule="1f1b",
        pipeline_flushes=1,
        batch=micro,
        micro_batch=micro,
    )
    return GenerateOptions(**values)


def _segment(node: Any) -> tuple[str, str]:
    """(part, pass) of a node of a micro-batch, from its typed attributes: a layer's backward
    node is ``("layer7", "bwd")`` (recomputation counts as backward), the fp8 amax reduction
    that ends chunk 0's forward ``("chunk0", "fwd")``."""
    part = node_part(node)
    if part is None:
        chunk = node_chunk(node)
        part = "" if chunk is None else f"chunk{chunk}"
    return part, "fwd" if node_phase(node) is Phase.FORWARD else "bwd"


class _PreparedPart:
    """A part's nodes prepared once for the many plans that price them (a search prices the
    parts of one reduced workload for every plan that shares it): its collectives, its other
    nodes with their --explain classes and FLOPs, and per pricing what the part costs."""

    def __init__(self, nodes: list[Any]) -> None:
        self.nodes = nodes
        self.is_collective = [n.type is NodeType.COMM_COLL for n in nodes]
        self.collectives = [n for n, coll in zip(nodes, self.is_collective, strict=True) if coll]
        self.others = [n for n, coll in zip(nodes, self.is_collective, strict=True) if not coll]
        self.categories = [category(n) for n in self.others]
        self.flops = 0
        self.model_flops = 0
        for n, key in zip(self.others, self.categories, strict=True):
            self.flops += n.num_ops
            if key != "recompute":
                self.model_flops += n.num_ops
        self.other_prices: dict[tuple[Any, ...], tuple[System, list[float]]] = {}
        """per compute pricing (:attr:`_Pricer.compute_key`): the other nodes' prices"""
        self.costs: dict[tuple[Any, ...], tuple[System, float, dict[str, float]]] = {}
        """per compute pricing and collectives' prices: the part's time and compute"""
        self.prefetch: tuple[_PreparedPart | None, set[tuple[str, ...]], list[Any]] | None = None
        """under FSDP, once asked: the part without its weight gathers (None: it has none),
        their streams and the collectives on those streams (:func:`_prefetched_cost`)"""

    def cost(self, pricer: _Pricer) -> PartCost:
        """What the part costs priced by ``pricer``: its nodes scheduled as
        :func:`schedule_part` schedules them, once per distinct set of prices."""
        system = pricer.system
        compute_key = pricer.compute_key
        known = self.other_prices.get(compute_key)
        if known is None or known[0] is not system:
            known = (system, [pricer(n) for n in self.others])
            self.other_prices[compute_key] = known
        others = known[1]
        collectives = tuple(pricer(n) for n in self.collectives)
        key = (compute_key, collectives)
        done = self.costs.get(key)
        if done is None or done[0] is not system:
            cost: dict[int, float] = {}
            compute: dict[str, float] = {}
            next_other, next_collective = iter(others), iter(collectives)
            for n, coll in zip(self.nodes, self.is_collective, strict=True):
                cost[n.id] = next(next_collective) if coll else next(next_other)
            for seconds, key_ in zip(others, self.categories, strict=True):
                compute[key_] = compute.get(key_, 0.0) + seconds
            done = (system, schedule_part(self.nodes, cost), compute)
            self.costs[key] = done
        return PartCost(done[1], dict(done[2]), self.flops, self.model_flops)


_KERNELS_KEYS: dict[tuple[Any, ...], int] = {}
_NEW_KERNELS_KEY = itertools.count().__next__


def kernels_key(kernels: KernelTable | None) -> int:
    """A number for what a kernel table holds (its records, which are values), the same for
    equal tables and never reused for another: the prices memoised under it are those of
    these kernels, not of others that share their names."""
    records = tuple(kernels.kernels.items()) if kernels else ()
    key = _KERNELS_KEYS.get(records)
    if key is None:
        if len(_KERNELS_KEYS) > 1024:
            _KERNELS_KEYS.clear()
        key = _KERNELS_KEYS[records] = _NEW_KERNELS_KEY()
    return key


_PREPARED: dict[int, tuple[list[Any], _PreparedPart]] = {}


def _prepared(nodes: list[Any]) -> _PreparedPart:
    """The :class:`_PreparedPart` of a list of nodes (the same list: the lists of a rank
    class's :func:`_index`)."""
    found = _PREPARED.get(id(nodes))
    if found is not None and found[0] is nodes:
        return found[1]
    if len(_PREPARED) > 65536:
        _PREPARED.clear()
    prepared = _PreparedPart(nodes)
    _PREPARED[id(nodes)] = (nodes, prepared)
    return prepared


def _part_cost(nodes: list[Any], price: _Pricer) -> PartCost:
    if not nodes:
        return PartCost()
    return _prepared(nodes).cost(price)


def _prefetched_cost(
    nodes: list[Any], price: _Pricer, reductions: Mapping[tuple[str, ...], float] | None = None
) -> PartCost:
    """A part's forward or backward under FSDP, whose weight all-gathers run ahead on their
    communicator's stream while the part before it computes: in the forward as soon as the
    stream is free (they wait for no compute), in the backward from the pre-backward of the
    part before it (FSDP2's ``_backward_prefetch``, PyTorch v2.4.0; stg.core.lowering's
    ``prefetch``). In the steady state of equal layers a layer takes the longer of its own
    work and everything on its gathers' communicators: the gathers and the gradient
    reduce-scatters it issues there (in the part, or per iteration in ``reductions``, seconds
    per communicator), which share the gathers' stream."""
    if not nodes:
        return PartCost()
    prepared = _prepared(nodes)
    if prepared.prefetch is None:
        gathers = [
            n for n in prepared.collectives if n.comm_type in GATHERS and "dp" in n.group_axes
        ]
        skip = {n.id for n in gathers}
        streams = {n.group_axes for n in gathers}
        prepared.prefetch = (
            _PreparedPart([n for n in nodes if n.id not in skip]) if gathers else None,
            streams,
            [n for n in prepared.collectives if n.group_axes in streams],
        )
    rest_part, streams, on_streams = prepared.prefetch
    if rest_part is None:  # no weight gathers
        return prepared.cost(price)
    rest = rest_part.cost(price)
    busy = sum(price(n) for n in on_streams) + sum(
        seconds for axes, seconds in (reductions or {}).items() if axes in streams
    )
    return PartCost(max(rest.time, busy), rest.compute, rest.flops, rest.model_flops)


@dataclasses.dataclass
class _Index:
    """A rank class's nodes by part: the first micro-batch's ``(part, phase)`` (without
    sends and receives), per-iteration collectives by part, the optimizer step."""

    parts: dict[tuple[str, str], list[Any]]
    iteration: dict[str, list[Any]]
    optimizer: Any
    muon: list[Any] = dataclasses.field(default_factory=list)
    """Muon's momentum all-gathers and Newton-Schulz nodes (``--optimizer muon``)"""


_INDEXES: dict[int, tuple[Any, _Index]] = {}


def _index(rank_class: Any) -> _Index:
    cached = _INDEXES.get(id(rank_class))
    if cached is not None and cached[0] is rank_class:
        return cached[1]
    parts: dict[tuple[str, str], list[Any]] = {}
    iteration: dict[str, list[Any]] = {}
    optimizer = None
    muon = []
    for n in rank_class.nodes:
        if node_role(n) is Role.OPTIMIZER_STEP:
            optimizer = n
        if node_role(n) is Role.ORTHOGONALIZE:
            muon.append(n)
            continue
        micro_batch = node_micro_batch(n)
        if micro_batch is not None:
            # the first micro-batch's parts stand for every micro-batch's
            if micro_batch == 0 and n.type not in (NodeType.COMM_SEND, NodeType.COMM_RECV):
                parts.setdefault(_segment(n), []).append(n)
        elif n.type is NodeType.COMM_COLL:
            iteration.setdefault(node_part(n) or "", []).append(n)
    index = _Index(parts, iteration, optimizer, muon)
    if len(_INDEXES) > 4096:
        _INDEXES.clear()
    _INDEXES[id(rank_class)] = (rank_class, index)
    return index


class _Pricer:
    def __init__(
        self,
        o: GenerateOptions,
        system: System,
        kernels: KernelTable | None,
        gather_scale: float,
    ) -> None:
        self.o, self.system, self.kernels = o, system, kernels
        self.gather_scale = gather_scale
        self.shapes: dict[tuple[str, ...], tuple[int, ...]] = {}
        self.kernels_key = kernels_key(kernels)
        self.compute_key = (id(system), self.kernels_key, o.dtype, o.profile)
        """what prices a node other than a collective: the system, the kernels' names, the
        dtype and the profile (a collective: its size and its group's shape)"""

    def shape(self, axes: tuple[str, ...]) -> tuple[int, ...]:
        if axes not in self.shapes:
            members = tuple(group_members(axes, self.o))
            # shapes memoised on the system object too (plans share their groups)
            shapes = self.system.__dict__.setdefault("_analytical_group_shapes", {})
            if members not in shapes:
                if len(shapes) > 100_000:
                    shapes.clear()
                shapes[members] = group_shape(members, self.system)
            self.shapes[axes] = shapes[members]
        return self.shapes[axes]

    def __call__(self, node: Any, scale: float = 1.0) -> float:
        if node.type is NodeType.COMM_COLL:
            size = node.comm_size
            if node.comm_type in GATHERS and "dp" in node.group_axes:
                size = size * self.gather_scale  # a shard of dp_r ways priced at dp ways
            elif PIPELINE_ENDS in node.group_axes and self.o.zero == 2:
                size = size * self.gather_scale  # ZeRO-2: the tied gradient's dp_r-way shard
            shape = self.shape(node.group_axes)
            # collective times memoised on the system object too (a search prices the same
            # collective for many plans)
            times = self.system.__dict__.setdefault("_analytical_collectives", {})
            route = expert_route(node.attrs)
            if route is not None:  # an expert dispatch that DeepEP or HybridEP runs
                key = (route, size, shape, node.dtype)
                if key not in times:
                    times[key] = expert_dispatch_time(
                        node.attrs, size, node.dtype, shape, self.system
                    )
                return times[key]
            key = (node.comm_type, size, shape)
            if key not in times:
                times[key] = collective_time(node.comm_type, size, shape, self.system)
            return times[key]
        if node.type in (NodeType.COMP, NodeType.MEM_LOAD, NodeType.MEM_STORE):
            if scale != 1.0:
                node = dataclasses.replace(
                    node,
                    num_ops=round(node.num_ops * scale),
                    tensor_size=round(node.tensor_size * scale),
                )
            attrs = node.attrs or {}
            key = (
                self.kernels_key,
                self.o.dtype,
                self.o.profile,
                kernel_name(node),
                node.num_ops,
                node.tensor_size,
                node.dtype,
                attrs.get("gemm"),
                attrs.get("attention"),
                attrs.get("attention_scaling"),  # training's fp8 attention (casts follow shape)
            )
            # prices memoised on the system object (frozen: its prices never change)
            prices = self.system.__dict__.setdefault("_analytical_prices", {})
            seconds = prices.get(key)
            if seconds is None:
                if len(prices) > 200_000:
                    prices.clear()
                seconds = prices[key] = compute_time(
                    node, self.system, self.o.dtype, self.kernels, self.o.profile, None
                )
            return seconds
        return 0.0


def unlike_layers(o: GenerateOptions, registry: Any) -> bool:
    """Whether the layers of ``o``'s stack differ: several block kinds in the model's stack
    (DeepSeek's dense and MoE layers, a hybrid pattern), a windowed or chunked attention
    span on all but every k-th layer, or layers kept in bf16 under a low-precision recipe."""
    if o.full_attention_every and (o.attention_window or o.attention_chunk):
        return True
    if any(o.bf16_layers):  # first_last_layers_bf16: bf16 layers beside quantized ones
        return True
    if registry is None:
        return False
    return workload_cache.layer_kinds(o, registry) > 1


def stack_options(o: GenerateOptions) -> GenerateOptions:
    """The options of the small workload that holds every layer of ``o`` on its own stages:
    the same pipeline split, schedule and micro-batch per replica, the replicas of
    :func:`reduced_dp`, and as few micro-batches as the schedule allows (in one schedule:
    ``pipeline_flushes`` repeats the schedule, not its layers)."""
    micro = reduced_micro_batch(o)
    micro_batches = o.pp if o.pipeline_schedule == "interleaved" else 1
    return dataclasses.replace(
        o,
        dp=reduced_dp(o),
        batch=micro * micro_batches,
        micro_batch=micro,
        pipeline_flushes=1,
    )


def _stage_layers(rank_class: Any, reductions: Any, layer_cost: Any) -> list[LayerCost]:
    """The layers a stage's rank class holds, in order, each priced as it is."""
    parts = _index(rank_class).parts
    indices = sorted(
        {n for part, _ in parts if part.startswith("layer") and (n := part[5:]).isdigit()},
        key=int,
    )
    out = []
    for i in indices:
        reduced = reductions(rank_class, f"layer{i}", after=False)
        fwd = layer_cost(parts.get((f"layer{i}", "fwd"), []))
        bwd = layer_cost(parts.get((f"layer{i}", "bwd"), []), reduced)
        out.append(LayerCost(fwd, bwd, reduced))
    return out


def analyse(
    o: GenerateOptions,
    system: System,
    kernels: KernelTable | None,
    registry: Any,
    workload: Any = None,
) -> Parts:
    """Build the reduced workloads (one and two layers per stage) and price their parts; or,
    given the whole ``workload`` of ``o``, price the parts of its own rank classes."""
    kept: PartCost | None = None
    kept_nodes: dict[tuple[str, str], list[Any]] | None = None
    unlike = unlike_layers(o, registry)
    if workload is not None:
        one = one_p = two = workload
        dp_r = o.dp
    elif unlike:
        one = one_p = two = workload = _build(stack_options(o), registry)
        dp_r = reduced_dp(o)
    else:
        if o.recompute_method:  # the layers not recomputed, on a workload of their own
            plain = dataclasses.replace(reduced_options(o, 1), activation_recompute="none")
            kept_nodes = _index(_build(plain, registry).rank_classes[0]).parts
        one = _build(reduced_options(o, 1), registry)
        one_p = _build(reduced_options(o, 1, parameters_only=True), registry)
        two = _build(reduced_options(o, 2, parameters_only=True), registry)
        dp_r = reduced_dp(o)
    sharded = bool(o.zero or o.weight_sharded)
    pricer = _Pricer(o, system, kernels, dp_r / o.dp if sharded else 1.0)

    def layer_cost(nodes: list[Any], reductions: Any = None) -> PartCost:
        """A part of the layers (or the embedding); under FSDP its gathers run ahead."""
        if o.weight_sharded:
            return _prefetched_cost(nodes, pricer, reductions)
        return _part_cost(nodes, pricer)

    one_classes, one_p_classes = one.rank_classes, one_p.rank_classes
    two_classes = two.rank_classes
    first, last = one_classes[0], one_classes[-1]
    first2, last2 = two_classes[0], two_classes[-1]

    def pick(rank_class: Any, part: str, phase: str) -> list[Any]:
        return _index(rank_class).parts.get((part, phase), [])

    if kept_nodes is not None:
        kept = layer_cost(kept_nodes.get(("layer0", "bwd"), []))
    elif workload is not None and o.recompute_method:
        # a layer that is not recomputed, wherever the workload holds one
        plain = [u.start for _, mode, u in recompute_units(o) if mode != "full"]
        for rank_class in workload.rank_classes if plain else ():
            nodes = _index(rank_class).parts
            layer = next((i for i in plain if (f"layer{i}", "bwd") in nodes), None)
            if layer is not None:
                kept = layer_cost(nodes[(f"layer{layer}", "bwd")])
                break

    layer = "layer0"
    p2p = next((n.comm_size for n in first.nodes if n.type is NodeType.COMM_SEND), 0) or next(
        (n.comm_size for n in last.nodes if n.type is NodeType.COMM_SEND), 0
    )

    def reductions(rank_class: Any, part: str, after: bool) -> dict[tuple[str, ...], float]:
        """Per-iteration collectives of ``part``: gradient reductions (before the optimizer
        step) or all-gathers of updated shards (``after``)."""
        out: dict[tuple[str, ...], float] = {}
        for n in _index(rank_class).iteration.get(part, []):
            is_after = n.comm_type in GATHERS
            if is_after != after:
                continue
            out[n.group_axes] = out.get(n.group_axes, 0.0) + pricer(n)
        return out

    def optimizer(rank_class: Any) -> Any:
        return _index(rank_class).optimizer

    shard_scale = dp_r / o.dp if sharded else 1.0

    def opt_cost(node: Any, scale: float) -> PartCost:
        if node is None or scale <= 0:
            return PartCost()
        seconds = pricer(node, scale * shard_scale)
        flops = round(node.num_ops * scale * shard_scale)
        return PartCost(seconds, {"optimizer": seconds}, flops, flops)

    def muon_cost(rank_class: Any) -> PartCost:
        """Muon's all-gathers and Newton-Schulz iterations on ``rank_class``, this rank's share
        of them at the full data-parallel degree."""
        scale = shard_scale
        seconds = compute = 0.0
        flops = 0
        for n in _index(rank_class).muon:
            if n.type is NodeType.COMM_COLL:
                seconds += pricer(dataclasses.replace(n, comm_size=round(n.comm_size * scale)))
                continue
            attrs = dict(n.attrs)
            if SHARE_ATTR in attrs or scale != 1.0:
                attrs[SHARE_ATTR] = float(attrs.get(SHARE_ATTR, 1.0)) * scale
            n = dataclasses.replace(n, attrs=attrs)
            t = pricer(n, scale)
            seconds, compute, flops = seconds + t, compute + t, flops + round(n.num_ops * scale)
        return PartCost(seconds, {"optimizer": compute} if compute else {}, flops, flops)

    def minus(a: PartCost, b: PartCost) -> PartCost:
        return a + b.scaled(-1.0)

    # the optimizer step of a stage is linear in its parameters: two layers minus one layer
    # is one layer's share; the rest of stage 0's is the embedding's, of the last the head's
    opt1_first, opt2_first = optimizer(one_p_classes[0]), optimizer(first2)
    opt1_last, opt2_last = optimizer(one_p_classes[-1]), optimizer(last2)
    optimizer_layer = PartCost()
    optimizer_embedding = optimizer_head = PartCost()
    if opt1_first is not None and opt2_first is not None:
        delta_ops = opt2_first.num_ops - opt1_first.num_ops
        delta_size = opt2_first.tensor_size - opt1_first.tensor_size
        per_layer = dataclasses.replace(opt1_first, num_ops=delta_ops, tensor_size=delta_size)
        optimizer_layer = opt_cost(per_layer, 1.0)
        stem = dataclasses.replace(
            opt1_first,
            num_ops=opt1_first.num_ops - delta_ops,
            tensor_size=opt1_first.tensor_size - delta_size,
        )
        stem_last = None
        if opt1_last is not None and opt2_last is not None and len(one_p_classes) > 1:
            stem_last = dataclasses.replace(
                opt1_last,
                num_ops=opt1_last.num_ops - delta_ops,
                tensor_size=opt1_last.tensor_size - delta_size,
            )
        optimizer_embedding = opt_cost(stem, 1.0)
        optimizer_head = opt_cost(stem_last, 1.0) if stem_last is not None else PartCost()
        muon_first, muon_layer = muon_cost(one_p_classes[0]), muon_cost(first2)
        if muon_first.time or muon_layer.time:  # Muon's work is linear in the layers too
            muon_layer = minus(muon_layer, muon_first)
            optimizer_layer = optimizer_layer + muon_layer
            optimizer_embedding = optimizer_embedding + minus(muon_first, muon_layer)
            if stem_last is not None:
                muon_last = minus(muon_cost(one_p_classes[-1]), muon_layer)
                optimizer_head = optimizer_head + muon_last
        # one stage (pp = 1): embedding and head share one stem, counted once
    layer_red = reductions(first, layer, after=False)
    # a reduction followed by a collective on a communicator the layers' backward uses (ZeRO's
    # reduce-scatter, then the tensor-parallel all-reduce of replicated weights) joins that
    # communicator's stream in order: the next layer's backward collectives wait for it
    bwd_streams = {n.group_axes for n in pick(first, layer, "bwd") if n.type is NodeType.COMM_COLL}
    serial = len(layer_red) > 1 and any(axes in bwd_streams for axes in layer_red)
    stage_optimizer = stage_after = None
    if workload is not None:
        by_stage: dict[int, Any] = {}
        for rank_class in workload.rank_classes:
            by_stage.setdefault(rank_class.stage, rank_class)
        stages = [by_stage[s] for s in sorted(by_stage)]
        stage_optimizer = [opt_cost(optimizer(c), 1.0) + muon_cost(c) for c in stages]
        stage_after = [
            sum(
                pricer(n)
                for n in c.nodes
                if n.type is NodeType.COMM_COLL
                and n.comm_type in GATHERS
                and node_micro_batch(n) is None
                and node_role(n) is not Role.ORTHOGONALIZE
            )
            for c in stages
        ]
    stage_layers = None
    if unlike and workload is not None:
        stage_layers = [_stage_layers(c, reductions, layer_cost) for c in stages]
    if workload is not None:
        tp_replicated = [_tp_replicated_time(c, pricer) for c in stages]
    else:
        tp_replicated = _reduced_tp_replicated_times(
            o, pricer, one_p_classes[0], one_p_classes[-1], first2, dp_r
        )
    return Parts(
        stage_tp_replicated=tp_replicated,
        stage_layers=stage_layers,
        stage_optimizer=stage_optimizer,
        stage_after=stage_after,
        layer_fwd=layer_cost(pick(first, layer, "fwd")),
        layer_bwd=layer_cost(pick(first, layer, "bwd"), layer_red),
        embedding_fwd=_part_cost(pick(first, "embedding", "fwd"), pricer),
        embedding_bwd=layer_cost(pick(first, "embedding", "bwd")),
        head_fwd=_part_cost(pick(last, "head", "fwd"), pricer),
        head_bwd=_part_cost(pick(last, "head", "bwd"), pricer),
        p2p_bytes=p2p,
        layer_reductions=layer_red,
        serial_reductions=serial,
        embedding_reductions=reductions(first, "embedding", after=False),
        head_reductions=reductions(last, "head", after=False),
        after_optimizer=sum(reductions(first, layer, after=True).values()),
        after_optimizer_embedding=sum(reductions(first, "embedding", after=True).values()),
        after_optimizer_head=sum(reductions(last, "head", after=True).values()),
        optimizer_layer=optimizer_layer,
        optimizer_embedding=optimizer_embedding,
        optimizer_head=optimizer_head,
        samples=bool(first.facts.get("stackless")),
        chunk_fwd=_part_cost(pick(first, "chunk0", "fwd"), pricer),
        chunk_bwd=_part_cost(pick(first, "chunk0", "bwd"), pricer),
        layer_bwd_kept=kept,
    )


def _tp_replicated_nodes(rank_class: Any) -> list[Any]:
    """The stage's once-per-iteration all-reduces outside every part: the tensor-parallel
    all-reduce of the gradients of weights replicated over it (Megatron-LM's
    ``_allreduce_non_tensor_model_parallel_grads``, after ``finish_grad_sync``)."""
    return [
        n
        for n in _index(rank_class).iteration.get("", [])
        if n.comm_type is CollectiveType.ALL_REDUCE and node_role(n) is None
    ]


def _tp_replicated_time(rank_class: Any, pricer: Any) -> float:
    return sum(pricer(n) for n in _tp_replicated_nodes(rank_class))


def _reduced_tp_replicated_times(
    o: GenerateOptions, pricer: Any, first: Any, last: Any, first2: Any, dp_r: int
) -> list[float]:
    """Each stage's all-reduce of :func:`_tp_replicated_nodes`, from the reduced workloads of
    one (``first``, ``last``) and two layers per stage (``first2``): the coalesced buffer
    holds each layer's share (two layers minus one), plus the embedding's on stage 0 and the
    head's on the last; under ZeRO-2 a dp-th of each (the dp_r-th of the reduced workload)."""
    one, two, tail = (_tp_replicated_nodes(c) for c in (first, first2, last))
    if not one:
        return []
    per_layer = sum(n.comm_size for n in two) - sum(n.comm_size for n in one)
    head_stem = sum(n.comm_size for n in tail) - per_layer
    embedding_stem = sum(n.comm_size for n in one) - per_layer
    scale = dp_r / o.dp if o.zero == 2 else 1.0
    chunk_layers = chunk_layer_counts(o)
    p, v = o.pp, o.virtual_stages
    times = []
    by_size: dict[int, float] = {}  # stages with as many layers share their all-reduce
    for s in range(p):
        size = per_layer * sum(chunk_layers[c] for c in range(s, p * v, p))
        if s == 0:
            size += embedding_stem
        if s == p - 1 and p > 1:
            size += head_stem
        comm_size = round(size * scale)
        if comm_size not in by_size:
            by_size[comm_size] = pricer(dataclasses.replace(one[0], comm_size=comm_size))
        times.append(by_size[comm_size])
    return times


_REGISTRIES: dict[int, Any] = {}
_REFUSED: dict[tuple[GenerateOptions, int], tuple[Any, ...]] = {}
"""The arguments of the UserError each refused build raised (the options' fault: the same
every time), by options and registry as :func:`_cached_build` keeps the workloads built: a
search asks for the same refused workload for many plans."""


def _build(options: GenerateOptions, registry: Any) -> Any:
    _REGISTRIES[id(registry)] = registry
    key = (options, id(registry))
    refused = _REFUSED.get(key)
    if refused is not None:
        raise UserError(*refused)
    try:
        return _cached_build(options, id(registry))
    except UserError as exc:
        if type(exc) is UserError:  # not a subclass (a workload too large for this machine)
            if len(_REFUSED) > 2048:
                _REFUSED.clear()
            _REFUSED[key] = exc.args
        raise


@lru_cache(maxsize=2048)
def _cached_build(options: GenerateOptions, registry_id: int) -> Any:
    registry = _REGISTRIES[registry_id]

    def build() -> Any:
        from stg.api import build_workload  # the pipeline and lowering load on the first build

        return build_workload(options, registry)

    return workload_cache.cached(
        workload_cache.entry_key(options, workload_cache.registry_plugins(registry)), build
    )


# ---------------------------------------------------------------------------------------------
# Composition


class _Streams:
    """The reductions a stage issues, on their communicators' streams in issue order: when
    each stream finishes (a reduction runs once it is ready and the one before it on its
    stream is done: ``finish = max(finish, ready) + cost``) and the cost of its first."""

    def __init__(self) -> None:
        self.finish: dict[tuple[str, ...], float] = {}
        self.first: dict[tuple[str, ...], float] = {}

    def add(self, axes: tuple[str, ...], ready: float, cost: float) -> None:
        finish = self.finish.get(axes)
        if finish is None:
            self.first[axes] = cost
            finish = 0.0
        self.finish[axes] = max(finish, ready) + cost

    def issue(
        self,
        tied: list[tuple[list[float], float]],
        reductions: Mapping[tuple[str, ...], float],
        at: float,
    ) -> None:
        """Queue a part's reductions issued at ``at``; its all-reduce over the embedding
        group (a tied embedding's) goes to ``tied`` with when the streams of the part's own
        reductions finish them, which it waits for (Megatron-LM's ``finalize_model_grads``:
        ``finish_grad_sync``, then ``_allreduce_word_embedding_grads``)."""
        for axes, cost in reductions.items():
            if PIPELINE_ENDS not in axes:
                self.add(axes, at, cost)
        upto = [self.finish[axes] for axes in reductions if PIPELINE_ENDS not in axes]
        tied.extend((upto, cost) for axes, cost in reductions.items() if PIPELINE_ENDS in axes)


def _optimizer_of(parts: Parts, s: int, p: int, layers: int) -> tuple[PartCost, float]:
    """Stage ``s``'s optimizer step and the ZeRO all-gathers after it."""
    if parts.stage_optimizer is not None and parts.stage_after is not None:
        return parts.stage_optimizer[s], parts.stage_after[s]
    optimizer = parts.optimizer_layer.scaled(layers)
    after = parts.after_optimizer * layers
    if s == 0:
        optimizer = optimizer + parts.optimizer_embedding
        after += parts.after_optimizer_embedding
    if s == p - 1 and p > 1:
        optimizer = optimizer + parts.optimizer_head
        after += parts.after_optimizer_head
    return optimizer, after


def one_f_one_b(forward: Sequence[float], backward: Sequence[float], m: int, t_p2p: float) -> float:
    """When the last backward of stage 0 ends under the 1F1B schedule, with stage s taking
    ``forward[s]`` and ``backward[s]`` per micro-batch and ``t_p2p`` per send: the latest
    over the stages of the time a stage s paces the pipeline,
    ``Σ_{j<s} (F_j + B_j + 2·t) + m·(F_s + B_s) + max(0, Σ_{j>s} (F_j + B_j + 2·t) -
    (p - 1 - s)·F_s)``: the first micro-batch reaches it and the last gradient leaves it
    through the stages before it, it runs its m forwards and backwards back to back, and it
    waits before its first backward only for what its p - 1 - s warm-up forwards do not
    cover of the stages after it. With equal stages the last stage paces it:
    ``(m + p - 1)·(F + B) + 2(p - 1)·t``, the usual 1F1B time; a slower earlier stage (an
    uneven split) hides the later stages' fill and drain."""
    p = len(forward)
    stage = [f + b + 2 * t_p2p for f, b in zip(forward, backward, strict=True)]
    before = [0] * p  # Σ_{j<s}, added up in order as sum() does
    for s in range(1, p):
        before[s] = before[s - 1] + stage[s - 1]
    return max(
        before[s]
        + m * (forward[s] + backward[s])
        + max(0.0, sum(stage[s + 1 :]) - (p - 1 - s) * forward[s])
        for s in range(p)
    )


def predict_options(
    options: Mapping[str, Any] | GenerateOptions,
    system: System | str = "a100-80g",
    *,
    registry: Any = None,
    kernels: KernelTable | Iterable[Any] | None = None,
    explain: bool = False,
    workload: Any = None,
    **_: Any,
) -> dict[str, Any]:
    """The report of the analytical predictor from generation options (see the module); with
    ``workload`` (built from these options) its own rank classes are priced."""
    if registry is None and workload is None:
        raise UserError("the analytical predictor needs the registry (the model to build)")
    system = load_system(system)
    o = options if isinstance(options, GenerateOptions) else GenerateOptions(**dict(options))
    if is_hybrid(system):
        raise UserError(
            f"the analytical predictor prices one kind of GPU; hybrid system {system.name!r} "
            "(device groups) needs the time predictor (--predictor time)"
        )
    phase = getattr(o, "phase", "training")
    if phase != "training":
        raise UserError(
            f"the analytical predictor models training iterations; phase={phase} needs the "
            "serving or time predictor (--predictor serving|time)"
        )
    overlaps = [f"{n}=true" for n in GenerateOptions.OVERLAP_FIELDS if getattr(o, n, False)]
    if overlaps:
        raise UserError(
            f"the analytical predictor does not model {', '.join(overlaps)}; the time "
            "predictor's replay does (--predictor time)"
        )
    if o.cpu_offloading_num_layers:
        raise UserError(
            f"the analytical predictor does not model cpu_offloading_num_layers="
            f"{o.cpu_offloading_num_layers} (host copies beside the compute); the time "
            "predictor's replay does (--predictor time)"
        )
    world = o.world_size
    if system.capacity and world > system.capacity:
        raise UserError(f"{world} ranks do not fit system {system.name!r} ({system.capacity} GPUs)")
    table = kernel_table(kernels, system.name)
    parts = analyse(o, system, table, registry, workload)
    p, v = o.pp, o.virtual_stages
    m = o.micro_batches
    chunk_layers = chunk_layer_counts(o)
    layers = [sum(chunk_layers[c] for c in range(s, p * v, p)) for s in range(p)]
    # each stage's layer backwards, last layer first: recomputed ones cost layer_bwd
    layer_bwds = [[parts.layer_bwd] * n for n in layers]
    if o.recompute_method and parts.layer_bwd_kept is not None:
        layer_bwds = [[] for _ in range(p)]
        for stage, mode, unit in reversed(recompute_units(o)):
            cost = parts.layer_bwd if mode == "full" else parts.layer_bwd_kept
            layer_bwds[stage].extend([cost] * len(unit))
    # each stage's layers, last first: the backward's time and the reductions it issues
    layer_drains = [[(b, parts.layer_reductions) for b in stage] for stage in layer_bwds]
    if parts.stage_layers is not None:
        layer_drains = [[(c.bwd, c.reductions) for c in reversed(st)] for st in parts.stage_layers]
    fwd: list[PartCost] = []
    bwd: list[PartCost] = []
    # stages alike (as many layers, neither first nor last) cost alike: composed once
    alike: dict[tuple[int, bool, bool], tuple[PartCost, PartCost]] = {}
    for s in range(p):
        key = (layers[s], s == 0, s == p - 1)
        if key in alike:
            f, b = alike[key]
            fwd.append(f)
            bwd.append(b)
            continue
        f = parts.layer_fwd.scaled(layers[s]) + parts.chunk_fwd.scaled(v)
        if parts.stage_layers is not None:
            f = sum((c.fwd for c in parts.stage_layers[s]), PartCost()) + parts.chunk_fwd.scaled(v)
            b = sum((c.bwd for c in parts.stage_layers[s]), PartCost()) + parts.chunk_bwd.scaled(v)
        elif o.recompute_method:
            b = sum(layer_bwds[s], PartCost()) + parts.chunk_bwd.scaled(v)
        else:
            b = parts.layer_bwd.scaled(layers[s]) + parts.chunk_bwd.scaled(v)
        if s == 0:
            f, b = f + parts.embedding_fwd, b + parts.embedding_bwd
        if s == p - 1:
            f, b = f + parts.head_fwd, b + parts.head_bwd
        if parts.stage_layers is None and not o.recompute_method:
            alike[key] = (f, b)
        fwd.append(f)
        bwd.append(b)
    stride_pp = (layout_of(o).peer(0, 1) if p > 1 else 0) if o.ep_folded else strides(o)["pp"]
    t_p2p = 0.0
    if p > 1 and parts.p2p_bytes:
        # the slowest send between neighbouring stages: one per network dimension they cross
        # (memoised on the system object: plans share their pipeline's placement)
        crossed = system.__dict__.setdefault("_analytical_pipeline_dimensions", {})
        if (stride_pp, p) not in crossed:
            crossed[stride_pp, p] = {
                link_dimension(s * stride_pp, (s + 1) * stride_pp, system) for s in range(p - 1)
            }
        t_p2p = max(send_time(parts.p2p_bytes, d, system) for d in crossed[stride_pp, p])
    per_stage = [fwd[s].time + bwd[s].time for s in range(p)]
    slowest = max(per_stage)
    # pipeline_flushes schedules in turn, each filled and drained before the next
    flushes = o.pipeline_flushes
    each = m // flushes
    if v > 1:
        pipe = sum(per_stage) / v + (each - 1 / v) * slowest + 2 * (p * v - 1) * t_p2p
    elif o.pipeline_schedule == "1f1b":
        pipe = one_f_one_b([f.time for f in fwd], [b.time for b in bwd], each, t_p2p)
    else:
        pipe = sum(per_stage) + (each - 1) * slowest + 2 * (p - 1) * t_p2p
    pipe *= flushes
    # each stage's optimizer step and ZeRO all-gathers (stages alike: found once)
    per_stage_optimizer = parts.stage_optimizer is not None and parts.stage_after is not None
    optimizer_alike: dict[Any, tuple[PartCost, float]] = {}
    optimizers = []
    for s in range(p):
        key = s if per_stage_optimizer else (layers[s], s == 0, s == p - 1)
        if key not in optimizer_alike:
            optimizer_alike[key] = _optimizer_of(parts, s, p, layers[s])
        optimizers.append(optimizer_alike[key])
    # each stage: gradient reductions after its last backward, optimizer, ZeRO all-gathers
    ends = []
    drain = 0.0
    details = []
    for s in range(p):
        end_backward = pipe - drain
        drain += bwd[s].time + t_p2p
        # ready times of the reductions during the last micro-batch's backward, head first
        start = end_backward - bwd[s].time
        clock = start
        streams = _Streams()
        tied: list[tuple[list[float], float]] = []
        if s == p - 1:
            clock += parts.head_bwd.time
            streams.issue(tied, parts.head_reductions, clock)
        stream_finish, stream_first = streams.finish, streams.first
        for layer_bwd, layer_reductions in layer_drains[s]:
            clock += layer_bwd.time
            for axes, c in layer_reductions.items():  # streams.add, inline: once per layer
                done = stream_finish.get(axes)
                if done is None:
                    stream_first[axes] = c
                    done = 0.0
                stream_finish[axes] = max(done, clock) + c
        if s == 0:
            clock += parts.embedding_bwd.time
            streams.issue(tied, parts.embedding_reductions, clock)
        for upto, cost in tied:  # the embedding group's all-reduce, after the dp reduction
            streams.add((PIPELINE_ENDS,), max(upto, default=clock), cost)
        finish = end_backward
        tails = streams.finish.values()
        if parts.serial_reductions:
            # in the last micro-batch each layer's backward waits for the previous layer's
            # reductions: they add up on the critical path; a stream the layers do not use
            # runs its first reduction after them
            end_backward += sum(sum(r.values()) for _, r in layer_drains[s])
            finish = end_backward
            chained = {axes for _, r in layer_drains[s] for axes in r}
            tails = [
                max(0.0, end_backward) + sum([first])
                for axes, first in streams.first.items()
                if axes not in chained
            ]
        for tail in tails:
            finish = max(finish, tail)
        if parts.stage_tp_replicated:  # after every data-parallel reduction of the stage
            finish += parts.stage_tp_replicated[s]
        optimizer, after = optimizers[s]
        end = finish + optimizer.time + after
        ends.append(end)
        details.append((end_backward, finish - end_backward, optimizer, after))
    iteration = max(ends)
    critical = ends.index(iteration)
    end_backward, dp_tail, optimizer, after = details[critical]
    ranks_per_stage = world // p
    model_flops = hardware_flops = 0
    for s in range(p):
        opt = optimizers[s][0]
        hardware_flops += ranks_per_stage * (m * (fwd[s].flops + bwd[s].flops) + opt.flops)
        model_flops += ranks_per_stage * (
            m * (fwd[s].model_flops + bwd[s].model_flops) + opt.model_flops
        )
    peak = system.peak(o.dtype)
    compute: dict[str, float] = {}
    busiest = max(range(p), key=lambda s: per_stage[s])
    for part in (fwd[busiest], bwd[busiest]):
        for k, seconds in part.compute.items():
            compute[k] = compute.get(k, 0.0) + m * seconds
    exposed_tp = m * (fwd[busiest].exposed + bwd[busiest].exposed)
    p2p_total = 2 * ((p * v - 1) if v > 1 else (p - 1)) * t_p2p
    bubble = max(0.0, end_backward - m * per_stage[busiest] - p2p_total)
    report: dict[str, Any] = {
        "predictor": "analytical",
        "system": system.name,
        "world_size": world,
        "iteration_time_s": iteration,
        "model_flops": model_flops,
        "hardware_flops": hardware_flops,
        "mfu": model_flops / (iteration * world * peak) if iteration > 0 else 0.0,
        "hfu": hardware_flops / (iteration * world * peak) if iteration > 0 else 0.0,
        "peak_flops_per_gpu": peak,
        **(
            {"samples_per_s": o.batch / iteration if iteration > 0 else 0.0}
            if parts.samples
            else {"tokens_per_s": o.batch * o.seq / iteration if iteration > 0 else 0.0}
        ),
        "bubble_s": bubble,
        "exposed_communication_s": exposed_tp + p2p_total + dp_tail + after,
        "stage_times_s": [
            {"forward": f.time, "backward": b.time} for f, b in zip(fwd, bwd, strict=True)
        ],
    }
    if explain:
        breakdown = {f"compute: {k}": v_ for k, v_ in compute.items()}
        breakdown["compute: optimizer"] = breakdown.get("compute: optimizer", 0.0) + optimizer.time
        breakdown["communication: exposed in layers (tp, fsdp)"] = exposed_tp
        breakdown["communication: p2p"] = p2p_total
        breakdown["communication: gradient reduction tail"] = dp_tail
        breakdown["communication: zero all-gather"] = after
        accounted = sum(breakdown.values())
        breakdown["wait"] = max(0.0, iteration - accounted)
        breakdown = {k: s for k, s in breakdown.items() if s > 1e-9 * iteration}
        report["explain"] = {
            "iteration_time_s": iteration,
            "breakdown_s": dict(sorted(breakdown.items(), key=lambda kv: -kv[1])),
        }
    return report


def predict_analytical(
    workload: Any,
    system: System | str = "a100-80g",
    *,
    kernels: KernelTable | Iterable[Any] | None = None,
    explain: bool = False,
    registry: Any = None,
    **_: Any,
) -> dict[str, Any]:
    """The analytical report of a generated workload: its rank classes' parts composed with
    the options it records."""
    options = workload.metadata.get("options") if workload.metadata else None
    if not options:
        raise UserError("the analytical predictor needs the generation options of the workload")
    names = {f.name for f in dataclasses.fields(GenerateOptions)}
    values = {k: (tuple(map(tuple, v)) if k == "precision" else v) for k, v in options.items()}
    o = GenerateOptions(**{k: v for k, v in values.items() if k in names})
    return predict_options(
        o, system, registry=registry, kernels=kernels, explain=explain, workload=workload
    )


@stg.hookimpl
def stg_register_predictors(register: Any) -> None:
    register(
        Predictor(
            name="analytical",
            predict=predict_analytical,
            predict_options=predict_options,
            needs="options",
            description="closed form over per-layer costs (same kernel and collective models "
            "as time): pipeline bubble, exposed communication, MFU; for sweeps and search",
        )
    )


__all__ = ["predict_analytical", "predict_options", "schedule_part"]
