"""``--fp8_dispatch`` and ``--overlap_moe_ep_comm`` act on a mixture's expert all-to-alls: on
a model whose layers send no tokens to experts they would do nothing, so they are refused with
one line (exit code 2, nothing written), as an option no layer reads is."""

from __future__ import annotations

from pathlib import Path

import pytest

from stg.cli import main
from stg.core.options import GenerateOptions, OptionError
from stg.core.pipeline import build_workload
from stg.core.workload import CollectiveType, NodeType
from stg.host.registry import load_registry

DENSE = {"model": "llama", "dmodel": 256, "dff": 512, "head": 4, "kvhead": 2, "seq": 128,
         "dvocal": 512, "num_stacks": 2, "ep": 2, "dp": 2, "batch": 4, "micro_batch": 4,
         "mixed_precision": True, "dtype": "fp8",
         "low_precision_recipe": "tensorwise"}  # fmt: skip
SWITCHES = ["fp8_dispatch", "overlap_moe_ep_comm"]


@pytest.mark.parametrize("switch", SWITCHES)
def test_refused_on_a_dense_model(switch: str) -> None:
    with pytest.raises(OptionError, match=f"{switch}=true does not apply to model 'llama'"):
        build_workload(GenerateOptions(**DENSE, **{switch: True}), load_registry(autoload=False))


@pytest.mark.parametrize("switch", SWITCHES)
def test_a_mixture_takes_it(switch: str) -> None:
    moe = {**DENSE, "model": "moe", "experts": 8, "kexperts": 2, switch: True}
    workload = build_workload(GenerateOptions(**moe), load_registry(autoload=False))
    assert any(
        n.type is NodeType.COMM_COLL and n.comm_type is CollectiveType.ALL_TO_ALL
        for n in workload.ranks[0].nodes()
    )


@pytest.mark.parametrize("switch", SWITCHES)
def test_the_cli_says_so_in_one_line(
    switch: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in DENSE.items()]
    out_dir = tmp_path / "trace"
    with pytest.raises(SystemExit) as done:
        main(["generate", *args, f"--{switch}", "true", "--output_dir", str(out_dir)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1, err
    assert f"{switch}=true does not apply" in err and not out_dir.exists()
