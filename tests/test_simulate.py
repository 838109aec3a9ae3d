"""``stg simulate`` and ``stg sweep --simulate astra-sim``: ASTRA-sim's output read, its
figures beside ``stg predict``'s, and every way a run fails (missing binary, crash, ranks that
never finish, a hang), against a stand-in that prints what the real binary prints
(tests/astra_sim_standin.py). Where ``$ASTRA_SIM_BIN`` names a real build, the last test runs
it too."""

from __future__ import annotations

import csv
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from astra_sim_standin import EXPOSED_CYCLES, FINISH_CYCLES, write_standin

from stg.cli import main
from stg.cli._shared import format_seconds
from stg.errors import UserError
from stg.perf.simulator import (
    BINARY_ENV,
    SimulationFailed,
    SimulatorInputs,
    parse_finished,
    resolve_binary,
    run_astra_sim,
)

TINY = [
    "--dvocal", "128", "--dmodel", "64", "--dff", "128", "--head", "4", "--kvhead", "2",
    "--seq", "32", "--batch", "8", "--micro_batch", "4", "--num_stacks", "2",
]  # fmt: skip
WORLD = 4
REAL_BINARY = os.environ.get(BINARY_ENV)
"""a real ASTRA-sim build, where the environment names one (read before the fixture below
removes it from each test's environment)"""


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


@pytest.fixture(autouse=True)
def _no_binary_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BINARY_ENV, raising=False)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-rank trace (tp 2, dp 2) with kernel times and ASTRA-sim's inputs for h100-80g."""
    out = tmp_path_factory.mktemp("trace") / "out"
    with pytest.raises(SystemExit) as info:
        main(["generate", *TINY, "--tp", "2", "--dp", "2", "--system", "h100-80g",
              "--astra_sim_configs", "--output_dir", str(out)])  # fmt: skip
    assert info.value.code == 0
    return out


def _predicted(capsys: pytest.CaptureFixture[str], trace: Path) -> dict:
    code, out, err = run(capsys, "predict", trace, "--system", "h100-80g", "--predictor", "time",
                         "--json")  # fmt: skip
    assert code == 0, err
    return json.loads(out)["time"]


# -- reading ASTRA-sim's output ---------------------------------------------------------------


def test_parse_reads_both_formats_in_any_order_with_colours() -> None:
    output = (
        "[2026-11-26 00:26:15.097] [workload] [info] sys[1] finished, 1500 cycles, exposed "
        "communication 700 cycles.\n"
        "[2026-11-26 00:26:15.097] [workload] [\x1b[32minfo\x1b[m] sys[0] finished, 1200 "
        "cycles, exposed communication 200 cycles.\n"
        "[2026-11-26 00:26:15.097] [statistics] [info] sys[0], Wall time: 1200\n"
        "sys[2] finished, 900 cycles\n"
    )
    found = parse_finished(output)
    assert sorted(found) == [0, 1, 2]
    assert (found[0].finish_cycles, found[0].exposed_communication_cycles) == (1200, 200)
    assert found[0].compute_cycles == 1000
    assert (found[1].finish_cycles, found[1].exposed_communication_cycles) == (1500, 700)
    assert (found[2].finish_cycles, found[2].exposed_communication_cycles) == (900, None)
    assert found[2].compute_cycles is None


# -- the side-by-side report ------------------------------------------------------------------


def test_simulate_prints_astra_sim_beside_predict(
    capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path
) -> None:
    before = sorted(p.name for p in trace.iterdir())
    binary = write_standin(tmp_path)
    code, out, err = run(capsys, "simulate", trace, "--astra-sim", binary)
    assert code == 0, err
    predicted = _predicted(capsys, trace)
    text = " ".join(out.split())
    last = (FINISH_CYCLES + 1000 * (WORLD - 1)) * 1e-9
    assert "ASTRA-sim beside stg predict" in text and "h100-80g (4 ranks)" in text
    assert f"{last * 1e3:.3f} ms" in text  # the last rank's finish is the iteration
    assert format_seconds(predicted["iteration_time_s"]) in text
    assert f"{last / predicted['iteration_time_s']:.3f}" in text
    assert f"{(FINISH_CYCLES - EXPOSED_CYCLES) * 1e-6:.3f} ms" in text  # rank 0's compute
    assert "all 4 ranks finished, between 2.000 ms and 2.003 ms" in text
    assert "ran 4 ranks in" in " ".join(err.split())
    assert sorted(p.name for p in trace.iterdir()) == before  # nothing written, no log folder


