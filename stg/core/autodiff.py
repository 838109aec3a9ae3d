"""Automatic backward: derive the backward ops of a built part from its forward ops.

The gradient of an einsum is two einsums; of an elementwise op, an elementwise op of declared
cost (and a reduction for broadcast operands such as a norm's weight); of a collective, the
reshard back to its input's sharding (all-gather <-> reduce-scatter, all-reduce <-> nothing,
all-to-all <-> all-to-all). Collectives of the backward are inferred exactly like forward ones.
Weight gradients stay partial over the axes that split the batch (and sequence); their
reduction is built separately, once per iteration (:func:`build_grad_reduction`).
"""

from __future__ import annotations

from collections import defaultdict

from stg.core.layout import PIPELINE_ENDS
from stg.core.sharding import NO_AXES, OWN_BUCKET, TP_REPLICATED_GRAD, Sharding
from stg.core.symbolic import GraphBuilder, Op, Tensor, is_routed_expert


def _key(t: Tensor) -> int:
    return id(t.base or t)


def grad_sharding(t: Tensor) -> Sharding:
    """How the gradient of ``t`` is sharded: like ``t``, but never partial (the gradient of a
    partial sum is the full gradient on every rank that holds a summand)."""
    return t.sharding.with_partial(())


class _Grads:
    def __init__(self, b: GraphBuilder) -> None:
        self.b = b
        self.contributions: dict[int, list[Tensor]] = defaultdict(list)
        self.forward: dict[int, Tensor] = {}

    def add(self, tensor: Tensor, grad: Tensor) -> None:
        self.forward.setdefault(_key(tensor), tensor.base or tensor)
        self.contributions[_key(tensor)].append(grad)

    def total(self, tensor: Tensor, conform: bool) -> Tensor | None:
        """The summed gradient of ``tensor``; resharded like ``tensor`` when ``conform``."""
        terms = self.contributions.get(_key(tensor))
        if not terms:
            return None
        b = self.b
        if len(terms) > 1 and any(t.sharding != terms[0].sharding for t in terms):
            terms = [b.reshard(t, grad_sharding(tensor)) for t in terms]
        grad = b.add(*terms, name=f"{tensor.name}.grad_sum") if len(terms) > 1 else terms[0]
        return b.reshard(grad, grad_sharding(tensor)) if conform else grad


def build_backward(b: GraphBuilder, seed: Tensor | None, loss: Tensor | None = None) -> None:
    """Append the backward ops of ``b.part`` to it.

    ``seed`` is the gradient arriving at the part's output (an input of the backward), or
    ``None`` when the part ends in ``loss``, whose gradient is implicit. Fills
    ``part.grad_input`` (the gradient of the part's first input, sharded like it) and
    ``part.weight_grads``.
    """
    part = b.part
    grads = _Grads(b)
    with b.phase("backward"):
        if seed is not None:
            assert part.output is not None
            grads.add(part.output, seed)
        aux = {id(t) for t in part.aux_losses}
        for op in reversed(part.forward):
            is_loss = (loss is not None and op.output is loss) or id(op.output) in aux
            if is_loss:
                dy = None
            else:
                # on a hybrid cluster (device groups running different precision plans) the
                # gradient of a cast weight stays partial through the cast, so that every
                # group reduces its weights' gradients in the same buckets and dtype
                keep_partial = (
                    b.weight_grads_through_casts
                    and op.kind == "elementwise"
                    and op.output.kind == "weight"
                )
                dy = grads.total(op.output, conform=op.kind != "collective" and not keep_partial)
                if dy is None:
                    continue
            first = len(part.backward)
            _backward_op(b, op, dy, grads)
            for grad_op in part.backward[first:]:
                grad_op.grad_of = op
        for w in part.weights:
            g = grads.total(w, conform=False)
            if g is not None:
                part.weight_grads[w] = g
        held = {id(w) for w in part.weights}
        for w in part.copies:  # a tied LM head on the embedding's stage: no weight of its own
            g = grads.total(w, conform=False) if id(w) not in held else None
            if g is not None:
                part.copy_grads.append(g)
        for t in part.inputs:
            if t.kind == "input" and grads.contributions.get(_key(t)):
                part.grad_input = grads.total(t, conform=True)
                break


