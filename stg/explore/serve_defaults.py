"""The defaults a simulated serving replica takes, each from its source (vLLM's engine
arguments and a measured tokenizer rate); shared by ``stg serve`` and capacity planning."""

from __future__ import annotations

DEFAULT_BUDGET = 2048
"""Tokens per iteration: vLLM's ``_DEFAULT_MAX_NUM_BATCHED_TOKENS`` (``vllm/config.py``,
v0.6: ``SchedulerConfig``), also the chunk budget of its V1 online server."""
GPU_MEMORY_UTILIZATION = 0.9
"""Share of GPU memory vLLM may use (``EngineArgs.gpu_memory_utilization`` default, 0.9)."""
TOKENIZE_TOKENS_PER_S = 100_000 / 0.220
"""Tokens a server's tokenizer handles per second: 100k tokens in 220 ms on one CPU core
(vLLM 0.19, measured by A. Luo, "CPU-GPU co-design for agentic inference on MI300X", 2026-05,
https://andyluo7.github.io/llm/amd/mi300x/vllm/lmcache/performance/2026/05/14/cpu-gpu-codesign-agentic-inference-mi300x/)."""

__all__ = ["DEFAULT_BUDGET", "GPU_MEMORY_UTILIZATION", "TOKENIZE_TOKENS_PER_S"]
