"""The options of one generation run, with the original STG's names and defaults."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from stg.errors import UserError


class OptionError(UserError):
    """An impossible option value: the message names the option and the allowed values."""


MODEL_ALIASES: dict[str, str] = {"dense": "gpt"}
"""Model names of the original STG that name a registered model: ``dense``, its default,
is the default GPT model."""

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "debug": {
        "model": "gpt",
        "dvocal": 1024,
        "dmodel": 256,
        "dff": 1024,
        "head": 8,
        "kvhead": 8,
        "seq": 256,
        "num_stacks": 4,
    },
}
"""Model names that stand for a registered model with other default sizes. ``debug`` (the
original STG's model for debugging) is a tiny GPT: 4 layers, dmodel 256, dff 1024, 8 heads,
seq 256, vocabulary 1024; sizes given explicitly win over the preset's."""


def apply_model_preset(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (GenerateOptions fields that were given) with a model alias or preset
    resolved: ``model="dense"`` becomes ``gpt``; ``model="debug"`` becomes ``gpt`` with the
    preset's sizes for the fields not given."""
    given = dict(values)
    model = given.get("model")
    if model in MODEL_ALIASES:
        given["model"] = MODEL_ALIASES[model]
    elif model in MODEL_PRESETS:
        given = {**MODEL_PRESETS[model], **{k: v for k, v in given.items() if k != "model"}}
    return given


@dataclass(frozen=True)
class GenerateOptions:
    """Everything ``stg generate`` needs to build a workload.

    Field names are the original STG's command-line options (underscored). ``precision`` is
    a per-op precision plan, ``((op name pattern, dtype), ...)`` (see :mod:`stg.core.precision`;
    ``--precision_plan FILE`` on the command line). Sizes are global:
    ``batch`` samples per iteration, ``micro_batch`` samples per micro-batch over all replicas
    (``None``, or ``-1`` as in the original STG, means one micro-batch: the whole batch).
    ``zero=3`` means ``weight_sharded=True`` (it is stored as that, with ``zero=0``).
    """

    model: str = "gpt"
    dvocal: int = 32000
    dmodel: int = 8192
    dff: int = 28672
    batch: int = 64
    micro_batch: int | None = None
    seq: int = 1024
    head: int = 64
    kvhead: int = 8
    num_stacks: int = 80
    experts: int = 8
    kexperts: int = 2
    capacity_factor: float = 1.0
    dp: int = 1
    tp: int = 1
    sp: int = 1
    pp: int = 1
    ep: int = 1
    tpsp: bool = True
    weight_sharded: bool = False
    zero: int = 0
    activation_recompute: str = "none"
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    mixed_precision: bool = False
    dtype: str = "bf16"
    grad_reduce_dtype: str | None = None
    causal: bool = False
    precision: tuple[tuple[str, str], ...] = ()
    rank_order: str = "tp,sp,ep,dp,pp"
    format: str = "chakra-v0.0.4"
    output_dir: str = "generated"
    output_name: str = "workload.%d.et"

    def __post_init__(self) -> None:
        # the original STG's spelling of "the whole batch"; same options, same workload
        if self.micro_batch == -1:
            object.__setattr__(self, "micro_batch", None)
        # ZeRO-3 shards weights, gradients and optimizer states: what weight_sharded does
        if self.zero == 3:
            object.__setattr__(self, "zero", 0)
            object.__setattr__(self, "weight_sharded", True)

    @property
    def micro_batches(self) -> int:
        """m = batch / micro_batch."""
        return self.batch // (self.micro_batch or self.batch)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.sp * self.pp * self.ep

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
