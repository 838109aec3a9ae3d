"""``stg serve``: simulate an inference cluster request by request.

A command of its own rather than ``stg predict --requests``: its inputs (a request stream, a
scheduler, a cache, replicas and routing, SLOs) and its outputs (latency percentiles over
requests, goodput, a per-request table) share nothing with a step's report but the model
options, and ``predict``'s step options (``--phase``, ``--batch``, ``--context``) would mean
nothing here.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer

from stg.cli import err_console, get_registry
from stg.cli._shared import check_writable_file, progress_bar
from stg.core.quantities import parse_duration
from stg.errors import UserError, write_replacing
from stg.explore.serve_defaults import (
    DEFAULT_BUDGET,
    GPU_MEMORY_UTILIZATION,
    TOKENIZE_TOKENS_PER_S,
)

app = typer.Typer(add_completion=False)


def _replica(
    model: str,
    tp: int,
    pp: int,
    dtype: str,
    kv_dtype: str | None,
    num_stacks: int | None,
    causal: bool,
) -> Any:
    """The serving options of one replica (a preset's dimensions resolved)."""
    from stg.core.options import GenerateOptions, resolve_model

    values: dict[str, Any] = {
        "model": model,
        "tp": tp,
        "pp": pp,
        "dtype": dtype,
        "causal": causal,
    }
    if kv_dtype is not None:
        values["kv_dtype"] = kv_dtype
    if num_stacks is not None:
        values["num_stacks"] = num_stacks
    resolved, _ = resolve_model(values, get_registry())
    return GenerateOptions(**{**resolved, "phase": "decode", "batch": 1, "steps": 1})


def _write_table(path: str, columns: dict[str, Any]) -> None:
    target = Path(path)
    if target.suffix == ".parquet":
        from stg.explore.sweep import need

        pa = need("pyarrow", "the Parquet table")
        pq = need("pyarrow.parquet", "the Parquet table")
        table = pa.table({k: v for k, v in columns.items()})
        write_replacing(target, lambda tmp: pq.write_table(table, str(tmp)))
    elif target.suffix == ".csv":
        import csv
        import io

        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        names = list(columns)
        writer.writerow(names)
        for row in zip(*(columns[n].tolist() for n in names), strict=True):
            writer.writerow([_cell(v) for v in row])
        write_replacing(target, lambda tmp: tmp.write_text(buffer.getvalue(), encoding="utf-8"))
    else:
        raise UserError(f"{path}: a table is written as .parquet or .csv")


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)
    return value


def _replicas(report: dict[str, Any]) -> str:
    if report["prefill_replicas"]:
        return f"{report['prefill_replicas']} prefill + {report['replicas']} decode replica(s)"
    return f"{report['replicas']} replica(s)"


def _stages(report: dict[str, Any]) -> str:
    pp, ep = report["pp"], report["ep"]
    experts = f", ep {ep}" if ep > 1 else ""
    if ep > 1 and report["ep_layout"] == "multiply":
        experts += " data-parallel attention"
    engines = report["virtual_engines"] // report["replicas"]
    return (
        experts
        + (f", pp {pp}" if pp > 1 else "")
        + (f": {report['virtual_engines']} virtual engines" if engines > 1 else "")
    )


def _within(goodput: dict[str, Any]) -> str:
    """The share of requests within the SLOs given (every request where none is)."""
    slos = [
        f"{name} {goodput[key]} s"
        for name, key in (("TTFT", "slo_ttft_s"), ("TPOT", "slo_tpot_s"))
        if goodput[key] is not None
    ]
    return f"{100 * goodput['fraction']:.1f}% within " + (
        ", ".join(slos) if slos else "the SLOs: none given"
    )


