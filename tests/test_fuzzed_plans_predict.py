"""Valid plans that a fuzz of option combinations found ending in a traceback (each must
predict, or be refused with one line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stg.cli import main
from stg.core.dtensor import GATHER_COPY
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry

DOCS = Path(__file__).resolve().parents[1] / "docs"


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


def test_an_infinite_iteration_time_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A system file that validates but whose figures give no finite time (docs/systems.md's
    example cluster with a 5e-324 GB/s NVLink) is refused with one line, exit code 2 and no
    output, by the replay and by the analytical predictor, instead of printing ``Infinity``
    (which no JSON reader accepts)."""
    monkeypatch.setenv("STG_CACHE_DIR", "")
    text = (DOCS / "systems.md").read_text(encoding="utf-8")
    system = json.loads(text.split("```json my-cluster.json", 1)[1].split("```", 1)[0])
    system["network"][0]["bandwidth_gbps"] = 5e-324
    path = tmp_path / "tiny-bw.json"
    path.write_text(json.dumps(system))
    plan = ("--model", "gpt", "--dmodel", "256", "--head", "4", "--kvhead", "4", "--dff", "1024",
            "--dvocal", "1024", "--seq", "128", "--num_stacks", "2", "--dp", "2")  # fmt: skip
    for predictor in ("time", "analytical"):
        with pytest.raises(SystemExit) as done:
            main(["predict", *plan, "--system", str(path), "--predictor", predictor, "--json"])
        out, err = capsys.readouterr()
        assert done.value.code == 2, (predictor, err)
        assert not out
        assert len(err.strip().splitlines()) == 1 and "inf" in err, err
