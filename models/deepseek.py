"""DeepSeek-V3 (and V2): multi-head latent attention, MoE layers of many small routed experts
beside shared experts, and dense first layers (DeepSeek-AI, arXiv:2412.19437, section 2.1).

Multi-head latent attention (MLA), as trained (no matrix absorption), per token ``x``:

- queries: ``c_q = RMSNorm(x·W_DQ)`` (rank ``q_lora_rank``; without it ``x`` itself), then
  ``q = c_q·W_UQ`` (``head·dhead``) and ``q_rope = RoPE(c_q·W_QR)`` (``head·drope``);
- the latent ``x·W_DKV`` (``kv_lora_rank + drope`` per token: what inference caches) splits
  into ``c_kv = RMSNorm(latent[:kv_lora_rank])`` and the decoupled key
  ``k_rope = RoPE(latent[kv_lora_rank:])``, one for all heads;
- ``k = c_kv·W_UK`` and ``v = c_kv·W_UV`` (``head·dhead`` each: DeepSeek's
  ``qk_nope_head_dim`` and ``v_head_dim``, both 128), ``k_rope`` copied to every head (the
  ``[head, dhead + drope]`` key the attention kernel reads and keeps), scores
  ``q·k + q_rope·k_rope``, softmax, context ``P·v``, output ``context·W_O``.

Serving (``--phase``): the KV cache holds the normalised ``c_kv`` and the rotated ``k_rope``
(``b.cached``: ``kv_lora_rank + drope`` per token and layer, whole on every tp rank). Prefill
keeps the form above, up-projecting keys and values from the cached latent; decode and mixed
iterations absorb the up-projections (DeepSeek-V2's section 2.1.2, vLLM's MLA decode):
``q_latent = q·W_UK`` per head, scores ``q_latent·c_kv + q_rope·k_rope`` and context
``P·c_kv`` against the one latent head, then ``context·W_UV`` and ``W_O``.

Tensor parallelism splits the heads (``W_UQ``, ``W_QR``, ``W_UK``, ``W_UV``, ``W_O``); the
down-projections and their norms are replicated, and the builder gathers the latent (not
``x``) where the heads need it. MoE layers are ``stg.models.moe``'s routed experts (router,
top-k, dispatch and combine over ``ep``) plus ``shared_experts`` SwiGLU experts of ``dff``
that every token uses. The first ``dense_layers`` layers (at most ``num_stacks - 1``, so
that ``--num_stacks 2`` keeps one dense and one MoE layer) have a dense SwiGLU MLP of
``dense_dff``.

Multi-token prediction (V3's section 2.2), with ``--mtp_depth D`` (unset: none): after the
head's loss, module k = 1..D joins ``RMSNorm(h^(k-1))`` (the last layer's output for k = 1)
and ``RMSNorm(Emb(tokens shifted by k))`` into ``[.., 2·dmodel]``, projects it back to
dmodel (``mtp<k>_proj``), runs one MoE layer, and adds the cross-entropy of its own norm and
the shared LM head to the loss (the loss weight λ is a scale: not modelled). Its ops run in
the head on the last pipeline stage; the embedding it shares with the model is a copy there
(``mtp_wte``), as Megatron keeps one of a tied embedding, and the LM head is the head's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy

from stg.api import AttentionSpan, Dim, GraphBuilder, Model, Sharding, Tensor, hookimpl
from stg.errors import UserError
from stg.models import llama, moe
from stg.models.gpt import (
    CROSS_ENTROPY_BACKWARD_FLOPS,
    CROSS_ENTROPY_FLOPS,
    SOFTMAX_FLOPS,
    causal_scale,
)

RMSNORM_FLOPS = 4
ABSORBED_PHASES = ("decode", "mixed")
INDEX_HEADS = 64  # index_n_heads (DeepSeek-V3.2-Exp, config.json)
INDEX_HEAD_DIM = 128  # index_head_dim (DeepSeek-V3.2-Exp, config.json)
LAYERNORM_FLOPS = 7  # the indexer's key LayerNorm, per element
TOPK_FLOPS = 1  # one comparison per index score (a radix select)
KL_FLOPS = 8  # per picked key: normalise the target, softmax (3), the KL term (4)
UP_PROJ = "mla_up_proj"
"""Tag of the ops that Megatron-LM's ``mla_up_proj`` selective recompute re-runs (its
``--recompute-modules`` entry): ``qkv_up_proj_and_rope_apply``, run in a
``CheckpointWithoutOutput`` (megatron/core/transformer/multi_latent_attention.py,
NVIDIA/Megatron-LM d98e8a6): the latents' norms (fused into the up-projections'
``TELayerNormColumnParallelLinear`` under ``--qk-layernorm``), the query and key/value
up-projections with the sequence-parallel gathers of the normalised latents, and RoPE of the
query and of the shared key. Not the latent's slices (the checkpoint's inputs) nor the shared
key's gather, which the attention's (``core_attention``) reshard makes: Megatron gathers that
key before the checkpoint, which keeps the gathered copy, so under sequence parallelism the
recomputed rotation of this rank's rows is read by no later op."""
MLP = "mlp"
"""Tag of the ops that Megatron-LM's ``mlp`` selective recompute re-runs: the dense MLP of
the first ``dense_layers`` layers, from its input (the ``ffn_norm`` output; under sequence
parallelism its gather runs again), as :func:`stg.models.llama.mlp` tags Llama's. Megatron
sets ``recompute_mlp`` only where the layer's MLP is not an ``MoELayer``
(megatron/core/transformer/transformer_layer.py, NVIDIA/Megatron-LM d98e8a6): the MoE
layers, their shared experts included (Megatron's ``shared_experts`` module, not built),
re-run nothing under ``mlp``."""


