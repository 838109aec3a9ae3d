"""Built-in emitters of stg (installed as stg.emitters); each module is an ordinary plugin."""