def _backward_op(b: GraphBuilder, op: Op, dy: Tensor | None, grads: _Grads) -> None:
    name = op.name
    if op.kind == "collective":
        assert dy is not None
        x = op.inputs[0]
        target = grad_sharding(x)
        with b.gradient_wrt(0):
            if x.kind == "weight":  # FSDP: reduce-scatter now, leave the other data axes partial
                target = target.with_partial(dy.sharding.partial - x.sharding.axes())
                with b.tag("weight_grad_reduce"):
                    grads.add(x, b.reshard(dy, target))
            else:
                grads.add(x, b.reshard(dy, target))
    elif op.kind == "einsum":
        assert dy is not None
        lhs, out_letters = op.spec.split("->")
        letters = lhs.split(",")
        for i, x in enumerate(op.inputs):
            if not _needs_grad(x):
                continue
            others = [(letters[j], t) for j, t in enumerate(op.inputs) if j != i]
            if x.kind == "weight":
                spec = ",".join([*(lt for lt, _ in others), out_letters]) + "->" + letters[i]
                operands = [*(t for _, t in others), dy]
            else:
                spec = ",".join([out_letters, *(lt for lt, _ in others)]) + "->" + letters[i]
                operands = [dy, *(t for _, t in others)]
            out_dtype = b.grad_dtype if x.kind == "weight" else None
            with b.gradient_wrt(i):
                grad = b.einsum(
                    spec,
                    *operands,
                    name=f"{name}.grad_{x.name}",
                    scale=op.scale,
                    out_dtype=out_dtype,
                    span=op.span,
                )
            grads.add(x, grad)
    elif op.kind == "elementwise" and op.mask is not None:  # dropout: dy times the mask
        assert dy is not None
        x = op.inputs[0]
        if _needs_grad(x):
            with b.gradient_wrt(0):
                g = b.elementwise(
                    f"{name}.grad_{x.name}",
                    dy,
                    op.mask,
                    flops=op.backward_flops_per_element,
                    backward_flops=0,
                )
                grads.add(x, b.reshard(g, grad_sharding(x)))
    elif op.kind == "elementwise":
        assert dy is not None
        x = op.inputs[0]
        full = [(i, t) for i, t in enumerate(op.inputs) if t.dims == x.dims and _needs_grad(t)]
        reduce_names = list(op.reduce_dims)
        share = op.backward_flops_per_element / max(len(full), 1)
        through_cast = b.weight_grads_through_casts and op.output.kind == "weight"
        for i, t in full:
            with b.gradient_wrt(i):
                g = b.elementwise(
                    f"{name}.grad_{t.name}",
                    dy,
                    *op.inputs,
                    flops=share,
                    backward_flops=0,
                    reduce=reduce_names,
                    out_dtype=b.grad_dtype if t.kind == "weight" else None,
                    keep_partial=through_cast,
                )
                grads.add(t, g if through_cast else b.reshard(g, grad_sharding(t)))
        for i, t in enumerate(op.inputs):
            if t.dims != x.dims and _needs_grad(t):
                dtype = b.grad_dtype if t.kind == "weight" else None
                with b.gradient_wrt(i):
                    g = b.reduce_to(f"{name}.grad_{t.name}", dy, t, x, flops=2, dtype=dtype)
                grads.add(t, g)
    elif op.kind == "view":
        # the gradient of a reshape or slice is the same memory seen the other way (a slice's
        # gradient accumulates in place into the full buffer)
        assert dy is not None
        x = op.inputs[0]
        if _needs_grad(x) and op.grad_inputs:  # a detached view passes no gradient
            if op.spec == "windows":  # the data gradient writes x's bytes (implicit GEMM)
                dy.footprint = x
            with b.gradient_wrt(0):
                grads.add(x, b.reinterpret(dy, x.dims, grad_sharding(x), name=f"{name}.grad"))
    elif op.kind == "concat":
        assert dy is not None
        index = op.reduce_dims[0]
        for i, t in enumerate(op.inputs):
            if _needs_grad(t):
                with b.gradient_wrt(i):
                    part = b.slice(
                        dy, dy.dims[index].name, t.dims[index], name=f"{name}.grad_{t.name}"
                    )
                grads.add(t, part)
    elif op.kind == "add":
        assert dy is not None
        for i, t in enumerate(op.inputs):
            if _needs_grad(t):
                with b.gradient_wrt(i):
                    grads.add(t, b.reshard(dy, grad_sharding(t)))
    elif op.kind == "gather":
        assert dy is not None
        table = op.inputs[0]
        with b.gradient_wrt(0):
            source = b.reshard(dy, grad_sharding(op.output))
            grad = b.scatter_add(f"{name}.grad_{table.name}", source, op.inputs[1], table)
        grads.add(table, grad)
    elif op.kind == "custom":
        saved = op.inputs if dy is None else (*op.inputs, dy)
        for j, i in enumerate(op.grad_inputs):
            t = op.inputs[i]
            if not _needs_grad(t):
                continue
            sharding = grad_sharding(t)
            if t.kind == "weight":
                # a weight's gradient sums over the positions it was applied at: partial over
                # the axes that split the first input's other dimensions (the data axes)
                own = {d.name for d in t.dims}
                x = op.inputs[0]
                summed = {
                    a
                    for d, axes in zip(x.dims, x.sharding.dims, strict=True)
                    if d.name not in own
                    for a in axes
                }
                sharding = sharding.with_partial(summed - sharding.axes())
            with b.gradient_wrt(i):
                g = b.custom(
                    f"{name}.grad_{t.name}",
                    saved,
                    t.dims,
                    flops=op.grad_flops[j] if op.grad_flops else op.backward_flops_per_element,
                    backward_flops=0,
                    out_sharding=sharding,
                )
            grads.add(t, g)
    else:  # pragma: no cover - every op kind is handled above
        raise AssertionError(f"no backward rule for op kind {op.kind!r}")