def _text(report: dict[str, Any]) -> str:
    def ms(block: dict[str, float]) -> str:
        return " ".join(f"{k} {1e3 * v:,.1f} ms" for k, v in block.items())

    t = report["throughput"]
    g = report["goodput"]
    law = report["littles_law"]
    lines = [
        f"{report['requests']:,} requests on {_replicas(report)} of "
        f"{report['model']} (tp {report['tp']}{_stages(report)}, {report['system']}), "
        f"{report['scheduler']} "
        f"scheduler, {report['routing']} routing, {report['simulated_s']:,.1f} s simulated",
        f"TTFT  {ms(report['ttft_s'])}",
        f"TPOT  {ms(report['tpot_s'])}",
        f"ITL   {ms(report['itl_s'])}",
        f"E2E   {ms(report['e2e_s'])}",
        f"throughput {t['requests_per_s']:,.2f} requests/s, {t['output_tokens_per_s']:,.0f} "
        f"output tokens/s, {t['prompt_tokens_per_s']:,.0f} prompt tokens/s",
        f"goodput {g['requests_per_s']:,.2f} requests/s ({_within(g)})",
        f"KV cache {report['kv_blocks_per_replica']:,} blocks of {report['block_size']} tokens "
        f"per replica: mean occupancy {100 * report['kv_occupancy']['mean']:.1f}%, max "
        f"{100 * report['kv_occupancy']['max']:.1f}%; {report['preemptions']:,} preemptions",
        f"Little's law: {law['mean_in_system']:.3f} requests in the system on average = "
        f"{law['arrival_rate_per_s']:.3f}/s x {law['mean_time_in_system_s']:.3f} s",
    ]
    return "\n".join(lines)


