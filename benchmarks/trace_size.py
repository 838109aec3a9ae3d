"""Bytes per node and generation time of `stg generate` in the v0.0.4 and json formats.

Run: python benchmarks/trace_size.py [--only NAME] [--repeat N]
Each case runs `stg generate --json` in this process (after one warm-up run, so imports and
lazy loading do not count) into a temporary directory, ``--repeat`` times; it reports the
least CPU time of this process (steadier than wall time on a shared machine; generation runs
on one core) and the bytes written divided by the nodes of all ranks (the comm-group file
and each rank file's GlobalMetadata included, as a user's disk sees them).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time

from stg.cli import main

CASES: dict[str, list[str]] = {
    "gpt 8 layers dp2 tp2 pp2, 8 micro-batches": [
        "--model",
        "gpt",
        "--num_stacks",
        "8",
        "--dp",
        "2",
        "--tp",
        "2",
        "--pp",
        "2",
        "--batch",
        "16",
        "--micro_batch",
        "2",
    ],
    "llama3-8b, 4 layers, dp2 tp2 pp2, 4 micro-batches": [
        "--model",
        "llama3-8b",
        "--num_stacks",
        "4",
        "--dp",
        "2",
        "--tp",
        "2",
        "--pp",
        "2",
        "--batch",
        "8",
        "--micro_batch",
        "2",
    ],
    "llama3-8b fp8, 4 layers, dp2 tp2 pp2, 4 micro-batches": [
        "--model",
        "llama3-8b",
        "--num_stacks",
        "4",
        "--dtype",
        "fp8",
        "--dp",
        "2",
        "--tp",
        "2",
        "--pp",
        "2",
        "--batch",
        "8",
        "--micro_batch",
        "2",
    ],
}
FORMATS = ("chakra-v0.0.4", "json")


def generate(args: list[str], fmt: str, directory: str) -> dict:
    """Run ``stg generate --json`` in this process; its summary."""
    out = io.StringIO()
    argv = ["generate", *args, "--format", fmt, "--output_dir", directory, "--json"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit as exc:
            if exc.code:
                raise RuntimeError(f"stg {' '.join(argv)} failed ({exc.code})") from None
    return json.loads(out.getvalue())


def measure(args: list[str], fmt: str, repeat: int) -> tuple[float, float, int]:
    """(bytes per node, least CPU seconds, nodes) of one case in one format."""
    best = float("inf")
    summary: dict = {}
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as directory:
            start = time.process_time()
            summary = generate(args, fmt, directory)
            best = min(best, time.process_time() - start)
    nodes = sum(summary["nodes"].values())
    return summary["bytes_written"] / nodes, best, nodes


def main_(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--repeat", type=int, default=5)
    ns = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:  # warm-up: imports, plugins
        generate(CASES[next(iter(CASES))], FORMATS[0], directory)
    for name, args in CASES.items():
        if ns.only and ns.only not in name:
            continue
        for fmt in FORMATS:
            per_node, seconds, nodes = measure(args, fmt, ns.repeat)
            cpu = f"{seconds * 1e3:.0f} ms CPU"
            print(f"{name} | {fmt}: {nodes} nodes, {per_node:.1f} B/node, {cpu}")
            sys.stdout.flush()


if __name__ == "__main__":
    main_()