def test_simulate_json(capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path) -> None:
    binary = write_standin(tmp_path)
    code, out, err = run(capsys, "simulate", trace, "--astra-sim", binary, "--json")
    assert code == 0, err
    data = json.loads(out)
    predicted = _predicted(capsys, trace)
    assert data["system"] == "h100-80g" and data["world_size"] == WORLD
    times = data["iteration_time_s"]
    assert times["stg"] == predicted["iteration_time_s"]
    assert times["astra_sim"] == pytest.approx((FINISH_CYCLES + 3000) * 1e-9)
    assert times["ratio"] == pytest.approx(times["astra_sim"] / times["stg"])
    ranks = data["astra_sim"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert ranks[2]["finish_s"] == pytest.approx((FINISH_CYCLES + 2000) * 1e-9)
    assert ranks[2]["exposed_communication_s"] == pytest.approx((EXPOSED_CYCLES + 2) * 1e-9)
    assert ranks[2]["compute_s"] == pytest.approx((FINISH_CYCLES + 1998 - EXPOSED_CYCLES) * 1e-9)
    (row,) = data["ranks"]  # identical ranks: one row of stg's report, rank 0
    assert row["rank"] == 0 and row["ranks"] == WORLD
    compute = predicted["ranks"][0]["compute_s"]
    assert row["stg"]["compute_s"] == compute
    assert row["stg"]["exposed_s"] == pytest.approx(predicted["iteration_time_s"] - compute)
    assert row["astra_sim"] == ranks[0]
    assert data["prediction"]["iteration_time_s"] == predicted["iteration_time_s"]
    assert data["astra_sim"]["binary"] == str(binary)
    _, again, _ = run(capsys, "simulate", trace, "--astra-sim", binary, "--json")
    assert again == out  # same input, same bytes (no wall time in the JSON)


def test_simulate_reads_astra_sim_2_2_lines_without_exposed_communication(
    capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BINARY_ENV, str(write_standin(tmp_path, "old")))
    code, out, err = run(capsys, "simulate", trace, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["astra_sim"]["ranks"][3]["exposed_communication_s"] is None
    assert data["iteration_time_s"]["astra_sim"] == pytest.approx((FINISH_CYCLES + 3000) * 1e-9)
    code, out, err = run(capsys, "simulate", trace)
    assert code == 0, err
    assert " - " in out  # no exposed communication to show


def test_simulate_takes_the_inputs_given(
    capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path
) -> None:
    moved = tmp_path / "moved"
    shutil.copytree(trace, moved)
    configs = {kind: tmp_path / f"mine.{kind}" for kind in ("system", "network", "memory")}
    suffix = {"system": ".system.json", "network": ".network.yml", "memory": ".memory.json"}
    for kind, path in configs.items():
        (moved / f"workload{suffix[kind]}").rename(path)
    binary = write_standin(tmp_path)
    code, _, err = run(capsys, "simulate", moved, "--astra-sim", binary)
    assert code == 2
    assert err.startswith(f"error: --system-config {moved}/workload.system.json: missing; ")
    code, out, err = run(
        capsys, "simulate", moved, "--astra-sim", binary, "--system-config", configs["system"],
        "--network-config", configs["network"], "--memory-config", configs["memory"], "--json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["world_size"] == WORLD


# -- errors: exit 2 for input and environment, exit 1 for the simulator -----------------------


def test_missing_binary_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run(capsys, "simulate", trace)
    assert (code, out) == (2, "")
    assert err == (
        "error: no ASTRA-sim binary: give --astra-sim PATH or set ASTRA_SIM_BIN (an analytical "
        "build's bin/AstraSim_Analytical_Congestion_Unaware; see docs/simulate.md)\n"
    )
    code, _, err = run(capsys, "simulate", trace, "--astra-sim", tmp_path / "nowhere")
    assert code == 2
    assert err == f"error: ASTRA-sim binary '{tmp_path}/nowhere' (--astra-sim) does not exist\n"
    monkeypatch.setenv(BINARY_ENV, "no-such-astra-sim")
    code, _, err = run(capsys, "simulate", trace)
    assert code == 2
    assert err == "error: ASTRA-sim binary 'no-such-astra-sim' (ASTRA_SIM_BIN) is not on PATH\n"
    plain = tmp_path / "plain"
    plain.write_text("not a program")
    code, _, err = run(capsys, "simulate", trace, "--astra-sim", plain)
    assert code == 2 and err.endswith("(--astra-sim) is not executable\n")
    plain.chmod(0o755)  # executable, but no program: the kernel refuses it
    code, _, err = run(capsys, "simulate", trace, "--astra-sim", plain)
    assert code == 2 and err.startswith(f"error: cannot run ASTRA-sim {plain}: ")
    assert len(err.splitlines()) == 1


def test_crash_is_one_line_exit_1(
    capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path
) -> None:
    code, out, err = run(capsys, "simulate", trace, "--astra-sim", write_standin(tmp_path, "abort"))
    assert (code, out) == (1, "")
    assert err == "error: ASTRA-sim crashed (SIGABRT): what():  Unknown collective implementation\n"
    binary = write_standin(tmp_path, "critical")
    code, out, err = run(capsys, "simulate", trace, "--astra-sim", binary)
    assert (code, out) == (1, "")
    assert err == (
        "error: ASTRA-sim failed with exit code 1: [2026-11-26 00:26:15.097] [workload] "
        "[critical] Node 0 in ctrl_dep graph, but not found in index\n"
    )


def test_a_crash_after_every_rank_finished_keeps_the_figures(
    capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path
) -> None:
    binary = write_standin(tmp_path, "teardown")
    code, out, err = run(capsys, "simulate", trace, "--astra-sim", binary, "--json")
    assert code == 0, err
    assert err == (
        "warning: ASTRA-sim crashed (SIGABRT) after every rank finished: malloc_consolidate(): "
        "unaligned fastbin chunk detected; its figures are complete\n"
    )
    assert json.loads(out)["iteration_time_s"]["astra_sim"] == pytest.approx(
        (FINISH_CYCLES + 3000) * 1e-9
    )


def test_ranks_that_never_finish_are_a_deadlock_exit_1(
    capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path
) -> None:
    binary = write_standin(tmp_path, "deadlock")
    code, out, err = run(capsys, "simulate", trace, "--astra-sim", binary)
    assert (code, out) == (1, "")
    assert err.startswith(
        "error: ASTRA-sim exited with 3 of 4 ranks finished (ranks 3 never did: a deadlock, "
    )
    assert len(err.splitlines()) == 1


def test_a_hang_is_stopped_at_the_timeout_with_its_children(
    capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setenv("STANDIN_PIDS", str(pids))
    binary = write_standin(tmp_path, "hang")
    code, out, err = run(capsys, "simulate", trace, "--astra-sim", binary, "--timeout", "3")
    assert (code, out) == (1, "")
    assert err == (
        "error: ASTRA-sim ran longer than 3 s and was stopped; allowed: a larger --timeout\n"
    )
    for pid in map(int, pids.read_text().split()):  # the simulator and the child it started
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"process {pid} outlived the timeout")
    for bad in ("0", "-1", "inf", "nan"):
        code, _, err = run(capsys, "simulate", trace, "--astra-sim", binary, "--timeout", bad)
        assert (code, err) == (2, f"error: --timeout {bad}: must be a positive number of seconds\n")


def test_inputs_astra_sim_cannot_run_are_refused(
    capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path
) -> None:
    binary = write_standin(tmp_path)
    bare = tmp_path / "bare"
    code, _, err = run(capsys, "generate", *TINY, "--dp", "2", "--output_dir", bare)
    assert code == 0, err
    code, _, err = run(capsys, "simulate", bare, "--astra-sim", binary)
    assert code == 2
    assert err.startswith(f"error: {bare}: the trace carries no kernel times (it was generated ")
    kinds = (("system", "json"), ("network", "yml"), ("memory", "json"))
    configs = [f"--{kind}-config={trace}/workload.{kind}.{ext}" for kind, ext in kinds]
    code, out, err = run(
        capsys, "simulate", bare, "--astra-sim", binary, "-s", "h100-80g", *configs
    )
    assert code == 0, err
    assert err.startswith(f"note: {bare} carries no kernel times; ASTRA-sim prices its compute ")
    code, out, err = run(capsys, "simulate", trace, "--astra-sim", binary, "-s", "a100-80g")
    assert code == 0, err
    assert err.startswith("note: the trace's kernel times are for h100-80g; stg predicts for a100")
    assert "on a100-80g (4 ranks)" in " ".join(out.split())
    feeder = tmp_path / "feeder"
    code, _, err = run(capsys, "generate", *TINY, "--dp", "2", "--format", "json",
                       "--output_dir", feeder)  # fmt: skip
    assert code == 0, err
    code, _, err = run(capsys, "simulate", feeder, "--astra-sim", binary, "-s", "h100-80g")
    assert code == 2
    assert err.startswith(f"error: {feeder}/workload.0.json: ASTRA-sim reads Chakra v0.0.4 ")
    code, _, err = run(capsys, "simulate", tmp_path / "none", "--astra-sim", binary)
    assert code == 2 and len(err.splitlines()) == 1


def test_run_astra_sim_needs_every_rank(tmp_path: Path, trace: Path) -> None:
    """The library call: the world size, not the ranks printed, decides completeness."""
    inputs = SimulatorInputs(
        workload=str(trace / "workload"),
        comm_group=str(trace / "workload.json"),
        system=str(trace / "workload.system.json"),
        network=str(trace / "workload.network.yml"),
        memory=str(trace / "workload.memory.json"),
        world_size=WORLD + 1,
    )
    with pytest.raises(SimulationFailed) as info:
        run_astra_sim(str(write_standin(tmp_path)), inputs, 60)
    assert info.value.reason == "incomplete" and "4 of 5 ranks finished (ranks 4 never" in str(
        info.value
    )
    assert "sys[0] finished" in info.value.output
    with pytest.raises(UserError, match="no ASTRA-sim binary"):
        resolve_binary(None, {})
    assert resolve_binary("python3", {}) == shutil.which("python3")


# -- stg sweep --simulate astra-sim -----------------------------------------------------------


def test_sweep_simulate_astra_sim(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sweep = [*TINY, "--tp", "2", "--dp", "1,2", "--system", "h100-80g", "-o", tmp_path / "s"]
    code, _, err = run(capsys, "sweep", *sweep, "--simulate", "astra-sim")
    assert code == 2 and err.startswith("error: no ASTRA-sim binary: ")
    monkeypatch.setenv(BINARY_ENV, str(write_standin(tmp_path)))
    code, _, err = run(capsys, "sweep", *sweep, "--simulate", "astra-sim", "--keep",
                       "--metric", r"npus=initializing (\d+) NPUs")  # fmt: skip
    assert code == 0, err
    rows = {r["dp"]: r for r in csv.DictReader((tmp_path / "s" / "results.csv").open())}
    for dp, world in (("1", 2), ("2", 4)):
        row = rows[dp]
        assert row["sim_status"] == "ok", row
        last = (FINISH_CYCLES + 1000 * (world - 1)) * 1e-9
        assert float(row["sim_finish_s"]) == pytest.approx(last)
        assert float(row["sim_exposed_communication_s"]) == pytest.approx(
            (EXPOSED_CYCLES + world - 1) * 1e-9
        )
        assert float(row["sim_ratio"]) == pytest.approx(last / float(row["iteration_time_s"]))
        assert float(row["metric_npus"]) == world
    kept = [sorted(p.name for p in d.iterdir()) for d in (tmp_path / "s" / "traces").iterdir()]
    names = min(kept, key=len)
    assert names == ["workload.0.et", "workload.1.et", "workload.json", "workload.memory.json",
                     "workload.network.yml", "workload.system.json"]  # fmt: skip
    monkeypatch.setenv(BINARY_ENV, str(write_standin(tmp_path, "deadlock")))
    code, _, err = run(capsys, "sweep", *sweep, "-o", tmp_path / "d", "--simulate", "astra-sim")
    assert code == 0, err
    rows = list(csv.DictReader((tmp_path / "d" / "results.csv").open()))
    assert {r["sim_status"] for r in rows} == {"incomplete"}
    assert all("ranks finished" in r["sim_error"] and r["sim_finish_s"] == "" for r in rows)


def test_sweep_simulate_astra_sim_records_inputs_it_refuses(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BINARY_ENV, str(write_standin(tmp_path)))
    code, _, err = run(capsys, "sweep", *TINY, "--tp", "1", "--dp", "1", "--system", "h100-80g",
                       "-o", tmp_path / "s", "--simulate", "astra-sim")  # fmt: skip
    assert code == 0, err
    (row,) = csv.DictReader((tmp_path / "s" / "results.csv").open())
    assert row["status"] == "ok" and row["sim_status"] == "error"
    assert "needs at least 2 NPUs per dimension" in row["sim_error"]


# -- the real simulator, where one is built ---------------------------------------------------


@pytest.mark.skipif(not REAL_BINARY, reason=f"no real ASTRA-sim (${BINARY_ENV})")
def test_real_astra_sim_runs_the_trace(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    code, out, err = run(capsys, "simulate", trace, "--astra-sim", REAL_BINARY, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert len(data["astra_sim"]["ranks"]) == WORLD
    assert all(r["exposed_communication_s"] is not None for r in data["astra_sim"]["ranks"])
    assert 0.5 < data["iteration_time_s"]["ratio"] < 2
