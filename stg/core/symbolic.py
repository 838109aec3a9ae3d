"""The symbolic tensor graph: tensors with sympy shapes and shardings, and the ops between them.

A model template calls a :class:`GraphBuilder` with plain forward einsums and elementwise ops.
The builder resolves shardings eagerly: when an op needs its inputs sharded differently from
how they are, it inserts the collectives that :func:`stg.core.sharding.plan_reshard` prescribes.
Model templates therefore never write a collective.

Sizes stay symbolic (sympy) here; :mod:`stg.core.lowering` binds them to integers once per run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import sympy

from stg.core.dropout import DROPOUT_BACKWARD_FLOPS, DROPOUT_FLOPS, MASK_DTYPE
from stg.core.layout import DENSE_AXES, EXPERT_AXES, UNFOLDED_AXIS_PARTS
from stg.core.precision import precision_of
from stg.core.quantization import Scaling, WeightFormat, weight_format
from stg.core.sharding import NO_AXES, Axes, Sharding, plan_reshard
from stg.core.workload import CollectiveType
from stg.errors import UserError

# Global sizes of the standard dimensions, as symbols named after their options.
MicroBatch, Seq, Dmodel, Dff, Head, KVHead, Dvocal, Experts, KExperts, Capacity = sympy.symbols(
    "micro_batch seq dmodel dff head kvhead dvocal experts kexperts capacity",
    integer=True,
    positive=True,
)
DHead = sympy.Symbol("dhead", integer=True, positive=True)
"""The size of one attention head where ``--dhead`` sets it apart from ``dmodel / head``."""
QLora, KVLora, DRope, DffDense, SharedExperts = sympy.symbols(
    "q_lora_rank kv_lora_rank drope dense_dff shared_experts", integer=True, positive=True
)
"""Multi-head latent attention (DeepSeek-V2/V3): the ranks of the query and the key/value
compressions and the decoupled RoPE dimension of a head; the FFN size of dense layers in a
model of dense and MoE layers; the shared experts of an MoE layer."""


ONE = sympy.Integer(1)
ZERO = sympy.Integer(0)


@dataclass(frozen=True)
class AttentionSpan:
    """The keys a query sees under causal masking when that is not every earlier key: the
    ``window`` latest positions, itself included (sliding-window attention, as Mistral and
    gpt-oss), or the positions of its own aligned ``chunk`` up to itself (chunked local
    attention, as Llama 4). 0 leaves that limit off; at most one is set.

    The query at position ``p`` (from 1) sees ``min(window, p)`` keys, or
    ``(p - 1) mod chunk + 1``; :meth:`seen` sums them over the first ``n`` positions."""

    window: int = 0
    chunk: int = 0
    topk: int = 0
    """sparse attention: the ``topk`` earlier keys an indexer picks for each query
    (DeepSeek-V3.2's DSA), as many as a window of that size, from anywhere in the cache"""

    def __post_init__(self) -> None:
        sizes = (self.window, self.chunk, self.topk)
        if min(sizes) < 0 or sum(1 for n in sizes if n) > 1:
            raise ValueError(f"{self}: one of window, chunk and topk, a positive number of keys")

    def seen(self, n: sympy.Expr) -> sympy.Expr:
        """(query, key) pairs of the first ``n`` positions."""
        if self.window or self.topk:
            w = sympy.Integer(self.window or self.topk)
            m = sympy.Min(n, w)
            return m * (m + 1) / 2 + sympy.Max(n - w, 0) * w
        if self.chunk:
            c = sympy.Integer(self.chunk)
            r = sympy.Mod(n, c)
            return sympy.floor(n / c) * c * (c + 1) / 2 + r * (r + 1) / 2
        return n * (n + 1) / 2

    def fraction(self, seq: sympy.Expr) -> sympy.Expr:
        """The computed fraction of a training step's ``seq`` x ``seq`` score matrix, with
        the diagonal counted half as causal attention's ``scale`` 1/2 counts it (so a span
        at least ``seq`` long computes exactly what causal attention does)."""
        return (self.seen(seq) - seq / 2) / seq**2

    def keys(self, kv: sympy.Expr, new: sympy.Expr) -> sympy.Expr:
        """Cached keys that ``new`` tokens ending at position ``kv`` can see, which is all a
        serving step keeps of this layer's cache: ``min(kv, window + new - 1)``, or the keys
        from the start of the first new token's chunk (top-k: all of them)."""
        if self.window:
            return sympy.Min(kv, self.window + new - 1)
        if self.chunk:
            return sympy.Min(kv, sympy.Mod(kv - new, self.chunk) + new)
        return kv


@dataclass(frozen=True)
class Dim:
    """A named tensor dimension with a symbolic global size."""

    name: str
    size: sympy.Expr

    def __repr__(self) -> str:
        return self.name


STANDARD_DIMS: dict[str, Dim] = {
    d.name: d
    for d in (
        Dim("batch", MicroBatch),
        Dim("seq", Seq),
        Dim("dmodel", Dmodel),
        Dim("dff", Dff),
        Dim("head", Head),
        Dim("kvhead", KVHead),
        Dim("qgroup", Head / KVHead),
        Dim("dhead", Dmodel / Head),
        Dim("dvocal", Dvocal),
        Dim("experts", Experts),
        Dim("kexperts", KExperts),
        Dim("capacity", Capacity),
    )
}


@dataclass(eq=False)
class Tensor:
    """A tensor of the graph. ``kind`` is ``activation``, ``weight``, ``input`` (a part's
    input that needs a gradient), ``grad`` (an incoming gradient), ``index`` (integer ids)
    or ``data`` (a model input without a gradient: images).
    ``base`` is the same tensor under another sharding mark (a free slice); ``storage`` the
    tensor whose memory a view (reshape, slice) reads; ``footprint`` the smaller tensor
    whose bytes a window view (im2col) or its gradient moves."""

    name: str
    dims: tuple[Dim, ...]
    sharding: Sharding
    dtype: str
    kind: str = "activation"
    producer: Op | None = None
    base: Tensor | None = None
    storage: Tensor | None = None
    footprint: Tensor | None = None
    """the smaller tensor whose bytes this one moves where an op reads or writes it: the
    input of a :meth:`GraphBuilder.windows` view, or its gradient for the data gradient that
    flows back through one"""
    scaling: Scaling | None = None
    """the scale factors stored with a quantized tensor (:mod:`stg.core.quantization`): its
    bytes count them"""
    scaled_dims: tuple[int, ...] = ()
    """the dimensions along which ``scaling``'s blocks run (a matmul's reduction)"""

    def __repr__(self) -> str:
        return f"{self.name}{self.sharding.describe(d.name for d in self.dims)}"

    @property
    def numel(self) -> sympy.Expr:
        """Global number of elements."""
        return sympy.Mul(*(d.size for d in self.dims))


BACKWARD_READS = ("inputs", "output", "nothing")
"""The values of :attr:`Op.backward_reads`."""


@dataclass(eq=False)
class Op:
    """One op. ``kind`` is einsum, elementwise, add, gather, custom or collective.

    Cost declarations: an einsum costs ``2·∏(letter sizes)·scale`` FLOPs; elementwise and
    custom ops cost ``flops_per_element`` per element of their first input.
    ``backward_flops_per_element`` is the cost of an elementwise or custom op's backward.
    """

    kind: str
    name: str
    inputs: tuple[Tensor, ...]
    output: Tensor
    phase: str = "forward"
    tags: frozenset[str] = frozenset()
    spec: str = ""
    scale: sympy.Expr = ONE
    flops_per_element: sympy.Expr = ZERO
    backward_flops_per_element: sympy.Expr = ZERO
    reduce_dims: tuple[int, ...] = ()
    grad_inputs: tuple[int, ...] = ()
    collective: CollectiveType | None = None
    axes: Axes = NO_AXES
    mask: Tensor | None = None
    """a second tensor the op writes for its backward (a dropout's 1-byte mask,
    :meth:`GraphBuilder.dropout`): its bytes count in the op's, and the backward reads it
    instead of the op's input"""
    grad_flops: tuple[sympy.Expr, ...] = ()
    """a custom op's backward cost for each input of ``grad_inputs`` where they differ
    (empty: ``backward_flops_per_element`` for each)"""
    span: AttentionSpan | None = None
    """an attention einsum's keys per query when they are fewer than causal masking's
    (:class:`AttentionSpan`); its ``scale`` is that span's fraction"""
    backward_reads: str = "inputs"
    """what of its forward an elementwise op's backward needs kept (the backward op reads
    the inputs either way): ``inputs``; ``output`` (a softmax: its gradient is computed from
    its output, PyTorch's ``SoftmaxBackward0`` and Megatron's fused softmax save only that);
    ``nothing`` (an op linear in its inputs with constant coefficients, a bias add or RoPE's
    rotation: the backward needs only the incoming gradient, so nothing is saved)"""
    grad_of: Op | None = None
    """for a backward op, the forward op whose gradient it computes"""
    grad_wrt: int | None = None
    """for a backward op, the position in ``grad_of``'s inputs of the input whose gradient it
    computes or carries (:meth:`GraphBuilder.gradient_wrt`)"""


@dataclass
class Part:
    """One built part of a model (embedding, block or head): its ops and tensors."""

    name: str
    forward: list[Op] = field(default_factory=list)
    backward: list[Op] = field(default_factory=list)
    inputs: list[Tensor] = field(default_factory=list)
    output: Tensor | None = None
    weights: list[Tensor] = field(default_factory=list)
    grad_input: Tensor | None = None
    grad_output: Tensor | None = None
    weight_grads: dict[Tensor, Tensor] = field(default_factory=dict)
    reduce: list[Op] = field(default_factory=list)
    update: list[Op] = field(default_factory=list)
    states: list[Tensor] = field(default_factory=list)
    """recurrent states a serving step keeps per sequence (:meth:`GraphBuilder.recurrent_state`)"""
    aux_losses: list[Tensor] = field(default_factory=list)
    """losses of the part besides the model's (:meth:`GraphBuilder.aux_loss`): the backward
    starts from each as from the loss"""
    linears: dict[str, list[Tensor]] = field(default_factory=dict)
    """weights that one linear layer of the training stack holds as one matrix
    (:meth:`GraphBuilder.weight`'s ``linear``), by the layer's name"""
    tied: list[Tensor] = field(default_factory=list)
    """weights of a tied pair (:meth:`GraphBuilder.weight`'s ``tied``) held by this part:
    under pipeline parallelism their gradients are all-reduced over the embedding group"""
    copies: list[Tensor] = field(default_factory=list)
    """weights that another part holds (a tied LM head's): counted there, once"""
    copy_grads: list[Tensor] = field(default_factory=list)
    """the gradients of ``copies`` that this part's backward computes without reducing them:
    they add to the holder's gradient (a tied LM head's at pp 1)"""


def _view_groups(
    src: tuple[Dim, ...], dst: tuple[Dim, ...]
) -> list[tuple[list[int], list[int]]] | None:
    """Pair each run of ``src`` dimensions with a run of ``dst`` dimensions of the same total
    size: one to one, several merged into one, or one split into several."""

    def same(a: sympy.Expr, b: sympy.Expr) -> bool:
        return sympy.simplify(a - b) == 0

    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        if same(src[i].size, dst[j].size):
            groups.append(([i], [j]))
            i, j = i + 1, j + 1
            continue
        for k in range(2, len(src) - i + 1):
            if same(sympy.Mul(*(d.size for d in src[i : i + k])), dst[j].size):
                groups.append((list(range(i, i + k)), [j]))
                i, j = i + k, j + 1
                break
        else:
            for k in range(2, len(dst) - j + 1):
                if same(sympy.Mul(*(d.size for d in dst[j : j + k])), src[i].size):
                    groups.append(([i], list(range(j, j + k))))
                    i, j = i + 1, j + k
                    break
            else:
                return None
    return groups if i == len(src) and j == len(dst) else None


def is_routed_expert(dims: Sequence[Dim], sharding: Sharding) -> bool:
    """Whether a weight holds routed experts split over ranks (its ``experts`` dimension is
    split: by ``ep``)."""
    return any(d.name == "experts" and axes for d, axes in zip(dims, sharding.dims, strict=True))


class KVCacheHook(Protocol):
    """What a builder of a serving phase consults (:class:`stg.core.inference.KVCache`):
    attention einsums read their keys and values from the KV cache (or a model declares what
    the cache holds: :meth:`GraphBuilder.cached`), and weights indexed by position are stored
    for every position the cache holds."""

    def attend(
        self,
        b: GraphBuilder,
        in_letters: Sequence[str],
        operands: tuple[Tensor, ...],
        scale: sympy.Expr | int,
        span: AttentionSpan | None = None,
    ) -> tuple[tuple[Tensor, ...], sympy.Expr | int]: ...

    def state(self, b: GraphBuilder, t: Tensor, name: str) -> Tensor: ...

    def position_weight(
        self,
        b: GraphBuilder,
        name: str,
        dims: tuple[Dim, ...],
        shard: Mapping[str, Iterable[str] | str],
    ) -> Tensor: ...


def _optional_dims(options: Mapping[str, object], head_size: sympy.Expr) -> dict[str, Dim]:
    """Dimensions of options that are unset unless a model needs them, with the fallback of
    each when unset: ``kvlora`` 4·dhead and ``drope`` dhead/2 (DeepSeek-V2 and V3's ratios,
    512 and 64 for heads of 128), ``kvcache`` their sum (the latent a token caches),
    ``dff_dense`` dff, ``qlora`` and ``shared`` none (a model checks the option first)."""

    def chosen(option: str, symbol: sympy.Symbol, fallback: sympy.Expr) -> sympy.Expr:
        return symbol if options.get(option) is not None else fallback

    kvlora = chosen("kv_lora_rank", KVLora, 4 * head_size)
    drope = chosen("drope", DRope, head_size / 2)
    return {
        "qlora": Dim("qlora", QLora),
        "kvlora": Dim("kvlora", kvlora),
        "drope": Dim("drope", drope),
        "kvcache": Dim("kvcache", kvlora + drope),
        "dff_dense": Dim("dff_dense", chosen("dense_dff", DffDense, Dff)),
        "shared": Dim("shared", SharedExperts),
    }


class GraphBuilder:
    """Builds one part of a model. Handed to model templates as ``b``.

    ``active_axes`` are the mesh axes with degree > 1; sharding requests on other axes are
    dropped, so no collective is ever planned on a one-rank group. ``data_axes`` split the
    batch, ``seq_axes`` the sequence of the residual stream between layers.
    ``shard_weights_over`` (FSDP / ZeRO-3) stores every weight split *flat* over these axes
    (those that do not already split it: a folded expert's)
    as well (``Sharding.flat``: the flattened local weight, padded, so any degree works) and
    all-gathers it where it is used; the gathers are tagged ``weight_gather`` so that lowering
    repeats them before the backward.
    """

    def __init__(
        self,
        name: str,
        *,
        active_axes: Iterable[str] = (),
        data_axes: Sequence[str] = ("dp", "ep"),
        seq_axes: Sequence[str] = ("sp",),
        dtype: str = "bf16",
        weight_dtype: str | None = None,
        grad_dtype: str | None = None,
        shard_weights_over: Sequence[str] = (),
        precision: tuple[tuple[str, str], ...] = (),
        options: Mapping[str, object] | None = None,
        kv_cache: KVCacheHook | None = None,
        axis_parts: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        self.part = Part(name)
        self.kv_cache = kv_cache
        parts = UNFOLDED_AXIS_PARTS if axis_parts is None else axis_parts
        self.axis_parts = {k: frozenset(v) for k, v in parts.items()}
        # on a folded mesh: the dense and the expert axis each mesh axis is a piece of
        self.pieces = {
            axis: (dense, expert)
            for dense in DENSE_AXES
            for expert in EXPERT_AXES
            for axis in self.axis_parts.get(dense, frozenset())
            & self.axis_parts.get(expert, frozenset())
        }
        self.active = frozenset(active_axes)
        self.data_axes = self._axes(data_axes)
        self.seq_axes = self._axes(seq_axes)
        self.dtype = dtype
        self.weight_dtype = weight_dtype or dtype
        self.grad_dtype = grad_dtype or self.weight_dtype
        self.fsdp_axes = self._axes(shard_weights_over)
        self.precision = precision
        self.weight_grads_through_casts = False
        """reduce a cast weight's gradient with the weight's (hybrid clusters), not at the cast"""
        self.options: Mapping[str, object] = options or {}
        self.dims: Mapping[str, Dim] = dict(STANDARD_DIMS)
        if self.options.get("dhead") is not None:  # --dhead: a size of its own (Qwen3)
            self.dims = {**self.dims, "dhead": Dim("dhead", DHead)}
        self.dims = {**self.dims, **_optional_dims(self.options, self.dims["dhead"].size)}
        self._phase = "forward"
        self._tags: frozenset[str] = frozenset()
        self._grad_wrt: int | None = None
        self._reshard_cache: dict[tuple[int, Sharding], Tensor] = {}
        self._names: dict[str, int] = {}

    # ----------------------------------------------------------------- helpers
    @property
    def _pipelined(self) -> bool:
        """Whether the embedding and the head run on different pipeline stages (pp > 1)."""
        return int(self.options.get("pp") or 1) > 1

    def _axes(self, axes: Iterable[str] | str | None) -> Axes:
        """The active mesh axes of named axes (``axis_parts`` maps a name to the mesh axes
        it is made of: ``etp`` to ``tp``, or on a folded mesh ``tp`` to ``tp.etp, tp.ep``)."""
        if axes is None:
            return NO_AXES
        if isinstance(axes, str):
            axes = (axes,)
        parts = self.axis_parts
        return frozenset(a for name in axes for a in parts.get(name, (name,)) if a in self.active)

    def _zero_axes_of(self, dims: Sequence[Dim], sharding: Sharding, axes: Axes) -> Axes:
        """The axes over which ZeRO / FSDP shard a weight of ``dims`` sharded as
        ``sharding`` (``axes``: the data-parallel ones): routed experts (an ``experts``
        dimension that is split) over the expert data parallel ranks (``edp``), as
        Megatron's distributed optimizer shards them, the others over ``axes``; never over
        an axis that already splits the weight."""
        if axes and is_routed_expert(dims, sharding):
            axes = self._axes("edp")
        return axes - sharding.axes()

    def _unique(self, name: str) -> str:
        count = self._names.get(name, 0)
        self._names[name] = count + 1
        return name if count == 0 else f"{name}_{count}"

    def dim(self, name: str) -> Dim:
        """A standard dimension by name (batch, seq, dmodel, dff, head, kvhead, qgroup, dhead,
        dvocal, experts, kexperts, capacity; for latent attention and mixed stacks qlora,
        kvlora, drope, kvcache, dff_dense, shared)."""
        try:
            return self.dims[name]
        except KeyError:
            raise UserError(
                f"unknown dimension {name!r}; allowed: {', '.join(sorted(self.dims))}"
            ) from None

    def _dims(self, dims: str | Sequence[Dim | str]) -> tuple[Dim, ...]:
        items = dims.split() if isinstance(dims, str) else dims
        return tuple(d if isinstance(d, Dim) else self.dim(d) for d in items)

    def _emit(self, op: Op) -> Tensor:
        op.phase = self._phase
        op.tags = self._tags
        op.grad_wrt = self._grad_wrt
        op.output.producer = op
        phases = {"forward": self.part.forward, "backward": self.part.backward}
        phases.update(reduce=self.part.reduce, update=self.part.update)
        phases[self._phase].append(op)
        return op.output

    def _new(
        self, name: str, dims: tuple[Dim, ...], sharding: Sharding, dtype: str | None = None
    ) -> Tensor:
        return Tensor(self._unique(name), dims, sharding, dtype or self.dtype)

    @contextmanager
    def tag(self, *tags: str) -> Iterator[None]:
        """Tag the ops built inside the block (e.g. ``core_attention`` for selective recompute)."""
        saved = self._tags
        self._tags = saved | frozenset(tags)
        try:
            yield
        finally:
            self._tags = saved

    @contextmanager
    def gradient_wrt(self, index: int) -> Iterator[None]:
        """Mark the ops built inside the block as the gradient of the ``index``-th input of the
        forward op being differentiated (their :attr:`Op.grad_wrt`)."""
        saved = self._grad_wrt
        self._grad_wrt = index
        try:
            yield
        finally:
            self._grad_wrt = saved

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """Build ops of ``phase``: forward, backward, reduce (gradients, once per iteration) or
        update (after the optimizer step, once per iteration)."""
        saved = self._phase
        self._phase = phase
        try:
            yield
        finally:
            self._phase = saved

    # ----------------------------------------------------------------- leaves
    def input(
        self,
        name: str,
        dims: str | Sequence[Dim | str],
        shard: Mapping[str, Iterable[str] | str] | None = None,
    ) -> Tensor:
        """An input of this part (activation from the previous part, tokens, a gradient)."""
        dim_tuple = self._dims(dims)
        sharding = Sharding(tuple(self._axes((shard or {}).get(d.name)) for d in dim_tuple))
        tensor = Tensor(self._unique(name), dim_tuple, sharding, self.dtype, kind="input")
        self.part.inputs.append(tensor)
        return tensor

    def recurrent_state(
        self,
        name: str,
        dims: str | Sequence[Dim | str],
        shard: Mapping[str, Iterable[str] | str] | None = None,
    ) -> Tensor:
        """The state a recurrent layer keeps per sequence while serving (Mamba-2's SSM state,
        its convolution's last inputs): of constant size, read by a decode step's ops, which
        write its next value (a prefill declares the state its scan leaves); held like the KV
        cache and counted with it."""
        dim_tuple = self._dims(dims)
        sharding = Sharding(tuple(self._axes((shard or {}).get(d.name)) for d in dim_tuple))
        state = Tensor(self._unique(name), dim_tuple, sharding, self.dtype, kind="cache")
        self.part.states.append(state)
        return state

    def residual_input(self, name: str = "x") -> Tensor:
        """The residual stream entering this part: [batch, seq, dmodel], batch split over the
        data axes and seq over the sequence axes of the plan."""
        return self.input(name, "batch seq dmodel", {"batch": self.data_axes, "seq": self.seq_axes})

    def tokens(self, name: str = "tokens") -> Tensor:
        """Token ids [batch, seq] of this replica (not split over tp)."""
        seq = self.seq_axes - self._axes("tp")
        tokens = self.input(name, "batch seq", {"batch": self.data_axes, "seq": seq})
        tokens.kind = "index"
        return tokens

    def data(self, name: str, dims: str | Sequence[Dim | str]) -> Tensor:
        """A model input without a gradient that is not token ids (images): in the
        activation dtype, its batch split over the data axes and its sequence (if any) over
        the sequence axes that split token ids."""
        shard = {"batch": self.data_axes, "seq": self.seq_axes - self._axes("tp")}
        tensor = self.input(name, dims, shard)
        tensor.kind = "data"
        return tensor

    def weight(
        self,
        name: str,
        dims: str | Sequence[Dim | str],
        shard: Mapping[str, Iterable[str] | str] | None = None,
        tied: str | None = None,
        linear: str | None = None,
    ) -> Tensor:
        """A parameter. ``shard`` maps dimension names to the mesh axes that split them,
        e.g. ``{"dff": "tp"}`` for a column-parallel weight. ``tied`` marks one matrix shared
        by the embedding and the head (``--tie_embeddings``): ``"embedding"`` where it is
        held, ``"copy"`` where the head reads it. Without pipeline parallelism the copy is
        the embedding's weight (no parameters, gradient reduction or optimizer state of its
        own: its gradient adds to the embedding's); with pp > 1 it is a weight of the last
        stage, as Megatron-LM keeps one, and both gradients are all-reduced over the first
        and last stage (:func:`stg.core.autodiff.build_grad_reduction`). ``linear`` names
        the linear layer whose one weight matrix this is a block of, where the training stack
        fuses several of the model's projections into one layer (Megatron-Core's ``fc1`` of
        SwiGLU's gate and up): weights of one part with the same ``linear`` are one matrix,
        their output dimensions stacked, to an optimizer that works on whole matrices (Muon,
        :mod:`stg.core.muon`); nothing else reads it."""
        if linear is not None:
            return self._in_linear(linear, self.weight(name, dims, shard, tied))
        if tied not in (None, "embedding", "copy"):
            raise ValueError(f"tied={tied!r}; allowed: None, 'embedding', 'copy'")
        if tied and self.fsdp_axes:
            raise UserError(
                "tie_embeddings with weight_sharded (FSDP) is not modelled; allowed: "
                "weight_sharded false"
            )
        dim_tuple = self._dims(dims)
        if tied:
            sharding = Sharding(tuple(self._axes((shard or {}).get(d.name)) for d in dim_tuple))
            tensor = Tensor(self._unique(name), dim_tuple, sharding, self.weight_dtype, "weight")
            if tied == "copy":
                self.part.copies.append(tensor)
            if tied == "embedding" or self._pipelined:
                self.part.weights.append(tensor)
                self.part.tied.append(tensor)
            return tensor
        if self.kv_cache is not None and any(d.name == "seq" for d in dim_tuple):
            return self.kv_cache.position_weight(self, name, dim_tuple, shard or {})
        sharding = Sharding(tuple(self._axes((shard or {}).get(d.name)) for d in dim_tuple))
        if not self.fsdp_axes:
            tensor = Tensor(
                self._unique(name), dim_tuple, sharding, self.weight_dtype, kind="weight"
            )
            self.part.weights.append(tensor)
            return tensor
        stored = Tensor(
            self._unique(name),
            dim_tuple,
            sharding.with_flat(self._zero_axes_of(dim_tuple, sharding, self.fsdp_axes)),
            self.weight_dtype,
            kind="weight",
        )
        self.part.weights.append(stored)
        with self.tag("weight_gather"):
            gathered = self.reshard(stored, sharding)
        return gathered

    def _in_linear(self, linear: str, weight: Tensor) -> Tensor:
        stored = self.part.weights[-1]  # under FSDP the stored shard, not the gathered copy
        self.part.linears.setdefault(linear, []).append(stored)
        return weight

    def cached(self, t: Tensor, name: str | None = None) -> Tensor:
        """Declare ``t`` (one row per token: a ``seq`` dimension) the attention state that
        serving keeps per token in the KV cache, e.g. latent attention's compressed latent.

        In training this is ``t`` itself. In a serving phase the new rows of ``t`` are
        appended to the layer's cache (a ``kv_append`` node) and the result is the cache,
        with ``seq_kv`` (cached plus new tokens) in place of ``seq``: the ops written on it
        read the whole cache. A part that declares a cached tensor takes charge of its
        cache: the generic rule (keys and values of any einsum pairing two sequence letters
        are cached) is off for it. ``t`` may be called several times (each tensor cached
        once); the cache keeps ``t``'s split (a tensor replicated over tp is cached whole on
        every tp rank)."""
        if self.kv_cache is None:
            return t
        return self.kv_cache.state(self, t, name or t.name)

    # ----------------------------------------------------------------- resharding
    def reshard(self, tensor: Tensor, target: Sharding) -> Tensor:
        """``tensor`` sharded as ``target``, through the collectives this needs (memoised)."""
        if tensor.sharding == target:
            return tensor
        key = (id(tensor), target)
        cached = self._reshard_cache.get(key)
        if cached is not None:
            return cached
        current = tensor
        for step in plan_reshard(tensor.sharding, target, self.pieces or None):
            out = self._new(tensor.name, tensor.dims, step.after, tensor.dtype)
            out.kind = tensor.kind if tensor.kind != "input" else "activation"
            kind_name = step.kind.name.lower()
            self._emit(
                Op(
                    "collective",
                    f"{kind_name}_{'_'.join(sorted(step.axes))}:{tensor.name}",
                    (current,),
                    out,
                    collective=step.kind,
                    axes=step.axes,
                )
            )
            current = out
        if current.sharding != target:  # only free slices/partial marks remain
            current = Tensor(
                current.name,
                current.dims,
                target,
                current.dtype,
                current.kind,
                current.producer,
                base=current.base or current,
            )
        self._reshard_cache[key] = current
        return current

    def conform(self, tensor: Tensor, like: Tensor) -> Tensor:
        """``tensor`` resharded as ``like`` is."""
        return self.reshard(tensor, like.sharding)

    def unpartial(self, tensor: Tensor) -> Tensor:
        if not tensor.sharding.partial:
            return tensor
        return self.reshard(tensor, tensor.sharding.with_partial(()))

    # ----------------------------------------------------------------- ops
    def einsum(
        self,
        spec: str,
        *operands: Tensor,
        name: str = "einsum",
        scale: sympy.Expr | int = 1,
        out_dtype: str | None = None,
        span: AttentionSpan | None = None,
    ) -> Tensor:
        """``einsum("bsh,hf->bsf", x, w)``: a matmul in Einstein notation.

        Weights keep their sharding; activations are resharded to match (earlier operands
        win over later ones). A contracted letter that is split yields a partial sum.
        ``span``: an attention einsum (scores or context) whose queries see fewer keys than
        causal masking gives (sliding window, chunks): its fraction replaces ``scale``.
        """
        lhs, out_letters = spec.replace(" ", "").split("->")
        in_letters = lhs.split(",")
        if span is not None:
            scale = span.fraction(Seq)
        compute = precision_of(self.precision, name) if self.precision else None
        stored = weight_format(compute) if compute and self.kv_cache is not None else None
        attended = False
        if stored is not None and len(in_letters) == len(operands):
            if any(t.kind == "weight" for t in operands):
                operands = self._serving_operands(stored, name, in_letters, out_letters, operands)
            else:  # the attention core: its keys and values are read from the cache as stored
                operands, scale = self._quantized_attention(
                    stored, name, in_letters, operands, scale, span
                )
                attended = True
        elif compute is not None:
            operands = tuple(self.cast(t, compute, f"{name}.cast_{t.name}") for t in operands)
        if len(in_letters) != len(operands):
            raise ValueError(
                f"einsum {spec!r} expects {len(in_letters)} operands, got {len(operands)}"
            )
        if self.kv_cache is not None and not attended:  # serving: keys, values from the cache
            operands, scale = self.kv_cache.attend(self, in_letters, operands, scale, span)
        letter_dim: dict[str, Dim] = {}
        for letters, t in zip(in_letters, operands, strict=True):
            if len(letters) != len(t.dims) or len(set(letters)) != len(letters):
                raise ValueError(f"einsum {spec!r}: {letters!r} does not fit {t!r}")
            for letter, d in zip(letters, t.dims, strict=True):
                if letter_dim.setdefault(letter, d).size != d.size:
                    raise ValueError(
                        f"einsum {spec!r}: letter {letter!r} is {letter_dim[letter]} and {d}"
                    )
        order = sorted(range(len(operands)), key=lambda i: (operands[i].kind != "weight", i))
        owner: dict[str, str] = {}
        letter_axes: dict[str, set[str]] = {}
        for i in order:
            t = operands[i]
            for letter, axes in zip(in_letters[i], t.sharding.dims, strict=True):
                for axis in sorted(axes):
                    if owner.setdefault(axis, letter) == letter:
                        letter_axes.setdefault(letter, set()).add(axis)
        resolved = []
        for letters, t in zip(in_letters, operands, strict=True):
            target = Sharding(tuple(frozenset(letter_axes.get(c, ())) for c in letters))
            resolved.append(
                t if t.kind == "weight" and t.sharding == target else self.reshard(t, target)
            )
        out_dims = tuple(letter_dim[c] for c in out_letters)
        partial = frozenset(
            a for c, axes in letter_axes.items() if c not in out_letters for a in axes
        )
        out_sharding = Sharding(
            tuple(frozenset(letter_axes.get(c, ())) for c in out_letters), partial
        )
        out = self._new(name, out_dims, out_sharding, out_dtype)
        return self._emit(
            Op(
                "einsum",
                name,
                tuple(resolved),
                out,
                spec=spec,
                scale=sympy.sympify(scale),
                span=span,
            )
        )

    def _serving_operands(
        self,
        fmt: WeightFormat,
        name: str,
        in_letters: Sequence[str],
        out_letters: str,
        operands: tuple[Tensor, ...],
    ) -> tuple[Tensor, ...]:
        """A serving matmul under weight format ``fmt`` (:mod:`stg.core.quantization`): its
        weight stored in the format, its activation quantized per step (weight-activation
        formats) or read as it is (weight-only). A weight another op reads at another width
        (a tied embedding) is quantized per step instead."""
        out = []
        for letters, t in zip(in_letters, operands, strict=True):
            reduced = tuple(i for i, c in enumerate(letters) if c not in out_letters)
            if t.kind == "weight" and self._storable(t, fmt):
                t.dtype, t.scaling, t.scaled_dims = fmt.weight_dtype, fmt.weight_scaling, reduced
                out.append(t)
                continue
            if t.kind == "weight":
                target, scaling = fmt.weight_dtype, fmt.weight_scaling
            elif fmt.activation_dtype is None:
                out.append(t)
                continue
            else:
                target, scaling = fmt.activation_dtype, fmt.activation_scaling
            quantized = self.cast(t, target, f"{name}.cast_{t.name}")
            if quantized is not t:
                quantized.scaling, quantized.scaled_dims = scaling, reduced
            out.append(quantized)
        return tuple(out)

    def _quantized_attention(
        self,
        fmt: WeightFormat,
        name: str,
        in_letters: Sequence[str],
        operands: tuple[Tensor, ...],
        scale: sympy.Expr | int,
        span: AttentionSpan | None = None,
    ) -> tuple[tuple[Tensor, ...], sympy.Expr | int]:
        """A serving matmul without a weight (the attention core) in ``fmt``'s dtype: FP8
        attention as vLLM's FlashAttention-3 and FlashInfer backends run it, on an fp8 KV
        cache (``--kv_dtype fp8``) read as it is stored; the query (and the probabilities)
        quantized per step."""
        assert self.kv_cache is not None
        if fmt.name == "int8":  # int8 attention: casts, as in training (a kernel plugin's)
            operands = tuple(self.cast(t, "int8", f"{name}.cast_{t.name}") for t in operands)
            return self.kv_cache.attend(self, in_letters, operands, scale, span)
        if fmt.name != "fp8":
            raise UserError(
                f"precision plan: {name} has no weight to store in {fmt.name}; the attention "
                "core takes a dtype: fp8 (with --kv_dtype fp8), int8, bf16, fp16"
            )
        if self.kv_cache.dtype != "fp8":
            raise UserError(
                f"precision plan: {name}: fp8 attention in a serving phase reads an fp8 KV "
                f"cache; give --kv_dtype fp8 (the cache is {self.kv_cache.dtype})"
            )
        operands, scale = self.kv_cache.attend(self, in_letters, operands, scale, span)
        quantized = []
        for t in operands:
            if t.kind != "cache" and t.dtype != "fp8":
                t = self.cast(t, "fp8", f"{name}.cast_{t.name}")
                t.scaling = fmt.activation_scaling  # the kernel's per-tensor descale
            quantized.append(t)
        return tuple(quantized), scale

    def _storable(self, weight: Tensor, fmt: WeightFormat) -> bool:
        """Whether ``weight`` is a stored weight of this part that is (or can still be) stored
        in ``fmt``: no op has read it at another width."""
        if not any(w is weight for w in self.part.weights):
            return False
        if weight.scaling is not None:
            return (weight.dtype, weight.scaling) == (fmt.weight_dtype, fmt.weight_scaling)
        return not any(weight is t for op in self.part.forward for t in op.inputs)

    def cast(self, t: Tensor, dtype: str, name: str | None = None) -> Tensor:
        """``t`` converted to ``dtype`` (one FLOP per element); ``t`` itself if it already is.
        A cast weight is still a weight: it keeps its sharding authority in einsums."""
        if t.dtype == dtype:
            return t
        if t.footprint is not None and t.producer is not None and t.producer.spec == "windows":
            # cast the input of a window view once, not each of its overlapping windows
            return self.windows(self.cast(t.footprint, dtype, name), t.dims, name=t.name)
        out = self.elementwise(
            name or f"cast_{t.name}", t, flops=1, backward_flops=1, out_dtype=dtype
        )
        out.name = f"{t.name}_{dtype}"
        if t.kind in ("weight", "data"):
            out.kind = t.kind
        return out

    def _broadcast_target(
        self, main: Sharding, main_dims: tuple[Dim, ...], other: Tensor
    ) -> Sharding:
        offset = len(main_dims) - len(other.dims)
        if offset < 0 or any(
            main_dims[offset + i].size != d.size for i, d in enumerate(other.dims)
        ):
            raise ValueError(f"{other!r} does not broadcast against {main_dims}")
        return Sharding(main.dims[offset:])

    def elementwise(
        self,
        name: str,
        x: Tensor,
        *others: Tensor,
        flops: sympy.Expr | float = 1,
        backward_flops: sympy.Expr | float | None = None,
        reduce: Sequence[str | int] = (),
        out_dtype: str | None = None,
        keep_partial: bool = False,
        backward_reads: str = "inputs",
    ) -> Tensor:
        """An elementwise op on ``x`` (others broadcast from the right, e.g. a norm's weight).

        ``flops`` per element of ``x``; ``backward_flops`` defaults to twice that.
        ``reduce`` lists dimensions the op reduces over (softmax, norms), by name or position
        (negative counts from the end): they must not be split, so they are gathered first.
        ``keep_partial``: the op is linear (a cast), so a partial sum stays partial through it.
        ``backward_reads``: what the backward needs kept (:attr:`Op.backward_reads`).
        """
        if backward_reads not in BACKWARD_READS:
            raise ValueError(
                f"backward_reads={backward_reads!r}; allowed: {', '.join(BACKWARD_READS)}"
            )
        n = len(x.dims)
        reduce_idx = tuple(
            sorted(
                {r % n for r in reduce if isinstance(r, int)}
                | {
                    i
                    for i, d in enumerate(x.dims)
                    if d.name in {r for r in reduce if isinstance(r, str)}
                }
            )
        )
        target = Sharding(
            tuple(NO_AXES if i in reduce_idx else a for i, a in enumerate(x.sharding.dims)),
            x.sharding.partial if keep_partial and not reduce_idx else frozenset(),
        )
        x_r = self.reshard(x, target)
        rest = tuple(
            o
            if o.kind == "weight" and o.sharding == self._broadcast_target(target, x.dims, o)
            else self.reshard(o, self._broadcast_target(target, x.dims, o))
            for o in others
        )
        out = self._new(name, x.dims, target, out_dtype)
        bwd = (
            sympy.sympify(backward_flops)
            if backward_flops is not None
            else 2 * sympy.sympify(flops)
        )
        return self._emit(
            Op(
                "elementwise",
                name,
                (x_r, *rest),
                out,
                flops_per_element=sympy.sympify(flops),
                backward_flops_per_element=bwd,
                reduce_dims=reduce_idx,
                grad_inputs=tuple(range(1 + len(others))),
                backward_reads=backward_reads,
            )
        )

    def dropout(self, x: Tensor, name: str = "dropout") -> Tensor:
        """Dropout of ``x`` in training: keep each element with probability 1 - p and scale it
        by 1/(1 - p). The op writes its output and a 1-byte mask (as Megatron-LM and PyTorch
        keep it), :data:`DROPOUT_FLOPS` per element; the backward reads the output gradient
        and the mask, :data:`DROPOUT_BACKWARD_FLOPS` per element. A model calls it where
        ``b.options["dropout"]`` is positive; the rate does not change the cost."""
        x_r = self.unpartial(x)
        out = self._new(name, x.dims, x_r.sharding)
        mask = self._new(f"{name}.mask", x.dims, x_r.sharding, MASK_DTYPE)
        op = Op(
            "elementwise",
            name,
            (x_r,),
            out,
            flops_per_element=sympy.Integer(DROPOUT_FLOPS),
            backward_flops_per_element=sympy.Integer(DROPOUT_BACKWARD_FLOPS),
            grad_inputs=(0,),
            mask=mask,
        )
        result = self._emit(op)
        mask.producer = op
        return result

    def add(self, *terms: Tensor, name: str = "add") -> Tensor:
        """Sum of same-shaped tensors (a residual connection, a gradient accumulation).

        Terms partial over the same axes stay partial; otherwise every term is resharded
        like the first term that is not partial.
        """
        if len(terms) == 1:
            return terms[0]
        first = terms[0]
        if all(t.sharding == first.sharding for t in terms):
            target = first.sharding
        else:
            full = next((t for t in terms if not t.sharding.partial), first)
            target = full.sharding.with_partial(())
        resolved = tuple(self.reshard(t, target) for t in terms)
        out = self._new(name, first.dims, target)
        return self._emit(
            Op(
                "add",
                name,
                resolved,
                out,
                flops_per_element=sympy.Integer(len(terms) - 1),
                grad_inputs=tuple(range(len(terms))),
            )
        )

    def gather(self, table: Tensor, ids: Tensor, name: str = "embedding") -> Tensor:
        """Row lookup ``table[ids]`` (an embedding). A table split by rows yields partial sums
        (vocabulary-parallel embedding)."""
        ids_r = self.unpartial(ids)
        dims = ids.dims + table.dims[1:]
        sharding = Sharding(ids_r.sharding.dims + table.sharding.dims[1:], table.sharding.dims[0])
        out = self._new(name, dims, sharding)
        return self._emit(Op("gather", name, (table, ids_r), out, grad_inputs=(0,)))

    def custom(
        self,
        name: str,
        inputs: Sequence[Tensor],
        out_dims: str | Sequence[Dim | str],
        *,
        flops: sympy.Expr | float,
        backward_flops: sympy.Expr | float | Sequence[sympy.Expr | float],
        grad_inputs: Sequence[int] = (0,),
        out_sharding: Sharding | None = None,
        out_shard: Mapping[str, Iterable[str] | str] | None = None,
        in_shardings: Sequence[Sharding | None] = (),
        out_dtype: str | None = None,
    ) -> Tensor:
        """An op with a declared cost: ``flops`` per element of its first input forward and
        ``backward_flops`` backward (the loss, a router): for each gradient, or one per input
        of ``grad_inputs`` in that order. Costs may depend on the sizes (sympy expressions
        of the dimensions' sizes). The output keeps the first input's
        split of every dimension it shares with it, unless ``out_sharding`` (or ``out_shard``,
        dimension name -> axes) is given. ``in_shardings`` lists the sharding each input must
        have (``None``: as it is, but not partial)."""
        wanted = list(in_shardings) + [None] * (len(inputs) - len(in_shardings))
        resolved = tuple(
            self.reshard(t, want) if want is not None else self.unpartial(t)
            for t, want in zip(inputs, wanted, strict=True)
        )
        dims = self._dims(out_dims)
        if out_shard is not None:
            out_sharding = self.sharding(dims, out_shard)
        if out_sharding is None:
            by_name = {
                d.name: axes
                for d, axes in zip(resolved[0].dims, resolved[0].sharding.dims, strict=True)
            }
            out_sharding = Sharding(tuple(by_name.get(d.name, NO_AXES) for d in dims))
        each = tuple(backward_flops) if isinstance(backward_flops, Sequence) else ()
        if each and len(each) != len(grad_inputs):
            raise ValueError(f"custom {name!r}: one backward cost per input of grad_inputs")
        out = self._new(name, dims, out_sharding, out_dtype)
        return self._emit(
            Op(
                "custom",
                name,
                resolved,
                out,
                flops_per_element=sympy.sympify(flops),
                backward_flops_per_element=sympy.sympify(each[0] if each else backward_flops),
                grad_inputs=tuple(grad_inputs),
                grad_flops=tuple(sympy.sympify(f) for f in each),
            )
        )

    def sharding(
        self, dims: str | Sequence[Dim | str], shard: Mapping[str, Iterable[str] | str]
    ) -> Sharding:
        """A sharding of ``dims`` from dimension name -> axes (inactive axes dropped)."""
        return Sharding(tuple(self._axes(shard.get(d.name)) for d in self._dims(dims)))

    def axes_of(self, t: Tensor, *dim_names: str) -> frozenset[str]:
        """The axes that split the named dimensions of ``t`` (e.g. all token axes)."""
        return frozenset(
            a
            for d, axes in zip(t.dims, t.sharding.dims, strict=True)
            if d.name in dim_names
            for a in axes
        )

    def reduce_to(
        self,
        name: str,
        source: Tensor,
        like: Tensor,
        *saved: Tensor,
        flops: sympy.Expr | float = 1,
        dtype: str | None = None,
    ) -> Tensor:
        """Sum ``source`` over its leading dimensions down to the shape of ``like`` (the gradient
        of a broadcast operand). Axes that split the summed dimensions become partial."""
        offset = len(source.dims) - len(like.dims)
        summed = frozenset(a for axes in source.sharding.dims[:offset] for a in axes)
        sharding = Sharding(source.sharding.dims[offset:], summed | source.sharding.partial)
        out = self._new(name, like.dims, sharding, dtype or like.dtype)
        return self._emit(
            Op("elementwise", name, (source, *saved), out, flops_per_element=sympy.sympify(flops))
        )

    def view(self, x: Tensor, dims: str | Sequence[Dim | str], name: str = "view") -> Tensor:
        """``x`` reshaped to ``dims`` (same number of elements), without a copy.

        Dimensions are grouped where their sizes multiply up alike; a group may be split only
        along its first dimension, which passes its split on (other splits are gathered)."""
        out_dims = self._dims(dims)
        groups = _view_groups(x.dims, out_dims)
        if groups is None:
            raise ValueError(f"view {name!r}: {x.dims} cannot be viewed as {out_dims}")
        x_target: list[Axes] = []
        out_axes: list[Axes] = []
        for ins, outs in groups:
            lead = x.sharding.dims[ins[0]] if ins else NO_AXES
            x_target.extend([lead] + [NO_AXES] * (len(ins) - 1))
            out_axes.extend([lead] + [NO_AXES] * (len(outs) - 1))
        x_r = self.reshard(x, Sharding(tuple(x_target)))
        return self.reinterpret(x_r, out_dims, Sharding(tuple(out_axes)), name)

    def detach(self, x: Tensor, name: str | None = None) -> Tensor:
        """``x`` through which no gradient flows back (``torch.Tensor.detach``): no node."""
        out = self.reinterpret(x, x.dims, x.sharding, name or f"{x.name}_detached")
        assert out.producer is not None
        out.producer.grad_inputs = ()
        out.kind = "detached"  # needs no gradient: the ops reading it compute none for it
        return out

    def aux_loss(self, t: Tensor) -> Tensor:
        """Declare ``t`` a loss of this part besides the model's (an indexer's training loss):
        in training the backward starts from it as from the loss, whatever reads the part's
        output; it is ``t``."""
        self.part.aux_losses.append(t)
        return t

    def reinterpret(
        self, x: Tensor, dims: tuple[Dim, ...], sharding: Sharding, name: str
    ) -> Tensor:
        """The memory of ``x`` seen with other dimensions and sharding (no node, no cost)."""
        out = self._new(name, dims, sharding, x.dtype)
        out.kind = x.kind if x.kind in ("weight", "data") else "activation"
        out.storage = x.storage or x.base or x
        return self._emit(Op("view", name, (x,), out, grad_inputs=(0,)))

    def windows(self, x: Tensor, dims: str | Sequence[Dim | str], name: str = "windows") -> Tensor:
        """``x`` seen as the overlapping windows that a convolution reads (im2col): e.g.
        ``[batch, h, w, c]`` as ``[batch, h_out, w_out, c, k_h, k_w]``, more elements than
        ``x`` holds. A view: no node, no copy. An einsum that reads it moves ``x``'s bytes
        (an implicit-GEMM convolution reads its input once); its gradient is a view back,
        whose data-gradient einsum writes ``x``'s bytes (the overlapping windows are summed
        inside that kernel). Dimensions of ``x`` that the windows keep (same name) keep
        their split; the others are gathered first."""
        out_dims = self._dims(dims)
        kept = {d.name for d in out_dims}
        x_r = self.reshard(
            self.unpartial(x),
            Sharding(
                tuple(
                    a if d.name in kept else NO_AXES
                    for d, a in zip(x.dims, x.sharding.dims, strict=True)
                )
            ),
        )
        axes = {d.name: a for d, a in zip(x_r.dims, x_r.sharding.dims, strict=True)}
        sharding = Sharding(tuple(axes.get(d.name, NO_AXES) for d in out_dims))
        out = self.reinterpret(x_r, out_dims, sharding, name)
        assert out.producer is not None
        out.producer.spec = "windows"
        out.footprint = x_r
        return out

    def slice(self, x: Tensor, dim: str, to: Dim | str, name: str = "slice") -> Tensor:
        """Part of ``x`` along dimension ``dim`` (e.g. Q out of a fused QKV), a view that keeps
        the split: each rank takes its part of its own shard."""
        index = next((i for i, d in enumerate(x.dims) if d.name == dim), None)
        if index is None:
            raise ValueError(f"slice {name!r}: {x!r} has no dimension {dim!r}")
        dims = list(x.dims)
        dims[index] = to if isinstance(to, Dim) else self.dim(to)
        x_r = self.unpartial(x)
        return self.reinterpret(x_r, tuple(dims), x_r.sharding, name)

    def concat(self, *parts: Tensor, dim: str, to: Dim | str, name: str = "concat") -> Tensor:
        """``parts`` joined along dimension ``dim`` into a new one ``to`` (a copy: one op per
        element written, every byte read and written). Parts are resharded like the first."""
        first = self.unpartial(parts[0])
        index = next((i for i, d in enumerate(first.dims) if d.name == dim), None)
        if index is None:
            raise ValueError(f"concat {name!r}: {first!r} has no dimension {dim!r}")
        resolved = tuple(
            p if i == 0 else self.reshard(p, first.sharding)
            for i, p in enumerate((first, *parts[1:]))
        )
        dims = list(first.dims)
        dims[index] = to if isinstance(to, Dim) else self.dim(to)
        out = self._new(name, tuple(dims), first.sharding, first.dtype)
        return self._emit(
            Op(
                "concat",
                name,
                resolved,
                out,
                reduce_dims=(index,),
                grad_inputs=tuple(range(len(parts))),
            )
        )

    def scatter_add(self, name: str, source: Tensor, ids: Tensor, table: Tensor) -> Tensor:
        """Add the rows of ``source`` into a tensor shaped like ``table`` at ``ids`` (the
        gradient of :meth:`gather`). Axes that split the ids become partial."""
        summed = frozenset(a for axes in source.sharding.dims[: len(ids.dims)] for a in axes)
        sharding = Sharding(table.sharding.dims, summed)
        out = self._new(name, table.dims, sharding, self.grad_dtype)
        return self._emit(
            Op("elementwise", name, (source, ids), out, flops_per_element=sympy.Integer(1))
        )

    # ----------------------------------------------------------------- conveniences
    def layernorm(self, x: Tensor, name: str = "layernorm") -> Tensor:
        """LayerNorm over dmodel with weight and bias (7 FLOPs per element forward), tagged
        ``layernorm`` (re-run under selective recompute of that module)."""
        gamma = self.weight(f"{name}.weight", "dmodel")
        beta = self.weight(f"{name}.bias", "dmodel")
        with self.tag("layernorm"):
            return self.elementwise(name, x, gamma, beta, flops=7, reduce=("dmodel",))

    def rmsnorm(self, x: Tensor, name: str = "rmsnorm") -> Tensor:
        """RMSNorm over dmodel with a weight (4 FLOPs per element forward), tagged
        ``layernorm`` as Megatron's module name has it."""
        gamma = self.weight(f"{name}.weight", "dmodel")
        with self.tag("layernorm"):
            return self.elementwise(name, x, gamma, flops=4, reduce=("dmodel",))

    def residual(self, x: Tensor) -> Tensor:
        """``x`` resharded like the residual stream (batch over the data axes, seq over the
        sequence axes): after a row-parallel matmul this is the all-reduce, or with sequence
        parallelism the reduce-scatter."""
        target = Sharding(
            tuple(
                self.data_axes
                if d.name == "batch"
                else self.seq_axes
                if d.name == "seq"
                else NO_AXES
                for d in x.dims
            )
        )
        return self.reshard(x, target)

    def output(self, x: Tensor) -> Tensor:
        """Mark ``x`` as this part's output, resharded like the residual stream."""
        out = self.residual(x)
        self.part.output = out
        return out
