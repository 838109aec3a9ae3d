"""The plugin host: hookspecs (the ``stg_*`` hooks), records (the typed records plugins
register) and registry (loading, provenance, failures, name clashes)."""
