"""Generation cost grows linearly with the number of ranks (issue 8).

Counted, never timed: the work done by ``Layout.members`` (ranks listed over all calls) must
be proportional to the world size, not to its square. Each comm group's members are listed
once, not once per member rank.
"""

from __future__ import annotations

from typing import Any

import pytest

from stg.core.layout import Layout
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry

SMALL: dict[str, Any] = dict(num_stacks=1, dmodel=64, dff=256, head=4, kvhead=4, seq=32, dvocal=128)


@pytest.fixture(scope="module")
def registry() -> Any:
    return load_registry(autoload=False)


def _members_work(
    monkeypatch: pytest.MonkeyPatch, registry: Any, **degrees: int
) -> tuple[int, int, int]:
    """(calls, ranks listed by all calls, world size) of one build_workload."""
    calls = 0
    listed = 0
    original = Layout.members

    def counting(self: Layout, rank: int, axes: Any) -> tuple[int, ...]:
        nonlocal calls, listed
        result = original(self, rank, axes)
        calls += 1
        listed += len(result)
        return result

    with monkeypatch.context() as patch:
        patch.setattr(Layout, "members", counting)
        replicas = degrees.get("dp", 1)
        options = GenerateOptions(**{**SMALL, "num_stacks": 2}, batch=replicas, **degrees)
        workload = build_workload(options, registry)
    world = len(workload.ranks)
    assert world == workload.layout.world_size
    return calls, listed, world


@pytest.mark.parametrize(
    "degrees",
    [{}, {"tp": 2}, {"tp": 2, "pp": 2}],
    ids=["dp", "dp-tp2", "dp-tp2-pp2"],
)
def test_members_work_is_linear_in_dp(
    monkeypatch: pytest.MonkeyPatch, registry: Any, degrees: dict[str, int]
) -> None:
    calls_1k, listed_1k, world_1k = _members_work(monkeypatch, registry, dp=1000, **degrees)
    calls_2k, listed_2k, world_2k = _members_work(monkeypatch, registry, dp=2000, **degrees)
    assert world_2k == 2 * world_1k
    # every rank is listed a bounded number of times (once per group it belongs to, in the
    # layout and in the workload's comm groups), whatever the world size
    assert listed_1k <= 8 * world_1k, (calls_1k, listed_1k)
    assert listed_2k <= 8 * world_2k, (calls_2k, listed_2k)
    # doubling the ranks at most doubles the work (quadratic work would quadruple it)
    assert listed_2k <= 2 * listed_1k + 16, (listed_1k, listed_2k)
    assert calls_2k <= 2 * calls_1k + 16, (calls_1k, calls_2k)


def test_comm_groups_unchanged(registry: Any) -> None:
    """The comm groups are the layout's groups, each member list sorted and complete."""
    options = GenerateOptions(**{**SMALL, "num_stacks": 2}, batch=4, dp=4, tp=2, pp=2)
    workload = build_workload(options, registry)
    layout = workload.layout
    assert workload.comm_groups
    for gid, members in workload.comm_groups.items():
        assert layout.comm_groups[gid] == members
        assert list(members) == sorted(set(members))
    world = layout.world_size
    assert all(0 <= m < world for members in workload.comm_groups.values() for m in members)
