"""Prediction from a trace groups its ranks the same with either decoder: the reference
reader summarises each rank (fingerprint, communicators, peers) as the compiled one does, so
``stg predict DIR --json`` writes the same bytes with ``STG_DECODER=python``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stg.cli import main
from stg.trace import decode
from stg.trace.ranks import read_ranks, reference_summary

needs_compiled = pytest.mark.skipif(
    not decode.enabled(), reason="the compiled decoder is not in use: nothing to compare with"
)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trace") / "out"
    args = (
        "--model gpt --dmodel 256 --dff 1024 --head 8 --kvhead 8 --seq 128 --dvocal 1024 "
        "--num_stacks 4 --tp 2 --pp 2 --dp 2 --batch 8 --micro_batch 2 --output_dir"
    ).split()
    with pytest.raises(SystemExit) as done:
        main(["generate", *args, str(out)])
    assert done.value.code == 0
    return out


def _files(trace: Path) -> list[Path]:
    return sorted(trace.glob("workload.*.et"), key=lambda p: int(p.name.split(".")[1]))


@needs_compiled
def test_reference_summaries_group_ranks_as_the_compiled_ones(trace: Path) -> None:
    files = _files(trace)
    compiled = read_ranks(files, jobs=1)
    with decode.reference_only():
        reference = read_ranks(files, jobs=1)
    assert compiled.fast and reference.fast
    assert reference.classes == compiled.classes == [0, 0, 0, 0, 1, 1, 1, 1]
    for rank in range(len(files)):
        assert reference.colls(rank) == compiled.colls(rank)
        assert reference.sends(rank) == compiled.sends(rank)
        assert reference.recvs(rank) == compiled.recvs(rank)


def test_reference_summary_tells_stages_apart(trace: Path) -> None:
    files = _files(trace)
    summaries = [reference_summary(f) for f in files]
    assert all(s is not None for s in summaries)
    # ranks 0-3 are the first stage, 4-7 the second: peers differ, nodes do not
    assert len({s.fingerprint for s in summaries[:4]}) == 1  # type: ignore[union-attr]
    assert summaries[0].fingerprint != summaries[4].fingerprint  # type: ignore[union-attr]
    assert summaries[0].sends == [4] * len(summaries[0].sends)  # type: ignore[union-attr]


def test_reference_summary_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    broken = tmp_path / "workload.0.et"
    broken.write_bytes(b"\xff\xff\xff")
    assert reference_summary(broken) is None


@needs_compiled
def test_predict_json_is_the_same_with_either_decoder(trace: Path) -> None:
    def predict(**env: str) -> bytes:
        return subprocess.run(
            [sys.executable, "-m", "stg", "predict", str(trace), "--json"],
            env={**os.environ, **env},
            check=True,
            capture_output=True,
        ).stdout

    compiled = predict()
    assert b'"class": 0' in compiled
    assert predict(STG_DECODER="python") == compiled
