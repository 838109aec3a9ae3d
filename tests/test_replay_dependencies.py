"""The engine's dependency lists (``stg.perf.replay._dependencies``): the same with ids that
are positions (looked up directly) as with any other ids, each dependency counted once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stg.core.workload import Node, NodeType
from stg.errors import TraceError
from stg.perf.replay import _dependencies


def _reference(nodes: list[Node]) -> tuple[list[list[int]], list[int], bool]:
    position = {n.id: i for i, n in enumerate(nodes)}
    children: list[list[int]] = [[] for _ in nodes]
    pending = []
    for i, node in enumerate(nodes):
        deps = sorted({position[d] for d in (*node.data_deps, *node.ctrl_deps)})
        for j in deps:
            children[j].append(i)
        pending.append(len(deps))
    ordered = all(i > j for j, c in enumerate(children) for i in c)
    return children, pending, ordered


@st.composite
def _graphs(draw: st.DrawFn) -> list[Node]:
    """Random graphs: dependencies on earlier or (sometimes) later nodes, repeated ones, data
    deps that are also ctrl deps; ids their positions or (sometimes) shifted."""
    n = draw(st.integers(1, 12))
    later = draw(st.booleans())
    offset = draw(st.sampled_from([0, 0, 100]))
    nodes = []
    for i in range(n):
        pool = st.integers(0, n - 1) if later else st.integers(0, max(0, i - 1))
        data = draw(st.lists(pool, max_size=4)) if (i or later) else []
        ctrl = draw(st.lists(pool, max_size=2)) if (i or later) else []
        data = [d for d in data if d != i]
        ctrl = [d for d in ctrl if d != i]
        nodes.append(
            Node(
                i + offset,
                f"n{i}",
                NodeType.COMP,
                data_deps=tuple(d + offset for d in data),
                ctrl_deps=tuple(d + offset for d in ctrl),
            )
        )
    return nodes


@settings(max_examples=300, deadline=None)
@given(_graphs())
def test_dependencies_match_a_plain_lookup_by_id(nodes: list[Node]) -> None:
    assert _dependencies(nodes, 0) == _reference(nodes)


def test_the_commonest_shapes_count_each_dependency_once() -> None:
    comp = NodeType.COMP
    nodes = [
        Node(0, "a", comp),
        Node(1, "b", comp, data_deps=(0,)),
        Node(2, "c", comp, data_deps=(1, 1)),  # twice, as two data deps
        Node(3, "d", comp, data_deps=(2,), ctrl_deps=(2,)),  # a data dep also a ctrl dep
        Node(4, "e", comp, data_deps=(1, 3)),
    ]
    children, pending, ordered = _dependencies(nodes, 0)
    assert pending == [0, 1, 1, 1, 2]
    assert children == [[1], [2, 4], [3], [4], []]
    assert ordered


def test_a_later_dependency_is_no_order() -> None:
    comp = NodeType.COMP
    nodes = [Node(0, "a", comp, ctrl_deps=(1,)), Node(1, "b", comp)]
    assert _dependencies(nodes, 0) == ([[], [0]], [1, 0], False)


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ([Node(0, "a", NodeType.COMP, data_deps=(-1,))], "node 0 depends on missing -1"),
        ([Node(0, "a", NodeType.COMP, data_deps=(5,))], "node 0 depends on missing 5"),
        ([Node(3, "a", NodeType.COMP), Node(3, "b", NodeType.COMP)], "duplicate node ids"),
    ],
)
def test_a_missing_dependency_or_a_repeated_id_is_a_trace_error(
    nodes: list[Node], message: str
) -> None:
    with pytest.raises(TraceError, match=message):
        _dependencies(nodes, 7)
