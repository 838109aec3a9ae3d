"""``stg search --jobs N`` and ``--engine dask``: plans priced on a process pool or a Dask
cluster, with the same bytes on stdout as in one process."""

from __future__ import annotations

import pytest

from stg.cli import main

SEARCH = [
    "search", "--model", "llama", "--num_stacks", "8", "--dmodel", "4096", "--dff", "16384",
    "--head", "32", "--kvhead", "8", "--seq", "2048", "--batch", "32", "--gpus", "8",
    "--zero", "0,1", "--recompute", "none,full", "--refine", "2", "--top", "2",
]  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


@pytest.mark.parametrize("output", [["--json"], []], ids=["json", "table"])
def test_search_gives_the_same_bytes_with_one_and_two_jobs(
    capsys: pytest.CaptureFixture[str], output: list[str]
) -> None:
    code, one, err = run(capsys, *SEARCH, *output, "--jobs", "1")
    assert code == 0, err
    code, two, err = run(capsys, *SEARCH, *output, "--jobs", "2")
    assert code == 0, err
    assert two == one
    # the bound stops the pricing inside a batch of the pool's (128 plans for 2 workers)
    assert "lower bound above the best times" in one


def test_search_on_dask_gives_the_same_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("distributed")
    code, local, err = run(capsys, *SEARCH, "--json", "--jobs", "1")
    assert code == 0, err
    code, dask, err = run(
        capsys, *SEARCH, "--json", "--engine", "dask", "--scheduler", "local-threads:2"
    )
    assert code == 0, err
    assert dask == local


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--jobs", "-1"], "--jobs -1: must be a positive number"),
        (["--engine", "spark"], "allowed: local, dask"),
        (["--scheduler", "tcp://x:1"], "--scheduler needs --engine dask"),
        (["--phase", "decode", "--jobs", "2"], "a serving search"),
    ],
)
def test_bad_engine_options_are_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run(capsys, *SEARCH, *args)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
