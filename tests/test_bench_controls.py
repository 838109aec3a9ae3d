"""PARAM's run controls on ``stg bench compute``: ``--resume-id``/``--stop-id``,
``--cuda-l2-cache``, ``--profile``, ``--ncu``/``--nsys`` with their batches.

The ncu and nsys runs are driven through a stand-in profiler (a script that records its
command line and runs the benchmark it was handed), so the batching, PARAM's command lines
and result lines are checked on the CPU; the real tools run where they are installed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_bench_compute import check_param_lines
from typer.testing import CliRunner

from stg.bench.config import expand
from stg.bench.results import read_results
from stg.bench.runner import select_cases
from stg.cli import app

GEN = "PyTorch:DefaultDataGenerator"


def _mm(n: int) -> dict[str, Any]:
    t = {"type": "tensor", "dtype": "float", "shape": [n, n]}
    return {"args": [t, t]}


CONFIG = {
    "torch.mm": {"input_data_generator": GEN, "config": [{"input": [_mm(4), _mm(8), _mm(16)]}]},
    "torch.add": {"input_data_generator": GEN, "config": [{"input": [_mm(4), _mm(8)]}]},
}
IDS = ["torch.mm|0|0|0", "torch.mm|0|0|1", "torch.mm|0|0|2", "torch.add|0|0|0", "torch.add|0|0|1"]


def _run(args: list[str], **env: str) -> Any:
    return CliRunner().invoke(app, args, env={"COLUMNS": "240", **env})


def _case_ids(path: Path) -> list[str]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return [f"{x['op_name']}|{x['id']}" for x in lines if "op_name" in x]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(CONFIG))
    return path


def test_resume_and_stop_follow_params_build_executor() -> None:
    """PARAM skips until the resume id (which runs) and stops at the stop id (which does
    not), over the whole run (BuildExecutor.get_transition_state)."""
    cases = expand(CONFIG).cases
    assert [c.run_id for c in cases] == IDS

    def ids(resume: str | None, stop: str | None) -> list[str]:
        return [c.run_id for c in select_cases(cases, resume, stop)]

    assert ids(None, None) == IDS
    assert ids("torch.mm|0|0|2", None) == IDS[2:]
    assert ids(None, "torch.add|0|0|0") == IDS[:3]
    assert ids("torch.mm|0|0|1", "torch.add|0|0|1") == IDS[1:4]
    assert ids("torch.add|0|0|0", "torch.add|0|0|0") == []  # PARAM checks the stop id last
    assert ids("torch.add|0|0|0", "torch.mm|0|0|0") == []  # a stop before the resume: none


def test_resume_and_stop_ids_on_the_command_line(config: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    result = _run(["bench", "compute", str(config), "-w", "0", "-i", "1", "-o", str(out),
                   "--resume-id", "torch.mm|0|0|1", "--stop_id", "torch.add|0|0|1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert _case_ids(out) == IDS[1:4]
    check_param_lines([json.loads(x) for x in out.read_text().splitlines()])


@pytest.mark.parametrize("option", ["--resume-id", "--stop-id"])
def test_an_id_that_names_no_case_is_one_line(config: Path, tmp_path: Path, option: str) -> None:
    out = tmp_path / "r.jsonl"
    result = _run(["bench", "compute", str(config), "-o", str(out), option, "0|0|1"])
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: {option} '0|0|1' names no case of the config; ids are <op>|<id>: "
        "torch.mm|0|0|0, torch.mm|0|0|1, torch.mm|0|0|2, ...\n"
    )
    assert not out.exists()


def test_cuda_l2_cache(config: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    bad = _run(["bench", "compute", str(config), "-o", str(out), "--cuda-l2-cache", "maybe"])
    assert bad.exit_code == 2
    assert bad.stderr == "error: --cuda-l2-cache maybe: allowed: on, off\n"
    cpu = _run(["bench", "compute", str(config), "-o", str(out), "--cuda-l2-cache", "off"])
    assert cpu.exit_code == 2
    assert cpu.stderr == (
        "error: --cuda-l2-cache off flushes a CUDA GPU's L2 cache between iterations; it does "
        "not apply to --device cpu (PARAM flushes on CUDA only)\n"
    )
    assert not out.exists()
    kept = _run(["bench", "compute", str(config), "-w", "0", "-i", "1", "-o", str(out),
                 "--stop-id", "torch.mm|0|0|1", "--cuda-l2-cache", "on"])  # fmt: skip
    assert kept.exit_code == 0, kept.output
    assert json.loads(out.read_text().splitlines()[0])["run_options"]["cuda_l2_cache"] is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_l2_cache_off_on_a_gpu(config: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    result = _run(["bench", "compute", str(config), "--device", "cuda", "-w", "1", "-i", "3",
                   "-o", str(out), "--cuda-l2-cache", "off"])  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["run_options"]["cuda_l2_cache"] is False
    check_param_lines(lines)


def test_profile_writes_a_chrome_trace_per_case(config: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    result = _run(["bench", "compute", str(config), "-w", "0", "-i", "2", "-o", str(out),
                   "--stop-id", "torch.mm|0|0|2", "--profile"])  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    check_param_lines([x for x in lines if "trace_file" not in x])
    traces = [x["trace_file"] for x in lines if "trace_file" in x]
    assert traces == [str(tmp_path / "r_trace_0.json"), str(tmp_path / "r_trace_1.json")]
    for index, trace in enumerate(traces):
        events = json.loads(Path(trace).read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert f"[param|{IDS[index]}]" in names and "aten::mm" in names
    assert len(read_results(out).cases) == 2


@pytest.mark.parametrize("tool", ["ncu", "nsys"])
def test_a_missing_profiler_is_one_line(config: Path, tmp_path: Path, tool: str) -> None:
    out = tmp_path / "r.jsonl"
    result = _run(["bench", "compute", str(config), "-o", str(out), "--device", "cuda",
                   f"--{tool}", f"--{tool}-bin", str(tmp_path / "absent")])  # fmt: skip
    assert result.exit_code == 2
    name = "Compute" if tool == "ncu" else "Systems"
    assert result.stderr == (
        f"error: --{tool}: {tmp_path / 'absent'} is not found (NSight {name} is not installed "
        f"here; give its path with --{tool}-bin)\n"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--ncu", "error: --ncu profiles CUDA kernels (NSight Compute); it does not apply to "
         "--device cpu\n"),
        ("--nvtx", "error: --nvtx marks CUDA work with NVTX ranges; it does not apply to "
         "--device cpu\n"),
    ],
)  # fmt: skip
def test_cuda_only_controls_on_a_cpu(
    config: Path, tmp_path: Path, option: str, message: str
) -> None:
    out = tmp_path / "r.jsonl"
    result = _run(["bench", "compute", str(config), "-o", str(out), option])
    assert result.exit_code == 2
    assert result.stderr == message
    assert not out.exists()


def test_params_ncu_command_line(tmp_path: Path) -> None:
    """PARAM's ncu options (build_executor._run_ncu), then the argument file's, then the
    child: one batch of stg bench compute on the GPU, with NVTX ranges."""
    from stg.bench.nsight import BatchRun, NsightTool, child_command

    tool = NsightTool("ncu", "/usr/bin/ncu", "--metrics sm__cycles_elapsed.avg", 5, 1)
    assert tool.command(tmp_path / "r_0_ncu.log") == [
        "/usr/bin/ncu", "--log-file", str(tmp_path / "r_0_ncu.log"), "--csv",
        "--app-replay-buffer", "file", "--nvtx", "--nvtx-include", "param_bench:measure",
        "--target-processes", "all", "--metrics", "sm__cycles_elapsed.avg",
    ]  # fmt: skip
    cases = expand(CONFIG).cases
    child = child_command(BatchRun("c.json", "cuda:0", True, 1, 1), tool, cases[1], cases[3])
    assert child[3:] == [
        "bench", "compute", "c.json", "--device", "cuda", "--warmup", "5", "--iterations", "1",
        "--resume-id", "torch.mm|0|0|1", "--nvtx", "--stop-id", "torch.add|0|0|0", "--backward",
        "--threads", "1",
    ]  # fmt: skip


STAND_IN = """#!{python}
import json, os, subprocess, sys
argv = sys.argv[1:]
child = argv.index({python!r})
with open({log!r}, "a") as log:
    log.write(json.dumps({{"tool": argv[:child], "child": argv[child:],
                           "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}}) + "\\n")
sys.exit(subprocess.run(argv[child:]).returncode)
"""


def test_nsys_batches_and_params_lines(config: Path, tmp_path: Path) -> None:
    """The whole --nsys run on the CPU, through a stand-in nsys that records its command
    line and runs the child it was given."""
    tool = "nsys"
    log = tmp_path / "calls.jsonl"
    binary = tmp_path / tool
    binary.write_text(STAND_IN.format(python=sys.executable, log=str(log)))
    binary.chmod(0o755)
    args_file = tmp_path / "args.txt"
    args_file.write_text("--metrics sm__cycles_elapsed.avg\n")
    out = tmp_path / "r.jsonl"
    result = _run(["bench", "compute", str(config), "-w", "0", "-i", "1", "-o", str(out),
                   "--resume-id", "torch.mm|0|0|1", f"--{tool}", f"--{tool}-bin", str(binary),
                   f"--{tool}-args-file", str(args_file), f"--{tool}-warmup", "0",
                   f"--{tool}-iteration", "2", "--run-batch-size", "1",
                   "--batch-cuda-device", "3"])  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    check_param_lines([x for x in lines if f"{tool}_file" not in x])
    batches = [x for x in lines if f"{tool}_file" in x]
    # one case per batch, from torch.mm|0|0|1 on
    assert [(b["start_run_id"], b["end_run_id"]) for b in batches] == [
        ("0|0|1", "0|0|1"),
        ("0|0|2", "0|0|2"),
        ("0|0|0", "0|0|0"),
        ("0|0|1", "0|0|1"),
    ]
    assert [b["config"]["op_name"] for b in batches] == ["torch.mm"] * 2 + ["torch.add"] * 2
    assert {b["config"]["run_options"]["iteration"] for b in batches} == {2}
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(calls) == 4 and {c["visible"] for c in calls} == {"3"}
    first = calls[0]
    output = str(tmp_path / "r_0_nsys.nsys-rep")
    assert first["tool"] == ["profile", "-t", "cuda,nvtx", "-o", output,
                             "--metrics", "sm__cycles_elapsed.avg"]  # fmt: skip
    child = first["child"]
    assert child[child.index("--resume-id") + 1] == "torch.mm|0|0|1"
    assert child[child.index("--stop-id") + 1] == "torch.mm|0|0|2"
    assert child[child.index("--iterations") + 1] == "2"
    assert "--nvtx" not in child  # NVTX ranges mark CUDA work; a CPU run has none
    assert "--stop-id" not in calls[-1]["child"]  # the last batch runs to the end
    assert batches[0][f"{tool}_cmd_str"].startswith(str(binary))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
