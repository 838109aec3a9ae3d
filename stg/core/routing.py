"""How many token slots each expert's matmuls are shaped for: the two MoE routings.

- ``capacity`` (token dropping, GShard / Switch Transformer): each expert takes at most
  ``ceil(capacity_factor · k · tokens / E)`` tokens of a micro-batch, rounded up to a multiple
  of the ranks that hold the tokens (Megatron-LM caps each source rank's share of them:
  :func:`expert_capacity`); tokens above it are dropped, slots below it padded, so the
  matmuls always cost the full capacity. With ``capacity_factor`` 1 this is perfectly
  balanced routing (what Megatron's ``--moe-router-force-load-balancing`` benchmarks run).
- ``dropless`` (Megatron-Core's default: ``--moe-token-dispatcher-type alltoall`` without
  ``--moe-expert-capacity-factor``): no token is dropped, every expert takes what the router
  sends it, and a step waits for the most loaded expert. A workload has one rank class per
  position in the mesh, not one per routing outcome, so every expert is shaped for the
  expected load of the most loaded one: the pace-setter's GEMM shapes and all-to-all sizes.

The expected maximum load is the balls-into-bins bound for a router that spreads tokens
uniformly at random (what an auxiliary balancing loss aims at): ``m`` balls thrown into ``n``
bins, the fullest holds ``m/n + sqrt(2·(m/n)·ln n)`` (Raab and Steger, "Balls into Bins — A
Simple and Tight Analysis", RANDOM 1998, Theorem 1, the regime m ≥ n·ln n), and never more
than the balls that exist. Trained routers are more skewed than uniform, so this is a lower
bound on the imbalance.
"""

from __future__ import annotations

import math

from stg.core.options import GenerateOptions

ROUTINGS = ("capacity", "dropless")
"""Values of ``--moe_routing``."""

NCCL_DISPATCHER = "alltoall"
DISPATCHERS = (NCCL_DISPATCHER, "deepep", "hybridep")
"""Values of ``--moe_dispatcher``: how an expert-parallel all-to-all moves tokens. ``alltoall``
is NCCL's all-to-all of every routed copy (Megatron-core's ``--moe-token-dispatcher-type
alltoall``); ``deepep`` and ``hybridep`` are DeepEP's and NVIDIA's HybridEP kernels
(Megatron-core's ``flex`` dispatcher backends, NeMo AutoModel's ``dispatcher``), which send a
token once per destination rank and node (:mod:`stg.perf.ep_dispatch`)."""

RANDOM_GATE = "random"
GATES = (RANDOM_GATE, "consecutive")
"""Values of ``--moe_gate``: where a token's ``k`` experts fall, which decides how many ranks
and nodes a DeepEP-class dispatch sends it to. ``random``: ``k`` distinct experts uniformly at
random (a balanced router; Megatron-core's ``--moe-router-force-load-balancing`` draws random
logits, ``megatron/core/transformer/moe/moe_utils.py``, ``apply_random_logits``);
``consecutive``: token ``t`` takes experts ``t·k`` to ``t·k + k - 1`` modulo ``E`` (NeMo
AutoModel's ``FakeBalancedGate``, ``nemo_automodel/components/moe/layers.py``:
``arange(n_tokens · k).view(-1, k) % n_experts``)."""

DISPATCHER_ATTR = "moe_dispatcher"
"""Node attribute of an expert-parallel all-to-all: the library that runs it (a value of
:data:`DISPATCHERS` other than ``alltoall``; NCCL's all-to-all carries none)."""
EP_ROUTE_ATTR = "ep_route"
"""... its direction: ``dispatch`` (tokens to the ranks of their experts) or ``combine``
(expert outputs back to their tokens' ranks)."""
EP_KEXPERTS_ATTR = "ep_kexperts"
"""... the experts each token is routed to (``kexperts``)."""
EP_EXPERTS_ATTR = "ep_experts"
"""... the routed experts of the layer (``experts``)."""
EP_HIDDEN_ATTR = "ep_hidden"
"""... the elements of one routed row (the hidden size on the rank)."""
EP_SMS_ATTR = "ep_sms"
"""... the SMs its kernels run on (absent: the library's default)."""
EP_GATE_ATTR = "ep_gate"
"""... where a token's experts fall (a value of :data:`GATES`; absent: ``random``)."""


