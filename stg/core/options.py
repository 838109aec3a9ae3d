"""The options of one generation run, with the original STG's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, fields

from stg.errors import UserError


class OptionError(UserError):
    """An impossible option value: the message names the option and the allowed values."""


@dataclass(frozen=True)
class GenerateOptions:
    """Everything ``stg generate`` needs to build a workload.

    Field names are the original STG's command-line options (underscored). ``precision`` is
    a per-op precision plan, ``((op name pattern, dtype), ...)`` (see :mod:`stg.core.precision`;
    ``--precision_plan FILE`` on the command line). Sizes are global:
    ``batch`` samples per iteration, ``micro_batch`` samples per micro-batch over all replicas
    (``None`` means one micro-batch: the whole batch).
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

    @property
    def micro_batches(self) -> int:
        """m = batch / micro_batch."""
        return self.batch // (self.micro_batch or self.batch)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.sp * self.pp * self.ep

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
