"""Hybrid stacks: state-space, linear-attention, attention, MLP and MoE layers in any order.

``--layer_pattern`` gives one letter per layer, as Nemotron-H's ``hybrid_override_pattern``
does (NVIDIA, "Nemotron-H", arXiv:2504.03624; its released config.json):

====== ==================================================================================
letter layer (each: RMSNorm, the mixer or MLP, the residual add)
====== ==================================================================================
``M``  Mamba-2 mixer (:mod:`stg.models.mamba2`)
``G``  gated DeltaNet mixer (:mod:`stg.models.gated_deltanet`)
``*``  attention (Llama's grouped-query attention, :mod:`stg.models.llama`), with the
       window or chunk of ``--attention_window`` / ``--attention_chunk`` if given
``A``  attention over every earlier key (a global layer beside windowed or chunked ones)
``-``  MLP: SwiGLU, or Nemotron-H's squared ReLU (two matrices) with ``--mlp_activation relu2``,
       of ``--dense_dff`` where given (else ``dff``)
``E``  routed experts of ``dff`` (:mod:`stg.models.moe`), with ``--shared_experts`` beside
       them where given
====== ==================================================================================

A pattern shorter than ``--num_stacks`` repeats when its length divides it: Qwen3-Next's
three gated DeltaNet layers to one attention layer, each followed by its experts, is
``GEGEGE*E`` (8 layers here for its 4); Llama 4 Maverick's chunked attention with a global
layer in four, dense and MoE feed-forward layers in turn, is ``*-*E*-AE``. Each letter is a
kind of the stack (``mamba``, ``deltanet``, ``attention``, ``global_attention``, ``mlp``,
``moe``), so pipeline stages split any mix. The
memory predictor takes each layer's saved activations from its graph (tag ``graph_memory``):
a transformer layer's closed forms do not apply.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stg.api import GraphBuilder, Model, Tensor, hookimpl
from stg.errors import UserError
from stg.models import gated_deltanet, llama, mamba2, moe

RELU2_FLOPS = 2  # max(x, 0), then its square


def attention_layer(b: GraphBuilder, x: Tensor) -> Tensor:
    """``*``: grouped-query attention (a window or chunk where the options give one)."""
    with b.tag("graph_memory"):
        return b.add(x, llama.attention(b, b.rmsnorm(x, "attention_norm")), name="residual")


def global_attention_layer(b: GraphBuilder, x: Tensor) -> Tensor:
    """``A``: grouped-query attention over every earlier key, whatever the window or chunk
    options (Llama 4's global layers beside its chunked ones)."""
    with b.tag("graph_memory"):
        h = b.rmsnorm(x, "attention_norm")
        return b.add(x, llama.attention(b, h, full=True), name="residual")


def mlp_layer(b: GraphBuilder, x: Tensor) -> Tensor:
    """``-``: an MLP, SwiGLU or (``--mlp_activation relu2``) squared ReLU."""
    with b.tag("graph_memory"):
        return _mlp(b, x)


def _mlp(b: GraphBuilder, x: Tensor) -> Tensor:
    h = b.rmsnorm(x, "ffn_norm")
    ffn = "dff_dense" if b.options.get("dense_dff") else "dff"  # dff: the experts' size
    if b.options.get("mlp_activation") == "relu2":
        tp = {ffn: "tp"}
        w1 = b.weight("w1", f"dmodel {ffn}", shard=tp)
        w2 = b.weight("w2", f"{ffn} dmodel", shard=tp)
        up = b.elementwise("relu2", b.einsum("bsh,hf->bsf", h, w1, name="up"), flops=RELU2_FLOPS)
        down = b.einsum("bsf,fh->bsh", up, w2, name="down")
        return b.add(x, b.residual(down), name="residual")
    return b.add(x, llama.mlp(b, h, ffn), name="residual")


def moe_layer(b: GraphBuilder, x: Tensor) -> Tensor:
    """``E``: top-k routed SwiGLU experts (and the shared experts, where given)."""
    with b.tag("graph_memory"):
        return b.add(x, moe.experts_ffn(b, b.rmsnorm(x, "ffn_norm")), name="residual")


def deltanet_layer(b: GraphBuilder, x: Tensor) -> Tensor:
    """``G``: a gated DeltaNet mixer."""
    with b.tag("graph_memory"):
        return b.add(x, gated_deltanet.mixer(b, b.rmsnorm(x, "mixer_norm")), name="residual")


LAYERS = {
    "M": ("mamba", mamba2.block),
    "G": ("deltanet", deltanet_layer),
    "*": ("attention", attention_layer),
    "A": ("global_attention", global_attention_layer),
    "-": ("mlp", mlp_layer),
    "E": ("moe", moe_layer),
}
"""Each letter of ``--layer_pattern``: its kind and block function."""


def stack(options: Mapping[str, Any]) -> list[tuple[str, Any, int]]:
    """The layers ``--layer_pattern`` spells, repeated to ``--num_stacks``."""
    pattern = options.get("layer_pattern")
    layers = int(options["num_stacks"])
    if not pattern:
        raise UserError("model hybrid needs --layer_pattern (e.g. M-M*-: Mamba-2, MLP, attention)")
    unknown = sorted(set(pattern) - set(LAYERS))
    if unknown:
        raise UserError(
            f"layer_pattern={pattern!r}: unknown letter {unknown[0]!r}; allowed: "
            + ", ".join(f"{letter} ({kind})" for letter, (kind, _) in LAYERS.items())
        )
    if layers % len(pattern):
        raise UserError(
            f"layer_pattern={pattern!r} has {len(pattern)} layers, which must divide "
            f"num_stacks={layers}"
        )
    if options.get("mlp_activation") not in (None, "swiglu", "relu2"):
        raise UserError(f"mlp_activation={options['mlp_activation']!r}; allowed: swiglu, relu2")
    return [(*LAYERS[letter], 1) for letter in pattern * (layers // len(pattern))]


@hookimpl
def stg_register_models(register):  # type: ignore[no-untyped-def]
    register(
        Model(
            "hybrid",
            embedding=llama.embedding,
            block=mamba2.block,
            head=llama.head,
            stack=stack,
            description="Hybrid stack: Mamba-2, gated DeltaNet, attention, MLP, MoE layers",
        )
    )
