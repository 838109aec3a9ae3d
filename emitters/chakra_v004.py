"""The ``chakra-v0.0.4`` emitter: current Chakra protobuf traces, one file per rank.

Each rank file is a ``GlobalMetadata`` record (version ``"0.0.4"``, attrs ``generator`` =
``"stg"``, ``generator_version``, ``rank``, ``world_size``, ``comm_group_file`` (the name of the
comm-group file beside it, which readers prefer) and the workload's metadata) followed
by the rank's nodes in id order. The encoding is :mod:`stg.trace.chakra_v004`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stg.api import Emitter, Workload, chakra_v004, generator_metadata, hookimpl, write_rank_files

EXTENSION = ".et"


def write(workload: Workload, directory: Path, output_name: str) -> list[Path]:
    """Write one v0.0.4 file per rank and the comm-group file into ``directory``."""
    return write_rank_files(
        workload,
        directory,
        output_name,
        EXTENSION,
        chakra_v004.encode_node,
        lambda rank, records: (
            chakra_v004.encode_metadata(generator_metadata(workload, rank, output_name))
            + b"".join(records)
        ),
    )


EMITTER = Emitter(
    name="chakra-v0.0.4",
    aliases=("v0.0.4",),
    extension=EXTENSION,
    write=write,
    description="Chakra execution trace, schema v0.0.4 (what ASTRA-sim and mlc-chakra read)",
)


@hookimpl
def stg_register_emitters(register: Any) -> None:
    """Register the chakra-v0.0.4 emitter."""
    register(EMITTER)