def sparse_span(b: GraphBuilder) -> AttentionSpan | None:
    """DeepSeek sparse attention (``--index_topk``): each query attends to the ``index_topk``
    keys its lightning indexer picks; None without it."""
    topk = b.options.get("index_topk")
    if not topk:
        return None
    if not b.options.get("causal"):
        raise UserError("index_topk picks among earlier keys: it needs --causal true")
    return AttentionSpan(topk=int(topk))


def lightning_indexer(b: GraphBuilder, x: Tensor, c_q: Tensor, source: str) -> Tensor:
    """The indexes of the keys each query attends to, ``[batch, seq, index_topk]``:
    DeepSeek-V3.2's lightning indexer (DeepSeek-AI 2025, "DeepSeek-V3.2-Exp", section 2.1),
    ``I[t, s] = Σ_j w[t, j] · ReLU(q_I[t, j] · k_I[s])`` over ``index_heads`` heads in fp8,
    then the top ``index_topk`` per query. Its input is detached from the model (the sparse
    training stage trains it on its own loss only, :func:`indexer_loss`); its weights are
    whole on every tensor-parallel rank. The ReLU and the weighting (2 FLOPs per head and
    pair, 1/index_head_dim of the dot products) are left out of its FLOPs."""
    heads = Dim("index_heads", sympy.Integer(int(b.options.get("index_heads") or INDEX_HEADS)))
    size = int(b.options.get("index_head_dim") or INDEX_HEAD_DIM)
    dim = Dim("index_head_dim", sympy.Integer(size))
    x, c_q = b.detach(x), b.detach(c_q)
    q = b.einsum("bsl,ljd->bsjd", c_q, b.weight("index_wq", [b.dim(source), heads, dim]),
                 name="index_q")  # fmt: skip
    k = b.einsum("bsh,hd->bsd", x, b.weight("index_wk", [b.dim("dmodel"), dim]), name="index_k")
    k = b.elementwise(
        "index_k_norm",
        k,
        b.weight("index_k_norm.weight", [dim]),
        b.weight("index_k_norm.bias", [dim]),
        flops=LAYERNORM_FLOPS,
        reduce=(-1,),
    )
    w = b.einsum(
        "bsh,hj->bsj", x, b.weight("index_w", [b.dim("dmodel"), heads]), name="index_weights"
    )
    k = b.cached(b.cast(k, "fp8", "index_k_fp8"), "index_k")
    scores = b.einsum(
        "bsjd,btd,bsj->bst",
        b.cast(q, "fp8", "index_q_fp8"),
        k,
        w,
        name="index_scores",
        scale=causal_scale(b),
        out_dtype="fp32",
    )
    picked = Dim("index_topk", sympy.Integer(int(b.options["index_topk"])))
    return b.custom(  # 4-byte key indexes (int32), stored like fp32
        "index_topk",
        [scores],
        [b.dim("batch"), b.dim("seq"), picked],
        flops=TOPK_FLOPS,
        backward_flops=0,
        grad_inputs=(),
        out_dtype="fp32",
    )


