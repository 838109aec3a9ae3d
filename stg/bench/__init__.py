"""``stg bench``: measure a device with PARAM-compatible benchmarks and calibrate the predictors.

PARAM (facebookresearch/param, ``train/compute/python`` and ``train/comms/pt``) describes
operators and their inputs in JSON and times them on a device; this package reads the same
configs and writes the same JSON-lines results, so the two tools read each other's files.

- :mod:`stg.bench.config`: PARAM's compute-benchmark config format: data specs, the
  ``__range__`` and ``__copy__`` macros (as PARAM's RangeConfigIterator expands them), and
  the cases of a config with stable run ids. Pure Python.
- :mod:`stg.bench.ops`: the built-in operators (registered through the
  ``stg_register_bench_ops`` hook, like any plugin's) and the analytic FLOPs, bytes and kernel
  shapes of a case. Pure Python.
- :mod:`stg.bench.runner`: runs the cases with PyTorch (CUDA events on a GPU,
  ``perf_counter`` on a CPU) and writes PARAM's result lines, plus FLOPs, bytes, achieved
  TFLOP/s and GB/s, median and IQR.
- :mod:`stg.bench.et_replay`: PARAM's et_replay: the distinct operators of a PyTorch
  execution trace as a PARAM config of ``aten::`` operators with the recorded shapes.
- :mod:`stg.bench.nsight`: PARAM's ``--ncu``/``--nsys``: the measured cases again, in
  batches, under NSight Compute or NSight Systems.
- :mod:`stg.bench.results`: reading result files (stg's and PARAM's own), statistics.
- :mod:`stg.bench.calibrate`: results -> a calibration table
  (:class:`stg.perf.calibration.Calibration`, which the time predictor consults).
- :mod:`stg.bench.model`: the PARAM config of exactly the kernels of a stg workload.
- :mod:`stg.bench.comms`: collectives over N local processes (gloo on CPU, NCCL on GPUs), the
  size / time / algBW / busBW table of nccl-tests, and a fitted network section.
- :mod:`stg.bench.plot`: roofline and bus-bandwidth plots (matplotlib).

PyTorch and matplotlib are optional (the ``bench`` extra); only running a benchmark or a plot
imports them, and :func:`require` names the extra when they are missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from stg.errors import UserError

EXTRA_HINT = "pip install 'symbolic-tensor-graph[bench]'"
"""How to install what ``stg bench`` needs (pyproject.toml's optional dependencies)."""


class MissingDependencyError(UserError):
    """An optional dependency of ``stg bench`` is not installed."""


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` (``torch``, ``matplotlib``) or raise one line naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(
            f"{what} needs {module}, which is not installed: {EXTRA_HINT}"
        ) from None


def require_cuda(what: str) -> ModuleType:
    """Import torch and check that it sees a CUDA GPU, or raise one line saying which is
    missing (a GPU-only measurement script)."""
    torch = require("torch", what)
    if not torch.cuda.is_available():
        raise MissingDependencyError(f"{what} needs a CUDA GPU; none is visible")
    return torch


__all__ = ["EXTRA_HINT", "MissingDependencyError", "require", "require_cuda"]
