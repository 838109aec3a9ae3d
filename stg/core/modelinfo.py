"""Closed-form summaries of a model template: parameters, FLOPs and activation bytes per part.

Builds the model once without parallelism and reads its symbolic graph, so every figure is a
sympy expression over the dimension symbols (``micro_batch``, ``seq``, ``dmodel``, ...) that a
user can print, and a number once the dimensions are given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy

from stg.core.autodiff import build_backward
from stg.core.options import GenerateOptions
from stg.core.precision import DTYPE_BYTES
from stg.core.symbolic import Experts, GraphBuilder, KExperts, Op, Part, Tensor
from stg.host.records import Model

PARTS = ("embedding", "block", "head")


def op_flops(op: Op) -> sympy.Expr:
    """FLOPs of one op over its global shape (no parallelism)."""
    if op.kind == "einsum":
        lhs, _ = op.spec.split("->")
        sizes: dict[str, sympy.Expr] = {}
        for letters, t in zip(lhs.split(","), op.inputs, strict=True):
            for letter, d in zip(letters, t.dims, strict=True):
                sizes.setdefault(letter, d.size)
        return 2 * sympy.Mul(*sizes.values()) * op.scale
    if op.kind in {"elementwise", "custom"}:
        return op.flops_per_element * op.inputs[0].numel
    if op.kind == "add":
        return op.flops_per_element * op.output.numel
    if op.kind in {"gather", "concat"}:  # data movement: one op per element written, as lowered
        return op.output.numel
    return sympy.Integer(0)


def _bytes(t: Tensor) -> sympy.Expr:
    return t.numel * DTYPE_BYTES[t.dtype]


def model_units(model: Model, options: GenerateOptions) -> list[tuple[str, int]]:
    """(part name, instances) of ``model`` for ``options``: the embedding, each block kind of
    its stack (:meth:`stg.host.records.Model.layer_runs`; ``block`` for most models; none
    for a model without a layer stack) with its number of layers, and the head."""
    layers: dict[str, int] = {}
    for kind, _, count in model.layer_runs(options.as_dict()):
        layers[kind] = layers.get(kind, 0) + count
    return [("embedding", 1), *layers.items(), ("head", 1)]


def build_unsharded(model: Model, part_name: str, options: GenerateOptions) -> Part:
    """Build one part of ``model`` on a single device, forward and backward: ``embedding``,
    ``head``, ``block`` or a block kind of the model's stack. The head of a model without a
    layer stack receives the embedding's output."""
    if part_name in PARTS:
        function = getattr(model, part_name)
    else:
        kinds = {kind: fn for kind, fn, _ in model.layer_runs(options.as_dict())}
        function = kinds[part_name]
    b = GraphBuilder(part_name, dtype=options.dtype, options=options.as_dict())
    if part_name == "embedding":
        x = None
    elif model.block is None and model.stack is None:
        out = build_unsharded(model, "embedding", options).output
        assert out is not None
        x = b.input("x", out.dims)
    else:
        x = b.residual_input()
    result = function(b, x)
    if part_name == "head":
        build_backward(b, seed=None, loss=result)
    else:
        if b.part.output is None:
            b.output(result)
        out = b.part.output
        assert out is not None
        seed = b.input("grad_output", out.dims)
        seed.kind = "grad"
        build_backward(b, seed=seed)
    return b.part


def saved_activations(part: Part) -> list[Tensor]:
    """Forward tensors that the backward reads: what stays in memory between the two. The
    backward of an op that needs only its output (a softmax) or nothing (a bias add, RoPE,
    :attr:`stg.core.symbolic.Op.backward_reads`) keeps that, not the inputs it reads."""
    forward = {id(op.output): op.output for op in part.forward}
    forward.update({id(op.mask): op.mask for op in part.forward if op.mask is not None})
    forward.update({id(t): t for t in part.inputs if t.kind in {"input", "index", "data"}})
    seen: dict[int, Tensor] = {}
    for op in part.backward:
        source = op.grad_of
        if source is not None and source.backward_reads == "output":
            seen.setdefault(id(source.output), source.output)
        unneeded = (
            {id(t.base or t) for t in source.inputs}
            if source is not None and source.backward_reads != "inputs"
            else set()
        )
        for t in op.inputs:
            base = t.base or t
            if id(base) in unneeded:
                continue
            if base.footprint is not None and id(base.footprint) in forward:
                base = base.footprint  # a window view keeps its input, not the windows
            if id(base) in forward and base.kind != "weight":
                seen.setdefault(id(base), base)
    return list(seen.values())