@app.command()
def serve(
    model: str = typer.Option(
        "llama3-8b", "--model", help="A model or preset (see stg plugins list)."
    ),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel GPUs per replica."),
    pp: int = typer.Option(
        1,
        "--pp",
        help="Pipeline stages per replica, run as vLLM V0 runs them: pp virtual engines, each "
        "with its own scheduler and 1/pp of the KV cache.",
    ),
    ep: int = typer.Option(
        1,
        "--ep",
        help="MoE models: split the experts over ep GPUs (see --ep_layout).",
    ),
    ep_layout: str = typer.Option(
        "fold",
        "--ep_layout",
        help="fold: the experts over ep of the replica's tp GPUs, each expert's FFN over "
        "tp/ep (vLLM's --enable-expert-parallel; ep divides tp). multiply: a replica of "
        "tp·ep GPUs, attention data-parallel over ep ranks of tp GPUs, each with its own "
        "scheduler and KV cache (vLLM's --data-parallel-size with expert parallelism).",
    ),
    dtype: str = typer.Option("bf16", "--dtype", help="Weights and compute dtype."),
    kv_dtype: str | None = typer.Option(
        None, "--kv_dtype", help="KV-cache dtype (default: --dtype)."
    ),
    num_stacks: int | None = typer.Option(
        None, "--num_stacks", help="Layers (default: the preset's)."
    ),
    causal: bool = typer.Option(True, "--causal/--no-causal", help="Causal attention masking."),
    system: str = typer.Option(
        "h100-80g", "--system", "-s", help="System preset or JSON file.", metavar="NAME|FILE"
    ),
    replicas: int = typer.Option(
        1, "--replicas", help="Model replicas (with --prefill-replicas: the decode replicas)."
    ),
    prefill_replicas: int = typer.Option(
        0,
        "--prefill-replicas",
        help="Disaggregated serving: this many prefill replicas beside --replicas decode "
        "replicas, the KV cache sent between them over the system's network.",
    ),
    routing: str = typer.Option(
        "round-robin", "--routing", help="round-robin, least-outstanding or kv-aware."
    ),
    scheduler: str = typer.Option(
        "sarathi",
        "--scheduler",
        help="sarathi (chunked prefill, decodes first), vllm (whole prompts first) or static.",
    ),
    max_num_seqs: int = typer.Option(
        256, "--max-num-seqs", help="Sequences a replica runs at once (vLLM's default 256)."
    ),
    max_num_batched_tokens: int | None = typer.Option(
        None,
        "--max-num-batched-tokens",
        help=f"Tokens per iteration (default {DEFAULT_BUDGET}; vllm: at least the longest one).",
    ),
    block_size: int = typer.Option(
        16, "--block-size", help="Tokens per KV-cache block (vLLM's default 16)."
    ),
    gpu_memory_utilization: float = typer.Option(
        GPU_MEMORY_UTILIZATION,
        "--gpu-memory-utilization",
        help="Share of GPU memory for weights, activations and the KV cache.",
    ),
    prefix_hit_rate: float = typer.Option(
        0.0, "--prefix-hit-rate", help="Share of each prompt found in the prefix cache, in [0, 1)."
    ),
    tokenize_rate: float = typer.Option(
        TOKENIZE_TOKENS_PER_S,
        "--tokenize-rate",
        help="Prompt tokens tokenized per second before a request reaches a replica.",
    ),
    iteration_overhead: str | None = typer.Option(
        None,
        "--iteration-overhead",
        help="Scheduler (CPU) time added to every scheduler call, e.g. 2ms (default: the "
        "--engine-profile's).",
    ),
    engine_profile: str = typer.Option(
        "none",
        "--engine-profile",
        help="The engine's CPU costs and streaming, each from a source: none, vllm-0.6, "
        "sglang or trtllm.",
    ),
    num_scheduler_steps: int = typer.Option(
        1,
        "--num-scheduler-steps",
        help="Decode steps per scheduler call (vLLM's multi-step scheduling; --scheduler vllm).",
    ),
    preemption: str = typer.Option(
        "recompute",
        "--preemption",
        help="recompute (the victim's cache dropped) or swap (copied to host memory and back).",
    ),
    swap_bandwidth: float | None = typer.Option(
        None,
        "--swap-bandwidth",
        help="GB/s one GPU copies to or from host memory (default: the system's host link one "
        "way: PCIe, or NVLink-C2C to the Grace on GB200/GB300 NVL72).",
    ),
    speculative: int = typer.Option(
        0, "--speculative", help="Speculative decoding: draft tokens verified per step (0: off)."
    ),
    acceptance: float = typer.Option(
        0.7, "--acceptance", help="Speculative decoding: chance the model accepts a draft token."
    ),
    draft: str | None = typer.Option(
        None,
        "--draft",
        help="Speculative decoding: the draft model (a preset, same --tp).",
    ),
    trace: str | None = typer.Option(
        None,
        "--trace",
        help="Requests from a CSV or JSON-lines file (arrival, prompt, output) instead of --rate.",
        metavar="FILE",
    ),
    rate: float = typer.Option(1.0, "--rate", help="Mean requests per second."),
    duration: float = typer.Option(60.0, "--duration", help="Seconds of arrivals."),
    arrival: str = typer.Option(
        "poisson", "--arrival", help="poisson, gamma (--cv) or bursty (--burst)."
    ),
    cv: float = typer.Option(1.0, "--cv", help="Coefficient of variation of gamma gaps."),
    burst: float = typer.Option(4.0, "--burst", help="Mean requests per burst (bursty)."),
    prompt: str = typer.Option(
        "fixed:1024",
        "--prompt",
        help="Prompt lengths: fixed:N, uniform:LO:HI, lognormal:MEAN:SIGMA or file:PATH[:FIELD].",
    ),
    output: str = typer.Option("fixed:256", "--output", help="Output lengths, as --prompt."),
    seed: int = typer.Option(0, "--seed", help="Seed of every random draw."),
    slo_ttft: str | None = typer.Option(
        None,
        "--slo-ttft",
        help="Goodput: limit on the time to first token, e.g. 2s.",
        metavar="TIME",
    ),
    slo_tpot: str | None = typer.Option(
        None,
        "--slo-tpot",
        help="Goodput: limit on the time per output token, e.g. 50ms.",
        metavar="TIME",
    ),
    requests_table: str | None = typer.Option(
        None,
        "--requests-table",
        help="Write one row per request to this .parquet (pyarrow) or .csv file.",
        metavar="FILE",
    ),
    timeline: str | None = typer.Option(
        None,
        "--timeline",
        help="Write KV occupancy, queues and preemptions over time to this .parquet or .csv file.",
        metavar="FILE",
    ),
    plot: str | None = typer.Option(
        None,
        "--plot",
        help="Write the latency CDFs and the KV occupancy over time to this .html file (plotly).",
        metavar="FILE",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Simulate an inference cluster request by request.

    TTFT, TPOT, inter-token and end-to-end latency percentiles, throughput, goodput under
    SLOs, KV-cache occupancy and preemptions of a request stream (docs/serving.md)."""
    from stg.explore.serve import EngineConfig, request_table, simulate, summary
    from stg.explore.serve import timeline as timeline_of
    from stg.explore.serve_cost import (
        expert_parallel,
        kv_transfer,
        pipeline_pricer,
        replica_blocks,
        replica_pricer,
    )
    from stg.explore.serve_profiles import engine_profile as engine_profile_of
    from stg.explore.serve_requests import generate, read_trace
    from stg.perf.system import HOST_LINK_BYTES_PER_S, load_system

    profile = engine_profile_of(engine_profile)
    if iteration_overhead is None:
        overhead = profile.scheduler_overhead_s
    elif iteration_overhead in ("0", "0s"):
        overhead = 0.0
    else:
        overhead = parse_duration(iteration_overhead, "--iteration-overhead")
    ttft = parse_duration(slo_ttft, "--slo-ttft", unit_required=True) if slo_ttft else None
    tpot = parse_duration(slo_tpot, "--slo-tpot", unit_required=True) if slo_tpot else None
    if plot is not None:
        if Path(plot).suffix != ".html":
            raise UserError(f"{plot}: --plot writes an .html file")
        from stg.explore.sweep import need

        need("plotly.graph_objects", "--plot")
    for path in (requests_table, timeline):
        if path is not None and Path(path).suffix not in (".parquet", ".csv"):
            raise UserError(f"{path}: a table is written as .parquet or .csv")
        if path is not None and path.endswith(".parquet"):
            from stg.explore.sweep import need

            need("pyarrow.parquet", "the Parquet table")
    outputs = {"--requests-table": requests_table, "--timeline": timeline, "--plot": plot}
    for flag, path in outputs.items():
        if path is not None:
            check_writable_file(flag, Path(path))
    if (
        requests_table is not None
        and timeline is not None
        and Path(requests_table).resolve() == Path(timeline).resolve()
    ):
        raise UserError(
            f"--requests-table {requests_table} --timeline {timeline}: both name the same "
            "file; give each its own"
        )
    if swap_bandwidth is not None and not (math.isfinite(swap_bandwidth) and swap_bandwidth > 0):
        raise UserError(f"--swap-bandwidth {swap_bandwidth:g}: must be a positive number (GB/s)")
    if draft is not None and not speculative:
        raise UserError(
            f"--draft {draft}: the draft model of speculative decoding; give --speculative N "
            "(draft tokens per step) with it"
        )
    config = EngineConfig(
        scheduler=scheduler,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=(
            DEFAULT_BUDGET if max_num_batched_tokens is None else max_num_batched_tokens
        ),
        block_size=block_size,
        replicas=replicas,
        routing=routing,
        prefix_hit_rate=prefix_hit_rate,
        tokenize_rate=tokenize_rate,
        iteration_overhead_s=overhead,
        prefill_replicas=prefill_replicas,
        preemption=preemption,
        swap_bandwidth=1.0,  # checked once the system is known
        num_scheduler_steps=num_scheduler_steps,
        stream_round_end=profile.stream_round_end,
        output_lag=profile.output_lag,
        speculative_tokens=speculative,
        acceptance_rate=acceptance,
        seed=seed,
    )
    config.check(with_blocks=False)
    if speculative and draft is None:
        raise UserError("--speculative needs a draft model: --draft NAME (e.g. llama3-8b)")
    if pp < 1:
        raise UserError(f"--pp {pp}: must be a positive integer")
    if pp > 1 and (speculative or prefill_replicas):
        raise UserError(
            f"--pp {pp}: a pipelined replica takes neither --speculative nor --prefill-replicas"
        )
    if ep > 1 and ep_layout == "multiply" and (speculative or prefill_replicas):
        raise UserError(
            f"--ep {ep} --ep_layout multiply: a replica of data-parallel attention ranks takes "
            "neither --speculative nor --prefill-replicas"
        )
    if trace is not None:
        stream = read_trace(trace)
    else:
        stream = generate(
            arrival=arrival,
            rate=rate,
            duration=duration,
            prompt=prompt,
            output=output,
            seed=seed,
            cv=cv,
            burst=burst,
        )
    budget = max_num_batched_tokens
    if budget is None:  # vLLM without chunked prefill: max(max_model_len, 2048)
        longest = int((stream.prompt + stream.output).max())
        budget = max(DEFAULT_BUDGET, longest) if scheduler == "vllm" else DEFAULT_BUDGET
    registry = get_registry()
    base = expert_parallel(
        _replica(model, tp, pp, dtype, kv_dtype, num_stacks, causal), ep, registry, ep_layout
    )
    system_ = load_system(system)
    pricer = pipeline_pricer(base, system_, registry)
    drafter = None
    if speculative:
        assert draft is not None
        drafter = replica_pricer(
            _replica(draft, tp, 1, dtype, kv_dtype, None, causal), system_, registry
        )
    blocks = replica_blocks(
        pricer,
        base,
        registry,
        tokens=budget,
        block_size=block_size,
        memory_fraction=gpu_memory_utilization,
        draft=drafter,
    )
    default_host = system_.host_link or HOST_LINK_BYTES_PER_S.get(system_.gpu.arch)
    host = swap_bandwidth * 1e9 if swap_bandwidth is not None else default_host
    if preemption == "swap" and not host:
        raise UserError(
            f"--preemption swap: no host link bandwidth known for {system_.name}; give "
            "--swap-bandwidth GB/s"
        )
    # vLLM V0 runs a pipeline of pp stages as pp virtual engines, each with its own
    # scheduler and 1/pp of the blocks (Scheduler: num_gpu_blocks //= pipeline_parallel_size);
    # data-parallel attention ranks (--ep_layout multiply) are engines of their own too
    engines = pp * pricer.attention_ranks
    config = replace(
        config,
        blocks=blocks // pp,
        replicas=replicas * engines,
        max_num_batched_tokens=budget,
        swap_bandwidth=host or 0.0,
    )
    with progress_bar(err_console()) as progress:
        sim = simulate(stream, pricer, config, progress, kv_transfer(pricer), drafter)
    report = {
        "model": base.model if model == base.model else model,
        "tp": tp,
        "ep": ep,
        "ep_layout": ep_layout,
        "system": system_.name,
        "gpus": tp * pp * pricer.attention_ranks * (replicas + prefill_replicas),
        "prefill_replicas": prefill_replicas,
        "max_num_batched_tokens": budget,
        "engine_profile": profile.name,
        "num_scheduler_steps": num_scheduler_steps,
        "iteration_overhead_s": overhead,
        **summary(sim, slo_ttft=ttft, slo_tpot=tpot),
        "replicas": replicas,
        "pp": pp,
        "virtual_engines": replicas * engines,
    }
    if requests_table is not None:
        _write_table(requests_table, request_table(sim))
    if timeline is not None:
        _write_table(timeline, timeline_of(sim))
    if plot is not None:
        from stg.explore.serve_plots import plot_serving

        plot_serving(sim, plot)
    if as_json:
        typer.echo(json.dumps(_finite(report), indent=2, sort_keys=True))
    else:
        typer.echo(_text(report))


def _finite(value: Any) -> Any:
    """``value`` with NaN (a latency no request has) as null, for strict JSON."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
