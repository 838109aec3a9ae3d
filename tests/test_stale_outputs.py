"""A trace written into a directory that holds an earlier trace of the same output name
replaces all of it: rank files beyond the new world size and the earlier comm-group file go,
so readers never mix the two; files of other names stay."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.trace.validate import validate_trace

LAYERS = ["--dmodel", "64", "--dff", "256", "--seq", "32", "--dvocal", "128"]
SMALL = [*LAYERS, "--head", "4", "--kvhead", "4"]


def _stg(*args: str | Path) -> Any:
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result


def test_the_readme_blocks_in_order_leave_a_valid_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    sizes = [*LAYERS, "--head", "8", "--kvhead", "8"]  # smaller layers, 8 heads for tp 8
    # README, Quick start: into the default output_dir, generated/
    _stg("generate", "--tp", "8", "--num_stacks", "8", "--predict", "--print_gpu_vram", "true",
         *sizes)  # fmt: skip
    assert (tmp_path / "generated" / "workload.json").is_file()
    # README, drop-in for the original STG
    _stg("generate", "--output_dir", "generated/", "--output_name", "workload.%d.et",
         "--comm_group_file", "comm_group.json", "--dp", "2", "--tp", "2", "--pp", "2",
         "--weight_sharded", "0", *sizes)  # fmt: skip
    out = tmp_path / "generated"
    assert sorted(os.listdir(out)) == ["comm_group.json"] + [f"workload.{r}.et" for r in range(8)]
    result = _stg("validate", "generated")
    assert result.stdout.startswith("valid: 8 ranks"), result.stdout
    assert validate_trace(out).ok


def test_a_smaller_world_leaves_no_stale_rank_or_group_file(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _stg("generate", "--dp", "4", "--num_stacks", "1", *SMALL, "--output_dir", out)
    _stg("generate", "--dp", "2", "--num_stacks", "1", *SMALL, "--output_dir", out,
         "--comm_group_file", "groups.json")  # fmt: skip
    assert sorted(os.listdir(out)) == ["groups.json", "workload.0.et", "workload.1.et"]
    assert validate_trace(out).ok
    # and back to the default name: the earlier groups.json is not known to be this trace's
    _stg("generate", "--dp", "2", "--num_stacks", "1", *SMALL, "--output_dir", out)
    assert sorted(os.listdir(out)) == [
        "groups.json", "workload.0.et", "workload.1.et", "workload.json"
    ]  # fmt: skip
    assert validate_trace(out).ok


def test_unrelated_files_survive(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _stg("generate", "--dp", "2", "--num_stacks", "1", *SMALL, "--output_dir", out,
         "--output_name", "other")  # fmt: skip
    mine = {
        "notes.txt": "my notes\n",
        "workload.1.et.bak": "a backup\n",
        "workload.x.et": "not a rank file\n",
        "groups.v1.json": json.dumps({"1": [0, 1]}),
    }
    for name, text in mine.items():
        (out / name).write_text(text)
    others = {p.name: p.read_bytes() for p in out.iterdir()}
    _stg("generate", "--dp", "4", "--num_stacks", "1", *SMALL, "--output_dir", out)
    (out / "workload.json").write_text('{"model": "gpt"}\n')  # the user's own, not groups
    _stg("generate", "--dp", "2", "--num_stacks", "1", *SMALL, "--output_dir", out,
         "--comm_group_file", "groups.json")  # fmt: skip
    assert (out / "workload.json").read_text() == '{"model": "gpt"}\n'
    assert not (out / "workload.2.et").exists() and not (out / "workload.3.et").exists()
    assert {n: (out / n).read_bytes() for n in others} == others
    assert validate_trace(out / "other").ok
    assert validate_trace(out / "workload", comm_group_file=out / "groups.json").ok
