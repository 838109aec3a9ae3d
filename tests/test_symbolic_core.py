"""The symbolic core on its own: reshard planning, sharding inference, views, autodiff."""

from __future__ import annotations

import pytest
from workload_checks import check_runs_to_completion, flops_by_root

import stg
from stg.core.autodiff import build_backward
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.sharding import Sharding, plan_reshard
from stg.core.symbolic import Dim, Dmodel, GraphBuilder, Head
from stg.core.workload import CollectiveType
from stg.host.records import Model
from stg.host.registry import load_registry
from stg.models import gpt
from stg.trace.validate import validate_workload

F = frozenset


def kinds(src, dst):
    return [(s.kind, sorted(s.axes), s.dim, s.dst_dim) for s in plan_reshard(src, dst)]


def test_plan_reshard_rules():
    rep = Sharding((F(), F(), F()))
    seq_tp = Sharding((F(), F({"tp"}), F()))
    partial = Sharding((F(), F(), F()), F({"tp"}))
    assert kinds(partial, rep) == [(CollectiveType.ALL_REDUCE, ["tp"], None, None)]
    assert kinds(partial, seq_tp) == [(CollectiveType.REDUCE_SCATTER, ["tp"], 1, None)]
    assert kinds(seq_tp, rep) == [(CollectiveType.ALL_GATHER, ["tp"], 1, None)]
    assert kinds(rep, seq_tp) == []  # a slice of a replicated tensor is free
    assert kinds(seq_tp, Sharding((F({"tp"}), F(), F()))) == [
        (CollectiveType.ALL_TO_ALL, ["tp"], 1, 0)
    ]
    two = Sharding((F(), F(), F()), F({"dp", "ep"}))
    assert kinds(two, rep) == [(CollectiveType.ALL_REDUCE, ["dp", "ep"], None, None)]
    assert kinds(rep, rep.with_partial({"tp"})) == []  # marking partial is free


def builder(**kw):
    return GraphBuilder("t", active_axes={"dp", "tp", "sp", "ep"}, seq_axes=("sp", "tp"), **kw)


def collectives(b):
    return [
        (op.collective.name, sorted(op.axes))
        for op in b.part.forward + b.part.backward
        if op.kind == "collective"
    ]


def test_megatron_mlp_with_sequence_parallelism_infers_gather_and_reduce_scatter():
    b = builder()
    x = b.residual_input()
    u = b.einsum("bsh,hf->bsf", x, b.weight("w1", "dmodel dff", shard={"dff": "tp"}))
    y = b.einsum("bsf,fh->bsh", u, b.weight("w2", "dff dmodel", shard={"dff": "tp"}))
    b.output(y)
    assert collectives(b) == [("ALL_GATHER", ["tp"]), ("REDUCE_SCATTER", ["tp"])]
    seed = b.input("dy", "batch seq dmodel", {"batch": ("dp", "ep"), "seq": ("sp", "tp")})
    seed.kind = "grad"
    build_backward(b, seed)
    assert collectives(b)[2:] == [("ALL_GATHER", ["tp"]), ("REDUCE_SCATTER", ["tp"])]
    grads = {w.name: g.sharding.partial for w, g in b.part.weight_grads.items()}
    assert grads == {"w1": F({"dp", "ep", "sp"}), "w2": F({"dp", "ep", "sp"})}


def test_expert_weights_move_tokens_by_all_to_all():
    b = builder()
    tokens = b.input("t", "experts capacity dmodel", {"capacity": ("dp", "ep")})
    b.einsum("ech,ehf->ecf", tokens, b.weight("w", "experts dmodel dff", shard={"experts": "ep"}))
    assert collectives(b) == [("ALL_TO_ALL", ["ep"])]


def test_view_groups_and_splits():
    b = builder()
    x = b.input("x", "batch seq head dhead", {"head": "tp"})
    flat = b.view(x, "batch seq dmodel")
    assert flat.sharding.dims[2] == F({"tp"}) and not collectives(b)
    back = b.view(flat, "batch seq head dhead")
    assert back.sharding == x.sharding
    with pytest.raises(ValueError, match="cannot be viewed"):
        b.view(x, "batch dmodel")
    y = b.input("y", "batch seq head dhead", {"dhead": "tp"})
    b.view(y, "batch seq dmodel")  # a split of the inner dimension must be gathered first
    assert collectives(b) == [("ALL_GATHER", ["tp"])]


