"""A fake installed plugin (stg-fake-wrongtype 0.3) registering a kernel as a model."""

from __future__ import annotations

import stg
from stg.api import Kernel


@stg.hookimpl
def stg_register_models(register):
    register(Kernel(name="not-a-model", op_class="einsum", dtype="bf16"))
