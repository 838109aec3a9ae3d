"""CPU time of ``stg serve``'s simulation: one simulated hour at 20 requests/s on 8 replicas.

Run: ``python benchmarks/bench_serve.py [--rate 20] [--duration 3600] [--replicas 8]
[--scheduler sarathi] [--routing least-outstanding] [--model llama3-8b] [--tp 1]``.
Prints the CPU seconds of pricing the replica (reading its reference workloads once) and of
the simulation (the target: under 30 s on one core), the requests, iterations and distinct
iterations priced, and the peak RSS. Prompts lognormal of mean 1024 tokens, outputs of mean
256 (sigma 0.8), Poisson arrivals, seed 0.
"""

from __future__ import annotations

import argparse
import resource
import time

from stg.core.options import GenerateOptions, resolve_model
from stg.explore.serve import EngineConfig, simulate, summary
from stg.explore.serve_cost import replica_blocks, replica_pricer
from stg.explore.serve_requests import generate
from stg.perf.system import load_system
from stg.testing import make_registry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--scheduler", default="sarathi")
    parser.add_argument("--routing", default="least-outstanding")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--system", default="h100-80g")
    args = parser.parse_args()

    registry = make_registry()
    values, _ = resolve_model({"model": args.model, "tp": args.tp, "causal": True}, registry)
    base = GenerateOptions(**{**values, "phase": "decode", "batch": 1})
    system = load_system(args.system)
    start = time.process_time()
    pricer = replica_pricer(base, system, registry)
    blocks = replica_blocks(pricer, base, registry, tokens=2048, block_size=16, memory_fraction=0.9)
    priced = time.process_time() - start
    stream = generate(
        arrival="poisson",
        rate=args.rate,
        duration=args.duration,
        prompt="lognormal:1024:0.8",
        output="lognormal:256:0.8",
        seed=0,
    )
    config = EngineConfig(
        scheduler=args.scheduler, routing=args.routing, replicas=args.replicas, blocks=blocks
    )
    start = time.process_time()
    sim = simulate(stream, pricer, config)
    simulated = time.process_time() - start
    report = summary(sim)
    distinct = len(pricer._body) + len(pricer._head) + len(pricer._attention)
    print(f"replica priced in {priced:.2f} CPU s ({args.model}, tp {args.tp}, {system.name})")
    print(
        f"simulation: {simulated:.2f} CPU s for {report['requests']:,} requests, "
        f"{report['iterations']:,} iterations, {distinct:,} distinct kernel groups priced "
        f"({args.duration:,.0f} s at {args.rate} requests/s on {args.replicas} replicas)"
    )
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
