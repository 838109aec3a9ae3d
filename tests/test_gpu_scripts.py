"""The GPU-only measurement scripts in benchmarks/ refuse a machine without a GPU in one line
(exit 2, nothing written): stg.bench.require_cuda."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = [
    "eager_step.py",
    "measure_expert_streams.py",
    "measure_float8_linear.py",
    "measure_gemm_graph.py",
    "measure_kernels.py",
    "profile_eager_step.py",
    "profile_moe_layer.py",
    "measure_torchtitan_ops.py",
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_without_a_gpu_each_script_says_so_in_one_line(
    script: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(script[:-3], BENCHMARKS / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [script, "--out", str(out)])
    assert module.main() == 2
    assert capsys.readouterr().err == f"error: {script} needs a CUDA GPU; none is visible\n"
    assert not out.exists()