def indexer_loss(b: GraphBuilder, picks: Tensor, probs: Tensor) -> None:
    """Training: the indexer's loss, the KL divergence from the main attention's distribution
    over each query's picked keys (summed over heads, normalised) to the softmax of its index
    scores there (DeepSeek-V3.2-Exp, section 2.1, sparse training stage). The attention is
    detached: the loss trains the indexer only."""
    scores = picks.producer.inputs[0]  # type: ignore[union-attr]
    keys = scores.dims[-1].size
    topk = picks.dims[-1]
    at_picks = b.custom(
        "attention_at_picks",
        [b.detach(probs), picks],
        [b.dim("batch"), b.dim("head"), b.dim("seq"), topk],
        flops=topk.size / keys,  # one value gathered per picked key
        backward_flops=0,
        grad_inputs=(),
    )
    target = b.einsum("bask->bsk", at_picks, name="indexer_target")  # partial over tp
    loss = b.custom(
        "indexer_kl",
        [scores, target, picks],
        "batch seq",
        flops=KL_FLOPS * topk.size / keys,
        backward_flops=(2 * topk.size / keys,),  # softmax minus target at the picks
        grad_inputs=(0,),
        out_dtype="fp32",
    )
    b.aux_loss(loss)


def latent_norm(b: GraphBuilder, x: Tensor, dim: str, name: str) -> Tensor:
    """RMSNorm over a compressed dimension (``qlora``, ``kvlora``) with its weight."""
    weight = b.weight(f"{name}.weight", dim)
    return b.elementwise(name, x, weight, flops=RMSNORM_FLOPS, reduce=(dim,))


def kv_latent(b: GraphBuilder, x: Tensor) -> Tensor:
    """The joint key/value compression of each token together with its decoupled RoPE key:
    ``[batch, seq, kvcache]``, kvcache = kv_lora_rank + drope. The KV cache holds this."""
    return b.einsum("bsh,hc->bsc", x, b.weight("w_dkv", "dmodel kvcache"), name="kv_latent")


def absorbed(b: GraphBuilder) -> bool:
    """Whether attention runs in the latent space with W_UK and W_UV absorbed (decode and
    mixed serving iterations), rather than up-projecting keys and values (training, prefill)."""
    return b.options.get("phase") in ABSORBED_PHASES


