"""Mamba-2: a selective state-space mixer computed by the SSD algorithm in its chunked form.

Dao and Gu, "Transformers are SSMs" (ICML 2024, arXiv:2405.21060), section 6 and Listing 1
(``ssd_minimal_discrete``): the sequence is cut into chunks of ``--ssm_chunk`` tokens and

1. within each chunk, the output is the masked quadratic form ``(C Bᵀ ∘ L) X`` (``L``: the
   decays between positions of the chunk);
2. each chunk's final state is ``Σ_l decay_l · B_l ⊗ X_l``;
3. the states pass between chunks through the decays between chunks, as a matmul over
   (chunk, chunk) pairs (the listing's ``decay_chunk`` einsum; no sequential loop);
4. each position reads the state entering its chunk, ``C · state``, decayed to its place.

These are plain einsums and elementwise ops, so the backward, the collectives and the
pipeline follow as for any layer. Heads are ``(ssm_groups, heads per group)``: B and C are
shared within a group, and tensor parallelism splits the groups (Megatron-LM's MambaMixer
splits heads and groups by tp). In serving, a decode step runs the recurrence instead: one
state update of constant size per token (``[heads, head_dim, state]`` read and written, and
the convolution's last ``d_conv - 1`` inputs), whatever the context.

Sizes (``mamba_ssm.modules.mamba2.Mamba2`` defaults, state-spaces/mamba v2.2.2):
``--ssm_state`` d_state 128, ``--ssm_head_dim`` headdim 64, ``--ssm_heads`` expand 2 times
dmodel over headdim, ``--ssm_groups`` ngroups 1, ``--ssm_chunk`` chunk_size 256.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from stg.api import Dim, GraphBuilder, Model, Tensor, hookimpl
from stg.errors import UserError
from stg.models import llama

D_CONV = 4  # d_conv: the causal depthwise convolution's width (Mamba2 default, v2.2.2)
EXPAND = 2  # expand: d_inner = expand · dmodel (Mamba2 default, v2.2.2)
D_STATE = 128  # d_state (Mamba2 default, v2.2.2)
HEAD_DIM = 64  # headdim (Mamba2 default, v2.2.2)
CHUNK = 256  # chunk_size (Mamba2 default, v2.2.2)
SILU_FLOPS = 4  # x · sigmoid(x): exp, add, divide, multiply
CONV_FLOPS = 2 * D_CONV + SILU_FLOPS  # D_CONV multiply-adds, then SiLU; per output
SOFTPLUS_FLOPS = 4  # dt + dt_bias, then log(1 + exp(.))
GATED_NORM_FLOPS = 4 + SILU_FLOPS + 1  # RMSNorm of y · SiLU(z) (RMSNormGated)


@dataclass(frozen=True)
class SSMDims:
    """The dimensions of one Mamba-2 mixer (sizes fixed per run)."""

    head_dim: Dim
    groups: Dim
    group_heads: Dim
    state: Dim
    chunk: Dim
    chunks: Dim
    conv: Dim


def fixed(name: str, size: int | sympy.Expr) -> Dim:
    return Dim(name, sympy.sympify(size))


def ssm_dims(b: GraphBuilder) -> SSMDims:
    """The mixer's sizes from the options, checked (one error line naming the option)."""
    o = b.options
    head_dim = int(o.get("ssm_head_dim") or HEAD_DIM)
    heads = o.get("ssm_heads")
    if heads is None:
        if EXPAND * int(o["dmodel"]) % head_dim:
            raise UserError(
                f"ssm_head_dim={head_dim} must divide {EXPAND}·dmodel={EXPAND * o['dmodel']} "
                "(or give --ssm_heads)"
            )
        heads = EXPAND * int(o["dmodel"]) // head_dim
    groups = int(o.get("ssm_groups") or 1)
    chunk = int(o.get("ssm_chunk") or CHUNK)
    if heads % groups:
        raise UserError(f"ssm_groups={groups} must divide ssm_heads={heads}")
    tp = int(o.get("tp") or 1)
    if groups % tp:
        raise UserError(f"tp={tp} must divide ssm_groups={groups} (Mamba-2 splits its groups)")
    check_chunks(b, chunk, f"ssm_chunk={chunk}")
    seq = b.dim("seq").size
    return SSMDims(
        head_dim=fixed("ssm_head_dim", head_dim),
        groups=fixed("ssm_groups", groups),
        group_heads=fixed("ssm_group_heads", heads // groups),
        state=fixed("ssm_state", int(o.get("ssm_state") or D_STATE)),
        chunk=fixed("ssm_chunk", chunk),
        chunks=fixed("ssm_chunks", seq / chunk),
        conv=fixed("ssm_conv", D_CONV),
    )


def check_chunks(b: GraphBuilder, chunk: int, what: str) -> None:
    """What a chunked scan needs: whole chunks of the sequence, no context parallelism, and
    no mixed iteration (its prefill and decode groups share one graph)."""
    o = b.options
    if o.get("phase") == "mixed":
        raise UserError(
            "phase=mixed is not allowed with Mamba-2 or gated DeltaNet layers; allowed: "
            "training, prefill, decode"
        )
    if int(o.get("sp") or 1) > 1:
        raise UserError(
            f"sp={o['sp']}: Mamba-2 and gated DeltaNet layers run without context "
            "parallelism; allowed: 1"
        )
    if o.get("phase") != "decode" and int(o["seq"]) % chunk:
        raise UserError(f"{what} must divide seq={o['seq']}")


def mixer(b: GraphBuilder, x: Tensor) -> Tensor:
    """The Mamba-2 mixer of ``x`` ``[batch, seq, dmodel]``: projections, convolution, SSD
    (chunked; the recurrence in a decode step), gated norm, output projection."""
    d = ssm_dims(b)
    batch, seq, dmodel = b.dim("batch"), b.dim("seq"), b.dim("dmodel")
    p, g, r, n = d.head_dim, d.groups, d.group_heads, d.state
    tp = {"ssm_groups": "tp"}
    heads = [p, g, r]
    z = b.einsum(
        "bsh,hpgr->bspgr",
        x,
        b.weight("w_z", [dmodel, *heads], shard=tp, linear="in_proj"),
        name="in_z",
    )
    xs = b.einsum(
        "bsh,hpgr->bspgr",
        x,
        b.weight("w_x", [dmodel, *heads], shard=tp, linear="in_proj"),
        name="in_x",
    )
    bs = b.einsum(
        "bsh,hgn->bsgn", x, b.weight("w_b", [dmodel, g, n], shard=tp, linear="in_proj"), name="in_b"
    )
    cs = b.einsum(
        "bsh,hgn->bsgn", x, b.weight("w_c", [dmodel, g, n], shard=tp, linear="in_proj"), name="in_c"
    )
    dt = b.einsum(
        "bsh,hgr->bsgr",
        x,
        b.weight("w_dt", [dmodel, g, r], shard=tp, linear="in_proj"),
        name="in_dt",
    )
    xs = conv(b, xs, [*heads, d.conv], "conv_x")
    bs = conv(b, bs, [g, n, d.conv], "conv_b")
    cs = conv(b, cs, [g, n, d.conv], "conv_c")
    dt = b.elementwise(
        "dt_softplus", dt, b.weight("dt_bias", [g, r], shard=tp), flops=SOFTPLUS_FLOPS
    )
    da = b.elementwise("dt_a", dt, b.weight("a_log", [g, r], shard=tp), flops=2)  # dt·(-exp A)
    if b.options.get("phase") == "decode":
        y = recurrent_step(b, d, xs, bs, cs, dt, da)
    else:
        y = chunked_scan(b, d, xs, bs, cs, da)
        y = b.view(y, [batch, seq, *heads], name="ssd_out")
        if b.options.get("phase") == "prefill":  # the state its last chunk leaves, kept
            b.recurrent_state("ssm_state", [batch, *heads, n], shard={**tp, "batch": b.data_axes})
    y = b.elementwise("gated_norm", y, z, b.weight("gated_norm.weight", heads, shard=tp),
                      flops=GATED_NORM_FLOPS, reduce=(2, 4))  # fmt: skip
    w_out = b.weight("w_out", [*heads, dmodel], shard=tp)
    return b.residual(b.einsum("bspgr,pgrh->bsh", y, w_out, name="out_proj"))


def conv(
    b: GraphBuilder,
    x: Tensor,
    weight_dims: list[Dim],
    name: str,
    split: str = "ssm_groups",
    bias: bool = True,
) -> Tensor:
    """The causal depthwise convolution of width ``D_CONV`` over the sequence of ``x``
    ``[batch, seq, ...]`` (with a ``bias``: Mamba2's conv_bias, default True), then SiLU; its
    channels split over tp along ``split``. A decode step reads the ``D_CONV - 1`` inputs
    before its token from a recurrent state."""
    inputs = [x, b.weight(name, weight_dims, shard={split: "tp"})]
    if bias:
        inputs.append(b.weight(f"{name}.bias", weight_dims[:-1], shard={split: "tp"}))
    if b.options.get("phase") in ("prefill", "decode"):  # the inputs the next token needs
        past = [b.dim("batch"), fixed("conv_past", D_CONV - 1), *x.dims[2:]]
        shard = {split: "tp", "batch": b.data_axes}
        state = b.recurrent_state(f"{name}_state", past, shard=shard)
        if b.options.get("phase") == "decode":
            inputs.append(state)
    flops = CONV_FLOPS + int(bias)
    return b.custom(
        name,
        inputs,
        list(x.dims),
        flops=flops,
        backward_flops=2 * flops,
        grad_inputs=(0, 1, 2) if bias else (0, 1),
    )


def chunked_scan(
    b: GraphBuilder, d: SSMDims, xs: Tensor, bs: Tensor, cs: Tensor, da: Tensor
) -> Tensor:
    """SSD in chunks (the module docstring's steps 1-4): ``[batch, chunks, chunk, p, g, r]``."""
    batch = b.dim("batch")
    c, ln, p, g, r, n = d.chunks, d.chunk, d.head_dim, d.groups, d.group_heads, d.state
    xc = b.view(xs, [batch, c, ln, p, g, r], name="x_chunks")
    bc = b.view(bs, [batch, c, ln, g, n], name="b_chunks")
    cc = b.view(cs, [batch, c, ln, g, n], name="c_chunks")
    ac = b.view(da, [batch, c, ln, g, r], name="a_chunks")
    a_cum = b.custom("a_cumsum", [ac], list(ac.dims), flops=1, backward_flops=1)
    # 1. within chunks: (C Bᵀ ∘ L) X, L[l, s] = exp(cumsum_l - cumsum_s) for s <= l
    cb = b.einsum("bclgn,bcsgn->bcgls", cc, bc, name="ssd_cb")
    mask = b.custom(
        "ssd_decay_mask",
        [cb, a_cum],
        [batch, c, g, r, ln, ln],
        flops=3 * r.size,  # per head of the group: the decay's subtract and exp, the product
        backward_flops=3 * r.size,
        grad_inputs=(0, 1),
    )
    y_diag = b.einsum("bcgrls,bcspgr->bclpgr", mask, xc, name="ssd_diag")
    # 2. the state each chunk leaves: Σ_l exp(cumsum_last - cumsum_l) · B_l ⊗ X_l
    to_end = b.custom("ssd_state_decay", [a_cum], list(a_cum.dims), flops=2, backward_flops=2)
    states = b.einsum("bclgn,bclgr,bclpgr->bcpgrn", bc, to_end, xc, name="ssd_states")
    # 3. states passed between chunks: a (chunk, chunk) decay matrix, one matmul
    chunk_sums = b.custom(
        "ssd_chunk_sums",
        [a_cum],
        [batch, c, g, r],
        flops=sympy.Rational(1, ln.size),  # each chunk's last cumulative sum, copied out
        backward_flops=sympy.Rational(1, ln.size),
    )
    before = fixed("ssm_chunks_before", c.size)
    decay = b.custom(
        "ssd_chunk_decay",
        [chunk_sums],
        [batch, g, r, c, before],
        flops=2 * c.size,  # per pair of chunks: the segment sum's subtract and exp
        backward_flops=2 * c.size,
    )
    passed = b.einsum("bgrzc,bcpgrn->bzpgrn", decay, states, name="ssd_pass")
    # 4. each position reads the state entering its chunk, decayed to its place
    to_here = b.custom("ssd_out_decay", [a_cum], list(a_cum.dims), flops=1, backward_flops=1)
    y_off = b.einsum("bclgn,bcpgrn,bclgr->bclpgr", cc, passed, to_here, name="ssd_off")
    y = b.add(y_diag, y_off, name="ssd_sum")
    return b.elementwise("d_skip", y, xc, b.weight("d", [g, r], shard={"ssm_groups": "tp"}),
                         flops=2)  # fmt: skip


def recurrent_step(
    b: GraphBuilder,
    d: SSMDims,
    xs: Tensor,
    bs: Tensor,
    cs: Tensor,
    dt: Tensor,
    da: Tensor,
) -> Tensor:
    """One decode token: ``state = exp(dt·A)·state + dt·B ⊗ x`` and ``y = C·state + D·x``,
    on a state of ``[batch, p, g, r, n]`` read and written whatever the context (the
    convolutions' ``D_CONV - 1`` past inputs are states too: :func:`conv`)."""
    batch = b.dim("batch")
    p, g, r, n = d.head_dim, d.groups, d.group_heads, d.state
    tp = {"ssm_groups": "tp", "batch": b.data_axes}
    state = b.recurrent_state("ssm_state", [batch, p, g, r, n], shard=tp)
    update = b.einsum("bsgn,bsgr,bspgr->bpgrn", bs, dt, xs, name="ssm_update")  # dt·B ⊗ x
    decayed = b.custom(
        "ssm_decay", [state, da], list(state.dims), flops=2, backward_flops=2, grad_inputs=(1,)
    )
    state = b.add(decayed, update, name="ssm_state_update")
    y = b.einsum("bsgn,bpgrn->bspgr", cs, state, name="ssm_read")
    return b.elementwise("d_skip", y, xs, b.weight("d", [g, r], shard={"ssm_groups": "tp"}),
                         flops=2)  # fmt: skip


def block(b: GraphBuilder, x: Tensor) -> Tensor:
    """A Mamba-2 layer: RMSNorm, the mixer, the residual add (Nemotron-H's ``M`` layer); its
    saved activations are what its graph keeps (tag ``graph_memory``)."""
    with b.tag("graph_memory"):
        return b.add(x, mixer(b, b.rmsnorm(x, "mixer_norm")), name="residual")


@hookimpl
def stg_register_models(register):  # type: ignore[no-untyped-def]
    register(
        Model(
            "mamba2",
            embedding=llama.embedding,
            block=block,
            head=llama.head,
            description="Mamba-2: SSD state-space mixers (chunked), RMSNorm",
        )
    )
