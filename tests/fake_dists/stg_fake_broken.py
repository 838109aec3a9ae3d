"""A fake installed plugin (stg-fake-broken 1.0) whose module fails at import."""

raise RuntimeError("stg_fake_broken cannot be imported (on purpose)")
