"""A stand-in for ASTRA-sim's analytical binary (CI has no ASTRA-sim): an executable Python
script that takes the real binary's options, checks that the files they name exist, and
prints what astra-sim 518bd51 prints (``Workload::report`` and ``Statistics::report``, as
its analytical build printed them here) or fails the way the real one can."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

BEHAVIOURS = ("ok", "old", "abort", "teardown", "critical", "deadlock", "hang")
"""ok: every rank finishes; old: ASTRA-sim 2.2.0's line without exposed communication;
abort: an uncaught exception (SIGABRT) before the last rank finished; teardown: SIGABRT after
every rank finished (astra-sim 518bd51's double free); critical: a logged error and exit 1;
deadlock: the last rank never finishes, exit 0; hang: never returns (its child neither)."""

FINISH_CYCLES = 2_000_000
"""rank r finishes at ``FINISH_CYCLES + 1000 r`` cycles"""
EXPOSED_CYCLES = 300_000
"""rank r's exposed communication is ``EXPOSED_CYCLES + r`` cycles"""

_SCRIPT = """#!{python}
import os, subprocess, sys, time
from pathlib import Path

BEHAVIOUR = {behaviour!r}
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
for key in ("system-configuration", "network-configuration", "remote-memory-configuration"):
    if not Path(args.get(key, "")).is_file():
        print(f"[Error] (system) no {{key}}", flush=True)
        sys.exit(3)
prefix = args["workload-configuration"]
ranks = 0
while Path(f"{{prefix}}.{{ranks}}.et").is_file():
    ranks += 1
if ranks == 0:
    sys.exit(4)
group = args.get("comm-group-configuration")
if group is not None and not Path(group).is_file():
    sys.exit(5)
log = Path(args.get("logging-folder", "log"))
log.mkdir(exist_ok=True)
(log / "log.log").write_text("stand-in\\n")
stamp = "[2026-11-26 00:26:15.097]"
print(f"{{stamp}} [system] [info] initializing {{ranks}} NPUs", flush=True)
if BEHAVIOUR == "hang":
    child = subprocess.Popen(["sleep", "600"])
    Path(os.environ["STANDIN_PIDS"]).write_text(f"{{os.getpid()}} {{child.pid}}")
    time.sleep(600)
if BEHAVIOUR == "critical":
    print(f"{{stamp}} [workload] [critical] Node 0 in ctrl_dep graph, but not found in index")
    sys.exit(1)
finished = ranks - 1 if BEHAVIOUR in ("deadlock", "abort") else ranks
for rank in reversed(range(finished)):  # the async logger keeps no rank order
    cycles = {finish} + 1000 * rank
    exposed = {exposed} + rank
    if BEHAVIOUR == "old":
        print(f"sys[{{rank}}] finished, {{cycles}} cycles")
        continue
    print(f"{{stamp}} [workload] [info] sys[{{rank}}] finished, {{cycles}} cycles, "
          f"exposed communication {{exposed}} cycles.")
    print(f"{{stamp}} [statistics] [info] sys[{{rank}}], Wall time: {{cycles}}")
    print(f"{{stamp}} [statistics] [info] sys[{{rank}}], GPU time: {{cycles - exposed}}")
sys.stdout.flush()
if BEHAVIOUR == "teardown":
    print("malloc_consolidate(): unaligned fastbin chunk detected", flush=True)
    os.abort()
if BEHAVIOUR == "abort":
    print("terminate called after throwing an instance of 'std::runtime_error'")
    print("  what():  Unknown collective implementation", flush=True)
    os.abort()
"""


def write_standin(directory: Path, behaviour: str = "ok") -> Path:
    """The stand-in script ``directory/astra-sim-<behaviour>``, executable."""
    assert behaviour in BEHAVIOURS, behaviour
    path = directory / f"astra-sim-{behaviour}"
    text = _SCRIPT.format(
        python=sys.executable, behaviour=behaviour, finish=FINISH_CYCLES, exposed=EXPOSED_CYCLES
    )
    path.write_text(text, encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path
