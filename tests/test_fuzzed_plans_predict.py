"""Valid plans that a fuzz of option combinations found ending in a traceback (each must
predict, or be refused with one line)."""

from __future__ import annotations

import json

import pytest

from stg.cli import main
from stg.core.dtensor import GATHER_COPY
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry


def _predict(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    with pytest.raises(SystemExit) as done:
        main(["predict", *args, "--json"])
    out, err = capsys.readouterr()
    assert not done.value.code, err
    return json.loads(out)


def test_tp_comm_overlap_over_a_group_spanning_nodes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Userbuffers' GEMMs beside a tensor-parallel group of 16 H100s (two nodes) are slowed as
    over the group's outermost link (its contention key named the spanning collective)."""
    monkeypatch.setenv("STG_CACHE_DIR", "")
    args = ("--tp", "16", "--num_stacks", "1", "--system", "h100-80g")
    overlapped = _predict(capsys, *args, "--tp_comm_overlap", "true")["time"]
    plain = _predict(capsys, *args)["time"]
    assert 0 < overlapped["iteration_time_s"] <= plain["iteration_time_s"]


def test_nvfp4_sequence_parallel_copies_count_4_bit_elements(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the PyTorch profiles DTensor copies sequence parallelism's gathered activations;
    under nvfp4 they hold 4-bit elements (two per byte)."""
    monkeypatch.setenv("STG_CACHE_DIR", "")
    given = dict(num_stacks=2, tp=2, dtype="fp8", low_precision_recipe="nvfp4")
    for profile in ("compiled", "eager"):
        options = GenerateOptions(**given, profile=profile)
        workload = build_workload(options, load_registry(autoload=False))
        copies = [
            n
            for c in workload.rank_classes
            for n in c.nodes
            if n.name.endswith(GATHER_COPY) and n.dtype == "fp4"
        ]
        assert copies, profile
        for node in copies:
            # two elements a byte; the copy reads and writes its bytes (tensor_size: twice them)
            assert node.num_ops == node.tensor_size
        report = _predict(
            capsys, *(f"--{k}={v}" for k, v in given.items()), "--profile", profile,
            "--system", "b200-180g",
        )  # fmt: skip
        assert report["time"]["iteration_time_s"] > 0