def _needs_grad(t: Tensor) -> bool:
    return t.kind in {"activation", "weight", "input"}


def build_grad_reduction(b: GraphBuilder, shard_optimizer_over: tuple[str, ...] = ()) -> None:
    """Append the once-per-iteration collectives: in the reduce phase, those that turn each
    weight gradient (partial over the data axes) into the sharding of its weight; with ZeRO-1/2
    (``shard_optimizer_over``) a reduce-scatter into a flat split (``Sharding.flat``: the
    padded flat buffer, as DeepSpeed and Megatron's distributed optimizer shard it) instead,
    and in the update phase the all-gather of the updated weight shards.

    The gradient of a tied weight (``part.tied``: a word embedding and its LM-head copy on
    another stage) is then all-reduced over the first and last pipeline stage
    (:data:`PIPELINE_ENDS`), as Megatron-LM's ``finalize_model_grads`` does after the
    data-parallel reduction (``finish_grad_sync``, then ``_allreduce_word_embedding_grads``,
    core_v0.15.0): the whole gradient (``main_grad``), also when the distributed optimizer
    has just reduce-scattered it and only this rank's shard of it is summed over the data
    ranks. ZeRO-2 holds only that shard (Megatron-FSDP's ``optim_grads``, whose embedding
    all-reduce takes the gradient's local shard: ``_allreduce_embedding_grad``,
    ``use_megatron_fsdp``), which is then what is all-reduced. With ZeRO-1/2 the tied weight
    is its own bucket (:data:`OWN_BUCKET`): its own reduce-scatter and all-gather of the
    updated shards.

    A gradient partial over the tensor-parallel group of a weight not split over it is reduced
    over the data axes with the others, then all-reduced over the tensor-parallel group
    (:data:`TP_REPLICATED_GRAD`): the whole gradient (``main_grad``), also under ZeRO-1, where
    only this rank's shard of it is summed over the data ranks; under ZeRO-2 and Megatron-FSDP
    only that shard (``grad._local_tensor``). PyTorch FSDP2 keeps each part's all-reduce."""
    part = b.part
    grads_sharded = b.options.get("zero") == 2
    axes = b._axes(shard_optimizer_over)
    tied = {id(w) for w in part.tied} if b._pipelined else set()
    # PyTorch FSDP2 reduces them in the backward (below, per part); Megatron-FSDP at the end
    fsdp2 = bool(b.fsdp_axes) and not b.options.get("megatron_fsdp")
    tensor_parallel = NO_AXES if fsdp2 else b._axes("tp")
    for w, g in part.weight_grads.items():
        flat = b._zero_axes_of(w.dims, w.sharding, axes)  # routed experts: over edp
        want = w.sharding.with_flat(flat) if flat else w.sharding
        own_bucket = (OWN_BUCKET,) if flat and id(w) in tied else ()
        replicated = NO_AXES  # routed experts: their tp pieces are expert data parallelism
        if not is_routed_expert(w.dims, w.sharding):
            replicated = (g.sharding.partial & tensor_parallel) - w.sharding.partial
        with b.phase("reduce"), b.tag(*own_bucket):
            reduced = b.reshard(g, want.with_partial(want.partial | replicated))
        # what Megatron all-reduces after the dp reduction: the whole main_grad under ZeRO-1,
        # the shard under ZeRO-2 (and where nothing is sharded, the gradient itself)
        held = w.sharding if flat and not grads_sharded else want
        if replicated:
            with b.phase("reduce"), b.tag(TP_REPLICATED_GRAD):
                if held != want:  # the whole buffer, this rank's summed shard in it
                    reduced = b.reinterpret(
                        reduced, w.dims, held.with_partial(held.partial | replicated), g.name
                    )
                reduced = b.reshard(reduced, held)
        with b.phase("reduce"), b.tag(*own_bucket):
            if id(w) in tied:
                if held != want:  # the whole buffer, this rank's summed shard in it
                    main_grad = b.reinterpret(
                        reduced, w.dims, held.with_partial({PIPELINE_ENDS}), g.name
                    )
                else:
                    main_grad = b.reshard(reduced, held.with_partial({PIPELINE_ENDS}))
                b.reshard(main_grad, held)
        if flat:
            with b.phase("update"), b.tag(*own_bucket):
                shard = Tensor(w.name, w.dims, want, w.dtype, kind="weight")
                b.reshard(shard, w.sharding)