def routed_weights(part: Part) -> list[Tensor]:
    """The weights of routed experts: each has an ``experts`` dimension that an einsum runs
    over as a batch dimension (an activation operand has it too: tokens dispatched to
    experts), so a token reaches only ``kexperts`` of its ``experts`` slices. A router's
    ``dmodel experts`` weight is not one: every token uses all of it."""
    routed: dict[int, Tensor] = {}
    for op in part.forward:
        if op.kind != "einsum":
            continue
        operands = [t.base or t for t in op.inputs]
        batched = any(
            t.kind != "weight" and any(d.name == "experts" for d in t.dims) for t in operands
        )
        if not batched:
            continue
        for t in operands:
            if t.kind == "weight" and any(d.name == "experts" for d in t.dims):
                routed.setdefault(id(t), t)
    return list(routed.values())


def own_weights(part: Part) -> list[Tensor]:
    """The weights of ``part`` less the copies of another part's (a tied LM head's, on its
    own pipeline stage): each parameter of the model once."""
    copies = {id(w) for w in part.copies}
    return [w for w in part.weights if id(w) not in copies]


def active_parameters(part: Part) -> sympy.Expr:
    """Parameters one token uses: every weight, routed experts' weights (:func:`routed_weights`)
    counted for ``kexperts`` of their ``experts`` slices (the "active" count of mixtures of
    experts)."""
    routed = {id(t) for t in routed_weights(part)}
    share = KExperts / Experts
    total = sympy.Integer(0)
    for w in own_weights(part):
        total += w.numel * share if id(w) in routed else w.numel
    return total


def describe_part(part: Part) -> dict[str, sympy.Expr]:
    return {
        "parameters": sympy.simplify(sum((w.numel for w in own_weights(part)), sympy.Integer(0))),
        "active_parameters": sympy.simplify(active_parameters(part)),
        "forward_flops": sympy.simplify(
            sum((op_flops(op) for op in part.forward), sympy.Integer(0))
        ),
        "backward_flops": sympy.simplify(
            sum((op_flops(op) for op in part.backward), sympy.Integer(0))
        ),
        "activation_bytes": sympy.simplify(
            sum((_bytes(t) for t in saved_activations(part)), sympy.Integer(0))
        ),
    }


def describe_model(
    model: Model, options: GenerateOptions, values: Mapping[Any, int]
) -> dict[str, Any]:
    """Per part (:func:`model_units`): each figure as an expression and as a number for
    ``values``; plus totals for ``options.num_stacks`` layers (``layers``: how many of each
    block kind)."""
    result: dict[str, Any] = {"model": model.name, "parts": {}}
    totals: dict[str, int] = {}
    units = model_units(model, options)
    for name, instances in units:
        figures = describe_part(build_unsharded(model, name, options))
        entry = {}
        for key, expr in figures.items():
            number = int(sympy.sympify(expr).xreplace(dict(values)))
            entry[key] = {"expression": str(expr), "value": number}
            totals[key] = totals.get(key, 0) + number * instances
        result["parts"][name] = entry
    result["totals"] = totals
    result["layers"] = {name: n for name, n in units[1:-1]}
    result["dims"] = {str(k): v for k, v in values.items()}
    return result


def model_parameters(
    model: Model, options: GenerateOptions, values: Mapping[Any, int]
) -> dict[str, int]:
    """``parameters`` and ``active_parameters`` (:func:`active_parameters`) of the whole
    model: embedding, ``options.num_stacks`` blocks and head, for the dimension ``values``."""
    counts = {"parameters": 0, "active_parameters": 0}
    for name, layers in model_units(model, options):
        part = build_unsharded(model, name, options)
        total = sum((w.numel for w in own_weights(part)), sympy.Integer(0))
        for key, expr in (("parameters", total), ("active_parameters", active_parameters(part))):
            counts[key] += int(sympy.sympify(expr).xreplace(dict(values))) * layers
    return counts


def part_dot(part: Part) -> str:
    """A Graphviz DOT view of one built part: ops as nodes (collectives as boxes, backward ops
    dashed), edges from producers to consumers, labelled with shape and sharding."""
    lines = [f'digraph "{part.name}" {{', "  rankdir=TB;", '  node [fontname="Helvetica"];']
    index: dict[int, int] = {}
    ops = [*part.forward, *part.backward]
    for i, op in enumerate(ops):
        index[id(op)] = i
        shape = "box" if op.kind == "collective" else "ellipse"
        style = ',style="dashed"' if op.phase == "backward" else ""
        label = f"{op.name}\\n{op.kind}"
        lines.append(f'  n{i} [label="{label}",shape={shape}{style}];')
    for i, op in enumerate(ops):
        for t in op.inputs:
            producer = (t.base or t).producer
            if producer is not None and id(producer) in index:
                desc = t.sharding.describe(d.name for d in t.dims).replace('"', "")
                lines.append(f'  n{index[id(producer)]} -> n{i} [label="{desc}",fontsize=8];')
    lines.append("}")
    return "\n".join(lines) + "\n"
