"""A loss left out of ``torch.compile`` (``--eager_loss`` under ``--profile compiled``), and
the loss's memory under the torchtitan profile.

torchtitan compiled each TransformerBlock but computed its loss eagerly until it compiled the
loss too: ``train.py`` at pytorch/torchtitan 9dec370 builds ``loss_fn`` as
``F.cross_entropy(pred.flatten(0, 1).float(), ...)`` and leaves it uncompiled ("compiling loss
function causes CUDA errors, turning off for now"). That loss runs eager PyTorch's kernels
over an fp32 copy of the logits, and its backward holds 8 bytes per logit beside the saved
fp32 log-probabilities (``predictors.memory.EAGER_CROSS_ENTROPY_TRANSIENT``) where a fused
loss holds 2 (``MEGATRON_CROSS_ENTROPY_TRANSIENT``). torchtitan's eager profile runs the
same loss.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.torchtitan import EAGER_KERNEL_BYTES_ATTR, EAGER_KERNELS_ATTR
from stg.host.registry import load_registry
from stg.predictors import memory as memory_predictor

TOKENS, VOCAB = 8192, 128256
# a short stack with a large vocabulary: the loss's transient is the largest buffer
LLAMA = dict(
    model="llama", dmodel=1024, dff=2816, head=8, kvhead=8, seq=TOKENS, dvocal=VOCAB,
    num_stacks=2, batch=2, micro_batch=2, mixed_precision=True, dtype="bf16", causal=True,
)  # fmt: skip


def _loss_nodes(**options: object) -> list:
    nodes = build_workload(GenerateOptions(**LLAMA, **options), load_registry(autoload=False))
    return [n for n in nodes.ranks[0].nodes() if n.name.split("/")[-1].startswith("cross_entropy")]


def _kernels(nodes: list) -> list[tuple[object, object]]:
    return [(n.attrs.get(EAGER_KERNELS_ATTR), n.attrs.get(EAGER_KERNEL_BYTES_ATTR)) for n in nodes]


def test_an_eager_loss_runs_eager_pytorchs_kernels_under_compile() -> None:
    eager = _loss_nodes(profile="eager")
    compiled = _loss_nodes(profile="compiled", eager_loss=True)
    assert len(eager) == len(compiled) == 2  # forward and backward
    assert _kernels(compiled) == _kernels(eager)
    assert compiled[0].attrs[EAGER_KERNELS_ATTR][0] == "convert:fp32"
    # the compiled loss keeps its one fused pass
    for node in _loss_nodes(profile="compiled"):
        assert EAGER_KERNELS_ATTR not in node.attrs


def _peak(**options: object) -> float:
    o = GenerateOptions(**LLAMA, **options)
    return memory_predictor.predict_memory_options(o, "h100-80g")["peak_bytes"]


def test_an_eager_loss_holds_eager_pytorchs_transient() -> None:
    logits = 2 * TOKENS * VOCAB  # two sequences
    transient = (
        memory_predictor.EAGER_CROSS_ENTROPY_TRANSIENT
        - memory_predictor.MEGATRON_CROSS_ENTROPY_TRANSIENT
    )
    fused = _peak(profile="compiled")
    assert _peak(profile="compiled", eager_loss=True) - fused == pytest.approx(transient * logits)


def test_torchtitans_loss_holds_eager_pytorchs_transient(monkeypatch: pytest.MonkeyPatch) -> None:
    options = dict(model="llama3-8b", dvocal=VOCAB, profile="torchtitan")
    o = GenerateOptions(**{**LLAMA, **options, "dmodel": 4096, "dff": 14336, "head": 32})
    assert o.runs_eager_loss
    eager = memory_predictor.predict_memory_options(o, "h100-80g")["peak_bytes"]
    monkeypatch.setattr(GenerateOptions, "runs_eager_loss", property(lambda _: False))
    fused = memory_predictor.predict_memory_options(o, "h100-80g")["peak_bytes"]
    assert eager - fused == pytest.approx(6 * 2 * TOKENS * VOCAB)


@pytest.mark.parametrize("profile", ["megatron", "eager", "torchtitan"])
def test_eager_loss_is_refused_outside_the_compiled_profile(profile: str) -> None:
    flags = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in LLAMA.items()]
    args = ["predict", "--predictor", "memory", *flags, f"--profile={profile}"]
    result = CliRunner().invoke(app, [*args, "--eager_loss", "true"])
    assert result.exit_code == 2
    message = result.output.strip().splitlines()
    assert len(message) == 1
    assert "eager_loss=true" in message[0] and "allowed: profile=compiled" in message[0]


def test_eager_loss_is_recorded_only_when_on() -> None:
    o = GenerateOptions(**LLAMA, profile="compiled")
    assert "eager_loss" not in o.recorded()
    assert replace(o, eager_loss=True).recorded()["eager_loss"] is True
