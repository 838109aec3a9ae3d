"""Mixture of experts (Mixtral-style): Llama attention, and in every layer a router that sends
each token to its top ``kexperts`` of ``experts`` SwiGLU experts.

Written with the public plugin API only, as a third-party model would be. Expert weights are
split over the ``ep`` axis and each expert's FFN over ``etp`` (expert tensor parallelism:
``tp`` unless ``--ep_layout fold`` sets it apart); tokens reach their experts through the
all-to-alls that follow from that split (and, under expert tensor parallelism, the
all-gather / reduce-scatter over etp).
Each expert has a capacity of ``ceil(kexperts · tokens · capacity_factor / experts)`` tokens
per micro-batch; its matmuls cost the full capacity (dropped or padded slots included).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stg.api import GraphBuilder, Model, Tensor, hookimpl
from stg.models import llama

ROUTER_FLOPS = 6  # softmax over experts and top-k selection, per router logit
COMBINE_FLOPS = 2  # scale by the gate weight and accumulate, per expert output element


def moe_mlp(b: GraphBuilder, x: Tensor) -> Tensor:
    logits = b.einsum("bsh,he->bse", x, b.weight("router", "dmodel experts"), name="router")
    gates = b.custom(
        "router_topk",
        [logits],
        "batch seq experts",
        flops=ROUTER_FLOPS,
        backward_flops=ROUTER_FLOPS,
    )
    token_axes = b.axes_of(x, "batch", "seq")
    dispatched = b.custom(
        "dispatch",
        [x, gates],
        "experts capacity dmodel",
        flops=1,
        backward_flops=1,
        grad_inputs=(0, 1),
        out_shard={"capacity": token_axes},
    )
    ep = {"experts": "ep", "dff": "etp"}
    gate = b.einsum(
        "ech,ehf->ecf",
        dispatched,
        b.weight("w1", "experts dmodel dff", shard=ep),
        name="expert_gate",
    )
    up = b.einsum(
        "ech,ehf->ecf", dispatched, b.weight("w3", "experts dmodel dff", shard=ep), name="expert_up"
    )
    act = b.elementwise("swiglu", gate, up, flops=llama.SWIGLU_FLOPS)
    down = b.einsum(
        "ecf,efh->ech", act, b.weight("w2", "experts dff dmodel", shard=ep), name="expert_down"
    )
    combined = b.custom(
        "combine",
        [down, gates],
        "batch seq dmodel",
        flops=COMBINE_FLOPS,
        backward_flops=COMBINE_FLOPS,
        grad_inputs=(0, 1),
        in_shardings=[b.sharding("experts capacity dmodel", {"capacity": token_axes}), None],
        out_sharding=x.sharding,
    )
    return b.residual(combined)


def block(b: GraphBuilder, x: Tensor) -> Tensor:
    x = b.add(x, llama.attention(b, b.rmsnorm(x, "attention_norm")), name="residual1")
    return b.add(x, moe_mlp(b, b.rmsnorm(x, "ffn_norm")), name="residual2")


def global_block(b: GraphBuilder, x: Tensor) -> Tensor:
    """An MoE layer whose attention sees every earlier key (``--full_attention_every``)."""
    h = b.rmsnorm(x, "attention_norm")
    x = b.add(x, llama.attention(b, h, full=True), name="residual1")
    return b.add(x, moe_mlp(b, b.rmsnorm(x, "ffn_norm")), name="residual2")


def stack(options: Mapping[str, Any]) -> list[tuple[str, Any, int]]:
    """The MoE layers: all alike, or local and global in turn (as gpt-oss's)."""
    return llama.local_global_stack(options, block, global_block)


@hookimpl
def stg_register_models(register):  # type: ignore[no-untyped-def]
    register(
        Model(
            "moe",
            embedding=llama.embedding,
            block=block,
            head=llama.head,
            stack=stack,
            description="Mixture of experts: Llama attention, top-k routed SwiGLU experts",
        )
    )
