"""The ranks of a trace on disk, summarised for prediction without holding every node.

:func:`read_ranks` reads every rank file once through the shared decoder
(:func:`stg.trace.decode.comm_summary`, spread over ``jobs`` processes) and keeps per rank
only its *fingerprint* (a hash of its node sequence less the values of peer and communicator
ids), the communicator of each collective and the peer of each send and receive, in file
order. Without the compiled decoder (``STG_DECODER=python``, or no build) the reference reader
summarises each rank from its decoded nodes instead (:func:`reference_summary`), so that
prediction groups ranks, and reports, the same either way. Ranks with equal fingerprints form a
*class*: they run the same nodes and differ only
in whom they talk to, as the ranks of one rank class of a generated workload do.
:class:`TraceRanks` also reads any rank's whole nodes on demand (it is a mapping from rank to
its nodes), so the time predictor replays one representative per class and decodes no other
rank (:func:`stg.perf.replay.problem_from_trace`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from stg.core.workload import Node, NodeType
from stg.errors import TraceError
from stg.trace.parallel import file_sizes, map_ranks


@dataclass(frozen=True)
class RankSummary:
    """What prediction needs of one rank file before choosing the ranks to replay."""

    nodes: int
    fingerprint: bytes
    colls: list[int]
    """the communicator of each collective, in file order"""
    sends: list[int]
    """the destination of each send, in file order"""
    recvs: list[int]
    """the source of each receive, in file order"""


class TraceRanks(Mapping[int, list[Node]]):
    """The rank files of a trace: a mapping from rank to its nodes (decoded on access, never
    kept), with per-rank summaries when every rank file could be summarised (``fast``)."""

    def __init__(self, files: Sequence[Path], summaries: Sequence[RankSummary | None]) -> None:
        self.files = list(files)
        self.world_size = len(self.files)
        self._summaries = list(summaries)
        self.fast = bool(self._summaries) and all(s is not None for s in self._summaries)
        self.classes: list[int] = []
        if self.fast:
            index: dict[bytes, int] = {}
            self.classes = [
                index.setdefault(s.fingerprint, len(index))  # type: ignore[union-attr]
                for s in self._summaries
            ]

    def summary(self, rank: int) -> RankSummary:
        summary = self._summaries[rank]
        if summary is None:
            raise TraceError(f"{self.files[rank]}: no summary (read it with the reference)")
        return summary

    def colls(self, rank: int) -> list[int]:
        return self.summary(rank).colls

    def sends(self, rank: int) -> list[int]:
        return self.summary(rank).sends

    def recvs(self, rank: int) -> list[int]:
        return self.summary(rank).recvs

    def nodes(self, rank: int) -> list[Node]:
        """The nodes of ``rank`` in file order (decoded now)."""
        from stg.trace.reader import iter_nodes

        return list(iter_nodes(self.files[rank]))

    def __getitem__(self, rank: int) -> list[Node]:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise KeyError(rank)
        return self.nodes(rank)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.world_size))

    def __len__(self) -> int:
        return self.world_size

    def all_nodes(self) -> dict[int, list[Node]]:
        """Every rank's nodes (the reference path: all of them in memory)."""
        return {rank: self.nodes(rank) for rank in range(self.world_size)}


def _summarize(path: Path) -> RankSummary | None:
    from stg.trace import decode
    from stg.trace.reader import detect_format

    try:
        fmt = detect_format(path)
    except (TraceError, OSError, EOFError):
        return None
    out = decode.comm_summary(path, fmt)
    if out is None or out["problem"]:
        return None
    return RankSummary(out["nodes"], out["fingerprint"], out["colls"], out["sends"], out["recvs"])


PEER_FIELDS = frozenset({"comm_group", "comm_src", "comm_dst"})
"""The fields a fingerprint leaves out: whom a node talks to (the compiled decoder leaves out
the values of ``pg_name``, ``comm_src`` and ``comm_dst``, the same three)."""
_HASHED_FIELDS = tuple(f.name for f in fields(Node) if f.name not in PEER_FIELDS | {"attrs"})


def reference_summary(path: Path) -> RankSummary | None:
    """:class:`RankSummary` of one rank file from the reference reader's nodes: the
    fingerprint hashes each node's fields but its peers and communicator (attributes in file
    order), so ranks share a class exactly when their decoded nodes are equal up to those. None
    for a file the reference cannot read, or with a collective lacking its communicator or type
    or a send or receive lacking its peer (as the compiled summary)."""
    from stg.trace.reader import iter_nodes

    digest = hashlib.blake2b(digest_size=16)
    colls: list[int] = []
    sends: list[int] = []
    recvs: list[int] = []
    count = 0
    try:
        for node in iter_nodes(path):
            count += 1
            if node.type is NodeType.COMM_COLL:
                if node.comm_group is None or node.comm_type is None:
                    return None
                colls.append(node.comm_group)
            elif node.type is NodeType.COMM_SEND:
                if node.comm_dst is None:
                    return None
                sends.append(node.comm_dst)
            elif node.type is NodeType.COMM_RECV:
                if node.comm_src is None:
                    return None
                recvs.append(node.comm_src)
            values = [getattr(node, name) for name in _HASHED_FIELDS]
            digest.update(repr((values, tuple(node.attrs.items()))).encode())
    except (TraceError, OSError, EOFError, ValueError):
        return None
    if count == 0:
        return None
    return RankSummary(count, digest.digest(), colls, sends, recvs)


def read_ranks(files: Sequence[Path], jobs: int | None = None) -> TraceRanks:
    """Summarise every rank file (``files[rank]``) with up to ``jobs`` processes (None or 0:
    every core; through the reference reader where the compiled decoder is off). A rank file
    that the fast decoder hands back, or that has a collective
    without communicator or a send or receive without peer, leaves the trace without
    summaries (``fast`` False): prediction then reads every rank, and reports what is wrong
    as before."""
    from stg.trace import decode

    summarize = _summarize if decode.enabled() else reference_summary
    summaries: list[Any] = []
    for summary in map_ranks(summarize, list(files), jobs, sizes=file_sizes(files)):
        summaries.append(summary)
    return TraceRanks(files, summaries)
