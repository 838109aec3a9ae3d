"""A plugin predictor that answers from the generation options alone (``needs="options"``),
loaded with ``-p fake_options_predictor``: its ``predict`` fails if it is handed a workload."""

from __future__ import annotations

from typing import Any

from stg.api import Predictor, hookimpl


def predict(workload: Any, system: Any, **_: Any) -> dict[str, Any]:
    raise AssertionError("an options-only predictor was handed a built workload")


def predict_options(options: Any, system: Any, **_: Any) -> dict[str, Any]:
    return {"predictor": "fake-layers", "layers": options.num_stacks, "ranks": options.world_size}


@hookimpl
def stg_register_predictors(register: Any) -> None:
    register(
        Predictor(
            name="fake-layers",
            predict=predict,
            predict_options=predict_options,
            needs="options",
            description="the layers and ranks of the options",
        )
    )
