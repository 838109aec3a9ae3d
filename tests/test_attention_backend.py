"""``--attention_backend``: which fused attention kernel a training run's stack ran.

NeMo-Framework-Launcher's releases 24.01 to 24.07 set ``NVTE_FUSED_ATTN: 0`` in
``launcher_scripts/conf/config.yaml`` ("Disable cudnn FA until we've tested it more"), so
their runs' Transformer Engine took FlashAttention-2 on H100, where left to itself it takes
cuDNN's fused attention (TE v1.3+: "Select FusedAttention on sm90"). stg priced every Megatron
run on Hopper with cuDNN's kernel, about 1.7x faster fwd+bwd at head size 128 (measured on an
H100: ../shared/data/kernels/h100-attention.jsonl), with no way to say otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stg.cli import main
from stg.core.attention_backend import ATTENTION_BACKEND_ATTR
from stg.core.options import GenerateOptions, OptionError
from stg.core.pipeline import build_workload
from stg.core.validation import validate_options
from stg.host.registry import load_registry
from stg.perf.costs import compute_time
from stg.perf.kernel_time import ATTENTION_CHOICE, attention_kernel_for
from stg.perf.system import load_system

LLAMA = {"model": "llama", "dmodel": 1024, "dff": 2816, "head": 8, "kvhead": 8, "seq": 8192,
         "dvocal": 1000, "num_stacks": 2, "batch": 2, "micro_batch": 1, "causal": True,
         "mixed_precision": True}  # fmt: skip


def _nodes(**given: Any) -> list[Any]:
    workload = build_workload(GenerateOptions(**LLAMA, **given), load_registry(autoload=False))
    return list(workload.ranks[0].nodes())


def _attention(nodes: list[Any]) -> list[Any]:
    return [n for n in nodes if "attention" in (getattr(n, "attrs", None) or {})]


@pytest.mark.parametrize("cp", [1, 2])
def test_backend_is_on_every_fused_attention_node(cp: int) -> None:
    """Forward and backward, and each step of a context-parallel ring (cp 2)."""
    auto, flash = _nodes(sp=cp), _nodes(sp=cp, attention_backend="flash")
    assert [n.name for n in auto] == [n.name for n in flash]
    assert len(_attention(flash)) >= (8 if cp > 1 else 4)
    assert all(n.attrs[ATTENTION_BACKEND_ATTR] == "flash" for n in _attention(flash))
    assert not any(ATTENTION_BACKEND_ATTR in n.attrs for n in auto)
    untouched = [n for n in flash if "attention" not in n.attrs]
    assert not any(ATTENTION_BACKEND_ATTR in n.attrs for n in untouched)


def test_kernel_by_backend_and_architecture() -> None:
    assert attention_kernel_for("hopper", "megatron") == "cudnn"
    assert attention_kernel_for("hopper", "megatron", "flash") == "flash2"
    assert attention_kernel_for("blackwell", "megatron", "flash") == "flash2"
    assert attention_kernel_for("ampere", "megatron", "fused") == "cudnn"
    assert attention_kernel_for("hopper", "eager", "fused") == "cudnn"
    assert attention_kernel_for("cdna3", "megatron", "flash") == "ck"
    assert attention_kernel_for("cdna4", "eager", "fused") == "aiter"
    for arch, by_profile in ATTENTION_CHOICE.items():
        for profile, kernel in by_profile.items():
            assert attention_kernel_for(arch, profile, "auto") == kernel


def test_flash_on_hopper_is_priced_as_flash_attention_2() -> None:
    """On an H100 the Megatron profile's attention under ``flash`` costs what the kernel of
    torchtitan's eager Llama of 2024 (PyTorch SDPA's FlashAttention-2) does, and more than
    cuDNN's: at 8k tokens and head size 128 the measured rates (328/299 against 613/491
    TFLOP/s forward/backward) make it 1.5-2x; on an A100, where Transformer Engine runs
    FlashAttention-2 anyway, nothing moves."""
    auto, flash = _attention(_nodes()), _attention(_nodes(attention_backend="flash"))
    h100, a100 = load_system("h100-80g"), load_system("a100-80g")
    cudnn_s = sum(compute_time(n, h100, "bf16") for n in auto)
    flash_s = sum(compute_time(n, h100, "bf16") for n in flash)
    assert 1.5 < flash_s / cudnn_s < 2.0
    for a, f in zip(auto, flash, strict=True):
        # these kernels outlast eager PyTorch's host launch cost: the same kernel time
        eager = compute_time(a, h100, "bf16", profile="torchtitan")
        assert compute_time(f, h100, "bf16") == pytest.approx(eager)
        assert compute_time(f, a100, "bf16") == pytest.approx(compute_time(a, a100, "bf16"))


def test_default_is_not_recorded() -> None:
    """Traces generated without the option keep their bytes: ``auto`` is left out of the
    metadata's options, a named backend is recorded."""
    assert "attention_backend" not in GenerateOptions(**LLAMA).recorded()
    flash = GenerateOptions(**LLAMA, attention_backend="flash").recorded()
    assert flash["attention_backend"] == "flash"


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(attention_backend="cudnn"), r"attention_backend='cudnn' must be one of auto, "
                                          r"flash, fused"),
        (dict(attention_backend="flash", attention="unfused"), r"needs attention=fused"),
        (dict(attention_backend="fused", phase="prefill"), r"phase=training"),
    ],
)  # fmt: skip
def test_attention_backend_is_checked(given: dict, message: str) -> None:
    options = {**LLAMA, "mixed_precision": given.get("phase", "training") == "training"}
    with pytest.raises(OptionError, match=message):
        validate_options(GenerateOptions(**options, **given), load_registry(autoload=False))


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


MODEL = ["--model", "llama", "--dmodel", "512", "--dff", "1408", "--head", "4", "--kvhead",
         "4", "--num_stacks", "2", "--seq", "4096", "--dvocal", "1000", "--batch", "2",
         "--causal", "true"]  # fmt: skip
ON_H100 = ["--system", "h100-80g", "--predictor", "time", "--json"]


def test_trace_on_disk_keeps_the_backend(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The attribute survives the Chakra files: predicting the written trace gives the time of
    the generated workload, slower than cuDNN's."""
    out_dir = tmp_path / "trace"
    flash = [*MODEL, "--attention_backend", "flash"]
    code, _, err = run(capsys, "generate", *flash, "--output_dir", str(out_dir))
    assert code == 0, err
    times = {}
    for label, args in (("disk", [out_dir]), ("flash", flash), ("auto", MODEL)):
        code, out, err = run(capsys, "predict", *args, *ON_H100)
        assert code == 0, err
        times[label] = json.loads(out)["time"]["iteration_time_s"]
    assert times["disk"] == pytest.approx(times["flash"], rel=1e-9)
    assert times["flash"] > times["auto"]


def test_bad_backend_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "predict", *MODEL, *ON_H100, "--attention_backend", "sdpa")
    assert code == 2 and not out
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "auto, flash, fused" in err


def test_refused_on_a_model_without_fused_attention(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A state-space stack runs no attention kernel: a named backend would do nothing."""
    mamba = ["--model", "mamba2", "--dmodel", "256", "--num_stacks", "2", "--seq", "256",
             "--batch", "2", "--attention_backend", "flash"]  # fmt: skip
    out_dir = tmp_path / "trace"
    code, _, err = run(capsys, "generate", *mamba, "--output_dir", str(out_dir))
    assert code == 2 and err.count("\n") == 1
    assert "does not apply to model 'mamba2'" in err and not out_dir.exists()
