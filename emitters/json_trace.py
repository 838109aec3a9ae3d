"""The ``json`` emitter: Chakra's feeder JSON, one file per rank.

Each rank file is ``{"global_metadata": {...}, "workload_graph": [node, ...]}`` with one node
object per line; the keys are those of :mod:`stg.trace.json_trace`. The metadata holds the
attributes of the ``chakra-v0.0.4`` emitter's GlobalMetadata (``comm_group_file`` included).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stg.api import Emitter, Workload, generator_metadata, hookimpl, json_trace, write_rank_files

EXTENSION = ".json"


def write(workload: Workload, directory: Path, output_name: str) -> list[Path]:
    """Write one JSON file per rank and the comm-group file into ``directory``."""
    return write_rank_files(
        workload,
        directory,
        output_name,
        EXTENSION,
        json_trace.encode_node,
        lambda rank, records: json_trace.encode_document(
            generator_metadata(workload, rank, output_name), json_trace.SCHEMA_VERSION, records
        ),
    )


EMITTER = Emitter(
    name="json",
    aliases=("chakra-json",),
    extension=EXTENSION,
    write=write,
    description='Chakra feeder JSON ({"workload_graph": [...]}), lossless with stg\'s extra keys',
)


@hookimpl
def stg_register_emitters(register: Any) -> None:
    """Register the json emitter."""
    register(EMITTER)
