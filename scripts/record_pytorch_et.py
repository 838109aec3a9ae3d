"""Record the PyTorch execution traces that ship in tests/data/pytorch_et (on the CPU).

- ``mlp_et.json`` / ``mlp_kineto.json``: one training step (forward, MSE loss, backward, SGD)
  of a two-layer MLP, ``Linear(H, H) -> ReLU -> Linear(H, H)`` on a batch of B rows, fp32,
  one CPU thread (as PARAM and ``stg bench`` run), recorded by PyTorch's
  ExecutionTraceObserver (the host execution trace) and torch.profiler (its Kineto trace)
  for the step after one warm-up step.
- ``ddp_et.<rank>.json`` / ``ddp_kineto.<rank>.json``: the same step of a smaller MLP under
  DistributedDataParallel over two gloo processes (its gradient all-reduce), one file per
  rank.

Usage: ``python scripts/record_pytorch_et.py [OUT_DIR] [--hidden H] [--batch B]``; the shipped
files were recorded with the defaults. ``benchmarks/et_replay_accuracy.py`` records a fresh
pair the same way (:func:`record_mlp`) to compare with a replay on the same machine.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile, schedule

HIDDEN = 1024
BATCH = 256
DDP_HIDDEN = 64
DDP_BATCH = 16


def _mlp(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden)
    )


def _record(model: torch.nn.Module, batch: int, hidden: int, et: Path, kineto: Path) -> None:
    """One warm-up step, then one recorded step: its host ET and its Kineto trace."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)
    data = torch.randn(batch, hidden)
    target = torch.randn(batch, hidden)
    observer = ExecutionTraceObserver().register_callback(str(et))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()
        optimizer.step()

    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
        execution_trace_observer=observer,
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(kineto)),
    ) as prof:
        for _ in range(2):
            step()
            prof.step()


def record_mlp(out: Path, hidden: int = HIDDEN, batch: int = BATCH, name: str = "mlp") -> None:
    """``<name>_et.json`` and ``<name>_kineto.json`` of the two-layer MLP in ``out``."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    _record(_mlp(hidden), batch, hidden, out / f"{name}_et.json", out / f"{name}_kineto.json")


def _ddp_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(_mlp(DDP_HIDDEN))
    where = Path(out)
    _record(
        model,
        DDP_BATCH,
        DDP_HIDDEN,
        where / f"ddp_et.{rank}.json",
        where / f"ddp_kineto.{rank}.json",
    )
    dist.destroy_process_group()


def record_ddp(out: Path, world: int = 2) -> None:
    """``ddp_et.<rank>.json`` and ``ddp_kineto.<rank>.json`` from ``world`` gloo processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_rank, args=(world, port, str(out)), nprocs=world, join=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="tests/data/pytorch_et")
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--batch", type=int, default=BATCH)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record_mlp(out, args.hidden, args.batch)
    record_ddp(out)
    for path in sorted(out.iterdir()):
        print(f"{path} {path.stat().st_size} B")


if __name__ == "__main__":
    main()
