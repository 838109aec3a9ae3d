"""Per-op precision plans: matmuls in the planned dtype, casts in front, same matmul FLOPs."""

from __future__ import annotations

import json

import pytest
from workload_checks import GPT_GEMMS, check_runs_to_completion, flops_by_root

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.precision import dump_plan, load_plan, normalize_plan, precision_of
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.trace.validate import validate_workload

SMALL = dict(dvocal=512, dmodel=64, dff=256, seq=32, head=8, kvhead=4, num_stacks=2, batch=8)


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def test_plan_files_round_trip_and_bad_plans_are_one_line(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(dump_plan(normalize_plan({"fc*": "int8", "logits": "fp32"})))
    assert load_plan(path) == (("fc*", "int8"), ("logits", "fp32"))
    assert precision_of(load_plan(path), "fc1") == "int8"
    assert precision_of(load_plan(path), "fc1.grad_w1") == "int8"
    assert precision_of(load_plan(path), "q") is None
    for text, message in [
        ("{", "not readable JSON"),
        (json.dumps({"ops": {"fc1": "int4"}}), "dtype 'int4' of 'fc1' must be one of"),
        (json.dumps(["fc1"]), 'expected {"ops"'),
    ]:
        path.write_text(text)
        with pytest.raises(UserError, match=message):
            load_plan(path)
    with pytest.raises(UserError, match="no such file"):
        load_plan(tmp_path / "missing.json")


def test_planned_matmuls_run_in_their_precision_with_casts(registry):
    plan = (("fc*", "int8"),)
    w = build_workload(
        GenerateOptions(**SMALL, tp=2, pp=2, micro_batch=4, precision=plan), registry
    )
    base = build_workload(GenerateOptions(**SMALL, tp=2, pp=2, micro_batch=4), registry)
    assert validate_workload(w).ok
    assert check_runs_to_completion(w) == sum(len(g) for g in w.ranks)
    gemm = {k: v for k, v in flops_by_root(w).items() if k in GPT_GEMMS}
    assert gemm == {k: v for k, v in flops_by_root(base).items() if k in GPT_GEMMS}
    nodes = [n for cls in w.rank_classes for n in cls.nodes]
    fc = [
        n
        for n in nodes
        if n.name.rsplit("/", 1)[-1].split(".grad_")[0] in {"fc1", "fc2"} and ".cast_" not in n.name
    ]
    assert fc and all(n.dtype == "int8" for n in fc if n.type.name == "COMP")
    casts = [n for n in nodes if ".cast_" in n.name and n.type.name == "COMP"]
    assert casts and all(n.dtype == "int8" and n.num_ops > 0 for n in casts if "/fwd/" in n.name)
    others = [n for n in nodes if n.name.endswith("/q") or n.name.endswith("/attn_out")]
    assert others and all(n.dtype == "bf16" for n in others)


def test_low_precision_inputs_move_fewer_bytes(registry):
    # fc1's input is all-gathered over tp after the cast: int8 moves half of bf16
    def gathered(plan):
        w = build_workload(GenerateOptions(**SMALL, tp=2, precision=plan), registry)
        names = ("/fwd/all_gather_tp:ln2", "/fwd/all_gather_tp:ln2_int8")
        return sum(n.comm_size for n in w.ranks[0].rank_class.nodes if n.name.endswith(names))

    assert gathered((("fc1", "int8"),)) * 2 == gathered(())
