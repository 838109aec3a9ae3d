"""Gated DeltaNet: linear attention with the gated delta rule, in its chunkwise form.

Yang, Kautz and Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule"
(ICLR 2025, arXiv:2412.06464), section 3.3: the recurrence
``S_t = alpha_t S_{t-1} (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ``, ``o_t = S_t q_t`` is computed over
chunks of ``CHUNK`` tokens. Within a chunk, the WY representation gives
``T = (I + strict_lower(β K Kᵀ ∘ Γ))⁻¹`` (a triangular solve), ``W = T (β Γ K)`` and
``U = T (β V)``; between chunks the state passes on, ``v_new = U - W S``,
``S' = Γ_last S + Kᵀ (Γ v_new)``; each chunk's output is ``Q S ∘ Γ + (Q Kᵀ ∘ Γ_mask) v_new``.

The state passing is a true sequential dependency (the state multiplies a matrix that
depends on the data), computed by one kernel that loops over the chunks (flash-linear-
attention's ``chunk_gated_delta_rule_fwd_h``, which also writes ``v_new``). Here it is one
op, ``state_scan``, whose FLOPs are its ``Kᵀ v_new`` products and the state's decay; the
``W S`` products it also needs are the ``v_new`` einsum that follows it, so that every
multiply is counted once. The graph needs no loop: the scan's inputs and outputs are whole
tensors, and its backward is declared like any custom op's.

Heads as in Qwen3-Next (``Qwen3NextGatedDeltaNet``, transformers v4.57): ``--linear_key_heads``
query/key heads, each serving ``linear_value_heads / linear_key_heads`` value heads,
``--linear_head_dim`` per head (keys and values alike), a causal convolution of width 4 over
q, k and v, L2-normalised q and k, an output gate ``z`` through a gated RMSNorm. Tensor
parallelism splits the key heads. A decode step runs the recurrence on a state of
``[value heads, head_dim, head_dim]`` per sequence: constant size per token.
"""

from __future__ import annotations

import sympy

from stg.api import GraphBuilder, Model, Tensor, hookimpl
from stg.errors import UserError
from stg.models import llama
from stg.models.mamba2 import (
    GATED_NORM_FLOPS,
    SOFTPLUS_FLOPS,
    check_chunks,
    conv,
    fixed,
)

CHUNK = 64  # chunk size of flash-linear-attention's chunk_gated_delta_rule (BT = 64)
HEAD_DIM = 128  # Qwen3-Next: linear_key_head_dim = linear_value_head_dim = 128
L2NORM_FLOPS = 3  # square-and-sum, then scale by the reciprocal root
SIGMOID_FLOPS = 4  # β = sigmoid(b): negate, exp, add, divide


