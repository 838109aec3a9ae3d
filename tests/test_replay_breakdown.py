"""``unit_breakdown`` (a unit's compute, communication, waits, bubble and host copies) against
a plain node-by-node reference: the same floats, bit for bit (the sums over the nodes in node
order, the wait added node by node), and the busy time the union of the intervals (ties in
any order)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stg.perf.replay import (
    COLL,
    COMPUTE,
    COPY,
    INSTANT,
    RECV,
    SEND,
    Unit,
    UnitResult,
    _union_length,
    unit_breakdown,
)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, current = 0.0, None
    for s, e in sorted(intervals):
        if current is None:
            current = [s, e]
        elif s > current[1]:
            total += current[1] - current[0]
            current = [s, e]
        else:
            current[1] = max(current[1], e)
    return total + (current[1] - current[0]) if current else 0.0


def _reference(res: UnitResult, iteration: float) -> dict[str, float]:
    compute, comm, copies, waiting = [], [], [], 0.0
    for i, k in enumerate(res.kind):
        if k == COMPUTE:
            compute.append((res.start[i], res.end[i]))
        elif k in (COLL, SEND):
            comm.append((res.transfer_start[i], res.end[i]))
            waiting += res.transfer_start[i] - res.start[i]
        elif k == COPY:
            copies.append((res.start[i], res.end[i]))
    compute_s = sum([e - s for s, e in compute])
    comm_s = sum([e - s for s, e in comm])
    busy = _union(compute + comm)
    out = {
        "compute_s": compute_s,
        "communication_s": comm_s,
        "exposed_communication_s": max(busy - compute_s, 0.0),
        "collective_wait_s": waiting,
        "bubble_s": max(iteration - busy, 0.0),
    }
    if copies:
        with_copies = _union(compute + comm + copies)
        out["host_copy_s"] = sum(e - s for s, e in copies)
        out["exposed_host_copy_s"] = max(with_copies - busy, 0.0)
        out["bubble_s"] = max(iteration - with_copies, 0.0)
    return out


# few distinct instants, so that intervals tie and touch
_instant = st.sampled_from([0.0, 0.1, 0.25, 0.3, 1.0 / 3.0, 0.7, 1.0])


@st.composite
def _results(draw: st.DrawFn) -> UnitResult:
    n = draw(st.integers(0, 30))
    kind = draw(
        st.lists(
            st.sampled_from([COMPUTE, COLL, SEND, RECV, INSTANT, COPY]), min_size=n, max_size=n
        )
    )
    start, issued, end = [], [], []
    for _ in range(n):
        a, b, c = sorted(draw(st.tuples(_instant, _instant, _instant)))
        start.append(a)
        issued.append(b)
        end.append(c)
    unit = Unit(0, 0, (0,), [])
    return UnitResult(unit, kind, [0.0] * n, start, end, issued, [None] * n)


@settings(max_examples=400, deadline=None)
@given(_results())
def test_the_breakdown_is_the_plain_node_by_node_one(res: UnitResult) -> None:
    got = unit_breakdown(res, 1.0)
    want = _reference(res, 1.0)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == value, key


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_instant, _instant).map(sorted).map(tuple)))
def test_the_union_of_intervals_does_not_depend_on_the_order_of_ties(
    intervals: list[tuple[float, float]],
) -> None:
    assert _union_length(intervals[::2], intervals[1::2]) == _union(intervals)


def test_the_critical_chain_ends_at_the_first_node_that_ends_last() -> None:
    """Ties for the last end: the first unit's, and within it the first node's."""
    from stg.perf.replay import Replay, critical_chain

    def result(end: list[float], cause: list[tuple[int, int] | None]) -> UnitResult:
        n = len(end)
        unit = Unit(0, 0, (0,), [])
        return UnitResult(unit, [COMPUTE] * n, [0.0] * n, [0.0] * n, end, [0.0] * n, cause)

    units = [
        result([1.0, 3.0, 2.0, 3.0], [None, (0, 0), None, None]),
        result([3.0, 0.5], [None, None]),
        result([], []),
    ]
    assert critical_chain(Replay(units, 3.0)) == [(0, 0), (0, 1)]
    assert critical_chain(Replay([units[2], units[1], units[0]], 3.0)) == [(1, 0)]
    assert critical_chain(Replay([units[2]], 0.0)) == []