ACTIVE_EXPERTS_ATTR = "active_experts"
"""Node attribute of a serving step's grouped expert GEMM (its ``gemm`` batch runs over a rank's
experts): how many of those experts can expect at least one token of the step
(:func:`active_expert_share` of them). Serving engines run the grouped GEMM only over the experts
that received tokens, so only their weights are read (the node's ``tensor_size`` counts those
alone)."""
EXPERT_WEIGHT_BYTES_ATTR = "expert_weight_bytes"
"""... and the bytes of all those experts' weights that it holds: its ``tensor_size`` leaves
``round(expert_weight_bytes · (1 - active share))`` of them unread."""


def expert_groups(options: GenerateOptions) -> tuple[int, int]:
    """(groups, shards): the token groups that meet one copy of the routed experts through the
    expert-parallel all-to-all (``dp·sp``, or the expert-data-parallel coordinates under
    ``ep_layout=fold``) and the ranks each group's slots of an expert start split over, the
    ranks that hold the group's tokens: ``ep``, times ``tp`` under sequence parallelism
    (``tpsp``: the residual stream that enters the router is split over tp along the sequence),
    or ``ep·etp`` folded. ``groups · shards`` ranks split the ``capacity`` dimension of the
    dispatched slots (the model's ``dispatch`` splits it over the token axes of its input).

    Megatron-LM at core_v0.14.0 refuses MoE with tensor parallelism but no sequence
    parallelism in training (megatron/core/transformer/moe/moe_layer.py, ``MoELayer.forward``),
    so each tp rank routes its own share of the tokens; its ``MoEAlltoAllTokenDispatcher``
    (token_dispatcher.py) all-to-alls them over ep and then all-gathers the expert-tp ranks'
    rows (``dispatch_postprocess``: ``gather_from_sequence_parallel_region`` over
    ``expt_tp``), and its token-dropping capacity is per source rank: an expert takes
    ``capacity · tp · ep`` slots."""
    if options.ep_folded:
        return options.expert_dp, options.ep * options.expert_tp
    return options.dp * options.sp, options.ep * (options.tp if options.tpsp else 1)


def token_ranks(options: GenerateOptions) -> int:
    """Ranks that hold different tokens of a micro-batch at the router, and so split the
    ``capacity`` dimension of the dispatched slots (the model's ``dispatch`` splits it over the
    token axes of its input): the data-parallel ones (``dp·ep``, or ``dp`` under
    ``ep_layout=fold``), times ``sp``, times ``tp`` under sequence parallelism (``tpsp``: the
    residual stream that enters the router is split over tp along the sequence; serving runs
    tp without it). In training it is ``groups · shards`` of :func:`expert_groups`."""
    return options.data_replicas * options.sp * (options.tp if options.tpsp else 1)


def active_expert_share(options: GenerateOptions, tokens: float) -> float:
    """Expected share of the routed experts that receive at least one of ``tokens`` tokens
    (all replicas together) when each token goes to ``k`` distinct experts of ``E`` uniformly at
    random (the balanced router of :data:`RANDOM_GATE`): an expert misses one token with
    probability ``1 - k/E``, and all ``T`` tokens of its group (:func:`expert_groups`) with
    ``(1 - k/E)^T``. Serving engines run a grouped expert GEMM only over the experts that
    received tokens (vLLM's and SGLang's ``fused_moe`` sort the routed rows by expert and launch
    tiles for those experts alone; TensorRT-LLM's MoE kernels likewise), so at a decode step of
    a few sequences most experts' weights are not read."""
    experts, k = options.experts, options.kexperts
    if experts <= 0 or k >= experts:
        return 1.0
    groups, _ = expert_groups(options)
    return 1.0 - (1.0 - k / experts) ** (tokens / groups)


