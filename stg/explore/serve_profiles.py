"""Engine profiles for ``stg serve``: the CPU costs and output behaviour of a serving engine
that its GPU kernels do not show, each constant from a named measurement.

A profile fills what ``stg serve`` would otherwise leave at zero: the time the GPU waits for
the engine's CPU at each scheduler call (scheduling, preparing the inputs, copying the sampled
tokens back and turning them into outputs), whether a multi-step round streams its tokens
step by step or at its end, and whether the engine overlaps that CPU work with the next
iteration (no GPU idle time, but an iteration's outputs reach the client one iteration
later). Its ``--num-scheduler-steps`` is the engine's own setting and
is given apart from the profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from stg.errors import UserError


@dataclass(frozen=True)
class EngineProfile:
    """A serving engine's costs outside the model's kernels."""

    name: str
    scheduler_overhead_s: float
    """GPU idle time per scheduler call (once per multi-step round)"""
    stream_round_end: bool
    """a multi-step round's tokens reach the client at the round's end"""
    output_lag: bool
    """overlap scheduling: outputs processed while the next iteration runs"""
    source: str


PROFILES: dict[str, EngineProfile] = {
    "none": EngineProfile(
        name="none",
        scheduler_overhead_s=0.0,
        stream_round_end=False,
        output_lag=False,
        source="no engine cost: iterations back to back, every token streamed when sampled",
    ),
    "vllm-0.6": EngineProfile(
        name="vllm-0.6",
        # 4 ms of GPU bubble per decode step, incurred once per scheduler call with
        # multi-step scheduling: Nsight trace of Llama 3 8B on one H100, vLLM main of July 2024
        # (the base of v0.6's multi-step), "[RFC]: Multi-Step Scheduling",
        # https://github.com/vllm-project/vllm/issues/6854 ("Each highlighted redbox is about
        # 4ms of GPU bubble ... With multi-step-8, the 4ms only needs to be incurred once for
        # every 8 decode")
        scheduler_overhead_s=4e-3,
        # v0.6.0 returns a multi-step round's outputs after its last step; the later
        # SchedulerConfig.multi_step_stream_outputs (default True) streams them per step
        # ("If False, then multi-step will stream outputs at the end of all steps")
        stream_round_end=True,
        # the async output processor combined with multi-step: "run sampler pythonization +
        # process_model_outputs of the previous step concurrently with the GPU forward pass"
        # (https://github.com/vllm-project/vllm/pull/7921), extended to "the last step of
        # decode ... and also on the previous prompt executions"
        # (https://github.com/vllm-project/vllm/pull/8050); both merged for the v0.6 line
        output_lag=True,
        source="vLLM v0.6 (V0 engine): 4 ms GPU bubble per scheduler call (vllm#6854), "
        "multi-step rounds streamed at their end, outputs processed during the next "
        "execution (vllm#7921, #8050)",
    ),
    "sglang": EngineProfile(
        name="sglang",
        # SGLang v0.4's overlap scheduler runs one batch ahead: "there are 5 consecutive
        # decoding batches, and you can see there is no single idle time on the GPU" (Nsight,
        # "SGLang v0.4: Zero-Overhead Batch Scheduler ...", LMSYS blog, 2024-12-04,
        # https://lmsys.org/blog/2024-12-04-sglang-v0-4/#zero-overhead-batch-scheduler); the
        # CPU handles an iteration's results while the next one runs
        scheduler_overhead_s=0.0,
        stream_round_end=False,
        output_lag=True,
        source="SGLang v0.4 overlap scheduler: no GPU idle time (Nsight, LMSYS blog "
        "2024-12-04), outputs one iteration late",
    ),
    "trtllm": EngineProfile(
        name="trtllm",
        # TensorRT-LLM's PyTorch executor, overlap scheduler enabled by default: "At step n,
        # the system launches GPU computation for step n+1 without waiting for CPU tasks ...
        # from step n to complete" (docs/source/features/overlap-scheduler.md,
        # https://nvidia.github.io/TensorRT-LLM/latest/features/overlap-scheduler.html)
        scheduler_overhead_s=0.0,
        stream_round_end=False,
        output_lag=True,
        source="TensorRT-LLM PyTorch executor overlap scheduler (default): CPU work of step "
        "n beside step n+1, outputs one iteration late",
    ),
}


def engine_profile(name: str) -> EngineProfile:
    """The profile called ``name``; one error line naming the allowed ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise UserError(
            f"--engine-profile {name!r}: allowed values are {', '.join(PROFILES)}"
        ) from None


__all__ = ["PROFILES", "EngineProfile", "engine_profile"]
