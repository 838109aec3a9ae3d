"""How many token slots each expert's matmuls are shaped for: the two MoE routings.

- ``capacity`` (token dropping, GShard / Switch Transformer): each expert takes at most
  ``ceil(capacity_factor · k · tokens / E)`` tokens of a micro-batch; tokens above it are
  dropped, slots below it padded, so the matmuls always cost the full capacity. With
  ``capacity_factor`` 1 this is perfectly balanced routing (what Megatron's
  ``--moe-router-force-load-balancing`` benchmarks run).
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


def expected_max_load(mean: float, bins: int) -> float:
    """Expected load of the fullest of ``bins`` bins whose loads average ``mean`` under
    uniform random throws (Raab and Steger 1998, Theorem 1): ``mean + sqrt(2·mean·ln n)``."""
    if bins <= 1:
        return mean
    return mean + math.sqrt(2 * mean * math.log(bins))


def expert_capacity(options: GenerateOptions, tokens: int) -> int:
    """Slots of one expert for a micro-batch of ``tokens`` tokens (all replicas together;
    the ``capacity`` dimension is then split over the token-holding ranks).

    ``capacity``: ``ceil(capacity_factor · k · tokens / E)``. ``dropless``: the tokens of one
    data-parallel and sequence-parallel coordinate (``tokens / (dp·sp)``) meet at its ``E``
    experts through the expert-parallel all-to-all; the step waits for the fullest of the
    ``E·dp·sp`` expert loads, each averaging ``k·tokens / (E·dp·sp)`` slots
    (:func:`expected_max_load`), and no expert can take more than the group's tokens (a token
    visits an expert at most once). Every group is shaped for that load, rounded up to a
    multiple of ``ep`` (the group's slots of an expert start split over its ep ranks).
    With ``ep_layout=fold`` a group is an expert-data-parallel coordinate (``edp`` of them,
    :attr:`GenerateOptions.expert_dp`) whose slots start split over its ``ep·etp`` ranks."""
    routed = tokens * options.kexperts
    if options.moe_routing == "capacity":
        return -(-int(routed * options.capacity_factor) // options.experts)
    if options.ep_folded:
        groups, shards = options.expert_dp, options.ep * options.expert_tp
    else:
        groups, shards = options.dp * options.sp, options.ep
    bins = options.experts * groups
    fullest = min(expected_max_load(routed / bins, bins), tokens / groups)
    return math.ceil(fullest / shards) * shards * groups