def attention(b: GraphBuilder, x: Tensor) -> Tensor:
    """Multi-head latent attention (module docstring)."""
    tp = {"head": "tp"}
    if b.options.get("q_lora_rank") is not None:
        c_q = b.einsum("bsh,hl->bsl", x, b.weight("w_dq", "dmodel qlora"), name="q_down")
        with b.tag(UP_PROJ):
            c_q = latent_norm(b, c_q, "qlora", "q_norm")
        source = "qlora"
    else:
        c_q, source = x, "dmodel"
    with b.tag(UP_PROJ):
        # Megatron-Core's linear_q_up_proj and linear_kv_up_proj: one weight each
        w_uq = b.weight("w_uq", f"{source} head dhead", shard=tp, linear="q_up")
        q = b.einsum("bsl,lak->bsak", c_q, w_uq, name="q")
        q_rope = b.einsum(
            "bsl,lar->bsar",
            c_q,
            b.weight("w_qr", f"{source} head drope", shard=tp, linear="q_up"),
            name="q_rope",
        )
        q_rope = b.elementwise("rope_q", q_rope, flops=llama.ROPE_FLOPS)
    latent = kv_latent(b, x)
    c_kv = b.slice(latent, "kvcache", "kvlora", name="c_kv")
    with b.tag(UP_PROJ):
        c_kv = latent_norm(b, c_kv, "kvlora", "kv_norm")
    k_rope = b.slice(latent, "kvcache", "drope", name="k_rope")
    with b.tag(UP_PROJ):
        k_rope = b.elementwise("rope_k", k_rope, flops=llama.ROPE_FLOPS)
    # serving caches the normalised latent and the rotated shared key: kv_lora_rank + drope
    # values per token and layer, for all heads (training: the tensors themselves)
    c_kv = b.cached(c_kv, "c_kv")
    k_rope = b.cached(k_rope, "k_rope")
    w_uk = b.weight("w_uk", "kvlora head dhead", shard=tp, linear="kv_up")
    scale = causal_scale(b)
    span = sparse_span(b)
    picks = lightning_indexer(b, x, c_q, source) if span is not None else None
    if absorbed(b):
        # W_UK absorbed into the query, W_UV applied to the latent context: one latent key and
        # value (c_kv) for all heads, as DeepSeek's and vLLM's MLA decode kernels run it
        q_latent = b.einsum("bsak,cak->bsac", q, w_uk, name="q_absorb")
        w_uv = b.weight("w_uv", "kvlora head dhead", shard=tp, linear="kv_up")
        with b.tag("core_attention"):
            scores = score_sum(
                b,
                b.einsum("bsac,btc->bast", q_latent, c_kv, name="scores", scale=scale, span=span),
                b.einsum(
                    "bsar,btr->bast", q_rope, k_rope, name="scores_rope", scale=scale, span=span
                ),
                picks,
            )
            probs = softmax(b, scores, span)
            latent_ctx = b.einsum(
                "bast,btc->bsac", probs, c_kv, name="context", scale=scale, span=span
            )
        ctx = b.einsum("bsac,cak->bsak", latent_ctx, w_uv, name="v_absorb")
    else:
        with b.tag(UP_PROJ):
            k = b.einsum("bsc,cak->bsak", c_kv, w_uk, name="k")
            w_uv = b.weight("w_uv", "kvlora head dhead", shard=tp, linear="kv_up")
            v = b.einsum("bsc,cak->bsak", c_kv, w_uv, name="v")
        if b.options.get("phase", "training") == "training":
            k_rope = expand_heads(b, q_rope, k_rope)
        with b.tag("core_attention"):
            scores = score_sum(
                b,
                b.einsum("bsak,btak->bast", q, k, name="scores", scale=scale, span=span),
                b.einsum(
                    "bsar,bt" + ("ar" if len(k_rope.dims) == 4 else "r") + "->bast",
                    q_rope,
                    k_rope,
                    name="scores_rope",
                    scale=scale,
                    span=span,
                ),
                picks,
            )
            probs = softmax(b, scores, span)
            ctx = b.einsum("bast,btak->bsak", probs, v, name="context", scale=scale, span=span)
        if picks is not None and b.options.get("phase", "training") == "training":
            indexer_loss(b, picks, probs)
    wo = b.weight("wo", "head dhead dmodel", shard=tp)
    return b.residual(b.einsum("bsak,akh->bsh", ctx, wo, name="attn_out"))


def softmax(b: GraphBuilder, scores: Tensor, span: AttentionSpan | None) -> Tensor:
    """The softmax over keys; under sparse attention over the picked keys of each row only."""
    flops: sympy.Expr = sympy.Integer(SOFTMAX_FLOPS)
    if span is not None:  # a row's picks, of its keys
        keys = scores.dims[-1].size
        flops = SOFTMAX_FLOPS * sympy.Min(span.topk, keys) / keys
    return b.elementwise("softmax", scores, flops=flops, reduce=(-1,))