def mixer(b: GraphBuilder, x: Tensor) -> Tensor:
    """The gated DeltaNet mixer of ``x`` ``[batch, seq, dmodel]``."""
    o = b.options
    keys = int(o.get("linear_key_heads") or o["head"])
    values = int(o.get("linear_value_heads") or keys)
    if values % keys:
        raise UserError(f"linear_key_heads={keys} must divide linear_value_heads={values}")
    tp = int(o.get("tp") or 1)
    if keys % tp:
        raise UserError(f"tp={tp} must divide linear_key_heads={keys}")
    check_chunks(b, CHUNK, f"gated DeltaNet's chunk of {CHUNK} tokens")
    dim = int(o.get("linear_head_dim") or HEAD_DIM)
    g, r = fixed("linear_key_heads", keys), fixed("linear_value_group", values // keys)
    kd, vd = fixed("linear_key_dim", dim), fixed("linear_value_dim", dim)
    dmodel, batch, seq = b.dim("dmodel"), b.dim("batch"), b.dim("seq")
    split = {"linear_key_heads": "tp"}
    q = b.einsum(
        "bsh,hgk->bsgk",
        x,
        b.weight("w_q", [dmodel, g, kd], shard=split, linear="in_proj"),
        name="q",
    )
    k = b.einsum(
        "bsh,hgk->bsgk",
        x,
        b.weight("w_k", [dmodel, g, kd], shard=split, linear="in_proj"),
        name="k",
    )
    v = b.einsum(
        "bsh,hgrv->bsgrv",
        x,
        b.weight("w_v", [dmodel, g, r, vd], shard=split, linear="in_proj"),
        name="v",
    )
    z = b.einsum(
        "bsh,hgrv->bsgrv",
        x,
        b.weight("w_z", [dmodel, g, r, vd], shard=split, linear="in_proj"),
        name="z",
    )
    beta = b.einsum(
        "bsh,hgr->bsgr", x, b.weight("w_b", [dmodel, g, r], shard=split, linear="in_proj"), name="b"
    )
    a = b.einsum(
        "bsh,hgr->bsgr", x, b.weight("w_a", [dmodel, g, r], shard=split, linear="in_proj"), name="a"
    )
    width = fixed("conv", 4)  # linear_conv_kernel_dim 4, without bias (Qwen3-Next)
    q = conv(b, q, [g, kd, width], "conv_q", "linear_key_heads", bias=False)
    k = conv(b, k, [g, kd, width], "conv_k", "linear_key_heads", bias=False)
    v = conv(b, v, [g, r, vd, width], "conv_v", "linear_key_heads", bias=False)
    q = b.elementwise("l2norm_q", q, flops=L2NORM_FLOPS, reduce=(-1,))
    k = b.elementwise("l2norm_k", k, flops=L2NORM_FLOPS, reduce=(-1,))
    beta = b.elementwise("beta_sigmoid", beta, flops=SIGMOID_FLOPS)
    decay = b.elementwise(  # log alpha = -exp(A_log) · softplus(a + dt_bias)
        "log_decay",
        a,
        b.weight("dt_bias", [g, r], shard=split),
        b.weight("a_log", [g, r], shard=split),
        flops=SOFTPLUS_FLOPS + 2,
    )
    if o.get("phase") == "decode":
        out = recurrent_step(b, q, k, v, beta, decay, [batch, g, r, kd, vd])
    else:
        out = chunked(b, q, k, v, beta, decay)
        out = b.view(out, [batch, seq, g, r, vd], name="delta_out")
        if o.get("phase") == "prefill":  # the state its last chunk leaves, kept
            shard = {"linear_key_heads": "tp", "batch": b.data_axes}
            b.recurrent_state("delta_state", [batch, g, r, kd, vd], shard=shard)
    out = b.elementwise(
        "gated_norm",
        out,
        z,
        b.weight("gated_norm.weight", [vd]),
        flops=GATED_NORM_FLOPS,
        reduce=(-1,),
    )
    w_out = b.weight("w_out", [g, r, vd, dmodel], shard=split)
    return b.residual(b.einsum("bsgrv,grvh->bsh", out, w_out, name="out_proj"))


def chunked(
    b: GraphBuilder, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, decay: Tensor
) -> Tensor:
    """The chunkwise gated delta rule (module docstring): ``[batch, chunks, chunk, g, r, v]``."""
    batch = b.dim("batch")
    g, kd = q.dims[2], q.dims[3]
    r, vd = v.dims[3], v.dims[4]
    ln = fixed("linear_chunk", CHUNK)
    c = fixed("linear_chunks", b.dim("seq").size / CHUNK)
    qc = b.view(q, [batch, c, ln, g, kd], name="q_chunks")
    kc = b.view(k, [batch, c, ln, g, kd], name="k_chunks")
    vc = b.view(v, [batch, c, ln, g, r, vd], name="v_chunks")
    bc = b.view(beta, [batch, c, ln, g, r], name="beta_chunks")
    gc = b.view(decay, [batch, c, ln, g, r], name="decay_chunks")
    g_cum = b.custom("decay_cumsum", [gc], list(gc.dims), flops=1, backward_flops=1)
    beta_decay = b.custom(  # β_t · Γ_t: the keys' scale in W
        "beta_decay", [bc, g_cum], list(bc.dims), flops=2, backward_flops=2, grad_inputs=(0, 1)
    )
    # WY representation: T = (I + strict_lower(β K Kᵀ ∘ Γ))⁻¹
    kk = b.einsum("bclgk,bcsgk->bcgls", kc, kc, name="wy_kk")
    lower = b.custom(
        "wy_mask",
        [kk, bc, g_cum],
        [batch, c, g, r, ln, ln],
        flops=3 * r.size,  # per value head: the decay ratio's exp, β, the product
        backward_flops=3 * r.size,
        grad_inputs=(0, 1, 2),
    )
    t = b.custom(  # forward substitution: chunk³/3 multiply-adds per chunk and head
        "wy_solve",
        [lower],
        list(lower.dims),
        flops=sympy.Rational(2 * CHUNK, 3),
        backward_flops=sympy.Rational(4 * CHUNK, 3),
    )
    w = b.einsum("bcgrls,bcsgk,bcsgr->bclgrk", t, kc, beta_decay, name="wy_w")
    u = b.einsum("bcgrls,bcsgrv,bcsgr->bclgrv", t, vc, bc, name="wy_u")
    # the state entering each chunk: one sequential kernel over the chunks
    states = b.custom(
        "state_scan",
        [u, w, kc, g_cum],
        [batch, c, g, r, kd, vd],
        flops=2 * kd.size + sympy.Rational(kd.size, CHUNK),  # Kᵀ v_new, and the decay of S
        backward_flops=4 * kd.size + sympy.Rational(2 * kd.size, CHUNK),
        grad_inputs=(0, 1, 2, 3),
    )
    ws = b.einsum("bclgrk,bcgrkv->bclgrv", w, states, name="w_state")
    v_new = b.elementwise("v_new", u, ws, flops=1)  # U - W S
    inter = b.einsum("bclgk,bcgrkv,bclgr->bclgrv", qc, states, g_cum, name="state_read")
    qk = b.einsum("bclgk,bcsgk->bcgls", qc, kc, name="qk")
    causal = b.custom(
        "qk_mask",
        [qk, g_cum],
        [batch, c, g, r, ln, ln],
        flops=3 * r.size,  # per value head: the decay ratio's exp, the mask, the product
        backward_flops=3 * r.size,
        grad_inputs=(0, 1),
    )
    intra = b.einsum("bcgrls,bcsgrv->bclgrv", causal, v_new, name="intra")
    return b.add(inter, intra, name="chunk_out")


def recurrent_step(
    b: GraphBuilder,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    decay: Tensor,
    state_dims: list,
) -> Tensor:
    """One decode token: ``S = alpha S``, ``S += k ⊗ β (v - Sᵀ k)``, ``o = Sᵀ q``, on a state of
    ``[batch, g, r, k, v]`` read and written whatever the context."""
    shard = {"linear_key_heads": "tp", "batch": b.data_axes}
    state = b.recurrent_state("delta_state", state_dims, shard=shard)
    state = b.custom(
        "state_decay", [state, decay], state_dims, flops=1, backward_flops=1, grad_inputs=(1,)
    )
    recalled = b.einsum("bsgk,bgrkv->bsgrv", k, state, name="state_recall")
    delta = b.custom(
        "delta",
        [v, recalled, beta],
        list(v.dims),
        flops=2,
        backward_flops=2,
        grad_inputs=(0, 1, 2),
    )
    update = b.einsum("bsgk,bsgrv->bgrkv", k, delta, name="state_write")
    state = b.add(state, update, name="state_update")
    return b.einsum("bsgk,bgrkv->bsgrv", q, state, name="state_read")


def block(b: GraphBuilder, x: Tensor) -> Tensor:
    """A gated DeltaNet layer: RMSNorm, the mixer, the residual add, then Llama's MLP; its
    saved activations are what its graph keeps (tag ``graph_memory``)."""
    with b.tag("graph_memory"):
        x = b.add(x, mixer(b, b.rmsnorm(x, "mixer_norm")), name="residual1")
        return b.add(x, llama.mlp(b, b.rmsnorm(x, "ffn_norm")), name="residual2")


@hookimpl
def stg_register_models(register):  # type: ignore[no-untyped-def]
    register(
        Model(
            "gated-deltanet",
            embedding=llama.embedding,
            block=block,
            head=llama.head,
            description="Gated DeltaNet: chunked gated delta rule mixers, SwiGLU MLP",
        )
    )
