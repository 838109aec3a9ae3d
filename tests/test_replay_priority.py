"""A unit's ``priority`` keys: the order in which ready nodes leave their stream's queue.

The engine issues the ready node of smallest position first; a unit's ``priority`` gives a
node a key between two positions in its place. A reduced problem uses it for the gradient
reductions that the longer schedule places among its last micro-batches' nodes, which the
schedule of as many micro-batches issues earlier (:func:`stg.perf.periodic._placed_ends`).
"""

from __future__ import annotations

import dataclasses

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import NodeType
from stg.host.registry import load_registry
from stg.perf.replay import Problem, Unit, problem_from_workload, replay
from stg.perf.system import load_system

H100 = load_system("h100-80g")
REGISTRY = load_registry(autoload=False)


def _ready_kernels() -> Problem:
    """One rank, four copies of a compute node, all ready at once on the compute stream."""
    options = GenerateOptions(
        model="gpt", dmodel=64, dff=256, head=4, kvhead=4, seq=32, dvocal=128, num_stacks=1
    )
    problem = problem_from_workload(build_workload(options, REGISTRY), H100)
    unit = problem.units[0]
    kernel = next(n for n in unit.nodes if n.type is NodeType.COMP)
    nodes = [dataclasses.replace(kernel, id=i, data_deps=(), ctrl_deps=()) for i in range(4)]
    single = Unit(0, unit.rank, (unit.rank,), nodes)
    return Problem([single], {unit.rank: 0}, {}, 1)


def test_ready_nodes_leave_their_queue_by_position() -> None:
    res = replay(_ready_kernels(), H100).units[0]
    duration = res.duration[0]
    assert duration > 0
    assert res.start == [0.0, duration, 2 * duration, 3 * duration]


def test_a_priority_key_places_a_node_between_two_positions() -> None:
    problem = _ready_kernels()
    unit = problem.units[0]
    problem.units[0] = dataclasses.replace(unit, priority={2: 0.25, 3: 0.5})
    res = replay(problem, H100).units[0]
    duration = res.duration[0]
    assert res.start == [0.0, 3 * duration, duration, 2 * duration]
    replayed = replay(problem, H100, states_at=[(0, 2)])
    # a state copied while the node keyed 0.5 is queued names it by its position, in the
    # order the queue gives them
    assert replayed.states[0].ready[0][0] == [3, 1]
