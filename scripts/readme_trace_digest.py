"""Print a SHA-256 digest of the traces that the README's examples write.

Run it before and after a change that must not change generation (a refactor); the two
outputs must be identical. It calls the installed ``stg`` command, so it does not depend
on the package layout::

    python scripts/readme_trace_digest.py
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLES: dict[str, list[str]] = {
    "default": [],
    "quick-start 3d": [
        "--dp", "2", "--tp", "2", "--pp", "2", "--batch", "16", "--micro_batch", "4",
        "--tpsp", "false", "--num_stacks", "8",
    ],
    "tp8": ["--tp", "8", "--num_stacks", "8"],
    "v0.0.1": ["--tp", "2", "--num_stacks", "2", "--format", "chakra-v0.0.1"],
    "json": ["--tp", "2", "--num_stacks", "2", "--format", "json"],
    "moe fsdp": [
        "--model_type", "moe", "--dp", "2", "--ep", "2", "--num_stacks", "2",
        "--weight_sharded", "true", "--batch", "8", "--micro_batch", "4",
    ],
}


def digest(args: list[str]) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        subprocess.run(
            ["stg", "generate", *args, "--output_dir", str(out)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        sha = hashlib.sha256()
        for path in sorted(out.iterdir()):
            sha.update(path.name.encode() + b"\0" + path.read_bytes())
        return sha.hexdigest()


def main() -> int:
    for name, args in EXAMPLES.items():
        print(f"{digest(args)}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
