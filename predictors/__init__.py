"""Built-in predictors of stg (installed as stg.predictors); each module is an ordinary plugin."""
