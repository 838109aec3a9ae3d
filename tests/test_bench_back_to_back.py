"""stg.bench.runner.time_back_to_back, the event timing of the GPU measurement scripts in
benchmarks/, on a fake CUDA clock (no GPU needed): each call advances the clock by a fixed
kernel time, each event reads it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from stg.bench.runner import time_back_to_back


def fake_torch(kernel_ms: float) -> tuple[Any, list[int]]:
    """A torch whose CUDA events read a clock that each call of the timed function advances
    by ``kernel_ms``; and the list counting those calls."""
    clock = [0.0]
    calls: list[int] = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = 0.0

        def record(self) -> None:
            self.at = clock[0]

        def elapsed_time(self, end: Event) -> float:
            return end.at - self.at

    def fn() -> None:
        calls.append(1)
        clock[0] += kernel_ms

    torch = SimpleNamespace(cuda=SimpleNamespace(Event=Event, synchronize=lambda: None))
    torch.fn = fn
    return torch, calls


def test_reps_fill_the_minimum_event_time() -> None:
    torch, calls = fake_torch(0.3)
    times, reps = time_back_to_back(torch, torch.fn, warmup=2, iterations=5, min_event_ms=1.0)
    assert reps == 4  # ceil(1.0 / 0.3)
    assert len(times) == 7 and all(abs(t - 0.3) < 1e-12 for t in times)
    assert len(calls) == 2 + 7 * 4  # one untimed, one timed to choose reps, then the timings


def test_reps_are_capped_and_can_be_given() -> None:
    torch, _ = fake_torch(0.001)
    assert time_back_to_back(torch, torch.fn, warmup=0, iterations=1, min_event_ms=5.0)[1] == 50
    assert (
        time_back_to_back(torch, torch.fn, warmup=0, iterations=1, min_event_ms=5.0, max_reps=8)[1]
        == 8
    )
    torch, calls = fake_torch(2.0)
    times, reps = time_back_to_back(
        torch, torch.fn, warmup=1, iterations=2, min_event_ms=50.0, reps=3
    )
    assert reps == 3 and len(calls) == 9 and times == [2.0, 2.0, 2.0]
