"""The ``chakra-v0.0.1`` emitter: the legacy proto2 Chakra schema, one file per rank.

No GlobalMetadata: every record is a flat v0.0.1 ``Node``. What the schema cannot hold is
lost, and what it cannot express is refused; see :mod:`stg.trace.chakra_v001`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stg.api import Emitter, Workload, chakra_v001, hookimpl, write_rank_files

EXTENSION = ".et"


def write(workload: Workload, directory: Path, output_name: str) -> list[Path]:
    """Write one v0.0.1 file per rank and the comm-group file into ``directory``."""
    return write_rank_files(
        workload,
        directory,
        output_name,
        EXTENSION,
        chakra_v001.encode_node,
        lambda _rank, records: b"".join(records),
    )


EMITTER = Emitter(
    name="chakra-v0.0.1",
    aliases=("v0.0.1",),
    extension=EXTENSION,
    write=write,
    description="legacy Chakra execution trace, schema v0.0.1 (proto2; lossy, see docs)",
)


@hookimpl
def stg_register_emitters(register: Any) -> None:
    """Register the chakra-v0.0.1 emitter."""
    register(EMITTER)
