"""Lowering's compiled loop (stg/core/_lowering.c) against its Python loop
(``stg.core.lowering.python_lowering``): the same workloads, node for node, attribute order
included, and the same trace files byte for byte."""

from __future__ import annotations

import contextlib
import filecmp
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_lowering_runs import CASES, layout

from stg.cli import main
from stg.core import lowering
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import CollectiveType, NodeType
from stg.host.registry import load_registry

REGISTRY = load_registry(autoload=False)

compiled = pytest.mark.skipif(
    lowering.lowering_status() != "compiled", reason=lowering.lowering_status()
)


def test_compiled_lowering_is_built() -> None:
    """CI runs the compiled loop; a stale or missing build fails here."""
    if os.environ.get("STG_LOWERING", "").lower() in ("python", "reference"):
        pytest.skip("STG_LOWERING=python")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: lowering runs its Python loop")
    assert lowering.lowering_status() == "compiled"


@compiled
@pytest.mark.parametrize("case", list(CASES))
def test_workloads_are_the_python_loops(case: str) -> None:
    given, lowered = CASES[case]
    options = GenerateOptions(**given)
    fast = build_workload(options, REGISTRY, lowered_micro_batches=lowered)
    with lowering.python_lowering():
        assert lowering.lowering_status() != "compiled"
        slow = build_workload(options, REGISTRY, lowered_micro_batches=lowered)
    assert layout(fast) == layout(slow)
    assert [type(n) for c in fast.rank_classes for n in c.nodes] == [
        type(n) for c in slow.rank_classes for n in c.nodes
    ]


@compiled
@pytest.mark.parametrize("env_kind", [tuple, list])
def test_a_run_with_unusual_inputs_is_the_python_loops(env_kind: type) -> None:
    """Inputs from before the run that are lists, unsorted or repeated, missing or empty;
    ``after`` and ``start``; the step's pending dep; collectives after the previous one."""
    from stg.core.lowering import BoundOp

    def op(name: str, inputs: tuple[int, ...], output: int, coll: bool = False) -> BoundOp:
        if coll:
            return BoundOp(
                name, NodeType.COMM_COLL, inputs, (output,),
                comm_type=CollectiveType.ALL_REDUCE, comm_size=8, group_axes=("dp",),
            )  # fmt: skip
        return BoundOp(name, NodeType.COMP, inputs, (output,), num_ops=1, tensor_size=4)

    ops = [
        op("a", (100, 101), 200),
        op("b", (200, 102), 201, coll=True),
        op("c", (103,), 202),
        op("d", (201, 202, 100), 203, coll=True),
        op("e", (), 204),
        op("f", (104,), 205),
        op("g", (105, 100), 206),
    ]
    results = []
    for python in (False, True):
        out = lowering._Nodes()
        for i in range(6):
            out.add({"name": f"n{i}", "type": NodeType.COMP}, ())
        out.add({"name": "c0", "type": NodeType.COMM_COLL, "group_axes": ("dp",)}, ())
        env: dict[int, Any] = {
            100: env_kind([4, 1, 4]),
            101: env_kind([2]),
            102: (),
            104: env_kind([5, 3]),
            105: env_kind([3]),
        }
        with lowering.python_lowering() if python else contextlib.nullcontext():
            out.start_step()
            out.run(ops, env, "mb0/", after=1, where={"phase": 1, "micro_batch": 0})
            out.run(ops, env, "mb1/", start=2, where={"phase": 2})
            out.run(tuple(ops), env, "mb2/", after=5, start=3)
        results.append(([(n, list(n.attrs.items())) for n in out.nodes], env, out.last_comp))
    assert results[0] == results[1]


@compiled
def test_trace_files_are_the_same_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    given, _ = CASES["1f1b"]
    flags = [f"--{key}={value}" for key, value in given.items()]
    for name, python in (("fast", False), ("slow", True)):
        with pytest.raises(SystemExit) as done:
            if python:
                with lowering.python_lowering():
                    main(["generate", "--output_dir", str(tmp_path / name), *flags])
            else:
                main(["generate", "--output_dir", str(tmp_path / name), *flags])
        assert not done.value.code, capsys.readouterr().err
    fast, slow = sorted((tmp_path / "fast").iterdir()), sorted((tmp_path / "slow").iterdir())
    assert [p.name for p in fast] == [p.name for p in slow]
    _, mismatch, errors = filecmp.cmpfiles(
        tmp_path / "fast", tmp_path / "slow", [p.name for p in fast], shallow=False
    )
    assert not mismatch and not errors
