"""Helpers for tests that sum and check generated workloads (not a test module)."""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict, deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import NodeType, Workload
from stg.trace.writer import write_workload

GPT_GEMMS = {"q", "k", "v", "attn_out", "fc1", "fc2"}
LLAMA_GEMMS = {"q", "k", "v", "attn_out", "gate", "up", "down"}
ATTENTION = {"scores", "context"}
HEAD = {"logits"}
DEEPSEEK_UP_PROJ_OPS = {
    "q_norm", "all_gather_tp:q_norm", "q", "q_rope", "rope_q",
    "kv_norm", "rope_k", "all_gather_tp:kv_norm", "k", "v", "k_rope_expand",
}  # fmt: skip
"""What DeepSeek's mla_up_proj re-runs under tp 2 with sequence parallelism: the norms and RoPE
of the key on this rank's rows, the gathers of the normalised latents, the up-projections and
RoPE of the query, and the shared RoPE key's copy to every head (its gather is not: Megatron
gathers that key before its checkpoint, which keeps the gathered copy)."""


def generate_args(base: Mapping[str, object], **kw: object) -> list[str]:
    """``stg generate`` with the options ``base`` and ``kw`` (tuples comma-separated)."""
    args = ["generate"]
    for key, value in {**base, **kw}.items():
        text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        args += [f"--{key}", text]
    return args


def trace_digest(options: GenerateOptions, registry: Any, out: Path) -> str:
    """The SHA-256 of the Chakra v0.0.4 files of ``options``' workload, written to ``out``."""
    workload = build_workload(options, registry)
    write_workload(workload, registry.emitters.get("chakra-v0.0.4"), out, "w.%d.et")
    digest = hashlib.sha256()
    for path in sorted(out.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def op_root(name: str) -> str:
    """The forward op a node comes from: ``mb0/layer3/bwd/fc1.grad_w1`` -> ``fc1``; every
    precision cast -> ``cast``."""
    last = name.rsplit("/", 1)[-1]
    return "cast" if ".cast_" in last else last.split(".grad_", 1)[0]


def flops_by_root(workload: Workload) -> Counter[str]:
    """FLOPs summed over all ranks, by forward op name."""
    per_class: dict[int, Counter[str]] = {}
    for cls in workload.rank_classes:
        c: Counter[str] = Counter()
        for n in cls.nodes:
            if n.type is NodeType.COMP:
                c[op_root(n.name)] += n.num_ops
        per_class[cls.index] = c
    total: Counter[str] = Counter()
    for graph in workload.ranks:
        total.update(per_class[graph.rank_class.index])
    return total


def total_flops(workload: Workload) -> int:
    return sum(flops_by_root(workload).values())


def comm_bytes(workload: Workload, rank: int) -> Counter[tuple[str, tuple[str, ...]]]:
    """Bytes per (collective type, group axes) for one rank; sends as ("SEND", ())."""
    c: Counter[tuple[str, tuple[str, ...]]] = Counter()
    for n in workload.ranks[rank].rank_class.nodes:
        if n.type is NodeType.COMM_COLL:
            assert n.comm_type is not None
            c[(n.comm_type.name, n.group_axes)] += n.comm_size
        elif n.type is NodeType.COMM_SEND:
            c[("SEND", ())] += n.comm_size
        elif n.type is NodeType.COMM_RECV:
            c[("RECV", ())] += n.comm_size
    return c


def check_runs_to_completion(workload: Workload) -> int:
    """Execute every rank's graph together, as a simulator would: a node runs when its deps are
    done; a collective completes when every member has reached it (matched by issue order per
    group); a receive completes after its matching send. Returns the number of nodes run;
    raises AssertionError on a deadlock or a mismatch."""
    ranks = [list(g.nodes()) for g in workload.ranks]
    remaining = [dict() for _ in ranks]  # node id -> unmet dep count
    children: list[dict[int, list[int]]] = [defaultdict(list) for _ in ranks]
    ready: list[deque[int]] = [deque() for _ in ranks]
    for r, nodes in enumerate(ranks):
        for n in nodes:
            deps = set(n.data_deps) | set(n.ctrl_deps)
            remaining[r][n.id] = len(deps)
            for d in deps:
                children[r][d].append(n.id)
            if not deps:
                ready[r].append(n.id)
    by_id = [{n.id: n for n in nodes} for nodes in ranks]
    coll_waiting: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    coll_count: Counter[tuple[int, int]] = Counter()
    sends: dict[tuple[int, int, int, int], int] = Counter()
    recvs_waiting: list[tuple[int, int]] = []
    done = 0

    def finish(r: int, nid: int) -> None:
        nonlocal done
        done += 1
        for child in children[r][nid]:
            remaining[r][child] -= 1
            if remaining[r][child] == 0:
                ready[r].append(child)

    progress = True
    while progress:
        progress = False
        for r in range(len(ranks)):
            while ready[r]:
                nid = ready[r].popleft()
                n = by_id[r][nid]
                progress = True
                if n.type is NodeType.COMM_COLL:
                    gid = n.comm_group
                    members = workload.comm_groups[gid]
                    idx = coll_count[(r, gid)]
                    coll_count[(r, gid)] += 1
                    coll_waiting[(gid, idx)].append((r, nid))
                    entries = coll_waiting[(gid, idx)]
                    if len(entries) == len(members):
                        sig = {
                            (by_id[rr][ii].comm_type, by_id[rr][ii].comm_size) for rr, ii in entries
                        }
                        assert len(sig) == 1, f"collective mismatch in group {gid} #{idx}: {sig}"
                        for rr, ii in entries:
                            finish(rr, ii)
                elif n.type is NodeType.COMM_SEND:
                    sends[(n.comm_src, n.comm_dst, n.comm_tag, n.comm_size)] += 1
                    finish(r, nid)
                elif n.type is NodeType.COMM_RECV:
                    recvs_waiting.append((r, nid))
                else:
                    finish(r, nid)
        still = []
        for r, nid in recvs_waiting:
            n = by_id[r][nid]
            k = (n.comm_src, n.comm_dst, n.comm_tag, n.comm_size)
            if sends[k] > 0:
                sends[k] -= 1
                finish(r, nid)
                progress = True
            else:
                still.append((r, nid))
        recvs_waiting = still
    total = sum(len(nodes) for nodes in ranks)
    assert done == total, f"deadlock: {total - done} of {total} nodes never ran"
    return done
