"""A fake installed plugin (stg-fake-clash 2.1) registering a name stg-fake-good registers."""

from __future__ import annotations

from stg_fake_good import write_lines

import stg
from stg.api import Emitter


@stg.hookimpl
def stg_register_emitters(register):
    register(Emitter(name="fake-lines", write=write_lines, extension=".lines"))
