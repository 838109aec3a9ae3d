"""Mixture of experts (Mixtral-style): Llama attention, and in every layer a router that sends
each token to its top ``kexperts`` of ``experts`` SwiGLU experts.

Written with the public plugin API only, as a third-party model would be. Expert weights are
split over the ``ep`` axis and each expert's FFN over ``etp`` (expert tensor parallelism:
``tp`` unless ``--ep_layout fold`` sets it apart); tokens reach their experts through the
all-to-alls that follow from that split (and, under expert tensor parallelism, the
all-gather / reduce-scatter over etp).
Each expert has a capacity of ``ceil(kexperts · tokens · capacity_factor / experts)`` tokens
per micro-batch; its matmuls cost the full capacity (dropped or padded slots included).

``--shared_experts N`` adds N SwiGLU experts of ``dff`` that every token goes through
(DeepSeek, Llama 4, Qwen3-Next, GLM-4.5: one each), their output added to the routed
experts'. The first ``--dense_layers`` layers (at most ``num_stacks - 1``) have a dense
SwiGLU MLP of ``--dense_dff`` instead (GLM-4.5's ``first_k_dense_replace``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from stg.api import GraphBuilder, Model, Tensor, hookimpl
from stg.models import llama

ROUTER_FLOPS = 6  # softmax over experts and top-k selection, per router logit
DISPATCH_FLOPS = 1  # one copy per routed element (its token gradient: one add)
COMBINE_FLOPS = 2  # scale by the gate weight and accumulate, per routed element
# (stg.perf.costs prices the eager dispatch and combine by their routed elements: num_ops over
# these, MOE_OPS_PER_ROUTED_ELEMENT there)
SORT_FLOPS = 0  # a copy: no arithmetic (stg.perf.costs prices the sorts' bytes, MOE_SORT_OPS)


def sorted_by_expert(b: GraphBuilder, rows: Tensor, name: str) -> Tensor:
    """``rows`` copied into another order of the experts' slots under ``--moe_sort_by_expert``
    where each expert-parallel rank holds several experts; ``rows`` itself otherwise.

    Megatron-core's alltoall token dispatcher (megatron/core/transformer/moe/token_dispatcher.py
    at core_v0.14.0, ``MoEAlltoAllTokenDispatcher``) receives the routed rows ordered by source
    rank, then by expert, and copies them into local-expert order before the experts
    (``dispatch_postprocess``: ``transpose(0, 1).contiguous()`` of the padded slots, or
    ``sort_chunks_by_idxs`` dropless) and back before the return all-to-all
    (``combine_preprocess``), when ``num_local_experts > 1``; autograd copies each gradient
    back. One copy of a rank's routed rows each: the dispatch side's runs here before its
    all-to-all, on as many bytes as arrive (every rank sends and receives its share of slots)."""
    options = b.options
    ep = int(options.get("ep") or 1)
    if not options.get("moe_sort_by_expert") or int(options.get("experts") or 1) <= ep:
        return rows
    return b.elementwise(
        name, rows, flops=SORT_FLOPS, backward_flops=SORT_FLOPS, backward_reads="nothing"
    )


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
    # routed rows per token (k, or more where experts are shaped for the fullest one): the
    # dispatch's ops are per element of its first input, the tokens
    per_token = (
        b.dim("experts").size * b.dim("capacity").size / (b.dim("batch").size * b.dim("seq").size)
    )
    dispatched = b.custom(
        "dispatch",
        [x, gates],
        "experts capacity dmodel",
        flops=DISPATCH_FLOPS * per_token,
        backward_flops=(DISPATCH_FLOPS * per_token, 1),
        grad_inputs=(0, 1),
        out_shard={"capacity": token_axes},
    )
    dispatched = sorted_by_expert(b, dispatched, "expert_sort")
    ep = {"experts": "ep", "dff": "etp"}
    gate = b.einsum(
        "ech,ehf->ecf",
        dispatched,
        b.weight("w1", "experts dmodel dff", shard=ep, linear="expert_fc1"),
        name="expert_gate",
    )
    up = b.einsum(
        "ech,ehf->ecf",
        dispatched,
        b.weight("w3", "experts dmodel dff", shard=ep, linear="expert_fc1"),
        name="expert_up",
    )
    act = b.elementwise("swiglu", gate, up, flops=llama.SWIGLU_FLOPS)
    down = b.einsum(
        "ecf,efh->ech", act, b.weight("w2", "experts dff dmodel", shard=ep), name="expert_down"
    )
    combined = b.custom(
        "combine",
        [sorted_by_expert(b, down, "expert_unsort"), gates],
        "batch seq dmodel",
        flops=COMBINE_FLOPS,
        backward_flops=COMBINE_FLOPS,
        grad_inputs=(0, 1),
        in_shardings=[b.sharding("experts capacity dmodel", {"capacity": token_axes}), None],
        out_sharding=x.sharding,
    )
    return b.residual(combined)


def shared_experts(b: GraphBuilder, x: Tensor) -> Tensor:
    """``shared_experts`` SwiGLU experts of ``dff`` that every token goes through, column/row
    parallel over tp."""
    tp = {"dff": "tp"}
    w1 = b.weight("shared_w1", "shared dmodel dff", shard=tp, linear="shared_fc1")
    w3 = b.weight("shared_w3", "shared dmodel dff", shard=tp, linear="shared_fc1")
    w2 = b.weight("shared_w2", "shared dff dmodel", shard=tp)
    gate = b.einsum("bsh,nhf->bsnf", x, w1, name="shared_gate")
    up = b.einsum("bsh,nhf->bsnf", x, w3, name="shared_up")
    act = b.elementwise("shared_swiglu", gate, up, flops=llama.SWIGLU_FLOPS)
    return b.residual(b.einsum("bsnf,nfh->bsh", act, w2, name="shared_down"))


def experts_ffn(b: GraphBuilder, x: Tensor) -> Tensor:
    """The routed experts of :func:`moe_mlp`, plus the ``--shared_experts`` where given."""
    ffn = moe_mlp(b, x)
    if b.options.get("shared_experts"):
        ffn = b.add(ffn, shared_experts(b, x), name="shared_sum")
    return ffn


def block(b: GraphBuilder, x: Tensor) -> Tensor:
    x = b.add(x, llama.attention(b, b.rmsnorm(x, "attention_norm")), name="residual1")
    return b.add(x, experts_ffn(b, b.rmsnorm(x, "ffn_norm")), name="residual2")


def global_block(b: GraphBuilder, x: Tensor) -> Tensor:
    """An MoE layer whose attention sees every earlier key (``--full_attention_every``)."""
    h = b.rmsnorm(x, "attention_norm")
    x = b.add(x, llama.attention(b, h, full=True), name="residual1")
    return b.add(x, experts_ffn(b, b.rmsnorm(x, "ffn_norm")), name="residual2")


def dense_block(b: GraphBuilder, x: Tensor) -> Tensor:
    """One of the first ``--dense_layers`` layers: a SwiGLU MLP of ``dense_dff``."""
    x = b.add(x, llama.attention(b, b.rmsnorm(x, "attention_norm")), name="residual1")
    return b.add(x, llama.mlp(b, b.rmsnorm(x, "ffn_norm"), "dff_dense"), name="residual2")


def dense_global_block(b: GraphBuilder, x: Tensor) -> Tensor:
    """A dense layer whose attention sees every earlier key."""
    h = b.rmsnorm(x, "attention_norm")
    x = b.add(x, llama.attention(b, h, full=True), name="residual1")
    return b.add(x, llama.mlp(b, b.rmsnorm(x, "ffn_norm"), "dff_dense"), name="residual2")


def dense_layer_count(options: Mapping[str, Any]) -> int:
    """The dense layers of a stack of ``num_stacks``: ``dense_layers``, at most
    ``num_stacks - 1`` (one MoE layer at least)."""
    return max(0, min(int(options.get("dense_layers") or 0), int(options["num_stacks"]) - 1))


Layers = list[tuple[str, Callable[[GraphBuilder, Tensor], Tensor], int]]


def stack(options: Mapping[str, Any]) -> Layers:
    """The MoE layers: all alike, or local and global in turn (as gpt-oss's); the first
    ``dense_layers`` of them dense (kinds ``dense`` and, for a global one, ``dense_global``)."""
    layers = llama.local_global_stack(options, block, global_block)
    dense = dense_layer_count(options)
    if not dense:
        return layers
    if len(layers) == 1:  # one run of alike layers
        kind, fn, count = layers[0]
        return [("dense", dense_block, dense), (kind, fn, count - dense)]
    swapped = {"local": ("dense", dense_block), "global": ("dense_global", dense_global_block)}
    return [(*swapped[kind], 1) for kind, _, _ in layers[:dense]] + layers[dense:]


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
