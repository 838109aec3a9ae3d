"""The built-in plugin modules that load only when one of their items is used.

Each of these imports the symbolic core (sympy) or a trace schema (protobuf) at import time: a
model's builders, a predictor that builds workloads, an emitter; or, for ``stg bench``'s
operators, the benchmark configs and calibration tables that only ``stg bench`` uses. Listing
names (``--help``, an unknown name's ``allowed:`` list, ``stg plugins``) reads this table
instead; the module is imported, and its hooks run, when an item it registers is first looked
up or iterated over. tests/test_plugins.py checks each entry against what the module's hooks
register.
"""

from __future__ import annotations

from collections.abc import Mapping

DEFERRED_BUILTINS: Mapping[str, Mapping[str, Mapping[str, tuple[str, ...]]]] = {
    "stg.bench.ops": {
        "bench_ops": {
            "torch.mm": (),
            "torch.matmul": (),
            "torch.bmm": (),
            "torch.baddbmm": (),
            "torch.addmm": (),
            "torch._scaled_mm": (),
            "torch.nn.Linear": (),
            "torch.add": (),
            "torch.mul": (),
            "torch.add_": (),
            "torch.nn.functional.relu": (),
            "torch.nn.functional.gelu": (),
            "torch.nn.functional.silu": (),
            "torch.nn.functional.layer_norm": (),
            "torch.nn.functional.rms_norm": (),
            "torch.nn.functional.dropout": (),
            "torch.nn.functional.softmax": (),
            "torch.softmax": (),
            "torch.Tensor.copy_": (),
            "torch.nn.functional.scaled_dot_product_attention": (),
        }
    },
    "stg.emitters.chakra_v001": {"emitters": {"chakra-v0.0.1": ("v0.0.1",)}},
    "stg.emitters.chakra_v004": {"emitters": {"chakra-v0.0.4": ("v0.0.4",)}},
    "stg.emitters.json_trace": {"emitters": {"json": ("chakra-json",)}},
    "stg.models.bert": {"models": {"bert": (), "bert-qa": ()}},
    "stg.models.deepseek": {"models": {"deepseek": ()}},
    "stg.models.gated_deltanet": {"models": {"gated-deltanet": ()}},
    "stg.models.gpt": {"models": {"gpt": ()}},
    "stg.models.hybrid": {"models": {"hybrid": ()}},
    "stg.models.llama": {"models": {"llama": ()}},
    "stg.models.mamba2": {"models": {"mamba2": ()}},
    "stg.models.moe": {"models": {"moe": ()}},
    "stg.models.mpt": {"models": {"mpt": ()}},
    "stg.models.roberta": {"models": {"roberta": (), "roberta-mc": ()}},
    "stg.predictors.analytical": {"predictors": {"analytical": ()}},
    "stg.predictors.memory": {"predictors": {"memory": ()}},
    "stg.predictors.serving": {"predictors": {"serving": ()}},
    "stg.predictors.time": {"predictors": {"time": ()}},
}
"""Per deferred built-in module, by catalog: the names it registers, each with its aliases."""
