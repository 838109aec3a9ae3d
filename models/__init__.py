"""Built-in models of stg (installed as stg.models); each module is an ordinary plugin."""
