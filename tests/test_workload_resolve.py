"""A rank's nodes resolved from its class's templates: ``RankGraph._resolve`` builds each
``Node`` positionally (keywords cost more), so every field must land where ``Node`` declares
it; a reordered or added field would shift the values silently."""

from __future__ import annotations

from dataclasses import fields

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import Node, NodeType
from stg.host.registry import load_registry

TEMPLATE_FIELDS = (
    "id", "name", "type", "data_deps", "ctrl_deps", "num_ops", "tensor_size", "comm_type",
    "comm_size",
)  # fmt: skip
"""The fields a resolved node copies from its template (then group, source, destination, the
template's ``comm_tag`` and ``runtime``, ``is_cpu_op`` False, ``dtype`` and ``attrs``)."""


def test_node_fields_are_in_the_order_resolve_passes_them() -> None:
    assert tuple(f.name for f in fields(Node)) == (
        *TEMPLATE_FIELDS, "comm_group", "comm_src", "comm_dst", "comm_tag", "runtime",
        "is_cpu_op", "dtype", "attrs",
    )  # fmt: skip


def test_every_resolved_field_is_the_templates_or_the_ranks() -> None:
    options = GenerateOptions(
        model="gpt", dmodel=64, dff=256, head=4, kvhead=4, seq=64, dvocal=128, num_stacks=2,
        tp=2, pp=2, dp=2, batch=4, micro_batch=2,
    )  # fmt: skip
    workload = build_workload(options, load_registry(autoload=False))
    kinds = set()
    for graph in workload.ranks:
        for template, node in zip(graph.rank_class.nodes, graph.nodes(), strict=True):
            for name in TEMPLATE_FIELDS:
                assert getattr(node, name) == getattr(template, name), name
            assert node.comm_tag == template.comm_tag and node.runtime == template.runtime
            assert node.dtype == template.dtype and node.attrs is template.attrs
            assert node.is_cpu_op is False
            kinds.add(node.type)
            if node.type is NodeType.COMM_COLL:
                assert node.comm_group is not None and node.comm_src is node.comm_dst is None
            elif node.type is NodeType.COMM_SEND:
                assert node.comm_src == graph.rank != node.comm_dst
            elif node.type is NodeType.COMM_RECV:
                assert node.comm_dst == graph.rank != node.comm_src
            else:
                assert node.comm_group is node.comm_src is node.comm_dst is None
    assert {NodeType.COMP, NodeType.COMM_COLL, NodeType.COMM_SEND, NodeType.COMM_RECV} <= kinds