def expand_heads(b: GraphBuilder, q_rope: Tensor, k_rope: Tensor) -> Tensor:
    """Training: the shared rotated key copied to every head of this rank, as the attention
    kernel reads it. Megatron-LM's MLA (``qkv_up_proj_and_rope_apply`` in
    ``megatron/core/transformer/multi_latent_attention.py``, d98e8a6) expands ``k_pos_emb`` to
    the heads and concatenates it to ``k_no_pe``: a ``[.., head, dhead + drope]`` key that the
    fused attention keeps for its backward (torchtitan's DeepSeek-V3 does the same). The key
    is gathered first, as the attention's einsum would gather it (under sequence parallelism
    its rows; tagged ``core_attention``: Megatron gathers it before the ``mla_up_proj``
    checkpoint), then copied (tagged :data:`UP_PROJ`); the copy's backward sums the heads'
    gradients into the shared key's. Serving keeps one key: a prefill's keys come from the
    KV cache, which holds the shared one."""
    letters = dict(zip("bsar", q_rope.sharding.dims, strict=True))
    owned = frozenset().union(*q_rope.sharding.dims)
    # the einsum bsar,btr->bast's sharding of the key: q_rope's axes on the letters they
    # share, the key's own where q_rope leaves them free
    target = Sharding(
        tuple(
            letters.get(c, frozenset()) | (axes - owned)
            for c, axes in zip("btr", k_rope.sharding.dims, strict=True)
        )
    )
    with b.tag("core_attention"):
        k_rope = b.reshard(k_rope, target)
    batch, seq, rope = target.dims
    # this rank's heads: tensor parallelism splits them
    heads = b.dim("head").size / (int(b.options.get("tp") or 1) if letters["a"] else 1)
    with b.tag(UP_PROJ):
        return b.custom(
            "k_rope_expand",
            [k_rope],
            "batch seq head drope",
            flops=0,  # a copy
            backward_flops=heads,  # per element of the shared key: the sum of its heads' copies
            out_sharding=Sharding((batch, seq, letters["a"], rope)),
        )


def score_sum(b: GraphBuilder, latent: Tensor, rope: Tensor, picks: Tensor | None) -> Tensor:
    """The scores: their content and RoPE parts added; under sparse attention at the keys the
    indexer picked only (1 FLOP per pick), which makes the picks an input of the kernel."""
    if picks is None:
        return b.add(latent, rope, name="scores_sum")
    keys = latent.dims[-1].size
    return b.custom(
        "scores_sum",
        [latent, rope, picks],
        list(latent.dims),
        flops=sympy.Min(picks.dims[-1].size, keys) / keys,
        backward_flops=0,
        grad_inputs=(0, 1),
        out_sharding=latent.sharding,
    )


def swiglu(b: GraphBuilder, x: Tensor, ffn: str, prefix: str = "") -> Tensor:
    """A SwiGLU MLP of FFN size ``ffn`` (a dimension name), column/row parallel over tp."""
    tp = {ffn: "tp"}
    gate = b.einsum(
        "bsh,hf->bsf",
        x,
        b.weight(f"{prefix}w1", f"dmodel {ffn}", shard=tp, linear=f"{prefix}fc1"),
        name=f"{prefix}gate",
    )
    up = b.einsum(
        "bsh,hf->bsf",
        x,
        b.weight(f"{prefix}w3", f"dmodel {ffn}", shard=tp, linear=f"{prefix}fc1"),
        name=f"{prefix}up",
    )
    act = b.elementwise(f"{prefix}swiglu", gate, up, flops=llama.SWIGLU_FLOPS)
    down = b.einsum(
        "bsf,fh->bsh", act, b.weight(f"{prefix}w2", f"{ffn} dmodel", shard=tp), name=f"{prefix}down"
    )
    return b.residual(down)


