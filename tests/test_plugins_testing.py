"""stg.testing: the contract checks pass for the built-ins and catch broken plugins."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import stg
from stg.errors import UnknownNameError
from stg.host.records import Emitter, Model, Predictor
from stg.testing import check_emitter, check_model, check_predictor, make_registry

SIZES = {
    "mamba2": dict(ssm_head_dim=8, ssm_groups=2, ssm_chunk=8),
    "gated-deltanet": dict(linear_head_dim=8, seq=64),
    "hybrid": dict(
        layer_pattern="M*G-", num_stacks=4, ssm_head_dim=8, ssm_groups=2, ssm_chunk=8,
        linear_head_dim=8, seq=64, causal=True,
    ),
}  # fmt: skip
"""The sizes a tiny build of the state-space models needs (their defaults are a real
model's: chunks of 64 to 256 tokens, head sizes of 64 and 128)."""


def test_builtin_models_pass_check_model() -> None:
    registry = make_registry()
    for name in registry.models.names():
        workload = check_model(name, registry=registry, tp=2, pp=2, **SIZES.get(name, {}))
        assert workload.world_size == 4


def test_check_model_accepts_a_record() -> None:
    from stg.models import gpt

    record = Model(name="gpt", embedding=gpt.embedding, block=gpt.block, head=gpt.head)
    workload = check_model(record, dp=2)  # clashes with the built-in gpt: selected by plugin
    assert workload.world_size == 2


def test_check_model_names_an_unknown_model() -> None:
    with pytest.raises(UnknownNameError, match="unknown model 'no-such'"):
        check_model("no-such")


def test_builtin_emitters_round_trip() -> None:
    registry = make_registry()
    for name in registry.emitters.names():
        files = check_emitter(name, registry=registry, merge_deps=name == "chakra-v0.0.1")
        assert files[:8] == sorted(files[:8], key=lambda f: int(f.split(".")[1]))


def test_check_emitter_catches_a_lossy_emitter(tmp_path: Path) -> None:
    registry = make_registry()
    real = registry.emitters.get("chakra-v0.0.4")

    def drop_last_dep(workload, directory, output_name):
        from dataclasses import replace

        from stg.core.workload import RankClass, RankGraph, Workload

        ranks = []
        for graph in workload.ranks:
            nodes = list(graph.rank_class.nodes)
            nodes[-1] = replace(nodes[-1], data_deps=())
            cls = RankClass(graph.rank_class.index, graph.rank_class.stage, tuple(nodes),
                            graph.rank_class.facts)
            ranks.append(RankGraph(graph.rank, cls, graph.layout))
        lossy = Workload(tuple(ranks), workload.comm_groups, workload.layout, workload.metadata)
        return real.write(lossy, directory, output_name)

    record = Emitter(name="lossy", write=drop_last_dep, extension=".et")
    with pytest.raises(AssertionError, match="wrote"):
        check_emitter(record)


def test_builtin_predictors_pass_check_predictor() -> None:
    registry = make_registry()
    for name in registry.predictors.names():
        serving = {"phase": "decode"} if name == "serving" else {}  # it needs a serving phase
        report = check_predictor(name, registry=registry, tp=2, **serving)
        assert isinstance(report, dict)


def test_check_predictor_rejects_nan() -> None:
    record = Predictor(name="nan", predict=lambda workload, system: {"time": math.nan})
    with pytest.raises(AssertionError, match=r"report\.time is nan"):
        check_predictor(record)


def test_stg_registry_fixture(stg_registry) -> None:
    class Plugin:
        @stg.hookimpl
        def stg_register_predictors(register):
            register(Predictor(name="zero", predict=lambda workload, system: {"time": 0}))

    registry = stg_registry(Plugin)
    assert registry.predictors.lookup("zero").source == "in process"
    assert "gpt" in registry.models
    assert check_predictor("zero", registry=registry) == {"time": 0}
    with pytest.raises(AssertionError, match="plugins failed to load"):
        stg_registry(object())