def expected_max_load(mean: float, bins: int) -> float:
    """Expected load of the fullest of ``bins`` bins whose loads average ``mean`` under
    uniform random throws (Raab and Steger 1998, Theorem 1): ``mean + sqrt(2·mean·ln n)``."""
    if bins <= 1:
        return mean
    return mean + math.sqrt(2 * mean * math.log(bins))


def expert_capacity(options: GenerateOptions, tokens: int) -> int:
    """Slots of one expert for a micro-batch of ``tokens`` tokens (all replicas together;
    the ``capacity`` dimension is then split over the token-holding ranks).

    ``capacity``: ``ceil(capacity_factor · k · tokens / E)``, rounded up to a multiple of the
    ``n`` :func:`token_ranks` that split it: Megatron-LM's token-dropping capacity is per source
    rank. Its router caps each expert at ``get_capacity(num_tokens · topk, E, capacity_factor)
    = ceil((num_tokens · topk / E) · capacity_factor)`` of the rank's own ``num_tokens`` rows
    (megatron/core/transformer/moe/moe_utils.py, ``get_capacity`` and
    ``apply_router_token_dropping``, called by router.py's ``TopKRouter.routing`` with the
    rank's local tokens: its sequence share under sequence and context parallelism), and the
    alltoall dispatcher pads each source rank's rows of an expert to that capacity, so a copy
    of an expert takes ``capacity · tp_size · ep_size`` slots, one capacity from each rank of
    its expert-tp and ep groups (token_dispatcher.py, ``MoEAlltoAllTokenDispatcher.preprocess``
    under ``moe_pad_expert_input_to_capacity``; core_v0.14.0 and later). With ``tokens / n`` local
    tokens per rank, that is ``n · ceil(X / n)`` for ``X = capacity_factor · k · tokens / E``,
    which is ``n · ceil(ceil(X) / n)`` (for a whole ``n``, ``ceil(ceil(X) / n) = ceil(X / n)``):
    the global capacity rounded up to a multiple of ``n``, unchanged where ``n`` divides it and
    fewer than ``n`` slots more where not. ``dropless``: the tokens of one
    data-parallel and sequence-parallel coordinate (``tokens / (dp·sp)``) meet at its ``E``
    experts through the expert-parallel all-to-all; the step waits for the fullest of the
    ``E·dp·sp`` expert loads, each averaging ``k·tokens / (E·dp·sp)`` slots
    (:func:`expected_max_load`), and no expert can take more than the group's tokens (a token
    visits an expert at most once). Every group is shaped for that load, rounded up to a
    multiple of the ranks its slots of an expert start split over (:func:`expert_groups`: its
    ``ep`` ranks, times ``tp`` where sequence parallelism splits its tokens over tp), so that
    every rank holds whole slots. With ``ep_layout=fold`` a group is an expert-data-parallel
    coordinate (``edp`` of them, :attr:`GenerateOptions.expert_dp`) whose slots start split
    over its ``ep·etp`` ranks. The rounding is the least that gives every rank whole slots,
    and it over-prices a little: it adds fewer than ``shards`` slots to a group's fullest load,
    which is at least the mean ``k·tokens / (E·groups)``, so the expert work grows by under
    ``shards·E·groups / (k·tokens)`` of it (Megatron-LM's dropless dispatch pads nothing: each
    rank sends what its router chose)."""
    routed = tokens * options.kexperts
    if options.moe_routing == "capacity":
        capacity = -(-int(routed * options.capacity_factor) // options.experts)
        ranks = token_ranks(options)
        return -(-capacity // ranks) * ranks
    groups, shards = expert_groups(options)
    bins = options.experts * groups
    fullest = min(expected_max_load(routed / bins, bins), tokens / groups)
    return math.ceil(fullest / shards) * shards * groups