def dense_block(b: GraphBuilder, x: Tensor) -> Tensor:
    """One of the first ``dense_layers`` layers: a SwiGLU MLP of ``dense_dff``, tagged
    :data:`MLP`."""
    x = b.add(x, attention(b, b.rmsnorm(x, "attention_norm")), name="residual1")
    h = b.rmsnorm(x, "ffn_norm")
    with b.tag(MLP):  # re-run under --recompute_modules mlp
        ffn = swiglu(b, h, "dff_dense")
    return b.add(x, ffn, name="residual2")


def moe_block(b: GraphBuilder, x: Tensor) -> Tensor:
    x = b.add(x, attention(b, b.rmsnorm(x, "attention_norm")), name="residual1")
    return b.add(x, moe.experts_ffn(b, b.rmsnorm(x, "ffn_norm")), name="residual2")


def cross_entropy(b: GraphBuilder, x: Tensor, lm_head: Tensor, prefix: str = "") -> Tensor:
    """The final norm, the logits of the LM head ``lm_head`` and the loss."""
    h = b.rmsnorm(x, f"{prefix}norm" if prefix else "ln_f")
    logits = b.einsum("bsh,vh->bsv", h, lm_head, name=f"{prefix}logits")
    return b.custom(
        f"{prefix}cross_entropy",
        [logits],
        "batch seq",
        flops=CROSS_ENTROPY_FLOPS,
        backward_flops=CROSS_ENTROPY_BACKWARD_FLOPS,
        out_dtype="fp32",
    )


def head(b: GraphBuilder, x: Tensor) -> Tensor:
    """Llama's head; with ``--mtp_depth`` the multi-token prediction modules after it."""
    depth = int(b.options.get("mtp_depth") or 0)
    if not depth:
        return llama.head(b, x)
    if b.options.get("tie_embeddings"):
        raise UserError(
            "tie_embeddings with mtp_depth is not built (the multi-token prediction modules "
            "keep their own embedding copy); allowed: tie_embeddings false"
        )
    vocab = {"dvocal": "tp"}
    lm_head = b.weight("lm_head", "dvocal dmodel", shard=vocab)
    loss = cross_entropy(b, x, lm_head)
    wte = b.weight("mtp_wte", "dvocal dmodel", shard=vocab)
    joined_dim = Dim("mtp_concat", 2 * b.dim("dmodel").size)
    hidden = x
    for k in range(1, depth + 1):
        with b.tag("mtp"):
            ids = b.tokens(name=f"mtp{k}_tokens")  # the tokens k positions ahead
            embedded = b.residual(b.gather(wte, ids, name=f"mtp{k}_embedding"))
            joined = b.concat(
                b.rmsnorm(hidden, f"mtp{k}_hnorm"),
                b.rmsnorm(embedded, f"mtp{k}_enorm"),
                dim="dmodel",
                to=joined_dim,
                name=f"mtp{k}_concat",
            )
            projection = b.weight(f"mtp{k}_proj", [joined_dim, b.dim("dmodel")])
            hidden = moe_block(b, b.einsum("bsc,ch->bsh", joined, projection, name=f"mtp{k}_proj"))
            extra = cross_entropy(b, hidden, lm_head, f"mtp{k}_")
            # the weighted sum of the losses (a custom op: the backward starts from the loss)
            loss = b.custom(
                f"mtp{k}_loss", [loss, extra], "batch seq", flops=1, backward_flops=1,
                grad_inputs=(0, 1), out_dtype="fp32",
            )  # fmt: skip
    return loss


def stack(options: Mapping[str, Any]) -> list[tuple[str, Any, int]]:
    dense = moe.dense_layer_count(options)
    return [("dense", dense_block, dense), ("moe", moe_block, int(options["num_stacks"]) - dense)]


@hookimpl
def stg_register_models(register):  # type: ignore[no-untyped-def]
    register(
        Model(
            "deepseek",
            embedding=llama.embedding,
            block=moe_block,
            head=head,
            stack=stack,
            description="DeepSeek-V3: latent attention, shared + routed experts, dense first",
        )
    )