def fused_block(b, x):
    """GPT attention with a fused QKV weight split by slices, heads merged by a view."""
    h = b.layernorm(x, "ln1")
    w = b.weight(
        "wqkv", [b.dim("dmodel"), Dim("qkv3", 3 * Head), b.dim("dhead")], shard={"qkv3": "tp"}
    )
    qkv = b.einsum("bsh,hak->bsak", h, w, name="qkv")
    q, k, v = (b.slice(qkv, "qkv3", "head", name=f"{n}_part") for n in "qkv")
    probs = b.elementwise(
        "softmax", b.einsum("bsak,btak->bast", q, k, name="scores"), flops=5, reduce=(-1,)
    )
    ctx = b.view(
        b.einsum("bast,btak->bsak", probs, v, name="context"), "batch seq dmodel", name="merge"
    )
    wo = b.weight("wo", [b.dim("dmodel"), Dim("dout", Dmodel)], shard={"dmodel": "tp"})
    x = b.add(x, b.residual(b.einsum("bsh,hd->bsd", ctx, wo, name="attn_out")))
    both = b.concat(x, x, dim="dmodel", to=Dim("two_h", 2 * Dmodel), name="cat")
    return b.add(x, b.slice(both, "two_h", "dmodel", name="half"))


class FusedPlugin:
    @stg.hookimpl
    def stg_register_models(self, register):
        register(Model("fused", gpt.embedding, fused_block, gpt.head))


@pytest.mark.parametrize("kw", [dict(), dict(tp=2), dict(tp=2, sp=2, pp=2, micro_batch=4)])
def test_slice_view_concat_in_a_plugin_model(kw):
    registry = load_registry(autoload=False, plugins=[FusedPlugin()])
    options = GenerateOptions(
        dvocal=512, dmodel=64, dff=256, seq=32, head=8, num_stacks=2, batch=8, model="fused", **kw
    )
    w = build_workload(options, registry)
    assert validate_workload(w).ok
    assert check_runs_to_completion(w) == sum(len(g) for g in w.ranks)
    f = flops_by_root(w)
    sums = sum(
        n.num_ops * w.layout.world_size // len(w.rank_classes)
        for cls in w.rank_classes
        for n in cls.nodes
        if n.name.endswith("qkv.grad_sum")
    )
    f["qkv"] -= sums  # the three slice gradients summed into the fused buffer
    B, s, h, L = 8, 32, 64, 2
    assert f["qkv"] == 3 * 2 * B * s * h * 3 * h * L
    assert f["attn_out"] == 3 * 2 * B * s * h * h * L
    assert f["cat"] == B * s * 2 * h * L  # a copy: one op per element written
    names = [n.name for cls in w.rank_classes for n in cls.nodes]
    assert not any(n.endswith(("/q_part", "/merge", "/half")) for n in names)  # views cost no node
    assert any(n.endswith("/cat") for n in names)


def test_a_gradient_op_carries_the_position_of_the_input_it_differentiates():
    """``Op.grad_wrt``: each op that computes the gradient of one input of a forward op (named
    ``<op>.grad_<input>`` by convention, which nothing downstream has to parse) carries that
    input's position, whatever the op kind: einsum, elementwise with a broadcast weight, and
    the reshards of sequence parallelism inside them."""
    b = builder()
    x = b.residual_input()
    h = b.rmsnorm(x, "norm")
    u = b.einsum("bsh,hf->bsf", h, b.weight("w1", "dmodel dff", shard={"dff": "tp"}))
    g = b.einsum("bsh,hf->bsf", h, b.weight("w3", "dmodel dff", shard={"dff": "tp"}))
    a = b.elementwise("swiglu", u, g, flops=4)
    y = b.einsum("bsf,fh->bsh", a, b.weight("w2", "dff dmodel", shard={"dff": "tp"}))
    b.output(y)
    seed = b.input("dy", "batch seq dmodel", {"batch": ("dp", "ep"), "seq": ("sp", "tp")})
    seed.kind = "grad"
    build_backward(b, seed)
    named = 0
    for op in b.part.backward:
        forward = op.grad_of
        if forward is None:
            continue
        for i, t in enumerate(forward.inputs):
            if op.name == f"{forward.name}.grad_{t.name}":
                assert op.grad_wrt == i, op.name
                named += 1
    assert named >= 8  # norm: x and weight; three einsums: 2 each; swiglu: gate and up
    swiglu = {op.grad_wrt for op in b.part.backward if op.grad_of and op.grad_of.name == "swiglu"}
    assert swiglu >= {0, 1}
